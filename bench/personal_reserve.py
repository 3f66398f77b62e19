"""Personal streams at scale: interval coverage, and reserve trials against the rule
without them (issue 32).

UCI Adult resampled with replacement to each of --sizes N rows; sensitive occupation
(m = 14), public education, marital_status, race and sex merged by the map fitted on
Adult (`fit_value_map`, as `splu merge` does); the thesis settings p = 0.5, λ = δ = 0.3.
Each of --publications publications per N draws a fresh resample, service key
(``ServiceKey.from_seed``) and arrival order, fixed by --seed:

1. Coverage of the 95% intervals of every large conjunctive count: each query
   ``A_1=a_1 ∧ … ∧ A_d=a_d ∧ occupation=s`` (d ≤ 3 public attributes) whose true count
   on the resample is at least --selectivity (1%) of N, answered by
   `PersonalReconstruction` (raw MLE, unclipped) on batch SPS (adaptive and
   conservative budgets) and on the stream (`service.core.mechanisms.personal_stream`, the
   Lua rule replayed; bounded and conservative budgets, release size 50, rows in random
   order). A publication's queries share one draw, so coverage is judged on its mean
   over publications: ``mean ± standard error over publications``; the mean relative
   error |estimate − true| / true beside it.
2. The stream's borrowed copies, with reserve trials and without (every trial on the
   first arrivals), rows in random order and with the rare occupations (Armed-Forces,
   Priv-house-serv, Protective-serv) arriving after every other: borrowed rows per
   publication, and each rare occupation's mean error relative to its true total.

Run from the repository root (about 8 minutes at the defaults):

    .venv/bin/python bench/personal_reserve.py
    .venv/bin/python bench/personal_reserve.py --sizes 45222 --publications 20
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
from personal_accuracy import percent
from report import print_table, status

from service.core.mechanisms.personal import PersonalGroups, PersonalRelease
from service.core.mechanisms.personal_reconstruction import PersonalReconstruction
from service.core.mechanisms.personal_stream import PersonalStream
from service.core.merge import ValueMap, fit_value_map
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query
from service.core.table import Table, distinct_rows, open_sample, read_table

PUBLIC = ("education", "marital_status", "race", "sex")
SENSITIVE = "occupation"
RARE = ("Armed-Forces", "Priv-house-serv", "Protective-serv")
RETENTION, LAMBDA, DELTA = 0.5, 0.3, 0.3
RELEASE_SIZE = 50
MAX_ATTRIBUTES = 3
# (label, budget, stream) of the coverage table.
MODES = [
    ("batch SPS, adaptive", "adaptive", False),
    ("batch SPS, conservative", "conservative", False),
    ("stream, bounded", "bounded", True),
    ("stream, conservative", "conservative", True),
]


def large_queries(table: Table, selectivity: float) -> tuple[list[Query], np.ndarray]:
    """Every conjunctive query of up to MAX_ATTRIBUTES public values and an occupation
    with a true count of at least `selectivity` of the rows, and those counts."""
    schema, queries, counts = table.schema, [], []
    for d in range(1, MAX_ATTRIBUTES + 1):
        for columns in itertools.combinations(PUBLIC, d):
            names = [*columns, SENSITIVE]
            sizes = [schema[c].size for c in names]
            cells, _, found = distinct_rows([table.codes[c] for c in names], sizes)
            for cell, count in zip(cells.tolist(), found.tolist(), strict=True):
                if count >= selectivity * len(table):
                    where = {c: (schema[c].domain[v],) for c, v in zip(columns, cell, strict=False)}
                    queries.append(Query(where, {SENSITIVE: schema[SENSITIVE].domain[cell[-1]]}))
                    counts.append(count)
    return queries, np.asarray(counts, dtype=np.float64)


def rare_last(table: Table, rng: np.random.Generator) -> np.ndarray:
    """A random arrival order with every rare occupation's rows after all others."""
    codes = [table.schema[SENSITIVE].domain.index(v) for v in RARE]
    rare = np.isin(table.codes[SENSITIVE], codes)
    return np.lexsort((rng.random(len(table)), rare))


def reconstruction(
    release: PersonalRelease, budget: str, stream: bool, value_map: ValueMap
) -> PersonalReconstruction:
    return PersonalReconstruction(
        PublishedCells.from_table(release.published), SENSITIVE, RETENTION,
        release.published.schema[SENSITIVE].size, LAMBDA, DELTA, budget, value_map,
        stream=stream,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Personal groups at scale: coverage of large-count intervals for batch "
        "SPS and the stream, and the stream's borrowed copies with and without reserve "
        "trials (Adult resampled, occupation, p = 0.5, λ = δ = 0.3)."
    )
    parser.add_argument(
        "--sizes", default="45222,300000,1000000", help="rows per resample (comma-separated)"
    )
    parser.add_argument("--publications", type=int, default=8, help="per size (default 8)")
    parser.add_argument(
        "--selectivity", type=float, default=0.01, help="smallest true count / N (default 0.01)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.publications < 2 or min(sizes) < 1:
        parser.error("--publications must be at least 2 and --sizes positive")

    with open_sample() as source:
        base, _ = read_table(source, quasi=list(PUBLIC), sensitive=[SENSITIVE])
    value_map = fit_value_map(base, SENSITIVE)
    rare_codes = [base.schema[SENSITIVE].domain.index(v) for v in RARE]
    coverage: dict[tuple[int, str], list[float]] = {}
    errors: dict[tuple[int, str], list[float]] = {}
    borrowed: dict[tuple[int, str, bool, str], list[int]] = {}
    rare_error: dict[tuple[int, str, bool, str], list[np.ndarray]] = {}
    queries_asked: dict[int, list[int]] = {}
    for n in sizes:
        for i in range(args.publications):
            seed = args.seed * 1_000_003 + n * 101 + i
            rng = np.random.default_rng(seed)
            rows = rng.integers(0, len(base), n)
            table = Table(base.schema, {k: codes[rows] for k, codes in base.codes.items()})
            key = ServiceKey.from_seed(seed)
            ids = random_ids(n, key)
            queries, truth = large_queries(table, args.selectivity)
            queries_asked.setdefault(n, []).append(len(queries))
            random_order = rng.permutation(n)
            for label, budget, stream in MODES:
                status(f"N = {n:,}, publication {i + 1}/{args.publications}: {label}")
                if stream:
                    mechanism = PersonalStream(
                        RETENTION, LAMBDA, DELTA, budget, value_map, RELEASE_SIZE
                    )
                    release = mechanism.publish(table, ids, key, random_order)
                else:
                    release = PersonalGroups(RETENTION, LAMBDA, DELTA, budget, value_map).publish(
                        table, ids, key
                    )
                answers = reconstruction(release, budget, stream, value_map).estimate_many(queries)
                low = np.array([a.low for a in answers])
                high = np.array([a.high for a in answers])
                estimate = np.array([a.estimate for a in answers])
                coverage.setdefault((n, label), []).append(
                    float(((low <= truth) & (truth <= high)).mean())
                )
                errors.setdefault((n, label), []).append(
                    float((np.abs(estimate - truth) / truth).mean())
                )
            true_rare = np.array([(table.codes[SENSITIVE] == c).sum() for c in rare_codes])
            orders = {"random": random_order, "rare last": rare_last(table, rng)}
            for (order, arrival), budget, reserve in itertools.product(
                orders.items(), ("bounded", "conservative"), (False, True)
            ):
                status(f"N = {n:,}, publication {i + 1}/{args.publications}: borrowing")
                mechanism = PersonalStream(
                    RETENTION, LAMBDA, DELTA, budget, value_map, RELEASE_SIZE, reserve=reserve
                )
                release = mechanism.publish(table, ids, key, arrival)
                answers = reconstruction(release, budget, True, value_map).estimate_many(
                    [Query({}, {SENSITIVE: v}) for v in RARE]
                )
                where = (n, order, reserve, budget)
                borrowed.setdefault(where, []).append(release.borrowed_rows)
                rare_error.setdefault(where, []).append(
                    (np.array([a.estimate for a in answers]) - true_rare) / true_rare
                )
        status(f"N = {n:,}: done", last=True)

    print(
        f"Personal groups on UCI Adult resampled, occupation (m = 14), public "
        f"{', '.join(PUBLIC)} merged by the map fitted on Adult; p = {RETENTION}, "
        f"λ = {LAMBDA}, δ = {DELTA}; {args.publications} publications per size (seed "
        f"{args.seed}); queries: every d ≤ {MAX_ATTRIBUTES} conjunctive count ≥ "
        f"{percent(args.selectivity)} of N\n"
    )
    rows = []
    for n in sizes:
        for label, _, _ in MODES:
            c, e = np.array(coverage[n, label]), np.array(errors[n, label])
            rows.append([
                f"{n:,}", label, f"{np.mean(queries_asked[n]):.0f}",
                f"{c.mean():.3f} ± {c.std(ddof=1) / np.sqrt(len(c)):.3f}",
                f"{c.min():.3f}–{c.max():.3f}", percent(float(e.mean())),
            ])  # fmt: skip
    print_table(
        [
            "N",
            "publication",
            "queries",
            "coverage (mean ± SE)",
            "per publication",
            "mean rel. error",
        ],
        rows,
    )
    print()
    rows = []
    for n, order, budget in itertools.product(
        sizes, ("random", "rare last"), ("bounded", "conservative")
    ):
        for reserve in (False, True):
            where = (n, order, reserve, budget)
            shares = np.array(rare_error[where])
            rows.append([
                f"{n:,}", order, budget, "reserve" if reserve else "first arrivals",
                f"{np.mean(borrowed[where]):,.0f}",
                *(f"{100 * m:+.0f}% ± {100 * s:.0f}%" for m, s in zip(
                    shares.mean(axis=0), shares.std(axis=0, ddof=1) / np.sqrt(len(shares)),
                    strict=True,
                )),
            ])  # fmt: skip
    print_table(
        ["N", "arrivals", "budget", "trials", "borrowed rows", *(f"{v} error" for v in RARE)],
        rows,
    )


if __name__ == "__main__":
    main()
