"""Output helpers shared by the benchmarks: progress on stderr, aligned tables on stdout."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROGRESS_EVERY = 5.0  # seconds between progress lines when stderr is not a terminal
# Random query draws allowed per query wanted, so an impossible filter fails instead of spinning.
DRAW_LIMIT = 1000


def log(message: str) -> None:
    """Progress goes to stderr so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


_shown = [0.0]  # when the last progress line was written (off a terminal)


def status(text: str, last: bool = False) -> None:
    """A progress line: redrawn in place on a terminal, else one every PROGRESS_EVERY s."""
    if sys.stderr.isatty():
        print(f"\r  {text}", end="\n" if last else "", file=sys.stderr, flush=True)
    elif last or time.monotonic() - _shown[0] >= PROGRESS_EVERY:
        _shown[0] = time.monotonic()
        log(f"  {text}")


def log_tail(path: Path, lines: int = 20) -> str:
    """The last lines of a process's log, for an error message."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


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


@dataclass(frozen=True)
class Result:
    """One line of the summary; a result without a target is shown for context only."""

    metric: str
    value: float
    unit: str
    spec: str = ",.0f"
    target: float | None = None
    at_least: bool = False  # the target is a floor (≥) rather than a ceiling (≤)

    def met(self) -> bool:
        assert self.target is not None
        return self.value >= self.target if self.at_least else self.value <= self.target

    def cells(self) -> list[str]:
        measured = f"{self.value:{self.spec}} {self.unit}".rstrip()
        if self.target is None:
            return [self.metric, measured, "—", "—", "—"]
        bound = "≥" if self.at_least else "≤"
        return [
            self.metric,
            measured,
            f"{bound} {self.target:{self.spec}} {self.unit}".rstrip(),
            f"{self.value / self.target:.2f}",
            "yes" if self.met() else "NO",
        ]
