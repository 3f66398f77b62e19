"""The guarantees each mechanism makes, computed exactly.

Decoy groups (SPEC §2.1): small-sum privacy and large-sum utility.
Personal groups (SPEC §2.2): the (λ, δ) reconstruction-privacy trial limit s_g, and
the upper confidence bound on a group's largest frequency that the stream's
``bounded`` budget plans s_g with.

Decoy groups. A value with true count f has published count f′ ~ Binomial(γ·f, 1/γ), so its
relative error has an exact distribution and every guarantee is a binomial
tail, computed here exactly:

- deviation probability at f:  P(|f′ − f| > ε·f)  (privacy convention, strict)
  or P(|f′ − f| ≥ ε·f) (utility convention);
- small-sum privacy (journal Definition 2, Lemma 2):
  T_P(ε, α) = min over f = 1..α of P(|f′ − f| > ε·f);
- large-sum utility (journal Definition 1): the smallest T_f with
  P(|f′ − f| ≥ ε·f) ≤ T_E for *every* f ≥ T_f.

The papers bound utility with Chebyshev but square n where it should not
(seed notes 001 §6.1, §10.13): their T_f = √(1/(γ ε² T_E)) is an order of
magnitude too small. `chebyshev_thresholds` gives both Chebyshev figures for
comparison only.

Window boundaries use exact rational arithmetic: ε is read as the decimal it
was written as, so 0.3·10 is exactly 3 and the window is never off by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np


def as_fraction(value: float | str | Fraction, name: str = "epsilon") -> Fraction:
    """The exact rational a user meant by a decimal like 0.3 (not 0.299999...)."""
    try:
        exact = Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if exact <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return exact


def _check_gamma(gamma: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer) or gamma < 2:
        raise ValueError(f"gamma must be an integer ≥ 2, got {gamma!r}")


def deviation_probability(
    f: int | np.ndarray, gamma: int, epsilon: float | Fraction, strict: bool = True
) -> np.ndarray:
    """P(|f′ − f| > ε·f) (strict) or P(|f′ − f| ≥ ε·f) for f′ ~ Bin(γ·f, 1/γ).

    Vectorized over integer true counts f ≥ 1. For the papers' example
    (f = 5, γ = 10, ε = 0.3) the count stays within ±30% with probability
    0.5199, so the strict deviation probability is 0.4801.
    """
    _check_gamma(gamma)
    eps = as_fraction(epsilon)
    f = np.asarray(f, dtype=np.int64)
    if (f < 1).any():
        raise ValueError("true counts must be at least 1")
    scaled = f * eps.numerator  # ε·f = scaled / denominator, exactly
    half_width = scaled // eps.denominator
    if not strict:
        # |x − f| ≥ εf excludes the boundary when εf is an integer.
        half_width = half_width - (scaled % eps.denominator == 0)
    lowest_inside = f - half_width
    highest_inside = f + half_width
    n = gamma * f
    p = 1.0 / gamma
    from scipy import stats

    below = np.where(lowest_inside > 0, stats.binom.cdf(lowest_inside - 1, n, p), 0.0)
    above = stats.binom.sf(highest_inside, n, p)
    return below + above


@dataclass(frozen=True)
class PrivacyGuarantee:
    """T_P(ε, α): every value with true count 1..α deviates by more than ε·f with
    probability at least `threshold` (reached at `worst_count`)."""

    gamma: int
    epsilon: float
    alpha: int
    threshold: float
    worst_count: int
    curve: tuple[float, ...]


def privacy_threshold(gamma: int, epsilon: float, alpha: int) -> PrivacyGuarantee:
    """T_P(ε, α) = min over f = 1..α of P(|f′ − f| > ε·f) (journal Lemma 2, Thm. 4).

    The curve is not monotone in f (integer rounding of the window), which
    is why every f up to α is checked.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | np.integer) or alpha < 1:
        raise ValueError(f"alpha must be an integer ≥ 1, got {alpha!r}")
    curve = deviation_probability(np.arange(1, alpha + 1), gamma, epsilon, strict=True)
    worst = int(np.argmin(curve))
    return PrivacyGuarantee(
        gamma, float(epsilon), int(alpha), float(curve[worst]), worst + 1, tuple(curve.tolist())
    )


@dataclass(frozen=True)
class UtilityGuarantee:
    """Every value with true count ≥ `threshold` has P(|f′ − f| ≥ ε·f) ≤ T_E."""

    gamma: int
    epsilon: float
    error_tolerance: float
    threshold: int
    checked_up_to: int


def utility_threshold(gamma: int, epsilon: float, error_tolerance: float) -> UtilityGuarantee:
    """The smallest T_f with P(|f′ − f| ≥ ε·f) ≤ T_E for all f ≥ T_f (Definition 1).

    The exact probability is not monotone in f, so "for all f" is settled
    rigorously: by the Chernoff bounds for a sum of Bernoullis with mean f,
    P(|f′ − f| ≥ ε·f) ≤ 2·exp(−ε²·f/(2+ε)), which is ≤ T_E for every
    f ≥ F = (2+ε)·ln(2/T_E)/ε². Every f below F is checked exactly.
    """
    _check_gamma(gamma)
    eps = float(as_fraction(epsilon))
    if not 0 < error_tolerance < 1:
        raise ValueError(f"the error tolerance T_E must lie in (0, 1), got {error_tolerance}")
    certified_from = math.ceil((2 + eps) * math.log(2 / error_tolerance) / eps**2)
    counts = np.arange(1, certified_from + 1)
    failing = np.flatnonzero(
        deviation_probability(counts, gamma, epsilon, strict=False) > error_tolerance
    )
    threshold = int(counts[failing[-1]]) + 1 if len(failing) else 1
    return UtilityGuarantee(gamma, eps, float(error_tolerance), threshold, certified_from)


def chebyshev_thresholds(gamma: int, epsilon: float, error_tolerance: float) -> dict[str, float]:
    """The papers' Chebyshev T_f (eq. 5, with the n² slip) and the corrected one.

    Both are loose or wrong; they are reported next to the exact threshold so
    the difference is visible, never used for a decision.
    """
    eps = float(as_fraction(epsilon))
    return {
        "paper": math.sqrt(1.0 / (gamma * eps**2 * error_tolerance)),
        "corrected": (gamma - 1) / (gamma * eps**2 * error_tolerance),
    }


def mate_probability(gamma: int, take: int) -> float:
    """How likely a published record's neighbour in a uniformly shuffled take of `take`
    records is its decoy group-mate: (γ − 1)/(take − 1) when the take holds whole groups
    (1 for a take of a single group or less). The mixing floor keeps every take's draw at
    least as large as the floor (SPEC §3); a survey's final remainder may be smaller."""
    _check_gamma(gamma)
    if take <= gamma:
        return 1.0
    return (gamma - 1) / (take - 1)


def lambda_limit(retention: float, domain_size: int, max_frequency: float = 1.0) -> float:
    """Largest λ for which the (λ, δ) test of seed 004 Cor. 6 holds: 1 + (1−p)/(m·p·f).

    Beyond it the lower-tail Chernoff bound the test rests on does not apply
    (ω > 1). The default f = 1 gives the limit that holds for every group.
    """
    return 1.0 + (1.0 - retention) / (domain_size * retention * max_frequency)


def check_reconstruction_parameters(
    retention: float, domain_size: int, lam: float, delta: float
) -> None:
    """Validate (p, m, λ, δ) for the personal-group test, naming the bad one."""
    if not 0 < retention < 1:
        raise ValueError(f"the retention probability p must lie in (0, 1), got {retention}")
    if isinstance(domain_size, bool) or not isinstance(domain_size, int | np.integer):
        raise ValueError(f"the sensitive domain size m must be an integer, got {domain_size!r}")
    if domain_size < 2:
        raise ValueError(f"the sensitive attribute needs at least 2 values, got {domain_size}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    limit = lambda_limit(retention, domain_size)
    if not 0 < lam <= limit:
        raise ValueError(
            f"lambda must lie in (0, {limit:.4g}] for p = {retention} and m = {domain_size} "
            f"(seed 004 Cor. 6 holds only for λ ≤ 1 + (1−p)/(m·p·f)); got {lam}"
        )


def trial_limit(
    max_frequency: float | np.ndarray, retention: float, domain_size: int, lam: float, delta: float
) -> np.ndarray:
    """s_g = −2·(f·p + (1−p)/m)·ln δ / (λ·p·f)², seed 004 Eq. 4.9.

    A personal group whose largest true relative frequency is f is (λ, δ)-
    reconstruction-private iff it holds at most s_g independently perturbed
    records. s_g falls as f grows, so f = 1 gives the limit for any group.
    It bounds the Chernoff tail an adversary could prove, not the true tail:
    a group at s_g usually reconstructs far better than λ (seed notes 004 §5.2).
    """
    check_reconstruction_parameters(retention, domain_size, lam, delta)
    f = np.asarray(max_frequency, dtype=np.float64)
    if ((f <= 0) | (f > 1)).any():
        raise ValueError("the largest frequency of a group must lie in (0, 1]")
    p, m = retention, domain_size
    return -2.0 * (f * p + (1.0 - p) / m) * np.log(delta) / (lam * p * f) ** 2


# The bounded budget's confidence per personal group, over the group's whole life in the
# stream: with probability at least this, no bound a group's trials were planned with
# fell below its final largest frequency (docs/architecture.md derives it). A violation
# costs a pause of publishing (fail_closed) and the error of a bound grows only with
# √ln(1/α), so α is taken small: 10⁻³ per group keeps the chance that any of a few
# hundred groups is overrun by sampling noise alone below a few percent.
BUDGET_CONFIDENCE = 0.999
# Bisection steps for the bound: 64 halvings of [0, 1] reach the spacing of doubles.
BOUND_STEPS = 64


def budget_epoch(records: int) -> int:
    """⌊log₂ n⌋: a group's bound is replanned once per doubling of its records."""
    return max(int(records), 1).bit_length() - 1


def budget_level(confidence: float = BUDGET_CONFIDENCE) -> float:
    """α = 1 − confidence: a group's level, whole, since one partition holds the group."""
    return 1.0 - confidence


def epoch_level(epoch: int, confidence: float = BUDGET_CONFIDENCE) -> float:
    """α_e = α / ((e + 1)(e + 2)): the level of the bound planned in epoch e.

    Σ_e 1/((e + 1)(e + 2)) = 1, so the bounds of every epoch of a group hold together
    with probability at least `confidence`.
    """
    return budget_level(confidence) / ((epoch + 1) * (epoch + 2))


def share_upper_bound(
    count: float | np.ndarray, records: float | np.ndarray, level: float | np.ndarray
) -> np.ndarray:
    """Upper confidence bound on a share: the largest q ≥ x = count/n with
    n·KL(x ‖ q) ≤ ln(1/α), KL the Bernoulli relative entropy.

    By Chernoff's bound P(Binomial(n, q) ≤ count) ≤ exp(−n·KL(x ‖ q)) for q ≥ x,
    so the bound is never below the one-sided Clopper–Pearson bound
    (beta.ppf(1 − α, count + 1, n − count)) and covers q with probability ≥ 1 − α.
    Hoeffding (JASA 58, 1963, Thm. 4) extends the Chernoff bound to draws without
    replacement, so it also covers the share of a finite group the n records are
    a random subset of. `service/store/lua/bound.lua` computes the same bisection.
    """
    n = np.asarray(records, dtype=np.float64)
    x = np.asarray(count, dtype=np.float64) / np.where(n > 0, n, 1.0)
    x = np.where(n > 0, x, 1.0)
    target = np.log(1.0 / np.asarray(level, dtype=np.float64))
    low, high = np.broadcast_arrays(x, np.ones_like(x))
    for _ in range(BOUND_STEPS):
        middle = (low + high) / 2
        above = n * _relative_entropy(x, middle) > target
        high = np.where(above, middle, high)
        low = np.where(above, low, middle)
    return np.where(x >= 1, 1.0, high)


def _relative_entropy(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(x ‖ q) of two Bernoulli laws, 0·ln 0 = 0, for x ≤ q < 1."""
    with np.errstate(divide="ignore", invalid="ignore"):
        kept = np.where(x > 0, x * np.log(x / q), 0.0)
        other = np.where(x < 1, (1 - x) * np.log((1 - x) / (1 - q)), 0.0)
    return kept + other
