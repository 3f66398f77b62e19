"""Batch mechanisms on windows of the stream (issue 7, item 4; SPEC §2.3, §3).

A stream with ``stream.mechanism = "windowed"`` cuts each raw partition into
*windows* of ``windowed.window`` records and publishes every window with one of
the batch mechanisms of ``splu publish``: ``sdr``, ``fprivacy``, ``anatomy``,
``dbr`` or ``global`` (`service.publication.BATCH_PUBLISHERS`, the very code the
CLI runs, with the same option names and defaults). The worker is
`streams/windowed.py`; this module holds its Redis buffer and the pure function
that turns a window into messages, `render_window`.

Redis keys (prefix ``splu:{<stream>:<partition>}``, one Cluster slot per partition;
the steps are ``service/lua/window.lua`` behind the shared prelude ``ingest.lua``):

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

Publishing a window (`render_window`). Its records, sorted by their keyed id,
form a table; the mechanism runs with the record ids and a per-window key derived
from the service key (``window <partition>:<number>``), so every keyed draw,
the row order included, is fresh for each window yet reproducible: a retry after
a crash computes exactly the same output, and nothing is randomized twice. A
window the mechanism refuses (e.g. Anatomy's eligibility, SDR without a protected
value) or a partial window smaller than ``min_window`` is **suppressed** whole:
never published, counted in ``:stats`` as ``windows_suppressed`` and its records
as ``suppressed``, and logged with the reason. Records a mechanism drops itself
(F′-privacy suppression and trimming) count as ``suppressed`` too, so in the end
``ingested = published + suppressed``.

Messages on ``<stream>.published``: the Kafka key is a fresh random token (32 hex
digits); consumers drop a token seen before. The value is one JSON object:

- a *row*, in the mechanism's keyed random order: ``{attribute: label, ...}``.
  ``dbr``, ``global``: every schema attribute, sensitive ones randomized.
  ``sdr``: every attribute plus ``"subtable": "<partition>-<window>-<i>"``.
  ``anatomy``, ``fprivacy``: the public attributes only (the QIT) plus
  ``"group"`` or ``"bucket": "<partition>-<window>-<g>"``;
- after the rows, the window's *side messages*, told apart by ``"kind"``:
  ``{"kind": "st", "group" (or "bucket"): "<p>-<w>-<g>", "<sensitive>": label,
  "count": c}`` (anatomy and fprivacy, the ST: one per group and value, fake
  values included) and ``{"kind": "subtable", "subtable": "<p>-<w>-<i>", "values":
  [labels], "rows": |T_i|, "rho1": "a/b", "gamma": "a/b"}`` (sdr: SA_i, |T_i|, ρ_1i,
  γ_i, what `splu publish` writes to OUT.params.json).

Group, bucket and sub-table ids carry the partition and window number so they are
unique in the stream; nothing else leaves: no record ids, no arrival times, no
source positions. The consumer counts rows and side messages alike, by token, and
answers from every sub-table, group or bucket it holds whole
(`service.running_counts.PublishedWindows`), as `splu query` does on those windows
written as one batch publication.

Failure handling. Offsets are committed only after the ingest call returned
(`streams/bulk.py`); a replay is absorbed by the dedup keys. A crash
before *stage* recomputes the same output and stages it with new tokens (nothing
was sent); a crash after it re-sends the staged output under its tokens, possibly
a second time, which consumers absorb by token; records are deleted only by
*finish*, after the acknowledgement. Two workers briefly owning one partition
after a rebalance send the same staged messages, and only one *finish* counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from service.buffer import COUNTERS, BufferState, IngestOutcome, lua_script
from service.config import StreamConfig, WindowedSettings
from service.ingest import AcceptedRows, PreparedBatch, Preparer
from service.prf import ServiceKey
from service.publication import BATCH_PUBLISHERS, EXTRA_COLUMN
from service.schema import Schema
from service.table import Table

KIND = "kind"  # the field that marks a side message


@dataclass
class WindowOutput:
    """What one window publishes: row messages (in the mechanism's order) and side
    messages, or nothing and the reason it was suppressed."""

    records: int
    rows: list[bytes] = field(default_factory=list)
    side: list[bytes] = field(default_factory=list)
    reason: str | None = None  # why the whole window is suppressed
    summary: str = ""  # the mechanism's own account (trusted side, for the log)

    @property
    def suppressed(self) -> int:
        """Records of the window that are not published."""
        return self.records - len(self.rows)

    @property
    def messages(self) -> list[bytes]:
        return [*self.rows, *self.side]


def _json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


def window_key(key: ServiceKey, partition: int, number: int) -> ServiceKey:
    """The key of one window's draws: fresh per window, the same on every retry."""
    return ServiceKey(key.subkey(f"window {partition}:{number}"))


def window_table(schema: Schema, records: dict[bytes, bytes]) -> tuple[Table, np.ndarray]:
    """A window's records (id → "public|sensitive" codes) as a table in id order, and ids."""
    ordered = sorted(records.items())
    ids = (
        np.frombuffer(bytes.fromhex(b"".join(i for i, _ in ordered).decode()), dtype=">u8")
        .astype(np.uint64)
        .reshape(len(ordered), 2)
    )
    public = [a for a in schema.attributes if not a.sensitive]
    sensitive = [a for a in schema.attributes if a.sensitive]
    rows = []
    for _, value in ordered:
        public_text, _, sensitive_text = value.partition(b"|")
        rows.append(
            [
                *(public_text.split(b",") if public_text else ()),
                *sensitive_text.split(b","),
            ]
        )
    codes = np.asarray(rows, dtype=np.int64).reshape(len(ordered), len(schema.attributes))
    columns = {a.name: codes[:, i].astype(np.int32) for i, a in enumerate([*public, *sensitive])}
    return Table(schema, {a.name: columns[a.name] for a in schema.attributes}), ids


def render_window(
    schema: Schema,
    settings: WindowedSettings,
    key: ServiceKey,
    partition: int,
    number: int,
    records: dict[bytes, bytes],
) -> WindowOutput:
    """Window `number` of `partition` through the configured batch mechanism.

    Deterministic: the same records (in any order) and key give byte-identical output.
    """
    output = WindowOutput(len(records))
    if len(records) < settings.min_window:
        output.reason = f"{len(records)} records, fewer than windowed.min_window"
        return output
    table, ids = window_table(schema, records)
    captured = io.StringIO()
    try:
        # The publishers report on stderr; here that goes to the worker's log.
        with contextlib.redirect_stderr(captured):
            batch = BATCH_PUBLISHERS[settings.mechanism](
                dict(settings.options), table, ids, window_key(key, partition, number)
            )
    except ValueError as err:
        # The publishers name the CLI's flags (--gamma); a worker's log names the configuration.
        output.reason = re.sub(
            r"--([a-z][a-z-]*)", lambda m: "windowed." + m[1].replace("-", "_"), str(err)
        )
        return output
    finally:
        output.summary = captured.getvalue()
    prefix = f"{partition}-{number}-"
    extra = EXTRA_COLUMN.get(settings.mechanism)

    def labelled(header: list[str], columns: list[np.ndarray]) -> list[list[Any]]:
        lists = [c.tolist() for c in columns]
        if extra is not None and extra in header:
            position = header.index(extra)
            lists[position] = [prefix + str(g) for g in lists[position]]
        return lists

    columns = labelled(batch.header, batch.columns)
    output.rows = [
        _json(dict(zip(batch.header, row, strict=True))) for row in zip(*columns, strict=True)
    ]
    if batch.st_header is not None and batch.st_columns is not None:
        st = labelled(batch.st_header, batch.st_columns)
        output.side = [
            _json({KIND: "st", **dict(zip(batch.st_header, row, strict=True))})
            for row in zip(*st, strict=True)
        ]
    for i, subtable in enumerate(batch.params.get("subtables", ())):
        output.side.append(
            _json({KIND: "subtable", EXTRA_COLUMN["sdr"]: prefix + str(i), **subtable})
        )
    return output


def encode_staged(output: WindowOutput) -> bytes:
    """The output under fresh random tokens, as kept in ``:wout:<number>``."""
    header = {"rows": len(output.rows), "side": len(output.side), "suppressed": output.suppressed}
    lines = [_json(header)]
    lines += [secrets.token_hex(16).encode() + b" " + m for m in output.messages]
    return b"\n".join(lines)


@dataclass(frozen=True)
class Staged:
    """A window's staged output: (token, message) in sending order, and its counts."""

    messages: list[tuple[bytes, bytes]]
    rows: int
    side: int
    suppressed: int


def decode_staged(blob: bytes) -> Staged:
    header, *lines = blob.split(b"\n")
    counts = json.loads(header)
    messages = [(token, message) for token, _, message in (line.partition(b" ") for line in lines)]
    return Staged(messages, counts["rows"], counts["side"], counts["suppressed"])


class WindowPreparer(Preparer):
    """`Preparer` for windowed streams: validation, dedup keys, fingerprints and keyed ids as
    for every stream, and no per-record draws (the mechanism draws per window)."""

    def _batch(self, partition: int, rows: AcceptedRows) -> PreparedBatch:
        return self.identify(partition, rows.messages, rows.codes)


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
        `through` as for `service.buffer.StreamBuffer.ingest`.

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


def row_messages(messages: Iterable[bytes]) -> list[dict[str, Any]]:
    """The row messages among published values (side messages carry `KIND`)."""
    return [m for m in (json.loads(v) for v in messages) if KIND not in m]
