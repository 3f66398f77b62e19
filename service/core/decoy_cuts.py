"""Decoy groups of one partition with one sensitive attribute, decided in the worker (SPEC
§2.1, §3): the same keyed cuts, randomized values, pool entries and suppressions as
``service/store/lua/decoy.lua``, computed here so that Redis only checks and stores them
(``decoy_store.lua``, `service.store.buffer.StreamBuffer`).

The worker holds a partition's waiting records as Redis holds them (loaded once it
claims the partition) and decides one step from them (`DecoyPartition.step`); the step
changes the state held to what Redis holds once it stores the step, and a step Redis
refuses leaves the state to be loaded again. decoy.lua stays the general step: several
sensitive attributes, a partition's close, and any step whose assumptions Redis
refuses.

Cuts, as decoy.lua makes them: groups of γ distinct values are cut while γ values wait.
A value whose records are at least 1/γ of those waiting is always taken; the rest are
drawn one by one with probability proportional to their waiting records, from
`KeyedUniforms`. Each value gives the group its smallest waiting ids, and each member
publishes the group's value at its own keyed draw index.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from service.core.takes import MixingPool

# Hex digits per uniform (32-bit uniforms), and uniforms per SHA-1 block: uniforms.lua's.
UNIFORM_HEX = 8
_PER_BLOCK = 40 // UNIFORM_HEX
_SCALE = float(16**UNIFORM_HEX)
_WORDS = struct.Struct(f">{_PER_BLOCK}I")


class KeyedUniforms:
    """Uniforms in [0, 1) from SHA-1 in counter mode, as uniforms.lua draws them for a cut:
    block k is the hex SHA-1 of "seed:k" for k = drawn + 1, drawn + 2, ..., cut into
    five 32-bit slices. The seed is secret and the counter persistent, so no two cuts
    reuse randomness and the same state always cuts the same groups."""

    def __init__(self, seed: str, drawn: int) -> None:
        self._seed = seed.encode()
        self.counter = drawn  # the last block used

    def __iter__(self) -> Iterator[float]:
        while True:
            self.counter += 1
            # The hex digest's 8-digit slices are the digest's big-endian 32-bit words.
            block = hashlib.sha1(b"%b:%d" % (self._seed, self.counter)).digest()
            for word in _WORDS.unpack(block):
                yield word / _SCALE


def plan_groups(sizes: Sequence[int], gamma: int, uniform: Callable[[], float]) -> list[list[int]]:
    """The groups cut from values waiting `sizes` records each (values in ascending
    order), as lists of value positions in ascending order: while γ values wait, the
    values over 1/γ of the waiting records, then draws proportional to size among the
    rest, scanned in ascending order. Floating point as in decoy.lua, so both cut the
    same groups."""
    size = list(sizes)
    pending = sum(size)
    live = [i for i, s in enumerate(size) if s > 0]
    plan = []
    while len(live) >= gamma:
        chosen, weight = [], 0
        if max(size) * gamma >= pending:
            chosen = [i for i in live if size[i] * gamma >= pending]
            weight = sum([size[i] for i in chosen])
        candidates = [i for i in live if i not in chosen] if chosen else list(live)
        for _ in range(gamma - len(chosen)):
            x = uniform() * (pending - weight)
            # Where rounding leaves x at 0 past the last candidate, the last is picked.
            for pick in candidates:
                x -= size[pick]
                if x < 0:
                    break
            candidates.remove(pick)
            chosen.append(pick)
            weight += size[pick]
        chosen.sort()
        emptied = False
        for i in chosen:
            size[i] -= 1
            emptied = emptied or not size[i]
        if emptied:
            live = [i for i in live if size[i]]
        pending -= gamma
        plan.append(chosen)
    return plan


class Waiting(NamedTuple):
    """A record waiting for a group: its arrival (ms), public codes, value and draw index."""

    arrival: int
    public: bytes
    value: int
    draw: int


class Arrivals(NamedTuple):
    """A batch's records as a step takes them, a column each: ids (32 hex digits), public
    codes, values, draw indices and raw offsets."""

    ids: list[bytes]
    public: list[bytes]
    values: list[int]
    draws: list[int]
    offsets: list[int]


@dataclass
class DecoyStep:
    """What one step decided, for Redis to check and store (`decoy_store.lua`): what the
    worker assumed of the partition, then the step's writes."""

    assumed: tuple[int, int, int]  # watermark, keyed draws used, records waiting
    statuses: dict[int, int] = field(default_factory=dict)  # position (1-based) -> 1
    added: int = 0
    redelivered: int = 0
    replayed: int = 0
    groups: int = 0
    pool_entries: list[bytes] = field(default_factory=list)
    new_waiting: list[tuple[bytes, Waiting]] = field(default_factory=list)
    left: list[tuple[bytes, int]] = field(default_factory=list)  # stored (id, value) gone
    suppressed: dict[int, int] = field(default_factory=dict)  # value -> records
    sizes: dict[int, int] = field(default_factory=dict)  # changed value -> records waiting
    watermark: int = -1
    draws: int = 0
    waiting: int = 0


class DecoyPartition:
    """A partition's decoy state as Redis holds it: the highest raw offset handled
    (`watermark`, ':off'), the keyed draws used (':stats' draws) and the groups cut
    (':stats' groups), and the records waiting (':rec'), by value in id order (the
    buckets ':b:1:<v>').

    A step changes the state to what Redis holds once it stored the step: a step Redis
    refuses, or whose outcome is unknown, leaves the state to be loaded again."""

    def __init__(
        self, watermark: int, draws: int, groups: int, waiting: dict[bytes, Waiting]
    ) -> None:
        self.watermark, self.draws, self.groups = watermark, draws, groups
        # In arrival order, so that the records past max_wait are the first ones.
        self.waiting = dict(sorted(waiting.items(), key=lambda item: item[1].arrival))
        self._latest = max((record.arrival for record in waiting.values()), default=0)
        self._in_order = True
        self.buckets: dict[int, list[bytes]] = {}
        # The partition's mixing pool, when the worker holds it too (`service.core.takes`).
        self.pool: MixingPool | None = None
        for record_id in sorted(waiting):
            self.buckets.setdefault(waiting[record_id].value, []).append(record_id)

    def step(
        self,
        arrivals: Arrivals | None,
        now_ms: int,
        through: int,
        max_wait_ms: int,
        gamma: int,
        seed: str,
    ) -> DecoyStep:
        """Store `arrivals` (those at raw offsets past the watermark whose ids are not
        waiting already), cut every group the buckets allow, and suppress what waited past
        max_wait; `through`: the highest raw offset handled with the batch."""
        step = DecoyStep(assumed=(self.watermark, self.draws, len(self.waiting)))
        highest = max(self.watermark, through)
        fresh: dict[bytes, int] = {}  # id -> position in the batch
        if arrivals is not None and arrivals.ids:
            highest = max(highest, max(arrivals.offsets))
            fresh = self._fresh(arrivals, step)
        step.added = len(fresh)
        uniforms = KeyedUniforms(seed, self.draws)
        if fresh:
            self._cut(step, arrivals, fresh, now_ms, gamma, uniforms)  # type: ignore[arg-type]
            if now_ms < self._latest:
                self._in_order = False
            self._latest = max(self._latest, now_ms)
        # What the cut left of the arrivals waits, in the order they came.
        for record_id, position in fresh.items():
            record = Waiting(
                now_ms,
                arrivals.public[position],  # type: ignore[union-attr]
                arrivals.values[position],  # type: ignore[union-attr]
                arrivals.draws[position],  # type: ignore[union-attr]
            )
            self.waiting[record_id] = record
            step.new_waiting.append((record_id, record))
        self._suppress(step, now_ms - max_wait_ms, fresh)
        if self.pool is not None:
            self.pool.add(step.pool_entries, now_ms)
        self.watermark, self.draws = highest, uniforms.counter
        self.groups += step.groups
        step.watermark, step.draws, step.waiting = highest, uniforms.counter, len(self.waiting)
        return step

    def _fresh(self, arrivals: Arrivals, step: DecoyStep) -> dict[bytes, int]:
        """The arrivals stored anew, by id, to their position; the others are
        redeliveries: at or below the watermark (replayed), or of an id waiting."""
        ids, offsets = arrivals.ids, arrivals.offsets
        if min(offsets) > self.watermark and self.waiting.keys().isdisjoint(ids):
            fresh = dict(zip(ids, range(len(ids)), strict=True))
            if len(fresh) == len(ids):
                return fresh
        fresh = {}
        for position, (record_id, offset) in enumerate(zip(ids, offsets, strict=True)):
            if offset <= self.watermark:
                step.replayed += 1
            elif record_id not in self.waiting and record_id not in fresh:
                fresh[record_id] = position
                continue
            step.statuses[position + 1] = 1
            step.redelivered += 1
        return fresh

    def _cut(
        self,
        step: DecoyStep,
        arrivals: Arrivals,
        fresh: dict[bytes, int],
        now_ms: int,
        gamma: int,
        uniforms: KeyedUniforms,
    ) -> None:
        """Cut every group the buckets allow, with the step's arrivals in them; the
        arrivals grouped leave `fresh`."""
        buckets, values_of = self.buckets, arrivals.values
        arrived: dict[int, list[bytes]] = {}
        for record_id, position in fresh.items():
            arrived.setdefault(values_of[position], []).append(record_id)
        for value, ids in arrived.items():
            bucket = buckets.get(value)
            if bucket:
                ids += bucket
            ids.sort()
            buckets[value] = ids
        values = sorted(buckets)
        sizes = [len(buckets[value]) for value in values]
        plan = plan_groups(sizes, gamma, iter(uniforms).__next__)
        owed = [0] * len(values)
        for chosen in plan:
            for i in chosen:
                owed[i] += 1
        # Each value gives its smallest ids, the first to its first group.
        popped: list[list[bytes]] = []
        for i, value in enumerate(values):
            bucket = buckets[value]
            popped.append(bucket[owed[i] - 1 :: -1] if owed[i] else [])
            if owed[i] == len(bucket):
                del buckets[value]
            elif owed[i]:
                buckets[value] = bucket[owed[i] :]
            step.sizes[value] = len(bucket) - owed[i]
        texts = [b"%d" % value for value in values]
        now = b"%d" % now_ms
        entries, public_of, draws_of = step.pool_entries, arrivals.public, arrivals.draws
        for number, chosen in enumerate(plan, self.groups + 1):
            group = [texts[i] for i in chosen]
            audit = b"%d:%b" % (number, b",".join(group))
            for i in chosen:
                record_id = popped[i].pop()
                position = fresh.pop(record_id, None)
                if position is None:
                    stored = self.waiting.pop(record_id)
                    step.left.append((record_id, stored.value))
                    arrival, public, draw = b"%d" % stored.arrival, stored.public, stored.draw
                else:
                    arrival, public, draw = now, public_of[position], draws_of[position]
                entries.append(
                    b"%b|%b|%b|%b|%b|%b"
                    % (public, group[draw], audit, texts[i], arrival, record_id)
                )
        step.groups = len(plan)

    def _suppress(self, step: DecoyStep, deadline: int, fresh: dict[bytes, int]) -> None:
        """Suppress the records that arrived at or before `deadline`: they belong to values
        over their share, or to the last few values of a quiet stream. Never published,
        counted per value."""
        expired = []
        for record_id, record in self.waiting.items():
            if record.arrival <= deadline:
                expired.append(record_id)
            elif self._in_order:
                break
        if not expired:
            return
        gone: dict[int, set[bytes]] = {}
        for record_id in expired:
            value = self.waiting.pop(record_id).value
            gone.setdefault(value, set()).add(record_id)
            if record_id not in fresh:
                step.left.append((record_id, value))
        step.new_waiting = [item for item in step.new_waiting if item[0] in self.waiting]
        for value, ids in gone.items():
            step.suppressed[value] = len(ids)
            bucket = [record_id for record_id in self.buckets[value] if record_id not in ids]
            step.sizes[value] = len(bucket)
            if bucket:
                self.buckets[value] = bucket
            else:
                del self.buckets[value]


__all__ = [
    "Arrivals", "DecoyPartition", "DecoyStep", "KeyedUniforms", "Waiting", "plan_groups",
]  # fmt: skip
