"""Calibration guard for decoy groups (issue 32): bench/calibration.py, scaled down.

A synthetic table where mixing matters at a small N: 6,000 rows, γ = 3, three values
at 25% of the rows and ten at 2.5%, and a public attribute `a` that mostly tells the
large values (a0) from the small ones (a1). Records of small values meet the large
values in their groups at other rates than the 2×2 model's t assumes, so its estimates
of "a1 ∧ large value" are biased by a multiple of their standard error already here (on
Adult the same happens only near a million rows). Anatomy's largest-first cut would put
the three large values together in nearly every group, where nothing is identifiable,
so its case has four values at 14-15% and fourteen at 3%, with γ = 5. Queries: every
"a = x ∧ s = v" and "a = x ∧ b = y ∧ s = v" with a true count ≥ 1% of the rows.

Each publication (fresh key, the same table) answers every query; its coverage is the
share of identifiable answers whose 95% interval holds the truth, counted on the rows
it publishes. Queries of one publication share its draw, so they are not independent
trials: the publications are. Their coverages are independent and identically
distributed with mean c, so the mean over n publications has standard error s/√n
(s their standard deviation) and is about normal for n of a few tens. H0: c ≥ 0.93 is
rejected, one-sided at α = 0.001, when mean + z_{0.999}·s/√n < 0.93.

The m×m model of the cutting rule passes; the 2×2 model (``matrix="corrected"``),
answering the same publications, is rejected, which shows the test discriminates.
Anatomy's cut declines many answers as not identifiable (largest-first never pairs some
values); the coverages these seeds give are in docs/performance.md (*Interval
coverage*).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query
from service.core.schema import Attribute, Schema
from service.core.table import Table

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
try:
    from calibration import Published, stream_publication, true_counts
finally:
    sys.path.pop(0)

ROWS = 6_000
REQUIRED = 0.93
ALPHA = 0.001
STREAM_BATCH = 500
# (γ, value shares): three values near 1/γ = 1/3; for Anatomy, whose largest-first cut
# would put those three in nearly every group together (then nothing is identifiable),
# four values at 14-15% with γ = 5.
MIXED = (3, np.array([25, 25, 25] + [2.5] * 10) / 100)
ANATOMY = (5, np.array([15, 15, 14, 14] + [3] * 14) / 100)


def synthetic(shares: np.ndarray) -> Table:
    rng = np.random.default_rng(7)
    values = rng.choice(len(shares), ROWS, p=shares)
    large = shares[values] >= 0.14
    a = np.where(rng.random(ROWS) < 0.85, np.where(large, 0, 1), rng.integers(2, 4, ROWS))
    b = rng.integers(0, 3, ROWS)
    schema = Schema(
        (
            Attribute("a", False, ("a0", "a1", "a2", "a3")),
            Attribute("b", False, ("b0", "b1", "b2")),
            Attribute("s", True, tuple(f"s{v:02d}" for v in range(len(shares)))),
        )
    )
    return Table(schema, {"a": a, "b": b, "s": values})


def large_queries(table: Table) -> list[Query]:
    schema, queries = table.schema, []
    for columns in (("a",), ("a", "b")):
        keys = [table.codes[c] for c in columns] + [table.codes["s"]]
        combos, counts = np.unique(np.stack(keys, axis=1), axis=0, return_counts=True)
        for combo, count in zip(combos.tolist(), counts.tolist(), strict=True):
            if count >= 0.01 * ROWS:
                where = {
                    c: (schema[c].domain[v],) for c, v in zip(columns, combo[:-1], strict=True)
                }
                queries.append(Query(where, {"s": schema["s"].domain[combo[-1]]}))
    return queries


Publish = Callable[[Table, ServiceKey, int], Published]


def batch(grouping: str) -> Publish:
    def publish(table: Table, key: ServiceKey, gamma: int) -> Published:
        release = DecoyGroups(gamma, grouping).publish(table, random_ids(len(table), key), key)
        kept = np.zeros(len(table), dtype=bool)
        kept[release.grouped_rows] = True
        return Published(release.published, kept)

    return publish


def stream(table: Table, key: ServiceKey, gamma: int) -> Published:
    rng = np.random.default_rng(int.from_bytes(key.subkey("calibration test")[:8], "little"))
    return stream_publication(table, "s", gamma, STREAM_BATCH, rng)


CASES: dict[str, tuple[Publish, str, tuple[int, np.ndarray], int]] = {
    # name: (publish, the grouping the estimator models, data, publications)
    "size-weighted batch": (batch("size-weighted"), "size-weighted", MIXED, 60),
    "size-weighted stream": (stream, "size-weighted", MIXED, 60),
    "anatomy batch": (batch("anatomy"), "anatomy", ANATOMY, 30),
}


def coverages(name: str) -> dict[str, np.ndarray]:
    """Per matrix, each publication's coverage of its identifiable large-count answers."""
    publish, grouping, (gamma, shares), publications = CASES[name]
    table = synthetic(shares)
    queries = large_queries(table)
    out: dict[str, list[float]] = {"mixing": [], "corrected": []}
    for index in range(publications):
        published = publish(table, ServiceKey.from_seed(1000 * len(name) + index), gamma)
        truth = true_counts(table.take(published.kept), queries, "s")
        cells = PublishedCells.from_table(published.table)
        for matrix, found in out.items():
            reconstruction = DecoyReconstruction(
                cells, gamma, ["s"], matrix=matrix, grouping=grouping
            )
            answers = reconstruction.estimate_many(queries)
            given = [a for a in answers if a.identifiable]
            assert given, f"{name}, {matrix}: every answer declined"
            covered = [
                a.low <= t <= a.high for a, t in zip(answers, truth, strict=True) if a.identifiable
            ]
            found.append(float(np.mean(covered)))
    return {matrix: np.asarray(found) for matrix, found in out.items()}


def upper_bound(coverage: np.ndarray) -> float:
    """The mean coverage plus z_{1−α} standard errors over publications."""
    error = coverage.std(ddof=1) / np.sqrt(len(coverage))
    return float(coverage.mean() + stats.norm.ppf(1 - ALPHA) * error)


@pytest.mark.parametrize("name", list(CASES))
def test_large_count_intervals_are_calibrated_and_the_2x2_model_is_not(name):
    found = coverages(name)
    mixing, uniform = found["mixing"], found["corrected"]
    assert upper_bound(mixing) >= REQUIRED, f"m×m: {mixing.mean():.3f}"
    assert upper_bound(uniform) < REQUIRED, f"2×2: {uniform.mean():.3f}"
