"""The worker's per-record Kafka parts beside aiokafka's own, in one run: CPU per record of
making fetched records and of filling a take's batches.

- **fetched records**: a record batch of --records Adult records, as the broker returns
  it, unpacked into aiokafka's `ConsumerRecord`s (`PartitionRecords._consumer_record`)
  and into the worker's `FetchedRecord`s (`streams.runtime.faust_adapter.StoppingRecords`).
- **filled batches**: takes of --take records (pool entries of the decoy example's
  records, 4 partitions) sent as `Publisher.send_all` sends them, the published JSON
  included: one `BatchBuilder.append` per record, to the partition of each token by a
  call each, against the worker's `partitions_of` and `fill_batch`. No broker: the
  batches are built, not sent.

Each figure is the best of --repeat timings; the two sides of a row alternate within one
process, so the machine's drift hits both alike.

Run from the repository root:

    .venv/bin/python bench/kafka_records.py
"""

from __future__ import annotations

import argparse
import os
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from aiokafka.structs import TopicPartition
from report import print_table
from stream_throughput import adult_rows, example_document, messages_of, resample

from service.core.config import parse_config
from service.core.decoy_cuts import Arrivals, DecoyPartition
from service.core.ingest import Preparer, RawMessage
from service.store.buffer import Emission
from streams.runtime.app import partition_of, partitions_of
from streams.runtime.faust_adapter import StoppingRecords, fill_batch

PARTITIONS = 4
BATCH_BYTES = 512 * 1024  # the publisher's max_batch_size
NOW_MS = 1_000_000


def fetched_batch(messages: list[tuple[bytes, bytes]]) -> bytes:
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, 0, 1 << 30)
    for offset, (key, value) in enumerate(messages):
        builder.append(offset, NOW_MS, key, value, [])
    return bytes(builder.build())


def unpacker(records: type) -> Callable[[bytes], list]:
    """Every record of a fetched batch, made as `records._consumer_record` makes them."""
    state = records.__new__(records)
    state._key_deserializer = state._value_deserializer = None
    tp = TopicPartition("raw", 0)
    make = state._consumer_record
    return lambda data: [make(tp, record) for record in DefaultRecordBatch(data)]


def takes_of(preparer: Preparer, messages: list[tuple[bytes, bytes]], take: int) -> list[Emission]:
    """The decoy example's pool entries of `messages`, as takes of `take` records."""
    raw = [RawMessage(i % PARTITIONS, i // PARTITIONS, k, v) for i, (k, v) in enumerate(messages)]
    batches, _ = preparer.prepare(raw)
    held = {p: DecoyPartition(-1, 0, 0, {}) for p in range(PARTITIONS)}
    entries: list[bytes] = []
    for batch in batches:
        columns = (batch.sensitive[:, 0].tolist(), batch.draws[:, 0].tolist())
        offsets = [m.offset for m in batch.messages]
        arrivals = Arrivals(batch.id_bytes(), batch.public, *columns, offsets)
        step = held[batch.partition].step(arrivals, NOW_MS, -1, 5_000, 5, "bench")
        entries += step.pool_entries
    return [
        Emission.of_take(f"take{start}", entries[start : start + take])
        for start in range(0, len(entries), take)
    ]


def appended(preparer: Preparer) -> Callable[[Emission], list[BatchBuilder]]:
    """A take's batches filled as aiokafka's `BatchBuilder.append` takes records."""

    def fill(items: Emission) -> list[BatchBuilder]:
        messages = ((token.encode(), preparer.published_json(entry)) for token, entry in items)
        batches: dict[int, BatchBuilder] = {}
        full = []
        for key, value in messages:
            partition = partition_of(key, PARTITIONS)
            batch = batches.get(partition)
            if batch is None or batch.append(key=key, value=value, timestamp=NOW_MS) is None:
                if batch is not None:
                    full.append(batch)
                batch = batches[partition] = BatchBuilder(BATCH_BYTES, 0)
                batch.append(key=key, value=value, timestamp=NOW_MS)
        return full + list(batches.values())

    return fill


def filled(preparer: Preparer) -> Callable[[Emission], list[BatchBuilder]]:
    """A take's batches filled as `Publisher.send_all` fills them."""

    def fill(items: Emission) -> list[BatchBuilder]:
        pairs = [(token.encode(), preparer.published_json(entry)) for token, entry in items]
        keys = [key for key, _ in pairs]
        queues: dict[int, list[tuple[bytes, bytes]]] = {}
        for pair, partition in zip(pairs, partitions_of(keys, PARTITIONS), strict=True):
            queues.setdefault(partition, []).append(pair)
        batches = []
        for queued in queues.values():
            while queued:
                batch = BatchBuilder(BATCH_BYTES, 0)
                queued = queued[fill_batch(batch, queued, NOW_MS) :]
                batches.append(batch)
        return batches

    return fill


def best_us(run: Callable[[], object], records: int, repeat: int) -> float:
    return min(timeit.repeat(run, number=3, repeat=repeat)) / 3 / records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description="CPU per record of the worker's fetched records and filled batches "
        "beside aiokafka's own, side by side in one run."
    )
    parser.add_argument("--records", type=int, default=20_000, help="records (default 20000)")
    parser.add_argument("--take", type=int, default=2_000, help="records per take (default 2000)")
    parser.add_argument("--repeat", type=int, default=7, help="timings per side (default 7)")
    args = parser.parse_args()
    if min(args.records, args.take, args.repeat) < 1:
        parser.error("--records, --take and --repeat must be positive")
    os.environ.setdefault("SPLU_SERVICE_KEY", "00" * 32)
    document = example_document()
    config = parse_config(document, "bench", Path.cwd())
    rows = resample(adult_rows(), args.records, np.random.default_rng(0))
    messages = messages_of(rows, config.schema.names)
    preparer = Preparer(config, config.service_key())
    data = fetched_batch(messages)
    takes = takes_of(preparer, messages, args.take)
    entries = sum(map(len, takes))
    sides = {
        "fetched records": (
            [("aiokafka ConsumerRecord", unpacker(PartitionRecords)),
             ("FetchedRecord", unpacker(StoppingRecords))],
            lambda make: make(data), args.records,
        ),
        "filled batches": (
            [("BatchBuilder.append", appended(preparer)), ("fill_batch", filled(preparer))],
            lambda fill: [fill(take) for take in takes], entries,
        ),
    }  # fmt: skip
    print(f"{args.records:,} Adult records; takes of {args.take:,}; best of {args.repeat}")
    rows = []
    for part, (variants, run, count) in sides.items():
        times = [float("inf")] * len(variants)
        for _ in range(2):  # alternating, each side's best kept
            for k, (_, make) in enumerate(variants):
                measured = best_us(lambda run=run, make=make: run(make), count, args.repeat)
                times[k] = min(times[k], measured)
        for (name, _), us in zip(variants, times, strict=True):
            rows.append([part, name, f"{us:.2f}", f"{us / times[0]:.2f}"])
    print_table(["part", "side", "µs per record", "/ aiokafka's"], rows)


if __name__ == "__main__":
    main()
