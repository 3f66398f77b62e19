"""Operators start things in any order: `splu produce` before any worker exists.

The broker would create `<stream>.raw` with its default partition count (4 on tansu)
the first time a producer asks for its metadata, and the worker would then refuse the
topic. `splu produce` creates the raw topic first, with the config's count (2 here), so a
worker started afterwards takes the records and publishes them; it creates no other topic
(a producer's principal may reach only `<stream>.raw`: `streams.runtime.kafka.topic_grants`).
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import subprocess
import sys
import time

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from harness import Harness

from service.core.table import open_sample

pytestmark = pytest.mark.stream

RECORDS = 2000  # four times the harness's mixing floor of 500 per partition
TIMEOUT = 90.0


async def partition_counts(bootstrap: str, topics: list[str]) -> dict[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics()
    finally:
        await admin.close()
    return {t["topic"]: len(t["partitions"]) for t in described if t["topic"] in topics}


def test_produce_before_the_worker_exists_and_the_stream_still_works(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    config = harness.config
    source = tmp_path / "survey.csv"
    with open_sample() as stream, source.open("w", newline="") as out:
        reader = csv.DictReader(stream)
        writer = csv.DictWriter(out, fieldnames=reader.fieldnames)
        writer.writeheader()
        writer.writerows(itertools.islice(reader, RECORDS))

    produced = subprocess.run(
        [sys.executable, "-m", "streams.cli", "produce", "--config", str(harness.path),
         "--input", str(source)],
        env=harness.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr
    topics = list(config.topic_partitions)
    counts = asyncio.run(partition_counts(config.kafka.bootstrap, topics))
    assert counts == {config.topics["raw"]: config.partitions}, counts

    async def settled() -> dict[str, int] | None:
        client = aioredis.from_url(config.redis_url)
        totals = await harness.totals(client)
        await client.aclose()
        return totals if totals.get("settled", 0) == RECORDS else None

    harness.start_worker()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (totals := asyncio.run(settled())) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        harness.stop()
    assert totals, "the worker never took the records produced before it started"
    assert totals["ingested"] == RECORDS and totals.get("published", 0) > 0, totals
