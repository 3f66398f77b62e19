"""Running the worker and the consumer: `splu worker` and `splu consumer`."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import faust

from service.buffer import RedisRefusedError, RedisUnavailableError, check_redis, connect
from service.config import StreamConfig
from service.running_counts import RunningCounts
from streams.app import create_app
from streams.consumer import create_consumer_app
from streams.kafka import BrokerUnreachableError, role_topics
from streams.manifest import check_manifest, claim_manifest, manifest_topics
from streams.topics import create_topics, run_in_thread
from streams.windowed import create_windowed_app

# Seconds a starting worker or consumer waits for a broker or Redis that is restarting.
STARTUP_PATIENCE = 5.0


class StreamWorker(faust.Worker):
    """A Faust worker whose app, once started, no longer has the cyclic garbage collector
    walk the objects its start-up made (`gc.freeze`).

    A worker's heap holds about 140,000 objects from its imports (Faust, aiokafka, numpy,
    scipy) and the app's construction, alive as long as the process. Each full collection
    walked them all with the event loop stopped: 80-95 ms, six times in 4.3 s of a
    200,000-record run of bench/stream_throughput.py, while Redis sat idle with its replies
    unread (idle 14% of the time the stream flowed, 8% frozen). Frozen, a full collection
    took at most 8 ms.

    Faust's start-up spinner draws only on a terminal, but hides and shows the cursor
    (``\\x1b[?25l``) whatever its output is: into a log file it writes no spinner at all.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        if self.spinner is not None and not self.spinner.file.isatty():
            self.spinner = None

    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        gc.collect()
        gc.freeze()


def ensure_ready(config: StreamConfig, role: str) -> None:
    """Create the topics `role` reaches (`streams.kafka.role_topics`: the worker's include
    a personal stream's <stream>.grouped and the manifest topic) with the stream's
    partition count, if missing, and check that Redis answers the stream's user: errors
    here are one line, not a retry loop. A server that is restarting gets
    STARTUP_PATIENCE seconds to come back; a refusal (of the broker's TLS or SASL
    settings too) fails at once."""
    _, settings = manifest_topics(config)
    deadline = time.monotonic() + STARTUP_PATIENCE
    while True:
        try:
            run_in_thread(create_topics(config.kafka, role_topics(config, role), settings))
            run_in_thread(check_redis(config))
            return
        except RedisRefusedError:
            raise
        except (BrokerUnreachableError, RedisUnavailableError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


async def refuse_legacy_counts(config: StreamConfig) -> None:
    client = connect(config)
    try:
        await RunningCounts(client, config).check_layout()
    finally:
        await client.aclose()


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
        build = create_windowed_app if config.mechanism == "windowed" else create_app
        app = build(config, key, Path(datadir), web=None if port is None else (host, port))
        StreamWorker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


def run_consumer(config: StreamConfig, host: str, port: int, loglevel: str = "warning") -> None:
    """Run the stream's consumer and its web pages until it is stopped."""
    ensure_ready(config, "consumer")
    run_in_thread(check_manifest(config))
    run_in_thread(refuse_legacy_counts(config))
    with tempfile.TemporaryDirectory(prefix=f"splu-{config.name}-consumer-") as datadir:
        app = create_consumer_app(config, Path(datadir), host, port)
        StreamWorker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
