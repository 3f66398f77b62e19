"""`splu demo`: the main job on embedded servers, from raw records to reconstructed counts.

Starts the embedded broker and Redis server, a worker (a child process, as in
production) and a producer over the bundled UCI Adult sample, shows live
progress from the buffer's counters, then reads the published topic back and
compares a few large and small reconstructed counts with the truth. Every
process it starts is stopped again, on success, error or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import secrets
import sys
import tempfile
import time
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaConsumer

from deploy.embedded import EmbeddedServers, spawn_worker
from service.buffer import StreamBuffer
from service.config import StreamConfig, load_config
from service.reconstruct import (
    DecoyReconstruction,
    PersonalReconstruction,
    PublishedCells,
    Query,
    Reconstruction,
)
from service.table import open_sample, read_table
from streams.produce import produce
from streams.topics import create_topics

EXAMPLES = {"decoy": "adult-decoy.toml", "personal": "adult-personal.toml"}
# Shorter than production so the tail of the demo stream is not left waiting long.
DEMO_SETTINGS = {"max_wait": 5.0, "flush_interval": 2.0, "partitions": 2}
LARGE = {
    "decoy": [
        ({"sex": "Male"}, "Craft-repair"),
        ({"sex": "Female"}, "Adm-clerical"),
        ({"education": "Bachelors"}, "Prof-specialty"),
        ({"marital_status": "Married-civ-spouse"}, "Exec-managerial"),
    ],
    "personal": [
        ({"sex": "Male"}, ">50K"),
        ({"education": "Bachelors"}, ">50K"),
        ({"sex": "Female"}, "<=50K"),
        ({"occupation": "Exec-managerial"}, ">50K"),
    ],
}
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
    mechanism: str = "decoy", records: int | None = None, rate: float | None = None
) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splu-demo-") as directory:
        work = Path(directory)
        with EmbeddedServers(work / "servers") as servers:
            config_path = _write_config(mechanism, work, servers.kafka_bootstrap, servers.redis_url)
            env = {
                **os.environ,
                "SPLU_SERVICE_KEY": secrets.token_hex(32),
                "KAFKA_BOOTSTRAP": servers.kafka_bootstrap,
                "REDIS_URL": servers.redis_url,
            }
            os.environ.update(
                {k: env[k] for k in ("SPLU_SERVICE_KEY", "KAFKA_BOOTSTRAP", "REDIS_URL")}
            )
            config = load_config(config_path)
            print(
                f"splu demo: {config.mechanism} stream {config.name!r} on embedded servers "
                f"(Kafka {servers.kafka_bootstrap}, Redis {servers.redis_url}), "
                f"{config.partitions} partitions"
            )
            asyncio.run(create_topics(config.kafka_bootstrap, config.topic_partitions))
            worker = spawn_worker(config_path, env, work / "worker.log")
            try:
                truth, published = asyncio.run(_stream(config, records, rate))
            finally:
                worker.stop()
            _summary(config, truth, published)
    print(f"done in {time.monotonic() - started:.0f} s; every process it started has stopped")
    return 0


async def _stream(
    config: StreamConfig, records: int | None, rate: float | None
) -> tuple[PublishedCells, PublishedCells]:
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
    client = aioredis.from_url(config.redis_url)
    buffer = StreamBuffer(client, config, config.service_key())
    print(f"producing {len(messages):,} records to {config.topics['raw']}")
    producing = asyncio.create_task(
        produce(config, iter(messages), len(messages), rate, progress=False)
    )
    deadline = time.monotonic() + TIMEOUT
    totals: dict[str, int] = {}
    live = sys.stdout.isatty()
    shown = 0.0
    print("waiting for the worker to join its consumer group (a few seconds)")
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        totals = await _totals(buffer, config)
        done = totals.get("published", 0) + totals.get("suppressed", 0)
        finished = producing.done() and done >= len(messages)
        if live or finished or time.monotonic() - shown >= 5:
            # On a terminal the line is redrawn in place; in a log, one line every 5 s.
            shown = time.monotonic()
            print(
                f"{chr(13) if live else ''}  in {totals.get('ingested', 0):7,}  "
                f"buffered {totals.get('pending', 0):6,}  "
                f"mixing pool {totals.get('pool', 0):6,}  "
                f"published {totals.get('published', 0):7,}  "
                f"suppressed {totals.get('suppressed', 0):4,}",
                end="" if live else "\n",
                flush=True,
            )
        if finished:
            break
    if live:
        print()
    await producing
    await client.aclose()
    if totals.get("published", 0) + totals.get("suppressed", 0) < len(messages):
        raise RuntimeError(
            f"only {totals} of {len(messages):,} records came through in {TIMEOUT:.0f} s"
        )
    published_rows = await _read_published(config, totals["published"])
    with open_sample() as stream:
        table, _ = read_table(stream, config.schema)
    truth = PublishedCells.from_table(table.take(np.arange(len(messages))))
    return truth, PublishedCells.from_rows(names, published_rows)


async def _totals(buffer: StreamBuffer, config: StreamConfig) -> dict[str, int]:
    totals: dict[str, int] = {}
    for partition in range(config.partitions):
        for name, value in (await buffer.stats(partition)).items():
            totals[name] = totals.get(name, 0) + value
    return totals


async def _read_published(config: StreamConfig, expected: int) -> list[list[str]]:
    """Every published record once: consumers drop re-sent copies by their token."""
    consumer = AIOKafkaConsumer(
        config.topics["published"],
        bootstrap_servers=config.kafka_bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    seen: dict[bytes, list[str]] = {}
    try:
        while len(seen) < expected:
            batches = await consumer.getmany(timeout_ms=1000)
            for messages in batches.values():
                for message in messages:
                    record = json.loads(message.value)
                    seen[message.key] = [record[n] for n in config.schema.names]
    finally:
        await consumer.stop()
    return list(seen.values())


def _summary(config: StreamConfig, truth: PublishedCells, published: PublishedCells) -> None:
    sensitive = config.sensitive[0]
    reconstruction = _reconstruction(config, published)
    exact = DecoyReconstruction(truth, 2, [sensitive])
    queries = [
        Query({c: (v,) for c, v in where.items()}, {sensitive: s})
        for where, s in LARGE[config.mechanism]
    ]
    queries += _small_queries(truth, sensitive, count=4)
    true_counts = [e.published for e in exact.estimate_many(queries)]
    texts = [
        " ∧ ".join(
            [*(f"{c}={v[0]}" for c, v in q.where.items()), f"{sensitive}={q.value[sensitive]}"]
        )
        for q in queries
    ]
    width = max(map(len, texts))
    print(f"\n{'count of':{width}} {'true':>6} {'estimate':>9} {'rel.err':>8}")
    errors: dict[bool, list[float]] = {True: [], False: []}
    for text, estimate, true in zip(
        texts, reconstruction.estimate_many(queries), true_counts, strict=True
    ):
        error = abs(estimate.estimate - true) / true
        errors[true > 10].append(error)
        print(f"{text:{width}} {true:6,} {estimate.estimate:9,.0f} {error:8.0%}")
    print(
        f"\nlarge counts: mean relative error {np.mean(errors[True]):.0%}; "
        f"small counts (1-10): {np.mean(errors[False]):.0%}"
    )


def _reconstruction(config: StreamConfig, published: PublishedCells) -> Reconstruction:
    if config.decoy is not None:
        return DecoyReconstruction(published, config.decoy.gamma, config.sensitive)
    settings = config.personal
    assert settings is not None
    return PersonalReconstruction(
        published, config.sensitive[0], settings.retention, config.schema.sensitive[0].size,
        lam=settings.lam, delta=settings.delta, budget=settings.budget,
        value_map=settings.value_map,
    )  # fmt: skip


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
