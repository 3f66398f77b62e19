"""The stream's public manifest on ``<stream>.manifest`` (`service.core.manifest`): written by the
first worker before anything is published, checked by every worker and consumer.

A stream's parameters are fixed for its life. A worker whose config yields another
manifest than the stream's refuses to start, before it consumes a raw record, saying what
changed and how to start a new stream; so every record on ``<stream>.published`` was
randomized under the one manifest on the topic, and a downstream reader needs no versions.

Workers of a stream start concurrently (scale-out), possibly with different configs by
mistake. The manifest's bytes follow from the config alone, so equal configs write equal
manifests. Which manifest a stream has is decided in Redis, by one SET NX of
``splu:{<stream>}:manifest``: the first worker's manifest stays, and a worker with another
one refuses even if no manifest reached the topic yet. The topic's manifest is checked first,
so a Redis that lost the key cannot let a different manifest in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord

from service.core.config import KafkaSettings, StreamConfig
from service.core.manifest import (
    MANIFEST_CONFIG,
    MANIFEST_KEY,
    MANIFEST_PARTITIONS,
    Manifest,
    ManifestError,
    manifest_topic,
)
from service.store.buffer import connect
from streams.runtime.kafka import CONFIG_HINT, client_options, start_client
from streams.runtime.topics import existing_topics

# Seconds a read may go without a record while positions are still short of the end offsets.
# The largest manifest a worker sends (before compression); the broker's own limit (1 MB
# by default) applies to the compressed message.
MANIFEST_MAX_BYTES = 32 * 1024 * 1024
STALL_TIMEOUT = 30.0


class ManifestConflictError(ValueError):
    """A process's config yields another manifest than the stream's."""


def manifest_topics(config: StreamConfig) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """The manifest topic with its partition count, and its settings, for `create_topics`."""
    topic = manifest_topic(config.name)
    return {topic: MANIFEST_PARTITIONS}, {topic: dict(MANIFEST_CONFIG)}


async def read_to_end(
    kafka: KafkaSettings,
    topic: str,
    partitions: int,
    on_batch: Callable[[list[ConsumerRecord]], None] | None = None,
) -> list[ConsumerRecord]:
    """Every record of `topic` from its beginning through the end offsets the broker reports
    when the read starts, with no consumer group; `on_batch(records)`, if given, takes each
    fetch instead of the returned list (which is then empty).

    tansu reports as a partition's end the offset of its last batch's first record plus one;
    the fetch that reaches that offset brings the whole batch, so reading until each position
    passes its end offset misses nothing the partition held when the read started.
    """
    consumer = await start_client(
        AIOKafkaConsumer(
            **client_options(kafka), enable_auto_commit=False, auto_offset_reset="earliest"
        ),
        kafka,
    )
    records: list[ConsumerRecord] = []
    try:
        assigned = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        end = await consumer.end_offsets(assigned)
        waiting = [tp for tp in assigned if await consumer.position(tp) < end[tp]]
        progress = time.monotonic()
        while waiting:
            for batch in (await consumer.getmany(*waiting, timeout_ms=500)).values():
                if batch:
                    progress = time.monotonic()
                    if on_batch is None:
                        records += batch
                    else:
                        on_batch(batch)
            waiting = [tp for tp in waiting if await consumer.position(tp) < end[tp]]
            if waiting and time.monotonic() - progress > STALL_TIMEOUT:
                short = {tp.partition: end[tp] for tp in waiting}
                raise TimeoutError(
                    f"{topic}: no records for {STALL_TIMEOUT:g} s before the end offsets {short}"
                )
    finally:
        await consumer.stop()
    return records


async def read_manifest(
    kafka: KafkaSettings, stream: str, hint: str = CONFIG_HINT
) -> Manifest | None:
    """The stream's manifest, or None if its topic is missing or holds none yet.

    Every record of the topic must hold the same manifest (workers write only the stream's
    own); the topic is never created here, because asking a tansu broker for a missing
    topic's records creates it with 4 partitions.
    """
    topic = manifest_topic(stream)
    partitions = (await existing_topics(kafka, hint)).get(topic)
    if partitions is None:
        return None
    found = {r.value for r in await read_to_end(kafka, topic, partitions) if r.value}
    manifests = {m.digest: m for m in map(Manifest.from_json, found)}
    if len(manifests) > 1:
        raise ManifestError(
            f"{topic} holds {len(manifests)} different manifests: {sorted(manifests)}"
        )
    return next(iter(manifests.values()), None)


def _refusal(config: StreamConfig, theirs: Manifest, mine: Manifest, where: str) -> str:
    changes = "; ".join(theirs.changes(mine))
    return (
        f"stream {config.name!r} was started with other parameters ({where}): {changes}. A "
        "stream keeps its parameters for life, because readers debias all its records with "
        "one manifest. Start with the stream's parameters again, or publish under the new "
        "ones as a new stream: set stream.name to a new name in the config (its topics and "
        "Redis keys are new) and produce to it. Nothing was consumed or published"
    )


async def claim_manifest(config: StreamConfig) -> None:
    """Make sure the stream's manifest is this config's, before the worker consumes a raw
    record: write it if the stream has none, raise ManifestConflictError if it has another."""
    mine = Manifest.of_config(config)
    published = await read_manifest(config.kafka, config.name)
    if published is not None:
        if published.digest != mine.digest:
            raise ManifestConflictError(
                _refusal(config, published, mine, f"its manifest on {manifest_topic(config.name)}")
            )
        return
    key = f"splu:{{{config.name}}}:manifest"
    client = connect(config)
    try:
        await client.set(key, mine.to_json(), nx=True)
        held = Manifest.from_json(await client.get(key))
    finally:
        await client.aclose()
    if held.digest != mine.digest:
        raise ManifestConflictError(
            _refusal(config, held, mine, f"claimed in Redis at {key} by another worker")
        )
    # Compressed: a schema's domains (a sequence or id column, say) can make the manifest
    # larger than the broker's 1 MB message limit in plain text, rarely after gzip.
    producer = AIOKafkaProducer(
        **client_options(config.kafka), enable_idempotence=False, acks="all",
        compression_type="gzip", max_request_size=MANIFEST_MAX_BYTES,
    )  # fmt: skip
    await start_client(producer, config.kafka)
    try:
        # Workers that won the claim together write the same bytes; compaction keeps one.
        await producer.send_and_wait(
            manifest_topic(config.name), mine.to_json(), key=MANIFEST_KEY, partition=0
        )
    except MessageSizeTooLargeError:
        raise ManifestError(
            f"the manifest of stream {config.name!r} is {len(mine.to_json()):,} bytes, more "
            "than Kafka takes in one message even compressed: its schema's domains are too "
            "large to publish (bin a numeric column, or drop an id-like column)"
        ) from None
    finally:
        await producer.stop()


async def check_manifest(config: StreamConfig) -> None:
    """Raise ManifestConflictError if the stream has a manifest other than this config's:
    a consumer reading the stream with other parameters would answer wrongly."""
    published = await read_manifest(config.kafka, config.name)
    mine = Manifest.of_config(config)
    if published is not None and published.digest != mine.digest:
        raise ManifestConflictError(
            _refusal(config, published, mine, f"its manifest on {manifest_topic(config.name)}")
        )
