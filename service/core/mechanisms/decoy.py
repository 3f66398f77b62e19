"""Decoy groups: SPLU-Gen (seed 000 §3) = mechanism A′ (seed 001 §4), batch form.

Records are split, using only their random id and sensitive value, into hidden
*decoy groups* of γ records with γ distinct sensitive values. Each record then
publishes a value drawn uniformly from its group's γ values (p = q = 1/γ),
independently of its own value. The published count of a value s is therefore

    f′_s ~ Binomial(γ·f_s, 1/γ),  E f′_s = f_s,  Var f′_s = f_s·(γ−1)/γ,

accurate for large counts and noisy for small ones (SPLU). Swapping the values
of two members of a group leaves the output distribution unchanged, so every
record has γ−1 hidden neighbours (ℓ′-diverted zero privacy, seed 001 Thm. 1).

What the guarantee needs, and how this module keeps it:

- groups depend only on (random id, sensitive value) and the service key:
  public attributes are never read;
- within a group the draw is uniform and independent per record, via a keyed
  PRF of the record id, so a repeat reproduces it instead of drawing again;
- nothing about groups is released: ids and group ids stay inside, and the
  output is in a keyed random order;
- eligibility: no value may exceed 1/γ of the grouped rows. Excess records of
  such a value are *suppressed* (reported, never published) and N is trimmed to
  a multiple of γ (trimmed rows reported).

Cutting rule (SPEC §2.1). Groups are cut one after another. Each cut takes any
value whose backlog equals the remaining share R/γ (skipping it would break
eligibility), then fills up to γ values by successive sampling with
probability proportional to bucket size, from a keyed uniform stream; within a
bucket the record with the smallest random id goes first. Size-weighted
choice mixes partner values almost uniformly, which is what the transition
model of the reconstruction assumes. Anatomy's rule (always the γ largest
buckets, seed 000 §6) is selectable for comparison; it pairs large values with
large values and biases conjunctive estimates (seed notes 001 §10.8).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from service.core.prf import KeyedUniforms, ServiceKey, prf64
from service.core.table import Table

GROUPINGS = ("size-weighted", "anatomy")
# Rebuild the sampling table once the remaining rows fall below this share of
# its snapshot: keeps the thinning acceptance rate above it on average, at a
# cost of O(V) per rebuild and O(log N / log(1/0.9)) rebuilds.
_SNAPSHOT_REFRESH = 0.9


@dataclass
class DecoyRelease:
    """A batch publication and its accounting, which never leaves the trusted side."""

    published: Table
    suppressed: dict[str, dict[str, int]]
    suppressed_lines: np.ndarray
    trimmed_lines: np.ndarray
    gamma: int
    grouping: str
    # Positions (in the input table) of the rows that were grouped, ascending;
    # `groups[name]` holds indices into this array, one row per decoy group.
    grouped_rows: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int64))
    groups: dict[str, np.ndarray] = field(repr=False, default_factory=dict)


class DecoyGroups:
    """SPLU-Gen decoy-group randomization with group size γ.

    Parameters
    ----------
    gamma:
        Group size and number of distinct sensitive values per group, γ ≥ 2.
        Every record could have had any of γ values as far as the output can
        tell; small counts get relative noise of about √((γ−1)/(γ·f)). The
        papers recommend γ ≥ 5.
    grouping:
        ``"size-weighted"`` (default, SPEC §2.1) or ``"anatomy"`` (largest
        buckets first, seed 000 §6; for comparison only).

    References: Fu, Wang, Wong, Wang, Jiang, "Small sum privacy and large sum
    utility in data publishing", J. Biomed. Inform. 2014 (seed 000); arXiv
    1202.3253 (seed 001).
    """

    def __init__(self, gamma: int, grouping: str = "size-weighted") -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer):
            raise TypeError(f"gamma must be an integer, got {type(gamma).__name__}")
        if gamma < 2:
            raise ValueError(f"gamma must be at least 2 (a group needs a decoy), got {gamma}")
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
        self.gamma = int(gamma)
        self.grouping = grouping

    def __repr__(self) -> str:
        return f"DecoyGroups(gamma={self.gamma}, grouping={self.grouping!r})"

    def eligible_rows(
        self, ids: np.ndarray, sensitive: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Which rows can be grouped: (kept mask, suppressed rows per attribute, trimmed rows).

        Values above 1/γ of the kept rows are cut to that share, keeping their
        smallest random ids, until no attribute has such a value (cutting one
        attribute can push another over its share). Then the rows with the
        largest ids are trimmed to make N a multiple of γ; trimming cannot
        break eligibility because every count is already ≤ ⌊N/γ⌋.
        """
        rank = id_rank(ids)
        kept = np.ones(len(rank), dtype=bool)
        suppressed = {name: [] for name in sensitive}
        while True:
            share = int(kept.sum()) // self.gamma
            cut_any = False
            for name, values in sensitive.items():
                counts = np.bincount(values[kept], minlength=int(values.max(initial=0)) + 1)
                for value in np.flatnonzero(counts > share):
                    rows = np.flatnonzero(kept & (values == value))
                    excess = rows[np.argsort(rank[rows])][share:]
                    kept[excess] = False
                    suppressed[name].append(excess)
                    cut_any = True
            if not cut_any:
                break
        surplus = int(kept.sum()) % self.gamma
        candidates = np.flatnonzero(kept)
        trimmed = candidates[np.argsort(rank[candidates])[len(candidates) - surplus :]]
        kept[trimmed] = False
        suppressed_rows = {
            name: np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
            for name, parts in suppressed.items()
        }
        return kept, suppressed_rows, np.sort(trimmed)

    def group(
        self, ids: np.ndarray, values: np.ndarray, key: ServiceKey, purpose: str
    ) -> np.ndarray:
        """Decoy groups of an eligible set: an (N/γ, γ) array of row positions.

        Deterministic given (ids, values, key, purpose). Row g lists the members
        of the g-th group cut; their values are pairwise distinct.
        """
        n = len(values)
        counts = np.bincount(values, minlength=int(values.max(initial=0)) + 1)
        if n % self.gamma or counts.max(initial=0) * self.gamma > n:
            raise ValueError(
                "the rows are not eligible: N must be a multiple of γ and no value may "
                "exceed N/γ (use eligible_rows first)"
            )
        if self.grouping == "anatomy":
            cuts = _largest_first_cuts(counts.tolist(), self.gamma)
        else:
            # A cut takes about 14 uniforms; chunks sized to the table spare small tables
            # the cost of a 65,536-uniform keystream.
            uniforms = KeyedUniforms(
                key, f"decoy grouping:{purpose}", chunk=min(1 << 16, 4 * n + 64)
            )
            cuts = _size_weighted_cuts(counts.tolist(), self.gamma, uniforms)
        # The k-th group holding value v gets the record of v with the k-th smallest id.
        slots = cuts.ravel()
        by_id = id_order(ids)
        by_value_then_id = by_id[np.argsort(values[by_id], kind="stable")]
        members = np.empty(n, dtype=np.int64)
        members[np.argsort(slots, kind="stable")] = by_value_then_id
        return members.reshape(-1, self.gamma)

    def draws(self, ids: np.ndarray, key: ServiceKey, purpose: str) -> np.ndarray:
        """Each record's draw index into its group's sorted values: PRF(key, id) mod γ.

        Fixed by the id alone, so the stream can compute it when a record
        arrives and any retry publishes the same value.
        """
        return (prf64(key, f"decoy draw:{purpose}", ids) % np.uint64(self.gamma)).astype(np.int64)

    def randomize(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        ids: np.ndarray,
        key: ServiceKey,
        purpose: str,
    ) -> np.ndarray:
        """Published codes: each member draws uniformly from its group's values.

        The draw index is PRF(key, id) mod γ into the group's values in sorted
        order; its bias from uniform is below γ/2⁶⁴.
        """
        draws = self.draws(ids, key, purpose)
        group_values = np.sort(values[groups], axis=1)
        published = np.empty(len(values), dtype=values.dtype)
        published[groups] = np.take_along_axis(group_values, draws[groups], axis=1)
        return published

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> DecoyRelease:
        """Publish `table`: every sensitive attribute grouped and randomized independently."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        sensitive_names = [a.name for a in table.schema.sensitive]
        for name in sensitive_names:
            present = len(np.unique(table.codes[name]))
            if present < self.gamma:
                raise ValueError(
                    f"sensitive attribute {name!r} has {present} distinct values in the data; "
                    f"groups of γ={self.gamma} need at least {self.gamma}"
                )
        kept, suppressed_rows, trimmed = self.eligible_rows(
            ids, {name: table.codes[name] for name in sensitive_names}
        )
        grouped = table.take(kept)
        grouped_ids = ids[kept]
        codes = dict(grouped.codes)
        groups = {}
        for name in sensitive_names:
            groups[name] = self.group(grouped_ids, codes[name], key, name)
            codes[name] = self.randomize(groups[name], codes[name], grouped_ids, key, name)
        order = np.argsort(prf64(key, "publication order", grouped_ids))
        published = Table(
            table.schema, {k: v[order] for k, v in codes.items()}, grouped.lines[order]
        )
        suppressed = {}
        for name, rows in suppressed_rows.items():
            domain = table.schema[name].domain
            counts = np.bincount(table.codes[name][rows], minlength=len(domain))
            suppressed[name] = {domain[v]: int(c) for v, c in enumerate(counts) if c}
        all_suppressed = np.concatenate(list(suppressed_rows.values()))
        return DecoyRelease(
            published=published,
            suppressed=suppressed,
            suppressed_lines=np.sort(table.lines[all_suppressed]),
            trimmed_lines=table.lines[trimmed],
            gamma=self.gamma,
            grouping=self.grouping,
            grouped_rows=np.flatnonzero(kept),
            groups=groups,
        )


def id_order(ids: np.ndarray) -> np.ndarray:
    """Row positions sorted by 128-bit id (rows of (high, low) words), ascending."""
    order = np.argsort(ids[:, 0])
    high = ids[order, 0]
    if len(high) > 1 and (high[1:] == high[:-1]).any():
        # Equal high words (probability about N²/2⁶⁵): let the low word decide.
        order = np.lexsort((ids[:, 1], ids[:, 0]))
    return order


def id_rank(ids: np.ndarray) -> np.ndarray:
    """Rank of each id among `ids`, 0 for the smallest."""
    order = id_order(ids)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank


def _size_weighted_cuts(counts: list[int], gamma: int, uniforms: KeyedUniforms) -> np.ndarray:
    """Values of each group, cut by size-weighted keyed choice (SPEC §2.1).

    Successive sampling proportional to current bucket size is done by
    thinning: draw a value from a snapshot of the sizes (binary search over
    cumulative sums, O(log V)), accept it with probability current/snapshot
    size, reject values already in the group. Rejection is exact conditioning,
    so each accepted value has probability proportional to its current size
    among the values still allowed. The snapshot is rebuilt in O(V) whenever
    the rows fall below 9/10 of it, O(log N) times in all.

    A value is forced once its bucket holds R/γ rows. Until the first such
    cut only an upper bound on the largest bucket is kept; from then on an
    index of buckets by size answers "which values are at R/γ?" in O(1). Each
    cut is O(γ log V) amortized, O(N log V) overall.
    """
    count = list(counts)
    remaining = sum(count)
    largest_bound = max(count, default=0)
    at_size: defaultdict[int, set[int]] | None = None
    cuts = []
    stream = uniforms.take()
    last = len(stream) - 1
    position = 0
    refresh_below = -1
    while remaining:
        if refresh_below < 0 or remaining < refresh_below:
            snapshot = list(count)
            cumulative = list(accumulate(snapshot))
            total = remaining
            refresh_below = int(remaining * _SNAPSHOT_REFRESH)
        share = remaining // gamma
        chosen = []
        if at_size is not None:
            forced = at_size.get(share)
            if forced:
                chosen = sorted(forced)
        elif share <= largest_bound:
            largest_bound = max(count)
            if share == largest_bound:
                at_size = defaultdict(set)
                for value, size in enumerate(count):
                    if size:
                        at_size[size].add(value)
                chosen = sorted(at_size[share])
        missing = gamma - len(chosen)
        while missing:
            if position >= last:
                stream = uniforms.take()
                last = len(stream) - 1
                position = 0
            value = bisect_right(cumulative, stream[position] * total)
            if stream[position + 1] * snapshot[value] < count[value] and value not in chosen:
                chosen.append(value)
                missing -= 1
            position += 2
        if at_size is None:
            for value in chosen:
                count[value] -= 1
        else:
            for value in chosen:
                size = count[value]
                at_size[size].discard(value)
                count[value] = size - 1
                if size > 1:
                    at_size[size - 1].add(value)
        remaining -= gamma
        cuts.append(chosen)
    return np.asarray(cuts, dtype=np.int64).reshape(-1, gamma)


def _largest_first_cuts(counts: list[int], gamma: int) -> np.ndarray:
    """Anatomy's rule: each group takes the γ largest buckets (ties: smaller code)."""
    heap = [(-size, value) for value, size in enumerate(counts) if size]
    heapq.heapify(heap)
    cuts = []
    while heap:
        taken = [heapq.heappop(heap) for _ in range(gamma)]
        cuts.append([value for _, value in taken])
        for negative_size, value in taken:
            if negative_size < -1:
                heapq.heappush(heap, (negative_size + 1, value))
    return np.asarray(cuts, dtype=np.int64).reshape(-1, gamma)
