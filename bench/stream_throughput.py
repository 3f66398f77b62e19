"""Stream throughput: the decoy pipeline and the consumer against a plain aiokafka anchor stage,
CPU per record per process, Redis memory and CPU per record, backfill time and delay.

Everything runs in one process tree on the embedded servers (``deploy.embedded``:
the tansu broker and a Redis-protocol server with ``appendfsync always``), each
phase on its own stream name, so its topics and Redis keys start empty. Every
stream uses ``deploy/examples/adult-decoy.toml`` with --partitions partitions,
max_wait --max-wait, flush_interval 2 s and report_interval one hour (no privacy
report runs meanwhile), topics created first (``streams.runtime.topics.create_topics``):

- **records**: --records records resampled with replacement (seed --seed) from
  the bundled UCI Adult sample, as JSON objects of the example's columns. The
  delay run alone adds a public attribute ``seq`` ("0".."N-1") to find each
  record's raw message; elsewhere it would make every record a cell of its own
  (in the buffer's truth tally and the consumer's counts), which real streams
  do not have.
- **anchor**: what a hand-written stage does with the same records, as a child
  process (this file with --run-anchor-stage): an ``AIOKafkaConsumer`` in a
  consumer group on ``<stream>.raw`` (offsets committed by hand, earliest)
  loops over ``getmany`` of up to batch_size records, decodes and re-encodes
  each one (``json.loads``, compact ``json.dumps``), appends it to a
  ``create_batch`` builder of its partition, ``send_batch``es the builders to
  ``<stream>.published`` (idempotence off, acks all), awaits every send and
  commits. Throughput is N / (last − first CreateTime on the output topic),
  so its group join is left out.
- **pipeline**: all records are produced to the raw topic first, then ``splu
  worker`` starts (fresh service key). Throughput is N / (last publication −
  first record consumed): the largest CreateTime on the published topic (the
  worker's producer stamps it at send) minus the last poll (every 50 ms) of the
  Redis counters before they showed an ingested record, which counts up to 50
  ms against the pipeline and leaves the group join out. The target is on the
  throughput *while the stream flows*: once the last records are in, each
  partition's mixing pool still holds its floor (mixing_pool records), which
  the mixing rule releases only after the pool was quiet for flush_interval, a
  wait a flowing stream never pays and the delay run reports. So the span of
  the P × mixing_pool records published last is left out: the records
  published before them over the time to the last of them. Both figures are
  printed; pipeline / anchor is of the first.
- **consumer counting**: once the pipeline's worker has stopped, ``splu
  consumer`` starts on the pipeline's stream and counts its published records:
  N published / (its Redis counter reaching N − the last poll, every 50 ms,
  before it showed a first record), as ``bench/query_latency.py`` measures it.
  Printed as consumer / anchor.
- **CPU per record**: utime + stime + cutime + cstime from ``/proc/<pid>/stat``
  (clock ticks, ``SC_CLK_TCK``) of each process, sampled at the poll that starts
  a phase's clock above and at the poll that sees its last record, divided by
  the phase's records: the anchor stage and the broker; the worker, Redis and
  the broker; the consumer, Redis and the broker. Startup and group joins are
  thereby left out; this process's own polls (a few Redis commands every
  250 ms) are in Redis's figures.
- **Redis CPU by command**: ``INFO commandstats`` sampled with the pipeline's
  CPU, per command: calls and microseconds per ingested record. On the embedded
  valkey (9.1) the commands a Lua script calls are counted there too, and the
  script's own evalsha time includes them, so the evalsha row is the whole Lua
  step and a row below gives what remains of it outside the commands'
  execution: the interpreter, cmsgpack, and turning each ``redis.call``'s
  arguments and reply between Lua and Redis. commandstats counts execution
  only, not reading requests or writing the AOF: Redis's CPU in the table
  above is the whole process.
- **backfill** (--backfill N, 0 skips it): N more resampled records are
  produced to a fresh stream's raw topic, then a worker starts; the time until
  every record is settled (published, suppressed or left below the mixing
  pool's floor) is given from the worker's spawn (process start, imports and
  consumer group join included) and from its first ingest.
- **delay**: a second pipeline run on a fresh stream whose worker has joined
  before records are produced at a fixed --rate (default 60% of the measured
  pipeline throughput while the stream flows), so delays do not include
  queueing behind a backlog.
  The delay of a record is the CreateTime of its publication minus the
  CreateTime of its raw message, matched through ``seq``; p50 and p99 over the
  published records (suppressed ones are never published and are counted apart).
  The p50 of the first and of the last tenth of the run (by raw write time) is
  printed too: if it grows, the rate was above what the worker sustains.
- **Redis memory per buffered record**: on a fresh key space, ``INFO memory``
  used_memory before and after ``StreamBuffer.ingest`` stores --buffered records
  from ``Preparer.prepare`` that cannot be grouped (resampled Adult records with
  only γ − 1 distinct occupations, max_wait one hour), divided by their number;
  ``MEMORY USAGE`` breaks it down by key (the records pass the identity screen
  first, which keeps their fingerprints). The fingerprints (:seen) stay after
  publication: the pipeline run's used_memory growth per ingested record is
  reported too.

Targets (2-core machine): pipeline ≥ 0.5 × anchor, consumer counting ≥ 0.5 ×
anchor, worker CPU ≤ 40 µs per record, p99 delay ≤ max_wait + 1 s, ≤ 400 bytes
of Redis per buffered record. The exit status is 1 if any is missed (after
everything is printed), unless --no-targets. Progress goes to stderr, results
to stdout. Every server and process started here is stopped on exit.

Run from the repository root:

    .venv/bin/python bench/stream_throughput.py      # several minutes: the backfill dominates
    .venv/bin/python bench/stream_throughput.py --records 5000 --buffered 5000 --backfill 0 \\
        --no-targets                                 # < 1 min, too small to meet the targets
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from report import Result, log, log_tail, print_table, status

from deploy.embedded import (
    EmbeddedServers,
    Endpoints,
    ManagedProcess,
    free_port,
    spawn,
    spawn_consumer,
    spawn_worker,
    stream_env,
)
from service.core.config import StreamConfig, load_config, parse_config
from service.core.ingest import Preparer, RawMessage
from service.core.kafka_settings import KafkaSettings
from service.core.table import open_sample
from service.store.auditor import TrustedState
from service.store.buffer import StreamBuffer, connect
from service.store.lifecycle import Lifecycle
from service.store.running_counts import RunningCounts
from streams.runtime.app import now_ms
from streams.runtime.kafka import client_options
from streams.runtime.metrics import DELAY_SLACK  # seconds over max_wait allowed at p99
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

EXAMPLE = "adult-decoy.toml"
# As in `splu demo`: a quiet pool is published after 2 s, so the mixing pool adds little delay.
FLUSH_INTERVAL = 2.0
REPORT_INTERVAL = 3600.0  # seconds: no privacy report in the consumer while it is measured
# Long enough that nothing buffered for the memory measurement is suppressed meanwhile.
MEMORY_MAX_WAIT = 3600.0
ANCHOR_SHARE = 0.5  # pipeline and consumer throughput, at least this share of the anchor's
WORKER_CPU_TARGET = 40.0  # µs of worker CPU per record
BYTES_TARGET = 400.0
# Default paced rate, as a share of the measured pipeline throughput: well below 1, as the
# producer then shares the two cores and paced batches are smaller than those a backlog
# fills, and a backlog would add queueing to the delays (docs/performance.md, *Paced delay*).
PACED_SHARE = 0.6
FIRST_POLL = 0.05  # seconds between polls until a phase's first record
POLL = 0.25  # seconds between progress polls afterwards
READY_TIMEOUT = 60.0  # seconds for a process to start and own every partition
SLOWEST_RATE = 500.0  # records/s below which a phase is taken as stuck and stopped
CREATE_TIME = 0  # Kafka timestamp type set by the producer at send
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SHOWN_USEC = 0.05  # µs per record below which Redis commands are summed into one row
# Redis data types by the commands the Lua steps and the worker call, for the CPU table.
COMMAND_TYPES = {
    **dict.fromkeys(
        ["zadd", "zrem", "zpopmin", "zrange", "zrangebyscore", "zcard", "zscore"], "zset"
    ),
    **dict.fromkeys(
        ["hset", "hget", "hdel", "hincrby", "hmget", "hgetall", "hexists", "hlen", "hkeys"],
        "hash",
    ),
    "hmset": "hash",
    **dict.fromkeys(["sadd", "srem", "smembers", "scard"], "set"),
    **dict.fromkeys(["rpush", "lpop", "llen"], "list"),
    **dict.fromkeys(["get", "set"], "string"),
    **dict.fromkeys(["exists", "del", "unlink", "pexpire"], "any key"),
    **dict.fromkeys(["evalsha", "eval"], "Lua"),
}
KEY_TYPES = (
    "zset: value buckets (:b:*), arrival index (:t); hash: mixing pool (:pool), records "
    "(:rec), takes in flight (:takes), counters (:stats, :waiting, :n:*, :delay, :sup), "
    "fingerprints (:seen), groups (:grp:*), truth tallies (:truth:*); set: open groups, "
    "holes; list: holes per value; string: offset watermark (:off), pool's last addition "
    "(:pooled), pause flag"
)

# What a sampler returns: (kind, name) -> a counter that only grows, such as
# ("cpu", "worker") in seconds or ("usec", "evalsha").
Counters = dict[tuple[str, str], float]
Sampler = Callable[[], Awaitable[Counters]]
# What a phase's progress poll returns: (records begun, records done).
Progress = Callable[[], Awaitable[tuple[int, int]]]


@dataclass(frozen=True)
class Span:
    """A phase's clock, from the last poll before its first record to the poll that saw its
    last, and how much each sampled counter grew over it."""

    started: float  # time.time()
    finished: float
    grew: Counters

    def of(self, kind: str) -> dict[str, float]:
        return {name: value for (k, name), value in self.grew.items() if k == kind}


@dataclass(frozen=True)
class Capacity:
    """A run on records waiting for it: N over its span, and CPU seconds per process."""

    records: int
    seconds: float
    cpu: dict[str, float]

    @property
    def throughput(self) -> float:
        return self.records / self.seconds


@dataclass(frozen=True)
class Pipeline:
    capacity: Capacity
    flowing: Capacity  # the records published before the pools' final quiet release
    published: int
    suppressed: int
    left_after: float  # Redis bytes per ingested record still used after publication
    calls: dict[str, float]  # per Redis command over the span
    usec: dict[str, float]


@dataclass(frozen=True)
class Backfill:
    records: int
    from_spawn: float  # seconds from the worker's spawn to every record settled
    from_ingest: float  # seconds from the last poll before its first ingest


@dataclass(frozen=True)
class Delays:
    rate: float  # records/s the paced producer achieved
    published: int
    suppressed: int
    seconds: np.ndarray  # per published record in order of raw write, publication minus raw write

    def tenths_p50(self) -> tuple[float, float]:
        """The median delay of the first and of the last tenth of the run."""
        tenths = np.array_split(self.seconds, 10)
        return float(np.median(tenths[0])), float(np.median(tenths[-1]))


@dataclass(frozen=True)
class Memory:
    records: int
    used_bytes: int  # used_memory growth
    by_key: dict[str, int]  # MEMORY USAGE summed per key family


@dataclass(frozen=True)
class Measured:
    config: StreamConfig  # the pipeline's
    anchor: Capacity
    pipeline: Pipeline
    consumer: Capacity
    backfill: Backfill | None
    delays: Delays
    memory: Memory


def adult_rows() -> list[dict[str, str]]:
    with open_sample() as stream:
        return list(csv.DictReader(stream))


def example_document() -> dict[str, Any]:
    examples = resources.files("deploy").joinpath("examples")
    return tomllib.loads(examples.joinpath(EXAMPLE).read_text())


def stream_document(
    name: str, kafka: str, redis: str, partitions: int, max_wait: float
) -> dict[str, Any]:
    """The decoy example under another stream name, pointed at the embedded servers."""
    document = example_document()
    document["stream"].update(
        name=name,
        partitions=partitions,
        max_wait=max_wait,
        flush_interval=FLUSH_INTERVAL,
        report_interval=REPORT_INTERVAL,
    )
    document["kafka"]["bootstrap"] = kafka
    document["redis"]["url"] = redis
    return document


def write_config(document: dict[str, Any], work: Path, sequence: int = 0) -> StreamConfig:
    """Write a bench stream's config and load it; with `sequence`, records carry `seq`."""
    if sequence:
        document["schema"]["public"]["seq"] = {"domain": [str(i) for i in range(sequence)]}
    path = work / f"{document['stream']['name']}.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


def messages_of(rows: list[dict[str, str]], names: list[str]) -> list[tuple[bytes, bytes]]:
    """(key, JSON value) per record; the key is the record's response id."""
    return [
        (
            f"bench.csv:{i + 2}".encode(),
            json.dumps(
                {n: str(i) if n == "seq" else row[n] for n in names}, separators=(",", ":")
            ).encode(),
        )
        for i, row in enumerate(rows)
    ]


def resample(
    rows: list[dict[str, str]], count: int, rng: np.random.Generator
) -> list[dict[str, str]]:
    return [rows[i] for i in rng.integers(0, len(rows), count)]


def stuck(what: str, log_path: Path) -> SystemExit:
    return SystemExit(f"\n{what}; end of {log_path.name}:\n{log_tail(log_path)}")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and of the children it reaped, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses; field 3 follows its last ')'.
    fields = stat.rpartition(")")[2].split()
    return sum(int(field) for field in fields[11:15]) / CLOCK_TICKS


def server_pids(servers: Endpoints, redis: bool = True) -> dict[str, int | None]:
    """The pids of the servers started here (None for those the environment names)."""
    pids = {}
    if redis:
        pids["Redis"] = servers.redis.pid if servers.redis is not None else None
    pids["broker"] = servers.kafka.pid if servers.kafka is not None else None
    return pids


def cpu_sampler(pids: Mapping[str, int | None]) -> Sampler:
    """CPU seconds of each named process that has a pid."""

    async def sample() -> Counters:
        return {("cpu", name): cpu_seconds(pid) for name, pid in pids.items() if pid is not None}

    return sample


async def command_stats(client: aioredis.Redis) -> Counters:
    """Calls and microseconds per Redis command since the server started."""
    stats = await client.info("commandstats")
    counters: Counters = {}
    for name, fields in stats.items():
        command = name.removeprefix("cmdstat_")
        counters["calls", command] = fields["calls"]
        counters["usec", command] = fields["usec"]
    return counters


async def follow(
    progress: Progress,
    records: int,
    process: ManagedProcess,
    log_path: Path,
    deadline: float,
    sample: Sampler | None = None,
) -> Span:
    """Poll until `records` are done; the clock starts at the last poll before one had begun.

    The counters are sampled before each poll until a record has begun, so that the
    start's sample precedes it, and once more after the poll that sees them all done.
    """
    started: tuple[float, Counters] | None = None
    previous: tuple[float, Counters] | None = None
    while True:
        now = time.time()
        counters = await sample() if sample is not None and started is None else {}
        begun, done = await progress()
        if started is None:
            if begun > 0:
                started = previous or (now, counters)
            else:
                previous = (now, counters)
        if done >= records:
            assert started is not None
            end = await sample() if sample is not None else {}
            grew = {key: value - started[1].get(key, 0.0) for key, value in end.items()}
            return Span(started[0], now, grew)
        if not process.running:
            raise stuck(f"{log_path.stem} exited", log_path)
        if time.monotonic() > deadline:
            raise stuck(f"only {done:,} of {records:,} records came through", log_path)
        await asyncio.sleep(FIRST_POLL if started is None else POLL)


class BufferProgress:
    """A stream's buffer counters as a phase's progress: records ingested, records settled."""

    def __init__(self, buffer: StreamBuffer, records: int) -> None:
        self.buffer = buffer
        self.records = records
        self.counts: dict[str, int] = {}

    async def __call__(self) -> tuple[int, int]:
        self.counts = counts = await self.buffer.totals()
        settled = counts.get("settled", 0)
        status(
            f"in {counts.get('ingested', 0):8,}  buffered {counts.get('pending', 0):6,}  "
            f"pool {counts.get('pool', 0):6,}  published {counts.get('published', 0):8,}  "
            f"suppressed {counts.get('suppressed', 0):5,}",
            last=settled >= self.records,
        )
        return counts.get("ingested", 0), settled


async def read_topic(
    kafka: KafkaSettings, topic: str, expected: int, deadline: float, log_path: Path
) -> dict[bytes, ConsumerRecord]:
    """Each key's earliest message, once `expected` keys arrived; progress on stderr.

    A copy re-sent after a retry carries the same key.
    """
    consumer = AIOKafkaConsumer(
        topic, **client_options(kafka), auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    seen: dict[bytes, ConsumerRecord] = {}
    try:
        while len(seen) < expected:
            if time.monotonic() > deadline:
                raise stuck(f"{topic}: read {len(seen):,} of {expected:,} messages", log_path)
            fetched = await consumer.getmany(timeout_ms=int(POLL * 1000), max_records=10_000)
            for messages in fetched.values():
                for message in messages:
                    if message.timestamp_type != CREATE_TIME:
                        # Broker-set times would move every delay by the broker's queueing.
                        raise SystemExit(f"{topic}: the broker does not keep CreateTime")
                    known = seen.get(message.key)
                    if known is None or message.timestamp < known.timestamp:
                        seen[message.key] = message
            status(f"{topic}: {len(seen):8,} of {expected:,}", last=len(seen) >= expected)
    finally:
        await consumer.stop()
    return seen


async def pre_produce(config: StreamConfig, messages: list[tuple[bytes, bytes]]) -> None:
    started = time.monotonic()
    log(f"  producing {len(messages):,} records to {config.topics['raw']}")
    await produce(config, iter(messages), len(messages), progress=False)
    elapsed = time.monotonic() - started
    log(f"  produced in {elapsed:.1f} s ({len(messages) / elapsed:,.0f} records/s)")


async def paced_produce(
    config: StreamConfig, messages: list[tuple[bytes, bytes]], rate: float
) -> float:
    """Send at `rate` records/s; returns the rate achieved."""
    started = time.monotonic()
    await produce(config, iter(messages), rate=rate, progress=False)
    return len(messages) / (time.monotonic() - started)


def anchor_progress_path(config_path: str) -> Path:
    return Path(config_path).with_suffix(".progress")


async def anchor_stage(config: StreamConfig) -> None:
    """Copy raw to published as a hand-written stage would, batch by batch, until killed.

    Each batch's "fetched done" counts go to a file beside the config, for the bench
    to follow without asking the broker.
    """
    topic = config.topics["published"]
    consumer = AIOKafkaConsumer(
        config.topics["raw"],
        **client_options(config.kafka),
        group_id=f"bench-anchor-{config.name}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    producer = AIOKafkaProducer(
        **client_options(config.kafka),
        enable_idempotence=False,
        acks="all",
        max_batch_size=512 * 1024,
    )
    await consumer.start()
    await producer.start()
    fetched = 0
    with anchor_progress_path(config.source).open("w") as progress:
        while True:
            # Batches as large and as patient as the worker's; the output keeps the partition.
            batch = await consumer.getmany(
                timeout_ms=int(config.batch_wait * 1000), max_records=config.batch_size
            )
            if not batch:
                continue
            done = fetched
            fetched += sum(len(messages) for messages in batch.values())
            progress.write(f"{fetched} {done}\n")
            progress.flush()
            futures = []
            for source, messages in batch.items():
                builder = producer.create_batch()
                for message in messages:
                    value = json.dumps(json.loads(message.value), separators=(",", ":")).encode()
                    if builder.append(key=message.key, value=value, timestamp=None) is None:
                        futures.append(
                            await producer.send_batch(builder, topic, partition=source.partition)
                        )
                        builder = producer.create_batch()
                        builder.append(key=message.key, value=value, timestamp=None)
                futures.append(
                    await producer.send_batch(builder, topic, partition=source.partition)
                )
            await asyncio.gather(*futures)
            await consumer.commit()
            progress.write(f"{fetched} {fetched}\n")
            progress.flush()


def file_progress(path: Path, records: int) -> Progress:
    """The anchor stage's last complete "fetched done" line."""

    async def poll() -> tuple[int, int]:
        text = path.read_text() if path.exists() else ""
        counts = text[: text.rfind("\n") + 1].split()[-2:]
        fetched, done = map(int, counts) if counts else (0, 0)
        status(f"anchor stage: {done:8,} of {records:,} copied", last=done >= records)
        return fetched, done

    return poll


async def copying_capacity(
    config: StreamConfig,
    messages: list[tuple[bytes, bytes]],
    command: list[str],
    name: str,
    env: Mapping[str, str],
    work: Path,
    servers: Endpoints,
) -> Capacity:
    """A stage that copies raw to published and writes "fetched done" lines beside its config
    (`anchor_progress_path`), run as `command` once `messages` are produced: N over the span
    of the output's CreateTimes, and CPU seconds of the stage (as `name`) and the broker."""
    await create_topics(config.kafka, config.topic_partitions)
    await pre_produce(config, messages)
    records = len(messages)
    deadline = time.monotonic() + READY_TIMEOUT + records / SLOWEST_RATE
    log_path = work / f"{name.replace(' ', '-')}.log"
    stage = spawn(command, env=env, log_path=log_path)
    try:
        span = await follow(
            file_progress(anchor_progress_path(config.source), records),
            records,
            stage,
            log_path,
            deadline,
            cpu_sampler({name: stage.pid, **server_pids(servers, redis=False)}),
        )
    finally:
        stage.stop()
    copies = await read_topic(config.kafka, config.topics["published"], records, deadline, log_path)
    stamps = [m.timestamp for m in copies.values()]
    return Capacity(records, (max(stamps) - min(stamps)) / 1000, span.of("cpu"))


async def anchor_capacity(
    config: StreamConfig,
    messages: list[tuple[bytes, bytes]],
    env: Mapping[str, str],
    work: Path,
    servers: Endpoints,
) -> Capacity:
    command = [sys.executable, str(Path(__file__).resolve()), "--run-anchor-stage", config.source]
    return await copying_capacity(config, messages, command, "anchor stage", env, work, servers)


async def backlog(
    config: StreamConfig, messages: list[tuple[bytes, bytes]]
) -> tuple[int, float, aioredis.Redis, StreamBuffer]:
    """Produce `messages` to a fresh stream before its worker starts; returns their number,
    the deadline for settling them, and a client and buffer to follow the worker with."""
    await create_topics(config.kafka, config.topic_partitions)
    await pre_produce(config, messages)
    records = len(messages)
    deadline = time.monotonic() + READY_TIMEOUT + records / SLOWEST_RATE + config.max_wait
    client = aioredis.from_url(config.redis_url)
    return records, deadline, client, StreamBuffer(client, config, config.service_key())


async def pipeline_capacity(
    config: StreamConfig,
    messages: list[tuple[bytes, bytes]],
    env: Mapping[str, str],
    work: Path,
    servers: Endpoints,
) -> Pipeline:
    """The pipeline's run on pre-produced records, its CPU and Redis commands."""
    records, deadline, client, buffer = await backlog(config, messages)
    progress = BufferProgress(buffer, records)
    before = await TrustedState(client, config).memory()
    log_path = work / "pipeline.log"
    worker = spawn_worker(config.source, env, log_path)
    cpu = cpu_sampler({"worker": worker.pid, **server_pids(servers)})

    async def sample() -> Counters:
        return {**await cpu(), **await command_stats(client)}

    try:
        span = await follow(progress, records, worker, log_path, deadline, sample)
        after = await TrustedState(client, config).memory()
    finally:
        worker.stop()
        await client.aclose()
    counts = progress.counts
    published = await read_topic(
        config.kafka, config.topics["published"], counts["published"], deadline, log_path
    )
    times = sorted(m.timestamp / 1000 for m in published.values())
    # The pools' floors, released once the stream went quiet (flush_interval), come last.
    flowing = max(len(times) - config.partitions * config.mixing_pool, 1)
    return Pipeline(
        Capacity(records, times[-1] - span.started, span.of("cpu")),
        Capacity(flowing, times[flowing - 1] - span.started, span.of("cpu")),
        counts["published"],
        counts["suppressed"],
        (after - before) / records,
        span.of("calls"),
        span.of("usec"),
    )


async def consumer_counting(
    config: StreamConfig, records: int, env: Mapping[str, str], work: Path, servers: Endpoints
) -> Capacity:
    """`splu consumer` counting a stream's `records` published records into Redis."""
    deadline = time.monotonic() + READY_TIMEOUT + records / SLOWEST_RATE
    log_path = work / "consumer.log"
    consumer = spawn_consumer(config.source, free_port(), env, log_path)
    client = connect(config)
    counts = RunningCounts(client, config)

    async def counted() -> tuple[int, int]:
        done = (await counts.stats()).get("records", 0)
        status(f"counted in Redis {done:9,} of {records:,}", last=done >= records)
        return done, done

    try:
        span = await follow(
            counted, records, consumer, log_path, deadline,
            cpu_sampler({"consumer": consumer.pid, **server_pids(servers)}),
        )  # fmt: skip
    finally:
        consumer.stop()
        await client.aclose()
    return Capacity(records, span.finished - span.started, span.of("cpu"))


async def backfill(
    config: StreamConfig, messages: list[tuple[bytes, bytes]], env: Mapping[str, str], work: Path
) -> Backfill:
    """A worker started on a backlog: the time until every record is settled."""
    records, deadline, client, buffer = await backlog(config, messages)
    log_path = work / "backfill.log"
    spawned = time.time()
    worker = spawn_worker(config.source, env, log_path)
    try:
        span = await follow(BufferProgress(buffer, records), records, worker, log_path, deadline)
    finally:
        worker.stop()
        await client.aclose()
    return Backfill(records, span.finished - spawned, span.finished - span.started)


async def pipeline_delays(
    config: StreamConfig,
    messages: list[tuple[bytes, bytes]],
    rate: float,
    env: Mapping[str, str],
    work: Path,
) -> Delays:
    await create_topics(config.kafka, config.topic_partitions)
    records = len(messages)
    client = aioredis.from_url(config.redis_url)
    buffer = StreamBuffer(client, config, config.service_key())
    progress = BufferProgress(buffer, records)
    log_path = work / "paced.log"
    worker = spawn_worker(config.source, env, log_path)
    try:
        # Records produced before the worker owns its partitions would queue behind the join.
        await wait_until_owned(client, buffer, config.partitions)
        log(f"  worker owns all partitions; producing {records:,} records at {rate:,.0f}/s")
        deadline = time.monotonic() + READY_TIMEOUT + records / rate + config.max_wait
        achieved, _ = await asyncio.gather(
            paced_produce(config, messages, rate),
            follow(progress, records, worker, log_path, deadline),
        )
        raw = await read_topic(config.kafka, config.topics["raw"], records, deadline, log_path)
        published = await read_topic(
            config.kafka,
            config.topics["published"],
            progress.counts["published"],
            deadline,
            log_path,
        )
    finally:
        worker.stop()
        await client.aclose()
    written = np.zeros(records)
    for i, (key, _) in enumerate(messages):
        written[i] = raw[key].timestamp
    sent = np.array([written[int(json.loads(m.value)["seq"])] for m in published.values()])
    delays = np.array([m.timestamp for m in published.values()]) - sent
    return Delays(
        achieved,
        progress.counts["published"],
        progress.counts["suppressed"],
        delays[np.argsort(sent)] / 1000,
    )


async def wait_until_owned(client: aioredis.Redis, buffer: StreamBuffer, partitions: int) -> None:
    """The worker's tick touches the counters of every partition it owns, once a second."""
    keys = [f"{buffer.prefix(p)}:stats" for p in range(partitions)]
    deadline = time.monotonic() + READY_TIMEOUT
    while await client.exists(*keys) < partitions:
        if time.monotonic() > deadline:
            raise SystemExit(f"the worker did not own all {partitions} partitions in time")
        await asyncio.sleep(FIRST_POLL)


def key_family(key: bytes) -> str:
    """Which part of the buffer a key of ``splu:{<stream>:<partition>}:<part>`` (or of an
    identity shard, ``splu:{<stream>:ids:<shard>}:<part>``) holds."""
    part = key.decode().split("}:", 1)[1].split(":", 1)[0]
    return {
        "rec": "records (:rec)",
        "t": "arrival index (:t)",
        "b": "value buckets (:b:*)",
        "seen": "record fingerprints (:seen)",
    }.get(part, "counters (:n:*, :stats, :waiting)")


async def buffer_memory(
    config: StreamConfig, rows: list[dict[str, str]], count: int, rng: np.random.Generator
) -> Memory:
    """Redis growth from `count` buffered records that no group can take yet."""
    assert config.decoy is not None
    occupations = [
        v for v, _ in Counter(r["occupation"] for r in rows).most_common(config.decoy.gamma - 1)
    ]
    eligible = [r for r in rows if r["occupation"] in occupations]
    messages = messages_of(resample(eligible, count, rng), config.schema.names)
    key = config.service_key()
    preparer = Preparer(config, key)
    client = aioredis.from_url(config.redis_url)
    buffer = StreamBuffer(client, config, key)
    lifecycle = Lifecycle(client, config)
    try:
        # A tick per partition first loads the script and creates the counters: fixed costs.
        for partition in range(config.partitions):
            await buffer.ingest(partition, None, now_ms())
        before = await TrustedState(client, config).memory()
        handled: dict[int, int] = {}
        for start in range(0, count, config.batch_size):
            raw = [
                RawMessage(i % config.partitions, i // config.partitions, k, v)
                for i, (k, v) in enumerate(messages[start : start + config.batch_size], start)
            ]
            batches, rejected = preparer.prepare(raw)
            if rejected:
                raise SystemExit(f"rejected: {rejected[0].rejection}")
            # As the worker admits them: the identity screen keeps their fingerprints.
            if any(any(statuses) for statuses in await lifecycle.screen(batches, handled)):
                raise SystemExit("the identity screen took a resampled record for a re-send")
            for batch in batches:
                await buffer.ingest(batch.partition, batch, now_ms())
                handled[batch.partition] = batch.messages[-1].offset
        after = await TrustedState(client, config).memory()
        counts = await buffer.totals()
        if counts["pending"] != count or counts["pool"] != 0:
            raise SystemExit(f"expected {count:,} records pending and none pooled, got {counts}")
        by_key: Counter[str] = Counter()
        async for name in client.scan_iter(match=f"splu:{{{config.name}:*", count=1000):
            by_key[key_family(name)] += await client.memory_usage(name, samples=0) or 0
    finally:
        await client.aclose()
    return Memory(count, after - before, dict(by_key))


def per_record(seconds: float, records: int) -> str:
    return f"{seconds * 1e6 / records:,.1f}"


def print_cpu(phases: list[tuple[str, Capacity]]) -> None:
    print(
        "\nCPU µs per record (utime + stime + cutime + cstime from /proc/<pid>/stat, "
        "over each phase's clock)"
    )
    rows = []
    for phase, capacity in phases:
        for process, seconds in [
            *capacity.cpu.items(),
            ("all of these", sum(capacity.cpu.values())),
        ]:
            rows.append(
                [f"{phase} ({capacity.records:,} records)", process, f"{seconds:.2f}",
                 per_record(seconds, capacity.records)]
            )  # fmt: skip
    print_table(["phase", "process", "CPU s", "µs per record"], rows)


def print_commands(pipeline: Pipeline) -> None:
    records = pipeline.capacity.records
    print(
        f"\nRedis CPU per ingested record by command (pipeline phase, INFO commandstats; "
        f"{records:,} records)"
    )
    usec = {command: us for command, us in pipeline.usec.items() if pipeline.calls[command] > 0}
    lua = sum(us for command, us in usec.items() if COMMAND_TYPES.get(command) == "Lua")
    called = sum(usec.values()) - lua
    shown = sorted(
        (kv for kv in usec.items() if kv[1] >= SHOWN_USEC * records), key=lambda kv: -kv[1]
    )
    rows = [
        [command, COMMAND_TYPES.get(command, "other"),
         f"{pipeline.calls[command] / records:,.2f}", per_record(us / 1e6, records)]
        for command, us in shown
    ]  # fmt: skip
    rest = {command: us for command, us in usec.items() if us < SHOWN_USEC * records}
    if rest:
        calls = sum(pipeline.calls[command] for command in rest)
        rows.append(
            [f"{len(rest)} other commands", "", f"{calls / records:,.2f}",
             per_record(sum(rest.values()) / 1e6, records)]
        )  # fmt: skip
    rows.append(["Lua outside the commands", "Lua", "—", per_record((lua - called) / 1e6, records)])
    redis_cpu = pipeline.capacity.cpu.get("Redis")
    if redis_cpu is not None:
        rows.append(["Redis process CPU (/proc)", "", "—", per_record(redis_cpu, records)])
    print_table(["command", "type", "calls per record", "µs per record"], rows)
    print(
        "evalsha's time includes the commands its scripts call: all rows but the last two "
        "are inside it, except the few direct calls of the worker (GET of the pause flag, "
        "HGETALL) and of this benchmark's polls (MULTI, HGETALL, EXEC, INFO)"
    )
    print(f"key types: {KEY_TYPES}")


def summary(args: argparse.Namespace, run: Measured) -> list[str]:
    """Print what was measured and how; return the targets missed."""
    config, anchor, pipeline, consumer = run.config, run.anchor, run.pipeline, run.consumer
    delays, memory, filled = run.delays, run.memory, run.backfill
    assert config.decoy is not None
    p50, p99 = np.percentile(delays.seconds, [50, 99])
    first, last = delays.tenths_p50()
    print(
        f"Stream throughput: {args.records:,} records resampled from UCI Adult (seed {args.seed}), "
        f"decoy groups γ={config.decoy.gamma}, {config.partitions} partitions, "
        f"max_wait {config.max_wait:g} s, flush_interval {config.flush_interval:g} s, "
        f"batch_size {config.batch_size:,}, embedded tansu broker and Redis (fsync always)"
    )
    print(
        f"throughput = N / span, records produced before each stage starts, group joins left out\n"
        f"  anchor:   {anchor.records:,} copied in {anchor.seconds:.2f} s by a plain aiokafka "
        f"stage (getmany, json.loads + json.dumps, send_batch, commit; first to last output "
        f"CreateTime)\n"
        f"  pipeline: {pipeline.published:,} published + {pipeline.suppressed:,} suppressed in "
        f"{pipeline.capacity.seconds:.2f} s (first ingest seen in Redis to last CreateTime); "
        f"the {pipeline.flowing.records:,} published before the pools' final quiet release "
        f"({config.partitions} × {config.mixing_pool:,} records after flush_interval) in "
        f"{pipeline.flowing.seconds:.2f} s\n"
        f"  consumer: {consumer.records:,} counted in {consumer.seconds:.2f} s (first to last "
        f"record counted in Redis; the pipeline's published records, its worker stopped)"
    )
    if filled is not None:
        print(
            f"backfill: {filled.records:,} records produced first, then a worker with the "
            f"pipeline's settings; all settled {filled.from_spawn:.1f} s after its spawn (process "
            f"start, imports and group join included), {filled.from_ingest:.1f} s after its first "
            f"ingest"
        )
    print(
        f"delay = CreateTime of publication − CreateTime of the raw record, in a separate run "
        f"paced at {delays.rate:,.0f} records/s with the worker already joined: "
        f"{delays.published:,} published, {delays.suppressed:,} suppressed, "
        f"max {delays.seconds.max():.2f} s; p50 of the first tenth {first:.2f} s, "
        f"of the last tenth {last:.2f} s"
    )
    print(
        f"Redis memory: {memory.records:,} buffered records with γ − 1 occupations, "
        f"used_memory +{memory.used_bytes:,} B\n"
    )
    worker_cpu = pipeline.capacity.cpu["worker"] * 1e6 / pipeline.capacity.records
    results = [
        Result("anchor throughput", anchor.throughput, "rec/s"),
        Result("pipeline throughput, to the last record", pipeline.capacity.throughput, "rec/s"),
        Result("pipeline throughput while the stream flows", pipeline.flowing.throughput, "rec/s"),
        Result(
            "pipeline / anchor (while the stream flows)",
            pipeline.flowing.throughput / anchor.throughput,
            "",
            ".2f",
            ANCHOR_SHARE,
            True,
        ),
        Result("consumer counting throughput", consumer.throughput, "rec/s"),
        Result(
            "consumer / anchor",
            consumer.throughput / anchor.throughput,
            "",
            ".2f",
            ANCHOR_SHARE,
            True,
        ),
        Result("worker CPU per record (pipeline)", worker_cpu, "µs", ".1f", WORKER_CPU_TARGET),
    ]
    if filled is not None:
        results += [
            Result("backfill from worker spawn", filled.from_spawn, "s", ".1f"),
            Result("backfill from worker spawn", filled.records / filled.from_spawn, "rec/s"),
            Result("backfill from first ingest", filled.from_ingest, "s", ".1f"),
            Result("backfill from first ingest", filled.records / filled.from_ingest, "rec/s"),
        ]
    results += [
        Result("delay p50 (paced run)", p50, "s", ".2f"),
        Result("delay p99 (paced run)", p99, "s", ".2f", config.max_wait + DELAY_SLACK),
        Result(
            "Redis bytes per buffered record",
            memory.used_bytes / memory.records,
            "B",
            ",.0f",
            BYTES_TARGET,
        ),
        Result("Redis bytes per ingested record left after publication", pipeline.left_after, "B"),
    ]
    print_table(
        ["metric", "measured", "target", "measured/target", "pass"], [r.cells() for r in results]
    )
    print_cpu([("anchor", anchor), ("pipeline", pipeline.capacity), ("consumer", consumer)])
    print(f"\nRedis memory per buffered record by key (MEMORY USAGE, {memory.records:,} records)")
    print_table(
        ["key", "bytes per record"],
        [
            [family, f"{size / memory.records:,.0f}"]
            for family, size in sorted(memory.by_key.items(), key=lambda kv: -kv[1])
        ],
    )
    print_commands(pipeline)
    missed = [r.metric for r in results if r.target is not None and not r.met()]
    print(f"\n{'targets missed: ' + '; '.join(missed) if missed else 'all targets met'}")
    return missed


def run(args: argparse.Namespace) -> Measured:
    rng = np.random.default_rng(args.seed)
    rows = adult_rows()
    log(
        f"resampling {args.records:,} records from the bundled Adult sample (seed {args.seed}); "
        f"max_wait {args.max_wait:g} s, {args.partitions} partitions"
    )
    records = resample(rows, args.records, rng)
    with tempfile.TemporaryDirectory(prefix="splu-bench-") as directory:
        work = Path(directory)
        with EmbeddedServers(work / "servers") as servers:
            env = stream_env(servers)
            # This process's own stages load the config and draw with the workers' key.
            os.environ.update(env)

            def document(name: str, max_wait: float = args.max_wait) -> dict[str, Any]:
                return stream_document(
                    name, servers.kafka_bootstrap, servers.redis_url, args.partitions, max_wait
                )

            log(f"Redis memory: buffering {args.buffered:,} records that cannot be grouped")
            memory_config = parse_config(
                document("bench-memory", MEMORY_MAX_WAIT), "bench-memory", work
            )
            memory = asyncio.run(buffer_memory(memory_config, rows, args.buffered, rng))

            log("anchor: a plain aiokafka stage")
            anchor_config = write_config(document("bench-anchor"), work)
            messages = messages_of(records, anchor_config.schema.names)
            anchor = asyncio.run(anchor_capacity(anchor_config, messages, env, work, servers))
            log(f"  {anchor.throughput:,.0f} records/s")

            log("decoy pipeline")
            config = write_config(document("bench-pipeline"), work)
            pipeline = asyncio.run(pipeline_capacity(config, messages, env, work, servers))
            log(f"  {pipeline.flowing.throughput:,.0f} records/s")

            log(f"consumer counting the pipeline's {pipeline.published:,} published records")
            consumer = asyncio.run(
                consumer_counting(config, pipeline.published, env, work, servers)
            )
            log(f"  {consumer.throughput:,.0f} records/s")

            rate = args.rate or PACED_SHARE * pipeline.flowing.throughput
            log(f"decoy pipeline, paced at {rate:,.0f} records/s for delays")
            delay_config = write_config(document("bench-delay"), work, args.records)
            sequenced = messages_of(records, delay_config.schema.names)
            delays = asyncio.run(pipeline_delays(delay_config, sequenced, rate, env, work))

            filled = None
            if args.backfill:
                log(f"backfill: a worker started on {args.backfill:,} records")
                backfill_config = write_config(document("bench-backfill"), work)
                backlog = messages_of(resample(rows, args.backfill, rng), config.schema.names)
                filled = asyncio.run(backfill(backfill_config, backlog, env, work))
                log(f"  settled {filled.from_spawn:.1f} s after the worker's spawn")
    return Measured(config, anchor, pipeline, consumer, filled, delays, memory)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(
            "Sustained throughput of the decoy stream pipeline and of the consumer against a "
            "plain aiokafka stage (the anchor), CPU per record per process, Redis memory and "
            "CPU per record, backfill time and publication delay, on embedded servers. Exits "
            "1 if a target is missed."
        ),
    )
    parser.add_argument(
        "--records", type=int, default=200_000, help="records per run (default 200000)"
    )
    parser.add_argument(
        "--partitions", type=int, default=4, help="partitions of every topic (default 4)"
    )
    parser.add_argument(
        "--max-wait", type=float, default=5.0, help="pipeline max_wait in seconds (default 5)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        help=(
            "records/s of the paced delay run (default 60%% of the measured pipeline "
            "throughput while the stream flows)"
        ),
    )
    parser.add_argument(
        "--buffered",
        type=int,
        default=50_000,
        help="records buffered for the Redis memory measurement (default 50000)",
    )
    parser.add_argument(
        "--backfill",
        type=int,
        default=1_000_000,
        help="records of the backfill run, 0 to skip it (default 1000000)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the records (default 0)")
    parser.add_argument(
        "--no-targets",
        action="store_true",
        help="print the targets but exit 0 when some are missed (smoke tests at sizes too "
        "small to meet them)",
    )
    parser.add_argument(
        "--run-anchor-stage",
        metavar="CONFIG",
        help="internal: run the anchor stage for a bench stream's config (started by the "
        "benchmark itself)",
    )
    args = parser.parse_args()
    if args.run_anchor_stage:
        asyncio.run(anchor_stage(load_config(args.run_anchor_stage)))
        return
    if min(args.records, args.partitions, args.buffered) < 1 or args.max_wait <= 0:
        parser.error("--records, --partitions, --buffered and --max-wait must be positive")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.backfill < 0:
        parser.error("--backfill must be 0 or positive")
    missed = summary(args, run(args))
    sys.exit(1 if missed and not args.no_targets else 0)


if __name__ == "__main__":
    main()
