"""Windowed streams: a batch mechanism (sdr, fprivacy, anatomy, dbr, global) per window.

The config and `render_window` are tested on their own; the Lua steps against the
session's Redis server; the whole stream with a real worker process (SIGKILLed
mid-stream and restarted) between the embedded broker and Redis server. Every
record carries a unique public `row` so published rows can be matched to the input.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import secrets
import time
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaProducer
from harness import Harness, adult_rows

from service.core.config import ConfigError, StreamConfig, load_config, parse_config
from service.core.ingest import RawMessage
from service.core.mechanism_settings import WindowedSettings
from service.core.mechanisms.registry import MECHANISMS as REGISTRY
from service.core.prf import ServiceKey
from service.core.windows import KIND, WindowPreparer, decode_staged, render_window
from service.store.lifecycle import Lifecycle
from service.store.windowed import WindowBuffer, encode_staged
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
EXAMPLE = "adult-windowed.toml"
MECHANISMS = ("sdr", "fprivacy", "anatomy", "dbr", "global")
STREAMED = 5000
WINDOW = 1000
STREAM_TIMEOUT = 60.0
WARM_UP = 200


@functools.cache
def sample(names: tuple[str, ...]) -> list[tuple[bytes, bytes]]:
    """`adult_rows` for a schema with these attribute names, read once."""
    return adult_rows(SimpleNamespace(schema=SimpleNamespace(names=list(names))))


def rows_of(config: StreamConfig) -> list[tuple[bytes, bytes]]:
    return sample(tuple(config.schema.names))


def example_document() -> dict:
    return tomllib.loads((EXAMPLES / EXAMPLE).read_text())


def windowed_config(**windowed: object) -> StreamConfig:
    document = example_document()
    document["windowed"] = {"mechanism": "anatomy", **windowed}
    return parse_config(document, EXAMPLE, EXAMPLES)


# ---------------------------------------------------------------------------------------
# Configuration


def test_the_example_loads_with_the_cli_defaults():
    config = load_config(EXAMPLES / EXAMPLE)
    assert config.mechanism == "windowed"
    assert config.windowed == WindowedSettings("anatomy", 1000, 60.0, 100, {"gamma": 5})
    for mechanism in MECHANISMS:
        settings = windowed_config(mechanism=mechanism).windowed
        assert settings is not None
        assert settings.options == REGISTRY[mechanism].defaults
        assert settings.min_window == 100  # a tenth of the default window
    sdr = windowed_config(mechanism="sdr", rho1="1/13", rho2=0.25, delta=0.1).windowed
    assert sdr is not None
    assert sdr.options == {"rho1": Fraction(1, 13), "rho2": Fraction(1, 4), "delta": 0.1}


@pytest.mark.parametrize(
    ("windowed", "message"),
    [
        ({"mechanism": "decoy"}, "windowed.mechanism must be one of sdr, fprivacy"),
        ({"window": 0}, "windowed.window must be at least 1"),
        ({"window": 100, "min_window": 200}, "windowed.min_window must be at most"),
        ({"max_window_wait": -1}, "windowed.max_window_wait must be positive"),
        ({"gamma": 1}, "windowed.gamma must be at least 2"),
        ({"gamma": 15}, "windowed.gamma = 15 needs 15 values of 'occupation'"),
        ({"rho1": "1/13"}, "windowed.rho1 applies to mechanism sdr, not anatomy"),
        ({"mechanism": "dbr", "gamma": 3}, "windowed.gamma applies to mechanism anatomy or global"),
        ({"mechanism": "sdr", "rho1": "one"}, "windowed.rho1 must be a number or a ratio"),
        ({"mechanism": "sdr", "rho1": 0.3}, "windowed.rho1 (3/10) must be below windowed.rho2"),
        ({"mechanism": "sdr", "rho2": 1}, "windowed.rho2 must lie in (0, 1)"),
        ({"mechanism": "sdr", "delta": 2.0}, "windowed.delta must lie in (0, 1)"),
        ({"mechanism": "fprivacy", "beta": 2}, "windowed.beta must lie in [0, 1]"),
        ({"mechanism": "fprivacy", "min_size": 60}, "windowed.min_size must lie in 1..50"),
        ({"mechanism": "fprivacy", "bucket_method": "3"}, "windowed.bucket_method must be one of"),
        ({"mechanism": "global", "gamma": 14}, "global randomization needs more than γ values"),
        ({"size": 5}, "windowed.size is not a known setting"),
    ],
)  # fmt: skip
def test_windowed_settings_are_checked_with_errors_naming_the_field(windowed, message):
    with pytest.raises(ConfigError) as error:
        windowed_config(**windowed)
    assert message in str(error.value)


def test_windowed_tables_and_reserved_names():
    document = example_document()
    del document["windowed"]
    with pytest.raises(ConfigError, match=r"the \[windowed\] table is required"):
        parse_config(document, EXAMPLE, EXAMPLES)
    document = example_document()
    document["stream"]["mechanism"] = "decoy"
    with pytest.raises(ConfigError, match=r"\[windowed\] is set but stream.mechanism is 'decoy'"):
        parse_config(document, EXAMPLE, EXAMPLES)
    document = example_document()
    document["reports"] = {"fail_closed": ["adversary"]}
    with pytest.raises(ConfigError, match="a windowed stream never runs"):
        parse_config(document, EXAMPLE, EXAMPLES)
    for mechanism, name in (("anatomy", "group"), ("fprivacy", "count"), ("sdr", "kind")):
        document = example_document()
        document["windowed"]["mechanism"] = mechanism
        document["windowed"].pop("gamma")
        document["schema"]["public"][name] = {"domain": ["a", "b"]}
        with pytest.raises(ConfigError, match=f"schema attribute '{name}'"):
            parse_config(document, EXAMPLE, EXAMPLES)


# ---------------------------------------------------------------------------------------
# One window


def window_records(config: StreamConfig, key: ServiceKey, rows, partition: int = 0):
    """Redis' view of raw records: id (32 hex digits) → "public codes|sensitive codes"."""
    messages = [RawMessage(partition, i, k, v) for i, (k, v) in enumerate(rows)]
    batches, rejected = WindowPreparer(config, key).prepare(messages)
    assert not rejected
    (batch,) = batches
    return {
        record_id: public + b"|" + b",".join(b"%d" % c for c in values)
        for record_id, public, values in zip(
            batch.id_bytes(), batch.public, batch.sensitive.tolist(), strict=True
        )
    }


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_window_renders_byte_identically_from_the_same_records_and_key(mechanism):
    config = windowed_config(mechanism=mechanism)
    assert config.windowed is not None
    key = ServiceKey.fresh()
    rows = rows_of(config)[:WINDOW]
    records = window_records(config, key, rows, partition=1)
    first = render_window(config.schema, config.windowed, key, 1, 7, records)
    shuffled = list(records.items())
    random.Random(0).shuffle(shuffled)
    again = render_window(config.schema, config.windowed, key, 1, 7, dict(shuffled))
    assert first.reason is None and first.messages
    assert again.messages == first.messages  # byte for byte, in the same order
    assert first.summary  # the mechanism's account, for the worker log
    # Another window (or another key) draws afresh.
    assert render_window(config.schema, config.windowed, key, 1, 8, records).messages != (
        first.messages
    )
    if mechanism in ("fprivacy",):
        assert first.suppressed == WINDOW - len(first.rows) >= 0
    else:
        assert len(first.rows) == WINDOW and first.suppressed == 0

    # Published fields: the schema's (QIT: public only) and the mechanism's label.
    names = config.schema.names
    public = [a.name for a in config.schema.public]
    extra = REGISTRY[mechanism].extra_column
    expected = {
        "sdr": [*names, "subtable"], "anatomy": [*public, "group"],
        "fprivacy": [*public, "bucket"], "dbr": names, "global": names,
    }[mechanism]  # fmt: skip
    rows_out = [json.loads(m) for m in first.rows]
    assert all(list(r) == expected for r in rows_out)
    if extra is not None:
        assert all(r[extra].startswith("1-7-") for r in rows_out)
    side = [json.loads(m) for m in first.side]
    if mechanism in ("anatomy", "fprivacy"):
        assert {tuple(s) for s in side} == {(KIND, extra, "occupation", "count")}
        assert sum(s["count"] for s in side) >= len(rows_out)
        assert {s[extra] for s in side} == {r[extra] for r in rows_out}
    elif mechanism == "sdr":
        assert {tuple(s) for s in side} == {(KIND, "subtable", "values", "rows", "rho1", "gamma")}
        assert sum(s["rows"] for s in side) == len(rows_out)
    else:
        assert side == []


def test_windows_too_small_or_refused_are_suppressed_with_a_reason():
    document = example_document()
    document["windowed"].update(window=50, min_window=10)
    config = parse_config(document, EXAMPLE, EXAMPLES)
    assert config.windowed is not None
    key = ServiceKey.fresh()
    rows = rows_of(config)
    small = render_window(
        config.schema, config.windowed, key, 0, 1, window_records(config, key, rows[:9])
    )
    assert small.messages == [] and small.suppressed == 9
    assert "fewer than windowed.min_window" in (small.reason or "")
    # Anatomy refuses a window in which one occupation holds more than 1/ℓ of the records.
    sales = [r for r in rows[20:] if json.loads(r[1])["occupation"] == "Sales"][:5]
    same = [*sales, *rows[:20]]
    assert len({k for k, _ in same}) == 25
    refused = render_window(
        config.schema, config.windowed, key, 0, 2, window_records(config, key, same)
    )
    assert refused.messages == [] and refused.suppressed == 25
    assert "windowed.gamma 5 (Anatomy's ℓ): the table is not eligible" in (refused.reason or "")


def test_staged_output_round_trips_with_fresh_tokens():
    config = windowed_config()
    assert config.windowed is not None
    key = ServiceKey.fresh()
    records = window_records(config, key, rows_of(config)[:200])
    output = render_window(config.schema, config.windowed, key, 0, 1, records)
    blob = encode_staged(output)
    staged = decode_staged(blob)
    assert [m for _, m in staged.messages] == output.messages
    assert (staged.rows, staged.side, staged.suppressed) == (200, len(output.side), 0)
    tokens = [t for t, _ in staged.messages]
    assert len(set(tokens)) == len(tokens) and all(len(t) == 32 for t in tokens)
    assert decode_staged(encode_staged(output)).messages != staged.messages  # fresh tokens


# ---------------------------------------------------------------------------------------
# The Lua steps


@pytest.mark.redis
def test_lua_steps_window_stage_and_finish(servers):
    document = example_document()
    document["stream"]["name"] = f"lua{secrets.token_hex(4)}"
    document["windowed"].update(window=4, max_window_wait=10.0, min_window=1)
    document["redis"]["url"] = servers.redis_url
    config = parse_config(document, EXAMPLE, EXAMPLES)
    key = ServiceKey.fresh()
    rows = [(f"k{i}".encode(), v) for i, (_, v) in enumerate(rows_of(config)[:10])]
    preparer = WindowPreparer(config, key)

    def batch(items):
        messages = [RawMessage(0, offset, k, v) for offset, (k, v) in items]
        (prepared,), _ = preparer.prepare(messages)
        return prepared

    async def run() -> None:
        client = aioredis.from_url(config.redis_url)
        buffer = WindowBuffer(client, config)
        lifecycle = Lifecycle(client, config)
        try:
            stored = batch(list(enumerate(rows[:6])))
            assert await lifecycle.screen([stored], {}) == [[0] * 6]
            first = await buffer.ingest(0, stored, 1000)
            # No mixing pool: the window's records wait buffered until it is published.
            assert first.statuses == [0] * 6 and (first.pending, first.pool) == (6, 0)
            assert (await buffer.stats(0))["waiting"] == 1  # one full window queued
            # A redelivery of the same offsets is stored once; the identity screen rejects
            # an id reused with other content before the buffer sees it.
            again = await buffer.ingest(0, batch(list(enumerate(rows[:6]))), 1100)
            assert again.statuses == [1] * 6 and again.pending == 6
            reused = batch([(6, (rows[0][0], rows[7][1]))])
            assert await lifecycle.screen([reused], {0: 5}) == [[2]]
            # A tick before max_window_wait closes nothing; after it, the partial window.
            await buffer.ingest(0, None, 10_999)
            assert (await buffer.stats(0))["waiting"] == 1
            await buffer.ingest(0, None, 11_000)
            stats = await buffer.stats(0)
            assert stats["closed_full"] == stats["closed_wait"] == 1
            assert (stats["open"], stats["queued"], stats["waiting"]) == (0, 6, 2)
            assert stats["ingested"] == 6 and (await lifecycle.totals())["conflicts"] == 1

            assert await buffer.oldest(0) == 1
            records = await buffer.records(0, 1)
            assert len(records) == 4
            output = render_window(config.schema, config.windowed, key, 0, 1, records)
            # Anatomy refuses four records of ℓ = 5: only the blob's counts matter here.
            output.rows = [b'{"x":1}'] * 4
            kept = await buffer.stage(0, 1, encode_staged(output))
            assert kept is not None
            other = await buffer.stage(0, 1, encode_staged(output))
            assert other == kept  # the first staged output wins, tokens and all
            assert await buffer.staged(0, 1) == kept
            assert await buffer.finish(0, 1, kept.rows, kept.side, kept.suppressed, whole=False)
            assert not await buffer.finish(0, 1, kept.rows, kept.side, kept.suppressed, False)
            assert await buffer.stage(0, 1, encode_staged(output)) is None
            assert await buffer.finish(0, 2, 0, 0, 2, whole=True)
            stats = await buffer.stats(0)
            assert stats["published"] == 4 and stats["suppressed"] == 2
            assert stats["windows_published"] == stats["windows_suppressed"] == 1
            assert stats["pending"] == stats["waiting"] == 0
            prefix = buffer.prefix(0)
            assert not await client.exists(f"{prefix}:w:1", f"{prefix}:wout:1", f"{prefix}:w:2")
        finally:
            await client.aclose()

    asyncio.run(run())


# ---------------------------------------------------------------------------------------
# The whole stream


@dataclass
class Observed:
    """What the test saw in Redis while the stream ran."""

    windows: dict[tuple[int, int], dict[bytes, bytes]] = field(default_factory=dict)
    staged: dict[tuple[int, int], list[tuple[bytes, bytes]]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    produced_at_kill: bool = False  # whether the producer was still sending


async def snapshot(client: aioredis.Redis, buffer: WindowBuffer, seen: Observed) -> None:
    """Record the records of every closed window (and its staged output) not seen yet."""
    for partition in range(buffer.config.partitions):
        for member in await client.zrange(f"{buffer.prefix(partition)}:wq", 0, -1):
            number = int(member)
            if (partition, number) not in seen.windows:
                records = await buffer.records(partition, number)
                if records:
                    seen.windows[partition, number] = records
            staged = await buffer.staged(partition, number)
            if staged is not None:
                seen.staged.setdefault((partition, number), staged.messages)


def windowed_harness(servers, directory: Path, mechanism: str) -> Harness:
    harness = Harness(servers, directory, EXAMPLE)
    document = tomllib.loads(harness.path.read_text())
    document["windowed"] = {
        "mechanism": mechanism, "window": WINDOW, "max_window_wait": 2.0, "min_window": 1,
    }  # fmt: skip
    document["stream"].update(batch_size=500)
    harness.path.write_text(tomli_w.dumps(document))
    harness.config = load_config(harness.path)
    return harness


def expected_fields(config: StreamConfig, mechanism: str) -> list[str]:
    names = config.schema.names
    public = [a.name for a in config.schema.public]
    extra = REGISTRY[mechanism].extra_column
    if mechanism in ("anatomy", "fprivacy"):
        return [*public, extra]
    return [*names, extra] if extra else names


# Whole processes: run once; the Lua steps they drive run on both servers above.
@pytest.mark.stream
@pytest.mark.parametrize("mechanism", ["anatomy", "sdr", "dbr"])
def test_windowed_stream_publishes_each_record_once_through_a_kill(servers, tmp_path, mechanism):
    harness = windowed_harness(servers, tmp_path, mechanism)
    config = harness.config
    assert config.windowed is not None
    key = config.service_key()
    asyncio.run(create_topics(config.kafka, dict.fromkeys(config.topics.values(), 2)))
    rows = rows_of(config)[:STREAMED]
    harness.start_worker()
    seen = Observed()
    dead = asyncio.Event()  # set once the worker is killed

    async def crash_after_staging(
        client: aioredis.Redis, buffer: WindowBuffer, producing: asyncio.Task
    ) -> None:
        """Pause publication, stage the oldest closed window and send half of it, as a
        worker killed between sending and the acknowledgement would have; then SIGKILL
        the worker, restart it and resume."""
        await buffer.pause("test: crash while publishing")
        await asyncio.sleep(0.5)  # a publication round under way finishes first
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            waiting = [(p, await buffer.oldest(p)) for p in range(config.partitions)]
            waiting = [(p, n) for p, n in waiting if n is not None]
            if waiting:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no window closed while paused")
        partition, number = waiting[0]
        records = await buffer.records(partition, number)
        output = await asyncio.to_thread(
            render_window, config.schema, config.windowed, key, partition, number, records
        )
        staged = await buffer.stage(partition, number, encode_staged(output))
        assert staged is not None
        producer = AIOKafkaProducer(bootstrap_servers=config.kafka.bootstrap)
        await producer.start()
        try:
            for token, message in staged.messages[: len(staged.messages) // 2]:
                await producer.send(config.topics["published"], message, key=token)
            await producer.flush()
        finally:
            await producer.stop()
        harness.worker.kill()
        seen.produced_at_kill = not producing.done()
        dead.set()
        await snapshot(client, buffer, seen)
        harness.start_worker()
        await buffer.pause(None)

    async def run_stream() -> None:
        client = aioredis.from_url(config.redis_url)
        buffer = WindowBuffer(client, config)
        killed = False
        deadline = time.monotonic() + STREAM_TIMEOUT
        try:
            # A few records first, until the worker has joined; then the rest at a pace,
            # half of them only once the worker is dead, so that records arrive after the
            # kill however fast the machine runs.
            await produce(config, iter(rows[:WARM_UP]), progress=False)
            while (await buffer.totals()).get("ingested", 0) < WARM_UP:
                assert time.monotonic() < deadline, "the worker should start"
                await asyncio.sleep(0.1)

            async def around_the_kill() -> None:
                half = STREAMED // 2
                await produce(config, iter(rows[WARM_UP:half]), rate=1500, progress=False)
                await dead.wait()
                await produce(config, iter(rows[half:]), rate=1500, progress=False)

            producing = asyncio.create_task(around_the_kill())
            while time.monotonic() < deadline:
                await snapshot(client, buffer, seen)
                totals = await buffer.totals()
                if not killed and totals.get("ingested", 0) >= 0.2 * STREAMED:
                    killed = True
                    await crash_after_staging(client, buffer, producing)
                    continue
                done = totals.get("settled", 0)
                if producing.done() and killed and done == STREAMED and totals["pending"] == 0:
                    seen.totals = totals
                    break
                await asyncio.sleep(0.05)
            await producing
        finally:
            await client.aclose()

    try:
        asyncio.run(run_stream())
        assert seen.totals, "the stream should finish in time"
        messages = asyncio.run(harness.read_all(config.topics["published"]))
    finally:
        harness.worker.stop()
    totals = seen.totals
    assert seen.produced_at_kill, "the worker should die while records still arrive"

    # Every accepted record is published once or suppressed (whole windows); counts add up.
    assert totals["ingested"] == STREAMED, totals
    assert totals["published"] + totals["suppressed"] == STREAMED
    assert totals["suppressed"] <= 0.02 * STREAMED, totals
    assert totals["windows_published"] >= STREAMED // WINDOW
    assert totals["conflicts"] == 0

    # A token names one message; repeats (the re-sent half) carry the same bytes.
    by_token: dict[bytes, bytes] = {}
    for message in messages:
        assert by_token.setdefault(message.key, message.value) == message.value
        assert len(message.key) == 32 and int(message.key, 16) >= 0
    assert len(by_token) == totals["published"] + totals["side"]
    assert len(messages) > len(by_token), "the staged half should have been sent twice"
    decoded = {token: json.loads(value) for token, value in by_token.items()}
    published_rows = {t: m for t, m in decoded.items() if KIND not in m}
    side = {t: m for t, m in decoded.items() if KIND in m}
    assert len(published_rows) == totals["published"] and len(side) == totals["side"]

    # Each record at most once: under one token only.
    row_count = Counter(m["row"] for m in published_rows.values())
    assert max(row_count.values()) == 1 and len(row_count) == totals["published"]

    # Nothing but the schema's attributes and the mechanism's label.
    fields = expected_fields(config, mechanism)
    assert all(list(m) == fields for m in published_rows.values())
    for attribute in config.schema.attributes:
        if attribute.name in fields:
            assert {m[attribute.name] for m in published_rows.values()} <= set(attribute.domain)
    if mechanism == "anatomy":
        assert {tuple(m) for m in side.values()} == {(KIND, "group", "occupation", "count")}
    elif mechanism == "sdr":
        assert {tuple(m) for m in side.values()} == {
            (KIND, "subtable", "values", "rows", "rho1", "gamma")
        }
    else:
        assert not side

    # The kill changed no published value: windows seen in Redis (closed, or staged when
    # the worker died) come out exactly as a recomputation says, the staged one with its
    # tokens.
    message_of_row = {m["row"]: by_token[t] for t, m in published_rows.items()}
    assert seen.staged, "a window should have been staged when the worker was killed"
    for window, staged in seen.staged.items():
        for token, message in staged:
            assert by_token[token] == message, window
    checked = 0
    for (partition, number), records in seen.windows.items():
        output = render_window(config.schema, config.windowed, key, partition, number, records)
        if output.reason is not None:
            # A suppressed window: none of its records is out (`row` is the first public code).
            window_rows = {value.split(b",", 1)[0].decode() for value in records.values()}
            assert not window_rows & set(message_of_row)
        for message in output.rows:
            assert message_of_row[json.loads(message)["row"]] == message
            checked += 1
        assert set(output.side) <= set(by_token.values())
    assert checked >= WINDOW

    # Anatomy and SDR name each row's window: recompute every window from the input alone.
    if mechanism in ("anatomy", "sdr"):
        recompute_every_window(config, key, rows, decoded, by_token)


def recompute_every_window(
    config: StreamConfig, key: ServiceKey, rows, decoded: dict[bytes, dict], by_token
) -> None:
    """Group published rows by their "<partition>-<window>-<i>" label, rebuild each window
    from the raw input and the key, and compare every message byte for byte."""
    assert config.windowed is not None
    extra = REGISTRY[config.windowed.mechanism].extra_column
    source = {json.loads(value)["row"]: (k, value) for k, value in rows}
    members: dict[tuple[int, int], list[str]] = defaultdict(list)
    published: dict[tuple[int, int], list[bytes]] = defaultdict(list)
    for token, message in decoded.items():
        partition, number, _ = message[extra].split("-")
        window = int(partition), int(number)
        if KIND not in message:
            members[window].append(message["row"])
        published[window].append(by_token[token])
    preparer = WindowPreparer(config, key)
    for (partition, number), window_rows in members.items():
        messages = [RawMessage(partition, i, *source[row]) for i, row in enumerate(window_rows)]
        (batch,), _ = preparer.prepare(messages)
        records = {
            record_id: public + b"|" + b",".join(b"%d" % c for c in values)
            for record_id, public, values in zip(
                batch.id_bytes(), batch.public, batch.sensitive.tolist(), strict=True
            )
        }
        output = render_window(config.schema, config.windowed, key, partition, number, records)
        assert sorted(output.messages) == sorted(published[partition, number])
    assert sum(len(v) for v in members.values()) == sum(
        1 for m in decoded.values() if KIND not in m
    )
    assert all(len(v) <= WINDOW for v in members.values())
