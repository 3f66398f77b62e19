"""The public manifest and the downstream reader (issue 17, items 1 and 3).

The manifest holds public parameters only and follows from the config alone; a worker whose
config differs from the stream's manifest refuses before it consumes anything, also when
workers start together. `splu query --topic` answers from the two topics exactly as the
consumer's `/estimate` does, with no config file, no key and no Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import tomli_w
from aiokafka import AIOKafkaProducer
from harness import EXAMPLES, RECORDS, Harness, adult_rows
from test_consumer import random_queries, wait_for

from service.cli import client
from service.cli.batch import main as service_main
from service.core.config import load_config
from service.core.manifest import Manifest, ManifestError, Publication, Tally, manifest_topic
from service.core.published import CellCodec
from service.core.reconstruct import Query
from streams.cli import main as streams_main
from streams.runtime.manifest import (
    ManifestConflictError,
    check_manifest,
    claim_manifest,
    manifest_topics,
    read_to_end,
)
from streams.runtime.topics import create_topics
from streams.tools.produce import produce
from streams.tools.reader import read_publication

ROOT = Path(__file__).parents[1]
KEY_HEX = "ab" * 32


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLU_SERVICE_KEY", KEY_HEX)


def example(name: str, tmp_path: Path, **tables: dict) -> Path:
    """An example config with some settings replaced, written beside its merge map."""
    document = tomllib.loads((EXAMPLES / name).read_text())
    for table, settings in tables.items():
        document.setdefault(table, {}).update(settings)
    if "personal" in document:
        merge = EXAMPLES / document["personal"]["merge_map"]
        (tmp_path / merge.name).write_text(merge.read_text())
    path = tmp_path / f"{len(list(tmp_path.glob('*.toml')))}-{name}"
    path.write_text(tomli_w.dumps(document))
    return path


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("adult-decoy.toml", {"gamma": 5, "grouping": "size-weighted"}),
        (
            "adult-personal.toml",
            {"retention": 0.5, "lambda": 0.3, "delta": 0.3, "budget": "conservative"},
        ),
        ("adult-windowed.toml", {"mechanism": "anatomy", "options": {"gamma": 5}}),
    ],
)
def test_the_manifest_holds_the_public_parameters_and_nothing_secret(
    tmp_path, key_env, name, parameters
):
    config = load_config(example(name, tmp_path))
    manifest = Manifest.of_config(config)
    document = json.loads(manifest.to_json())
    assert set(document) == {
        "version", "stream", "published", "mechanism", "parameters", "schema", "merge_map",
        "digest",
    }  # fmt: skip
    assert document["parameters"] == parameters
    assert document["published"] == config.topics["published"]
    schema = manifest.schema()
    assert schema == config.schema  # domains, bins and order survive
    if "age" in schema:
        assert document["schema"]["public"][0] == {
            "name": "age", "bins": [17, 25, 35, 45, 55, 65, 91],
            "domain": ["[17,25)", "[25,35)", "[35,45)", "[45,55)", "[55,65)", "[65,91)"],
        }  # fmt: skip
    # The merge map of a personal stream over its published public attributes only.
    if config.personal is not None:
        assert set(document["merge_map"]["classes"]) <= {a.name for a in schema.public}
        assert document["merge_map"]["alpha"] == 0.05
    else:
        assert document["merge_map"] is None
    # Nothing of the key, its source, the servers or the operational settings.
    text = manifest.to_json().decode()
    for secret in (KEY_HEX, "SPLU_SERVICE_KEY", config.redis_url, config.kafka.bootstrap):
        assert secret not in text
    for operational in ("max_wait", "mixing_pool", "release_size", "window", "partitions"):
        assert f'"{operational}"' not in text
    # The same config gives the same bytes, so concurrent workers agree; a reader checks them.
    again = Manifest.of_config(load_config(example(name, tmp_path)))
    assert again.to_json() == manifest.to_json()
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_windowed_ratios_stay_exact(tmp_path, key_env):
    path = example("adult-windowed.toml", tmp_path)
    document = tomllib.loads(path.read_text())
    document["windowed"] = {"mechanism": "sdr", "rho1": "1/13", "rho2": 0.2}
    path.write_text(tomli_w.dumps(document))
    parameters = Manifest.of_config(load_config(path)).parameters
    assert parameters == {
        "mechanism": "sdr", "options": {"rho1": "1/13", "rho2": "1/5", "delta": 0.05},
    }  # fmt: skip


def test_a_changed_parameter_is_named_and_a_tampered_manifest_refused(tmp_path, key_env):
    five = Manifest.of_config(load_config(example("adult-decoy.toml", tmp_path)))
    six = Manifest.of_config(load_config(example("adult-decoy.toml", tmp_path, decoy={"gamma": 6})))
    assert five.digest != six.digest
    assert five.changes(six) == ["parameters.gamma: 5 → 6"]
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    public = document["schema"]["public"]
    document["schema"]["public"] = dict(reversed(public.items()))
    (tmp_path / "reordered.toml").write_text(tomli_w.dumps(document))
    reordered = Manifest.of_config(load_config(tmp_path / "reordered.toml"))
    assert five.changes(reordered) == ["schema: the order of the attributes"]
    tampered = json.loads(five.to_json())
    tampered["parameters"]["gamma"] = 6
    with pytest.raises(ManifestError, match="digest"):
        Manifest.from_json(json.dumps(tampered).encode())
    later = {**json.loads(five.to_json()), "version": 2}
    with pytest.raises(ManifestError, match="version 2"):
        Manifest.from_json(json.dumps(later).encode())


@pytest.mark.parametrize("name", ["adult-decoy.toml", "adult-personal.toml"])
def test_the_publication_answers_as_the_consumer_counts(tmp_path, key_env, name):
    """Without servers: the same messages through the consumer's cell codec and
    reconstruction, and through `Publication`, give equal answers, re-sent copies and
    unreadable messages dropped alike."""
    config = load_config(example(name, tmp_path))
    rng = random.Random(3)
    sensitive = config.schema.sensitive[0]
    messages = []
    for i, (_, value) in enumerate(adult_rows(config)[:6000]):
        raw = json.loads(value)
        record = {a.name: a.domain[a.code_of(raw[a.name])] for a in config.schema.attributes}
        record[sensitive.name] = rng.choice(sensitive.domain)  # any published value will do
        messages.append((b"t%d" % i, json.dumps(record).encode()))
    messages += rng.sample(messages, 300)  # re-sent copies
    messages += [(None, messages[0][1]), (b"bad", b'{"sex": "Male"}'), (b"worse", b"[1]")]
    rng.shuffle(messages)

    codec = CellCodec(config.schema)
    tally: dict[bytes, int] = {}
    seen = set()
    for token, value in messages:
        try:
            cell = codec.key_of(value)
        except ValueError:
            continue
        if token and token not in seen:
            seen.add(token)
            tally[cell] = tally.get(cell, 0) + 1
    consumer = config.reconstruction(codec.cells(tally))

    publication = Publication.from_records(Manifest.of_config(config), messages)
    assert (publication.records, publication.duplicates, publication.invalid) == (6000, 300, 3)
    queries = random_queries(config, 80, seed=11)
    expected = consumer.estimate_many([Query.from_json(q) for q in queries])
    answers = publication.answer(queries)
    for query, estimate, answer in zip(queries, expected, answers, strict=True):
        assert answer == {
            **query, **estimate.answer(), "published": estimate.published,
            "rows": estimate.predicate_rows,
        }, query  # fmt: skip
    bad = publication.answer([{"where": {"nosuch": "x"}}, {"value": {"sex": "Male"}}])
    assert "no such public column" in bad[0]["error"] and "not a sensitive" in bad[1]["error"]


def test_a_windowed_manifest_restores_its_mechanism_and_exact_options(tmp_path, key_env):
    config = load_config(example("adult-windowed.toml", tmp_path))
    manifest = Manifest.from_json(Manifest.of_config(config).to_json())
    settings = manifest.windowed_settings()
    assert settings is not None and config.windowed is not None
    assert (settings.mechanism, dict(settings.options)) == (
        config.windowed.mechanism, dict(config.windowed.options),
    )  # fmt: skip
    with pytest.raises(ManifestError, match="side messages"):
        manifest.reconstruction(Tally(manifest.schema()).cells())


def test_query_topic_needs_a_bootstrap_and_no_mechanism_options(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KAFKA_BOOTSTRAP", raising=False)
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"value": {"occupation": "Sales"}}\n')
    io = ["--queries", str(queries), "--output", str(tmp_path / "a.jsonl")]
    for command, message in [
        (["--topic", "adult"], "give --bootstrap HOST:PORT, set KAFKA_BOOTSTRAP"),
        (["--topic", "adult", "--bootstrap", "h:1", "--gamma", "5"], "--gamma does not apply"),
        (["--published", "p.csv", "--bootstrap", "h:1"], "--bootstrap applies to --topic only"),
    ]:
        assert streams_main(["query", *command, *io]) == 1
        assert message in capsys.readouterr().err, command
    # The batch commands alone (no Kafka) cannot read topics.
    assert service_main(["query", "--topic", "adult", "--bootstrap", "h:1", *io]) == 1
    assert "run it as `splu query`" in capsys.readouterr().err
    assert not (tmp_path / "a.jsonl").exists()


async def _manifests_on_topic(config) -> list[bytes]:
    return [r.value for r in await read_to_end(config.kafka, manifest_topic(config.name), 1)]


async def _create(config) -> None:
    manifest, settings = manifest_topics(config)
    await create_topics(config.kafka, {**config.topic_partitions, **manifest}, settings)


@pytest.mark.stream
def test_workers_starting_together_agree_on_one_manifest(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    config = harness.config
    other = load_config(example_of(harness, tmp_path, decoy={"gamma": 6}))
    asyncio.run(_create(config))

    async def start_together():
        claims = [claim_manifest(config) for _ in range(4)] + [claim_manifest(other)]
        return await asyncio.gather(*claims, return_exceptions=True)

    outcomes = asyncio.run(start_together())
    refused = [o for o in outcomes if isinstance(o, ManifestConflictError)]
    # Whichever claimed first decided: either the four equal workers proceed, or only the
    # odd one does; never both kinds.
    assert sorted(o is None for o in outcomes) in ([False] + [True] * 4, [False] * 4 + [True])
    assert all("gamma" in str(r) for r in refused)
    on_topic = asyncio.run(_manifests_on_topic(config))
    assert on_topic and len(set(on_topic)) == 1
    # A worker started later with the stream's own config proceeds and writes nothing more;
    # a consumer with the other config refuses too.
    winner, loser = (config, other) if len(refused) == 1 else (other, config)
    asyncio.run(claim_manifest(winner))
    assert asyncio.run(_manifests_on_topic(config)) == on_topic
    asyncio.run(check_manifest(winner))
    with pytest.raises(ManifestConflictError, match=r"parameters\.gamma"):
        asyncio.run(check_manifest(loser))


@pytest.mark.stream
def test_a_manifest_past_the_brokers_message_limit_is_sent_compressed(servers, tmp_path):
    """A public column of 200,000 values (a sequence number, as bench/stream_throughput.py
    streams) makes a 1.7 MB manifest: over Kafka's 1 MB message limit as text, not gzipped."""
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    document = tomllib.loads(harness.path.read_text())
    document["schema"]["public"]["seq"] = {"domain": [str(i) for i in range(200_000)]}
    path = tmp_path / "seq.toml"
    path.write_text(tomli_w.dumps(document))
    config = load_config(path)
    assert len(Manifest.of_config(config).to_json()) > 1_500_000
    asyncio.run(_create(config))
    asyncio.run(claim_manifest(config))
    (found,) = set(asyncio.run(_manifests_on_topic(config)))
    assert Manifest.from_json(found).digest == Manifest.of_config(config).digest


def example_of(harness: Harness, tmp_path: Path, **tables: dict) -> Path:
    """The harness's config (same stream, same servers) with some settings replaced."""
    document = tomllib.loads(harness.path.read_text())
    for table, settings in tables.items():
        document[table].update(settings)
    path = tmp_path / f"changed-{harness.path.name}"
    path.write_text(tomli_w.dumps(document))
    return path


async def _settled(harness: Harness, records: int) -> dict | None:
    redis = aioredis.from_url(harness.config.redis_url)
    try:
        totals = await harness.totals(redis)
    finally:
        await redis.aclose()
    done = totals.get("settled", 0) == records and totals.get("in_flight", 0) == 0
    return totals if done else None


def _published(harness: Harness) -> int:
    topic = harness.config.topics["published"]
    return len(asyncio.run(harness.read_all(topic, timeout=30)))


@pytest.mark.stream
def test_a_worker_started_with_another_gamma_refuses_and_loses_nothing(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    config = harness.config
    rows = adult_rows(config)
    first, second = rows[:3000], rows[3000:4500]
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    harness.start_worker()
    try:
        asyncio.run(produce(config, iter(first), progress=False))
        before = wait_for(lambda: asyncio.run(_settled(harness, len(first))), "the first part")
    finally:
        harness.stop()
    published = _published(harness)
    assert published == before["published"]
    group = f"splu-{config.name}"
    committed = asyncio.run(harness.committed_offsets(config.topics["raw"], group))
    assert sum(committed.values()) == len(first)

    # More records arrive; the worker restarts with γ = 6.
    asyncio.run(produce(config, iter(second), progress=False))
    changed = example_of(harness, tmp_path, decoy={"gamma": 6})
    refused = subprocess.run(
        [sys.executable, "-m", "streams.cli", "worker", "--config", str(changed)],
        env=harness.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    message = refused.stderr
    assert "parameters.gamma: 5 → 6" in message and "stream.name" in message, message
    # Nothing published under γ = 6, nothing consumed: the new records wait on the raw topic.
    assert _published(harness) == published
    assert asyncio.run(harness.committed_offsets(config.topics["raw"], group)) == committed
    assert asyncio.run(_settled(harness, len(first))) is not None

    # With the stream's parameters again, the waiting records go through.
    harness.start_worker()
    try:
        wait_for(lambda: asyncio.run(_settled(harness, len(first) + len(second))), "the rest")
    finally:
        harness.stop()
    on_topic = asyncio.run(_manifests_on_topic(config))
    assert {Manifest.from_json(m).parameters["gamma"] for m in on_topic} == {5}


@pytest.mark.stream
@pytest.mark.parametrize("mechanism", ["decoy", "personal"])
def test_splu_query_topic_answers_as_the_consumer_without_config_or_redis(
    servers, tmp_path, mechanism
):
    harness = Harness(
        servers, tmp_path, f"adult-{mechanism}.toml", row_column=False,
        reports={"fail_closed": []},
    )  # fmt: skip
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    harness.start_worker()
    harness.start_consumer()
    try:
        asyncio.run(produce(config, iter(adult_rows(config)), rate=8000, progress=False))
        totals = wait_for(lambda: asyncio.run(_settled(harness, RECORDS)), "a finished stream")
        wait_for(
            lambda: client.status(harness.url)["consumer"]["records"] == totals["published"],
            "the consumer to count every published record",
        )
        # Re-sent copies on the topic: the reader drops them by token, as the consumer does.
        asyncio.run(resend_some(harness, 40))
        wait_for(
            lambda: client.status(harness.url)["consumer"]["duplicates"] == 40,
            "the consumer to see the re-sent copies",
        )
        # Random queries, and a small one: every public value of a rare respondent.
        rare = next(
            r for r in map(json.loads, (v for _, v in adult_rows(config)))
            if r["race"] == "Amer-Indian-Eskimo"
        )  # fmt: skip
        sensitive = config.sensitive[0]
        queries = [
            *random_queries(config, 40, seed=17),
            {"where": {a.name: a.domain[a.code_of(rare[a.name])] for a in config.schema.public},
             "value": {sensitive: rare[sensitive]}},
        ]  # fmt: skip
        served = client.ask(harness.url, queries)
    finally:
        harness.stop()
    small = [a for a in served if "value" in a and a.get("where") and a["rows"] <= 50]
    large = [a for a in served if "value" in a and a["rows"] >= 1000]
    assert small and large, "the queries hold small and large counts"

    # The reader: no config file anywhere, no key, and a Redis URL nobody answers at.
    hidden = harness.path.rename(harness.path.with_suffix(".hidden"))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("SPLU_SERVICE_KEY", "KAFKA_BOOTSTRAP", "REDIS_URL")
    }  # fmt: skip
    env.update(REDIS_URL="redis://127.0.0.1:1/0", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "streams.cli", "query", "--topic", config.name,
         "--bootstrap", config.kafka.bootstrap, "--queries", str(tmp_path / "q.jsonl"),
         "--output", str(tmp_path / "topic.jsonl")],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"{totals['published']:,} published records" in result.stderr
    read = [json.loads(line) for line in (tmp_path / "topic.jsonl").read_text().splitlines()]
    for query, expected, answer in zip(queries, served, read, strict=True):
        for field in ("estimate", "low", "high", "published", "rows"):
            assert answer.get(field) == expected.get(field), (query, expected, answer)
    hidden.rename(harness.path)

    # The Python API gives the same numbers.
    publication = read_publication(config.name, config.kafka.bootstrap)
    assert publication.records == totals["published"] and publication.duplicates == 40
    assert [a["estimate"] for a in publication.answer(queries)] == [a["estimate"] for a in read]


async def resend_some(harness: Harness, count: int) -> None:
    """Publish copies of some published records under their tokens and partitions, as a
    worker re-sending its in-flight records after a crash does."""
    config = harness.config
    topic = config.topics["published"]
    records = (await harness.read_all(topic, timeout=30))[:count]
    producer = AIOKafkaProducer(bootstrap_servers=config.kafka.bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for record in records:
            await producer.send_and_wait(
                topic, record.value, key=record.key, partition=record.partition
            )
    finally:
        await producer.stop()
