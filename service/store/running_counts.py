"""Running counts of published cells (SPEC §4), kept in Redis so they survive restarts.

The consumer counts each published record once, by its dedup token, in a single Lua
step (``lua/count.lua``) into the cell its record belongs to (`service.core.published`): a
record the worker re-sent after a crash, however much later, carries the token
it had, and a batch redelivered to a consumer that died before committing its
offsets brings tokens already counted; both are skipped and counted as
duplicates. Tokens are remembered as 64-bit fingerprints (6 bytes each in
Redis) for the life of the stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from service.core.config import StreamConfig
from service.core.published import CellCodec, WindowCodec
from service.store.buffer import Replication, lua_script


@dataclass(frozen=True)
class CountedBatch:
    new: int
    duplicates: int
    side: int = 0


class RunningCounts:
    """The consumer's published-cell counts and the tokens already counted, one shard per
    partition of ``<stream>.published`` (``splu:{<stream>:consumer:<partition>}``, a hash
    slot each), so consumers in one group split the counting and a Redis Cluster spreads
    it. A token always lands in the same partition (`streams.runtime.app.partition_of`), so each
    shard's dedup sees every copy of its records. Reads merge all shards."""

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        self.client = client
        self.partitions = config.partitions
        self.name = config.name
        self.codec: CellCodec | WindowCodec = (
            CellCodec(config.schema)
            if config.windowed is None
            else WindowCodec(config.schema, config.windowed)
        )
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
        new, duplicates, side = await self._count(keys=keys, args=args)
        await self.replication.confirm(self.prefix(partition))
        return CountedBatch(int(new), int(duplicates), int(side))

    async def tally(self) -> dict[bytes, int]:
        """Every cell's count, summed over the shards."""
        out: dict[bytes, int] = {}
        for cells in await self._every_shard("cells"):
            for cell, count in cells.items():
                out[cell] = out.get(cell, 0) + int(count)
        return out

    async def stats(self) -> dict[str, int]:
        """records (published rows), duplicates and side (a windowed stream's side
        messages), summed over the shards."""
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
