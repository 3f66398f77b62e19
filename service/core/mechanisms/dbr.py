"""Distribution-based randomization (DBR): the strawman baseline of seed 000 §3, §6.

Every record publishes a sensitive value drawn from the table's empirical
distribution of that attribute, f_s/N, independently of its own value and of
every other record. The published count of s is therefore

    f′_s ~ Binomial(N, f_s/N),  E f′_s = f_s,

so sensitive-only counts survive, but the published value carries no trace of
the record's own value: a conjunctive count P ∧ s comes out, in expectation,
as |P|·f_s/N whatever the true association between P and s. The journal uses
DBR to show why SPLU-Gen keeps a retention probability (seed 000, around Fig. 9).

Its estimator, as in the journal, is the published count itself (the MLE of
f_s from f′_s). For a sensitive-only count of one value that is also a sound
interval: the Clopper–Pearson interval for f_s/N from f′_s out of N, times N.
A conjunctive count has no interval, because no function of the publication
estimates it consistently.

Several sensitive attributes are drawn independently, each from its own
marginal, as decoy groups randomize each attribute independently.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.prf import ServiceKey, prf64
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction
from service.core.table import Table


class DistributionBasedRandomization:
    """DBR: published values drawn from the empirical sensitive distribution.

    Reference: Fu, Wang, Wong, Wang, Jiang, "Small sum privacy and large sum
    utility in data publishing", J. Biomed. Inform. 2014 (seed 000), §3.
    """

    def __repr__(self) -> str:
        return "DistributionBasedRandomization()"

    def draw(
        self, values: np.ndarray, ids: np.ndarray, key: ServiceKey, purpose: str
    ) -> np.ndarray:
        """Published codes: PRF(key, id) mod N picks a row of the sorted value column.

        Rows sorted by value make value s own f_s of the N residues, so each draw
        is s with probability f_s/N (bias below N/2⁶⁴) and a repeat reproduces it.
        """
        n = len(values)
        if n == 0:
            return values.copy()
        boundaries = np.cumsum(np.bincount(values))
        picks = prf64(key, f"dbr draw:{purpose}", ids) % np.uint64(n)
        return np.searchsorted(boundaries, picks, side="right").astype(values.dtype)

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> Table:
        """Every sensitive attribute replaced by an independent draw from its distribution."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        codes = dict(table.codes)
        for attribute in table.schema.sensitive:
            codes[attribute.name] = self.draw(codes[attribute.name], ids, key, attribute.name)
        # Keyed per mechanism: a shared order would line up rows across two publications.
        order = np.argsort(prf64(key, "dbr publication order", ids))
        return Table(table.schema, {k: v[order] for k, v in codes.items()}, table.lines[order])


class DBRReconstruction(Reconstruction):
    """Published counts as estimates, with an exact interval for one value's total.

    Parameters
    ----------
    cells: the published table, aggregated.
    sensitive: the randomized columns.
    confidence: coverage of the Clopper–Pearson interval.
    """

    def __init__(
        self, cells: PublishedCells, sensitive: Sequence[str], confidence: float = 0.95
    ) -> None:
        super().__init__(cells, sensitive, confidence, clip=False)

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        from scipy import stats

        y = self._states(queries, columns)
        published = y[:, -1]
        rows = y[:, y.shape[1] // 2 :].sum(axis=1)
        n = self.cells.total
        tail = (1 - self.confidence) / 2
        # Clopper–Pearson via beta quantiles; the bounds are 0 and N where they degenerate.
        missing = n - published
        with np.errstate(invalid="ignore"):
            low = n * np.nan_to_num(stats.beta.ppf(tail, published, missing + 1), nan=0.0)
            high = n * np.nan_to_num(stats.beta.ppf(1 - tail, published + 1, missing), nan=1.0)
        bounded = len(columns) == 1
        answers = []
        for q, query in enumerate(queries):
            interval = bounded and not query.where
            answers.append(
                Estimate(
                    float(published[q]),
                    float(low[q]) if interval else None,
                    float(high[q]) if interval else None,
                    int(published[q]),
                    int(rows[q]),
                )
            )
        return answers
