"""The m×m transition models of decoy cutting rules (service/core/mixing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.mechanisms import decoy
from service.core.mixing import REPLAY_GROUPS, partner_weights, transition_model
from service.core.prf import KeyedUniforms, ServiceKey

# Occupation on Adult (45,222 rows), two Craft-repair fewer so that N is a multiple of 5.
ADULT = [5540, 14, 6018, 5984, 1480, 2046, 2970, 4808, 232, 6008, 976, 5408, 1420, 2316]


def pair_counts(cuts: np.ndarray, size: int) -> np.ndarray:
    """G[s, s′]: groups holding both s and s′."""
    pairs = np.zeros((size, size))
    for left in range(cuts.shape[1]):
        for right in range(cuts.shape[1]):
            if left != right:
                np.add.at(pairs, (cuts[:, left], cuts[:, right]), 1.0)
    return pairs


@pytest.mark.parametrize("gamma", [2, 3, 4, 5])
def test_product_form_has_the_cut_margins_and_stochastic_rows(gamma):
    counts = np.asarray(ADULT, dtype=float)
    if gamma == 2:
        counts[0] = 0.9 * (counts.sum() - counts[0])  # near half of N: the larger root
    a = partner_weights(counts, gamma)
    assert a * (a.sum() - a) == pytest.approx((gamma - 1) * counts, rel=1e-10)
    model = transition_model(counts, gamma, "size-weighted")
    assert model.matrix.sum(axis=1) == pytest.approx(np.ones(len(counts)), rel=1e-12)
    assert np.diag(model.matrix) == pytest.approx(np.full(len(counts), 1 / gamma))
    # Stationary: fᵀM = f, so the whole table's estimate is the published counts.
    assert counts @ model.matrix == pytest.approx(counts, rel=1e-9)


@pytest.mark.parametrize("grouping", ["size-weighted", "anatomy"])
def test_derivative_matches_finite_differences(grouping):
    # Anatomy's at a tenth of Adult: replays of 900 groups, not the capped 5,000.
    counts = np.asarray(ADULT, dtype=float) * (1 if grouping == "size-weighted" else 0.1)
    model = transition_model(counts, 5, grouping)
    for i in (0, 2, 8):
        # The size-weighted model is smooth; Anatomy's is piecewise linear, and its
        # derivative a central difference of the replay, checked at the same step.
        step = 1.0 if grouping == "size-weighted" else 0.02 * counts[i]
        up, down = counts.copy(), counts.copy()
        up[i] += step
        down[i] -= step
        numeric = (
            transition_model(up, 5, grouping).matrix - transition_model(down, 5, grouping).matrix
        ) / (2 * step)
        assert model.derivative[i] == pytest.approx(numeric, abs=1e-9, rel=1e-5)


def test_product_form_matches_simulated_size_weighted_cuts():
    """M[s′→s] of the batch cut, averaged over 40 runs, against the product form and the
    2×2 model's t_s, on pairs of values with at least 5% of the rows each. A tolerance of
    1% plus four standard errors of the simulated mean (a run's pair count is about
    Poisson, relative SE 1/√(40·G)) holds for the product form everywhere and fails for
    the 2×2 rates somewhere."""
    counts = np.asarray(ADULT)
    runs = 40
    simulated = np.zeros((len(counts), len(counts)))
    for seed in range(runs):
        uniforms = KeyedUniforms(ServiceKey.from_seed(seed), "mixing test")
        simulated += pair_counts(decoy._size_weighted_cuts(counts.tolist(), 5, uniforms), 14)
    simulated /= runs
    large = counts >= 0.05 * counts.sum()
    pairs = np.outer(large, large) & ~np.eye(len(counts), dtype=bool)
    tolerance = 0.01 + 4 / np.sqrt(runs * simulated[pairs])
    simulated /= 5 * counts[:, None]  # M[s′→s] = G(s, s′)/(γ·f_{s′})
    product = transition_model(counts, 5, "size-weighted").matrix
    assert (np.abs(product[pairs] / simulated[pairs] - 1) <= tolerance).all()
    n = counts.sum()
    uniform = np.broadcast_to(4 * counts / (5 * (n - counts)), product.shape)
    assert (np.abs(uniform[pairs] / simulated[pairs] - 1) > tolerance).any()


def test_largest_first_model_replays_the_rule():
    counts = [340, 330, 300, 300, 250, 230, 150, 100]  # 400 groups of 5: replayed as is
    assert sum(counts) // 5 <= REPLAY_GROUPS
    model = transition_model(counts, 5, "anatomy")
    pairs = pair_counts(decoy._largest_first_cuts(counts, 5), len(counts))
    expected = pairs / (5 * np.asarray(counts, dtype=float)[:, None])
    np.fill_diagonal(expected, 1 / 5)
    assert model.matrix == pytest.approx(expected)


def test_largest_first_model_scales_large_counts_down():
    counts = np.asarray(ADULT, dtype=float) * 20
    model = transition_model(counts, 5, "anatomy")
    assert model.matrix.sum(axis=1) == pytest.approx(np.ones(len(counts)), abs=1e-9)
    # Largest-first never puts some values together (Armed-Forces, 1, meets neither
    # Machine-op-inspct, 6, nor Prof-specialty, 9); size-weighted cuts mix every pair.
    assert model.matrix[1, 6] == model.matrix[1, 9] == 0
    assert (transition_model(counts, 5, "size-weighted").matrix > 0).all()


@pytest.mark.parametrize("grouping", ["size-weighted", "anatomy"])
def test_a_value_at_the_eligibility_bound_makes_the_model_singular(grouping):
    assert transition_model([100, 100, 100, 100, 100], 5, grouping).capped  # every group
    counts = np.asarray([2000, 1600, 1600, 1600, 1600, 1600], dtype=float)  # 2000 = N/5
    assert transition_model(counts, 5, grouping).capped
    # Within three standard deviations of N/γ (f′ ~ Bin(N, 1/γ), SD 40 here) counts too.
    counts[0], counts[-1] = 1890, 1710
    assert transition_model(counts, 5, grouping).capped
    counts[0], counts[-1] = 1870, 1730
    assert not transition_model(counts, 5, grouping).capped
    # Values never published are left out of the model.
    model = transition_model([0, *counts, 0], 5, grouping)
    assert model.values.tolist() == [1, 2, 3, 4, 5, 6]
