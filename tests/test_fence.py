"""The owner fence (issue 35): a rebalance never lets two workers write one partition.

A worker claims a partition's buffer before it writes there (claim.lua), and every step
that writes (ingest, take, acknowledgement) checks the claim first (fence.lua): a worker
whose partition was claimed since by another is refused before it writes anything.

- In the store: two workers' buffers on one partition, as a rebalance leaves them. The
  older claim is refused at each step and leaves every key as it was; a worker that keeps
  its partition through a rebalance keeps its claim.
- In the processes: a worker frozen (SIGSTOP) while a second worker joins the group is
  evicted, and the second claims its partitions. Woken, the frozen worker's first write
  is refused and says so in its log; it is then killed. Every record is published once
  under one token, or suppressed, and nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import redis.asyncio as aioredis
from harness import RECORDS, Harness, adult_rows

from deploy.embedded import spawn_worker
from service.core.ingest import Preparer, RawMessage
from service.store.buffer import BufferState, FencedError, StreamBuffer
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

STALE = "was claimed by a newer worker"


async def snapshot(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes]:
    """Every key of a partition's buffer, serialized (DUMP)."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
    return {key: await client.dump(key) for key in sorted(keys)}


@pytest.mark.redis
def test_the_older_claim_is_refused_at_every_step_and_writes_nothing(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False, partitions=1)
    config = harness.config
    key = config.service_key()
    rows = adult_rows(config)[:1200]
    messages = [RawMessage(0, offset, k, v) for offset, (k, v) in enumerate(rows)]
    batches, _ = Preparer(config, key).prepare(messages)

    async def scenario() -> None:
        client = aioredis.from_url(config.redis_url)
        old, new = StreamBuffer(client, config, key), StreamBuffer(client, config, key)
        prefix = old.prefix(0)
        try:
            # The old owner stores a first part, past the pool's floor, and takes some of it.
            first = batches[0].subset(list(range(900)))
            await old.ingest(0, first, 1_000, 899)
            taken = await old.take(0, 1_000, 50)
            assert taken
            # A rebalance gives the partition to the new owner, which claims it as it writes.
            new.assigned({0})
            await new.ingest(0, None, 2_000)
            before = await snapshot(client, prefix)
            rest = batches[0].subset(list(range(900, 1200)))
            with pytest.raises(FencedError, match=STALE):
                await old.ingest(0, rest, 2_500, 1199)
            with pytest.raises(FencedError, match=STALE):
                await old.take(0, 2_500, 50)
            with pytest.raises(FencedError, match=STALE):
                await old.acknowledge(0, taken, 2_500)
            assert await snapshot(client, prefix) == before
            # The new owner re-sends what the old one left in flight, and goes on.
            assert sorted(await new.in_flight(0)) == sorted(taken)
            await new.acknowledge(0, taken, 3_000)
            await new.ingest(0, rest, 3_000, 1199)
            # Kept through a rebalance, a claim stays: the new owner's steps go on.
            new.assigned({0})
            await new.ingest(0, None, 3_500)
            # Given back, the old owner claims anew, and the other is refused in turn.
            old.assigned({0})
            await old.ingest(0, None, 4_000)
            with pytest.raises(FencedError, match=STALE):
                await new.ingest(0, None, 4_500)
            assert (await old.stats(0))["ingested"] == 1200
        finally:
            await client.aclose()

    asyncio.run(scenario())


TIMEOUT = 240.0


def test_a_worker_frozen_through_a_rebalance_is_refused_when_it_wakes(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml")
    config = harness.config
    asyncio.run(create_topics(config.kafka, dict.fromkeys(config.topics.values(), 2)))
    rows = adult_rows(config)
    half = len(rows) // 2
    stale_log = tmp_path / "stale-worker.log"
    stale = spawn_worker(harness.path, harness.env, stale_log)
    successor = None

    async def owners(client: aioredis.Redis) -> list[bytes | None]:
        state = BufferState(client, config)
        return [await client.get(f"{state.prefix(p)}:owner") for p in range(2)]

    async def run_stream() -> dict[str, int]:
        nonlocal successor
        client = aioredis.from_url(config.redis_url)
        try:
            await produce(config, iter(rows[:half]), rate=8000, progress=False)
            deadline = time.monotonic() + TIMEOUT
            while (await harness.totals(client)).get("ingested", 0) < half:
                assert time.monotonic() < deadline, "the first worker did not ingest"
                await asyncio.sleep(0.2)
            claims = await owners(client)
            # Frozen mid-stream; a second worker joins, the group evicts the frozen one
            # and the second claims every partition.
            os.kill(stale.pid, signal.SIGSTOP)
            successor = spawn_worker(harness.path, harness.env, harness.log)
            while not all(
                now is not None and now != then
                for now, then in zip(await owners(client), claims, strict=True)
            ):
                assert time.monotonic() < deadline, "the second worker claimed nothing"
                await asyncio.sleep(0.2)
            producing = asyncio.create_task(
                produce(config, iter(rows[half:]), rate=8000, progress=False)
            )
            # Woken, the frozen worker writes under its old claim, and is refused.
            os.kill(stale.pid, signal.SIGCONT)
            while STALE not in stale_log.read_text():
                assert time.monotonic() < deadline, "the stale worker was not refused"
                await asyncio.sleep(0.1)
            stale.kill()
            while True:
                totals = await harness.totals(client)
                if (
                    producing.done()
                    and totals.get("settled", 0) == RECORDS
                    and totals["in_flight"] == 0
                ):
                    break
                assert time.monotonic() < deadline, f"the stream did not settle: {totals}"
                await asyncio.sleep(0.2)
            await producing
            return totals
        finally:
            await client.aclose()

    try:
        totals = asyncio.run(run_stream())
        published = asyncio.run(harness.read(config.topics["published"], totals["published"]))
    finally:
        stale.stop()
        if successor is not None:
            successor.stop()
    assert totals["ingested"] == RECORDS
    assert totals["published"] + totals["suppressed"] == RECORDS
    # Each published record once, under one token (the topic's distinct tokens).
    assert len(published) == totals["published"]
    published_rows = [json.loads(value)["row"] for value in published.values()]
    assert len(set(published_rows)) == len(published_rows)
