"""Each wire shape has one owner (`service.core.wire`): what a writer makes of a record, the
owner reads back, for the Python writers and for the Lua steps that write pool entries and
truth cells on the embedded Redis-protocol server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from test_buffer import KEY, T0, adult_messages, ingest_all, stream_config

from service.core.ingest import Preparer
from service.core.published import CellCodec
from service.core.wire import (
    PoolEntry,
    cell_fields,
    cell_key,
    codes_of,
    codes_text,
    published_record,
    read_published,
    shown_fields,
)
from service.store.auditor import TrustedState
from service.store.buffer import StreamBuffer

codes = st.lists(st.integers(0, 10_000), max_size=6)
text = st.binary(max_size=12).filter(lambda b: b"|" not in b)


@given(codes, codes, text, codes, st.integers(0, 2**53), text)
def test_a_pool_entry_reads_back_as_written(public, published, audit, true, arrival, record_id):
    entry = PoolEntry(
        codes_text(public), codes_text(published), audit, codes_text(true), arrival, record_id
    )
    parsed = PoolEntry.parse(entry.encode())
    assert parsed == entry
    assert [codes_of(f) for f in (parsed.public, parsed.published, parsed.true)] == [
        public, published, true
    ]  # fmt: skip
    assert shown_fields(entry.encode()) == (entry.public, entry.published)


@given(codes, codes)
def test_a_cell_key_reads_back_as_written(public, sensitive):
    key = cell_key(codes_text(public), codes_text(sensitive))
    assert [codes_of(f) for f in cell_fields(key)] == [public, sensitive]


@given(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=5))
def test_a_published_record_reads_back_as_written(labels):
    assert read_published(published_record(labels)) == labels


def test_a_published_record_is_a_json_object():
    with pytest.raises(ValueError, match="JSON object"):
        read_published(b"[1, 2]")


@pytest.mark.redis
@pytest.mark.parametrize("example", ["adult-decoy.toml", "adult-personal.toml"])
def test_what_the_lua_steps_write_the_owner_reads(servers, example):
    """Pool entries written by the ingest step and the truth tallies written by
    acknowledge.lua read back through the owner as the records they came from; the
    worker's published JSON of an entry is `published_record`'s, and the consumer counts
    it in the cell the entry shows."""
    config = stream_config(example, partitions=1, max_wait=1000.0, mixing_pool=50)
    preparer = Preparer(config, KEY)
    messages = adult_messages(config, 1000)

    async def scenario():
        client = aioredis.from_url(servers.redis_url)
        buffer = StreamBuffer(client, config, KEY)
        batches, _ = await ingest_all(buffer, preparer, messages, T0)
        taken = await buffer.take(0, T0, 10_000)
        await buffer.acknowledge(0, taken, T0)
        tallies = {}
        async for key in client.scan_iter(match=f"{buffer.prefix(0)}:truth:*"):
            side = key.decode().split(":")[-2]
            tallies[side] = {c: int(n) for c, n in (await client.hgetall(key)).items()}
        truth = await TrustedState(client, config).truth()
        await client.aclose()
        return batches, [entry for _, entry in taken], tallies, truth

    batches, entries, tallies, truth = asyncio.run(scenario())
    assert len(entries) > 100
    sent = {
        record_id: public
        for batch in batches
        for record_id, public in zip(batch.id_bytes(), batch.public, strict=True)
    }
    names = config.schema.names
    codec = CellCodec(config.schema)
    shown: dict[bytes, int] = {}
    true: dict[bytes, int] = {}
    for raw in entries:
        entry = PoolEntry.parse(raw)
        assert entry.encode() == raw
        assert (entry.public, entry.arrival) == (sent[entry.id], T0)
        assert len(codes_of(entry.published)) == len(config.schema.sensitive)
        assert len(codes_of(entry.true)) == len(config.schema.sensitive)
        value = preparer.published_json(raw)
        labels = preparer.decode(raw)
        assert value == published_record({n: labels[n] for n in names})
        key = cell_key(entry.public, entry.published)
        assert codec.key_of(value) == key
        shown[key] = shown.get(key, 0) + 1
        true_key = cell_key(entry.public, entry.true)
        true[true_key] = true.get(true_key, 0) + 1
    assert tallies == {"true": true, "shown": shown}
    assert truth == (true, shown)
