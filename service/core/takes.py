"""A partition's mixing pool held by the worker, and the takes drawn from it (SPEC §3):
the same takes ``service/store/lua/emit.lua`` draws for the same seed, computed here so
that Redis only checks and stores them (``take_store.lua``, `service.store.buffer`).

The pool is held beside the partition's decoy state (`service.core.decoy_cuts`), as
Redis holds it (pool.lua): entries at positions 1..size and when it last received
records. A take follows emit.lua's mixing rule for a partition's own pool: only the excess
over the floor, or the whole pool once it has been quiet and holds at least the floor;
a closing partition's pool and the stream's final pool stay emit.lua's.

The draw is emit.lua's partial Fisher-Yates from the pool's end: for last = size down
to size - count + 1, j = last - floor(u · last) with u a 48-bit slice of SHA-1(seed:k),
three slices a block; the record at j is taken and the one at `last` moves into j, so
the pool stays dense in 1..size - count.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

# 48-bit uniforms (12 hex digits, uniforms.lua), three per SHA-1 block.
_SLICE_BYTES, _PER_BLOCK = 6, 3
_SCALE = float(2 ** (8 * _SLICE_BYTES))


def shuffle_digests(seed: str, count: int) -> bytes:
    """The SHA-1 blocks a take of `count` records draws from: SHA-1 of "seed:k" for
    k = 1, 2, ..., one block per three records, concatenated (uniforms.lua's blocks)."""
    key = seed.encode()
    blocks = (count + _PER_BLOCK - 1) // _PER_BLOCK
    return b"".join([hashlib.sha1(b"%b:%d" % (key, k)).digest() for k in range(1, blocks + 1)])


def shuffle_uniforms(seed: str, count: int) -> np.ndarray:
    """A take's first `count` uniforms in [0, 1): its blocks (`shuffle_digests`), each cut
    into three 48-bit big-endian slices, as emit.lua reads them from the hex digest.
    Exact: a 48-bit integer over 2⁴⁸ is a double, as in Lua."""
    digests = shuffle_digests(seed, count)
    blocks = len(digests) // 20
    slices = np.frombuffer(digests, np.uint8).reshape(blocks, 20)[:, : _PER_BLOCK * _SLICE_BYTES]
    words = np.zeros((blocks * _PER_BLOCK, 8), np.uint8)
    words[:, 8 - _SLICE_BYTES :] = slices.reshape(-1, _SLICE_BYTES)
    return words.view(">u8").ravel()[:count] / _SCALE


class Take(NamedTuple):
    """A take as Redis stores it: its entries in the order drawn, the records left in
    the pool that moved (position, entry), and the pool's size before the take."""

    entries: list[bytes]
    moved: list[tuple[int, bytes]]
    size: int


class MixingPool:
    """A partition's pool as Redis holds it: `entries[p - 1]` at position p, and when it
    last received records (':pooled', ms; 0 once emptied)."""

    def __init__(self, entries: list[bytes], pooled_ms: int) -> None:
        self.entries, self.pooled_ms = entries, pooled_ms

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entries: list[bytes], now_ms: int) -> None:
        """Append `entries` at the pool's end, as pool.lua does."""
        if entries:
            self.entries += entries
            self.pooled_ms = now_ms

    def due(self, now_ms: int, floor: int, quiet_ms: int, limit: int) -> int:
        """How many records a take releases now: at most `limit` of the excess over the
        floor, or the whole pool once it has received nothing for `quiet_ms` and holds at
        least the floor (emit.lua)."""
        size = len(self.entries)
        due = min(size - floor, limit)
        if due <= 0 < size and size >= floor and now_ms - self.pooled_ms >= quiet_ms:
            due = size
        return max(due, 0)

    def take(self, due: int, seed: str) -> Take:
        """Draw `due` records under `seed`, removing them from the pool."""
        pool, size = self.entries, len(self.entries)
        lasts = np.arange(size, size - due, -1, dtype=np.int64)
        # The products and floors in doubles, as emit.lua computes them.
        drawn = lasts - np.floor(shuffle_uniforms(seed, due) * lasts).astype(np.int64)
        taken = []
        append, left = taken.append, size - due
        for j, last in zip((drawn - 1).tolist(), range(size - 1, left - 1, -1), strict=True):
            append(pool[j])
            pool[j] = pool[last]
        del pool[left:]
        if not left:
            self.pooled_ms = 0
        moved = np.unique(drawn[drawn <= left]).tolist()
        return Take(taken, [(j, pool[j - 1]) for j in moved], size)


__all__ = ["MixingPool", "Take", "shuffle_digests", "shuffle_uniforms"]
