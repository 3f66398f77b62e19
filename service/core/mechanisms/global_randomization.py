"""Global randomization: mechanism A of seed 001 (notes §3), a baseline of its experiments.

Identity perturbation over the whole sensitive domain (Agrawal, Srikant and
Thomas, SIGMOD 2005): each record keeps its value with probability p and
otherwise publishes each of the other m−1 values with probability q, with

    p = 1/γ,  q = (1 − 1/γ)/(m − 1),

so its retention matches decoy groups of size γ (seed notes 001, pitfall 20).
Unlike decoy groups the draw depends on the record's own value, so p ≠ q and
a one-record change moves the likelihood by p/q (seed 001 Lemma 2).

This is uniform perturbation with retention r (keep outright with r, else
draw uniformly from all m values): keep = r + (1−r)/m and switch = (1−r)/m
match p and q exactly for

    r = (m/γ − 1)/(m − 1),

which lies in (0, 1) iff m > γ. At m = γ the output is uniform noise
(p = q, seed 001 Lemma 1) and below it p < q; neither is this baseline.

Estimator. With M = (p − q)·I + q·J the transition matrix, M⁻¹ = (I − q·J)/(p − q)
because p + (m−1)·q = 1. Inverting the published counts of the rows matching
P therefore gives, for value s with published count O and |P| rows,

    x̂ = (O − q·|P|)/(p − q),

which is unbiased, and is the MLE (Agrawal et al.) whenever every entry of
M⁻¹y is non-negative. O is a sum of Binomial(x, p) and Binomial(|P| − x, q), so

    Var x̂ = (x·p(1−p) + (|P| − x)·q(1−q)) / (p − q)²,

evaluated at x̂ clipped to [0, |P|] for the error bar.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.mechanisms.personal import UniformPerturbation
from service.core.prf import ServiceKey, prf64
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction
from service.core.schema import SchemaError
from service.core.table import Table


class GlobalRandomization:
    """Mechanism A with p = 1/γ over a sensitive domain of m values.

    Parameters
    ----------
    gamma: γ ≥ 2, the decoy group size this baseline is matched to.
    domain_size: m > γ, the size of the whole sensitive domain.

    Reference: Wang, Fu, Wong, Wang, "Small count privacy and large count
    utility in data publishing", arXiv 1202.3253 (seed 001), §3 and §9.
    """

    def __init__(self, gamma: int, domain_size: int) -> None:
        for label, number in (("gamma", gamma), ("domain_size", domain_size)):
            if isinstance(number, bool) or not isinstance(number, int | np.integer):
                raise TypeError(f"{label} must be an integer, got {type(number).__name__}")
        if gamma < 2:
            raise ValueError(f"gamma must be at least 2, got {gamma}")
        if domain_size <= gamma:
            raise ValueError(
                f"global randomization needs more than γ={gamma} sensitive values to keep a "
                f"value with probability 1/γ above the chance of each other one; got "
                f"m={domain_size}"
            )
        self.gamma = int(gamma)
        self.domain_size = int(domain_size)
        retention = (domain_size / gamma - 1) / (domain_size - 1)
        self.perturbation = UniformPerturbation(retention, self.domain_size)

    def __repr__(self) -> str:
        return f"GlobalRandomization(gamma={self.gamma}, domain_size={self.domain_size})"

    @property
    def keep(self) -> float:
        """p: probability of publishing the true value, 1/γ."""
        return self.perturbation.keep

    @property
    def switch(self) -> float:
        """q: probability of publishing one given other value, (1 − 1/γ)/(m − 1)."""
        return self.perturbation.switch

    def matrix(self) -> np.ndarray:
        """M[i, j] = probability that true value i is published as j."""
        return self.perturbation.matrix()

    def perturb(
        self, values: np.ndarray, ids: np.ndarray, key: ServiceKey, purpose: str
    ) -> np.ndarray:
        """Published codes, keyed by record id so a repeat reproduces them."""
        # A purpose of its own: personal groups perturb with the same law and key.
        return self.perturbation.perturb(values, ids, key, f"global randomization:{purpose}")

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> Table:
        """`table` with its one sensitive attribute perturbed, rows in a keyed random order."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        sensitive = table.schema.sensitive
        if len(sensitive) != 1:
            raise SchemaError(
                f"global randomization perturbs one sensitive attribute; the schema has "
                f"{len(sensitive)}"
            )
        name = sensitive[0].name
        if sensitive[0].size != self.domain_size:
            raise ValueError(
                f"{name!r} has {sensitive[0].size} values in its domain, but the mechanism "
                f"was built for m={self.domain_size}"
            )
        codes = {**table.codes, name: self.perturb(table.codes[name], ids, key, name)}
        # Keyed per mechanism: a shared order would line up rows across two publications.
        order = np.argsort(prf64(key, "global randomization publication order", ids))
        return Table(table.schema, {k: v[order] for k, v in codes.items()}, table.lines[order])


class GlobalRandomizationReconstruction(Reconstruction):
    """Inverse-matrix MLE of P ∧ s counts with a normal error bar.

    Parameters
    ----------
    cells, confidence: as for `Reconstruction`.
    sensitive: the perturbed column.
    gamma, domain_size: γ and m of the publication.
    clip: False by default, keeping the estimate unbiased.
    """

    def __init__(
        self,
        cells: PublishedCells,
        sensitive: str,
        gamma: int,
        domain_size: int,
        confidence: float = 0.95,
        clip: bool = False,
    ) -> None:
        super().__init__(cells, [sensitive], confidence, clip)
        self.mechanism = GlobalRandomization(gamma, domain_size)

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        p, q = self.mechanism.keep, self.mechanism.switch
        y = self._states(queries, columns)  # columns (P, s): 00, 01, 10, 11
        rows, observed = y[:, 2] + y[:, 3], y[:, 3]
        raw = (observed - q * rows) / (p - q)
        held = np.clip(raw, 0, rows)
        variance = (held * p * (1 - p) + (rows - held) * q * (1 - q)) / (p - q) ** 2
        estimate, low, high = self._interval(raw, variance, rows)
        return [
            Estimate(float(e), float(lo), float(hi), int(o), int(r))
            for e, lo, hi, o, r in zip(estimate, low, high, observed, rows, strict=True)
        ]
