"""Small domain randomization: the paper's worked example, Def. 2 on every PP partition, the
perturbation law, unbiased reconstruction and keyed reproducibility (seed 002)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from service.core.mechanisms.sdr import (
    SUBTABLE_COLUMN,
    SDRReconstruction,
    SmallDomainRandomization,
    SubTable,
    amplification,
    balance,
    is_balanced,
    max_retention,
    merge,
    perturbation_partitioning,
    protected_values,
    rearrangements,
)
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import Query, QueryError
from service.core.schema import Attribute, Schema, SchemaError
from service.core.table import Table

# Examples 1–4: frequencies of x1..x10 (the source's trailing zeros are a typo for ones,
# seed notes 002 §2.3) under (1/3, 2/3)-privacy.
EXAMPLE = np.array([12, 8, 6, 5, 4, 3, 1, 1, 1, 1])
RHO1, RHO2 = Fraction(1, 3), Fraction(2, 3)
EXAMPLE_GROUPS = np.array(
    [
        [6, 6, 6, 0, 0, 0, 0, 0, 0, 0],
        [4, 0, 0, 4, 4, 0, 0, 0, 0, 0],
        [2, 2, 0, 0, 0, 2, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
)
T1 = [12, 8, 6, 4, 4, 2, 0, 0, 0, 0]
T2 = [0, 0, 0, 1, 0, 1, 1, 1, 1, 1]
# a = 2·√ln(2/δ) of Eq. 11 at the paper's δ = 0.05.
CHERNOFF_A = 2 * math.sqrt(math.log(2 / 0.05))


def test_retention_matches_table_1():
    """Table 1 (γ = 5), rounded to whole percent as printed; §1.1's ICD-9 and Age × Country
    figures to two significant digits. The paper's compound "(p+q) = 7.4e-4" is p."""
    gamma = Fraction(5)
    domains = [77, 70, 50, 14, 9, 7, 6, 2]
    p_percent = [5, 5, 7, 22, 31, 36, 40, 67]
    q_percent = [1, 1, 2, 6, 8, 9, 10, 17]
    for m, p_printed, q_printed in zip(domains, p_percent, q_percent, strict=True):
        p = max_retention(gamma, m)
        assert round(float(100 * p)) == p_printed, m
        assert round(float(100 * (1 - p) / m)) == q_printed, m
    assert f"{float(1 / (15_000 - 1 + gamma)):.1e}" == "6.7e-05"
    assert f"{float(gamma / (15_000 - 1 + gamma)):.1e}" == "3.3e-04"
    assert f"{float(1 / (5390 - 1 + gamma)):.1e}" == "1.9e-04"
    assert f"{float(max_retention(gamma, 5390)):.1e}" == "7.4e-04"
    assert max_retention(5.0, 50) == pytest.approx(4 / 54)


def test_example_1_subtable_parameters():
    """ρ_11 = 1/3, γ_1 = 4, P_1 = 4/9 | 1/9; ρ_12 = 1/6, γ_2 = 10, P_2 = 2/3 | 1/15;
    unpartitioned with the publisher's ρ1: γ = 4, P = 4/13 | 1/13."""
    protected = protected_values(EXAMPLE, RHO1)
    assert protected.all()  # SA' = SA
    assert EXAMPLE.sum() // EXAMPLE.max() == 3  # θ
    first = SubTable(tuple(range(6)), 36, Fraction(1, 3), amplification(Fraction(1, 3), RHO2))
    second = SubTable((3, 5, 6, 7, 8, 9), 6, Fraction(1, 6), amplification(Fraction(1, 6), RHO2))
    assert (first.gamma, first.keep, first.switch, first.retention) == (
        4,
        Fraction(4, 9),
        Fraction(1, 9),
        Fraction(1, 3),
    )
    assert (second.gamma, second.keep, second.switch, second.retention) == (
        10,
        Fraction(2, 3),
        Fraction(1, 15),
        Fraction(3, 5),
    )
    gamma = amplification(RHO1, RHO2)
    assert gamma == 4
    assert gamma / (10 - 1 + gamma) == Fraction(4, 13)
    assert max_retention(gamma, 10) + (1 - max_retention(gamma, 10)) / 10 == Fraction(4, 13)
    assert np.allclose(first.matrix().sum(axis=1), 1)
    assert first.matrix()[0, 0] == pytest.approx(4 / 9)
    # Pitfall 5: the posterior of the most frequent value given its own output is exactly ρ2.
    prior = first.rho1
    assert prior * first.keep / (prior * first.keep + (1 - prior) * first.switch) == RHO2


def test_protected_values_include_the_boundary():
    """SA' = {x : f_x/|T| ≤ ρ1}, non-strict (Eq. 9); values absent from T are irrelevant."""
    assert protected_values(np.array([1, 1, 1]), Fraction(1, 3)).all()
    assert protected_values(np.array([1, 2, 0]), Fraction(1, 3)).tolist() == [True, False, False]
    assert protected_values(np.array([3, 7]), 0.3).tolist() == [True, False]


def test_example_2_balancing():
    assert np.array_equal(balance(EXAMPLE, 3), EXAMPLE_GROUPS)


def test_example_3_overlap_and_the_rcm_tie():
    """B = A·Aᵀ has B12 = B13 = 24, B23 = 8, B24 = 4, B34 = 2 and g5 isolated. The order
    matters: on scipy's RCM order (g4, g3, g2, g1, g5) the best merge is worse (0.5285·a)
    than PP's, which finds the paper's optimum (0.5258·a) among its candidate orders."""
    overlap = EXAMPLE_GROUPS @ EXAMPLE_GROUPS.T
    upper = {
        (i + 1, j + 1): int(overlap[i, j]) for i, j in zip(*np.triu_indices(5, 1), strict=True)
    }
    assert {pair: b for pair, b in upper.items() if b} == {
        (1, 2): 24,
        (1, 3): 24,
        (2, 3): 8,
        (2, 4): 4,
        (3, 4): 2,
    }
    # scipy's reverse_cuthill_mckee returns g4, g3, g2, g1, g5 here (seed notes 002 §2.3).
    scipy_order = np.array([3, 2, 1, 0, 4])
    runs, objective = merge(EXAMPLE_GROUPS[scipy_order], np.ones(10, bool), RHO2)
    assert sorted(sorted(scipy_order[a:b].tolist()) for a, b in runs) == [[0, 1, 2, 3], [4]]
    assert objective / 42 == pytest.approx(0.5285, abs=5e-5)
    candidates = rearrangements(EXAMPLE_GROUPS)
    assert any(order.tolist() in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0]) for order in candidates)
    partition = perturbation_partitioning(EXAMPLE, RHO1, RHO2)
    assert partition.error_bound < objective / 42 * CHERNOFF_A


def test_example_4_merging_the_papers_order():
    """On g1, g3, g2, g4, g5 the DP keeps {g1, g3, g2} and {g4, g5}: ε = (6·3 + √6·5/3)/42·a."""
    order = [0, 2, 1, 3, 4]
    runs, objective = merge(EXAMPLE_GROUPS[order], np.ones(10, bool), RHO2)
    assert runs == [(0, 3), (3, 5)]
    assert objective == pytest.approx(math.sqrt(36) * (6 / 3 + 1) + math.sqrt(6) * (6 / 9 + 1))


def test_pp_reproduces_example_1():
    partition = perturbation_partitioning(EXAMPLE, RHO1, RHO2)
    assert partition.theta == partition.theta_prime == 3
    assert np.array_equal(partition.groups, EXAMPLE_GROUPS)
    assert sorted(partition.subtable_counts.tolist()) == sorted([T1, T2])
    by_size = {sub.size: sub for sub in partition.subtables}
    assert (by_size[36].m, by_size[36].gamma, by_size[6].m, by_size[6].gamma) == (6, 4, 6, 10)
    assert partition.error_bound / CHERNOFF_A == pytest.approx(0.5258, abs=5e-5)
    # Unpartitioned, Eq. 9 gives ρ_1 = 12/42 = 2/7 and γ = 5.
    assert partition.unpartitioned_error == pytest.approx(
        CHERNOFF_A / math.sqrt(42) * (10 / (5 - 1) + 1)
    )


def worst_posterior(counts: np.ndarray, protected: np.ndarray, sub: SubTable) -> Fraction:
    """Exact max of Pr_i[X = x | Y = y] over protected x ∈ SA_i and outputs y (Cor. 1).

    Pr_i[Y = y] = π_y·(p+q) + (1 − π_y)·q since the priors π over SA_i sum to one.
    """
    size = int(counts.sum())
    priors = {x: Fraction(int(counts[x]), size) for x in sub.values}
    evidence = {y: prior * sub.keep + (1 - prior) * sub.switch for y, prior in priors.items()}
    return max(
        priors[x] * (sub.keep if x == y else sub.switch) / evidence[y]
        for x in sub.values
        if protected[x]
        for y in sub.values
    )


privacy_pair = st.integers(1, 18).flatmap(lambda a: st.tuples(st.just(a), st.integers(a + 1, 19)))


# Mixing a few large counts with small ones (like Example 1's tail) makes PP split the table
# in about 40% of the cases; uniform counts almost never split.
frequencies = st.lists(st.one_of(st.integers(0, 5), st.integers(0, 500)), min_size=2, max_size=12)


@settings(max_examples=300, deadline=None)
@given(counts=frequencies, pair=privacy_pair)
def test_every_pp_partition_meets_definition_2(counts, pair):
    """Def. 2 (i) exactly, Cor. 1's posterior bound, Theorem 3 (SA' = SA) or Theorem 5
    (SA' ⊂ SA), and a bound no worse than not partitioning."""
    counts = np.asarray(counts)
    rho1, rho2 = Fraction(pair[0], 20), Fraction(pair[1], 20)
    protected = protected_values(counts, rho1)
    assume(protected.any())
    partition = perturbation_partitioning(counts, rho1, rho2)
    assert np.array_equal(partition.subtable_counts.sum(axis=0), counts)
    assert (partition.subtable_counts >= 0).all()
    theta = Fraction(partition.theta)
    for sub, part in zip(partition.subtables, partition.subtable_counts, strict=True):
        assert sub.values == tuple(np.flatnonzero(part).tolist())
        assert sub.size == part.sum()
        assert sub.rho1 == Fraction(int(part[protected].max()), int(part.sum()))
        assert 0 < sub.rho1 < rho2  # Def. 2 (i)
        assert sub.gamma == amplification(sub.rho1, rho2) and sub.gamma > 1
        assert sub.m >= 2 and 0 < sub.retention < 1
        assert worst_posterior(part, protected, sub) <= rho2
        if protected[counts > 0].all():
            assert is_balanced(part, protected, partition.theta)  # Theorem 3 (i)
            assert sub.rho1 <= 1 / theta
        elif partition.theta_prime > 1:
            alpha = Fraction(partition.theta_prime, partition.theta_prime - 1)
            if theta > alpha:
                assert sub.rho1 <= alpha / (theta - alpha)  # Theorem 5 (i)
    assert partition.error_bound <= partition.unpartitioned_error * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 60), min_size=1, max_size=12))
def test_balancing_follows_lemma_1(counts):
    """Groups are θ-balanced and sum to T; every group but the last takes h records of each of
    θ values, and h is the largest that leaves the rest θ-balanced."""
    counts = np.asarray(counts)
    assume(counts.sum() > 0)
    theta = int(counts.sum() // counts.max())
    groups = balance(counts, theta)
    assert np.array_equal(groups.sum(axis=0), counts)
    remaining = counts.copy()
    everything = np.ones(len(counts), bool)
    for j, group in enumerate(groups):
        assert is_balanced(group, everything, theta)
        after = remaining - group
        assert is_balanced(after, everything, theta)
        if j < len(groups) - 1:
            support = np.flatnonzero(group)
            assert len(support) == theta and len(set(group[support].tolist())) == 1
            h = int(group[support[0]])
            if h < remaining[support].min():
                bigger = after.copy()
                bigger[support] -= 1
                assert not is_balanced(bigger, everything, theta)
        remaining = after


def brute_force_objective(groups: np.ndarray, protected: np.ndarray, rho2: Fraction) -> float:
    """min over all contiguous segmentations of Σ √n·(m/(γ − 1) + 1), infeasible runs excluded."""

    def weight(run: np.ndarray) -> float:
        rho = Fraction(int(run[protected].max(initial=0)), int(run.sum()))
        if not 0 < rho < rho2:
            return math.inf
        gamma = rho2 * (1 - rho) / (rho * (1 - rho2))
        return math.sqrt(run.sum()) * ((run > 0).sum() / float(gamma - 1) + 1)

    t, best = len(groups), math.inf
    for cuts in itertools.product([False, True], repeat=t - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), t]
        total = sum(weight(groups[a:b].sum(axis=0)) for a, b in itertools.pairwise(bounds))
        best = min(best, total)
    return best


@settings(max_examples=200, deadline=None)
@given(
    groups=st.integers(1, 7).flatmap(
        lambda t: st.lists(
            st.lists(st.integers(0, 9), min_size=5, max_size=5), min_size=t, max_size=t
        )
    ),
    mask=st.lists(st.booleans(), min_size=5, max_size=5),
    b=st.integers(1, 19),
)
def test_merge_is_the_optimal_segmentation(groups, mask, b):
    groups = np.asarray(groups)
    protected = np.asarray(mask)
    assume((groups.sum(axis=1) > 0).all() and protected.any())
    rho2 = Fraction(b, 20)
    expected = brute_force_objective(groups, protected, rho2)
    if math.isinf(expected):
        with pytest.raises(ValueError, match="no run of the groups is feasible"):
            merge(groups, protected, rho2)
        return
    runs, objective = merge(groups, protected, rho2)
    assert [a for a, _ in runs] == [0, *(b for _, b in runs[:-1])] and runs[-1][1] == len(groups)
    assert objective == pytest.approx(expected, rel=1e-12)


def release_rows(table: Table, release) -> np.ndarray:
    """True sensitive code of every published row."""
    return table.codes[release.sensitive][release.source_rows]


def test_perturbation_law_on_adult(adult):
    """Per sub-table, empirical transitions vs P_i (γ_i diagonal, 1 off it, over m_i − 1 + γ_i):
    one exact binomial test per cell of every P_i, Bonferroni at family α = 0.001; outputs
    never leave SA_i."""
    mechanism = SmallDomainRandomization(Fraction(1, 30), Fraction(1, 6))
    key = ServiceKey.from_seed(20)
    release = mechanism.publish(adult, random_ids(len(adult), key), key)
    assert len(release.subtables) >= 2
    truth = release_rows(adult, release)
    shown = release.published.codes["occupation"]
    cells = sum(sub.m**2 for sub in release.subtables)
    for i, sub in enumerate(release.subtables):
        rows = release.subtable == i
        assert np.isin(shown[rows], sub.values).all()
        assert np.array_equal(
            np.bincount(truth[rows], minlength=14), release.partition.subtable_counts[i]
        )
        matrix = sub.matrix()
        for (a, x), (b, y) in itertools.product(enumerate(sub.values), repeat=2):
            trials = int((rows & (truth == x)).sum())
            hits = int((rows & (truth == x) & (shown == y)).sum())
            result = stats.binomtest(hits, trials, matrix[a, b])
            assert result.pvalue > 0.001 / cells, (i, x, y, hits, trials, matrix[a, b])
    for name in ("age", "sex", "race", "marital_status", "education"):
        assert np.array_equal(release.published.codes[name], adult.codes[name][release.source_rows])


def example_table(scale: int = 50, seed: int = 0) -> Table:
    """Example 1's frequencies × scale, with a public attribute `a` that depends on s."""
    rng = np.random.default_rng(seed)
    s = np.repeat(np.arange(10), EXAMPLE * scale)
    a = (rng.random(len(s)) < 0.2 + 0.06 * s).astype(np.int32) + (rng.random(len(s)) < 0.3)
    schema = Schema(
        (
            Attribute("a", False, ("a0", "a1", "a2")),
            Attribute("s", True, tuple(f"x{i + 1}" for i in range(10))),
        )
    )
    return Table(schema, {"a": a.astype(np.int32), "s": s.astype(np.int32)})


def test_same_key_and_ids_publish_the_same_rows():
    table = example_table()
    key = ServiceKey.from_seed(21)
    ids = random_ids(len(table), key)
    mechanism = SmallDomainRandomization(RHO1, RHO2)
    first = mechanism.publish(table, ids, key)
    again = mechanism.publish(table, ids, ServiceKey(key.secret))
    for name in ("a", "s"):
        assert np.array_equal(first.published.codes[name], again.published.codes[name])
    assert np.array_equal(first.subtable, again.subtable)
    assert np.array_equal(first.published.lines, again.published.lines)
    other = mechanism.publish(table, ids, ServiceKey.from_seed(22))
    assert (other.subtable_of_row != first.subtable_of_row).mean() > 0.05
    assert (
        other.published.codes["s"][np.argsort(other.source_rows)]
        != first.published.codes["s"][np.argsort(first.source_rows)]
    ).mean() > 0.2


QUERIES = [
    Query({"a": ("a0",)}, {"s": "x1"}),  # only in T1
    Query({"a": ("a1",)}, {"s": "x4"}),  # in both sub-tables
    Query({"a": ("a2",)}, {"s": "x8"}),  # only in T2
    Query({}, {"s": "x6"}),  # in both, no predicate
    Query({"a": ("a0", "a2")}, {"s": "x2"}),
]


def true_count(table: Table, query: Query) -> int:
    rows = np.ones(len(table), dtype=bool)
    for column, labels in query.where.items():
        codes = [table.schema[column].domain.index(label) for label in labels]
        rows &= np.isin(table.codes[column], codes)
    value = table.schema["s"].domain.index(query.value["s"])
    return int((rows & (table.codes["s"] == value)).sum())


def test_reconstruction_is_unbiased_and_its_error_bar_fits():
    """Over 200 keyed publications: |mean − truth| in standard errors within the normal
    quantile, and (R−1)·s²/mean predicted variance within χ²(R−1) quantiles; Bonferroni over
    the 2·5 checks at family α = 0.001."""
    table = example_table()
    truth = np.array([true_count(table, q) for q in QUERIES])
    repetitions = 200
    estimates = np.empty((repetitions, len(QUERIES)))
    predicted = np.empty((repetitions, len(QUERIES)))
    z95 = stats.norm.ppf(0.975)
    mechanism = SmallDomainRandomization(RHO1, RHO2)
    for r in range(repetitions):
        key = ServiceKey.from_seed(1000 + r)
        release = mechanism.publish(table, random_ids(len(table), key), key)
        answers = SDRReconstruction.from_release(release).estimate_many(QUERIES)
        estimates[r] = [e.estimate for e in answers]
        predicted[r] = [((e.high - e.low) / (2 * z95)) ** 2 for e in answers]
    alpha = 0.001 / (2 * len(QUERIES))
    spread = estimates.std(axis=0, ddof=1)
    z = (estimates.mean(axis=0) - truth) / (spread / math.sqrt(repetitions))
    assert (np.abs(z) < stats.norm.ppf(1 - alpha / 2)).all(), z
    statistic = (repetitions - 1) * spread**2 / predicted.mean(axis=0)
    low, high = stats.chi2.ppf([alpha / 2, 1 - alpha / 2], repetitions - 1)
    assert ((low < statistic) & (statistic < high)).all(), statistic / (repetitions - 1)


def test_reconstruction_is_equation_7_per_subtable_summed():
    """Against a row-level reimplementation: Σ over sub-tables holding s of
    ((m_j − 1 + γ_j)·o_j − r_j)/(γ_j − 1); a sub-table without s adds nothing."""
    table = example_table(seed=1)
    key = ServiceKey.from_seed(23)
    release = SmallDomainRandomization(RHO1, RHO2).publish(table, random_ids(len(table), key), key)
    reconstruction = SDRReconstruction.from_release(release)
    shown, a = release.published.codes["s"], release.published.codes["a"]
    for query in QUERIES:
        where = np.ones(len(shown), dtype=bool)
        for labels in query.where.values():
            where &= np.isin(a, [int(label[1]) for label in labels])
        value = int(query.value["s"][1:]) - 1
        expected = 0.0
        for j, sub in enumerate(release.subtables):
            if value not in sub.values:
                continue
            r = (where & (release.subtable == j)).sum()
            o = (where & (release.subtable == j) & (shown == value)).sum()
            expected += float(((sub.m - 1 + sub.gamma) * int(o) - int(r)) / (sub.gamma - 1))
        answer = reconstruction.estimate(query)
        assert answer.estimate == pytest.approx(expected)
        assert answer.low < answer.estimate < answer.high
    public_only = reconstruction.estimate(Query({"a": ("a1",)}, {}))
    assert public_only.estimate == (table.codes["a"] == 1).sum()
    with pytest.raises(QueryError, match="not in the sensitive domain"):
        reconstruction.estimate(Query({}, {"s": "x11"}))


def test_cells_carry_the_subtable():
    table = example_table()
    key = ServiceKey.from_seed(24)
    release = SmallDomainRandomization(RHO1, RHO2).publish(table, random_ids(len(table), key), key)
    cells = release.cells()
    assert cells.columns == ["a", "s", SUBTABLE_COLUMN]
    assert cells.total == len(table)
    sizes = np.bincount(cells.column[SUBTABLE_COLUMN], weights=cells.weights)
    assert sizes.tolist() == [sub.size for sub in release.subtables]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.3, 0.2), "rho1 must be below rho2"),
        ((0.2, 1.0), r"rho2 must lie in \(0, 1\)"),
        ((0.0, 0.5), "rho1 must be positive"),
        ((0.2, 0.5, 1.5), r"delta must lie in \(0, 1\)"),
    ],
)
def test_parameters_are_validated(args, message):
    with pytest.raises(ValueError, match=message):
        SmallDomainRandomization(*args)


def test_unusable_tables_are_refused():
    with pytest.raises(ValueError, match="SA' is empty"):
        perturbation_partitioning(np.array([50, 50]), 0.3, 0.6)
    with pytest.raises(ValueError, match="the table is empty"):
        perturbation_partitioning(np.zeros(3), 0.3, 0.6)
    schema = Schema(
        (
            Attribute("a", False, ("x",)),
            Attribute("s", True, ("p", "q")),
            Attribute("t", True, ("u", "v")),
        )
    )
    table = Table(schema, {n: np.zeros(4, np.int32) for n in ("a", "s", "t")})
    with pytest.raises(SchemaError, match="one sensitive attribute"):
        SmallDomainRandomization(0.3, 0.6).partition(table)
