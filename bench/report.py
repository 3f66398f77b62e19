"""Output helpers shared by the benchmarks: progress on stderr, aligned tables on stdout."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

# Random query draws allowed per query wanted, so an impossible filter fails instead of spinning.
DRAW_LIMIT = 1000


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


def median_seconds(run: Callable[[], object], repeats: int, label: str) -> float:
    """Median wall time of `repeats` calls, each one logged as it finishes."""
    times = []
    for attempt in range(1, repeats + 1):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
        log(f"  {label}: run {attempt}/{repeats}: {times[-1]:.3f} s")
    return statistics.median(times)
