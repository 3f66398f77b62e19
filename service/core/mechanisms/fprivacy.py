"""F′-privacy bucketization (seed 003): a threshold per sensitive value, buckets of mixed sizes.

Every sensitive value x_i has its own threshold f′_i ∈ (0, 1]. Records are grouped
into buckets and published Anatomy-style as two tables, QIT(public values, BID) and
ST(BID, value, count). A record in bucket g has value x_i with probability
|g, x_i| / |g| as far as the adversary can tell, so F′-privacy (Definition 2) is

    |g, x_i| ≤ ⌊f′_i·|g|⌋   for every bucket g and every value x_i.

Default thresholds are the paper's f′_i = min{1, θ·f_i + β} with θ = 8, β = 0.02
(§7), f_i the value's share of the input, frozen for the whole publication.
Explicit thresholds override it per value (f′ = 1: not sensitive; small: highly
sensitive). Utility is Loss = Σ_g (|g| − 1)², MSE = Loss / (N − 1) (Definition 3).

Choosing the buckets, with o_i the count of x_i and N = Σ o_i:

- one size (Lemma 2): b buckets of size S can hold the records iff N = S·b and
  o_i ≤ ⌊f′_i·S⌋·b for all i;
- two sizes (Theorem 3): with a_ij = min{⌊f′_i·S_j⌋·b_j, o_i}, valid iff
  PC a_i1 + a_i2 ≥ o_i, FC Σ_i a_ij ≥ S_j·b_j (j = 1, 2), CC N = S_1·b_1 + S_2·b_2;
- optimal two sizes (Algorithm 1): for M ≤ S_1 < S_2 ≤ M′ the feasible (b_1, b_2)
  form an arithmetic list Γ whose loss rises along it (Lemmas 4, 5), so the first
  valid pair is the best for (S_1, S_2). It is found with the loss cut-off of
  Lemma 6, PC as an interval in closed form (PC(x_i) ⇔ ⌊f′_i S_1⌋b_1 + ⌊f′_i S_2⌋b_2
  ≥ o_i, linear along Γ) and one binary search on FC(S_1), which is monotone
  (Lemma 7). FC(S_2) is anti-monotone, so checking it at that one pair suffices;
- several sizes (Algorithm 2): split each part by its optimal two-size setting
  (RecordPartition, §4.3) while that lowers its loss; counts are recounted in each
  part, thresholds stay global;
- inside a part, records sorted by value are dealt to its buckets cyclically
  (round-robin assignment, §4.1).

Exact arithmetic: thresholds are Fractions and every floor is taken on integers.
A float is converted through its shortest decimal form (0.29 → 29/100), because
in binary floating point 0.29·100 = 28.999… floors to 28 and rejects valid settings.

Which record of a value goes to which bucket, which records are suppressed or
trimmed, the QIT order and the fake values all derive from the service key and
the record ids, so a repeat reproduces the publication. ST is published as counts
per (BID, value), never row-aligned with QIT (that would publish the linkage).

Choices the paper leaves open (ours):

- suppression: a value whose count exceeds φ_i·N, φ_i = max_{S ≤ M′} ⌊f′_i S⌋/S,
  cannot be bucketized with sizes ≤ M′ (Lemma 1 with bounded sizes), so its
  records with the largest keyed order are suppressed until none does; if still
  no setting fits (CC or FC fail, e.g. on small tables), the records with the
  largest keyed order are trimmed one by one. Both are reported, never published;
- the multi-size recursion starts from the optimal two-size setting (which
  includes every one-size setting) and collects the parts it stops at;
- RecordPartition moves records one value at a time in round-robin passes, which
  reproduces Example 3;
- fake values (§6): σ values per bucket drawn uniformly (keyed) among the values
  present in the data and absent from the bucket. The paper defines them only for
  equal thresholds, where every bucket holds distinct values; we allow any
  thresholds whose buckets turn out distinct, and refuse otherwise.

Estimation ("P ∧ SA = s", Anatomy's estimator, seed notes 003 §3): a bucket's QIT
and ST rows are matched uniformly, so

    est = Σ_g |P ∩ g| · c_g(s) / |ST_g|,

c_g(s) the ST count of s in g and |ST_g| = |g| + σ (with σ = 0 this is Anatomy's
|P ∩ g|·c_g(s)/|g|; scaling by |g|/(|g| + σ) for fake values is ours).

Reference: Ke Wang, Peng Wang, Ada Waichee Fu, Raymond Chi-Wing Wong, "Inferential
or Differential: Privacy Laws Dictate" (seed 003).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

import numpy as np

from service.core.prf import ServiceKey, keystream64, prf64, to_unit_interval
from service.core.reconstruct import Estimate, Query, QueryError
from service.core.schema import Attribute, SchemaError
from service.core.table import Table

ThresholdLike = Fraction | Decimal | int | float | str
METHODS = ("multi", "two")
Part = tuple[int, int]


def as_fraction(x: ThresholdLike | np.integer | np.floating, name: str = "value") -> Fraction:
    """`x` as an exact rational.

    A float goes through its shortest decimal form (its repr), so 0.29 is 29/100,
    the number that was written, not the double 0.28999999999999998. Strings may
    be decimals ("0.29", "2e-2") or ratios ("29/100").
    """
    if isinstance(x, bool):
        raise TypeError(f"{name} must be a number, got bool")
    try:
        if isinstance(x, float | np.floating):
            return Fraction(repr(float(x)))
        if isinstance(x, np.integer):
            return Fraction(int(x))
        if isinstance(x, Fraction | int | Decimal):
            return Fraction(x)
        if isinstance(x, str):
            return Fraction(x.strip())
    except (ValueError, OverflowError, ZeroDivisionError):
        raise ValueError(f"{name} must be a finite number, got {x!r}") from None
    raise TypeError(f"{name} must be a number or a decimal string, got {type(x).__name__}")


def check_threshold(x: ThresholdLike, name: str = "threshold") -> Fraction:
    """A threshold f′ as a Fraction, checked to lie in (0, 1] (Definition 2)."""
    f = as_fraction(x, name)
    if not 0 < f <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {f}")
    return f


def frequency_thresholds(
    counts: Sequence[int], theta: ThresholdLike = 8, beta: ThresholdLike = "0.02"
) -> list[Fraction]:
    """f′_i = min{1, θ·o_i/N + β} for every value, exactly (paper §7: θ = 8, β = 0.02)."""
    theta_, beta_ = _check_formula(theta, beta)
    total = sum(int(o) for o in counts)
    if total <= 0:
        raise ValueError("thresholds from frequencies need at least one record")
    return [min(Fraction(1), theta_ * Fraction(int(o), total) + beta_) for o in counts]


def floor_share(threshold: Fraction, size: int) -> int:
    """⌊f′·S⌋: the most records of one value a bucket of size S may hold."""
    return threshold.numerator * size // threshold.denominator


def min_bucket_size(threshold: Fraction) -> int:
    """⌈1/f′⌉: the smallest bucket that may hold a record of a value with threshold f′."""
    return -(-threshold.denominator // threshold.numerator)


@dataclass(frozen=True)
class BucketSetting:
    """⟨B_1(S_1, b_1), …, B_q(S_q, b_q)⟩: b_j buckets of size S_j.

    Stored with sizes ascending, equal sizes merged and empty parts dropped.
    """

    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        merged: dict[int, int] = {}
        for size, buckets in self.parts:
            if size < 1 or buckets < 0:
                raise ValueError(f"a part needs size ≥ 1 and count ≥ 0, got ({size}, {buckets})")
            merged[int(size)] = merged.get(int(size), 0) + int(buckets)
        normal = tuple((s, b) for s, b in sorted(merged.items()) if b)
        object.__setattr__(self, "parts", normal)

    @property
    def rows(self) -> int:
        return sum(s * b for s, b in self.parts)

    @property
    def loss(self) -> int:
        """Σ_j b_j·(S_j − 1)² (Eq. 2)."""
        return sum(b * (s - 1) ** 2 for s, b in self.parts)

    def __str__(self) -> str:
        return "⟨" + ", ".join(f"B({s}, {b})" for s, b in self.parts) + "⟩"


@dataclass(frozen=True)
class FeasiblePairs:
    """Γ(S_1, S_2): all (b_1, b_2) ≥ 0 with S_1·b_1 + S_2·b_2 = N, by descending b_1.

    The t-th pair is (b_1 − t·Δ_1, b_2 + t·Δ_2), t = 0..last (Lemma 4), and its loss
    is first_loss + t·step_loss with step_loss > 0 (Lemma 5), so the list is
    indexed, never stored.
    """

    small: int
    large: int
    b1: int
    b2: int
    step1: int
    step2: int
    last: int

    @classmethod
    def of(cls, rows: int, small: int, large: int) -> FeasiblePairs | None:
        """Γ for N = rows, or None when no pair is feasible."""
        if not 1 <= small < large:
            raise ValueError(f"sizes must satisfy 1 ≤ S_1 < S_2, got {small}, {large}")
        g = math.gcd(small, large)
        if rows < 0 or rows % g:
            return None
        step1, step2 = large // g, small // g
        # Eq. 7, the smallest b_2: S_2·b_2 ≡ N (mod S_1), i.e. b_2 ≡ (N/g)·(S_2/g)⁻¹ mod S_1/g.
        b2 = (rows // g) * pow(step1, -1, step2) % step2 if step2 > 1 else 0
        if large * b2 > rows:
            return None
        b1 = (rows - large * b2) // small
        return cls(small, large, b1, b2, step1, step2, b1 // step1)

    def pair(self, t: int) -> tuple[int, int]:
        return self.b1 - t * self.step1, self.b2 + t * self.step2

    @property
    def first_loss(self) -> int:
        return self.b1 * (self.small - 1) ** 2 + self.b2 * (self.large - 1) ** 2

    @property
    def step_loss(self) -> int:
        return self.step2 * (self.large - 1) ** 2 - self.step1 * (self.small - 1) ** 2


@dataclass(frozen=True, eq=False)
class Leaf:
    """`buckets` buckets of one `size`, and how many records of each value they hold."""

    size: int
    buckets: int
    counts: np.ndarray


class _Planner:
    """The bucket-setting searches for fixed thresholds and size range.

    caps[S, i] = ⌊f′_i·S⌋ is computed once, exactly, for S = 0..M′; everything
    after is integer arithmetic on numpy arrays.
    """

    def __init__(self, thresholds: Sequence[Fraction], max_size: int, min_size: int) -> None:
        self.max_size = max_size
        self.min_size = min_size
        self.caps = np.array(
            [[floor_share(f, s) for f in thresholds] for s in range(max_size + 1)],
            dtype=np.int64,
        ).reshape(max_size + 1, len(thresholds))
        self.least = np.array([min_bucket_size(f) for f in thresholds], dtype=np.int64)

    def shares(self) -> list[Fraction]:
        """φ_i = max over allowed sizes S of ⌊f′_i S⌋/S: no bucketization with these
        sizes gives x_i more than φ_i·N records (each bucket holds ≤ φ_i·|g| of them)."""
        sizes = range(self.min_size, self.max_size + 1)
        return [
            max(Fraction(int(self.caps[s, i]), s) for s in sizes) for i in range(self.caps.shape[1])
        ]

    def two_size(self, counts: np.ndarray) -> BucketSetting | None:
        """The valid setting of at most two sizes with the least loss (Algorithm 1)."""
        o = counts
        n = int(o.sum())
        if n == 0:
            return BucketSetting(())
        lowest = max(self.min_size, int(self.least[o > 0].min()))
        best: tuple[Part, ...] | None = None
        best_loss = -1
        # One-size settings first: they seed the loss cut-off. Loss per record (S−1)²/S
        # rises with S, so the smallest valid size is the best of them.
        for s in range(lowest, self.max_size + 1):
            if n % s == 0 and (o <= self.caps[s] * (n // s)).all():
                best, best_loss = ((s, n // s),), (n // s) * (s - 1) ** 2
                break
        for s1 in range(lowest, self.max_size):
            # Every bucket from here on has size ≥ S_1, costing ≥ (S_1−1)²/S_1 per record.
            if best is not None and n * (s1 - 1) ** 2 >= best_loss * s1:
                break
            c1 = self.caps[s1]
            for s2 in range(s1 + 1, self.max_size + 1):
                pairs = FeasiblePairs.of(n, s1, s2)
                if pairs is None:
                    continue
                last = pairs.last
                if best is not None:
                    # Lemma 6 with a strict cut-off: only pairs that beat the best so far.
                    last = min(last, (best_loss - pairs.first_loss - 1) // pairs.step_loss)
                t = self._first_valid(o, c1, self.caps[s2], pairs, last)
                if t is not None:
                    b1, b2 = pairs.pair(t)
                    best = ((s1, b1), (s2, b2))
                    best_loss = pairs.first_loss + t * pairs.step_loss
        return None if best is None else BucketSetting(best)

    @staticmethod
    def _first_valid(
        o: np.ndarray, c1: np.ndarray, c2: np.ndarray, pairs: FeasiblePairs, last: int
    ) -> int | None:
        """Index of the first valid pair among Γ[0..last] (Theorem 4), or None."""
        if last < 0:
            return None
        # PC(x_i): slack + t·slope ≥ 0, since min{a, o} + min{c, o} ≥ o ⇔ a + c ≥ o for a, c ≥ 0.
        slack = c1 * pairs.b1 + c2 * pairs.b2 - o
        slope = c2 * pairs.step2 - c1 * pairs.step1
        if (slack[slope == 0] < 0).any():
            return None
        rising, falling = slope > 0, slope < 0
        lo = max(0, int((-(slack[rising] // slope[rising])).max(initial=0)))
        hi = min(last, int((slack[falling] // -slope[falling]).min(initial=last)))
        if lo > hi:
            return None

        def fills_small(t: int) -> bool:
            b1 = pairs.b1 - t * pairs.step1
            return int(np.minimum(c1 * b1, o).sum()) >= pairs.small * b1

        # FC(S_1) is monotone along Γ (Lemma 7): binary search for where it starts.
        if not fills_small(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if fills_small(mid):
                hi = mid
            else:
                lo = mid + 1
        # FC(S_2) is anti-monotone: failing here, it fails at every later pair, and every
        # earlier pair fails FC(S_1).
        b2 = pairs.b2 + lo * pairs.step2
        if int(np.minimum(c2 * b2, o).sum()) < pairs.large * b2:
            return None
        return lo

    def partition(
        self, counts: np.ndarray, first: Part, second: Part
    ) -> tuple[np.ndarray, np.ndarray]:
        """RecordPartition (§4.3): counts for T_1 and T_2 of a valid two-size setting."""
        (s1, b1), (s2, b2) = first, second
        a1 = np.minimum(self.caps[s1] * b1, counts)
        a2 = np.minimum(self.caps[s2] * b2, counts)
        excess = int(a1.sum()) - s1 * b1
        room = a2 - (counts - a1)
        # Move records one value at a time, in passes over the values, until T_1 fits:
        # after p passes value i has moved min(room_i, p).
        lo, hi = 0, int(room.max(initial=0))
        while lo < hi:
            mid = (lo + hi) // 2
            if int(np.minimum(room, mid).sum()) >= excess:
                hi = mid
            else:
                lo = mid + 1
        moved = np.minimum(room, max(lo - 1, 0))
        if lo:
            moved[np.flatnonzero(room >= lo)[: excess - int(moved.sum())]] += 1
        return a1 - moved, counts - a1 + moved

    def leaves_of(self, counts: np.ndarray, setting: BucketSetting) -> list[Leaf]:
        if len(setting.parts) < 2:
            return [Leaf(s, b, counts) for s, b in setting.parts]
        first, second = setting.parts
        n1, n2 = self.partition(counts, first, second)
        return [Leaf(*first, n1), Leaf(*second, n2)]

    def multi_size(self, counts: np.ndarray) -> list[Leaf] | None:
        """Algorithm 2: split parts by their optimal two-size setting while the loss drops."""
        top = self.two_size(counts)
        if top is None:
            return None
        leaves = []
        work = [(counts, top)]
        while work:
            part, setting = work.pop()
            if len(setting.parts) < 2:
                leaves.extend(self.leaves_of(part, setting))
                continue
            for leaf in self.leaves_of(part, setting):
                current = BucketSetting(((leaf.size, leaf.buckets),))
                better = self.two_size(leaf.counts)
                # The part's own buckets are valid for it, so `better` exists.
                assert better is not None
                if better.loss < current.loss:
                    work.append((leaf.counts, better))
                else:
                    leaves.append(leaf)
        return leaves


def _checked(
    counts: Sequence[int], thresholds: Sequence[ThresholdLike]
) -> tuple[np.ndarray, list[Fraction]]:
    o = np.asarray(counts, dtype=np.int64)
    if o.ndim != 1 or (o < 0).any():
        raise ValueError("counts must be a list of non-negative integers")
    if len(thresholds) != len(o):
        raise ValueError(f"{len(thresholds)} thresholds for {len(o)} counts")
    return o, [check_threshold(f, f"threshold {i}") for i, f in enumerate(thresholds)]


def _check_sizes(max_size: int, min_size: int) -> None:
    for name, size in (("max_size", max_size), ("min_size", min_size)):
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(f"{name} must be an integer, got {type(size).__name__}")
    if not 1 <= min_size <= max_size:
        raise ValueError(f"bucket sizes need 1 ≤ min_size ≤ max_size, got {min_size}, {max_size}")


def _check_formula(theta: ThresholdLike, beta: ThresholdLike) -> tuple[Fraction, Fraction]:
    theta_, beta_ = as_fraction(theta, "theta"), as_fraction(beta, "beta")
    if theta_ <= 0:
        raise ValueError(f"theta must be positive, got {theta_}")
    if not 0 <= beta_ <= 1:
        raise ValueError(f"beta must lie in [0, 1], got {beta_}")
    return theta_, beta_


def valid_one_size(
    counts: Sequence[int], thresholds: Sequence[ThresholdLike], size: int, buckets: int
) -> bool:
    """Lemma 2 (4): b buckets of size S hold the records iff N = S·b and o_i ≤ ⌊f′_i S⌋·b."""
    o, f = _checked(counts, thresholds)
    if size * buckets != int(o.sum()):
        return False
    return all(int(oi) <= floor_share(fi, size) * buckets for oi, fi in zip(o, f, strict=True))


def valid_two_size(
    counts: Sequence[int], thresholds: Sequence[ThresholdLike], first: Part, second: Part
) -> bool:
    """Theorem 3: PC, FC and CC for ⟨B_1(S_1, b_1), B_2(S_2, b_2)⟩, literally."""
    o, f = _checked(counts, thresholds)
    (s1, b1), (s2, b2) = first, second
    if s1 * b1 + s2 * b2 != int(o.sum()):
        return False
    a1 = [min(floor_share(fi, s1) * b1, int(oi)) for oi, fi in zip(o, f, strict=True)]
    a2 = [min(floor_share(fi, s2) * b2, int(oi)) for oi, fi in zip(o, f, strict=True)]
    privacy = all(x + y >= int(oi) for x, y, oi in zip(a1, a2, o, strict=True))
    return privacy and sum(a1) >= s1 * b1 and sum(a2) >= s2 * b2


def two_size_search(
    counts: Sequence[int],
    thresholds: Sequence[ThresholdLike],
    max_size: int,
    min_size: int = 1,
) -> BucketSetting | None:
    """The optimal setting with at most two sizes in [M, M′] (Algorithm 1), or None."""
    _check_sizes(max_size, min_size)
    o, f = _checked(counts, thresholds)
    return _Planner(f, max_size, min_size).two_size(o)


def record_partition(
    counts: Sequence[int], thresholds: Sequence[ThresholdLike], first: Part, second: Part
) -> tuple[np.ndarray, np.ndarray]:
    """Counts of T_1 and T_2 (§4.3) for a two-size setting that passes Theorem 3."""
    o, f = _checked(counts, thresholds)
    if not valid_two_size(o, f, first, second):
        raise ValueError(f"{BucketSetting((first, second))} is not valid for these counts")
    n1, n2 = _Planner(f, max(first[0], second[0]), 1).partition(o, first, second)
    return n1, n2


def multi_size_search(
    counts: Sequence[int],
    thresholds: Sequence[ThresholdLike],
    max_size: int,
    min_size: int = 1,
) -> list[Leaf] | None:
    """Algorithm 2's parts: one-size leaves whose counts add up to `counts`, or None."""
    _check_sizes(max_size, min_size)
    o, f = _checked(counts, thresholds)
    return _Planner(f, max_size, min_size).multi_size(o)


def round_robin(counts: Sequence[int], leaves: Sequence[Leaf]) -> np.ndarray:
    """Bucket of every record, records listed by value, then by position within the value.

    Value i's records go to the leaves in order, leaf ℓ taking the next
    leaves[ℓ].counts[i] of them; inside a leaf, its records sorted by value are dealt
    to its buckets cyclically (RRA, §4.1), so a bucket gets ⌊o_i/b⌋ or ⌈o_i/b⌉ of
    each value. Buckets are numbered leaf by leaf.
    """
    o = np.asarray(counts, dtype=np.int64)
    if not leaves:
        if o.any():
            raise ValueError("records but no buckets")
        return np.empty(0, dtype=np.int64)
    per_leaf = np.array([leaf.counts for leaf in leaves], dtype=np.int64).reshape(len(leaves), -1)
    sizes = np.array([leaf.size for leaf in leaves], dtype=np.int64)
    buckets = np.array([leaf.buckets for leaf in leaves], dtype=np.int64)
    if not np.array_equal(per_leaf.sum(axis=0), o) or not np.array_equal(
        per_leaf.sum(axis=1), sizes * buckets
    ):
        raise ValueError("the leaves do not split the counts into full buckets")
    value_start = np.cumsum(o) - o
    taken_before = np.cumsum(per_leaf, axis=0) - per_leaf
    # Runs of (leaf, value) in leaf-major order, as index ranges into the value-major list.
    run_start = (value_start[None, :] + taken_before).ravel()
    run_length = per_leaf.ravel()
    run_offset = np.cumsum(run_length) - run_length
    n = int(o.sum())
    record = np.repeat(run_start - run_offset, run_length) + np.arange(n)
    leaf_rows = sizes * buckets
    leaf_of = np.repeat(np.arange(len(leaves)), leaf_rows)
    within = np.arange(n) - np.repeat(np.cumsum(leaf_rows) - leaf_rows, leaf_rows)
    first_bucket = np.cumsum(buckets) - buckets
    bucket = np.empty(n, dtype=np.int64)
    bucket[record] = first_bucket[leaf_of] + within % buckets[leaf_of]
    return bucket


@dataclass
class BucketPublication:
    """What is published: QIT(public values, BID) and ST(BID, value, count), seed 003 §3.1.

    QIT rows are in keyed random order. ST has one row per (bucket, value) with its
    count, sorted by bucket then value code, plus `fake_values` fake values per
    bucket (count 1 each) when requested.
    """

    public: tuple[Attribute, ...]
    qit: dict[str, np.ndarray]
    bucket: np.ndarray
    sensitive: Attribute
    st_bucket: np.ndarray
    st_value: np.ndarray
    st_count: np.ndarray
    fake_values: int = 0

    @property
    def buckets(self) -> int:
        return int(self.bucket.max(initial=-1)) + 1

    @property
    def sizes(self) -> np.ndarray:
        """|g| for every bucket id: its number of QIT rows (fake values excluded)."""
        return np.bincount(self.bucket, minlength=self.buckets)


@dataclass
class FPrivacyRelease:
    """A batch publication and its accounting, which never leaves the trusted side."""

    published: BucketPublication
    setting: BucketSetting
    thresholds: dict[str, Fraction]
    suppressed: dict[str, int]
    suppressed_lines: np.ndarray
    trimmed_lines: np.ndarray
    # Source line of every QIT row, in QIT order.
    lines: np.ndarray

    @property
    def loss(self) -> int:
        """Σ_g (|g| − 1)² over the published buckets (Eq. 2)."""
        return self.setting.loss

    @property
    def mse(self) -> float:
        """Loss / (N − 1) (Eq. 1); 0 for fewer than two published rows."""
        n = self.setting.rows
        return self.loss / (n - 1) if n > 1 else 0.0


class FPrivacyBucketization:
    """F′-privacy bucketization with a threshold per sensitive value.

    Parameters
    ----------
    theta, beta:
        Thresholds f′_i = min{1, θ·f_i + β} for values without an explicit one
        (paper §7: θ = 8, β = 0.02; θ ∈ {2, …, 32} in its experiments). Values with
        f_i ≥ (1 − β)/θ get f′ = 1 and are not protected; raise `min_size` to keep
        such records out of singleton buckets.
    thresholds:
        Explicit f′ per sensitive label, in (0, 1], overriding the formula.
        Floats are read through their shortest decimal form; strings and Fractions
        are exact.
    max_size:
        M′, the largest bucket (paper: 50). A value with ⌈1/f′⌉ > M′ cannot be
        published and is suppressed.
    min_size:
        The smallest bucket allowed besides ⌈1/f′⌉ (paper: none, i.e. 1).
    method:
        ``"multi"`` (Algorithm 2, default) or ``"two"`` (optimal two-size, Algorithm 1).
    fake_values:
        σ fake sensitive values added to each bucket's ST against corruption and
        negative-association attacks (§6); needs buckets with distinct values.
    """

    def __init__(
        self,
        theta: ThresholdLike = 8,
        beta: ThresholdLike = "0.02",
        thresholds: Mapping[str, ThresholdLike] | None = None,
        max_size: int = 50,
        min_size: int = 1,
        method: str = "multi",
        fake_values: int = 0,
    ) -> None:
        self.theta, self.beta = _check_formula(theta, beta)
        self.overrides = {
            str(label): check_threshold(f, f"threshold of {label!r}")
            for label, f in (thresholds or {}).items()
        }
        _check_sizes(max_size, min_size)
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if isinstance(fake_values, bool) or not isinstance(fake_values, int | np.integer):
            raise TypeError(f"fake_values must be an integer, got {type(fake_values).__name__}")
        if fake_values < 0:
            raise ValueError(f"fake_values must be ≥ 0, got {fake_values}")
        self.max_size = int(max_size)
        self.min_size = int(min_size)
        self.method = method
        self.fake_values = int(fake_values)

    def __repr__(self) -> str:
        return (
            f"FPrivacyBucketization(theta={self.theta}, beta={self.beta}, "
            f"{len(self.overrides)} explicit thresholds, max_size={self.max_size}, "
            f"min_size={self.min_size}, method={self.method!r}, fake_values={self.fake_values})"
        )

    def sensitive_attribute(self, table: Table) -> Attribute:
        sensitive = table.schema.sensitive
        if len(sensitive) != 1:
            raise SchemaError(
                "F′-privacy bucketizes on one sensitive attribute (seed 003 §3.1); "
                f"the schema has {len(sensitive)}"
            )
        unknown = sorted(set(self.overrides) - set(sensitive[0].domain))
        if unknown:
            raise SchemaError(
                f"a threshold is given for {unknown[0]!r}, which is not a value of "
                f"{sensitive[0].name!r}"
            )
        return sensitive[0]

    def thresholds_for(self, table: Table) -> dict[str, Fraction]:
        """f′ of every sensitive value present in `table`, by label."""
        attribute = self.sensitive_attribute(table)
        counts = np.bincount(table.codes[attribute.name], minlength=attribute.size)
        present = np.flatnonzero(counts)
        if not len(present):
            return {}
        formula = frequency_thresholds(counts[present].tolist(), self.theta, self.beta)
        labels = [attribute.domain[v] for v in present]
        return {
            label: self.overrides.get(label, f) for label, f in zip(labels, formula, strict=True)
        }

    def _plan(self, planner: _Planner, counts: np.ndarray) -> list[Leaf] | None:
        """The parts the configured method chooses for `counts`, or None if none is valid."""
        if self.method == "multi":
            return planner.multi_size(counts)
        setting = planner.two_size(counts)
        return None if setting is None else planner.leaves_of(counts, setting)

    def publish(self, table: Table, ids: np.ndarray, key: ServiceKey) -> FPrivacyRelease:
        """Bucketize `table` so that every bucket meets every f′_i, and publish QIT and ST."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        attribute = self.sensitive_attribute(table)
        name = attribute.name
        threshold_of = self.thresholds_for(table)
        present = np.array([attribute.domain.index(label) for label in threshold_of], np.int64)
        thresholds = list(threshold_of.values())
        codes = table.codes[name].astype(np.int64)
        local = np.searchsorted(present, codes)
        # Rows by value, then keyed order: a value's first k rows are the ones kept, and
        # which rows those are (and which buckets they reach) is random but reproducible.
        keyed = prf64(key, f"fprivacy order:{name}", ids)
        order = np.lexsort((keyed, local))
        counts = np.bincount(local, minlength=len(present)).astype(np.int64)
        start = np.cumsum(counts) - counts
        kept, suppressed, trimmed = counts.copy(), [], []
        planner = _Planner(thresholds, self.max_size, self.min_size)
        shares = planner.shares()
        while True:
            suppressed.extend(_cut_to_shares(kept, shares, start, order))
            leaves = self._plan(planner, kept)
            if leaves is not None:
                break
            # No setting fits although no value is over its share (CC or FC fail, as on
            # small tables): give up the kept row last in keyed order, and retry.
            tails = np.flatnonzero(kept)
            last_rows = order[start[tails] + kept[tails] - 1]
            value = tails[np.argmax(keyed[last_rows])]
            kept[value] -= 1
            trimmed.append(order[start[value] + kept[value] : start[value] + kept[value] + 1])
        # Rows of one value are interchangeable for validity, so any leaf order works;
        # by size, bucket ids come out grouped by size.
        leaves = sorted(leaves, key=lambda leaf: leaf.size)
        position = np.arange(len(order)) - np.repeat(start, counts)
        chosen = order[position < np.repeat(kept, counts)]
        bucket = np.empty(len(table), dtype=np.int64)
        bucket[chosen] = round_robin(kept, leaves)

        rows = chosen[np.argsort(prf64(key, f"fprivacy publication:{name}", ids[chosen]))]
        st_bucket, st_value, st_count = _sensitive_table(bucket[rows], codes[rows], attribute.size)
        if self.fake_values:
            st_bucket, st_value, st_count = self._with_fakes(
                st_bucket, st_value, st_count, present[kept > 0], key, name
            )
        published = BucketPublication(
            public=tuple(table.schema.public),
            qit={a.name: table.codes[a.name][rows] for a in table.schema.public},
            bucket=bucket[rows],
            sensitive=attribute,
            st_bucket=st_bucket,
            st_value=st_value,
            st_count=st_count,
            fake_values=self.fake_values,
        )
        suppressed_rows = np.concatenate([np.empty(0, np.int64), *suppressed])
        per_value = np.bincount(codes[suppressed_rows], minlength=attribute.size)
        return FPrivacyRelease(
            published=published,
            setting=BucketSetting(tuple((leaf.size, leaf.buckets) for leaf in leaves)),
            thresholds=threshold_of,
            suppressed={attribute.domain[v]: int(c) for v, c in enumerate(per_value) if c},
            suppressed_lines=np.sort(table.lines[suppressed_rows]),
            trimmed_lines=np.sort(table.lines[np.concatenate([np.empty(0, np.int64), *trimmed])]),
            lines=table.lines[rows],
        )

    def _with_fakes(
        self,
        st_bucket: np.ndarray,
        st_value: np.ndarray,
        st_count: np.ndarray,
        shown: np.ndarray,
        key: ServiceKey,
        name: str,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ST with σ fake values per bucket, each distinct from the bucket's values (§6)."""
        sigma = self.fake_values
        if (st_count > 1).any():
            raise ValueError(
                "fake values need every bucket to hold distinct sensitive values (seed 003 §6), "
                "but these thresholds let a bucket repeat one: use one threshold f′ for all "
                "values and max_size < 2/f′"
            )
        buckets = int(st_bucket.max(initial=-1)) + 1
        sizes = np.bincount(st_bucket, minlength=buckets)
        if buckets and int(sizes.max()) + sigma > len(shown):
            raise ValueError(
                f"{sigma} fake values in a bucket of {int(sizes.max())} need "
                f"{int(sizes.max()) + sigma} distinct values; the data has {len(shown)}"
            )
        draws = to_unit_interval(keystream64(key, f"fprivacy fakes:{name}", buckets * len(shown)))
        draws = draws.reshape(buckets, len(shown))
        # A real value sorts after every uniform draw, so it is never picked as a fake.
        draws[st_bucket, np.searchsorted(shown, st_value)] = 2.0
        fakes = shown[np.argsort(draws, axis=1)[:, :sigma]]
        all_bucket = np.concatenate([st_bucket, np.repeat(np.arange(buckets), sigma)])
        all_value = np.concatenate([st_value, fakes.ravel()])
        all_count = np.concatenate([st_count, np.ones(buckets * sigma, dtype=np.int64)])
        order = np.lexsort((all_value, all_bucket))
        return all_bucket[order], all_value[order], all_count[order]


def _cut_to_shares(
    kept: np.ndarray, shares: Sequence[Fraction], start: np.ndarray, order: np.ndarray
) -> list[np.ndarray]:
    """Cut every value to ⌊φ_i·N⌋ rows, repeating as N shrinks; the rows cut, in place."""
    cut = []
    while True:
        n = int(kept.sum())
        over = False
        for i, share in enumerate(shares):
            allowed = share.numerator * n // share.denominator
            if kept[i] > allowed:
                cut.append(order[start[i] + allowed : start[i] + kept[i]])
                kept[i] = allowed
                over = True
        if not over:
            return cut


def _sensitive_table(
    bucket: np.ndarray, value: np.ndarray, domain: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ST as counts per (bucket, value), sorted by bucket then value."""
    cells, counts = np.unique(bucket * domain + value, return_counts=True)
    return cells // domain, cells % domain, counts.astype(np.int64)


class FPrivacyReconstruction:
    """Count estimates for "public predicate P ∧ SA = s" from QIT and ST alone.

    est = Σ_g |P ∩ g|·c_g(s) / |ST_g| (Anatomy's estimator; with σ fake values per
    bucket |ST_g| = |g| + σ, which scales c_g(s) by the chance |g|/(|g|+σ) that a
    shown value is real). Without a sensitive value the answer is |P|, exact;
    without a predicate it is Σ_g c_g(s), exact when σ = 0.

    low and high are not a confidence interval but the range of counts consistent
    with the publication: in a bucket, |P ∩ g| predicate rows and r rows of value s
    overlap in max(0, |P ∩ g| + r − |g|) to min(|P ∩ g|, r) records, and any overlap
    in between is possible (Fréchet bounds). With fake values r may be 0 or c_g(s).
    `published` is the ST count of s over buckets that hold a predicate row.
    """

    def __init__(self, published: BucketPublication) -> None:
        self.published = published
        self.columns = {a.name: a for a in published.public}
        self.sensitive = published.sensitive.name
        self._codes = {
            a.name: {v: i for i, v in enumerate(a.domain)}
            for a in (*published.public, published.sensitive)
        }
        self.sizes = published.sizes
        self.totals = np.bincount(
            published.st_bucket, weights=published.st_count, minlength=len(self.sizes)
        )
        by_value = np.argsort(published.st_value, kind="stable")
        values = published.st_value[by_value]
        self._rows_of = {int(v): by_value[lo:hi] for v, lo, hi in zip(*_runs(values), strict=True)}

    def check(self, query: Query) -> None:
        for column in query.where:
            if column == self.sensitive:
                raise QueryError(
                    f'where.{column}: {column!r} is sensitive; ask for it under "value"'
                )
            if column not in self.columns:
                raise QueryError(f"where.{column}: no such public column")
        for column in query.value:
            if column != self.sensitive:
                raise QueryError(f"value.{column}: {column!r} is not the sensitive column")

    def estimate(self, query: Query) -> Estimate:
        return self.estimate_many([query])[0]

    def estimate_many(self, queries: Sequence[Query]) -> list[Estimate]:
        for query in queries:
            self.check(query)
        return [self._answer(query) for query in queries]

    def _answer(self, query: Query) -> Estimate:
        published = self.published
        mask = np.ones(len(published.bucket), dtype=bool)
        for column, labels in query.where.items():
            codes = self._codes[column]
            wanted = [codes[label] for label in labels if label in codes]
            mask &= np.isin(published.qit[column], wanted)
        rows = int(mask.sum())
        if not query.value:
            return Estimate(float(rows), float(rows), float(rows), rows, rows)
        code = self._codes[self.sensitive].get(query.value[self.sensitive], -1)
        st_rows = self._rows_of.get(code, np.empty(0, dtype=np.int64))
        in_predicate = np.bincount(published.bucket[mask], minlength=len(self.sizes))
        g = published.st_bucket[st_rows]
        shown = published.st_count[st_rows]
        hits = in_predicate[g]
        real_low = 0 if published.fake_values else shown
        estimate = float((hits * shown / self.totals[g]).sum())
        low = float(np.maximum(hits + real_low - self.sizes[g], 0).sum())
        high = float(np.minimum(hits, shown).sum())
        return Estimate(estimate, low, high, int(shown[hits > 0].sum()), rows)


def _runs(sorted_values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(value, start, end) of each run of equal values in a sorted array."""
    if not len(sorted_values):
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(sorted_values)]
    return sorted_values[starts], starts, ends
