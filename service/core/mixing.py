"""Which values a decoy group puts together: the m×m transition model of a cutting rule.

A record of value s′ sits in a group of γ distinct values and publishes each of
them with probability 1/γ (SPEC §2.1). So it publishes its own value with
probability 1/γ and another value s with probability

    M[s′→s] = G(s, s′) / (γ·f_{s′}),

where G(s, s′) is the expected number of groups holding both s and s′ and f_{s′}
the count of s′. Each value meets γ − 1 partners in each of its f_{s′} groups, so
Σ_{s≠s′} G(s, s′) = (γ − 1)·f_{s′} and every row of M sums to 1. The published
counts of the records inside a public predicate P then have E[y_P] = Mᵀ x_P.

The papers (seed 000 §5, seed 001 §7.1) assume a record meets s as often whatever
its own value, t_s = f_s/N, corrected to t_s = (γ − 1)·f_s/(γ·(N − f_s)) by seed
notes 001 §10.7 so that E f′_s = f_s. No cutting rule mixes that uniformly: under
that model row s′ of M sums to 1/γ + Σ_{s≠s′} t_s, not 1 (on Adult's occupation
from 0.97 to 1.10), and a conjunctive estimate is biased in proportion to N while
its standard error grows like √N (issue 32).

Size-weighted cuts (`service.core.mechanisms.decoy._size_weighted_cuts`, and the
stream's `service/store/lua/decoy.lua`, which cuts the same way in each call) choose
each group's values with probability proportional to bucket size. Their pairs
follow closely (tests/test_mixing.py holds them to it on census-like counts) the
product form

    G(s, s′) = a_s·a_{s′} (s ≠ s′),   a_s·(A − a_s) = (γ − 1)·f_s,   A = Σ_k a_k,

the pairing of largest entropy with the right margins: each value meets the
others in proportion to their weights a, and the margins hold exactly. Given A,
a_s is the smaller root of a² − A·a + (γ − 1)·f_s = 0, and A is the root of
Σ_s a_s(A) = A, a single monotone equation (solved by `scipy.optimize.brentq`).
A solution with every a_s < A/2 exists when the largest count is at most N/3,
which γ ≥ 3 and eligibility (f_s ≤ N/γ) guarantee; for γ = 2 the largest value
may take the larger root. Then M[s′→s] = ((γ − 1)/γ)·a_s/(A − a_{s′}).

The interval needs how M moves with the counts it is computed from, the
published f′. Implicit differentiation of F_s(a, f) = a_s·(A − a_s) − (γ − 1)·f_s:
∂F/∂a = diag(A − 2a) + a·1ᵀ and ∂F/∂f = −(γ − 1)·I, so ∂a/∂f = (γ − 1)·(∂F/∂a)⁻¹, and

    ∂M[s′→s]/∂f_i = ((γ−1)/γ)·[∂a_s/∂f_i/(A − a_{s′}) − a_s·(∂A/∂f_i − ∂a_{s′}/∂f_i)/(A − a_{s′})²].

The product form cannot put one value in every group, which the cut does once a
value's backlog reaches R/γ of the R rows left: a value at the eligibility bound
N/γ sits in every group from the first cut. Its records then publish exactly as
an average record of the other values does (both publish it with probability
1/γ and any other value j with probability f_j/N), so no conjunctive count on the
attribute is identifiable, whatever the predicate: M is singular. A value whose
published count is within `CAP_MARGIN` standard deviations of N/γ (f′ ~
Binomial(N, 1/γ) at the bound) is taken to be at the bound.

Anatomy's largest-first cuts (seed 000 §6) pair large values with large ones and
then rotate through values of equal size in a fixed order; no product form
describes them, so G comes from replaying the rule itself on the counts (at most
`REPLAY_GROUPS` groups, the counts scaled down and G scaled back up, since the
rule's pairs scale with the counts), and its derivatives from replays with each
count moved by `REPLAY_STEP` of itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.core.mechanisms.decoy import GROUPINGS, _largest_first_cuts

# Standard deviations of f′ ~ Binomial(N, 1/γ) within which a value is taken to be at
# N/γ, in every group: one-sided, 3 leaves a value that is there undetected 0.13% of
# the time.
CAP_MARGIN = 3.0
# Groups a largest-first replay cuts at most; larger counts are scaled down to this.
REPLAY_GROUPS = 5_000
# Relative change of one count in the finite differences of a largest-first replay.
REPLAY_STEP = 0.02


@dataclass(frozen=True)
class Mixing:
    """The transition model of one sensitive attribute, over the values published.

    values: codes of the values with a published count (the model's states).
    counts: their published counts.
    matrix: M[s′, s], the probability that a record of s′ publishes s.
    inverse: M⁻¹; column s holds the weights of the estimate of "P ∧ s".
    derivative: ∂M/∂f′_i as derivative[i], each (k, k).
    capped: a value sits in every group (f′ within CAP_MARGIN SDs of N/γ): M is
        singular and no conjunctive count on this attribute is identifiable.
    """

    values: np.ndarray
    counts: np.ndarray
    matrix: np.ndarray
    inverse: np.ndarray
    derivative: np.ndarray
    capped: bool

    def amplification(self) -> np.ndarray:
        """Per value, how much a conjunctive count on it amplifies the noise of the
        published counts: the weight of "published s" less the mean weight of the other
        published values in its estimate, w_s − Σ_{j≠s} f_j·w_j / Σ_{j≠s} f_j (w = column
        s of M⁻¹). Under uniform mixing this is the 2×2 model's 1/(1/γ − t_s); infinite
        when the attribute is capped."""
        if self.capped:
            return np.full(len(self.values), np.inf)
        own = np.diag(self.inverse)
        others = self.counts.sum() - self.counts
        return own - (self.counts @ self.inverse - self.counts * own) / others


def transition_model(counts: Sequence[float], gamma: int, grouping: str) -> Mixing:
    """The m×m model of `grouping` ("size-weighted" or "anatomy") for one attribute whose
    values were published `counts` times (zeros allowed: those values are left out)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
    counts = np.asarray(counts, dtype=np.float64)
    values = np.flatnonzero(counts > 0)
    f = counts[values]
    n = f.sum()
    capped = bool(
        len(f) <= gamma or f.max() >= n / gamma - CAP_MARGIN * math.sqrt(n * (gamma - 1)) / gamma
    )
    k = len(f)
    if capped:
        # Every group holds every value (k = γ) or one value sits in all of them.
        nan = np.full((k, k), np.nan)
        return Mixing(values, f, nan, nan, np.full((k, k, k), np.nan), True)
    if grouping == "size-weighted":
        matrix, derivative = _size_weighted(f, gamma)
    else:
        matrix, derivative = _largest_first(f, gamma)
    return Mixing(values, f, matrix, np.linalg.inv(matrix), derivative, False)


def partner_weights(counts: np.ndarray, gamma: int) -> np.ndarray:
    """a with a_s·(Σa − a_s) = (γ − 1)·f_s: the product form G(s, s′) = a_s·a_{s′}."""
    c = (gamma - 1) * np.asarray(counts, dtype=np.float64)
    largest = int(np.argmax(c))
    floor = 2.0 * math.sqrt(c[largest])  # A below this leaves the largest root complex

    def weights(total: float, large_root: bool) -> np.ndarray:
        root = np.sqrt(np.clip(total * total - 4.0 * c, 0.0, None))
        a = (total - root) / 2.0
        if large_root:
            a[largest] = (total + root[largest]) / 2.0
        return a

    def excess(total: float, large_root: bool) -> float:
        return float(weights(total, large_root).sum() / total - 1.0)

    # With small roots Σa/A − 1 falls to −1 as A grows; if it is negative already at the
    # floor, the largest value takes its larger root, and Σa/A − 1 then rises to 0⁺.
    large_root = excess(floor, False) < 0
    ceiling = floor * 2.0
    while (excess(ceiling, large_root) > 0) != large_root:
        ceiling *= 2.0
    from scipy.optimize import brentq

    total = brentq(excess, floor, ceiling, args=(large_root,), xtol=1e-13 * floor, rtol=1e-14)
    return weights(total, large_root)


def _size_weighted(f: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """M and ∂M/∂f of the product form (module docstring)."""
    a = partner_weights(f, gamma)
    total = a.sum()
    scale = (gamma - 1) / gamma
    rest = total - a  # A − a_{s′}, by row s′
    matrix = scale * a[None, :] / rest[:, None]
    np.fill_diagonal(matrix, 1.0 / gamma)
    jacobian = np.diag(total - 2.0 * a) + a[:, None]
    da = (gamma - 1) * np.linalg.inv(jacobian)  # da[s, i] = ∂a_s/∂f_i
    d_total = da.sum(axis=0)
    # derivative[i, s′, s]
    derivative = scale * (
        da.T[:, None, :] / rest[None, :, None]
        - a[None, None, :] * (d_total[:, None, None] - da.T[:, :, None]) / rest[None, :, None] ** 2
    )
    derivative[:, np.arange(len(f)), np.arange(len(f))] = 0.0
    return matrix, derivative


def _largest_first(f: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """M from a replay of the largest-first rule, and ∂M/∂f by central differences."""
    matrix = _replayed_transition(f, gamma)
    derivative = np.empty((len(f), len(f), len(f)))
    for i in range(len(f)):
        step = REPLAY_STEP * f[i]
        up, down = f.copy(), f.copy()
        up[i] += step
        down[i] -= step
        derivative[i] = (_replayed_transition(up, gamma) - _replayed_transition(down, gamma)) / (
            2.0 * step
        )
    return matrix, derivative


def _replayed_transition(f: np.ndarray, gamma: int) -> np.ndarray:
    """M of largest-first cuts on counts f, scaled to at most REPLAY_GROUPS groups and
    made eligible (no count above the groups, the total a multiple of γ)."""
    groups = int(min(REPLAY_GROUPS, f.sum() // gamma))
    scaled = np.maximum(np.rint(f * (groups * gamma / f.sum())), 1).astype(np.int64)
    scaled = np.minimum(scaled, groups)
    # Trim or pad the largest counts so the total is γ per group, each at most `groups`.
    surplus = int(scaled.sum()) - groups * gamma
    order = np.argsort(-scaled, kind="stable")
    position = 0
    while surplus:
        v = order[position % len(order)]
        if surplus > 0 and scaled[v] > 1:
            scaled[v] -= 1
            surplus -= 1
        elif surplus < 0 and scaled[v] < groups:
            scaled[v] += 1
            surplus += 1
        position += 1
    cuts = _largest_first_cuts(scaled.tolist(), gamma)
    k = len(f)
    pairs = np.zeros((k, k))
    for left in range(gamma):
        for right in range(gamma):
            if left != right:
                np.add.at(pairs, (cuts[:, left], cuts[:, right]), 1.0)
    matrix = pairs / (gamma * scaled[:, None])
    np.fill_diagonal(matrix, 1.0 / gamma)
    return matrix
