"""The whole stream: a real worker process between the embedded broker and Redis server.

Each record carries a unique public `row` so the published topic can be matched
back to the input; decoy groups ignore public values and the personal merge map
puts every row in one class, so `row` changes no grouping.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from harness import RECORDS, TIMEOUT, Harness, adult_rows

from deploy.embedded import RedisServer
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

# Whole stream processes on the embedded servers; run once, not again on Debian's Redis.
pytestmark = pytest.mark.stream

PR_SET_CHILD_SUBREAPER = 36


def bad_messages(good: bytes) -> list[tuple[bytes, bytes]]:
    record = json.loads(good)
    return [
        (b"bad-json", b"{not json"),
        (b"bad-utf8", b"\xff\xfe\xfd"),
        (b"bad-empty", b""),
        (b"bad-list", b"[1,2,3]"),
        (b"bad-unknown", json.dumps({**record, "zip": "02139"}).encode()),
        (b"bad-domain", json.dumps({**record, "sex": "Unknown"}).encode()),
        (b"bad-missing", json.dumps({k: v for k, v in record.items() if k != "row"}).encode()),
        (b"bad-huge", b'{"x": "' + b"y" * 70_000 + b'"}'),
    ]


@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_stream_end_to_end_with_kills_and_replay(servers, tmp_path, example):
    harness = Harness(servers, tmp_path, example)
    config = harness.config
    asyncio.run(create_topics(config.kafka, dict.fromkeys(config.topics.values(), 2)))
    rows = adult_rows(config)
    bad = bad_messages(rows[0][1])
    conflicts = [(key, rows[(i + 1) % 100][1]) for i, (key, _) in enumerate(rows[:10])]
    repeats = rows[100:150]
    harness.start_worker()
    snapshots: dict[str, str] = {}

    async def run_stream() -> dict[str, int]:
        client = aioredis.from_url(config.redis_url)
        producing = asyncio.create_task(
            produce(config, iter(rows + bad + conflicts + repeats), rate=8000, progress=False)
        )
        kills = [0.3 * RECORDS, 0.7 * RECORDS]
        deadline = time.monotonic() + TIMEOUT
        totals: dict[str, int] = {}
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            totals = await harness.totals(client)
            if kills and totals.get("ingested", 0) >= kills[0]:
                kills.pop(0)
                harness.worker.kill()
                snapshots.update(await harness.waiting(client))
                harness.start_worker()
            done = totals.get("settled", 0)
            if producing.done() and not kills and done == RECORDS and totals["in_flight"] == 0:
                break
        await producing
        await client.aclose()
        return totals

    try:
        totals = asyncio.run(run_stream())
        published = asyncio.run(harness.read(config.topics["published"], totals["published"]))
        expected_rejections = len(bad) + len(conflicts)
        rejected = asyncio.run(
            harness.read(
                config.topics["rejected"], expected_rejections,
                key=lambda m: (json.loads(m.value)["partition"], json.loads(m.value)["offset"]),
            )
        )  # fmt: skip

        # Every accepted record is published once or suppressed; counts add up exactly.
        assert totals["ingested"] == RECORDS, totals
        assert totals["settled"] == RECORDS
        assert len(published) == totals["published"]  # distinct tokens
        records = [json.loads(v) for v in published.values()]
        by_row = {r["row"]: r for r in records}
        assert len(by_row) == len(records)  # no record under two tokens
        assert totals["conflicts"] == len(conflicts) and totals["redelivered"] >= len(repeats)
        assert len(rejected) == expected_rejections

        # Nothing but the schema's attributes, values from their domains, tokens only as keys.
        names = set(config.schema.names)
        assert all(set(r) == names for r in records)
        for attribute in config.schema.attributes:
            assert {r[attribute.name] for r in records} <= set(attribute.domain)
        assert all(len(token) == 32 and int(token, 16) >= 0 for token in published)

        # A record waiting when the worker was killed kept its randomized value.
        assert snapshots, "the kills should find records in the pool"
        for row, codes in snapshots.items():
            if row in by_row:
                sensitive = [a for a in config.schema.attributes if a.sensitive]
                values = [
                    a.domain[int(c)] for a, c in zip(sensitive, codes.split(","), strict=True)
                ]
                assert [by_row[row][a.name] for a in sensitive] == values

        # A replayed raw stream publishes nothing new.
        asyncio.run(produce(config, iter(rows), progress=False))

        async def replayed() -> dict[str, int]:
            client = aioredis.from_url(config.redis_url)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                again = await harness.totals(client)
                if again["redelivered"] >= totals["redelivered"] + RECORDS:
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.5)  # longer than flush_interval: anything new would be out
            again = await harness.totals(client)
            await client.aclose()
            return again

        again = asyncio.run(replayed())
        assert again["redelivered"] == totals["redelivered"] + RECORDS
        assert again["ingested"] == totals["ingested"] and again["published"] == totals["published"]
        assert again["settled"] == totals["settled"] and again["pool"] == totals["pool"]
    finally:
        harness.worker.stop()


@pytest.mark.redis
def test_a_redis_outage_loses_nothing(servers, tmp_path):
    """Redis dies mid-stream and comes back from its append-only file: the worker waits,
    commits no offset for a batch Redis does not hold, and every record arrives."""
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    harness = Harness(servers, tmp_path, "adult-decoy.toml", redis_url=redis_server.url)
    config = harness.config
    asyncio.run(create_topics(config.kafka, dict.fromkeys(config.topics.values(), 2)))
    rows = adult_rows(config)
    harness.start_worker()

    async def run_stream() -> dict[str, int]:
        producing = asyncio.create_task(produce(config, iter(rows), rate=4000, progress=False))
        client = aioredis.from_url(config.redis_url)
        deadline = time.monotonic() + TIMEOUT
        outage_done = False
        totals: dict[str, int] = {}
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            if not outage_done and redis_server.running:
                totals = await harness.totals(client)
                if totals.get("ingested", 0) >= RECORDS // 4:
                    redis_server.kill()
                    await asyncio.sleep(3)  # the worker keeps consuming into retries
                    redis_server.start()
                    await client.aclose()
                    client = aioredis.from_url(config.redis_url)
                    outage_done = True
                continue
            totals = await harness.totals(client)
            done = totals.get("settled", 0)
            if producing.done() and done == RECORDS and totals["in_flight"] == 0:
                break
        await producing
        await client.aclose()
        return totals

    try:
        totals = asyncio.run(run_stream())
        assert harness.worker.running, "the worker rides out the outage"
        assert totals["ingested"] == RECORDS, totals
        assert totals["settled"] == RECORDS
        published = asyncio.run(harness.read(config.topics["published"], totals["published"]))
        rows_published = {json.loads(v)["row"] for v in published.values()}
        assert len(rows_published) == len(published) == totals["published"]
    finally:
        harness.worker.stop()
        redis_server.stop()


def children() -> set[int]:
    """Live processes whose parent is this one."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[1]) == os.getpid():
                found.add(int(entry.name))
    return found


def test_demo_runs_and_leaves_nothing_behind():
    # As a subreaper, this process inherits whatever the demo leaves running: it would
    # show up here as a new child instead of vanishing under init.
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    before = children()
    result = subprocess.run(
        [sys.executable, "-m", "streams.cli", "demo", "--records", "5000"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # The summary says what its numbers mean: large counts accurate, small ones noisy.
    large = r"Large counts \(over 10\): off by \d+% on average; the truth lies inside"
    assert re.search(large, result.stdout), result.stdout
    assert "That noise is the privacy." in result.stdout
    assert "every process it started has stopped" in result.stdout
    deadline = time.monotonic() + 5
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children() - before == set()
