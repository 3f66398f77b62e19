"""`splu up`: the embedded broker and Redis server in the foreground, for the stream commands.

Prints the ``export KAFKA_BOOTSTRAP=… REDIS_URL=…`` lines the other terminals need
(`splu worker`, `splu produce`, `splu consumer` read them), then waits. Ctrl-C or
SIGTERM stops both servers and every process they started. With ``--data-dir`` Redis
keeps its append-only file there, so the buffers, fingerprints and counts survive a
restart; the broker keeps its messages in memory only, so a restart starts with empty
topics (the commands create them again).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from deploy.embedded import KAFKA_BOOTSTRAP_ENV, REDIS_URL_ENV, EmbeddedServers


def run_up(data_dir: Path | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM."""
    # `up` starts its own servers even where the variables name others.
    for name in (KAFKA_BOOTSTRAP_ENV, REDIS_URL_ENV):
        os.environ.pop(name, None)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        with EmbeddedServers(data_dir) as servers:
            print(f"export {KAFKA_BOOTSTRAP_ENV}={servers.kafka_bootstrap}")
            print(f"export {REDIS_URL_ENV}={servers.redis_url}", flush=True)
            kept = f"Redis keeps its data in {data_dir / 'redis'}" if data_dir else "no data kept"
            print(
                "splu up: the embedded broker and Redis are running; paste the two lines above "
                f"into the terminals of the stream commands. {kept}. Ctrl-C stops both.",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("splu up: stopped the broker and Redis", file=sys.stderr)
    return 0
