"""The Redis buffer's Lua steps against a real Redis-protocol server.

Pool entries keep an audit field the emitter never publishes (a decoy record's
group values, a personal record's trial/copy kind), so these tests can check
what the published topic alone cannot: every group and every draw.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import math
import random
import tomllib
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from harness import GroupedHops
from scipy.stats import chi2 as stats_chi2
from scipy.stats import norm as stats_norm
from test_identity_screen import first_reads
from virtual_worker import VirtualWorker

from service.core.config import StreamConfig, parse_config
from service.core.guarantees import trial_limit
from service.core.ingest import NO_KEY, Preparer, RawMessage
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.personal import UniformPerturbation
from service.core.prf import ServiceKey
from service.core.table import open_sample
from service.core.wire import PoolEntry, cell_key, truth_cells_and_arrivals
from service.store.auditor import TrustedState
from service.store.buffer import FencedError, StreamBuffer

# Talks to a Redis-protocol server: .ci/run repeats these against Debian's redis-server.
pytestmark = pytest.mark.redis

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(41)
T0 = 1_700_000_000_000  # a fixed clock, advanced by hand


def stream_config(example: str, **stream: object) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / example).read_text())
    document["stream"].update(name=f"t{uuid.uuid4().hex[:8]}", **stream)
    return parse_config(document, example, EXAMPLES)


def adult_messages(config: StreamConfig, count: int, partition: int = 0) -> list[RawMessage]:
    with open_sample() as stream:
        rows = list(itertools.islice(csv.DictReader(stream), count))
    names = config.schema.names
    return [
        RawMessage(
            partition,
            offset,
            b"%d:%d" % (partition, offset),
            json.dumps({n: row[n] for n in names}).encode(),
        )
        for offset, row in enumerate(rows)
    ]


def run(coroutine):
    return asyncio.run(coroutine)


async def ingest_all(
    buffer: StreamBuffer, preparer: Preparer, messages, now: int, size: int = 1000
):
    outcomes, batches = [], []
    for start in range(0, len(messages), size):
        prepared, rejected = preparer.prepare(messages[start : start + size])
        assert not rejected
        for batch in prepared:
            outcomes.append(await buffer.ingest(batch.partition, batch, now))
            batches.append(batch)
    return batches, outcomes


async def pool_entries(client: aioredis.Redis, buffer: StreamBuffer, partition: int) -> list[bytes]:
    return await client.hvals(f"{buffer.prefix(partition)}:pool")


def test_decoy_groups_draws_and_redelivery(servers):
    config = stream_config("adult-decoy.toml", partitions=1)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = adult_messages(config, 5000)
        batches, outcomes = await ingest_all(buffer, preparer, messages, T0)
        assert all(set(o.statuses) == {0} for o in outcomes)
        entries = await pool_entries(client, buffer, 0)
        replay, _ = preparer.prepare(messages[:1000])
        replayed = await buffer.ingest(0, replay[0], T0)
        stats = await buffer.stats(0)
        await client.aclose()
        return batches, entries, replayed, stats

    batches, entries, replayed, stats = run(scenario())
    gamma = config.decoy.gamma
    true_value, draws = {}, {}
    decoy = DecoyGroups(gamma)
    for batch in batches:
        for record_id, value, draw in zip(
            batch.id_bytes(), batch.sensitive[:, 0], decoy.draws(batch.ids, KEY, "occupation"),
            strict=True,
        ):  # fmt: skip
            true_value[record_id] = int(value)
            draws[record_id] = int(draw)
    assert stats["ingested"] == 5000 and stats["pending"] + len(entries) == 5000
    assert stats["groups"] * gamma == len(entries)
    members: Counter[bytes] = Counter()
    for entry in map(PoolEntry.parse, entries):
        number, _, listed = entry.audit.partition(b":")
        members[number] += 1
        values = [int(v) for v in listed.split(b",")]
        assert len(set(values)) == gamma and values == sorted(values)
        assert true_value[entry.id] == int(entry.true)
        assert true_value[entry.id] in values  # its own value is one of its group's
        assert int(entry.published) == values[draws[entry.id]]  # the keyed draw, nothing else
    assert set(members.values()) == {gamma} and len(members) == stats["groups"]
    assert set(replayed.statuses) == {1} and stats["redelivered"] == 1000


def test_a_cut_takes_the_smallest_waiting_ids_of_each_value(servers):
    """From each chosen value a cut takes the smallest ids among those waiting in the
    value's bucket and the call's own arrivals (decoy.lua, `smallest`), as one pop of the
    bucket would had the arrivals been added first. So after every call, every id of a
    value grouped in it sorts below every id of that value left waiting. Calls of 1 to 600
    records, so that arrivals meet leftovers of earlier calls."""
    config = stream_config("adult-decoy.toml", partitions=1, max_wait=3600.0)
    sizes = [1, 7, 40, 200, 3, 600, 11, 90, 1, 250, 5, 400]

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = adult_messages(config, sum(sizes))
        prefix, pooled, calls, start = buffer.prefix(0), set(), [], 0
        for size in sizes:
            batches, _ = preparer.prepare(messages[start : start + size])
            start += size
            await buffer.ingest(0, batches[0], T0)
            entries = map(PoolEntry.parse, await pool_entries(client, buffer, 0))
            grouped = [e for e in entries if e.id not in pooled]
            pooled |= {e.id for e in grouped}
            values = config.schema.sensitive[0].size
            waiting = [await client.zrange(f"{prefix}:b:1:{v}", 0, -1) for v in range(values)]
            calls.append((grouped, waiting))
        await client.aclose()
        return calls

    calls = run(scenario())
    merged = 0
    for grouped, waiting in calls:
        by_value: dict[int, list[bytes]] = {}
        for entry in grouped:
            by_value.setdefault(int(entry.true), []).append(entry.id)
        for value, ids in by_value.items():
            if waiting[value]:
                assert max(ids) < min(waiting[value]), value
                merged += 1
    assert merged > 20  # values grouped while others of theirs waited: the case at stake


def test_decoy_groups_each_sensitive_attribute_independently(servers):
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"].update(name=f"t{uuid.uuid4().hex[:8]}", partitions=1)
    age = document["schema"]["public"].pop("age")
    document["schema"]["sensitive"]["age"] = age  # six age bins ≥ γ = 5
    config = parse_config(document, "two sensitive attributes", EXAMPLES)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        await ingest_all(buffer, preparer, adult_messages(config, 3000), T0)
        entries = await pool_entries(client, buffer, 0)
        stats = await buffer.stats(0)
        await client.aclose()
        return entries, stats

    entries, stats = run(scenario())
    # A record leaves once both attributes grouped it; ages 25-44 exceed 1/γ and wait.
    assert len(entries) + stats["pending"] == 3000 and len(entries) > 1000
    for entry in map(PoolEntry.parse, entries):
        for value, group in zip(entry.published.split(b","), entry.audit.split(b";"), strict=True):
            members = group.partition(b":")[2].split(b",")
            assert len(set(members)) == 5 and value in members


# Per held record: its group number per attribute (cmsgpack fields 8), from the record hash.
HELD_GROUPS = """
local out = {}
for _, packed in ipairs(redis.call('HVALS', KEYS[1])) do
  local record = cmsgpack.unpack(packed)
  if record[6] == 0 then out[#out + 1] = table.concat(record[8], ',') end
end
return out
"""


def test_groups_publish_whole_with_two_sensitive_attributes_under_suppression(servers):
    """With several sensitive attributes a record grouped on one attribute can wait on
    another and be suppressed there. Its first group must not then publish short: every
    group's members are published or still held back waiting for a group-mate, never
    suppressed, and each value's published count stays unbiased for its true count."""
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"].update(name=f"t{uuid.uuid4().hex[:8]}", partitions=1, max_wait=10.0)
    document["schema"]["sensitive"]["age"] = document["schema"]["public"].pop("age")
    config = parse_config(document, "two sensitive attributes", EXAMPLES)
    gamma, records = config.decoy.gamma, 12_000

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = adult_messages(config, records)
        now = T0
        for start in range(0, records, 200):  # 200 records a second: suppression all along
            batches, _ = preparer.prepare(messages[start : start + 200])
            await buffer.ingest(0, batches[0], now)
            now += 1000
        await buffer.ingest(0, None, now + 10_000)
        entries = [PoolEntry.parse(e) for e in await pool_entries(client, buffer, 0)]
        held = await client.eval(HELD_GROUPS, 1, f"{buffer.prefix(0)}:rec")
        stats = await buffer.stats(0)
        await client.aclose()
        return entries, held, stats

    entries, held, stats = run(scenario())
    assert stats["suppressed"] > 500 and stats["refills"] > 100
    assert len(entries) + stats["suppressed"] + stats["held"] == records
    assert len(held) == stats["held"] == stats["pending"]
    published: Counter[tuple[int, bytes]] = Counter()
    for entry in entries:
        for a, audit in enumerate(entry.audit.split(b";")):
            published[a, audit.partition(b":")[0]] += 1
    members = published.copy()
    for groups in held:
        for a, number in enumerate(groups.split(b",")):
            members[a, number] += 1
    # Nothing of a group that published was suppressed: its other members are held.
    short = {g: (published[g], members[g]) for g in published if members[g] != gamma}
    assert not short, short
    # Per value: published count - true count ~ N(0, T(1 - 1/γ)) for whole groups.
    values = [(a, v) for a, s in enumerate(config.schema.sensitive) for v in range(s.size)]
    limit = stats_norm.ppf(1 - 0.001 / (2 * len(values)))
    for a, v in values:
        true = sum(int(e.true.split(b",")[a]) == v for e in entries)
        shown = sum(int(e.published.split(b",")[a]) == v for e in entries)
        assert abs(shown - true) <= limit * math.sqrt(true * (1 - 1 / gamma)) + 1e-9, (a, v)


def test_values_over_their_share_wait_then_are_suppressed(servers):
    config = stream_config("adult-decoy.toml", partitions=1, max_wait=10.0)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = [
            m for m in adult_messages(config, 4000)
            if json.loads(m.value)["occupation"] in ("Sales", "Tech-support", "Exec-managerial")
        ]  # fmt: skip
        await ingest_all(buffer, preparer, messages, T0)
        waiting = await buffer.stats(0)
        await buffer.ingest(0, None, T0 + 9_000)
        still = await buffer.stats(0)
        await buffer.ingest(0, None, T0 + 10_001)
        after, suppressed = await buffer.stats(0), await TrustedState(client, config).suppressed()
        await client.aclose()
        return len(messages), waiting, still, after, suppressed

    total, waiting, still, after, suppressed = run(scenario())
    # Three values can never fill a group of five: every record waits, then is suppressed.
    assert waiting["pending"] == still["pending"] == total and waiting["groups"] == 0
    assert after["pending"] == 0 and after["suppressed"] == total
    assert sum(suppressed.values()) == total
    assert set(suppressed) == {
        ("occupation", v) for v in ("Sales", "Tech-support", "Exec-managerial")
    }


def test_mixing_pool_keeps_its_floor_and_releases_whole_only_when_full_and_quiet(servers):
    config = stream_config("adult-decoy.toml", partitions=1, mixing_pool=1000, flush_interval=2.0)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = adult_messages(config, 3000)
        await ingest_all(buffer, preparer, messages[:2500], T0)
        pooled = (await buffer.stats(0))["pool"]
        first = await buffer.take(0, T0, 10_000)
        in_flight = await buffer.in_flight(0)
        await buffer.acknowledge(0, first, T0)
        early = await buffer.take(0, T0 + 1_000, 10_000)
        late = await buffer.take(0, T0 + 2_000, 10_000)
        stats = await buffer.stats(0)
        # Below the floor nothing leaves, however quiet the pool is.
        await ingest_all(buffer, preparer, messages[2500:], T0 + 3_000)
        small = (await buffer.stats(0))["pool"]
        never = await buffer.take(0, T0 + 1_000_000, 10_000)
        await client.aclose()
        return pooled, first, in_flight, early, late, stats, small, never

    pooled, first, in_flight, early, late, stats, small, never = run(scenario())
    assert pooled > 1000 and len(first) == pooled - 1000  # only the excess leaves
    assert dict(in_flight) == dict(first) and len({t for t, _ in first}) == len(first)
    assert early == [] and len(late) == 1000  # a full pool quiet for flush_interval leaves
    assert stats["published"] == len(first) and stats["in_flight"] == 1000
    assert 0 < small < 1000 and never == []


def test_a_take_is_a_uniform_sample_in_uniform_order(servers):
    """A take of 2 from a pool of 5 (moving records into the positions taken), then of the 3
    left: over 1,200 seeded trials, every one of the 120 orders of the 5 records is as
    likely. Pearson's chi-square over the 120 cells (10 expected each, 119 degrees of
    freedom) rejects at p < 0.001."""
    config = replace(stream_config("adult-decoy.toml", partitions=1), mixing_pool=0)
    trials, records = 1200, [b"p|1|0:1|1|%d|%032x" % (T0, i) for i in range(5)]
    draws = random.Random(35)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer = StreamBuffer(client, config, KEY, entropy=lambda n: draws.randbytes(n).hex())
        prefix, orders = buffer.prefix(0), Counter()
        for _ in range(trials):
            async with client.pipeline(transaction=True) as pipe:
                pipe.delete(f"{prefix}:pool", f"{prefix}:takes")
                pipe.hset(f"{prefix}:pool", mapping=dict(enumerate(records, 1)))
                pipe.set(f"{prefix}:pooled", T0)
                await pipe.execute()
            first, rest = await buffer.take(0, T0, 2), await buffer.take(0, T0, 3)
            orders[tuple(entry[-1] for _, entry in first + rest)] += 1
        await client.aclose()
        return orders

    orders = run(scenario())
    assert sum(orders.values()) == trials and all(len(set(order)) == 5 for order in orders)
    expected = trials / math.factorial(5)
    cells = itertools.permutations(b"01234")
    statistic = sum((orders[cell] - expected) ** 2 / expected for cell in cells)
    assert statistic < stats_chi2.ppf(0.999, math.factorial(5) - 1), statistic


def test_a_take_re_sent_after_a_crash_keeps_its_tokens_and_counts_once(servers):
    """Takes never acknowledged (the worker crashed) come back to the next owner whole,
    under the same tokens, in another order; the crashed worker's late acknowledgement is
    fenced off, and acknowledging them, twice, publishes each record once."""
    config = stream_config("adult-decoy.toml", partitions=1, max_wait=1000.0, mixing_pool=50)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        await ingest_all(buffer, preparer, adult_messages(config, 1000), T0)
        taken = [await buffer.take(0, T0, 300), await buffer.take(0, T0, 300)]
        restarted = StreamBuffer(client, config, KEY)
        again = await restarted.in_flight(0)
        await restarted.acknowledge(0, again, T0)
        with pytest.raises(FencedError):
            await buffer.acknowledge(0, taken[0], T0)
        await restarted.acknowledge(0, taken[0], T0)
        left = await restarted.in_flight(0)
        stats, truth = await buffer.stats(0), await TrustedState(client, config).truth()
        tallies = {}
        async for key in client.scan_iter(match=f"{buffer.prefix(0)}:truth:*"):
            cells = {cell: int(n) for cell, n in (await client.hgetall(key)).items()}
            tallies[key.decode().split(":")[-2]] = cells
        await client.aclose()
        return taken, again, left, stats, truth, tallies

    taken, again, left, stats, truth, tallies = run(scenario())
    both = taken[0] + taken[1]
    # Both takes in one acknowledgement, their shared cells added up once each.
    expected = truth_cells_and_arrivals(entry for _, entry in both)
    assert tallies == {"true": dict(expected.true), "shown": dict(expected.shown)}
    assert len(expected.shown) < 600
    assert len(both) == 600 and len({token for token, _ in both}) == 600
    assert all(len(token) == 32 and int(token, 16) >= 0 for token, _ in both)
    assert sorted(again) == sorted(both) and list(again) != both
    assert set(again.takes) == set(taken[0].takes) | set(taken[1].takes)
    assert left == [] and stats["published"] == 600 and stats["in_flight"] == 0
    assert sum(truth[0].values()) == sum(truth[1].values()) == 600


def test_personal_trials_copies_and_budget(servers):
    config = stream_config("adult-personal.toml", partitions=2, max_wait=5.0)
    settings = config.personal
    assert settings.release_size == 50

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = [
            RawMessage(offset % 2, offset, m.key, m.value)
            for offset, m in enumerate(adult_messages(config, 8000))
        ]
        batches, _ = preparer.prepare(messages)
        hops = GroupedHops(buffer)
        for batch in batches:
            await hops.store(batch, T0)
        await buffer.ingest(0, None, T0 + 5_000)  # the rest leave after max_wait
        await buffer.ingest(1, None, T0 + 5_000)
        entries = [await pool_entries(client, buffer, p) for p in (0, 1)]
        stats = [await buffer.stats(p) for p in (0, 1)]
        tallies = await TrustedState(client, config).personal_groups()
        await client.aclose()
        return batches, entries, stats, tallies

    batches, entries, stats, tallies = run(scenario())
    assert sum(len(e) for e in entries) == 8000 and all(s["pending"] == 0 for s in stats)
    perturbation = UniformPerturbation(settings.retention, 2)
    own, groups = {}, {}
    for batch in batches:
        perturbed = perturbation.perturb(batch.sensitive[:, 0], batch.ids, KEY, "income")
        for record_id, group, value, draw in zip(
            batch.id_bytes(), batch.groups, batch.sensitive[:, 0], perturbed, strict=True
        ):
            own[record_id] = (int(value), int(draw))
            groups[record_id] = group
    trials = Counter()
    trial_values: dict[tuple, set[int]] = {}
    for partition_entries in entries:
        for entry in partition_entries:
            entry = PoolEntry.parse(entry)
            value, draw = own[entry.id]
            assert int(entry.true) == value
            key = (groups[entry.id], value)
            if entry.audit == b"t":
                assert int(entry.published) == draw  # a trial publishes its own perturbation
                trials[groups[entry.id]] += 1
                trial_values.setdefault(key, set()).add(int(entry.published))
    for partition_entries in entries:
        for entry in partition_entries:
            entry = PoolEntry.parse(entry)
            if entry.audit == b"c":  # a copy repeats a trial of the same original value
                key = (groups[entry.id], own[entry.id][0])
                assert int(entry.published) in trial_values[key]
    # Records of a group from both raw partitions meet in one partition, which grants it
    # s_g(f = 1) trials, whole.
    limit = math.floor(trial_limit(1.0, settings.retention, 2, settings.lam, settings.delta))
    assert max(trials.values()) == limit
    # Trials are counted where only the trusted zone reads: whether a record is one
    # depends on its value (reserve trials), so no counter the consumer reads has them.
    assert sum(g["trials"] for g in tallies.values()) == sum(trials.values()) < 8000
    assert not any("trials" in s or "copies" in s or "borrowed" in s for s in stats)


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_record_ttl_expires_raw_records_and_never_randomized_ones(servers, example):
    """With record_ttl, raw records nobody groups leave Redis by themselves, counted as
    expired; records already randomized (pooled, in flight) stay until published, however
    long emission is held (a pause, a Kafka outage), and the partition works on."""
    # Below the configurable minimum, so the test can wait it out in real time.
    config = stream_config(example, partitions=1, max_wait=1000.0, mixing_pool=50)
    config = replace(config, record_ttl=1.0)
    if config.personal is not None:  # release the first groups, keep later records raw
        config = replace(config, personal=replace(config.personal, release_size=20))

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = adult_messages(config, 400)
        batches, _ = preparer.prepare(messages[:303])  # not a multiple of γ: some wait
        await buffer.ingest(0, batches[0], T0)
        await buffer.take(0, T0, 100)  # some records in flight, never acknowledged
        before = await buffer.stats(0)
        await asyncio.sleep(1.5)  # longer than the TTL, and no worker touches the partition
        after = await buffer.stats(0)
        left = sorted({k.decode().rsplit("}:", 1)[1].split(":")[0]
                       async for k in client.scan_iter(match=f"{buffer.prefix(0)}:*")})  # fmt: skip
        later, _ = preparer.prepare(messages[303:])
        resumed = await buffer.ingest(0, later[0], T0 + 2_000)
        await client.aclose()
        return before, after, left, resumed

    before, after, left, resumed = run(scenario())
    assert before["expired"] == 0 and before["pending"] > 0
    assert before["pool"] + before["in_flight"] > 0
    assert after["pending"] == 0 and after["expired"] == before["pending"]
    assert (after["pool"], after["in_flight"]) == (before["pool"], before["in_flight"])
    assert not {"rec", "t", "b", "gq", "waiting"} & set(left), left
    assert {"pool", "takes"} <= set(left), left
    # Fingerprints stay where they are kept (a personal stream's grouped partitions).
    assert ("seen" in left) == (config.personal is not None), left
    assert set(resumed.statuses) == {0}


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_adversary_truth_counts_published_records_only_and_expires(servers, example):
    """The adversary test's tallies hold exactly the records the broker acknowledged: none
    while emission is held (a pause, records in flight), both tallies for the same
    records once acknowledged, and only the last one to two retention periods."""
    config = stream_config(example, partitions=1, max_wait=1000.0, mixing_pool=50)
    retention = int(config.reports.truth_retention * 1000)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        await ingest_all(buffer, preparer, adult_messages(config, 1000), T0)
        pooled = await TrustedState(client, config).truth()
        half = ((await buffer.stats(0))["pool"] - config.mixing_pool) // 2
        halves = [await buffer.take(0, T0, half), await buffer.take(0, T0, 10_000)]
        held = await TrustedState(client, config).truth()
        await buffer.acknowledge(0, halves[0], T0)
        again = await buffer.take(0, T0, 10_000)  # nothing left above the floor
        await buffer.acknowledge(0, halves[0], T0)  # a repeated acknowledgement adds nothing
        first = await TrustedState(client, config).truth()
        later = T0 + 2 * retention  # two periods on: the first tallies are dropped
        await buffer.acknowledge(0, halves[1], later)
        second = await TrustedState(client, config).truth()
        expiry = [await client.pttl(k) async for k in client.scan_iter(
                  match=f"{buffer.prefix(0)}:truth:*")]  # fmt: skip
        await client.aclose()
        return pooled, halves, again, held, first, second, expiry

    pooled, halves, again, held, first, second, expiry = run(scenario())
    assert len(halves[1]) >= len(halves[0]) > 50 and again == []
    assert pooled == held == ({}, {})  # pooled or in flight: not published yet

    def tallies(items):
        entries = [PoolEntry.parse(entry) for _, entry in items]
        return (Counter(cell_key(e.public, e.true) for e in entries),
                Counter(cell_key(e.public, e.published) for e in entries))  # fmt: skip

    assert tuple(map(Counter, first)) == tallies(halves[0])
    assert tuple(map(Counter, second)) == tallies(halves[1])
    assert first[0] != first[1]  # some values were randomized
    assert len(expiry) == 2 and all(0 < ttl <= 2 * retention for ttl in expiry)  # both sides


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_record_ids_are_recognised_at_any_age_in_bounded_memory(servers, example):
    """A record id seen once is recognised forever (a producer's re-send a year later, on
    either partition, is not randomized again), an id reused with other content is a
    conflict at any age, and Redis keeps 10 bytes per record for it in the identity shards
    (and 10 more in a personal stream's grouped partitions, which see the first hop's
    forwards again after a crash), in at most 65,536 hash fields per shard. Where a first
    copy was read is kept only until its partition has handled it: at the
    end, for the last fetch alone."""
    config = stream_config(example, partitions=2, max_wait=1000.0)
    year = 365 * 86_400_000
    rows = [(b"id-%d" % m.offset, m.value) for m in adult_messages(config, 600)]

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        async with VirtualWorker(servers.kafka_bootstrap, client, config, KEY) as worker:
            await worker.arrive(worker.messages(0, rows[:300]), T0)
            before = await worker.lifecycle.totals()
            await worker.arrive(worker.messages(0, rows[:150]), T0 + year)
            await worker.arrive(worker.messages(1, rows[150:300]), T0 + year)
            await worker.arrive(worker.messages(1, [(rows[0][0], rows[1][1])]), T0 + year)
            await worker.arrive(worker.messages(1, rows[300:]), T0 + year)
            totals = await worker.lifecycle.totals()
            shards = [worker.lifecycle.shard_prefix(s) for s in (0, 1)]
            known = [await client.hgetall(f"{shard}:known") for shard in shards]
            unsettled = [await client.hgetall(f"{shard}:unsettled") for shard in shards]
            partitions = [await client.hgetall(f"{worker.buffer.prefix(p)}:seen") for p in (0, 1)]
        await client.aclose()
        return before, totals, known, unsettled, partitions

    before, totals, known, unsettled, partitions = run(scenario())
    assert before["ingested"] == 300
    assert totals["ingested"] == 600 and totals["redelivered"] == 300
    assert totals["conflicts"] == totals["rejected"] == 1
    assert all(len(fields) <= 65_536 for fields in known)
    assert sum(len(entries) for fields in known for entries in fields.values()) == 600 * 10
    kept = first_reads([call for fields in unsettled for call in fields.values()])
    assert {partition: len(offsets) for partition, offsets in kept.items()} == {1: 300}
    kept = sum(len(entries) for fields in partitions for entries in fields.values())
    assert kept == (600 * 10 if config.personal is not None else 0)


def test_an_id_stored_twice_is_kept_once_and_the_partition_moves_on(servers):
    """Two records with one id but different fingerprints (a fingerprint collision, or a
    bug) must not count twice in a bucket: a cut would pop an empty bucket and the
    partition would stop cutting groups."""
    config = stream_config("adult-decoy.toml", partitions=1)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = adult_messages(config, 2000)
        batch, _ = preparer.prepare(messages[:1])
        twin, _ = preparer.prepare([RawMessage(0, 1, b"twin", messages[0].value)])
        twin[0].ids = batch[0].ids  # the same id under another fingerprint
        first = await buffer.ingest(0, batch[0], T0)
        second = await buffer.ingest(0, twin[0], T0)
        # The partition's next offsets: the buffer takes those up to its last as stored.
        rest, _ = preparer.prepare(
            [RawMessage(0, m.offset + 1, m.key, m.value) for m in messages[1:]]
        )
        await buffer.ingest(0, rest[0], T0)
        await buffer.ingest(0, None, T0 + int(config.max_wait * 1000))
        stats = await buffer.stats(0)
        await client.aclose()
        return first, second, stats

    first, second, stats = run(scenario())
    assert first.statuses == [0] and second.statuses == [1]
    assert stats["ingested"] == 2000 and stats["pending"] == 0
    assert stats["pool"] + stats["suppressed"] == 2000


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_timer_ticks_are_idempotent(servers, example):
    config = stream_config(example, partitions=1)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        await ingest_all(buffer, preparer, adult_messages(config, 1000), T0)
        before = await buffer.stats(0)
        for _ in range(3):
            await buffer.ingest(0, None, T0 + 1)
        after = await buffer.stats(0)
        await client.aclose()
        return before, after

    before, after = run(scenario())
    assert before == after


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_record_keys_may_hold_the_field_separator(servers, example):
    config = stream_config(example, partitions=1)
    value = adult_messages(config, 1)[0].value
    keys = [b"a|b", b"a|b|", b"a", b"a|b"]

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
        messages = [RawMessage(0, offset, key, value) for offset, key in enumerate(keys)]
        outcome = await buffer.ingest(0, preparer.prepare(messages)[0][0], T0)
        stats = await buffer.stats(0)
        await client.aclose()
        return outcome, stats

    outcome, stats = run(scenario())
    assert outcome.statuses == [0, 0, 0, 1]  # only the repeated key is a redelivery
    assert (stats["ingested"], stats["redelivered"]) == (3, 1)


def test_invalid_records_are_rejected_with_reasons():
    config = stream_config("adult-decoy.toml", partitions=1)
    good = json.loads(adult_messages(config, 1)[0].value)
    cases = [
        (b"{not json", None, "not valid JSON"),
        (b"\xff\xfe", None, "not valid UTF-8"),
        (b"", None, "empty message"),
        (b"[1, 2]", None, "a record must be an object"),
        (json.dumps({**good, "zip": "1"}).encode(), "zip", "unknown attribute"),
        (json.dumps({**good, "occupation": None}).encode(), "occupation", "missing value"),
        (json.dumps({**good, "occupation": "Astronaut"}).encode(), "occupation", "outside"),
        (json.dumps({**good, "age": 12}).encode(), "age", "outside the bins"),
        (json.dumps({**good, "sex": 1.5}).encode(), "sex", "expected a string"),
        (b"{" + b" " * 70_000 + b"}", None, "exceeds"),
        (b"[" * 50_000, None, "not valid JSON"),
    ]
    messages = [RawMessage(0, i, b"%d" % i, value) for i, (value, _, _) in enumerate(cases)]
    batches, rejected = Preparer(config, KEY).prepare(messages)
    assert batches == [] and len(rejected) == len(cases)
    for rejection, (_, field, reason) in zip(rejected, cases, strict=True):
        assert rejection.rejection.field == field and reason in rejection.rejection.reason
        assert "Astronaut" not in rejection.rejection.reason
        payload = json.loads(rejection.payload())
        assert payload["offset"] == rejection.message.offset and payload["reason"]


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_ids_are_keyed_by_the_producers_key_on_every_partition(example):
    """A response's id and fingerprint come from its key alone: the same on any partition
    and at any offset, whatever else differs. A message without a key is rejected: nothing
    could recognise it when it is sent again."""
    config = stream_config(example, partitions=2)
    preparer = Preparer(config, KEY)
    message = adult_messages(config, 1)[0]
    first = preparer.prepare([RawMessage(0, 7, b"r1", message.value)])[0][0]
    assert first.dedup_keys == [b"k:r1"]
    elsewhere = preparer.prepare([RawMessage(1, 99, b"r1", message.value)])[0][0]
    assert np.array_equal(first.ids, elsewhere.ids)  # a re-send gets its id back
    assert first.fingerprints == elsewhere.fingerprints
    other = preparer.prepare([RawMessage(0, 7, b"r2", message.value)])[0][0]
    assert not np.array_equal(first.ids, other.ids)
    assert first.fingerprints[0][:8] != other.fingerprints[0][:8]
    assert first.fingerprints[0][8:] == other.fingerprints[0][8:]  # the content digest
    batches, rejected = preparer.prepare([RawMessage(0, 8, None, message.value)])
    assert batches == [] and rejected[0].rejection.reason == NO_KEY
    assert "Kafka key" in NO_KEY
