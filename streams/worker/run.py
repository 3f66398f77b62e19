"""`splu worker`: one worker process, owning some of the stream's partitions."""

from __future__ import annotations

import tempfile
from pathlib import Path

from service.core.config import StreamConfig
from streams.runtime.manifest import claim_manifest
from streams.runtime.process import StreamWorker, ensure_ready
from streams.runtime.topics import run_in_thread
from streams.worker.app import create_app
from streams.worker.windowed import create_windowed_app


def run_worker(
    config: StreamConfig,
    loglevel: str = "warning",
    host: str = "127.0.0.1",
    port: int | None = None,
) -> None:
    """Run one worker until it is stopped (SIGTERM or Ctrl-C); it owns some partitions.
    With a port it serves /healthz, /readyz and /metrics there."""
    key = config.service_key()
    ensure_ready(config, "worker")
    # Before the app starts: a refused worker has consumed and published nothing.
    run_in_thread(claim_manifest(config))
    # Faust wants a data directory even with in-memory tables; nothing in it outlives us.
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-") as datadir:
        build = create_windowed_app if config.windowed is not None else create_app
        app = build(config, key, Path(datadir), web=None if port is None else (host, port))
        StreamWorker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
