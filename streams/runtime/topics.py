"""Creating a stream's topics explicitly, with the partition counts its config names."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from service.core.config import KafkaSettings
from streams.runtime.kafka import CONFIG_HINT, BrokerRefusedError, client_options, start_client

T = TypeVar("T")
# Copies per partition on a cluster that has the brokers for it.
REPLICATION = 3
END_READ = 5.0  # seconds `end_offsets` may read past the end a broker reports


class TopicMismatchError(ValueError):
    """A stream's topic exists with another partition count than its config names."""


async def create_topics(
    kafka: KafkaSettings,
    topics: Mapping[str, int],
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Create the missing topics with the given partition counts (and `configs`, topic
    settings by topic name); check the partition counts of those that exist.

    Topics are created explicitly because tansu, and Kafka with auto-creation on, silently
    create a topic with a default partition count (4 for tansu) the first time a client asks
    for its metadata. The partition count decides how many workers share a stream and how the
    Redis keys are tagged, so an existing topic with another count raises ValueError instead
    of being used. A topic created by someone else meanwhile is fine (idempotent).
    """
    admin = await _admin(kafka)
    try:
        existing = await _partition_counts(admin)
        wrong = {
            name: existing[name]
            for name, partitions in topics.items()
            if name in existing and existing[name] != partitions
        }
        if wrong:
            counts = ", ".join(f"{n} has {p}, wanted {topics[n]}" for n, p in wrong.items())
            raise TopicMismatchError(
                f"topics exist with other partition counts ({counts}) at {kafka.bootstrap}: set "
                "stream.partitions to their count, or delete them if they hold nothing you "
                "need (kafka-topics.sh --delete --topic NAME) and start again"
            )
        missing = [name for name in topics if name not in existing]
        if not missing:
            return
        replicas = min(REPLICATION, len((await admin.describe_cluster())["brokers"]))
        response = await admin.create_topics(
            [
                NewTopic(n, topics[n], replicas, topic_configs=dict((configs or {}).get(n, {})))
                for n in missing
            ]
        )
    finally:
        await admin.close()
    for result in response.to_object()["topic_errors"]:
        error = kafka_errors.for_code(result["error_code"])
        if error in (kafka_errors.TopicAuthorizationFailedError,
                     kafka_errors.ClusterAuthorizationFailedError):  # fmt: skip
            raise BrokerRefusedError(
                f"topic {result['topic']} does not exist at {kafka.bootstrap} or is not visible "
                f"to {kafka.username or 'this client'}, which may not create it: have the "
                "admin create the stream's topics and grant this role its ACLs (docs/security.md: "
                "the ACL table)"
            )
        if error not in (kafka_errors.NoError, kafka_errors.TopicAlreadyExistsError):
            raise error(f"creating topic {result['topic']}: {result['error_message']}")


async def end_offsets(
    kafka: KafkaSettings, topic: str, partitions: Iterable[int]
) -> dict[int, int]:
    """Each partition's end offset: the offset the next record written there will get.

    The embedded broker reports a partition's end short of its last batch (the batch's
    first offset plus one), so the records past the reported end are read as well, until
    a fetch finds none (at most END_READ seconds while producers keep writing)."""
    consumer = await start_client(
        AIOKafkaConsumer(**client_options(kafka), enable_auto_commit=False, fetch_max_wait_ms=100),
        kafka,
    )
    try:
        wanted = [TopicPartition(topic, p) for p in partitions]
        reported = await consumer.end_offsets(wanted)
        consumer.assign(wanted)
        for tp in wanted:
            consumer.seek(tp, reported[tp])
        deadline = time.monotonic() + END_READ
        while time.monotonic() < deadline:
            fetched = await consumer.getmany(*wanted, timeout_ms=200)
            if not any(fetched.values()):
                break
        return {tp.partition: max(reported[tp], await consumer.position(tp)) for tp in wanted}
    finally:
        await consumer.stop()


async def existing_topics(kafka: KafkaSettings, hint: str = CONFIG_HINT) -> dict[str, int]:
    """Every topic this client may see at the brokers with its partition count; `hint`
    ends the error if no broker answers."""
    admin = await _admin(kafka, hint)
    try:
        return await _partition_counts(admin)
    finally:
        await admin.close()


async def _admin(kafka: KafkaSettings, hint: str = CONFIG_HINT) -> AIOKafkaAdminClient:
    """A started admin client, or a one-line error ending with `hint` (`start_client`)."""
    return await start_client(AIOKafkaAdminClient(**client_options(kafka)), kafka, hint)


async def _partition_counts(admin: AIOKafkaAdminClient) -> dict[str, int]:
    # All topics: asking for named ones would auto-create them on tansu.
    return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics()}


def run_in_thread(step: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end for a sync caller, in a thread of its own: the caller's
    thread may already run an event loop (async tests), or be about to get one that
    asyncio.run would leave unset (a Faust worker)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, step).result()
