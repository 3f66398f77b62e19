"""The worker's decoy steps (`service.core.decoy_cuts`, stored by decoy_store.lua) and
the takes it draws from the pool it holds (`service.core.takes`, stored by
take_store.lua) leave Redis exactly as decoy.lua's steps and emit.lua's takes do, call for
call, from the same records, clock and take seeds: the same pool entries in the same order
(groups, published values, audits), the same waiting records, buckets, arrival index,
suppressions, counters and watermark, the same takes in flight and the same pool left.
Driven in the regimes users live in: a burst, a slow survey on a virtual clock whose
records wait past max_wait, a skewed stream whose value over its share is suppressed,
redeliveries, a record TTL, a worker restarted mid-stream, takes of every size, and
Redis changed behind the worker's back (the step or take is then refused unwritten and
decoy.lua or emit.lua does it).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import replace

import msgspec
import pytest
from harness import Harness, adult_rows, buffer_steps

from service.core.decoy_cuts import KeyedUniforms, plan_groups
from service.core.takes import MixingPool, shuffle_uniforms
from service.store.buffer import StreamBuffer, connect

GAMMA = 5
# Records a take may release at most, in turn: a whole backlog, a few, a pool's worth.
TAKE_LIMITS = (20_000, 37, 400)


def test_keyed_uniforms_are_five_32_bit_slices_of_each_sha1_block():
    uniforms = KeyedUniforms("seed", 41)
    draw = iter(uniforms).__next__
    drawn = [draw() for _ in range(7)]
    blocks = [hashlib.sha1(b"seed:%d" % k).hexdigest() for k in (42, 43)]
    expected = [int(block[at : at + 8], 16) / 2**32 for block in blocks for at in range(0, 40, 8)]
    assert drawn == expected[:7]
    assert uniforms.counter == 43


def test_a_plan_cuts_groups_of_distinct_values_taking_every_value_over_its_share():
    generator = random.Random(5)
    sizes = [40, 3, 9, 0, 1, 7, 2, 12]
    plan = plan_groups(sizes, GAMMA, generator.random)
    left = list(sizes)
    for chosen in plan:
        assert len(set(chosen)) == GAMMA == len(chosen) and chosen == sorted(chosen)
        pending = sum(left)
        forced = {i for i, s in enumerate(left) if s > 0 and s * GAMMA >= pending}
        assert forced <= set(chosen)
        for i in chosen:
            left[i] -= 1
    assert sum(1 for s in left if s > 0) < GAMMA
    assert all(s >= 0 for s in left)


def test_shuffle_uniforms_are_three_48_bit_slices_of_each_sha1_block():
    drawn = shuffle_uniforms("seed", 4).tolist()
    blocks = [hashlib.sha1(b"seed:%d" % k).hexdigest() for k in (1, 2)]
    expected = [int(block[at : at + 12], 16) / 2**48 for block in blocks for at in (0, 12, 24)]
    assert drawn == expected[:4]


def test_a_take_is_the_partial_fisher_yates_from_the_pools_end():
    entries = [b"e%d" % p for p in range(1, 11)]
    pool = MixingPool(list(entries), 7)
    take = pool.take(4, "seed")
    uniforms, reference = iter(shuffle_uniforms("seed", 4).tolist()), list(entries)
    expected = []
    for last in range(10, 6, -1):
        j = last - int(next(uniforms) * last)
        expected.append(reference[j - 1])
        reference[j - 1] = reference[last - 1]
    assert take.entries == expected and take.size == 10
    assert pool.entries == reference[:6] and pool.pooled_ms == 7
    assert dict(take.moved) == {p: e for p, e in enumerate(reference[:6], 1) if e != entries[p - 1]}
    assert pool.take(6, "other").moved == [] and pool.pooled_ms == 0


@pytest.mark.parametrize(
    ("size", "now", "due"), [(130, 0, 30), (100, 999, 0), (100, 1_000, 100), (99, 5_000, 0)]
)
def test_a_take_releases_the_excess_or_a_quiet_pool_whole(size, now, due):
    pool = MixingPool([b"e"] * size, 0)
    assert pool.due(now, 100, 1_000, 40) == due


def _config(harness: Harness, name: str, max_wait: float, ttl: float | None):
    return replace(harness.config, name=name, max_wait=max_wait, record_ttl=ttl, mixing_pool=120)


async def _snapshot(client, config, partition: int) -> dict:
    """Every key a decoy step writes in a partition, decoded; records as decoy.lua's
    fields, whichever msgpack string type they were packed with."""
    prefix = f"splu:{{{config.name}:{partition}}}"
    values = range(config.schema.sensitive[0].size)
    out: dict = {
        "off": await client.get(f"{prefix}:off"),
        "stats": await client.hgetall(f"{prefix}:stats"),
        "waiting": await client.hgetall(f"{prefix}:waiting"),
        "n": await client.hgetall(f"{prefix}:n:1"),
        "sup": await client.hgetall(f"{prefix}:sup"),
        "t": await client.zrange(f"{prefix}:t", 0, -1, withscores=True),
        "pool": await client.hgetall(f"{prefix}:pool"),
        "pooled": await client.get(f"{prefix}:pooled"),
        "takes": await client.hgetall(f"{prefix}:takes"),
        "buckets": [await client.zrange(f"{prefix}:b:1:{v}", 0, -1) for v in values],
        "expiring": [
            await client.pttl(f"{prefix}:{key}") > 0 for key in ("rec", "t", "n:1", "waiting")
        ],
    }
    out["rec"] = {
        record_id: msgspec.msgpack.decode(packed)
        for record_id, packed in (await client.hgetall(f"{prefix}:rec")).items()
    }
    return out


async def _replay(config_general, config_decided, steps, tamper_at=None, restart_at=None):
    key = config_general.service_key()
    client = connect(config_general)
    seed = [""]
    general = StreamBuffer(client, config_general, key, entropy=lambda n: seed[0])
    general._decides = False
    decided = StreamBuffer(client, config_decided, key, entropy=lambda n: seed[0])
    assert decided._decides
    stale, tampered, pool_tampered, takes_drawn, pool_drops = 0, None, None, 0, 0
    seeds = random.Random(len(steps))

    def holds_pool(partition: int) -> bool:
        state = decided._decoy.get(partition)
        return state is not None and state.pool is not None

    try:
        for number, (partition, now, batch, through) in enumerate(steps):
            had_pool = holds_pool(partition)
            if number == restart_at:
                decided = StreamBuffer(client, config_decided, key, entropy=lambda n: seed[0])
            prefix = f"splu:{{{config_general.name}:{partition}}}"
            if tampered is None and number >= tamper_at and await client.hlen(f"{prefix}:rec"):
                tampered = number
                # Behind the worker's back, as a record TTL expiring would: both sides lose
                # the same waiting record.
                for config in (config_general, config_decided):
                    prefix = f"splu:{{{config.name}:{partition}}}"
                    record_id = sorted(await client.hkeys(f"{prefix}:rec"))[0]
                    value = msgspec.msgpack.decode(await client.hget(f"{prefix}:rec", record_id))
                    await client.hdel(f"{prefix}:rec", record_id)
                    await client.zrem(f"{prefix}:t", record_id)
                    await client.zrem(f"{prefix}:b:1:{value[2][0]}", record_id)
                    await client.hincrby(f"{prefix}:n:1", value[2][0], -1)
                held = partition in decided._decoy
            expected = await general.ingest(partition, batch, now, through)
            got = await decided.ingest(partition, batch, now, through)
            assert got == expected, f"step {number}"
            assert await _snapshot(client, config_decided, partition) == await _snapshot(
                client, config_general, partition
            ), f"step {number}"
            if number == tampered and held:
                stale += 1
            assert partition in decided._decoy or number == tampered, f"step {number}"
            if pool_tampered is not None and partition == pool_tampered:
                pool_drops += had_pool and not holds_pool(partition)
            if pool_tampered is None and number >= 2 * tamper_at and holds_pool(partition):
                pool_tampered = partition
                # Behind the worker's back: a record enters both pools, so the worker's
                # next take or step finds the pool not as it holds it, and drops it.
                for config in (config_general, config_decided):
                    prefix = f"splu:{{{config.name}:{partition}}}"
                    size = await client.hlen(f"{prefix}:pool")
                    await client.hset(f"{prefix}:pool", size + 1, b"p|1|0:1|1|%d|x" % now)
            limit = TAKE_LIMITS[number % len(TAKE_LIMITS)]
            while True:
                seed[0] = seeds.randbytes(16).hex()
                had_pool = holds_pool(partition)
                expected = await general.take(partition, now, limit)
                got = await decided.take(partition, now, limit)
                assert got == expected and got.takes == expected.takes, f"step {number}"
                takes_drawn += bool(got) and had_pool and holds_pool(partition)
                if partition == pool_tampered:
                    pool_drops += had_pool and not holds_pool(partition)
                else:
                    assert holds_pool(partition) or not had_pool, f"take {number}"
                assert await _snapshot(client, config_decided, partition) == await _snapshot(
                    client, config_general, partition
                ), f"take {number}"
                if not got:
                    break
    finally:
        await client.aclose()
    assert tampered is not None, "no record waited to lose"
    assert pool_tampered is not None and takes_drawn >= 5, (pool_tampered, takes_drawn)
    assert pool_drops == 1, "the pool held was not dropped once it changed behind the worker"
    return stale


@pytest.mark.redis
@pytest.mark.parametrize(
    ("records", "per_step", "step_ms", "max_wait", "ttl", "skewed"),
    [
        (4_000, 503, 200, 3.0, None, False),
        (900, 3, 20_000, 600.0, None, False),
        (3_000, 200, 1_000, 4.0, 3600.0, True),
    ],
    ids=["burst", "slow survey", "skewed with a record ttl"],
)
def test_the_worker_decides_what_decoy_lua_decided(
    servers, tmp_path, records, per_step, step_ms, max_wait, ttl, skewed
):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    general = _config(harness, harness.config.name + "g", max_wait, ttl)
    decided = _config(harness, harness.config.name + "d", max_wait, ttl)
    rows = adult_rows(general)[:records]
    if skewed:
        # Half the records of one value: over its share of 1/γ, so its surplus waits past
        # max_wait and is suppressed.
        craft = [row for row in adult_rows(general) if b'"Craft-repair"' in row[1]]
        rows = [row for pair in zip(rows, craft, strict=False) for row in pair][:records]
    steps = buffer_steps(general, rows, per_step, step_ms, ticks=3, stored_again=3)
    tamper_at, restart_at = len(steps) // 3, len(steps) // 2
    stale = asyncio.run(_replay(general, decided, steps, tamper_at, restart_at))
    assert stale == 1, "the step after Redis changed was not refused as stale"
