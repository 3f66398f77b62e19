"""Running the worker and the consumer: `splu worker` and `splu consumer`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import faust

from service.config import StreamConfig
from streams.app import create_app
from streams.consumer import create_consumer_app
from streams.topics import create_topics_sync
from streams.windowed import create_windowed_app


def ensure_topics(config: StreamConfig) -> None:
    """Create the stream's four topics with its partition count, if missing."""
    create_topics_sync(config.kafka_bootstrap, config.topic_partitions)


def run_worker(config: StreamConfig, loglevel: str = "warning") -> None:
    """Run one worker until it is stopped (SIGTERM or Ctrl-C); it owns some partitions."""
    key = config.service_key()
    ensure_topics(config)
    # Faust wants a data directory even with in-memory tables; nothing in it outlives us.
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-") as datadir:
        build = create_windowed_app if config.mechanism == "windowed" else create_app
        app = build(config, key, Path(datadir))
        faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


def run_consumer(config: StreamConfig, host: str, port: int, loglevel: str = "warning") -> None:
    """Run the stream's consumer and its web pages until it is stopped."""
    ensure_topics(config)
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-consumer-") as datadir:
        app = create_consumer_app(config, Path(datadir), host, port)
        faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
