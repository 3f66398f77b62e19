"""`splu publish`: a CSV published once (batch), with the code the stream runs."""

from __future__ import annotations

import argparse
import time

from service.cli.commands.common import (
    FORMATTER,
    CommandError,
    Commands,
    add_mechanism_options,
    add_table_options,
    key_and_ids,
    mechanism_settings,
    read_input_table,
    report_rejections,
    write_atomically,
    write_json,
)
from service.core.batch_files import (
    MERGE_SUFFIX,
    PARAMS_SUFFIX,
    beside,
    check_reserved,
    write_batch,
)
from service.core.mechanisms.registry import MECHANISMS
from service.core.publication import log
from service.core.table import write_table


def command_publish(args: argparse.Namespace) -> int:
    spec = MECHANISMS[args.mechanism]
    if spec.publish is None:
        raise CommandError(
            "--mechanism laplace publishes nothing: it answers queries from the raw data with "
            "noise, on the trusted side; run `splu query --mechanism laplace --input IN.csv "
            "--epsilon E --sensitive COL --quasi ... --queries Q.jsonl --output R.jsonl`"
        )
    started = time.perf_counter()
    settings = mechanism_settings(args)
    batch_only = spec.batch_only
    if batch_only and args.output == "-":
        raise CommandError(
            f"--output -: --mechanism {args.mechanism} writes OUT.{PARAMS_SUFFIX} beside "
            "OUT.csv (see --help), so give a file name"
        )
    fits_map = "merge_map" in spec.options and not settings["merge_map"]
    if fits_map and args.output == "-":
        raise CommandError(
            f"--output -: without --merge-map, --mechanism personal writes the merge map it "
            f"fits on the input beside OUT.csv (OUT.{MERGE_SUFFIX}), so give a file name or "
            "--merge-map"
        )
    table, rejections = read_input_table(args)
    rows_read = len(table) + len(rejections)
    log(f"splu publish: read {rows_read:,} rows from {args.input}")
    report_rejections(rejections)
    if batch_only:
        check_reserved(table, args.mechanism)
    key, ids = key_and_ids(args.seed, len(table))
    if batch_only:
        batch = spec.publish(settings, table, ids, key)
        files = write_batch(args.output, args.mechanism, settings, table, batch)
        rows, details = len(batch.columns[0]), {**batch.details, "files": files}
        shown = f" (and {', '.join(files[1:])})"
    else:
        published, details = spec.publish(settings, table, ids, key)
        value_map = details.pop("value_map", None)
        shown = ""
        if fits_map:
            # `splu query` reads it back: the reconstruction needs the groups that were used.
            fitted = beside(args.output, MERGE_SUFFIX)
            write_atomically(fitted, lambda s: s.write(value_map.to_toml()))
            shown = f" (and the merge map fitted on the input, {fitted})"
        write_atomically(args.output, lambda s: write_table(published, s))
        rows = len(published)
    if args.report:
        write_json(args.report, {
            "mechanism": args.mechanism,
            "input_rows": rows_read,
            "published_rows": rows,
            "rejected": [
                {"line": r.record, "field": r.field, "reason": r.reason} for r in rejections
            ],
            **details,
        })  # fmt: skip
    log(
        f"  published {rows:,} rows to {args.output}{shown} "
        f"in {time.perf_counter() - started:.2f} s"
    )
    return 0


def register(commands: Commands) -> None:
    """Add `splu publish`."""
    publish = commands.add_parser(
        "publish", formatter_class=FORMATTER,
        help="publish a CSV once (batch), with the same mechanism code the stream uses",
        description=(
            "Publish IN.csv as OUT.csv: public columns unchanged, sensitive columns\n"
            "randomized, rows in random order, no ids. Nothing is dropped without being\n"
            "counted: rows that break the schema are rejected and listed; decoy groups cut\n"
            "values above 1/γ of the data to their share and trim N to a multiple of γ.\n\n"
            "examples:\n"
            "  splu publish --input adult.csv --output published.csv --mechanism decoy \\\n"
            "      --gamma 5 --sensitive occupation --quasi age,sex,race,marital_status,education\n"
            "  splu merge --input adult.csv --sensitive income \\\n"
            "      --quasi education,occupation,race,sex --output merge.toml\n"
            "  splu publish --input adult.csv --output published.csv --mechanism personal \\\n"
            "      --retention 0.5 --lambda 0.3 --delta 0.3 --merge-map merge.toml \\\n"
            "      --sensitive income --quasi education,occupation,race,sex\n"
            "  splu publish --input adult.csv --output sdr.csv --mechanism sdr \\\n"
            "      --rho1 1/13 --rho2 1/6 --sensitive occupation --quasi age,sex,race\n"
            "  splu publish --input adult.csv --output buckets.csv --mechanism fprivacy \\\n"
            "      --theta 8 --beta 0.02 --max-size 50 --sensitive occupation --quasi age,sex\n\n"
            "files beside OUT.csv (batch-only mechanisms: sdr, fprivacy, anatomy, dbr, global):\n"
            "OUT is the --output name without .csv; `splu query` reads them back and checks\n"
            "that they belong together.\n"
            "  OUT.params.json  every one: mechanism, options, columns, the sensitive\n"
            "                   domain, sdr's SA_i, |T_i| and γ_i per sub-table, checksums\n"
            "  OUT.st.csv       anatomy, fprivacy: the sensitive table ST, columns\n"
            "                   group|bucket, the sensitive column, count\n"
            "OUT.csv holds the --quasi columns, then the --sensitive ones, except:\n"
            "  sdr        ... plus subtable: each row's sub-table (public, as in the paper)\n"
            "  anatomy    the QIT: --quasi columns plus group; the values are in OUT.st.csv\n"
            "  fprivacy   the QIT: --quasi columns plus bucket; the values are in OUT.st.csv\n"
            "Rows come in the mechanism's keyed random order. No file holds ids, source\n"
            "lines, true values or thresholds fitted on the data: those are in --report,\n"
            "which stays on the trusted side."
        ),
    )  # fmt: skip
    add_table_options(publish)
    publish.add_argument("--output", required=True, help="published CSV (- for stdout)")
    add_mechanism_options(publish, reconstruction=False)
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
        "suppressed and trimmed rows, per-mechanism figures",
    )
    publish.set_defaults(run=command_publish)
