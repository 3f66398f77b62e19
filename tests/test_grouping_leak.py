"""No leak of the grouping (issue 6, item 6; SPEC §3, mixing pool).

The published topic must not tell which records share a hidden decoy group: records
published close together (in emission order, in a partition's offset order, at the
same Kafka timestamp) may come from one group no more often than random order gives,
and group-mates land in the same published partition as often as if partitions were
drawn at random. Every check below is a test at level ALPHA = 0.001 (the five that
must pass together raise a false alarm with probability at most 0.005; the bounds of
checks 1 and 2 are conservative, so far less in fact).

The run. The real code end to end: the first 20,000 Adult records (adult-decoy.toml:
γ = 5 occupations per group, mixing_pool = 1000, flush_interval = 5 s) go into a
fresh two-partition stream's buffer (`StreamBuffer.ingest`) 200 per round on a fake
clock advanced 100 ms a round (the worker's emit timer); every round each partition
is emptied as the worker's `emit` does (`take` in chunks of EMIT_CHUNK), each take is
sent with the real `Publisher.send_all` to the embedded broker's published topic
under its tokens, and acknowledged. A 6 s pause in the middle and the drain at the
end (past max_wait) make the flush rule fire besides the pool-size rule. The topic is
read back (partition, offset, timestamp, key) and each message is mapped, by its
token, to its take and to its group (partition, group number) from the pool entry's
audit field, which the publisher never sends.

Each record leaves by one of two rules of service/lua/emit.lua: a *draw* (only the
excess over mixing_pool leaves) or a *flush* (the oldest pooled record is
flush_interval old, so the whole pool leaves). The checks run on each kind
separately: a pair counts for the kind of its later record (for timestamps: records
of takes of that kind).

H0, the ideal mixing pool: within a stream partition each emitted record is drawn
uniformly from the pooled records not yet emitted, and where it lands in Kafka
(partition, offset, timestamp) does not depend on which record it is.

1. Emission order. Let R_i be the number of pooled, not yet emitted records when
   record i is drawn (ZCARD before its take minus its position in the take). Its
   predecessor in the partition's emission order has at most γ - 1 group-mates among
   them, so under H0 P(same group | past) <= p_i = min(1, (γ - 1)/R_i). A draw keeps
   R_i >= mixing_pool, so p_i <= 4/1000; a flush empties the pool, so R_i falls to 1
   and the bound grows to 1 for its last records, which random order allows (the
   last few records of an emptied pool are likely mates). The count X of same-group
   consecutive pairs is then stochastically below a sum of independent Bernoulli(p_i)
   (coupling, given the realized pool sizes); the test rejects when the exact
   Poisson-binomial tail P(S >= X) <= ALPHA (one-sided; the exact binomial when all
   p_i are equal; where the Chernoff bound e^-μ (eμ/X)^X is below 1e-9 that upper
   bound is reported instead).
2. Offset order. The same test and bound for consecutive offsets of each published
   partition: the later message's record is drawn from R records that hold at most
   γ - 1 mates of any earlier record. Pairs from different stream partitions cannot
   share a group and are left out.
3. Shared timestamps. X = pairs of messages with the same timestamp (ms) from the same
   group. Under H0 the order inside each take (= one send_all) is a uniformly random
   permutation, so X is compared with X under 999 permutations of each take's records
   over its messages (numpy seed 6): p = (1 + #{X_perm >= X}) / 1000, reject when
   p <= ALPHA, i.e. when no permutation reaches X. This guards against timestamps that
   follow groups (cut times, group-wise sends) beyond which take a record left in;
   which take is the pool's business and checked by 1.
4. Shared partitions. Each group's members in emission order are paired disjointly
   (1st with 2nd, 3rd with 4th), so under H0 the pairs are independent and land in
   the same published partition with probability 1/k (k = 2 partitions; round robin
   over a random order inside a take is within 1/(2(c - 1)) of it for a take of c
   records). Two-sided exact binomial test against 1/k, reject when p <= ALPHA.

The broken order must be detected by the same checks: a run with mixing_pool = 0 whose
takes are emitted in cut order (each group's members consecutively, as an emitter
without pool and randomization would; 10,000 records in one burst, so that each take
spans many milliseconds) is rejected by all four.

Flushes are where this test first failed: `ZRANDMEMBER pool count` with count >= the
pool size returns the whole sorted set in score order (the time each record was pooled),
not at random, so records pooled together, among them every group's members, left
together and checks 1-3 rejected the flushes. emit.lua now shuffles every take.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import math
import time
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from scipy.stats import binomtest

from service.buffer import StreamBuffer
from service.config import StreamConfig, parse_config
from service.ingest import Preparer, RawMessage
from service.prf import ServiceKey
from service.table import open_sample
from streams.app import EMIT_CHUNK, Publisher
from streams.topics import create_topics

# Talks to a Redis-protocol server: .ci/run repeats these against Debian's redis-server.
pytestmark = pytest.mark.redis

ALPHA = 0.001
PERMUTATIONS = 999
SEED = 6
EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(6)
T0 = 1_700_000_000_000  # a fixed clock, advanced by hand
STEP_MS = 100  # the worker's emit interval
QUIET = range(40, 100)  # rounds without input: the pool's oldest record ages to a flush

Order = Callable[[list[tuple[str, bytes]]], list[tuple[str, bytes]]]


@dataclass(frozen=True)
class Emission:
    """One published record: where it left the pool and where it landed in Kafka."""

    source: int  # stream (raw) partition
    group: int  # dense id of (source, group number)
    take: int  # index of the take (one send_all) that emitted it
    flush: bool  # left by the flush rule rather than as excess over mixing_pool
    remaining: int  # pooled records not yet emitted when it was drawn, itself included
    partition: int  # published partition
    offset: int
    timestamp: int  # Kafka timestamp (ms)


@dataclass(frozen=True)
class Run:
    emissions: list[Emission]  # in emission order
    gamma: int
    partitions: int
    takes: list[tuple[int, int, int, bool]]  # (source, pool size, taken, flush)
    mixing_pool: int


@dataclass(frozen=True)
class Verdict:
    statistic: int
    expected: float  # its mean (or bound on the mean) under H0
    sample: int  # pairs compared (messages, for timestamps)
    p_value: float

    @property
    def rejects(self) -> bool:
        return self.p_value <= ALPHA


def stream_config(**stream: object) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"].update(name=f"g{uuid.uuid4().hex[:8]}", partitions=2, **stream)
    return parse_config(document, "adult-decoy.toml", EXAMPLES)


def group_number(entry: bytes) -> int:
    audit = entry.split(b"|")[2]
    assert b";" not in audit, "one sensitive attribute: one group per record"
    return int(audit.partition(b":")[0])


def cut_order(items: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The broken emitter: each group's members consecutively, groups in cut order."""
    return sorted(items, key=lambda item: group_number(item[1]))


async def read_topic(bootstrap: str, topic: str, partitions: int, expected: int) -> list:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list = []
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        deadline = time.monotonic() + 30
        while len(records) < expected and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def publish_stream(
    servers, config: StreamConfig, order: Order, records: int, per_round: int
) -> Run:
    """Feed `records` Adult rows through the buffer and the publisher; see the docstring."""
    client = aioredis.from_url(servers.redis_url)
    buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
    topic, sources = config.topics["published"], config.partitions
    await create_topics(servers.kafka_bootstrap, {topic: sources})
    publisher = Publisher(servers.kafka_bootstrap)
    await publisher.on_start()
    with open_sample() as stream:
        rows = list(itertools.islice(csv.DictReader(stream), records))
    names = config.schema.names
    messages = [
        RawMessage(i % sources, i // sources, None, json.dumps({n: r[n] for n in names}).encode())
        for i, r in enumerate(rows)
    ]
    drawn: dict[str, tuple[int, int, int, bool, int]] = {}
    takes: list[tuple[int, int, int, bool]] = []
    groups: dict[tuple[int, int], int] = {}
    now, position, round_ = T0, 0, 0
    try:
        while True:
            if position < len(messages) and round_ not in QUIET:
                batches, rejected = preparer.prepare(messages[position : position + per_round])
                assert not rejected
                position += per_round
                for batch in batches:
                    await buffer.ingest(batch.partition, batch, now)
            elif position >= len(messages):
                if (await buffer.totals())["pool"] == 0:
                    break
                # Drain: whatever still waits for a group is suppressed, the pool flushes.
                now += int(config.max_wait * 1000)
                for source in range(sources):
                    await buffer.ingest(source, None, now)
            for source in range(sources):  # the worker's emit, one round
                while True:
                    size = await client.zcard(f"{buffer.prefix(source)}:pool")
                    items = await buffer.take(source, now, EMIT_CHUNK)
                    if not items:
                        break
                    flush = len(items) > size - config.mixing_pool
                    takes.append((source, size, len(items), flush))
                    items = order(items)
                    for j, (token, entry) in enumerate(items):
                        group = groups.setdefault((source, group_number(entry)), len(groups))
                        drawn[token] = (source, group, len(takes) - 1, flush, size - j)
                    await publisher.send_all(
                        topic,
                        ((t.encode(), preparer.published_json(e)) for t, e in items),
                    )
                    await buffer.acknowledge(source, [t for t, _ in items])
                    if len(items) < EMIT_CHUNK:
                        break
            now += STEP_MS
            round_ += 1
    finally:
        await publisher.on_stop()
        await client.aclose()
    received = await read_topic(servers.kafka_bootstrap, topic, sources, len(drawn))
    assert sorted(m.key.decode() for m in received) == sorted(drawn)  # each record once
    emissions = [
        Emission(*drawn[m.key.decode()], m.partition, m.offset, m.timestamp) for m in received
    ]
    emissions.sort(key=emitted)
    return Run(emissions, config.decoy.gamma, sources, takes, config.mixing_pool)


def poisson_binomial_tail(probabilities: list[float], observed: int) -> float:
    """P(S >= observed) for S a sum of independent Bernoulli(p_i): exact, or the Chernoff
    bound e^-μ (eμ/x)^x (an upper bound) where that is below 1e-9."""
    mean = sum(probabilities)
    if observed <= 0:
        return 1.0
    if mean == 0:
        return 0.0
    if observed > mean:
        chernoff = math.exp(observed - mean + observed * math.log(mean / observed))
        if chernoff < 1e-9:
            return chernoff
    below = np.zeros(observed)  # P(S = s) for s < observed
    below[0] = 1.0
    for p in probabilities:
        if p > 0:
            below[1:] = below[1:] * (1 - p) + below[:-1] * p
            below[0] *= 1 - p
    return float(max(0.0, 1.0 - below.sum()))


def pair_test(run: Run, pairs: list[tuple[Emission, Emission]], flush: bool) -> Verdict:
    """Checks 1 and 2: same-group pairs (earlier, later) against min(1, (γ-1)/R_later)."""
    kept = [(a, b) for a, b in pairs if b.flush == flush and a.source == b.source]
    bounds = [min(1.0, (run.gamma - 1) / b.remaining) for _, b in kept]
    same = sum(a.group == b.group for a, b in kept)
    return Verdict(same, sum(bounds), len(kept), poisson_binomial_tail(bounds, same))


def emitted(e: Emission) -> tuple[int, int]:
    """Sort key of emission order: by take, then by position inside it."""
    return (e.take, -e.remaining)


def emission_order(run: Run, flush: bool) -> Verdict:
    pairs = []
    for source in range(run.partitions):
        pairs += itertools.pairwise(e for e in run.emissions if e.source == source)
    return pair_test(run, pairs, flush)


def offset_order(run: Run, flush: bool) -> Verdict:
    pairs = []
    for partition in range(run.partitions):
        landed = sorted(
            (e for e in run.emissions if e.partition == partition), key=lambda e: e.offset
        )
        assert landed == sorted(landed, key=emitted)  # offsets follow emission order
        pairs += itertools.pairwise(landed)
    return pair_test(run, pairs, flush)


def _shared_pairs(keys: np.ndarray) -> np.ndarray:
    """Per row: pairs of equal entries."""
    keys = np.sort(keys, axis=1)
    equal = keys[:, 1:] == keys[:, :-1]
    index = np.arange(1, keys.shape[1])
    starts = np.maximum.accumulate(np.where(equal, 0, index), axis=1)
    return (index - starts).sum(axis=1)  # each entry pairs with the equal ones before it


def shared_timestamps(run: Run, flush: bool) -> Verdict:
    kept = [e for e in run.emissions if e.flush == flush]
    if not kept:
        return Verdict(0, 0.0, 0, 1.0)
    takes = np.array([e.take for e in kept])
    groups = np.array([e.group for e in kept], dtype=np.int64)
    stamps = np.unique([e.timestamp for e in kept], return_inverse=True)[1].astype(np.int64)
    width = int(groups.max()) + 1
    observed = int(_shared_pairs((stamps * width + groups)[None, :])[0])
    rng = np.random.default_rng(SEED)
    permuted = []
    for start in range(0, PERMUTATIONS, 111):
        rows = min(111, PERMUTATIONS - start)
        # Sorting by take + U(0, 1) shuffles records within each take only.
        shuffle = np.argsort(takes[None, :] + rng.random((rows, len(kept))), axis=1)
        permuted.append(_shared_pairs(stamps[None, :] * width + groups[shuffle]))
    null = np.concatenate(permuted)
    p_value = (1 + int((null >= observed).sum())) / (PERMUTATIONS + 1)
    return Verdict(observed, float(null.mean()), len(kept), p_value)


def shared_partitions(run: Run, flush: bool) -> Verdict:
    members: dict[int, list[Emission]] = {}
    for e in run.emissions:
        members.setdefault(e.group, []).append(e)
    pairs = [
        (mates[i], mates[i + 1])
        for mates in members.values()
        for i in range(0, len(mates) - 1, 2)
        if mates[i + 1].flush == flush
    ]
    same = sum(a.partition == b.partition for a, b in pairs)
    p_value = binomtest(same, len(pairs), 1 / run.partitions).pvalue if pairs else 1.0
    return Verdict(same, len(pairs) / run.partitions, len(pairs), float(p_value))


CHECKS: dict[str, Callable[[Run, bool], Verdict]] = {
    "emission order": emission_order,
    "offset order": offset_order,
    "timestamps": shared_timestamps,
    "partitions": shared_partitions,
}


@pytest.fixture(scope="module")
def pipeline(servers) -> Run:
    return asyncio.run(publish_stream(servers, stream_config(), list, 20_000, per_round=200))


@pytest.fixture(scope="module")
def broken(servers) -> Run:
    # One burst, so each take holds thousands of records and spans many milliseconds
    # however fast the machine: a take sent within one millisecond has one timestamp,
    # which then cannot reveal its order.
    config = stream_config(mixing_pool=0)
    return asyncio.run(publish_stream(servers, config, cut_order, 10_000, per_round=10_000))


def test_the_run_exercises_both_emission_rules(pipeline):
    draws = [t for t in pipeline.takes if not t[3]]
    flushes = [t for t in pipeline.takes if t[3]]
    assert len(draws) > 100 and len(flushes) >= 4
    # A draw leaves exactly mixing_pool records behind; a flush empties the pool.
    assert all(size - taken == pipeline.mixing_pool for _, size, taken, _ in draws)
    assert all(size == taken for _, size, taken, _ in flushes)
    assert {e.partition for e in pipeline.emissions} == {0, 1}


@pytest.mark.parametrize("check", CHECKS)
def test_draws_do_not_reveal_groups(pipeline, check):
    verdict = CHECKS[check](pipeline, False)
    assert not verdict.rejects, verdict


@pytest.mark.parametrize("check", CHECKS)
def test_flushes_do_not_reveal_groups(pipeline, check):
    verdict = CHECKS[check](pipeline, True)
    assert not verdict.rejects, verdict


@pytest.mark.parametrize("check", CHECKS)
def test_cut_order_without_a_pool_is_detected(broken, check):
    assert all(not flush for *_, flush in broken.takes)
    verdict = CHECKS[check](broken, False)
    assert verdict.rejects, verdict
