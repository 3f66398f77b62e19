"""The consumer counts windowed streams (issue 17, item 2).

A windowed stream publishes each window's rows and side messages (ST rows, sub-tables).
The consumer's `/estimate` must equal `splu query` on the same published messages, read
back from the topic, deduplicated by token and written as one batch publication
(`PublishedWindows.write`): that is the sum of the per-window reconstructions, since every
mechanism's estimate is a sum over its sub-tables, groups or buckets, and dbr's and
global's over rows. The consumer is made to die before committing its second fetch and
is restarted (its counts must absorb the redelivery), then SIGKILLed and restarted once
the stream is done (same answers, nothing counted twice).

The five streams run at once on the session's embedded servers: sdr, fprivacy and anatomy
with 20,000 Adult records each, dbr and global (which need no side data) with 5,000.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import tomllib
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import fault_points
import pytest
import redis.asyncio as aioredis
import tomli_w
from harness import RECORDS, Harness, adult_rows
from test_consumer import wait_for
from test_windowed import rows_of, window_records, windowed_config

from service.cli import client
from service.cli.batch import main
from service.core.config import StreamConfig, load_config
from service.core.mechanisms.registry import MECHANISMS
from service.core.prf import ServiceKey
from service.core.privacy_tests import guarantee_curve, windowed_tests
from service.core.published import PublishedRecordError, PublishedWindows, WindowCodec
from service.core.reconstruct import Query
from service.core.schema import Schema
from service.core.windows import KIND, render_window
from service.store.windowed import WindowState
from streams.runtime.topics import create_topics
from streams.tools.produce import produce
from streams.tools.reader import read_publication

# Whole stream processes on the embedded servers; run once, not again on Debian's Redis.
pytestmark = pytest.mark.stream

EXAMPLE = "adult-windowed.toml"
STREAMED = {"sdr": RECORDS, "fprivacy": RECORDS, "anatomy": RECORDS, "dbr": 5000, "global": 5000}
WINDOW = 2000  # records per window and partition: 5 windows a partition at 20,000
QUERIES = 60
TESTS = ("eligibility", "guarantees", "budget", "adversary", "dp_audit")


def queries_for(schema: Schema, seed: int) -> list[dict]:
    """Sensitive-only, public-only and conjunctive queries, some with lists of values, and
    one asking for a value outside the domain."""
    rng = random.Random(seed)
    public = schema.public
    sensitive = schema.sensitive[0]
    queries: list[dict] = [{"value": {sensitive.name: v}} for v in sensitive.domain]
    queries.append({"where": {public[0].name: list(public[0].domain[:2])}})
    queries.append({"where": {"sex": "Male"}, "value": {sensitive.name: "Astronaut"}})
    while len(queries) < QUERIES:
        where = {}
        for column in rng.sample(public, rng.randint(1, 3)):
            picked = rng.sample(column.domain, rng.choice([1, 1, 2]))
            where[column.name] = picked[0] if len(picked) == 1 else picked
        queries.append({"where": where, "value": {sensitive.name: rng.choice(sensitive.domain)}})
    return queries


def ready(url: str) -> bool:
    """Whether the consumer's /readyz says it is ready (partitions assigned)."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            return bool(json.loads(response.read())["ready"])
    except urllib.error.HTTPError:
        return False


@dataclass
class Run:
    """One windowed stream run to its end, as the tests check it."""

    mechanism: str
    harness: Harness
    totals: dict[str, int]
    messages: dict[bytes, bytes]  # token → value, each once
    queries: list[dict]
    answers: list[dict]  # /estimate once every message was counted
    status: dict
    restarted: list[dict]  # /estimate after a SIGKILL and a restart
    restarted_status: dict
    reports: list[dict]
    page: str


def windowed_harness(servers, directory: Path, mechanism: str) -> Harness:
    harness = Harness(servers, directory, EXAMPLE, row_column=False)
    document = tomllib.loads(harness.path.read_text())
    document["windowed"] = {
        "mechanism": mechanism, "window": WINDOW, "max_window_wait": 1.0, "min_window": 1,
    }  # fmt: skip
    document["stream"]["report_interval"] = 1.0
    harness.path.write_text(tomli_w.dumps(document))
    harness.config = load_config(harness.path)
    return harness


def run_stream(servers, directory: Path, mechanism: str) -> Run:
    harness = windowed_harness(servers, directory, mechanism)
    config = harness.config
    records = STREAMED[mechanism]
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    try:
        harness.start_worker()
        # The first consumer ends after handling its second fetch, before committing it:
        # the next one is handed that fetch again and must count none of it twice.
        harness.start_consumer(fault_points.command(exit_before_commit=2))
        rows = adult_rows(config)[:records]

        asyncio.run(produce(config, iter(rows), progress=False))
        wait_for(
            lambda: harness.consumer.returncode == fault_points.EXIT_FAULT,
            "the consumer's fault exit",
        )
        harness.start_consumer()

        async def settled() -> dict | None:
            redis = aioredis.from_url(config.redis_url)
            try:
                totals = await WindowState(redis, config).totals()
            finally:
                await redis.aclose()
            done = totals.get("published", 0) + totals.get("suppressed", 0)
            return totals if done == records and totals["pending"] == 0 else None

        totals = wait_for(lambda: asyncio.run(settled()), "every window published")

        def counted() -> dict | None:
            status = client.status(harness.url)
            consumer = status["consumer"]
            whole = (consumer["records"], consumer["side"]) == (
                totals["published"], totals["side"],
            )  # fmt: skip
            return status if whole and consumer["counted"] == totals["published"] else None

        wait_for(counted, "the consumer to count every message")
        whole = time.time()
        queries = queries_for(config.schema, seed=len(mechanism))
        answers = client.ask(harness.url, queries)

        def reported() -> dict | None:
            """A status after a report round on every window (standing queries, tests)."""
            status = client.status(harness.url)
            times = [t["time"] for t in status["tests"] + status["not_applicable"]]
            return status if times and min(times) > whole else None

        status = wait_for(reported, "a report round on the whole stream")

        harness.consumer.kill()
        harness.start_consumer()
        wait_for(
            lambda: client.status(harness.url)["consumer"]["records"] == totals["published"],
            "the restarted consumer's counts",
        )
        wait_for(lambda: ready(harness.url), "the restarted consumer to rejoin")
        time.sleep(1.0)  # a fetch after the join: anything it brought again must be skipped
        restarted = client.ask(harness.url, queries)
        restarted_status = client.status(harness.url)
        with urllib.request.urlopen(harness.url + "/", timeout=10) as response:
            page = response.read().decode()
        messages = asyncio.run(harness.read_all(config.topics["published"]))
        reports = asyncio.run(harness.read_all(config.topics["reports"]))
    finally:
        harness.stop()
    by_token: dict[bytes, bytes] = {}
    for message in messages:
        assert by_token.setdefault(message.key, message.value) == message.value
    return Run(
        mechanism, harness, totals, by_token, queries, answers, status, restarted,
        restarted_status, [json.loads(m.value) for m in reports], page,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(servers, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every mechanism's stream, all at once (threads: each waits on its processes)."""
    with ThreadPoolExecutor(len(STREAMED)) as pool:
        futures = {
            m: pool.submit(run_stream, servers, tmp_path_factory.mktemp(m), m) for m in STREAMED
        }
        return {m: future.result() for m, future in futures.items()}


def batch_answers(run: Run, directory: Path) -> list[dict]:
    """`splu query` on the run's published messages, written as one batch publication."""
    config = run.harness.config
    assert config.windowed is not None
    windows = PublishedWindows.from_messages(config.schema, config.windowed, run.messages.values())
    assert windows.held == 0 and windows.rows == run.totals["published"]
    published = directory / "published.csv"
    windows.write(str(published))
    queries, output = directory / "q.jsonl", directory / "answers.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in run.queries))
    command = [
        "query", "--published", str(published), "--mechanism", run.mechanism,
        "--queries", str(queries), "--output", str(output),
    ]  # fmt: skip
    assert main(command) == 1  # the value outside the domain is an error of its line
    return [json.loads(line) for line in output.read_text().splitlines()]


@pytest.mark.parametrize("mechanism", list(STREAMED))
def test_estimates_equal_splu_query_on_the_published_messages(runs, tmp_path, mechanism):
    run = runs[mechanism]
    totals = run.totals
    assert totals["ingested"] == STREAMED[mechanism]
    assert totals["published"] + totals["suppressed"] == STREAMED[mechanism]
    assert totals["published"] >= 0.9 * STREAMED[mechanism]
    rows = [v for v in run.messages.values() if not v.startswith(b'{"kind"')]
    assert len(rows) == totals["published"]
    assert len(run.messages) - len(rows) == totals["side"]
    assert (totals["side"] > 0) == (mechanism in ("sdr", "fprivacy", "anatomy"))

    batch = batch_answers(run, tmp_path)
    assert len(run.queries) == QUERIES
    for query, expected, answer in zip(run.queries, batch, run.answers, strict=True):
        if "error" in expected:
            assert "is not in the domain" in answer["error"], (query, answer)
            continue
        for field in ("estimate", "low", "high"):
            assert answer.get(field) == expected.get(field), (query, expected, answer)
        assert answer["records"] == totals["published"] and answer["method"]
    assert sum("error" in a for a in run.answers) == 1


@pytest.mark.parametrize("mechanism", list(STREAMED))
def test_the_downstream_reader_answers_as_the_consumer(runs, mechanism):
    """`streams.tools.reader` (what `splu query --topic` runs) reads the manifest and the
    published topic alone, side messages included, and gives the consumer's numbers."""
    run = runs[mechanism]
    config = run.harness.config
    publication = read_publication(config.name, config.kafka.bootstrap)
    assert publication.manifest.parameters["mechanism"] == mechanism
    assert (publication.records, publication.held) == (run.totals["published"], 0)
    read = publication.answer(run.queries)
    for query, expected, answer in zip(run.queries, run.answers, read, strict=True):
        if "error" in expected:
            assert "is not in the domain" in answer["error"], (query, answer)
            continue
        for field in ("estimate", "low", "high"):
            assert answer.get(field) == expected.get(field), (query, expected, answer)


@pytest.mark.parametrize("mechanism", list(STREAMED))
def test_counts_survive_restarts_and_count_each_message_once(runs, mechanism):
    run = runs[mechanism]
    published, side = run.totals["published"], run.totals["side"]
    for status in (run.status, run.restarted_status):
        consumer = status["consumer"]
        assert (consumer["records"], consumer["counted"], consumer["side"]) == (
            published, published, side,
        )  # fmt: skip
        assert consumer["held"] == consumer["invalid"] == 0
    # The fault exit left a handled fetch uncommitted: it came again and was skipped.
    assert run.status["consumer"]["duplicates"] > 0
    assert run.restarted == run.answers


@pytest.mark.parametrize("mechanism", list(STREAMED))
def test_reports_standing_queries_and_the_live_page(runs, mechanism):
    run = runs[mechanism]
    status = run.status
    config = run.harness.config
    # Standing queries: one per occupation by default, as /estimate answers them.
    standing = {tuple(q["value"].items()): q for q in status["standing"]}
    assert len(standing) == config.schema.sensitive[0].size
    for query, answer in zip(run.queries, run.answers, strict=True):
        if not query.get("where") and "value" in query:
            assert standing[tuple(query["value"].items())]["estimate"] == answer["estimate"]
    # Every consumer test is either run or reported not applicable, with the reason.
    checked = {t["test"]: t for t in status["tests"]}
    skipped = {t["test"]: t for t in status["not_applicable"]}
    assert set(checked) | set(skipped) == set(TESTS) - {"dp_audit"}
    assert not set(checked) & set(skipped)
    for test in skipped.values():
        assert test["passed"] is None and test["applicable"] is False
        assert test["reason"].startswith(f"not applicable to {mechanism}: ")
    if mechanism in ("sdr", "anatomy"):
        guarantees = checked["guarantees"]
        assert guarantees["passed"] is True
        numbers = guarantees["numbers"]
        assert numbers["windows"] == run.totals["windows_published"]
        if mechanism == "sdr":
            # γ_i is set so that the posterior bound is exactly ρ2.
            assert numbers["max_posterior"] == pytest.approx(numbers["rho2"])
        else:
            assert numbers["max_share"] <= numbers["bound"] and numbers["groups_over"] == 0
    else:
        assert not checked
    # The report topic carries the same, and the standing queries.
    tests = [r for r in run.reports if r["kind"] == "test"]
    assert {r["test"] for r in tests} == set(TESTS) - {"dp_audit"}
    assert all(r["passed"] is not None or r["reason"] for r in tests)
    assert any(r["kind"] == "standing" and r["queries"] for r in run.reports)
    assert status["guarantee"]["kind"] == "windowed"
    assert "tests-body" in run.page


# ---------------------------------------------------------------------------------------
# Without servers


def one_window(mechanism: str, **options: object) -> tuple[StreamConfig, list[bytes], list[bytes]]:
    """A window of 1,000 Adult records through `mechanism`: config, rows, side messages."""
    config = windowed_config(mechanism=mechanism, **options)
    assert config.windowed is not None
    key = ServiceKey.fresh()
    records = window_records(config, key, rows_of(config)[:1000])
    output = render_window(config.schema, config.windowed, key, 0, 1, records)
    assert output.reason is None, output.reason
    return config, output.rows, output.side


def same_as_splu_query(windows: PublishedWindows, directory: Path) -> None:
    """The estimator answers as `splu query` does on the batch files `write` makes."""
    queries = queries_for(windows.schema, seed=1)[:30]
    published, answers = directory / "p.csv", directory / "a.jsonl"
    windows.write(str(published))
    (directory / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    main([
        "query", "--published", str(published), "--mechanism", windows.mechanism,
        "--queries", str(directory / "q.jsonl"), "--output", str(answers),
    ])  # fmt: skip
    batch = [json.loads(line) for line in answers.read_text().splitlines()]
    valid = [(q, b) for q, b in zip(queries, batch, strict=True) if "error" not in b]
    estimates = windows.estimator().estimate_many([Query.from_json(q) for q, _ in valid])
    assert [{**q, **e.answer()} for (q, _), e in zip(valid, estimates, strict=True)] == [
        b for _, b in valid
    ]


@pytest.mark.parametrize("mechanism", ["sdr", "anatomy", "fprivacy"])
def test_a_unit_enters_the_estimates_once_counted_whole(tmp_path, mechanism):
    config, rows, side = one_window(mechanism)
    unit = MECHANISMS[mechanism].extra_column
    whole = PublishedWindows.from_messages(config.schema, config.windowed, [*rows, *side])
    assert (whole.held, whole.rows, whole.side) == (0, len(rows), len(side))
    members = Counter(json.loads(row)[unit] for row in rows)
    assert list(whole.units) == sorted(members, key=lambda label: int(label.split("-")[2]))
    # Without one of its side messages, or one of its rows, a unit is held out.
    missing = json.loads(side[0])[unit]
    no_side = PublishedWindows.from_messages(config.schema, config.windowed, [*rows, *side[1:]])
    assert missing not in no_side.units and no_side.held == members[missing]
    short = json.loads(rows[0])[unit]
    no_row = PublishedWindows.from_messages(config.schema, config.windowed, [*rows[1:], *side])
    assert short not in no_row.units and no_row.held == members[short] - 1
    assert no_row.rows == len(rows) - members[short]
    same_as_splu_query(no_side, tmp_path)


def test_fprivacy_buckets_are_whole_at_their_st_sum_less_the_fake_values(tmp_path):
    config, rows, side = one_window(
        "fprivacy", fake_values=1, theta="1/1000000", beta="1/5", max_size=5
    )
    windows = PublishedWindows.from_messages(config.schema, config.windowed, [*rows, *side])
    assert windows.held == 0 and windows.rows == len(rows)
    assert len(side) == len(rows) + len(windows.units)  # distinct values, one fake each
    same_as_splu_query(windows, tmp_path)


def test_the_codec_refuses_messages_of_another_mechanism_or_schema():
    config, rows, side = one_window("anatomy")
    codec = WindowCodec(config.schema, config.windowed)
    row, st = json.loads(rows[0]), json.loads(side[0])
    for bad in (
        b"[1]", b"not json",
        json.dumps({**row, "occupation": "Sales"}).encode(),  # a QIT row holds no value
        json.dumps({**row, "group": "1-2"}).encode(),
        json.dumps({**row, "sex": "Other"}).encode(),
        json.dumps({**st, KIND: "subtable"}).encode(),
        json.dumps({**st, "count": 0}).encode(),
        json.dumps({**st, "occupation": "Astronaut"}).encode(),
    ):  # fmt: skip
        with pytest.raises(PublishedRecordError):
            codec.key_of(bad)
    assert codec.key_of(side[0]) == side[0]
    dbr_config = windowed_config(mechanism="dbr")
    assert dbr_config.windowed is not None
    dbr = WindowCodec(dbr_config.schema, dbr_config.windowed)
    with pytest.raises(PublishedRecordError, match="side message of kind 'st'"):
        dbr.key_of(side[0])


def test_not_applicable_tests_are_reported_with_their_reason_never_as_passed():
    config = windowed_config(mechanism="dbr")
    results, skipped = windowed_tests(config, None)
    assert results == []
    assert [s.test for s in skipped] == ["guarantees", "eligibility", "budget", "adversary"]
    for test in skipped:
        document = test.to_json()
        assert document["passed"] is None and document["applicable"] is False
        assert document["reason"].startswith("not applicable to dbr: ")
    assert guarantee_curve(config)["kind"] == "windowed"
