"""Laplace-DP disclosure audit: the closed-form CP_τ against Monte Carlo, and the audit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from service.core.dp_audit import audit_disclosures, closeness_probability, laplace_ratio_cdf
from service.core.table import open_sample, read_table

SAMPLES = 200_000  # Monte Carlo standard error ≤ 0.5/√200000 ≈ 0.0011, so 0.01 is 9 of them


def monte_carlo_ratio(theta: float, phi: float, b: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (theta + rng.laplace(0, b, SAMPLES)) / (phi + rng.laplace(0, b, SAMPLES))


# τ = 0.25 at θ/φ = 0.8 puts the upper end exactly on z = 1; τ = 1 puts the lower end on
# z = 0; τ = 1.5 puts it below 0 (the z < 0 branch); b up to φ makes X change sign.
GRID = list(
    itertools.product(
        [(40, 50), (80, 100), (400, 500), (800, 1000)],
        [2.0, 25.0, 100.0],
        [0.1, 0.25, 0.2499999, 1.0, 1.5],
    )
)


@pytest.mark.parametrize(("counts", "b", "tau"), GRID)
def test_closeness_probability_agrees_with_monte_carlo(counts, b, tau):
    theta, phi = counts
    z = monte_carlo_ratio(theta, phi, b, seed=int(theta + 7 * b + 100 * tau))
    confidence = theta / phi
    simulated = (np.abs(confidence - z) <= tau * confidence).mean()
    assert closeness_probability(theta, phi, b, tau) == pytest.approx(simulated, abs=0.01)


@pytest.mark.parametrize("b", [5.0, 40.0, 200.0])
def test_cdf_is_right_at_and_near_its_singular_points(b):
    theta, phi = 60.0, 100.0
    z = monte_carlo_ratio(theta, phi, b, seed=int(b))
    points = np.array(
        [-1.0, -1 + 1e-7, -1 - 1e-9, -0.5, 0.0, 1e-9, 0.6, 1 - 1e-7, 1.0, 1 + 1e-9, 2.0]
    )
    closed = laplace_ratio_cdf(points, theta, phi, b)
    simulated = np.array([(z <= p).mean() for p in points])
    np.testing.assert_allclose(closed, simulated, atol=0.01)
    assert np.all(np.diff(closed[np.argsort(points)]) >= -1e-9)  # a CDF does not decrease


def test_closeness_tends_to_one_as_groups_grow():
    phi = np.array([100.0, 1000.0, 10_000.0, 100_000.0])
    cp = closeness_probability(0.7 * phi, phi, 50.0, 0.2)
    assert np.all(np.diff(cp) > 0) and cp[-1] > 0.999  # Thm. 2(2)


def test_audit_finds_the_theses_adult_example():
    with open_sample() as stream:
        table, _ = read_table(
            stream, quasi=["education", "occupation", "race", "sex"], sensitive=["income"]
        )
    loud, quiet = audit_disclosures(table, "income", 0.5), audit_disclosures(table, "income", 0.01)
    assert quiet.disclosures == 0  # the thesis: no disclosure at ε = 0.01
    found = {(group, value): (theta, phi) for group, value, theta, phi, _, _ in loud.disclosed}
    # seed 004 Example 2: Prof-school ∧ Prof-specialty ∧ White ∧ Male, 420 of 501 earn >50K.
    assert found[(("Prof-school", "Prof-specialty", "White", "Male"), ">50K")] == (420, 501)
    assert loud.groups_disclosing == len({g for g, *_ in loud.disclosed})
    assert loud.scale == pytest.approx(4.0)
    assert all(cp >= 0.7 and jump >= 3 for *_, jump, cp in loud.disclosed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": 0}, "positive"),
        ({"epsilon": 1, "k_j": 1.0}, "K_J > 1"),
        ({"epsilon": 1, "tau": 0}, "tau"),
    ],
)
def test_audit_parameters_are_validated(kwargs, message):
    with open_sample() as stream:
        table, _ = read_table(stream, quasi=["sex"], sensitive=["income"])
    with pytest.raises(ValueError, match=message):
        audit_disclosures(table, "income", **kwargs)
