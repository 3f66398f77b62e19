"""A window of a windowed stream as messages (SPEC §2.3, §3): the batch mechanism of
``splu publish`` run on the window's records (`render_window`), and the messages'
format. The worker (`streams/worker/windowed.py`) keeps windows in Redis
(`service.store.windowed`).

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
(`service.core.published.PublishedWindows`), as `splu query` does on those windows
written as one batch publication.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.core.ingest import AcceptedRows, PreparedBatch, Preparer
from service.core.mechanism_settings import WindowedSettings
from service.core.mechanisms.registry import MECHANISMS
from service.core.mechanisms.sdr import SUBTABLE_COLUMN
from service.core.prf import ServiceKey
from service.core.publication import configured
from service.core.schema import Schema
from service.core.table import Table

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


def message_json(document: dict[str, Any]) -> bytes:
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
            batch = MECHANISMS[settings.mechanism].publish(
                dict(settings.options), table, ids, window_key(key, partition, number)
            )
    except ValueError as err:
        # The publishers name the CLI's flags (--gamma); a worker's log names the configuration.
        output.reason = configured(str(err), "windowed")
        return output
    finally:
        output.summary = captured.getvalue()
    prefix = f"{partition}-{number}-"
    extra = MECHANISMS[settings.mechanism].extra_column

    def labelled(header: list[str], columns: list[np.ndarray]) -> list[list[Any]]:
        lists = [c.tolist() for c in columns]
        if extra is not None and extra in header:
            position = header.index(extra)
            lists[position] = [prefix + str(g) for g in lists[position]]
        return lists

    columns = labelled(batch.header, batch.columns)
    output.rows = [
        message_json(dict(zip(batch.header, row, strict=True)))
        for row in zip(*columns, strict=True)
    ]
    if batch.st_header is not None and batch.st_columns is not None:
        st = labelled(batch.st_header, batch.st_columns)
        output.side = [
            message_json({KIND: "st", **dict(zip(batch.st_header, row, strict=True))})
            for row in zip(*st, strict=True)
        ]
    for i, subtable in enumerate(batch.params.get("subtables", ())):
        output.side.append(
            message_json({KIND: "subtable", SUBTABLE_COLUMN: prefix + str(i), **subtable})
        )
    return output


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


def row_messages(messages: Iterable[bytes]) -> list[dict[str, Any]]:
    """The row messages among published values (side messages carry `KIND`)."""
    return [m for m in (json.loads(v) for v in messages) if KIND not in m]
