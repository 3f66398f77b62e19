"""Secrets, least privilege and what stays behind (issue 6, item 5).

One decoy stream runs on its own Redis server, the worker and the consumer each
as a restricted ACL user (`service.store.buffer.acl_rules`), with log level info and
a sensitive domain of unique marker labels. Mid-stream and at its end the consumer
tries every key, as `tests/test_trust_boundary.py` does for a personal stream
(`assert_the_boundary_holds`). Then:

- both processes did their work with those users, and the users cannot run
  anything else (KEYS, FLUSHALL, CONFIG) or touch another stream's keys;
- no marker, neither a valid label nor the out-of-domain values of bad
  records, appears in either log;
- the published topic carries only the schema's attributes under a token key,
  no headers;
- the consumer (the web-facing process) cannot read a record, a pool or
  in-flight entry, a fingerprint or an aggregate of true values, only counters
  (`tests/test_trust_boundary.py` tries every key); neither user may MONITOR or
  read the SLOWLOG, and the server keeps no slow log;
- once everything is published, Redis holds no raw record: no record hash,
  pool or in-flight entry, only counters, aggregates, keyed fingerprints and the
  adversary test's tallies, which expire by themselves.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import itertools
import json
import os
import secrets
import shutil
import time
import tomllib
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaConsumer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError
from test_trust_boundary import assert_the_boundary_holds, observe

from deploy.certificates import make_certificates
from deploy.embedded import RedisServer, free_port, service_user_envs, spawn_consumer, spawn_worker
from service.cli import client
from service.core.config import ConfigError, load_config
from service.core.table import open_sample
from service.store.buffer import BufferState, connect
from streams.runtime.topics import create_topics

pytestmark = pytest.mark.redis

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
RECORDS = 3000
TIMEOUT = 120.0
# What may remain of a partition once everything is published: counters, aggregates,
# gauges, the keyed fingerprints, the offset watermark, the owner fence's generation, the
# gate's offsets and the adversary test's tallies; of an identity shard, its keyed
# fingerprints, where the last first copies were read (keyed fingerprints and offsets),
# the offsets it screened and knows handled, and its counters.
LEFT_BEHIND = {
    "stats", "waiting", "delay", "sup", "off", "seen", "truth", "shown", "close", "owner",
}  # fmt: skip
SHARD_LEFT_BEHIND = {"known", "unsettled", "handled", "screened", "stats"}
EXPIRING = {"truth", "shown"}
READ_RECORDS = "return redis.call('HGETALL', KEYS[1])"  # a script runs under its caller's ACL


def marker_config(directory: Path, redis_url: str, kafka: str) -> tuple[Path, dict[str, str]]:
    """The decoy example with occupations renamed to unique markers."""
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    occupations = document["schema"]["sensitive"]["occupation"]["domain"]
    tag = secrets.token_hex(4)
    markers = {o: f"occ{tag}x{i}" for i, o in enumerate(occupations)}
    document["schema"]["sensitive"]["occupation"]["domain"] = list(markers.values())
    document["stream"].update(
        name=f"sec{uuid.uuid4().hex[:8]}", partitions=2, max_wait=3.0, flush_interval=1.0,
        report_interval=2.0,
    )  # fmt: skip
    document["kafka"]["bootstrap"] = kafka
    document["redis"]["url"] = redis_url
    document["reports"]["queries"] = [{"value": {"occupation": markers["Sales"]}}]
    path = directory / "stream.toml"
    path.write_text(tomli_w.dumps(document))
    return path, markers


def rows(config, markers: dict[str, str], leaks: list[str]) -> list[tuple[bytes, bytes]]:
    names = config.schema.names
    with open_sample() as stream:
        records = list(itertools.islice(csv.DictReader(stream), RECORDS))
    good = [
        (
            f"r{i}".encode(),
            json.dumps(
                {**{n: r[n] for n in names}, "occupation": markers[r["occupation"]]}
            ).encode(),
        )
        for i, r in enumerate(records)
    ]
    # Bad records whose sensitive value is a marker outside the domain, and id conflicts.
    first = json.loads(good[0][1])
    bad = [
        (f"bad{i}".encode(), json.dumps({**first, "occupation": leak}).encode())
        for i, leak in enumerate(leaks)
    ]
    conflicts = [(good[i][0], good[i + 1][1]) for i in range(5)]
    return good + bad + conflicts


async def read_published(config, expected: int) -> list:
    consumer = AIOKafkaConsumer(
        config.topics["published"], bootstrap_servers=config.kafka.bootstrap,
        auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    messages: dict = {}
    deadline = time.monotonic() + 30
    try:
        while len(messages) < expected and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for message in batch:
                    messages[message.key] = message
    finally:
        await consumer.stop()
    return list(messages.values())


def test_least_privilege_no_raw_values_in_logs_or_left_in_redis(servers, tmp_path):
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    config_path, markers = marker_config(tmp_path, redis_server.url, servers.kafka_bootstrap)
    config = load_config(config_path)
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    base_env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KAFKA_BOOTSTRAP")}
    env = service_user_envs(config, {**base_env, "SPLU_SERVICE_KEY": secrets.token_hex(32)})
    assert "SPLU_SERVICE_KEY" not in env["consumer"]  # the consumer needs no key
    passwords = {role: env[role]["REDIS_PASSWORD"] for role in env}
    logs = {role: tmp_path / f"{role}.log" for role in passwords}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = spawn_worker(config_path, env["worker"], logs["worker"], loglevel="info")
    consumer = spawn_consumer(config_path, port, env["consumer"], logs["consumer"], loglevel="info")
    leaks = [f"leak{secrets.token_hex(6)}" for _ in range(20)]
    try:
        # Mid-stream and at the end the consumer tries every key (tests/test_trust_boundary.py).
        source = rows(config, markers, leaks)
        observed = observe(config, redis_server.url, passwords["consumer"], port, source, 1500)
        assert_the_boundary_holds(observed, config)

        async def settled() -> dict | None:
            admin = aioredis.from_url(redis_server.url)
            totals = await BufferState(admin, config).totals()
            await admin.aclose()
            done = totals.get("settled", 0)
            return totals if done == RECORDS and totals["in_flight"] == 0 else None

        deadline = time.monotonic() + TIMEOUT
        while not (totals := asyncio.run(settled())) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert totals, "every record published or suppressed"
        while time.monotonic() < deadline:
            try:
                status = client.status(url)
                if status["consumer"]["records"] == totals["published"] and status["tests"]:
                    break
            except client.ConsumerError:
                pass
            time.sleep(0.5)
        assert status["consumer"]["records"] == totals["published"]
        assert totals["rejected"] == len(leaks) + 5

        # The restricted users can do their work and nothing else.
        async def forbidden(role: str, commands) -> list[str]:  # type: ignore[no-untyped-def]
            refused = []
            user = aioredis.from_url(
                redis_server.url, username=f"splu-{role}", password=passwords[role]
            )
            for command in commands:
                try:
                    await user.execute_command(*command)
                except NoPermissionError:
                    refused.append(command[0])
            await user.aclose()
            return refused

        admin_only = (("KEYS", "*"), ("FLUSHALL",), ("CONFIG", "GET", "*"),
                      ("SET", "splu:{other:0}:x", "1"), ("ACL", "LIST"), ("MONITOR",),
                      ("SLOWLOG", "GET"))  # fmt: skip
        for role in passwords:
            assert asyncio.run(forbidden(role, admin_only)) == [c[0] for c in admin_only]
        prefix = BufferState(None, config).prefix(0)  # type: ignore[arg-type]
        records = (("HGETALL", f"{prefix}:rec"), ("HGETALL", f"{prefix}:pool"),
                   ("HGETALL", f"{prefix}:takes"), ("HGETALL", f"{prefix}:seen"),
                   ("ZRANGE", f"{prefix}:b:1:0", "0", "-1"), ("HLEN", f"{prefix}:rec"),
                   ("SCAN", "0"), ("EVAL", READ_RECORDS, "1", f"{prefix}:rec"))  # fmt: skip
        assert asyncio.run(forbidden("consumer", records)) == [c[0] for c in records]
        aggregates = (("HGETALL", f"{prefix}:stats"), ("HGETALL", f"{prefix}:delay"))  # fmt: skip
        assert asyncio.run(forbidden("consumer", aggregates)) == []
        # Aggregates of true values are the worker's (its audit): issue 30.
        true_values = (("HGETALL", f"{prefix}:sup"), ("HGETALL", f"{prefix}:truth:true:1"),
                       ("HGETALL", f"{prefix}:truth:shown:1"))  # fmt: skip
        assert asyncio.run(forbidden("consumer", true_values)) == ["HGETALL"] * 3

        async def slow_log() -> tuple[list, list]:
            admin = aioredis.from_url(redis_server.url)
            entries = await admin.slowlog_get(128)
            setting = await admin.config_get("slowlog-log-slower-than")
            await admin.aclose()
            return entries, setting

        entries, setting = asyncio.run(slow_log())
        assert entries == [] and setting == {"slowlog-log-slower-than": "-1"}

        # Only the schema's attributes, under a 32-hex-digit token, with no headers.
        published = asyncio.run(read_published(config, totals["published"]))
        assert len(published) == totals["published"]
        for message in published:
            assert set(json.loads(message.value)) == set(config.schema.names)
            assert len(message.key) == 32 and int(message.key, 16) >= 0
            assert not message.headers
    finally:
        consumer.stop()
        worker.stop()

    # No marker in either log, though the logs are at info level and the run rejected
    # records whose sensitive value was a marker.
    for role, path in logs.items():
        text = path.read_text(errors="replace")
        assert text, f"the {role} logged nothing at info level"
        found = [m for m in [*markers.values(), *leaks] if m in text]
        assert not found, f"{role} log holds raw values {found[:3]}"

    # What is left in Redis: no record, pool or in-flight entry; keyed fingerprints, and
    # tallies that expire.
    async def leftovers() -> tuple[set[str], list[bytes], list[int]]:
        admin = aioredis.from_url(redis_server.url)
        kinds, digests, expiries = set(), [], []
        for partition in range(config.partitions):
            prefix = BufferState(admin, config).prefix(partition)
            async for key in admin.scan_iter(match=f"{prefix}:*"):
                kind = key.decode()[len(prefix) + 1 :].split(":")[0]
                kinds.add(kind)
                if kind == "seen":
                    for entries in (await admin.hgetall(key)).values():
                        digests += [entries[i + 6 : i + 10] for i in range(0, len(entries), 10)]
                if kind in EXPIRING:
                    expiries.append(await admin.pttl(key))
        for shard in range(config.partitions):
            prefix = BufferState(admin, config).shard_prefix(shard)
            async for key in admin.scan_iter(match=f"{prefix}:*"):
                kind = key.decode()[len(prefix) + 1 :]
                assert kind in SHARD_LEFT_BEHIND, kind
                if kind == "known":
                    for entries in (await admin.hgetall(key)).values():
                        digests += [entries[i + 6 : i + 10] for i in range(0, len(entries), 10)]
        await admin.aclose()
        return kinds, digests, expiries

    kinds, digests, expiries = asyncio.run(leftovers())
    redis_server.stop()
    assert kinds <= LEFT_BEHIND, kinds - LEFT_BEHIND
    retention = config.reports.truth_retention * 1000
    assert expiries and all(0 < ttl <= 2 * retention for ttl in expiries)
    # An unkeyed hash of a record's codes could be inverted by trying every possible record.
    unkeyed = {
        hashlib.blake2b(
            np.asarray(config.schema.encode_record(json.loads(value), key), np.int64).tobytes(),
            digest_size=4,
        ).digest()
        for key, value in rows(config, markers, [])[:RECORDS]
    }
    assert len(digests) == RECORDS and not unkeyed & set(digests)


def test_the_buffer_talks_tls_when_configured(tmp_path):
    """Debian's redis-server (installed by deploy/system-packages.sh) has TLS built in."""
    binary = shutil.which("redis-server")
    assert binary, "deploy/system-packages.sh installs redis-server"
    files = make_certificates(tmp_path / "tls", ["127.0.0.1"], days=1)
    certificate, key, authority = files.certificate, files.key, files.ca
    server = RedisServer(tmp_path / "redis", binary=Path(binary), tls=(certificate, key, authority))
    server.start()
    try:
        document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
        document["stream"]["name"] = f"tls{uuid.uuid4().hex[:8]}"
        document["redis"].update(url=server.tls_url, ca_file=str(authority))
        path = tmp_path / "tls.toml"
        path.write_text(tomli_w.dumps(document))
        config = load_config(path)

        async def over_tls() -> tuple[int, dict]:
            buffer = BufferState(connect(config), config)
            await buffer.pause("tls check")
            reason = await buffer.paused()
            await buffer.pause(None)
            stats = await buffer.totals()
            await buffer.client.aclose()
            return reason, stats

        reason, stats = asyncio.run(over_tls())
        assert reason == "tls check" and stats["pending"] == 0

        # Without the CA the server's certificate is refused; a plain URL with TLS files is
        # a configuration error naming the field.
        async def without_ca() -> None:
            unverified = aioredis.from_url(server.tls_url)
            try:
                await unverified.ping()
            finally:
                await unverified.aclose()

        with pytest.raises(RedisConnectionError):
            asyncio.run(without_ca())
        document["redis"]["url"] = server.url
        path.write_text(tomli_w.dumps(document))
        with pytest.raises(ConfigError, match=r"redis\.ca_file"):
            load_config(path)
    finally:
        server.stop()
