"""The Markdown report: every figure next to the trend its paper reports, with a verdict.

Everything here is computed from the harness's results; the report is never edited
by hand. Each claim is a paper's statement (quoted or paraphrased from the seed
notes, with its source), the numbers we measured for it, and a verdict (agree,
partly, differ) whose explanation is chosen by the same test that sets the verdict.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.experiments.mechanisms import (
    BY_KEY,
    DEFAULT_GAMMA,
    DELTA,
    EPSILONS,
    F_MAX_SIZE,
    F_THETA,
    LAMBDA,
    LAPLACE_QUERIES,
    MECHANISMS,
    RETENTION,
)
from bench.experiments.plots import Figure
from bench.experiments.workload import (
    BANDS,
    INCOME,
    LARGE_KEY,
    OCCUPATION,
    SMALL_MAX,
    UTILITY_KEY,
    WORKLOADS,
)
from service.core.table import Table

AGREE, PARTLY, DIFFER = "Agree", "Partly agree", "Differ"
HOLDS, FAILS = "Holds", "Does not hold"
SHORT = {
    "decoy": "decoy groups",
    "sdr": "SDR",
    "global": "global randomization",
    "laplace-eps-0.1": "Laplace (ε = 0.1, b = 1/ε)",
    "anatomy": "Anatomy",
    "dbr": "DBR",
    "fprivacy": "F′-privacy",
}
UNPROTECTED = "values with f' = 1"


def pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    if abs(x) >= 10:
        return f"{100 * x:,.0f}%"
    return f"{100 * x:.1f}%"


def seconds(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def rows_label(n: int) -> str:
    return f"{n:,}"


@dataclass
class Claim:
    source: str
    paper: str
    measured: str
    verdict: str
    why: str
    kind: str = "Paper"

    def render(self) -> str:
        return (
            f"- **{self.kind}** ({self.source}): {self.paper}\n"
            f"  **We measure:** {self.measured}\n"
            f"  **{self.verdict}.** {self.why}\n"
        )


class Results:
    """Lookups into the aggregated rows."""

    def __init__(
        self,
        gamma_rows: list[dict],
        n_rows: list[dict],
        runtime_rows: list[dict],
        note_rows: list[dict],
        pool_rows: list[dict],
    ) -> None:
        self.pool_rows = pool_rows
        self.by_gamma = {(r["mechanism"], r["gamma"], r["band"]): r for r in gamma_rows}
        self.by_n = {(r["mechanism"], r["n"], r["band"]): r for r in n_rows}
        self.runtime_rows = {(r["mechanism"], r["n"]): r for r in runtime_rows}
        self.note_rows = note_rows
        self.gammas = sorted({r["gamma"] for r in gamma_rows if r["gamma"] != ""})
        self.sizes = sorted({r["n"] for r in n_rows})
        self.adult_n = self.sizes[0]
        self.adult_name = next(r["dataset"] for r in gamma_rows)
        self.largest = self.sizes[-1]

    def row(self, mechanism: str, band: str, gamma: int | None = None) -> dict | None:
        uses = BY_KEY[mechanism].uses_gamma
        return self.by_gamma.get((mechanism, (gamma or DEFAULT_GAMMA) if uses else "", band))

    def at(self, mechanism: str, band: str, gamma: int | None = None) -> float:
        row = self.row(mechanism, band, gamma)
        return row["mean_rel_error"] if row else math.nan

    def sd(self, mechanism: str, band: str, gamma: int | None = None) -> float:
        row = self.row(mechanism, band, gamma)
        return row["sd_over_publications"] if row else math.nan

    def over_gamma(self, mechanism: str, band: str) -> list[float]:
        return [self.at(mechanism, band, g) for g in self.gammas]

    def n_at(self, mechanism: str, band: str, n: int) -> float:
        row = self.by_n.get((mechanism, n, band))
        return row["mean_rel_error"] if row else math.nan

    def over_n(self, mechanism: str, band: str) -> list[float]:
        return [self.n_at(mechanism, band, n) for n in self.sizes]

    def mean_true(self, band: str, n: int, workload: str = OCCUPATION) -> float:
        for row in self.pool_rows:
            if row["band"] == band and row["n"] == n and row["workload"] == workload:
                return float(row["mean_true_count"])
        return math.nan

    def runtime(self, mechanism: str, n: int, column: str) -> float:
        row = self.runtime_rows.get((mechanism, n))
        return row[column] if row else math.nan

    def note(self, mechanism: str, name: str, n: int | None = None) -> float | None:
        n = self.adult_n if n is None else n
        for row in self.note_rows:
            if row["mechanism"] == mechanism and row["name"] == name and row["n"] == n:
                return row["value"]
        return None


def series(values: Sequence[float], keys: Sequence[object], fmt=pct) -> str:
    return ", ".join(f"{k}: {fmt(v)}" for k, v in zip(keys, values, strict=True))


def gamma_series(r: Results, mechanism: str, band: str) -> str:
    return series(r.over_gamma(mechanism, band), [f"γ = {g}" for g in r.gammas])


def n_series(r: Results, mechanism: str, band: str) -> str:
    return series(r.over_n(mechanism, band), [f"{n // 1000}k" for n in r.sizes])


def falls(values: Sequence[float]) -> bool:
    return all(b <= a for a, b in itertools.pairwise(values))


def rises(values: Sequence[float]) -> bool:
    return all(b >= a for a, b in itertools.pairwise(values))


def correlation(x: Sequence[float], y: Sequence[float]) -> float:
    if len(x) < 3:
        return math.nan
    return float(np.corrcoef(np.asarray(x, float), np.asarray(y, float))[0, 1])


@dataclass
class Facts:
    """What the data set itself says (Adult, occupation and income)."""

    n: int
    m: int
    top_share: float
    top_values: list[str]
    unprotected: list[str]  # values F′-privacy's θ formula gives f′ = 1
    income_m: int
    income_top_share: float

    @classmethod
    def of(cls, adult: dict[str, Table]) -> Facts:
        table = adult[OCCUPATION]
        sensitive = WORKLOADS[OCCUPATION][1]
        counts = np.bincount(table.codes[sensitive], minlength=table.schema[sensitive].size)
        order = np.argsort(-counts)
        domain = table.schema[sensitive].domain
        return cls(
            n=len(table),
            m=table.schema[sensitive].size,
            top_share=float(counts.max() / len(table)),
            top_values=[domain[i] for i in order[:4]],
            unprotected=[
                domain[i] for i in order if F_THETA * counts[i] >= (1 - 0.02) * len(table)
            ],
            income_m=adult[INCOME].schema[WORKLOADS[INCOME][1]].size,
            income_top_share=float(
                np.bincount(adult[INCOME].codes[WORKLOADS[INCOME][1]]).max() / len(adult[INCOME])
            ),
        )

    def amplification(self, gamma: int) -> float:
        """1/(1/γ − t) for the most frequent value: the decoy estimate's noise amplification."""
        f = self.top_share
        t = (gamma - 1) * f / (gamma * (1 - f))
        return 1 / (1 / gamma - t) if 1 / gamma > t else math.inf


# --------------------------------------------------------------------------- claims


def headline_claims(r: Results) -> list[Claim]:
    decoy_large, anatomy_large = r.at("decoy", LARGE_KEY), r.at("anatomy", LARGE_KEY)
    decoy_small = r.at("decoy", "small")
    laplace_small = r.at("laplace-eps-ln3", "small")
    return [
        Claim(
            "issue 7; the papers' claim in seed 000 Fig. 9 and seed 001 Figs. 8–9",
            f"decoy groups' large-count error (selectivity ≥ 1%) at γ = {DEFAULT_GAMMA} is "
            f"below Anatomy's (ℓ = {DEFAULT_GAMMA}).",
            f"decoy groups {pct(decoy_large)} (sd over publications "
            f"{pct(r.sd('decoy', LARGE_KEY))}), Anatomy {pct(anatomy_large)} "
            f"(sd {pct(r.sd('anatomy', LARGE_KEY))}).",
            HOLDS if decoy_large < anatomy_large else FAILS,
            (
                f"Decoy groups are {anatomy_large / decoy_large:.2f}× more accurate. Anatomy's "
                "estimator assumes public and sensitive values are independent inside each "
                "group; that bias does not average out (its signed mean is "
                f"{pct(r.row('anatomy', LARGE_KEY)['signed_mean_rel_error'])}), while the decoy "
                "estimate is unbiased (signed mean "
                f"{pct(r.row('decoy', LARGE_KEY)['signed_mean_rel_error'])})."
            )
            if decoy_large < anatomy_large
            else "On this data the decoy estimate's sampling noise exceeds Anatomy's bias.",
            "Target",
        ),
        Claim(
            "issue 7; the journal's claim in seed 000 Fig. 7, Δf = 1, ε = ln 2 and ln 3",
            f"decoy groups' small-count error (true count 1–{SMALL_MAX}) at γ = "
            f"{DEFAULT_GAMMA} is above Laplace's at ε = ln 3 (noise Lap(1/ε) per query).",
            f"decoy groups {pct(decoy_small)} (sd {pct(r.sd('decoy', 'small'))}), Laplace "
            f"{pct(laplace_small)} (sd {pct(r.sd('laplace-eps-ln3', 'small'))}).",
            HOLDS if decoy_small > laplace_small else FAILS,
            (
                f"Decoy groups leave small counts {decoy_small / laplace_small:.1f}× noisier. "
                "Laplace noise of scale 1/ln 3 ≈ 0.91 is small against counts of 1–10, while a "
                "decoy estimate of a small conjunctive count carries the binomial noise of the "
                f"whole predicate amplified by 1/(1/γ − t)."
            )
            if decoy_small > laplace_small
            else "Laplace noise exceeds the decoy estimate's noise on these small counts.",
            "Target",
        ),
    ]


def laplace_note(r: Results) -> str:
    """The other Laplace calibration, which reverses the small-count comparison."""
    decoy_small = r.at("decoy", "small")
    budget_small = r.at(f"laplace-m{LAPLACE_QUERIES}-eps-ln3", "small")
    budget_large = r.at(f"laplace-m{LAPLACE_QUERIES}-eps-ln3", LARGE_KEY)
    above = budget_small > decoy_small
    return (
        "The second target depends on how Laplace is calibrated. The journal's Fig. 7 adds "
        "Lap(1/ε) to each count (Δf = 1, every query on its own budget); seed 001 and the "
        f"fair-comparison rule (pitfall 20) split ε over m = {LAPLACE_QUERIES} queries, noise "
        f"Lap(m/ε), b = {LAPLACE_QUERIES / math.log(3):.0f} at ε = ln 3. With that calibration "
        f"Laplace's small-count error is {pct(budget_small)}, "
        + (
            f"**above** decoy groups' {pct(decoy_small)}, so the comparison reverses, and its "
            f"large-count error is {pct(budget_large)}. "
            if above
            else f"still below decoy groups' {pct(decoy_small)}. "
        )
        + "Both calibrations are reported throughout."
    )


def large_gamma_claims(r: Results, facts: Facts) -> list[Claim]:
    claims = []
    decoy = r.over_gamma("decoy", LARGE_KEY)
    anatomy = r.over_gamma("anatomy", LARGE_KEY)
    below = [g for g, d, a in zip(r.gammas, decoy, anatomy, strict=True) if d < a]
    claims.append(
        Claim(
            "seed 000 Fig. 9(a, b); seed 001 Figs. 8–9, at γ = ℓ = 5",
            "decoy groups (SPLU-Gen) answer large counts more accurately than Anatomy.",
            f"decoy groups {gamma_series(r, 'decoy', LARGE_KEY)}; Anatomy "
            f"{gamma_series(r, 'anatomy', LARGE_KEY)}.",
            AGREE if len(below) == len(r.gammas) else PARTLY if below else DIFFER,
            (
                f"Decoy groups are below Anatomy at γ ∈ {{{', '.join(map(str, below))}}}"
                if below
                else "Decoy groups are above Anatomy at every γ"
            )
            + (
                "; above it at "
                + ", ".join(f"γ = {g}" for g in r.gammas if g not in below)
                + ". The decoy estimate's noise grows with γ: the closed form amplifies it by "
                "1/(1/γ − t), which for Adult's most frequent occupations (up to "
                f"{pct(facts.top_share)} of the records, close to the eligibility bound 1/γ) is "
                + ", ".join(
                    f"{facts.amplification(g):.0f} at γ = {g}"
                    for g in dict.fromkeys((r.gammas[0], DEFAULT_GAMMA, r.gammas[-1]))
                    if g in r.gammas
                )
                + " (seed notes 001 §5.3: values near the bound are barely identifiable in "
                "conjunctions), while Anatomy's bias barely moves with ℓ."
                if len(below) < len(r.gammas)
                else "."
            ),
        )
    )
    two_five = r.at("decoy", "2-5%")
    paper_bands = [b.key for b in BANDS if b.low >= 0.005]
    worst = max(r.at("decoy", b) for b in paper_bands)
    best_gamma = r.gammas[int(np.nanargmin(decoy))]
    paper_config = r.over_gamma("decoy-paper", LARGE_KEY)
    paper_best = r.gammas[int(np.nanargmin(paper_config))]
    bounds_hold = two_five <= 0.20 and worst <= 0.40
    dip = best_gamma not in (r.gammas[0], r.gammas[-1])
    claims.append(
        Claim(
            "seed 001 Fig. 4 (ℓ′ = γ = 2…10)",
            "large-count error 'as low as 20%' for selectivity 2–5% and bounded by 40% for "
            "selectivities 0.5–5%; as γ grows it first decreases, then rises.",
            f"at γ = {DEFAULT_GAMMA}: 2–5% band {pct(two_five)}, worst band from 0.5% up "
            f"{pct(worst)}. The error is smallest at γ = {best_gamma} "
            f"({gamma_series(r, 'decoy', LARGE_KEY)}); with the papers' configuration (Anatomy "
            f"grouping, the paper's matrix, iterative method) it is smallest at γ = {paper_best} "
            f"({gamma_series(r, 'decoy-paper', LARGE_KEY)}).",
            AGREE if bounds_hold and dip else PARTLY if bounds_hold or dip else DIFFER,
            ("The bounds hold. " if bounds_hold else "The bounds do not hold at γ = 5. ")
            + (
                f"The dip appears too (smallest at γ = {best_gamma})."
                if dip
                else "There is no initial decrease with the service's estimator: its noise "
                f"amplification 1/(1/γ − t) grows with γ, so the smallest γ, {best_gamma}, is "
                "best. The paper's dip is plausibly an artefact of its matrix entry t = f_s/N, "
                "which overcounts by γ/(γ − 1), most at γ = 2 (seed notes 001 §5.3, §7.2)"
                + (
                    "; our run of the papers' configuration does dip (smallest at γ = "
                    f"{paper_best}), which supports that."
                    if paper_best not in (r.gammas[0], r.gammas[-1])
                    else "; our run of the papers' configuration does not dip either (smallest "
                    f"at γ = {paper_best}), so this stays a hypothesis."
                )
                if best_gamma == r.gammas[0]
                else f"The error is smallest at the largest γ, {best_gamma}."
            )
            + (
                f" The error jumps at γ = {max(r.gammas)}: Adult's most frequent occupation "
                f"holds {pct(facts.top_share)} of the records, just under 1/{max(r.gammas)}, "
                "so those values are nearly unidentifiable in conjunctions."
                if max(r.gammas) >= 7
                else ""
            ),
        )
    )
    glob = r.over_gamma("global", LARGE_KEY)
    worse = [g for g, a, d in zip(r.gammas, glob, decoy, strict=True) if a > d]
    p, q = 1 / DEFAULT_GAMMA, (1 - 1 / DEFAULT_GAMMA) / (facts.m - 1)
    claims.append(
        Claim(
            "seed 001 Fig. 10",
            "global randomization (mechanism A, p = 1/γ) is much worse than decoy groups for "
            "all selectivities.",
            f"global randomization {gamma_series(r, 'global', LARGE_KEY)}.",
            AGREE if len(worse) == len(r.gammas) else PARTLY if worse else DIFFER,
            (
                "It is worse at every γ."
                if len(worse) == len(r.gammas)
                else (
                    f"It is worse only at γ ∈ {{{', '.join(map(str, worse))}}}. "
                    if worse
                    else "It is more accurate at every γ. "
                )
                + f"With m = {facts.m} occupations and p = 1/γ, q = (1 − 1/γ)/(m − 1), "
                f"each record keeps p − q = {p - q:.3f} of its signal at γ = {DEFAULT_GAMMA}, "
                "about what a decoy group keeps (1/γ − t, 0.08–0.2 by value), and the "
                "inverse-matrix MLE is unbiased. The price is privacy, not accuracy: one "
                f"record changes the output's likelihood by p/q = {p / q:.2f} (seed 001 "
                "Lemma 2), where decoy groups give zero-privacy swaps. The paper does not say "
                "which estimator it used for mechanism A; a cruder one would explain its result."
            ),
        )
    )
    sdr = r.over_gamma("sdr", LARGE_KEY)
    sdr_below = all(s < a for s, a in zip(sdr, anatomy, strict=True))
    rho1, rho2 = sdr_privacy_at(r, facts)
    claims.append(
        Claim(
            "seed 002 Fig. 2 (OCC, ρ2 = 1/L)",
            "SDR's error falls as privacy weakens (larger ρ2) and is below Anatomy's at every "
            "setting.",
            f"SDR {gamma_series(r, 'sdr', LARGE_KEY)}.",
            AGREE if falls(sdr) and sdr_below else PARTLY if falls(sdr) or sdr_below else DIFFER,
            f"Here γ is SDR's amplification (ρ1 = {rho1}, ρ2 = {rho2:.3f} at γ = "
            f"{DEFAULT_GAMMA}), so a larger γ is a weaker guarantee, as a larger ρ2 is in the "
            "paper"
            + (", and the error falls with it" if falls(sdr) else ", yet the error does not fall")
            + (
                "; SDR is below Anatomy at every γ."
                if sdr_below
                else "; not below Anatomy everywhere."
            )
            + f" Note the privacy scale: at γ = {DEFAULT_GAMMA} SDR bounds a posterior by "
            f"ρ2 = {rho2:.0%}, Anatomy by 1/ℓ = {1 / DEFAULT_GAMMA:.0%}.",
        )
    )
    dbr, d5 = r.at("dbr", LARGE_KEY), r.at("decoy", LARGE_KEY)
    claims.append(
        Claim(
            "seed 000 Fig. 9(c)",
            "DBR leads to higher relative errors than SPLU-Gen for large sums.",
            f"DBR {pct(dbr)} (no γ), decoy groups {pct(d5)} at γ = {DEFAULT_GAMMA}.",
            AGREE if dbr > d5 else DIFFER,
            ("" if dbr > d5 else "Not here: decoy groups' noise exceeds DBR's bias. ")
            + (
                "DBR's published value ignores the record's own value, so P ∧ s comes out as "
                "|P|·f_s/N whatever the association; its error is the association itself "
                f"(signed mean {pct(r.row('dbr', LARGE_KEY)['signed_mean_rel_error'])})."
            ),
        )
    )
    fp, fp_all = r.at("fprivacy", LARGE_KEY), r.at("fprivacy", UTILITY_KEY)
    singletons = r.note("fprivacy", "rows in singleton buckets")
    unprotected = r.note("fprivacy", UNPROTECTED)
    claims.append(
        Claim(
            f"seed 003 Fig. 5 (θ = {F_THETA})",
            "F′-privacy's relative error is at most 'slightly over 10%' on OCC and below 10% "
            "for most settings.",
            f"F′-privacy {pct(fp)} on large counts and {pct(fp_all)} over all queries of "
            "selectivity ≥ 0.1%.",
            AGREE if fp_all <= 0.15 else PARTLY if fp <= 0.15 else DIFFER,
            "Comparable magnitude, with caveats: the paper's queries are disjunctions over up "
            "to 7 attributes with about 1% expected selectivity, not our conjunctions. And on "
            f"Adult θ = {F_THETA} gives f′ = 1 (no protection) to the "
            f"{int(unprotected or 0)} occupations with f ≥ (1 − 0.02)/θ = "
            f"{(1 - 0.02) / F_THETA:.2%}"
            + (
                f", whose {int(singletons):,} records sit in singleton buckets and are "
                "answered exactly"
                if singletons
                else ""
            )
            + "; that helps its error and is no privacy at all for them.",
        )
    )
    return claims


def sdr_privacy_at(r: Results, facts: Facts) -> tuple[str, float]:
    rho1 = r.note("sdr", "rho1")
    rho2 = r.note("sdr", "rho2")
    if rho1 is None or rho2 is None:
        return "n/a", math.nan
    return f"1/{round(1 / rho1)}", float(rho2)


def small_gamma_claims(r: Results) -> list[Claim]:
    claims = []
    decoy = r.over_gamma("decoy", "small")
    slope = float(np.polyfit(r.gammas, decoy, 1)[0]) if len(r.gammas) > 1 else math.nan
    rho = correlation(r.gammas, decoy)
    linear = rises(decoy) and (math.isnan(rho) or rho > 0.95)
    claims.append(
        Claim(
            "seed 001 Fig. 5; seed 000 Fig. 6",
            "the small-count error of decoy groups is 'sufficiently high to ensure privacy' and "
            "shows a positive linear correlation with γ.",
            f"{gamma_series(r, 'decoy', 'small')}; least-squares slope {pct(slope)} per unit "
            f"of γ, Pearson r = {'n/a' if math.isnan(rho) else f'{rho:.3f}'}.",
            AGREE if linear and decoy[0] >= 0.5 else PARTLY if rises(decoy) else DIFFER,
            "The error rises steadily with γ"
            + (" and almost exactly linearly" if linear else "")
            + ": the noise of a conjunctive estimate grows with γ (roughly linearly, seed notes "
            "001 §5.3), and the smallest γ already leaves "
            f"small counts off by {pct(decoy[0])} on average.",
        )
    )
    higher_from = [g for g in r.gammas if g >= 4] or r.gammas[-1:]
    rivals = ["anatomy", "dbr", "laplace-eps-ln2", "laplace-eps-ln3"]
    beaten = {
        g: [x for x in rivals if r.at("decoy", "small", g) > r.at(x, "small")] for g in higher_from
    }
    everywhere = all(len(v) == len(rivals) for v in beaten.values())
    claims.append(
        Claim(
            "seed 000 Figs. 7 and 10",
            "SPLU-Gen has a clearly higher small-count error than Anatomy, DBR and DP "
            "(Δf = 1, ε = ln 2 or ln 3) at γ ≥ 4.",
            f"at γ ∈ {{{', '.join(map(str, higher_from))}}}: decoy groups "
            + series(
                [r.at("decoy", "small", g) for g in higher_from], [f"γ = {g}" for g in higher_from]
            )
            + f"; Anatomy {gamma_series(r, 'anatomy', 'small')}; DBR "
            f"{pct(r.at('dbr', 'small'))}; Laplace ε = ln 2 "
            f"{pct(r.at('laplace-eps-ln2', 'small'))}, ε = ln 3 "
            f"{pct(r.at('laplace-eps-ln3', 'small'))}.",
            AGREE if everywhere else PARTLY,
            "Decoy groups randomize every record's value among γ, so the noise on a count of "
            "1–10 is of the order of the count itself; Anatomy publishes the true values "
            "(only their link to the public part is blurred), DBR's error on small counts is "
            "the association again, and Laplace at these ε adds noise of about one unit."
            + (
                ""
                if everywhere
                else " Exceptions: "
                + "; ".join(
                    f"γ = {g} not above {', '.join(BY_KEY[x].label for x in rivals if x not in v)}"
                    for g, v in beaten.items()
                    if len(v) < len(rivals)
                )
                + "."
            ),
        )
    )
    occupation = [m for m in MECHANISMS if m.workload == OCCUPATION]
    ranked = sorted(
        ((r.at(m.key, "small"), m.label) for m in occupation if r.row(m.key, "small")),
        key=lambda x: x[0],
    )
    lowest = ranked[0][1]
    ln3 = r.at("laplace-eps-ln3", "small")
    claims.append(
        Claim(
            "seed 000 Fig. 7",
            "with Δf = 1 and ε = ln 2 or ln 3 the Laplace small-count error is 'quite small "
            "compared to the other methods, and can lead to privacy concerns'; a smaller ε "
            "makes it bigger.",
            f"ε = ln 2 {pct(r.at('laplace-eps-ln2', 'small'))}, ε = ln 3 {pct(ln3)}, "
            f"ε = 0.1 {pct(r.at('laplace-eps-0.1', 'small'))}. The lowest small-count error of "
            f"all occupation mechanisms at γ = {DEFAULT_GAMMA}: {lowest} ({pct(ranked[0][0])}).",
            AGREE if ln3 < 1 and ln3 <= ranked[min(2, len(ranked) - 1)][0] else PARTLY,
            "Laplace's noise does not grow with the count, so relative error falls as 1/count; "
            "at ε = ln 3 a count of 5 is typically off by under one unit."
            + (
                f" Only {lowest} is lower: with θ = {F_THETA} its most frequent values are "
                "published exactly (see the large-count figure)."
                if lowest.startswith("F′")
                else ""
            ),
        )
    )
    budget = [
        r.at(f"laplace-m{LAPLACE_QUERIES}-eps-{e.replace(' ', '')}", "small") for e in EPSILONS
    ]
    claims.append(
        Claim(
            "seed 001 §9 (Lap(m/ε), m = 100; ε ∈ {0.01, 0.05} there)",
            "with the budget split over the workload, DP noise swamps counts, the more so the "
            "smaller they are.",
            "small-count error with b = m/ε: "
            + series(budget, [f"ε = {e}" for e in EPSILONS])
            + ".",
            AGREE if min(budget) > 1 else DIFFER,
            "Scale m/ε is 91 at ε = ln 3 and 1,000 at ε = 0.1 against counts of 1–10; the "
            "papers' ε = 0.01 and 0.05 would be 5–100× noisier still.",
        )
    )
    return claims


def selectivity_claims(r: Results) -> list[Claim]:
    claims = []
    utility = [b for b in BANDS if b.low >= 0.001]
    keys, labels = [b.key for b in utility], [b.label for b in utility]
    decoy = [r.at("decoy", k) for k in keys]
    anatomy = [r.at("anatomy", k) for k in keys]
    claims.append(
        Claim(
            "seed 000 Fig. 8",
            "SPLU-Gen's error falls as selectivity grows, consistent with the SPLU model; "
            "Anatomy does not show a similar trend.",
            f"decoy groups at γ = {DEFAULT_GAMMA}: {series(decoy, labels)}; Anatomy: "
            f"{series(anatomy, labels)}.",
            AGREE if falls(decoy) and not falls(anatomy) else PARTLY if falls(decoy) else DIFFER,
            f"Decoy groups fall {decoy[0] / decoy[-1]:.1f}× from the lowest band to the "
            f"highest"
            + (" monotonically" if falls(decoy) else ", though not monotonically")
            + ": the estimate is unbiased and its relative error shrinks like 1/√count (law of "
            f"large numbers). Anatomy changes only {anatomy[0] / anatomy[-1]:.1f}×"
            + (" and not monotonically" if not falls(anatomy) else "")
            + ": its error is mostly bias from assuming independence within groups.",
        )
    )
    dbr = [r.at("dbr", k) for k in keys]
    low_band_worse = dbr[0] > decoy[0]
    claims.append(
        Claim(
            "seed 000 Fig. 8",
            "DBR shows larger errors than SPLU-Gen at smaller selectivities and an increase in "
            "error at larger selectivity ('no obvious trend').",
            f"DBR: {series(dbr, labels)}.",
            AGREE if low_band_worse and not falls(dbr) else PARTLY if not falls(dbr) else DIFFER,
            (
                "DBR is below decoy groups in the lowest band, "
                if not low_band_worse
                else "DBR is above decoy groups in the lowest band, "
            )
            + (
                "and its error follows no monotone trend. "
                if not falls(dbr)
                else "and its error falls with selectivity. "
            )
            + "DBR's error is query-specific bias (how far P ∧ s is from |P|·f_s/N), which "
            "does not shrink with the count; decoy groups' error is noise, large at low "
            "counts. Which is bigger in a band depends on how associated the data are: the "
            "paper says as much ('utility fluctuates with the correlations').",
        )
    )
    budget = [r.at(f"laplace-m{LAPLACE_QUERIES}-eps-ln3", k) for k in keys]
    budget01 = [r.at(f"laplace-m{LAPLACE_QUERIES}-eps-0.1", k) for k in keys]
    decoy_spread = decoy[0] / decoy[-1]
    claims.append(
        Claim(
            "seed 001 Fig. 10 (N = 100k, m = 100, ε ∈ {0.01, 0.05})",
            "the DP error becomes 'unacceptably large for smaller s', while the impact of s on "
            "decoy groups is limited.",
            f"Laplace b = m/ε, ε = ln 3: {series(budget, labels)}; ε = 0.1: "
            f"{series(budget01, labels)}.",
            AGREE if falls(budget01) and budget01[0] > 1 and decoy_spread < 3 else PARTLY,
            "DP's error does explode at low selectivity (×"
            f"{budget01[0] / budget01[-1]:.0f} across the bands at ε = 0.1). But decoy groups "
            f"also vary {decoy_spread:.1f}× across the same bands: with {r.adult_n:,} rows the "
            f"0.1–0.5% band holds counts of {math.ceil(0.001 * r.adult_n)}–"
            f"{math.ceil(0.005 * r.adult_n) - 1}, where binomial noise is large. The paper's "
            "'limited impact' was over 1–5% only, where we see "
            f"{pct(r.at('decoy', '1-2%'))} → {pct(r.at('decoy', '>=5%'))}.",
        )
    )
    sdr = [r.at("sdr", k) for k in keys]
    glob = [r.at("global", k) for k in keys]
    claims.append(
        Claim(
            "seed 002 Fig. 2",
            "SDR's error falls as the selectivity threshold s grows (more random trials).",
            f"SDR: {series(sdr, labels)}; global randomization: {series(glob, labels)}.",
            AGREE if falls(sdr) else DIFFER,
            "Both are unbiased inverse-matrix estimators, so they follow the law of large "
            "numbers band by band.",
        )
    )
    return claims


def n_claims(r: Results) -> list[Claim]:
    claims = []
    decoy = r.over_n("decoy", LARGE_KEY)
    anatomy = r.over_n("anatomy", LARGE_KEY)
    below = sum(d < a for d, a in zip(decoy, anatomy, strict=True))
    claims.append(
        Claim(
            "seed 001 Figs. 8–9 (N = 100k…500k, ℓ = ℓ′ = 5)",
            "decoy groups' error is bounded by 30%, Anatomy's 'can be over 40%', and decoy "
            "groups are smaller 'for most choices of N'.",
            f"decoy groups {n_series(r, 'decoy', LARGE_KEY)}; Anatomy "
            f"{n_series(r, 'anatomy', LARGE_KEY)}.",
            AGREE if max(decoy) <= 0.30 and below == len(decoy) else PARTLY,
            f"Decoy groups stay ≤ {pct(max(decoy))} and are below Anatomy at {below} of "
            f"{len(decoy)} sizes"
            + (
                f"; Anatomy never exceeds {pct(max(anatomy))} here."
                if max(anatomy) <= 0.40
                else f"; Anatomy reaches {pct(max(anatomy))}."
            ),
        )
    )
    drop = decoy[0] / decoy[-1] if len(decoy) > 1 else math.nan
    expected = math.sqrt(r.largest / r.adult_n)
    candidates = ["decoy", "sdr", "global", "laplace-eps-0.1", "anatomy", "dbr", "fprivacy"]
    ratios = {
        k: r.n_at(k, LARGE_KEY, r.adult_n) / r.n_at(k, LARGE_KEY, r.largest) for k in candidates
    }
    falling = [SHORT[k] for k, v in ratios.items() if v >= 1 + 0.5 * (expected - 1)]
    flat = [SHORT[k] for k, v in ratios.items() if v < 1 + 0.2 * (expected - 1)]
    claims.append(
        Claim(
            "seed 001 Figs. 8–9",
            "'no obvious correlation' of the error with N.",
            f"from {r.adult_n:,} to {r.largest:,} rows the large-count error falls "
            + ", ".join(f"{v:.1f}× for {SHORT[k]}" for k, v in ratios.items())
            + ".",
            AGREE if drop < 1.3 else DIFFER,
            "Resampling keeps Adult's joint distribution, so at a fixed selectivity every "
            "count grows ∝ N and an unbiased estimator's relative error shrinks ∝ 1/√N "
            f"(√({r.largest:,}/{r.adult_n:,}) = {expected:.1f}×)"
            + (f": {', '.join(falling)} follow it" if falling else "")
            + (
                f"; {', '.join(flat)} are dominated by bias, which does not depend on N, and "
                "stay flat"
                if flat
                else ""
            )
            + ". The paper's figures are unreadable in the seed text, so we cannot say why "
            "its decoy curve was flat; its 100k–500k tables were samples of one census "
            "population too, where we would expect the same √N gain.",
        )
    )
    sdr = r.over_n("sdr", LARGE_KEY)
    claims.append(
        Claim(
            "seed 002 Fig. 2 (OCC-|T|, L = 6)",
            "SDR has a lower error than Anatomy at every |T|.",
            f"SDR {n_series(r, 'sdr', LARGE_KEY)}.",
            AGREE if all(s < a for s, a in zip(sdr, anatomy, strict=True)) else DIFFER,
            f"SDR's sub-tables keep a mean retention p_i = "
            f"{r.note('sdr', 'mean retention p_i') or math.nan:.3f} at amplification "
            f"{DEFAULT_GAMMA}, and its estimator is unbiased; Anatomy's bias stays.",
        )
    )
    small = r.over_n("decoy", "small")
    claims.append(
        Claim(
            "SPLU model (seeds 000, 001)",
            "small counts stay inaccurate whatever the table size: privacy is a property of "
            "the count, not of N.",
            f"decoy groups' small-count error {n_series(r, 'decoy', 'small')}; Laplace "
            f"ε = ln 3 (b = 1/ε) {n_series(r, 'laplace-eps-ln3', 'small')}. The band's mean "
            f"true count is {r.mean_true('small', r.adult_n):.1f} at {r.adult_n:,} rows and "
            f"{r.mean_true('small', r.largest):.1f} at {r.largest:,}.",
            AGREE if min(small) >= 0.5 else DIFFER,
            f"Decoy groups stay above {pct(min(small))} at every size: a count of 1–10 is "
            "protected by the binomial noise of its own few records, which does not shrink "
            "when the rest of the table grows. The error drifts down only because resampling "
            "(each Adult record appears about N/45k times) fills the band with counts nearer "
            "10, as Laplace's falling curve shows too.",
        )
    )
    return claims


def personal_claims(r: Results) -> list[Claim]:
    claims = []
    sps, up = (
        r.n_at("personal-sps", UTILITY_KEY, r.adult_n),
        r.n_at("personal-up", UTILITY_KEY, r.adult_n),
    )
    ratio = sps / up
    perturbed = r.note("personal-sps", "perturbed rows")
    groups = r.note("personal-sps", "personal groups")
    trial_ratio = math.sqrt(r.adult_n / perturbed) if perturbed else math.nan
    claims.append(
        Claim(
            "seed 004 Fig. 4.3 (Adult, p = 0.5, λ = δ = 0.3, selectivity ≥ 0.1%)",
            "SPS's relative error is up to about 50% higher than plain uniform perturbation's in "
            "the worst case.",
            f"over all queries of selectivity ≥ 0.1%: SPS {pct(sps)}, plain perturbation "
            f"{pct(up)}, ratio {ratio:.2f}×. SPS perturbs {int(perturbed or 0):,} of "
            f"{r.adult_n:,} rows.",
            AGREE if ratio <= 1.5 else DIFFER,
            "An unbiased estimate's error scales as 1/√(trials); SPS keeps "
            f"{int(perturbed or 0):,} trials, so we expect about √({r.adult_n:,}/"
            f"{int(perturbed or 0):,}) = {trial_ratio:.1f}× the error of plain perturbation"
            + (
                f", close to the {ratio:.1f}× we see. "
                if abs(math.log(ratio / trial_ratio)) < math.log(1.5)
                else f"; we see {ratio:.1f}×. "
            )
            + "With most records in groups over their limit (below) SPS "
            "must sample them hard; we cannot see how the thesis's ≤ 1.5× arose (its "
            f"generalization left 112 groups, our χ² merge {int(groups or 0)}, and its plot "
            "values are not in the seed text). "
            "bench/personal_accuracy.py measures the same gap on the thesis's merged-class "
            "queries.",
        )
    )
    vg, vr = r.note("personal-up", "v_g (plain)"), r.note("personal-up", "v_r (plain)")
    over = r.note("personal-sps", "groups over limit")
    groups = r.note("personal-sps", "personal groups")
    claims.append(
        Claim(
            "seed 004 Fig. 4.2 and §4.4",
            "at the defaults, plain perturbation leaves v_g = 85% of the personal groups, "
            "holding v_r > 99% of the records, over their (λ, δ) limit; SPS leaves none.",
            f"v_g = {pct(vg)}, v_r = {pct(vr)} of {int(groups or 0)} groups under plain "
            f"perturbation; {int(over or 0)} groups over the limit after SPS.",
            AGREE if (vr or 0) > 0.95 and (vg or 0) > 0.75 and over == 0 else PARTLY,
            "The records side matches (nearly all records are in violating groups) and SPS "
            "fixes every group. The group share is lower because our χ² merge "
            "(service.core.merge) yields fewer, larger groups than the thesis's generalization, "
            "and large groups are the ones that violate.",
        )
    )
    sps_n = r.over_n("personal-sps", LARGE_KEY)
    up_n = r.over_n("personal-up", LARGE_KEY)
    trials_n = [r.note("personal-sps", "perturbed rows", n) or math.nan for n in r.sizes]
    widens = sps_n[-1] / up_n[-1] > sps_n[0] / up_n[0]
    claims.append(
        Claim(
            "seed 004 Fig. 4.5(d) (OCC, |D| = 100k…500k)",
            "a larger data set gives a lower SPS error; SPS is more effective on larger data "
            "with many balanced values.",
            f"large-count error, SPS {n_series(r, 'personal-sps', LARGE_KEY)}; plain "
            f"perturbation {n_series(r, 'personal-up', LARGE_KEY)}. SPS perturbs "
            + ", ".join(f"{int(t or 0):,}" for t in trials_n)
            + " rows at these sizes.",
            [DIFFER, PARTLY, AGREE][(sps_n[-1] < sps_n[0]) + (not widens)],
            f"From {r.adult_n:,} to {r.largest:,} rows SPS's error goes from {pct(sps_n[0])} to "
            f"{pct(sps_n[-1])}, plain perturbation's from {pct(up_n[0])} to {pct(up_n[-1])}"
            + (
                ", so the gap to plain perturbation widens. "
                if widens
                else ", so the gap narrows. "
            )
            + "The limit s_g depends on a "
            "group's value frequencies, not on its size, and resampling Adult adds records to "
            "the same personal groups (and few new ones), so SPS's number of trials grows only "
            f"{trials_n[-1] / trials_n[0]:.1f}× while N grows {r.largest / r.adult_n:.0f}×: "
            "SPS's error cannot follow plain perturbation's 1/√N. The thesis's OCC has 50 "
            "balanced values (small f, large s_g) and 1,512 groups, a regime our income data "
            "(m = 2, f ≥ 0.5) cannot reach.",
        )
    )
    return claims


def runtime_claims(r: Results) -> list[Claim]:
    n = r.largest
    decoy = r.runtime("decoy", n, "publish_seconds")
    sdr = r.runtime("sdr", n, "publish_seconds")
    fp_small = r.runtime("fprivacy", r.adult_n, "publish_seconds")
    fp_large = r.runtime("fprivacy", n, "publish_seconds")
    sps = r.runtime("personal-sps", n, "publish_seconds")
    return [
        Claim(
            "seed 001 §9 (C++, Core i3)",
            "publication takes under 10 s for 500k tuples for every γ from 2 to 10.",
            f"decoy groups at γ = {DEFAULT_GAMMA}: {seconds(decoy)} for {n:,} rows (Python, "
            "NumPy).",
            AGREE if decoy < 10 else DIFFER,
            "Grouping is a keyed sampling pass over value buckets, then one vectorized draw.",
        ),
        Claim(
            "seed 002 Fig. 5",
            "perturbation partitioning takes at most 30 s at every |T| up to 500k.",
            f"SDR: {seconds(sdr)} for {n:,} rows.",
            AGREE if sdr <= 30 else DIFFER,
            "PP works on the m-value frequency vector (balancing, RCM, a dynamic program), "
            "not on records; only the final perturbation touches every row.",
        ),
        Claim(
            "seed 003 Fig. 6",
            "the two-size search with full pruning is barely affected by |T|.",
            f"F′-privacy publication {seconds(fp_small)} at {r.adult_n:,} rows and "
            f"{seconds(fp_large)} at {n:,} rows ({fp_large / fp_small:.1f}×).",
            PARTLY,
            "Not the same quantity: the paper times the bucket-setting search, we time the "
            "whole publication, which also assigns every record to a bucket and writes QIT "
            "and ST, O(N). The search itself runs on the frequency vector.",
        ),
        Claim(
            "seed 004 §4.3",
            "SPS is O(|D| log |D|); no run times are reported.",
            f"SPS publication {seconds(sps)} for {n:,} rows.",
            AGREE,
            "One sort by (group, value, keyed order), then vectorized sampling and copying.",
        ),
    ]


# --------------------------------------------------------------------------- tables


def summary_table(r: Results) -> str:
    bands = [b.key for b in BANDS]
    header = (
        "| mechanism | workload | "
        + " | ".join(b.label for b in BANDS)
        + " | large (≥ 1%) | publish, "
        + f"{r.adult_n // 1000}k rows | publish, {r.largest // 1000}k rows |"
    )
    lines = [header, "|" + "---|" * (len(bands) + 5)]
    for m in MECHANISMS:
        if not r.row(m.key, "small") and m.workload == OCCUPATION:
            continue
        if m.workload == OCCUPATION:
            values = [r.at(m.key, b) for b in bands] + [r.at(m.key, LARGE_KEY)]
        else:
            values = [r.n_at(m.key, b, r.adult_n) for b in bands] + [
                r.n_at(m.key, LARGE_KEY, r.adult_n)
            ]
        publish = [
            r.runtime(m.key, r.adult_n, "publish_seconds"),
            r.runtime(m.key, r.largest, "publish_seconds"),
        ]
        shown = [
            "—" if m.key.startswith("laplace") else seconds(p) if math.isfinite(p) else "—"
            for p in publish
        ]
        name = m.label.replace(", γ", f", γ = {DEFAULT_GAMMA}").replace(
            "ℓ = γ", f"ℓ = {DEFAULT_GAMMA}"
        )
        name = name.replace("p = 1/γ", f"p = 1/{DEFAULT_GAMMA}").replace(
            "amplification γ", f"amplification {DEFAULT_GAMMA}"
        )
        lines.append(
            f"| {name} | {m.workload} | "
            + " | ".join(pct(v) for v in values)
            + f" | {shown[0]} | {shown[1]} |"
        )
    return "\n".join(lines)


def pool_table(pool_rows: list[dict]) -> str:
    lines = [
        "| table | workload | " + " | ".join(b.label for b in BANDS) + " |",
        "|" + "---|" * (len(BANDS) + 2),
    ]
    tables: dict[tuple, dict[str, str]] = {}
    for row in pool_rows:
        cells = tables.setdefault((row["n"], row["dataset"], row["workload"]), {})
        cells[row["band"]] = f"{row['sampled']:,} of {row['available']:,}"
    for (n, name, workload), cells in sorted(tables.items()):
        shown = " | ".join(cells.get(b.key, "—") for b in BANDS)
        lines.append(f"| {name}, {n:,} rows | {workload} | {shown} |")
    return "\n".join(lines)


def parameter_table(r: Results, facts: Facts) -> str:
    rho1, rho2 = sdr_privacy_at(r, facts)

    def note(mechanism: str, name: str, fmt="{:,.0f}") -> str:
        value = r.note(mechanism, name)
        return "n/a" if value is None else fmt.format(value)

    rows = [
        (
            ("decoy",),
            f"γ ∈ {{{', '.join(map(str, r.gammas))}}}; size-weighted grouping, mixing "
            "matrix, closed form, estimates clipped (service defaults)",
            f"{note('decoy', 'suppressed rows')} rows suppressed, {note('decoy', 'trimmed rows')} "
            "trimmed to a multiple of γ (γ = 5)",
        ),
        (
            ("decoy-paper",),
            "Anatomy's largest-first grouping, the paper's matrix (t = f_s/N), iterative "
            "Bayesian method; Adult only",
            "for comparison with the default",
        ),
        (
            ("anatomy",),
            "ℓ = γ (pitfall 20), Xiao & Tao's estimator",
            f"{note('anatomy', 'groups')} groups at ℓ = 5",
        ),
        (
            ("global",),
            f"p = 1/γ, q = (1 − 1/γ)/(m − 1), m = {facts.m}; inverse-matrix MLE",
            f"likelihood ratio p/q = {(facts.m - 1) / (DEFAULT_GAMMA - 1):.2f} at γ = 5",
        ),
        (
            ("sdr",),
            f"ρ1 = 1/⌊N/f_max⌋ = {rho1} (every value protected, as 1/13 on OCC); ρ2 from γ = "
            "(ρ2/ρ1)(1 − ρ1)/(1 − ρ2), the whole table's amplification",
            f"at γ = 5: ρ2 = {rho2:.4f}, {note('sdr', 'sub-tables')} sub-tables, mean "
            f"m_i = {note('sdr', 'mean m_i', '{:.1f}')}, mean γ_i = "
            f"{note('sdr', 'mean gamma_i', '{:.2f}')}, mean retention p_i = "
            f"{note('sdr', 'mean retention p_i', '{:.3f}')}",
        ),
        (
            ("fprivacy",),
            f"f′_i = min{{1, θ·f_i + 0.02}}, θ = {F_THETA}, M′ = {F_MAX_SIZE}, multi-size "
            "(seed 003 §7 defaults)",
            f"{note('fprivacy', 'buckets')} buckets, "
            f"{note('fprivacy', 'rows in singleton buckets')} rows in singleton buckets, "
            f"{note('fprivacy', UNPROTECTED)} values with f′ = 1 "
            f"({', '.join(facts.unprotected)}), MSE {note('fprivacy', 'MSE', '{:.2f}')}",
        ),
        (
            ("dbr", "dbr-income"),
            "values drawn from the sensitive marginal; published counts as estimates",
            "—",
        ),
        (
            ("laplace-eps-ln2", "laplace-eps-ln3", "laplace-eps-0.1"),
            "ε ∈ {ln 2, ln 3, 0.1}, Δf = 1, each query on its own budget (seed 000 Fig. 7)",
            "the noise is `LaplaceCounts(ε, 1).noise(...)`",
        ),
        (
            tuple(k for k in BY_KEY if k.startswith(f"laplace-m{LAPLACE_QUERIES}")),
            "ε ∈ {ln 2, ln 3, 0.1}; m = 100 queries share ε (seed 001 §9, pitfall 20)",
            f"scale 144, 91, 1,000; `LaplaceCounts(ε, {LAPLACE_QUERIES}).noise(...)`",
        ),
        (
            ("personal-sps",),
            f"p = {RETENTION}, λ = {LAMBDA}, δ = {DELTA}, adaptive budget; merge map "
            "fitted on Adult (χ², α = 0.05) and reused at every N",
            f"{note('personal-sps', 'personal groups')} groups, "
            f"{note('personal-sps', 'perturbed rows')} rows perturbed on Adult",
        ),
        (
            ("personal-up",),
            f"p = {RETENTION} (the thesis's baseline UP)",
            "every row perturbed",
        ),
    ]
    lines = [
        "| mechanism (as in the plots) | workload | parameters | on Adult |",
        "|---|---|---|---|",
    ]
    for keys, parameters, seen in rows:
        labels = "<br>".join(dict.fromkeys(BY_KEY[k].label for k in keys))
        workloads = ", ".join(dict.fromkeys(BY_KEY[k].workload for k in keys))
        lines.append(f"| {labels} | {workloads} | {parameters} | {seen} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- report


def render(
    *,
    settings,
    jobs: int,
    output: Path,
    figures: dict[str, Figure],
    gamma_rows: list[dict],
    n_rows: list[dict],
    runtime_rows: list[dict],
    note_rows: list[dict],
    pool_rows: list[dict],
    adult: dict[str, Table],
    compute_seconds: float,
    total_seconds: float,
) -> str:
    r = Results(gamma_rows, n_rows, runtime_rows, note_rows, pool_rows)
    facts = Facts.of(adult)
    link = output.name

    def image(key: str) -> str:
        figure = figures[key]
        return f"![{figure.title}]({link}/{figure.name})"

    sections: list[tuple[str, str, list[Claim]]] = [
        (
            "large_vs_gamma",
            "Large counts (selectivity ≥ 1%) versus γ. Mechanisms without a γ are flat lines. "
            "For Anatomy γ is ℓ, for global randomization p = 1/γ, for SDR the amplification "
            "ratio of the whole table.",
            large_gamma_claims(r, facts),
        ),
        (
            "small_vs_gamma",
            f"Small counts (true count 1–{SMALL_MAX}) versus γ. Here a high error is the goal: "
            "it is the privacy side of SPLU.",
            small_gamma_claims(r),
        ),
        (
            "selectivity",
            f"Every band at γ = {DEFAULT_GAMMA}: the small band on the left (privacy side), "
            "then selectivity bands (utility side).",
            selectivity_claims(r),
        ),
        (
            "vs_n",
            "Adult, then Adult resampled with replacement to "
            f"{', '.join(f'{n // 1000}k' for n in r.sizes[1:])} rows, γ = {DEFAULT_GAMMA}.",
            n_claims(r),
        ),
        (
            "personal",
            "The income workload (m = 2), the one personal groups are defined for in seed 004: "
            "SPS against plain uniform perturbation with the same p, DBR and Laplace for scale.",
            personal_claims(r),
        ),
        (
            "runtime",
            "Publication time (left) and the time to answer the query pool per query, "
            "including building the reader from the publication (right). Laplace publishes "
            "nothing and is left out.",
            runtime_claims(r),
        ),
    ]
    headline = headline_claims(r)
    all_claims = [c for _, _, claims in sections for c in claims]
    met = sum(c.verdict == HOLDS for c in headline)
    counts = {v: sum(c.verdict == v for c in all_claims) for v in (AGREE, PARTLY, DIFFER)}

    out = [
        "# Evaluation: every mechanism on the papers' workloads",
        "",
        "<!-- Generated by `make evaluation` (.venv/bin/python -m bench.experiments); "
        "do not edit by hand. -->",
        "",
        "Generated by `make evaluation` (`.venv/bin/python -m bench.experiments`, code in "
        "`bench/experiments/`) with fixed seeds; every number, figure and verdict below comes "
        "from that run. "
        + (
            "**This is the `--quick` run: tiny tables and few queries, for CI only. Its "
            "numbers mean nothing.** "
            if settings.quick
            else ""
        )
        + f"The run took {total_seconds / 60:.1f} min ({compute_seconds:.0f} s of experiments) "
        f"with {jobs} worker process(es). CSVs and plots are in "
        f"[`{link}/`]({link}/).",
        "",
        "## Headline",
        "",
        "Decoy groups at γ = 5 on Adult, occupation workload:",
        "",
        *[c.render() for c in headline],
        laplace_note(r),
        "",
        f"**{met} of {len(headline)} targets hold.** Across the {len(all_claims)} paper "
        f"claims checked below: {counts[AGREE]} agree, "
        f"{counts[PARTLY]} partly agree, {counts[DIFFER]} differ; the differences are "
        "listed [at the end](#where-we-differ-and-why).",
        "",
        "## Set-up",
        "",
        f"- **Data.** {r.adult_name}: {facts.n:,} records of UCI Adult (the bundled sample). "
        f"Larger tables: {', '.join(f'{n:,}' for n in r.sizes[1:])} records drawn from it with "
        "replacement (seed = N), which keeps its joint distribution (the papers used 100k–500k "
        "samples of CENSUS/IPUMS, not available here).",
        f"- **Workloads.** *occupation*: public age, sex, race, marital_status, education; "
        f"sensitive occupation (m = {facts.m}, the most frequent value holds "
        f"{pct(facts.top_share)}, so ℓ-diversity and eligible decoy groups stop at γ = "
        f"{int(1 / facts.top_share)}; the papers' OCC has m = 50). Decoy groups, Anatomy, "
        "global randomization, SDR, F′-privacy, DBR and Laplace answer it. *income*: public "
        f"education, occupation, race, sex; sensitive income (m = {facts.income_m}), the "
        "thesis's Adult table, for personal groups with SPS (plus plain perturbation, DBR and "
        "Laplace for scale). Decoy groups and Anatomy cannot run on income (its larger value "
        f"holds {pct(facts.income_top_share)}, ineligible even for γ = 2), nor global "
        "randomization (it needs m > γ).",
        "- **Queries.** Count queries `A1 = a1 ∧ … ∧ Ad = ad ∧ SA = s`, d ∈ {1, 2, 3} distinct "
        "public attributes: we enumerate every such query with a non-empty predicate and "
        f"sample up to {settings.per_band} distinct ones per band on Adult "
        f"({settings.per_band_n} on the resampled tables) with a fixed seed; bands with fewer "
        "are taken whole (only 38 distinct occupation queries reach 5%). Bands: true count "
        f"1–{SMALL_MAX}, and selectivity (true count / N) 0.1–0.5%, 0.5–1%, 1–2%, 2–5%, ≥ 5%. "
        "'Large' pools every query of selectivity ≥ 1%. The papers draw d, the attributes "
        "and the values at random; sampling distinct queries per band is our choice, so the "
        "narrow high bands are covered without repeats.",
        "- **Error.** Relative error |estimate − true| / true, each estimate clipped to "
        "[0, |P|] (|P| is public; decoy groups clip by default and we apply the same free "
        "post-processing to every mechanism), averaged over the band's queries and over "
        f"{settings.publications} independent publications on Adult "
        f"({settings.publications_n} on each resampled table): keys "
        "`ServiceKey.from_seed(s)`, ids `random_ids(N, key)`, s = 0, 1, ….",
        "",
        "Queries per band (sampled of distinct available):",
        "",
        pool_table(pool_rows),
        "",
        "Mechanisms and parameters (the papers' fair-comparison settings; seed notes 001 "
        "pitfall 20):",
        "",
        parameter_table(r, facts),
        "",
        f"## Summary at γ = {DEFAULT_GAMMA} on {r.adult_name}",
        "",
        "Mean relative error per band (small band: higher is more private; the others: lower "
        "is more useful), and the median publication time.",
        "",
        summary_table(r),
        "",
    ]
    for number, (key, caption, claims) in enumerate(sections, start=1):
        out += [
            f"## Figure {number}: {figures[key].title}",
            "",
            image(key),
            "",
            caption,
            "",
            *[c.render() for c in claims],
        ]
    differ = [c for c in headline if c.verdict != HOLDS]
    differ += [c for c in all_claims if c.verdict != AGREE]
    out += [
        "## Where we differ, and why",
        "",
        *[f"- **{c.verdict}** — {c.source}: {c.paper} *{c.why}*" for c in differ],
        "",
        "## Workarounds and limitations",
        "",
        "- `LaplaceCounts.answer` refuses more distinct queries than its budget m covers, as a "
        "service must. The harness answers ~1,100 queries per pool, each *as if* it were one "
        "of m, by adding the mechanism's own keyed `LaplaceCounts(ε, m).noise(...)` to the "
        "true counts, which is what `answer` computes.",
        "- γ stops at 7: on Adult's occupation, Anatomy is infeasible and decoy groups "
        "suppress records for γ ≥ 8 (the papers' range is 2–10 on CENSUS, m = 50).",
        "- SDR's γ is an amplification ratio, not a group size; we set ρ2 so the whole "
        "table's ratio equals γ (the seed's Table 1 uses γ = 5), which bounds a posterior by "
        f"ρ2 ≈ {sdr_privacy_at(r, facts)[1]:.0%} at γ = 5, weaker than Anatomy's 1/ℓ = 20%.",
        "- F′-privacy and personal groups have no γ: they appear as flat lines in the γ "
        "figures (F′) or only on the income workload (personal groups). The papers' queries "
        "differ per seed (F′'s are disjunctive, the thesis's widen values to merged classes); "
        "we use one conjunctive workload for all, so only the trends are comparable.",
        "- The papers' figures exist only as captions in the seed texts, so every comparison "
        "is with the prose (seed notes), never with plotted values.",
        f"- Run times come from the same runs, with {jobs} worker process(es) sharing the "
        "machine; they are medians over publications, indicative only.",
        "",
        "## Reproduce",
        "",
        "```",
        "make evaluation                                   # this report, docs/evaluation/*",
        ".venv/bin/python -m bench.experiments --quick --output /tmp/eval   # seconds, for CI",
        "```",
        "",
    ]
    return "\n".join(out)
