"""The identity screen (service/store/lua/identity.lua) forgets where a first copy was read
once its raw partition has handled it, and still lets exactly the first copies through.

A virtual worker drives one shard through fetches of three raw partitions whose logs mix
new ids, re-sends of earlier ones (to any partition) and ids reused with other content;
it crashes between screening and storing and between storing and committing, and tells
the screen handled offsets that lag behind its buffers by random amounts (as a pipelined
worker, or a new one that knows none yet, does). Beside it runs the screen as specified
before first reads were forgotten: every id keeps where its first copy was read for life
(`ReferenceScreen`). Both feed model buffers that store a passed record if its offset is
past their partition's watermark, as ingest.lua does. They must store the same records
at every step, reject the same ones and count the same re-sends and conflicts; every id
ends up stored once; and once every partition is handled, the shard keeps 10 bytes per id
and no first read.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import random
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from service.core.config import parse_config
from service.core.ingest import Preparer, RawMessage
from service.core.prf import ServiceKey
from service.core.table import open_sample
from service.store.buffer import lua_script
from service.store.lifecycle import Lifecycle

pytestmark = pytest.mark.redis

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
PARTITIONS = 3
MESSAGES = 1500


@dataclass(frozen=True)
class Message:
    partition: int
    offset: int
    fingerprint: bytes  # bucket (2), key (6), content digest (4), as identity.lua reads it

    @property
    def member(self) -> bytes:
        return self.fingerprint[:8]


def fingerprint(identity: int, content: int) -> bytes:
    # Few buckets, so that lookups meet other members in theirs.
    bucket = (identity % 5).to_bytes(2, "big")
    key = hashlib.blake2b(b"%d" % identity, digest_size=6).digest()
    return bucket + key + hashlib.blake2b(b"%d/%d" % (identity, content), digest_size=4).digest()


def logs(rng: random.Random) -> list[list[Message]]:
    """Each raw partition's log: new ids, re-sends of ids already written anywhere, and ids
    reused with other content."""
    out: list[list[Message]] = [[] for _ in range(PARTITIONS)]
    written: list[int] = []
    for identity in range(MESSAGES):
        p = rng.randrange(PARTITIONS)
        kind = rng.random()
        if written and kind < 0.25:
            fp = fingerprint(rng.choice(written), 0)
        elif written and kind < 0.3:
            fp = fingerprint(rng.choice(written), 1)
        else:
            fp = fingerprint(identity, 0)
            written.append(identity)
        out[p].append(Message(p, len(out[p]), fp))
    return out


class ReferenceScreen:
    """Every id keeps its content digest and where its first copy was read, for life."""

    def __init__(self) -> None:
        self.first: dict[bytes, tuple[bytes, tuple[int, int]]] = {}
        self.screened: dict[int, int] = {}
        self.redelivered = self.conflicts = 0

    def screen(self, messages: list[Message]) -> list[int]:
        watermarks = dict(self.screened)
        for m in messages:
            self.screened[m.partition] = max(self.screened.get(m.partition, -1), m.offset)
        statuses = []
        for m in messages:
            digest, read_at = m.fingerprint[8:], (m.partition, m.offset)
            known = self.first.get(m.member)
            first_time = m.offset > watermarks.get(m.partition, -1)
            if known is None:
                self.first[m.member] = (digest, read_at)
                statuses.append(0)
            elif known[0] != digest:
                statuses.append(2)
                self.conflicts += first_time
            elif known[1] != read_at:
                statuses.append(1)
                self.redelivered += first_time
            else:
                statuses.append(0)
        return statuses


class RedisScreen:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.prefix = f"splu:{{screen{uuid.uuid4().hex[:8]}:ids:0}}"
        self.script = client.register_script(lua_script("fingerprints", "identity"))

    def screen(self, messages: list[Message], handled: dict[int, int]) -> list[int]:
        args: list[bytes | int] = [
            b"".join(
                m.fingerprint + m.partition.to_bytes(2, "big") + m.offset.to_bytes(6, "big")
                for m in messages
            )
        ]
        for p in sorted({m.partition for m in messages}):
            highest = max(m.offset for m in messages if m.partition == p)
            args += [p.to_bytes(2, "big"), highest, handled.get(p, -1)]
        found = self.script(keys=[self.prefix], args=args)
        statuses = [0] * len(messages)
        for k in range(0, len(found), 2):
            statuses[int(found[k]) - 1] = int(found[k + 1])
        return statuses

    def stats(self) -> dict[bytes, int]:
        return {k: int(v) for k, v in self.client.hgetall(f"{self.prefix}:stats").items()}

    def known_bytes(self) -> int:
        """Bytes of the ids' entries, a split bucket's mark not counted."""
        values = self.client.hgetall(f"{self.prefix}:known").values()
        return sum(len(v) for v in values if v != b"/")

    def first_reads(self) -> int:
        """First copies whose read position is kept."""
        return sum(map(len, first_reads(self.client.hvals(f"{self.prefix}:unsettled")).values()))


def first_reads(calls: list[bytes]) -> dict[int, list[int]]:
    """The offsets of the first copies `:unsettled` keeps, by raw partition."""
    out: dict[int, list[int]] = {}
    for call in calls:
        count = len(call) // 21
        marks, records = call[:count], call[count:]
        for position in [i for i, mark in enumerate(marks) if mark == ord("1")]:
            record = records[20 * position : 20 * position + 20]
            partition = int.from_bytes(record[12:14], "big")
            out.setdefault(partition, []).append(int.from_bytes(record[14:], "big"))
    return out


@dataclass
class Buffers:
    """Each raw partition's buffer as ingest.lua keeps it: everything up to the watermark
    handled, a passed record stored if it is past it."""

    watermark: dict[int, int] = field(default_factory=dict)
    stored: list[tuple[int, int]] = field(default_factory=list)

    def store(self, messages: list[Message], statuses: list[int]) -> list[tuple[int, int]]:
        new = [
            (m.partition, m.offset)
            for m, status in zip(messages, statuses, strict=True)
            if status == 0 and m.offset > self.watermark.get(m.partition, -1)
        ]
        for m in messages:
            self.watermark[m.partition] = max(self.watermark.get(m.partition, -1), m.offset)
        self.stored += new
        return new


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forgetting_first_reads_stores_what_remembering_them_does(redis_client, seed):
    rng = random.Random(seed)
    written = logs(rng)
    screen, reference = RedisScreen(redis_client), ReferenceScreen()
    buffers, reference_buffers = Buffers(), Buffers()
    committed = dict.fromkeys(range(PARTITIONS), 0)
    position = dict(committed)
    handled: dict[int, int] = {}  # what the worker knows its buffers handled
    told: list[dict[int, int]] = [{}]  # what it knew before, for lagging claims
    rejected: list[tuple[int, int]] = []
    while any(position[p] < len(written[p]) for p in range(PARTITIONS)):
        partitions = [p for p in range(PARTITIONS) if position[p] < len(written[p])]
        fetch = []
        for p in rng.sample(partitions, rng.randint(1, len(partitions))):
            fetch += written[p][position[p] : position[p] + rng.randint(1, 40)]
        claim = rng.choice(told) if rng.random() < 0.3 else handled
        statuses = screen.screen(fetch, claim)
        expected = reference.screen(fetch)
        assert [s == 2 for s in statuses] == [s == 2 for s in expected]
        # A pass where the reference skips only at an offset its buffer handled.
        for m, status, wanted in zip(fetch, statuses, expected, strict=True):
            if status != wanted:
                assert (status, wanted) == (0, 1)
                assert m.offset <= buffers.watermark.get(m.partition, -1)
        if rng.random() < 0.15:  # a crash before storing: a new worker reads again
            position, handled, told = dict(committed), {}, [{}]
            continue
        assert buffers.store(fetch, statuses) == reference_buffers.store(fetch, expected)
        rejected += [
            (m.partition, m.offset) for m, s in zip(fetch, statuses, strict=True) if s == 2
        ]
        told.append(dict(handled))
        for m in fetch:
            position[m.partition] = max(position[m.partition], m.offset + 1)
            handled[m.partition] = max(handled.get(m.partition, -1), m.offset)
        if rng.random() < 0.6:
            committed = dict(position)
        elif rng.random() < 0.1:  # a crash between storing and committing
            position, handled, told = dict(committed), {}, [{}]

    stats = screen.stats()
    assert (stats[b"redelivered"], stats[b"conflicts"]) == (
        reference.redelivered,
        reference.conflicts,
    )
    # Every id stored once, by its first copy; a reused id's other content never.
    by_position = {(m.partition, m.offset): m for log in written for m in log}
    members = [by_position[at].member for at in buffers.stored]
    assert len(members) == len(set(members)) == len(reference.first)
    assert all(reference.first[by_position[at].member][1] == at for at in buffers.stored)
    assert {by_position[at].member for at in rejected} <= set(members)

    # Once each partition's buffer is known to have handled everything, one more call per
    # partition (a replay of its last record) leaves no first read, and ids 10 bytes each.
    assert screen.first_reads() > 0
    for p in range(PARTITIONS):
        screen.screen([written[p][-1]], buffers.watermark)
    assert screen.first_reads() == 0
    assert screen.known_bytes() == 10 * len(reference.first)


def test_a_first_copy_read_again_before_its_partition_handled_it_passes(redis_client):
    """The first copy of an id, screened but not stored (a crash), passes again on its
    replay; a re-send on another partition meanwhile is skipped; both are judged alike
    once the first copy's partition is known to have handled it."""
    screen = RedisScreen(redis_client)
    first = Message(0, 7, fingerprint(1, 0))
    resend = Message(1, 3, first.fingerprint)
    assert screen.screen([first], {}) == [0]
    assert screen.screen([resend, first], {0: 6}) == [1, 0]
    assert screen.first_reads() == 1
    # Handled: the first copy's replay passes (its buffer knows the offset), a new re-send
    # on partition 1 past its handled offset is skipped.
    assert screen.screen([first, Message(1, 4, first.fingerprint)], {0: 7, 1: 3}) == [0, 1]
    assert screen.first_reads() == 0
    assert screen.stats()[b"redelivered"] == 2


def test_a_screen_an_earlier_version_kept_stops_the_worker(servers):
    """Over an identity shard an earlier version kept (every id with where its first copy
    was read, in `:seen`), the screen stops with what to do, and writes nothing."""
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"]["name"] = f"old{uuid.uuid4().hex[:8]}"
    config = parse_config(document, "adult-decoy.toml", EXAMPLES)
    with open_sample() as sample:
        row = next(csv.DictReader(sample))
    value = json.dumps({name: row[name] for name in config.schema.names}).encode()
    (batch,), _ = Preparer(config, ServiceKey.from_seed(3)).prepare(
        [RawMessage(0, 0, b"r0", value)]
    )

    async def scenario() -> list[bytes]:
        client = aioredis.from_url(servers.redis_url)
        lifecycle = Lifecycle(client, config)
        for shard in range(config.partitions):
            await client.hset(f"{lifecycle.shard_prefix(shard)}:seen", b"\0\0", b"x" * 18)
        try:
            with pytest.raises(RuntimeError, match="identity screen of an earlier version"):
                await lifecycle.screen([batch], {})
            return [
                key
                for shard in range(config.partitions)
                async for key in client.scan_iter(match=f"{lifecycle.shard_prefix(shard)}:*")
            ]
        finally:
            await client.aclose()

    keys = asyncio.run(scenario())
    assert len(keys) == config.partitions and all(key.endswith(b":seen") for key in keys)


def test_first_reads_of_two_calls_ending_at_one_offset_are_both_kept(redis_client):
    """A call's first reads are kept under its partition and highest offset there. While
    fetches read a partition's log in order from committed offsets, a later call ending
    at the same offset finds every id known; the screen does not rely on it: two calls
    that both add first reads keep both, and each first copy, read again before its
    partition handled it, still passes."""
    screen = RedisScreen(redis_client)
    a = Message(0, 5, fingerprint(1, 0))
    b = Message(0, 4, fingerprint(2, 0))
    assert screen.screen([a], {}) == [0]
    assert screen.screen([b, a], {}) == [0, 0]
    assert screen.first_reads() == 2
    assert screen.screen([b, a], {0: 3}) == [0, 0]
    assert screen.screen([Message(1, 0, a.fingerprint)], {0: 3}) == [1]
    assert screen.screen([a], {0: 5}) == [0]
    assert screen.first_reads() == 0
