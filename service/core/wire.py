"""The shapes a decoy or personal record takes between the buffer and a count, each owned
here: every Python reader and writer goes through this module, and tests/test_wire.py
checks the Lua steps that write them (service/store/lua) against it.

Pool entry (written by the ingest steps, decoy.lua and personal.lua; read by the take, the
worker's publisher and the audit)::

    public|published|audit|true|arrival|id

  `public` and `published`: the public codes and the published sensitive codes, each
  comma-separated decimal codes in schema order; the only fields ever published.
  `audit`: a decoy record's group number and values per attribute ("number:v1,v2,...",
  ";" between attributes), or a personal record's kind (t trial, c copy, b borrowed copy).
  `true`: its true sensitive codes. `arrival`: milliseconds since the epoch. `id`: the
  record id.

Cell key (a published cell, as the consumer counts it and the audit's tallies hold it)::

    public|sensitive

  Comma-separated codes as in a pool entry. The two truth tallies count each record
  once in each: its true cell ``public|true`` and its shown cell ``public|published``
  (the pool entry's first two fields). The worker makes both of a take's records
  (`truth_cells_and_arrivals`) and acknowledge.lua adds them up in one step, so the two
  tallies always count the same records.

Published record (the worker writes it to ``<stream>.published``; the consumer, the
reader and `splu run` read it): a JSON object of attribute name to label, in schema
order, each member as ``json.dumps`` writes it and members joined by "," (`published_record`).
Workers write a cell's records byte for byte alike, which the consumer's cache of parsed
values relies on (`service.core.published.CellCodec`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple

FIELD = b"|"  # between the fields of a pool entry or a cell key
CODE = b","  # between the codes of one field


def codes_text(codes: Iterable[int]) -> bytes:
    """Codes as one field of a pool entry or a cell key."""
    return CODE.join(b"%d" % code for code in codes)


def codes_of(text: bytes) -> list[int]:
    """The codes of one field (`codes_text`); an empty field holds none."""
    return [int(code) for code in text.split(CODE)] if text else []


@dataclass(frozen=True)
class PoolEntry:
    """A record in a mixing pool or in flight (the module's first layout)."""

    public: bytes
    published: bytes
    audit: bytes
    true: bytes
    arrival: int
    id: bytes

    @classmethod
    def parse(cls, entry: bytes) -> PoolEntry:
        public, published, audit, true, arrival, record_id = entry.split(FIELD)
        return cls(public, published, audit, true, int(arrival), record_id)

    def encode(self) -> bytes:
        return FIELD.join(
            (self.public, self.published, self.audit, self.true, b"%d" % self.arrival, self.id)
        )


def shown_fields(entry: bytes) -> tuple[bytes, bytes]:
    """A pool entry's public and published fields, the only ones ever published, without
    parsing the rest."""
    public, published, _ = entry.split(FIELD, 2)
    return public, published


class TakeTotals(NamedTuple):
    """What the acknowledgement of a take counts, each with its records: the true cells
    and the shown cells of its records (`cell_key`) and their arrivals, as text."""

    true: Counter[bytes]
    shown: Counter[bytes]
    arrivals: Counter[bytes]


def truth_cells_and_arrivals(entries: Iterable[bytes]) -> TakeTotals:
    """The truth tallies' cells of pool entries and their arrivals. The worker does this
    per record, so each entry is split once, and cells are joined and counted by C loops
    (`map`, `Counter`) with no Python step per record."""
    fields = [entry.split(FIELD) for entry in entries]
    if any(map((6).__ne__, map(len, fields))):
        raise ValueError("a pool entry has 6 fields")
    join = FIELD.join
    return TakeTotals(
        Counter(map(join, map(itemgetter(0, 3), fields))),
        Counter(map(join, map(itemgetter(0, 1), fields))),
        Counter(map(itemgetter(4), fields)),
    )


def cell_key(public: bytes, sensitive: bytes) -> bytes:
    """The cell of a record's public and sensitive fields."""
    return public + FIELD + sensitive


def cell_fields(key: bytes) -> tuple[bytes, bytes]:
    """A cell key's public and sensitive fields."""
    public, sensitive = key.split(FIELD)
    return public, sensitive


def published_member(name: str, label: str) -> bytes:
    """One attribute of a published record, as its JSON text holds it."""
    return json.dumps({name: label})[1:-1].encode()


def published_record(labels: Mapping[str, str]) -> bytes:
    """A published record's JSON text: its attributes in the order given (schema order)."""
    return b"{%s}" % b",".join(published_member(n, label) for n, label in labels.items())


def read_published(value: bytes) -> dict[str, Any]:
    """A published record's attributes; raises ValueError if it is no JSON object."""
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError("a published record is a JSON object")
    return record
