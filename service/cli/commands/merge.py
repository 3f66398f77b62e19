"""`splu merge`: the merge map of public values for personal groups (χ² test)."""

from __future__ import annotations

import argparse
import json
import math

from service.cli.commands.common import (
    FORMATTER,
    CommandError,
    Commands,
    add_table_options,
    column_names,
    read_input_table,
    report_rejections,
    write_atomically,
)
from service.core.merge import fit_value_map
from service.core.publication import log


def command_merge(args: argparse.Namespace) -> int:
    sensitive = column_names(args.sensitive)
    if len(sensitive) != 1:
        raise CommandError("merge public values against exactly one --sensitive column")
    table, rejections = read_input_table(args)
    report_rejections(rejections)
    value_map = fit_value_map(table, sensitive[0], args.alpha)
    write_atomically(args.output, lambda s: s.write(value_map.to_toml()))
    counts = value_map.class_counts()
    before = math.prod(v for v, _ in counts.values())
    after = math.prod(c for _, c in counts.values())
    if args.json:
        print(json.dumps({
            "sensitive": sensitive[0],
            "alpha": args.alpha,
            "attributes": {n: {"values": v, "merged": c} for n, (v, c) in counts.items()},
            "possible_groups": {"before": before, "after": after},
            "classes": {n: [list(c) for c in cs] for n, cs in value_map.classes.items()},
        }, indent=2))  # fmt: skip
    else:
        for name, classes in value_map.classes.items():
            print(f"{name}: {counts[name][0]} values → {counts[name][1]}")
            for members in classes:
                if len(members) > 1:
                    print(f"    merged: {', '.join(members)}")
        print(f"possible personal groups: {before:,} → {after:,}")
    log(f"splu merge: wrote {args.output}")
    return 0


def register(commands: Commands) -> None:
    """Add `splu merge`."""
    merge = commands.add_parser(
        "merge", formatter_class=FORMATTER,
        help="merge public values with the same effect on a sensitive column (χ² test)",
        description=(
            "For each public column, join values whose sensitive-value counts a χ²\n"
            "two-sample test (α = 0.05, df = values with data) cannot tell apart, by\n"
            "connected components, and write the classes as a merge map for personal\n"
            "groups. Without it an adversary could pool groups that differ only in an\n"
            "irrelevant attribute and reconstruct more accurately than each allows."
        ),
    )  # fmt: skip
    add_table_options(merge, schema=False)
    merge.add_argument("--alpha", type=float, default=0.05, help="test level (default 0.05)")
    merge.add_argument("--output", required=True, help="merge map (TOML) to write")
    merge.add_argument("--json", action="store_true", help="machine-readable output")
    merge.set_defaults(run=command_merge)
