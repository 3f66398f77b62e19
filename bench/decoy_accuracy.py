"""Accuracy of conjunctive counts from decoy groups, large versus small, by configuration.

On the bundled UCI Adult sample (45,222 records; public: age, sex, race,
marital_status, education; sensitive: occupation; γ = 5) a fixed-seed pool of
random conjunctive queries is drawn: d ∈ {1, 2, 3} distinct public attributes
valued as in a uniformly random record (so the predicate is non-empty) ∧ an
occupation drawn uniformly from its domain. Each query's true count is
counted on the original table. Drawing stops once both bands hold --queries
queries, and the first --queries of each are kept:

- large: true count ≥ 1% of N (≥ 453); target mean relative error ≤ 20%;
- small: true count 1–10; target mean relative error ≥ 50% (small counts must
  stay noisy: that is the privacy side).

The draw is ``service.core.planning.query_pool``, the one `splu plan` measures with.

The table is published --publications times (ServiceKey.from_seed(s) and
random_ids(n, key), s = --seed, --seed + 1, ...) with each grouping, and every
configuration of grouping × transition matrix × method answers the whole pool
with one ``estimate_many`` call (the iterative method is vectorized over
queries). Relative error is |estimate − true| / true, pooled over queries and
publications. The default is (size-weighted, mixing, closed), the papers'
choice (anatomy, paper, iterative); the other rows show each choice alone (the
iterative method runs on the papers' 2×2 matrices only).

Run from the repository root:

    .venv/bin/python bench/decoy_accuracy.py
    .venv/bin/python bench/decoy_accuracy.py --publications 10 --queries 2000
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

import numpy as np
from report import DRAW_LIMIT, log, print_table

from service.core import planning
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query
from service.core.table import Table, open_sample, read_table

QUASI = ("age", "sex", "race", "marital_status", "education")
SENSITIVE = "occupation"
LARGE_TARGET = 0.20
SMALL_TARGET = 0.50
SMALL_MAX = planning.SMALL_MAX


@dataclass(frozen=True)
class Config:
    grouping: str
    matrix: str
    method: str
    label: str = ""

    def name(self) -> str:
        return f"{self.grouping}, {self.matrix}, {self.method}"


# Default first and the papers' choice last; in between, every mix of the three
# choices the estimator allows, so each one's effect shows on its own.
CONFIGS = (
    Config("size-weighted", "mixing", "closed", "default"),
    Config("size-weighted", "corrected", "closed"),
    Config("size-weighted", "corrected", "iterative"),
    Config("size-weighted", "paper", "closed"),
    Config("size-weighted", "paper", "iterative"),
    Config("anatomy", "mixing", "closed"),
    Config("anatomy", "corrected", "closed"),
    Config("anatomy", "corrected", "iterative"),
    Config("anatomy", "paper", "closed"),
    Config("anatomy", "paper", "iterative", "paper"),
)


@dataclass
class Outcome:
    """Signed relative errors and run times of one configuration over all publications."""

    large: list[np.ndarray] = field(default_factory=list)
    small: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0
    iterations: list[np.ndarray] = field(default_factory=list)

    def large_abs(self) -> np.ndarray:
        return np.abs(np.concatenate(self.large))

    def small_abs(self) -> np.ndarray:
        return np.abs(np.concatenate(self.small))

    def seed_spread(self) -> float:
        """Standard deviation of the large-band mean over publications."""
        means = [np.abs(e).mean() for e in self.large]
        return float(np.std(means, ddof=1)) if len(means) > 1 else math.nan


def query_pool(
    table: Table, per_band: int, rng: np.random.Generator
) -> tuple[list[Query], np.ndarray, int]:
    """(queries, true counts, draws): the first `per_band` large ones, then small ones."""
    pool = planning.query_pool(table, SENSITIVE, QUASI, per_band, rng, DRAW_LIMIT * per_band)
    if min(pool.large, pool.small) < per_band:
        raise SystemExit(f"no {per_band:,} queries per band after {pool.draws:,} draws")
    return pool.queries, pool.true, pool.draws


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Relative error of decoy-group conjunctive counts on UCI Adult, "
        "large (≥ 1% of N) versus small (1–10) true counts, per configuration.",
    )
    parser.add_argument("--gamma", type=int, default=5, help="decoy group size (default 5)")
    parser.add_argument("--queries", type=int, default=1000, help="queries per band (default 1000)")
    parser.add_argument(
        "--publications",
        type=int,
        default=5,
        help="independent publications, one seed each (default 5)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the query pool and keys (default 0)"
    )
    args = parser.parse_args()
    if min(args.queries, args.publications) < 1:
        parser.error("--queries and --publications must be positive")

    with open_sample() as stream:
        table, _ = read_table(stream, quasi=QUASI, sensitive=[SENSITIVE])
    n = len(table)
    log(f"drawing queries until both bands hold {args.queries:,} (seed {args.seed})")
    queries, true, draws = query_pool(table, args.queries, np.random.default_rng(args.seed))
    large = slice(0, args.queries)
    small = slice(args.queries, 2 * args.queries)

    outcomes = {config: Outcome() for config in CONFIGS}
    seeds = range(args.seed, args.seed + args.publications)
    for seed in seeds:
        key = ServiceKey.from_seed(seed)
        ids = random_ids(n, key)
        for grouping in dict.fromkeys(c.grouping for c in CONFIGS):
            log(f"publication seed {seed}, {grouping} grouping")
            release = DecoyGroups(args.gamma, grouping).publish(table, ids, key)
            cells = PublishedCells.from_table(release.published)
            for config in (c for c in CONFIGS if c.grouping == grouping):
                reconstruction = DecoyReconstruction(
                    cells, args.gamma, [SENSITIVE], method=config.method,
                    matrix=config.matrix, grouping=grouping,
                )  # fmt: skip
                started = time.perf_counter()
                answers = reconstruction.estimate_many(queries)
                outcome = outcomes[config]
                outcome.seconds += time.perf_counter() - started
                error = (np.asarray([a.estimate for a in answers]) - true) / true
                outcome.large.append(error[large])
                outcome.small.append(error[small])
                outcome.iterations.append(np.asarray([a.iterations for a in answers]))

    per_query_ms = {c: 1e3 * o.seconds / (len(seeds) * len(queries)) for c, o in outcomes.items()}
    print(
        f"Decoy groups on UCI Adult: N = {n:,}, γ = {args.gamma}, sensitive {SENSITIVE}, "
        f"public {', '.join(QUASI)}"
    )
    print(
        f"{args.queries:,} queries per band (from {draws:,} random draws, seed {args.seed}): "
        f"large = true count ≥ {planning.large_minimum(n)} (1% of N), small = 1–{SMALL_MAX}; "
        f"{len(seeds)} publications (seeds {seeds.start}–{seeds.stop - 1})"
    )
    print("relative error = |estimate − true| / true, pooled over queries and publications\n")
    print_table(
        [
            "configuration (grouping, matrix, method)",
            "large mean",
            "sd over seeds",
            "large median",
            "large signed",
            "small mean",
            "ms/query",
        ],
        [
            [
                f"{c.name()}{f'  [{c.label}]' if c.label else ''}",
                percent(o.large_abs().mean()),
                percent(o.seed_spread()),
                percent(float(np.median(o.large_abs()))),
                f"{100 * np.concatenate(o.large).mean():+.1f}%",
                percent(o.small_abs().mean()),
                f"{per_query_ms[c]:.3f}",
            ]
            for c, o in outcomes.items()
        ],
    )

    default, paper = outcomes[CONFIGS[0]], outcomes[CONFIGS[-1]]
    large_error, small_error = default.large_abs().mean(), default.small_abs().mean()
    print(f"\ntargets for the default ({CONFIGS[0].name()}):\n")
    print_table(
        ["metric", "measured", "target", "measured/target", "pass"],
        [
            [
                "large band, mean relative error",
                percent(large_error),
                f"≤ {percent(LARGE_TARGET)}",
                f"{large_error / LARGE_TARGET:.2f}",
                "yes" if large_error <= LARGE_TARGET else "NO",
            ],
            [
                "small band, mean relative error",
                percent(small_error),
                f"≥ {percent(SMALL_TARGET)}",
                f"{small_error / SMALL_TARGET:.2f}",
                "yes" if small_error >= SMALL_TARGET else "NO",
            ],
        ],
    )
    paper_large = paper.large_abs().mean()
    gap = paper_large - large_error
    print(
        f"\ndefault vs paper ({CONFIGS[-1].name()}): large-band mean relative error "
        f"{percent(large_error)} vs {percent(paper_large)}, the default "
        f"{abs(100 * gap):.1f} points {'lower' if gap > 0 else 'higher'} "
        f"(paper/default = {paper_large / large_error:.2f}×); small band "
        f"{percent(small_error)} vs {percent(paper.small_abs().mean())}"
    )
    iterative = [c for c in CONFIGS if c.method == "iterative"]
    closed = [c for c in CONFIGS if c.method == "closed"]
    iterations = np.concatenate([np.concatenate(outcomes[c].iterations) for c in iterative])
    print(
        f"iterative method: {np.mean([per_query_ms[c] for c in iterative]):.3f} ms per query "
        f"(mean over its {len(iterative)} configurations, {2 * args.queries:,} queries per "
        f"estimate_many call, {iterations.mean():.0f} iterations on average, at most "
        f"{iterations.max():,}); closed form "
        f"{np.mean([per_query_ms[c] for c in closed]):.3f} ms per query"
    )


if __name__ == "__main__":
    main()
