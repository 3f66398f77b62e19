"""One worker's steps on a virtual clock, with the real code each step of `splu worker`
runs: the ingest handler's `Intake` (validation, the gate, the identity screen, the Lua
store), the tick (`StreamBuffer.ingest` without records, then `Closer.step`), and the
emission round (`Emitter`, with the final pool once the stream closes). Only Kafka's
part in moving raw and grouped records is simulated: offsets are counted here, and a
personal stream's grouped records go straight to the second hop. Publishing is real:
published and rejected records go to the embedded broker."""

from __future__ import annotations

import json
import secrets
from collections import Counter, defaultdict
from collections.abc import Callable

import redis.asyncio as aioredis

from service.core.config import StreamConfig
from service.core.ingest import Preparer, RawMessage
from service.core.kafka_settings import KafkaSettings
from service.core.prf import ServiceKey
from service.store.buffer import FINAL_POOL, StreamBuffer
from service.store.lifecycle import Lifecycle
from streams.runtime.app import Publisher, partition_of
from streams.runtime.topics import create_topics
from streams.worker.app import Emitter, Intake
from streams.worker.closing import Closer


class VirtualWorker:
    """Every partition of one stream, owned by one worker on a virtual clock."""

    def __init__(
        self,
        bootstrap: str,
        client: aioredis.Redis,
        config: StreamConfig,
        key: ServiceKey,
        entropy: Callable[[int], str] = secrets.token_hex,
    ) -> None:
        self.kafka, self.config = KafkaSettings(bootstrap), config
        self.buffer = StreamBuffer(client, config, key, entropy=entropy)
        self.lifecycle = Lifecycle(client, config)
        self.preparer = Preparer(config, key)
        self.publisher = Publisher(self.kafka)
        forward = self._forward if config.personal is not None else None
        self.intake = Intake(
            config, self.preparer, self.buffer, self.lifecycle, self.publisher, forward
        )
        self.closer = Closer(config, self.lifecycle, ends=self.ends)
        self.emitter = Emitter(config, self.buffer, self.publisher, self.preparer)
        self.partitions = set(range(config.partitions))
        self.emitter.owned = set(self.partitions)
        self.raw_offsets: Counter[int] = Counter()
        self.grouped_offsets: Counter[int] = Counter()
        self._grouped: dict[int, list[tuple[int, bytes]]] = defaultdict(list)

    async def __aenter__(self) -> VirtualWorker:
        await create_topics(self.kafka, self.config.topic_partitions)
        await self.publisher.on_start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.publisher.on_stop()

    async def _forward(self, messages: list[tuple[bytes, bytes]]) -> None:
        for key, value in messages:
            partition = partition_of(key, self.config.partitions)
            self._grouped[partition].append((self.grouped_offsets[partition], value))
            self.grouped_offsets[partition] += 1

    async def ends(self, topic: str, partitions: list[int]) -> dict[int, int]:
        offsets = self.raw_offsets if topic == self.config.topics["raw"] else self.grouped_offsets
        return {p: offsets[p] for p in partitions}

    def messages(self, partition: int, rows: list[tuple[bytes, bytes]]) -> list[RawMessage]:
        """Rows as the next messages of a raw partition."""
        out = []
        for key, value in rows:
            out.append(RawMessage(partition, self.raw_offsets[partition], key, value))
            self.raw_offsets[partition] += 1
        return out

    async def arrive(self, messages: list[RawMessage], now: int) -> None:
        """One fetch of raw messages (and, for a personal stream, of what it forwarded)."""
        await self.intake.raw(await self.intake.admit(self.intake.prepare(messages)), now)
        if self._grouped:
            fetched = sorted(self._grouped.items())
            self._grouped.clear()
            await self.intake.grouped(fetched, now)

    async def tick(self, now: int) -> None:
        for partition in sorted(self.partitions):
            await self.buffer.ingest(partition, None, now)
        await self.closer.step(self.partitions, self.partitions, now)

    async def emit(self, now: int) -> list[tuple[int, list[tuple[str, bytes]]]]:
        partitions = set(self.partitions)
        if self.closer.requested is not None:
            partitions.add(FINAL_POOL)
        return await self.emitter.round(partitions, now)


def adult_messages(config: StreamConfig, rows: list[dict[str, str]]) -> list[tuple[bytes, bytes]]:
    """(key, JSON value) per Adult row in the stream's schema, keyed r0, r1, ..."""
    names = config.schema.names
    return [
        (b"r%d" % i, json.dumps({n: row[n] for n in names}).encode()) for i, row in enumerate(rows)
    ]
