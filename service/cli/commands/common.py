"""What the batch commands share: reading the input table, writing outputs whole, the
mechanism options and their help, and the error they report."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeAlias

import numpy as np

from service.core.mechanisms.decoy import GROUPINGS
from service.core.mechanisms.decoy_reconstruction import MATRICES, METHODS
from service.core.mechanisms.fprivacy import METHODS as BUCKET_METHODS
from service.core.mechanisms.personal import STREAM_BUDGETS
from service.core.mechanisms.registry import (
    ALL_OPTIONS,
    DEFAULT_MECHANISM,
    MECHANISMS,
    checked_settings,
)
from service.core.prf import ServiceKey, random_ids
from service.core.publication import SHOWN, flag_of, log, open_input
from service.core.schema import Rejection, Schema
from service.core.table import Table, read_table

# What each command module's `register` adds its parser to.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
FORMATTER = argparse.RawDescriptionHelpFormatter

GAMMA_HELP = (
    "decoy: group size γ ≥ 2 (default 5). Each record publishes a value drawn "
    "uniformly from the γ distinct values of its hidden group, so no output can "
    "tell which of γ values a person had. A value with true count f is published "
    "as Binomial(γf, 1/γ): small counts get relative noise ≈ √((γ−1)/(γf)), large "
    "counts stay accurate. The papers recommend γ ≥ 5."
)
GAMMA_BASELINES_HELP = (
    " anatomy: ℓ = γ distinct sensitive values per group (default 5; the papers compare "
    "Anatomy at ℓ = γ). global: keep the value with probability 1/γ, else publish one of "
    "the other m − 1 values uniformly (default 5; needs m > γ)."
)
RETENTION_HELP = (
    "personal: retention probability p in (0, 1) (default 0.5): a record keeps its "
    "value with probability p, else gets a uniform draw from all m values"
)
LAMBDA_HELP = (
    "personal: relative error λ (default 0.3) and bound δ (default 0.3): no one can "
    "prove a personal group's reconstruction is within λ with probability above 1 − δ"
)
DELTA_HELP = (
    "personal: δ in (0, 1), see --lambda (default 0.3). sdr: the error bound PP "
    "minimizes holds with confidence 1 − δ (default 0.05); it scales the reported bound "
    "and never changes the partition"
)
BUDGET_HELP = (
    "personal: trials allowed per group: adaptive (its true largest frequency, default), "
    "conservative (frequency 1, safe under drift), none (plain perturbation, for comparison); "
    "query also takes bounded, a stream's default (an upper confidence bound on the frequency)"
)
RHO_HELP = (
    "sdr: restricted (ρ1, ρ2)-privacy, 0 < ρ1 < ρ2 < 1 (default 1/13 and 1/6, the paper's "
    "setting on occupation): a value with relative frequency ≤ ρ1 is never inferred with "
    "posterior above ρ2; more frequent values are not protected. Decimals or ratios (1/13)"
)


def delimiter_argument(text: str) -> str:
    """--delimiter as given: one ASCII character other than a quote or a line break, or
    the word tab."""
    chosen = "\t" if text in ("tab", "\\t") else text
    if len(chosen) != 1 or not chosen.isascii() or chosen in '"\r\n':
        raise argparse.ArgumentTypeError(f"give one character, or tab; got {text!r}")
    return chosen


def add_delimiter_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--delimiter", type=delimiter_argument, metavar="CHAR",
        help="the CSV's field delimiter, e.g. ';' or tab (default: the one of , ; tab | "
        "found in its header line)",
    )  # fmt: skip


class CommandError(Exception):
    """A mistake in a command's arguments, reported as one clear line like a
    `PublicationError`, with nothing half-written."""


def column_names(values: Sequence[str] | None) -> list[str]:
    """Flags that may be repeated or comma-separated: --quasi a,b --quasi c."""
    return [c.strip() for v in values or () for c in v.split(",") if c.strip()]


def parse_bins(values: Sequence[str] | None) -> dict[str, float | list[float]]:
    """--bin COL=WIDTH or COL=EDGE,EDGE,... as {column: width or edges}."""
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


def write_atomically(path: str, write: Callable[[TextIO], None]) -> None:
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


def write_json(path: str, document: Any) -> None:
    write_atomically(path, lambda s: s.write(json.dumps(document, indent=2) + "\n"))


def mechanism_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options of --mechanism, checked, with defaults filled in; others given are an error."""
    chosen = args.mechanism
    spec = MECHANISMS[chosen]
    for option in ALL_OPTIONS:
        if option in spec.options or getattr(args, option, None) is None:
            continue
        owners = [m for m, other in MECHANISMS.items() if option in other.options]
        listed = ", ".join(owners[:-1]) + " or " + owners[-1] if len(owners) > 1 else owners[0]
        raise CommandError(f"{flag_of(option)} applies to --mechanism {listed}, not {chosen}")
    defaults = spec.defaults
    settings = {o: getattr(args, o, None) for o in spec.options}
    settings = {o: defaults[o] if v is None and o in defaults else v for o, v in settings.items()}
    return checked_settings(chosen, settings)


def read_input_table(args: argparse.Namespace) -> tuple[Table, list[Rejection]]:
    """--input by --schema or by --quasi/--sensitive/--bin, and the rows it rejected."""
    quasi, sensitive = column_names(args.quasi), column_names(args.sensitive)
    if getattr(args, "schema", None) and (quasi or sensitive or args.bin):
        raise CommandError("give either --schema or --quasi/--sensitive/--bin, not both")
    if not getattr(args, "schema", None) and not sensitive:
        raise CommandError("name the sensitive column(s) with --sensitive (or give --schema)")
    schema = Schema.load(args.schema) if getattr(args, "schema", None) else None
    with open_input(args.input) as stream:
        return read_table(
            stream, schema, quasi, sensitive, parse_bins(args.bin), delimiter=args.delimiter
        )


def report_rejections(rejections: Sequence[Rejection]) -> None:
    if not rejections:
        return
    log(f"  rejected {len(rejections):,} rows:")
    for r in rejections[:SHOWN]:
        field = f", field {r.field!r}" if r.field is not None else ""
        log(f"    line {r.record}{field}: {r.reason}")
    if len(rejections) > SHOWN:
        log(f"    ... and {len(rejections) - SHOWN:,} more (all listed by --report)")


def key_and_ids(seed: int | None, n: int) -> tuple[ServiceKey, np.ndarray]:
    """A fresh key and random ids, or both derived from --seed."""
    if seed is None:
        return ServiceKey.fresh(), random_ids(n)
    key = ServiceKey.from_seed(seed)
    return key, random_ids(n, key)


def add_table_options(parser: argparse.ArgumentParser, schema: bool = True) -> None:
    parser.add_argument("--input", required=True, help="CSV with a header line (.gz or - ok)")
    add_delimiter_option(parser)
    parser.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="sensitive column(s); repeat or comma-separate",
    )
    parser.add_argument(
        "--quasi",
        action="append",
        metavar="COL,COL",
        help="public columns; other columns are dropped",
    )
    parser.add_argument(
        "--bin",
        action="append",
        metavar="COL=SPEC",
        help="bin a numeric column: COL=WIDTH or COL=EDGE,EDGE,... "
        "(half-open bins [a,b); the label is published)",
    )
    if schema:
        parser.add_argument(
            "--schema",
            help="TOML file with a [schema] table instead of "
            "--quasi/--sensitive (see `splu schema`)",
        )


def add_threshold_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The thresholds of T_P(ε, α) and T_f (`splu guarantees`, `splu plan`)."""
    parser.add_argument(
        "--epsilon", type=float, default=0.3, help="relative error ε of T_P (default 0.3)"
    )
    parser.add_argument(
        "--alpha", type=int, default=10, help="largest count that must stay private (default 10)"
    )
    parser.add_argument(
        "--te",
        type=float,
        default=0.02,
        help="T_f: tolerated probability T_E of an error ≥ ε (default 0.02)",
    )
    parser.add_argument(
        "--utility-epsilon",
        type=float,
        help="relative error for T_f (default: --epsilon)",
    )


def add_mechanism_options(parser: argparse.ArgumentParser, reconstruction: bool) -> None:
    parser.add_argument(
        "--mechanism",
        choices=tuple(MECHANISMS),
        default=DEFAULT_MECHANISM,
        help="decoy (SPLU-Gen decoy groups, default), personal (personal groups with "
        "reconstruction privacy, SPS), or, in batch only: sdr (small domain randomization), "
        "fprivacy (F′-privacy bucketization), anatomy, dbr (distribution-based "
        "randomization), global (global randomization, mechanism A); laplace answers "
        "queries from the raw data (`splu query --input`, trusted side)",
    )
    decoy = parser.add_argument_group("decoy groups (--gamma also: anatomy, global)")
    decoy.add_argument("--gamma", type=int, help=GAMMA_HELP + GAMMA_BASELINES_HELP)
    personal = parser.add_argument_group("personal groups (--delta also: sdr)")
    personal.add_argument("--retention", type=float, help=RETENTION_HELP)
    personal.add_argument("--lambda", dest="lam", type=float, help=LAMBDA_HELP)
    personal.add_argument("--delta", type=float, help=DELTA_HELP)
    personal.add_argument("--budget", choices=STREAM_BUDGETS, help=BUDGET_HELP)
    personal.add_argument(
        "--merge-map",
        metavar="FILE",
        help="personal: merged public values from `splu merge`; without it publish "
        "fits one on its input and writes it beside OUT.csv as OUT.merge.toml, "
        "which query then reads (the groups must be the publication's)",
    )
    sdr = parser.add_argument_group(
        "small domain randomization (sdr)",
        "Partition the rows into sub-tables, perturb each within its own values SA_i\n"
        "with its own γ_i; --delta: confidence of the error bound (see above).",
    )
    sdr.add_argument("--rho1", metavar="R", help=RHO_HELP)
    sdr.add_argument("--rho2", metavar="R", help="sdr: see --rho1")
    fprivacy = parser.add_argument_group(
        "F′-privacy bucketization (fprivacy)",
        "Buckets in which each value x holds at most ⌊f′_x·|bucket|⌋ rows, published as\n"
        "QIT (public columns, bucket) and ST (bucket, value, count).",
    )
    fprivacy.add_argument(
        "--theta",
        metavar="X",
        help="fprivacy: thresholds f′_x = min(1, θ·f_x + β), f_x the value's share "
        "(default θ = 8, β = 0.02, the paper's); values with f′ = 1 are not protected",
    )
    fprivacy.add_argument("--beta", metavar="X", help="fprivacy: see --theta")
    fprivacy.add_argument(
        "--max-size",
        type=int,
        metavar="N",
        help="fprivacy: largest bucket M′ (default 50); a value needing more is suppressed",
    )
    fprivacy.add_argument(
        "--min-size",
        type=int,
        metavar="N",
        help="fprivacy: smallest bucket (default 1); 2 keeps rows of values with f′ = 1 "
        "out of buckets of one",
    )
    fprivacy.add_argument(
        "--bucket-method",
        choices=BUCKET_METHODS,
        help="fprivacy: bucket sizes by Algorithm 2 (multi, default) or the optimal "
        "two-size setting (two)",
    )
    fprivacy.add_argument(
        "--fake-values",
        type=int,
        metavar="N",
        help="fprivacy: σ fake values added to each bucket's ST (default 0); needs buckets "
        "of distinct values",
    )
    if reconstruction:
        personal.add_argument(
            "--stream",
            action="store_true",
            default=None,
            help="personal: the file is a stream's publication (`splu run --published-out`), "
            "whose groups spent their trials in arrival order: the interval models that "
            "(implied by --budget bounded and by --config; the estimate is the same)",
        )
        decoy.add_argument(
            "--grouping",
            choices=GROUPINGS,
            help="the cutting rule the publication was grouped by, which the mixing model "
            "follows: size-weighted (default, every stream's) or anatomy (`splu publish "
            "--grouping anatomy`)",
        )
        decoy.add_argument(
            "--method",
            choices=METHODS,
            help="closed form (default) or the papers' iterative Bayesian method (2×2 "
            "matrices only)",
        )
        decoy.add_argument(
            "--matrix",
            choices=MATRICES,
            help="mixing (default): how often the cutting rule groups each pair of values, "
            "m×m, from the published counts; or the papers' 2×2 model, with "
            "t=(γ−1)f/(γ(N−f)) (corrected) or f/N (paper), which assume every value mixes "
            "alike and bias conjunctive counts as N grows",
        )
        decoy.add_argument(
            "--tolerance",
            type=float,
            help="iterative method: stop when no state count moves more than this (default 0.01)",
        )
        decoy.add_argument(
            "--max-iterations", type=int, help="iterative method: iteration cap (default 10000)"
        )
    else:
        decoy.add_argument(
            "--grouping",
            choices=GROUPINGS,
            help="cutting rule: size-weighted keyed choice (default) or anatomy "
            "(largest buckets first; biases conjunctive counts, for "
            "comparison)",
        )
