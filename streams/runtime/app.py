"""What every stream process shares: its Faust app and Kafka producer, its Redis client
and the cluster's map, retries through outages, and the health pages."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import faust
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from faust.web import Request, Response, View
from mode import Service
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.core.config import KafkaSettings, StreamConfig
from service.store.buffer import ReplicationError, connect
from streams.runtime.faust_adapter import fill_batch
from streams.runtime.kafka import client_options, faust_options

log = logging.getLogger("splu.stream")

RETRY_CEILING = 5.0  # seconds between retries while Redis or Kafka is away
# Failures of Redis or Kafka that end by themselves; anything else is a bug. A cluster
# client that reaches no node of its map while a master fails over raises
# RedisClusterException, which is no RedisError.
TRANSIENT = (RedisError, RedisClusterException, KafkaError, OSError, asyncio.TimeoutError)
# Errors whose text says which node or key failed and how, and never quotes a command's
# arguments (records, in the ingest step), as some RedisClusterException texts do.
_TELLING = (RedisConnectionError, RedisTimeoutError, ReplicationError, OSError)


def now_ms() -> int:
    return int(time.time() * 1000)


def describe(err: BaseException) -> str:
    """An error for a log line: its type, then the errors that caused it, with the text of
    those that name a node or key and why it failed (`_TELLING`), e.g. "RedisClusterException,
    caused by AuthenticationError: invalid username-password pair or user is disabled."."""
    parts = []
    cause: BaseException | None = err
    while cause is not None:
        text = f": {cause}" if isinstance(cause, _TELLING) and str(cause) else ""
        parts.append(type(cause).__name__ + text)
        # The chain a traceback would show.
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return ", caused by ".join(parts)


async def retrying(what: str, call, *args: object):  # type: ignore[no-untyped-def]
    """Await call(*args) until it succeeds: a batch in hand must wait out an outage."""
    delay = 0.1
    while True:
        try:
            return await call(*args)
        except TRANSIENT as err:
            log.warning("%s failed (%s); retrying in %.1f s", what, describe(err), delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_CEILING)


class Publisher(Service):
    """A plain aiokafka producer: batches of sends, then one wait for every ack.

    tansu has no idempotent producer, so idempotence is off; duplicates after a
    retry carry the same token and consumers drop them.

    It sends uncompressed: the worker is the pipeline's busiest process, and the published
    topic's readers may run any client. A topic's `compression.type` has the broker store
    it compressed (README, Producing).
    """

    def __init__(self, kafka: KafkaSettings, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.kafka = kafka
        self.producer: AIOKafkaProducer | None = None

    async def on_start(self) -> None:
        self.producer = AIOKafkaProducer(
            **client_options(self.kafka),
            enable_idempotence=False,
            acks="all",
            linger_ms=5,
            max_batch_size=512 * 1024,
        )
        await self.producer.start()

    async def on_stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def send_all(
        self,
        topic: str,
        messages: Iterable[tuple[bytes | None, bytes]],
        timestamp_ms: int | None = None,
    ) -> int:
        """Send messages in batches and await every ack: a keyed message to the partition of
        its key (`partition_of`), an unkeyed one round-robin.

        Published records are keyed by their token, drawn fresh from the OS per take, so
        their partition says nothing about their group, and a record re-sent after a crash
        lands where it landed before: a consumer's dedup per partition sees both copies.
        `timestamp_ms`, if given, stamps every message alike: one time per take, never one
        per record.
        """
        assert self.producer is not None, "the publisher starts with the app"
        count = len(await self.producer.partitions_for(topic))
        pairs = list(messages)
        keys = [key for key, _ in pairs]
        if None in keys:
            partitions = [
                sent % count if key is None else partition_of(key, count)
                for sent, key in enumerate(keys, start=1)
            ]
        else:
            partitions = partitions_of(keys, count)  # type: ignore[arg-type]
        queues: dict[int, list[tuple[bytes | None, bytes]]] = {}
        for pair, partition in zip(pairs, partitions, strict=True):
            queues.setdefault(partition, []).append(pair)
        futures = []
        for partition, queued in queues.items():
            while queued:
                batch = self.producer.create_batch()
                queued = queued[fill_batch(batch, queued, timestamp_ms) :]
                futures.append(await self.producer.send_batch(batch, topic, partition=partition))
        await asyncio.gather(*futures)
        return len(pairs)


class ClusterMap(Service):
    """Reads the Redis Cluster's map (its nodes and their slots) into a cluster client as
    the app starts, before it consumes or serves anything.

    A cluster client knows only the node its URL names until its first command reads the
    map from that node; from then on every node of the map is one it can ask. A process
    whose first command comes late (a consumer counts nothing before records are
    published, hours in a slow stream) and finds that one node failed over and down knows
    no other node to ask: it fails every command until that node is back.
    """

    def __init__(self, client: aioredis.Redis, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.client = client

    async def on_start(self) -> None:
        if not isinstance(self.client, aioredis.RedisCluster):
            return
        try:
            await self.client.initialize()
        except TRANSIENT as err:
            # As without this service: the first command reads the map.
            log.warning("reading the Redis Cluster's map failed (%s)", describe(err))


def redis_client(app: faust.App, config: StreamConfig) -> aioredis.Redis:
    """The app's client of the stream's Redis (`service.store.buffer.connect`); in a cluster it
    reads the cluster's map as the app starts (`ClusterMap`)."""
    client = connect(config)
    app.add_dependency(ClusterMap(client, loop=app.loop))
    return client


def stream_topic(app: faust.App, config: StreamConfig, kind: str) -> faust.TopicT:
    """The stream's `kind` topic (raw, grouped, published...) with its partitions, as bytes:
    each agent decodes what it reads itself."""
    return app.topic(
        config.topics[kind], partitions=config.partitions, value_serializer="raw",
        key_serializer="raw",
    )  # fmt: skip


def app_publisher(app: faust.App, config: StreamConfig) -> Publisher:
    """A producer that starts and stops with the app."""
    publisher = Publisher(config.kafka, loop=app.loop)
    app.add_dependency(publisher)
    return publisher


def partition_of(key: bytes, partitions: int) -> int:
    """The partition of a keyed message: CRC-32 of the key modulo the partition count."""
    return zlib.crc32(key) % partitions


def partitions_of(keys: list[bytes], partitions: int) -> list[int]:
    """`partition_of` each key, by one C loop over the keys rather than a call per key."""
    return [crc % partitions for crc in map(zlib.crc32, keys)]


def faust_app(
    config: StreamConfig,
    name: str,
    datadir: Path,
    web: tuple[str, int] | None = None,
    fetch_records: int | None = None,
) -> faust.App:
    """A Faust app with the settings every process of a stream uses.

    Short rebalance and session timeouts keep group joins and failovers to a
    few seconds (tansu, tests); topics are never declared by Faust, because
    the stream's partition count is created explicitly (`streams/runtime/topics.py`).
    `web` (host, port) serves the app's own pages and no Faust debug pages.
    `fetch_records` caps a fetch (default: the stream's batch_size). Every topic is
    consumed whole (`streams.runtime.bulk`), so Faust's per-message stream settings (commit
    counts, stream buffers, the monitor's per-message hooks) play no part.
    """
    web_settings: dict = {"web_enabled": False}
    if web is not None:
        host, port = web
        web_settings = {
            "web_enabled": True, "web_bind": host, "web_host": host, "web_port": port,
            "web_router_enabled": False, "web_tables_enabled": False,
            "web_stats_enabled": False, "web_graph_enabled": False,
        }  # fmt: skip
    return faust.App(
        name,
        **faust_options(config.kafka),
        value_serializer="raw",
        key_serializer="raw",
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        topic_allow_declare=False,
        topic_disable_leader=True,
        broker_rebalance_timeout=3,
        broker_session_timeout=6,
        broker_heartbeat_interval=1,
        broker_max_poll_records=fetch_records or config.batch_size,
        # `streams.runtime.bulk.GuardedRecords` checks every fetched batch's CRC itself,
        # standing in for a bad batch rather than raising: a second check is only cost.
        broker_check_crcs=False,
        store="memory://",
        datadir=datadir,
        loghandlers=[],
        **web_settings,
    )


READINESS_TIMEOUT = 2.0  # seconds Redis and Kafka each get to answer /readyz


async def readiness(
    app: faust.App, topic: faust.TopicT, client: Any, publisher: Publisher
) -> list[str]:
    """What keeps this process from doing its work now; empty when ready: Redis answers,
    a Kafka broker answers, and some partitions of `topic` are assigned to it."""
    problems = []
    try:
        await asyncio.wait_for(client.ping(), READINESS_TIMEOUT)
    except Exception as err:  # any failure means not ready; the name says which
        problems.append(f"Redis does not answer ({type(err).__name__})")
    if publisher.producer is None:
        problems.append("the Kafka producer has not started")
    else:
        try:
            await asyncio.wait_for(
                publisher.producer.client.fetch_all_metadata(), READINESS_TIMEOUT
            )
        except Exception as err:
            problems.append(f"no Kafka broker answers ({type(err).__name__})")
    if not assigned_partitions(app, topic):
        problems.append(
            f"no partition of {topic.get_topic_name()} is assigned: the group is joining, or "
            "more processes than partitions share it"
        )
    return problems


def add_health_pages(
    app: faust.App, topic: faust.TopicT, client: Any, publisher: Publisher
) -> None:
    """/healthz: the process is alive and its event loop turns; it checks no dependency, so
    a Redis or Kafka outage does not become a restart storm. /readyz: 200 when `readiness`
    finds nothing wrong, else 503 with the problems."""

    @app.page("/healthz")
    class Alive(View):
        async def get(self, request: Request) -> Response:
            return self.json({"alive": True})

    @app.page("/readyz")
    class Ready(View):
        async def get(self, request: Request) -> Response:
            problems = await readiness(app, topic, client, publisher)
            return self.json(
                {"ready": not problems, "problems": problems}, status=503 if problems else 200
            )


def assigned_partitions(app: faust.App, raw: faust.TopicT) -> set[int]:
    """The partitions of `raw` (or any topic) this worker owns now."""
    return {tp.partition for tp in app.consumer.assignment() if tp.topic == raw.get_topic_name()}
