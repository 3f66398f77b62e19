"""Laplace counts: the ε-differential-privacy baseline of seeds 000 §6 and 001 §9.

An interactive mechanism: it publishes no table but answers up to m count
queries on the true table, each with independent noise

    answer = count + Lap(b),  b = Σ_i Δf_i / ε = m/ε  (Δf_i = 1),

which makes the m answers together ε-differentially private (Dwork et al.,
TCC 2006; sequential composition). The papers' comparison uses m = 100 and
ε ∈ {0.01, 0.05} (seed notes 001 §7.1, pitfall 20). The estimate is the noisy
answer itself, unbiased, with the exact interval ±b·ln(1/(1 − confidence)).

The noise of a query is a keyed function of the query's content (its column
conditions as sets), not a fresh draw: asking the same query again returns
the same answer, so repeats cannot be averaged to strip the noise and do not
spend more budget. A query set with more than m distinct sensitive queries
would exceed the budget and is refused.

Queries on public columns alone are answered exactly and outside the budget:
in this system public values are published verbatim (SPEC §1), so they are
not the secret, and the papers' workload is always P ∧ s. For the same
reason each estimate reports |P| exactly. `Estimate.published` is 0 because
nothing is published row by row.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import numpy as np

from service.core.prf import ServiceKey, prf128, to_unit_interval
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction
from service.core.table import Table


class LaplaceCounts:
    """ε-DP answers to at most m count queries, each with noise Lap(m/ε).

    Parameters
    ----------
    epsilon: ε > 0, the privacy budget shared by all m answers.
    queries: m ≥ 1, how many count queries the budget covers.
    confidence: coverage of the [low, high] interval of each answer.

    Reference: C. Dwork, F. McSherry, K. Nissim, A. Smith, "Calibrating noise
    to sensitivity in private data analysis", TCC 2006.
    """

    def __init__(self, epsilon: float, queries: int, confidence: float = 0.95) -> None:
        if not (isinstance(epsilon, int | float) and math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
        if isinstance(queries, bool) or not isinstance(queries, int | np.integer):
            raise TypeError(f"queries must be an integer, got {type(queries).__name__}")
        if queries < 1:
            raise ValueError(f"the budget must cover at least one query, got {queries}")
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
        self.epsilon = float(epsilon)
        self.queries = int(queries)
        self.confidence = float(confidence)

    def __repr__(self) -> str:
        return f"LaplaceCounts(epsilon={self.epsilon}, queries={self.queries})"

    @property
    def scale(self) -> float:
        """b = m/ε: the noise scale of every answer (Δf = 1 per count)."""
        return self.queries / self.epsilon

    def noise(self, queries: Sequence[Query], key: ServiceKey) -> np.ndarray:
        """Lap(0, b) noise per query, a keyed function of the query's content.

        The PRF's two 64-bit words give U, V uniform on (0, 1], and
        b·(ln U − ln V) is Laplace as a difference of two Exp(1/b) variables.
        """
        digests = b"".join(hashlib.blake2b(_canonical(q), digest_size=16).digest() for q in queries)
        blocks = np.frombuffer(digests, dtype=">u8").astype(np.uint64).reshape(-1, 2)
        words = prf128(key, "laplace noise", blocks)
        # 1 − [0, 1) is (0, 1], where the logarithm is finite.
        u, v = 1.0 - to_unit_interval(words[:, 0]), 1.0 - to_unit_interval(words[:, 1])
        return self.scale * (np.log(u) - np.log(v))

    def answer(self, table: Table, queries: Sequence[Query], key: ServiceKey) -> list[Estimate]:
        """Noisy answers on the true `table`; refused if they would exceed the budget."""
        distinct = {_canonical(q) for q in queries if q.value}
        if len(distinct) > self.queries:
            raise ValueError(
                f"{len(distinct)} distinct count queries exceed the budget of m={self.queries}; "
                "build the mechanism for more queries (noise grows as m/ε)"
            )
        sensitive = [a.name for a in table.schema.sensitive]
        return _NoisyCounts(self, key, PublishedCells.from_table(table), sensitive).estimate_many(
            queries
        )


class _NoisyCounts(Reconstruction):
    """True counts from the table's cells plus the mechanism's keyed noise."""

    def __init__(
        self,
        mechanism: LaplaceCounts,
        key: ServiceKey,
        cells: PublishedCells,
        sensitive: Sequence[str],
    ) -> None:
        super().__init__(cells, sensitive, mechanism.confidence, clip=False)
        self.mechanism = mechanism
        self.key = key

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        y = self._states(queries, columns)
        rows = y[:, y.shape[1] // 2 :].sum(axis=1)
        noisy = y[:, -1] + self.mechanism.noise(queries, self.key)
        # P(|Lap(b)| > t) = exp(−t/b).
        margin = -self.mechanism.scale * math.log(1 - self.confidence)
        return [
            Estimate(float(e), float(e - margin), float(e + margin), 0, int(r))
            for e, r in zip(noisy, rows, strict=True)
        ]


def _canonical(query: Query) -> bytes:
    """The query as bytes that do not depend on how its conditions were ordered."""
    where = {column: sorted(set(values)) for column, values in query.where.items()}
    return json.dumps([where, dict(query.value)], sort_keys=True).encode()
