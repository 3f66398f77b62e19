"""`splu produce`: stream a CSV into ``<stream>.raw``, one JSON object per row.

Each row's Kafka key is the response's id (README: Producing): the stream recognises a
response by it on any partition, at any age, however often it is sent. With
``--id-column`` the id is that column's. Without, it is derived from the row's content
and occurrence (`ContentIds`): ``c:<digest of the schema's columns>:<n>``, the n-th row
of the export with that content. A survey exported again with rows appended, or in
another order, gets the same ids for the same rows; identical rows (common in census-like
data) stay distinct responses. Rows are sent in batches and the producer waits for every
acknowledgement; a progress bar is redrawn on stderr when it is a terminal.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from aiokafka import AIOKafkaProducer

from service.cli.progress import progress_bar
from service.core.config import StreamConfig
from service.core.table import csv_reader
from streams.runtime.kafka import client_options, role_topics, start_client
from streams.runtime.topics import create_topics

BATCH = 1000


class ProduceError(ValueError):
    """The input cannot be produced as it is; nothing was sent."""


def rows_of(
    stream: TextIO, config: StreamConfig, id_column: str | None, delimiter: str | None = None
) -> Iterator[tuple[bytes, bytes]]:
    """(key, JSON value) per CSV row, with only the schema's columns; the key is the id
    column's value, or a content id (`ContentIds`)."""
    return ((key, value) for _, key, value in numbered_rows(stream, config, id_column, delimiter))


def numbered_rows(
    stream: TextIO, config: StreamConfig, id_column: str | None, delimiter: str | None = None
) -> Iterator[tuple[int, bytes, bytes]]:
    """(line, key, JSON value) per CSV row as `rows_of` makes them, with the line of the
    input each row ends on (as `splu publish` numbers a rejected row)."""
    header, reader = csv_reader(stream, delimiter)
    missing = [n for n in config.schema.names if n not in header]
    if missing:
        raise ProduceError(
            f"the input has no column {missing[0]!r}; its header is {', '.join(header)}"
        )
    if id_column is not None and id_column not in header:
        raise ProduceError(f"--id-column {id_column!r} is not in the header")
    names = config.schema.names
    content_id = ContentIds() if id_column is None else None
    for row in reader:
        if not row:
            continue  # a blank line, as the csv module skips it
        # A short row's missing fields are null, which the worker rejects by name.
        record = dict(zip(header, row, strict=False))
        value = json.dumps({n: record.get(n) for n in names}, separators=(",", ":")).encode()
        if content_id is not None:
            yield reader.line_num, content_id(value), value
            continue
        key = record.get(id_column)
        if not key:
            raise ProduceError(f"--id-column {id_column!r} is empty on line {reader.line_num}")
        yield reader.line_num, key.encode(), value


class ContentIds:
    """Each value's id: ``c:<BLAKE2b-128 of the value>:<n>``, where the value is the n-th
    (from 1) with that content. An export's rows get the same ids when it is produced
    again whole, grown or reordered: only the order among identical rows changes, and
    they are interchangeable. An export of only the new rows would reuse the ids of
    earlier identical rows: produce the whole export each time, or use an id column."""

    def __init__(self) -> None:
        self.seen: Counter[bytes] = Counter()

    def __call__(self, value: bytes) -> bytes:
        digest = hashlib.blake2b(value, digest_size=16).hexdigest().encode()
        self.seen[digest] += 1
        return b"c:%b:%d" % (digest, self.seen[digest])


async def produce(
    config: StreamConfig,
    rows: Iterator[tuple[bytes | None, bytes]],
    total: int | None = None,
    rate: float | None = None,
    progress: bool = True,
) -> int:
    """Send every row to the raw topic; returns how many were acknowledged.

    The raw topic is created first if missing (and the producer's principal may): a
    producer asking for its metadata would have the broker create it with its default
    partition count."""
    await create_topics(config.kafka, role_topics(config, "producer"))
    producer = AIOKafkaProducer(
        **client_options(config.kafka),
        enable_idempotence=False,
        acks="all",
        linger_ms=5,
        max_batch_size=512 * 1024,
    )
    await start_client(producer, config.kafka)
    sent, started = 0, time.monotonic()
    # Batches of at most a tenth of a second's worth, so a rate is kept smoothly.
    size = min(BATCH, max(1, int(rate / 10))) if rate else BATCH
    with progress_bar(total, "produced", "rec", scale=True, quiet=not progress) as bar:
        try:
            batch: list[asyncio.Future] = []
            for key, value in rows:
                batch.append(await producer.send(config.topics["raw"], value, key=key))
                sent += 1
                if len(batch) >= size:
                    await asyncio.gather(*batch)
                    bar.update(len(batch))
                    batch.clear()
                    if rate:
                        ahead = sent / rate - (time.monotonic() - started)
                        if ahead > 0:
                            await asyncio.sleep(ahead)
            await asyncio.gather(*batch)
            bar.update(len(batch))
        finally:
            await producer.stop()
    return sent


def count_rows(path: Path) -> int | None:
    """Data rows in a plain CSV file (for the progress bar); None when not countable cheaply."""
    if path.suffix == ".gz" or str(path) == "-":
        return None
    with path.open("rb") as stream:
        return max(sum(1 for _ in stream) - 1, 0)
