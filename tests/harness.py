"""A test stream on the embedded servers: its config, worker and consumer processes,
producer rows and topic readers; shared by the stream and consumer tests."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import os
import secrets
import time
import tomllib
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import KafkaError

from deploy.embedded import free_port, spawn_consumer, spawn_worker
from deploy.embedded.environments import SPLU
from service.core.config import StreamConfig, load_config
from service.core.ingest import PreparedBatch, Preparer, RawMessage
from service.core.table import open_sample
from service.core.wire import PoolEntry
from service.store.buffer import BufferState, IngestOutcome, StreamBuffer, takes_in_flight
from streams.runtime.app import partition_of
from streams.runtime.kafka import client_options

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
RECORDS = 20_000
TIMEOUT = 180.0


class Harness:
    """Config, worker process, producer and observers of one test stream."""

    def __init__(
        self,
        servers,
        directory: Path,
        example: str,
        redis_url: str | None = None,
        row_column: bool = True,
        reports: dict | None = None,
        partitions: int = 2,
        redis_settings: dict | None = None,
        personal: dict | None = None,
        kafka: dict | None = None,
    ) -> None:
        """`kafka`: [kafka] settings over the servers' bootstrap (TLS, SASL)."""
        document = tomllib.loads((EXAMPLES / example).read_text())
        name = f"it{uuid.uuid4().hex[:8]}"
        document["stream"].update(
            name=name, partitions=partitions, max_wait=3.0, flush_interval=1.0,
            report_interval=2.0,
        )  # fmt: skip
        document["stream"]["mixing_pool"] = 500
        document["kafka"]["bootstrap"] = servers.kafka_bootstrap
        document["kafka"].update(kafka or {})
        document["redis"]["url"] = redis_url or servers.redis_url
        document["redis"]["cluster"] = servers.redis_cluster
        document["redis"].update(redis_settings or {})
        document.setdefault("reports", {}).update(reports or {})
        if personal:
            document["personal"].update(personal)
        merge = None
        if "personal" in document:
            merge = tomllib.loads((EXAMPLES / document["personal"]["merge_map"]).read_text())
        if row_column:
            # A unique public `row` matches published records back to the input.
            rows = [str(i) for i in range(RECORDS)]
            document["schema"]["public"] = {"row": {"domain": rows}, **document["schema"]["public"]}
            if merge is not None:
                merge["merge"]["classes"]["row"] = [rows]
        if merge is not None:
            self.merge_map = directory / "merge.toml"
            self.merge_map.write_text(tomli_w.dumps(merge))
            document["personal"]["merge_map"] = "merge.toml"
        self.path = directory / f"{name}.toml"
        self.path.write_text(tomli_w.dumps(document))
        self.env = {**os.environ, "SPLU_SERVICE_KEY": secrets.token_hex(32)}
        # The config names the servers; the environment may name others.
        for variable in ("KAFKA_BOOTSTRAP", "REDIS_URL", "REDIS_CLUSTER"):
            self.env.pop(variable, None)
        os.environ.pop("REDIS_CLUSTER", None)
        os.environ["SPLU_SERVICE_KEY"] = self.env["SPLU_SERVICE_KEY"]
        self.config: StreamConfig = load_config(self.path)
        self.log = directory / f"{name}.log"
        self.worker = None
        self.consumer = None
        self.url = f"http://127.0.0.1:{free_port()}"

    def start_worker(self, port: int | None = None) -> None:
        """With a port, the worker serves /healthz, /readyz and /metrics there."""
        self.worker = spawn_worker(self.path, self.env, self.log, port=port)

    def start_consumer(self, splu: Sequence[str] = SPLU) -> None:
        """`splu`: the command that runs splu (`fault_points.command` for a fault point)."""
        port = int(self.url.rsplit(":", 1)[1])
        log = self.log.with_suffix(".consumer.log")
        self.consumer = spawn_consumer(self.path, port, self.env, log, splu=splu)

    def stop(self) -> None:
        for process in (self.consumer, self.worker):
            if process is not None:
                process.stop()

    async def totals(self, client: aioredis.Redis) -> dict[str, int]:
        return await BufferState(client, self.config).totals()

    async def waiting(self, client: aioredis.Redis) -> dict[str, str]:
        """Row → published sensitive codes of every record in a pool or in flight."""
        out = {}
        for partition in range(self.config.partitions):
            prefix = BufferState(client, self.config).prefix(partition)
            entries = list(await client.hvals(f"{prefix}:pool"))
            taken = takes_in_flight(await client.hgetall(f"{prefix}:takes"))
            entries += [entry for _, entry in taken]
            for entry in map(PoolEntry.parse, entries):
                # `row` is the first public column.
                out[entry.public.decode().split(",")[0]] = entry.published.decode()
        return out

    async def read(self, topic: str, expected: int, key=None) -> dict:
        consumer = AIOKafkaConsumer(
            topic, **client_options(self.config.kafka),
            auto_offset_reset="earliest", enable_auto_commit=False,
        )  # fmt: skip
        await consumer.start()
        seen: dict = {}
        deadline = time.monotonic() + 30
        try:
            while len(seen) < expected and time.monotonic() < deadline:
                for messages in (await consumer.getmany(timeout_ms=500)).values():
                    for message in messages:
                        seen[key(message) if key else message.key] = message.value
        finally:
            await consumer.stop()
        return seen

    async def entries(self, client: aioredis.Redis) -> list[tuple[int, str | None, bytes]]:
        """(partition, token or None if pooled, entry) of every record in a pool or in flight;
        an entry is a `PoolEntry`: "public|published|audit|true|arrival|id"."""
        out: list[tuple[int, str | None, bytes]] = []
        for partition in range(self.config.partitions):
            prefix = BufferState(client, self.config).prefix(partition)
            async with client.pipeline(transaction=True) as pipe:
                pipe.hvals(f"{prefix}:pool")
                pipe.hgetall(f"{prefix}:takes")
                pool, takes = await pipe.execute()
            out += [(partition, None, entry) for entry in pool]
            out += [(partition, token, entry) for token, entry in takes_in_flight(takes)]
        return out

    async def read_all(self, topic: str, timeout: float = 60.0) -> list[ConsumerRecord]:
        """Every message of a topic, duplicates included: read past the end offsets the
        broker reports (tansu's can fall short by its last batch) until a second passes
        with nothing new."""
        consumer = AIOKafkaConsumer(
            **client_options(self.config.kafka), enable_auto_commit=False,
            auto_offset_reset="earliest",
        )  # fmt: skip
        await consumer.start()
        messages: list[ConsumerRecord] = []
        try:
            partitions = [TopicPartition(topic, p) for p in range(self.config.partitions)]
            consumer.assign(partitions)
            await consumer.seek_to_beginning(*partitions)
            end = await consumer.end_offsets(partitions)
            deadline = time.monotonic() + timeout
            quiet_since = time.monotonic()
            while [
                tp for tp in partitions if await consumer.position(tp) < end[tp]
            ] or time.monotonic() - quiet_since < 1.0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{topic}: read {len(messages)}, ends at least {end}")
                for batch in (await consumer.getmany(*partitions, timeout_ms=200)).values():
                    if batch:
                        messages += batch
                        quiet_since = time.monotonic()
        finally:
            await consumer.stop()
        return messages

    async def committed_offsets(self, topic: str, group: str) -> dict[int, int | None]:
        """The offsets consumer group `group` committed on each partition of `topic`."""
        consumer = AIOKafkaConsumer(
            **client_options(self.config.kafka), group_id=group,
            enable_auto_commit=False,
        )  # fmt: skip
        await consumer.start()
        try:
            partitions = [TopicPartition(topic, p) for p in range(self.config.partitions)]
            return {tp.partition: await consumer.committed(tp) for tp in partitions}
        finally:
            await consumer.stop()

    async def commit_offsets(
        self, topic: str, group: str, offset: int, timeout: float = 30.0
    ) -> dict[int, int | None]:
        """Commit `offset` on every partition of `topic` for consumer group `group`, as a
        standalone consumer; returns the committed offsets. The group must have no live
        member: a stopped one may hold on until its session times out, so this retries."""
        consumer = AIOKafkaConsumer(
            **client_options(self.config.kafka), group_id=group,
            enable_auto_commit=False,
        )  # fmt: skip
        await consumer.start()
        deadline = time.monotonic() + timeout
        try:
            partitions = [TopicPartition(topic, p) for p in range(self.config.partitions)]
            consumer.assign(partitions)
            while True:
                try:
                    await consumer.commit(dict.fromkeys(partitions, offset))
                    break
                except KafkaError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            return {tp.partition: await consumer.committed(tp) for tp in partitions}
        finally:
            await consumer.stop()

    async def rewind(
        self, topic: str, group: str, offset: int = 0, timeout: float = 60.0
    ) -> tuple[str, dict[int, int | None]]:
        """Commit `offset` for the stopped consumer group `group` on every partition of
        `topic`; returns how, and the committed offsets.

        A standalone commit (assign() and commit()) works once the group is empty, but
        tansu may keep a stopped Faust member and refuse it (UNKNOWN_MEMBER_ID). Then this
        joins the group under the name of Faust's assignor (a join must share the stale
        member's protocol), which waits the stale member out, and commits as the group's
        only member.
        """
        try:
            return "standalone", await self.commit_offsets(topic, group, offset, timeout=2.0)
        except KafkaError:
            pass
        consumer = AIOKafkaConsumer(
            topic, **client_options(self.config.kafka), group_id=group,
            enable_auto_commit=False, session_timeout_ms=6000, heartbeat_interval_ms=1000,
            max_poll_interval_ms=3000, rebalance_timeout_ms=3000,
            partition_assignment_strategy=(FaustNamedAssignor,),
        )  # fmt: skip
        await consumer.start()
        deadline = time.monotonic() + timeout
        try:
            while len(consumer.assignment()) < self.config.partitions:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not join {group} to rewind {topic}")
                await asyncio.sleep(0.1)
            partitions = sorted(consumer.assignment())
            await consumer.commit(dict.fromkeys(partitions, offset))
            return "as a member", {tp.partition: await consumer.committed(tp) for tp in partitions}
        finally:
            await consumer.stop()


class FaustNamedAssignor(RoundRobinPartitionAssignor):
    """Round robin under the protocol name Faust's workers join with."""

    name = "faust"


async def add_to_pool(
    client: aioredis.Redis, prefix: str, entries: Sequence[bytes], now_ms: int
) -> None:
    """Append entries to a mixing pool as the ingest steps do (service/store/lua/pool.lua):
    positions after its last, and the time it last received records."""
    size = await client.hlen(f"{prefix}:pool")
    await client.hset(f"{prefix}:pool", mapping=dict(enumerate(entries, size + 1)))
    await client.set(f"{prefix}:pooled", now_ms)


async def pool_in_draw_order(client: aioredis.Redis, prefix: str) -> list[bytes]:
    """A mixing pool's entries in the order emit.lua's draw reads its positions: from the
    last to the first."""
    pool = await client.hgetall(f"{prefix}:pool")
    return [pool[b"%d" % position] for position in range(len(pool), 0, -1)]


def buffer_steps(
    config: StreamConfig,
    rows: list[tuple[bytes, bytes]],
    per_step: int,
    step_ms: int,
    ticks: int,
    stored_again: int = 0,
) -> list[tuple[int, int, PreparedBatch | None, int]]:
    """The buffer steps of `rows` on a virtual clock, as (partition, now, batch, highest raw
    offset): `per_step` records spread over the partitions every `step_ms`, then `ticks`
    rounds of a tick per partition, max_wait apart, as time goes on without records. With
    `stored_again`, every that many steps' batches are stored twice, as a redelivered
    fetch is."""
    preparer = Preparer(config, config.service_key())
    offsets = [0] * config.partitions
    now, steps = 1_000_000, []
    for number, start in enumerate(range(0, len(rows), per_step)):
        messages = []
        for k, v in rows[start : start + per_step]:
            partition = len(messages) % config.partitions
            messages.append(RawMessage(partition, offsets[partition], k, v))
            offsets[partition] += 1
        batches, rejected = preparer.prepare(messages)
        assert not rejected
        for batch in batches:
            times = 2 if stored_again and number % stored_again == 0 else 1
            steps += [(batch.partition, now, batch, offsets[batch.partition] - 1)] * times
        now += step_ms
    for _ in range(ticks):
        now += int(config.max_wait * 1000)
        steps += [(p, now, None, -1) for p in range(config.partitions)]
    return steps


def adult_rows(config: StreamConfig, start: int = 0) -> list[tuple[bytes, bytes]]:
    """RECORDS Adult records from the `start`-th on as (key, JSON) in the stream's
    schema, keyed r<number>."""
    names = [n for n in config.schema.names if n != "row"]
    with open_sample() as stream:
        rows = list(itertools.islice(csv.DictReader(stream), start, start + RECORDS))
    row = {"row"} & set(config.schema.names)
    return [
        (
            f"r{i}".encode(),
            json.dumps({**dict.fromkeys(row, str(i)), **{n: record[n] for n in names}}).encode(),
        )
        for i, record in enumerate(rows, start=start)
    ]


class GroupedHops:
    """A personal stream's two hops without Kafka (`streams.runtime.app.add_ingest`): each record of
    a raw batch goes to the partition of its group, as the worker keys it, at the next
    offset there, and is stored in that partition's buffer."""

    def __init__(self, buffer: StreamBuffer) -> None:
        self.buffer = buffer
        self.offsets: Counter[int] = Counter()

    async def store(self, batch: PreparedBatch, now: int) -> dict[int, IngestOutcome]:
        """The outcome of each grouped partition the batch reached."""
        by_partition: dict[int, list[tuple[int, bytes]]] = {}
        for key, value in self.buffer.grouped_messages(batch):
            partition = partition_of(key, self.buffer.config.partitions)
            by_partition.setdefault(partition, []).append((self.offsets[partition], value))
            self.offsets[partition] += 1
        return {
            partition: await self.buffer.ingest_grouped(partition, messages, now)
            for partition, messages in sorted(by_partition.items())
        }
