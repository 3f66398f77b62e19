"""Personal groups, batch against stream on UCI Adult: large-count error side by side.

Issue 15's target: the stream with its default (bounded) budget within 1.25× of the
batch's large-count error, with no group over its trial limit. One run, fixed seeds:

- data and workload: the bundled Adult sample (45,222 records), the income workload
  of docs/evaluation.md (public education, occupation, race, sex; sensitive income,
  m = 2), merged by the stream example's map (deploy/examples/adult.merge.toml) in
  both. --queries count queries ``A_1=a_1 ∧ … ∧ A_d=a_d ∧ income=v`` on original
  public values, drawn as in bench/personal_accuracy.py (d uniform in {1, 2, 3})
  and kept when their true count is at least --selectivity (1%) of N: the large
  counts.
- batch: ``splu publish --mechanism personal`` (SPS, adaptive budget: each group's
  true frequency) at the thesis settings p = 0.5, λ = δ = 0.3, key seed s.
- stream: ``splu run`` of the same CSV (embedded broker and Redis, worker, consumer,
  producer) with deploy/examples/adult-personal.toml, its budget left at the
  default and --partitions partitions, service key seed s, the published topic
  written out (--published-out); v_g, the closest group (trials / ⌊s_g⌋ at its
  final frequency) and the frozen groups come from the consumer's last budget test.
- both answered by ``splu query --mechanism personal`` (raw MLE, unclipped), with
  --budget adaptive and bounded respectively; relative error |estimate − true| /
  true, pooled over queries and --runs seeds. The ratio stream/batch of the means
  is the figure the target is on.

Run from the repository root (a stream run takes about a minute):

    .venv/bin/python bench/personal_stream.py
    .venv/bin/python bench/personal_stream.py --runs 5 --partitions 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import tomllib
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import tomli_w
from personal_accuracy import PUBLIC, SENSITIVE, draw_workloads, percent
from report import log, print_table

from service.cli import client
from service.cli.batch import main as splu
from service.core.merge import ValueMap
from service.core.prf import ServiceKey
from service.core.table import open_sample, read_table
from streams.tools.run import run_stream

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
RATIO_TARGET = 1.25
SETTINGS = ["--retention", "0.5", "--lambda", "0.3", "--delta", "0.3"]


def answers(
    published: Path, budget: str, merge_map: Path, queries: Path, stream: bool = False
) -> np.ndarray:
    """`splu query` on a publication (a stream's with `stream`): the estimates, in query
    order."""
    output = published.with_suffix(".answers.jsonl")
    with redirect_stdout(sys.stderr):
        code = splu([
            "query", "--published", str(published), "--mechanism", "personal",
            "--sensitive", SENSITIVE, *SETTINGS, "--budget", budget,
            "--merge-map", str(merge_map), "--queries", str(queries), "--output", str(output),
            *(["--stream"] if stream else []),
        ])  # fmt: skip
    if code != 0:
        raise SystemExit(f"splu query failed on {published}")
    lines = output.read_text().splitlines()
    return np.array([json.loads(line)["estimate"] for line in lines])


def batch(csv: Path, merge_map: Path, seed: int, work: Path) -> Path:
    out = work / f"batch-{seed}.csv"
    code = splu([
        "publish", "--input", str(csv), "--output", str(out), "--mechanism", "personal",
        "--sensitive", SENSITIVE, "--quasi", ",".join(PUBLIC), *SETTINGS,
        "--merge-map", str(merge_map), "--seed", str(seed),
    ])  # fmt: skip
    if code != 0:
        raise SystemExit("splu publish failed")
    return out


def stream(csv: Path, partitions: int, seed: int, work: Path) -> tuple[Path, dict, str]:
    """`splu run` with the example's stream at its default budget: the published CSV,
    the consumer's last budget test and the budget the stream ran with."""
    document = tomllib.loads((EXAMPLES / "adult-personal.toml").read_text())
    del document["personal"]["budget"]
    document["personal"]["merge_map"] = str(EXAMPLES / "adult.merge.toml")
    document["stream"].update(partitions=partitions, report_interval=2.0, flush_interval=1.0)
    document["reports"]["fail_closed"] = []  # measure what happens, never pause
    config = work / f"stream-{seed}.toml"
    config.write_text(tomli_w.dumps(document))
    os.environ[document["key"]["env"]] = ServiceKey.from_seed(seed).secret.hex()
    # run_stream exports its embedded servers' addresses: each run starts its own.
    for variable in ("KAFKA_BOOTSTRAP", "REDIS_URL"):
        os.environ.pop(variable, None)
    published = work / f"stream-{seed}.csv"
    test: dict = {}
    budget: list[str] = []

    def afterwards(stream_config, url: str) -> None:
        assert stream_config.personal is not None
        budget.append(stream_config.personal.budget)
        tests = client.status(url)["tests"]
        test.update(next(t for t in tests if t["test"] == "budget"))

    with redirect_stdout(sys.stderr):
        run_stream(config, csv, published_out=published, afterwards=afterwards)
    return published, test, budget[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Large-count error of personal groups: batch SPS against the stream's "
        "default budget on UCI Adult (income workload), side by side."
    )
    parser.add_argument("--runs", type=int, default=3, help="seeds (default 3)")
    parser.add_argument("--queries", type=int, default=1000, help="query pool (default 1000)")
    parser.add_argument(
        "--selectivity", type=float, default=0.01, help="smallest true count / N (default 0.01)"
    )
    parser.add_argument("--partitions", type=int, default=1, help="stream partitions (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    args = parser.parse_args()
    if min(args.runs, args.queries, args.partitions) < 1:
        parser.error("--runs, --queries and --partitions must be positive")

    merge_map_path = EXAMPLES / "adult.merge.toml"
    value_map = ValueMap.load(merge_map_path)
    with open_sample() as source:
        table, _ = read_table(source, quasi=PUBLIC, sensitive=[SENSITIVE])
    workload, _, draws = draw_workloads(
        table, value_map, args.queries, args.selectivity, np.random.default_rng(args.seed)
    )
    work = Path(tempfile.mkdtemp(prefix="splu-personal-stream-"))
    try:
        csv = work / "adult.csv"
        with redirect_stdout(sys.stderr):
            splu(["sample", "--output", str(csv)])
        queries = work / "queries.jsonl"
        queries.write_text(
            "".join(
                json.dumps({"where": {c: v[0] for c, v in q.where.items()}, "value": q.value})
                + "\n"
                for q in workload.queries
            )
        )
        errors: dict[str, list[np.ndarray]] = {"batch": [], "stream": []}
        tests: list[dict] = []
        for seed in range(args.seed, args.seed + args.runs):
            log(f"seed {seed}: batch publish")
            published = batch(csv, merge_map_path, seed, work)
            estimates = answers(published, "adaptive", merge_map_path, queries)
            errors["batch"].append(np.abs(estimates - workload.true) / workload.true)
            log(f"seed {seed}: stream run ({args.partitions} partitions)")
            published, test, budget = stream(csv, args.partitions, seed, work)
            estimates = answers(published, budget, merge_map_path, queries, stream=True)
            errors["stream"].append(np.abs(estimates - workload.true) / workload.true)
            tests.append(test)
    finally:
        shutil.rmtree(work)

    batch_error = float(np.concatenate(errors["batch"]).mean())
    stream_error = float(np.concatenate(errors["stream"]).mean())
    ratio = stream_error / batch_error
    print(
        f"Personal groups on UCI Adult, income workload: N = {len(table):,}, p = 0.5, "
        f"λ = δ = 0.3, merge map {merge_map_path.name}; {args.queries:,} queries with true "
        f"count ≥ {percent(args.selectivity)} of N (from {draws:,} draws, seed {args.seed}); "
        f"{args.runs} runs; stream: {args.partitions} partition(s), {budget} budget\n"
    )
    print_table(
        ["publication", "mean relative error", "per run", "median"],
        [
            [
                name,
                percent(float(np.concatenate(e).mean())),
                ", ".join(percent(float(x.mean())) for x in e),
                percent(float(np.median(np.concatenate(e)))),
            ]
            for name, e in errors.items()
        ],
    )
    numbers = [t["numbers"] for t in tests]
    print()
    print_table(
        ["metric", "measured", "target", "pass"],
        [
            [
                "stream / batch mean error",
                f"{ratio:.3f}",
                f"≤ {RATIO_TARGET}",
                "yes" if ratio <= RATIO_TARGET else "NO",
            ],
            [
                "stream v_g (worst run)",
                percent(max(n["v_g"] for n in numbers)),
                "0",
                "yes" if all(n["v_g"] == 0 for n in numbers) else "NO",
            ],
            [
                "closest group: trials / ⌊s_g⌋ at final f",
                f"{max(n['max_exact_use'] for n in numbers):.3f}",
                "≤ 1",
                "yes" if all(n["max_exact_use"] <= 1 for n in numbers) else "NO",
            ],
            ["groups frozen (worst run)", f"{max(n['groups_frozen'] for n in numbers)}", "—", "—"],
            [
                "stream trials (mean over runs)",
                f"{np.mean([n['trials'] for n in numbers]):,.0f}",
                "—",
                "—",
            ],
        ],
    )


if __name__ == "__main__":
    main()
