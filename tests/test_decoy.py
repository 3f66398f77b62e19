"""Decoy groups: group structure, eligibility, keyed reproducibility, exact binomial law."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from service.core.mechanisms import decoy
from service.core.mechanisms.decoy import DecoyGroups
from service.core.prf import (
    KeyedUniforms,
    ServiceKey,
    keystream64,
    prf64,
    random_ids,
    to_unit_interval,
)
from service.core.schema import Attribute, Schema
from service.core.table import Table
from tests.conftest import synthetic_table


def table_with_counts(counts: list[int], seed: int = 0) -> Table:
    """A table whose sensitive value v appears counts[v] times, rows in random order."""
    rng = np.random.default_rng(seed)
    sensitive = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)
    schema = Schema(
        (
            Attribute("a", False, ("x", "y")),
            Attribute("s", True, tuple(f"s{i}" for i in range(len(counts)))),
        )
    )
    public = rng.integers(0, 2, size=len(sensitive)).astype(np.int32)
    return Table(schema, {"a": public, "s": sensitive})


def eligible_counts(counts: list[int], gamma: int) -> list[int]:
    """Cut counts to the largest share T with γ·T ≤ Σ min(c, T), then trim to a multiple of γ."""
    share = sum(counts) // gamma
    while share * gamma > sum(min(c, share) for c in counts):
        share -= 1
    capped = [min(c, share) for c in counts]
    surplus = sum(capped) % gamma
    for v in range(len(capped) - 1, -1, -1):
        taken = min(surplus, capped[v])
        capped[v] -= taken
        surplus -= taken
    return capped


@pytest.mark.parametrize("grouping", ["size-weighted", "anatomy"])
@pytest.mark.parametrize("gamma", [2, 3, 5, 10])
def test_every_group_has_gamma_distinct_values(grouping, gamma):
    table = synthetic_table([0.2, 0.15, 0.12, 0.1, 0.1, 0.08, 0.08, 0.07, 0.06, 0.04], 3000)
    key = ServiceKey.from_seed(gamma)
    ids = random_ids(len(table), key)
    mechanism = DecoyGroups(gamma, grouping)
    release = mechanism.publish(table, ids, key)
    groups = release.groups["s"]
    assert groups.shape == (len(release.published) // gamma, gamma)
    values = table.codes["s"][release.grouped_rows][groups]
    assert all(len(set(row)) == gamma for row in values.tolist())
    assert sorted(groups.ravel().tolist()) == list(range(len(release.published)))


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=2, max_size=14),
    gamma=st.integers(2, 6),
    seed=st.integers(0, 2**32),
)
def test_optimized_cut_loop_equals_the_plain_rule(counts, gamma, seed):
    counts = eligible_counts(counts, gamma)
    if sum(1 for c in counts if c) < gamma:
        counts = [0] * len(counts)
    key = ServiceKey.from_seed(seed)
    cuts = decoy._size_weighted_cuts(counts, gamma, KeyedUniforms(key, "g", chunk=64))
    flat = to_unit_interval(keystream64(key, "g", 64 * (sum(counts) + 4))).tolist()
    assert cuts.tolist() == plain_size_weighted_cuts(counts, gamma, flat)
    assert np.bincount(cuts.ravel(), minlength=len(counts)).tolist() == counts


def plain_size_weighted_cuts(counts: list[int], gamma: int, uniforms: list[float]) -> list:
    """SPEC §2.1 written plainly: force values at R/γ, then thinned size-weighted draws."""
    count, remaining, position, cuts = list(counts), sum(counts), 0, []
    refresh_below = -1
    while remaining:
        if refresh_below < 0 or remaining < refresh_below:
            snapshot, total = list(count), remaining
            refresh_below = int(remaining * decoy._SNAPSHOT_REFRESH)
        chosen = [v for v, c in enumerate(count) if c and c == remaining // gamma]
        while len(chosen) < gamma:
            target, accept = uniforms[position] * total, uniforms[position + 1]
            position += 2
            value, reached = 0, snapshot[0]
            while reached <= target:
                value += 1
                reached += snapshot[value]
            if accept * snapshot[value] < count[value] and value not in chosen:
                chosen.append(value)
        for value in chosen:
            count[value] -= 1
        remaining -= gamma
        cuts.append(chosen)
    return cuts


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=2, max_size=12), gamma=st.integers(2, 6))
def test_anatomy_takes_the_largest_buckets(counts, gamma):
    counts = eligible_counts(counts, gamma)
    if sum(1 for c in counts if c) < gamma:
        return
    remaining = list(counts)
    for cut in decoy._largest_first_cuts(counts, gamma).tolist():
        largest = sorted(range(len(remaining)), key=lambda v: (-remaining[v], v))[:gamma]
        assert cut == largest
        for v in cut:
            remaining[v] -= 1
    assert sum(remaining) == 0


def test_over_share_values_are_suppressed_and_reported():
    # 50 rows of s0 and 5 of each of s1..s10 at γ=5: the largest feasible share is
    # T=12 (γ·12 ≤ 50+12), so 38 rows of s0 are suppressed and 62 is trimmed to 60.
    table = table_with_counts([50] + [5] * 10)
    key = ServiceKey.from_seed(1)
    ids = random_ids(len(table), key)
    release = DecoyGroups(5).publish(table, ids, key)
    assert release.suppressed == {"s": {"s0": 38}}
    assert len(release.trimmed_lines) == 2
    assert len(release.published) == 60
    accounted = (
        set(release.published.lines) | set(release.suppressed_lines) | set(release.trimmed_lines)
    )
    assert accounted == set(range(len(table)))
    # The suppressed rows of s0 are those with the largest random ids.
    rank = decoy.id_rank(ids)
    s0 = np.flatnonzero(table.codes["s"] == 0)
    assert set(release.suppressed_lines) == set(s0[np.argsort(rank[s0])][12:])


def test_eligible_data_is_published_whole_except_the_remainder():
    table = synthetic_table([0.2, 0.2, 0.2, 0.2, 0.2], 1003)
    counts = np.bincount(table.codes["s"]).tolist()
    key = ServiceKey.from_seed(2)
    release = DecoyGroups(5).publish(table, random_ids(len(table), key), key)
    expected = sum(eligible_counts(counts, 5))
    assert len(release.published) == expected
    assert len(release.published) + sum(release.suppressed["s"].values()) + len(
        release.trimmed_lines
    ) == len(table)


def test_grouping_ignores_public_columns(adult):
    key = ServiceKey.from_seed(11)
    ids = random_ids(len(adult), key)
    rng = np.random.default_rng(0)
    shuffled = Table(
        adult.schema,
        {
            name: rng.permutation(codes) if not adult.schema[name].sensitive else codes
            for name, codes in adult.codes.items()
        },
    )
    first = DecoyGroups(5).publish(adult, ids, key)
    second = DecoyGroups(5).publish(shuffled, ids, key)
    assert np.array_equal(first.groups["occupation"], second.groups["occupation"])
    assert np.array_equal(first.published.codes["occupation"], second.published.codes["occupation"])
    assert not np.array_equal(first.published.codes["sex"], second.published.codes["sex"])


def test_same_key_and_ids_reproduce_the_publication_exactly(adult):
    key = ServiceKey.from_seed(12)
    ids = random_ids(len(adult), key)
    first = DecoyGroups(5).publish(adult, ids, key)
    again = DecoyGroups(5).publish(adult, ids.copy(), ServiceKey(key.secret))
    for name in adult.schema.names:
        assert np.array_equal(first.published.codes[name], again.published.codes[name])
    other = DecoyGroups(5).publish(adult, ids, ServiceKey.from_seed(13))
    same = first.published.codes["occupation"] == other.published.codes["occupation"]
    assert same.mean() < 0.5


def test_published_value_is_the_keyed_draw_from_the_group(adult):
    key = ServiceKey.from_seed(14)
    ids = random_ids(len(adult), key)
    release = DecoyGroups(5).publish(adult, ids, key)
    kept = release.grouped_rows
    kept_ids, values = ids[kept], adult.codes["occupation"][kept]
    draws = prf64(key, "decoy draw:occupation", kept_ids) % np.uint64(5)
    by_line = dict(
        zip(
            release.published.lines.tolist(),
            release.published.codes["occupation"].tolist(),
            strict=True,
        )
    )
    for group in release.groups["occupation"][:500]:
        options = sorted(values[group].tolist())
        for member in group:
            assert by_line[int(adult.lines[kept[member]])] == options[int(draws[member])]


def test_output_order_is_unrelated_to_input_order(adult):
    key = ServiceKey.from_seed(15)
    release = DecoyGroups(5).publish(adult, random_ids(len(adult), key), key)
    rho = stats.spearmanr(np.arange(len(release.published)), release.published.lines).statistic
    # Under a random order ρ·√(n−1) is about standard normal; 4.4 is its 10⁻⁵ two-sided quantile.
    assert abs(rho) * np.sqrt(len(release.published) - 1) < 4.4
    assert release.published.schema.names == adult.schema.names


def test_several_sensitive_attributes_are_grouped_independently():
    rng = np.random.default_rng(3)
    n = 2000
    schema = Schema(
        (
            Attribute("a", False, ("x", "y")),
            Attribute("s", True, tuple("abcdefgh")),
            Attribute("t", True, tuple("pqrstu")),
        )
    )
    table = Table(
        schema,
        {
            "a": rng.integers(0, 2, n).astype(np.int32),
            "s": rng.integers(0, 8, n).astype(np.int32),
            "t": rng.integers(0, 6, n).astype(np.int32),
        },
    )
    key = ServiceKey.from_seed(4)
    release = DecoyGroups(4).publish(table, random_ids(n, key), key)
    kept = release.grouped_rows
    for name in ("s", "t"):
        values = table.codes[name][kept][release.groups[name]]
        assert all(len(set(row)) == 4 for row in values.tolist())

    # Different partitions: few pairs grouped together for s are grouped together for t.
    def pairs(groups):
        return {frozenset(p) for g in groups.tolist() for p in itertools.combinations(g, 2)}

    assert len(pairs(release.groups["s"]) & pairs(release.groups["t"])) < 0.05 * len(kept)


def test_published_count_follows_binomial():
    """Over 2,000 publications with fresh keys, f′_s ~ Binomial(γ·f_s, 1/γ).

    Pearson χ² goodness of fit for two values (f = 10, the eligibility bound at
    N = 50, γ = 5, so in every group; and f = 2), each at α = 0.005, family
    α = 0.01; bins with expected count below 5 are pooled into the tails.
    """
    counts = [10, 9, 8, 7, 6, 5, 3, 2]
    gamma, repetitions = 5, 2000
    table = table_with_counts(counts)
    observed = {0: [], 7: []}
    for repetition in range(repetitions):
        key = ServiceKey.from_seed(repetition)
        published = DecoyGroups(gamma).publish(table, random_ids(len(table), key), key)
        assert len(published.published) == 50
        tally = np.bincount(published.published.codes["s"], minlength=len(counts))
        for value in observed:
            observed[value].append(tally[value])
    for value, samples in observed.items():
        n = gamma * counts[value]
        pmf = stats.binom.pmf(np.arange(n + 1), n, 1 / gamma) * repetitions
        histogram = np.bincount(samples, minlength=n + 1).astype(float)
        expected_bins, observed_bins = pool_small_bins(pmf, histogram)
        result = stats.chisquare(observed_bins, expected_bins)
        assert result.pvalue > 0.005, (value, result)
        assert np.mean(samples) == pytest.approx(
            counts[value], abs=4 * np.sqrt(counts[value] * (gamma - 1) / gamma / repetitions)
        )


def pool_small_bins(expected: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge each run of bins with expected count < 5 into its neighbour toward the mode."""
    mode = int(np.argmax(expected))
    low, high = 0, len(expected) - 1
    while expected[: low + 1].sum() < 5:
        low += 1
    while expected[high:].sum() < 5:
        high -= 1
    assert low < mode < high
    exp = np.concatenate(
        [[expected[: low + 1].sum()], expected[low + 1 : high], [expected[high:].sum()]]
    )
    obs = np.concatenate(
        [[observed[: low + 1].sum()], observed[low + 1 : high], [observed[high:].sum()]]
    )
    return exp, obs


def test_size_weighted_mixes_partners_closer_to_uniform_than_anatomy(adult):
    """Partner frequencies P(s in group | own value s′) vs the model's (γ−1)f_s/(N−f_s)."""

    def mixing_error(grouping: str) -> float:
        key = ServiceKey.from_seed(16)
        ids = random_ids(len(adult), key)
        release = DecoyGroups(5, grouping).publish(adult, ids, key)
        values = adult.codes["occupation"][release.grouped_rows][release.groups["occupation"]]
        size = len(adult.schema["occupation"].domain)
        together = np.zeros((size, size))
        for row in values.tolist():
            for a in row:
                for b in row:
                    together[a, b] += 1
        f = np.diag(together).copy()
        n = f.sum()
        model = np.broadcast_to(4 * f / (n - f), (size, size))
        observed = together / np.where(f[:, None] > 0, f[:, None], 1)
        off = ~np.eye(size, dtype=bool) & (f[:, None] > 0) & (f[None, :] > 0)
        weight = (f[:, None] * f[None, :])[off]
        return float(np.average(np.abs(observed[off] - model[off]) / model[off], weights=weight))

    size_weighted, anatomy = mixing_error("size-weighted"), mixing_error("anatomy")
    assert size_weighted < anatomy / 2, (size_weighted, anatomy)


@pytest.mark.parametrize(
    ("gamma", "grouping", "error", "message"),
    [
        (1, "size-weighted", ValueError, "at least 2"),
        (2.5, "size-weighted", TypeError, "integer"),
        (True, "size-weighted", TypeError, "integer"),
        (5, "random", ValueError, "size-weighted, anatomy"),
    ],
)
def test_parameters_are_validated(gamma, grouping, error, message):
    with pytest.raises(error, match=message):
        DecoyGroups(gamma, grouping)


def test_too_few_distinct_values_fail_clearly():
    table = table_with_counts([10, 10, 10])
    key = ServiceKey.from_seed(0)
    with pytest.raises(ValueError, match="'s' has 3 distinct values in the data; groups of γ=5"):
        DecoyGroups(5).publish(table, random_ids(len(table), key), key)


def test_group_refuses_ineligible_input():
    values = np.array([0, 0, 0, 0, 1, 2], dtype=np.int32)
    with pytest.raises(ValueError, match="not eligible"):
        DecoyGroups(2).group(random_ids(6), values, ServiceKey.from_seed(0), "s")
