"""`splu schema` and `splu sample`: a CSV's schema, and the bundled sample data."""

from __future__ import annotations

import argparse

from service.cli.commands.common import (
    FORMATTER,
    Commands,
    add_delimiter_option,
    column_names,
    parse_bins,
    write_atomically,
)
from service.core.publication import log, open_input
from service.core.schema import Schema
from service.core.table import open_sample, read_rows


def command_schema(args: argparse.Namespace) -> int:
    with open_input(args.input) as stream:
        raw = read_rows(stream, args.delimiter)
    schema = Schema.scan(
        raw.header,
        raw.rows,
        column_names(args.quasi),
        column_names(args.sensitive),
        parse_bins(args.bin),
    )
    write_atomically(args.output, lambda s: s.write(schema.to_toml()))
    sizes = ", ".join(f"{a.name} ({a.size})" for a in schema.attributes)
    log(f"splu schema: wrote {args.output}: {sizes}")
    return 0


def command_sample(args: argparse.Namespace) -> int:
    with open_sample() as sample:
        text = sample.read()
    write_atomically(args.output, lambda s: s.write(text))
    log(f"splu sample: wrote the UCI Adult sample (45,222 records) to {args.output}")
    return 0


def register(commands: Commands) -> None:
    """Add `splu schema` and `splu sample`."""
    schema = commands.add_parser(
        "schema",
        formatter_class=FORMATTER,
        help="scan a CSV and write its schema (domains, bins) as TOML",
        description="Write a [schema] table for the named columns, with every value seen in "
        "the input as the domain. Edit it, then pass it to --schema.",
    )
    schema.add_argument("--input", required=True, help="CSV with a header line")
    add_delimiter_option(schema)
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
