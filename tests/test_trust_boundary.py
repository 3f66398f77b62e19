"""The trust boundary (issue 30; SPEC §3): the web-facing consumer never sees a true value.

A personal stream runs here, and a decoy stream in `tests/test_security.py`, each on a
Redis server of its own, the worker and the consumer as the project's own least-privilege
users (`service.store.buffer.acl_rules`). While records stream in and again once they are
published and the worker's audit has run, every key in Redis is read with the read
command of its type, as the consumer (`observe`, `assert_the_boundary_holds`):

- the consumer reads only counters and gauges, delays, the close, the audit, the pause
  flag and its own counts; every key holding a true value (records, pools, in-flight
  entries, buckets, personal group state, fingerprints, the truth tally, true counts per
  group or per suppressed value) is refused, and such keys did exist;
- it cannot list or count keys: RANDOMKEY, SCAN, KEYS, DBSIZE and INFO are refused;
- the server keeps no log of arguments: no slow log, and on valkey no command log;
- the privacy tests still reach the operator: `/status`, `/metrics` and the report topic
  carry every test's verdict, with no count computed from true values.

CI runs the decoy stream again on Debian's redis-server (`-m redis`), which has a slow log
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from harness import Harness, adult_rows
from redis.exceptions import NoPermissionError, ResponseError
from test_consumer import wait_for

from deploy.embedded import (
    COMMAND_LOG_THRESHOLDS,
    RedisServer,
    free_port,
    service_user_envs,
    spawn_consumer,
    spawn_worker,
)
from service.store.auditor import PUBLISHABLE
from service.store.buffer import BufferState
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

RECORDS = 2500
TIMEOUT = 120.0
# What the consumer may read: counters and gauges, delays, the close, the audit and the
# pause flag, and its own shards.
READABLE = {"stats", "waiting", "delay", "close", "audit", "paused"}
# Keys that hold a true value, by the part after the hash tag.
TRUE_VALUES = {
    "rec", "t", "b", "n", "grp", "hole", "holes", "open", "g", "gq", "gstat", "pool",
    "takes", "handoff", "truth", "sup", "seen", "known", "unsettled", "handled", "screened",
}  # fmt: skip
READ = {
    b"string": ("GET",),
    b"hash": ("HGETALL",),
    b"zset": ("ZRANGE", "0", "-1"),
    b"list": ("LRANGE", "0", "-1"),
    b"set": ("SMEMBERS",),
}
LISTING = (("RANDOMKEY",), ("SCAN", "0"), ("KEYS", "*"), ("DBSIZE",), ("INFO", "keyspace"))
# Numbers a report may not carry: counts computed from true values.
COUNTS_OF_TRUE_VALUES = {
    "small_cells", "small_within", "large_cells", "large_within", "disclosures",
    "groups_disclosing", "records_in_disclosing_groups",
}  # fmt: skip


def kind_of(key: bytes, stream: str) -> str:
    """What a key holds: the part after its hash tag, or "consumer" for the consumer's own
    shards."""
    text = key.decode()
    if text.startswith(f"splu:{{{stream}:consumer:"):
        return "consumer"
    return text.split("}:", 1)[1].split(":", 1)[0]


async def probe(url: str, password: str, stream: str) -> tuple[set[str], set[str], list[str]]:
    """As the consumer: the kinds of key it could read, those it was refused, and the
    listing commands it could run."""
    admin = aioredis.from_url(url)
    consumer = aioredis.from_url(url, username="splu-consumer", password=password)
    readable, refused = set(), set()
    try:
        async for key in admin.scan_iter(match="splu:*", count=1000):
            kind = kind_of(key, stream)
            command = READ.get(await admin.type(key))
            if command is None:
                continue  # expired or deleted meanwhile
            try:
                await consumer.execute_command(command[0], key, *command[1:])
            except NoPermissionError:
                refused.add(kind)
            else:
                readable.add(kind)
        listed = []
        for command in LISTING:
            try:
                await consumer.execute_command(*command)
            except NoPermissionError:
                continue
            listed.append(command[0])
    finally:
        await consumer.aclose()
        await admin.aclose()
    return readable, refused, listed


async def logs_kept(url: str) -> dict[str, str]:
    """The server's thresholds for logging commands with their arguments."""
    admin = aioredis.from_url(url)
    try:
        settings = await admin.config_get("slowlog-log-slower-than")
        for name in COMMAND_LOG_THRESHOLDS:
            with contextlib.suppress(ResponseError):  # a server without a command log
                settings |= await admin.config_get(name)
        return settings
    finally:
        await admin.aclose()


async def ingested(url: str, config) -> int:  # type: ignore[no-untyped-def]
    admin = aioredis.from_url(url)
    try:
        return (await BufferState(admin, config).totals())["ingested"]
    finally:
        await admin.aclose()


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        return json.loads(response.read())


@dataclass
class Observed:
    """What a stream showed of its trust boundary: the consumer's reads mid-stream and at
    the end (readable kinds, refused kinds, listing commands it could run), the server's
    log thresholds, and what reached the operator."""

    during: tuple[set[str], set[str], list[str]]
    after: tuple[set[str], set[str], list[str]]
    logs: dict[str, str]
    status: dict
    metrics: str
    reports: list[dict]


def assert_the_boundary_holds(observed: Observed, config) -> None:  # type: ignore[no-untyped-def]
    """The checks of the module docstring, on a stream's observations."""
    for readable, _, listed in (observed.during, observed.after):
        assert readable <= READABLE | {"consumer"}, readable - READABLE
        assert not readable & TRUE_VALUES
        assert listed == [], f"the consumer could run {listed}"
    # The keys it was refused hold true values, and there were such keys to refuse.
    refused = observed.during[1] | observed.after[1]
    personal = config.personal is not None
    assert {"truth", "known", "pool"} | ({"gstat", "g"} if personal else set()) <= refused
    assert "pool" in observed.during[1]  # probed mid-stream
    assert observed.logs["slowlog-log-slower-than"] == "-1"
    assert all(observed.logs[n] == "-1" for n in COMMAND_LOG_THRESHOLDS if n in observed.logs)

    # Every test's verdict reaches the operator, without counts of true values.
    tests = {t["test"]: t for t in observed.status["tests"]}
    expected = {"adversary"} | ({"budget"} if personal else {"eligibility", "guarantees"})
    expected |= {"dp_audit"} if config.reports.dp_epsilon is not None else set()
    assert set(tests) == expected, set(tests)
    for name, test in tests.items():
        assert test["passed"] in (True, False)
        assert not set(test["numbers"]) & COUNTS_OF_TRUE_VALUES, (name, test["numbers"])
        assert name in PUBLISHABLE
        labels = f'stream="{config.name}",test="{name}"'
        assert f"splu_privacy_test_passed{{{labels}}}" in observed.metrics
    verdicts = [m for m in observed.reports if m.get("kind") == "test"]
    assert {m["test"] for m in verdicts} == expected
    assert not any(set(m["numbers"]) & COUNTS_OF_TRUE_VALUES for m in verdicts)
    assert observed.status["worker"]["redis_memory_bytes"] > 0  # from the worker's audit


async def read_reports(config) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every message of the stream's report topic."""
    consumer = AIOKafkaConsumer(
        config.topics["reports"], bootstrap_servers=config.kafka.bootstrap,
        auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    try:
        out: list[dict] = []
        while batches := await consumer.getmany(timeout_ms=2000):
            out += [json.loads(m.value) for ms in batches.values() for m in ms]
        return out
    finally:
        await consumer.stop()


def observe(config, redis_url: str, password: str, port: int, rows: list, rate: float) -> Observed:  # type: ignore[no-untyped-def]
    """Produce `rows` at `rate`, probe as the consumer once a third is in and once every
    record is published and counted and the worker's audit has run."""
    producer = threading.Thread(
        target=lambda: asyncio.run(produce(config, iter(rows), rate=rate, progress=False))
    )
    producer.start()
    wait_for(
        lambda: asyncio.run(ingested(redis_url, config)) >= len(rows) // 3, "records to arrive"
    )
    during = asyncio.run(probe(redis_url, password, config.name))
    producer.join()
    audited = wait_for(
        lambda: (
            (s := status(port))["worker"]["in_flight"] == s["worker"]["pending"] == 0
            and s["consumer"]["records"] == s["worker"]["published"] > 0
            and any(t["test"] == "adversary" for t in s["tests"])
            and s
        ),
        "everything published, counted and audited",
    )
    after = asyncio.run(probe(redis_url, password, config.name))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        metrics = response.read().decode()
    reports = asyncio.run(read_reports(config))
    return Observed(during, after, asyncio.run(logs_kept(redis_url)), audited, metrics, reports)


@pytest.mark.stream
def test_a_personal_streams_consumer_reads_no_true_value_and_lists_no_key(servers, tmp_path):
    """A personal stream's keys; `tests/test_security.py` checks a decoy stream's, on either
    server."""
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    try:
        harness = Harness(
            servers, tmp_path, "adult-personal.toml", redis_url=redis_server.url,
            row_column=False, reports={"fail_closed": []},
        )  # fmt: skip
        config = harness.config
        asyncio.run(create_topics(config.kafka, config.topic_partitions))
        base = {k: v for k, v in harness.env.items() if k not in ("REDIS_URL", "KAFKA_BOOTSTRAP")}
        envs = service_user_envs(config, base)
        port = free_port()
        worker = spawn_worker(harness.path, envs["worker"], tmp_path / "worker.log")
        consumer = spawn_consumer(harness.path, port, envs["consumer"], tmp_path / "c.log")
        try:
            password = envs["consumer"][config.redis_password_env]
            rows = adult_rows(config)[:RECORDS]
            observed = observe(config, redis_server.url, password, port, rows, rate=500)
        finally:
            consumer.stop()
            worker.stop()
    finally:
        redis_server.stop()
    assert_the_boundary_holds(observed, config)
