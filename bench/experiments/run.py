"""The experiment harness (issue 7, item 5): one command, fixed seeds, CSVs + PNGs + report.

    .venv/bin/python -m bench.experiments [--quick] [--output DIR] [--jobs J]

Experiments (γ = 5 unless varied; every mechanism's parameters in mechanisms.py):

1. versus γ on UCI Adult (45,222 records), γ = 2…7 (Adult's most frequent
   occupation holds 13.3% of the records, so ℓ-diversity and eligible decoy
   groups stop at γ = 7), 5 independent publications (keys
   ServiceKey.from_seed(s), ids random_ids(N, key), s = 0…4);
2. versus N at γ = 5 on Adult itself (the runs of experiment 1) and on tables
   resampled from Adult with replacement at 100k…500k rows, 2 publications each
   (fewer queries per band there: Anatomy and F′-privacy answer in O(N) per query);
3. run times of publication and of answering the query pool, from the same runs.

Relative error = |estimate − true| / true, each estimate clipped to [0, |P|]; per
band it is pooled over the band's queries and the publications (mean, median,
signed mean, and the standard deviation of the per-publication means).

Work is split into one task per (table, publication), run by `--jobs` worker
processes (default 2). Every task is deterministic, so the numbers do not depend
on the number of workers; the run times do a little.

Outputs, for DIR (default docs/evaluation): DIR/*.csv, DIR/*.png and the report
DIR + ".md" (docs/evaluation.md), whose figure links are relative to it.
`--quick` runs a tiny version (an 8,000-row subsample of Adult, γ ∈ {3, 5}, one
publication, a few queries per band) in seconds, for CI; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path

import numpy as np

from bench.experiments import markdown, plots
from bench.experiments.mechanisms import BY_KEY, DEFAULT_GAMMA, MECHANISMS, Context, Mechanism
from bench.experiments.workload import (
    BANDS,
    INCOME,
    LARGE,
    LARGE_KEY,
    LARGE_LABEL,
    OCCUPATION,
    UTILITY,
    UTILITY_KEY,
    UTILITY_LABEL,
    Pool,
    load,
    log,
    query_pool,
    resample,
    subsample,
)
from service.core.merge import ValueMap, fit_value_map
from service.core.prf import ServiceKey, random_ids
from service.core.table import Table

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = ROOT / "docs" / "evaluation"
POOL_SEED = 0
ADULT = "Adult"
RESAMPLED = "Adult resampled"


@dataclass(frozen=True)
class Settings:
    quick: bool
    gammas: tuple[int, ...]
    sizes: tuple[int, ...]  # resampled table sizes
    publications: int  # on Adult (experiment 1)
    publications_n: int  # on each resampled table
    per_band: int  # queries per band on Adult
    per_band_n: int  # on the resampled tables (their answer time grows with N)
    adult_rows: int | None  # None: all of Adult; else a subsample (quick mode)

    @property
    def adult_label(self) -> str:
        return ADULT if self.adult_rows is None else f"{ADULT} subsample"

    @classmethod
    def from_run(cls, run: dict[str, object]) -> Settings:
        """Back from run.csv, where tuples are written as Python literals."""

        def number_tuple(text: object) -> tuple[int, ...]:
            return tuple(int(x) for x in str(text).strip("(),").split(",") if x.strip())

        return cls(
            quick=str(run["quick"]) == "True",
            gammas=number_tuple(run["gammas"]),
            sizes=number_tuple(run["sizes"]),
            publications=int(run["publications"]),
            publications_n=int(run["publications_n"]),
            per_band=int(run["per_band"]),
            per_band_n=int(run["per_band_n"]),
            adult_rows=None if run["adult_rows"] in ("", "None") else int(run["adult_rows"]),
        )


FULL = Settings(
    quick=False,
    gammas=(2, 3, 4, 5, 6, 7),
    sizes=(100_000, 200_000, 300_000, 400_000, 500_000),
    publications=5,
    publications_n=2,
    per_band=300,
    per_band_n=100,
    adult_rows=None,
)
QUICK = Settings(
    quick=True,
    gammas=(3, 5),
    sizes=(16_000,),
    publications=1,
    publications_n=1,
    per_band=15,
    per_band_n=15,
    adult_rows=8_000,
)


@dataclass(frozen=True)
class Task:
    """One publication of one table: every mechanism (every γ where γ applies)."""

    rows: int | None  # None: the Adult base table
    seed: int
    gammas: tuple[int, ...]
    mechanisms: tuple[str, ...]
    per_band: int
    adult_rows: int | None


@dataclass
class Measurement:
    """One mechanism, one γ, one publication: signed relative error per pool query."""

    dataset: str
    n: int
    mechanism: Mechanism
    gamma: int | None
    seed: int
    errors: np.ndarray
    band: np.ndarray
    publish_seconds: float
    answer_seconds: float
    info: dict[str, float] = field(default_factory=dict)


@dataclass
class Dataset:
    name: str
    tables: dict[str, Table]
    pools: dict[str, Pool]
    value_map: ValueMap

    @property
    def n(self) -> int:
        return len(self.tables[OCCUPATION])


@cache
def adult_tables(adult_rows: int | None) -> tuple[dict[str, Table], ValueMap]:
    """Adult for both workloads (or its quick-mode subsample), and the income merge map.

    The merge map of personal groups is fitted once on the reference sample (Adult)
    and reused for every resampled table, as a service would.
    """
    adult = {w: load(w) for w in (OCCUPATION, INCOME)}
    if adult_rows is not None:
        adult = {w: subsample(t, adult_rows, seed=0) for w, t in adult.items()}
    return adult, fit_value_map(adult[INCOME], INCOME)


@cache
def dataset(rows: int | None, per_band: int, adult_rows: int | None) -> Dataset:
    """Adult itself (rows None) or `rows` records resampled from it, with its query pools."""
    adult, value_map = adult_tables(adult_rows)
    if rows is None:
        name = ADULT if adult_rows is None else f"{ADULT} subsample"
        tables = dict(adult)
    else:
        # The same seed for both workloads: the same Adult rows are drawn for each.
        name, tables = RESAMPLED, {w: resample(t, rows, seed=rows) for w, t in adult.items()}
    pools = {w: query_pool(t, w, per_band, POOL_SEED) for w, t in tables.items()}
    return Dataset(name, tables, pools, value_map)


def run_task(task: Task) -> list[dict]:
    """Publish and answer; plain data out, so it crosses process boundaries."""
    data = dataset(task.rows, task.per_band, task.adult_rows)
    key = ServiceKey.from_seed(task.seed)
    ids = random_ids(data.n, key)
    out = []
    for name in task.mechanisms:
        mechanism = BY_KEY[name]
        pool = data.pools[mechanism.workload]
        context = Context(
            data.tables[mechanism.workload],
            ids,
            key,
            pool,
            data.value_map if mechanism.workload == INCOME else None,
        )
        started = time.perf_counter()
        for gamma in task.gammas if mechanism.uses_gamma else (None,):
            outcome = mechanism.run(context, gamma or DEFAULT_GAMMA)
            estimates = np.clip(outcome.estimates, 0, pool.rows)
            out.append(
                {
                    "dataset": data.name,
                    "n": data.n,
                    "mechanism": name,
                    "gamma": gamma,
                    "seed": task.seed,
                    "errors": (estimates - pool.true) / pool.true,
                    "band": pool.band,
                    "publish_seconds": outcome.publish_seconds,
                    "answer_seconds": outcome.answer_seconds,
                    "info": outcome.info,
                }
            )
        shown = f", γ = {', '.join(map(str, task.gammas))}" if mechanism.uses_gamma else ""
        log(
            f"  {data.name} (N = {data.n:,}), publication {task.seed}: {name}{shown} "
            f"({time.perf_counter() - started:.1f} s)"
        )
    return out


def run_tasks(tasks: list[Task], jobs: int) -> list[Measurement]:
    if jobs <= 1:
        results = [run_task(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as executor:
            results = list(executor.map(run_task, tasks))
    return [
        Measurement(**{**r, "mechanism": BY_KEY[r["mechanism"]]})
        for batch in results
        for r in batch
    ]


ERROR_FIELDS = [
    "experiment",
    "dataset",
    "n",
    "workload",
    "mechanism",
    "label",
    "gamma",
    "band",
    "band_label",
    "queries",
    "publications",
    "mean_rel_error",
    "median_rel_error",
    "signed_mean_rel_error",
    "sd_over_publications",
]
AGGREGATE_BANDS = [
    *((b.key, b.label, (i,)) for i, b in enumerate(BANDS)),
    (LARGE_KEY, LARGE_LABEL, LARGE),
    (UTILITY_KEY, UTILITY_LABEL, UTILITY),
]


def aggregate(experiment: str, measurements: list[Measurement]) -> list[dict]:
    """One row per (table, mechanism, γ, band), plus the pooled large and ≥ 0.1% bands."""
    groups: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.dataset, m.n, m.mechanism.key, m.gamma), []).append(m)
    rows = []
    for (dataset_name, n, _, gamma), members in groups.items():
        mechanism = members[0].mechanism
        for key, label, indices in AGGREGATE_BANDS:
            per_seed = [m.errors[np.isin(m.band, indices)] for m in members]
            pooled = np.concatenate(per_seed)
            if not len(pooled):
                continue
            means = [float(np.abs(e).mean()) for e in per_seed]
            rows.append(
                {
                    "experiment": experiment,
                    "dataset": dataset_name,
                    "n": n,
                    "workload": mechanism.workload,
                    "mechanism": mechanism.key,
                    "label": mechanism.label,
                    "gamma": "" if gamma is None else gamma,
                    "band": key,
                    "band_label": label,
                    "queries": len(per_seed[0]),
                    "publications": len(members),
                    "mean_rel_error": float(np.abs(pooled).mean()),
                    "median_rel_error": float(np.median(np.abs(pooled))),
                    "signed_mean_rel_error": float(pooled.mean()),
                    "sd_over_publications": (
                        float(np.std(means, ddof=1)) if len(means) > 1 else math.nan
                    ),
                }
            )
    return rows


RUNTIME_FIELDS = [
    "dataset",
    "n",
    "workload",
    "mechanism",
    "label",
    "gamma",
    "publications",
    "publish_seconds",
    "answer_ms_per_query",
]


def runtimes(measurements: list[Measurement]) -> list[dict]:
    """Median publish time and answer time per query, at γ = 5 where γ applies."""
    groups: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        if m.gamma in (None, DEFAULT_GAMMA):
            groups.setdefault((m.dataset, m.n, m.mechanism.key), []).append(m)
    rows = []
    for (dataset_name, n, _), members in groups.items():
        mechanism = members[0].mechanism
        rows.append(
            {
                "dataset": dataset_name,
                "n": n,
                "workload": mechanism.workload,
                "mechanism": mechanism.key,
                "label": mechanism.label,
                "gamma": DEFAULT_GAMMA if mechanism.uses_gamma else "",
                "publications": len(members),
                "publish_seconds": float(np.median([m.publish_seconds for m in members])),
                "answer_ms_per_query": float(
                    np.median([1e3 * m.answer_seconds / len(m.errors) for m in members])
                ),
            }
        )
    return rows


NOTE_FIELDS = ["dataset", "n", "mechanism", "label", "gamma", "name", "value"]


def notes(measurements: list[Measurement]) -> list[dict]:
    """What each mechanism reported about its first publication of every table, at γ = 5."""
    rows = []
    for m in measurements:
        if m.seed == 0 and m.gamma in (None, DEFAULT_GAMMA):
            for name, value in m.info.items():
                rows.append(
                    {
                        "dataset": m.dataset,
                        "n": m.n,
                        "mechanism": m.mechanism.key,
                        "label": m.mechanism.label,
                        "gamma": "" if m.gamma is None else m.gamma,
                        "name": name,
                        "value": value,
                    }
                )
    return rows


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as stream:
        writer = csv.DictWriter(stream, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.experiments",
        description="Run every mechanism on the papers' workloads (Adult and Adult resampled "
        "to 100k–500k rows) with fixed seeds; write CSVs, PNG plots and a Markdown report.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny run for CI (seconds)")
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="directory for CSVs and PNGs; the report is written next to it as DIR.md "
        "(default docs/evaluation, hence docs/evaluation.md)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes (default 2; results do not depend on it)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redraw the plots and rewrite the report from the CSVs already in DIR",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        publish(args.output.resolve())
        return
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    settings = QUICK if args.quick else FULL
    output: Path = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    log(
        f"{'quick' if settings.quick else 'full'} run with {args.jobs} worker(s); "
        f"outputs in {output} and {output.name}.md next to it"
    )
    everything = tuple(m.key for m in MECHANISMS)
    swept = tuple(m.key for m in MECHANISMS if m.sweeps_n)
    tasks = [
        Task(None, seed, settings.gammas, everything, settings.per_band, settings.adult_rows)
        for seed in range(settings.publications)
    ]
    # Largest tables first, so the workers finish together.
    tasks = [
        Task(size, seed, (DEFAULT_GAMMA,), swept, settings.per_band_n, settings.adult_rows)
        for size in sorted(settings.sizes, reverse=True)
        for seed in range(settings.publications_n)
    ] + tasks
    log(
        f"{len(tasks)} tasks: γ ∈ {settings.gammas} on {settings.adult_label} "
        f"({settings.publications} publications); N ∈ {settings.sizes} at γ = {DEFAULT_GAMMA} "
        f"({settings.publications_n} publications each)"
    )
    measurements = run_tasks(tasks, args.jobs)
    compute_seconds = time.perf_counter() - started

    base = [m for m in measurements if not m.dataset.startswith(RESAMPLED)]
    by_n = [m for m in measurements if m.mechanism.sweeps_n and m.gamma in (None, DEFAULT_GAMMA)]
    write_csv(output / "errors_vs_gamma.csv", ERROR_FIELDS, aggregate("gamma", base))
    write_csv(output / "errors_vs_n.csv", ERROR_FIELDS, aggregate("n", by_n))
    write_csv(output / "runtime.csv", RUNTIME_FIELDS, runtimes(by_n))
    write_csv(
        output / "mechanism_notes.csv",
        NOTE_FIELDS,
        notes(by_n + [m for m in base if not m.mechanism.sweeps_n]),
    )
    datasets = [dataset(None, settings.per_band, settings.adult_rows)] + [
        dataset(size, settings.per_band_n, settings.adult_rows) for size in settings.sizes
    ]
    write_csv(output / "pools.csv", POOL_FIELDS, pool_rows(datasets))
    run = {
        **{f.name: getattr(settings, f.name) for f in fields(Settings)},
        "jobs": args.jobs,
        "experiment_seconds": compute_seconds,
        "total_seconds": time.perf_counter() - started,
    }
    write_csv(
        output / "run.csv", ["name", "value"], [{"name": k, "value": v} for k, v in run.items()]
    )
    publish(output)
    total = time.perf_counter() - started
    log(f"total run time {total:.1f} s ({total / 60:.1f} min)")


POOL_FIELDS = [
    "dataset",
    "n",
    "workload",
    "band",
    "band_label",
    "sampled",
    "available",
    "mean_true_count",
]


def pool_rows(datasets: list[Dataset]) -> list[dict]:
    rows = []
    for data in datasets:
        for workload, pool in data.pools.items():
            sampled = np.bincount(pool.band, minlength=len(BANDS))
            for i, band in enumerate(BANDS):
                rows.append(
                    {
                        "dataset": data.name,
                        "n": data.n,
                        "workload": workload,
                        "band": band.key,
                        "band_label": band.label,
                        "sampled": int(sampled[i]),
                        "available": int(pool.available[i]),
                        "mean_true_count": float(pool.true[pool.band == i].mean())
                        if sampled[i]
                        else math.nan,
                    }
                )
    return rows


INTEGER = {"n", "queries", "publications", "sampled", "available"}
TEXT = {
    "experiment",
    "dataset",
    "workload",
    "mechanism",
    "label",
    "band",
    "band_label",
    "name",
}


def read_csv(path: Path) -> list[dict]:
    """Rows as written by `write_csv`, numbers parsed back (γ stays "" where it does not apply)."""

    def parse(column: str, text: str) -> object:
        if column in TEXT or text == "":
            return text
        if column in INTEGER or column == "gamma":
            return int(text)
        try:
            return float(text)
        except ValueError:
            return text

    with path.open(newline="", encoding="utf-8") as stream:
        return [{k: parse(k, v) for k, v in row.items()} for row in csv.DictReader(stream)]


def publish(output: Path) -> None:
    """Plots and report from the CSVs in `output` alone (also `--report-only`)."""
    run = {row["name"]: row["value"] for row in read_csv(output / "run.csv")}
    settings = Settings.from_run(run)
    gamma_rows = read_csv(output / "errors_vs_gamma.csv")
    n_rows = read_csv(output / "errors_vs_n.csv")
    runtime_rows = read_csv(output / "runtime.csv")
    figures = plots.draw_all(output, gamma_rows, n_rows, runtime_rows, settings.gammas)
    adult, _ = adult_tables(settings.adult_rows)
    report = markdown.render(
        settings=settings,
        jobs=int(run["jobs"]),
        output=output,
        figures=figures,
        gamma_rows=gamma_rows,
        n_rows=n_rows,
        runtime_rows=runtime_rows,
        note_rows=read_csv(output / "mechanism_notes.csv"),
        pool_rows=read_csv(output / "pools.csv"),
        adult=adult,
        compute_seconds=float(run["experiment_seconds"]),
        total_seconds=float(run["total_seconds"]),
    )
    report_path = output.with_name(output.name + ".md")
    report_path.write_text(report, encoding="utf-8")
    log(f"wrote {len(figures)} figures in {output} and the report {report_path}")


if __name__ == "__main__":
    main()
