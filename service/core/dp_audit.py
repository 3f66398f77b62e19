"""Laplace-DP disclosure audit (seed 004 chapter 3, Appendix A).

An analyst who may ask noisy counts about a personal group g (the records
sharing a full public vector) learns its *confidence* θ/φ for a sensitive
value: φ = |g|, θ = |g_sa|, answered as X = φ + Lap(b), Y = θ + Lap(b) with
b = Δ/ε. The noisy confidence Y/X tends to θ/φ as φ grows whatever ε is, so
differential privacy can disclose large personal groups:

- closeness probability (Def. 3): CP_τ = P(|θ/φ − Y/X| ≤ τ·θ/φ);
- jump (Def. 4): J = (θ/φ) / prior, prior = |D_sa|/|D|;
- disclosure (Def. 5): CP_τ ≥ K_CP and J ≥ K_J.

CP_τ = F(θ/φ·(1+τ)) − F(θ/φ·(1−τ)) with F the CDF of Z = Y/X, in closed form
(Lemma 2, Eqs. 3.7–3.9, three branches). The closed form divides by z and by
1 − z², so at z = 0 the exact limit is used and within 10⁻⁶ of z = ±1 the
CDF is integrated numerically, F(z) = ∫ P(Y ≤ zx) f_X(x) dx over x > 0 plus
∫ P(Y ≥ zx) f_X(x) dx over x < 0. Both agree with Monte Carlo (tests).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from service.core.table import Table, distinct_rows

# Within this distance of z = ±1 the closed form cancels badly: integrate instead.
_NEAR_SINGULAR = 1e-6


def _laplace_cdf(x: float, location: float, scale: float) -> float:
    tail = 0.5 * np.exp(-abs(x - location) / scale)
    return float(tail if x < location else 1.0 - tail)


def _laplace_pdf(x: float, location: float, scale: float) -> float:
    return float(np.exp(-abs(x - location) / scale) / (2 * scale))


def _ratio_cdf_by_integration(z: float, theta: float, phi: float, b: float) -> float:
    from scipy import integrate

    breaks = sorted({phi, theta / z} if z else {phi})

    def below(x: float) -> float:
        return _laplace_cdf(z * x, theta, b) * _laplace_pdf(x, phi, b)

    def above(x: float) -> float:
        return (1.0 - _laplace_cdf(z * x, theta, b)) * _laplace_pdf(x, phi, b)

    positive = [0.0, *[x for x in breaks if x > 0], np.inf]
    negative = [-np.inf, *[x for x in breaks if x < 0], 0.0]
    total = sum(
        integrate.quad(below, lo, hi, limit=200)[0] for lo, hi in itertools.pairwise(positive)
    )
    total += sum(
        integrate.quad(above, lo, hi, limit=200)[0] for lo, hi in itertools.pairwise(negative)
    )
    return total


def laplace_ratio_cdf(z: np.ndarray, theta: np.ndarray, phi: np.ndarray, b: float) -> np.ndarray:
    """P(Y/X ≤ z) for X ~ φ + Lap(b), Y ~ θ + Lap(b) independent (seed 004 Lemma 2).

    Vectorized; θ ≥ 0, φ > 0, b > 0.
    """
    z, theta, phi = np.broadcast_arrays(
        np.asarray(z, dtype=np.float64), np.asarray(theta, np.float64), np.asarray(phi, np.float64)
    )
    if b <= 0 or (phi <= 0).any() or (theta < 0).any():
        raise ValueError("need b > 0, φ > 0 and θ ≥ 0")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        zz = z * z
        common = -np.exp(-(theta + phi) / b) / (2 * (z + 1)) + 0.5 * np.exp(-phi / b)
        negative = (  # Eq. 3.7, z < 0
            zz / (2 * (1 - zz)) * np.exp((theta - z * phi) / (z * b))
            + common
            - np.exp((z * phi - theta) / b) / (2 * (zz - 1))
        )
        middle = (  # Eq. 3.8, 0 < z ≤ θ/φ
            zz / (2 * (zz - 1)) * np.exp((z * phi - theta) / (z * b))
            + common
            - np.exp((z * phi - theta) / b) / (2 * (zz - 1))
        )
        upper = (  # Eq. 3.9, z > θ/φ
            zz / (2 * (1 - zz)) * np.exp((theta - z * phi) / (z * b))
            + common
            + 1.0
            - np.exp((theta - z * phi) / b) / (2 * (1 - zz))
        )
    out = np.where(z < 0, negative, np.where(z <= theta / phi, middle, upper))
    # z = 0: P(Y ≤ 0, X > 0) + P(Y ≥ 0, X < 0), exactly.
    y_below, x_below = 0.5 * np.exp(-theta / b), 0.5 * np.exp(-phi / b)
    out = np.where(z == 0, y_below * (1 - x_below) + (1 - y_below) * x_below, out)
    for i in np.flatnonzero(np.abs(np.abs(z.ravel()) - 1) < _NEAR_SINGULAR):
        out.flat[i] = _ratio_cdf_by_integration(
            float(z.flat[i]), float(theta.flat[i]), float(phi.flat[i]), b
        )
    return np.clip(out, 0.0, 1.0)


def closeness_probability(theta: np.ndarray, phi: np.ndarray, b: float, tau: float) -> np.ndarray:
    """CP_τ = P(|θ/φ − Y/X| ≤ τ·θ/φ), seed 004 Def. 3 and Cor. 3."""
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    theta, phi = np.asarray(theta, np.float64), np.asarray(phi, np.float64)
    confidence = theta / phi
    return laplace_ratio_cdf(confidence * (1 + tau), theta, phi, b) - laplace_ratio_cdf(
        confidence * (1 - tau), theta, phi, b
    )


@dataclass(frozen=True)
class DisclosureReport:
    """Disclosures of Def. 5 over all personal groups of a table, for one ε."""

    epsilon: float
    scale: float
    tau: float
    k_cp: float
    k_j: float
    groups: int
    disclosures: int
    groups_disclosing: int
    records_in_disclosing_groups: int
    records: int
    # One entry per disclosed (group, value): labels, value, θ, φ, J, CP_τ.
    disclosed: tuple[tuple[tuple[str, ...], str, int, int, float, float], ...]


def audit_disclosures(
    table: Table,
    sensitive: str,
    epsilon: float,
    tau: float = 0.2,
    k_cp: float = 0.7,
    k_j: float = 3.0,
    sensitivity: float = 2.0,
) -> DisclosureReport:
    """Which (personal group, value) pairs Laplace counts at ε would disclose.

    The thesis's two-query attack: Q1 = |g|, Q2 = |g ∧ sa|; one record edit
    changes both, so the default sensitivity is Δ = 2 and b = Δ/ε. Thresholds
    default to the thesis's study: τ = 0.2, K_CP = 0.7, K_J = 3.
    """
    if epsilon <= 0 or sensitivity <= 0:
        raise ValueError("epsilon and the sensitivity must be positive")
    if not (0 < k_cp <= 1) or k_j <= 1:
        raise ValueError("need 0 < K_CP ≤ 1 and K_J > 1 (seed 004 Def. 5)")
    attribute = table.schema[sensitive]
    public = table.schema.public
    keys, group_of_row, _ = distinct_rows(
        [table.codes[a.name] for a in public], [a.size for a in public]
    )
    m, groups = attribute.size, len(keys)
    joint = np.bincount(group_of_row * m + table.codes[sensitive], minlength=groups * m)
    theta = joint.reshape(groups, m).astype(np.float64)
    phi = np.broadcast_to(theta.sum(axis=1, keepdims=True), theta.shape)
    prior = np.bincount(table.codes[sensitive], minlength=m) / max(len(table), 1)
    scale = sensitivity / epsilon
    present = theta > 0
    cp = np.zeros_like(theta)
    cp[present] = closeness_probability(theta[present], phi[present], scale, tau)
    with np.errstate(divide="ignore", invalid="ignore"):
        jump = np.where(prior > 0, (theta / phi) / prior, 0.0)
    disclosed = present & (cp >= k_cp) & (jump >= k_j)
    sizes = phi[:, 0]
    disclosing = disclosed.any(axis=1)
    entries = []
    for g, v in zip(*np.nonzero(disclosed), strict=True):
        labels = tuple(a.domain[c] for a, c in zip(public, keys[g], strict=True))
        entries.append(
            (
                labels,
                attribute.domain[v],
                int(theta[g, v]),
                int(sizes[g]),
                float(jump[g, v]),
                float(cp[g, v]),
            )
        )
    entries.sort(key=lambda e: (-e[5], -e[4]))
    return DisclosureReport(
        epsilon=float(epsilon),
        scale=float(scale),
        tau=float(tau),
        k_cp=float(k_cp),
        k_j=float(k_j),
        groups=groups,
        disclosures=int(disclosed.sum()),
        groups_disclosing=int(disclosing.sum()),
        records_in_disclosing_groups=int(sizes[disclosing].sum()),
        records=len(table),
        disclosed=tuple(entries),
    )
