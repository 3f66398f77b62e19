"""`splu plan`: which γ (or p, λ, δ) to choose, with guarantees and errors measured on a
sample of the user's own data, and the stream-config block of the recommended setting."""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from service.cli.commands.common import (
    FORMATTER,
    LAMBDA_HELP,
    CommandError,
    Commands,
    add_table_options,
    add_threshold_options,
    column_names,
    key_and_ids,
    parse_bins,
    read_input_table,
    report_rejections,
    write_atomically,
    write_json,
)
from service.cli.commands.plan_report import (
    percent,
    plot_plan,
    print_baselines,
    print_decoy,
    print_personal,
)
from service.cli.progress import progress_bar
from service.core import drafting, planning
from service.core.config import DEFAULT_MIXING_POOL, DEFAULT_PARTITIONS, MIN_MIXING_GROUPS
from service.core.mechanisms.personal import BUDGETS
from service.core.mechanisms.registry import MECHANISMS, STREAM_MECHANISMS
from service.core.merge import ValueMap
from service.core.publication import log, open_input
from service.core.publishers import only_sensitive
from service.core.schema import Rejection
from service.core.table import Table, csv_reader

# The stream's mechanisms, which the plan recommends a setting of; `all` adds the batch ones.
EVERY = "all"
# Random query draws allowed per query wanted, as in bench/: a sample without small (or
# large) queries ends the search instead of spinning.
DRAW_LIMIT = 1000
# Separate random streams of one --seed, so --records does not change the queries drawn.
SUBSAMPLE_STREAM, QUERY_STREAM = 1, 2
TRUSTED_SIDE = (
    "The plan is itself a release of the raw sample: keep its output on the trusted side. "
    "Per value it shows shares of the sample, never a record."
)

DESCRIPTION = f"""\
Measure, on a sample of your own data, what each setting of decoy groups and personal
groups guarantees and how accurate its counts are, and recommend one:

  decoy, every feasible γ (2 up to 1/the largest value's share): T_P(ε, α), T_f,
    the share suppressed, each value's share and the amplification of the noise of
    conjunctive counts on it under the estimator's model of size-weighted cuts
    (1/(1/γ − t) if values mixed uniformly; warned past --max-amplification);
  personal, each --retention p at --lambda/--delta: v_g and v_r of plain
    perturbation, the share SPS perturbs, v_g under SPS;
  --mechanism all adds the batch mechanisms on the same queries: Anatomy (ℓ = γ),
    global randomization (retention 1/γ) and SDR (amplification γ) at each γ,
    F′-privacy and DBR at `splu publish`'s defaults;
  each: mean and median relative error |estimate − true|/true of random
    conjunctive counts (1–3 public columns = a record's values ∧ a sensitive
    value), large (true count ≥ 1% of the rows) and small (1–10), over
    --publications publications with fresh keys.

The recommendation is the largest γ whose large-count mean error is at most
--max-error, and the p with the lowest such error among settings SPS keeps private,
printed as the block to paste into the stream config (`splu run --config`); where none
is, what would help (more rows, fewer or coarser public columns, a looser bound).
--plot draws the privacy/utility curve: small-count error (higher: more private) and
T_P against large-count error (lower: more useful).

--config-out FILE writes a whole stream config that `splu run` accepts as it is: the
schema from the data, each numeric public column of more than 10 values cut into a few
bins of about equal size (planned so, too); the recommended setting (decoy first), or
the most private one planned, marked as such, when none meets --max-error; partitions,
mixing floor and max_wait sized to the rows and to --expected-rate; standing queries on
your own columns. It prints the commands that run it and query what it published.

{textwrap.fill(TRUSTED_SIDE, 86)}

example:
  splu plan --input answers.csv --sensitive condition --quasi age,sex,region,education \\
      --id-column respondent --config-out my-stream.toml
  splu sample --output adult.csv
  splu plan --input adult.csv --sensitive occupation \\
      --quasi age,sex,race,marital_status,education --max-error 0.2 --json plan.json
  splu plan --input adult.csv --sensitive occupation --quasi age,sex,race \
      --mechanism all --plot plan.png
"""


def parse_retentions(values: Sequence[str] | None) -> list[float]:
    """--retention 0.3,0.5 --retention 0.7 as [0.3, 0.5, 0.7]."""
    out = []
    for text in (v for value in values or ("0.3,0.5,0.7",) for v in value.split(",")):
        try:
            p = float(text)
        except ValueError:
            raise CommandError(f"--retention {text!r}: not a number") from None
        if not 0 < p < 1:
            raise CommandError(f"--retention {text}: p must lie in (0, 1)")
        out.append(p)
    return sorted(set(out))


def check_arguments(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--publications", args.publications),
        ("--queries", args.queries),
        ("--alpha", args.alpha),
    ):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    if args.records is not None and args.records < 2:
        raise CommandError(f"--records must be at least 2, got {args.records}")
    if not args.max_error > 0:
        raise CommandError(f"--max-error must be positive, got {args.max_error}")
    if not args.max_amplification > 0:
        raise CommandError(f"--max-amplification must be positive, got {args.max_amplification}")
    if args.config_out is None:
        given = [f for f, v in (("--expected-rate", args.expected_rate),
                                ("--id-column", args.id_column)) if v is not None]  # fmt: skip
        if given:
            raise CommandError(f"{given[0]} applies to --config-out")
    elif args.input == "-":
        raise CommandError("--config-out needs --input FILE: `splu run` reads the file again")


def random_stream(seed: int | None, stream: int) -> np.random.Generator:
    return np.random.default_rng(None if seed is None else [stream, seed])


def sample_of(table: Table, records: int | None, seed: int | None) -> Table:
    """--records rows drawn without replacement (all rows if the table has fewer)."""
    if records is None or records >= len(table):
        return table
    rng = random_stream(seed, SUBSAMPLE_STREAM)
    return table.take(np.sort(rng.choice(len(table), records, replace=False)))


def run_plan(
    table: Table,
    sensitive: str,
    mechanisms: Sequence[str],
    baselines: Sequence[str],
    gammas: range,
    retentions: Sequence[float],
    pool: planning.QueryPool,
    releases: planning.Releases,
    merge_map: tuple[str, ValueMap] | None,
    args: argparse.Namespace,
) -> list[planning.Setting]:
    """Every setting of the plan, in the order the tables show them, under a progress bar."""
    steps: list[tuple[str, Callable[[], planning.Setting]]] = []
    varied = {
        "decoy": [
            (
                f"decoy γ = {gamma}",
                partial(
                    planning.plan_decoy, table, sensitive, gamma, pool, releases, args.epsilon,
                    args.alpha, args.te, args.utility_epsilon or args.epsilon,
                    args.max_amplification,
                ),
            )
            for gamma in gammas
        ],
        "personal": [
            (
                f"personal p = {p:g}",
                partial(
                    planning.plan_personal, table, sensitive, p, args.lam, args.delta,
                    args.budget, merge_map, pool, releases,
                ),
            )
            for p in retentions
        ],
    }  # fmt: skip
    for mechanism, mechanism_steps in varied.items():
        if mechanism in mechanisms:
            steps += mechanism_steps
    for mechanism in baselines:
        at = (
            planning.baseline_gammas(mechanism, table, sensitive, gammas)
            if mechanism in planning.WITH_GAMMA
            else [None]
        )
        steps += [
            (
                f"{mechanism}" + ("" if gamma is None else f" γ = {gamma}"),
                partial(planning.plan_baseline, mechanism, table, sensitive, gamma, pool, releases),
            )
            for gamma in at
        ]
    settings = []
    with progress_bar(len(steps), "planning", unit="setting") as bar:
        for label, plan in steps:
            bar.set_postfix_str(label)
            settings.append(plan())
            bar.update()
    return settings


def recommendation(
    mechanism: str, settings: Sequence[planning.Setting], args: argparse.Namespace
) -> dict[str, Any]:
    """The recommended setting of `mechanism` with its block, or why there is none."""
    chosen = planning.recommend(mechanism, settings, args.max_error)
    rule = MECHANISMS[mechanism].recommend_rule
    if chosen is None:
        planned = [s.large_mean() for s in settings if s.mechanism == mechanism]
        best = min((e for e in planned if e is not None), default=None)
        return {
            "mechanism": mechanism,
            "setting": None,
            "toml": None,
            "reason": f"no setting keeps the large-count mean error at or below "
            f"{args.max_error:.1%} (the lowest is {percent(best)})",
        }
    return {
        "mechanism": mechanism,
        "setting": chosen.parameters,
        "toml": planning.toml_block(chosen),
        "reason": f"{rule} large-count mean error ({percent(chosen.large_mean())}) is at most "
        f"{args.max_error:.1%}",
    }


def command_plan(args: argparse.Namespace) -> int:
    check_arguments(args)
    chosen = args.mechanism or STREAM_MECHANISMS
    mechanisms = [m for m in STREAM_MECHANISMS if m in chosen or EVERY in chosen]
    baselines = planning.BASELINES if EVERY in chosen else ()
    retentions = parse_retentions(args.retention)
    started = time.perf_counter()
    rate = drafting.parse_rate(args.expected_rate) if args.expected_rate else None
    table, rejections = read_input_table(args)
    binned: list[drafting.Binning] = []
    if args.config_out is not None:
        check_id_column(args)
        table, rejections, binned = bin_for_stream(table, rejections, args)
    report_rejections(rejections)
    sensitive = only_sensitive(table, "splu plan")
    public = [a.name for a in table.schema.public]
    if not public:
        raise CommandError("name the public columns with --quasi: the queries condition on them")
    whole = table
    table = sample_of(table, args.records, args.seed)
    n = len(table)
    log(f"  planning on {n:,} rows. {TRUSTED_SIDE}")
    pool = planning.query_pool(
        table, sensitive, public, args.queries, random_stream(args.seed, QUERY_STREAM),
        DRAW_LIMIT * args.queries,
    )  # fmt: skip
    log(f"  {pool.large:,} large and {pool.small:,} small queries from {pool.draws:,} draws")
    releases = [
        key_and_ids(None if args.seed is None else args.seed + i, n)
        for i in range(args.publications)
    ]
    merge_map = (args.merge_map, ValueMap.load(args.merge_map)) if args.merge_map else None
    gammas = planning.feasible_gammas(table, sensitive)
    by_gamma = any(MECHANISMS[m].knob == "gamma" for m in mechanisms)
    if (by_gamma or baselines) and not gammas:
        raise CommandError(
            f"no γ ≥ 2 is feasible: {sensitive!r} needs two values, none above half the rows "
            "(--mechanism personal plans personal groups alone)"
        )
    settings = run_plan(
        table, sensitive, mechanisms, baselines, gammas, retentions, pool, releases, merge_map,
        args,
    )  # fmt: skip
    recommendations = [recommendation(m, settings, args) for m in mechanisms]

    print(
        f"splu plan: {n:,} rows of {args.input}, sensitive {sensitive} "
        f"({table.schema[sensitive].size} values), public {', '.join(public)}"
    )
    print(
        f"{pool.large:,} large queries (true count ≥ {planning.large_minimum(n):,}, 1% of the "
        f"rows) and {pool.small:,} small ones (1–{planning.SMALL_MAX}), each answered on "
        f"{args.publications} publication(s); error = |estimate − true| / true"
    )
    print(TRUSTED_SIDE)
    for warning in planning.missing_bands(pool):
        print(f"warning: {warning}; its errors are not measured (a larger sample may hold one)")
    printers = {
        "decoy": partial(print_decoy, args=args),
        "personal": partial(print_personal, merge_map=args.merge_map),
    }
    for mechanism, print_settings in printers.items():
        planned = [s for s in settings if s.mechanism == mechanism]
        if planned:
            print_settings(planned)
    batch = [s for s in settings if s.mechanism in planning.BASELINES]
    if batch:
        print_baselines(batch)
    for binning in binned:
        print(
            f"{binning.column}: {binning.values} numeric values, planned and written cut into "
            f"{len(binning.edges) - 1} bins of about equal size "
            f"({', '.join(whole.schema[binning.column].domain)})"
        )
    print(f"\nRecommendation (--max-error {args.max_error:.1%} on large counts):")
    for r in recommendations:
        if r["toml"] is None:
            print(f"  {r['mechanism']}: none; {r['reason']}. What would help:")
            for line in drafting.advice(settings, r["mechanism"], args.max_error, table, binned):
                print(f"    - {line}")
            continue
        print(f"  {r['mechanism']}: {r['reason']}. Paste into the stream config:\n")
        print("".join(f"    {line}\n" for line in r["toml"].splitlines()))
    if args.config_out is not None:
        write_config(args, whole, settings, recommendations, binned, rate)
    else:
        if any(r["toml"] for r in recommendations):
            print("  then: splu run --config my-stream.toml --input answers.csv")
        # The floor a stream gets by default, and the least it may hold (10 groups).
        sizes = [
            r["setting"][size]
            for r in recommendations
            if r["setting"] and (size := MECHANISMS[r["mechanism"]].group_size)
        ]
        groups = MIN_MIXING_GROUPS * max(sizes, default=1)
        note = planning.floor_note(n, DEFAULT_MIXING_POOL, DEFAULT_PARTITIONS, groups)
        if note:
            print(f"\n{note}")

    if args.json:
        write_json(args.json, {
            "input": args.input, "rows": n, "sensitive": sensitive, "quasi": public,
            "seed": args.seed, "publications": args.publications,
            "queries": {
                "large": pool.large, "small": pool.small, "draws": pool.draws,
                "large_min_count": planning.large_minimum(n), "small_max_count": planning.SMALL_MAX,
            },
            "max_error": args.max_error, "max_amplification": args.max_amplification,
            "trusted_side": TRUSTED_SIDE,
            "settings": [s.row() for s in settings],
            "recommendations": recommendations,
            "seconds": time.perf_counter() - started,
        })  # fmt: skip
        log(f"  wrote {args.json}")
    if args.plot:
        plot_plan(settings, recommendations, args.max_error, args.plot)
        log(f"  wrote {args.plot}")
    log(f"  planned {len(settings)} settings in {time.perf_counter() - started:.1f} s")
    return 0


def check_id_column(args: argparse.Namespace) -> None:
    """--id-column names a column of the input, which is never published."""
    if args.id_column is None:
        return
    if args.id_column in column_names(args.quasi) + column_names(args.sensitive):
        raise CommandError(
            f"--id-column {args.id_column!r} is also named by --quasi or --sensitive: a "
            "stream never publishes ids"
        )
    with open_input(args.input) as stream:
        header = csv_reader(stream, args.delimiter)[0]
    if args.id_column not in header:
        raise CommandError(
            f"--id-column {args.id_column!r} is not a column of {args.input} (its columns: "
            f"{', '.join(header)})"
        )


def bin_for_stream(
    table: Table, rejections: list[Rejection], args: argparse.Namespace
) -> tuple[Table, list[Rejection], list[drafting.Binning]]:
    """The table as the drafted stream will read it: numeric public columns of many values
    binned, unless --schema or --bin says how (`drafting.bin_numeric_columns`)."""
    if args.schema:
        return table, rejections, []
    given = parse_bins(args.bin)
    columns = [c for c in column_names(args.quasi) if c not in given]
    table, more, binned = drafting.bin_numeric_columns(table, columns)
    return table, sorted([*rejections, *more], key=lambda r: r.record), binned


def write_config(
    args: argparse.Namespace,
    table: Table,
    settings: Sequence[planning.Setting],
    recommendations: Sequence[dict[str, Any]],
    binned: Sequence[drafting.Binning],
    rate: float | None,
) -> None:
    """Draft the stream config (`service/core/drafting.py`), check that it loads, write it, and
    print what it holds and the commands that run it."""
    try:
        setting, recommended = drafting.choose_setting(settings, recommendations)
    except ValueError as err:
        raise CommandError(f"--config-out: {err}") from None
    sensitive = table.schema.sensitive[0].name
    gamma = setting.parameters.get("gamma")
    avoid = [] if gamma is None else [
        v["value"] for v in setting.guarantees["values"]
        if v["amplification"] is None or v["amplification"] > args.max_amplification
    ]  # fmt: skip
    path = Path(args.config_out)
    run = ["splu", "run", "--config", args.config_out, "--input", args.input]
    run += ["--id-column", args.id_column] if args.id_column else []
    run += ["--delimiter", args.delimiter] if args.delimiter else []
    draft = drafting.Draft(
        path=path, input=args.input, rows=len(table), schema=table.schema, binned=binned,
        setting=setting, recommended=recommended, max_error=args.max_error,
        advice=drafting.advice(settings, setting.mechanism, args.max_error, table, binned),
        sizing=drafting.size_stream(len(table), rate, MIN_MIXING_GROUPS * (gamma or 1)),
        queries=drafting.standing_queries(table, sensitive, avoid),
        run_command=shlex.join([*run, "--published-out", "published.csv"]),
    )  # fmt: skip
    text = drafting.render(draft)
    drafting.checked(text, path)
    write_atomically(args.config_out, lambda stream: stream.write(text))
    s = draft.sizing
    chosen = drafting.planning_label(setting)
    if not recommended:
        chosen += (
            f", the SAFEST SETTING, NOT A RECOMMENDATION (none met --max-error "
            f"{args.max_error:g}; what would help is above and in the file)"
        )
    print(
        f"\nWrote {args.config_out}: {chosen}; {s.partitions} partition(s), mixing floor "
        f"{s.mixing_pool}, max_wait {drafting.duration_text(s.max_wait)}, "
        f"{len(draft.queries)} standing queries. "
        "Next:"
    )
    example = shlex.quote(json.dumps(draft.queries[0])) if draft.queries else "'{...}'"
    print(f"  {draft.run_command}")
    print(f"  echo {example} > queries.jsonl")
    print(
        "  "
        + shlex.join(["splu", "query", "--published", "published.csv", "--config",
                      args.config_out, "--queries", "queries.jsonl", "--output", "-"])
    )  # fmt: skip


def register(commands: Commands) -> None:
    """Add `splu plan`."""
    plan = commands.add_parser(
        "plan",
        formatter_class=FORMATTER,
        help="choose γ (or p, λ, δ) with guarantees and errors measured on your own sample",
        description=DESCRIPTION,
    )
    add_table_options(plan)
    plan.add_argument(
        "--mechanism",
        action="append",
        choices=(*STREAM_MECHANISMS, EVERY),
        help="plan decoy groups or personal groups (repeat for both; default both), or all: "
        "both and the batch mechanisms on the same queries, for comparison",
    )
    plan.add_argument(
        "--max-error",
        type=float,
        default=0.25,
        metavar="E",
        help="largest acceptable mean relative error of large counts (default 0.25)",
    )
    plan.add_argument(
        "--publications",
        type=int,
        default=3,
        metavar="N",
        help="publications per setting, each with a fresh key (default 3)",
    )
    plan.add_argument(
        "--queries",
        type=int,
        default=1000,
        metavar="N",
        help="random queries per band, large and small (default 1000)",
    )
    plan.add_argument(
        "--records",
        type=int,
        metavar="N",
        help="plan on N rows drawn at random without replacement (default: every row); "
        "the run time grows with the rows",
    )
    plan.add_argument(
        "--seed",
        type=int,
        help="derive the subsample, the queries and the keys from N, to repeat a plan exactly",
    )
    plan.add_argument(
        "--json",
        metavar="OUT",
        help="write one row per setting as JSON (schema: docs/plan.schema.json)",
    )
    plan.add_argument("--plot", metavar="OUT.png", help="draw the privacy/utility curve of "
                      "every setting (needs matplotlib)")  # fmt: skip
    stream = plan.add_argument_group("the stream config (--config-out)")
    stream.add_argument(
        "--config-out", metavar="FILE.toml",
        help="write a complete, commented stream config for `splu run --config`: schema "
        "(numeric public columns of many values binned), the recommended setting (or the "
        "safest, marked), floor and partitions sized to the rows and --expected-rate",
    )  # fmt: skip
    stream.add_argument(
        "--expected-rate", metavar="R",
        help="responses expected per second, or per min, h or day (500/day): sizes "
        "partitions and max_wait (default: a survey of the input's size, no rate)",
    )  # fmt: skip
    stream.add_argument(
        "--id-column", metavar="COL",
        help="the column holding each response's id, for the `splu run` command printed "
        "(never published)",
    )  # fmt: skip
    decoy = plan.add_argument_group("decoy groups (the thresholds of `splu guarantees`)")
    add_threshold_options(decoy)
    decoy.add_argument(
        "--max-amplification",
        type=float,
        default=10.0,
        metavar="X",
        help="warn when a value's share t makes 1/(1/γ − t) exceed X (default 10): the noise "
        "of conjunctive counts on that value is amplified that much. It is γ at t = 0, so "
        "at γ ≥ X every value warns",
    )
    personal = plan.add_argument_group("personal groups")
    personal.add_argument(
        "--retention",
        action="append",
        metavar="P,P",
        help="retention probabilities p to plan (default 0.3,0.5,0.7); repeat or comma-separate",
    )
    personal.add_argument("--lambda", dest="lam", type=float, default=0.3, help=LAMBDA_HELP)
    personal.add_argument(
        "--delta", type=float, default=0.3, help="δ in (0, 1), see --lambda (default 0.3)"
    )
    personal.add_argument(
        "--budget",
        choices=BUDGETS,
        default="adaptive",
        help="the batch budget to measure: adaptive (default; the recommended block names "
        "the stream's bounded budget, which approaches it safely as groups grow), "
        "conservative (f = 1, safe under any drift) or none (plain perturbation)",
    )
    personal.add_argument(
        "--merge-map",
        metavar="FILE",
        help="the merge map the stream will name (`splu merge`); without it every public "
        "combination is a group of its own, as in a stream without one",
    )
    plan.set_defaults(run=command_plan)
