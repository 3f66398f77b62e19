"""`splu consumer`: the stream's consumer and its web pages."""

from __future__ import annotations

import tempfile
from pathlib import Path

from service.core.config import StreamConfig
from streams.consumer.app import create_consumer_app
from streams.runtime.manifest import check_manifest
from streams.runtime.process import StreamWorker, ensure_ready
from streams.runtime.topics import run_in_thread


def run_consumer(config: StreamConfig, host: str, port: int, loglevel: str = "warning") -> None:
    """Run the stream's consumer and its web pages until it is stopped."""
    ensure_ready(config, "consumer")
    run_in_thread(check_manifest(config))
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-consumer-") as datadir:
        app = create_consumer_app(config, Path(datadir), host, port)
        StreamWorker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
