"""The ``splu`` command line (SPEC §5)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import numpy as np

from service.guarantees import (
    chebyshev_thresholds,
    privacy_threshold,
    utility_threshold,
)
from service.mechanisms.decoy import GROUPINGS, DecoyGroups, DecoyRelease
from service.prf import ServiceKey, random_ids
from service.reconstruct import (
    MATRICES,
    METHODS,
    DecoyReconstruction,
    Estimate,
    PublishedCells,
    Query,
    QueryError,
)
from service.schema import Rejection, Schema, SchemaError
from service.table import Table, open_sample, open_text, read_rows, read_table, write_table

MECHANISMS = ("decoy",)
SHOWN_REJECTIONS = 10

GAMMA_HELP = (
    "decoy group size γ ≥ 2 (default 5). Each record publishes a value drawn "
    "uniformly from the γ distinct values of its hidden group, so no output can "
    "tell which of γ values a person had. A value with true count f is published "
    "as Binomial(γf, 1/γ): small counts get relative noise ≈ √((γ−1)/(γf)), large "
    "counts stay accurate. The papers recommend γ ≥ 5."
)


class CommandError(Exception):
    """A failure to report as one clear line, with nothing half-written."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _columns(values: Sequence[str] | None) -> list[str]:
    """Flags that may be repeated or comma-separated: --quasi a,b --quasi c."""
    return [c.strip() for v in values or () for c in v.split(",") if c.strip()]


def _bins(values: Sequence[str] | None) -> dict[str, float | list[float]]:
    out: dict[str, float | list[float]] = {}
    for spec in values or ():
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise CommandError(f"--bin {spec!r}: write COL=WIDTH or COL=EDGE,EDGE,...")
        try:
            numbers = [float(x) for x in rest.split(",")]
        except ValueError:
            raise CommandError(f"--bin {spec!r}: the width or edges must be numbers") from None
        out[name] = numbers[0] if len(numbers) == 1 else numbers
    return out


@contextmanager
def _input(path: str):
    try:
        stream = sys.stdin if path == "-" else open_text(path)
    except OSError as err:
        raise CommandError(f"cannot read {path}: {err.strerror}") from None
    try:
        yield stream
    finally:
        if stream is not sys.stdin:
            stream.close()


def _write_atomically(path: str, write: Callable[[TextIO], None]) -> None:
    """Write via a temporary file in the same directory, so a failure leaves no partial file."""
    if path == "-":
        write(sys.stdout)
        return
    target = Path(path)
    if not target.parent.exists():
        raise CommandError(f"cannot write {path}: directory {target.parent} does not exist")
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
            write(stream)
        Path(temporary).replace(target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _key_and_ids(seed: int | None, n: int) -> tuple[ServiceKey, np.ndarray]:
    if seed is None:
        return ServiceKey.fresh(), random_ids(n)
    key = ServiceKey.from_seed(seed)
    return key, random_ids(n, key)


def _report_rejections(rejections: Sequence[Rejection]) -> None:
    if not rejections:
        return
    _log(f"  rejected {len(rejections):,} rows:")
    for rejection in rejections[:SHOWN_REJECTIONS]:
        _log(f"    line {rejection}")
    if len(rejections) > SHOWN_REJECTIONS:
        _log(f"    ... and {len(rejections) - SHOWN_REJECTIONS:,} more (all listed by --report)")


def _describe_release(release: DecoyRelease) -> None:
    for name, counts in release.suppressed.items():
        if counts:
            listed = ", ".join(f"{v}: {c:,}" for v, c in sorted(counts.items()))
            _log(f"  suppressed (value above 1/γ of the data) in {name}: {listed}")
    if len(release.trimmed_lines):
        lines = ", ".join(str(x) for x in release.trimmed_lines)
        _log(f"  trimmed {len(release.trimmed_lines)} rows to a multiple of γ (lines {lines})")


def _publish_report(
    args: argparse.Namespace,
    rows_read: int,
    rejections: Sequence[Rejection],
    release: DecoyRelease,
) -> dict:
    return {
        "mechanism": args.mechanism,
        "gamma": release.gamma,
        "grouping": release.grouping,
        "input_rows": rows_read,
        "published_rows": len(release.published),
        "rejected": [{"line": r.record, "field": r.field, "reason": r.reason} for r in rejections],
        "suppressed": release.suppressed,
        "suppressed_lines": release.suppressed_lines.tolist(),
        "trimmed_lines": release.trimmed_lines.tolist(),
    }


def _read_input_table(args: argparse.Namespace) -> tuple[Table, list[Rejection]]:
    quasi, sensitive = _columns(args.quasi), _columns(args.sensitive)
    if args.schema and (quasi or sensitive or args.bin):
        raise CommandError("give either --schema or --quasi/--sensitive/--bin, not both")
    if not args.schema and not sensitive:
        raise CommandError("name the sensitive column(s) with --sensitive (or give --schema)")
    schema = Schema.load(args.schema) if args.schema else None
    with _input(args.input) as stream:
        return read_table(stream, schema, quasi, sensitive, _bins(args.bin))


def command_publish(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    table, rejections = _read_input_table(args)
    rows_read = len(table) + len(rejections)
    _log(f"splu publish: read {rows_read:,} rows from {args.input}")
    _report_rejections(rejections)
    mechanism = DecoyGroups(args.gamma, args.grouping)
    key, ids = _key_and_ids(args.seed, len(table))
    release = mechanism.publish(table, ids, key)
    _describe_release(release)
    _write_atomically(args.output, lambda s: write_table(release.published, s))
    if args.report:
        report = _publish_report(args, rows_read, rejections, release)
        _write_atomically(args.report, lambda s: json.dump(report, s, indent=2))
    groups = len(release.published) // release.gamma
    _log(
        f"  published {len(release.published):,} rows in {groups:,} decoy groups of γ={args.gamma}"
        f" ({args.grouping}) to {args.output} in {time.perf_counter() - started:.2f} s"
    )
    return 0


def _answer(estimate: Estimate) -> dict:
    out = {"estimate": round(estimate.estimate, 3)}
    if estimate.low is not None and estimate.high is not None:
        out["low"] = round(estimate.low, 3)
        out["high"] = round(estimate.high, 3)
    return out


def command_query(args: argparse.Namespace) -> int:
    sensitive = _columns(args.sensitive)
    if not sensitive:
        raise CommandError("name the sensitive column(s) of the published file with --sensitive")
    with _input(args.published) as stream:
        raw = read_rows(stream)
    if raw.rejections:
        raise CommandError(f"{args.published}: {raw.rejections[0]} (is it a published file?)")
    cells = PublishedCells.from_rows(raw.header, raw.rows)
    reconstruction = DecoyReconstruction(
        cells,
        args.gamma,
        sensitive,
        method=args.method,
        matrix=args.matrix,
        tolerance=args.tolerance,
        max_iterations=args.max_iterations,
        confidence=args.confidence,
    )
    objects, parsed, failures = [], [], 0
    with _input(args.queries) as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                objects.append({"line": number, "error": f"not valid JSON: {err.msg}"})
                parsed.append(None)
                failures += 1
                continue
            try:
                query = Query.from_json(obj)
                reconstruction.check(query)
            except QueryError as err:
                shown = obj if isinstance(obj, dict) else {"line": number}
                objects.append({**shown, "error": str(err)})
                parsed.append(None)
                failures += 1
                continue
            objects.append(obj)
            parsed.append(query)
    valid = [q for q in parsed if q is not None]
    answers = iter(reconstruction.estimate_many(valid))
    results = [
        obj if q is None else {**obj, **_answer(next(answers))}
        for obj, q in zip(objects, parsed, strict=True)
    ]
    _write_atomically(
        args.output,
        lambda s: s.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in results),
    )
    _log(
        f"splu query: answered {len(valid):,} queries over {cells.total:,} published rows "
        f"({args.method}, {args.matrix} matrix) into {args.output}"
    )
    if failures:
        _log(f'  {failures:,} queries could not be answered; their lines carry an "error"')
        return 1
    return 0


def command_guarantees(args: argparse.Namespace) -> int:
    privacy = privacy_threshold(args.gamma, args.epsilon, args.alpha)
    utility_epsilon = args.utility_epsilon or args.epsilon
    utility = utility_threshold(args.gamma, utility_epsilon, args.te)
    chebyshev = chebyshev_thresholds(args.gamma, utility_epsilon, args.te)
    if args.json:
        print(
            json.dumps(
                {
                    "mechanism": "decoy",
                    "gamma": args.gamma,
                    "privacy": {
                        "epsilon": args.epsilon,
                        "alpha": args.alpha,
                        "T_P": privacy.threshold,
                        "worst_count": privacy.worst_count,
                        "deviation_probability": {
                            str(f): p for f, p in enumerate(privacy.curve, start=1)
                        },
                    },
                    "utility": {
                        "epsilon": utility_epsilon,
                        "T_E": args.te,
                        "T_f": utility.threshold,
                        "checked_exactly_up_to": utility.checked_up_to,
                        "chebyshev_T_f_paper": chebyshev["paper"],
                        "chebyshev_T_f_corrected": chebyshev["corrected"],
                    },
                },
                indent=2,
            )
        )
        return 0
    percent = f"{args.epsilon:.0%}"
    print(f"Decoy groups, γ = {args.gamma}; published count of a value f ~ Binomial(γf, 1/γ)")
    print(
        f"Small-sum privacy (ε = {args.epsilon}, α = {args.alpha}): "
        f"T_P = {privacy.threshold:.4f}, reached at f = {privacy.worst_count}"
    )
    print(
        f"  any value with true count 1..{args.alpha} is published off by more than "
        f"{percent} with probability ≥ {privacy.threshold:.4f}"
    )
    print(f"Large-sum utility (ε = {utility_epsilon}, T_E = {args.te}): T_f = {utility.threshold}")
    print(
        f"  any value with true count ≥ {utility.threshold} is published within "
        f"±{utility_epsilon:.0%} with probability ≥ {1 - args.te:g}"
    )
    print(
        f"  (the papers' Chebyshev formula claims T_f = {chebyshev['paper']:.1f}, which is "
        f"wrong; corrected Chebyshev gives {chebyshev['corrected']:.0f}, which is loose)"
    )
    return 0


def command_schema(args: argparse.Namespace) -> int:
    with _input(args.input) as stream:
        raw = read_rows(stream)
    schema = Schema.scan(
        raw.header, raw.rows, _columns(args.quasi), _columns(args.sensitive), _bins(args.bin)
    )
    _write_atomically(args.output, lambda s: s.write(schema.to_toml()))
    sizes = ", ".join(f"{a.name} ({a.size})" for a in schema.attributes)
    _log(f"splu schema: wrote {args.output}: {sizes}")
    return 0


def command_sample(args: argparse.Namespace) -> int:
    with open_sample() as sample:
        text = sample.read()
    _write_atomically(args.output, lambda s: s.write(text))
    _log(f"splu sample: wrote the UCI Adult sample (45,222 records) to {args.output}")
    return 0


DEMO_QUASI = ["age", "sex", "race", "marital_status", "education"]
DEMO_SENSITIVE = "occupation"
DEMO_LARGE = [
    ({"sex": "Male"}, "Craft-repair"),
    ({"sex": "Female"}, "Adm-clerical"),
    ({"education": "Bachelors"}, "Prof-specialty"),
    ({"marital_status": "Married-civ-spouse"}, "Exec-managerial"),
    ({"race": "White", "sex": "Female"}, "Other-service"),
]


def command_demo(args: argparse.Namespace) -> int:
    gamma = args.gamma
    print(
        f"splu demo: decoy groups (γ={gamma}) over the bundled UCI Adult sample, "
        f"sensitive = {DEMO_SENSITIVE}, public = {', '.join(DEMO_QUASI)}"
    )
    with open_sample() as stream:
        table, rejections = read_table(stream, quasi=DEMO_QUASI, sensitive=[DEMO_SENSITIVE])
    key, ids = _key_and_ids(args.seed, len(table))
    started = time.perf_counter()
    release = DecoyGroups(gamma).publish(table, ids, key)
    print(
        f"published {len(release.published):,} of {len(table) + len(rejections):,} records "
        f"in {time.perf_counter() - started:.2f} s ({len(release.trimmed_lines)} trimmed to a "
        f"multiple of γ)"
    )
    truth = PublishedCells.from_table(table)
    published = PublishedCells.from_table(release.published)
    reconstruction = DecoyReconstruction(published, gamma, [DEMO_SENSITIVE])
    exact = DecoyReconstruction(truth, gamma, [DEMO_SENSITIVE])
    queries = [
        Query({c: (v,) for c, v in where.items()}, {DEMO_SENSITIVE: s}) for where, s in DEMO_LARGE
    ] + _small_count_queries(truth, count=5)
    true_counts = [e.published for e in exact.estimate_many(queries)]
    texts = [
        " ∧ ".join(
            [
                *(f"{c}={v[0]}" for c, v in q.where.items()),
                f"{DEMO_SENSITIVE}={q.value[DEMO_SENSITIVE]}",
            ]
        )
        for q in queries
    ]
    width = max(map(len, texts))
    print(f"\n{'count of':{width}} {'true':>6} {'estimate':>9} {'rel.err':>8}")
    errors: dict[bool, list[float]] = {True: [], False: []}
    estimates = reconstruction.estimate_many(queries)
    for text, estimate, true in zip(texts, estimates, true_counts, strict=True):
        error = abs(estimate.estimate - true) / true
        errors[true > 10].append(error)
        print(f"{text:{width}} {true:6,} {estimate.estimate:9,.0f} {error:8.0%}")
    privacy = privacy_threshold(gamma, 0.3, 10)
    print(
        f"\nlarge counts: mean relative error {np.mean(errors[True]):.0%}; "
        f"small counts (1-10): {np.mean(errors[False]):.0%}"
    )
    print(
        f"guarantee: a value held by 1-10 people is published off by more than 30% "
        f"with probability ≥ {privacy.threshold:.2f}"
    )
    return 0


def _small_count_queries(truth: PublishedCells, count: int) -> list[Query]:
    """Deterministic conjunctive queries whose true count is between 1 and 10."""
    positions = [truth.columns.index(c) for c in ("sex", "race", "education", DEMO_SENSITIVE)]
    keys = np.unique(truth.cells[:, positions], axis=0)
    chosen = []
    for key in keys:
        where = {c: (truth.domains[c][key[i]],) for i, c in enumerate(("sex", "race", "education"))}
        value = {DEMO_SENSITIVE: truth.domains[DEMO_SENSITIVE][key[3]]}
        chosen.append(Query(where, value))
    exact = DecoyReconstruction(truth, 2, [DEMO_SENSITIVE]).estimate_many(chosen)
    small = [q for q, e in zip(chosen, exact, strict=True) if 1 <= e.published <= 10]
    step = max(len(small) // count, 1)
    return small[::step][:count]


def _add_mechanism_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        default="decoy",
        help="privacy mechanism (default decoy: SPLU-Gen decoy groups)",
    )
    parser.add_argument("--gamma", type=int, default=5, help=GAMMA_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splu",
        description=(
            "SPLU Stream: publish survey responses so that large counts stay accurate and "
            "small counts stay private. Public attributes are published as they are; "
            "sensitive ones are randomized within hidden decoy groups."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formatter = argparse.RawDescriptionHelpFormatter

    demo = commands.add_parser(
        "demo",
        formatter_class=formatter,
        help="run the main job on the bundled sample and compare counts with the truth",
        description="Publish the bundled UCI Adult sample with decoy groups and show how "
        "large counts come back accurately while small counts do not.",
    )
    demo.add_argument("--gamma", type=int, default=5, help=GAMMA_HELP)
    demo.add_argument("--seed", type=int, help="reproducible run (default: a fresh key)")
    demo.set_defaults(run=command_demo)

    publish = commands.add_parser(
        "publish",
        formatter_class=formatter,
        help="publish a CSV once (batch), with the same mechanism code the stream uses",
        description=(
            "Publish IN.csv as OUT.csv: public columns unchanged, each sensitive column\n"
            "grouped and randomized independently, rows in random order, no ids.\n\n"
            "Rows that break the schema are rejected and listed; values above 1/γ of the\n"
            "data are cut to their share (suppressed) and N is trimmed to a multiple of γ.\n"
            "Nothing is dropped without being counted.\n\n"
            "example:\n"
            "  splu publish --input adult.csv --output published.csv --mechanism decoy \\\n"
            "      --gamma 5 --sensitive occupation --quasi age,sex,race,marital_status,education"
        ),
    )
    publish.add_argument("--input", required=True, help="CSV with a header line (.gz or - ok)")
    publish.add_argument("--output", required=True, help="published CSV (- for stdout)")
    _add_mechanism_options(publish)
    publish.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="sensitive column(s) to randomize; repeat or comma-separate",
    )
    publish.add_argument(
        "--quasi",
        action="append",
        metavar="COL,COL",
        help="public columns to publish unchanged; other columns are dropped",
    )
    publish.add_argument(
        "--bin",
        action="append",
        metavar="COL=SPEC",
        help="bin a numeric column: COL=WIDTH or COL=EDGE,EDGE,... "
        "(half-open bins [a,b); the label is published)",
    )
    publish.add_argument(
        "--schema",
        help="TOML file with a [schema] table instead of --quasi/--sensitive (see `splu schema`)",
    )
    publish.add_argument(
        "--grouping",
        choices=GROUPINGS,
        default="size-weighted",
        help="cutting rule: size-weighted keyed choice (default) or anatomy "
        "(largest buckets first; biases conjunctive counts, for comparison)",
    )
    publish.add_argument(
        "--seed",
        type=int,
        help="derive the key and ids from this seed so the publication can be "
        "repeated exactly; anyone with the seed can too, so experiments "
        "only (default: a fresh random key)",
    )
    publish.add_argument(
        "--report",
        metavar="FILE.json",
        help="write the full accounting: rejected rows with reasons, "
        "suppressed counts per value, trimmed lines",
    )
    publish.set_defaults(run=command_publish)

    query = commands.add_parser(
        "query",
        formatter_class=formatter,
        help="answer count queries (JSONL) from a published CSV",
        description=(
            'Each input line is {"where": {"col": "val", ...}, "value": {"sacol": "val"}};\n'
            "a where value may also be a list (any of). Each output line is the same object\n"
            'plus "estimate" and, for the closed form, a confidence interval "low"/"high".\n\n'
            "Large counts come back accurately; small counts deliberately do not.\n\n"
            "example:\n"
            '  echo \'{"where": {"sex": "Female"}, "value": {"occupation": "Sales"}}\' > q.jsonl\n'
            "  splu query --published published.csv --mechanism decoy --gamma 5 \\\n"
            "      --sensitive occupation --queries q.jsonl --output answers.jsonl"
        ),
    )
    query.add_argument("--published", required=True, help="CSV written by `splu publish`")
    _add_mechanism_options(query)
    query.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="the randomized column(s) of the published file",
    )
    query.add_argument("--queries", required=True, help="JSONL file of queries (- for stdin)")
    query.add_argument("--output", required=True, help="JSONL answers (- for stdout)")
    query.add_argument(
        "--method",
        choices=METHODS,
        default="closed",
        help="closed form (default) or the papers' iterative Bayesian method",
    )
    query.add_argument(
        "--matrix",
        choices=MATRICES,
        default="corrected",
        help="transition entry t=(γ−1)f/(γ(N−f)) (default) or the papers' f/N, "
        "which biases conjunctive counts low",
    )
    query.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="iterative method: stop when no state count moves more than this",
    )
    query.add_argument(
        "--max-iterations", type=int, default=10_000, help="iterative method: iteration cap"
    )
    query.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="coverage of the [low, high] interval (default 0.95)",
    )
    query.set_defaults(run=command_query)

    guarantees = commands.add_parser(
        "guarantees",
        formatter_class=formatter,
        help="exact small-sum privacy T_P and large-sum utility T_f for a γ",
        description=(
            "Exact binomial tails of f′ ~ Binomial(γf, 1/γ):\n"
            "  T_P(ε, α) = min over f = 1..α of P(|f′ − f| > εf)  (privacy of small counts)\n"
            "  T_f       = smallest f with P(|f′ − f| ≥ εf) ≤ T_E for every larger f (utility)"
        ),
    )
    _add_mechanism_options(guarantees)
    guarantees.add_argument(
        "--epsilon", type=float, default=0.3, help="relative error ε (default 0.3)"
    )
    guarantees.add_argument(
        "--alpha", type=int, default=10, help="largest count that must stay private (default 10)"
    )
    guarantees.add_argument(
        "--te",
        type=float,
        default=0.02,
        help="utility: tolerated probability T_E of an error ≥ ε (default 0.02)",
    )
    guarantees.add_argument(
        "--utility-epsilon",
        type=float,
        help="relative error for the utility threshold (default: --epsilon)",
    )
    guarantees.add_argument("--json", action="store_true", help="machine-readable output")
    guarantees.set_defaults(run=command_guarantees)

    schema = commands.add_parser(
        "schema",
        formatter_class=formatter,
        help="scan a CSV and write its schema (domains, bins) as TOML",
        description="Write a [schema] table for the named columns, with every value seen in "
        "the input as the domain. Edit it, then pass it to --schema.",
    )
    schema.add_argument("--input", required=True, help="CSV with a header line")
    schema.add_argument("--sensitive", action="append", metavar="COL", required=True)
    schema.add_argument("--quasi", action="append", metavar="COL,COL")
    schema.add_argument(
        "--bin", action="append", metavar="COL=SPEC", help="COL=WIDTH or COL=EDGE,EDGE,..."
    )
    schema.add_argument("--output", required=True, help="TOML file to write")
    schema.set_defaults(run=command_schema)

    sample = commands.add_parser(
        "sample",
        help="write the bundled UCI Adult sample (45,222 records) as CSV",
    )
    sample.add_argument("--output", default="adult.csv", help="where to write (default adult.csv)")
    sample.set_defaults(run=command_sample)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (CommandError, SchemaError, QueryError, ValueError) as err:
        print(f"splu {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"splu {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
