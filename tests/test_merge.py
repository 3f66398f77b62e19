"""χ² merging of public values into classes for personal groups."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from service.core.merge import ValueMap, chi_square_statistics, fit_value_map, merged_classes
from service.core.schema import Attribute, Schema, SchemaError
from service.core.table import Table


def test_statistic_is_pearsons_two_sample_chi_square():
    rng = np.random.default_rng(0)
    for _ in range(20):
        counts = rng.integers(0, 60, size=(4, 6))
        counts[:, 1] = 0  # an empty bin is skipped, not divided by
        statistic, degrees = chi_square_statistics(counts)
        for i in range(4):
            for k in range(i + 1, 4):
                pair = counts[[i, k]][:, counts[[i, k]].sum(axis=0) > 0]
                expected = stats.chi2_contingency(pair, correction=False).statistic
                assert statistic[i, k] == pytest.approx(expected, rel=1e-9)
                assert degrees[i, k] == pair.shape[1]  # the thesis's df = m, less empty bins


def test_values_with_the_same_effect_merge_transitively():
    # a ~ b and b ~ c with a, c distinguishable: one component {a, b, c}; d stands apart.
    counts = np.array([[50, 50], [62, 38], [74, 26], [5, 95]])
    statistic, _ = chi_square_statistics(counts)
    critical = stats.chi2.isf(0.05, 2)
    assert statistic[0, 1] <= critical and statistic[1, 2] <= critical
    assert statistic[0, 2] > critical
    assert merged_classes(["a", "b", "c", "d"], counts, 0.05) == [("a", "b", "c"), ("d",)]


def adult_like_table() -> Table:
    rng = np.random.default_rng(1)
    n = 6000
    color = rng.integers(0, 3, n)  # no effect on s
    job = rng.integers(0, 4, n)  # jobs 0 and 1 behave alike, 2 and 3 differ
    p_high = np.array([0.2, 0.2, 0.5, 0.8])[job]
    s = (rng.random(n) < p_high).astype(np.int32)
    schema = Schema(
        (
            Attribute("color", False, ("blue", "green", "red")),
            Attribute("job", False, ("clerk", "cook", "doctor", "judge")),
            Attribute("income", True, ("high", "low")),
        )
    )
    return Table(
        schema,
        {"color": color.astype(np.int32), "job": job.astype(np.int32), "income": 1 - s},
    )


def test_fit_merges_irrelevant_values_and_keeps_relevant_ones(tmp_path):
    value_map = fit_value_map(adult_like_table(), "income")
    assert value_map.classes["color"] == (("blue", "green", "red"),)
    assert value_map.classes["job"] == (("clerk", "cook"), ("doctor",), ("judge",))
    assert value_map.class_counts() == {"color": (3, 1), "job": (4, 3)}
    path = tmp_path / "merge.toml"
    path.write_text(value_map.to_toml())
    assert ValueMap.load(path) == value_map


def test_unseen_values_form_their_own_classes():
    value_map = ValueMap("income", ("high", "low"), 0.05, {"job": (("clerk", "cook"),)})
    per_value, labels = value_map.classes_of("job", ("clerk", "cook", "pilot"))
    assert per_value.tolist() == [0, 0, 1]
    assert labels == ["clerk|cook", "pilot"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[other]\n", "no \\[merge\\] table"),
        ("[merge]\nsensitive = 'income'\n", "missing or mangles"),
        (
            "[merge]\nsensitive = 'i'\nsensitive_domain = ['a']\nalpha = 0.05\n"
            "[merge.classes]\njob = [['a', 'b'], ['b']]\n",
            "lists a value twice",
        ),
        ("[merge\n", "not valid TOML"),
    ],
)
def test_bad_merge_maps_are_explained(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SchemaError, match=message):
        ValueMap.load(path)


def test_fit_refuses_a_public_column_and_a_bad_alpha():
    table = adult_like_table()
    with pytest.raises(SchemaError, match="not a sensitive attribute"):
        fit_value_map(table, "job")
    with pytest.raises(ValueError, match="alpha"):
        fit_value_map(table, "income", alpha=1.5)
