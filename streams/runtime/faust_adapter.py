"""Every private member of Faust, mode and aiokafka this project touches, in one place.

The bulk path (`streams.runtime.bulk`) replaces Faust's per-message delivery with whole
fetches, keeps the broker's hold on an empty fetch short, and stops a partition at a
batch it cannot decode; fetched records and published batches are made without aiokafka's
per-record Python layers (`FetchedRecord`, `fill_batch`). None of that has a public hook,
so this module overrides the few private methods and attributes it needs and offers the
rest of the project public ones instead (`FetchConsumer`, `StoppingRecords`,
`fill_batch`, `consumer_exists`). `RELIED_ON` lists each
private member with the signature it was written against and `TESTED_WITH` the versions,
and tests/test_faust_adapter.py checks both against what is installed, so that an upgrade
that moves one of them fails there, by name, rather than deep in a stream test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import faust
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer import fetcher as aiokafka_fetcher
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import ConsumerRecord
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from mode import ServiceT

# The installed versions these overrides were checked against.
TESTED_WITH = {"faust-streaming": "0.15.3", "mode-streaming": "0.7.1", "aiokafka": "0.14.0"}

# (owner, member, parameters): the private methods overridden or called here, with the
# parameters each was written against; None marks an attribute read or written.
RELIED_ON: tuple[tuple[Any, str, tuple[str, ...] | None], ...] = (
    (faust_aiokafka.Consumer, "_new_consumer_thread", ("self",)),
    (faust_aiokafka.Consumer, "_drain_messages", ("self", "fetcher")),
    (faust_aiokafka.Consumer, "_commit_offsets", ("self", "offsets", "start_new_transaction")),
    (faust_aiokafka.Consumer, "_wait_next_records", ("self", "timeout")),
    (faust_aiokafka.Consumer, "_read_offset", None),
    (faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", ("self", "transport")),
    (faust.App, "_consumer", None),
    (AIOKafkaConsumer, "_fetch_max_wait_ms", None),
    (aiokafka_fetcher.PartitionRecords, "_unpack_records", ("self",)),
    (aiokafka_fetcher.PartitionRecords, "_records", None),
    (aiokafka_fetcher.PartitionRecords, "_tp", None),
    (aiokafka_fetcher.PartitionRecords, "_consumer_record", ("self", "tp", "record")),
    (aiokafka_fetcher.PartitionRecords, "_key_deserializer", None),
    (aiokafka_fetcher.PartitionRecords, "_value_deserializer", None),
    (aiokafka_fetcher, "PartitionRecords", None),
    (BatchBuilder, "_builder", None),
    (BatchBuilder, "_relative_offset", None),
    (DefaultRecordBatchBuilder, "append", None),
)


def consumer_exists(app: faust.App) -> bool:
    """Whether `app` has built its consumer (after which its transport is fixed)."""
    return app._consumer is not None  # type: ignore[attr-defined]


def compression_of(batch: Any) -> int:
    """The codec code of a fetched record batch (0: none). A message set of the old
    formats (v0, v1) keeps it privately."""
    compression = getattr(batch, "compression_type", None)
    return getattr(batch, "_compression_type", 0) if compression is None else compression


class ShortWaitConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's consumer thread, whose aiokafka consumer has the broker hold a fetch that
    finds no records for `fetch_max_wait_ms`, not the wait Faust fixes."""

    fetch_max_wait_ms = 500

    def _create_worker_consumer(self, transport: faust_aiokafka.Transport) -> AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # Read when the consumer starts (AIOKafkaConsumer.start creates its Fetcher).
        if not hasattr(consumer, "_fetch_max_wait_ms"):
            raise RuntimeError("this aiokafka keeps no _fetch_max_wait_ms to shorten")
        consumer._fetch_max_wait_ms = self.fetch_max_wait_ms
        return consumer


class FetchConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer with its delivery loop replaced by `drain`, which takes
    whole fetches (`next_fetch`) and commits them (`commit_fetch`) itself. Faust keeps
    group membership, rebalancing, flow control and the commits' bookkeeping."""

    thread_class: type[ShortWaitConsumerThread] = ShortWaitConsumerThread

    def _new_consumer_thread(self) -> ShortWaitConsumerThread:
        return self.thread_class(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: ServiceT) -> None:
        await self.drain(lambda: self.should_stop or fetcher.should_stop)

    async def drain(self, stopping: Callable[[], bool]) -> None:
        """Take and handle fetches until `stopping()`."""
        raise NotImplementedError

    async def next_fetch(
        self, timeout: float
    ) -> tuple[Mapping[TP, list[ConsumerRecord]] | None, set[TP] | None]:
        """The next fetch's records by partition, waiting up to `timeout` seconds, and the
        partitions whose records may be used (None: all)."""
        return await self._wait_next_records(timeout)

    def mark_read(self, tp: TP, offset: int) -> None:
        """Record that `tp` was read through `offset`, as Faust's own delivery does."""
        self._read_offset[tp] = offset

    async def commit_fetch(self, offsets: Mapping[TP, int]) -> None:
        """Commit each partition's next offset to read; Faust discards those of
        partitions revoked meanwhile."""
        await self._commit_offsets(offsets)


class _ReadableBatches:
    """The record batches of one fetched partition, up to the first one `refuse` gives a
    reason for, which is kept aside (`refused`)."""

    def __init__(self, records: Any, refuse: Callable[[Any], str | None]) -> None:
        self._records = records
        self._refuse = refuse
        self._ahead: Any = None
        self.refused: tuple[Any, str] | None = None

    def has_next(self) -> bool:
        if self._ahead is None and self.refused is None and self._records.has_next():
            batch = self._records.next_batch()
            reason = self._refuse(batch)
            if reason is None:
                self._ahead = batch
            else:
                self.refused = (batch, reason)
        return self._ahead is not None

    def next_batch(self) -> Any:
        batch, self._ahead = self._ahead, None
        return batch


class FetchedRecord(NamedTuple):
    """A fetched record with the fields of aiokafka's ConsumerRecord, made by one C call
    instead of a dataclass's __init__: the worker's consumer thread makes one per record."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    timestamp_type: int
    key: bytes | None
    value: bytes | None
    checksum: int | None
    serialized_key_size: int
    serialized_value_size: int
    headers: tuple


_new_fetched_record = tuple.__new__


class StoppingRecords(aiokafka_fetcher.PartitionRecords):
    """aiokafka's records of one fetched partition, which end at the first batch `refuse`
    gives a reason for, with the record `stand_in` makes of it instead of the batch's
    records. The partition's position stays at that batch. Installed for every fetch by
    `install_records`."""

    @staticmethod
    def refuse(batch: Any) -> str | None:
        """Why the batch is not to be unpacked, or None."""
        return None

    @staticmethod
    def stand_in(topic: str, partition: int, batch: Any, reason: str) -> ConsumerRecord:
        """The record that ends a partition's records in place of a refused batch."""
        raise NotImplementedError

    def _consumer_record(self, tp: Any, record: Any) -> Any:
        if self._key_deserializer or self._value_deserializer:
            return super()._consumer_record(tp, record)
        key, value = record.key, record.value
        return _new_fetched_record(
            FetchedRecord,
            (
                tp.topic, tp.partition, record.offset, record.timestamp, record.timestamp_type,
                key, value, record.checksum, -1 if key is None else len(key),
                -1 if value is None else len(value), tuple(record.headers),
            ),
        )  # fmt: skip

    def _unpack_records(self):  # type: ignore[no-untyped-def]
        batches = self._records = _ReadableBatches(self._records, self.refuse)
        yield from super()._unpack_records()
        if batches.refused is not None:
            batch, reason = batches.refused
            yield self.stand_in(self._tp.topic, self._tp.partition, batch, reason)


_NO_HEADERS: list = []


def fill_batch(
    batch: BatchBuilder, messages: Sequence[tuple[bytes | None, bytes]], timestamp_ms: int | None
) -> int:
    """Append `messages` to `batch` in order until it is full; how many it took (into an
    empty batch, at least one). `BatchBuilder.append` does the same one keyword call and
    serializer check at a time; a publisher's messages are bytes already, without headers.
    """
    builder, offset = batch._builder, batch._relative_offset
    append = builder.append
    for key, value in messages:
        if append(offset, timestamp_ms, key, value, _NO_HEADERS) is None:
            batch.close()
            break
        offset += 1
    taken = offset - batch._relative_offset
    batch._relative_offset = offset
    return taken


def install_records(records: type[StoppingRecords]) -> None:
    """Have aiokafka build every fetched partition's records as `records`: its fetcher
    looks the class up by this module attribute."""
    aiokafka_fetcher.PartitionRecords = records  # type: ignore[misc]
