"""A survey exported more than once, and responses re-sent by other clients (issue 29).

A response's identity is the stream's: nothing may be randomized twice, whoever sends it
again, to whichever raw partition, in whatever order. On the embedded servers, with a real
worker and consumer: a 2,000-row export produced by `splu produce` with its default ids
(row content and occurrence), then the same export grown by 100 rows and shuffled, then
300 responses with ids of their own (`--id-column`), which a plain aiokafka producer then
re-sends to every other raw partition. Then the stream closes.

The worker must have accepted 2,100 + 300 records, recognising the other 2,000 + 600 as
sent before; every one is published or suppressed, and the consumer's counts are those of
one clean produce of the 2,400: the same number of records in every public cell (public
values are published as they are; which sensitive value a record publishes depends on its
group, hence on arrival order, so that part of a count differs between any two runs).
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from harness import Harness
from test_consumer import wait_for

from service.core.table import open_sample
from service.store.running_counts import RunningCounts
from streams.cli import main
from streams.runtime.topics import create_topics
from streams.worker.closing import request_close

pytestmark = pytest.mark.stream

PARTITIONS = 3
EXPORT, APPENDED, KEYED = 2000, 100, 300


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


async def resend(config, rows: list[dict[str, str]]) -> int:
    """Each keyed row to every raw partition but the one `splu produce` sent it to (the
    default partitioner's), by a plain producer: how many messages."""
    producer = AIOKafkaProducer(bootstrap_servers=config.kafka.bootstrap, acks="all")
    await producer.start()
    partitioner, everyone = DefaultPartitioner(), list(range(PARTITIONS))
    sent = 0
    try:
        for row in rows:
            key = row["respondent"].encode()
            value = json.dumps({n: row[n] for n in config.schema.names}).encode()
            first = partitioner(key, everyone, everyone)
            for partition in everyone:
                if partition != first:
                    await producer.send_and_wait(
                        config.topics["raw"], value, key=key, partition=partition
                    )
                    sent += 1
    finally:
        await producer.stop()
    return sent


async def stream_state(harness: Harness) -> tuple[dict[str, int], dict[bytes, int]]:
    redis = aioredis.from_url(harness.config.redis_url)
    try:
        return await harness.totals(redis), await RunningCounts(redis, harness.config).tally()
    finally:
        await redis.aclose()


def test_a_reexport_and_resent_responses_are_randomized_once(servers, tmp_path):
    harness = Harness(
        servers, tmp_path, "adult-decoy.toml", row_column=False, partitions=PARTITIONS,
        reports={"fail_closed": []},
    )  # fmt: skip
    config = harness.config
    with open_sample() as stream:
        sample = list(csv.DictReader(stream))
    first, grown = tmp_path / "export-1.csv", tmp_path / "export-2.csv"
    write_csv(first, sample[:EXPORT])
    again = sample[: EXPORT + APPENDED]
    random.Random(29).shuffle(again)
    write_csv(grown, again)
    keyed_rows = [
        {"respondent": f"resp-{i}", **row}
        for i, row in enumerate(sample[EXPORT + APPENDED : EXPORT + APPENDED + KEYED])
    ]
    keyed = tmp_path / "keyed.csv"
    write_csv(keyed, keyed_rows)

    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    harness.start_worker()
    harness.start_consumer()
    try:
        produce = ["produce", "--config", str(harness.path), "--input"]
        assert main([*produce, str(first)]) == 0
        assert main([*produce, str(grown)]) == 0
        assert main([*produce, str(keyed), "--id-column", "respondent"]) == 0
        resent = asyncio.run(resend(config, keyed_rows))
        sent = EXPORT + len(again) + KEYED + resent
        assert resent == KEYED * (PARTITIONS - 1)
        wait_for(
            lambda: (
                (t := asyncio.run(stream_state(harness))[0])["ingested"]
                + t["redelivered"]
                + t["rejected"]
                >= sent
            ),
            "the worker to take in every message",
        )
        asyncio.run(request_close(config))
        totals, tally = wait_for(
            lambda: (
                (s := asyncio.run(stream_state(harness)))[0]["published"] + s[0]["suppressed"]
                == EXPORT + APPENDED + KEYED
                and sum(s[1].values()) == s[0]["published"]
                and s
            ),
            "every accepted record published or suppressed, and counted",
        )
    finally:
        harness.stop()

    unique = EXPORT + APPENDED + KEYED
    assert totals["ingested"] == unique, totals
    assert totals["rejected"] == totals["conflicts"] == 0
    assert totals["redelivered"] == sent - unique == EXPORT + resent
    # Counted as one clean produce of the 2,400 would be: each public cell holds the
    # records of that cell, each once (the suppressed ones, found no group at the close or
    # after max_wait, aside).
    public = list(config.schema.public)
    truth = Counter(
        ",".join(str(a.code_of(row[a.name])) for a in public) for row in sample[:unique]
    )
    counted: Counter[str] = Counter()
    for cell, count in tally.items():
        counted[cell.decode().partition("|")[0]] += count
    assert sum(counted.values()) == totals["published"] == unique - totals["suppressed"]
    assert all(counted[cell] <= truth[cell] for cell in counted), "a record counted twice"
    missing = sum(truth.values()) - sum(counted.values())
    assert missing == totals["suppressed"] < 0.02 * unique
