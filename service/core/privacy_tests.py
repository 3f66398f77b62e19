"""The consumer's periodic privacy tests (SPEC §4), each a pass/fail with its numbers.

Pure functions of what the consumer reads: the published cells (its running
counts), the producer side's truth tally and counters (in Redis, never
published) and the stream's configuration.

- ``eligibility`` (decoy): each sensitive value's published share against
  1/γ, and the share of records suppressed for waiting past max_wait.
- ``guarantees`` (decoy): T_P(ε, α) and T_f(ε, T_E) for γ; fails when T_P
  falls below ``min_privacy``.
- ``budget`` (personal): the share of groups (v_g) and of records (v_r) whose
  independent trials exceed s_g at the group's current true frequencies (the
  f = 1 limit for the conservative budget), and the same for plain
  perturbation (every record a trial) for comparison; how close the closest
  group came (its trials over ⌊s_g⌋ at its current frequency, whatever the
  budget), and how many groups the bounded budget froze because their
  frequency drifted past its bound.
- ``adversary``: what an analyst holding only the published data reconstructs.
  For every public combination with at least ``min_rows`` published rows and
  every sensitive value, the count is estimated exactly as ``/estimate``
  would and scored against the truth. Small cells (true count 1..α) should
  rarely come within ε: the test fails when a one-sided exact binomial test
  at level 0.001 says their within-ε rate exceeds the bound (decoy: 1 − T_P,
  the most any count ≤ α can achieve even for sensitive-only counts; else
  ``max_small_within``). The adversary may use the model's reconstruction or
  read published counts as they are (which exposes a mechanism that leaked
  true values); the better of the two is tested, Bonferroni-corrected.
  Large cells (≥ ``large_count``) are reported.
- ``dp_audit``: disclosures Laplace counts at ``dp_epsilon`` would make on the
  true data (seed 004 ch. 3), for one sensitive attribute.

Windowed streams (`windowed_tests`) run what the published side data lets one check:
``guarantees`` for SDR (every sub-table's posterior bound, from its public ρ_1i and γ_i)
and for Anatomy (every QI-group's ℓ-diversity, from the ST). Every other test is reported
as `NotApplicable`, with the reason, rather than passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np

from service.core.config import StreamConfig
from service.core.dp_audit import audit_disclosures
from service.core.guarantees import (
    deviation_probability,
    privacy_threshold,
    trial_limit,
    utility_threshold,
)
from service.core.published import PublishedWindows
from service.core.reconstruct import PublishedCells, Query, Reconstruction
from service.core.table import Table

# Level of the one-sided binomial test on the small cells' within-ε rate.
ADVERSARY_LEVEL = 0.001
# Without a configured bound, at most this share of small cells may come within ε.
DEFAULT_SMALL_WITHIN = 0.5


@dataclass(frozen=True)
class TestResult:
    test: str
    passed: bool
    numbers: dict[str, float]

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class NotApplicable:
    """A test that has no meaning for the stream's mechanism, and why: reported as such
    (``"passed": null``), never as passed."""

    test: str
    reason: str

    def to_json(self) -> dict:
        return {"test": self.test, "applicable": False, "passed": None, "reason": self.reason}


def eligibility(config: StreamConfig, published: PublishedCells, suppressed: int) -> TestResult:
    """Each value's published share against 1/γ, and the share of records suppressed.

    Shares come from published counts (unbiased for the true ones), never from
    true counts: a report must not hand out the exact count of a rare value.
    Values over their share wait and are suppressed, so the verdict rests on
    the suppressed share.
    """
    assert config.decoy is not None
    gamma = config.decoy.gamma
    numbers: dict[str, float] = {}
    margins = []
    for attribute in config.schema.sensitive:
        counts = np.bincount(
            published.column[attribute.name], weights=published.weights, minlength=attribute.size
        )
        shares = counts / published.total if published.total else counts
        for label, share in zip(attribute.domain, shares.tolist(), strict=True):
            numbers[f"margin:{attribute.name}={label}"] = 1 / gamma - share
            margins.append(1 / gamma - share)
    resolved = published.total + suppressed
    share = suppressed / resolved if resolved else 0.0
    numbers.update(
        min_margin=min(margins),
        values_over_share=sum(m < 0 for m in margins),
        suppressed=suppressed,
        suppressed_share=share,
    )
    return TestResult("eligibility", share <= config.reports.max_suppressed, numbers)


def guarantees(config: StreamConfig) -> TestResult:
    assert config.decoy is not None
    settings = config.reports
    privacy = privacy_threshold(config.decoy.gamma, settings.epsilon, settings.alpha)
    utility = utility_threshold(config.decoy.gamma, settings.epsilon, settings.error_tolerance)
    numbers = {
        "T_P": privacy.threshold,
        "worst_count": privacy.worst_count,
        "T_f": utility.threshold,
        "gamma": config.decoy.gamma,
        "epsilon": settings.epsilon,
        "alpha": settings.alpha,
        "error_tolerance": settings.error_tolerance,
        "min_privacy": settings.min_privacy,
    }
    return TestResult("guarantees", privacy.threshold >= settings.min_privacy, numbers)


def budget(config: StreamConfig, groups: Mapping[str, Mapping[str, int]]) -> TestResult:
    """Trials per personal group (summed over partitions) against s_g, and the groups that
    published borrowed copies (`service/store/lua/personal.lua`: a record whose value had no
    trial when no trial could be spent), which bias their values' estimates: a count of
    groups may leave the trusted zone, the rows borrowed may not."""
    assert config.personal is not None
    settings = config.personal
    m = config.schema.sensitive[0].size
    totals = np.array([g.get("total", 0) for g in groups.values()], dtype=np.float64)
    trials = np.array([g.get("trials", 0) for g in groups.values()], dtype=np.float64)
    largest = np.array(
        [max((v for k, v in g.items() if k.startswith("c:")), default=0) for g in groups.values()],
        dtype=np.float64,
    )
    frequency = np.divide(largest, totals, out=np.ones_like(totals), where=totals > 0)
    frequency = np.clip(frequency, 1e-9, 1.0)
    exact = np.floor(trial_limit(frequency, settings.retention, m, settings.lam, settings.delta))
    conservative = np.floor(trial_limit(1.0, settings.retention, m, settings.lam, settings.delta))
    # A conservative stream promised the f = 1 limit; the others at most the exact one.
    limit = np.full_like(exact, conservative) if settings.budget == "conservative" else exact
    used = totals if settings.budget == "none" else trials
    over, plain_over = used > limit, totals > exact
    records = totals.sum()

    def share(mask: np.ndarray, weights: np.ndarray | None = None) -> float:
        if weights is None:
            return float(mask.mean()) if len(mask) else 0.0
        return float(weights[mask].sum() / records) if records else 0.0

    numbers = {
        "groups": len(totals),
        "records": records,
        "v_g": share(over),
        "v_r": share(over, totals),
        "groups_over": int(over.sum()),
        "plain_v_g": share(plain_over),
        "plain_v_r": share(plain_over, totals),
        "trials": float(used.sum()),
        "budget_use": float(used.sum() / limit.sum()) if limit.sum() else 0.0,
        "max_group_use": float((used / limit).max()) if len(limit) else 0.0,
        "max_exact_use": float((used / exact).max()) if len(exact) else 0.0,
        "groups_frozen": sum(g.get("frozen", 0) > 0 for g in groups.values()),
        "groups_borrowing": sum(g.get("borrowed", 0) > 0 for g in groups.values()),
        "borrowed": sum(g.get("borrowed", 0) for g in groups.values()),
    }
    return TestResult("budget", not over.any(), numbers)


def adversary_queries(
    config: StreamConfig, published: PublishedCells
) -> tuple[list[Query], list[tuple[int, ...]]]:
    """Every (public combination with ≥ min_rows published rows, sensitive value) query,
    with its key (sensitive attribute's position, combination codes..., value code)."""
    public = [a.name for a in config.schema.public]
    positions = [published.columns.index(c) for c in public]
    combos, inverse = np.unique(published.cells[:, positions], axis=0, return_inverse=True)
    rows = np.bincount(inverse.ravel(), weights=published.weights, minlength=len(combos))
    combos = combos[rows >= config.reports.min_rows]
    queries, keys = [], []
    for position, attribute in enumerate(config.schema.sensitive):
        for combo in combos.tolist():
            where = {
                c: (published.domains[c][code],) for c, code in zip(public, combo, strict=True)
            }
            for code, label in enumerate(attribute.domain):
                queries.append(Query(where, {attribute.name: label}))
                keys.append((position, *combo, code))
    return queries, keys


def _true_counts(config: StreamConfig, truth: PublishedCells) -> dict[tuple[int, ...], int]:
    """True count per (sensitive attribute's position, public codes..., value code)."""
    public = [truth.column[a.name] for a in config.schema.public]
    out: dict[tuple[int, ...], int] = {}
    for position, attribute in enumerate(config.schema.sensitive):
        codes = np.column_stack([*public, truth.column[attribute.name]])
        for row, count in zip(codes.tolist(), truth.counts.tolist(), strict=True):
            key = (position, *row)
            out[key] = out.get(key, 0) + count
    return out


def adversary(
    config: StreamConfig, reconstruction: Reconstruction, truth: PublishedCells
) -> TestResult:
    settings = config.reports
    queries, keys = adversary_queries(config, reconstruction.cells)
    answers = reconstruction.estimate_many(queries)
    known = _true_counts(config, truth)
    true_counts = np.array([known.get(key, 0) for key in keys], dtype=np.float64)
    small = (true_counts >= 1) & (true_counts <= settings.alpha)
    large = true_counts >= settings.large_count
    n_small, n_large = int(small.sum()), int(large.sum())
    bound = settings.max_small_within
    if bound is None and config.decoy is not None:
        bound = (
            1 - privacy_threshold(config.decoy.gamma, settings.epsilon, settings.alpha).threshold
        )
    bound = DEFAULT_SMALL_WITHIN if bound is None else bound

    def within(estimates: np.ndarray) -> np.ndarray:
        return np.abs(estimates - true_counts) <= settings.epsilon * true_counts

    # The adversary may pick either estimator beforehand: the model's reconstruction, or
    # the published count read as is (exact if the mechanism leaked true values).
    model = within(np.array([a.estimate for a in answers]))
    naive = within(np.array([a.published for a in answers], dtype=np.float64))
    k_small = max(int((model & small).sum()), int((naive & small).sum()))
    # Bonferroni over the two estimators.
    from scipy import stats

    p_value = min(2 * float(stats.binom.sf(k_small - 1, n_small, bound)), 1.0) if n_small else 1.0
    k_large = int((model & large).sum())
    numbers = {
        "combinations": len({key[1:-1] for key in keys}),
        "small_cells": n_small,
        "small_within": int((model & small).sum()),
        "small_within_share": float((model & small).sum() / n_small) if n_small else 0.0,
        "small_within_share_naive": float((naive & small).sum() / n_small) if n_small else 0.0,
        "small_bound": bound,
        "p_value": p_value,
        "large_cells": n_large,
        "large_within": k_large,
        "large_within_share": k_large / n_large if n_large else 0.0,
        "epsilon": settings.epsilon,
        "alpha": settings.alpha,
    }
    return TestResult("adversary", p_value >= ADVERSARY_LEVEL, numbers)


def dp_audit(config: StreamConfig, truth: PublishedCells) -> TestResult:
    """Disclosures Laplace counts at dp_epsilon would make on the true records."""
    assert config.reports.dp_epsilon is not None
    sensitive = config.sensitive[0]
    rows = np.repeat(np.arange(len(truth.counts)), truth.counts)
    table = Table(
        config.schema, {name: truth.column[name][rows].astype(np.int32) for name in truth.columns}
    )
    report = audit_disclosures(table, sensitive, config.reports.dp_epsilon)
    numbers = {
        "epsilon": report.epsilon,
        "groups": report.groups,
        "disclosures": report.disclosures,
        "groups_disclosing": report.groups_disclosing,
        "records_in_disclosing_groups": report.records_in_disclosing_groups,
        "records": report.records,
    }
    return TestResult("dp_audit", report.disclosures == 0, numbers)


# Why each consumer test says nothing about a windowed mechanism's output.
_NO_TRUTH = "the windowed worker keeps no tally of true values to score against"
_WINDOWED_REASONS = {
    "eligibility": "it checks decoy groups' 1/γ share rule; a window the mechanism refuses "
    "is suppressed whole and counted in the worker's suppressed records",
    "budget": "it checks personal groups' trial budgets",
    "adversary": _NO_TRUTH,
    "dp_audit": _NO_TRUTH,
}


def windowed_tests(
    config: StreamConfig, windows: PublishedWindows | None
) -> tuple[list[TestResult], list[NotApplicable]]:
    """The tests a windowed stream's publication can be checked with (once something is
    counted), and the others with the reason they do not apply."""
    assert config.windowed is not None
    mechanism, spec = config.windowed.mechanism, config.spec
    reasons = dict(_WINDOWED_REASONS)
    if config.reports.dp_epsilon is None:
        del reasons["dp_audit"]
    if spec.unchecked_guarantee is not None:
        reasons = {"guarantees": spec.unchecked_guarantee, **reasons}
    skipped = [NotApplicable(t, f"not applicable to {mechanism}: {r}") for t, r in reasons.items()]
    results = []
    if windows is not None and windows.units:
        results += [WINDOW_TESTS[test](windows) for test in spec.window_tests]
    return results, skipped


def _windows(units: tuple[str, ...]) -> int:
    return len({unit.rpartition("-")[0] for unit in units})


def posterior_bound(windows: PublishedWindows) -> TestResult:
    """SDR: in every published sub-table, a protected value (prior ≤ ρ_1i there) has a
    posterior of at most γ_i·ρ_1i/(γ_i·ρ_1i + 1 − ρ_1i) (amplification γ_i), which must
    not exceed ρ2 (seed 002 Cor. 1); exact, from the public ρ_1i and γ_i."""
    rho2 = Fraction(windows.settings.options["rho2"])
    posteriors = [s.gamma * s.rho1 / (s.gamma * s.rho1 + 1 - s.rho1) for s in windows.subtables]
    over = sum(p > rho2 for p in posteriors)
    numbers = {
        "subtables": len(windows.subtables),
        "windows": _windows(windows.units),
        "max_rho1": float(max(s.rho1 for s in windows.subtables)),
        "min_gamma": float(min(s.gamma for s in windows.subtables)),
        "max_posterior": float(max(posteriors)),
        "rho2": float(rho2),
        "subtables_over": over,
    }
    return TestResult("guarantees", over == 0, numbers)


def diversity(windows: PublishedWindows) -> TestResult:
    """Anatomy: an adversary links a record to its QI-group's values only, so believes any
    one with c_g(s)/|g|; every group must keep that at 1/ℓ at most (ℓ-diversity)."""
    ell = int(windows.settings.options["gamma"])
    sizes = np.bincount(windows.st_unit, weights=windows.st_count, minlength=len(windows.units))
    largest = np.zeros(len(windows.units))
    np.maximum.at(largest, windows.st_unit, windows.st_count)
    over = int((largest * ell > sizes).sum())
    numbers = {
        "groups": len(windows.units),
        "windows": _windows(windows.units),
        "max_share": float((largest / sizes).max()),
        "bound": 1 / ell,
        "groups_over": over,
    }
    return TestResult("guarantees", over == 0, numbers)


def guarantee_curve(config: StreamConfig) -> dict:
    """The decoy deviation probability over true counts, or the personal trial limit; a
    windowed stream has none of the two (an empty curve naming its mechanism)."""
    settings = config.reports
    if config.windowed is not None:
        return {"kind": "windowed", "mechanism": config.windowed.mechanism, "x": [], "y": []}
    if config.decoy is not None:
        gamma = config.decoy.gamma
        x = np.arange(1, 201)
        return {
            "kind": "deviation",
            "epsilon": settings.epsilon,
            "alpha": settings.alpha,
            "error_tolerance": settings.error_tolerance,
            "T_P": privacy_threshold(gamma, settings.epsilon, settings.alpha).threshold,
            "T_f": utility_threshold(gamma, settings.epsilon, settings.error_tolerance).threshold,
            "x": x.tolist(),
            "y": deviation_probability(x, gamma, settings.epsilon).tolist(),
        }
    personal = config.personal
    assert personal is not None
    m = config.schema.sensitive[0].size
    x = np.linspace(1 / m, 1.0, 50)
    return {
        "kind": "trial_limit",
        "lambda": personal.lam,
        "delta": personal.delta,
        "retention": personal.retention,
        "x": x.tolist(),
        "y": trial_limit(x, personal.retention, m, personal.lam, personal.delta).tolist(),
    }


# The tests of a windowed mechanism's publication, as the registry names them.
WINDOW_TESTS = {"posterior_bound": posterior_bound, "diversity": diversity}
