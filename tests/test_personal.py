"""Personal groups: perturbation law, the (λ, δ) test, SPS, and unbiased reconstruction."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from service.core.guarantees import lambda_limit, trial_limit
from service.core.mechanisms.personal import PersonalGroups, UniformPerturbation
from service.core.mechanisms.personal_reconstruction import PersonalReconstruction
from service.core.merge import fit_value_map
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query
from service.core.schema import Attribute, Schema, SchemaError
from service.core.table import Table, open_sample, read_table


def test_perturbation_matrix_is_what_the_formula_says():
    """Empirical transitions vs P[i, j] = p·[i = j] + (1−p)/m.

    One exact binomial test per cell, Bonferroni over the m² cells at family α = 0.001.
    """
    m, p, per_value = 5, 0.3, 20_000
    values = np.repeat(np.arange(m), per_value).astype(np.int32)
    key = ServiceKey.from_seed(1)
    perturbation = UniformPerturbation(p, m)
    published = perturbation.perturb(values, random_ids(len(values), key), key, "s")
    transitions = np.bincount(values * m + published, minlength=m * m).reshape(m, m)
    expected = perturbation.matrix()
    assert np.allclose(expected.sum(axis=1), 1)
    assert expected[0, 0] == pytest.approx(p + (1 - p) / m)
    for i in range(m):
        for j in range(m):
            result = stats.binomtest(int(transitions[i, j]), per_value, expected[i, j])
            assert result.pvalue > 0.001 / m**2, (i, j, transitions[i, j] / per_value)


def test_perturbation_is_keyed():
    values = np.arange(1000, dtype=np.int32) % 4
    key = ServiceKey.from_seed(2)
    ids = random_ids(1000, key)
    perturbation = UniformPerturbation(0.5, 4)
    first = perturbation.perturb(values, ids, key, "s")
    assert np.array_equal(first, perturbation.perturb(values, ids, ServiceKey(key.secret), "s"))
    other = perturbation.perturb(values, ids, ServiceKey.from_seed(3), "s")
    assert (first != other).mean() > 0.2


def grouped_table(seed: int = 0, n: int = 4000) -> Table:
    """Public a (4 values) × b (3 values); s (4 values) depends on a."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 4, n)
    b = rng.integers(0, 3, n)
    distributions = np.array(
        [[0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.1, 0.1, 0.7]]
    )
    s = (rng.random(n)[:, None] > distributions[a].cumsum(axis=1)).sum(axis=1)
    schema = Schema(
        (
            Attribute("a", False, ("a0", "a1", "a2", "a3")),
            Attribute("b", False, ("b0", "b1", "b2")),
            Attribute("s", True, ("s0", "s1", "s2", "s3")),
        )
    )
    return Table(
        schema, {"a": a.astype(np.int32), "b": b.astype(np.int32), "s": s.astype(np.int32)}
    )


@pytest.mark.parametrize("budget", ["adaptive", "conservative"])
def test_sps_never_exceeds_the_limit_and_keeps_frequencies(budget):
    table = grouped_table()
    mechanism = PersonalGroups(0.5, 0.3, 0.3, budget)
    key = ServiceKey.from_seed(4)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    plain, audit = release.plain, release.audit
    assert (~plain.passed).sum() > 0, "the table must have groups over their limit"
    assert audit.passed.all()
    limit_used = (
        plain.limit
        if budget == "adaptive"
        else np.full(len(plain.sizes), trial_limit(1.0, 0.5, 4, 0.3, 0.3))
    )
    assert (audit.trials <= np.floor(limit_used)).all()
    values = table.codes["s"]
    for g in np.flatnonzero(audit.trials < plain.sizes):
        members = release.group_of_row == g
        strata = np.bincount(values[members], minlength=4)
        sample = np.bincount(values[members & release.sampled], minlength=4)
        n, size, k = sample.sum(), members.sum(), (strata > 0).sum()
        assert n == audit.trials[g]
        # Fact 1: one per value, then proportional shares rounded to floor or ceiling.
        share = 1 + (n - k) * (strata - 1) / (size - k)
        present = strata > 0
        assert (np.floor(share[present] + 1e-9) <= sample[present]).all()
        assert (sample[present] <= np.ceil(share[present] - 1e-9)).all()
        # The sample itself passes the test with its own largest frequency.
        assert n <= trial_limit(sample.max() / n, 0.5, 4, 0.3, 0.3)
        assert sample.max() / n <= strata.max() / size + 1 / n


def test_unsampled_rows_copy_a_sampled_value_of_their_own_stratum():
    table = grouped_table(seed=1)
    key = ServiceKey.from_seed(5)
    release = PersonalGroups(0.5, 0.3, 0.3).publish(table, random_ids(len(table), key), key)
    published = np.empty(len(table), dtype=np.int64)
    published[release.published.lines] = release.published.codes["s"]
    values = table.codes["s"]
    assert release.borrowed_rows == 0
    for g in np.unique(release.group_of_row):
        for x in range(4):
            stratum = (release.group_of_row == g) & (values == x)
            if not stratum.any():
                continue
            drawn = set(published[stratum & release.sampled].tolist())
            assert drawn and set(published[stratum].tolist()) <= drawn
    for name in ("a", "b"):  # public values are published untouched, row for row
        assert np.array_equal(
            release.published.codes[name], table.codes[name][release.published.lines]
        )


def test_groups_with_fewer_trials_than_values_borrow_and_say_so():
    # m = 12 values, p = 0.9, λ = 0.6, δ = 0.3: s_g(f = 1) ≈ 7.5, so a group holding
    # all 12 values gets 7 trials and five strata copy from another value.
    rng = np.random.default_rng(6)
    schema = Schema(
        (Attribute("a", False, ("x",)), Attribute("s", True, tuple(f"v{i}" for i in range(12))))
    )
    table = Table(
        schema,
        {"a": np.zeros(600, np.int32), "s": rng.permutation(np.arange(600) % 12).astype(np.int32)},
    )
    key = ServiceKey.from_seed(7)
    release = PersonalGroups(0.9, 0.6, 0.3, "conservative").publish(
        table, random_ids(600, key), key
    )
    assert release.audit.trials[0] == 7 == math.floor(trial_limit(1.0, 0.9, 12, 0.6, 0.3))
    assert release.borrowed_rows == 5 * 50
    assert len(release.published) == 600


def mle_bias_in_standard_errors(budget: str, repetitions: int = 200) -> np.ndarray:
    table = grouped_table(seed=2, n=3000)
    queries = [
        Query({"a": ("a0",)}, {"s": "s0"}),
        Query({"a": ("a3",), "b": ("b1",)}, {"s": "s3"}),
        Query({"b": ("b2",)}, {"s": "s1"}),
        Query({}, {"s": "s2"}),
    ]
    truth = []
    for query in queries:
        rows = np.ones(len(table), dtype=bool)
        for column, labels in query.where.items():
            rows &= table.codes[column] == table.schema[column].domain.index(labels[0])
        truth.append(
            (rows & (table.codes["s"] == table.schema["s"].domain.index(query.value["s"]))).sum()
        )
    estimates = np.empty((repetitions, len(queries)))
    for r in range(repetitions):
        key = ServiceKey.from_seed(100 + r)
        release = PersonalGroups(0.5, 0.3, 0.3, budget).publish(
            table, random_ids(len(table), key), key
        )
        reconstruction = PersonalReconstruction(
            PublishedCells.from_table(release.published), "s", 0.5, 4, budget=budget
        )
        estimates[r] = [e.estimate for e in reconstruction.estimate_many(queries)]
    standard_error = estimates.std(axis=0, ddof=1) / np.sqrt(repetitions)
    return (estimates.mean(axis=0) - np.asarray(truth)) / standard_error


@pytest.mark.parametrize("budget", ["none", "adaptive", "conservative"])
def test_mle_is_unbiased_over_repetitions(budget):
    """|mean − truth| within the Bonferroni normal quantile of 12 checks at family α = 0.001."""
    z = stats.norm.ppf(1 - 0.001 / (2 * 12))
    assert (np.abs(mle_bias_in_standard_errors(budget)) < z).all()


def test_mle_matches_the_closed_form():
    table = grouped_table(seed=3)
    key = ServiceKey.from_seed(8)
    release = PersonalGroups(0.4, 0.3, 0.3, "none").publish(table, random_ids(len(table), key), key)
    cells = PublishedCells.from_table(release.published)
    estimate = PersonalReconstruction(cells, "s", 0.4, 4, budget="none").estimate(
        Query({"a": ("a1",)}, {"s": "s1"})
    )
    rows = release.published.codes["a"] == 1
    observed = (rows & (release.published.codes["s"] == 1)).sum()
    assert estimate.estimate == pytest.approx((observed / rows.sum() - 0.6 / 4) / 0.4 * rows.sum())
    assert estimate.low < estimate.estimate < estimate.high


def test_adult_picture():
    """The thesis's ADULT setting: merging shrinks the groups, plain perturbation fails most of
    them and nearly all records, SPS passes every group (figures in the closing note)."""
    with open_sample() as stream:
        table, _ = read_table(
            stream, quasi=["education", "occupation", "race", "sex"], sensitive=["income"]
        )
    value_map = fit_value_map(table, "income")
    counts = value_map.class_counts()
    assert math.prod(v for v, _ in counts.values()) == 2240
    assert math.prod(c for _, c in counts.values()) == 84
    assert counts["education"] == (16, 7) and counts["race"] == (5, 2)
    key = ServiceKey.from_seed(9)
    release = PersonalGroups(0.5, 0.3, 0.3, "adaptive", value_map).publish(
        table, random_ids(len(table), key), key
    )
    assert release.plain.groups_failing > 0.5
    assert release.plain.records_failing > 0.98
    assert release.audit.passed.all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1.2, 0.3, 0.3), r"retention probability p must lie in \(0, 1\)"),
        ((0.5, 0.3, 1.0), r"delta must lie in \(0, 1\)"),
        ((0.5, 2.0, 0.3), r"lambda must lie in \(0, 1.5\]"),
        ((0.5, 0.3, 0.3, "sometimes"), "budget must be one of"),
    ],
)
def test_parameters_are_validated(args, message):
    with pytest.raises(ValueError, match=message):
        PersonalGroups(*args)


def test_lambda_limit_depends_on_the_domain():
    assert lambda_limit(0.5, 2) == pytest.approx(1.5)
    table = grouped_table()
    key = ServiceKey.from_seed(0)
    with pytest.raises(ValueError, match=r"lambda must lie in \(0, 1.25\]"):
        PersonalGroups(0.5, 1.4, 0.3).publish(table, random_ids(len(table), key), key)


def test_parameters_that_leave_a_group_no_trial_are_refused():
    table = grouped_table()
    key = ServiceKey.from_seed(0)
    with pytest.raises(ValueError, match="less than one record"):
        PersonalGroups(0.9, 1.0, 0.9).publish(table, random_ids(len(table), key), key)


def test_one_sensitive_attribute_and_a_matching_map():
    schema = Schema(
        (
            Attribute("a", False, ("x",)),
            Attribute("s", True, ("p", "q")),
            Attribute("t", True, ("u", "v")),
        )
    )
    table = Table(schema, {n: np.zeros(10, np.int32) for n in ("a", "s", "t")})
    with pytest.raises(SchemaError, match="one sensitive attribute"):
        PersonalGroups(0.5, 0.3, 0.3).audit(table)
    value_map = fit_value_map(grouped_table(), "s")
    other = Table(
        Schema((Attribute("a", False, ("a0",)), Attribute("z", True, ("p", "q")))),
        {"a": np.zeros(4, np.int32), "z": np.zeros(4, np.int32)},
    )
    with pytest.raises(SchemaError, match="fitted for 's', not 'z'"):
        PersonalGroups(0.5, 0.3, 0.3, value_map=value_map).audit(other)
