"""A stream's life in Redis (SPEC §3): which records it accepts, and how it ends.

Every fetch of raw records passes two steps before a buffer stores anything:

- the *gate* (``close.lua``), one call per raw partition: while the stream is open it
  remembers the highest offset it let through; once the partition is closed it gives the
  close offset, and records at or past it are rejected. A close never falls below a record
  already let through, so "accepted" has one meaning: below the close offset;
- the *identity screen* (``identity.lua``), one call per shard of the stream's record ids:
  a response's identity is the stream's, not a partition's. The first copy of an id owns
  it; another copy with the same content, on any partition, is a re-send and is skipped,
  a copy with other content is rejected, and the first copy read again (a replay) goes on
  to its buffer, which knows by its offset whether it stored it (``ingest.lua``). The
  worker tells the screen how far each raw partition's buffer has handled its offsets, so
  that the screen forgets where a first copy was read once that no longer matters.

A survey ends with a close (`request_close`, then every raw partition's close offset,
`close_partition`). Each buffer partition is finalized by its own ingest step once every
offset below its close offset is handled: decoy records that can no longer be grouped are
suppressed, personal groups are released, and the pool leaves whole if it holds the floor.
A smaller remainder is handed to the stream's final pool (`hand_off`), where the
remainders of all partitions are mixed and leave together once all are in (``emit.lua``);
a final remainder below the minimum mixing is published or suppressed as configured.
A personal stream's buffers are the partitions of ``<stream>.grouped``, whose close offsets
are fixed once every raw partition's first hop is through (`close_grouped`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from service.core.config import StreamConfig
from service.core.guarantees import mate_probability
from service.core.ingest import PreparedBatch, offset_of
from service.store.buffer import FINAL_POOL, BufferState, lua_script

# Pool entries per call when a remainder moves to the final pool: a call's arguments stay
# far below the size at which a server logs a command.
HANDOFF_CHUNK = 2000
# The close states a finalized partition goes through (`:close` state, ingest.lua).
RELEASING, HANDOFF, DONE = "releasing", "handoff", "done"
# An identity shard's keys that screen arriving records (identity.lua), expired once the
# stream's close is complete: the gate refuses late records without them.
SCREEN_KEYS = ("known", "unsettled", "handled")


class Lifecycle(BufferState):
    """The gate, the identity screen and the close steps of one stream."""

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        super().__init__(client, config)
        self._close = client.register_script(lua_script("close"))
        self._identity = client.register_script(lua_script("fingerprints", "identity"))
        self._receive = client.register_script(lua_script("pool", "receive"))
        self._layout_checked: set[int] = set()

    async def gate(self, highest: Mapping[int, int]) -> dict[int, int | None]:
        """For each raw partition of a fetch and its highest offset there: the partition's
        close offset, or None while it is open."""
        partitions = sorted(highest)
        offsets = await asyncio.gather(
            *(self._close(keys=[self.prefix(p)], args=["gate", highest[p]]) for p in partitions)
        )
        return {p: None if int(o) < 0 else int(o) for p, o in zip(partitions, offsets, strict=True)}

    async def screen(
        self, batches: list[PreparedBatch], handled: Mapping[int, int]
    ) -> list[list[int]]:
        """Per batch, per record: 0 to store (a first copy, read for the first time or
        again, or any copy read again at an offset its buffer handled), 1 a re-send
        (skipped), 2 an id reused with other content (rejected).

        `handled`: per raw partition, an offset up to which its buffer has handled every
        offset (stored or not), as this worker knows it; never more than the buffer has."""
        statuses = [[0] * len(batch) for batch in batches]
        if not any(statuses):
            return statuses
        # Each record as identity.lua reads it: fingerprint, raw partition, offset.
        records, partitions, offsets, batch_of, position = [], [], [], [], []
        for b, batch in enumerate(batches):
            n = len(batch)
            fingerprints = np.frombuffer(b"".join(batch.fingerprints), np.uint8).reshape(n, 12)
            read = np.fromiter(map(offset_of, batch.messages), np.int64, n)
            where = (read | (batch.partition << 48)).astype(">u8").view(np.uint8).reshape(n, 8)
            records.append(np.hstack([fingerprints, where]))
            partitions.append(np.full(n, batch.partition))
            offsets.append(read)
            batch_of.append(np.full(n, b))
            position.append(np.arange(n))
        packed = np.vstack(records)
        partition, offset = np.concatenate(partitions), np.concatenate(offsets)
        batch_index, record_index = np.concatenate(batch_of), np.concatenate(position)
        shard = ((packed[:, 0].astype(np.int64) << 8) | packed[:, 1]) % self.config.partitions
        calls = []
        for s in np.unique(shard).tolist():
            rows = np.flatnonzero(shard == s)
            args: list[bytes | int] = [packed[rows].tobytes()]
            for p in np.unique(partition[rows]).tolist():
                highest = int(offset[rows][partition[rows] == p].max())
                args += [int(p).to_bytes(2, "big"), highest, handled.get(p, -1)]
            calls.append((s, rows, args))
        await self._check_layout([s for s, _, _ in calls])
        found = await asyncio.gather(
            *(self._identity(keys=[self.shard_prefix(s)], args=args) for s, _, args in calls)
        )
        for (shard_number, rows, _), result in zip(calls, found, strict=True):
            for k in range(0, len(result), 2):
                row = rows[int(result[k]) - 1]
                statuses[batch_index[row]][record_index[row]] = int(result[k + 1])
            await self.replication.confirm(self.shard_prefix(shard_number))
        return statuses

    async def _check_layout(self, shards: list[int]) -> None:
        """Stop at a shard an earlier version screened: it kept every id with where its
        first copy was read, in `:seen`, which this version neither reads nor writes."""
        for shard in shards:
            if shard in self._layout_checked:
                continue
            if await self.client.exists(f"{self.shard_prefix(shard)}:seen"):
                raise RuntimeError(
                    f"{self.shard_prefix(shard)} holds an identity screen of an earlier "
                    "version: drain the stream with that version before upgrading "
                    "(docs/operations.md, Migrating from earlier versions)"
                )
            self._layout_checked.add(shard)

    async def mark_forwarded(self, highest: Mapping[int, int]) -> None:
        """A personal stream's first hop forwarded every record of these raw partitions up
        to these offsets, and the broker acknowledged them."""
        await asyncio.gather(
            *(self._close(keys=[self.prefix(p)], args=["through", o]) for p, o in highest.items())
        )

    async def request_close(self, now_ms: int) -> int:
        """Record that the stream is closing (once); returns when the close was requested."""
        await self.client.hsetnx(self.close_key, "requested", now_ms)
        return int(await self.client.hget(self.close_key, "requested"))

    async def close_requested(self) -> int | None:
        """When the stream's close was requested (ms), or None while it is open."""
        requested = await self.client.hget(self.close_key, "requested")
        return None if requested is None else int(requested)

    async def close_partition(self, partition: int, end_offset: int, now_ms: int) -> int:
        """Fix a raw partition's close offset (once): the raw topic's end offset when the
        close was asked for, or past every record already let through. Returns it."""
        return int(
            await self._close(keys=[self.prefix(partition)], args=["close", end_offset, now_ms])
        )

    async def close_grouped(self, partition: int, end_offset: int) -> int:
        """Fix a personal stream's grouped partition's close offset (once), the grouped
        topic's end offset read after every raw partition's first hop was through."""
        return int(await self._close(keys=[self.prefix(partition)], args=["grouped", end_offset]))

    async def partition_close(self, partition: int) -> dict[str, int | str]:
        """A partition's `:close` hash: raw, gated, raw_through, grouped (offsets), state."""
        fields = await self.client.hgetall(f"{self.prefix(partition)}:close")
        out: dict[str, int | str] = {}
        for field, value in fields.items():
            name = field.decode()
            out[name] = value.decode() if name == "state" else int(value)
        return out

    async def forwarded(self) -> bool:
        """Whether every raw partition of a personal stream is closed and its first hop has
        forwarded every record below its close offset."""
        for partition in range(self.config.partitions):
            close = await self.partition_close(partition)
            if "raw" not in close or int(close.get("raw_through", -1)) < int(close["raw"]) - 1:
                return False
        return True

    async def hand_off(self, partition: int, now_ms: int) -> int | None:
        """Move a finalized partition's remainder below the floor to the final pool, in
        chunks that the final pool takes once each, then drop it here. Returns how many
        records moved, or None if the partition has no remainder to hand off (now)."""
        prefix = self.prefix(partition)
        if await self.client.hget(f"{prefix}:close", "state") != HANDOFF.encode():
            return None
        entries = await self.client.hvals(f"{prefix}:handoff")
        chunks = [entries[i : i + HANDOFF_CHUNK] for i in range(0, len(entries), HANDOFF_CHUNK)]
        final = self.prefix(FINAL_POOL)
        for number, chunk in enumerate(chunks or [[]]):
            last = number == max(len(chunks) - 1, 0)
            await self._receive(keys=[final], args=[now_ms, partition, number, int(last), *chunk])
        await self.replication.confirm(final)
        moved = int(await self._close(keys=[prefix], args=["handed"]))
        await self.replication.confirm(prefix)
        return moved

    async def complete(self, now_ms: int, retention_ms: int) -> bool:
        """Mark the close complete once every partition is done and nothing is pooled or in
        flight anywhere, the final pool included; the identity shards' fingerprints then
        expire after `retention_ms` (the gate keeps refusing late records without them).
        Returns whether the close is complete."""
        if await self.client.hget(self.close_key, "completed") is not None:
            return True
        for partition in range(self.config.partitions):
            if (await self.partition_close(partition)).get("state") != DONE:
                return False
        for partition in [*range(self.config.partitions), FINAL_POOL]:
            stats = await self.stats(partition)
            if stats["pending"] or stats["pool"] or stats["in_flight"] or stats["handoff"]:
                return False
        if self.config.windowed is None:
            final = await self.client.scard(f"{self.prefix(FINAL_POOL)}:from")
            if final < self.config.partitions:
                return False
        if retention_ms > 0:
            for shard in range(self.config.partitions):
                for part in SCREEN_KEYS:
                    await self.client.pexpire(f"{self.shard_prefix(shard)}:{part}", retention_ms)
        await self.client.hsetnx(self.close_key, "completed", now_ms)
        return True


async def close_status(state: BufferState) -> dict[str, Any]:
    """What operators and the reports see of a stream's close: `state` (open, closing or
    closed), when it was requested and completed (ms), each partition's close state, and
    the final pool's take: how many records it held and what became of them."""
    config = state.config
    close = {k.decode(): int(v) for k, v in (await state.client.hgetall(state.close_key)).items()}
    if "requested" not in close:
        return {"state": "open"}
    partitions = {}
    for partition in range(config.partitions):
        fields = await state.client.hget(f"{state.prefix(partition)}:close", "state")
        partitions[partition] = fields.decode() if fields is not None else "open"
    final = await state.stats(FINAL_POOL)
    take = final.get("final_take")
    out: dict[str, Any] = {
        "state": "closed" if "completed" in close else "closing",
        "requested_ms": close["requested"],
        "completed_ms": close.get("completed"),
        "partitions": partitions,
        "remainder": {
            "records": final.get("received", 0),
            "take": take,
            "suppressed": final.get("suppressed_remainder", 0),
            "min_mixing": config.min_mixing,
            "choice": config.small_remainder,
        },
    }
    if config.decoy is not None and take:
        # What the smallest take tells, next to what a take from the floor tells.
        gamma = config.decoy.gamma
        out["remainder"]["mate_probability"] = mate_probability(gamma, take)
        out["remainder"]["floor_mate_probability"] = mate_probability(gamma, config.mixing_pool)
    return out
