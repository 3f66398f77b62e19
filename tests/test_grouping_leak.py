"""No leak of the grouping at any arrival rate (issue 11; SPEC §3, mixing pool).

The published topic must not tell which records share a hidden decoy group, whether the
stream brings one record every two seconds or a burst of thousands. The mixing rule
(service/store/lua/emit.lua) promises: every record leaves in a uniformly shuffled take drawn
uniformly from at least `mixing_pool` records (the floor). These tests hold the real
code to that promise.

The runs. The real buffer (`StreamBuffer`, its Lua steps) and the real emission code
(`streams.runtime.app.Emitter`, what the worker's timer calls, with the real `Publisher` and the
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
per second as a control: the same checks must reject it. Such a pool leaves whole once
older than flush_interval, so in a slow stream each flush is one freshly cut group,
sent together: the leak the floor prevents.

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
from harness import add_to_pool, pool_in_draw_order
from virtual_worker import VirtualWorker

from service.core.config import StreamConfig, parse_config
from service.core.ingest import Preparer, RawMessage
from service.core.prf import ServiceKey
from service.core.table import open_sample
from service.core.wire import PoolEntry
from service.store.buffer import FINAL_POOL, SHUFFLE_SEED_BYTES, StreamBuffer
from streams.worker.app import EMIT_CHUNK, EMIT_INTERVAL
from streams.worker.closing import close_stream

# Talks to a Redis-protocol server: .ci/run repeats these against Debian's redis-server.
pytestmark = pytest.mark.redis

ALPHA = 0.001
SIMULATIONS = 999
EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(11)
T0 = 1_700_000_000_000
STEP = int(EMIT_INTERVAL * 1000)
FLOOR = 50
SOURCES = 2
SURVEY = "1 per minute, 3,000 on the defaults"
# Records per stream partition, their arrival times (ms after T0), and whether the stream
# keeps the default partition count and floor, per regime.
REGIMES: dict[str, tuple[int, Callable[[int], int], bool]] = {
    "0.5 per second": (240, lambda i: 2000 * i, False),
    "5 per second": (800, lambda i: 200 * i, False),
    "50 per second": (2000, lambda i: 20 * i, False),
    "burst": (3000, lambda i: 0, False),
    SURVEY: (3000, lambda i: 60_000 * i, True),
}


def stream_config(defaults: bool = False) -> StreamConfig:
    """The example decoy stream with `SOURCES` partitions and a floor of `FLOOR`, or with
    the default partition count and floor and a max_wait for a survey (a record waits
    minutes for the others of its group). Final remainders are published, so that every
    record is in the statistics."""
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    stream = document["stream"]
    if defaults:
        del stream["partitions"], stream["mixing_pool"]
        stream["max_wait"] = 86400.0
    else:
        stream.update(partitions=SOURCES, mixing_pool=FLOOR)
    stream.update(name=f"g{uuid.uuid4().hex[:8]}", flush_interval=5.0, small_remainder="publish")
    return parse_config(document, "adult-decoy.toml", EXAMPLES)


def seeded_entropy(seed: int) -> Callable[[int], str]:
    generator = random.Random(seed)
    return lambda n: generator.randbytes(n).hex()


@dataclass
class Run:
    """A published stream and the ideal pool's inputs. Sources are the stream's partitions
    0..sources-1 and, numbered `sources`, the final pool a close fills."""

    gamma: int
    sources: int
    entered: list[tuple[int, int, bytes, int]]  # (time, source, record id, group label)
    # source -> (time the close finalized its partition, "releasing" its pool whole or
    # "handed" to the final pool)
    finalized: dict[int, tuple[int, str]]
    final_ready: int | None  # when every partition's remainder was in the final pool
    rounds: list[int]  # emission round times
    takes: list[tuple[int, int, int]]  # (round time, source, size), in sending order
    # Per published record, in sending order: source, group label, published partition,
    # offset, timestamp.
    layout: np.ndarray
    labels: np.ndarray
    totals: dict[str, int]  # the stream's counters once the close is complete


async def publish_stream(servers, config: StreamConfig, records: int, arrival) -> Run:
    """Feed `records` Adult rows per stream partition through the worker's steps on a
    virtual clock (`tests/virtual_worker.py`), close the stream once they are in, go on
    until the close is complete, then read the published topic back.

    The clock moves in steps of the emit interval while something is due, and jumps to the
    next arrival, or to the next time a quiet pool may leave whole, while nothing is: a
    stream of one record a minute takes a few steps per record."""
    client = aioredis.from_url(servers.redis_url)
    sources = config.partitions
    final = sources
    with open_sample() as stream:
        rows = list(itertools.islice(csv.DictReader(stream), records * sources))
    names = config.schema.names
    # Per stream partition, its records in arrival order: (arrival ms, key, value).
    queues = [
        collections.deque(
            (T0 + arrival(offset), b"%d:%d" % (source, offset),
             json.dumps({n: r[n] for n in names}).encode())
            for offset, r in enumerate(rows[source::sources])
        )
        for source in range(sources)
    ]  # fmt: skip
    last = max(queue[-1][0] for queue in queues)
    flush_ms = int(config.flush_interval * 1000)
    labels: dict[tuple[int, bytes], int] = {}
    label_of: dict[bytes, int] = {}
    pooled: set[bytes] = set()  # entries seen in a pool: the rest entered it now
    entered, rounds, takes, sent = [], [], [], []
    finalized: dict[int, tuple[int, str]] = {}
    final_ready = None
    newest = [0] * sources  # when each pool last received records
    now, step, closed = T0, 0, False
    async with VirtualWorker(
        servers.kafka_bootstrap, client, config, KEY, entropy=seeded_entropy(7)
    ) as worker:
        buffer = worker.buffer
        while True:
            for source, queue in enumerate(queues):
                # A burst is taken in batches, as the worker's fetches are.
                arrived = []
                while queue and queue[0][0] <= now and len(arrived) < config.batch_size:
                    arrived.append(queue.popleft()[1:])
                if arrived:
                    await worker.arrive(worker.messages(source, arrived), now)
            if not closed and not any(queues) and now >= last + 1000:
                await close_stream(worker.lifecycle, worker.ends, now)
                closed = True
            await worker.tick(now)
            for source in range(sources):
                pool = f"{buffer.prefix(source)}:pool"
                for raw in set(await client.hvals(pool)) - pooled:
                    pooled.add(raw)
                    entry = PoolEntry.parse(raw)
                    group = int(entry.audit.partition(b":")[0])
                    label = labels.setdefault((source, group), len(labels))
                    label_of[entry.id] = label
                    entered.append((now, source, entry.id, label))
                    newest[source] = now
                state = await client.hget(f"{buffer.prefix(source)}:close", "state")
                if state is not None and source not in finalized:
                    finalized[source] = (now, "releasing" if state == b"releasing" else "handed")
            if final_ready is None and closed:
                ready = await client.scard(f"{buffer.prefix(FINAL_POOL)}:from")
                final_ready = now if ready == sources else None
            rounds.append(now)
            for source, items in await worker.emit(now):
                source = final if source == FINAL_POOL else source
                takes.append((now, source, len(items)))
                sent += [(token, source, PoolEntry.parse(entry)) for token, entry in items]
            if worker.closer.complete:
                totals = await worker.lifecycle.totals()
                break
            step += 1
            later = [q[0][0] for q in queues if q]
            later += [t + flush_ms for t in newest if t + flush_ms > now]
            if closed or any(q and q[0][0] <= now + STEP for q in queues):
                now += STEP
            else:
                # Nothing arrives or comes due before the next event: jump to its step.
                soonest = min(later, default=now + STEP)
                now += STEP * max(1, -(-(soonest - now) // STEP))
    await client.aclose()
    topic = config.topics["published"]
    where = await read_topic(servers.kafka_bootstrap, topic, sources, len(sent))
    layout, record_labels = [], []
    for token, source, entry in sent:
        partition, offset, timestamp = where[token]
        layout.append((source, partition, offset, timestamp))
        record_labels.append(label_of[entry.id])
    return Run(
        config.decoy.gamma, sources, entered, finalized, final_ready, rounds, takes,
        np.array(layout, dtype=np.int64), np.array([record_labels], dtype=np.int64), totals,
    )  # fmt: skip


async def read_topic(
    bootstrap: str, topic: str, partitions: int, expected: int
) -> dict[str, tuple[int, int, int]]:
    """token -> (partition, offset, timestamp) of every published message."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    out: dict[str, tuple[int, int, int]] = {}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
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
    """The takes the ideal floor pool makes from the same entries: (time, source, size).

    While the stream is open, each round takes the excess over the floor, or a quiet pool
    of at least the floor whole. When the close finalizes a partition, a pool of at least
    the floor leaves whole; a smaller one joins the final pool, which leaves whole once
    every partition's remainder is in. In a round the final pool goes first, as the
    emitter orders it (`FINAL_POOL` sorts first)."""
    sources, final = run.sources, run.sources
    takes = []
    size, newest = [0] * (sources + 1), [0] * sources
    releasing, handed = set(), set()
    entering = iter(sorted(run.entered))
    pending = next(entering, None)
    for now in run.rounds:
        while pending is not None and pending[0] <= now:
            size[pending[1]] += 1
            newest[pending[1]] = pending[0]
            pending = next(entering, None)
        for source, (time, _) in run.finalized.items():
            if time <= now and source not in releasing | handed:
                if size[source] >= floor and size[source] > 0:
                    releasing.add(source)
                else:
                    size[final] += size[source]
                    size[source] = 0
                    handed.add(source)
        ready = run.final_ready is not None and run.final_ready <= now
        for source in ([final] if ready else []) + list(range(sources)):
            while True:  # the emitter takes until nothing is due
                if source == final or source in releasing:
                    count = min(size[source], EMIT_CHUNK)
                else:
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
    offsets = [0] * run.sources
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
    """Group labels in sending order for SIMULATIONS runs of the ideal pool: (K, records).
    A partition the close handed off moves whatever its simulated pool still holds to the
    final pool."""
    sources, final = run.sources, run.sources
    by_source: dict[int, list[tuple[int, int]]] = {s: [] for s in range(sources)}
    for time, source, _, label in sorted(run.entered):
        by_source[source].append((time, label))
    pools = {s: np.empty((SIMULATIONS, 0), dtype=np.int64) for s in range(sources + 1)}
    cursor = dict.fromkeys(range(sources), 0)
    moved: set[int] = set()

    def fill(source: int, until: int) -> None:
        entries = by_source[source]
        start = cursor[source]
        while cursor[source] < len(entries) and entries[cursor[source]][0] <= until:
            cursor[source] += 1
        if cursor[source] > start:
            new = np.array([label for _, label in entries[start : cursor[source]]])
            pools[source] = np.hstack([pools[source], np.tile(new, (SIMULATIONS, 1))])

    out = []
    for now, source, size in takes:
        if source == final:
            for handed, (time, kind) in run.finalized.items():
                if kind == "handed" and time <= now and handed not in moved:
                    fill(handed, time)
                    pools[final] = np.hstack([pools[final], pools[handed]])
                    pools[handed] = pools[handed][:, :0]
                    moved.add(handed)
        else:
            fill(source, now)
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
    records, arrival, defaults = REGIMES[request.param]
    config = stream_config(defaults)
    return request.param, asyncio.run(publish_stream(servers, config, records, arrival)), config


@pytest.fixture(scope="module")
def without_floor(servers) -> Run:
    config = replace(stream_config(), mixing_pool=0)  # below what the config accepts
    records, arrival, _ = REGIMES["0.5 per second"]
    return asyncio.run(publish_stream(servers, config, records, arrival))


def test_takes_follow_the_floor_rule_and_the_close(regime):
    name, run, config = regime
    records = REGIMES[name][0]
    flush = int(config.flush_interval * 1000)
    assert run.takes == ideal_takes(run, config.mixing_pool, flush), name
    # The close published every pooled record: below the floor too, in the final pool.
    assert len(run.layout) == len(run.entered) == len({e[2] for e in run.entered})
    assert sorted(run.finalized) == list(range(config.partitions))
    # Every accepted record published, but those no group could take at the close.
    totals = run.totals
    assert totals["ingested"] == records * config.partitions
    assert totals["published"] == len(run.layout)
    assert totals["suppressed"] == totals["ingested"] - totals["published"]
    if name == SURVEY:
        # The default floor held: records left in whole draws of at least 1,000, or of the
        # excess over a full pool, and the rest in the close's mixed take. A record waits
        # for its group at most max_wait, a day: only the close suppresses.
        assert config.partitions == 1 and config.mixing_pool == 1000
        assert run.takes[-1][1] == run.sources and run.takes[-1][2] < 1000
        assert totals["suppressed"] == totals["suppressed_at_close"] < 20


@pytest.mark.parametrize("check", CHECKS)
def test_published_neighbours_say_no_more_than_a_draw_from_the_floor(regime, check):
    name, run, config = regime
    verdict = verdicts(run, config.mixing_pool, int(config.flush_interval * 1000))[check]
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
            RawMessage(0, i, b"%d" % i, json.dumps({n: r[n] for n in names}).encode())
            for i, r in enumerate(rows)
        ]
        await buffer.ingest(0, preparer.prepare(messages)[0][0], T0)
        pool = await pool_in_draw_order(client, buffer.prefix(0))
        first = await buffer.take(0, T0, 60)
        await add_to_pool(client, buffer.prefix(0), [e for _, e in first], T0)
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
    """A take, small or large, reads only the positions its swaps touch, and is the
    reference draw over the pool's positions from the last; a take of EMIT_CHUNK records
    lands in flight whole (its reads and writes are chunked)."""
    config = replace(stream_config(), mixing_pool=0)
    seed = random.Random(count).randbytes(SHUFFLE_SEED_BYTES).hex()

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer = StreamBuffer(client, config, KEY, entropy=lambda n: seed)
        prefix = buffer.prefix(0)
        pool = [f"p|1|0:1|1|{T0}|{i:032x}".encode() for i in range(EMIT_CHUNK + 1000)]
        await add_to_pool(client, prefix, pool, T0)
        ordered = await pool_in_draw_order(client, prefix)
        taken = await buffer.take(0, T0, count)
        in_flight = {token.encode(): entry for token, entry in await buffer.in_flight(0)}
        await client.aclose()
        return ordered, taken, in_flight

    ordered, taken, in_flight = asyncio.run(scenario())
    assert [entry for _, entry in taken] == reference_take(seed, ordered, count)
    assert {token.encode(): entry for token, entry in taken} == in_flight


def test_the_worker_hashes_a_takes_tokens_and_shuffle_as_redis_would(servers):
    """The worker hashes the shuffle blocks of the records it expects a take to release
    (`shuffle_blocks`, from the pool size it last saw) and Redis hashes the rest: the take
    is the same whoever hashed which part, and so are its tokens (`take_tokens`, from its
    seed). Partition 0's worker saw 200 of its 400
    pooled records (a tick), so it hashes 200 and Redis 100 of a take of 300; partition 1's
    saw none, so Redis hashes all 300."""
    config = replace(stream_config(), mixing_pool=0)
    seed = random.Random(5).randbytes(SHUFFLE_SEED_BYTES).hex()

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer = StreamBuffer(client, config, KEY, entropy=lambda n: seed)
        entries = [f"p|1|0:1|1|{T0}|{i:032x}".encode() for i in range(400)]
        await add_to_pool(client, buffer.prefix(0), entries[:200], T0)
        await buffer.ingest(0, None, T0)
        await add_to_pool(client, buffer.prefix(0), entries[200:], T0)
        await add_to_pool(client, buffer.prefix(1), entries, T0)
        takes = [await buffer.take(partition, T0, 300) for partition in (0, 1)]
        await client.aclose()
        return takes

    (partly_given, hashed_in_redis) = asyncio.run(scenario())
    assert len(partly_given) == 300 and partly_given == hashed_in_redis
