"""Personal groups: reconstruction privacy by uniform perturbation and SPS (seed 004 ch. 4).

A *personal group* is the set of records sharing the full public vector, after
public values with the same effect on the sensitive attribute were merged
(`service.core.merge`). Each record's sensitive value is perturbed independently:

    keep it with probability p, else draw uniformly from all m values
    (the original included), so P[s → s] = p + (1−p)/m, P[s → s′] = (1−p)/m.

Every perturbed record is one random trial about its group. A group is
(λ, δ)-reconstruction-private iff it holds at most s_g trials
(`service.core.guarantees.trial_limit`, from its largest true frequency f). Plain
perturbation of a large group gives away too many trials; SPS
(Sampling–Perturbing–Scaling, thesis Algorithm 1) fixes that:

- *Sampling*: from a group with |g| > s_g draw n ≤ s_g records, stratified by
  original value. Every value present gets one record when n allows it, the
  rest are allocated in proportion to the strata by systematic rounding with
  a keyed offset, which is unbiased, never exceeds n in total, and rounds each
  stratum to the floor or ceiling of its share. With the adaptive budget, n
  is lowered until it also passes the test against the sample's own largest
  frequency, so rounding can never push a group over its limit.
- *Perturbing*: only the sampled records are perturbed; they are the trials.
- *Scaling*: every other record of the group publishes a copy of the
  perturbed value of a sampled record **with the same original value**
  (round-robin in keyed order). Each row keeps its own public values, so
  public counts and every stratum's size stay exact and the estimator stays
  unbiased. (The thesis duplicates whole sampled records instead, which
  changes the public-value mix inside a merged group.) Only when n is smaller
  than the number of values in the group do some strata get no trial; their
  rows copy a sampled record of another value, and are counted as *borrowed*.
  A stream, which meets its records one at a time, keeps the same promise with
  reserve trials (`service/store/lua/personal.lua`, replayed by
  `service.core.mechanisms.personal_stream`).

Budgets: ``adaptive`` uses each group's true f (the thesis), ``conservative``
uses f = 1 (the smallest limit, safe if f drifts), ``none`` is plain uniform
perturbation for comparison. A batch knows every group whole, so adaptive is
exact here; the stream does not, and its default ``bounded`` budget plans with
an upper confidence bound on f instead (`service/store/lua/personal.lua`,
docs/architecture.md). All randomness is keyed by record id, so a repeat
reproduces the publication.

Reference: Chao Han, "Sensitive Disclosures under Differential Privacy
Guarantees", PhD thesis, Simon Fraser University, 2016, chapter 4 (seed 004);
Wang, Han, Fu, Wong, Yu, "Reconstruction Privacy", EDBT 2015.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from service.core.guarantees import check_reconstruction_parameters, trial_limit
from service.core.merge import ValueMap
from service.core.prf import ServiceKey, keystream64, prf64, to_unit_interval
from service.core.schema import SchemaError
from service.core.table import Table, distinct_rows

# Budgets of a batch publication, which knows each group's final frequencies.
BUDGETS = ("adaptive", "conservative", "none")
# A stream's budgets: `bounded` (the default) plans with an upper confidence bound on a
# group's final largest frequency, the only one of them both safe and near the batch.
STREAM_BUDGETS = ("bounded", *BUDGETS)


class UniformPerturbation:
    """Retention-probability randomization over a domain of m values (seed 004 Eq. 4.2).

    Parameters
    ----------
    retention: p in (0, 1); the chance the true value is kept outright.
    domain_size: m ≥ 2, the size of the sensitive domain (all of it, not just
        the values seen).
    """

    def __init__(self, retention: float, domain_size: int) -> None:
        if not 0 < retention < 1:
            raise ValueError(f"the retention probability p must lie in (0, 1), got {retention}")
        if isinstance(domain_size, bool) or not isinstance(domain_size, int | np.integer):
            raise TypeError(f"the domain size must be an integer, got {type(domain_size).__name__}")
        if domain_size < 2:
            raise ValueError(f"the sensitive domain needs at least 2 values, got {domain_size}")
        self.retention = float(retention)
        self.domain_size = int(domain_size)

    def __repr__(self) -> str:
        return f"UniformPerturbation(retention={self.retention}, domain_size={self.domain_size})"

    @property
    def keep(self) -> float:
        """P[published value = true value] = p + (1−p)/m."""
        return self.retention + (1 - self.retention) / self.domain_size

    @property
    def switch(self) -> float:
        """P[published value = a given other value] = (1−p)/m."""
        return (1 - self.retention) / self.domain_size

    def matrix(self) -> np.ndarray:
        """P[i, j] = probability that true value i is published as j."""
        m = self.domain_size
        return np.full((m, m), self.switch) + np.eye(m) * self.retention

    def perturb(
        self, values: np.ndarray, ids: np.ndarray, key: ServiceKey, purpose: str
    ) -> np.ndarray:
        """Perturbed codes: a keyed coin of the id decides, a keyed draw replaces."""
        heads = to_unit_interval(prf64(key, f"perturb keep:{purpose}", ids)) < self.retention
        draws = prf64(key, f"perturb value:{purpose}", ids) % np.uint64(self.domain_size)
        return np.where(heads, values, draws.astype(values.dtype))


@dataclass
class GroupAudit:
    """The (λ, δ) test for every personal group (seed 004 Cor. 6, §4.4.2)."""

    labels: list[tuple[str, ...]]
    sizes: np.ndarray
    max_frequency: np.ndarray
    limit: np.ndarray
    trials: np.ndarray

    @property
    def passed(self) -> np.ndarray:
        return self.trials <= self.limit

    @property
    def groups_failing(self) -> float:
        """v_g: share of personal groups over their limit."""
        return float((~self.passed).mean()) if len(self.sizes) else 0.0

    @property
    def records_failing(self) -> float:
        """v_r: share of records that lie in groups over their limit."""
        total = self.sizes.sum()
        return float(self.sizes[~self.passed].sum() / total) if total else 0.0


@dataclass
class PersonalRelease:
    """A batch publication and its accounting, which never leaves the trusted side."""

    published: Table
    plain: GroupAudit  # the test had every record been perturbed (plain perturbation)
    audit: GroupAudit  # the test on what was published (SPS trials)
    sampled_rows: int
    borrowed_rows: int
    group_of_row: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int64))
    sampled: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, bool))


class PersonalGroups:
    """SPS over personal groups with (λ, δ)-reconstruction privacy.

    Parameters
    ----------
    retention: p, the retention probability of the perturbation.
    lam, delta: the privacy parameters (λ, δ). No adversary can prove that a
        personal reconstruction is within a relative error λ with probability
        above 1 − δ by a Chernoff bound. Thesis defaults: p = 0.5, λ = δ = 0.3.
    budget: ``adaptive`` (true f), ``conservative`` (f = 1) or ``none``.
    value_map: merged public values defining the groups; None groups on the
        raw public values (pooling groups then defeats the test, so publish
        with a map fitted on a reference table).
    """

    def __init__(
        self,
        retention: float,
        lam: float,
        delta: float,
        budget: str = "adaptive",
        value_map: ValueMap | None = None,
    ) -> None:
        if budget == "bounded":
            raise ValueError(
                "the bounded budget is the stream's: a batch knows each group's final "
                "frequency, so adaptive is exact here"
            )
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
        check_reconstruction_parameters(retention, 2, lam, delta)
        self.retention = float(retention)
        self.lam = float(lam)
        self.delta = float(delta)
        self.budget = budget
        self.value_map = value_map

    def __repr__(self) -> str:
        return (
            f"PersonalGroups(retention={self.retention}, lam={self.lam}, delta={self.delta}, "
            f"budget={self.budget!r})"
        )

    def sensitive_attribute(self, table: Table) -> str:
        sensitive = table.schema.sensitive
        if len(sensitive) != 1:
            raise SchemaError(
                "personal groups protect one sensitive attribute (seed 004 ch. 4); "
                f"the schema has {len(sensitive)}: use decoy groups for several"
            )
        name = sensitive[0].name
        if self.value_map is not None and self.value_map.sensitive != name:
            raise SchemaError(
                f"the merge map was fitted for {self.value_map.sensitive!r}, not {name!r}"
            )
        m = sensitive[0].size
        check_reconstruction_parameters(self.retention, m, self.lam, self.delta)
        smallest = float(trial_limit(1.0, self.retention, m, self.lam, self.delta))
        if self.budget != "none" and smallest < 1:
            raise ValueError(
                f"with p = {self.retention}, λ = {self.lam}, δ = {self.delta} and m = {m} a "
                f"group whose values all agree may hold {smallest:.2f} trials, less than one "
                "record: lower p or λ, or raise δ"
            )
        return name

    def group_keys(self, table: Table) -> tuple[np.ndarray, list[list[str]], list[int]]:
        """Each row's merged class per public attribute: (n, attributes) codes, class labels."""
        columns, names, sizes = [], [], []
        for attribute in table.schema.public:
            if self.value_map is None:
                per_code, labels = np.arange(attribute.size), list(attribute.domain)
            else:
                per_code, labels = self.value_map.classes_of(attribute.name, attribute.domain)
            columns.append(per_code[table.codes[attribute.name]])
            names.append(labels)
            sizes.append(len(labels))
        keys = np.column_stack(columns) if columns else np.zeros((len(table), 0), np.int64)
        return keys, names, sizes

    def groups(self, table: Table) -> tuple[np.ndarray, list[tuple[str, ...]]]:
        """Personal group of every row (0..G−1, in key order) and each group's label."""
        keys, names, sizes = self.group_keys(table)
        rows, group_of_row, _ = distinct_rows(list(keys.T), sizes)
        labels = [tuple(n[c] for n, c in zip(names, key, strict=True)) for key in rows]
        return group_of_row, labels

    def audit(self, table: Table) -> GroupAudit:
        """The test for plain perturbation: every record of a group is a trial."""
        return self._audit(table, *self.groups(table))

    def _audit(
        self, table: Table, group_of_row: np.ndarray, labels: list[tuple[str, ...]]
    ) -> GroupAudit:
        name = self.sensitive_attribute(table)
        sizes, largest = _group_statistics(group_of_row, table.codes[name], len(labels))
        frequency = largest / np.maximum(sizes, 1)
        limit = trial_limit(
            frequency, self.retention, table.schema[name].size, self.lam, self.delta
        )
        return GroupAudit(labels, sizes, frequency, limit, sizes.copy())

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> PersonalRelease:
        """SPS: sample oversized groups, perturb the sample, scale back by copies."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        name = self.sensitive_attribute(table)
        m = table.schema[name].size
        perturbation = UniformPerturbation(self.retention, m)
        values = table.codes[name].astype(np.int64)
        group_of_row, labels = self.groups(table)
        plain = self._audit(table, group_of_row, labels)
        n_groups = len(labels)

        # Rows in order of (group, original value, keyed sample order): strata are contiguous.
        order = np.lexsort((prf64(key, f"sps sample:{name}", ids), values, group_of_row))
        stratum_key = group_of_row[order] * m + values[order]
        starts = np.flatnonzero(np.r_[True, stratum_key[1:] != stratum_key[:-1]])
        stratum_sizes = np.diff(np.r_[starts, len(order)])
        stratum_group = group_of_row[order][starts]
        budget = self._budget(plain, m)
        quota = stratum_sizes.copy()
        offsets = to_unit_interval(keystream64(key, f"sps rounding:{name}", n_groups))
        first_stratum = np.searchsorted(stratum_group, np.arange(n_groups + 1))
        trials = plain.sizes.copy()
        for g in np.flatnonzero(plain.sizes > budget):
            strata = slice(first_stratum[g], first_stratum[g + 1])
            quota[strata] = self._sample_sizes(stratum_sizes[strata], budget[g], offsets[g], m)
            trials[g] = quota[strata].sum()

        stratum_start = np.repeat(starts, stratum_sizes)
        position = np.arange(len(order)) - stratum_start
        row_quota = np.repeat(quota, stratum_sizes)
        sampled_sorted = position < row_quota
        has_trial = row_quota > 0
        # Row j of a stratum copies the perturbed value of its (j mod n_x)-th sampled row.
        source = np.where(has_trial, stratum_start + position % np.maximum(row_quota, 1), 0)
        borrowed = np.flatnonzero(~has_trial)
        if len(borrowed):
            source[borrowed] = _borrow(sampled_sorted, group_of_row[order], borrowed, position)
        perturbed = np.zeros(len(order), dtype=np.int64)
        sampled_rows = order[sampled_sorted]
        perturbed[sampled_sorted] = perturbation.perturb(
            values[sampled_rows], ids[sampled_rows], key, name
        )
        published_values = np.empty(len(order), dtype=table.codes[name].dtype)
        published_values[order] = perturbed[source]
        published = publication(table, name, published_values, ids, key)
        sampled = np.zeros(len(order), dtype=bool)
        sampled[sampled_rows] = True
        audit = GroupAudit(labels, plain.sizes, plain.max_frequency, plain.limit, trials)
        return PersonalRelease(
            published, plain, audit, int(sampled.sum()), len(borrowed), group_of_row, sampled
        )

    def _budget(self, plain: GroupAudit, m: int) -> np.ndarray:
        """Trials each group may have: s_g from its f (adaptive) or f = 1 (conservative)."""
        if self.budget == "none":
            return np.full(len(plain.sizes), np.inf)
        if self.budget == "conservative":
            return np.full(
                len(plain.sizes), trial_limit(1.0, self.retention, m, self.lam, self.delta)
            )
        return plain.limit

    def _sample_sizes(self, strata: np.ndarray, limit: float, offset: float, m: int) -> np.ndarray:
        """Per-stratum sample sizes totalling at most ⌊limit⌋, passing the test on the sample."""
        n = math.floor(limit)
        while True:
            sizes = _stratified_allocation(strata, n, offset)
            if self.budget == "conservative":
                return sizes
            largest = sizes.max() / n
            if n <= trial_limit(largest, self.retention, m, self.lam, self.delta):
                return sizes
            # Ends by n = 1 at the latest: s_g(f = 1) ≥ 1 was checked up front.
            n -= 1


def publication(
    table: Table, name: str, published: np.ndarray, ids: np.ndarray, key: ServiceKey
) -> Table:
    """`table` with column `name` replaced by its `published` values, the rows in keyed
    order: nothing in the file's order follows the input's."""
    order = np.argsort(prf64(key, "publication order", ids))
    codes = {**table.codes, name: published}
    return Table(table.schema, {k: v[order] for k, v in codes.items()}, table.lines[order])


def _group_statistics(
    group_of_row: np.ndarray, values: np.ndarray, n_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Size of every group and the count of its most frequent true value."""
    sizes = np.bincount(group_of_row, minlength=n_groups)
    width = int(values.max(initial=0)) + 1
    joint = np.bincount(group_of_row * width + values, minlength=n_groups * width)
    return sizes, joint.reshape(n_groups, width).max(axis=1)


def _stratified_allocation(strata: np.ndarray, n: int, offset: float) -> np.ndarray:
    """Split n draws over strata: one per stratum if n allows, the rest proportionally.

    Systematic rounding on integer cumulative sums: with weights N_x/D and
    U = ⌊offset·D⌋, stratum x gets ⌊(C_x + U)/D⌋ − ⌊(C_{x−1} + U)/D⌋, which is
    the floor or ceiling of its share, equal to it in expectation, and sums to
    the total exactly.
    """
    total = int(strata.sum())
    k = len(strata)
    if n >= total:
        return strata.copy()
    if n >= k:
        base, numerators, denominator = 1, (strata - 1) * (n - k), total - k
    else:
        base, numerators, denominator = 0, strata * n, total
    shift = int(offset * denominator)
    cumulative = np.r_[0, np.cumsum(numerators, dtype=np.int64)] + shift
    return base + np.diff(cumulative // denominator)


def _borrow(
    sampled_sorted: np.ndarray, group_sorted: np.ndarray, rows: np.ndarray, position: np.ndarray
) -> np.ndarray:
    """Sources for rows of strata without a trial: sampled rows of the same group, round-robin."""
    sampled_positions = np.flatnonzero(sampled_sorted)
    groups = group_sorted[rows]
    first = np.searchsorted(group_sorted[sampled_positions], groups, side="left")
    last = np.searchsorted(group_sorted[sampled_positions], groups, side="right")
    return sampled_positions[first + position[rows] % (last - first)]
