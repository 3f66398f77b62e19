"""The bulk path (`streams.runtime.bulk`): a worker that dies after Redis stored a fetch and before
its offsets were committed loses nothing and randomizes nothing twice.

The worker ends at a fault point (`fault_points`: after handling its
third fetch of the topic Redis stores from, before committing it), so Redis holds records
whose offsets the group never committed. A second worker reads them again from the
committed offsets: the buffer recognises every one (`replayed`), and each record is
published once, under one token, or suppressed.
"""

from __future__ import annotations

import asyncio
import json
import time

import fault_points
import pytest
import redis.asyncio as aioredis
from harness import RECORDS, TIMEOUT, Harness, adult_rows

from deploy.embedded import spawn_worker
from service.core.prf import ServiceKey
from streams.runtime.bulk import FETCH_MAX_WAIT_MS
from streams.runtime.topics import create_topics
from streams.tools.produce import produce
from streams.worker.app import create_app

pytestmark = pytest.mark.stream


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_a_kill_between_store_and_commit_loses_and_rerandomizes_nothing(servers, tmp_path, example):
    harness = Harness(servers, tmp_path, example)
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    # Produced first: the worker's fetches are full, so the lost commit covers a batch.
    asyncio.run(produce(config, iter(adult_rows(config)), progress=False))
    # The topic Redis stores from: a personal stream's second hop reads <stream>.grouped.
    stored = config.topics["grouped" if config.personal is not None else "raw"]
    fault = fault_points.command(exit_before_commit=3, topic=stored)
    faulty = spawn_worker(harness.path, harness.env, harness.log, splu=fault)
    deadline = time.monotonic() + TIMEOUT
    while faulty.running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not faulty.running and faulty.returncode == fault_points.EXIT_FAULT

    async def crashed() -> tuple[dict[str, int], int]:
        client = aioredis.from_url(config.redis_url)
        totals = await harness.totals(client)
        await client.aclose()
        group = f"splu-{config.name}"
        committed = await harness.committed_offsets(stored, group)
        return totals, sum(offset or 0 for offset in committed.values())

    at_crash, committed = asyncio.run(crashed())
    # Redis holds more than the group committed: the window the fault point opens.
    assert at_crash["ingested"] > committed

    harness.start_worker()

    async def settled() -> dict[str, int]:
        client = aioredis.from_url(config.redis_url)
        try:
            while time.monotonic() < deadline:
                totals = await harness.totals(client)
                if totals.get("settled", 0) == RECORDS and totals["in_flight"] == 0:
                    return totals
                await asyncio.sleep(0.2)
            raise AssertionError(f"the stream did not settle: {totals}")
        finally:
            await client.aclose()

    try:
        totals = asyncio.run(settled())
        published = asyncio.run(harness.read(config.topics["published"], totals["published"]))
    finally:
        harness.stop()
    assert totals["ingested"] == RECORDS, totals
    # Every record stored before the crash and not committed came again and was recognised.
    assert totals["replayed"] >= at_crash["ingested"] - committed > 0
    rows = [json.loads(value)["row"] for value in published.values()]
    assert len(set(rows)) == len(rows) == totals["published"]  # once each, one token each
    assert totals["published"] + totals.get("suppressed", 0) + totals["below_floor"] == RECORDS


def test_the_broker_holds_a_fetch_that_finds_nothing_briefly(servers, tmp_path):
    """A worker's fetcher has the broker hold a fetch without records for FETCH_MAX_WAIT_MS,
    not the 1.5 s Faust fixes, during which partitions that ran dry would wait behind it
    (`streams.runtime.bulk.BulkConsumerThread`)."""
    config = Harness(servers, tmp_path, "adult-decoy.toml").config

    async def fetch_wait_ms() -> int:
        app = create_app(config, ServiceKey(bytes(32)), tmp_path / "app")
        consumer = app.consumer._thread._create_worker_consumer(app.transport)
        await consumer.start()
        try:
            return consumer._fetcher._fetch_max_wait_ms
        finally:
            await consumer.stop()

    assert asyncio.run(fetch_wait_ms()) == FETCH_MAX_WAIT_MS < 1500
