"""Soak: the decoy stream at a fixed rate for minutes, watching throughput, delay and memory.

One run on the embedded servers (``deploy.embedded``: the tansu broker with memory
storage and a Redis-protocol server with ``appendfsync always``), with the processes of
production: ``splu worker`` and ``splu consumer`` (``spawn_worker``, ``spawn_consumer``),
each a child process.

- **stream**: ``deploy/examples/adult-decoy.toml`` under a fresh name with the settings
  of ``bench/stream_throughput.py`` (--partitions 4, --max-wait 5 s, flush_interval 2 s),
  so the default rate relates to the capacity that benchmark measures. When
  ``service.core.config.StreamConfig`` has a ``dedup_window`` field, the config sets
  ``stream.dedup_window`` (--dedup-window) and the run is *windowed*: the worker's dedup
  index and the consumer's tokens are kept for one to two windows. Otherwise the run is
  *unwindowed*: both keep an entry per record for good (this checkout: a 10-byte
  fingerprint per ingested record and a 6-byte one per counted token, plus hash
  overhead). Which mode ran is printed.
- **records**: the bundled UCI Adult sample resampled with replacement (seed --seed),
  cycled, each record under a unique id (``soak:<n>``), produced at --rate records/s
  for --minutes (``streams.tools.produce.produce``), after both the worker and the consumer
  joined their consumer groups (the worker owns every partition, the consumer's group
  is Stable and its /status answers).
- **every --interval seconds** a line on stdout: elapsed time; records produced
  (handed to the producer), published, suppressed, pending in Redis and in the mixing
  pools (the worker's counters as the consumer's /status shows them); *backlog*, the
  records produced but not yet ingested (they wait in Kafka, where the delay histogram
  cannot see them); *counted*, the records the consumer counted; throughput over the
  interval (published + suppressed per second); the publish delay's p50/p99 over the
  interval (the difference of two /status "delay" histograms: arrival in Redis to
  emission, interpolated inside the buckets 0.1, 0.25, 0.5, 1, 2.5, 5, 10 s, ... as
  Prometheus does); Redis used_memory (INFO); worker and consumer RSS (VmRSS of
  /proc/<pid>/status).
- **memory**: Redis used_memory and the RSS of the worker, the consumer, the broker and
  the Redis server are sampled every 2 s. The *steady phase* is the second half of the
  production phase (the first half lets allocators, hash tables, Faust buffers and a
  first dedup window fill). It is cut into bins of --dedup-window seconds aligned to
  multiples of it since the epoch: those are the instants when the worker and the
  consumer drop a window's keys, so Redis memory is a sawtooth with that period. A
  least-squares line through the bin means gives the slope; through the raw samples a
  sawtooth would add a slope of up to its amplitude per fit span, a bin mean removes it.
  The slope is shown per minute, as a share of the level (the mean of the bin means),
  and per record produced, with its standard error.
- **CPU**: each process's user + system time over the steady phase (/proc/<pid>/stat),
  as a share of a core and per record produced: which process limits the rate.
- **Redis by key**: ``MEMORY USAGE`` of every key of the stream, summed by what holds it
  (a buffer partition, an identity shard, a consumer shard, the final pool, the stream)
  and the key's name, read when the steady phase starts and when production ends: which
  keys Redis's growth per record produced goes to.
- **backlogs**: produced − ingested (the worker's, in Kafka) and published − counted
  (the consumer's), fit like memory; a backlog growing over the steady phase by more
  than 1% of the records produced (KEEP_UP) or one batch, whichever is more, means
  --rate is above what the machine sustains, and the memory figures were then taken
  under overload.
- **verdict**: "memory flat" when Redis used_memory, worker RSS and consumer RSS each
  change by at most 1% of their level per minute (FLAT_TOLERANCE). Why 1%: the growth
  to catch, an entry per record kept for good, is 56 B × 3,000 records/s ≈ 10 MB a
  minute in Redis for the dedup index alone, over 10% a minute of the levels a bounded
  run holds here (tens of MB with a 60 s window); 1% a minute of such a level is a
  few bytes per record. A process growing at 1% a minute would double in about 70
  minutes, so a steady leak slower than that is left to longer soaks. The standard
  error of each slope is printed: where it exceeds the tolerance (short runs), the
  verdict says the fit cannot resolve it. The broker's and the Redis server's RSS are
  shown for context only: tansu's memory storage keeps every record produced, by
  design, and a server's RSS keeps freed pages.
- **drain**: after the last record is produced the run waits until every record is
  published or suppressed and the consumer counted every published record, and prints
  the account.

Default rate: 3,000 records/s (DEFAULT_RATE), fixed so that soaks compare across runs,
and far below the pipeline capacity ``bench/stream_throughput.py`` measures (CAPACITY):
here the worker, the consumer, the producer and the broker share two cores and one
single-threaded Redis, and a soak is about memory, so the machine must keep up with
room to spare. The CPU each process spends per record at this rate is in
docs/performance.md (*Soak*). Fetches are small at this rate, so per-fetch costs weigh
more than in the throughput benchmark. The backlog table says whether the machine kept up
(a machine busy with other work may not: lower --rate). Redis used_memory grows by design
in an unwindowed run: every record id and published token keeps its fingerprint for the
life of the stream (docs/performance.md, *Soak*, has the bytes per record), so the
verdict reports it; the worker's and the consumer's memory must stay flat.

Run from the repository root:

    .venv/bin/python bench/soak.py                 # 10 minutes at 3,000 records/s
    .venv/bin/python bench/soak.py --minutes 1     # a quick check

Progress goes to stderr, the interval lines and the summary to stdout. Every server and
process started here is stopped on exit, on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import tomli_w
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from report import log, log_tail, print_table
from stream_throughput import adult_rows, resample, stream_document, wait_until_owned

from deploy.embedded import (
    EmbeddedServers,
    ManagedProcess,
    free_port,
    spawn_consumer,
    spawn_worker,
    stream_env,
)
from service.cli.client import ConsumerError
from service.cli.client import status as consumer_status
from service.core.config import StreamConfig, load_config
from service.store.auditor import TrustedState
from service.store.buffer import BufferState
from service.store.running_counts import RunningCounts
from streams.runtime.kafka import client_options
from streams.runtime.metrics import histogram_quantile
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

CAPACITY = 50_000.0  # records/s while the stream flows: bench/stream_throughput.py, 2 cores
# Fixed, so that soaks compare across runs.
DEFAULT_RATE = 3000.0
FLAT_TOLERANCE = 0.01  # share of the level per minute
KEEP_UP = 0.01  # a backlog may grow by this share of the records produced
SAMPLE_EVERY = 2.0  # seconds between memory samples
MIN_MINUTES = 0.5  # the second half then holds 7 samples
READY_TIMEOUT = 60.0  # seconds for the worker and the consumer to join their groups
DRAIN_STALL = 60.0  # seconds beyond max_wait + flush_interval without progress while draining
STATUS_TIMEOUT = 10.0  # seconds for the consumer to answer /status
MB = 1024 * 1024
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sample:
    time: float  # wall time, seconds since the epoch
    produced: int
    ingested: int
    resolved: int  # published + suppressed
    published: int
    counted: int  # published records the consumer counted
    redis_used: int  # INFO used_memory
    worker_rss: int | None
    consumer_rss: int | None
    broker_rss: int | None
    redis_rss: int | None
    cpu: dict[str, float | None]  # CPU seconds used so far, per process


@dataclass(frozen=True)
class Trend:
    """A least-squares line through the steady phase's bin means."""

    name: str
    first: float  # the first bin's mean
    last: float  # the last bin's mean
    level: float  # mean of the bin means
    slope: float  # per minute
    error: float  # standard error of the slope, per minute (nan with two points)
    per_record: float  # slope per record produced
    judged: bool  # part of the verdict

    @property
    def relative(self) -> float:
        return self.slope / self.level

    @property
    def flat(self) -> bool:
        return abs(self.relative) <= FLAT_TOLERANCE


class Feed:
    """Resampled records cycled under unique ids, counted as the producer takes them."""

    def __init__(self, values: list[bytes], total: int) -> None:
        self.values = values
        self.total = total
        self.taken = 0

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        for i in range(self.total):
            self.taken = i + 1
            yield f"soak:{i}".encode(), self.values[i % len(self.values)]


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a running process, from /proc/<pid>/stat."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss(pid: int | None) -> int | None:
    """Resident set size of a running process in bytes, from /proc/<pid>/status."""
    if pid is None:
        return None
    try:
        with Path(f"/proc/{pid}/status").open() as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def windowed() -> bool:
    """Whether this checkout's StreamConfig knows stream.dedup_window."""
    return "dedup_window" in {field.name for field in dataclasses.fields(StreamConfig)}


def interval_quantiles(
    later: dict[str, Any], earlier: dict[str, Any]
) -> tuple[float | None, float | None, int]:
    """p50, p99 and count of the delays added between two /status "delay" histograms."""
    buckets = [
        [bound, cumulative - previous]
        for (bound, cumulative), (_, previous) in zip(
            later["buckets"], earlier["buckets"], strict=True
        )
    ]
    return (
        histogram_quantile(0.5, buckets),
        histogram_quantile(0.99, buckets),
        later["count"] - earlier["count"],
    )


def seconds(value: float | None) -> str:
    return "   —  " if value is None else f"{value:5.2f}s"


def megabytes(value: float | None) -> str:
    return "—" if value is None else f"{value / MB:,.1f} MB"


def interval_line(
    elapsed: float,
    produced: int,
    status: dict[str, Any],
    previous: dict[str, Any],
    redis_used: int | None,
    worker_rss: int | None,
    consumer_rss: int | None,
) -> str:
    worker, earlier = status["worker"], previous["worker"]
    resolved = worker["published"] + worker["suppressed"]
    span = max(status["time"] - previous["time"], 1e-9)
    throughput = (resolved - earlier["published"] - earlier["suppressed"]) / span
    p50, p99, _ = interval_quantiles(status["delay"], previous["delay"])
    paused = "  PUBLISHING PAUSED" if status["paused"] else ""
    return (
        f"{elapsed:5.0f}s  produced {produced:9,}  published {worker['published']:9,}  "
        f"suppressed {worker['suppressed']:6,}  pending {worker['pending']:6,}  "
        f"pool {worker['pool']:6,}  backlog {produced - worker['ingested']:7,}  "
        f"counted {status['consumer']['counted']:9,} | {throughput:6,.0f} rec/s  "
        f"delay p50 {seconds(p50)} p99 {seconds(p99)} | "
        f"Redis {megabytes(redis_used)}  worker {megabytes(worker_rss)}  "
        f"consumer {megabytes(consumer_rss)}{paused}"
    )


async def fetch_status(url: str, log_path: Path) -> dict[str, Any]:
    try:
        return await asyncio.to_thread(consumer_status, url, STATUS_TIMEOUT)
    except ConsumerError as err:
        raise SystemExit(f"\nthe consumer did not answer: {err}\n{log_tail(log_path)}") from None


async def wait_for_consumer(config: StreamConfig, url: str, log_path: Path) -> None:
    """Until the consumer's group is Stable with a member and its /status answers."""
    group = f"splu-{config.name}-consumer"
    deadline = time.monotonic() + READY_TIMEOUT
    admin = AIOKafkaAdminClient(**client_options(config.kafka))
    await admin.start()
    try:
        while True:
            try:
                responses = await admin.describe_consumer_groups([group])
            except KafkaError:
                responses = []  # no coordinator for the group yet
            described = [g for response in responses for g in response.to_object()["groups"]]
            joined = any(g["state"] == "Stable" and g["members"] for g in described)
            if joined:
                try:
                    await asyncio.to_thread(consumer_status, url, STATUS_TIMEOUT)
                    return
                except ConsumerError:
                    pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the consumer did not join in time\n{log_tail(log_path)}")
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


class Soak:
    """The run: production at a fixed rate, samples, interval lines, then the drain."""

    def __init__(
        self,
        args: argparse.Namespace,
        config: StreamConfig,
        url: str,
        processes: dict[str, ManagedProcess],
        server_pids: dict[str, int | None],
        work: Path,
    ) -> None:
        self.args = args
        self.config = config
        self.url = url
        self.processes = processes
        self.server_pids = server_pids
        self.work = work
        self.samples: list[Sample] = []
        # (records produced, MEMORY USAGE by key family) at the steady phase's start and end
        self.key_usages: list[tuple[int, dict[str, int]]] = []
        self.started = self.ended = self.drained = 0.0  # wall times
        self.last_line = 0.0  # monotonic time of the last interval line

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if not process.running:
                raise SystemExit(
                    f"\nthe {name} exited; end of its log:\n{log_tail(self.work / f'{name}.log')}"
                )

    async def key_usage(self, client: aioredis.Redis, feed: Feed) -> None:
        """Record MEMORY USAGE by key family (`key_family`) with the records produced."""
        usage: dict[str, int] = {}
        async for key in client.scan_iter(match=f"splu:{{{self.config.name}*", count=1000):
            family = key_family(key)
            usage[family] = usage.get(family, 0) + (await client.memory_usage(key, samples=0) or 0)
        self.key_usages.append((feed.taken, usage))

    async def sample(self, state: BufferState, counts: RunningCounts, feed: Feed) -> Sample:
        totals = await state.totals()
        return Sample(
            time=time.time(),
            produced=feed.taken,
            ingested=totals.get("ingested", 0),
            resolved=totals.get("published", 0) + totals.get("suppressed", 0),
            published=totals.get("published", 0),
            counted=(await counts.stats()).get("records", 0),
            redis_used=await state.memory(),
            worker_rss=rss(self.processes["worker"].pid),
            consumer_rss=rss(self.processes["consumer"].pid),
            broker_rss=rss(self.server_pids["broker"]),
            redis_rss=rss(self.server_pids["redis"]),
            cpu={
                **{name: cpu_seconds(p.pid) for name, p in self.processes.items()},
                **{name: cpu_seconds(pid) for name, pid in self.server_pids.items()},
                "this script (producer, sampling)": time.process_time(),
            },
        )

    async def run(self, feed: Feed) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """Produce, sample and print; then drain. Returns the /status documents at the
        start of production and after the drain, and whether everything came through."""
        config, consumer_log = self.config, self.work / "consumer.log"
        client = aioredis.from_url(config.redis_url)
        state = TrustedState(client, config)
        counts = RunningCounts(client, config)
        try:
            log("waiting for the worker to own every partition and the consumer to join")
            await wait_until_owned(client, state, config.partitions)
            await wait_for_consumer(config, self.url, consumer_log)
            first = previous = await fetch_status(self.url, consumer_log)
            log(f"producing {feed.total:,} records at {self.args.rate:,.0f}/s")
            self.started = time.time()
            producing = asyncio.create_task(
                produce(config, iter(feed), feed.total, self.args.rate, progress=False)
            )
            ticks = 0
            next_line = self.started + self.args.interval
            steady = self.started + feed.total / self.args.rate / 2
            try:
                while not producing.done():
                    ticks += 1
                    pause = self.started + ticks * SAMPLE_EVERY - time.time()
                    await asyncio.wait({producing}, timeout=max(pause, 0))
                    self.check_alive()
                    if producing.done():
                        break
                    self.samples.append(await self.sample(state, counts, feed))
                    if not self.key_usages and time.time() >= steady:
                        await self.key_usage(client, feed)
                    if time.time() >= next_line:
                        previous = await self.line(previous, feed)
                        next_line += self.args.interval
                await producing
            finally:
                producing.cancel()
            self.ended = time.time()
            self.samples.append(await self.sample(state, counts, feed))
            await self.key_usage(client, feed)
            if time.monotonic() - self.last_line >= SAMPLE_EVERY:
                previous = await self.line(previous, feed)
            log(f"produced {feed.total:,} records in {self.ended - self.started:,.0f} s; draining")
            drained = await self.drain(feed, previous)
            last = await fetch_status(self.url, consumer_log)
        finally:
            await client.aclose()
        return first, last, drained

    async def line(self, previous: dict[str, Any], feed: Feed) -> dict[str, Any]:
        status = await fetch_status(self.url, self.work / "consumer.log")
        print(
            interval_line(
                time.time() - self.started, feed.taken, status, previous,
                self.samples[-1].redis_used if self.samples else None,
                rss(self.processes["worker"].pid), rss(self.processes["consumer"].pid),
            ),
            flush=True,
        )  # fmt: skip
        self.last_line = time.monotonic()
        return status

    async def drain(self, feed: Feed, previous: dict[str, Any]) -> bool:
        """Until every record is published or suppressed and every publication counted;
        False if that stops progressing for longer than a record may wait, plus slack."""
        config = self.config
        stall = config.max_wait + config.flush_interval + DRAIN_STALL
        progress, moved = None, time.monotonic()
        next_line = self.last_line + self.args.interval
        while time.monotonic() - moved < stall:
            self.check_alive()
            status = await fetch_status(self.url, self.work / "consumer.log")
            worker = status["worker"]
            resolved = worker["published"] + worker["suppressed"]
            counted = status["consumer"]["counted"]
            if worker["settled"] >= feed.total and counted >= worker["published"]:
                self.drained = time.time()
                if time.monotonic() - self.last_line >= self.args.interval / 3:
                    await self.line(previous, feed)
                return True
            if (resolved, status["consumer"]["counted"]) != progress:
                progress, moved = (resolved, status["consumer"]["counted"]), time.monotonic()
            if time.monotonic() >= next_line:
                previous = await self.line(previous, feed)
                next_line += self.args.interval
            await asyncio.sleep(0.5)
        log(f"the stream made no progress for {stall:.0f} s")
        return False


def key_family(key: bytes) -> str:
    """What holds a key of the stream, and the key's name: "partition :rec" for
    ``splu:{<stream>:<p>}:rec``, "identity shard :known", "consumer shard :seen", "final
    pool :takes", "stream :close"; the name without its period or depth suffixes."""
    tag, _, name = key.decode().partition("}:")
    within = tag.split(":")[2:]  # past "splu:{<stream>"
    holder = (
        "stream" if not within
        else "identity shard" if within[0] == "ids"
        else "consumer shard" if within[0] == "consumer"
        else "final pool" if within[0] == "final"
        else "partition"
    )  # fmt: skip
    return f"{holder} :{name.split(':')[0]}"


def steady_bins(
    samples: list[Sample], start: float, end: float, width: float
) -> list[list[Sample]]:
    """Samples of [start, end] in bins of `width` s aligned to multiples of it (whole bins)."""
    first, last = math.ceil(start / width), math.floor(end / width)
    bins = [
        [s for s in samples if k * width <= s.time < (k + 1) * width] for k in range(first, last)
    ]
    return [b for b in bins if b]


def trend(
    name: str,
    bins: list[list[Sample]],
    value: Any,
    judged: bool,
) -> Trend | None:
    """Least squares through the bins' mean value against their mean time."""
    points = [
        (np.mean([s.time for s in b]), np.mean(values))
        for b in bins
        if (values := [v for s in b if (v := value(s)) is not None])
    ]
    if len(points) < 2:
        return None
    minutes = np.array([t for t, _ in points]) / 60
    levels = np.array([v for _, v in points])
    slope, intercept = np.polyfit(minutes, levels, 1)
    error = math.nan
    if len(points) > 2:
        residuals = levels - (slope * minutes + intercept)
        spread = np.sum((minutes - minutes.mean()) ** 2)
        error = math.sqrt(np.sum(residuals**2) / (len(points) - 2) / spread)
    produced = [np.mean([s.produced for s in b]) for b in bins]
    per_minute = (produced[-1] - produced[0]) / ((points[-1][0] - points[0][0]) / 60)
    return Trend(
        name, float(levels[0]), float(levels[-1]), float(levels.mean()), float(slope), error,
        float(slope / per_minute) if per_minute else math.nan, judged,
    )  # fmt: skip


def trend_row(t: Trend) -> list[str]:
    error = "" if math.isnan(t.error) else f" ± {t.error / MB:,.2f}"
    return [
        t.name,
        f"{t.first / MB:,.1f} MB",
        f"{t.last / MB:,.1f} MB",
        f"{t.slope / MB:+,.2f}{error} MB/min",
        f"{100 * t.relative:+.2f}%",
        f"{t.per_record:+,.1f} B",
        ("yes" if t.flat else "NO") if t.judged else "(context)",
    ]


def summary(
    args: argparse.Namespace,
    config: StreamConfig,
    soak: Soak,
    first: dict[str, Any],
    last: dict[str, Any],
    drained: bool,
    feed: Feed,
) -> None:
    samples = soak.samples
    production = soak.ended - soak.started
    half = soak.started + production / 2
    steady = [s for s in samples if s.time >= half]
    mode = (
        f"windowed: stream.dedup_window = {args.dedup_window:g} s"
        if windowed()
        else "unwindowed: this StreamConfig has no dedup_window; Redis keeps an entry per record"
    )
    print(
        f"\nSoak: {feed.total:,} Adult records resampled (seed {args.seed}) at "
        f"{args.rate:,.0f} records/s for {production / 60:.1f} min; decoy γ="
        f"{config.decoy.gamma if config.decoy else '—'}, {config.partitions} partitions, "
        f"max_wait {config.max_wait:g} s, flush_interval {config.flush_interval:g} s, "
        f"batch_size {config.batch_size:,}; worker and consumer processes, embedded tansu "
        f"broker and Redis (fsync always)\ndedup mode: {mode}"
    )
    p50, p99, delays = interval_quantiles(last["delay"], first["delay"])
    worker = last["worker"]
    span = steady[-1].time - steady[0].time
    produced_rate = (steady[-1].produced - steady[0].produced) / span
    print_table(
        ["metric", "measured"],
        [
            ["producer rate achieved", f"{feed.total / production:,.0f} rec/s"],
            ["mean throughput while producing (published + suppressed)",
             f"{samples[-1].resolved / production:,.0f} rec/s"],
            ["mean throughput, steady phase",
             f"{(steady[-1].resolved - steady[0].resolved) / span:,.0f} rec/s "
             f"(produced {produced_rate:,.0f} rec/s)"],
            [f"delay p50, all {delays:,} publications", seconds(p50).strip()],
            [f"delay p99, all {delays:,} publications", seconds(p99).strip()],
            ["records published / suppressed",
             f"{worker['published']:,} / {worker['suppressed']:,}"],
            ["published records counted by the consumer (duplicates)",
             f"{last['consumer']['counted']:,} ({last['consumer']['duplicates']:,})"],
            ["drain after the last record was produced",
             f"{soak.drained - soak.ended:,.0f} s" if drained else "did not finish"],
        ],
    )  # fmt: skip

    # CPU per record says which process limits the rate: two cores give 2 s of CPU a second.
    records = steady[-1].produced - steady[0].produced
    print(f"\nCPU over the steady phase ({span:.0f} s, {records:,} records produced)")
    print_table(
        ["process", "share of a core", "per record produced"],
        [
            [name, f"{used / span:.0%}", f"{1e6 * used / records:,.0f} µs" if records else "—"]
            for name in steady[0].cpu
            if (start := steady[0].cpu[name]) is not None
            and (end := steady[-1].cpu[name]) is not None
            and (used := end - start) >= 0
        ],
    )

    width = args.dedup_window
    bins = steady_bins(samples, half, soak.ended, width)
    aligned = "the dedup windows" if windowed() else "multiples of their width"
    how = f"means of {len(bins)} bins of {width:g} s (aligned to {aligned})"
    if len(bins) < 3:
        # Too few whole windows in the second half: fall back to the samples themselves.
        bins = [[s] for s in steady]
        how = f"{len(bins)} samples every {SAMPLE_EVERY:g} s (fewer than 3 whole bins fit)"

    # Keeping up: a backlog that grows means --rate is above what the processes sustain,
    # and the memory below is then measured under overload. Backlogs move by up to a batch
    # as batches are taken and counted, so growth of one batch is not held against them.
    allowed = max(KEEP_UP * produced_rate * span, config.batch_size) / (span / 60)
    backlogs = [
        trend("worker: produced − ingested", bins, lambda s: s.produced - s.ingested, True),
        trend("consumer: published − counted", bins, lambda s: s.published - s.counted, True),
    ]
    print(
        f"\nBacklogs over the steady phase: least squares through {how}; kept up if growing "
        f"by at most {100 * KEEP_UP:g}% of the records produced or one batch "
        f"({config.batch_size:,}), whichever is more: {allowed:,.0f} a minute"
    )
    print_table(
        ["backlog", "steady start", "steady end", "slope", "kept up"],
        [
            [t.name, f"{t.first:,.0f}", f"{t.last:,.0f}", f"{t.slope:+,.0f} /min",
             "yes" if t.slope <= allowed else "NO"]
            for t in backlogs if t is not None
        ],
    )  # fmt: skip
    kept_up = all(t is not None and t.slope <= allowed for t in backlogs)

    trends = [
        trend("Redis used_memory", bins, lambda s: s.redis_used, judged=True),
        trend("worker RSS", bins, lambda s: s.worker_rss, judged=True),
        trend("consumer RSS", bins, lambda s: s.consumer_rss, judged=True),
        trend("broker RSS (memory storage)", bins, lambda s: s.broker_rss, judged=False),
        trend("Redis server RSS", bins, lambda s: s.redis_rss, judged=False),
    ]
    shown = [t for t in trends if t is not None]
    print(
        f"\nMemory over the steady phase (second half, {production / 120:.1f} min): least "
        f"squares through {how}; flat within ±{100 * FLAT_TOLERANCE:g}% of the level per minute"
    )
    print_table(
        ["memory", "steady start", "steady end", "slope ± s.e.", "of level/min", "per record",
         "flat"],
        [trend_row(t) for t in shown],
    )  # fmt: skip
    if len(soak.key_usages) == 2:
        (start, before), (end, after) = soak.key_usages
        grown = {f: after.get(f, 0) - before.get(f, 0) for f in {*before, *after}}
        print(
            f"\nRedis by key over the steady phase: MEMORY USAGE summed by key family when it "
            f"started and when production ended ({end - start:,} records produced between)"
        )
        print_table(
            ["key family", "at start", "at end", "per record produced"],
            [
                [f, f"{before.get(f, 0) / MB:.1f} MB", f"{after.get(f, 0) / MB:.1f} MB",
                 f"{grown[f] / (end - start):+.1f} B"]
                for f in sorted(grown, key=lambda f: -abs(grown[f]))
                if abs(grown[f]) >= (end - start) / 100
            ],
        )  # fmt: skip
    judged = [t for t in shown if t.judged]
    flat = len(judged) == 3 and all(t.flat for t in judged)
    numbers = "; ".join(f"{t.name} {100 * t.relative:+.2f}%/min" for t in judged)
    print(
        f"\nverdict: {'memory flat' if flat else 'memory NOT flat'} ({numbers}; tolerance "
        f"±{100 * FLAT_TOLERANCE:g}%/min), {mode.split(':')[0]} run"
    )
    vague = [t.name for t in judged if t.error > FLAT_TOLERANCE * t.level]
    if vague:
        print(
            f"  the fit cannot resolve the tolerance for {', '.join(vague)} (standard error "
            "above it): run longer"
        )
    if not kept_up:
        print(
            "  a backlog grew: --rate is above what this machine sustains now, so memory was "
            "measured under overload; lower --rate"
        )
    if not drained:
        print("  the stream did not drain: not every record was published, suppressed and counted")


def run(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    total = round(args.rate * args.minutes * 60)
    with tempfile.TemporaryDirectory(prefix="splu-soak-") as directory:
        work = Path(directory)
        with EmbeddedServers(work / "servers") as servers:
            env = stream_env(servers)
            # This process's own stages load the config and draw with the workers' key.
            os.environ.update(env)
            name = f"soak-{secrets.token_hex(3)}"
            document = stream_document(
                name, servers.kafka_bootstrap, servers.redis_url, args.partitions, args.max_wait
            )
            if windowed():
                document["stream"]["dedup_window"] = args.dedup_window
            path = work / f"{name}.toml"
            path.write_text(tomli_w.dumps(document))
            config = load_config(path)
            mode = (
                f"windowed (stream.dedup_window = {args.dedup_window:g} s)"
                if windowed()
                else "unwindowed (StreamConfig has no dedup_window)"
            )
            log(f"stream {name}: dedup {mode}")
            rows = adult_rows()
            values = [
                json.dumps({n: row[n] for n in config.schema.names}, separators=(",", ":")).encode()
                for row in resample(rows, len(rows), rng)
            ]
            feed = Feed(values, total)
            asyncio.run(create_topics(config.kafka, config.topic_partitions))
            url = f"http://127.0.0.1:{free_port()}"
            processes: dict[str, ManagedProcess] = {}
            try:
                processes["worker"] = spawn_worker(path, env, work / "worker.log")
                processes["consumer"] = spawn_consumer(
                    path, int(url.rsplit(":", 1)[1]), env, work / "consumer.log"
                )
                pids = {
                    "broker": servers.kafka.pid if servers.kafka else None,
                    "redis": servers.redis.pid if servers.redis else None,
                }
                soak = Soak(args, config, url, processes, pids, work)
                print(
                    "elapsed  produced  published  suppressed  pending  pool  backlog "
                    "(produced − ingested)  counted (by the consumer) | throughput over the "
                    "interval  publish delay p50/p99 over the interval | Redis used_memory  "
                    "worker RSS  consumer RSS",
                    flush=True,
                )
                first, last, drained = asyncio.run(soak.run(feed))
            finally:
                for process in reversed(processes.values()):
                    process.stop()
    summary(args, config, soak, first, last, drained, feed)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=(
            "Soak the decoy stream: produce resampled Adult records at a fixed rate for "
            "minutes through a real worker and consumer on embedded servers, print "
            "throughput, publish delay and memory every --interval seconds, and judge "
            "whether memory stays flat over the second half."
        ),
    )
    parser.add_argument(
        "--minutes", type=float, default=10.0,
        help="minutes of production at --rate (default 10; 1 is a quick check)",
    )  # fmt: skip
    parser.add_argument(
        "--rate", type=float, default=DEFAULT_RATE,
        help=f"records/s to produce (default {DEFAULT_RATE:,.0f}, fixed so that soaks compare; "
        f"bench/stream_throughput.py measures a pipeline capacity of ~{CAPACITY:,.0f} "
        "records/s on a 2-core machine; watch the backlog column to see whether the worker "
        "keeps up)",
    )  # fmt: skip
    parser.add_argument(
        "--dedup-window", type=float,
        help="stream.dedup_window in seconds, if this checkout's config has it; also the "
        "width of the bins memory is averaged over (default a tenth of the run, so about "
        "five whole windows fall in the second half, where slopes are fit)",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=float, default=30.0,
        help="seconds between progress lines (default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--partitions", type=int, default=4, help="partitions of every topic (default 4)"
    )
    parser.add_argument(
        "--max-wait", type=float, default=5.0, help="stream max_wait in seconds (default 5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the records (default 0)")
    args = parser.parse_args(argv)
    if min(args.rate, args.interval, args.max_wait) <= 0 or args.partitions < 1:
        parser.error("--rate, --interval, --max-wait and --partitions must be positive")
    if args.minutes < MIN_MINUTES:
        parser.error(f"--minutes must be at least {MIN_MINUTES:g}: the second half is fit")
    if args.dedup_window is None:
        args.dedup_window = args.minutes * 60 / 10
    if args.dedup_window <= 0:
        parser.error("--dedup-window must be positive")
    signal.signal(signal.SIGTERM, interrupt)
    try:
        run(args)
    except KeyboardInterrupt:
        log("\ninterrupted; every process started here has been stopped")
        sys.exit(130)


if __name__ == "__main__":
    main()
