"""What `splu plan` computes: guarantees and accuracy of decoy and personal groups measured
on a sample of the user's own data, and the setting to recommend. No printing here; the
command (`service/cli/commands/plan.py`) reports.

Accuracy is measured as `bench/decoy_accuracy.py` measures it (which imports `query_pool`
from here): random conjunctive count queries "1–3 public columns = the values of a random
record ∧ sensitive = a uniform value of its domain", kept in two bands by their true count,

- large: true count ≥ 1% of the rows (the utility side: the error should be small);
- small: true count 1–10 (the privacy side: the error should stay large);

answered on publications made with fresh keys; the relative error |estimate − true| / true
is pooled over queries and publications. The batch mechanisms (`BASELINES`) are measured
the same way on the same queries, for comparison only: a stream runs decoy or personal
groups, so only those are recommended.

Everything here reads the raw sample, so every result is a release of it: per value only
shares of the sample are reported, never a record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.core.guarantees import privacy_threshold, utility_threshold
from service.core.mechanisms.anatomy import Anatomy, AnatomyReconstruction
from service.core.mechanisms.dbr import DBRReconstruction, DistributionBasedRandomization
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.mechanisms.fprivacy import FPrivacyBucketization, FPrivacyReconstruction
from service.core.mechanisms.global_randomization import (
    GlobalRandomization,
    GlobalRandomizationReconstruction,
)
from service.core.mechanisms.personal import PersonalGroups
from service.core.mechanisms.personal_reconstruction import PersonalReconstruction
from service.core.mechanisms.registry import MECHANISMS
from service.core.mechanisms.sdr import (
    SDRReconstruction,
    SmallDomainRandomization,
    privacy_for_amplification,
)
from service.core.merge import ValueMap
from service.core.mixing import transition_model
from service.core.prf import ServiceKey
from service.core.reconstruct import Answers, PublishedCells, Query
from service.core.table import Table

LARGE_SHARE = 0.01
SMALL_MAX = 10
MAX_ATTRIBUTES = 3
# The only cutting rule a stream accepts (service/core/config.py), so the only one worth planning.
GROUPING = "size-weighted"

Releases = Sequence[tuple[ServiceKey, np.ndarray]]


def large_minimum(rows: int) -> int:
    """The smallest true count of a large query: 1% of the rows."""
    return math.ceil(LARGE_SHARE * rows)


@dataclass
class QueryPool:
    """The large queries first, then the small ones, with their true counts."""

    queries: list[Query]
    true: np.ndarray
    large: int
    small: int
    draws: int


def query_pool(
    table: Table,
    sensitive: str,
    public: Sequence[str],
    per_band: int,
    rng: np.random.Generator,
    draw_limit: int,
) -> QueryPool:
    """Up to `per_band` queries per band, drawn at random until both are full or
    `draw_limit` draws are spent (a small sample may hold no large or small query)."""
    large_min = large_minimum(len(table))
    domain = table.schema[sensitive].domain
    widest = min(MAX_ATTRIBUTES, len(public))
    bands: dict[str, list[tuple[Query, int]]] = {"large": [], "small": []}
    draws = 0
    while min(len(b) for b in bands.values()) < per_band and draws < draw_limit:
        draws += 1
        columns = rng.choice(public, size=rng.integers(1, widest + 1), replace=False)
        record = rng.integers(len(table))
        value = rng.integers(len(domain))
        matches = table.codes[sensitive] == value
        for column in columns:
            matches &= table.codes[column] == table.codes[column][record]
        true = int(matches.sum())
        band = "large" if true >= large_min else "small" if 1 <= true <= SMALL_MAX else None
        if band is not None and len(bands[band]) < per_band:
            where = {str(c): (table.schema[c].domain[table.codes[c][record]],) for c in columns}
            bands[band].append((Query(where, {sensitive: domain[value]}), true))
    chosen = bands["large"] + bands["small"]
    return QueryPool(
        [q for q, _ in chosen],
        np.asarray([t for _, t in chosen], dtype=np.float64),
        len(bands["large"]),
        len(bands["small"]),
        draws,
    )


@dataclass
class Errors:
    """Absolute relative errors of each band, one array per publication."""

    large: list[np.ndarray] = field(default_factory=list)
    small: list[np.ndarray] = field(default_factory=list)

    def add(self, reconstruction: Answers, pool: QueryPool) -> None:
        answers = reconstruction.estimate_many(pool.queries)
        estimates = np.asarray([a.estimate for a in answers])
        error = np.abs(estimates - pool.true) / pool.true
        self.large.append(error[: pool.large])
        self.small.append(error[pool.large :])

    def summary(self) -> dict[str, dict[str, float | int] | None]:
        """Mean and median of each band, None for a band without queries."""
        out: dict[str, dict[str, float | int] | None] = {}
        for band, parts in (("large", self.large), ("small", self.small)):
            pooled = np.concatenate(parts) if parts else np.empty(0)
            out[band] = (
                {
                    "mean": float(pooled.mean()),
                    "median": float(np.median(pooled)),
                    "queries": len(pooled) // max(len(parts), 1),
                }
                if len(pooled)
                else None
            )
        return out


@dataclass
class Setting:
    """One planned setting, as a row of the plan (`row()` is its JSON form)."""

    mechanism: str
    parameters: dict[str, Any]
    guarantees: dict[str, Any]
    errors: dict[str, dict[str, float | int] | None]
    warnings: list[str]

    def row(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "parameters": self.parameters,
            "guarantees": self.guarantees,
            "errors": self.errors,
            "warnings": self.warnings,
        }

    def large_mean(self) -> float | None:
        large = self.errors["large"]
        return None if large is None else float(large["mean"])


def value_shares(table: Table, sensitive: str) -> list[tuple[str, float]]:
    """Each sensitive value present and its share of the sample, largest first."""
    counts = np.bincount(table.codes[sensitive], minlength=table.schema[sensitive].size)
    domain = table.schema[sensitive].domain
    present = [(domain[v], int(c)) for v, c in enumerate(counts) if c]
    present.sort(key=lambda item: (-item[1], item[0]))
    return [(value, c / len(table)) for value, c in present]


def feasible_gammas(table: Table, sensitive: str) -> range:
    """γ from 2 up to the eligibility limit: no value may hold more than 1/γ of the rows
    (γ·largest ≤ N, in integers so a share of exactly 1/γ counts) and a group needs γ
    distinct values."""
    counts = np.bincount(table.codes[sensitive])
    largest, distinct = int(counts.max(initial=0)), int((counts > 0).sum())
    limit = min(len(table) // largest, distinct) if largest else 1
    return range(2, limit + 1)


def amplifications(table: Table, sensitive: str, gamma: int) -> dict[str, float]:
    """Per value present, how much conjunctive counts on it amplify the noise under the
    estimator's m×m model of size-weighted cuts (`service.core.mixing`), at the sample's
    counts; infinite where a value sits in every group (the count is unidentifiable)."""
    counts = np.bincount(table.codes[sensitive], minlength=table.schema[sensitive].size)
    model = transition_model(counts, gamma, GROUPING)
    domain = table.schema[sensitive].domain
    return {
        domain[v]: float(factor)
        for v, factor in zip(model.values, model.amplification(), strict=True)
    }


def plan_decoy(
    table: Table,
    sensitive: str,
    gamma: int,
    pool: QueryPool,
    releases: Releases,
    epsilon: float,
    alpha: int,
    error_tolerance: float,
    utility_epsilon: float,
    max_amplification: float,
) -> Setting:
    """Decoy groups of size γ: T_P, T_f, what is suppressed, each value's amplification,
    and the errors over one publication per (key, ids) in `releases`."""
    privacy = privacy_threshold(gamma, epsilon, alpha)
    utility = utility_threshold(gamma, utility_epsilon, error_tolerance)
    mechanism = DecoyGroups(gamma, GROUPING)
    errors = Errors()
    suppressed, trimmed = [], []
    for key, ids in releases:
        release = mechanism.publish(table, ids, key)
        suppressed.append(sum(sum(c.values()) for c in release.suppressed.values()))
        trimmed.append(len(release.trimmed_lines))
        cells = PublishedCells.from_table(release.published)
        errors.add(DecoyReconstruction(cells, gamma, [sensitive], grouping=GROUPING), pool)
    values, warnings = [], []
    factors = amplifications(table, sensitive, gamma)
    for value, share in value_shares(table, sensitive):
        factor = factors[value]
        values.append(
            {
                "value": value,
                "share": share,
                "amplification": None if math.isinf(factor) else factor,
            }
        )
        if factor > max_amplification:
            shown = "unbounded" if math.isinf(factor) else f"{factor:.1f}×"
            warnings.append(
                f"{sensitive}={value} ({share:.1%} of the sample, 1/γ = {1 / gamma:.1%}): "
                f"the noise of conjunctive counts on it is amplified {shown}, past "
                f"{max_amplification:g}"
            )
    warnings.extend(missing_bands(pool))
    return Setting(
        "decoy",
        {"gamma": gamma, "grouping": GROUPING},
        {
            "epsilon": epsilon,
            "alpha": alpha,
            "T_P": privacy.threshold,
            "utility_epsilon": utility_epsilon,
            "T_E": error_tolerance,
            "T_f": utility.threshold,
            "suppressed_share": float(np.mean(suppressed)) / len(table),
            "trimmed_rows": int(max(trimmed)),
            "values": values,
        },
        errors.summary(),
        warnings,
    )


def plan_personal(
    table: Table,
    sensitive: str,
    retention: float,
    lam: float,
    delta: float,
    budget: str,
    merge_map: tuple[str, ValueMap] | None,
    pool: QueryPool,
    releases: Releases,
) -> Setting:
    """Personal groups at retention p: v_g and v_r of plain perturbation and under SPS, the
    share SPS perturbs, and the errors over one publication per (key, ids). `merge_map` is
    the stream's (file, map), None to group by every public combination as a stream does
    without one."""
    value_map = None if merge_map is None else merge_map[1]
    mechanism = PersonalGroups(retention, lam, delta, budget, value_map)
    domain_size = table.schema[sensitive].size
    errors = Errors()
    perturbed = []
    release = None
    for key, ids in releases:
        release = mechanism.publish(table, ids, key)
        perturbed.append(release.sampled_rows / len(table))
        cells = PublishedCells.from_table(release.published)
        errors.add(
            PersonalReconstruction(
                cells, sensitive, retention, domain_size, lam, delta, budget, value_map
            ),
            pool,
        )
    if release is None:
        raise ValueError("a plan needs at least one publication")
    # The audits depend on the true data only, so any publication's are the plan's.
    plain, sps = release.plain, release.audit
    warnings = missing_bands(pool)
    if sps.groups_failing:
        warnings.append(
            f"SPS leaves {sps.groups_failing:.1%} of the personal groups over their trial limit"
        )
    return Setting(
        "personal",
        {
            "retention": retention,
            "lambda": lam,
            "delta": delta,
            "budget": budget,
            "merge_map": None if merge_map is None else merge_map[0],
        },
        {
            "groups": len(plain.sizes),
            "plain": {"v_g": plain.groups_failing, "v_r": plain.records_failing},
            "sps": {"v_g": sps.groups_failing, "v_r": sps.records_failing},
            "perturbed_share": float(np.mean(perturbed)),
        },
        errors.summary(),
        warnings,
    )


Published = tuple[Answers, dict[str, Any]]


def _anatomy(
    table: Table, sensitive: str, gamma: int, key: ServiceKey, ids: np.ndarray
) -> Published:
    return AnatomyReconstruction(Anatomy(gamma).publish(table, ids, key)), {"ell": gamma}


def _global(
    table: Table, sensitive: str, gamma: int, key: ServiceKey, ids: np.ndarray
) -> Published:
    m = table.schema[sensitive].size
    cells = PublishedCells.from_table(GlobalRandomization(gamma, m).publish(table, ids, key))
    return GlobalRandomizationReconstruction(cells, sensitive, gamma, m), {"gamma": gamma}


def _sdr(table: Table, sensitive: str, gamma: int, key: ServiceKey, ids: np.ndarray) -> Published:
    rho1, rho2 = privacy_for_amplification(np.bincount(table.codes[sensitive]), gamma)
    release = SmallDomainRandomization(rho1, rho2).publish(table, ids, key)
    parameters = {"gamma": gamma, "rho1": float(rho1), "rho2": float(rho2)}
    return SDRReconstruction.from_release(release), parameters


def _fprivacy(table: Table, sensitive: str, key: ServiceKey, ids: np.ndarray) -> Published:
    defaults = MECHANISMS["fprivacy"].defaults
    theta, beta = defaults["theta"], defaults["beta"]
    release = FPrivacyBucketization(theta, beta, max_size=defaults["max_size"]).publish(
        table, ids, key
    )
    return FPrivacyReconstruction(release.published), {"theta": float(theta), "beta": float(beta)}


def _dbr(table: Table, sensitive: str, key: ServiceKey, ids: np.ndarray) -> Published:
    cells = PublishedCells.from_table(DistributionBasedRandomization().publish(table, ids, key))
    return DBRReconstruction(cells, [sensitive]), {}


# The batch mechanisms `--mechanism all` plans, each as one publication and its estimator:
# the first three at each planned γ (Anatomy's ℓ = γ, global randomization's 1/γ retention,
# SDR's amplification γ), the others once, at `splu publish`'s defaults.
WITH_GAMMA: dict[str, Callable[[Table, str, int, ServiceKey, np.ndarray], Published]] = {
    "anatomy": _anatomy,
    "global": _global,
    "sdr": _sdr,
}
WITHOUT_GAMMA: dict[str, Callable[[Table, str, ServiceKey, np.ndarray], Published]] = {
    "fprivacy": _fprivacy,
    "dbr": _dbr,
}
BASELINES = (*WITH_GAMMA, *WITHOUT_GAMMA)


def plan_baseline(
    mechanism: str,
    table: Table,
    sensitive: str,
    gamma: int | None,
    pool: QueryPool,
    releases: Releases,
) -> Setting:
    """A batch mechanism (`BASELINES`) at `gamma` (those in `WITH_GAMMA`; None for the
    others): its guarantee in words and the errors over one publication per (key, ids)."""
    if (gamma is None) == (mechanism in WITH_GAMMA):
        raise ValueError(f"{mechanism} takes {'a' if mechanism in WITH_GAMMA else 'no'} γ")
    errors = Errors()
    parameters: dict[str, Any] = {}
    for key, ids in releases:
        if gamma is None:
            answers, parameters = WITHOUT_GAMMA[mechanism](table, sensitive, key, ids)
        else:
            answers, parameters = WITH_GAMMA[mechanism](table, sensitive, gamma, key, ids)
        errors.add(answers, pool)
    guarantees = {"statement": MECHANISMS[mechanism].guarantee}
    return Setting(mechanism, parameters, guarantees, errors.summary(), missing_bands(pool))


def baseline_gammas(mechanism: str, table: Table, sensitive: str, gammas: range) -> list[int]:
    """The planned γ a batch mechanism can publish at, as its domain allows (global
    randomization needs more than γ values: its retention 1/γ must exceed each other
    value's probability)."""
    check, attribute = MECHANISMS[mechanism].check_domain, table.schema[sensitive]
    return [g for g in gammas if check is None or check({"gamma": g}, attribute) is None]


def missing_bands(pool: QueryPool) -> list[str]:
    """Warnings for a band the sample gave no query for: its error is not measured."""
    out = []
    if not pool.large:
        out.append(f"no large query (true count ≥ {LARGE_SHARE:.0%} of the rows) was found")
    if not pool.small:
        out.append(f"no small query (true count 1–{SMALL_MAX}) was found")
    return out


def most_private(mechanism: str, settings: Sequence[Setting]) -> Setting | None:
    """The setting of `mechanism` its knob makes most private (decoy groups: the largest
    γ; personal groups: the lowest retention)."""
    spec = MECHANISMS[mechanism]
    assert spec.knob is not None, f"{mechanism} is not planned"
    pick = max if spec.private_upward else min
    return pick(settings, key=lambda s: s.parameters[spec.knob], default=None)


def recommend(mechanism: str, settings: Sequence[Setting], max_error: float) -> Setting | None:
    """Among the settings of `mechanism` that keep its guarantee and whose large-count
    mean error is at most `max_error`, the most private (decoy groups: the largest γ) or
    the most accurate (personal groups, among those SPS keeps private in every group)."""
    spec = MECHANISMS[mechanism]
    fitting = [
        s
        for s in settings
        if s.mechanism == mechanism
        and spec.keeps_guarantee(s.guarantees)
        and (e := s.large_mean()) is not None
        and e <= max_error
    ]
    if spec.recommends_most_private:
        return most_private(mechanism, fitting)
    return min(fitting, key=lambda s: s.large_mean() or 0.0, default=None)


# The stream budget a planned batch budget stands for: the batch's adaptive budget uses
# each group's final frequency, which a stream does not know; its bounded budget plans with
# an upper confidence bound on it instead and approaches adaptive as groups grow.
STREAM_BUDGET = {"adaptive": "bounded", "conservative": "conservative", "none": "none"}


def toml_block(setting: Setting) -> str:
    """The stream config's table for `setting`, as service/core/config.py reads it."""
    lines = [f"[{setting.mechanism}]"]
    for key, value in setting.parameters.items():
        if key == "budget":
            value = STREAM_BUDGET[value]
        if value is not None:
            lines.append(
                f"{key} = {value:g}" if isinstance(value, float) else f"{key} = {json.dumps(value)}"
            )
    return "\n".join(lines) + "\n"


def floor_note(rows: int, floor: int, partitions: int, min_mixing: int) -> str | None:
    """What a survey of `rows` responses gets from a mixing floor it can never fill, and
    what to set to publish while responses arrive; None if it fills the floor."""
    if rows >= floor * partitions:
        return None
    per_partition = "" if partitions == 1 else f" per partition × {partitions} partitions"
    fits = max(rows // (2 * partitions), min_mixing)
    return (
        f"note: {rows:,} responses never fill the mixing floor of {floor:,} records"
        f"{per_partition}: nothing is published until the stream closes (`splu close`; "
        "`splu run` closes at the end of its input), then every record leaves mixed in one "
        f"take. To publish while responses arrive, set [stream] mixing_pool = {fits} (at "
        f"least {min_mixing}, 10 groups)" + ("" if partitions == 1 else " and partitions = 1")
    )
