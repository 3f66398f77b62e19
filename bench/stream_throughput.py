"""Stream throughput: the decoy pipeline against a bare Faust passthrough, delay and Redis memory.

Everything runs in one process tree on the embedded servers (``deploy.embedded``:
the tansu broker and a Redis-protocol server with ``appendfsync always``), each
phase on its own stream name, so its topics and Redis keys start empty:

- **records**: --records records resampled with replacement (seed --seed) from the
  bundled UCI Adult sample, as JSON objects of the columns of
  ``deploy/examples/adult-decoy.toml`` plus a public attribute ``seq`` ("0".."N-1")
  that identifies each record in the published topic. Decoy groups ignore public
  attributes, so ``seq`` changes nothing about grouping.
- **passthrough**: a bare Faust app with the worker's settings (its
  ``BatchMonitor`` too, so the baseline pays no bookkeeping the pipeline skips)
  and one agent that sends every raw event to the output topic, one ``send`` per
  record, no Redis. It runs as a child process (this file with
  --run-passthrough-worker).
- **pipeline**: ``splu worker`` (``python -m streams.cli worker``) with a fresh
  service key, max_wait --max-wait and flush_interval 2 s.
- **sustained throughput**: all records are produced to the raw topic first
  (``streams.produce.produce``), then the worker starts; throughput is N / (last
  publication − first record consumed). The last publication is the largest
  CreateTime on the published topic (the worker's producer stamps it at send).
  The first record consumed is, for the passthrough, the smallest CreateTime on
  its output topic and, for the pipeline, the last poll (every 50 ms) of the
  Redis counters before they showed an ingested record, which counts up to 50 ms
  against the pipeline. Group joins are thereby left out of both.
- **delay**: a second pipeline run on a fresh stream whose worker has joined
  before records are produced at a fixed --rate (default 60% of the measured
  pipeline throughput), so delays do not include queueing behind a backlog.
  The delay of a record is the CreateTime of its publication minus the
  CreateTime of its raw message, matched through ``seq``; p50 and p99 over the
  published records (suppressed ones are never published and are counted apart).
  The p50 of the first and of the last tenth of the run (by raw write time) is
  printed too: if it grows, the rate was above what the worker sustains.
- **Redis memory per buffered record**: on a fresh key space, ``INFO memory``
  used_memory before and after ``StreamBuffer.ingest`` stores --buffered records
  from ``Preparer.prepare`` that cannot be grouped (resampled Adult records with
  only γ − 1 distinct occupations, max_wait one hour), divided by their number;
  ``MEMORY USAGE`` breaks it down by key. The fingerprints (:seen) stay after
  publication: the pipeline run's used_memory growth per ingested record is
  reported too.

Targets (2-core machine): pipeline ≥ 5,000 records/s and ≥ 0.7 × passthrough,
p99 delay ≤ max_wait + 1 s, ≤ 400 bytes of Redis per buffered record. Progress
goes to stderr, results to stdout. Every server and worker started here is
stopped on exit.

Run from the repository root:

    .venv/bin/python bench/stream_throughput.py
    .venv/bin/python bench/stream_throughput.py --records 5000 --buffered 5000  # < 1 min
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import faust
import numpy as np
import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from report import Result, log, print_table

from deploy.embedded import EmbeddedServers, spawn, spawn_worker, stream_env
from service.buffer import StreamBuffer
from service.config import StreamConfig, load_config, parse_config
from service.ingest import Preparer, RawMessage
from service.table import open_sample
from streams.app import faust_app, now_ms
from streams.produce import produce
from streams.topics import create_topics

EXAMPLE = "adult-decoy.toml"
# As in `splu demo`: a quiet pool is published after 2 s, so the mixing pool adds little delay.
FLUSH_INTERVAL = 2.0
# Long enough that nothing buffered for the memory measurement is suppressed meanwhile.
MEMORY_MAX_WAIT = 3600.0
THROUGHPUT_TARGET = 5000.0  # records/s
RATIO_TARGET = 0.7
DELAY_SLACK = 1.0  # seconds over max_wait allowed at p99
BYTES_TARGET = 400.0
# Default paced rate, as a share of the measured pipeline throughput. At 0.8 the backlog grew
# through the run: the producer then shares the two cores, and paced batches are smaller than
# those a backlog fills.
PACED_SHARE = 0.6
FIRST_POLL = 0.05  # seconds between polls until the pipeline ingests its first record
POLL = 0.25  # seconds between progress polls afterwards
READY_TIMEOUT = 60.0  # seconds for a worker to own every partition
SLOWEST_RATE = 500.0  # records/s below which a phase is taken as stuck and stopped
CREATE_TIME = 0  # Kafka timestamp type set by the producer at send


@dataclass(frozen=True)
class Capacity:
    """One run on pre-produced records: N over the span from first consumed to last published."""

    records: int
    published: int
    suppressed: int
    seconds: float

    @property
    def throughput(self) -> float:
        return self.records / self.seconds


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
        name=name, partitions=partitions, max_wait=max_wait, flush_interval=FLUSH_INTERVAL
    )
    document["kafka"]["bootstrap"] = kafka
    document["redis"]["url"] = redis
    return document


def write_config(document: dict[str, Any], records: int, work: Path) -> StreamConfig:
    """Write a bench stream's config, with `seq` as an extra public attribute, and load it."""
    document["schema"]["public"]["seq"] = {"domain": [str(i) for i in range(records)]}
    path = work / f"{document['stream']['name']}.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


def messages_of(rows: list[dict[str, str]], names: list[str]) -> list[tuple[bytes, bytes]]:
    """(key, JSON value) per record; the key is a record id in `splu produce`'s format."""
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


def status(text: str) -> None:
    print(f"\r  {text}", end="", file=sys.stderr, flush=True)


def log_tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stuck(what: str, log_path: Path) -> SystemExit:
    return SystemExit(f"\n{what}; end of {log_path.name}:\n{log_tail(log_path)}")


async def follow_buffer(
    buffer: StreamBuffer, config: StreamConfig, records: int, deadline: float, log_path: Path
) -> tuple[float, dict[str, int]]:
    """Wait until every record is published or suppressed.

    Returns the wall time of the last poll before the first record was ingested
    (the start of the pipeline's clock) and the final counters.
    """
    started = last_poll = None
    while True:
        now = time.time()
        counts = await buffer.totals()
        if started is None and counts.get("ingested", 0) > 0:
            started = last_poll or now
        last_poll = now
        done = counts.get("settled", 0)
        status(
            f"in {counts.get('ingested', 0):8,}  buffered {counts.get('pending', 0):6,}  "
            f"pool {counts.get('pool', 0):6,}  published {counts.get('published', 0):8,}  "
            f"suppressed {counts.get('suppressed', 0):5,}"
        )
        if done >= records:
            print(file=sys.stderr)
            assert started is not None
            return started, counts
        if time.monotonic() > deadline:
            raise stuck(f"only {done:,} of {records:,} records came through", log_path)
        await asyncio.sleep(FIRST_POLL if started is None else POLL)


async def wait_until_owned(client: aioredis.Redis, buffer: StreamBuffer, partitions: int) -> None:
    """The worker's tick touches the counters of every partition it owns, once a second."""
    keys = [f"{buffer.prefix(p)}:stats" for p in range(partitions)]
    deadline = time.monotonic() + READY_TIMEOUT
    while await client.exists(*keys) < partitions:
        if time.monotonic() > deadline:
            raise SystemExit(f"the worker did not own all {partitions} partitions in time")
        await asyncio.sleep(FIRST_POLL)


async def read_topic(
    bootstrap: str, topic: str, expected: int, deadline: float, log_path: Path
) -> dict[bytes, ConsumerRecord]:
    """Each key's earliest message, once `expected` keys arrived; progress on stderr.

    A copy re-sent after a retry carries the same key. Reading is cheap (well
    over 100,000 messages/s), so it can follow a run without slowing it.
    """
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
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
            status(f"{topic}: {len(seen):8,} of {expected:,}")
        print(file=sys.stderr)
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


async def passthrough_capacity(
    config: StreamConfig, messages: list[tuple[bytes, bytes]], env: Mapping[str, str], work: Path
) -> Capacity:
    await create_topics(config.kafka_bootstrap, config.topic_partitions)
    await pre_produce(config, messages)
    records = len(messages)
    deadline = time.monotonic() + READY_TIMEOUT + records / SLOWEST_RATE
    log_path = work / "passthrough.log"
    worker = spawn(
        [sys.executable, str(Path(__file__).resolve()), "--run-passthrough-worker", config.source],
        env=env,
        log_path=log_path,
    )
    try:
        # tansu's ListOffsets lags the last batch, so progress is counted on the topic itself.
        copies = await read_topic(
            config.kafka_bootstrap, config.topics["published"], records, deadline, log_path
        )
    finally:
        worker.stop()
    stamps = [m.timestamp for m in copies.values()]
    return Capacity(records, records, 0, (max(stamps) - min(stamps)) / 1000)


async def pipeline_capacity(
    config: StreamConfig, messages: list[tuple[bytes, bytes]], env: Mapping[str, str], work: Path
) -> tuple[Capacity, float]:
    """The pipeline's run on pre-produced records, and Redis growth per ingested record."""
    await create_topics(config.kafka_bootstrap, config.topic_partitions)
    await pre_produce(config, messages)
    records = len(messages)
    deadline = time.monotonic() + READY_TIMEOUT + records / SLOWEST_RATE + config.max_wait
    client = aioredis.from_url(config.redis_url)
    buffer = StreamBuffer(client, config, config.service_key())
    before = await buffer.memory()
    log_path = work / "pipeline.log"
    worker = spawn_worker(config.source, env, log_path)
    try:
        started, counts = await follow_buffer(buffer, config, records, deadline, log_path)
        after = await buffer.memory()
        published = await read_topic(
            config.kafka_bootstrap,
            config.topics["published"],
            counts["published"],
            deadline,
            log_path,
        )
    finally:
        worker.stop()
        await client.aclose()
    last = max(m.timestamp for m in published.values()) / 1000
    capacity = Capacity(records, counts["published"], counts["suppressed"], last - started)
    return capacity, (after - before) / records


async def pipeline_delays(
    config: StreamConfig,
    messages: list[tuple[bytes, bytes]],
    rate: float,
    env: Mapping[str, str],
    work: Path,
) -> Delays:
    await create_topics(config.kafka_bootstrap, config.topic_partitions)
    records = len(messages)
    client = aioredis.from_url(config.redis_url)
    buffer = StreamBuffer(client, config, config.service_key())
    log_path = work / "paced.log"
    worker = spawn_worker(config.source, env, log_path)
    try:
        # Records produced before the worker owns its partitions would queue behind the join.
        await wait_until_owned(client, buffer, config.partitions)
        log(f"  worker owns all partitions; producing {records:,} records at {rate:,.0f}/s")
        deadline = time.monotonic() + READY_TIMEOUT + records / rate + config.max_wait
        achieved, (_, counts) = await asyncio.gather(
            paced_produce(config, messages, rate),
            follow_buffer(buffer, config, records, deadline, log_path),
        )
        raw = await read_topic(
            config.kafka_bootstrap, config.topics["raw"], records, deadline, log_path
        )
        published = await read_topic(
            config.kafka_bootstrap,
            config.topics["published"],
            counts["published"],
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
        achieved, counts["published"], counts["suppressed"], delays[np.argsort(sent)] / 1000
    )


def key_family(key: bytes) -> str:
    """Which part of the buffer a key of ``splu:{<stream>:<partition>}:<part>`` holds."""
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
    try:
        # A tick per partition first loads the script and creates the counters: fixed costs.
        for partition in range(config.partitions):
            await buffer.ingest(partition, None, now_ms())
        before = await buffer.memory()
        for start in range(0, count, config.batch_size):
            raw = [
                RawMessage(i % config.partitions, i // config.partitions, k, v)
                for i, (k, v) in enumerate(messages[start : start + config.batch_size], start)
            ]
            batches, rejected = preparer.prepare(raw)
            if rejected:
                raise SystemExit(f"rejected: {rejected[0].rejection}")
            for batch in batches:
                await buffer.ingest(batch.partition, batch, now_ms())
        after = await buffer.memory()
        counts = await buffer.totals()
        if counts["pending"] != count or counts["pool"] != 0:
            raise SystemExit(f"expected {count:,} records pending and none pooled, got {counts}")
        by_key: Counter[str] = Counter()
        async for name in client.scan_iter(match=f"splu:{{{config.name}:*", count=1000):
            by_key[key_family(name)] += await client.memory_usage(name, samples=0) or 0
    finally:
        await client.aclose()
    return Memory(count, after - before, dict(by_key))


def passthrough_app(config: StreamConfig, datadir: Path) -> faust.App:
    """The naive baseline: the worker's Faust settings, one send per record, no Redis."""
    app = faust_app(config, f"bench-passthrough-{config.name}", datadir)
    source = app.topic(
        config.topics["raw"], partitions=config.partitions, value_serializer="raw",
        key_serializer="raw",
    )  # fmt: skip
    sink = app.topic(
        config.topics["published"], partitions=config.partitions, value_serializer="raw",
        key_serializer="raw",
    )  # fmt: skip

    @app.agent(source)
    async def copy(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await sink.send(key=event.key, value=event.value)

    return app


def run_passthrough_worker(config_path: str) -> None:
    config = load_config(config_path)
    app = passthrough_app(config, Path(config_path).parent / "passthrough-faust")
    faust.Worker(app, loglevel="warning", quiet=True).execute_from_commandline()


def summary(
    args: argparse.Namespace,
    config: StreamConfig,
    passthrough: Capacity,
    pipeline: Capacity,
    left_after: float,
    delays: Delays,
    memory: Memory,
) -> list[Result]:
    """Print what was measured and how; return the summary rows."""
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
        f"sustained throughput = N / (last publication − first record consumed), records "
        f"produced before the worker starts\n"
        f"  passthrough: {passthrough.records:,} copied in {passthrough.seconds:.2f} s "
        f"(first to last copy's CreateTime)\n"
        f"  pipeline:    {pipeline.published:,} published + {pipeline.suppressed:,} suppressed "
        f"in {pipeline.seconds:.2f} s (first ingest seen in Redis to last CreateTime)"
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
    return [
        Result(
            "pipeline throughput", pipeline.throughput, "rec/s", ",.0f", THROUGHPUT_TARGET, True
        ),
        Result("passthrough throughput", passthrough.throughput, "rec/s"),
        Result(
            "pipeline / passthrough",
            pipeline.throughput / passthrough.throughput,
            "",
            ".2f",
            RATIO_TARGET,
            True,
        ),
        Result("delay p50 (paced run)", p50, "s", ".2f"),
        Result("delay p99 (paced run)", p99, "s", ".2f", config.max_wait + DELAY_SLACK),
        Result(
            "Redis bytes per buffered record",
            memory.used_bytes / memory.records,
            "B",
            ",.0f",
            BYTES_TARGET,
        ),
        Result("Redis bytes per ingested record left after publication", left_after, "B"),
    ]


def run(args: argparse.Namespace) -> None:
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

            def config(name: str, max_wait: float = args.max_wait) -> dict[str, Any]:
                return stream_document(
                    name, servers.kafka_bootstrap, servers.redis_url, args.partitions, max_wait
                )

            log(f"Redis memory: buffering {args.buffered:,} records that cannot be grouped")
            memory_config = parse_config(
                config("bench-memory", MEMORY_MAX_WAIT), "bench-memory", work
            )
            memory = asyncio.run(buffer_memory(memory_config, rows, args.buffered, rng))

            passthrough_config = write_config(config("bench-passthrough"), args.records, work)
            messages = messages_of(records, passthrough_config.schema.names)
            log("bare Faust passthrough")
            passthrough = asyncio.run(passthrough_capacity(passthrough_config, messages, env, work))
            log(f"  {passthrough.throughput:,.0f} records/s")

            log("decoy pipeline")
            pipeline_config = write_config(config("bench-pipeline"), args.records, work)
            pipeline, left_after = asyncio.run(
                pipeline_capacity(pipeline_config, messages, env, work)
            )
            log(f"  {pipeline.throughput:,.0f} records/s")

            rate = args.rate or PACED_SHARE * pipeline.throughput
            log(f"decoy pipeline, paced at {rate:,.0f} records/s for delays")
            delay_config = write_config(config("bench-delay"), args.records, work)
            delays = asyncio.run(pipeline_delays(delay_config, messages, rate, env, work))

    results = summary(args, pipeline_config, passthrough, pipeline, left_after, delays, memory)
    print_table(
        ["metric", "measured", "target", "measured/target", "pass"], [r.cells() for r in results]
    )
    print(f"\nRedis memory per buffered record by key (MEMORY USAGE, {memory.records:,} records)")
    print_table(
        ["key", "bytes per record"],
        [
            [family, f"{size / memory.records:,.0f}"]
            for family, size in sorted(memory.by_key.items(), key=lambda kv: -kv[1])
        ],
    )
    missed = [r.metric for r in results if r.target is not None and not r.met()]
    print(f"\n{'targets missed: ' + '; '.join(missed) if missed else 'all targets met'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(
            "Sustained throughput of the decoy stream pipeline against a bare Faust "
            "passthrough, publication delay, and Redis memory per buffered record, "
            "on embedded servers."
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
        help="records/s of the paced delay run (default 60%% of the measured pipeline throughput)",
    )
    parser.add_argument(
        "--buffered",
        type=int,
        default=50_000,
        help="records buffered for the Redis memory measurement (default 50000)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the records (default 0)")
    parser.add_argument(
        "--run-passthrough-worker",
        metavar="CONFIG",
        help="internal: run the passthrough worker for a bench stream's config (started by the "
        "benchmark itself)",
    )
    args = parser.parse_args()
    if args.run_passthrough_worker:
        run_passthrough_worker(args.run_passthrough_worker)
        return
    if min(args.records, args.partitions, args.buffered) < 1 or args.max_wait <= 0:
        parser.error("--records, --partitions, --buffered and --max-wait must be positive")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    run(args)


if __name__ == "__main__":
    main()
