"""Fault tests (issue 6): crashes and redeliveries change nothing that gets published.

A producer sends 20,000 Adult records while the worker is SIGKILLed at seeded random
points (each time restarted at once), the Redis-protocol server is SIGKILLed and
restarted from its append-only file, and the consumer is SIGKILLed and restarted.
Afterwards:

- every accepted record is published once, under one token, or counted as suppressed;
- every published value is the keyed draw of its record, not a second draw. Reading
  the raw topic back gives each record's partition, hence its id and keyed draws
  (`Preparer`). A decoy record's group is visible only inside Redis: in snapshots of
  the pools and in-flight hashes, and in the server's MONITOR feed, which shows the
  pool entries the Lua steps write, group values included. A personal stream's
  publication follows from the key and the order of ``<stream>.grouped`` alone (trials
  while the group's fixed budget lasts, then copies in turn), so it is recomputed for
  every record;
- the consumer's cell counts equal the published topic's distinct tokens.

The producer sends at 4,000 records/s once the first worker consumes: a worker takes
about ten seconds to start and join its group, so the first kill falls while the
producer runs and the others while the restarted workers catch up.

Then the worker's consumer group is rewound to offset 0 on `<stream>.raw`: the whole
topic comes again, nothing new is published and `redelivered` grows by its size.

A personal stream takes two hops (``<stream>.raw`` → ``<stream>.grouped`` → Redis);
`test_a_kill_between_the_hops_loses_duplicates_and_rerandomizes_nothing` stops its worker
right after each hop, before the hop's offsets are committed.

SPLU_FAULT_SEED changes the seeded fault plan; each run prints its faults and counts
(visible with -s).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import fault_points
import numpy as np
import pytest
import redis.asyncio as aioredis
from harness import RECORDS, Harness, adult_rows
from redis.exceptions import RedisError

from deploy.embedded import HOST, RedisServer, spawn_worker
from service.cli import client as consumer_client
from service.core.config import StreamConfig
from service.core.ingest import Preparer, RawMessage
from service.core.mechanisms.personal_stream import BORROWED, COPY, TRIAL, stream_trials
from service.core.published import CellCodec
from service.core.wire import PoolEntry, cell_fields
from service.store.auditor import TrustedState
from service.store.running_counts import RunningCounts
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

# Whole stream processes on the embedded servers; run once, not again on Debian's Redis.
pytestmark = pytest.mark.stream

RATE = 4000  # records per second from the producer
WARM_UP = 100  # records sent before the first worker is seen consuming
SEED = int(os.environ.get("SPLU_FAULT_SEED", "6"))
POLL = 0.1  # seconds between snapshots and fault decisions
FAULT_TIMEOUT = 150.0
SETTLE_TIMEOUT = 60.0
QUIET = 1.5  # seconds past the flush interval: anything still to publish would be out
POOL_ADD = b' lua] "HSET" "'  # a Lua step's HSET as MONITOR shows it (pool.lua)


@dataclass(frozen=True)
class Kill:
    """Kill the worker once `at` of the records are ingested: `delay` seconds after it
    is seen working again, or with `startup`, `delay` seconds after its start, working
    or not (Faust still starting, joining its group or re-sending)."""

    at: float
    delay: float
    startup: bool = False


@dataclass
class Plan:
    kills: list[Kill]
    redis_at: float  # ingest fraction of the Redis kill
    outage: float  # seconds Redis stays down
    consumer_at: float  # ingest fraction of the consumer kill

    @classmethod
    def draw(cls, rng: random.Random) -> Plan:
        kills = [Kill(rng.uniform(0.03, 0.2), rng.uniform(0.0, 0.3))]  # while producing
        kills += [Kill(rng.uniform(0.2, 0.95), rng.uniform(0.0, 0.4)) for _ in range(3)]
        kills.append(Kill(rng.uniform(0.03, 0.95), rng.uniform(0.5, 6.0), startup=True))
        kills.append(Kill(1.0, rng.uniform(0.0, 0.3)))  # all ingested, the pool not yet out
        kills.sort(key=lambda kill: kill.at)
        return cls(kills, rng.uniform(0.3, 0.7), rng.uniform(1.0, 3.0), rng.uniform(0.15, 0.85))


@dataclass
class Observed:
    """What the test did and saw while the stream ran."""

    kills: list[str] = field(default_factory=list)
    kills_while_producing: int = 0
    redis: str = ""
    consumer: str = ""
    unexpected_exits: list[str] = field(default_factory=list)
    snapshots: int = 0
    snapshot_entries: int = 0
    entries: dict[bytes, set[bytes]] = field(default_factory=lambda: defaultdict(set))
    tokens: dict[bytes, set[bytes]] = field(default_factory=lambda: defaultdict(set))
    totals: dict[str, int] = field(default_factory=dict)
    took: float = 0.0

    def add(self, entries: list[tuple[int, str | None, bytes]]) -> None:
        self.snapshots += 1
        self.snapshot_entries += len(entries)
        for _, token, entry in entries:
            record_id = PoolEntry.parse(entry).id
            self.entries[record_id].add(entry)
            if token is not None:
                self.tokens[record_id].add(token.encode())


class PoolMonitor:
    """Every entry a Lua step adds to a mixing pool, from the server's MONITOR feed
    (which shows the commands scripts run), one list per connection: a Redis restart
    starts a new one. An entry of a script the crash cut short may precede it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sessions: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-monitor", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.sessions:
            assert time.monotonic() < deadline, "MONITOR did not attach"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def entries(self) -> int:
        return sum(len(session) for session in self.sessions)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with socket.create_connection((HOST, self.port), timeout=1.0) as sock:
                    self._follow(sock)
            except OSError:
                pass
            time.sleep(0.005)

    def _follow(self, sock: socket.socket) -> None:
        sock.sendall(b"MONITOR\r\n")
        buffer = b""
        while b"\r\n" not in buffer:
            data = sock.recv(1 << 16)
            if not data:
                return
            buffer += data
        first, _, buffer = buffer.partition(b"\r\n")
        if first != b"+OK":  # -LOADING while the server reads its AOF
            return
        entries: list[bytes] = []
        self.sessions.append(entries)
        sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not data:
                return
            lines = (buffer + data).split(b"\r\n")
            buffer = lines.pop()
            for line in lines:
                if POOL_ADD in line and b':pool" "' in line:
                    # An entry holds digits and , | : ; only: the last quoted argument.
                    entries.append(line.rsplit(b' "', 1)[1][:-1])


async def run_faults(
    harness: Harness, redis_server: RedisServer, rows: list, plan: Plan
) -> Observed:
    """Produce every row while the plan's faults happen; return once all has settled."""
    config = harness.config
    seen = Observed()
    kills = list(plan.kills)
    redis_done = consumer_done = False
    client = aioredis.from_url(config.redis_url)
    began = time.monotonic()
    ready = asyncio.Event()

    async def producer() -> None:
        # A worker takes seconds to start: the bulk goes out once the first one consumes.
        await produce(config, iter(rows[:WARM_UP]), rate=RATE, progress=False)
        await ready.wait()
        await produce(config, iter(rows[WARM_UP:]), rate=RATE, progress=False)

    producing = asyncio.create_task(producer())
    started, ingested_at_start, working_since = began, 0, None  # of the current worker
    totals: dict[str, int] = {}

    async def snapshot() -> None:
        seen.add(await harness.entries(client))

    try:
        while True:
            if time.monotonic() - began > FAULT_TIMEOUT:
                raise AssertionError(f"the stream did not settle: {totals}; left: {kills}")
            await asyncio.sleep(POLL)
            try:
                totals = await harness.totals(client)
                await snapshot()
            except (RedisError, OSError):
                await client.aclose()
                client = aioredis.from_url(config.redis_url)
                continue
            for name, process in (("worker", harness.worker), ("consumer", harness.consumer)):
                if not process.running:
                    seen.unexpected_exits.append(f"{name} at {totals.get('ingested')} ingested")
                    (harness.start_worker if name == "worker" else harness.start_consumer)()
            ingested = totals.get("ingested", 0)
            if ingested:
                ready.set()
            state = f"{ingested} ingested, {totals['pool']} pooled, {totals['in_flight']} in flight"
            now = time.monotonic()
            if working_since is None and (ingested > ingested_at_start or ingested == RECORDS):
                working_since = now
            kill = kills[0] if kills else None
            if kill is not None and ingested >= kill.at * RECORDS:
                since = started if kill.startup else working_since
                if since is not None and now - since >= kill.delay:
                    kills.pop(0)
                    waiting = await harness.entries(client)
                    seen.add(waiting)
                    harness.worker.kill()
                    await snapshot()
                    in_flight = sum(token is not None for _, token, _ in waiting)
                    seen.kills.append(
                        f"{ingested} ingested, {len(waiting) - in_flight} pooled, {in_flight} in"
                        f" flight, {now - started:.1f} s after start"
                        + (" (startup kill)" if kill.startup else "")
                    )
                    seen.kills_while_producing += not producing.done()
                    harness.start_worker()
                    started, working_since = time.monotonic(), None
                    # Counted after the kill: a step the dead worker sent may still finish.
                    ingested_at_start = (await harness.totals(client)).get("ingested", 0)
            if not redis_done and ingested >= plan.redis_at * RECORDS:
                redis_done = True
                await snapshot()
                await client.aclose()
                redis_server.kill()
                await asyncio.sleep(plan.outage)
                # From this thread: the kernel kills a server when the thread that started
                # it exits (PR_SET_PDEATHSIG), so not from a short-lived executor thread.
                redis_server.start()
                client = aioredis.from_url(config.redis_url)
                seen.redis = f"at {state}, down {plan.outage:.1f} s"
                continue
            if not consumer_done and ingested >= plan.consumer_at * RECORDS:
                consumer_done = True
                harness.consumer.kill()
                harness.start_consumer()
                seen.consumer = f"at {state}"
            settled = (
                producing.done() and not kills and redis_done and consumer_done
                and ingested == totals["settled"] == RECORDS
            )  # fmt: skip
            if settled:
                break
        await producing
        seen.totals = totals
        seen.took = time.monotonic() - began
        return seen
    finally:
        producing.cancel()
        await client.aclose()


async def pooled_ids(harness: Harness) -> set[bytes]:
    """Ids of the records in the mixing pools (not in flight)."""
    client = aioredis.from_url(harness.config.redis_url)
    try:
        entries = await harness.entries(client)
    finally:
        await client.aclose()
    return {PoolEntry.parse(entry).id for _, token, entry in entries if token is None}


async def consumer_state(harness: Harness, published: int) -> tuple[dict, dict, dict]:
    """Once the consumer counted `published` records (or at the deadline): its counters
    and tally, and the worker's suppressions per (attribute, value)."""
    client = aioredis.from_url(harness.config.redis_url)
    counts = RunningCounts(client, harness.config)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    try:
        while True:
            stats = await counts.stats()
            if stats.get("records", 0) >= published or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        suppressed = await TrustedState(client, harness.config).suppressed()
        return stats, await counts.tally(), suppressed
    finally:
        await client.aclose()


async def current_totals(harness: Harness) -> dict[str, int]:
    client = aioredis.from_url(harness.config.redis_url)
    try:
        return await harness.totals(client)
    finally:
        await client.aclose()


async def wait_committed(harness: Harness, topic: str, group: str, ends: dict[int, int]) -> dict:
    """The group's committed offsets on `topic` once they reach `ends` (or at the
    deadline)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        committed = await harness.committed_offsets(topic, group)
        if committed == ends or time.monotonic() > deadline:
            return committed
        await asyncio.sleep(0.5)


def ends_of(config: StreamConfig, messages: list) -> dict[int, int]:
    """The end offset of each partition of a topic read whole."""
    sizes = Counter(m.partition for m in messages)
    return {partition: sizes[partition] for partition in range(config.partitions)}


def grouped_order(grouped: list) -> dict[bytes, tuple[int, int]]:
    """Each record id's first (partition, offset) on <stream>.grouped: the one stored, since
    a partition is stored in offset order and later copies are recognised. A value starts
    with the record's id (`StreamBuffer.grouped_messages`)."""
    order: dict[bytes, tuple[int, int]] = {}
    for message in grouped:
        where = (message.partition, message.offset)
        record_id = message.value[:32]
        order[record_id] = min(order.get(record_id, where), where)
    return order


@dataclass
class Record:
    """An accepted raw record and its keyed randomization inputs."""

    partition: int
    offset: int
    id: bytes
    public: bytes
    values: list[int]
    draws: list[int]  # decoy: per sensitive attribute, the index into its group's values
    group: bytes  # personal: the group key
    perturbed: int  # personal: the keyed perturbation of the true value


def accepted_records(config: StreamConfig, raw: list) -> dict[bytes, Record]:
    """Each distinct raw record by id (the first of a key, by offset), as the worker
    prepared it from its partition and key."""
    messages = sorted(
        (RawMessage(m.partition, m.offset, m.key, m.value) for m in raw),
        key=lambda m: (m.partition, m.offset),
    )
    batches, rejected = Preparer(config, config.service_key()).prepare(messages)
    assert not rejected
    records: dict[bytes, Record] = {}
    for batch in batches:
        for i, record_id in enumerate(batch.id_bytes()):
            if record_id not in records:
                records[record_id] = Record(
                    partition=batch.partition, offset=batch.messages[i].offset, id=record_id,
                    public=batch.public[i], values=[int(v) for v in batch.sensitive[i]],
                    draws=[int(d) for d in batch.draws[i]] if config.decoy else [],
                    group=batch.groups[i] if config.personal else b"",
                    perturbed=int(batch.perturbed[i]) if config.personal else -1,
                )  # fmt: skip
    return records


def decoy_problem(entry: bytes, record: Record, gamma: int) -> str | None:
    """Why a decoy pool entry is not its record's keyed draw from a valid group, if so."""
    parsed = PoolEntry.parse(entry)
    public, published, audit = parsed.public, parsed.published, parsed.audit
    if public != record.public:
        return "public codes differ from the record's"
    for a, (code, group) in enumerate(zip(published.split(b","), audit.split(b";"), strict=True)):
        values = [int(v) for v in group.partition(b":")[2].split(b",")]
        if len(set(values)) != gamma or values != sorted(values):
            return f"group {group!r} is not {gamma} sorted distinct values"
        if record.values[a] not in values:
            return f"group {group!r} lacks the record's value {record.values[a]}"
        if int(code) != values[record.draws[a]]:
            return f"published {code!r}, not draw {record.draws[a]} of group {group!r}"
    return None


def personal_publication(
    config: StreamConfig, records: dict[bytes, Record], order: dict[bytes, tuple[int, int]]
) -> dict[bytes, tuple[bytes, int]]:
    """(kind, published code) of every record, replaying `personal.lua` per group in the
    order of <stream>.grouped (`grouped_order`), which holds each group in one partition
    (`service.core.mechanisms.personal_stream`). The budget is fixed, so the release points,
    which the replay cannot know, change nothing."""
    settings = config.personal
    assert settings is not None and settings.budget == "conservative", "a fixed budget"
    arrived = sorted(records.values(), key=lambda r: order[r.id])
    replay = stream_trials(
        np.array([r.group for r in arrived]), np.array([r.values[0] for r in arrived]),
        config.schema.sensitive[0].size, settings.budget, settings.retention, settings.lam,
        settings.delta, settings.release_size,
    )  # fmt: skip
    marks = {TRIAL: b"t", COPY: b"c", BORROWED: b"b"}
    return {
        record.id: (marks[int(kind)], arrived[source].perturbed)
        for record, kind, source in zip(
            arrived, replay.kind.tolist(), replay.source.tolist(), strict=True
        )
    }


@dataclass
class Audit:
    """The published topic checked against the raw records and what Redis showed."""

    messages: int = 0
    tokens: int = 0
    published: dict[bytes, bytes] = field(default_factory=dict)  # id -> sensitive codes
    unpublished: list[Record] = field(default_factory=list)
    twice: int = 0  # records under two tokens
    changed: int = 0  # copies of a token with another value
    tally: Counter = field(default_factory=Counter)  # cell -> distinct tokens
    checked: int = 0  # published records whose keyed draw was checked
    snapshot_coverage: float = 0.0
    monitor_coverage: float = 0.0
    pooled_twice: int = 0  # records pooled twice while one Redis process ran
    kinds: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def audit(
    config: StreamConfig,
    records: dict[bytes, Record],
    messages: list,
    seen: Observed,
    monitor: PoolMonitor,
    resting: set[bytes],
    order: dict[bytes, tuple[int, int]],
) -> Audit:
    """`resting`: ids still pooled below their partition's floor, which the mixing rule
    publishes only with later records; `order`: a personal stream's `grouped_order`."""
    out = Audit(messages=len(messages))
    codec = CellCodec(config.schema)
    by_row = {int(r.public.split(b",")[0]): r for r in records.values()}  # `row` comes first
    cells: dict[bytes, bytes] = {}
    for message in messages:
        cell = codec.key_of(message.value)
        out.changed += cells.setdefault(message.key, cell) != cell
    out.tokens = len(cells)
    out.tally = Counter(cells.values())
    tokens_of: dict[bytes, set[bytes]] = defaultdict(set)
    for token, cell in cells.items():
        public, sensitive = cell_fields(cell)
        record = by_row[int(public.split(b",")[0])]
        if public != record.public:
            out.problems.append(f"token {token!r} published {public!r} for {record.public!r}")
        tokens_of[record.id].add(token)
        out.published[record.id] = sensitive
    out.twice = sum(len(tokens) > 1 for tokens in tokens_of.values())
    out.unpublished = [r for r in records.values() if r.id not in out.published]

    # The last pool entry of each record in the MONITOR feed; earlier ones in the same
    # Redis process would be a second grouping of the record.
    pooled: dict[bytes, bytes] = {}
    for session in monitor.sessions:
        in_session: set[bytes] = set()
        for entry in session:
            record_id = PoolEntry.parse(entry).id
            out.pooled_twice += record_id in in_session
            in_session.add(record_id)
            pooled[record_id] = entry
    published = out.published.keys()
    out.snapshot_coverage = len(published & seen.entries.keys()) / max(len(published), 1)
    out.monitor_coverage = len(published & pooled.keys()) / max(len(published), 1)

    # A record the surviving Redis process saw pooled was published, not lost.
    last = monitor.sessions[-1] if monitor.sessions else []
    lost = {PoolEntry.parse(entry).id for entry in last} - published - resting
    out.problems += [f"{record_id!r} was pooled and never published" for record_id in lost]

    every = [e for session in monitor.sessions for e in session]
    every += [e for entries in seen.entries.values() for e in entries]
    if config.decoy is not None:
        gamma = config.decoy.gamma
        for entry in every:
            record = records[PoolEntry.parse(entry).id]
            if (problem := decoy_problem(entry, record, gamma)) is not None:
                out.problems.append(f"entry {entry!r}: {problem}")
        out.checked = len(published & (seen.entries.keys() | pooled.keys()))
    else:
        expected = personal_publication(config, records, order)
        out.kinds = Counter(kind for kind, _ in expected.values())
        for record_id, codes in out.published.items():
            if codes != b"%d" % expected[record_id][1]:
                out.problems.append(f"{record_id!r} published {codes!r}, not {expected[record_id]}")
        for entry in every:
            parsed = PoolEntry.parse(entry)
            record_id, kind, codes = parsed.id, parsed.audit, parsed.published
            if (kind, int(codes)) != expected[record_id]:
                out.problems.append(f"entry {entry!r}, not {expected[record_id]}")
        out.checked = len(published)

    # What Redis held is what got published, under the token it had in flight.
    for record_id in seen.entries.keys() | pooled.keys():
        entries = seen.entries.get(record_id, set()) | (
            {pooled[record_id]} if record_id in pooled else set()
        )
        shown = {PoolEntry.parse(entry).published for entry in entries}
        if record_id in out.published and shown != {out.published[record_id]}:
            out.problems.append(
                f"{record_id!r} was {shown} in Redis, published {out.published[record_id]!r}"
            )
        in_flight = seen.tokens.get(record_id, set())
        if len(in_flight) > 1 or (in_flight and tokens_of.get(record_id, set()) - in_flight):
            out.problems.append(
                f"{record_id!r} in flight as {in_flight}, published as {tokens_of.get(record_id)}"
            )
    return out


def summarize(
    mechanism: str, seen: Observed, monitor: PoolMonitor, result: Audit, stats: dict
) -> str:
    totals = seen.totals
    kinds = f"; kinds {dict(result.kinds)}" if result.kinds else ""
    return (
        f"[{mechanism}, seed {SEED}] {len(seen.kills)} worker kills "
        f"({seen.kills_while_producing} while producing): "
        + "; ".join(seen.kills)
        + f". Redis killed {seen.redis}; consumer killed {seen.consumer}; unexpected exits: "
        f"{seen.unexpected_exits or 'none'}.\n"
        f"  accounting: ingested {totals['ingested']}, published "
        f"{totals['published']} (topic: {result.messages} messages, {result.tokens} tokens, "
        f"{result.messages - result.tokens} re-sent copies, {len(result.published)} records, "
        f"{result.twice} under two tokens), suppressed {totals.get('suppressed', 0)} "
        f"({len(result.unpublished)} records unpublished), rejected {totals.get('rejected', 0)},"
        f" redelivered {totals.get('redelivered', 0)}, conflicts {totals.get('conflicts', 0)}\n"
        f"  keyed draws: {result.checked} of {len(result.published)} published records checked;"
        f" {seen.snapshots} snapshots ({seen.snapshot_entries} entries) cover "
        f"{result.snapshot_coverage:.1%}, MONITOR ({monitor.entries} pool entries, "
        f"{len(monitor.sessions)} Redis processes, {result.pooled_twice} records pooled twice "
        f"by one) covers "
        f"{result.monitor_coverage:.1%}{kinds}; {len(result.problems)} problems "
        f"{result.problems[:3]}\n"
        f"  consumer: counted {stats.get('records')}, duplicates {stats.get('duplicates')}; "
        f"{len(result.tally)} cells on the topic\n"
        f"  time: faults and settling {seen.took:.1f} s"
    )


@pytest.mark.parametrize("mechanism", ["decoy", "personal"])
def test_crashes_and_replays_change_nothing_published(servers, tmp_path, mechanism):
    plan = Plan.draw(random.Random(f"{SEED}:{mechanism}"))
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    monitor = PoolMonitor(redis_server.port)
    monitor.start()
    harness = Harness(servers, tmp_path, f"adult-{mechanism}.toml", redis_url=redis_server.url)
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    harness.start_worker()
    harness.start_consumer()
    try:
        seen = asyncio.run(run_faults(harness, redis_server, adult_rows(config), plan))
        totals = seen.totals
        stats, tally, suppressed = asyncio.run(consumer_state(harness, totals["published"]))
        status = consumer_client.status(harness.url)
        raw = asyncio.run(harness.read_all(config.topics["raw"]))
        messages = asyncio.run(harness.read_all(config.topics["published"]))
        records = accepted_records(config, raw)
        resting = asyncio.run(pooled_ids(harness))
        order = {}
        if config.personal is not None:
            order = grouped_order(asyncio.run(harness.read_all(config.topics["grouped"])))
        result = audit(config, records, messages, seen, monitor, resting, order)
        summary = summarize(mechanism, seen, monitor, result, stats)
        print("\n" + summary)

        # Once each: one token and one value per record, or suppressed.
        assert totals["ingested"] == len(records) == RECORDS, summary
        assert not seen.unexpected_exits, summary
        assert result.twice == result.changed == 0, summary
        assert len(result.published) == result.tokens == totals["published"], summary
        assert len(resting) == totals["below_floor"] == totals["pool"], summary
        assert {r.id for r in result.unpublished} >= resting, summary
        assert len(result.unpublished) == totals.get("suppressed", 0) + len(resting), summary
        assert totals.get("rejected", 0) == totals.get("conflicts", 0) == 0, summary
        if config.decoy is not None:
            attribute = config.schema.sensitive[0]
            lost = Counter(
                (attribute.name, attribute.domain[r.values[0]])
                for r in result.unpublished
                if r.id not in resting
            )
            assert lost == Counter(suppressed), (summary, lost, suppressed)
        # The keyed draw of each record, however often things crashed around it.
        assert not result.problems, summary
        assert result.pooled_twice == 0, summary
        assert len(seen.kills) == len(plan.kills) and seen.snapshots, summary
        # The consumer counted each token once: its cells are the topic's.
        assert stats.get("records") == result.tokens, summary
        assert tally == dict(result.tally), summary
        assert status["consumer"]["counted"] == result.tokens, (summary, status["consumer"])
        assert status["consumer"]["invalid"] == 0, (summary, status["consumer"])

        # Replay: once the last worker has committed the whole raw topic, and a personal
        # stream's whole grouped topic (it may still be skipping what its killed
        # predecessor consumed but did not commit), stop it and rewind its group to offset
        # 0 on the raw topic.
        began = time.monotonic()
        group = f"splu-{config.name}"
        ends = ends_of(config, raw)
        before = asyncio.run(wait_committed(harness, config.topics["raw"], group, ends))
        if config.personal is not None:
            grouped = asyncio.run(harness.read_all(config.topics["grouped"]))
            topic = config.topics["grouped"]
            assert asyncio.run(wait_committed(harness, topic, group, ends_of(config, grouped))) == (
                ends_of(config, grouped)
            ), summary
        harness.worker.stop()
        base = asyncio.run(current_totals(harness))
        assert before == ends, (summary, before, ends)
        assert (base["ingested"], base["published"]) == (RECORDS, totals["published"]), base
        how, rewound = asyncio.run(harness.rewind(config.topics["raw"], group, 0))
        assert rewound == dict.fromkeys(range(config.partitions), 0), (summary, rewound)
        pooled = monitor.entries
        harness.start_worker()

        async def replayed() -> dict[str, int]:
            client = aioredis.from_url(config.redis_url)
            deadline = time.monotonic() + SETTLE_TIMEOUT
            try:
                while time.monotonic() < deadline:
                    again = await harness.totals(client)
                    if again["redelivered"] >= base["redelivered"] + len(raw):
                        break
                    await asyncio.sleep(0.2)
                await asyncio.sleep(config.flush_interval + QUIET)
                return await harness.totals(client)
            finally:
                await client.aclose()

        again = asyncio.run(replayed())
        after = asyncio.run(harness.read_all(config.topics["published"]))
        recounted, retally, _ = asyncio.run(consumer_state(harness, totals["published"]))
        replay = (
            f"  replay of {len(raw)} raw messages from offset 0 (committed {before}, rewound "
            f"{how}): redelivered {base['redelivered']} -> {again['redelivered']}, ingested "
            f"{totals['ingested']} -> {again['ingested']}, published {totals['published']} -> "
            f"{again['published']}, topic {len(messages)} -> {len(after)} messages, pool "
            f"entries {pooled} -> {monitor.entries}, counted {stats.get('records')} -> "
            f"{recounted.get('records')}; took {time.monotonic() - began:.1f} s"
        )
        print(replay)
        summary += "\n" + replay
        assert again["redelivered"] == base["redelivered"] + len(raw), summary
        assert again["ingested"] == totals["ingested"], summary
        assert again["published"] == totals["published"], summary
        assert again["settled"] == totals["settled"] and again["pool"] == totals["pool"], summary
        assert len(after) == len(messages) and monitor.entries == pooled, summary
        assert recounted == stats and retally == tally, summary
    finally:
        monitor.stop()
        harness.stop()
        redis_server.stop()


async def settled_totals(harness: Harness) -> dict[str, int]:
    """The buffer's totals once every record is published, suppressed or resting in a pool
    below its floor, with nothing in flight."""
    client = aioredis.from_url(harness.config.redis_url)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    try:
        while True:
            totals = await harness.totals(client)
            if totals.get("settled", 0) == RECORDS and totals["in_flight"] == 0:
                return totals
            if time.monotonic() > deadline:
                raise AssertionError(f"the stream did not settle: {totals}")
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()


@pytest.mark.parametrize("hop", ["raw", "grouped"])
def test_a_kill_between_the_hops_loses_duplicates_and_rerandomizes_nothing(servers, tmp_path, hop):
    """A personal stream's worker ends right after a fetch's handler returned, before the
    fetch's offsets are committed (`fault_points`, counting fetches of one topic): with
    `raw`, after the first hop, once the broker acknowledged the fetch's copies on
    <stream>.grouped; with `grouped`, after the second, once Redis stored the fetch's
    grouped records. A fresh worker reads them again: the copies the first hop sends twice,
    and the grouped records stored twice, are recognised, and each record is published
    once, with the value the key and the grouped order give it."""
    harness = Harness(servers, tmp_path, "adult-personal.toml")
    config = harness.config
    group = f"splu-{config.name}"
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    # Produced first: the worker's fetches are full, so the lost commit covers batches.
    asyncio.run(produce(config, iter(adult_rows(config)), progress=False))
    topic = config.topics[hop]
    faulty = spawn_worker(
        harness.path,
        harness.env,
        harness.log,
        splu=fault_points.command(exit_before_commit=2, topic=topic),
    )
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while faulty.running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not faulty.running and faulty.returncode == fault_points.EXIT_FAULT

    async def at_crash() -> tuple[int, int, int]:
        """Records Redis holds, grouped messages sent, offsets committed on `topic`."""
        client = aioredis.from_url(config.redis_url)
        try:
            ingested = (await harness.totals(client)).get("ingested", 0)
        finally:
            await client.aclose()
        sent = len(await harness.read_all(config.topics["grouped"]))
        committed = await harness.committed_offsets(topic, group)
        return ingested, sent, sum(offset or 0 for offset in committed.values())

    ingested, sent, committed = asyncio.run(at_crash())
    # The window the fault point opens: more was done than the group committed.
    assert (sent if hop == "raw" else ingested) > committed, (ingested, sent, committed)

    began = time.monotonic()
    harness.start_worker()
    try:
        totals = asyncio.run(settled_totals(harness))
        raw = asyncio.run(harness.read_all(config.topics["raw"]))
        grouped = asyncio.run(harness.read_all(config.topics["grouped"]))
        for name, messages in (("raw", raw), ("grouped", grouped)):
            ends = ends_of(config, messages)
            reached = asyncio.run(wait_committed(harness, config.topics[name], group, ends))
            assert reached == ends, (name, reached, ends)
        published = asyncio.run(harness.read_all(config.topics["published"]))
    finally:
        harness.stop()
    took = time.monotonic() - began

    records = accepted_records(config, raw)
    expected = personal_publication(config, records, grouped_order(grouped))
    codec = CellCodec(config.schema)
    by_row = {int(r.public.split(b",")[0]): r for r in records.values()}  # `row` comes first
    tokens: dict[bytes, set[bytes]] = defaultdict(set)
    wrong = []
    for message in published:
        public, sensitive = cell_fields(codec.key_of(message.value))
        record = by_row[int(public.split(b",")[0])]
        tokens[record.id].add(message.key)
        if public != record.public or sensitive != b"%d" % expected[record.id][1]:
            wrong.append((record.id, public, sensitive, expected[record.id]))
    print(
        f"\n[kill after the {hop} hop] at the crash: {ingested} stored, {sent} grouped messages,"
        f" {committed} offsets of {topic} committed; after: {len(raw)} raw and {len(grouped)} "
        f"grouped messages, redelivered {totals['redelivered']}, replayed {totals['replayed']}"
        f", published {totals['published']}, resting {totals['below_floor']}; "
        f"{len(wrong)} wrong values; settled in {took:.1f} s"
    )
    assert len(raw) == totals["ingested"] == len(records) == RECORDS, totals
    # Every copy beyond a record's first on the grouped topic was recognised, not stored.
    assert totals["redelivered"] >= len(grouped) - RECORDS, totals
    assert totals.get("conflicts", 0) == totals.get("rejected", 0) == 0, totals
    if hop == "raw":
        assert len(grouped) > RECORDS  # the first hop sent the uncommitted fetch again
    else:
        assert totals["replayed"] >= ingested - committed > 0, totals
    assert all(len(t) == 1 for t in tokens.values()) and len(published) == len(tokens)
    assert len(tokens) == totals["published"], totals
    assert totals["published"] + totals.get("suppressed", 0) + totals["below_floor"] == RECORDS
    assert not wrong, wrong[:3]
