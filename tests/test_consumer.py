"""The consumer against a real worker on the embedded servers (SPEC §4).

20,000 Adult records go through a worker and the consumer. The consumer's
`/estimate` must equal `splu query` on a CSV of the same published rows
(read back from the topic), its counts must survive a restart and ignore
re-sent copies, and the reports topic must carry every privacy test.
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from harness import RECORDS, TIMEOUT, Harness, adult_rows
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from deploy.embedded import free_port
from service.cli import client
from service.cli.batch import main
from streams.runtime.app import partition_of
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

# Whole stream processes on the embedded servers; run once, not again on Debian's Redis.
pytestmark = pytest.mark.stream

TESTS = {"decoy": {"eligibility", "guarantees", "adversary"}, "personal": {"budget", "adversary"}}
BATCH_OPTIONS = {
    "decoy": ["--mechanism", "decoy", "--gamma", "5", "--sensitive", "occupation"],
    "personal": [
        "--mechanism", "personal", "--sensitive", "income", "--retention", "0.5",
        "--lambda", "0.3", "--delta", "0.3", "--budget", "conservative", "--stream",
    ],
}  # fmt: skip


def random_queries(config, count: int, seed: int) -> list[dict]:
    """Sensitive-only, public-only and conjunctive queries, some with lists of values."""
    rng = random.Random(seed)
    public = config.schema.public
    sensitive = config.schema.sensitive[0]
    queries = [{"value": {sensitive.name: v}} for v in sensitive.domain]
    queries.append({"where": {public[0].name: list(public[0].domain[:2])}})
    while len(queries) < count:
        columns = rng.sample(public, rng.randint(1, 3))
        where = {}
        for column in columns:
            picked = rng.sample(column.domain, rng.choice([1, 1, 2]))
            where[column.name] = picked[0] if len(picked) == 1 else picked
        queries.append({"where": where, "value": {sensitive.name: rng.choice(sensitive.domain)}})
    return queries


def get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
            kind = response.headers.get("Content-Type", "")
            return response.status, json.loads(body) if "json" in kind else body
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Samples(dict):
    """A /metrics page's samples by (name, labels), read by Prometheus's own parser."""

    def __getitem__(self, key: tuple[str, dict[str, str]]) -> float:
        name, labels = key
        return super().__getitem__((name, frozenset(labels.items())))


def metrics(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        # The current text format, which Prometheus 3 reads without a fallback.
        assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
        text = response.read().decode()
    return Samples(
        ((s.name, frozenset(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def wait_for(condition, what: str, timeout: float = TIMEOUT):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except client.ConsumerError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def write_published_csv(path: Path, config, records: list[dict]) -> None:
    names = config.schema.names
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(names)
        writer.writerows([r[n] for n in names] for r in records)


async def resend(config, messages: dict) -> None:
    """Publish copies of already published records under their tokens, to their token's
    partition, as a worker re-sending its in-flight records after a crash does."""
    producer = AIOKafkaProducer(bootstrap_servers=config.kafka.bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for token, value in messages.items():
            partition = partition_of(token, config.partitions)
            await producer.send_and_wait(
                config.topics["published"], value, key=token, partition=partition
            )
    finally:
        await producer.stop()


@pytest.mark.parametrize("mechanism", ["decoy", "personal"])
def test_consumer_estimates_equal_batch_reconstruction(servers, tmp_path, mechanism):
    harness = Harness(
        servers, tmp_path, f"adult-{mechanism}.toml", row_column=False,
        reports={"dp_epsilon": 0.5, "fail_closed": []},
    )  # fmt: skip
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    worker_url = f"http://127.0.0.1:{free_port()}"
    harness.start_worker(port=int(worker_url.rsplit(":", 1)[1]))
    harness.start_consumer()
    try:
        asyncio.run(produce(config, iter(adult_rows(config)), rate=8000, progress=False))

        async def settled() -> dict | None:
            redis = aioredis.from_url(config.redis_url)
            totals = await harness.totals(redis)
            await redis.aclose()
            done = totals.get("settled", 0)
            return totals if done == RECORDS and totals["in_flight"] == 0 else None

        totals = wait_for(lambda: asyncio.run(settled()), "every record published or suppressed")
        status = wait_for(
            lambda: (
                (s := client.status(harness.url))["consumer"]["records"] == totals["published"]
                and s
            ),
            "the consumer to count every published record",
        )
        assert status["worker"]["ingested"] == RECORDS
        assert status["consumer"]["duplicates"] == 0

        # /estimate equals the batch reconstruction of the rows read back from the topic.
        published = asyncio.run(harness.read(config.topics["published"], totals["published"]))
        assert len(published) == totals["published"]
        write_published_csv(
            tmp_path / "published.csv", config, [json.loads(v) for v in published.values()]
        )
        queries = random_queries(config, 60, seed=5) + [dict(q) for q in config.reports.queries]
        (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
        options = list(BATCH_OPTIONS[mechanism])
        if mechanism == "personal":
            options += ["--merge-map", str(harness.merge_map)]
        batch_command = [
            "query", "--published", str(tmp_path / "published.csv"), *options,
            "--queries", str(tmp_path / "q.jsonl"), "--output", str(tmp_path / "batch.jsonl"),
        ]  # fmt: skip
        assert main(batch_command) == 0
        batch = [json.loads(line) for line in (tmp_path / "batch.jsonl").read_text().splitlines()]
        served = client.ask(harness.url, queries)
        for query, expected, answer in zip(queries, batch, served, strict=True):
            for field in ("estimate", "low", "high"):
                assert answer.get(field) == expected.get(field), (query, expected, answer)
            assert answer["records"] == totals["published"] and answer["method"]

        # GET with the col:val syntax gives the same answer as the POSTed object.
        sensitive = config.sensitive[0]
        first = next(q for q in queries if len(q.get("where", {})) == 2 and "value" in q)
        where = ",".join(
            f"{c}:{v}"
            for c, vs in first["where"].items()
            for v in (vs if isinstance(vs, list) else [vs])
        )
        parameters = urllib.parse.urlencode(
            {"where": where, "value": f"{sensitive}:{first['value'][sensitive]}"}
        )
        code, body = get(f"{harness.url}/estimate?{parameters}")
        assert code == 200 and body["estimate"] == client.ask(harness.url, [first])[0]["estimate"]
        if "age" in config.schema:  # bin labels hold commas: "[17,25)"
            bins = config.schema["age"].domain
            obj = {"where": {"age": list(bins[:2]), "sex": "Male"}, "value": first["value"]}
            where = f"age:{bins[0]},age:{bins[1]},sex:Male"
            parameters = urllib.parse.urlencode(
                {"where": where, "value": f"{sensitive}:{first['value'][sensitive]}"}
            )
            code, body = get(f"{harness.url}/estimate?{parameters}")
            assert code == 200 and body["estimate"] == client.ask(harness.url, [obj])[0]["estimate"]
        for bad, message in [
            ("where=sex", "col:val"),
            (
                f"where=nosuch:x&value={sensitive}:{first['value'][sensitive]}",
                "no such public column",
            ),
            (f"where={sensitive}:x", "is sensitive"),
            ("colour=red", "unknown parameter"),
        ]:
            code, body = get(f"{harness.url}/estimate?{bad}")
            assert code == 400 and message in body["error"], (bad, body)

        # `splu query --url` writes what the batch command writes.
        assert main(["query", "--url", harness.url, "--queries", str(tmp_path / "q.jsonl"),
                     "--output", str(tmp_path / "url.jsonl")]) == 0  # fmt: skip
        over_url = [json.loads(line) for line in (tmp_path / "url.jsonl").read_text().splitlines()]
        assert [a["estimate"] for a in over_url] == [b["estimate"] for b in batch]

        # Re-sent copies are not counted again, and the counts survive a restart.
        copies = dict(list(published.items())[:50])
        asyncio.run(resend(config, copies))
        wait_for(
            lambda: client.status(harness.url)["consumer"]["duplicates"] == len(copies),
            "the consumer to see the re-sent copies",
        )
        harness.consumer.kill()
        harness.start_consumer()
        after = wait_for(
            lambda: (s := client.status(harness.url))["consumer"]["records"] > 0 and s,
            "the restarted consumer",
        )
        assert after["consumer"]["records"] == totals["published"]
        assert [a["estimate"] for a in client.ask(harness.url, queries)] == [
            b["estimate"] for b in batch
        ]

        # The reports topic carries every test of the mechanism, with a verdict and numbers.
        counted_at = time.time()
        wait_for(
            lambda: any(t["time"] > counted_at for t in client.status(harness.url)["tests"]),
            "a report on the complete counts",
        )
        reports = asyncio.run(
            harness.read(config.topics["reports"], 10, key=lambda m: (m.partition, m.offset))
        )
        tests = sorted(
            (t for t in map(json.loads, reports.values()) if t["kind"] == "test"),
            key=lambda t: t["time"],
        )
        assert {t["test"] for t in tests} >= TESTS[mechanism] | {"dp_audit"}
        for test in tests:
            assert isinstance(test["passed"], bool) and test["numbers"], test
        latest = {t["test"]: t for t in tests}
        if mechanism == "decoy":
            assert latest["eligibility"]["passed"] and latest["guarantees"]["passed"]
            assert latest["guarantees"]["numbers"]["T_P"] == pytest.approx(0.2139, abs=1e-4)
        else:
            assert latest["budget"]["passed"] and latest["budget"]["numbers"]["v_g"] == 0
            assert latest["budget"]["numbers"]["plain_v_g"] > 0
        assert latest["adversary"]["passed"], latest["adversary"]
        # It scored cells, and says how, but not how many cells of true counts 1..α exist.
        numbers = latest["adversary"]["numbers"]
        assert numbers["combinations"] > 0 and 0 <= numbers["small_within_share"] <= 1
        assert "small_cells" not in numbers

        # Metrics carry the same numbers as the status: the consumer's for the stream, the
        # worker's for each partition it owns (here all of them).
        stream = {"stream": config.name}
        consumer = metrics(f"{harness.url}/metrics")
        assert consumer["splu_consumer_records", stream] == totals["published"]
        assert consumer["splu_consumer_lag", stream] == 0
        assert consumer["splu_privacy_test_passed", {**stream, "test": "adversary"}] == 1
        worker = metrics(f"{worker_url}/metrics")
        partitions = [str(p) for p in range(config.partitions)]
        assert worker["splu_worker_partitions", stream] == config.partitions
        for state in ("ingested", "published", "suppressed"):
            by_partition = [
                worker["splu_records_total", {**stream, "partition": p, "state": state}]
                for p in partitions
            ]
            assert sum(by_partition) == status["worker"][state] == totals.get(state, 0), state
        delays = [
            worker["splu_publish_delay_seconds_count", {**stream, "partition": p}]
            for p in partitions
        ]
        assert sum(delays) == status["delay"]["count"] == totals["published"]
    finally:
        harness.stop()
