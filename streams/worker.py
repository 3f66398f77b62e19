"""Running the worker and the consumer: `splu worker` and `splu consumer`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import faust

from service.buffer import check_redis
from service.config import StreamConfig
from streams.app import create_app
from streams.consumer import create_consumer_app
from streams.topics import create_topics, run_in_thread
from streams.windowed import create_windowed_app


def ensure_ready(config: StreamConfig) -> None:
    """Create the stream's four topics with its partition count, if missing, and check that
    Redis answers the stream's user: errors here are one line, not a retry loop."""
    run_in_thread(create_topics(config.kafka_bootstrap, config.topic_partitions))
    run_in_thread(check_redis(config))


def run_worker(config: StreamConfig, loglevel: str = "warning") -> None:
    """Run one worker until it is stopped (SIGTERM or Ctrl-C); it owns some partitions."""
    key = config.service_key()
    ensure_ready(config)
    # Faust wants a data directory even with in-memory tables; nothing in it outlives us.
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-") as datadir:
        build = create_windowed_app if config.mechanism == "windowed" else create_app
        app = build(config, key, Path(datadir))
        faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


def run_consumer(config: StreamConfig, host: str, port: int, loglevel: str = "warning") -> None:
    """Run the stream's consumer and its web pages until it is stopped."""
    ensure_ready(config)
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-consumer-") as datadir:
        app = create_consumer_app(config, Path(datadir), host, port)
        faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
