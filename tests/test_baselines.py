"""Baselines: Anatomy, DBR, global randomization and Laplace counts, and their estimators.

Statistical checks use fixed seeds and thresholds from the distributions under
test: family α = 0.001, Bonferroni across the checks of one test.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from service.core.mechanisms.anatomy import Anatomy, AnatomyReconstruction
from service.core.mechanisms.dbr import DBRReconstruction, DistributionBasedRandomization
from service.core.mechanisms.decoy import id_rank
from service.core.mechanisms.global_randomization import (
    GlobalRandomization,
    GlobalRandomizationReconstruction,
)
from service.core.mechanisms.laplace import LaplaceCounts
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query
from service.core.schema import Attribute, Schema, SchemaError
from service.core.table import Table
from tests.conftest import synthetic_table

ALPHA = 0.001
SENSITIVE = "occupation"


def true_count(table: Table, query: Query) -> int:
    """Row scan of the true table: the reference every estimator is checked against."""
    mask = np.ones(len(table), dtype=bool)
    conditions = [*query.where.items(), *((c, (v,)) for c, v in query.value.items())]
    for column, labels in conditions:
        domain = table.schema[column].domain
        mask &= np.isin(table.codes[column], [domain.index(v) for v in labels])
    return int(mask.sum())


def conjunctive_queries(table: Table, columns: list[str]) -> list[Query]:
    """Every value of each public column in `columns` ∧ every sensitive value."""
    return [
        Query({column: (value,)}, {SENSITIVE: s})
        for column in columns
        for value in table.schema[column].domain
        for s in table.schema[SENSITIVE].domain
    ]


def in_input_order(published: Table, original: Table) -> Table:
    """The published rows put back in the input's order, via the trusted source lines."""
    return published.take(np.argsort(published.lines)).take(np.argsort(np.argsort(original.lines)))


# --- Anatomy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ell", [5, 7])
def test_anatomy_groups_are_ell_diverse_and_st_describes_them(adult, ell):
    key = ServiceKey.from_seed(1)
    release = Anatomy(ell).publish(adult, random_ids(len(adult), key), key)
    n = len(adult)
    true_values = adult.codes[SENSITIVE][np.searchsorted(adult.lines, release.lines)]

    # ST is the exact (group, value) histogram of the records behind the QIT rows.
    st_cells = dict(
        zip(
            zip(release.st_group.tolist(), release.st_value.tolist(), strict=True),
            release.st_count.tolist(),
            strict=True,
        )
    )
    actual = Counter(zip(release.qit_group.tolist(), true_values.tolist(), strict=True))
    assert st_cells == dict(actual)
    assert release.st_count.sum() == n
    assert np.array_equal(
        np.bincount(release.st_value, weights=release.st_count, minlength=14),
        np.bincount(adult.codes[SENSITIVE], minlength=14),
    )

    # Every group: distinct values, at least ℓ of them; residues add exactly N mod ℓ rows.
    sizes = np.bincount(release.st_group, weights=release.st_count).astype(int)
    distinct = np.bincount(release.st_group)
    assert release.groups == n // ell
    assert (release.st_count == 1).all()
    assert np.array_equal(sizes, distinct)
    assert sizes.min() >= ell and sizes.max() <= 2 * ell - 1
    assert (sizes - ell).sum() == n % ell

    # The QIT is the public columns verbatim, with no sensitive column.
    assert set(release.qit) == {a.name for a in adult.schema.public}
    for name, codes in release.qit.items():
        assert np.array_equal(codes[np.argsort(release.lines)], adult.codes[name])


def anatomize(counts: list[int], ell: int) -> tuple[Counter, list[int]]:
    """Xiao & Tao's group creation on bucket sizes: the groups' value sets and the residues."""
    sizes = list(counts)
    cuts: Counter = Counter()
    while sum(1 for s in sizes if s) >= ell:
        largest = sorted(range(len(sizes)), key=lambda v: (-sizes[v], v))[:ell]
        cuts[frozenset(largest)] += 1
        for v in largest:
            sizes[v] -= 1
    assert all(s <= 1 for s in sizes), "eligible counts leave at most one record per bucket"
    return cuts, [v for v, s in enumerate(sizes) if s]


@st.composite
def eligible_counts(draw: st.DrawFn) -> tuple[list[int], int]:
    """Bucket sizes and an ℓ ≥ 2 with no bucket above N/ℓ."""
    counts = draw(
        st.lists(st.integers(0, 25), min_size=2, max_size=12).filter(
            lambda c: sum(c) >= 2 * max(c) > 0
        )
    )
    return counts, draw(st.integers(2, min(6, sum(counts) // max(counts))))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(case=eligible_counts())
def test_anatomy_grouping_is_anatomize(case):
    """Groups are Anatomize's cuts plus residues placed in groups lacking their value."""
    counts, ell = case
    n = sum(counts)
    values = np.repeat(np.arange(len(counts)), counts)
    key = ServiceKey.from_seed(n)
    ids = random_ids(n, key)
    group = Anatomy(ell).group(ids, values, key, "s")
    cuts, residue_values = anatomize(counts, ell)

    assert group.max() + 1 == n // ell
    for g in range(n // ell):
        members = values[group == g]
        assert len(set(members.tolist())) == len(members) >= ell
    # Within a bucket records are taken by id, so a residue is its bucket's largest id.
    rank = id_rank(ids)
    residue = [np.flatnonzero(values == v)[rank[values == v].argmax()] for v in residue_values]
    created = np.ones(n, dtype=bool)
    created[residue] = False
    found = Counter(frozenset(values[created & (group == g)].tolist()) for g in range(n // ell))
    assert found == cuts


def test_anatomy_estimator_is_exact_on_sensitive_only_and_public_only_queries(adult):
    key = ServiceKey.from_seed(2)
    release = Anatomy(5).publish(adult, random_ids(len(adult), key), key)
    reconstruction = AnatomyReconstruction(release)
    queries = [Query({}, {SENSITIVE: s}) for s in adult.schema[SENSITIVE].domain]
    queries += [Query({"sex": (v,)}, {}) for v in adult.schema["sex"].domain]
    queries += [Query({"race": ("White", "Black"), "education": ("Bachelors",)}, {})]
    for query, answer in zip(queries, reconstruction.estimate_many(queries), strict=True):
        assert answer.estimate == pytest.approx(true_count(adult, query), rel=1e-12, abs=1e-9)


def test_anatomy_estimator_is_xiao_and_taos_formula(adult):
    """Σ_g |P ∩ g|·c_g(s)/|g| computed row by row from QIT and ST agrees with the cell version."""
    key = ServiceKey.from_seed(3)
    release = Anatomy(5).publish(adult, random_ids(len(adult), key), key)
    queries = conjunctive_queries(adult, ["sex", "race"])
    queries.append(Query({"race": ("White", "Other"), "sex": ("Female",)}, {SENSITIVE: "Sales"}))
    answers = AnatomyReconstruction(release).estimate_many(queries)

    holding = np.zeros((release.groups, 14))
    holding[release.st_group, release.st_value] = release.st_count
    share = holding / holding.sum(axis=1, keepdims=True)
    domain = adult.schema[SENSITIVE].domain
    for query, answer in zip(queries, answers, strict=True):
        rows = np.ones(len(adult), dtype=bool)
        for column, labels in query.where.items():
            wanted = [adult.schema[column].domain.index(v) for v in labels]
            rows &= np.isin(release.qit[column], wanted)
        expected = share[release.qit_group[rows], domain.index(query.value[SENSITIVE])].sum()
        assert answer.estimate == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert answer.predicate_rows == rows.sum()
        assert answer.low is None and answer.high is None


def test_anatomy_refuses_ineligible_tables_and_bad_parameters():
    values = np.repeat([0, 1, 2], [10, 2, 2])
    key = ServiceKey.from_seed(4)
    with pytest.raises(ValueError, match=r"not eligible for ℓ=2.*at most 1"):
        Anatomy(2).group(random_ids(14, key), values, key, "s")
    with pytest.raises(ValueError, match="at least ℓ=3 rows"):
        Anatomy(3).group(random_ids(2, key), np.array([0, 1]), key, "s")
    with pytest.raises(ValueError, match="at least 2"):
        Anatomy(1)
    with pytest.raises(TypeError, match="integer"):
        Anatomy(2.5)  # type: ignore[arg-type]


# --- DBR -------------------------------------------------------------------------------------


def test_dbr_reproduces_the_distribution_and_forgets_the_record(adult):
    key = ServiceKey.from_seed(5)
    published = DistributionBasedRandomization().publish(adult, random_ids(len(adult), key), key)
    original = np.bincount(adult.codes[SENSITIVE], minlength=14)
    drawn = np.bincount(published.codes[SENSITIVE], minlength=14)
    # f′ ~ Multinomial(N, f/N): χ² goodness of fit with m − 1 degrees of freedom.
    assert stats.chisquare(drawn, original).pvalue > ALPHA / 2

    # The draw ignores the record, so the published value is independent of the public
    # columns although the true one is not.
    def by_sex(table: Table) -> np.ndarray:
        joint = table.codes["sex"] * 14 + table.codes[SENSITIVE]
        return np.bincount(joint, minlength=2 * 14).reshape(2, 14)

    assert stats.chi2_contingency(by_sex(published)).pvalue > ALPHA / 2
    assert stats.chi2_contingency(by_sex(adult)).pvalue < 1e-100

    restored = in_input_order(published, adult)
    for attribute in adult.schema.public:
        assert np.array_equal(restored.codes[attribute.name], adult.codes[attribute.name])


def test_dbr_estimate_is_the_published_count_and_its_interval_covers():
    table = synthetic_table([0.4, 0.3, 0.2, 0.1], 2000, seed=6)
    f = int((table.codes["s"] == 3).sum())
    queries = [Query({}, {"s": "s3"}), Query({"a": ("a0",)}, {"s": "s3"})]
    mechanism = DistributionBasedRandomization()
    repetitions, covered = 400, 0
    for r in range(repetitions):
        key = ServiceKey.from_seed(1000 + r)
        published = mechanism.publish(table, random_ids(len(table), key), key)
        total, conjunctive = DBRReconstruction(
            PublishedCells.from_table(published), ["s"]
        ).estimate_many(queries)
        shown = published.codes["s"] == 3
        assert total.estimate == total.published == shown.sum()
        assert conjunctive.estimate == (shown & (published.codes["a"] == 0)).sum()
        assert conjunctive.low is None and conjunctive.high is None
        covered += total.low <= f <= total.high
    # Clopper–Pearson never covers less than its nominal 95%.
    assert stats.binomtest(covered, repetitions, 0.95, alternative="less").pvalue > ALPHA


# --- Global randomization --------------------------------------------------------------------


def test_global_randomization_transitions_are_p_and_q():
    """One exact binomial test per cell of the m×m matrix, Bonferroni at family α."""
    gamma, m, per_value = 3, 6, 20_000
    mechanism = GlobalRandomization(gamma, m)
    assert mechanism.keep == pytest.approx(1 / gamma)
    assert mechanism.switch == pytest.approx((1 - 1 / gamma) / (m - 1))
    assert np.allclose(mechanism.matrix().sum(axis=1), 1)
    values = np.repeat(np.arange(m), per_value).astype(np.int32)
    key = ServiceKey.from_seed(7)
    published = mechanism.perturb(values, random_ids(len(values), key), key, "s")
    transitions = np.bincount(values * m + published, minlength=m * m).reshape(m, m)
    expected = mechanism.matrix()
    for i in range(m):
        for j in range(m):
            result = stats.binomtest(int(transitions[i, j]), per_value, expected[i, j])
            assert result.pvalue > ALPHA / m**2, (i, j, transitions[i, j] / per_value)


def test_global_randomization_estimator_is_unbiased_with_the_stated_variance():
    gamma, shares = 4, [0.25, 0.2, 0.15, 0.12, 0.1, 0.08, 0.06, 0.04]
    table = synthetic_table(shares, 3000, seed=8)
    mechanism = GlobalRandomization(gamma, len(shares))
    queries = [Query({}, {"s": s}) for s in table.schema["s"].domain]
    queries += [
        Query({"a": (a,)}, {"s": s})
        for a in table.schema["a"].domain
        for s in table.schema["s"].domain
    ]
    truth = np.array([true_count(table, q) for q in queries], dtype=float)
    rows = np.array([true_count(table, Query(q.where, {})) for q in queries], dtype=float)
    repetitions = 300
    estimates = np.empty((repetitions, len(queries)))
    margins = np.empty((repetitions, len(queries)))
    for r in range(repetitions):
        key = ServiceKey.from_seed(2000 + r)
        published = mechanism.publish(table, random_ids(len(table), key), key)
        answers = GlobalRandomizationReconstruction(
            PublishedCells.from_table(published), "s", gamma, len(shares)
        ).estimate_many(queries)
        estimates[r] = [a.estimate for a in answers]
        margins[r] = [(a.high - a.low) / 2 for a in answers]
    p, q = mechanism.keep, mechanism.switch

    def variance(x: np.ndarray) -> np.ndarray:
        return (x * p * (1 - p) + (rows - x) * q * (1 - q)) / (p - q) ** 2

    # Two two-sided checks per query (mean and variance), Bonferroni over all of them.
    tail = ALPHA / (2 * 2 * len(queries))
    z = (estimates.mean(axis=0) - truth) / np.sqrt(variance(truth) / repetitions)
    assert np.abs(z).max() < stats.norm.ppf(1 - tail), (np.abs(z).argmax(), z)
    # (R−1)·s²/σ² ~ χ²(R−1): the spread matches the stated variance at the true count.
    ratio = (repetitions - 1) * estimates.var(axis=0, ddof=1) / variance(truth)
    assert ratio.min() > stats.chi2.ppf(tail, repetitions - 1)
    assert ratio.max() < stats.chi2.ppf(1 - tail, repetitions - 1)
    # The reported error bar is that variance at the clipped estimate.
    plugged = variance(np.clip(estimates, 0, rows))
    assert np.allclose(margins, stats.norm.ppf(0.975) * np.sqrt(plugged))


def test_global_randomization_keeps_public_columns_and_checks_its_parameters(adult):
    key = ServiceKey.from_seed(9)
    published = GlobalRandomization(5, 14).publish(adult, random_ids(len(adult), key), key)
    restored = in_input_order(published, adult)
    for attribute in adult.schema.public:
        assert np.array_equal(restored.codes[attribute.name], adult.codes[attribute.name])
    with pytest.raises(ValueError, match=r"more than γ=5 sensitive values.*m=5"):
        GlobalRandomization(5, 5)
    with pytest.raises(ValueError, match=r"14 values in its domain.*m=20"):
        GlobalRandomization(5, 20).publish(adult, random_ids(len(adult), key), key)
    three = ("v0", "v1", "v2")
    schema = Schema((Attribute("s", True, three), Attribute("t", True, three)))
    column = (np.arange(9) % 3).astype(np.int32)
    two_sensitive = Table(schema, {"s": column, "t": column})
    with pytest.raises(SchemaError, match="one sensitive attribute; the schema has 2"):
        GlobalRandomization(2, 3).publish(two_sensitive, random_ids(9, key), key)
    with pytest.raises(SchemaError, match="one sensitive attribute; the schema has 2"):
        Anatomy(2).publish(two_sensitive, random_ids(9, key), key)


# --- Laplace ---------------------------------------------------------------------------------


def test_laplace_noise_has_scale_m_over_epsilon(adult):
    queries = conjunctive_queries(adult, ["sex", "race", "marital_status", "education"])
    epsilon, key = 0.5, ServiceKey.from_seed(10)
    mechanism = LaplaceCounts(epsilon, len(queries))
    assert mechanism.scale == len(queries) / epsilon
    answers = mechanism.answer(adult, queries, key)
    noise = np.array(
        [a.estimate - true_count(adult, q) for a, q in zip(answers, queries, strict=True)]
    )
    assert np.allclose(noise, mechanism.noise(queries, key), rtol=0, atol=1e-6)
    # A few hundred answers cannot resolve the scale to a few percent; 20,000 more
    # queries' noise can (KS power against a 10% scale error is then near 1).
    many = [Query({"q": (str(i),)}, {"s": "x"}) for i in range(20_000)]
    sample = np.concatenate([noise, mechanism.noise(many, key)])
    assert stats.kstest(sample, "laplace", args=(0, mechanism.scale)).pvalue > ALPHA
    # The interval is the exact central 95% of Lap(b): ±b·ln 20.
    half = mechanism.scale * np.log(20)
    assert all(a.high - a.estimate == pytest.approx(half) for a in answers)
    assert all(
        a.predicate_rows == true_count(adult, Query(q.where, {}))
        for a, q in zip(answers, queries, strict=True)
    )


def test_laplace_budget_counts_distinct_queries(adult):
    key = ServiceKey.from_seed(11)
    mechanism = LaplaceCounts(0.1, 2)
    sales = Query({"race": ("White", "Black")}, {SENSITIVE: "Sales"})
    same = Query({"race": ("Black", "White")}, {SENSITIVE: "Sales"})
    other = Query({"sex": ("Male",)}, {SENSITIVE: "Sales"})
    answers = mechanism.answer(
        adult, [sales, same, sales, other, Query({"sex": ("Male",)}, {})], key
    )
    # Repeats, in any order of their conditions, get the same noise and spend no budget.
    assert answers[0] == answers[1] == answers[2]
    assert answers[4].estimate == true_count(adult, Query({"sex": ("Male",)}, {}))
    with pytest.raises(ValueError, match="3 distinct count queries exceed the budget of m=2"):
        mechanism.answer(adult, [sales, other, Query({}, {SENSITIVE: "Sales"})], key)
    with pytest.raises(ValueError, match="epsilon"):
        LaplaceCounts(0.0, 10)
    with pytest.raises(ValueError, match="at least one query"):
        LaplaceCounts(1.0, 0)


# --- Reproducibility -------------------------------------------------------------------------


def publication(name: str, table: Table, ids: np.ndarray, key: ServiceKey) -> list[np.ndarray]:
    """Every array a mechanism releases, in release order."""
    if name == "anatomy":
        release = Anatomy(5).publish(table, ids, key)
        return [
            *release.qit.values(),
            release.qit_group,
            release.st_group,
            release.st_value,
            release.st_count,
        ]
    if name == "dbr":
        published = DistributionBasedRandomization().publish(table, ids, key)
    elif name == "global":
        published = GlobalRandomization(5, 14).publish(table, ids, key)
    else:
        queries = conjunctive_queries(table, ["sex"])
        answers = LaplaceCounts(0.1, len(queries)).answer(table, queries, key)
        return [np.array([a.estimate for a in answers])]
    return [published.codes[n] for n in table.schema.names]


@pytest.mark.parametrize("name", ["anatomy", "dbr", "global", "laplace"])
def test_same_key_and_ids_give_identical_output(adult, name):
    key = ServiceKey.from_seed(12)
    ids = random_ids(len(adult), key)
    first = publication(name, adult, ids, key)
    again = publication(name, adult, ids.copy(), ServiceKey(key.secret))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    other = publication(name, adult, ids, ServiceKey.from_seed(13))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
