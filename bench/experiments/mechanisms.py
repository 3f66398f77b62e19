"""Every mechanism behind one signature: publish a table, answer a query pool, time both.

Parameters follow the papers' fair-comparison rules (seed notes 001 pitfall 20 and
each paper's experiment section), with γ = 5 unless a sweep varies it:

- decoy groups: group size γ; the service default (size-weighted grouping, mixing
  matrix, closed form) and, for reference, the papers' configuration (Anatomy
  grouping, the paper's matrix, iterative Bayesian reconstruction);
- Anatomy: ℓ = γ, Xiao & Tao's estimator;
- global randomization (mechanism A): keep the value with p = 1/γ;
- SDR: ρ1 = 1/⌊N/f_max⌋ (every value protected, as the paper sets 1/13 on OCC) and
  ρ2 chosen so the whole table's amplification (ρ2/ρ1)(1−ρ1)/(1−ρ2) equals γ;
- F′-privacy: f′_i = min{1, θ·f_i + 0.02}, θ = 8, buckets of at most M′ = 50 (seed 003 §7);
- DBR: values drawn from the sensitive marginal, published counts as estimates;
- Laplace: ε ∈ {ln 2, ln 3, 0.1}, either b = 1/ε per query (Δf = 1, the journal's
  small-count comparison, seed 000 Fig. 7) or b = m/ε with m = 100 queries sharing ε
  (seed 001 §9, pitfall 20);
- personal groups: p = 0.5, λ = δ = 0.3, adaptive budget (the thesis's SPS), and plain
  uniform perturbation with the same p (the thesis's baseline UP), merge map fitted on
  Adult once (the reference sample) and reused at every N.

Every estimate is then clipped to [0, |P|] by the harness, not here: |P| is public
(public values are published verbatim), so clipping is free post-processing, and
applying it to every mechanism keeps the comparison even (decoy groups clip by
default; the other estimators are unclipped, unbiased MLEs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.experiments.workload import INCOME, OCCUPATION, Pool
from service.core.mechanisms.anatomy import Anatomy, AnatomyReconstruction
from service.core.mechanisms.dbr import DBRReconstruction, DistributionBasedRandomization
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.mechanisms.fprivacy import FPrivacyBucketization, FPrivacyReconstruction
from service.core.mechanisms.global_randomization import (
    GlobalRandomization,
    GlobalRandomizationReconstruction,
)
from service.core.mechanisms.laplace import LaplaceCounts
from service.core.mechanisms.personal import PersonalGroups
from service.core.mechanisms.personal_reconstruction import PersonalReconstruction
from service.core.mechanisms.sdr import (
    SDRReconstruction,
    SmallDomainRandomization,
    privacy_for_amplification,
)
from service.core.merge import ValueMap
from service.core.prf import ServiceKey
from service.core.reconstruct import PublishedCells
from service.core.table import Table

DEFAULT_GAMMA = 5
F_THETA = 8
F_MAX_SIZE = 50
RETENTION, LAMBDA, DELTA = 0.5, 0.3, 0.3
LAPLACE_QUERIES = 100
EPSILONS = {"ln 2": math.log(2), "ln 3": math.log(3), "0.1": 0.1}


@dataclass
class Context:
    """One publication's inputs: the table, its ids and key, and the queries to answer."""

    table: Table
    ids: np.ndarray
    key: ServiceKey
    pool: Pool
    value_map: ValueMap | None = None


@dataclass
class Outcome:
    estimates: np.ndarray
    publish_seconds: float
    answer_seconds: float
    info: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Mechanism:
    key: str  # as written in the CSVs
    label: str  # as shown in plots and the report
    workload: str
    uses_gamma: bool
    color: str
    style: str
    run: Callable[[Context, int], Outcome] = field(repr=False, compare=False)
    sweeps_n: bool = True  # also measured on the resampled tables


def _timed(publish: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    release = publish()
    return release, time.perf_counter() - started


def _answer(reconstruction_of: Callable[[], object], pool: Pool) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    answers = reconstruction_of().estimate_many(pool.queries)  # type: ignore[attr-defined]
    estimates = np.fromiter((a.estimate for a in answers), float, len(answers))
    return estimates, time.perf_counter() - started


def decoy(grouping: str, matrix: str, method: str) -> Callable[[Context, int], Outcome]:
    def run(ctx: Context, gamma: int) -> Outcome:
        release, publish = _timed(
            lambda: DecoyGroups(gamma, grouping).publish(ctx.table, ctx.ids, ctx.key)
        )
        estimates, answer = _answer(
            lambda: DecoyReconstruction(
                PublishedCells.from_table(release.published),
                gamma,
                [ctx.pool.sensitive],
                method=method,
                matrix=matrix,
                grouping=grouping,
            ),
            ctx.pool,
        )
        suppressed = sum(sum(v.values()) for v in release.suppressed.values())
        info = {"suppressed rows": suppressed, "trimmed rows": len(release.trimmed_lines)}
        return Outcome(estimates, publish, answer, info)

    return run


def anatomy(ctx: Context, gamma: int) -> Outcome:
    release, publish = _timed(lambda: Anatomy(gamma).publish(ctx.table, ctx.ids, ctx.key))
    estimates, answer = _answer(lambda: AnatomyReconstruction(release), ctx.pool)
    return Outcome(estimates, publish, answer, {"groups": release.groups})


def global_randomization(ctx: Context, gamma: int) -> Outcome:
    m = ctx.table.schema[ctx.pool.sensitive].size
    published, publish = _timed(
        lambda: GlobalRandomization(gamma, m).publish(ctx.table, ctx.ids, ctx.key)
    )
    estimates, answer = _answer(
        lambda: GlobalRandomizationReconstruction(
            PublishedCells.from_table(published), ctx.pool.sensitive, gamma, m
        ),
        ctx.pool,
    )
    return Outcome(estimates, publish, answer)


def sdr(ctx: Context, gamma: int) -> Outcome:
    rho1, rho2 = privacy_for_amplification(np.bincount(ctx.table.codes[ctx.pool.sensitive]), gamma)
    release, publish = _timed(
        lambda: SmallDomainRandomization(rho1, rho2).publish(ctx.table, ctx.ids, ctx.key)
    )
    estimates, answer = _answer(lambda: SDRReconstruction.from_release(release), ctx.pool)
    subtables = release.subtables
    weights = np.array([s.size for s in subtables], dtype=float)
    info = {
        "rho1": float(rho1),
        "rho2": float(rho2),
        "sub-tables": len(subtables),
        "mean m_i": float(np.average([s.m for s in subtables], weights=weights)),
        "mean gamma_i": float(np.average([float(s.gamma) for s in subtables], weights=weights)),
        "mean retention p_i": float(
            np.average([float(s.retention) for s in subtables], weights=weights)
        ),
    }
    return Outcome(estimates, publish, answer, info)


def fprivacy(ctx: Context, gamma: int) -> Outcome:
    mechanism = FPrivacyBucketization(F_THETA, max_size=F_MAX_SIZE)
    release, publish = _timed(lambda: mechanism.publish(ctx.table, ctx.ids, ctx.key))
    estimates, answer = _answer(lambda: FPrivacyReconstruction(release.published), ctx.pool)
    sizes = release.published.sizes
    unprotected = [label for label, f in release.thresholds.items() if f >= 1]
    info = {
        "buckets": len(sizes),
        "rows in singleton buckets": int((sizes == 1).sum()),
        "values with f' = 1": len(unprotected),
        "suppressed rows": sum(release.suppressed.values()),
        "MSE": release.mse,
    }
    return Outcome(estimates, publish, answer, info)


def dbr(ctx: Context, gamma: int) -> Outcome:
    published, publish = _timed(
        lambda: DistributionBasedRandomization().publish(ctx.table, ctx.ids, ctx.key)
    )
    estimates, answer = _answer(
        lambda: DBRReconstruction(PublishedCells.from_table(published), [ctx.pool.sensitive]),
        ctx.pool,
    )
    return Outcome(estimates, publish, answer)


def laplace(epsilon: float, queries: int) -> Callable[[Context, int], Outcome]:
    """True count + the mechanism's keyed Lap(queries/ε) noise.

    `LaplaceCounts.answer` refuses a pool of more distinct queries than its budget m
    covers (correctly, for a service). The experiments answer ~1,100 queries per
    pool, each *as if* it were one of m queries sharing ε, so they call the public
    `noise` method of a mechanism built for m and add it to the true counts, which
    is exactly what `answer` computes.
    """

    def run(ctx: Context, gamma: int) -> Outcome:
        started = time.perf_counter()
        noise = LaplaceCounts(epsilon, queries).noise(ctx.pool.queries, ctx.key)
        answer = time.perf_counter() - started
        return Outcome(ctx.pool.true + noise, 0.0, answer, {"scale b": queries / epsilon})

    return run


def personal(budget: str) -> Callable[[Context, int], Outcome]:
    def run(ctx: Context, gamma: int) -> Outcome:
        sensitive = ctx.pool.sensitive
        m = ctx.table.schema[sensitive].size
        mechanism = PersonalGroups(RETENTION, LAMBDA, DELTA, budget, ctx.value_map)
        release, publish = _timed(lambda: mechanism.publish(ctx.table, ctx.ids, ctx.key))
        estimates, answer = _answer(
            lambda: PersonalReconstruction(
                PublishedCells.from_table(release.published),
                sensitive,
                RETENTION,
                m,
                LAMBDA,
                DELTA,
                budget=budget,
                value_map=ctx.value_map,
            ),
            ctx.pool,
        )
        plain = release.plain
        info = {
            "personal groups": len(plain.sizes),
            "perturbed rows": release.sampled_rows,
            "v_g (plain)": plain.groups_failing,
            "v_r (plain)": plain.records_failing,
            "groups over limit": int((~release.audit.passed).sum()),
        }
        return Outcome(estimates, publish, answer, info)

    return run


def _laplace_mechanisms(workload: str, suffix: str) -> list[Mechanism]:
    shades = {"ln 2": "#bcbd22", "ln 3": "#000000", "0.1": "#7f7f7f"}
    out = [
        Mechanism(
            f"laplace-eps-{name.replace(' ', '')}{suffix}",
            f"Laplace ε = {name}, b = 1/ε",
            workload,
            False,
            shades[name],
            ":",
            laplace(eps, 1),
        )
        for name, eps in EPSILONS.items()
    ]
    if workload == OCCUPATION:
        out += [
            Mechanism(
                f"laplace-m{LAPLACE_QUERIES}-eps-{name.replace(' ', '')}",
                f"Laplace ε = {name}, b = m/ε (m = {LAPLACE_QUERIES})",
                workload,
                False,
                shades[name],
                "-.",
                laplace(eps, LAPLACE_QUERIES),
            )
            for name, eps in EPSILONS.items()
        ]
    return out


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism(
        "decoy",
        "Decoy groups (SPLU-Gen), γ",
        OCCUPATION,
        True,
        "#d62728",
        "-",
        decoy("size-weighted", "mixing", "closed"),
    ),
    Mechanism(
        "decoy-paper",
        "Decoy groups, papers' configuration, γ",
        OCCUPATION,
        True,
        "#ff9896",
        "--",
        decoy("anatomy", "paper", "iterative"),
        sweeps_n=False,
    ),
    Mechanism("anatomy", "Anatomy, ℓ = γ", OCCUPATION, True, "#1f77b4", "-", anatomy),
    Mechanism(
        "global",
        "Global randomization, p = 1/γ",
        OCCUPATION,
        True,
        "#ff7f0e",
        "-",
        global_randomization,
    ),
    Mechanism("sdr", "SDR, amplification γ", OCCUPATION, True, "#2ca02c", "-", sdr),
    Mechanism(
        "fprivacy", f"F′-privacy, θ = {F_THETA}", OCCUPATION, False, "#9467bd", "--", fprivacy
    ),
    Mechanism("dbr", "DBR", OCCUPATION, False, "#8c564b", "--", dbr),
    *_laplace_mechanisms(OCCUPATION, ""),
    Mechanism(
        "personal-sps",
        f"Personal groups + SPS (p = {RETENTION}, λ = δ = {LAMBDA})",
        INCOME,
        False,
        "#17becf",
        "-",
        personal("adaptive"),
    ),
    Mechanism(
        "personal-up",
        f"Uniform perturbation, no SPS (p = {RETENTION})",
        INCOME,
        False,
        "#e377c2",
        "-",
        personal("none"),
    ),
    Mechanism("dbr-income", "DBR", INCOME, False, "#8c564b", "--", dbr),
    *_laplace_mechanisms(INCOME, "-income"),
)
BY_KEY = {m.key: m for m in MECHANISMS}
