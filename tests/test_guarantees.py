"""Exact guarantees against independent computations and the seed notes' tables."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from service.core.guarantees import (
    chebyshev_thresholds,
    deviation_probability,
    privacy_threshold,
    utility_threshold,
)


def brute_force(f: int, gamma: int, epsilon: str, strict: bool) -> float:
    """Sum the binomial pmf over the outcomes whose error exceeds ε·f, judged exactly."""
    eps = Fraction(epsilon)
    n = gamma * f
    total = 0.0
    for x in range(n + 1):
        error = abs(Fraction(x - f))
        if (error > eps * f) if strict else (error >= eps * f):
            total += stats.binom.pmf(x, n, 1 / gamma)
    return total


@pytest.mark.parametrize("gamma", [2, 3, 5, 10])
@pytest.mark.parametrize("epsilon", ["0.1", "0.2", "0.3", "0.5", "1"])
@pytest.mark.parametrize("strict", [True, False])
def test_deviation_probability_matches_a_brute_force_sum(gamma, epsilon, strict):
    counts = np.array([1, 2, 3, 4, 5, 7, 10, 13, 20, 33, 50])
    ours = deviation_probability(counts, gamma, float(epsilon), strict=strict)
    expected = [brute_force(int(f), gamma, epsilon, strict) for f in counts]
    np.testing.assert_allclose(ours, expected, rtol=1e-9, atol=1e-12)


def test_the_papers_worked_example():
    # f = 5, γ = 10, ε = 0.3: stays within ±30% with probability ≈ 0.52 (seed 001
    # Example 2); the paper's "deviates with probability 0.52" is a typo for 0.48.
    within = 1 - deviation_probability(5, 10, 0.3)[()]
    assert within == pytest.approx(0.5199, abs=1e-4)


def test_rational_boundaries_do_not_slip():
    # 0.29·100 is 28.999999999999996 in floats; the window must still be [71, 129].
    exact = brute_force(100, 5, "0.29", strict=True)
    assert deviation_probability(100, 5, 0.29)[()] == pytest.approx(exact, rel=1e-12)


# T_P rows of seed notes 001 §6.2 (ε = 0.3), f = 1, 2, 3, 4, 5, 10, 20, 50.
NOTES_TP = {
    2: [0.500, 0.625, 0.688, 0.289, 0.344, 0.115, 0.038, 0.002],
    5: [0.590, 0.698, 0.750, 0.402, 0.454, 0.214, 0.103, 0.014],
    10: [0.613, 0.715, 0.764, 0.429, 0.480, 0.241, 0.124, 0.021],
}


@pytest.mark.parametrize("gamma", sorted(NOTES_TP))
def test_privacy_curve_matches_the_notes_table(gamma):
    counts = np.array([1, 2, 3, 4, 5, 10, 20, 50])
    np.testing.assert_allclose(
        deviation_probability(counts, gamma, 0.3), NOTES_TP[gamma], atol=6e-4
    )


def test_privacy_threshold_is_the_minimum_over_small_counts():
    guarantee = privacy_threshold(5, 0.3, 10)
    curve = [brute_force(f, 5, "0.3", strict=True) for f in range(1, 11)]
    assert guarantee.threshold == pytest.approx(min(curve), rel=1e-9)
    assert guarantee.worst_count == 1 + int(np.argmin(curve)) == 10
    np.testing.assert_allclose(guarantee.curve, curve, rtol=1e-9)
    # T_P is not monotone in f (window rounding): f = 3 is more private than f = 4.
    assert curve[2] > curve[3]


# Exact T_f of seed notes 001 §6.1 for γ = 2, 3, 5, 10.
NOTES_TF = {
    (0.02, 0.1): [281, 371, 441, 491],
    (0.02, 0.2): [71, 91, 111, 126],
    (0.02, 0.3): [31, 41, 51, 54],
    (0.05, 0.1): [201, 261, 311, 351],
    (0.05, 0.2): [51, 66, 81, 91],
    (0.05, 0.3): [24, 31, 34, 41],
}


@pytest.mark.parametrize(("tolerance", "epsilon"), sorted(NOTES_TF))
def test_utility_threshold_matches_the_notes_table(tolerance, epsilon):
    found = [utility_threshold(g, epsilon, tolerance).threshold for g in (2, 3, 5, 10)]
    assert found == NOTES_TF[(tolerance, epsilon)]


def test_utility_threshold_holds_for_every_larger_count_checked_independently():
    gamma, epsilon, tolerance = 5, 0.2, 0.02
    threshold = utility_threshold(gamma, epsilon, tolerance).threshold
    counts = np.arange(1, 3000)
    n = gamma * counts
    lower = stats.binom.cdf(np.floor(0.8 * counts + 1e-9), n, 1 / gamma)
    upper = stats.binom.sf(np.ceil(1.2 * counts - 1e-9) - 1, n, 1 / gamma)
    failing = counts[(lower + upper) > tolerance]
    assert threshold == failing.max() + 1


def test_chebyshev_figures_show_the_papers_error():
    figures = chebyshev_thresholds(10, 0.2, 0.02)
    assert figures["paper"] == pytest.approx(math.sqrt(125))  # seed 001 Example 1: T_f = 11
    assert figures["corrected"] == pytest.approx(1125)
    assert utility_threshold(10, 0.2, 0.02).threshold == 126  # the truth lies in between


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: deviation_probability(0, 5, 0.3), "at least 1"),
        (lambda: deviation_probability(5, 1, 0.3), "gamma"),
        (lambda: deviation_probability(5, 5, -0.3), "positive"),
        (lambda: privacy_threshold(5, 0.3, 0), "alpha"),
        (lambda: utility_threshold(5, 0.3, 1.5), "T_E"),
    ],
)
def test_bad_parameters_are_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call()
