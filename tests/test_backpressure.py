"""Backpressure: a full buffer pauses consumption of the raw topic; time frees it again.

A decoy stream (γ = 5) gets records of only three occupations: no group of five distinct
values can ever be cut, so every record waits in Redis until max_wait suppresses it. With
more records than the buffers hold (BUFFER_CAP per partition), the worker must stop taking
records from Kafka while a partition is full (they stay uncommitted there, not dropped, and
Redis does not grow past the cap), and take the next ones once the waiting records expire,
until every record has been ingested and suppressed.

Why a partition can exceed the cap by at most one batch: the ingest agent checks each
partition a batch touched after storing it and, while one is at the cap, ingests nothing
at all; so a partition under the cap receives at most one more batch before the next check.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import math
import time
import tomllib
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
import tomli_w
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition
from harness import Harness

from service.core.config import load_config
from service.core.table import open_sample
from service.store.buffer import BufferState
from streams.runtime.topics import create_topics
from streams.tools.produce import produce
from streams.worker.app import TICK_INTERVAL

# Whole stream processes on the embedded servers; run once, not again on Debian's Redis.
pytestmark = pytest.mark.stream

BUFFER_CAP = 1000  # pending records per partition before ingest pauses
PARTITIONS = 2
BATCH_SIZE = 250  # raw records per batch: the most a partition can exceed the cap by
MAX_WAIT = 6.0  # seconds; long against a batch's ingest time, so a pause is plain to see
RECORDS = 4000  # twice what the two buffers hold together
# Fewer than γ = 5 distinct values: these records can never form a group.
OCCUPATIONS = ("Craft-repair", "Prof-specialty", "Exec-managerial")
SAMPLE_EVERY = 0.05  # seconds between observations
JOIN_TIMEOUT = 60.0  # seconds for the worker to join its group and ingest a first record


@dataclass(frozen=True)
class Sample:
    done: float  # wall time (time.time()) when every read of this sample had completed
    committed: int  # raw offsets the worker committed, summed over partitions
    pending: tuple[int, ...]  # per partition
    ingested: int
    suppressed: int
    published: int
    pool: int
    oldest: float | None  # arrival (s) of the oldest pending record, over partitions

    @property
    def capped(self) -> bool:
        return max(self.pending) >= BUFFER_CAP

    @property
    def lag(self) -> int:
        """Produced records not yet committed by the worker: still in Kafka for it."""
        return RECORDS - self.committed


def uncountable_records(names: list[str]) -> list[tuple[bytes, bytes]]:
    """The first RECORDS Adult records with one of three occupations, in file order."""
    with open_sample() as stream:
        rows = itertools.islice(
            (r for r in csv.DictReader(stream) if r["occupation"] in OCCUPATIONS), RECORDS
        )
        return [
            (f"bp{i}".encode(), json.dumps({n: row[n] for n in names}).encode())
            for i, row in enumerate(rows)
        ]


def capped_harness(servers, directory) -> Harness:
    harness = Harness(servers, directory, "adult-decoy.toml", row_column=False)
    document = tomllib.loads(harness.path.read_text())
    assert document["decoy"]["gamma"] == 5
    document["stream"].update(
        partitions=PARTITIONS, buffer_cap=BUFFER_CAP, batch_size=BATCH_SIZE, max_wait=MAX_WAIT
    )
    harness.path.write_text(tomli_w.dumps(document))
    harness.config = load_config(harness.path)
    return harness


async def observe(harness: Harness, deadline: float) -> list[Sample]:
    """Sample the raw group's committed offsets, then the buffers, until all is suppressed."""
    config = harness.config
    client = aioredis.from_url(config.redis_url)
    state = BufferState(client, config)
    admin = AIOKafkaAdminClient(bootstrap_servers=config.kafka.bootstrap)
    await admin.start()
    raw = [TopicPartition(config.topics["raw"], p) for p in range(config.partitions)]
    samples: list[Sample] = []
    try:
        while time.monotonic() < deadline:
            # Offsets first: an offset committed before the buffer was read must be in it.
            offsets = await admin.list_consumer_group_offsets(f"splu-{config.name}", partitions=raw)
            stats = [await state.stats(p) for p in range(config.partitions)]
            oldest = [
                await client.zrange(f"{state.prefix(p)}:t", 0, 0, withscores=True)
                for p in range(config.partitions)
            ]
            arrivals = [entries[0][1] / 1000 for entries in oldest if entries]
            sample = Sample(
                done=time.time(),
                committed=sum(max(offsets[tp].offset, 0) for tp in raw if tp in offsets),
                pending=tuple(s["pending"] for s in stats),
                ingested=sum(s.get("ingested", 0) for s in stats),
                suppressed=sum(s.get("suppressed", 0) for s in stats),
                published=sum(s.get("published", 0) for s in stats),
                pool=sum(s["pool"] for s in stats),
                oldest=min(arrivals) if arrivals else None,
            )
            samples.append(sample)
            if sample.suppressed == RECORDS and sample.committed == RECORDS:
                break
            await asyncio.sleep(SAMPLE_EVERY)
    finally:
        await admin.close()
        await client.aclose()
    return samples


def test_full_buffer_pauses_consumption_and_time_resumes_it(servers, tmp_path):
    harness = capped_harness(servers, tmp_path)
    config = harness.config
    messages = uncountable_records(config.schema.names)
    assert len(messages) == RECORDS
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    assert asyncio.run(produce(config, iter(messages), progress=False)) == RECORDS
    # A guard against a stuck worker, not a pace: the worker takes about one buffer's worth
    # (BUFFER_CAP) per pause, and a pause lasts until its oldest records expire (max_wait,
    # noticed within a tick); twice that many pauses are allowed.
    pauses = 2 * math.ceil(RECORDS / BUFFER_CAP)
    deadline = time.monotonic() + JOIN_TIMEOUT + pauses * (MAX_WAIT + TICK_INTERVAL)
    harness.start_worker()
    try:
        samples = asyncio.run(observe(harness, deadline))
    finally:
        harness.stop()
    last = samples[-1]
    log = harness.log.read_text(errors="replace")[-2000:] if harness.log.exists() else ""

    # Resumed until every record is accounted for: all ingested once, all suppressed (no
    # group can be cut), nothing left waiting, and every raw offset committed.
    assert last.ingested == RECORDS, (last, log)
    assert last.suppressed == RECORDS and last.published == 0, last
    assert sum(last.pending) == 0 and last.pool == 0, last
    assert last.committed == RECORDS, last

    # Bounded: no partition ever holds more than the cap plus one batch.
    assert max(max(s.pending) for s in samples) <= BUFFER_CAP + BATCH_SIZE
    capped = [s for s in samples if s.capped]
    assert capped, "the buffer never reached its cap"

    # Not dropped: Kafka has offsets committed only for records Redis holds (or held), and
    # while a buffer is full the records not yet ingested wait in Kafka, uncommitted.
    assert all(s.committed <= s.ingested for s in samples)
    assert all(s.lag > 0 for s in capped if s.ingested < RECORDS)

    # Paused: from the first time a partition is full until its oldest record can expire
    # (max_wait after its arrival), nothing is ingested beyond the batch then being stored,
    # and the rest of the records stay in Kafka.
    first = capped[0]
    assert first.suppressed == 0 and first.oldest is not None, first
    expiry = first.oldest + MAX_WAIT
    held = [s for s in samples if first.done <= s.done < expiry]
    assert len(held) > 1, "no samples while the buffer was full"
    assert all(s.ingested <= first.ingested + BATCH_SIZE for s in held)
    assert all(s.lag >= RECORDS - first.ingested - BATCH_SIZE > 0 for s in held)


POOL_FLOOR = 100  # records each partition's mixing pool keeps back


def test_a_paused_stream_caps_its_mixing_pool_and_publishes_it_all_after(servers, tmp_path):
    """While the privacy tests hold publication (fail-closed pause), groups still form and
    their records pile up in the mixing pools: the cap counts pooled records too, so ingest
    stops and the rest waits in Kafka; lifting the pause publishes every pooled record."""
    harness = capped_harness(servers, tmp_path)
    document = tomllib.loads(harness.path.read_text())
    document["stream"].update(mixing_pool=POOL_FLOOR, max_wait=60.0)
    harness.path.write_text(tomli_w.dumps(document))
    config = harness.config = load_config(harness.path)
    with open_sample() as stream:
        rows = itertools.islice(csv.DictReader(stream), RECORDS)
        messages = [
            (f"pp{i}".encode(), json.dumps({n: row[n] for n in config.schema.names}).encode())
            for i, row in enumerate(rows)
        ]

    async def observe_once() -> tuple[list[dict[str, int]], int]:
        """Each partition's counters and gauges, and the raw offsets the worker committed."""
        client = aioredis.from_url(config.redis_url)
        state = BufferState(client, config)
        admin = AIOKafkaAdminClient(bootstrap_servers=config.kafka.bootstrap)
        await admin.start()
        raw = [TopicPartition(config.topics["raw"], p) for p in range(config.partitions)]
        try:
            offsets = await admin.list_consumer_group_offsets(f"splu-{config.name}", partitions=raw)
            stats = [await state.stats(p) for p in range(config.partitions)]
        finally:
            await admin.close()
            await client.aclose()
        return stats, sum(max(offsets[tp].offset, 0) for tp in raw if tp in offsets)

    def held(stats: list[dict[str, int]]) -> list[int]:
        return [s["pending"] + s["pool"] + s.get("in_flight", 0) for s in stats]

    def total(stats: list[dict[str, int]], name: str) -> int:
        return sum(s.get(name, 0) for s in stats)

    async def pause(reason: str | None) -> None:
        client = aioredis.from_url(config.redis_url)
        await BufferState(client, config).pause(reason)
        await client.aclose()

    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    asyncio.run(pause("adversary test failed (test)"))
    assert asyncio.run(produce(config, iter(messages), progress=False)) == RECORDS
    harness.start_worker()
    try:
        # Paused: a buffer fills to the cap, mostly with pooled records, and ingest stops
        # (the one ingest agent waits while any partition is full).
        deadline = time.monotonic() + JOIN_TIMEOUT
        while time.monotonic() < deadline:
            stats, committed = asyncio.run(observe_once())
            assert total(stats, "published") == 0
            if max(held(stats)) >= BUFFER_CAP:
                break
            time.sleep(SAMPLE_EVERY * 4)
        time.sleep(3 * TICK_INTERVAL)
        stats, committed = asyncio.run(observe_once())
        assert max(held(stats)) >= BUFFER_CAP, f"no buffer reached the cap: {stats}"
        assert max(held(stats)) <= BUFFER_CAP + BATCH_SIZE, stats
        assert total(stats, "ingested") <= config.partitions * (BUFFER_CAP + BATCH_SIZE), stats
        assert total(stats, "pool") > total(stats, "pending"), stats
        assert total(stats, "published") == 0 and committed < RECORDS

        # Released: the pools empty (a quiet pool at its floor leaves whole), every offset
        # is committed, and every record is published or still waits for its group.
        asyncio.run(pause(None))
        deadline = time.monotonic() + JOIN_TIMEOUT
        while time.monotonic() < deadline:
            stats, committed = asyncio.run(observe_once())
            if committed == RECORDS and total(stats, "pool") + total(stats, "in_flight") == 0:
                break
            time.sleep(SAMPLE_EVERY * 4)
    finally:
        harness.stop()
    assert committed == RECORDS and total(stats, "ingested") == RECORDS, stats
    assert total(stats, "pool") + total(stats, "in_flight") == 0, stats
    resolved = total(stats, "published") + total(stats, "suppressed")
    assert resolved + total(stats, "pending") == RECORDS, stats
