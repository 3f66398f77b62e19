"""No leak of the grouping at any arrival rate (issue 11; SPEC §3, mixing pool).

The published topic must not tell which records share a hidden decoy group, whether the
stream brings one record every two seconds or a burst of thousands. The mixing rule
(service/lua/emit.lua) promises: every record leaves in a uniformly shuffled take drawn
uniformly from at least `mixing_pool` records (the floor). These tests hold the real
code to that promise.

The runs. The real buffer (`StreamBuffer`, its Lua steps) and the real emission code
(`streams.app.Emitter`, what the worker's timer calls, with the real `Publisher` and the
embedded broker) on a virtual clock: every 100 ms (the emit interval) the records that
arrived are ingested, every second the partitions tick, then one emission round runs.
Two stream partitions, γ = 5 occupations of Adult, a floor of 50 records (10 groups),
flush_interval 5 s, at 0.5, 5 and 50 records per second per partition and in one burst;
then the stream goes quiet until everything left. The shuffle seeds come from a seeded
generator instead of the OS, so each run is reproducible (the seeds' use is the same).

H0, the ideal floor pool: fed with the same records entering the pool at the same times,
each round releases the excess over the floor (a whole pool of at least the floor when
nothing entered for flush_interval), drawn uniformly and in uniformly random order, sent
as `Publisher.send_all` lays a take out (each record to its token's partition, one
timestamp per take). Under H0, which group sits where in Kafka carries exactly the
information a uniform draw from the floor allows.

Checks. First, structure: the worker's takes have exactly the ideal sizes, round by round
(a take below the floor fails here). Then four statistics of group-mates sitting
together, each compared with 999 simulations of H0 (numpy seed 11); a check rejects when
p = (1 + #{simulated ≥ observed}) / 1000 ≤ ALPHA = 0.001, i.e. when no simulation
reaches the observed count:
1. offsets: consecutive offsets of a published partition holding mates;
2. timestamps: pairs of mates with the same Kafka timestamp;
3. emission order: consecutive records of a stream partition's emission order;
4. partitions: mates, paired disjointly in emission order, in the same published
   partition.
A pool with no floor (mixing_pool = 0, which the config refuses) is run at 0.5 records
per second as a control: the same checks must reject it. That is what the emitter did
before this test existed: a pool older than flush_interval left whole, so in a slow
stream each flush was one freshly cut group, sent together.

The shuffle's entropy: each take draws 128 fresh bits, and the order it publishes is
SHA-1 in counter mode over all of them (a reference implementation below must reproduce
the script's take exactly), so there is no short state to search.
"""

from __future__ import annotations

import asyncio
import collections
import csv
import hashlib
import itertools
import json
import random
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition

from service.buffer import SHUFFLE_SEED_BYTES, PoolEntry, StreamBuffer
from service.config import StreamConfig, parse_config
from service.ingest import Preparer, RawMessage
from service.prf import ServiceKey
from service.table import open_sample
from streams.app import EMIT_CHUNK, EMIT_INTERVAL, TICK_INTERVAL, Emitter, Publisher
from streams.topics import create_topics

# Talks to a Redis-protocol server: .ci/run repeats these against Debian's redis-server.
pytestmark = pytest.mark.redis

ALPHA = 0.001
SIMULATIONS = 999
EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(11)
T0 = 1_700_000_000_000
STEP = int(EMIT_INTERVAL * 1000)
TICK_EVERY = int(TICK_INTERVAL * 1000) // STEP
FLOOR = 50
SOURCES = 2
# Records per stream partition and their arrival times (ms after T0) per regime.
REGIMES: dict[str, tuple[int, Callable[[int], int]]] = {
    "0.5 per second": (240, lambda i: 2000 * i),
    "5 per second": (800, lambda i: 200 * i),
    "50 per second": (2000, lambda i: 20 * i),
    "burst": (3000, lambda i: 0),
}


def stream_config(**stream: object) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"].update(
        name=f"g{uuid.uuid4().hex[:8]}", partitions=SOURCES, mixing_pool=FLOOR,
        flush_interval=5.0, **stream,
    )  # fmt: skip
    return parse_config(document, "adult-decoy.toml", EXAMPLES)


def seeded_entropy(seed: int) -> Callable[[int], str]:
    generator = random.Random(seed)
    return lambda n: generator.randbytes(n).hex()


@dataclass
class Run:
    """A published stream and the ideal pool's inputs."""

    gamma: int
    entered: list[tuple[int, int, bytes, int]]  # (time, source, record id, group label)
    rounds: list[int]  # emission round times
    takes: list[tuple[int, int, int]]  # (round time, source, size), in sending order
    # Per published record, in sending order: source, group label, published partition,
    # offset, timestamp.
    layout: np.ndarray
    labels: np.ndarray


async def publish_stream(servers, config: StreamConfig, records: int, arrival) -> Run:
    """Feed `records` Adult rows per stream partition through the buffer and the emitter on
    a virtual clock, then read the published topic back."""
    client = aioredis.from_url(servers.redis_url)
    buffer = StreamBuffer(client, config, KEY, entropy=seeded_entropy(7))
    preparer = Preparer(config, KEY)
    topic = config.topics["published"]
    await create_topics(servers.kafka_bootstrap, {topic: SOURCES})
    publisher = Publisher(servers.kafka_bootstrap)
    await publisher.on_start()
    emitter = Emitter(config, buffer, publisher, preparer)
    emitter.owned = set(range(SOURCES))
    with open_sample() as stream:
        rows = list(itertools.islice(csv.DictReader(stream), records * SOURCES))
    names = config.schema.names
    # Per stream partition, its records in arrival order: (arrival ms, message).
    queues = [
        collections.deque(
            (T0 + arrival(offset), RawMessage(source, offset, None, json.dumps(
                {n: r[n] for n in names}).encode()))
            for offset, r in enumerate(rows[source::SOURCES])
        )
        for source in range(SOURCES)
    ]  # fmt: skip
    last = max(queue[-1][0] for queue in queues)
    wait_ms, flush_ms = int(config.max_wait * 1000), int(config.flush_interval * 1000)
    labels: dict[tuple[int, bytes], int] = {}
    entered, rounds, takes, sent = [], [], [], []
    now, step = T0, 0
    try:
        while True:
            for source, queue in enumerate(queues):
                # A burst is taken in batches, as the worker's take_events does.
                messages = []
                while queue and queue[0][0] <= now and len(messages) < config.batch_size:
                    messages.append(queue.popleft()[1])
                if messages:
                    batches, rejected = preparer.prepare(messages)
                    assert not rejected
                    await buffer.ingest(source, batches[0], now)
                if step % TICK_EVERY == 0:
                    await buffer.ingest(source, None, now)
                if messages or step % TICK_EVERY == 0:
                    pool = f"{buffer.prefix(source)}:pool"
                    for raw in await client.zrangebyscore(pool, now, now):
                        entry = PoolEntry.parse(raw)
                        group = int(entry.audit.partition(b":")[0])
                        label = labels.setdefault((source, group), len(labels))
                        entered.append((now, source, entry.id, label))
            rounds.append(now)
            for source, items in await emitter.round(set(range(SOURCES)), now):
                takes.append((now, source, len(items)))
                sent += [(token, source, PoolEntry.parse(entry)) for token, entry in items]
            # The stream goes quiet: waiting records are suppressed, pools holding their
            # floor leave whole; below the floor records wait for more.
            if not any(queues) and now > last + wait_ms + flush_ms + 1000:
                break
            now += STEP
            step += 1
    finally:
        await publisher.on_stop()
        await client.aclose()
    where = await read_topic(servers.kafka_bootstrap, topic, len(sent))
    layout, record_labels = [], []
    for token, source, entry in sent:
        partition, offset, timestamp = where[token]
        group = int(entry.audit.partition(b":")[0])
        layout.append((source, partition, offset, timestamp))
        record_labels.append(labels[(source, group)])
    return Run(
        config.decoy.gamma, entered, rounds, takes, np.array(layout, dtype=np.int64),
        np.array([record_labels], dtype=np.int64),
    )  # fmt: skip


async def read_topic(bootstrap: str, topic: str, expected: int) -> dict[str, tuple[int, int, int]]:
    """token -> (partition, offset, timestamp) of every published message."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    out: dict[str, tuple[int, int, int]] = {}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(SOURCES)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while len(out) < expected and loop.time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for m in batch:
                    assert m.key.decode() not in out, "each record is published once"
                    out[m.key.decode()] = (m.partition, m.offset, m.timestamp)
    finally:
        await consumer.stop()
    assert len(out) == expected
    return out


def ideal_takes(run: Run, floor: int, flush_ms: int) -> list[tuple[int, int, int]]:
    """The takes the ideal floor pool makes from the same entries: (time, source, size)."""
    takes = []
    size, newest = [0] * SOURCES, [0] * SOURCES
    entering = iter(sorted(run.entered))
    pending = next(entering, None)
    for now in run.rounds:
        while pending is not None and pending[0] <= now:
            size[pending[1]] += 1
            newest[pending[1]] = pending[0]
            pending = next(entering, None)
        for source in range(SOURCES):
            while True:  # the emitter takes until nothing is due
                count = min(size[source] - floor, EMIT_CHUNK)
                quiet = now - newest[source] >= flush_ms
                if count <= 0 < size[source] and size[source] >= floor and quiet:
                    count = size[source]
                if count <= 0:
                    break
                takes.append((now, source, count))
                size[source] -= count
    return takes


def ideal_layout(run: Run, takes: list[tuple[int, int, int]]) -> np.ndarray:
    """Where the ideal pool's records land as Publisher.send_all lays them out: each to its
    token's partition, offsets in sending order, one timestamp per take. Tokens are fresh
    randomness, independent of groups, so the ideal pool's k-th record goes to the
    partition the worker's k-th record went to."""
    offsets = [0] * SOURCES
    layout = []
    sent = 0
    for now, source, size in takes:
        for _ in range(size):
            partition = int(run.layout[sent, 1])
            layout.append((source, partition, offsets[partition], now))
            offsets[partition] += 1
            sent += 1
    return np.array(layout, dtype=np.int64)


def simulate(run: Run, takes: list[tuple[int, int, int]], rng: np.random.Generator) -> np.ndarray:
    """Group labels in sending order for SIMULATIONS runs of the ideal pool: (K, records)."""
    by_source: dict[int, list[tuple[int, int]]] = {s: [] for s in range(SOURCES)}
    for time, source, _, label in sorted(run.entered):
        by_source[source].append((time, label))
    pools = {s: np.empty((SIMULATIONS, 0), dtype=np.int64) for s in range(SOURCES)}
    cursor = dict.fromkeys(range(SOURCES), 0)
    out = []
    for now, source, size in takes:
        entries = by_source[source]
        start = cursor[source]
        while cursor[source] < len(entries) and entries[cursor[source]][0] <= now:
            cursor[source] += 1
        if cursor[source] > start:
            new = np.array([label for _, label in entries[start : cursor[source]]])
            pools[source] = np.hstack([pools[source], np.tile(new, (SIMULATIONS, 1))])
        pool = pools[source]
        order = np.argsort(rng.random(pool.shape), axis=1)
        shuffled = np.take_along_axis(pool, order, axis=1)
        out.append(shuffled[:, :size])  # a uniform draw, in uniform order
        pools[source] = shuffled[:, size:]
    return np.hstack(out)


def _same_pairs(keys: np.ndarray) -> np.ndarray:
    """Per row: pairs of equal entries."""
    keys = np.sort(keys, axis=1)
    equal = keys[:, 1:] == keys[:, :-1]
    index = np.arange(1, keys.shape[1])
    starts = np.maximum.accumulate(np.where(equal, 0, index), axis=1)
    return (index - starts).sum(axis=1)


def statistics(layout: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """The four counts of mates sitting together, per row of `labels` (records in sending
    order as `layout` lays them out)."""
    source, partition, offset, timestamp = layout.T
    out = {}
    by_offset = np.lexsort((offset, partition))
    a, b = by_offset[:-1], by_offset[1:]
    keep = (partition[a] == partition[b]) & (source[a] == source[b])
    out["offsets"] = (labels[:, a[keep]] == labels[:, b[keep]]).sum(axis=1)
    stamp = np.unique(np.column_stack([timestamp, source]), axis=0, return_inverse=True)[1]
    width = int(labels.max()) + 1
    out["timestamps"] = _same_pairs(stamp.ravel()[None, :] * width + labels)
    order = np.argsort(source, kind="stable")
    a, b = order[:-1], order[1:]
    keep = source[a] == source[b]
    out["emission order"] = (labels[:, a[keep]] == labels[:, b[keep]]).sum(axis=1)
    # Mates paired disjointly in sending order: sort each row by (label, position).
    positions = np.arange(labels.shape[1])
    ranked = np.argsort(labels * labels.shape[1] + positions, axis=1)
    sorted_labels = np.take_along_axis(labels, ranked, axis=1)
    first = np.ones_like(sorted_labels, dtype=bool)
    first[:, 1:] = sorted_labels[:, 1:] != sorted_labels[:, :-1]
    starts = np.maximum.accumulate(np.where(first, positions, 0), axis=1)
    leads = ((positions - starts) % 2 == 0)[:, :-1] & (
        sorted_labels[:, 1:] == sorted_labels[:, :-1]
    )
    landed = partition[ranked]
    out["partitions"] = (leads & (landed[:, 1:] == landed[:, :-1])).sum(axis=1)
    return out


@dataclass(frozen=True)
class Verdict:
    observed: int
    simulated_mean: float
    p_value: float

    @property
    def rejects(self) -> bool:
        return self.p_value <= ALPHA


def verdicts(run: Run, floor: int, flush_ms: int) -> dict[str, Verdict]:
    takes = ideal_takes(run, floor, flush_ms)
    simulated = statistics(
        ideal_layout(run, takes), simulate(run, takes, np.random.default_rng(11))
    )
    observed = statistics(run.layout, run.labels)
    return {
        name: Verdict(
            int(observed[name][0]),
            float(simulated[name].mean()),
            (1 + int((simulated[name] >= observed[name][0]).sum())) / (SIMULATIONS + 1),
        )
        for name in observed
    }


CHECKS = ("offsets", "timestamps", "emission order", "partitions")


@pytest.fixture(scope="module", params=list(REGIMES))
def regime(request, servers) -> tuple[str, Run, StreamConfig]:
    config = stream_config()
    records, arrival = REGIMES[request.param]
    return request.param, asyncio.run(publish_stream(servers, config, records, arrival)), config


@pytest.fixture(scope="module")
def without_floor(servers) -> Run:
    config = replace(stream_config(), mixing_pool=0)  # below what the config accepts
    records, arrival = REGIMES["0.5 per second"]
    return asyncio.run(publish_stream(servers, config, records, arrival))


def test_takes_follow_the_floor_rule(regime):
    name, run, config = regime
    flush = int(config.flush_interval * 1000)
    assert run.takes == ideal_takes(run, FLOOR, flush), name
    # Every pooled record was published, except fewer than a floor's worth per partition
    # that arrived after the last whole release and wait for more.
    assert len(run.entered) - SOURCES * FLOOR < len(run.layout) <= len(run.entered)


@pytest.mark.parametrize("check", CHECKS)
def test_published_neighbours_say_no_more_than_a_draw_from_the_floor(regime, check):
    name, run, config = regime
    verdict = verdicts(run, FLOOR, int(config.flush_interval * 1000))[check]
    assert not verdict.rejects, (name, verdict)


@pytest.mark.parametrize("check", ("offsets", "timestamps", "emission order"))
def test_a_pool_without_a_floor_is_detected_in_a_slow_stream(without_floor, check):
    flush = 5000
    assert without_floor.takes != ideal_takes(without_floor, FLOOR, flush)
    verdict = verdicts(without_floor, FLOOR, flush)[check]
    assert verdict.rejects, verdict


def reference_take(seed: str, pool: list[bytes], count: int) -> list[bytes]:
    """emit.lua's draw, written again: a partial Fisher-Yates over the pool in score order,
    each index from a 48-bit slice of SHA-1(seed:counter), three slices per block."""
    members, counter, slices = list(pool), 0, []
    for i in range(count):
        if not slices:
            counter += 1
            block = hashlib.sha1(f"{seed}:{counter}".encode()).hexdigest()
            slices = [int(block[k : k + 12], 16) for k in (0, 12, 24)]
        j = i + int(slices.pop(0) / 2**48 * (len(members) - i))
        members[i], members[j] = members[j], members[i]
    return members[:count]


def test_each_take_is_shuffled_by_128_fresh_bits_and_nothing_shorter(servers):
    config = replace(stream_config(), mixing_pool=0)
    drawn: list[int] = []

    def counting(n: int) -> str:
        drawn.append(n)
        return bytes(n).hex() if len(drawn) == 1 else random.Random(len(drawn)).randbytes(n).hex()

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = (
            StreamBuffer(client, config, KEY, entropy=counting),
            Preparer(config, KEY),
        )
        with open_sample() as stream:
            rows = list(itertools.islice(csv.DictReader(stream), 400))
        names = config.schema.names
        messages = [
            RawMessage(0, i, None, json.dumps({n: r[n] for n in names}).encode())
            for i, r in enumerate(rows)
        ]
        await buffer.ingest(0, preparer.prepare(messages)[0][0], T0)
        pool = await client.zrange(f"{buffer.prefix(0)}:pool", 0, -1)
        first = await buffer.take(0, T0, 60)
        await client.zadd(f"{buffer.prefix(0)}:pool", dict.fromkeys([e for _, e in first], T0))
        second = await buffer.take(0, T0, 60)
        await client.aclose()
        return pool, first, second

    pool, first, second = asyncio.run(scenario())
    assert drawn == [SHUFFLE_SEED_BYTES, SHUFFLE_SEED_BYTES] and SHUFFLE_SEED_BYTES >= 16
    assert [e for _, e in first] == reference_take(bytes(16).hex(), pool, 60)
    assert [e for _, e in first] != [e for _, e in second]  # a fresh seed per take
    assert all(len(token) == 32 for token, _ in first + second)


@pytest.mark.parametrize("count", [100, EMIT_CHUNK])
def test_a_take_reads_by_rank_or_whole_and_draws_the_same(servers, count):
    """A small take from a large pool reads only the positions its swaps touch; a large
    one reads the pool whole. Both are the reference draw, and a take of EMIT_CHUNK
    records lands in flight whole (its writes are chunked)."""
    config = replace(stream_config(), mixing_pool=0)
    seed = random.Random(count).randbytes(SHUFFLE_SEED_BYTES).hex()

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer = StreamBuffer(client, config, KEY, entropy=lambda n: seed)
        prefix = buffer.prefix(0)
        pool = {f"p|1|0:1|1|{T0}|{i:032x}".encode(): T0 for i in range(EMIT_CHUNK + 1000)}
        await client.zadd(f"{prefix}:pool", pool)
        ordered = await client.zrange(f"{prefix}:pool", 0, -1)
        taken = await buffer.take(0, T0, count)
        in_flight = await client.hgetall(f"{prefix}:inflight")
        await client.aclose()
        return ordered, taken, in_flight

    ordered, taken, in_flight = asyncio.run(scenario())
    assert [entry for _, entry in taken] == reference_take(seed, ordered, count)
    assert {token.encode(): entry for token, entry in taken} == in_flight


def test_the_worker_hashes_a_takes_tokens_and_shuffle_as_redis_would(servers):
    """The worker hashes the tokens and shuffle blocks of the records it expects a take to
    release (`take_tokens`, from the pool size it last saw) and Redis hashes the rest: the
    take is the same whoever hashed which part. Partition 0's worker saw 200 of its 400
    pooled records (a tick), so it hashes 200 and Redis 100 of a take of 300; partition 1's
    saw none, so Redis hashes all 300."""
    config = replace(stream_config(), mixing_pool=0)
    seed = random.Random(5).randbytes(SHUFFLE_SEED_BYTES).hex()

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer = StreamBuffer(client, config, KEY, entropy=lambda n: seed)
        entries = [f"p|1|0:1|1|{T0}|{i:032x}".encode() for i in range(400)]
        await client.zadd(f"{buffer.prefix(0)}:pool", dict.fromkeys(entries[:200], T0))
        await buffer.ingest(0, None, T0)
        for partition in (0, 1):
            await client.zadd(f"{buffer.prefix(partition)}:pool", dict.fromkeys(entries, T0))
        takes = [await buffer.take(partition, T0, 300) for partition in (0, 1)]
        await client.aclose()
        return takes

    (partly_given, hashed_in_redis) = asyncio.run(scenario())
    assert len(partly_given) == 300 and partly_given == hashed_in_redis
