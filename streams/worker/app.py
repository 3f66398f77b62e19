"""The Faust worker (SPEC §3): ``<stream>.raw`` → Redis buffer → ``<stream>.published``.

One agent per concern:

- ``ingest`` takes each fetch of raw records whole (`streams.runtime.bulk`, around
  Faust's per-message machinery), validates it (bad records go to
  ``<stream>.rejected`` with a reason), and hands each partition's batch to
  the Redis buffer, which stores, groups and randomizes in one Lua step. The
  fetch's offsets are committed only after Redis (with fsync on every write)
  has the batch: a crash replays it, and the buffer recognises the replay.
  A personal stream takes two hops, so that each personal group has one owner
  and one trial budget: validated raw records go, keyed by group,
  to the internal ``<stream>.grouped``, and the records of each of its
  partitions to the buffer (`add_ingest`).
- ``emit`` (timer, `Emitter`) moves records from each owned partition's mixing
  pool to the published topic under fresh tokens by the mixing rule (only the
  excess over the pool's floor, uniformly drawn and shuffled; a quiet pool
  whole, if it holds the floor), and forgets them only once the broker
  acknowledged them; a newly assigned partition first re-sends whatever its
  previous owner left in flight, with the same tokens.
- ``tick`` (timer) lets time act: decoy records past ``max_wait`` are
  suppressed, personal groups past it are released.

While the consumer's privacy tests hold publishing paused (fail closed),
``emit`` sends nothing; records keep arriving and wait in Redis.

When a partition's records (waiting for a group and pooled) reach
``buffer_cap`` the ingest handler waits, so the consumer stops fetching instead
of Redis growing without bound, also while publishing is paused.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

import faust
import numpy as np
from aiokafka.structs import ConsumerRecord
from faust.types import TP
from faust.web import Request, Response, View
from prometheus_client import CONTENT_TYPE_LATEST

from service.core.config import StreamConfig
from service.core.ingest import (
    Message,
    PreparedBatch,
    Preparer,
    Rejected,
    offset_of,
    partition_of,
)
from service.core.prf import ServiceKey
from service.core.schema import Rejection
from service.store.auditor import Auditor, publishable
from service.store.buffer import FINAL_POOL, BufferState, Emission, FencedError, StreamBuffer
from service.store.lifecycle import Lifecycle
from streams.runtime.app import (
    TRANSIENT,
    Publisher,
    add_health_pages,
    app_publisher,
    assigned_partitions,
    describe,
    faust_app,
    now_ms,
    redis_client,
    retrying,
    stream_topic,
)
from streams.runtime.bulk import consume_in_bulk
from streams.runtime.metrics import DELAY_SLACK, delay_histogram, render_worker
from streams.worker.closing import Closer
from streams.worker.undecodable import HeldBatches

log = logging.getLogger("splu.worker")

EMIT_INTERVAL = 0.5  # seconds between emission rounds
TAKES_IN_FLIGHT = 2  # takes of one partition being published at once (Emitter.emit_partition)
EMIT_CHUNK = 20_000  # records per take from one pool: a backlog leaves in few Redis calls
TICK_INTERVAL = 1.0  # seconds between time-driven steps
REUSED_ID = "record id already used with different content"
CLOSED = "the stream is closed: its raw partition accepts no record after its close offset"


async def worker_document(buffer: BufferState, partitions: Iterable[int]) -> dict[str, Any]:
    """What a worker's /metrics shows (`streams.runtime.metrics.worker_families`): the numbers of
    the partitions it owns, so the stream's workers together show each partition once."""
    config = buffer.config
    numbers = {}
    for partition in partitions:
        delay = delay_histogram(await buffer.delays([partition]))
        stats = await buffer.stats(partition)
        numbers[partition] = {**stats, "buffer_cap": config.buffer_cap, "delay": delay}
    return {
        "stream": config.name,
        "delay_bound": config.max_wait + DELAY_SLACK,
        "partitions": numbers,
    }


def add_metrics_page(app: faust.App, raw: faust.TopicT, buffer: BufferState) -> None:
    """/metrics: `worker_document` for the partitions of `raw` (the topic whose partitions
    the buffers are) this worker owns now, in the
    Prometheus text format; 503 while Redis does not answer, which Prometheus counts as the
    target being down."""

    @app.page("/metrics")
    class Metrics(View):
        async def get(self, request: Request) -> Response:
            try:
                document = await worker_document(buffer, sorted(assigned_partitions(app, raw)))
            except TRANSIENT as err:
                return self.text(f"Redis does not answer ({type(err).__name__})", status=503)
            # In the headers: aiohttp refuses a content_type argument with a charset.
            return self.bytes(
                render_worker(document), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )


class PauseWatch:
    """Whether a failed privacy test holds publication (fail closed); logs each change once.

    While held, records keep arriving and wait in Redis.
    """

    def __init__(self, buffer: BufferState) -> None:
        self.buffer = buffer
        self.reason: str | None = None

    async def holding(self) -> bool:
        try:
            reason = await self.buffer.paused()
        except TRANSIENT:
            return True
        if reason != self.reason:
            if reason is None:
                log.warning("publishing resumed")
            else:
                log.error("publishing paused: %s", reason)
            self.reason = reason
        return reason is not None


class Emitter:
    """One emission round per timer tick: for each owned partition, re-send what a previous
    owner left in flight, then publish every take the mixing rule allows, each take under
    one timestamp, and acknowledge it once the broker has it.

    Free of Faust, so tests drive it on a virtual clock exactly as the timer does.
    """

    def __init__(
        self, config: StreamConfig, buffer: StreamBuffer, publisher: Publisher, preparer: Preparer
    ) -> None:
        self.config, self.buffer = config, buffer
        self.publisher, self.preparer = publisher, preparer
        self.owned: set[int] = set()
        self.resend: set[int] = set()

    def assigned(self, partitions: set[int]) -> None:
        """Partitions newly given to this worker: their in-flight records go out first."""
        self.resend |= partitions - self.owned

    async def publish(self, partition: int, items: Emission, now: int) -> None:
        await self.publisher.send_all(
            self.config.topics["published"],
            ((token.encode(), self.preparer.published_json(entry)) for token, entry in items),
            timestamp_ms=now,
        )
        await self.buffer.acknowledge(partition, items, now)

    async def round(
        self, partitions: set[int], now: int
    ) -> list[tuple[int, list[tuple[str, bytes]]]]:
        """Emit from `partitions` at time `now` (ms); returns the takes sent, each with its
        partition, in partition order. Partitions are emitted concurrently, so that Redis
        draws one partition's take while the worker encodes and sends another's."""
        self.owned &= partitions
        takes = await asyncio.gather(*(self.emit_partition(p, now) for p in sorted(partitions)))
        return [take for partition_takes in takes for take in partition_takes]

    async def emit_partition(
        self, partition: int, now: int
    ) -> list[tuple[int, list[tuple[str, bytes]]]]:
        sent = []
        try:
            if partition in self.resend or partition not in self.owned:
                waiting = await self.buffer.in_flight(partition)
                if waiting:
                    log.warning(
                        "partition %d: re-sending %d unacknowledged records",
                        partition, len(waiting),
                    )  # fmt: skip
                    await self.publish(partition, waiting, now)
                self.resend.discard(partition)
                self.owned.add(partition)
            # The next take is drawn in Redis while the broker acknowledges the last one.
            sending: deque[tuple[asyncio.Future, list[tuple[str, bytes]]]] = deque()

            async def settle_oldest() -> None:
                publication, items = sending[0]
                await publication
                sending.popleft()
                sent.append((partition, items))

            try:
                while items := await self.buffer.take(partition, now, EMIT_CHUNK):
                    publication = asyncio.ensure_future(self.publish(partition, items, now))
                    sending.append((publication, items))
                    if len(sending) >= TAKES_IN_FLIGHT:
                        await settle_oldest()
                while sending:
                    await settle_oldest()
            finally:
                # After a failure, the publications still running end before the partition is
                # emitted again; what they fail to send stays in flight too.
                await asyncio.gather(*(p for p, _ in sending), return_exceptions=True)
        except TRANSIENT as err:
            # Whatever was taken stays in flight; send it again once things recover.
            log.warning("partition %d: emission failed (%s)", partition, describe(err))
            self.resend.add(partition)
        except FencedError as err:
            # The new owner re-sends what this worker left in flight, with the same tokens.
            log.error("%s; this worker stops emitting it", err)
            self.owned.discard(partition)
        return sent


Forward = Callable[[list[tuple[bytes, bytes]]], Awaitable[Any]]


class RawFetch(NamedTuple):
    """A fetch of raw messages, validated: accepted records per partition, rejections,
    and the highest offset of each raw partition in it."""

    batches: list[PreparedBatch]
    rejected: list[Rejected]
    highest: dict[int, int]


class Intake:
    """What a worker does with a fetch, free of Faust, so tests drive it on a virtual clock
    as the worker's ingest handler does: validate the raw records, admit them (the raw
    partitions' gate rejects what came after a close, the stream-wide identity screen skips
    re-sends and rejects ids reused with other content; `service.store.lifecycle`), store them
    idempotently in one Lua call per partition (`buffer.ingest`), send and count the
    rejections.

    A personal stream takes two hops, so that each personal group has one owner and one
    trial budget:

    1. `raw` admits a fetch and `forward`s its records, keyed by their personal group
       (`buffer.grouped_messages`), to the grouped topic, so each group lives in one
       partition. Once the broker acknowledged every copy (acks=all) the raw partitions are
       marked forwarded up to the fetch (a close waits for it), and the raw offsets may be
       committed. A crash before that sends them again: their id and fingerprint are the
       record's, so the second hop recognises the copies;
    2. `grouped` stores a fetch of the grouped topic as a raw batch would be
       (`buffer.ingest_grouped`), in its partition's buffer.
    """

    def __init__(
        self,
        config: StreamConfig,
        preparer: Preparer,
        buffer: Any,
        lifecycle: Lifecycle,
        publisher: Publisher,
        forward: Forward | None = None,
    ) -> None:
        self.config, self.preparer, self.buffer = config, preparer, buffer
        self.lifecycle, self.publisher = lifecycle, publisher
        self.forward = forward
        # Per raw partition, the highest offset this worker stored or forwarded a fetch
        # through: the identity screen forgets first reads up to it (`Lifecycle.screen`).
        self.handled: dict[int, int] = {}

    def prepare(self, messages: Sequence[Message]) -> RawFetch:
        """Validate a fetch of raw messages (CPU only: the worker prepares the next fetch
        while the last one is being stored)."""
        partitions = np.fromiter(map(partition_of, messages), np.int64, len(messages))
        offsets = np.fromiter(map(offset_of, messages), np.int64, len(messages))
        highest = {p: int(offsets[partitions == p].max()) for p in np.unique(partitions).tolist()}
        batches, rejected = self.preparer.prepare(messages)
        return RawFetch(batches, rejected, highest)

    async def raw(self, fetch: RawFetch, now: int) -> list[tuple[int, int]]:
        """Take in one admitted fetch of raw messages (`admit`); (partition, records held)
        per buffer partition it stored into: waiting for a group or release, and pooled.
        Fetches are taken in one after another, in the order of their offsets."""
        admitted, rejected, highest = fetch
        if self.forward is None:
            held = await self.store(admitted, rejected, highest, now)
        else:
            held = []
            if highest:
                grouped = [m for batch in admitted for m in self.buffer.grouped_messages(batch)]
                # A retry may send some twice: the second hop stores each record once.
                await retrying("forwarding records", self.forward, grouped)
                await retrying("marking records forwarded", self.lifecycle.mark_forwarded, highest)
            await self.send_rejections(rejected)
        for partition, offset in highest.items():
            self.handled[partition] = max(offset, self.handled.get(partition, -1))
        return held

    async def admit(self, fetch: RawFetch) -> RawFetch:
        """The records of a prepared fetch the stream takes in: before the close offset of
        their raw partition, and neither re-sent nor reused elsewhere in the stream.

        A fetch may be admitted while the one before it is still being stored: the gate
        only raises its watermark, and the screen marks a record's first copy before any
        buffer stores it in any case (a replay passes it again). The gate comes first, so
        that the screen never marks a record the close turns away."""
        batches, rejected, highest = fetch
        if not highest:
            return fetch
        closes = await retrying("gating a fetch", self.lifecycle.gate, highest)
        gated = []
        for batch in batches:
            close = closes[batch.partition]
            if close is not None:
                after = [i for i, m in enumerate(batch.messages) if m.offset >= close]
                rejected += [refused(batch.messages[i], CLOSED) for i in after]
                if after:
                    keep = [i for i, m in enumerate(batch.messages) if m.offset < close]
                    batch = batch.subset(keep)
            if len(batch):
                gated.append(batch)
        screened = await retrying("screening a fetch", self.lifecycle.screen, gated, self.handled)
        admitted = []
        for batch, statuses in zip(gated, screened, strict=True):
            rejected += [
                refused(m, REUSED_ID)
                for m, status in zip(batch.messages, statuses, strict=True)
                if status == 2
            ]
            if any(statuses):
                batch = batch.subset([i for i, status in enumerate(statuses) if status == 0])
            admitted.append(batch)
        return RawFetch(admitted, rejected, highest)

    async def store(
        self,
        batches: list[PreparedBatch],
        rejected: list[Rejected],
        highest: dict[int, int],
        now: int,
    ) -> list[tuple[int, int]]:
        """Buffer the admitted records of a fetch, telling every raw partition of it how far
        the fetch went (a close waits for every offset below its own); send the
        rejections."""
        by_partition = {b.partition: b for b in batches if len(b)}
        partitions = sorted(highest)
        outcomes = await asyncio.gather(
            *(
                retrying(
                    "storing a batch", self.buffer.ingest, p, by_partition.get(p), now, highest[p]
                )
                for p in partitions
            )
        )
        for partition, outcome in zip(partitions, outcomes, strict=True):
            batch = by_partition.get(partition)
            for message, status in zip(
                batch.messages if batch else [], outcome.statuses, strict=True
            ):
                if status in (2, 3):
                    rejected.append(refused(message, REUSED_ID if status == 2 else CLOSED))
        await self.send_rejections(rejected)
        return [(p, o.pending + o.pool) for p, o in zip(partitions, outcomes, strict=True)]

    async def grouped(
        self, fetched: list[tuple[int, list[tuple[int, bytes]]]], now: int
    ) -> list[tuple[int, int]]:
        """The second hop: store each partition's (offset, value) records of the grouped
        topic; (partition, records held) per partition."""
        outcomes = await asyncio.gather(
            *(
                retrying("storing a batch", self.buffer.ingest_grouped, p, records, now)
                for p, records in fetched
            )
        )
        for (partition, records), outcome in zip(fetched, outcomes, strict=True):
            for (offset, _), status in zip(records, outcome.statuses, strict=True):
                if status in (2, 3):
                    # The first hop admits no reused id and nothing after the close: only a
                    # collision of 64-bit fingerprints, or a forward that outlived the
                    # close, gets here. Counted (`conflicts`, `late`); the raw record stays
                    # on the raw topic.
                    log.error(
                        "%s %d/%d: %s; not stored", self.config.topics["grouped"], partition,
                        offset, REUSED_ID if status == 2 else CLOSED,
                    )  # fmt: skip
        return [(p, o.pending + o.pool) for (p, _), o in zip(fetched, outcomes, strict=True)]

    async def send_rejections(self, rejected: list[Rejected]) -> None:
        """Send rejected records to the rejected topic with their reasons, and count them."""
        if not rejected:
            return
        await retrying("sending rejections", self._reject, rejected)
        counts = Counter(r.message.partition for r in rejected)
        closed = Counter(r.message.partition for r in rejected if r.rejection.reason == CLOSED)
        await retrying("counting rejections", self.buffer.count_rejected, counts, closed)

    async def _reject(self, rejected: list[Rejected]) -> None:
        await self.publisher.send_all(
            self.config.topics["rejected"], ((r.message.key, r.payload()) for r in rejected)
        )
        for r in rejected:
            # The field and the reason, never the value (a reason never echoes a sensitive one).
            where = f"{r.message.partition}/{r.message.offset}"
            field = "" if r.rejection.field is None else f", field {r.rejection.field!r}"
            log.warning("rejected %s%s: %s", where, field, r.rejection.reason)


def refused(message: Message, reason: str) -> Rejected:
    return Rejected(message, Rejection(f"{message.partition}/{message.offset}", None, reason))


def add_ingest(
    app: faust.App,
    raw: faust.TopicT,
    config: StreamConfig,
    intake: Intake,
    held: HeldBatches,
    grouped: faust.TopicT | None = None,
) -> None:
    """The ingest agent every worker shares: each fetch of `raw` (and of `grouped`, a
    personal stream's second hop) goes to `intake`, the consumer is held while a
    partition's buffer is at its cap, and a raw batch that cannot be decoded holds its
    partition (`streams.worker.undecodable`)."""
    raw_name = raw.get_topic_name()
    grouped_name = grouped.get_topic_name() if grouped is not None else None
    # A fetch is prepared as it comes, admitted once the fetch before it is (the screen
    # counts a re-send once by its offset), and stored once the fetch before it is stored:
    # so one fetch is admitted while the one before it is being stored, but each step
    # takes the fetches in the order they were fetched. A partition's buffer takes every
    # offset up to its watermark as stored (ingest.lua), so a fetch stored after a later
    # one would be lost. A fetch whose storing did not finish (a shutdown or rebalance
    # cancelled it) stops the later ones too; they are read again from the committed
    # offsets.
    last: tuple[asyncio.Future[bool], asyncio.Future[bool]] | None = None

    async def ingest(fetched: Mapping[TP, list[ConsumerRecord]]) -> None:
        # Before the first await: handlers start in the order of their fetches.
        nonlocal last
        loop = asyncio.get_running_loop()
        previous, steps = last, (loop.create_future(), loop.create_future())
        last = steps
        try:
            await handle(fetched, previous, *steps)
        finally:
            for step in steps:
                if not step.done():
                    step.set_result(False)

    async def after(step: asyncio.Future[bool] | None) -> None:
        if step is not None and not await asyncio.shield(step):
            raise asyncio.CancelledError("the fetch before this one did not get this far")

    async def handle(
        fetched: Mapping[TP, list[ConsumerRecord]],
        previous: tuple[asyncio.Future[bool], asyncio.Future[bool]] | None,
        admitted: asyncio.Future[bool],
        stored: asyncio.Future[bool],
    ) -> None:
        # The consumer's records themselves, read as `Message`s: no copy of each.
        fetch = intake.prepare(
            list(chain.from_iterable(r for tp, r in fetched.items() if tp.topic == raw_name))
        )
        await after(previous and previous[0])
        fetch = await intake.admit(fetch)
        admitted.set_result(True)
        await after(previous and previous[1])
        now = now_ms()
        held = await intake.raw(fetch, now)
        if grouped_name is not None:
            held += await intake.grouped(
                [
                    (tp.partition, [(m.offset, m.value) for m in records])
                    for tp, records in fetched.items()
                    if tp.topic == grouped_name
                ],
                now,
            )
        for partition, records in held:
            while records >= config.buffer_cap:
                # Backpressure: hold the consumer until time or publication frees room.
                await asyncio.sleep(config.batch_wait)
                tick = await retrying("ticking", intake.buffer.ingest, partition, None, now_ms())
                records = tick.pending + tick.pool
        stored.set_result(True)

    topics = (t for t in (raw, grouped) if t is not None)
    consume_in_bulk(app, ingest, *topics, undecodable=held.hold)


def create_app(
    config: StreamConfig, key: ServiceKey, datadir: Path, web: tuple[str, int] | None = None
) -> faust.App:
    """The worker app for one stream; with `web` (host, port) it serves /healthz, /readyz and
    /metrics."""
    app = faust_app(config, f"splu-{config.name}", datadir, web=web)
    raw = stream_topic(app, config, "raw")
    grouped = None
    if config.personal is not None:
        grouped = stream_topic(app, config, "grouped")
    # The topic whose partitions the Redis buffers are: a personal stream's are its groups'.
    buffered = grouped or raw
    publisher = app_publisher(app, config)
    preparer = Preparer(config, key)
    client = redis_client(app, config)
    buffer = StreamBuffer(client, config, key)
    lifecycle = Lifecycle(client, config)
    closer = Closer(config, lifecycle)
    auditor = Auditor(client, config)
    emitter = Emitter(config, buffer, publisher, preparer)
    pause = PauseWatch(buffer)

    @app.on_partitions_assigned.connect
    async def on_assigned(sender: object, assigned: set, **kwargs: object) -> None:
        name = buffered.get_topic_name()
        partitions = {tp.partition for tp in assigned if tp.topic == name}
        emitter.assigned(partitions)
        # The final pool goes with partition 0.
        buffer.assigned(partitions | ({FINAL_POOL} if 0 in partitions else set()))

    forward = None
    if grouped is not None:
        topic = grouped.get_topic_name()

        async def forward(messages: list[tuple[bytes, bytes]]) -> None:
            await publisher.send_all(topic, messages)

    intake = Intake(config, preparer, buffer, lifecycle, publisher, forward)
    held = HeldBatches(buffer, publisher.send_all)
    add_ingest(app, raw, config, intake, held, grouped)
    add_health_pages(app, buffered, client, publisher)
    add_metrics_page(app, buffered, buffer)

    @app.task
    async def emit() -> None:
        # Rounds follow each other at once while they find a backlog, and every
        # EMIT_INTERVAL otherwise: on a timer, Redis and the broker would sit idle between
        # the rounds of a fast stream while its pools filled.
        while not app.should_stop:
            emitted = 0
            if not await pause.holding():
                partitions = assigned_partitions(app, buffered)
                if closer.requested is not None and 0 in partitions:
                    # A closing stream's final pool goes with partition 0.
                    partitions.add(FINAL_POOL)
                takes = await emitter.round(partitions, now_ms())
                emitted = sum(len(items) for _, items in takes)
            await asyncio.sleep(0 if emitted >= config.mixing_pool else EMIT_INTERVAL)

    @app.timer(interval=TICK_INTERVAL)
    async def tick() -> None:
        for partition in sorted(assigned_partitions(app, buffered)):
            try:
                await buffer.ingest(partition, None, now_ms())
            except TRANSIENT as err:
                log.warning("partition %d: tick failed (%s)", partition, describe(err))
            except FencedError as err:
                log.error("%s; its tick is left to the new owner", err)
        await close_step(closer, assigned_partitions(app, raw), assigned_partitions(app, buffered))
        await held_step(app, held, raw)

    @app.timer(interval=config.report_interval)
    async def audit() -> None:
        # One worker runs the privacy tests: the owner of partition 0.
        if 0 in assigned_partitions(app, buffered):
            await run_audit(auditor)

    app.splu_buffer = buffer  # type: ignore[attr-defined]
    return app


async def run_audit(auditor: Auditor) -> None:
    """The privacy tests of a decoy or personal stream (`service.store.auditor`); an outage waits
    for the next round. A failed test is logged with its publishable numbers only."""
    try:
        results = await auditor.audit()
    except TRANSIENT as err:
        log.warning("the privacy tests failed to run (%s)", describe(err))
        return
    for result in results:
        if not result.passed:
            numbers = publishable(result).numbers
            log.warning("privacy test %s failed: %s", result.test, json.dumps(numbers))


async def held_step(app: faust.App, held: HeldBatches, raw: faust.TopicT) -> None:
    """The tick's step over undecodable batches (`streams.worker.undecodable`); an outage waits
    for the next."""
    try:
        await held.step(assigned_partitions(app, raw), app.consumer.skip_past)
    except TRANSIENT as err:
        log.warning("checking undecodable batches failed (%s)", describe(err))


async def close_step(closer: Closer, raw: set[int], buffered: set[int]) -> None:
    """The tick's close steps (`streams.worker.closing.Closer`); an outage waits for the next."""
    try:
        await closer.step(raw, buffered, now_ms())
    except TRANSIENT as err:
        log.warning("closing the stream failed (%s); trying again", describe(err))
