"""The Faust, mode and aiokafka internals `streams.runtime.faust_adapter` overrides are
there, as it was written against them: an upgrade of any of the three fails here, naming
the member that moved, before a stream test fails somewhere deep in the bulk path."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from aiokafka.structs import ConsumerRecord, TopicPartition

from streams.runtime import faust_adapter

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("distribution", sorted(faust_adapter.TESTED_WITH))
def test_the_installed_version_is_the_one_the_adapter_was_checked_against(distribution):
    installed = importlib.metadata.version(distribution)
    assert installed == faust_adapter.TESTED_WITH[distribution], (
        f"{distribution} {installed} is installed; streams/runtime/faust_adapter.py was "
        f"checked against {faust_adapter.TESTED_WITH[distribution]}: check each member of "
        "RELIED_ON against the new version, then update TESTED_WITH"
    )


def _sets(owner: type, name: str) -> bool:
    """Whether some class of `owner`'s MRO declares `name` or assigns self.<name>."""
    for cls in inspect.getmro(owner):
        if name in vars(cls) or name in getattr(cls, "__annotations__", {}):
            return True
        init = vars(cls).get("__init__")
        if inspect.isfunction(init) and f"self.{name} =" in inspect.getsource(init):
            return True
    return False


@pytest.mark.parametrize(
    ("owner", "name", "parameters"),
    faust_adapter.RELIED_ON,
    ids=[f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in faust_adapter.RELIED_ON],
)
def test_every_private_member_the_adapter_relies_on_is_there(owner, name, parameters):
    if parameters is None:
        assert hasattr(owner, name) or (isinstance(owner, type) and _sets(owner, name)), (
            f"{owner!r} no longer has {name}"
        )
        return
    member = inspect.getattr_static(owner, name)
    assert inspect.isfunction(member), f"{owner.__name__}.{name} is no longer a method"
    assert tuple(inspect.signature(member).parameters) == parameters


def test_the_adapter_overrides_only_members_it_declares():
    """Every underscore method the adapter's classes define overrides one of RELIED_ON, so
    the list stays the whole of what an upgrade must be checked for."""
    declared = {name for _, name, _ in faust_adapter.RELIED_ON}
    classes = [
        faust_adapter.ShortWaitConsumerThread,
        faust_adapter.FetchConsumer,
        faust_adapter.StoppingRecords,
    ]
    overridden = {
        name
        for cls in classes
        for name, value in vars(cls).items()
        if name.startswith("_") and not name.startswith("__") and inspect.isfunction(value)
    }
    assert overridden <= declared, overridden - declared


def test_no_other_module_touches_those_members():
    """The adapter is the one place: no other module of the stream names a private member
    it relies on."""
    names = {name for _, name, _ in faust_adapter.RELIED_ON if name.startswith("_")}
    adapter = Path(faust_adapter.__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "streams").rglob("*.py"))
        if path.resolve() != adapter
        for name in names
        if re.search(rf"\b{re.escape(name)}\b", path.read_text(encoding="utf-8"))
    ]
    assert not found, found


def _messages(count: int) -> list[tuple[bytes | None, bytes]]:
    return [
        (None if i % 7 == 0 else b"key%d" % i, b'{"n":"%d"}' % i * (1 + i % 5))
        for i in range(count)
    ]


def test_fill_batch_builds_the_batches_append_builds():
    """Byte for byte, split where `BatchBuilder.append` splits them, with the same counts."""
    messages, timestamp = _messages(300), 1_700_000_000_000

    def appended() -> list[BatchBuilder]:
        batches = [BatchBuilder(2_000, 0)]
        for key, value in messages:
            if batches[-1].append(key=key, value=value, timestamp=timestamp) is None:
                batches.append(BatchBuilder(2_000, 0))
                batches[-1].append(key=key, value=value, timestamp=timestamp)
        return batches

    def filled() -> list[BatchBuilder]:
        batches, queued = [], messages
        while queued:
            batches.append(BatchBuilder(2_000, 0))
            queued = queued[faust_adapter.fill_batch(batches[-1], queued, timestamp) :]
        return batches

    expected, got = appended(), filled()
    assert len(expected) > 3
    assert [b.record_count() for b in got] == [b.record_count() for b in expected]
    assert [bytes(b._build()) for b in got] == [bytes(b._build()) for b in expected]


@pytest.mark.parametrize("deserialized", [False, True])
def test_fetched_records_hold_what_aiokafkas_records_hold(deserialized):
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, 0, 1 << 20)
    for offset, (key, value) in enumerate(_messages(50)):
        builder.append(offset, 1_700_000_000_000 + offset, key, value, [("h", b"v")] * (offset % 2))
    data = bytes(builder.build())
    tp = TopicPartition("raw", 3)

    def unpacked(records: type) -> list:
        state = records.__new__(records)
        # A deserializer (never the stream's, which reads bytes) leaves aiokafka's own.
        state._key_deserializer = state._value_deserializer = str if deserialized else None
        return [state._consumer_record(tp, record) for record in DefaultRecordBatch(data)]

    names = [f.name for f in dataclasses.fields(ConsumerRecord)]
    assert list(faust_adapter.FetchedRecord._fields) == names

    def fields(records: list) -> list[tuple]:
        return [tuple(getattr(r, name) for name in names) for r in records]

    theirs, ours = unpacked(PartitionRecords), unpacked(faust_adapter.StoppingRecords)
    assert fields(ours) == fields(theirs) != []
    assert all(isinstance(r, ConsumerRecord) == deserialized for r in ours)
