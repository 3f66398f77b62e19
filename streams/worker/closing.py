"""A survey's end (SPEC §3): `splu close`, and the steps a worker takes while its stream
closes.

`splu close --config F` records the close request and fixes every raw partition's close
offset (`request_close`): the records below it are the survey's; a record after it is
rejected with its reason. It then waits, showing progress, until the workers have
published or suppressed every accepted record (`wait_closed`). Each worker drives the close
for the partitions it owns, once a tick (`Closer`): it fixes close offsets a killed
`splu close` left unfixed, a personal stream's grouped close offsets, and hands each
finalized partition's remainder to the final pool; the first to find every partition
done and nothing left marks the close complete. A worker killed at any step leaves state
from which the next owner goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from service.core.config import StreamConfig
from service.store.buffer import connect
from service.store.lifecycle import Lifecycle, close_status
from streams.runtime.topics import end_offsets

log = logging.getLogger("splu.close")

PROGRESS_EVERY = 5.0  # seconds between progress lines while `splu close` waits
EndOffsets = Callable[[str, list[int]], Awaitable[dict[int, int]]]


def now_ms() -> int:
    return int(time.time() * 1000)


class Closer:
    """The close steps of the partitions one worker owns, taken once a tick. Free of
    Faust, so tests drive it on a virtual clock as the worker's timer does."""

    def __init__(
        self, config: StreamConfig, lifecycle: Lifecycle, ends: EndOffsets | None = None
    ) -> None:
        """`ends(topic, partitions)` gives the partitions' end offsets (default: the
        stream's broker's)."""
        self.config = config
        self.lifecycle = lifecycle
        self.ends = ends or partial(end_offsets, config.kafka)
        self.requested: int | None = None
        self.complete = False
        self._raw_closed: set[int] = set()
        self._grouped_closed: set[int] = set()

    async def step(self, raw: set[int], buffered: set[int], now: int) -> None:
        """One tick: `raw` and `buffered` are the partitions of the raw topic and of the
        buffers' topic (a personal stream's grouped topic, else the raw one) owned here."""
        if self.requested is None:
            self.requested = await self.lifecycle.close_requested()
            if self.requested is None:
                return
            log.warning("the stream is closing (requested at %d ms)", self.requested)
        if self.complete:
            return
        config, lifecycle = self.config, self.lifecycle
        await self._fix(raw, self._raw_closed, "raw", config.topics["raw"], now)
        grouped_open = config.personal is not None and not buffered <= self._grouped_closed
        if grouped_open and await lifecycle.forwarded():
            await self._fix(
                buffered, self._grouped_closed, "grouped", config.topics["grouped"], now
            )
        for partition in sorted(buffered):
            moved = await lifecycle.hand_off(partition, now)
            if moved is not None:
                log.warning(
                    "partition %d: closed; %d records below the floor joined the final pool",
                    partition, moved,
                )  # fmt: skip
        self.complete = await lifecycle.complete(now, int(config.closed_retention * 1000))
        if self.complete:
            log.warning("the stream is closed: every accepted record is settled")

    async def _fix(
        self, owned: set[int], fixed: set[int], field: str, topic: str, now: int
    ) -> None:
        """Fix the close offsets of the owned partitions that have none yet."""
        missing = []
        for partition in sorted(owned - fixed):
            if field in await self.lifecycle.partition_close(partition):
                fixed.add(partition)
            else:
                missing.append(partition)
        if not missing:
            return
        ends = await self.ends(topic, missing)
        for partition in missing:
            if field == "raw":
                await self.lifecycle.close_partition(partition, ends[partition], now)
            else:
                await self.lifecycle.close_grouped(partition, ends[partition])
            fixed.add(partition)


async def request_close(config: StreamConfig) -> dict[int, int]:
    """`close_stream` on the stream's own Redis and broker."""
    client = connect(config)
    try:
        return await close_stream(
            Lifecycle(client, config), partial(end_offsets, config.kafka), now_ms()
        )
    finally:
        await client.aclose()


async def close_stream(lifecycle: Lifecycle, ends: EndOffsets, now: int) -> dict[int, int]:
    """Record the stream's close and fix each raw partition's close offset, from the raw
    topic's end offsets (`ends`); returns them. Repeating it changes nothing: the first
    offsets stay."""
    config = lifecycle.config
    await lifecycle.request_close(now)
    partitions = list(range(config.partitions))
    offsets = await ends(config.topics["raw"], partitions)
    return {p: await lifecycle.close_partition(p, offsets[p], now) for p in partitions}


async def wait_closed(
    config: StreamConfig,
    timeout: float | None,
    show: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """Wait until the stream's close is complete; (close status, totals). Raises
    TimeoutError, with what is still open, after `timeout` seconds without progress."""
    client = connect(config)
    lifecycle = Lifecycle(client, config)
    started = shown = time.monotonic()
    last: tuple = ()
    moved = started
    try:
        while True:
            status = await close_status(lifecycle)
            totals = await lifecycle.totals()
            if status["state"] == "closed":
                return status, totals
            progress = (
                tuple(status.get("partitions", {}).values()),
                totals.get("published", 0),
                totals.get("suppressed", 0),
            )
            if progress != last:
                last, moved = progress, time.monotonic()
            if timeout is not None and time.monotonic() - moved > timeout:
                raise TimeoutError(describe_closing(status, totals))
            if show is not None and time.monotonic() - shown >= PROGRESS_EVERY:
                shown = time.monotonic()
                show(describe_closing(status, totals))
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()


def describe_closing(status: dict[str, Any], totals: dict[str, int]) -> str:
    """One line: how far a close has come."""
    states = list(status.get("partitions", {}).values())
    done = sum(state == "done" for state in states)
    waiting = totals.get("pending", 0) + totals.get("pool", 0) + totals.get("in_flight", 0)
    waiting += totals.get("handoff", 0)
    return (
        f"closing: {done} of {len(states)} partitions done, {waiting:,} records still "
        f"waiting or in flight, {totals.get('published', 0):,} published, "
        f"{totals.get('suppressed', 0):,} suppressed"
    )


def describe_closed(
    config: StreamConfig, status: dict[str, Any], totals: dict[str, int]
) -> list[str]:
    """What a completed close did, for people: every accepted record's fate, and the final
    remainder's."""
    accepted = totals.get("ingested", 0)
    lines = [
        f"closed: {accepted:,} records accepted, {totals.get('published', 0):,} published, "
        f"{totals.get('suppressed', 0):,} suppressed, {totals.get('expired', 0):,} expired; "
        f"{totals.get('rejected_closed', 0):,} rejected for coming after the close"
    ]
    at_close = totals.get("suppressed_at_close", 0)
    if at_close:
        lines.append(
            f"  {at_close:,} suppressed at the close: decoy records no group could take "
            "any more (values over their share, or the last few values)"
        )
    remainder = status.get("remainder", {})
    take = remainder.get("take")
    if take:
        floor = config.mixing_pool
        if remainder.get("suppressed"):
            lines.append(
                f"  the remainder below the mixing floor, {take:,} records, was suppressed: "
                f"fewer than the minimum mixing of {config.min_mixing} records "
                f"(stream.small_remainder = {config.small_remainder!r})"
            )
        elif take < floor:
            mates = remainder.get("mate_probability")
            told = (
                f": a record's neighbour there is its group-mate with probability "
                f"{mates:.3f}, against {remainder['floor_mate_probability']:.4f} for a take "
                "from the floor"
                if mates is not None
                else ""
            )
            lines.append(
                f"  the remainder below the mixing floor of {floor:,} left as one take of "
                f"{take:,} records mixed across all partitions{told}"
            )
    return lines
