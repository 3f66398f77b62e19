"""Progress bars for long commands: tqdm on stderr, redrawn in place on a terminal and
silent when stderr is not one, so logs and pipes keep only the commands' own lines."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(
    total: int | None, description: str, unit: str, scale: bool = False, quiet: bool = False
) -> tqdm:
    """A bar counting `unit`s to `total` (None: a running count and rate), used as a
    context; `scale` shows large counts as 12.3k, `quiet` draws nothing anywhere."""
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=scale,
        file=sys.stderr,
        disable=quiet or not sys.stderr.isatty(),
        dynamic_ncols=True,
    )
