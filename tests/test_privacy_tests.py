"""The consumer's privacy tests, metrics and running counts, without Kafka.

Each privacy test is run once on data where it must pass and once where the
property it guards is broken on purpose, so every verdict is shown to move.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import tomllib
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from service.core.config import ConfigError, StreamConfig, parse_config
from service.core.guarantees import trial_limit
from service.core.mechanisms.decoy import DecoyGroups
from service.core.prf import ServiceKey, random_ids
from service.core.privacy_tests import adversary, budget, eligibility, guarantees
from service.core.published import CellCodec, PublishedRecordError
from service.core.reconstruct import PublishedCells
from service.core.table import open_sample, read_table
from service.store.running_counts import RunningCounts
from streams.runtime.metrics import (
    delay_histogram,
    histogram_quantile,
    render_prometheus,
    render_worker,
)

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
T0 = 1_700_000_000_000  # a fixed clock, advanced by hand


def example(name: str, **reports: object) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / name).read_text())
    document["stream"]["name"] = f"t{uuid.uuid4().hex[:8]}"
    document.setdefault("reports", {}).update(reports)
    return parse_config(document, name, EXAMPLES)


@pytest.fixture(scope="module")
def decoy_release():
    """Adult published with decoy groups under the stream's schema, and the truth."""
    config = example("adult-decoy.toml")
    with open_sample() as stream:
        table, _ = read_table(stream, config.schema)
    key = ServiceKey.from_seed(3)
    release = DecoyGroups(5).publish(table, random_ids(len(table), key), key)
    published = PublishedCells.from_table(release.published)
    truth = PublishedCells.from_table(table.take(release.grouped_rows))
    return config, published, truth


def test_adversary_passes_on_decoy_output_and_fails_on_the_raw_data(decoy_release):
    config, published, truth = decoy_release
    result = adversary(config, config.reconstruction(published), truth)
    assert result.passed, result.numbers
    assert result.numbers["small_cells"] > 100
    assert result.numbers["small_within_share"] < result.numbers["small_bound"]
    # Publishing the true values instead: every small count is exact, and the test says so.
    leaked = adversary(config, config.reconstruction(truth), truth)
    assert leaked.numbers["small_within_share_naive"] == 1
    assert not leaked.passed and leaked.numbers["p_value"] < 1e-6, leaked.numbers


def test_eligibility_margins_and_suppression(decoy_release):
    config, published, _ = decoy_release
    result = eligibility(config, published, 0)
    assert result.passed and 0 < result.numbers["min_margin"] < 0.2
    assert result.numbers["values_over_share"] == 0
    dropped = eligibility(config, published, published.total // 50)
    assert not dropped.passed and dropped.numbers["suppressed_share"] > 0.01


def test_guarantees_report_the_thresholds():
    result = guarantees(example("adult-decoy.toml"))
    assert result.passed
    assert result.numbers["T_P"] == pytest.approx(0.2139, abs=1e-4)
    assert result.numbers["T_f"] == 51
    assert not guarantees(example("adult-decoy.toml", min_privacy=0.5)).passed


def test_budget_flags_groups_over_their_trial_limit():
    config = example("adult-personal.toml")
    limit = int(trial_limit(1.0, 0.5, 2, 0.3, 0.3))  # conservative: f = 1
    groups = {
        "0.0.0.0": {"total": 5 * limit, "trials": limit, "c:0": 4 * limit, "c:1": limit},
        "1.0.0.0": {"total": 30, "trials": 30, "c:0": 20, "c:1": 10},
    }
    result = budget(config, groups)
    assert result.passed and result.numbers["v_g"] == 0
    assert result.numbers["plain_v_g"] == 0.5  # every record a trial would overrun group 0
    groups["1.0.0.0"]["trials"] = groups["1.0.0.0"]["total"] = limit + 1
    over = budget(config, groups)
    assert not over.passed and over.numbers["v_g"] == 0.5
    assert over.numbers["v_r"] == pytest.approx((limit + 1) / (6 * limit + 1))
    assert over.numbers["groups_over"] == 1 and over.numbers["groups_frozen"] == 0
    # How close a group came, against ⌊s_g⌋ at its own frequency whatever the budget.
    exact = math.floor(trial_limit(30 / 31, 0.5, 2, 0.3, 0.3))
    groups["1.0.0.0"].update(total=31, trials=exact, frozen=1, **{"c:0": 30, "c:1": 1})
    closest = budget(config, groups)
    assert closest.numbers["max_exact_use"] == 1.0 and closest.numbers["groups_frozen"] == 1


def test_histogram_quantiles_follow_prometheus():
    raw = {"100": 10, "250": 10, "+Inf": 5, "count": 25, "sum_ms": 5000}
    histogram = delay_histogram(raw)
    assert histogram["buckets"][0] == [0.1, 10] and histogram["buckets"][-1] == ["+Inf", 25]
    assert histogram["p50"] == pytest.approx(0.1 + 0.15 * (12.5 - 10) / 10)
    assert histogram["p99"] == 86400.0  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, delay_histogram({})["buckets"]) is None


def samples(exposition: bytes) -> dict[tuple[str, frozenset], float]:
    """(name, labels) → value of every sample, as Prometheus's own parser reads them."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exposition.decode())
        for s in family.samples
    }


def test_consumer_metrics_are_prometheus_text_and_skip_unknown_numbers():
    status = {
        "stream": 'a"b',
        "paused": True,
        "max_suppressed": 0.01,
        "worker": {"redis_memory_bytes": 1000, "redis_memory_limit_bytes": 4000},
        "consumer": {"records": 2, "cells": 2, "duplicates": 1, "lag": 5},
        "tests": [{"test": "adversary", "passed": False, "numbers": {"p_value": 1e-9}}],
        "standing": [{"name": "x", "estimate": None, "published": 4}],
    }
    text = render_prometheus(status)
    found = samples(text)
    stream = ("stream", 'a"b')
    assert b'stream="a\\"b"' in text  # escaped in the text, read back whole
    assert found["splu_consumer_duplicates_total", frozenset([stream])] == 1
    assert found["splu_consumer_lag", frozenset([stream])] == 5
    assert found["splu_privacy_test_passed", frozenset([stream, ("test", "adversary")])] == 0
    assert found["splu_publishing_paused", frozenset([stream])] == 1
    assert found["splu_redis_memory_limit_bytes", frozenset([stream])] == 4000
    assert found["splu_standing_published", frozenset([stream, ("query", "x")])] == 4
    assert b"None" not in text and b"splu_standing_estimate{" not in text
    # Counters end in _total, and nothing is left to a reader's guess: every family typed.
    assert b"# TYPE splu_consumer_duplicates_total counter" in text
    assert text.count(b"# TYPE") == text.count(b"# HELP") == 12


def test_worker_metrics_show_each_owned_partition():
    histogram = delay_histogram({"100": 2, "2500": 1, "count": 3, "sum_ms": 2300})
    document = {
        "stream": "s",
        "delay_bound": 31.0,
        "partitions": {
            1: {"ingested": 5, "published": 3, "pending": 2, "buffer_cap": 10, "delay": histogram},
            3: {"buffer_cap": 10, "delay": delay_histogram({})},
        },
    }
    found = samples(render_worker(document))

    def value(name: str, **labels: str) -> float:
        return found[name, frozenset({"stream": "s", **labels}.items())]

    assert value("splu_worker_partitions") == 2
    assert value("splu_records_total", partition="1", state="published") == 3
    assert value("splu_records_total", partition="3", state="published") == 0
    assert value("splu_buffer_pending", partition="1") == 2
    assert value("splu_buffer_cap", partition="3") == 10
    assert value("splu_publish_delay_seconds_bucket", partition="1", le="0.1") == 2
    assert value("splu_publish_delay_seconds_bucket", partition="1", le="2.5") == 3
    assert value("splu_publish_delay_seconds_count", partition="1") == 3
    assert value("splu_publish_delay_seconds_sum", partition="1") == 2.3
    assert value("splu_publish_delay_bound_seconds") == 31
    # A worker that owns no partition says so, and shows no partition's numbers.
    idle = samples(render_worker({**document, "partitions": {}}))
    assert idle == {
        ("splu_worker_partitions", frozenset({("stream", "s")})): 0,
        ("splu_publish_delay_bound_seconds", frozenset({("stream", "s")})): 31,
    }


def test_codec_reads_published_records_and_refuses_others():
    config = example("adult-decoy.toml")
    codec = CellCodec(config.schema)
    record = {a.name: a.domain[-1] for a in config.schema.attributes}
    key = codec.key_of(json.dumps(record).encode())
    cells = codec.cells({key: 3})
    assert cells.total == 3 and [cells.domains[c][cells.cells[0, i]] for i, c in
                                 enumerate(cells.columns)] == list(record.values())  # fmt: skip
    for bad in [b"{", json.dumps({**record, "id": "7"}).encode(),
                json.dumps({**record, "sex": "Other"}).encode(), b"[1]"]:  # fmt: skip
        with pytest.raises(PublishedRecordError):
            codec.key_of(bad)


@pytest.mark.parametrize(
    ("reports", "message"),
    [
        ({"epsilon": -1}, "reports.epsilon must be positive"),
        ({"fail_closed": ["budget"]}, "never runs"),
        ({"fail_closed": ["nosuch"]}, "reports.fail_closed must be a list of test names"),
        ({"queries": [{"where": {"occupation": "Sales"}}]}, "where.occupation is not a public"),
        ({"queries": [{"value": {"occupation": "Pilot"}}]}, "is not in its domain"),
        ({"colour": 1}, "reports.colour is not a known setting"),
        ({"max_suppressed": 2}, "reports.max_suppressed must lie in [0, 1]"),
    ],
)
def test_bad_report_settings_name_the_field(reports, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        example("adult-decoy.toml", **reports)


@pytest.mark.redis
def test_redis_memory_is_unknown_until_the_workers_first_audit(servers):
    """Before the worker's first audit the consumer knows no Redis memory: its status says
    None (the live page shows a dash) and /metrics has no sample, never a 0."""
    from streams.consumer.app import Consumer

    config = example("adult-decoy.toml")

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        consumer = Consumer(config, client, publisher=None, leads=lambda: False)  # type: ignore[arg-type]
        before = await consumer.status()
        record = {"time": 0, "tests": [], "redis_memory_bytes": 7, "redis_memory_limit_bytes": 9}
        await client.set(consumer.buffer.audit_key, json.dumps(record))
        after = await consumer.status()
        await client.aclose()
        return before, after

    before, after = asyncio.run(scenario())
    assert before["worker"]["redis_memory_bytes"] is None
    assert before["worker"]["redis_memory_limit_bytes"] is None
    assert not [k for k in samples(render_prometheus(before)) if "redis_memory" in k[0]]
    assert (
        samples(render_prometheus(after))[
            "splu_redis_memory_bytes", frozenset([("stream", config.name)])
        ]
        == 7
    )


@pytest.mark.redis
def test_consumer_counts_each_token_once_at_any_age_in_bounded_memory(servers):
    """A token is counted once however late it comes back (a worker down for days re-sends
    what it had in flight): Redis keeps a 6-byte fingerprint per token, nothing expires."""
    config = example("adult-decoy.toml")

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        counts = RunningCounts(client, config)
        tokens = [secrets.token_hex(16).encode() for _ in range(5)]
        cells = [b"0,0,0,0,0|1", b"0,0,0,0,0|1", b"1,0,0,0,0|2", b"1,0,0,0,0|2", b"2,0,0,0,0|3"]
        first = await counts.add(1, tokens, cells)
        again = await counts.add(1, [*tokens[:3], secrets.token_hex(16).encode()], cells[:4])
        many = [secrets.token_hex(16).encode() for _ in range(3000)]
        await counts.add(1, many, [b"2,0,0,0,0|3"] * 3000)
        late = await counts.add(1, tokens[:1], cells[:1])
        # Another partition's shard: counted apart, read back merged.
        await counts.add(3, [secrets.token_hex(16).encode()], [b"2,0,0,0,0|3"])
        seen = await client.hgetall(f"{counts.prefix(1)}:seen")
        ttl = await client.pttl(f"{counts.prefix(1)}:seen")
        tally, stats = await counts.tally(), await counts.stats()
        await client.aclose()
        return first, again, late, seen, ttl, tally, stats

    first, again, late, seen, ttl, tally, stats = asyncio.run(scenario())
    assert (first.new, first.duplicates) == (5, 0) and (again.new, again.duplicates) == (1, 3)
    assert (late.new, late.duplicates) == (0, 1) and ttl == -1
    assert sum(len(entries) for entries in seen.values()) == 6 * 3006
    assert tally == {b"0,0,0,0,0|1": 2, b"1,0,0,0,0|2": 3, b"2,0,0,0,0|3": 3002}
    assert stats["records"] == 3007 and stats["duplicates"] == 4
