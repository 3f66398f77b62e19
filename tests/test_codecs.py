"""Any Kafka client, any codec (issue 31; SPEC §3).

Survey platforms write with librdkafka (confluent-kafka and the clients built on it) or
the Java client, usually compressed. On the embedded servers, with a real worker and
consumer:

- the same 1,000 responses, 200 under each codec Kafka defines (none, gzip, snappy, lz4,
  zstd), produced by confluent-kafka with librdkafka's partitioner, then all again by
  aiokafka with its own (murmur2, the Java client's): the worker takes each response in
  once, and the consumer's counts are those of one produce of the 1,000;
- a batch the worker cannot decode (its snappy library hidden from the worker process)
  holds its partition without stopping the worker: it is reported on <stream>.rejected
  with its offsets and reason, counted, exported for the alert, and `splu skip` reads on
  past it, while later batches of the partition wait and are then taken in.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter

import pytest
import redis.asyncio as aioredis
from aiokafka.consumer import fetcher as aiokafka_fetcher
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from confluent_kafka import Producer
from harness import Harness, adult_rows
from test_consumer import wait_for

from deploy.embedded import free_port
from service.store.buffer import BufferState
from service.store.running_counts import RunningCounts
from streams.cli import main
from streams.runtime.bulk import GuardedRecords, undecodable_reason
from streams.runtime.topics import create_topics
from streams.tools.produce import produce
from streams.worker.closing import request_close

pytestmark = pytest.mark.stream

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
PER_CODEC = 200


def librdkafka_produce(
    config, rows: list[tuple[bytes, bytes]], compression: str, partition: int | None = None
) -> None:  # type: ignore[no-untyped-def]
    """`rows` written by librdkafka as a survey platform would: acks=all, the codec, its
    default partitioner (CRC-32 of the key), one batch where they fit."""
    producer = Producer(
        {
            "bootstrap.servers": config.kafka.bootstrap, "acks": "all",
            "compression.type": compression, "linger.ms": 50,
        }
    )  # fmt: skip
    for key, value in rows:
        extra = {} if partition is None else {"partition": partition}
        producer.produce(config.topics["raw"], value, key, **extra)
    assert producer.flush(30) == 0, "librdkafka delivered every message"


async def state(config) -> tuple[dict[str, int], dict[bytes, int]]:  # type: ignore[no-untyped-def]
    client = aioredis.from_url(config.redis_url)
    try:
        return await BufferState(client, config).totals(), await RunningCounts(
            client, config
        ).tally()
    finally:
        await client.aclose()


def test_every_codec_and_partitioner_takes_each_response_in_once(servers, tmp_path):
    harness = Harness(
        servers, tmp_path, "adult-decoy.toml", row_column=False, partitions=3,
        reports={"fail_closed": []},
    )  # fmt: skip
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    rows = adult_rows(config)[: PER_CODEC * len(CODECS)]
    harness.start_worker()
    harness.start_consumer()
    try:
        for i, compression in enumerate(CODECS):
            librdkafka_produce(config, rows[i * PER_CODEC : (i + 1) * PER_CODEC], compression)
        asyncio.run(produce(config, iter(rows), progress=False))
        wait_for(
            lambda: (
                (t := asyncio.run(state(config))[0])["ingested"] + t["redelivered"] >= 2 * len(rows)
            ),
            "the worker to take in every message",
        )
        asyncio.run(request_close(config))
        totals, tally = wait_for(
            lambda: (
                (s := asyncio.run(state(config)))[0]["published"] + s[0]["suppressed"] == len(rows)
                and sum(s[1].values()) == s[0]["published"]
                and s
            ),
            "every record published or suppressed, and counted",
        )
    finally:
        harness.stop()
    assert totals["ingested"] == len(rows) and totals["redelivered"] == len(rows)
    assert totals["rejected"] == 0
    # Counted as one produce of the 1,000: each public cell once per record in it.
    truth = Counter(
        ",".join(str(a.code_of(json.loads(value)[a.name])) for a in config.schema.public)
        for _, value in rows
    )
    counted: Counter[str] = Counter()
    for cell, count in tally.items():
        counted[cell.decode().partition("|")[0]] += count
    assert all(counted[cell] <= truth[cell] for cell in counted), "a record counted twice"
    assert sum(truth.values()) - sum(counted.values()) == totals["suppressed"] < 20


def test_a_batch_the_worker_cannot_decode_holds_its_partition_until_skipped(servers, tmp_path):
    harness = Harness(
        servers, tmp_path, "adult-decoy.toml", row_column=False, partitions=1,
        reports={"fail_closed": []},
    )  # fmt: skip
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    # The worker's Python finds a cramjam that fails to import: aiokafka then has no
    # snappy, lz4 or zstd, as an image built without the codec extras.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "cramjam.py").write_text('raise ImportError("hidden by the test")\n')
    harness.env["PYTHONPATH"] = f"{shadow}:{harness.env.get('PYTHONPATH', '')}"
    port = free_port()
    harness.start_worker(port=port)
    rows = adult_rows(config)[:150]
    try:
        librdkafka_produce(config, rows[:50], "gzip")
        wait_for(lambda: asyncio.run(state(config))[0]["ingested"] == 50, "the gzip batch")
        librdkafka_produce(config, rows[50:100], "snappy")
        librdkafka_produce(config, rows[100:], "gzip")
        totals = wait_for(
            lambda: (t := asyncio.run(state(config))[0])["undecodable"] == 1 and t,
            "the snappy batch to be held",
        )
        time.sleep(3)  # the later gzip batch waits behind it
        assert asyncio.run(state(config))[0]["ingested"] == 50
        assert harness.worker.running, "the worker is up"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as page:
            assert page.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        labels = f'partition="0",stream="{config.name}"'
        assert f"splu_undecodable_batches{{{labels}}} 1.0" in metrics, metrics
        rejected = asyncio.run(harness.read(config.topics["rejected"], 1, key=lambda m: m.offset))
        (report,) = map(json.loads, rejected.values())
        assert report["reason"].startswith("undecodable batch: snappy compression")
        assert (report["partition"], report["last_offset"] - report["offset"]) == (0, 49)

        # The documented way forward: skip it; the later gzip batch is then taken in.
        assert main([
            "skip", "--config", str(harness.path), "--partition", "0",
            "--offset", str(report["offset"]),
        ]) == 0  # fmt: skip
        totals = wait_for(
            lambda: (t := asyncio.run(state(config))[0])["ingested"] == 100 and t,
            "the batch after the skipped one",
        )
        assert totals["undecodable"] == 0 and totals["skipped"] == 50
        reports = asyncio.run(harness.read(config.topics["rejected"], 2, key=lambda m: m.offset))
        reasons = [json.loads(v)["reason"] for v in reports.values()]
        assert reasons[1].startswith("skipped by the operator, undecodable: snappy")
    finally:
        harness.stop()


def test_a_batch_whose_crc_does_not_match_is_refused_not_taken():
    """aiokafka's own CRC check is off in every stream process (`faust_app`): the records
    every fetch is read through (`GuardedRecords`) check each batch's CRC once and stand
    in for a batch whose bytes changed after its CRC was written."""
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=0, is_transactional=0, producer_id=-1, producer_epoch=-1,
        base_sequence=-1, batch_size=1 << 20,
    )  # fmt: skip
    for offset in range(3):
        builder.append(offset, timestamp=None, key=b"k%d" % offset, value=b"{}", headers=[])
    intact = bytes(builder.build())
    changed = intact[:-1] + bytes([intact[-1] ^ 1])
    assert aiokafka_fetcher.PartitionRecords is GuardedRecords
    assert undecodable_reason(DefaultRecordBatch(intact)) is None
    assert undecodable_reason(DefaultRecordBatch(changed)) == "its CRC does not match its contents"
