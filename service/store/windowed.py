"""Batch mechanisms on windows of the stream (issue 7, item 4; SPEC §2.3, §3).

A stream with ``stream.mechanism = "windowed"`` cuts each raw partition into
*windows* of ``windowed.window`` records and publishes every window with one of
the batch mechanisms of ``splu publish``: ``sdr``, ``fprivacy``, ``anatomy``,
``dbr`` or ``global`` (their publishers in `service.core.mechanisms.registry`, the very code the
CLI runs, with the same option names and defaults). The worker is
`streams/worker/windowed.py`; this module holds its Redis buffer, and
`service.core.windows` turns a window into messages (`render_window`).

Redis keys (prefix ``splu:{<stream>:<partition>}``, one Cluster slot per partition;
the steps are ``service/store/lua/window.lua`` behind the shared prelude ``ingest.lua``):

=====================  =======  ==========================================================
``:seen``, ``:off``     hash,    record fingerprints and the raw offset watermark, as
                        string   every stream (``ingest.lua``)
``:open``               hash     record id (32 hex digits) → ``public codes|sensitive
                                 codes`` of the open window
``:w:<number>``         hash     the same for closed window ``number`` (1, 2, ... per
                                 partition), until the broker acknowledged its output
``:wq``                 zset     closed windows waiting for publication (score: number)
``:wout:<number>``      string   the window's staged output: a JSON header line
                                 ``{"rows": R, "side": S, "suppressed": K}`` then one line
                                 ``<token> <message JSON>`` per message, in sending order
``:stats``              hash     ``ingested``, ``redelivered``, ``replayed``,
                                 ``conflicts``, ``rejected``, ``windows`` (last number),
                                 ``closed_full``, ``closed_wait``, ``windows_published``,
                                 ``windows_suppressed``, ``published`` (rows), ``side``
                                 (side messages), ``suppressed`` (records), ``opened`` (ms
                                 the open window got its first record), and gauges
=====================  =======  ==========================================================

Steps, each one atomic Lua call:

- *ingest* (one per partition batch, and once a second without records, a tick):
  store every new record in the open window idempotently (the prelude's fingerprints;
  a redelivery is skipped); the window closes, i.e. becomes
  ``:w:<number>`` and enters ``:wq``, when it holds ``window`` records, or, at the
  start of a call, when its first record arrived ``max_window_wait`` seconds ago;
- *stage*: keep a window's output under fresh random tokens, unless an output is
  kept already (then that one is sent), or the window is finished already;
- *finish*: after the broker acknowledged every message of the window, drop its
  records and output and count it; finishing twice counts nothing twice.

Failure handling. Offsets are committed only after the ingest call returned
(`streams/runtime/bulk.py`); a replay is absorbed by the dedup keys. A crash
before *stage* recomputes the same output and stages it with new tokens (nothing
was sent); a crash after it re-sends the staged output under its tokens, possibly
a second time, which consumers absorb by token; records are deleted only by
*finish*, after the acknowledgement. Two workers briefly owning one partition
after a rebalance send the same staged messages, and only one *finish* counts.
"""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis

from service.core.config import StreamConfig
from service.core.ingest import PreparedBatch
from service.core.windows import Staged, WindowOutput, decode_staged, message_json
from service.store.buffer import COUNTERS, BufferState, IngestOutcome, lua_script


def encode_staged(output: WindowOutput) -> bytes:
    """The output under fresh random tokens, as kept in ``:wout:<number>``."""
    header = {"rows": len(output.rows), "side": len(output.side), "suppressed": output.suppressed}
    lines = [message_json(header)]
    lines += [secrets.token_hex(16).encode() + b" " + m for m in output.messages]
    return b"\n".join(lines)


class WindowState(BufferState):
    """What may be read of a windowed stream's buffers (no service key needed)."""

    async def stats(self, partition: int) -> dict[str, int]:
        """Counters of one partition, plus `open` (records in the open window), `queued`
        (records in closed windows not yet finished), `waiting` (those windows),
        `staged` (windows with a staged output), `pending` (open + queued) and `settled`
        (published or suppressed: a windowed stream has no mixing pool)."""
        prefix = self.prefix(partition)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(f"{prefix}:stats")
            pipe.hlen(f"{prefix}:open")
            pipe.zrange(f"{prefix}:wq", 0, -1)
            counters, open_records, waiting = await pipe.execute()
        async with self.client.pipeline(transaction=True) as pipe:
            for number in waiting:
                pipe.hlen(f"{prefix}:w:{number.decode()}")
                pipe.exists(f"{prefix}:wout:{number.decode()}")
            sizes = await pipe.execute()
        out = dict.fromkeys(COUNTERS, 0) | {k.decode(): int(v) for k, v in counters.items()}
        out.pop("opened", None)
        queued = sum(sizes[0::2])
        out.update(
            open=open_records, queued=queued, waiting=len(waiting), staged=sum(sizes[1::2]),
            pending=open_records + queued,
            settled=out.get("published", 0) + out.get("suppressed", 0),
        )  # fmt: skip
        return out


class WindowBuffer(WindowState):
    """A windowed stream's buffers in Redis, for the partitions a worker owns."""

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        super().__init__(client, config)
        assert config.windowed is not None, "a windowed stream has a [windowed] table"
        self.settings = config.windowed
        self._script = client.register_script(lua_script("fingerprints", "ingest", "window"))
        self._ttl = int((config.record_ttl or 0) * 1000)

    async def ingest(
        self, partition: int, batch: PreparedBatch | None, now_ms: int, through: int = -1
    ) -> IngestOutcome:
        """Store a batch (or nothing: a tick) in the open window; close windows now due;
        `through` as for `service.store.buffer.StreamBuffer.ingest`.

        `pending` is the records buffered in the partition, `pool` its closed windows
        waiting for publication."""
        records = len(batch) if batch is not None else 0
        args: list = [
            "ingest", now_ms, self.settings.window, int(self.settings.max_window_wait * 1000),
            self._ttl, through, int(self.config.closed_retention * 1000), records,
        ]  # fmt: skip
        if batch is not None:
            args += [
                record_id + b"|".join([public, b",".join(b"%d" % c for c in values),
                                       b"%d" % m.offset])
                for record_id, public, values, m in zip(
                    batch.id_bytes(), batch.public, batch.sensitive.tolist(), batch.messages,
                    strict=True,
                )
            ]  # fmt: skip
        result = await self._script(keys=[self.prefix(partition)], args=args)
        if batch is not None or through >= 0:
            await self.replication.confirm(self.prefix(partition))
        statuses = [0] * records
        for position in range(2, len(result), 2):
            statuses[int(result[position]) - 1] = int(result[position + 1])
        return IngestOutcome(statuses, int(result[0]), int(result[1]))

    async def oldest(self, partition: int) -> int | None:
        """The number of the oldest closed window waiting for publication."""
        numbers = await self.client.zrange(f"{self.prefix(partition)}:wq", 0, 0)
        return int(numbers[0]) if numbers else None

    async def staged(self, partition: int, number: int) -> Staged | None:
        blob = await self.client.get(f"{self.prefix(partition)}:wout:{number}")
        if blob is None:
            return None
        await self.replication.confirm(self.prefix(partition))
        return decode_staged(blob)

    async def records(self, partition: int, number: int) -> dict[bytes, bytes]:
        return await self.client.hgetall(f"{self.prefix(partition)}:w:{number}")

    async def stage(self, partition: int, number: int, blob: bytes) -> Staged | None:
        """Keep `blob` as the window's output unless one is kept already: the output to
        send, or None if the window is finished already."""
        kept = await self._script(keys=[self.prefix(partition)], args=["stage", number, blob])
        if kept is None:
            return None
        await self.replication.confirm(self.prefix(partition))
        return decode_staged(blob if kept == 1 else kept)

    async def finish(
        self, partition: int, number: int, rows: int, side: int, suppressed: int, whole: bool
    ) -> bool:
        """Drop a published (or suppressed) window and count it; False if done before."""
        args = ["finish", number, rows, side, suppressed, int(whole)]
        return bool(await self._script(keys=[self.prefix(partition)], args=args))
