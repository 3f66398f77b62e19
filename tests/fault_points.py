"""`splu` with a fault point, for the tests that crash a stream process on purpose.

    python tests/fault_points.py --exit-before-commit N [--topic T] -- <splu arguments>

runs `splu` (a worker or a consumer) whose bulk path ends the process right after its
Nth fetch was handled, before the fetch's offsets are committed: the window a crash of
the bulk path is most likely to hit. With a topic, only fetches holding records of that
topic count, so a personal stream's worker can be stopped between its two hops. The
fault is patched in at the bulk path's commit seam (`FetchConsumer.commit_fetch`), so the
production code carries none of it. Tests pass `command(...)` as the `splu` of
`spawn_worker` or `spawn_consumer`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

EXIT_FAULT = 70  # the exit status of a process that reached its fault point


def command(exit_before_commit: int, topic: str | None = None) -> list[str]:
    """The command that runs `splu` with this fault point, before `splu`'s own arguments."""
    topics = [] if topic is None else ["--topic", topic]
    options = ["--exit-before-commit", str(exit_before_commit), *topics, "--"]
    return [sys.executable, str(Path(__file__).resolve()), *options]


def install(exit_before_commit: int, topic: str | None) -> None:
    """Patch the fault point into the bulk path's commit."""
    from streams.runtime.bulk import BulkConsumer

    commit = BulkConsumer.commit_fetch
    remaining = exit_before_commit

    async def commit_or_exit(self: BulkConsumer, offsets: Mapping) -> None:
        nonlocal remaining
        if topic is None or any(tp.topic == topic for tp in offsets):
            remaining -= 1
            if remaining == 0:
                logging.getLogger("splu.bulk").critical("fault point: exiting before a commit")
                os._exit(EXIT_FAULT)
        await commit(self, offsets)

    BulkConsumer.commit_fetch = commit_or_exit  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exit-before-commit", type=int, required=True, metavar="N")
    parser.add_argument("--topic")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    install(args.exit_before_commit, args.topic)
    from streams.cli import main as splu

    return splu(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
