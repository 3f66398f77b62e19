"""Query latency: the consumer's GET /estimate against in-process reconstruction, same cells.

One run, fixed seeds, on the embedded servers (``deploy.embedded``: the tansu
broker and a Redis-protocol server with ``appendfsync always``):

- **records**: --records records resampled with replacement (seed --seed) from
  the bundled UCI Adult sample, encoded with the schema of
  ``deploy/examples/adult-decoy.toml`` (public: age, sex, race, marital_status,
  education; sensitive: occupation), published in one batch by
  ``DecoyGroups(γ).publish(table, ids, key)`` with γ and grouping from that
  config and ``ServiceKey.from_seed(--seed)``.
- **counting**: a copy of the config under a fresh stream name (--partitions
  partitions, report_interval 3600 s so no privacy report runs meanwhile) is
  pointed at the servers; its topics are created and every published record is
  produced straight to ``<stream>.published``, as the worker would send it: a
  JSON object of exactly the schema's attributes, keyed by a fresh random
  32-hex token, in batches (``create_batch``/``send_batch``, idempotence off).
  Then ``splu consumer`` starts (``spawn_consumer``; it needs no service key).
  Counting throughput is N / (Redis counter reaching N − last poll, every
  50 ms, before it showed a first record), so the group join is left out; the
  wait until ``/status`` reports all N records (estimates include them) is
  shown too. The consumer's cells, read back from its Redis tally, must equal
  the published table's cells.
- **queries**: --queries queries (seed --seed), a quarter each with 0
  (sensitive-only), 1, 2 and 3 public columns ∧ one occupation value. Public
  values come from a random published record, so the predicate is never
  empty; a public column lists 2–3 values ("any of") with probability
  --list-share. After --warmup untimed queries, each query is timed twice, side
  by side: ``GET /estimate?where=...&value=...`` end to end over one
  persistent HTTP/1.1 keep-alive connection (``http.client``; from sending the
  request to the last byte of the answer; --new-connection opens a connection
  per query instead), then ``reconstruction.estimate(Query)`` in this process
  on the same cells (``StreamConfig.reconstruction`` of the consumer's tally, the
  object the consumer itself builds). Every HTTP answer must equal the
  in-process one (estimate, low and high to 3 decimals, published, rows).
- Labels that hold commas (the age bins, "[17,25)") are asked for by GET like
  any other: a comma starts a new pair only before ``column:``.

Target: HTTP p99 ≤ 50 ms. The exit status is 1 if it is missed, if any answer
differs from the in-process one, or if the consumer's cells differ from the
published ones. Progress goes to stderr, results to stdout. The servers and
the consumer started here are stopped on success, error or Ctrl-C.

Run from the repository root:

    .venv/bin/python bench/query_latency.py
    .venv/bin/python bench/query_latency.py --records 50000 --queries 200   # < 1 min
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import secrets
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
import tomli_w
from aiokafka import AIOKafkaProducer
from aiokafka.producer.message_accumulator import BatchBuilder
from report import Result, log, log_tail, print_table, status

from deploy.embedded import EmbeddedServers, ManagedProcess, free_port, spawn_consumer
from service.cli import client
from service.core.config import StreamConfig, load_config
from service.core.mechanisms.decoy import DecoyGroups
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction
from service.core.table import Table, open_sample, read_table
from service.store.buffer import connect
from service.store.running_counts import RunningCounts
from streams.runtime.kafka import client_options
from streams.runtime.topics import create_topics

EXAMPLE = "adult-decoy.toml"
HOST = "127.0.0.1"
P99_TARGET = 0.050  # seconds, HTTP p99
REPORT_INTERVAL = 3600.0  # seconds: no privacy report while the benchmark runs
FIRST_POLL = 0.05  # seconds between Redis polls until the first record is counted
POLL = 0.25  # seconds between progress polls afterwards
POLL_TIMEOUT = 10.0  # seconds for one poll of the consumer's Redis counter
READY_TIMEOUT = 60.0  # seconds for the consumer to join and for its first refresh
SLOWEST_RATE = 1000.0  # records/s below which counting is taken as stuck
SEND_WINDOW = 20_000  # records sent before waiting for the broker's acks
HTTP_TIMEOUT = 10.0  # seconds per request
COMPARED = ("estimate", "low", "high", "published", "rows")
SHOWN_MISMATCHES = 5
REBUILDS = 3  # timed rebuilds of the consumer's reconstruction; the median is shown


@dataclass(frozen=True)
class Counting:
    records: int
    seconds: float  # first record counted (to FIRST_POLL) to the last, in Redis
    ready: float  # consumer start to /status showing every record

    @property
    def throughput(self) -> float:
        return self.records / self.seconds


@dataclass(frozen=True)
class Timings:
    http: np.ndarray  # seconds per query
    local: np.ndarray
    mismatches: list[str]


@dataclass(frozen=True)
class Measured:
    config: StreamConfig
    counting: Counting
    cells: PublishedCells  # the consumer's, from its Redis tally
    cells_match: bool  # equal to the published table's cells
    rebuild: float  # seconds: tally -> cells -> reconstruction, as the consumer refreshes
    view: dict[str, Any]  # the consumer part of /status after the queries
    columns: list[str]  # public columns of the workload
    queries: list[Query]
    timings: Timings


def write_config(work: Path, name: str, kafka: str, redis: str, partitions: int) -> StreamConfig:
    """The decoy example under a fresh stream name, pointed at the servers, as `splu demo`."""
    examples = resources.files("deploy").joinpath("examples")
    document = tomllib.loads(examples.joinpath(EXAMPLE).read_text())
    document["stream"].update(name=name, partitions=partitions, report_interval=REPORT_INTERVAL)
    document["kafka"]["bootstrap"] = kafka
    document["redis"]["url"] = redis
    path = work / f"{name}.toml"
    path.write_text(tomli_w.dumps(document))
    return load_config(path)


def published_table(config: StreamConfig, records: int, seed: int) -> Table:
    """Resampled Adult in the stream's schema, published by batch decoy groups."""
    assert config.decoy is not None
    with open_sample() as stream:
        sample, rejected = read_table(stream, config.schema)
    if rejected:
        log(f"  {len(rejected):,} sample rows do not fit the schema and are left out")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(sample), records)
    table = Table(config.schema, {k: v[picks] for k, v in sample.codes.items()})
    key = ServiceKey.from_seed(seed)
    mechanism = DecoyGroups(config.decoy.gamma, config.decoy.grouping)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    dropped = records - len(release.published)
    if dropped:
        log(f"  {dropped:,} records suppressed or trimmed; {len(release.published):,} published")
    return release.published


def published_values(table: Table) -> list[bytes]:
    """Each row as the worker publishes it: compact JSON of the schema's attributes, in order."""
    fragments = [
        [json.dumps({a.name: label})[1:-1].encode() for label in a.domain]
        for a in table.schema.attributes
    ]
    columns = [table.codes[a.name].tolist() for a in table.schema.attributes]
    return [
        b"{%s}" % b",".join(f[c] for f, c in zip(fragments, row, strict=True))
        for row in zip(*columns, strict=True)
    ]


async def produce_published(config: StreamConfig, values: list[bytes]) -> None:
    """Send every value to <stream>.published round-robin, in batches, each under a new token."""
    topic = config.topics["published"]
    producer = AIOKafkaProducer(
        **client_options(config.kafka),
        enable_idempotence=False,
        acks="all",
        linger_ms=5,
        max_batch_size=512 * 1024,
    )
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(topic))
        batches: dict[int, BatchBuilder] = {}
        futures: list[asyncio.Future] = []
        for sent, value in enumerate(values, start=1):
            partition = partitions[sent % len(partitions)]
            token = secrets.token_hex(16).encode()
            batch = batches.get(partition)
            if batch is None or batch.append(key=token, value=value, timestamp=None) is None:
                if batch is not None:
                    futures.append(await producer.send_batch(batch, topic, partition=partition))
                batch = batches[partition] = producer.create_batch()
                batch.append(key=token, value=value, timestamp=None)
            if sent % SEND_WINDOW == 0:
                await asyncio.gather(*futures)
                futures.clear()
                status(f"{topic}: {sent:9,} of {len(values):,} sent")
        for partition, batch in batches.items():
            futures.append(await producer.send_batch(batch, topic, partition=partition))
        await asyncio.gather(*futures)
        status(f"{topic}: {len(values):9,} of {len(values):,} sent", last=True)
    finally:
        await producer.stop()


def consumer_records(url: str) -> dict[str, Any] | None:
    """The consumer part of /status, or None while the consumer starts."""
    try:
        return client.status(url, timeout=2.0)["consumer"]
    except client.ConsumerError:
        return None


async def wait_counted(
    config: StreamConfig, url: str, records: int, consumer: ManagedProcess, log_path: Path
) -> Counting:
    """Follow the consumer's Redis counter until every record is counted, then /status until
    its estimates include them all. /status is not polled while counting: it costs the
    consumer several Redis round trips."""
    started = time.monotonic()
    deadline = started + READY_TIMEOUT + records / SLOWEST_RATE
    redis = connect(config)
    counts = RunningCounts(redis, config)
    first = last_poll = finished = None
    counted = included = 0

    def check(now: float) -> None:
        if not consumer.running:
            raise SystemExit(f"\nthe consumer exited; end of its log:\n{log_tail(log_path)}")
        if now > deadline:
            raise SystemExit(
                f"\n{counted:,} of {records:,} records counted, {included:,} in estimates after "
                f"{now - started:.0f} s; end of the consumer's log:\n{log_tail(log_path)}"
            )

    try:
        while finished is None:
            now = time.monotonic()
            try:
                # Bounded, so that a Redis that stops answering meets the deadline below.
                stats = await asyncio.wait_for(counts.stats(), POLL_TIMEOUT)
                counted = stats.get("records", 0)
            except TimeoutError:
                log(f"  Redis did not answer a poll within {POLL_TIMEOUT:g} s")
            if first is None and counted > 0:
                first = last_poll or now
            last_poll = now
            if counted >= records:
                finished = now
            status(
                f"counted in Redis {counted:9,} of {records:,}   {now - started:5.1f} s",
                last=finished is not None,
            )
            check(now)
            if finished is None:
                await asyncio.sleep(FIRST_POLL if first is None else POLL)
    finally:
        await redis.aclose()
    while True:
        view = await asyncio.to_thread(consumer_records, url)
        included = view["records"] if view is not None else 0
        if included >= records:
            break
        check(time.monotonic())
        await asyncio.sleep(POLL)
    assert first is not None
    if included != records or counted != records:
        raise SystemExit(
            f"expected {records:,} records, the consumer counted {counted:,} ({included:,} in "
            "its estimates)"
        )
    return Counting(records, finished - first, time.monotonic() - started)


async def consumer_cells(config: StreamConfig) -> tuple[PublishedCells, float]:
    """The consumer's cells as it rebuilds them (its Redis tally through the cell codec), and
    the median time of the whole rebuild it runs on new counts (tally, cells, reconstruction)."""
    redis = connect(config)
    counts = RunningCounts(redis, config)
    times = []
    try:
        for _ in range(REBUILDS):
            started = time.perf_counter()
            cells = counts.codec.cells(await counts.tally())
            config.reconstruction(cells)
            times.append(time.perf_counter() - started)
    finally:
        await redis.aclose()
    return cells, float(np.median(times))


def cell_counts(cells: PublishedCells) -> dict[tuple[int, ...], int]:
    return {tuple(row): int(n) for row, n in zip(cells.cells.tolist(), cells.counts, strict=True)}


def random_queries(
    table: Table, columns: list[str], count: int, list_share: float, rng: np.random.Generator
) -> list[Query]:
    """A quarter each with 0, 1, 2 and 3 public columns, valued as in a random record
    (sometimes with other values as alternatives), ∧ a uniform value of the sensitive column."""
    sensitive = table.schema.sensitive[0]
    sizes = rng.permutation(np.arange(count) % 4)
    queries = []
    for size in sizes:
        record = rng.integers(len(table))
        where = {}
        for column in map(str, rng.choice(columns, size=min(size, len(columns)), replace=False)):
            domain = table.schema[column].domain
            own = domain[table.codes[column][record]]
            labels = [own]
            if len(domain) > 1 and rng.random() < list_share:
                others = [label for label in domain if label != own]
                extra = rng.choice(others, size=min(len(others), rng.integers(1, 3)), replace=False)
                labels += [str(label) for label in extra]
            where[column] = tuple(labels)
        value = {sensitive.name: sensitive.domain[rng.integers(sensitive.size)]}
        queries.append(Query(where, value))
    return queries


def query_path(query: Query) -> str:
    """GET /estimate for a query; a column named twice in `where` means any of its values."""
    parameters = []
    if query.where:
        pairs = [f"{c}:{label}" for c, labels in query.where.items() for label in labels]
        parameters.append(("where", ",".join(pairs)))
    if query.value:
        parameters.append(("value", ",".join(f"{c}:{v}" for c, v in query.value.items())))
    return "/estimate?" + urlencode(parameters)


class Http:
    """GET requests over one keep-alive connection, or a new connection per request."""

    def __init__(self, port: int, keep_alive: bool) -> None:
        self.port = port
        self.keep_alive = keep_alive
        self.connection: http.client.HTTPConnection | None = None

    def get(self, path: str) -> tuple[float, int, bytes]:
        """(seconds from sending the request to the answer's last byte, status, body)."""
        started = time.perf_counter()
        if self.connection is None:
            self.connection = http.client.HTTPConnection(HOST, self.port, timeout=HTTP_TIMEOUT)
        self.connection.request("GET", path)
        response = self.connection.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - started
        if not self.keep_alive or response.will_close:
            self.close()
        return elapsed, response.status, body

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def expected_answer(estimate: Estimate) -> dict[str, Any]:
    return {**estimate.answer(), "published": estimate.published, "rows": estimate.predicate_rows}


def time_queries(
    http: Http, reconstruction: Reconstruction, queries: list[Query], warmup: list[Query]
) -> Timings:
    """Each query over HTTP, then in process; HTTP answers checked against in-process ones."""
    for query in warmup:
        http.get(query_path(query))
        reconstruction.estimate(query)
    http_seconds, local_seconds, mismatches = [], [], []
    for i, query in enumerate(queries, start=1):
        path = query_path(query)
        elapsed, code, body = http.get(path)
        http_seconds.append(elapsed)
        started = time.perf_counter()
        estimate = reconstruction.estimate(query)
        local_seconds.append(time.perf_counter() - started)
        expected = expected_answer(estimate)
        answer = json.loads(body) if body else {}
        got = {k: answer[k] for k in COMPARED if k in answer}
        if code != 200 or got != expected:
            mismatches.append(f"GET {path} -> {code} {body.decode(errors='replace')}; "
                              f"in process {expected}")  # fmt: skip
        if i % 100 == 0 or i == len(queries):
            status(
                f"{i:5,} of {len(queries):,} queries, {len(mismatches)} answers differ",
                last=i == len(queries),
            )
    return Timings(np.array(http_seconds), np.array(local_seconds), mismatches)


def latency_rows(name: str, seconds: np.ndarray, target: float | None) -> list[Result]:
    p50, p99 = np.percentile(seconds, [50, 99])
    return [
        Result(f"{name} p50", p50 * 1e3, "ms", ".3f"),
        Result(f"{name} p99", p99 * 1e3, "ms", ".3f", None if target is None else target * 1e3),
        Result(f"{name} max", seconds.max() * 1e3, "ms", ".3f"),
    ]


def run(args: argparse.Namespace) -> Measured:
    name = f"bench-query-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="splu-bench-") as directory:
        work = Path(directory)
        with EmbeddedServers(work / "servers") as servers:
            config = write_config(
                work, name, servers.kafka_bootstrap, servers.redis_url, args.partitions
            )
            assert config.decoy is not None
            log(
                f"resampling {args.records:,} records from the bundled Adult sample "
                f"(seed {args.seed}); batch decoy groups, γ={config.decoy.gamma}"
            )
            table = published_table(config, args.records, args.seed)
            truth = PublishedCells.from_table(table)
            values = published_values(table)
            log(f"stream {name!r}: creating topics, {config.partitions} partitions")
            asyncio.run(create_topics(config.kafka, config.topic_partitions))
            produce_started = time.monotonic()
            asyncio.run(produce_published(config, values))
            log(f"  produced in {time.monotonic() - produce_started:.1f} s")

            env = {
                **os.environ,
                "KAFKA_BOOTSTRAP": servers.kafka_bootstrap,
                "REDIS_URL": servers.redis_url,
            }
            port = free_port()
            url = f"http://{HOST}:{port}"
            log_path = work / "consumer.log"
            log(f"starting the consumer at {url} and waiting for it to count every record")
            consumer = spawn_consumer(config.source, port, env, log_path)
            http = Http(port, keep_alive=not args.new_connection)
            try:
                counting = asyncio.run(wait_counted(config, url, len(table), consumer, log_path))
                log(f"  counted at {counting.throughput:,.0f} records/s")
                cells, rebuild = asyncio.run(consumer_cells(config))
                reconstruction = config.reconstruction(cells)

                columns = [a.name for a in config.schema.public]
                rng = np.random.default_rng(args.seed)
                queries = random_queries(table, columns, args.queries, args.list_share, rng)
                warmup = random_queries(table, columns, args.warmup, args.list_share, rng)
                log(f"{args.queries:,} queries over HTTP and in process, after "
                    f"{args.warmup} warm-up queries")  # fmt: skip
                timings = time_queries(http, reconstruction, queries, warmup)
                view = consumer_records(url) or {}
            finally:
                http.close()
                consumer.stop()
    return Measured(
        config, counting, cells, cell_counts(cells) == cell_counts(truth), rebuild, view,
        columns, queries, timings,
    )  # fmt: skip


def summary(args: argparse.Namespace, run: Measured, elapsed: float) -> int:
    """Print what was measured and how; the exit status."""
    config, counting, queries, timings = run.config, run.counting, run.queries, run.timings
    assert config.decoy is not None
    sizes = np.bincount([len(q.where) for q in queries], minlength=4)
    lists = sum(any(len(v) > 1 for v in q.where.values()) for q in queries)
    connection = (
        "a new connection per query (http.client)"
        if args.new_connection
        else "one persistent keep-alive connection (http.client, HTTP/1.1)"
    )
    print(
        f"Query latency: {counting.records:,} records resampled from UCI Adult (seed {args.seed}), "
        f"published by batch decoy groups γ={config.decoy.gamma}, produced to "
        f"{config.topics['published']} ({config.partitions} partitions), embedded tansu broker "
        f"and Redis (fsync always)"
    )
    print(
        f"consumer: counted {counting.records:,} records in {counting.seconds:.1f} s "
        f"(first to last record counted in Redis, group join excluded); every record in its "
        f"estimates {counting.ready:.1f} s after it started; {len(run.cells.counts):,} distinct "
        f"cells, {run.view.get('duplicates', '?')} duplicates, {run.view.get('invalid', '?')} "
        f"invalid; cells {'equal' if run.cells_match else 'DIFFER from'} the published table's"
    )
    print(
        f"workload: {len(queries):,} queries (seed {args.seed}): {sizes[0]} sensitive-only, "
        f"{sizes[1]} / {sizes[2]} / {sizes[3]} with 1 / 2 / 3 public columns ({lists} with a "
        f"list of values), public columns {', '.join(run.columns)}; {args.warmup} warm-up "
        f"queries first"
    )
    print(
        f"HTTP: GET /estimate over {connection}, from sending the request to the answer's "
        f"last byte; in process: reconstruction.estimate(Query) on the consumer's cells "
        f"(StreamConfig.reconstruction of its Redis tally)"
    )
    equal = len(queries) - len(timings.mismatches)
    print(
        f"answers: {equal:,} of {len(queries):,} HTTP answers equal the in-process ones "
        f"({', '.join(COMPARED)}; estimates to 3 decimals)"
    )
    print(f"run time {elapsed:.0f} s\n")

    http_p50 = float(np.percentile(timings.http, 50))
    local_p50 = float(np.percentile(timings.local, 50))
    results = [
        Result("records", counting.records, ""),
        Result("distinct cells", len(run.cells.counts), ""),
        *latency_rows("HTTP GET /estimate", timings.http, P99_TARGET),
        *latency_rows("in-process estimate()", timings.local, None),
        Result("HTTP / in-process at p50", http_p50 / local_p50, "×", ".1f"),
        Result("answers equal to in-process", equal, "", ",.0f", len(queries), True),
        Result("consumer counting", counting.throughput, "rec/s"),
        Result("consumer rebuild on new counts (in process)", run.rebuild * 1e3, "ms", ".1f"),
    ]
    print_table(
        ["metric", "measured", "target", "measured/target", "pass"], [r.cells() for r in results]
    )
    print("\nby query shape (latency in ms)")
    shapes = np.array([len(q.where) for q in queries])
    rows = []
    for size in range(4):
        chosen = shapes == size
        if chosen.any():
            figures = [
                np.percentile(t[chosen], [50, 99]) * 1e3 for t in (timings.http, timings.local)
            ]
            rows.append(
                [
                    "sensitive only" if size == 0 else f"{size} public column{'s' * (size > 1)}",
                    f"{chosen.sum():,}",
                    *(f"{x:.3f}" for pair in figures for x in pair),
                ]
            )
    print_table(
        ["shape", "queries", "HTTP p50", "HTTP p99", "in-process p50", "in-process p99"], rows
    )
    missed = [r.metric for r in results if r.target is not None and not r.met()]
    if not run.cells_match:
        missed.append("consumer cells equal to the published table's")
    print(f"\n{'targets missed: ' + '; '.join(missed) if missed else 'all targets met'}")
    for mismatch in timings.mismatches[:SHOWN_MISMATCHES]:
        log(f"answer differs: {mismatch}")
    if len(timings.mismatches) > SHOWN_MISMATCHES:
        log(f"... and {len(timings.mismatches) - SHOWN_MISMATCHES} more")
    return 1 if missed else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(
            "p50/p99 latency of a running consumer's GET /estimate over published records, "
            "side by side with in-process reconstruction on the same cells, on embedded "
            "servers (target: HTTP p99 ≤ 50 ms). Exits 1 if the target is missed or any "
            "HTTP answer differs from the in-process one."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "how it measures:\n"
            "  records are resampled from the bundled Adult sample, published in one batch by\n"
            "  decoy groups (γ from deploy/examples/adult-decoy.toml), produced straight to\n"
            "  <stream>.published and counted by `splu consumer`; each query is then timed over\n"
            "  HTTP (http.client, one keep-alive connection, request sent to last byte read)\n"
            "  and in process (reconstruction.estimate on the consumer's own cells), and the\n"
            "  answers must agree. Queries: a quarter each sensitive-only and with 1, 2, 3\n"
            "  public columns. Progress on stderr, results on stdout.\n\n"
            "examples:\n"
            "  .venv/bin/python bench/query_latency.py                       # about 2-4 min\n"
            "  .venv/bin/python bench/query_latency.py --records 50000 --queries 200\n"
            "  .venv/bin/python bench/query_latency.py --new-connection      # TCP setup per query"
        ),
    )
    parser.add_argument(
        "--records",
        type=int,
        default=500_000,
        help="records resampled from Adult, published and counted (default 500000)",
    )
    parser.add_argument("--queries", type=int, default=1000, help="timed queries (default 1000)")
    parser.add_argument(
        "--warmup", type=int, default=50, help="untimed queries sent first (default 50)"
    )
    parser.add_argument(
        "--list-share",
        type=float,
        default=0.25,
        help="chance that a public column of a query lists 2-3 values instead of one "
        "(default 0.25)",
    )
    parser.add_argument(
        "--partitions", type=int, default=2, help="partitions of the stream's topics (default 2)"
    )
    parser.add_argument(
        "--new-connection",
        action="store_true",
        help="open a new HTTP connection per query instead of one keep-alive connection "
        "(adds the TCP handshake to every query)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of records, service key and queries (default 0)"
    )
    args = parser.parse_args()
    if min(args.records, args.queries, args.partitions) < 1 or args.warmup < 0:
        parser.error("--records, --queries and --partitions must be positive, --warmup ≥ 0")
    if not 0 <= args.list_share <= 1:
        parser.error("--list-share must lie in [0, 1]")
    started = time.monotonic()
    try:
        measured = run(args)
    except KeyboardInterrupt:
        log("\ninterrupted; the consumer and servers were stopped")
        sys.exit(130)
    sys.exit(summary(args, measured, time.monotonic() - started))


if __name__ == "__main__":
    main()
