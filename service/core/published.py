"""What a published record is in counts: the cell key of a decoy or personal stream's
record (`CellCodec`), and a windowed stream's rows and side messages (`WindowCodec`,
`PublishedWindows`).

A *cell* is one combination of every published column: public values and
published sensitive values, written as ``"public codes|sensitive codes"`` (codes
comma-separated, schema order), the same text the buffer's truth tally uses, so published
and true counts read back into `PublishedCells` the same way.

Windowed streams (`service/store/windowed.py`) publish each window through a batch mechanism,
rows and side messages. `WindowCodec` writes a row as ``"public|sensitive|unit"``, the
unit being the row's sub-table (sdr), QI-group (anatomy) or bucket (fprivacy), and a side
message as its own JSON text; `PublishedWindows` turns such a tally into the estimator
`splu query` builds from the same rows and side messages written as one batch
publication (`PublishedWindows.write`), so the consumer's answers are `splu query`'s.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np

from service.core.batch_files import write_batch
from service.core.mechanism_settings import WindowedSettings
from service.core.mechanisms.registry import MECHANISMS, Buckets, Evidence, MechanismSpec
from service.core.mechanisms.sdr import SUBTABLE_COLUMN, SubTable
from service.core.publishers import COUNT_COLUMN, Batch
from service.core.reconstruct import (
    Answers,
    PublishedCells,
)
from service.core.schema import Schema
from service.core.table import Table
from service.core.windows import KIND
from service.core.wire import CODE, FIELD, cell_key, codes_text, read_published


class PublishedRecordError(ValueError):
    """A message on the published topic that the stream's schema cannot read."""


# Distinct published values whose cell is remembered: at ~200 bytes each, ~40 MB at most.
KNOWN_VALUES = 200_000


class CellCodec:
    """Published JSON records to cell keys and cell tallies to `PublishedCells`."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        codes = {a.name: {label: i for i, label in enumerate(a.domain)} for a in schema.attributes}
        self._public = [(a.name, codes[a.name]) for a in schema.public]
        self._sensitive = [(a.name, codes[a.name]) for a in schema.sensitive]
        self._known: dict[bytes, bytes] = {}

    def key_of(self, value: bytes) -> bytes:
        """The cell of one published record; raises PublishedRecordError if unreadable.

        Workers write a cell's records byte for byte alike, so a stream has about as
        many distinct values as cells: each is parsed once (up to KNOWN_VALUES of them).
        """
        key = self._known.get(value)
        if key is None:
            key = self._parse(value)
            if len(self._known) >= KNOWN_VALUES:
                self._known.clear()
            self._known[value] = key
        return key

    def _parse(self, value: bytes) -> bytes:
        try:
            record = read_published(value)
            public = codes_text(codes[record[name]] for name, codes in self._public)
            sensitive = codes_text(codes[record[name]] for name, codes in self._sensitive)
        except (ValueError, KeyError, TypeError) as err:
            raise PublishedRecordError(f"not a published record of this schema ({err})") from None
        if len(record) != len(self._public) + len(self._sensitive):
            raise PublishedRecordError("a published record carries attributes beyond the schema")
        return cell_key(public, sensitive)

    def cells(self, tally: Mapping[bytes, int]) -> PublishedCells:
        """A tally of cell keys as `PublishedCells` over the schema's domains."""
        names = self.schema.names
        order = [a.name for a in self.schema.public] + [a.name for a in self.schema.sensitive]
        # One split of all keys at once: tallies hold tens of thousands of cells.
        blob = CODE.join(tally).replace(FIELD, CODE)
        codes = np.array(blob.split(CODE), dtype=np.int32) if tally else np.empty(0, np.int32)
        rows = codes.reshape(len(tally), len(order))
        counts = np.fromiter(tally.values(), dtype=np.int64, count=len(tally))
        position = {name: i for i, name in enumerate(order)}
        cells = rows[:, [position[n] for n in names]]
        domains = {a.name: a.domain for a in self.schema.attributes}
        return PublishedCells(names, domains, cells, counts)


# A unit's label: "<raw partition>-<window>-<unit in the window>", unique in the stream.
UNIT_LABEL = re.compile(r"(\d+)-(\d+)-(\d+)")


def side_kind(spec: MechanismSpec) -> str | None:
    """The kind of a windowed mechanism's side messages (`service.core.windows`): a
    bucketing mechanism's rows are QIT rows (public values and a unit, no sensitive value)
    and its side messages the ST, one per unit and value, with a count; SDR's are its
    sub-tables."""
    if spec.bucketed:
        return "st"
    return "subtable" if spec.extra_column == SUBTABLE_COLUMN else None


def _unit_order(label: str) -> tuple[int, ...]:
    """Units in stream order: partition, window, then the unit's number in its window."""
    return tuple(int(part) for part in label.split("-"))


class WindowCodec:
    """A windowed stream's published messages to cell keys (see `PublishedWindows`).

    A row becomes ``"public codes|sensitive codes|unit"`` (no sensitive codes in a QIT row,
    no unit for dbr and global), a side message its own JSON text: side messages are few
    (one per unit, or per unit and value) and each is distinct, and their text starts with
    "{", which no row's key does.
    """

    def __init__(self, schema: Schema, settings: WindowedSettings) -> None:
        self.mechanism = settings.mechanism
        self.spec = MECHANISMS[settings.mechanism]
        self.unit = self.spec.extra_column
        codes = {a.name: {label: i for i, label in enumerate(a.domain)} for a in schema.attributes}
        self._public = [(a.name, codes[a.name]) for a in schema.public]
        shown = [] if self.spec.bucketed else schema.sensitive
        self._sensitive = [(a.name, codes[a.name]) for a in shown]
        self._fields = {n for n, _ in self._public + self._sensitive} | (
            {self.unit} if self.unit is not None else set()
        )
        self._domain = set(schema.sensitive[0].domain)
        self._name = schema.sensitive[0].name

    def key_of(self, value: bytes) -> bytes:
        """The cell of one published message; raises PublishedRecordError if unreadable."""
        try:
            record = json.loads(value)
        except ValueError as err:
            raise PublishedRecordError(f"not a published message ({err})") from None
        if not isinstance(record, dict):
            raise PublishedRecordError("a published message is a JSON object")
        if KIND in record:
            self._check_side(record)
            if not value.startswith(b"{"):
                raise PublishedRecordError("a side message starts with '{'")
            return value
        if set(record) != self._fields:
            raise PublishedRecordError(
                f"not a published row of a windowed {self.mechanism} stream of this schema "
                f"(fields {', '.join(sorted(record))})"
            )
        try:
            public = ",".join(str(codes[record[name]]) for name, codes in self._public)
            sensitive = ",".join(str(codes[record[name]]) for name, codes in self._sensitive)
        except (KeyError, TypeError) as err:
            raise PublishedRecordError(f"a value outside the schema ({err})") from None
        unit = "" if self.unit is None else self._label(record[self.unit])
        return f"{public}|{sensitive}|{unit}".encode()

    def _label(self, unit: object) -> str:
        if not isinstance(unit, str) or not UNIT_LABEL.fullmatch(unit):
            raise PublishedRecordError(f"{self.unit} {unit!r} is not <partition>-<window>-<n>")
        return unit

    def _check_side(self, record: dict[str, Any]) -> None:
        kind = side_kind(self.spec)
        if record[KIND] != kind or self.unit is None:
            raise PublishedRecordError(
                f"a side message of kind {record[KIND]!r} on a windowed {self.mechanism} stream"
            )
        self._label(record.get(self.unit))
        try:
            if kind == "st":
                if set(record) != {KIND, self.unit, self._name, COUNT_COLUMN}:
                    raise ValueError(f"fields {', '.join(sorted(record))}")
                if record[self._name] not in self._domain:
                    raise ValueError(f"{record[self._name]!r} is not in the domain")
                if not isinstance(record[COUNT_COLUMN], int) or record[COUNT_COLUMN] < 1:
                    raise ValueError(f"count {record[COUNT_COLUMN]!r}")
            else:
                if set(record) != {KIND, self.unit, "values", "rows", "rho1", "gamma"}:
                    raise ValueError(f"fields {', '.join(sorted(record))}")
                values = record["values"]
                if not values or not set(values) <= self._domain:
                    raise ValueError(f"values {values!r}")
                if not isinstance(record["rows"], int) or record["rows"] < 1:
                    raise ValueError(f"rows {record['rows']!r}")
                if not 0 < Fraction(record["rho1"]) < 1 or not Fraction(record["gamma"]) > 1:
                    raise ValueError(f"rho1 {record['rho1']!r}, gamma {record['gamma']!r}")
        except (ValueError, TypeError, ZeroDivisionError) as err:
            raise PublishedRecordError(f"not a {kind} message of this stream ({err})") from None


@dataclass(frozen=True)
class PublishedWindows:
    """What a windowed stream published, as far as it is counted: its rows as cells and its
    side data, for the units (sub-tables, groups, buckets) counted whole.

    A unit counts once its side messages and all its rows are in: an SDR sub-table when
    its message is and its rows number the message's |T_i|; a group or bucket when its
    rows number its ST counts' sum (less the fake values, σ per bucket). Until then its rows
    are `held` out of every estimate, so that each estimate is the one `splu query` gives on
    the same units written as one batch publication (`write`). Each unit is a sub-publication
    of its own and every mechanism's estimate is a sum over units, so this is the sum of
    the per-window reconstructions. DBR and global rows need no side data.

    Units are numbered in stream order (partition, window, unit) and the ST is sorted by
    unit, then value, as each window's own ST is.
    """

    schema: Schema
    settings: WindowedSettings
    units: tuple[str, ...]  # labels of the units counted whole, in order
    public: np.ndarray  # (cells, public attributes) codes
    sensitive: np.ndarray  # (cells, sensitive attributes) codes; none in a QIT row
    unit: np.ndarray  # each cell's unit (index into `units`); 0 without units
    counts: np.ndarray  # rows per cell
    subtables: tuple[SubTable, ...]  # sdr: SA_i, |T_i|, ρ_1i, γ_i per unit
    st_unit: np.ndarray  # anatomy, fprivacy: the ST, one row per unit and value
    st_value: np.ndarray
    st_count: np.ndarray
    side: int  # side messages of the units counted whole
    held: int  # rows counted whose unit is not whole yet

    @property
    def rows(self) -> int:
        """Published rows the estimates include."""
        return int(self.counts.sum())

    @classmethod
    def from_messages(
        cls, schema: Schema, settings: WindowedSettings, messages: Iterable[bytes]
    ) -> PublishedWindows:
        """From published message values, each once (deduplicated by token); the schema
        and settings are a stream config's, or a reader's from the stream's manifest."""
        codec = WindowCodec(schema, settings)
        return cls.from_tally(schema, settings, Counter(codec.key_of(m) for m in messages))

    @classmethod
    def from_tally(
        cls, schema: Schema, settings: WindowedSettings, tally: Mapping[bytes, int]
    ) -> PublishedWindows:
        """From the consumer's counts of `WindowCodec` cells."""
        spec = MECHANISMS[settings.mechanism]
        subtabled = spec.extra_column == SUBTABLE_COLUMN
        # Each side message is distinct; a repeat under another token would be a window
        # published twice, whose rows then outnumber its side data and hold it out.
        side = [json.loads(key) for key in tally if key.startswith(b"{")]
        rows = [(key.split(b"|"), count) for key, count in tally.items() if key[:1] != b"{"]
        unit_column = spec.extra_column
        counted: Counter[str] = Counter()
        for (_, _, unit), count in rows:
            counted[unit.decode()] += count
        if unit_column is None:
            units: list[str] = []
            whole = {""}
        else:
            size = "rows" if subtabled else COUNT_COLUMN
            declared: Counter[str] = Counter()
            for message in side:
                declared[message[unit_column]] += message[size]
            # F′-privacy: each bucket's ST lists σ fake values, with a count of 1 each.
            sigma = settings.options.get("fake_values", 0)
            declared = Counter({u: n - sigma for u, n in declared.items()})
            units = sorted((u for u, n in declared.items() if counted[u] == n), key=_unit_order)
            whole = set(units)
        index = {label: i for i, label in enumerate(units)}
        kept = [(parts, count) for parts, count in rows if parts[2].decode() in whole]

        def codes(position: int, width: int) -> np.ndarray:
            lists = [p[position].split(b",") if p[position] else [] for p, _ in kept]
            return np.array(lists, dtype=np.int32).reshape(len(kept), width)

        width = 0 if spec.bucketed else len(schema.sensitive)
        name = schema.sensitive[0].name
        code_of = {label: i for i, label in enumerate(schema.sensitive[0].domain)}
        subtables, st = [], []
        for message in side:
            position = index.get(message[unit_column]) if unit_column else None
            if position is None:
                continue
            if subtabled:
                subtables.append(
                    (
                        position,
                        SubTable(
                            tuple(sorted(code_of[v] for v in message["values"])),
                            int(message["rows"]), Fraction(message["rho1"]),
                            Fraction(message["gamma"]),
                        ),
                    )
                )  # fmt: skip
            else:
                st.append((position, code_of[message[name]], int(message[COUNT_COLUMN])))
        st.sort()
        st_columns = np.array(st, dtype=np.int64).reshape(len(st), 3).T
        return cls(
            schema=schema,
            settings=settings,
            units=tuple(units),
            public=codes(0, len(schema.public)),
            sensitive=codes(1, width),
            unit=np.array([index.get(p[2].decode(), 0) for p, _ in kept], dtype=np.int64),
            counts=np.array([c for _, c in kept], dtype=np.int64),
            subtables=tuple(s for _, s in sorted(subtables, key=lambda item: item[0])),
            st_unit=st_columns[0], st_value=st_columns[1], st_count=st_columns[2],
            side=len(subtables) + len(st),
            held=sum(counted.values()) - sum(c for _, c in kept),
        )  # fmt: skip

    def _columns(self) -> tuple[list[str], list[np.ndarray], dict[str, tuple[str, ...]]]:
        """The published columns of the whole units, as cells: names, codes, domains (the
        unit column holds unit numbers)."""
        schema = self.schema
        public = [a.name for a in schema.public]
        sensitive = [a.name for a in schema.sensitive][: self.sensitive.shape[1]]
        names = [*public, *sensitive]
        columns = [*self.public.T, *self.sensitive.T]
        domains = {n: schema[n].domain for n in names}
        unit_column = MECHANISMS[self.mechanism].extra_column
        if unit_column is not None:
            names.append(unit_column)
            columns.append(self.unit)
            domains[unit_column] = tuple(str(i) for i in range(len(self.units)))
        return names, columns, domains

    @property
    def mechanism(self) -> str:
        return self.settings.mechanism

    def estimator(self, confidence: float = 0.95) -> Answers:
        """The estimator `splu query` builds from `write`'s files (`load_batch`), with its
        defaults: the given confidence, no clipping."""
        schema, spec = self.schema, MECHANISMS[self.mechanism]
        sensitive = schema.sensitive[0]
        evidence = Evidence(
            self.settings.options, [a.name for a in schema.sensitive],
            domains={a.name: a.domain for a in schema.sensitive}, confidence=confidence,
            clip=False, subtables=self.subtables,
        )  # fmt: skip
        if spec.bucketed:
            rows = np.repeat(np.arange(len(self.counts)), self.counts)
            buckets = Buckets(
                public=tuple(schema.public),
                sensitive=sensitive,
                qit={a.name: self.public[rows, i] for i, a in enumerate(schema.public)},
                unit=self.unit[rows],
                st_unit=self.st_unit,
                st_value=self.st_value,
                st_count=self.st_count,
            )
            evidence = replace(evidence, buckets=buckets)
        else:
            names, columns, domains = self._columns()
            cells = PublishedCells(
                names, domains, np.column_stack(columns).astype(np.int32), self.counts
            )
            evidence = replace(evidence, cells=cells)
        assert spec.reconstruct is not None
        return spec.reconstruct(evidence)

    def write(self, output: str) -> list[str]:
        """The whole units as one batch publication, the files `splu publish --mechanism
        <the stream's>` writes (OUT.csv, OUT.st.csv, OUT.params.json), units numbered as
        here, for `splu query --published OUT.csv`."""
        schema, settings = self.schema, self.settings
        names, columns, domains = self._columns()
        rows = np.repeat(np.arange(len(self.counts)), self.counts)
        spec = MECHANISMS[self.mechanism]
        unit_column = spec.extra_column
        labels = [
            column[rows] if name == unit_column else np.asarray(domains[name], object)[column[rows]]
            for name, column in zip(names, columns, strict=True)
        ]
        batch = Batch(header=names, columns=labels)
        sensitive = schema.sensitive[0]
        if spec.bucketed:
            assert unit_column is not None
            batch.st_header = [unit_column, sensitive.name, COUNT_COLUMN]
            values = np.asarray(sensitive.domain, dtype=object)[self.st_value]
            batch.st_columns = [self.st_unit, values, self.st_count]
            # What the publisher records: Anatomy's groups, F′-privacy's buckets.
            batch.params = {f"{unit_column}s": len(self.units)}
        elif unit_column == SUBTABLE_COLUMN:
            batch.params = {
                "subtables": [
                    {
                        "values": [sensitive.domain[v] for v in s.values],
                        "rows": s.size, "rho1": str(s.rho1), "gamma": str(s.gamma),
                    }
                    for s in self.subtables
                ]
            }  # fmt: skip
        empty = Table(schema, {})
        return write_batch(output, self.mechanism, dict(settings.options), empty, batch)
