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
from service.core.config import REDIS_CLUSTER_ENV


def run_up(data_dir: Path | None = None, redis_cluster: int = 0) -> int:
    """Serve until Ctrl-C or SIGTERM; with `redis_cluster` masters, a Redis Cluster."""
    # `up` starts its own servers even where the variables name others.
    for name in (KAFKA_BOOTSTRAP_ENV, REDIS_URL_ENV, REDIS_CLUSTER_ENV):
        os.environ.pop(name, None)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        with EmbeddedServers(data_dir, redis_cluster=redis_cluster) as servers:
            lines = [
                f"export {KAFKA_BOOTSTRAP_ENV}={servers.kafka_bootstrap}",
                f"export {REDIS_URL_ENV}={servers.redis_url}",
            ]
            if redis_cluster:
                lines.append(f"export {REDIS_CLUSTER_ENV}=1")
            print("\n".join(lines), flush=True)
            kept = f"Redis keeps its data in {data_dir / 'redis'}" if data_dir else "no data kept"
            what = f"a Redis Cluster of {redis_cluster} masters" if redis_cluster else "Redis"
            print(
                f"splu up: the embedded broker and {what} are running; paste the "
                f"{len(lines)} lines above into the terminals of the stream commands. {kept}. "
                "Ctrl-C stops everything.",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("splu up: stopped the broker and Redis", file=sys.stderr)
    return 0
