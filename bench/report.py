"""Output helpers shared by the benchmarks: progress on stderr, aligned tables on stdout."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """Progress goes to stderr so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Left-align the first column, right-align the figures."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def render(row: list[str]) -> str:
        first, *rest = row
        return " | ".join(
            [first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))]
        )

    print(render(header))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(render(row))
