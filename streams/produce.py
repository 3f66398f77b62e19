"""`splu produce`: stream a CSV into ``<stream>.raw``, one JSON object per row.

Each row's Kafka key is a record id, ``<file digest>:<line>`` unless a column
holds one, so producing the same file twice stores every record once, another
file never collides with it, and a record always lands on the same partition.
Rows are sent in batches and the producer waits for every acknowledgement; a
progress bar is redrawn on stderr when it is a terminal.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from aiokafka import AIOKafkaProducer

from service.config import StreamConfig
from service.progress import progress_bar
from streams.topics import create_topics

BATCH = 1000


class ProduceError(ValueError):
    """The input cannot be produced as it is; nothing was sent."""


def rows_of(
    stream: TextIO, config: StreamConfig, source: str | None, id_column: str | None
) -> Iterator[tuple[bytes | None, bytes]]:
    """(key, JSON value) per CSV row, with only the schema's columns."""
    reader = csv.DictReader(stream)
    header = reader.fieldnames or []
    missing = [n for n in config.schema.names if n not in header]
    if missing:
        raise ProduceError(
            f"the input has no column {missing[0]!r}; its header is {', '.join(header)}"
        )
    if id_column is not None and id_column not in header:
        raise ProduceError(f"--id-column {id_column!r} is not in the header")
    names = config.schema.names
    for row in reader:
        if id_column is not None:
            key = row[id_column].encode()
        else:
            key = f"{source}:{reader.line_num}".encode()
        yield key, json.dumps({n: row.get(n) for n in names}, separators=(",", ":")).encode()


async def produce(
    config: StreamConfig,
    rows: Iterator[tuple[bytes | None, bytes]],
    total: int | None = None,
    rate: float | None = None,
    progress: bool = True,
) -> int:
    """Send every row to the raw topic; returns how many were acknowledged.

    The stream's topics are created first if missing: a producer asking for the raw
    topic's metadata would have the broker create it with its default partition count."""
    await create_topics(config.kafka_bootstrap, config.topic_partitions)
    producer = AIOKafkaProducer(
        bootstrap_servers=config.kafka_bootstrap,
        enable_idempotence=False,
        acks="all",
        linger_ms=5,
        max_batch_size=512 * 1024,
    )
    try:
        await producer.start()
    except BaseException:
        await producer.stop()
        raise
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


def file_digest(path: Path) -> str:
    """A short content digest of a file: the namespace of its default record ids."""
    digest = hashlib.blake2b(digest_size=8)
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def count_rows(path: Path) -> int | None:
    """Data rows in a plain CSV file (for the progress bar); None when not countable cheaply."""
    if path.suffix == ".gz" or str(path) == "-":
        return None
    with path.open("rb") as stream:
        return max(sum(1 for _ in stream) - 1, 0)
