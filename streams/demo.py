"""`splu demo`: the main job on embedded servers, from raw records to reconstructed counts.

Starts the embedded broker and Redis server, a worker and a consumer (child
processes, as in production) and a producer over the bundled UCI Adult
sample, and shows live progress. The consumer serves the live page, counts
the published records and runs the privacy tests; at the end the demo asks it
for a few large and small counts and compares them with the truth. Every
process it starts is stopped again, on success, error or Ctrl-C; with
``--serve`` it keeps serving the live page until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import csv
import json
import signal
import sys
import tempfile
import time
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import tomli_w

from deploy.embedded import (
    EmbeddedServers,
    free_port,
    service_user_envs,
    spawn_consumer,
    spawn_worker,
    stream_env,
)
from service import client
from service.buffer import BufferState, connect
from service.config import StreamConfig, load_config
from service.reconstruct import DecoyReconstruction, PublishedCells, Query
from service.table import open_sample, read_table
from streams.produce import produce
from streams.topics import create_topics

EXAMPLES = {"decoy": "adult-decoy.toml", "personal": "adult-personal.toml"}
# Shorter than production so the tail of the demo stream is not left waiting long.
DEMO_SETTINGS = {"max_wait": 5.0, "flush_interval": 2.0, "partitions": 2, "report_interval": 5.0}
TIMEOUT = 120.0  # seconds to wait for every record to be published or suppressed


def _write_config(mechanism: str, work: Path, servers_kafka: str, servers_redis: str) -> Path:
    examples = resources.files("deploy").joinpath("examples")
    document = tomllib.loads(examples.joinpath(EXAMPLES[mechanism]).read_text())
    document["stream"].update(DEMO_SETTINGS)
    document["kafka"]["bootstrap"] = servers_kafka
    document["redis"]["url"] = servers_redis
    if mechanism == "personal":
        merge = document["personal"]["merge_map"]
        (work / merge).write_text(examples.joinpath(merge).read_text())
    path = work / EXAMPLES[mechanism]
    path.write_text(tomli_w.dumps(document))
    return path


def run_demo(
    mechanism: str = "decoy",
    records: int | None = None,
    rate: float | None = None,
    serve: bool = False,
    port: int | None = None,
) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splu-demo-") as directory:
        work = Path(directory)
        with EmbeddedServers(work / "servers") as servers:
            config_path = _write_config(mechanism, work, servers.kafka_bootstrap, servers.redis_url)
            env = stream_env(servers)
            config = load_config(config_path)
            url = f"http://127.0.0.1:{port or free_port()}"
            print(
                f"splu demo: {config.mechanism} stream {config.name!r} on embedded servers "
                f"(Kafka {servers.kafka_bootstrap}, Redis {servers.redis_url}), "
                f"{config.partitions} partitions"
            )
            asyncio.run(create_topics(config.kafka_bootstrap, config.topic_partitions))
            # As in production: each process under its own least-privilege Redis user.
            envs = service_user_envs(config, env)
            worker = spawn_worker(config_path, envs["worker"], work / "worker.log")
            consumer = spawn_consumer(
                config_path, int(url.rsplit(":", 1)[1]), envs["consumer"], work / "consumer.log"
            )
            print(f"live page: {url}/  (counts, privacy tests, delays; it updates itself)")
            try:
                truth = asyncio.run(_stream(config, records, rate, url))
                _summary(config, truth, url)
                if serve:
                    _serve(url)
            finally:
                consumer.stop()
                worker.stop()
    print(f"done in {time.monotonic() - started:.0f} s; every process it started has stopped")
    return 0


def _serve(url: str) -> None:
    print(f"\nserving the live page at {url}/ until Ctrl-C", flush=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM stops it as cleanly as Ctrl-C (and a background job may ignore SIGINT).
    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print()


async def _stream(
    config: StreamConfig, records: int | None, rate: float | None, url: str
) -> PublishedCells:
    """Produce the sample, show progress until every record is accounted for and counted by
    the consumer; the true cells of what was produced."""
    with open_sample() as stream:
        rows = list(csv.DictReader(stream))[:records]
    names = config.schema.names
    messages = [
        (
            f"adult.csv:{line}".encode(),
            json.dumps({n: row[n] for n in names}, separators=(",", ":")).encode(),
        )
        for line, row in enumerate(rows, start=2)
    ]
    redis = connect(config)
    buffer = BufferState(redis, config)
    print(f"producing {len(messages):,} records to {config.topics['raw']}")
    producing = asyncio.create_task(
        produce(config, iter(messages), len(messages), rate, progress=False)
    )
    deadline = time.monotonic() + TIMEOUT
    totals: dict[str, int] = {}
    counted = done = 0
    live = sys.stdout.isatty()
    shown = 0.0
    print("waiting for the worker and consumer to join their groups (a few seconds)")
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        totals = await buffer.totals()
        counted = await _counted(url)
        done = totals.get("settled", 0)
        finished = producing.done() and done >= len(messages)
        finished = finished and counted >= totals.get("published", 0)
        if live or finished or time.monotonic() - shown >= 5:
            # On a terminal the line is redrawn in place; in a log, one line every 5 s.
            shown = time.monotonic()
            print(
                f"{chr(13) if live else ''}  in {totals.get('ingested', 0):7,}  "
                f"buffered {totals.get('pending', 0):6,}  "
                f"mixing pool {totals.get('pool', 0):6,}  "
                f"published {totals.get('published', 0):7,}  "
                f"suppressed {totals.get('suppressed', 0):4,}  "
                f"counted {counted:7,}",
                end="" if live else "\n",
                flush=True,
            )
        if finished:
            break
    if live:
        print()
    await producing
    await redis.aclose()
    if done < len(messages) or counted < totals.get("published", 0):
        raise RuntimeError(
            f"only {totals} of {len(messages):,} records came through and {counted:,} were "
            f"counted in {TIMEOUT:.0f} s"
        )
    if totals.get("below_floor"):
        print(
            f"{totals['below_floor']:,} records stay in mixing pools below their floor of "
            f"{config.mixing_pool:,} per partition: the mixing rule publishes them only "
            "together with later records"
        )
    with open_sample() as stream:
        table, _ = read_table(stream, config.schema)
    return PublishedCells.from_table(table.take(np.arange(len(messages))))


async def _counted(url: str) -> int:
    """Published records the consumer's estimates include; 0 while it starts."""
    try:
        status = await asyncio.to_thread(client.status, url, 2.0)
    except client.ConsumerError:
        return 0
    return int(status["consumer"]["records"])


def _summary(config: StreamConfig, truth: PublishedCells, url: str) -> None:
    """The consumer's answers to the standing queries and a few small counts, against truth."""
    sensitive = config.sensitive[0]
    queries = [Query.from_json(q) for q in config.reports.queries]
    queries += _small_queries(truth, sensitive, count=4)
    true_counts = [
        e.published for e in DecoyReconstruction(truth, 2, [sensitive]).estimate_many(queries)
    ]
    objects = [
        {"where": {c: list(v) for c, v in q.where.items()}, "value": dict(q.value)} for q in queries
    ]
    answers = client.ask(url, objects)
    texts = [
        " ∧ ".join(
            [*(f"{c}={v[0]}" for c, v in q.where.items()), f"{sensitive}={q.value[sensitive]}"]
        )
        for q in queries
    ]
    width = max(map(len, texts))
    print(f"\n{'count of':{width}} {'true':>6} {'estimate':>9} {'rel.err':>8}")
    errors: dict[bool, list[float]] = {True: [], False: []}
    for text, answer, true in zip(texts, answers, true_counts, strict=True):
        error = abs(answer["estimate"] - true) / true
        errors[true > 10].append(error)
        print(f"{text:{width}} {true:6,} {answer['estimate']:9,.0f} {error:8.0%}")
    print(
        f"\nlarge counts: mean relative error {np.mean(errors[True]):.0%}; "
        f"small counts (1-10): {np.mean(errors[False]):.0%}"
    )
    tests = client.status(url)["tests"]
    if tests:
        verdicts = ", ".join(f"{t['test']} {'pass' if t['passed'] else 'FAIL'}" for t in tests)
        print(f"privacy tests (last report): {verdicts}")


def _small_queries(truth: PublishedCells, sensitive: str, count: int) -> list[Query]:
    """Deterministic conjunctions of three public columns whose true count is 1 to 10."""
    public = [c for c in truth.columns if c != sensitive][-3:]
    positions = [truth.columns.index(c) for c in (*public, sensitive)]
    candidates = [
        Query(
            {c: (truth.domains[c][key[i]],) for i, c in enumerate(public)},
            {sensitive: truth.domains[sensitive][key[-1]]},
        )
        for key in np.unique(truth.cells[:, positions], axis=0)
    ]
    exact = DecoyReconstruction(truth, 2, [sensitive]).estimate_many(candidates)
    small = [q for q, e in zip(candidates, exact, strict=True) if 1 <= e.published <= 10]
    step = max(len(small) // count, 1)
    return small[::step][:count]
