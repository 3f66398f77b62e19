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
# The collector's thresholds once the app has started. A fetch in hand holds thousands of
# records and tens of thousands of containers made for them; at Python's default (a
# young collection every 700 allocations) each collection walks the fetch still in hand
# and promotes it, so the older generations fill with it and are walked in turn. The
# stream's objects die by reference count, hardly ever in cycles, so a collection every
# 50,000 allocations still bounds what cycles can hold.
GC_THRESHOLDS = (50_000, 20, 20)


class StreamWorker(faust.Worker):
    """A Faust worker whose app, once started, keeps the cyclic garbage collector out of
    the stream's way: the objects its start-up made are frozen (`gc.freeze`), so full
    collections no longer walk them with the event loop stopped while Redis's replies
    wait, and young collections run far more rarely (`GC_THRESHOLDS`).

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
        gc.set_threshold(*GC_THRESHOLDS)


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
