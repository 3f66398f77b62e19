"""F′-privacy bucketization (seed 003): the paper's examples, exact floors, optimality
of the two-size search against brute force, privacy of every published bucket, the
estimator, and keyed reproducibility."""

from __future__ import annotations

import itertools
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from service.core.mechanisms import fprivacy
from service.core.mechanisms.fprivacy import (
    BucketPublication,
    BucketSetting,
    FeasiblePairs,
    FPrivacyBucketization,
    FPrivacyReconstruction,
    Leaf,
    as_fraction,
    floor_share,
    frequency_thresholds,
    min_bucket_size,
    multi_size_search,
    record_partition,
    round_robin,
    two_size_search,
    valid_one_size,
    valid_two_size,
)
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import Query, QueryError
from service.core.schema import Attribute, Schema
from service.core.table import Table

# Example 3: x1–x8 once, x9–x12 six times, x13–x14 nine times; f′ = 2f + 0.05.
EXAMPLE_3 = [1] * 8 + [6] * 4 + [9] * 2


def flow_valid(counts: list[int], thresholds: list[Fraction], sizes: list[int]) -> bool:
    """Whether some assignment fills buckets of `sizes` with at most ⌊f′·|g|⌋ of each value.

    A max-flow over source → value (o_i) → bucket (⌊f′_i|g|⌋) → sink (|g|), written
    from Definition 2 alone, independent of Lemma 2 and Theorem 3.
    """
    m, b = len(counts), len(sizes)
    if sum(sizes) != sum(counts):
        return False
    source, sink = 0, m + b + 1
    capacity = np.zeros((m + b + 2, m + b + 2), dtype=np.int32)
    capacity[source, 1 : m + 1] = counts
    for i, f in enumerate(thresholds):
        for j, size in enumerate(sizes):
            capacity[1 + i, 1 + m + j] = f.numerator * size // f.denominator
    capacity[1 + m : 1 + m + b, sink] = sizes
    return maximum_flow(csr_matrix(capacity), source, sink).flow_value == sum(counts)


def brute_force_two_size(
    counts: list[int], thresholds: list[Fraction], max_size: int, min_size: int
) -> int | None:
    """The least loss over every setting with at most two sizes in [min_size, max_size]."""
    n, best = sum(counts), None
    for s1 in range(min_size, max_size + 1):
        settings_ = [[s1] * (n // s1)] if n % s1 == 0 else []
        for s2 in range(s1 + 1, max_size + 1):
            for b2 in range(1, n // s2 + 1):
                rest = n - s2 * b2
                if rest and rest % s1 == 0:
                    settings_.append([s1] * (rest // s1) + [s2] * b2)
        for sizes in settings_:
            loss = sum((s - 1) ** 2 for s in sizes)
            if (best is None or loss < best) and flow_valid(counts, thresholds, sizes):
                best = loss
    return best


def bucket_contents(counts: list[int], leaves: list[Leaf]) -> list[list[int]]:
    """Values (1-based, as in the paper) of every bucket that round_robin fills."""
    bucket = round_robin(counts, leaves)
    values = np.repeat(np.arange(len(counts)), counts) + 1
    return [sorted(values[bucket == g].tolist()) for g in range(int(bucket.max()) + 1)]


def assert_private(counts: list[int], thresholds: list[Fraction], leaves: list[Leaf]) -> None:
    for contents in bucket_contents(counts, leaves):
        for value in set(contents):
            share = Fraction(contents.count(value), len(contents))
            assert share <= thresholds[value - 1], (contents, value)


def table_with_counts(counts: list[int], seed: int = 0) -> Table:
    """A table whose sensitive value v appears counts[v] times, with a random public column."""
    rng = np.random.default_rng(seed)
    sensitive = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)
    schema = Schema(
        (
            Attribute("a", False, ("x", "y", "z")),
            Attribute("s", True, tuple(f"s{i}" for i in range(len(counts)))),
        )
    )
    public = rng.integers(0, 3, size=len(sensitive)).astype(np.int32)
    return Table(schema, {"a": public, "s": sensitive})


def check_release(table: Table, release, mechanism: FPrivacyBucketization) -> None:
    """Every bucket meets every f′ (recomputed here), and every input row is accounted for."""
    published = release.published
    sizes = np.bincount(published.bucket)
    assert (sizes > 0).all()
    assert sizes.max(initial=1) <= mechanism.max_size
    assert sizes.min(initial=mechanism.min_size) >= mechanism.min_size
    domain = table.schema["s"].domain
    for g, v, c in zip(published.st_bucket, published.st_value, published.st_count, strict=True):
        assert Fraction(int(c), int(sizes[g])) <= release.thresholds[domain[v]]
    assert np.array_equal(
        np.bincount(published.st_bucket, weights=published.st_count, minlength=len(sizes)),
        sizes + published.fake_values,
    )
    removed = np.concatenate([release.suppressed_lines, release.trimmed_lines])
    assert len(np.unique(np.concatenate([release.lines, removed]))) == len(table)
    assert len(published.bucket) == len(table) - len(removed)
    assert sum(release.suppressed.values()) == len(release.suppressed_lines)
    assert release.loss == int(((sizes - 1) ** 2).sum())
    assert release.setting.rows == len(published.bucket)
    # The QIT rows carry the public values of the rows they came from.
    rows = np.searchsorted(table.lines, release.lines)
    assert np.array_equal(published.qit["a"], table.codes["a"][rows])


def test_floats_are_read_as_the_decimal_they_print_as():
    """The 0.29·100 trap: binary floating point floors it to 28, the paper means 29."""
    assert math.floor(0.29 * 100) == 28
    assert as_fraction(0.29) == Fraction(29, 100)
    assert floor_share(as_fraction(0.29), 100) == 29
    assert as_fraction("0.29") == as_fraction("29/100") == as_fraction(Decimal("0.29"))
    # 29 records of x in one bucket of 100 meet f′ = 0.29 exactly.
    assert valid_one_size([29, 71], [0.29, 1], 100, 1)
    assert not valid_one_size([30, 70], [0.29, 1], 100, 1)
    # Example 3 works in floats only by luck: 0.41·14 = 5.739… floors to 5 either way.
    assert floor_share(as_fraction(0.41), 14) == math.floor(0.41 * 14) == 5


def test_example_3_capacities_partition_and_figure_1():
    thresholds = frequency_thresholds(EXAMPLE_3, theta=2, beta="0.05")
    assert thresholds[0] == Fraction("0.09")
    assert thresholds[8] == Fraction("0.29")
    assert thresholds[12] == Fraction("0.41")
    first, second = (4, 9), (14, 1)
    u1 = [floor_share(f, 4) * 9 for f in thresholds]
    u2 = [floor_share(f, 14) * 1 for f in thresholds]
    assert (u1[0], u1[8], u1[12]) == (0, 9, 9)
    assert (u2[0], u2[8], u2[12]) == (1, 4, 5)
    a1 = [min(u, o) for u, o in zip(u1, EXAMPLE_3, strict=True)]
    a2 = [min(u, o) for u, o in zip(u2, EXAMPLE_3, strict=True)]
    assert (sum(a1), sum(a2)) == (42, 34)
    assert valid_two_size(EXAMPLE_3, thresholds, first, second)
    # T_1 starts with 42 records, 6 too many: one record each of x9–x14 moves to T_2.
    n1, n2 = record_partition(EXAMPLE_3, thresholds, first, second)
    assert n2.tolist() == [1] * 14
    assert n1.tolist() == [0] * 8 + [5] * 4 + [8] * 2
    contents = bucket_contents(EXAMPLE_3, [Leaf(4, 9, n1), Leaf(14, 1, n2)])
    # Figure 1 (its captions are swapped): nine buckets of 4, then the bucket of 14.
    assert contents == [
        [9, 10, 12, 13],
        [9, 11, 12, 14],
        [9, 11, 13, 14],
        [9, 11, 13, 14],
        [9, 11, 13, 14],
        [10, 11, 13, 14],
        [10, 12, 13, 14],
        [10, 12, 13, 14],
        [10, 12, 13, 14],
        list(range(1, 15)),
    ]
    assert_private(EXAMPLE_3, thresholds, [Leaf(4, 9, n1), Leaf(14, 1, n2)])


def test_example_3_setting_is_the_optimal_two_size_one():
    thresholds = frequency_thresholds(EXAMPLE_3, theta=2, beta="0.05")
    best = two_size_search(EXAMPLE_3, thresholds, max_size=50)
    assert best == BucketSetting(((4, 9), (14, 1)))
    assert best.loss == 9 * 3**2 + 13**2
    assert brute_force_two_size(EXAMPLE_3, thresholds, 20, 1) == best.loss


def test_example_4_feasible_pairs_and_rising_loss():
    pairs = FeasiblePairs.of(28, 2, 4)
    listed = [pairs.pair(t) for t in range(pairs.last + 1)]
    assert listed == [(14, 0), (12, 1), (10, 2), (8, 3), (6, 4), (4, 5), (2, 6), (0, 7)]
    losses = [b1 * 1 + b2 * 9 for b1, b2 in listed]
    assert losses == [pairs.first_loss + t * pairs.step_loss for t in range(len(listed))]
    assert all(a < b for a, b in itertools.pairwise(losses))  # Lemma 5
    assert FeasiblePairs.of(29, 2, 4) is None  # gcd 2 does not divide 29


@pytest.mark.parametrize(
    ("smallest", "largest", "sizes", "diverse"),
    [
        # OCC-300K: min f 0.18%, max f 7.5%; only θ = 32 is ℓ-diverse-feasible (ℓ ≤ 13).
        ("0.0018", "0.075", [43, 37, 30, 21, 13], [False, False, False, False, True]),
        # EDU-300K: min f 0.44%, max f 27.3%; infeasible for every ℓ ≥ 4, so every θ.
        ("0.0044", "0.273", [35, 27, 19, 12, 7], [False] * 5),
    ],
)
def test_section_7_1_l_diversity_needs_buckets_it_cannot_have(smallest, largest, sizes, diverse):
    """Remark 1: modelling F′ by ℓ-diversity needs ℓ = ⌈1/min f′⌉; it exists iff 1/ℓ ≥ max f."""
    ells = [
        min_bucket_size(theta * Fraction(smallest) + Fraction("0.02"))
        for theta in (2, 4, 8, 16, 32)
    ]
    assert ells == sizes
    assert [Fraction(1, ell) >= Fraction(largest) for ell in ells] == diverse


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda c: sum(c) > 0),
    denominators=st.lists(st.integers(1, 6), min_size=4, max_size=4),
    data=st.data(),
)
def test_theorem_3_agrees_with_max_flow(counts, denominators, data):
    thresholds = [Fraction(data.draw(st.integers(1, d)), d) for d in denominators[: len(counts)]]
    n = sum(counts)
    s1 = data.draw(st.integers(1, 5))
    s2 = data.draw(st.integers(s1 + 1, 7))
    for b2 in range(n // s2 + 1):
        if (n - s2 * b2) % s1 == 0:
            b1 = (n - s2 * b2) // s1
            expected = flow_valid(counts, thresholds, [s1] * b1 + [s2] * b2)
            assert valid_two_size(counts, thresholds, (s1, b1), (s2, b2)) == expected
            if b2 == 0:
                assert valid_one_size(counts, thresholds, s1, b1) == expected


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 8), min_size=1, max_size=4).filter(lambda c: sum(c) > 0),
    numerators=st.lists(st.integers(1, 8), min_size=4, max_size=4),
    max_size=st.integers(2, 8),
    min_size=st.integers(1, 2),
)
def test_two_size_search_equals_brute_force(counts, numerators, max_size, min_size):
    thresholds = [Fraction(k, 8) for k in numerators[: len(counts)]]
    best = two_size_search(counts, thresholds, max_size, min_size)
    expected = brute_force_two_size(counts, thresholds, max_size, min_size)
    assert (best is None) == (expected is None)
    if best is not None:
        assert best.loss == expected
        assert best.rows == sum(counts)
        assert all(min_size <= s <= max_size for s, _ in best.parts)
        assert flow_valid(counts, thresholds, [s for s, b in best.parts for _ in range(b)])


def first_valid_pair(counts: list[int], thresholds: list[Fraction], s1: int, s2: int) -> int | None:
    """Index in Γ(S_1, S_2) of the first valid pair found by the pruned search."""
    pairs = FeasiblePairs.of(sum(counts), s1, s2)
    planner = fprivacy._Planner(thresholds, s2, 1)
    o = np.asarray(counts, dtype=np.int64)
    return planner._first_valid(o, planner.caps[s1], planner.caps[s2], pairs, pairs.last)


def test_a_setting_whose_large_buckets_cannot_be_filled_is_not_valid():
    """(3, 1), (5, 1) with four values at f′ = 1/3: PC, FC(S_1) and CC hold, but a bucket
    of 5 needs 5 distinct values (FC(S_2) fails)."""
    thresholds = [Fraction(1, 3)] * 4
    assert not valid_two_size([2, 2, 2, 2], thresholds, (3, 1), (5, 1))
    assert not flow_valid([2, 2, 2, 2], thresholds, [3, 5])
    assert first_valid_pair([2, 2, 2, 2], thresholds, 3, 5) is None


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 80), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    denominator=st.integers(1, 8),
    data=st.data(),
)
def test_pruned_scan_of_gamma_finds_the_first_valid_pair(counts, denominator, data):
    """Γ* (Theorem 4) from the PC interval, a binary search on FC(S_1) and one FC(S_2)
    check, against a linear scan of Γ with Theorem 3."""
    numerators = data.draw(st.lists(st.integers(1, denominator), min_size=6, max_size=6))
    thresholds = [Fraction(k, denominator) for k in numerators[: len(counts)]]
    s1 = data.draw(st.integers(1, 9))
    s2 = data.draw(st.integers(s1 + 1, 12))
    pairs = FeasiblePairs.of(sum(counts), s1, s2)
    if pairs is None:
        return
    scan = [
        t
        for t in range(pairs.last + 1)
        if valid_two_size(counts, thresholds, (s1, pairs.pair(t)[0]), (s2, pairs.pair(t)[1]))
    ]
    assert first_valid_pair(counts, thresholds, s1, s2) == (scan[0] if scan else None)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 60), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    theta=st.sampled_from([1, 2, 4, 8]),
    beta=st.sampled_from(["0", "0.02", "0.05", "0.1"]),
    max_size=st.integers(3, 25),
)
def test_multi_size_never_loses_to_one_or_two_sizes_and_stays_private(
    counts, theta, beta, max_size
):
    thresholds = frequency_thresholds(counts, theta, beta)
    leaves = multi_size_search(counts, thresholds, max_size)
    two = two_size_search(counts, thresholds, max_size)
    assert (leaves is None) == (two is None)
    if leaves is None:
        return
    setting = BucketSetting(tuple((leaf.size, leaf.buckets) for leaf in leaves))
    assert setting.loss <= two.loss
    n = sum(counts)
    one_size = [
        (n // s) * (s - 1) ** 2
        for s in range(1, max_size + 1)
        if n % s == 0 and valid_one_size(counts, thresholds, s, n // s)
    ]
    if one_size:
        assert setting.loss <= min(one_size)
    assert np.array_equal(sum(leaf.counts for leaf in leaves), counts)
    assert_private(counts, thresholds, leaves)
    # Algorithm 2 stops only where the best two-size split of a part would not lower its loss.
    for leaf in leaves:
        split = two_size_search(leaf.counts.tolist(), thresholds, max_size)
        assert split.loss >= leaf.buckets * (leaf.size - 1) ** 2


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 80), min_size=1, max_size=8),
    theta=st.sampled_from([1, 2, 8, 32]),
    beta=st.sampled_from(["0", "0.02", "0.1"]),
    strict=st.sampled_from([None, "1/4", "0.1"]),
    max_size=st.integers(2, 30),
    min_size=st.integers(1, 2),
    method=st.sampled_from(["multi", "two"]),
    seed=st.integers(0, 2**16),
)
def test_every_published_bucket_meets_every_threshold(
    counts, theta, beta, strict, max_size, min_size, method, seed
):
    """On random frequency vectors, some with a threshold below the value's frequency
    (Lemma 1 fails and rows must be suppressed)."""
    table = table_with_counts(counts, seed)
    overrides = {"s0": strict} if strict else None
    mechanism = FPrivacyBucketization(theta, beta, overrides, max_size, min_size, method)
    key = ServiceKey.from_seed(seed)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    n = sum(counts)
    for v, o in enumerate(counts):
        if o:
            formula = min(Fraction(1), theta * Fraction(o, n) + Fraction(beta))
            wanted = Fraction(strict) if strict and v == 0 else formula
            assert release.thresholds[f"s{v}"] == wanted
    check_release(table, release, mechanism)


def test_lemma_1_violation_is_suppressed_to_the_largest_valid_share():
    """f′ = 1/4 for a value holding half the rows: it keeps k rows with 4k ≤ k + 50."""
    table = table_with_counts([50, 50])
    mechanism = FPrivacyBucketization(thresholds={"s0": "1/4", "s1": 1})
    key = ServiceKey.from_seed(5)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    assert release.suppressed == {"s0": 34}
    assert len(release.trimmed_lines) == 0
    assert set(table.codes["s"][release.suppressed_lines].tolist()) == {0}
    check_release(table, release, mechanism)


def test_rows_that_fit_no_setting_are_trimmed():
    """Five distinct values under f′ = 1/3, buckets of 3 or 4: 3·b_1 + 4·b_2 = 5 has no
    solution although no value is over its share; one row goes, four fill one bucket."""
    table = table_with_counts([1, 1, 1, 1, 1])
    mechanism = FPrivacyBucketization(thresholds={f"s{i}": "1/3" for i in range(5)}, max_size=4)
    key = ServiceKey.from_seed(6)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    assert release.suppressed == {}
    assert len(release.trimmed_lines) == 1
    assert release.setting == BucketSetting(((4, 1),))
    check_release(table, release, mechanism)


def test_adult_publication_is_private_complete_and_estimable(adult):
    key = ServiceKey.from_seed(7)
    ids = random_ids(len(adult), key)
    losses = {}
    for method in ("two", "multi"):
        mechanism = FPrivacyBucketization(method=method)
        release = mechanism.publish(adult, ids, key)
        assert release.suppressed == {} and len(release.trimmed_lines) == 0
        published = release.published
        domain = adult.schema["occupation"].domain
        sizes = np.bincount(published.bucket)
        for g, v, c in zip(
            published.st_bucket, published.st_value, published.st_count, strict=True
        ):
            assert Fraction(int(c), int(sizes[g])) <= release.thresholds[domain[v]]
        assert np.array_equal(np.bincount(published.st_bucket, weights=published.st_count), sizes)
        assert len(published.bucket) == len(adult)
        assert release.loss == int(((sizes - 1) ** 2).sum())
        losses[method] = release.loss
    assert losses["multi"] < losses["two"]

    estimator = FPrivacyReconstruction(release.published)
    truth = adult.codes["occupation"]
    rng = np.random.default_rng(8)
    queries, expected = [], []
    for _ in range(60):
        where = {}
        for name in rng.choice(["age", "sex", "race", "marital_status", "education"], 2, False):
            size = adult.schema[name].size
            where[str(name)] = tuple(
                adult.schema[name].domain[c] for c in rng.choice(size, max(1, size // 3), False)
            )
        value = int(rng.integers(len(domain)))
        mask = np.ones(len(adult), dtype=bool)
        for name, labels in where.items():
            mask &= np.isin(adult.labels(name), labels)
        queries += [Query(where, {}), Query({}, {"occupation": domain[value]})]
        queries.append(Query(where, {"occupation": domain[value]}))
        expected += [mask.sum(), (truth == value).sum(), (mask & (truth == value)).sum()]
    answers = estimator.estimate_many(queries)
    for query, answer, true in zip(queries, answers, expected, strict=True):
        if not query.value or not query.where:
            assert answer.estimate == answer.low == answer.high == true
        else:
            assert answer.low <= true <= answer.high
            assert answer.low <= answer.estimate <= answer.high


def test_same_key_and_ids_reproduce_the_publication_exactly():
    table = table_with_counts([40, 25, 20, 10, 5], seed=9)
    key = ServiceKey.from_seed(10)
    ids = random_ids(len(table), key)
    mechanism = FPrivacyBucketization(theta=2)
    first = mechanism.publish(table, ids, key)
    again = mechanism.publish(table, ids, ServiceKey(key.secret))
    other = mechanism.publish(table, ids, ServiceKey.from_seed(11))
    for name in ("bucket", "st_bucket", "st_value", "st_count"):
        assert np.array_equal(getattr(first.published, name), getattr(again.published, name))
    assert np.array_equal(first.published.qit["a"], again.published.qit["a"])
    assert np.array_equal(first.lines, again.lines)
    assert first.setting == other.setting
    assert not np.array_equal(first.lines, other.lines)


def test_example_2_estimate_is_the_inference_probability():
    """Table 2: Alice ⟨F, 61434⟩ shares bucket 2 with {Cancer, HIV}: Pr(HIV) = 50%."""
    gender = Attribute("gender", False, ("M", "F"))
    zipcode = Attribute("zipcode", False, ("54321", "54322", "61234", "61434"))
    disease = Attribute("disease", True, ("Brain Tumor", "Indigestion", "Cancer", "HIV"))
    published = BucketPublication(
        public=(gender, zipcode),
        qit={"gender": np.array([0, 0, 1, 1]), "zipcode": np.array([0, 1, 2, 3])},
        bucket=np.array([0, 0, 1, 1]),
        sensitive=disease,
        st_bucket=np.array([0, 0, 1, 1]),
        st_value=np.array([0, 1, 2, 3]),
        st_count=np.array([1, 1, 1, 1]),
    )
    estimator = FPrivacyReconstruction(published)
    alice = estimator.estimate(Query({"gender": ("F",), "zipcode": ("61434",)}, {"disease": "HIV"}))
    assert (alice.estimate, alice.low, alice.high) == (0.5, 0.0, 1.0)
    women = estimator.estimate(Query({"gender": ("F",)}, {"disease": "HIV"}))
    assert (women.estimate, women.low, women.high, women.predicate_rows) == (1.0, 1.0, 1.0, 2)
    men = estimator.estimate(Query({"gender": ("M",)}, {"disease": "HIV"}))
    assert (men.estimate, men.low, men.high, men.published) == (0.0, 0.0, 0.0, 0)
    with pytest.raises(QueryError, match="sensitive"):
        estimator.estimate(Query({"disease": ("HIV",)}, {}))
    with pytest.raises(QueryError, match="no such public column"):
        estimator.estimate(Query({"age": ("30",)}, {}))


def test_fake_values_are_distinct_per_bucket_and_keep_estimates_bracketed():
    counts = [30, 25, 20, 15, 10, 10, 5, 5]
    table = table_with_counts(counts, seed=12)
    uniform = {f"s{i}": "1/3" for i in range(len(counts))}
    mechanism = FPrivacyBucketization(thresholds=uniform, max_size=5, fake_values=2)
    key = ServiceKey.from_seed(13)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    check_release(table, release, mechanism)
    published = release.published
    real = table.codes["s"][np.searchsorted(table.lines, release.lines)]
    for g in range(published.buckets):
        shown = published.st_value[published.st_bucket == g]
        held = real[published.bucket == g]
        assert len(set(shown.tolist())) == len(shown) == len(held) + 2
        assert set(held.tolist()) < set(shown.tolist())
    estimator = FPrivacyReconstruction(published)
    for value, true in enumerate(counts):
        answer = estimator.estimate(Query({"a": ("x",)}, {"s": f"s{value}"}))
        in_x = ((real == value) & (published.qit["a"] == 0)).sum()
        assert answer.low <= in_x <= answer.high
        whole = estimator.estimate(Query({}, {"s": f"s{value}"}))
        expected = sum(
            c * np.sum(published.bucket == g) / (np.sum(published.bucket == g) + 2)
            for g, v, c in zip(
                published.st_bucket, published.st_value, published.st_count, strict=True
            )
            if v == value
        )
        assert whole.estimate == pytest.approx(expected, rel=1e-12)
        assert whole.low <= true <= whole.high


def test_fake_values_refuse_buckets_they_cannot_hide_in():
    key = ServiceKey.from_seed(14)
    repeats = table_with_counts([40, 4])
    with pytest.raises(ValueError, match="distinct sensitive values"):
        FPrivacyBucketization(min_size=2, fake_values=1).publish(
            repeats, random_ids(len(repeats), key), key
        )
    few = table_with_counts([3, 3, 3])
    uniform = {f"s{i}": "1/3" for i in range(3)}
    with pytest.raises(ValueError, match="need 4 distinct values; the data has 3"):
        FPrivacyBucketization(thresholds=uniform, max_size=3, fake_values=1).publish(
            few, random_ids(len(few), key), key
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"theta": 0}, ValueError, "theta must be positive"),
        ({"beta": "1.5"}, ValueError, r"beta must lie in \[0, 1\]"),
        ({"beta": float("nan")}, ValueError, "finite number"),
        ({"theta": True}, TypeError, "bool"),
        ({"thresholds": {"s0": 0}}, ValueError, r"must lie in \(0, 1\]"),
        ({"thresholds": {"s0": "abc"}}, ValueError, "finite number"),
        ({"max_size": 0}, ValueError, "1 ≤ min_size ≤ max_size"),
        ({"min_size": 5, "max_size": 4}, ValueError, "1 ≤ min_size ≤ max_size"),
        ({"method": "three"}, ValueError, "method must be one of multi, two"),
        ({"fake_values": -1}, ValueError, "fake_values must be ≥ 0"),
    ],
)
def test_parameters_are_validated(kwargs, error, message):
    with pytest.raises(error, match=message):
        FPrivacyBucketization(**kwargs)


def test_thresholds_for_unknown_values_are_refused():
    table = table_with_counts([5, 5])
    key = ServiceKey.from_seed(15)
    with pytest.raises(ValueError, match="not a value of 's'"):
        FPrivacyBucketization(thresholds={"HIV": "0.1"}).publish(
            table, random_ids(len(table), key), key
        )
