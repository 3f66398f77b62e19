"""Bulk consumption: each fetched batch handled whole, around Faust's per-message machinery.

Faust hands a topic's messages to an agent one by one: a ``Message`` and an ``Event`` per
record, two tasks per record to race the callback against flow control, a queue, and an
ack per record, which costs more of a worker's CPU than the records' own work
(docs/performance.md). A bulk topic skips it: the Faust consumer (its group membership,
rebalancing, flow control and offset commits stay Faust's) fetches as usual, and the
fetcher hands each fetch (its records by partition) to one handler. The Faust internals
this takes live in `streams.runtime.faust_adapter`.

The commit rule is the worker's: a fetch's offsets are committed only after the
handler returned, i.e. after Redis (with fsync on every write) holds the batch.
A handler that fails ends the process before anything is committed, so the
batch is redelivered and the handler's idempotence absorbs whatever part of it
was done. A handler cancelled by a shutdown or a rebalance commits nothing
either; a commit for a partition revoked meanwhile is discarded by Faust, and
the partition's next owner reads the batch again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import faust
from aiokafka import codec
from aiokafka.structs import ConsumerRecord
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from service.store.buffer import FencedError
from streams.runtime.faust_adapter import (
    FetchConsumer,
    ShortWaitConsumerThread,
    StoppingRecords,
    compression_of,
    consumer_exists,
    install_records,
)

log = logging.getLogger("splu.bulk")

EXIT_UNSTORED = 75  # EX_TEMPFAIL: a batch could not be stored; it will be redelivered
FETCH_TIMEOUT = 1.0  # seconds one fetch waits for records
FETCHES_IN_HAND = 2  # fetches handled at once, so that CPU and Redis work overlap
FETCH_MAX_WAIT_MS = 500  # the longest the broker holds a fetch that finds no records

BulkHandler = Callable[[Mapping[TP, list[ConsumerRecord]]], Awaitable[Any]]
# Told of a batch this process cannot decode: its partition, first and last offset, and why.
UndecodableHandler = Callable[[TP, int, int, str], Awaitable[Any]]
# The header of the record that stands for such a batch in a fetch (`GuardedRecords`).
UNDECODABLE = "splu-undecodable"
# Compression codecs by their code in a batch's attributes, and whether this process has
# the library each needs (aiokafka's codec extras, from the project's dependencies).
CODECS = {
    1: ("gzip", codec.has_gzip), 2: ("snappy", codec.has_snappy), 3: ("lz4", codec.has_lz4),
    4: ("zstd", codec.has_zstd),
}  # fmt: skip


def undecodable_reason(batch: Any) -> str | None:
    """Why this process cannot decode a fetched record batch, or None if it can."""
    compression = compression_of(batch)
    if compression:
        name, available = CODECS.get(compression, (f"codec {compression:#04x}", lambda: False))
        if not available():
            return f"{name} compression, whose library this process lacks"
    if not batch.validate_crc():
        return "its CRC does not match its contents"
    return None


class GuardedRecords(StoppingRecords):
    """aiokafka's records of one fetched partition, which end at a batch this process
    cannot decode (a codec whose library it lacks, a broken CRC) with one record standing
    for the batch, header UNDECODABLE, instead of raising: the exception would end the
    fetcher, and a restarted process would meet the same batch again, so one producer's
    setting would stop the stream for good. The partition's position stays at the batch.
    """

    refuse = staticmethod(undecodable_reason)

    @staticmethod
    def stand_in(topic: str, partition: int, batch: Any, reason: str) -> ConsumerRecord:
        header = f"{batch.next_offset - 1} {reason}".encode()
        return ConsumerRecord(
            topic, partition, batch.base_offset, -1, 0, None, None, None, -1, -1,
            ((UNDECODABLE, header),),
        )  # fmt: skip


install_records(GuardedRecords)


def undecodable_batch(record: ConsumerRecord) -> tuple[int, int, str] | None:
    """(first offset, last offset, reason) if `record` stands for an undecodable batch."""
    for name, value in record.headers or ():
        if name == UNDECODABLE:
            last, _, reason = value.decode().partition(" ")
            return record.offset, int(last), reason
    return None


class BulkConsumerThread(ShortWaitConsumerThread):
    """Faust's consumer thread, whose aiokafka consumer has the broker hold a fetch that
    finds no records for FETCH_MAX_WAIT_MS (aiokafka's own default), not the 1,500 ms Faust
    fixes.

    aiokafka keeps one fetch in flight per broker, for the partitions whose fetched records
    are used up, and the broker holds a fetch that finds nothing: the embedded broker for
    the whole wait, even when records arrive meanwhile. When partitions drain unevenly (a
    backlog's end, a burst on some partitions), those that run dry wait behind the held
    fetch. A shorter wait costs CPU at a steady rate, as fetches come back smaller and more
    often; this wait is the balance docs/performance.md measures.
    """

    fetch_max_wait_ms = FETCH_MAX_WAIT_MS


class BulkConsumer(FetchConsumer):
    """Faust's aiokafka consumer whose fetcher hands whole fetches to the transport's
    bulk handler, then commits them."""

    thread_class = BulkConsumerThread

    async def drain(self, stopping: Callable[[], bool]) -> None:
        handle: BulkHandler = self.transport.bulk_handler  # type: ignore[attr-defined]
        # Fetches being handled, oldest first: the next fetch's CPU work (parsing,
        # validation) runs while the previous one waits on Redis. Each is committed only
        # after it and every older one were handled.
        handling: deque[tuple[asyncio.Task, dict[TP, int]]] = deque()
        try:
            while not stopping():
                while handling and (len(handling) >= FETCHES_IN_HAND or handling[0][0].done()):
                    task, offsets = handling.popleft()
                    await task
                    await self.commit_fetch(offsets)
                records, active = await self.next_fetch(FETCH_TIMEOUT if not handling else 0)
                if not records:
                    if handling:  # nothing prefetched: let the oldest fetch finish first
                        await asyncio.wait([handling[0][0]])
                    continue
                if not self.flow_active:
                    # A rebalance began during the fetch: read again from committed offsets.
                    await self.perform_seek()
                    continue
                batch = {
                    tp: messages
                    for tp, messages in records.items()
                    if messages and (active is None or tp in active)
                }
                batch = await self._hold_undecodable(batch)
                if not batch:
                    continue
                for tp, messages in batch.items():
                    self.mark_read(tp, messages[-1].offset)
                offsets = {tp: messages[-1].offset + 1 for tp, messages in batch.items()}
                handling.append((asyncio.ensure_future(handled(handle, batch)), offsets))
        finally:
            for task, _ in handling:
                task.cancel()

    async def _hold_undecodable(
        self, batch: dict[TP, list[ConsumerRecord]]
    ) -> dict[TP, list[ConsumerRecord]]:
        """The fetch without the records that stand for undecodable batches: each such
        partition stops (paused, its position at the batch) and the transport's handler
        is told, until `skip_past` or a process that can decode it goes on."""
        out = {}
        for tp, messages in batch.items():
            held = undecodable_batch(messages[-1])
            if held is not None:
                messages = messages[:-1]
                self.pause_partitions([tp])
                log.error(
                    "%s/%d: the batch at offsets %d..%d cannot be decoded (%s); the "
                    "partition waits", tp.topic, tp.partition, *held,
                )  # fmt: skip
                report = self.transport.undecodable_handler  # type: ignore[attr-defined]
                if report is not None:
                    await report(tp, *held)
            if messages:
                out[tp] = messages
        return out

    async def skip_past(self, tp: TP, offset: int) -> None:
        """Go on with a held partition from `offset`, past the batch it could not decode."""
        await self.seek(tp, offset)
        self.resume_partitions([tp])


async def handled(handle: BulkHandler, batch: Mapping[TP, list[ConsumerRecord]]) -> Any:
    """Run the handler on a batch; if it fails, end the process before anything is
    committed (with the traceback: a message that breaks the handler must be findable; a
    worker fenced off a partition it lost in a rebalance says so in one line)."""
    try:
        return await handle(batch)
    except FencedError as err:
        log.critical("%s; exiting before this fetch is committed: its new owner reads it", err)
        os._exit(EXIT_UNSTORED)
    except Exception:
        log.critical("a batch could not be stored; exiting before it is committed", exc_info=True)
        os._exit(EXIT_UNSTORED)


class BulkTransport(faust_aiokafka.Transport):
    Consumer = BulkConsumer

    def __init__(
        self, app: faust.App, handle: BulkHandler, undecodable: UndecodableHandler | None
    ) -> None:
        super().__init__(app.conf.broker_consumer, app)
        self.bulk_handler = handle
        self.undecodable_handler = undecodable


def consume_in_bulk(
    app: faust.App,
    handle: BulkHandler,
    *topics: faust.TopicT,
    undecodable: UndecodableHandler | None = None,
) -> None:
    """Subscribe `app` to `topics` and hand every fetch of them to `handle`, partition by
    partition (a fetch may hold records of each topic), committing each fetch once the
    handler returned. The app's only topics. A batch that cannot be decoded holds its
    partition and goes to `undecodable` (`BulkConsumer._hold_undecodable`)."""
    if consumer_exists(app):
        raise RuntimeError("consume_in_bulk must come before the app's consumer exists")
    app.transport = BulkTransport(app, handle, undecodable)
    for topic in topics:
        app.topics.add(topic)
