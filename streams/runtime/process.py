"""What starting a worker or a consumer process shares: its topics and Redis checked
first, and the Faust worker that runs its app."""

from __future__ import annotations

import gc
import time

import faust

from service.core.config import StreamConfig
from service.store.buffer import RedisRefusedError, RedisUnavailableError, check_redis
from streams.runtime.kafka import BrokerUnreachableError, role_topics
from streams.runtime.manifest import manifest_topics
from streams.runtime.topics import create_topics, run_in_thread

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
    """Create the topics `role` reaches (`streams.runtime.kafka.role_topics`: the worker's include
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
