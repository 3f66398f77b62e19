"""Anatomy (Xiao & Tao, VLDB 2006): the ℓ-diversity baseline of seeds 000 and 001.

Anatomy changes no value. It splits the table into QI-groups whose sensitive
values are pairwise distinct and publishes two tables:

- QIT: the public columns of every record plus its group id;
- ST: (group id, sensitive value, count) for every value present in a group.

A record is linked to its group's values and to nothing finer, so an adversary
believes any one of them with probability c_g(s)/|g| ≤ 1/ℓ. The papers compare
with ℓ = γ (seed notes 001, pitfall 20).

Grouping is Xiao & Tao's *Anatomize*:

1. group creation: while at least ℓ buckets (one per sensitive value) are
   non-empty, cut a group from the ℓ largest (ties: smaller code), taking
   from each bucket the record with the smallest random id;
2. residue assignment: the records left over, at most ℓ−1 and of distinct
   values, each join a keyed-random group among those not holding their value.

Groups thus hold ℓ records, or more where residues joined (at most 2ℓ−1;
Anatomize draws each residue's group independently, and so do we). Creation
reuses the decoy module's largest-first rule, padded with ℓ − (N mod ℓ)
one-record buckets whose codes sort after every real value: among equal sizes
they come last, so they are drawn only once fewer than ℓ real buckets remain,
every earlier cut is Anatomize's, and the real members of the last cut are its
residue. Eligibility, max_s f_s ≤ N/ℓ, is Anatomy's existence condition; an
ineligible table is refused (the journal, too, calls Anatomy infeasible then).

Estimator (Xiao & Tao; seed notes 002 §3 and 003 §3), assuming public and
sensitive values are associated uniformly within a group:

    count(P ∧ s) ≈ Σ_g |P ∩ g| · c_g(s) / |g|.

It is exact for a sensitive-only query (Σ_g c_g(s) = f_s) and for a
public-only one (the QIT is the public columns verbatim).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.core.mechanisms.decoy import _largest_first_cuts, id_order
from service.core.prf import ServiceKey, keystream64, prf64, to_unit_interval
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction
from service.core.schema import Schema, SchemaError
from service.core.table import Table, distinct_rows


@dataclass
class AnatomyRelease:
    """QIT and ST. Everything here is published except `lines`."""

    schema: Schema
    sensitive: str
    ell: int
    # QIT, rows in a keyed random order: public column codes and each row's group.
    qit: dict[str, np.ndarray]
    qit_group: np.ndarray
    # ST, sorted by group then value.
    st_group: np.ndarray
    st_value: np.ndarray
    st_count: np.ndarray
    lines: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int64))

    @property
    def groups(self) -> int:
        return int(self.st_group.max(initial=-1)) + 1


class Anatomy:
    """Anatomy with diversity ℓ.

    Parameters
    ----------
    ell:
        Number of distinct sensitive values per group, ℓ ≥ 2. The table must
        be eligible: no value may exceed N/ℓ records.

    Reference: X. Xiao and Y. Tao, "Anatomy: simple and effective privacy
    preservation", VLDB 2006; the baseline of seed 000 §6 and seed 001 §9.
    """

    def __init__(self, ell: int) -> None:
        if isinstance(ell, bool) or not isinstance(ell, int | np.integer):
            raise TypeError(f"ell must be an integer, got {type(ell).__name__}")
        if ell < 2:
            raise ValueError(
                f"ell must be at least 2 (one value per group hides nothing), got {ell}"
            )
        self.ell = int(ell)

    def __repr__(self) -> str:
        return f"Anatomy(ell={self.ell})"

    def group(
        self, ids: np.ndarray, values: np.ndarray, key: ServiceKey, purpose: str
    ) -> np.ndarray:
        """Group of every row, 0..⌊N/ℓ⌋−1, deterministic given (ids, values, key, purpose)."""
        n, ell = len(values), self.ell
        counts = np.bincount(values, minlength=int(values.max(initial=0)) + 1)
        if n < ell:
            raise ValueError(f"Anatomy needs at least ℓ={ell} rows, got {n}")
        largest = int(counts.argmax())
        if counts[largest] * ell > n:
            raise ValueError(
                f"the table is not eligible for ℓ={ell}: value code {largest} holds "
                f"{counts[largest]} of {n} rows, more than 1/ℓ; lower ℓ to at most "
                f"{n // counts[largest]}"
            )
        padding = -n % ell
        cuts = _largest_first_cuts([*counts.tolist(), *[1] * padding], ell)
        slots = cuts.ravel()
        real = slots < len(counts)
        cut_of_slot = np.repeat(np.arange(len(cuts)), ell)[real]
        # The k-th cut holding value v takes the record of v with the k-th smallest id.
        by_id = id_order(ids)
        by_value_then_id = by_id[np.argsort(values[by_id], kind="stable")]
        group = np.empty(n, dtype=np.int64)
        group[by_value_then_id] = cut_of_slot[np.argsort(slots[real], kind="stable")]
        if padding:
            full = len(cuts) - 1
            residue = np.flatnonzero(group == full)
            draws = to_unit_interval(keystream64(key, f"anatomy residue:{purpose}", len(residue)))
            for row, u in zip(residue, draws, strict=True):
                # Residues have distinct values, so placing one never changes another's options;
                # a value with f_v ≤ ⌊N/ℓ⌋ records, one of them residual, misses some full group.
                holding = group[values == values[row]]
                allowed = np.setdiff1d(np.arange(full), holding)
                group[row] = allowed[int(u * len(allowed))]
        return group

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> AnatomyRelease:
        """QIT and ST of `table`, which must have exactly one sensitive attribute."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        sensitive = table.schema.sensitive
        if len(sensitive) != 1:
            raise SchemaError(
                f"Anatomy protects one sensitive attribute; the schema has {len(sensitive)}"
            )
        name = sensitive[0].name
        values = table.codes[name].astype(np.int64)
        group = self.group(ids, values, key, name)
        # Keyed per mechanism: a shared order would line up rows across two publications.
        order = np.argsort(prf64(key, "anatomy publication order", ids))
        m = sensitive[0].size
        cells, counts = np.unique(group * m + values, return_counts=True)
        return AnatomyRelease(
            schema=table.schema,
            sensitive=name,
            ell=self.ell,
            qit={a.name: table.codes[a.name][order] for a in table.schema.public},
            qit_group=group[order],
            st_group=cells // m,
            st_value=cells % m,
            st_count=counts,
            lines=table.lines[order],
        )


class AnatomyReconstruction(Reconstruction):
    """Xiao & Tao's estimate Σ_g |P ∩ g|·c_g(s)/|g| from QIT and ST.

    Estimates carry no interval: the estimator has no error model, its bias
    depends on how public and sensitive values co-vary inside groups.
    """

    def __init__(self, release: AnatomyRelease) -> None:
        public = [a.name for a in release.schema.public]
        domains = {name: release.schema[name].domain for name in public}
        columns = [release.qit[name] for name in public]
        sizes = [len(domains[name]) for name in public]
        groups = release.groups
        rows, _, counts = distinct_rows([*columns, release.qit_group], [*sizes, groups])
        cells = PublishedCells(public, domains, rows[:, :-1].astype(np.int32), counts)
        # The sensitive column lives in ST, not in the QIT cells, so it joins the
        # query checks after the base class has validated the cells.
        super().__init__(cells, [], confidence=0.95, clip=False)
        self.sensitive = [release.sensitive]
        self._labels = {v: i for i, v in enumerate(release.schema[release.sensitive].domain)}
        self._cell_group = rows[:, -1]
        self._groups = groups
        self._st_group = release.st_group
        self._st_value = release.st_value
        sizes = np.bincount(release.st_group, weights=release.st_count, minlength=groups)
        self._st_share = release.st_count / sizes[release.st_group]

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        cells, name = self.cells, columns[0]
        answers = []
        for query in queries:
            inside = cells.predicate(query.where)
            in_predicate = np.bincount(
                self._cell_group[inside], weights=cells.weights[inside], minlength=self._groups
            )
            hit = self._st_value == self._labels.get(query.value[name], -1)
            estimate = float(in_predicate[self._st_group[hit]] @ self._st_share[hit])
            answers.append(Estimate(estimate, None, None, 0, int(in_predicate.sum())))
        return answers
