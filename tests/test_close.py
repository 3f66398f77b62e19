"""A survey's end (issue 29; SPEC §3): after a close every accepted record is published or
suppressed with a reason, within bounded time, and nothing more is accepted.

The worker's real steps on a virtual clock (`tests/virtual_worker.py`): Adult responses
arrive a few at a time on two partitions whose floors they never fill, the stream
closes, and the worker's ticks and emission rounds carry the close out. The checks:
every accepted record is published or suppressed, each published once; the remainders
below the floors left as one take drawn from every partition; a record sent after the
close is rejected with its reason; nothing holding a true value is left in Redis but
what expires within the closed retention; a final remainder below the minimum mixing
follows `stream.small_remainder`.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import tomllib
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from virtual_worker import VirtualWorker, adult_messages

from service.core.config import StreamConfig, parse_config
from service.core.prf import ServiceKey
from service.core.table import open_sample
from service.store.lifecycle import close_status
from streams.worker.closing import close_stream

pytestmark = pytest.mark.redis

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(29)
T0 = 1_700_000_000_000
RETENTION = 600.0  # closed_retention, seconds


def survey_config(example: str, **stream: object) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / example).read_text())
    document["stream"].update(
        name=f"c{uuid.uuid4().hex[:8]}", partitions=2, max_wait=3600.0, flush_interval=5.0,
        closed_retention=RETENTION,
    )  # fmt: skip
    document["stream"].pop("mixing_pool", None)
    document["stream"].update(stream)
    return parse_config(document, example, EXAMPLES)


def adult_rows(count: int, start: int = 0) -> list[dict[str, str]]:
    with open_sample() as stream:
        return list(itertools.islice(csv.DictReader(stream), start, start + count))


async def read_published(bootstrap: str, config: StreamConfig) -> list[bytes]:
    """The keys (tokens) of every published message."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(config.topics["published"], p) for p in range(2)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        keys: list[bytes] = []
        while any([await consumer.position(tp) < end[tp] for tp in partitions]):
            for batch in (await consumer.getmany(*partitions, timeout_ms=500)).values():
                keys += [m.key for m in batch]
        return keys
    finally:
        await consumer.stop()


async def run_survey(
    servers, config: StreamConfig, responses: int, late: int = 0
) -> tuple[dict, dict, list[bytes], dict[bytes, int]]:
    """`responses` Adult rows, one every 10 s alternating partitions, then the close, then
    `late` more rows; ticks and rounds until the close completes. (close status, totals,
    published tokens, the stream's keys left in Redis with their TTLs)."""
    client = aioredis.from_url(servers.redis_url)
    rows = adult_messages(config, adult_rows(responses + late))
    async with VirtualWorker(servers.kafka_bootstrap, client, config, KEY) as worker:
        now = T0
        for i, row in enumerate(rows[:responses]):
            await worker.arrive(worker.messages(i % 2, [row]), now)
            if i % 10 == 0:
                await worker.tick(now)
                await worker.emit(now)
            now += 10_000
        totals = await worker.lifecycle.totals()
        assert totals.get("published", 0) == 0, "the floors were never reached"
        await close_stream(worker.lifecycle, worker.ends, now)
        for i, row in enumerate(rows[responses:]):
            await worker.arrive(worker.messages(i % 2, [row]), now)
        for _ in range(30):
            now += 1000
            await worker.tick(now)
            await worker.emit(now)
            if worker.closer.complete:
                break
        status = await close_status(worker.lifecycle)
        totals = await worker.lifecycle.totals()
    left = await keys_left(client, config)
    await client.aclose()
    tokens = await read_published(servers.kafka_bootstrap, config)
    return status, totals, tokens, left


async def keys_left(client: aioredis.Redis, config: StreamConfig) -> dict[bytes, int]:
    """Every key of the stream left in Redis, with its TTL (ms; -1: none)."""
    out = {}
    async for key in client.scan_iter(match=f"splu:{{{config.name}*"):
        out[key] = await client.pttl(key)
    return out


# Keys that never hold a true value, a record or a fingerprint: counters and gauges,
# delays, close state, the final pool's bookkeeping of which chunks came in, the owner
# fence's generation.
KEPT = (
    b":stats", b":waiting", b":delay", b":close", b":off", b":screened", b":from", b":chunks",
    b":owner",
)  # fmt: skip


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_a_closed_survey_publishes_or_suppresses_every_accepted_record(servers, example):
    config = survey_config(example)
    assert config.mixing_pool == 1000  # the default: 150 per partition never fill it
    status, totals, tokens, left = asyncio.run(run_survey(servers, config, 300, late=6))
    assert status["state"] == "closed", status
    assert set(status["partitions"].values()) == {"done"}
    assert totals["ingested"] == 300 and totals["rejected_closed"] == 6
    assert totals["published"] + totals.get("suppressed", 0) == 300, totals
    assert totals["expired"] == 0 and totals["pending"] == totals["pool"] == 0
    # Published once each, in one take of every partition's remainder.
    assert len(tokens) == len(set(tokens)) == totals["published"]
    assert status["remainder"]["records"] == status["remainder"]["take"] == totals["published"]
    if config.decoy is not None:
        # The last few values of each partition find no group any more.
        assert 0 < totals["suppressed_at_close"] == totals["suppressed"] <= 2 * 4 * 5
    else:
        assert totals.get("suppressed", 0) == 0
    holding = {k: ttl for k, ttl in left.items() if not k.endswith(KEPT) and b":truth:" not in k}
    # Fingerprints, personal group state and suppression counts expire after the closed
    # retention; no record, pool or hand-off is left at all.
    assert all(0 < ttl <= RETENTION * 1000 for ttl in holding.values()), holding
    assert not [k for k in holding if k.endswith((b":rec", b":pool", b":handoff", b":inflight"))]
    truth = [ttl for k, ttl in left.items() if b":truth:" in k]
    assert truth and all(0 < t <= 2 * config.reports.truth_retention * 1000 for t in truth)


@pytest.mark.parametrize("choice", ["suppress", "publish"])
def test_a_remainder_below_the_minimum_mixing_follows_the_configured_choice(servers, choice):
    """30 responses with γ = 5: at most 6 groups, below the minimum of 10."""
    config = survey_config("adult-decoy.toml", small_remainder=choice)
    status, totals, tokens, _ = asyncio.run(run_survey(servers, config, 30))
    assert status["state"] == "closed"
    remainder = status["remainder"]
    pooled = remainder["records"]
    assert 0 < pooled < config.min_mixing and remainder["take"] == pooled
    assert totals["published"] + totals["suppressed"] == 30
    if choice == "suppress":
        assert remainder["suppressed"] == pooled and tokens == [] and totals["published"] == 0
    else:
        assert remainder["suppressed"] == 0 and len(tokens) == totals["published"] == pooled
        # The weaker guarantee is stated: a neighbour in a take of `pooled` records.
        assert remainder["mate_probability"] == pytest.approx(4 / (pooled - 1))
        assert remainder["mate_probability"] > remainder["floor_mate_probability"]


def test_a_response_is_recognised_on_any_partition_and_at_any_age(servers):
    """The identity screen: a re-send on another partition is skipped, a re-send on the
    same partition is a redelivery, an id reused with other content is rejected on either,
    and a replay of a fetch stores nothing twice."""
    config = survey_config("adult-decoy.toml", mixing_pool=50)
    rows = adult_messages(config, adult_rows(200))

    async def scenario() -> dict[str, int]:
        client = aioredis.from_url(servers.redis_url)
        async with VirtualWorker(servers.kafka_bootstrap, client, config, KEY) as worker:
            first = worker.messages(0, rows[:100]) + worker.messages(1, rows[100:])
            await worker.arrive(first, T0)
            await worker.arrive(first, T0 + 1)  # the same fetch again: a crash's replay
            await worker.arrive(worker.messages(1, rows[:100]), T0 + 2)  # other partition
            await worker.arrive(worker.messages(0, rows[:50]), T0 + 3)  # same partition
            other = [(key, rows[150][1]) for key, _ in rows[:20]]
            await worker.arrive(worker.messages(0, other[:10]), T0 + 4)
            await worker.arrive(worker.messages(1, other[10:]), T0 + 5)
            totals = await worker.lifecycle.totals()
        await client.aclose()
        return totals

    totals = asyncio.run(scenario())
    assert totals["ingested"] == 200
    assert totals["rejected"] == totals["conflicts"] == 20
    # 100 re-sent to partition 1 (counted by the shards), 50 re-sent to partition 0 and
    # the 200 of the replayed fetch (counted by the buffers, 200 of them as replayed).
    assert totals["redelivered"] == 100 + 50 + 200 and totals["replayed"] == 200
