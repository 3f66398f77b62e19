"""Raw batches a worker cannot decode (SPEC §3: reported, and never stopping the stream).

A producer may compress with a codec whose library a worker lacks, or a batch may arrive
corrupt. The fetcher stops such a partition at the batch (`streams.runtime.bulk.GuardedRecords`)
while the other partitions go on, and the worker holds it (`HeldBatches.hold`):

- it is reported on ``<stream>.rejected`` with its partition, offset range and reason,
  and kept in ``splu:{<stream>:<p>}:undecodable`` (first offset → last offset, reason,
  since when); ``:stats`` ``undecodable`` counts the batches held, which
  ``splu_undecodable_batches`` exports and the SpluUndecodableBatch alert watches;
- nothing past it is committed, so nothing is lost. Two ways go on
  (docs/operations.md): a worker that can decode the batch (its library installed)
  reads it as any other, and the hold is lifted once the gate has let the batch's last
  offset through; or the operator skips it, `splu skip --config F --partition P
  --offset FIRST`, and the worker owning the partition reads on past it, reporting the
  skip on ``<stream>.rejected`` and counting its offsets in ``:stats`` ``skipped``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from faust.types import TP

from service.core.config import StreamConfig
from service.store.buffer import BufferState, connect

log = logging.getLogger("splu.undecodable")

Send = Callable[[str, list[tuple[bytes | None, bytes]]], Awaitable[Any]]
SkipPast = Callable[[TP, int], Awaitable[None]]


def now_ms() -> int:
    return int(time.time() * 1000)


class HeldBatches:
    """The undecodable batches of the raw partitions one worker owns."""

    def __init__(self, state: BufferState, send: Send) -> None:
        """`send(topic, messages)` publishes (`streams.runtime.app.Publisher.send_all`)."""
        self.state, self.config, self.send = state, state.config, send
        self.held: dict[int, tuple[int, int]] = {}  # partition -> (first, last) offsets

    def key(self, partition: int) -> str:
        return f"{self.state.prefix(partition)}:undecodable"

    async def hold(self, tp: TP, first: int, last: int, reason: str) -> None:
        """Record and report a batch the fetcher could not decode (once per batch)."""
        self.held[tp.partition] = (first, last)
        entry = json.dumps({"last": last, "reason": reason, "since": now_ms()})
        if await self.state.client.hsetnx(self.key(tp.partition), str(first), entry):
            await self._report(tp.partition, first, last, f"undecodable batch: {reason}")
            await self._count(tp.partition)

    async def step(
        self, raw: Iterable[int], skip_past: Callable[[TP, int], Awaitable[None]]
    ) -> None:
        """One tick over the owned raw partitions: read on past a batch the operator
        skipped; lift the hold of a batch the gate has let through since (decoded by a
        worker that could)."""
        for partition in raw:
            entries = await self.state.client.hgetall(self.key(partition))
            if not entries:
                continue
            gated = await self.state.client.hget(f"{self.state.prefix(partition)}:close", "gated")
            for field, value in entries.items():
                first, entry = int(field), json.loads(value)
                last = entry["last"]
                if gated is not None and int(gated) >= last:
                    await self._release(partition, first)
                elif "skip" in entry and self.held.get(partition) == (first, last):
                    await skip_past(TP(self.config.topics["raw"], partition), last + 1)
                    del self.held[partition]
                    await self.state.client.hincrby(
                        f"{self.state.prefix(partition)}:stats", "skipped", last - first + 1
                    )
                    await self._report(
                        partition, first, last,
                        f"skipped by the operator, undecodable: {entry['reason']}",
                    )  # fmt: skip
                    await self._release(partition, first)
                    log.warning("partition %d: skipped offsets %d..%d", partition, first, last)

    async def _release(self, partition: int, first: int) -> None:
        await self.state.client.hdel(self.key(partition), str(first))
        if self.held.get(partition, (None,))[0] == first:
            del self.held[partition]
        await self._count(partition)

    async def _count(self, partition: int) -> None:
        held = await self.state.client.hlen(self.key(partition))
        await self.state.client.hset(f"{self.state.prefix(partition)}:stats", "undecodable", held)

    async def _report(self, partition: int, first: int, last: int, reason: str) -> None:
        message = {
            "reason": reason, "field": None, "partition": partition, "offset": first,
            "last_offset": last, "key": None, "value": None,
        }  # fmt: skip
        await self.send(self.config.topics["rejected"], [(None, json.dumps(message).encode())])


async def request_skip(config: StreamConfig, partition: int, first: int) -> dict[str, Any]:
    """Mark the undecodable batch of `partition` at offset `first` to be skipped; returns
    its entry (last offset, reason). Raises ValueError if no such batch is held."""
    client = connect(config)
    try:
        key = f"{BufferState(client, config).prefix(partition)}:undecodable"
        value = await client.hget(key, str(first))
        if value is None:
            held = [int(f) for f in await client.hkeys(key)]
            where = (
                f"partition {partition} holds batches at offsets {sorted(held)}"
                if held
                else f"partition {partition} holds no undecodable batch"
            )
            raise ValueError(f"no undecodable batch at {partition}/{first}: {where}")
        entry = json.loads(value)
        entry.setdefault("skip", now_ms())
        await client.hset(key, str(first), json.dumps(entry))
        return entry
    finally:
        await client.aclose()
