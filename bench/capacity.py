"""Capacity figures for docs/scaling.md (issue 14): worker throughput on one Redis server and
on a Redis Cluster, Redis memory per buffered and per published record, and the consumer's
counting rate, each on embedded servers started here. Prints markdown tables, exits 0.

Two sets of embedded servers run one after the other (``deploy.embedded.EmbeddedServers``):
a tansu broker with one Redis-protocol server (``appendfsync always``), then a tansu broker
with a 3-master Redis Cluster (``redis_cluster=3``; stream configs with ``[redis] cluster =
true`` and REDIS_CLUSTER=1, so workers and consumers use a cluster client). Every phase runs
on its own stream name, so its topics and Redis keys start empty. Every stream is
``deploy/examples/adult-decoy.toml`` adapted as ``bench/stream_throughput.py`` adapts it
(its ``stream_document``: --partitions partitions, max_wait --max-wait, flush_interval 2 s,
report_interval one hour), with records resampled with replacement (seed --seed) from the
bundled UCI Adult sample.

- **workers** (--backlog N records): the backlog is produced to the raw topic first, then
  1 worker (single Redis, cluster) or 2 workers (cluster) start at once; the clock runs from
  their spawn (process start, imports and group join included) to the poll (every 250 ms)
  that sees every record settled: ``BufferState.totals()["settled"]`` (published,
  suppressed after max_wait, or below a partition's mixing floor) equal to N. Also given from
  the last poll before the first record was ingested. CPU per record: utime + stime + cutime
  + cstime from ``/proc/<pid>/stat`` of each worker (and of the Redis nodes and the broker),
  from that poll to the last, divided by N.
- **consumer counting**: once a 1-worker run has stopped, ``splu consumer`` counts that
  stream's published records (``stream_throughput.consumer_counting``: from the last poll of
  ``RunningCounts.stats()["records"]`` before a first record was counted to the poll that
  sees them all; its CPU the same way).
- **Redis memory per buffered record** (--buffered N): a stream with mixing_pool 10^6 and
  max_wait one hour, so nothing is published or suppressed; N records pass through a worker
  (grouped and randomized into the mixing pools, or waiting for a group). ``used_memory``
  (``TrustedState.memory()``: summed over the masters of a cluster) after the worker has
  stopped minus before it started, divided by N.
- **Redis memory per published record** (--published N): a stream with the smallest mixing
  pool allowed (10 groups of γ) and max_wait --max-wait; N records pass through a worker and
  a consumer running together until every record is settled and every published record is
  counted, both stop, and the used_memory growth is divided by N: what stays for good (the
  worker's id fingerprints ``:seen``, the consumer's token fingerprints, truth tallies,
  counters, published cells, and the few records below the mixing floor).
  ``MEMORY USAGE`` of each of the stream's keys breaks both memory figures down.

Run from the repository root (about 5 minutes on 2 cores with the defaults):

    PYTHONPATH=$PWD .venv/bin/python bench/capacity.py
    PYTHONPATH=$PWD .venv/bin/python bench/capacity.py --backlog 20000 --buffered 5000 \\
        --published 5000                             # a smoke run, < 2 min
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from redis.crc import key_slot
from report import log, status
from stream_throughput import (
    FLUSH_INTERVAL,
    READY_TIMEOUT,
    SLOWEST_RATE,
    BufferProgress,
    Capacity,
    Counters,
    adult_rows,
    consumer_counting,
    cpu_seconds,
    example_document,
    follow,
    messages_of,
    pre_produce,
    resample,
    stream_document,
    write_config,
)

from deploy.embedded import (
    EmbeddedServers,
    Endpoints,
    ManagedProcess,
    free_port,
    spawn_consumer,
    spawn_worker,
    stream_env,
)
from service.core.config import MIN_MIXING_GROUPS, StreamConfig
from service.store.auditor import TrustedState
from service.store.buffer import BufferState, connect
from service.store.running_counts import RunningCounts
from streams.runtime.topics import create_topics

CLUSTER_MASTERS = 3
CLUSTER_SLOTS = 16384
SETUPS = (("single Redis", 0), (f"{CLUSTER_MASTERS}-master Redis Cluster", CLUSTER_MASTERS))
WORKER_RUNS = {0: (1,), CLUSTER_MASTERS: (1, 2)}  # worker processes per run, by setup
BIG_POOL = 1_000_000  # a mixing floor no memory run reaches: nothing is published
LONG_WAIT = 3600.0  # seconds: nothing buffered for the memory runs is suppressed meanwhile
# Environment variables naming external servers: the benchmark starts its own.
SERVER_ENV = ("KAFKA_BOOTSTRAP", "REDIS_URL", "REDIS_CLUSTER")
FINGERPRINT_BUCKETS = 65536  # 2-byte buckets per fingerprint hash (fingerprints.lua)


@dataclass(frozen=True)
class WorkerRun:
    setup: str
    workers: int
    records: int
    from_spawn: float  # seconds from the workers' spawn to every record settled
    to_published: float  # seconds from the last poll before the first ingest to the poll
    # that saw the last publication
    cpu: dict[str, float]  # CPU seconds per process over the ingest span
    published: int
    suppressed: int
    masters: dict[int, int] | None  # partitions per cluster master (by index), if a cluster


@dataclass(frozen=True)
class MemoryRun:
    setup: str
    state: str  # "buffered" or "published"
    records: int
    used_bytes: int  # used_memory growth
    by_key: dict[str, int]  # MEMORY USAGE summed per key family
    counts: dict[str, int]  # the buffer's totals at the end
    buckets: dict[str, int]  # fingerprint hash fields, per family ("worker :seen", ...)


@dataclass(frozen=True)
class ConsumerRun:
    setup: str
    capacity: Capacity


@dataclass
class Results:
    workers: list[WorkerRun]
    memory: list[MemoryRun]
    consumer: list[ConsumerRun]
    redis_version: str = ""


class AllRunning:
    """Several processes as one for `follow`: running while every one of them runs."""

    def __init__(self, processes: list[ManagedProcess]) -> None:
        self.processes = processes

    @property
    def running(self) -> bool:
        return all(p.running for p in self.processes)


@contextmanager
def restored_environ() -> Iterator[None]:
    """A run exports the servers' addresses into os.environ (`stream_env`); undo it
    afterwards, or the next EmbeddedServers would take them for external servers."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def redis_pids(servers: Endpoints) -> list[int]:
    """The pids of the Redis server or of every node of the cluster started here."""
    redis = servers.redis
    if redis is None:
        return []
    nodes = getattr(redis, "nodes", [redis])
    return [node.pid for node in nodes if node.pid is not None]


def cpu_of(workers: list[ManagedProcess], servers: Endpoints) -> Counters:
    counters: Counters = {
        ("cpu", f"worker {i + 1}"): cpu_seconds(w.pid)
        for i, w in enumerate(workers)
        if w.pid is not None
    }
    counters["cpu", "Redis"] = sum(cpu_seconds(pid) for pid in redis_pids(servers))
    if servers.kafka is not None and servers.kafka.pid is not None:
        counters["cpu", "broker"] = cpu_seconds(servers.kafka.pid)
    return counters


def partitions_per_master(config: StreamConfig) -> dict[int, int]:
    """Which master serves each partition's keys (slots split evenly, as RedisCluster forms
    them), counted per master."""
    share = -(-CLUSTER_SLOTS // CLUSTER_MASTERS)
    state = BufferState(None, config)  # type: ignore[arg-type]  # prefix() needs no client
    masters = Counter(key_slot(state.prefix(p).encode()) // share for p in range(config.partitions))
    return {m: masters.get(m, 0) for m in range(CLUSTER_MASTERS)}


async def produce_backlog(config: StreamConfig, records: list[dict[str, str]]) -> int:
    await create_topics(config.kafka, config.topic_partitions)
    await pre_produce(config, messages_of(records, config.schema.names))
    return len(records)


async def worker_run(
    setup: str,
    config: StreamConfig,
    records: list[dict[str, str]],
    workers: int,
    env: dict[str, str],
    work: Path,
    servers: Endpoints,
) -> WorkerRun:
    """`workers` worker processes started on a backlog, until every record is settled."""
    count = await produce_backlog(config, records)
    deadline = time.monotonic() + READY_TIMEOUT + count / SLOWEST_RATE + config.max_wait
    client = connect(config)
    progress = BufferProgress(BufferState(client, config), count)  # type: ignore[arg-type]
    logs = [work / f"{config.name}-worker-{i + 1}.log" for i in range(workers)]
    spawned = time.time()
    processes = [spawn_worker(config.source, env, path) for path in logs]

    async def sample() -> Counters:
        return cpu_of(processes, servers)

    # When the published count last grew: the settled count waits max_wait longer for the
    # records that found no group, to suppress them.
    last_published = [time.time(), 0]

    async def poll() -> tuple[int, int]:
        begun, done = await progress()
        if progress.counts.get("published", 0) > last_published[1]:
            last_published[:] = [time.time(), progress.counts["published"]]
        return begun, done

    running = AllRunning(processes)
    try:
        span = await follow(poll, count, running, logs[0], deadline, sample)  # type: ignore[arg-type]
    finally:
        for process in processes:
            process.stop()
        await client.aclose()
    return WorkerRun(
        setup, workers, count, span.finished - spawned, last_published[0] - span.started,
        span.of("cpu"), progress.counts["published"], progress.counts["suppressed"],
        partitions_per_master(config) if config.redis_cluster else None,
    )  # fmt: skip


def key_family(key: bytes) -> str:
    """`worker :<part>` for ``splu:{<stream>:<p>}:<part>...``, `consumer :<part>` for
    ``splu:{<stream>:consumer:<p>}:<part>...``."""
    tag, _, rest = key.decode().partition("}:")
    role = "consumer" if ":consumer" in tag else "worker"
    return f"{role} :{rest.split(':', 1)[0]}"


async def key_usage(client: Any, config: StreamConfig) -> tuple[dict[str, int], dict[str, int]]:
    """MEMORY USAGE summed per key family, and the fields of the fingerprint hashes."""
    by_key: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    async for name in client.scan_iter(match=f"splu:{{{config.name}:*", count=1000):
        family = key_family(name)
        by_key[family] += await client.memory_usage(name, samples=0) or 0
        if family.endswith((":seen", ":known")):
            buckets[family] += await client.hlen(name)
    return dict(by_key), dict(buckets)


async def memory_run(
    setup: str,
    state: str,
    config: StreamConfig,
    records: list[dict[str, str]],
    env: dict[str, str],
    work: Path,
) -> MemoryRun:
    """Redis growth from records buffered by a worker (state "buffered": nothing published)
    or from records published and counted (state "published": a worker and a consumer)."""
    count = await produce_backlog(config, records)
    deadline = time.monotonic() + READY_TIMEOUT + count / SLOWEST_RATE + config.max_wait
    client = connect(config)
    buffer = TrustedState(client, config)
    counts_in = RunningCounts(client, config)
    before = await buffer.memory()
    worker_log = work / f"{config.name}-worker.log"
    processes = [spawn_worker(config.source, env, worker_log)]
    if state == "published":
        consumer_log = work / f"{config.name}-consumer.log"
        processes.append(spawn_consumer(config.source, free_port(), env, consumer_log))
    totals: dict[str, int] = {}

    async def progress() -> tuple[int, int]:
        nonlocal totals
        totals = await buffer.totals()
        ingested = totals.get("ingested", 0)
        if state == "buffered":
            waiting = totals["pending"] + totals["pool"]
            status(
                f"in {ingested:8,}  buffered {totals['pending']:7,}  pool {totals['pool']:7,}",
                last=waiting >= count,
            )
            return ingested, waiting
        counted = (await counts_in.stats()).get("records", 0)
        settled, published = totals["settled"], totals.get("published", 0)
        done = count if settled >= count and counted >= published else min(counted, count - 1)
        status(
            f"in {ingested:8,}  settled {settled:8,}  published {published:8,}  "
            f"counted {counted:8,}",
            last=done >= count,
        )
        return ingested, done

    try:
        await follow(progress, count, AllRunning(processes), worker_log, deadline)  # type: ignore[arg-type]
    finally:
        for process in processes:
            process.stop()
    try:
        await asyncio.sleep(1.0)  # the stopped processes' connections and their buffers go
        after = await buffer.memory()
        by_key, buckets = await key_usage(client, config)
    finally:
        await client.aclose()
    return MemoryRun(setup, state, count, after - before, by_key, totals, buckets)


async def redis_version(config: StreamConfig) -> str:
    client = connect(config)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    if all(isinstance(v, dict) for v in info.values()):  # one answer per node
        info = next(iter(info.values()))
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info.get('redis_version', '?')}"


def run_setup(
    setup: str,
    masters: int,
    args: argparse.Namespace,
    records: dict[str, list[dict[str, str]]],
    directory: Path,
    results: Results,
) -> None:
    """Every run of one set of servers, on `records` ("backlog", "buffered", "published")."""
    tag = "cluster" if masters else "single"
    work = directory / tag
    work.mkdir()
    with restored_environ(), EmbeddedServers(work / "servers", redis_cluster=masters) as servers:
        if servers.redis_cluster != bool(masters):
            raise SystemExit(f"{setup}: EmbeddedServers gave redis_cluster={servers.redis_cluster}")
        env = stream_env(servers)
        # This process's own stages load the config and draw with the workers' key.
        os.environ.update(env)

        def config(name: str, max_wait: float = args.max_wait, **stream: Any) -> StreamConfig:
            document = stream_document(
                f"cap-{tag}-{name}", servers.kafka_bootstrap, servers.redis_url,
                args.partitions, max_wait,
            )  # fmt: skip
            document["stream"].update(stream)
            document["redis"]["cluster"] = bool(masters)
            return write_config(document, work)

        if not results.redis_version:
            results.redis_version = asyncio.run(redis_version(config("probe")))
        if "workers" in args.figures or "consumer" in args.figures:
            for workers in WORKER_RUNS[masters] if "workers" in args.figures else (1,):
                log(f"{setup}: {workers} worker(s) on a backlog of {args.backlog:,} records")
                stream = config(f"w{workers}")
                backlog = records["backlog"]
                run = asyncio.run(worker_run(setup, stream, backlog, workers, env, work, servers))
                rate = run.records / run.from_spawn
                log(f"  settled {run.from_spawn:.1f} s after spawn: {rate:,.0f} records/s")
                if workers == 1 and "consumer" in args.figures:
                    log(f"{setup}: a consumer counting {run.published:,} published records")
                    # consumer_counting samples the CPU of servers.redis by its pid: a
                    # cluster's nodes have several, so its Redis CPU is left out.
                    counted_on = servers if not masters else replace(servers, redis=None)
                    capacity = asyncio.run(
                        consumer_counting(stream, run.published, env, work, counted_on)
                    )
                    results.consumer.append(ConsumerRun(setup, capacity))
                    log(f"  {capacity.throughput:,.0f} records/s")
                if "workers" in args.figures:
                    results.workers.append(run)

        if "memory" in args.figures:
            gamma = example_document()["decoy"]["gamma"]
            floor = MIN_MIXING_GROUPS * gamma  # the smallest mixing floor allowed
            log(f"{setup}: Redis memory, {args.buffered:,} records buffered in the mixing pool")
            stream = config("buffered", LONG_WAIT, mixing_pool=BIG_POOL, buffer_cap=2 * BIG_POOL)
            buffered = records["buffered"]
            results.memory.append(
                asyncio.run(memory_run(setup, "buffered", stream, buffered, env, work))
            )
            log(f"{setup}: Redis memory, {args.published:,} records published and counted")
            stream = config("published", mixing_pool=floor)
            published = records["published"]
            results.memory.append(
                asyncio.run(memory_run(setup, "published", stream, published, env, work))
            )


def print_markdown(header: list[str], rows: list[list[str]]) -> None:
    """A GitHub markdown table: the first column left-aligned, the figures right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def render(row: list[str]) -> str:
        first, *rest = row
        cells = [
            first.ljust(widths[0]),
            *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)),
        ]
        return "| " + " | ".join(cells) + " |"

    print(render(header))
    print(
        "| "
        + " | ".join([":" + "-" * (widths[0] - 1), *("-" * (w - 1) + ":" for w in widths[1:])])
        + " |"
    )
    for row in rows:
        print(render(row))


def command(args: argparse.Namespace, figure: str, **sizes: int) -> str:
    options = [f"--figures {figure}", *(f"--{k} {v}" for k, v in sizes.items())]
    options += [
        f"--partitions {args.partitions}",
        f"--max-wait {args.max_wait:g}",
        f"--seed {args.seed}",
    ]
    return "PYTHONPATH=$PWD .venv/bin/python bench/capacity.py " + " ".join(options)


def usec(seconds: float, records: int) -> str:
    return f"{seconds * 1e6 / records:,.1f}"


def machine(results: Results) -> str:
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(meminfo.read_text().split("MemTotal:", 1)[1].split()[0])
        memory = f", {kib / 2**20:.0f} GiB RAM"
    return (
        f"{os.cpu_count()} cores ({model or platform.processor()}){memory}, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"{results.redis_version or 'Redis ?'} (appendfsync always), tansu broker"
    )


def report(args: argparse.Namespace, results: Results, wall: float) -> None:
    print("# Capacity figures (docs/scaling.md, issue 14)\n")
    print(f"Machine: {machine(results)}.")
    example = example_document()
    print(
        f"Stream: deploy/examples/adult-decoy.toml (decoy groups, γ = "
        f"{example['decoy']['gamma']}), {args.partitions} partitions, max_wait "
        f"{args.max_wait:g} s, flush_interval {FLUSH_INTERVAL:g} s, batch_size "
        f"{example['stream']['batch_size']:,}, mixing_pool {example['stream']['mixing_pool']:,} "
        f"(memory runs: see below); "
        f"records resampled from the bundled UCI Adult sample (seed {args.seed}); embedded "
        f"servers started by the benchmark.\n"
    )
    if results.workers:
        print(f"## Worker throughput: a backlog of {args.backlog:,} records\n")
        print(
            "Time from the workers' spawn (start, imports, group join) to every record "
            "settled (published, suppressed after max_wait, or below a mixing floor), "
            "which ends at least max_wait after the last ingest (records that find no group "
            "are suppressed then); also records published per second from the first ingest "
            "to the last publication. CPU from /proc from the first ingest to all settled.\n"
        )
        rows = []
        for run in results.workers:
            worker_cpu = sum(s for name, s in run.cpu.items() if name.startswith("worker"))
            rate = run.records / run.from_spawn
            rows.append([
                run.setup, str(run.workers), f"{run.from_spawn:.1f}", f"{rate:,.0f}",
                f"{rate / run.workers:,.0f}", f"{run.published / run.to_published:,.0f}",
                usec(worker_cpu, run.records), f"{run.records / worker_cpu:,.0f}",
                usec(run.cpu.get("Redis", 0.0), run.records),
                usec(run.cpu.get("broker", 0.0), run.records),
                f"{run.published:,} / {run.suppressed:,}",
            ])  # fmt: skip
        print_markdown(
            ["Redis", "workers", "s from spawn", "records/s", "records/s per worker",
             "published/s from first ingest", "worker CPU µs/record",
             "records per worker CPU s", "Redis CPU µs/record", "broker CPU µs/record",
             "published / suppressed"],
            rows,
        )  # fmt: skip
        for run in results.workers:
            if run.masters is not None:
                spread = ", ".join(f"master {m}: {n}" for m, n in run.masters.items())
                print(f"\nPartitions per master ({run.setup}, {run.workers} worker(s)): {spread}")
        print(f"\nReproduce: `{command(args, 'workers', backlog=args.backlog)}`\n")
    if results.consumer:
        print("## Consumer counting rate\n")
        print(
            "`splu consumer` started on the published records of the 1-worker run, its worker "
            "stopped: from the first record counted in Redis to the last "
            "(`RunningCounts.stats()['records']`).\n"
        )
        rows = []
        for run in results.consumer:
            capacity = run.capacity
            redis = capacity.cpu.get("Redis")
            rows.append([
                run.setup, f"{capacity.records:,}", f"{capacity.seconds:.1f}",
                f"{capacity.throughput:,.0f}", usec(capacity.cpu["consumer"], capacity.records),
                "—" if redis is None else usec(redis, capacity.records),
            ])  # fmt: skip
        print_markdown(
            ["Redis", "records", "s", "records/s", "consumer CPU µs/record", "Redis CPU µs/record"],
            rows,
        )
        print(
            "\n(Redis CPU is not sampled on the cluster: `consumer_counting` reads one pid.)"
            if any(r.capacity.cpu.get("Redis") is None for r in results.consumer)
            else ""
        )
        print(f"Reproduce: `{command(args, 'consumer', backlog=args.backlog)}`\n")
    if results.memory:
        print("## Redis memory per record\n")
        print(
            "used_memory growth (summed over the masters of a cluster) divided by the records "
            "sent, with the worker (and consumer) stopped. Buffered: mixing_pool 10^6 and "
            "max_wait 1 h, nothing published. Published: mixing_pool 10·γ (the smallest "
            "allowed), a consumer counting alongside; what stays after publication.\n"
        )
        rows = []
        for run in results.memory:
            counts = run.counts
            if run.state == "buffered":
                left = f"{counts.get('pool', 0):,} pooled, {counts.get('pending', 0):,} waiting"
            else:
                left = (
                    f"{counts.get('published', 0):,} published, "
                    f"{counts.get('suppressed', 0):,} suppressed, "
                    f"{counts.get('pool', 0):,} below floor"
                )
            rows.append([
                f"{run.state}, {run.setup}", f"{run.records:,}", f"{run.used_bytes / 2**20:,.1f}",
                f"{run.used_bytes / run.records:,.0f}",
                f"{sum(run.by_key.values()) / run.records:,.0f}", left,
            ])  # fmt: skip
        print_markdown(
            ["records", "sent", "used_memory growth MiB", "bytes/record",
             "MEMORY USAGE of the stream's keys, bytes/record", "at the end"],
            rows,
        )  # fmt: skip
        families = sorted(
            {f for run in results.memory for f in run.by_key},
            key=lambda f: -max(run.by_key.get(f, 0) / run.records for run in results.memory),
        )
        print("\nBy key (MEMORY USAGE, bytes per record sent):\n")
        print_markdown(
            ["key", *(f"{run.state}, {run.setup}" for run in results.memory)],
            [
                [f, *(f"{run.by_key.get(f, 0) / run.records:,.1f}" for run in results.memory)]
                for f in families
            ],
        )
        print(
            f"\nFingerprints are kept in {FINGERPRINT_BUCKETS:,} hash fields (2-byte buckets) "
            f"per partition: 10 bytes per id, 6 per token once buckets are full; below that "
            f"a field's own overhead dominates. Buckets used, summed over the partitions "
            f"(ids or tokens per bucket):"
        )
        for run in results.memory:
            parts = []
            for family, fields in sorted(run.buckets.items()):
                members = (
                    run.records if family.startswith("worker") else run.counts.get("published", 0)
                )
                parts.append(f"{family} {fields:,} ({members / max(fields, 1):.2f})")
            print(f"- {run.state}, {run.setup}: {'; '.join(parts)}")
        sizes = {"buffered": args.buffered, "published": args.published}
        print(f"\nReproduce: `{command(args, 'memory', **sizes)}`\n")
    print(f"Wall time: {wall:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(
            "Capacity figures for docs/scaling.md: worker records/s on one Redis server and "
            "on a 3-master Redis Cluster (1 and 2 workers), Redis memory per buffered and per "
            "published record, and the consumer's counting rate, on embedded servers."
        )
    )
    parser.add_argument(
        "--figures",
        default="workers,memory,consumer",
        help="comma-separated: workers, memory, consumer (default all)",
    )
    parser.add_argument(
        "--backlog", type=int, default=300_000, help="records per worker run (default 300000)"
    )
    parser.add_argument(
        "--buffered",
        type=int,
        default=100_000,
        help="records buffered for the memory figure (default 100000)",
    )
    parser.add_argument(
        "--published",
        type=int,
        default=200_000,
        help="records published and counted for the memory figure (default 200000)",
    )
    parser.add_argument(
        "--partitions", type=int, default=6, help="partitions of every topic (default 6)"
    )
    parser.add_argument(
        "--max-wait", type=float, default=5.0, help="max_wait in seconds (default 5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the records (default 0)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="a new directory to keep the configs, process logs and server data in (default: "
        "a temporary directory, removed at the end)",
    )
    args = parser.parse_args()
    args.figures = {f.strip() for f in args.figures.split(",") if f.strip()}
    unknown = args.figures - {"workers", "memory", "consumer"}
    if unknown or not args.figures:
        parser.error(f"--figures takes workers, memory, consumer; got {sorted(unknown)}")
    if min(args.backlog, args.buffered, args.published, args.partitions) < 1 or args.max_wait <= 0:
        parser.error(
            "--backlog, --buffered, --published, --partitions, --max-wait must be positive"
        )
    if args.buffered >= BIG_POOL:
        parser.error(f"--buffered must stay below the memory run's mixing floor ({BIG_POOL:,})")
    for name in SERVER_ENV:
        if os.environ.pop(name, None) is not None:
            log(f"ignoring {name}: the benchmark starts its own servers")
    started = time.monotonic()
    rng = np.random.default_rng(args.seed)
    rows = adult_rows()
    # The same records for every set of servers, so their runs compare.
    records = {
        "backlog": resample(rows, args.backlog, rng),
        "buffered": resample(rows, args.buffered, rng),
        "published": resample(rows, args.published, rng),
    }
    results = Results([], [], [])
    log(f"capacity: {shlex.join(sys.argv)}")
    with ExitStack() as stack:
        if args.work_dir is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="splu-cap-")))
        else:
            directory = args.work_dir
            directory.mkdir(parents=True)
        for setup, masters in SETUPS:
            run_setup(setup, masters, args, records, directory, results)
    report(args, results, time.monotonic() - started)


if __name__ == "__main__":
    main()
