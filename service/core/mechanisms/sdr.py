"""Small domain randomization (SDR): perturbation partitioning, then per-sub-table UP (seed 002).

Uniform perturbation (UP) over m values keeps a value with probability p and
otherwise draws uniformly from all m values (the original included), so with
q = (1−p)/m, P[x → x] = p + q and P[x → y] = q. It gives restricted
(ρ1, ρ2)-privacy (a value x with prior Pr[X = x] ≤ ρ1 has posterior
Pr[X = x | Y = y] ≤ ρ2) when the amplification (p + q)/q is at most

    γ = ρ2·(1 − ρ1) / (ρ1·(1 − ρ2)),                                 (Eq. 6)

and the largest retention with that amplification is

    p = (γ − 1)/(m − 1 + γ),   p + q = γ/(m − 1 + γ),                (Eq. 4–5)

which is tiny when m is large. SDR partitions the *records* into sub-tables
T_1..T_k and perturbs each T_i only within SA_i, the values occurring in it
(m_i = |SA_i|; the SA_i may overlap), with its own amplification:

    SA'  = {x : f_x/|T| ≤ ρ1}                   the protected values
    ρ_1i = max over x ∈ SA' of f_x(T_i)/|T_i|    (Eq. 9)
    γ_i  = ρ2·(1 − ρ_1i) / (ρ_1i·(1 − ρ2))       (Eq. 10)
    p_i  = (γ_i − 1)/(m_i − 1 + γ_i).

A partition is admissible iff ρ_1i < ρ2 for every sub-table (Def. 2 (i)): then
every x ∈ SA' has posterior ≤ ρ2 inside its sub-table (Cor. 1). Among
admissible partitions, Perturbation Partitioning (PP) heuristically minimizes
the Chernoff error bound (Def. 2 (ii))

    ε(Part) = Σ_i |T_i|/|T| · a/√|T_i| · (m_i/(γ_i − 1) + 1),  a = 2·√ln(2/δ)   (Eq. 12)

in three phases: balancing into θ-balanced initial groups (Fig. 1, Eq. 13;
App. 10.7 when SA' ⊂ SA), Reverse Cuthill–McKee rearranging on the pattern of
B = A·Aᵀ, and a dynamic program over contiguous runs of groups (Eq. 14).

What is public. For reconstruction the paper publishes SA_i and P_i (m_i and
γ_i) of every sub-table (§4.3, App. 10.3), and so which sub-table each
published row belongs to. A reader therefore learns Pr[X ∈ SA_i | Y = y] = 1
for a record of T_i, and ρ_1i from γ_i. The restricted privacy covers only
single-value predicates X = x, and values outside SA' are not protected at
all. Unlike the stream mechanisms (SPEC §3: no group ids), an SDR publication
labels every row with its sub-table; rows still come out in a keyed random
order.

Where the paper is silent or slips (seed notes 002 §6):
- ties between equally frequent values go to the lower code, which
  reproduces Example 2; h uses |T_0|/θ, not ⌊T_0⌋/θ, and θ stays fixed;
- App. 10.7 hands out ⌊|g_j|/|T'|·|T''|⌋ records of T'' to group g_j (the
  text's |g_j|/|T''| would hand out |g_j|), most frequent value first;
- which records of a value join which sub-table is a keyed random choice, so
  public attributes and input order never shape the public sub-tables;
- RCM's start node and tie-breaking change the result and the paper's order
  for Example 3 follows no stated rule: PP tries scipy's RCM and one
  Cuthill–McKee order per low-degree start node, and keeps the order whose
  DP optimum is smallest (reversal does not change the DP);
- a run of groups is infeasible unless 0 < ρ_1i < ρ2, so no sub-table is
  published unperturbed (ρ_1i = 0 would mean γ_i = ∞). The whole table is
  always feasible (ρ_1 ≤ ρ1 < ρ2), so PP always returns a partition;
- every draw is a keyed PRF of the record id: a repeat publishes the same rows.

Reconstruction of "public predicate ∧ SA = s" (§3.3, App. 10.10): in each
sub-table j with s ∈ SA_j, the r_j published rows matching the predicate, o_j
of them showing s, give (o_j − r_j·q_j)/p_j = ((m_j − 1 + γ_j)·o_j − r_j)/(γ_j − 1)
(Eq. 7, the inverse of P_j). Sub-tables without s add nothing (the formula
would add −r_j/(γ_j − 1)). The sum over sub-tables is unbiased; its variance
is Σ_j [f_j·a_j(1 − a_j) + (r_j − f_j)·q_j(1 − q_j)]/p_j², a_j = p_j + q_j,
with f_j estimated and clipped to [0, r_j].

Reference: Chaytor, Wang, "Small Domain Randomization: Same Privacy, More
Utility", PVLDB 3(1), VLDB 2010 (seed 002).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TypeVar

import numpy as np

from service.core.guarantees import as_fraction
from service.core.mechanisms.personal import UniformPerturbation
from service.core.prf import ServiceKey, prf64
from service.core.reconstruct import Estimate, PublishedCells, Query, QueryError, Reconstruction
from service.core.schema import SchemaError
from service.core.table import Table

SUBTABLE_COLUMN = "subtable"
# Cuthill–McKee start nodes tried, lowest degree first. The paper saw at most 20
# initial groups on CENSUS, so usually every node is tried; the cap keeps PP
# within a constant factor of one O(t²·m) dynamic program on skewed domains.
_START_CANDIDATES = 32

Number = TypeVar("Number", float, Fraction)


def amplification(rho1: float | Fraction, rho2: float | Fraction) -> Fraction:
    """γ = ρ2(1 − ρ1)/(ρ1(1 − ρ2)), the largest admissible (p+q)/q (Eq. 6, Eq. 10).

    Exact: floats are read as the decimals they print as; pass Fractions for
    thirds and the like.
    """
    r1, r2 = _probability(rho1, "rho1"), _probability(rho2, "rho2")
    return r2 * (1 - r1) / (r1 * (1 - r2))


def privacy_for_amplification(counts: np.ndarray, gamma: int) -> tuple[Fraction, Fraction]:
    """(ρ1, ρ2) that compare SDR fairly with γ-based mechanisms (seed notes 001 pitfall 20):
    ρ1 = 1/⌊N/f_max⌋ protects every value (as the paper sets 1/13 on OCC), and ρ2 makes the
    whole table's amplification ρ2(1 − ρ1)/(ρ1(1 − ρ2)) equal γ. `counts` holds the
    sensitive column's count of each value."""
    rho1 = Fraction(1, int(counts.sum()) // int(counts.max()))
    odds = gamma * rho1 / (1 - rho1)  # ρ2/(1 − ρ2) = γ·ρ1/(1 − ρ1)
    return rho1, odds / (1 + odds)


def max_retention(gamma: Number, m: int) -> Number:
    """p = (γ − 1)/(m − 1 + γ): the largest retention over m values with amplification γ (Eq. 4).

    The diagonal p + q is γ/(m − 1 + γ), the off-diagonal q is 1/(m − 1 + γ).
    """
    if not gamma >= 1:
        raise ValueError(f"the amplification γ must be at least 1, got {gamma}")
    if m < 1:
        raise ValueError(f"the domain needs at least one value, got m = {m}")
    return (gamma - 1) / (m - 1 + gamma)


def protected_values(counts: np.ndarray, rho1: float | Fraction) -> np.ndarray:
    """SA' as a mask over codes: values with relative frequency ≤ ρ1 (non-strict, Eq. 9)."""
    r1 = _probability(rho1, "rho1")
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    return np.array([c > 0 and c * r1.denominator <= r1.numerator * total for c in counts.tolist()])


def is_balanced(counts: np.ndarray, protected: np.ndarray, theta: int) -> bool:
    """Def. 3: every protected value holds at most 1/θ of the records."""
    counts = np.asarray(counts, dtype=np.int64)
    return bool(theta * counts[protected].max(initial=0) <= counts.sum())


def balance(counts: np.ndarray, theta: int) -> np.ndarray:
    """Phase 1 (Fig. 1, Eq. 13): θ-balanced initial groups, as a (t, m) count matrix.

    Each group takes h records of each of the θ most frequent values left, h
    the largest that leaves the rest θ-balanced (Lemma 1); h = 0 makes the rest
    the last group. `counts` must itself be θ-balanced over all its values.
    """
    remaining = np.asarray(counts, dtype=np.int64).copy()
    if theta < 1 or not is_balanced(remaining, np.ones(len(remaining), bool), theta):
        raise ValueError(f"the counts are not {theta}-balanced")
    groups = []
    while remaining.any():
        total = int(remaining.sum())
        by_size = np.argsort(-remaining, kind="stable")
        mu = remaining[by_size]
        largest, mu_theta = int(mu[0]), int(mu[theta - 1])
        mu_next = int(mu[theta]) if theta < len(mu) else 0
        # σ(v) = |T_0|/θ − max(μ_1 − v, μ_θ+1), compared after multiplying by θ.
        if total - theta * max(largest - mu_theta, mu_next) >= theta * mu_theta:
            h = mu_theta
        else:
            h = (total - theta * mu_next) // theta
        group = remaining.copy()
        if h:
            group[:] = 0
            group[by_size[:theta]] = h
        groups.append(group)
        remaining -= group
    return np.array(groups, dtype=np.int64).reshape(-1, len(remaining))


def distribute_unprotected(groups: np.ndarray, unprotected: np.ndarray) -> np.ndarray:
    """App. 10.7: add T'' to the groups of T' in proportion to |g_j|, most frequent value first.

    Group j receives the next ⌊|g_j|·|T''|/|T'|⌋ records of T'' listed value by
    value (so each group gains few distinct values); the residue goes to the
    last group.
    """
    groups = np.array(groups, dtype=np.int64)
    unprotected = np.asarray(unprotected, dtype=np.int64)
    rest = int(unprotected.sum())
    sizes = groups.sum(axis=1)
    quotas = sizes * rest // sizes.sum()
    quotas[-1] += rest - quotas.sum()
    by_size = np.argsort(-unprotected, kind="stable")
    listed = np.cumsum(unprotected[by_size])
    start = 0
    for j, quota in enumerate(quotas.tolist()):
        end = start + quota
        # Records start..end−1 of the listing, counted per value.
        taken = np.clip(listed, start, end) - np.clip(listed - unprotected[by_size], start, end)
        groups[j, by_size] += taken
        start = end
    return groups


def rearrangements(groups: np.ndarray) -> list[np.ndarray]:
    """Phase 2 candidates: Reverse Cuthill–McKee orders of the groups on the pattern of A·Aᵀ.

    scipy's RCM first, then one RCM order per start node (the lowest-degree
    `_START_CANDIDATES`), neighbours by degree then index. Orders equal up to
    reversal admit the same segmentations and are listed once.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    pattern = (np.asarray(groups) > 0).astype(np.int64)
    adjacent = pattern @ pattern.T > 0
    np.fill_diagonal(adjacent, False)
    degree = adjacent.sum(axis=1)
    priority = np.lexsort((np.arange(len(degree)), degree))
    candidates = [reverse_cuthill_mckee(csr_matrix(adjacent.astype(np.int8)), symmetric_mode=True)]
    candidates += [
        _cuthill_mckee(adjacent, priority, int(start))[::-1]
        for start in priority[:_START_CANDIDATES]
    ]
    seen, distinct = set(), []
    for order in candidates:
        signature = min(tuple(order.tolist()), tuple(order[::-1].tolist()))
        if signature not in seen:
            seen.add(signature)
            distinct.append(np.asarray(order, dtype=np.int64))
    return distinct


def _cuthill_mckee(adjacent: np.ndarray, priority: np.ndarray, start: int) -> np.ndarray:
    """Breadth-first order from `start`; other components from their first node in `priority`."""
    rank = np.empty(len(priority), dtype=np.int64)
    rank[priority] = np.arange(len(priority))
    visited = np.zeros(len(priority), dtype=bool)
    order = []
    for root in [start, *priority.tolist()]:
        if visited[root]:
            continue
        visited[root] = True
        queue = deque([root])
        while queue:
            node = queue.popleft()
            order.append(node)
            neighbours = np.flatnonzero(adjacent[node] & ~visited)
            neighbours = neighbours[np.argsort(rank[neighbours])]
            visited[neighbours] = True
            queue.extend(neighbours.tolist())
    return np.asarray(order, dtype=np.int64)


def merge(
    groups: np.ndarray, protected: np.ndarray, rho2: float | Fraction
) -> tuple[list[tuple[int, int]], float]:
    """Phase 3 (Eq. 14): the best split of a sequence of groups into contiguous runs.

    Returns the runs as half-open (start, end) positions and the optimum of
    Σ_i √|T_i|·(m_i/(γ_i − 1) + 1), which is ε(Part)·|T|/a. Runs with
    ρ_1i ≥ ρ2 or without a protected value are infeasible.
    """
    groups = np.asarray(groups, dtype=np.int64)
    weights = _run_weights(groups, np.asarray(protected, dtype=bool), _probability(rho2, "rho2"))
    t = len(groups)
    best = np.full(t + 1, math.inf)
    best[0] = 0.0
    previous = np.zeros(t + 1, dtype=np.int64)
    for end in range(1, t + 1):
        options = best[:end] + weights[:end, end - 1]
        previous[end] = int(np.argmin(options))
        best[end] = options[previous[end]]
    if not math.isfinite(best[t]):
        raise ValueError("no run of the groups is feasible: ρ_1i < ρ2 fails everywhere")
    runs, end = [], t
    while end:
        runs.append((int(previous[end]), end))
        end = int(previous[end])
    return runs[::-1], float(best[t])


def _run_weights(groups: np.ndarray, protected: np.ndarray, rho2: Fraction) -> np.ndarray:
    """W[i, j] = √n·(m/(γ − 1) + 1) for the run of groups i..j (inf when infeasible)."""
    t = len(groups)
    prefix = np.vstack([np.zeros((1, groups.shape[1]), np.int64), np.cumsum(groups, axis=0)])
    weights = np.full((t, t), math.inf)
    odds = float(rho2 / (1 - rho2))
    for i in range(t):
        runs = prefix[i + 1 :] - prefix[i]
        size = runs.sum(axis=1)
        distinct = (runs > 0).sum(axis=1)
        largest = runs[:, protected].max(axis=1, initial=0)
        # ρ_1 = largest/size < ρ2, exactly: object arrays hold Python ints.
        feasible = (largest > 0) & (
            largest.astype(object) * rho2.denominator < rho2.numerator * size.astype(object)
        ).astype(bool)
        with np.errstate(divide="ignore", invalid="ignore"):
            gamma = odds * (size - largest) / largest
            weight = np.sqrt(size) * (distinct / (gamma - 1) + 1)
        weights[i, i:] = np.where(feasible, weight, math.inf)
    return weights


@dataclass(frozen=True)
class SubTable:
    """What a reader gets for one sub-table: SA_i (codes, ascending), |T_i|, ρ_1i and γ_i."""

    values: tuple[int, ...]
    size: int
    rho1: Fraction
    gamma: Fraction

    @property
    def m(self) -> int:
        return len(self.values)

    @property
    def retention(self) -> Fraction:
        """p_i = (γ_i − 1)/(m_i − 1 + γ_i)."""
        return max_retention(self.gamma, self.m)

    @property
    def keep(self) -> Fraction:
        """P_i diagonal p_i + q_i = γ_i/(m_i − 1 + γ_i)."""
        return self.gamma / (self.m - 1 + self.gamma)

    @property
    def switch(self) -> Fraction:
        """P_i off-diagonal q_i = 1/(m_i − 1 + γ_i)."""
        return 1 / (self.m - 1 + self.gamma)

    def matrix(self) -> np.ndarray:
        """P_i[x, y] = probability that x ∈ SA_i is published as y (rows and columns in SA_i)."""
        return np.full((self.m, self.m), float(self.switch)) + np.eye(self.m) * float(
            self.retention
        )

    def error_bound(self, delta: float) -> float:
        """ε_i of Eq. 12 at confidence 1 − δ."""
        return _chernoff_factor(delta) / math.sqrt(self.size) * _error_term(self.m, self.gamma)


@dataclass
class SDRPartition:
    """PP's result on a frequency vector; the counts stay on the trusted side."""

    counts: np.ndarray  # frequency of every code in T
    protected: np.ndarray  # SA' mask
    theta: int  # ⌊|T|/f^m⌋
    theta_prime: int  # ⌊|T'|/f^m⌋, the level T' was balanced at (= θ when SA' = SA)
    groups: np.ndarray  # (t, m) initial groups, in balancing order
    order: np.ndarray  # the rearranged sequence of groups
    runs: list[tuple[int, int]]  # sub-table i = groups order[start:end]
    subtable_counts: np.ndarray  # (k, m)
    subtables: list[SubTable]
    error_bound: float  # ε(Part) at confidence 1 − δ
    unpartitioned_error: float  # ε({T}): UP over all of SA with ρ_1 from Eq. 9


def perturbation_partitioning(
    counts: np.ndarray, rho1: float | Fraction, rho2: float | Fraction, delta: float = 0.05
) -> SDRPartition:
    """PP (§5, App. 10.7) on the frequency vector of T."""
    r1, r2 = _probability(rho1, "rho1"), _probability(rho2, "rho2")
    if not r1 < r2:
        raise ValueError(f"rho1 must be below rho2, got {rho1} and {rho2}")
    counts = np.asarray(counts, dtype=np.int64)
    if counts.sum() == 0:
        raise ValueError("the table is empty")
    protected = protected_values(counts, r1)
    if not protected.any():
        raise ValueError(
            f"no value has relative frequency ≤ rho1 = {rho1}, so (ρ1, ρ2)-privacy protects "
            "nothing (SA' is empty): raise rho1"
        )
    largest = int(counts[protected].max())
    theta = int(counts.sum()) // largest
    inside = np.where(protected, counts, 0)
    theta_prime = int(inside.sum()) // largest
    groups = balance(inside, theta_prime)
    if not protected.all():
        groups = distribute_unprotected(groups, counts - inside)
    best = None
    for order in rearrangements(groups):
        runs, objective = merge(groups[order], protected, r2)
        if best is None or objective < best[2]:
            best = (order, runs, objective)
    order, runs, objective = best
    subtable_counts = np.array([groups[order[a:b]].sum(axis=0) for a, b in runs])
    subtables = [_subtable(c, protected, r2) for c in subtable_counts]
    whole = _subtable(counts, protected, r2)
    factor = _chernoff_factor(delta)
    return SDRPartition(
        counts=counts,
        protected=protected,
        theta=theta,
        theta_prime=theta_prime,
        groups=groups,
        order=order,
        runs=runs,
        subtable_counts=subtable_counts,
        subtables=subtables,
        error_bound=factor * objective / counts.sum(),
        unpartitioned_error=whole.error_bound(delta),
    )


def _subtable(counts: np.ndarray, protected: np.ndarray, rho2: Fraction) -> SubTable:
    size = int(counts.sum())
    rho1 = Fraction(int(counts[protected].max()), size)
    return SubTable(
        tuple(np.flatnonzero(counts).tolist()),
        size,
        rho1,
        rho2 * (1 - rho1) / (rho1 * (1 - rho2)),
    )


def _error_term(m: int, gamma: Fraction) -> float:
    return m / float(gamma - 1) + 1


def _chernoff_factor(delta: float) -> float:
    """a = 2·√ln(2/δ) of Eq. 11 (natural log, as in the Chernoff bound it comes from)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return 2 * math.sqrt(math.log(2 / delta))


def _probability(value: float | Fraction, name: str) -> Fraction:
    exact = as_fraction(value, name)
    if not exact < 1:
        raise ValueError(
            f"{name} must lie in (0, 1), got {value}: at 1 the posterior bound is vacuous"
        )
    return exact


@dataclass
class SDRRelease:
    """A batch publication. `published`, `subtable` and `subtables` are public (App. 10.3);
    the partition and row assignment never leave the trusted side."""

    published: Table
    sensitive: str
    subtable: np.ndarray  # sub-table of every published row
    subtables: list[SubTable]
    partition: SDRPartition = field(repr=False)
    subtable_of_row: np.ndarray = field(repr=False)  # sub-table of every input row
    source_rows: np.ndarray = field(repr=False)  # input row of every published row

    def cells(self) -> PublishedCells:
        """The publication aggregated to cells, with the sub-table as column `SUBTABLE_COLUMN`."""
        schema = self.published.schema
        names = [*schema.names, SUBTABLE_COLUMN]
        domains = {n: schema[n].domain for n in schema.names}
        domains[SUBTABLE_COLUMN] = tuple(str(i) for i in range(len(self.subtables)))
        codes = [self.published.codes[n] for n in schema.names]
        return PublishedCells.from_codes(names, domains, [*codes, self.subtable])


class SmallDomainRandomization:
    """Small domain randomization of one sensitive attribute under (ρ1, ρ2)-privacy.

    Parameters
    ----------
    rho1, rho2: the restricted (ρ1, ρ2)-privacy, 0 < ρ1 < ρ2 < 1: a value whose
        relative frequency in the table is at most ρ1 is inferred with posterior
        at most ρ2. Floats are read as the decimals they print as; pass
        Fractions for exact thirds. Paper: ρ1 = 1/13, ρ2 = 1/6 .. 1/3 on OCC.
    delta: confidence 1 − δ of the error bound PP minimizes (paper: 0.05); it
        scales the reported bound but never changes the partition.
    """

    def __init__(self, rho1: float | Fraction, rho2: float | Fraction, delta: float = 0.05) -> None:
        r1, r2 = _probability(rho1, "rho1"), _probability(rho2, "rho2")
        if not r1 < r2:
            raise ValueError(f"rho1 must be below rho2, got {rho1} and {rho2}")
        _chernoff_factor(delta)
        self.rho1, self.rho2, self.delta = r1, r2, float(delta)

    def __repr__(self) -> str:
        return f"SmallDomainRandomization(rho1={self.rho1}, rho2={self.rho2}, delta={self.delta})"

    def sensitive_attribute(self, table: Table) -> str:
        sensitive = table.schema.sensitive
        if len(sensitive) != 1:
            raise SchemaError(
                "small domain randomization protects one sensitive attribute (seed 002 §3.1; "
                f"several form one compound attribute); the schema has {len(sensitive)}"
            )
        return sensitive[0].name

    def partition(self, table: Table) -> SDRPartition:
        """PP on the table's sensitive frequencies (which records go where is decided by
        `publish`)."""
        name = self.sensitive_attribute(table)
        counts = np.bincount(table.codes[name], minlength=table.schema[name].size)
        return perturbation_partitioning(counts, self.rho1, self.rho2, self.delta)

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> SDRRelease:
        """Partition, then perturb every record within its sub-table's domain."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        if SUBTABLE_COLUMN in table.schema:
            raise SchemaError(f"the column name {SUBTABLE_COLUMN!r} is reserved for sub-tables")
        name = self.sensitive_attribute(table)
        partition = self.partition(table)
        values = table.codes[name]
        # Records of a value fill its sub-table quotas in keyed order.
        by_value = np.lexsort((prf64(key, f"sdr assignment:{name}", ids), values))
        k, m = partition.subtable_counts.shape
        subtable_of_row = np.empty(len(table), dtype=np.int64)
        subtable_of_row[by_value] = np.repeat(
            np.tile(np.arange(k), m), partition.subtable_counts.T.ravel()
        )
        published_values = values.copy()
        for i, sub in enumerate(partition.subtables):
            rows = np.flatnonzero(subtable_of_row == i)
            domain = np.asarray(sub.values, dtype=values.dtype)
            local = np.searchsorted(domain, values[rows])
            perturbation = UniformPerturbation(float(sub.retention), sub.m)
            published_values[rows] = domain[
                perturbation.perturb(local, ids[rows], key, f"sdr:{name}")
            ]
        order = np.argsort(prf64(key, "publication order", ids))
        codes = {**table.codes, name: published_values}
        published = Table(table.schema, {c: v[order] for c, v in codes.items()}, table.lines[order])
        return SDRRelease(
            published,
            name,
            subtable_of_row[order],
            partition.subtables,
            partition,
            subtable_of_row,
            order,
        )


class SDRReconstruction(Reconstruction):
    """Count queries "public predicate ∧ SA = s" on an SDR publication: Eq. 7 per sub-table, summed.

    Parameters
    ----------
    cells: the publication aggregated, including the sub-table column.
    sensitive: the perturbed column.
    subtables: SA_i and γ_i of each sub-table, in label order ("0", "1", ...).
    domain: the labels the codes in SA_i stand for (the schema's domain).
    subtable_column: the column holding each row's sub-table label.
    confidence, clip: as for `Reconstruction`; unclipped by default, which
        keeps the estimate unbiased.
    """

    def __init__(
        self,
        cells: PublishedCells,
        sensitive: str,
        subtables: Sequence[SubTable],
        domain: Sequence[str],
        subtable_column: str = SUBTABLE_COLUMN,
        confidence: float = 0.95,
        clip: bool = False,
    ) -> None:
        if subtable_column not in cells.columns:
            raise ValueError(f"the published data has no sub-table column {subtable_column!r}")
        super().__init__(cells, [sensitive], confidence, clip)
        labels = cells.domains[subtable_column]
        index = {str(i): i for i in range(len(subtables))}
        unknown = [label for label in labels if label not in index]
        if unknown:
            raise ValueError(
                f"sub-table {unknown[0]!r} is published but {len(subtables)} sub-tables are given"
            )
        self._part = np.asarray([index[label] for label in labels], dtype=np.int64)[
            cells.column[subtable_column]
        ]
        self._domain = frozenset(domain)
        self._members = [frozenset(domain[v] for v in sub.values) for sub in subtables]
        self._retention = np.array([float(sub.retention) for sub in subtables])
        self._keep = np.array([float(sub.keep) for sub in subtables])
        self._switch = np.array([float(sub.switch) for sub in subtables])

    @classmethod
    def from_release(
        cls, release: SDRRelease, confidence: float = 0.95, clip: bool = False
    ) -> SDRReconstruction:
        domain = release.published.schema[release.sensitive].domain
        return cls(
            release.cells(),
            release.sensitive,
            release.subtables,
            domain,
            SUBTABLE_COLUMN,
            confidence,
            clip,
        )

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        cells, name = self.cells, columns[0]
        column, k = cells.column[name], len(self._members)
        p, a, q = self._retention, self._keep, self._switch
        raw, variance = np.empty(len(queries)), np.empty(len(queries))
        rows, published = np.empty(len(queries)), np.empty(len(queries), dtype=np.int64)
        for i, query in enumerate(queries):
            label = query.value[name]
            if label not in self._domain:
                raise QueryError(f"value.{name}: {label!r} is not in the sensitive domain")
            member = np.array([label in values for values in self._members], dtype=bool)
            inside = cells.predicate(query.where)
            hit = inside & (column == cells.code(name, label))
            r = np.bincount(self._part[inside], weights=cells.weights[inside], minlength=k)
            o = np.bincount(self._part[hit], weights=cells.weights[hit], minlength=k)
            estimate = np.where(member, (o - q * r) / p, 0.0)
            holding = np.clip(estimate, 0, r)  # plug-in true count per sub-table
            spread = holding * a * (1 - a) + (r - holding) * q * (1 - q)
            raw[i] = estimate.sum()
            variance[i] = np.where(member, spread / p**2, 0.0).sum()
            rows[i], published[i] = r.sum(), int(o.sum())
        estimate, low, high = self._interval(raw, variance, rows)
        return [
            Estimate(float(e), float(lo), float(hi), int(pub), int(n))
            for e, lo, hi, pub, n in zip(estimate, low, high, published, rows, strict=True)
        ]
