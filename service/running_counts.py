"""Running counts of published cells (SPEC §4), kept in Redis so they survive restarts.

A *cell* is one combination of every published column: public values and
published sensitive values. The consumer counts each published record once,
by its dedup token, in a single Lua step (``service/lua/count.lua``): a
record the worker re-sent after a crash, however much later, carries the token
it had, and a batch redelivered to a consumer that died before committing its
offsets brings tokens already counted; both are skipped and counted as
duplicates. Tokens are remembered as 64-bit fingerprints (6 bytes each in
Redis) for the life of the stream.

Cells are written as ``"public codes|sensitive codes"`` (codes comma-separated,
schema order), the same text the buffer's truth tally uses, so published and
true counts read back into `PublishedCells` the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis

from service.buffer import Replication, lua_script
from service.config import StreamConfig
from service.reconstruct import (
    DecoyReconstruction,
    PersonalReconstruction,
    PublishedCells,
    Reconstruction,
)
from service.schema import Schema


class PublishedRecordError(ValueError):
    """A message on the published topic that the stream's schema cannot read."""


# Distinct published values whose cell is remembered: at ~200 bytes each, ~40 MB at most.
KNOWN_VALUES = 200_000


class CellCodec:
    """Published JSON records to cell keys and cell tallies to `PublishedCells`."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        codes = {a.name: {label: i for i, label in enumerate(a.domain)} for a in schema.attributes}
        self._public = [(a.name, codes[a.name]) for a in schema.public]
        self._sensitive = [(a.name, codes[a.name]) for a in schema.sensitive]
        self._known: dict[bytes, bytes] = {}

    def key_of(self, value: bytes) -> bytes:
        """The cell of one published record; raises PublishedRecordError if unreadable.

        Workers write a cell's records byte for byte alike, so a stream has about as
        many distinct values as cells: each is parsed once (up to KNOWN_VALUES of them).
        """
        key = self._known.get(value)
        if key is None:
            key = self._parse(value)
            if len(self._known) >= KNOWN_VALUES:
                self._known.clear()
            self._known[value] = key
        return key

    def _parse(self, value: bytes) -> bytes:
        try:
            record = json.loads(value)
            public = ",".join(str(codes[record[name]]) for name, codes in self._public)
            sensitive = ",".join(str(codes[record[name]]) for name, codes in self._sensitive)
        except (ValueError, KeyError, TypeError) as err:
            raise PublishedRecordError(f"not a published record of this schema ({err})") from None
        if len(record) != len(self._public) + len(self._sensitive):
            raise PublishedRecordError("a published record carries attributes beyond the schema")
        return f"{public}|{sensitive}".encode()

    def cells(self, tally: Mapping[bytes, int]) -> PublishedCells:
        """A tally of cell keys as `PublishedCells` over the schema's domains."""
        names = self.schema.names
        order = [a.name for a in self.schema.public] + [a.name for a in self.schema.sensitive]
        # One split of all keys at once: tallies hold tens of thousands of cells.
        blob = b",".join(tally).replace(b"|", b",")
        codes = np.array(blob.split(b","), dtype=np.int32) if tally else np.empty(0, np.int32)
        rows = codes.reshape(len(tally), len(order))
        counts = np.fromiter(tally.values(), dtype=np.int64, count=len(tally))
        position = {name: i for i, name in enumerate(order)}
        cells = rows[:, [position[n] for n in names]]
        domains = {a.name: a.domain for a in self.schema.attributes}
        return PublishedCells(names, domains, cells, counts)


@dataclass(frozen=True)
class CountedBatch:
    new: int
    duplicates: int


class LegacyCountsError(RuntimeError):
    """Counts kept by a consumer from before the counts were sharded by published partition."""


class RunningCounts:
    """The consumer's published-cell counts and the tokens already counted, one shard per
    partition of ``<stream>.published`` (``splu:{<stream>:consumer:<partition>}``, a hash
    slot each), so consumers in one group split the counting and a Redis Cluster spreads
    it. A token always lands in the same partition (`streams.app.partition_of`), so each
    shard's dedup sees every copy of its records. Reads merge all shards."""

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        self.client = client
        self.partitions = config.partitions
        self.name = config.name
        self.codec = CellCodec(config.schema)
        self.replication = Replication(client, config)
        self._count = client.register_script(lua_script("fingerprints", "count"))

    def prefix(self, partition: int) -> str:
        return f"splu:{{{self.name}:consumer:{partition}}}"

    async def add(
        self, partition: int, tokens: Sequence[bytes], cells: Sequence[bytes]
    ) -> CountedBatch:
        """Count each (token, cell) of one published partition whose token was never
        counted before."""
        args = [
            item
            for token, cell in zip(tokens, cells, strict=True)
            for item in (hashlib.blake2b(token, digest_size=8).digest(), cell)
        ]
        keys = [f"{self.prefix(partition)}:{name}" for name in ("seen", "cells", "stats")]
        new, duplicates = await self._count(keys=keys, args=args)
        await self.replication.confirm(self.prefix(partition))
        return CountedBatch(int(new), int(duplicates))

    async def tally(self) -> dict[bytes, int]:
        """Every cell's count, summed over the shards."""
        out: dict[bytes, int] = {}
        for cells in await self._every_shard("cells"):
            for cell, count in cells.items():
                out[cell] = out.get(cell, 0) + int(count)
        return out

    async def stats(self) -> dict[str, int]:
        """records and duplicates, summed over the shards."""
        out: dict[str, int] = {}
        for counters in await self._every_shard("stats"):
            for name, value in counters.items():
                out[name.decode()] = out.get(name.decode(), 0) + int(value)
        return out

    async def _every_shard(self, name: str) -> list[dict[bytes, bytes]]:
        """HGETALL of one hash of every shard, in one pipeline (one round trip per node)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for partition in range(self.partitions):
                pipe.hgetall(f"{self.prefix(partition)}:{name}")
            return await pipe.execute()

    async def check_layout(self) -> None:
        """Raise LegacyCountsError if an earlier version's unsharded counts exist: a consumer
        resuming from their committed offsets would count only what comes next."""
        legacy = f"splu:{{{self.name}:consumer}}"
        if await self.client.exists(f"{legacy}:stats"):
            raise LegacyCountsError(
                f"Redis holds counts of stream {self.name!r} from an earlier version "
                f"({legacy}:*), kept in one place instead of per published partition. "
                f"Count again from the topic: delete those keys and reset the consumer group "
                f"splu-{self.name}-consumer to the earliest offsets (kafka-consumer-groups.sh "
                f"--group splu-{self.name}-consumer --reset-offsets --to-earliest --all-topics "
                "--execute), then start the consumer"
            )


def stream_reconstruction(config: StreamConfig, cells: PublishedCells) -> Reconstruction:
    """The reconstruction `splu query` would use for this stream's publication."""
    if config.decoy is not None:
        return DecoyReconstruction(cells, config.decoy.gamma, config.sensitive)
    settings = config.personal
    assert settings is not None
    return PersonalReconstruction(
        cells, config.sensitive[0], settings.retention, config.schema.sensitive[0].size,
        lam=settings.lam, delta=settings.delta, budget=settings.budget,
        value_map=settings.value_map,
    )  # fmt: skip
