"""Encoded tables and the CSV edge of batch mode.

A `Table` holds one integer code array per schema attribute plus the source
line of every row, so any row a mechanism suppresses or trims can be reported
back by line. Reading never drops a row silently: a row that cannot be encoded
becomes a `Rejection` with the line and the field.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TextIO

import numpy as np

from service.schema import Rejection, Schema, SchemaError

SAMPLE_NAME = "adult"


@dataclass
class Table:
    """Rows of a stream as integer codes into the schema's domains."""

    schema: Schema
    codes: dict[str, np.ndarray]
    lines: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    def __post_init__(self) -> None:
        lengths = {len(c) for c in self.codes.values()}
        if len(lengths) > 1:
            raise ValueError("all columns of a table must have the same length")
        if len(self.lines) == 0 and self.codes:
            self.lines = np.arange(len(next(iter(self.codes.values()))), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lines)

    def take(self, rows: np.ndarray) -> Table:
        """The rows at positions (or boolean mask) `rows`, in that order."""
        return Table(self.schema, {k: v[rows] for k, v in self.codes.items()}, self.lines[rows])

    def labels(self, name: str) -> np.ndarray:
        """Column `name` decoded back to its published strings."""
        domain = np.asarray(self.schema[name].domain, dtype=object)
        return domain[self.codes[name]]

    @classmethod
    def from_labels(cls, schema: Schema, columns: Mapping[str, Sequence[str]]) -> Table:
        """Encode columns of strings that are known to be in the domains (tests, examples)."""
        codes = {}
        for attribute in schema.attributes:
            encoded = np.asarray(attribute.codes_of(columns[attribute.name]), dtype=np.int32)
            if (encoded < 0).any():
                raise SchemaError(f"column {attribute.name!r} has values outside its domain")
            codes[attribute.name] = encoded
        return cls(schema, codes)


def distinct_rows(
    columns: Sequence[np.ndarray], sizes: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct rows of integer code columns (codes < sizes), sorted.

    Returns (rows as a (k, c) array, each input row's index into them, counts).
    Codes are folded into one mixed-radix key so a 1-D unique does the work; a
    row-wise unique is an order of magnitude slower.
    """
    n = len(columns[0]) if columns else 0
    if not columns:
        return np.zeros((1, 0), np.int64), np.zeros(n, np.int64), np.array([n])
    stacked = np.column_stack([np.asarray(c, dtype=np.int64) for c in columns])
    if math.prod(sizes) < 2**62:
        radix = np.cumprod([1, *sizes[:0:-1]])[::-1]
        keys, inverse, counts = np.unique(stacked @ radix, return_inverse=True, return_counts=True)
        rows = (keys[:, None] // radix) % np.asarray(sizes)
    else:
        rows, inverse, counts = np.unique(stacked, axis=0, return_inverse=True, return_counts=True)
    return rows, inverse.ravel(), counts


def open_text(path: str | Path) -> TextIO:
    """Open a CSV (plain or .gz) so that bad UTF-8 reaches the validator, not a crash."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape", newline="")
    return path.open(encoding="utf-8", errors="surrogateescape", newline="")


def open_sample() -> TextIO:
    """The bundled sample: UCI Adult, 45,222 records without missing values."""
    data = resources.files("service").joinpath("data", f"{SAMPLE_NAME}.csv.gz").read_bytes()
    return io.TextIOWrapper(io.BytesIO(gzip.decompress(data)), encoding="utf-8", newline="")


@dataclass
class RawRows:
    """A CSV split into its header and well-formed rows, with malformed lines rejected."""

    header: list[str]
    rows: list[list[str]]
    lines: list[int]
    rejections: list[Rejection]


def read_rows(stream: TextIO) -> RawRows:
    reader = csv.reader(stream)
    try:
        header = next(reader)
    except StopIteration:
        raise SchemaError("the input is empty: expected a header line") from None
    except csv.Error as err:
        raise SchemaError(f"line 1: malformed header: {err}") from None
    if len(set(header)) != len(header):
        raise SchemaError("line 1: the header names a column twice")
    rows, lines, rejections = [], [], []
    width = len(header)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as err:
            rejections.append(Rejection(reader.line_num, None, f"malformed CSV line: {err}"))
            continue
        if not row:
            continue
        if len(row) != width:
            rejections.append(
                Rejection(
                    reader.line_num,
                    None,
                    f"malformed CSV line: {len(row)} fields, the header has {width}",
                )
            )
            continue
        rows.append(row)
        lines.append(reader.line_num)
    return RawRows(header, rows, lines, rejections)


def encode_rows(schema: Schema, raw: RawRows) -> tuple[Table, list[Rejection]]:
    """Encode well-formed rows; each row with an unusable value becomes a Rejection."""
    missing = [a.name for a in schema.attributes if a.name not in raw.header]
    if missing:
        raise SchemaError(
            f"the input has no column {missing[0]!r}; its header is {', '.join(raw.header)}"
        )
    codes = {}
    bad = np.zeros(len(raw.rows), dtype=bool)
    for attribute in schema.attributes:
        i = raw.header.index(attribute.name)
        column = [row[i] for row in raw.rows]
        encoded = np.asarray(attribute.codes_of(column), dtype=np.int32)
        bad |= encoded < 0
        codes[attribute.name] = encoded
    lines = np.asarray(raw.lines, dtype=np.int64)
    rejections = list(raw.rejections)
    for position in np.flatnonzero(bad):
        record = dict(zip(raw.header, raw.rows[position], strict=True))
        rejections.append(_first_problem(schema, record, int(lines[position])))
    rejections.sort(key=lambda r: r.record)
    table = Table(schema, codes, lines).take(~bad)
    return table, rejections


def _first_problem(schema: Schema, record: Mapping[str, str], line: int) -> Rejection:
    for attribute in schema.attributes:
        try:
            attribute.code_of(record[attribute.name])
        except ValueError as err:
            reason = str(err)
            if reason == "missing value" and attribute.sensitive:
                reason = "missing value for a sensitive attribute"
            return Rejection(line, attribute.name, reason)
    raise AssertionError("row flagged as bad has no bad field")


def read_table(
    stream: TextIO,
    schema: Schema | None = None,
    quasi: Sequence[str] = (),
    sensitive: Sequence[str] = (),
    bins: Mapping[str, float | Sequence[float]] | None = None,
) -> tuple[Table, list[Rejection]]:
    """Read a CSV into a Table, with a given schema or one scanned from the data."""
    raw = read_rows(stream)
    if schema is None:
        schema = Schema.scan(raw.header, raw.rows, quasi, sensitive, bins)
    return encode_rows(schema, raw)


def write_table(table: Table, stream: TextIO, order: np.ndarray | None = None) -> None:
    """Write the schema's columns of `table` (rows in `order`) as CSV text."""
    names = table.schema.names
    columns = [table.labels(n) for n in names]
    if order is not None:
        columns = [c[order] for c in columns]
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(names)
    writer.writerows(zip(*columns, strict=True))
