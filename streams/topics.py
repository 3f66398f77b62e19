"""Creating a stream's topics explicitly, with the partition counts its config names."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

# Copies per partition on a cluster that has the brokers for it.
REPLICATION = 3


async def create_topics(bootstrap: str, topics: Mapping[str, int]) -> None:
    """Create the missing topics with the given partition counts; check those that exist.

    Topics are created explicitly because tansu, and Kafka with auto-creation on, silently
    create a topic with a default partition count (4 for tansu) the first time a client asks
    for its metadata. The partition count decides how many workers share a stream and how the
    Redis keys are tagged, so an existing topic with another count raises ValueError instead
    of being used. A topic created by someone else meanwhile is fine (idempotent).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        # All topics: asking for named ones would auto-create them on tansu.
        existing = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics()}
        wrong = {
            name: existing[name]
            for name, partitions in topics.items()
            if name in existing and existing[name] != partitions
        }
        if wrong:
            raise ValueError(
                "topics exist with other partition counts: "
                + ", ".join(f"{n} has {p}, wanted {topics[n]}" for n, p in wrong.items())
            )
        brokers = len((await admin.describe_cluster())["brokers"])
        replicas = min(REPLICATION, brokers)
        missing = [NewTopic(n, p, replicas) for n, p in topics.items() if n not in existing]
        if not missing:
            return
        response = await admin.create_topics(missing)
    finally:
        await admin.close()
    for result in response.to_object()["topic_errors"]:
        error = kafka_errors.for_code(result["error_code"])
        if error not in (kafka_errors.NoError, kafka_errors.TopicAlreadyExistsError):
            raise error(f"creating topic {result['topic']}: {result['error_message']}")


def create_topics_sync(bootstrap: str, topics: Mapping[str, int]) -> None:
    """create_topics for sync callers, in a thread of its own: the caller's thread may
    already run an event loop (async tests, the stream worker)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, create_topics(bootstrap, topics)).result()
