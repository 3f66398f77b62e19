"""Encoded tables and the CSV edge of batch mode.

A `Table` holds one integer code array per schema attribute plus the source
line of every row, so any row a mechanism suppresses or trims can be reported
back by line. Reading never drops a row silently: a row that cannot be encoded
becomes a `Rejection` with the line and the field. The csv module's reading
(`read_rows`) defines what a row is; `read_table` gets the same rows faster from
Arrow's CSV parser wherever that is certain to split a line the same way. Every reader
takes the delimiter it is given, or the one `sniff_delimiter` finds in the header line
(survey exports use semicolons in many locales, tabs or bars), and drops a byte-order
mark from the header.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from service.core.schema import Rejection, Schema, SchemaError

SAMPLE_NAME = "adult"
WRITE_CHUNK = 100_000  # rows joined into one string per write
# The delimiters a header line is sniffed for; a header with none of them is one column.
DELIMITERS = ",;\t|"
BYTE_ORDER_MARK = "\ufeff"


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
    Codes are folded into one mixed-radix key so a 1-D unique does the work: a
    row-wise unique sorts and compares whole rows.
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
    data = resources.files("service.core").joinpath("data", f"{SAMPLE_NAME}.csv.gz").read_bytes()
    return io.TextIOWrapper(io.BytesIO(gzip.decompress(data)), encoding="utf-8", newline="")


@dataclass
class RawRows:
    """A CSV split into its header and well-formed rows, with malformed lines rejected."""

    header: list[str]
    rows: list[list[str]]
    lines: list[int]
    rejections: list[Rejection]


def sniff_delimiter(text: str) -> str:
    """The delimiter of a CSV starting with `text`: the one of `DELIMITERS` that
    csv.Sniffer finds in its first line, else a comma."""
    first = text.partition("\n")[0].partition("\r")[0]
    try:
        return csv.Sniffer().sniff(first, delimiters=DELIMITERS).delimiter
    except csv.Error:
        return ","


def _read_header(reader: Iterator[list[str]]) -> list[str]:
    try:
        header = next(reader)
    except StopIteration:
        raise SchemaError("the input is empty: expected a header line") from None
    except csv.Error as err:
        raise SchemaError(f"line 1: malformed header: {err}") from None
    if header and header[0].startswith(BYTE_ORDER_MARK):
        header[0] = header[0].removeprefix(BYTE_ORDER_MARK)
    if len(set(header)) != len(header):
        raise SchemaError("line 1: the header names a column twice")
    return header


def csv_reader(stream: TextIO, delimiter: str | None = None) -> tuple[list[str], Any]:
    """The header of a CSV and a csv.reader of the lines after it (its `line_num` counts
    from the file's first line), split at `delimiter`, or at the one sniffed from the
    header line."""
    first = stream.readline()
    lines = itertools.chain([first] if first else [], stream)
    reader = csv.reader(lines, delimiter=delimiter or sniff_delimiter(first))
    return _read_header(reader), reader


def read_rows(stream: TextIO, delimiter: str | None = None) -> RawRows:
    """Split a CSV row by row with the csv module: the reference every faster reader matches."""
    header, reader = csv_reader(stream, delimiter)
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


@dataclass
class Columns:
    """A CSV read column by column: each header column as its distinct strings and
    each row's index into them, the source line of each row, and the malformed
    lines rejected (the rows of `RawRows`, stored by column)."""

    header: list[str]
    values: list[list[str]]
    indices: list[np.ndarray]
    lines: np.ndarray
    rejections: list[Rejection]

    def __len__(self) -> int:
        return len(self.lines)

    def record(self, position: int) -> dict[str, str]:
        return {
            name: self.values[j][self.indices[j][position]] for j, name in enumerate(self.header)
        }


@functools.cache
def _plain_patterns(delimiter: str) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """A line that both the csv module and Arrow's parser (quoting on) split into the same
    fields at `delimiter`, and a body of such lines: each field either holds no quote, or
    is wholly quoted with inner quotes doubled and no line break. The quantifiers are
    possessive: no backtracking."""
    split = re.escape(delimiter.encode())
    field = rb'(?:"(?:[^"\r\n]++|"")*+"|[^"' + split + rb"\r\n]*+)"
    line = field + rb"(?:" + split + field + rb")*+"
    return re.compile(line), re.compile(rb"(?:" + line + rb"\r?\n)*+(?:" + line + rb")?+")


def read_columns(text: str, delimiter: str | None = None) -> Columns | None:
    """CSV text split as `read_rows` splits it, column by column; None where only it can.

    Arrow's CSV parser splits the lines whose every field is either free of double
    quotes or wholly quoted (inner quotes doubled, no line break inside): on those
    the csv module and Arrow give the same fields. From each other line with a
    quote, or one long enough to reach the csv module's field limit, the csv
    module reads one record itself (over as many lines as its quotes span), so its
    errors and line numbers are its own. Text with a lone carriage return (a line
    break only where the file was opened with newline=""), or with characters that
    are not UTF-8 bytes read with surrogateescape, is left to `read_rows`: None.
    """
    data = _utf8(text)
    if data is None or data.count(b"\r") != data.count(b"\r\n"):
        return None
    delimiter = delimiter or sniff_delimiter(text)
    feed = _Lines(data, 0)
    header = _read_header(csv.reader(feed, delimiter=delimiter))
    if not header:
        return None
    body = data[feed.offset :]
    if b'"' not in body or _plain_patterns(delimiter)[1].fullmatch(body):
        parsed = _split(body, len(header), delimiter)
        # Every physical line became a row: no blank line was skipped, no width was wrong.
        if parsed is not None and len(parsed[1][0]) == body.count(b"\n") + (
            not body.endswith(b"\n") and len(body) > 0
        ):
            values, indices = parsed
            first = feed.count + 1
            lines = np.arange(first, first + len(indices[0]), dtype=np.int64)
            return Columns(header, values, indices, lines, [])
    return _read_columns_by_line(data, header, feed.count, delimiter)


def _utf8(text: str) -> bytes | None:
    """The bytes `text` was decoded from (UTF-8, bad bytes as surrogateescape), if any."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None
    # Escaped bytes that happen to form a valid sequence would decode differently.
    return data if data.decode("utf-8", "surrogateescape") == text else None


class _Lines:
    """The lines of UTF-8 `data` from byte `offset` on, as text, counted: a csv.reader's input."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data, self.offset, self.count = data, offset, 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        if self.offset >= len(self.data):
            raise StopIteration
        end = self.data.find(b"\n", self.offset)
        end = len(self.data) if end < 0 else end + 1
        line = self.data[self.offset : end]
        self.offset, self.count = end, self.count + 1
        return line.decode("utf-8", "surrogateescape")


def _split(
    body: bytes, width: int, delimiter: str
) -> tuple[list[list[str]], list[np.ndarray]] | None:
    """Lines of `width` fields that `_plain_patterns` match, as (distinct values, indices)
    per column; None if a line has another width or a field passes the csv field limit.
    Blank lines are skipped, as the csv module skips them."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    names = [f"f{i}" for i in range(width)]
    # Arrow takes a byte-order mark at the start of its input for one, where the csv
    # module keeps it in the field: a first row of placeholders, dropped below, comes first.
    placeholder = delimiter.encode().join([b"x"] * width) + b"\n"
    try:
        table = pacsv.read_csv(
            pa.py_buffer(placeholder + body),
            pacsv.ReadOptions(column_names=names),
            pacsv.ParseOptions(
                delimiter=delimiter,
                quote_char='"',
                double_quote=True,
                escape_char=False,
                newlines_in_values=False,
                ignore_empty_lines=True,
            ),
            pacsv.ConvertOptions(
                column_types=dict.fromkeys(names, pa.binary()),
                null_values=[],
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
                check_utf8=False,
            ),
        )
    except pa.ArrowException:  # a line of another width, mostly
        return None
    limit = csv.field_size_limit()
    values, indices = [], []
    for name in names:
        column = table.column(name).combine_chunks()[1:]
        if len(column) and pc.max(pc.binary_length(column)).as_py() > limit:
            return None
        encoded = column.dictionary_encode()
        values.append(
            [v.decode("utf-8", "surrogateescape") for v in encoded.dictionary.to_pylist()]
        )
        indices.append(encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64))
    return values, indices


def _read_columns_by_line(
    data: bytes, header: list[str], first: int, delimiter: str
) -> Columns | None:
    """`read_columns` line by line: blank, quoted, long and malformed lines found with
    numpy, the csv module for the records that start on a line `_plain_patterns` does not
    match or a long one, Arrow for the rest. `first` is the number of lines the header
    took."""
    width = len(header)
    text = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(text == ord("\n"))
    starts = np.concatenate(([0], newlines + 1))
    stops = np.concatenate((newlines, [len(data)]))  # each line's "\n", or the end
    if starts[-1] == len(data):
        starts, stops = starts[:-1], stops[:-1]
    ends = np.minimum(stops + 1, len(data))  # past each line's terminator
    carriage = np.zeros(len(starts), dtype=bool)
    inside = stops > starts
    carriage[inside] = text[stops[inside] - 1] == ord("\r")
    content = stops - carriage  # where each line's text ends, before "\r\n"
    blank = content == starts
    after_header = np.arange(len(starts)) >= first

    quotes = np.flatnonzero(text == ord('"'))
    quoted = np.searchsorted(quotes, ends) > np.searchsorted(quotes, starts)
    # Fields of a line `_plain_patterns` matches: one more than its delimiters outside
    # quotes, those with an even number of quotes before them on the line.
    splits = np.flatnonzero(text == ord(delimiter))
    line_of = np.searchsorted(starts, splits, side="right") - 1
    before = np.searchsorted(quotes, splits) - np.searchsorted(quotes, starts)[line_of]
    fields = np.bincount(line_of[before % 2 == 0], minlength=len(starts)) + 1

    to_csv = ends - starts > csv.field_size_limit()
    check = np.flatnonzero(quoted & after_header & ~to_csv)
    match = _plain_patterns(delimiter)[0].fullmatch
    to_csv[check] = [
        match(data, a, b) is None
        for a, b in zip(starts[check].tolist(), content[check].tolist(), strict=True)
    ]
    by_csv = np.zeros(len(starts), dtype=bool)
    rows: list[tuple[int, list[str]]] = []
    rejections = []
    for start in np.flatnonzero(to_csv & after_header).tolist():
        if by_csv[start]:
            continue  # inside a record the csv module already read
        feed = _Lines(data, int(starts[start]))
        reader = csv.reader(feed, delimiter=delimiter)
        try:
            row = next(reader)
        except csv.Error as err:
            rejections.append(
                Rejection(start + reader.line_num, None, f"malformed CSV line: {err}")
            )
        else:
            if len(row) == width:
                rows.append((start + reader.line_num, row))
            else:  # never [], the csv module's blank line: this line is not blank
                rejections.append(_wrong_width(start + reader.line_num, len(row), width))
        by_csv[start : start + feed.count] = True

    split = after_header & ~by_csv & ~blank
    rejections += [
        _wrong_width(i + 1, int(fields[i]), width)
        for i in np.flatnonzero(split & (fields != width)).tolist()
    ]
    good = split & (fields == width)
    values: list[list[str]] = [[] for _ in header]
    indices = [np.zeros(0, dtype=np.int64) for _ in header]
    if good.any():
        parsed = _split(text[np.repeat(good, ends - starts)].tobytes(), width, delimiter)
        if parsed is None or len(parsed[1][0]) != np.count_nonzero(good):
            return None  # pragma: no cover - Arrow disagreed with the line count; be exact
        values, indices = parsed
    lines = np.flatnonzero(good).astype(np.int64) + 1
    if rows:
        lines = np.concatenate((lines, [line for line, _ in rows]))
        order = np.argsort(lines, kind="stable")
        lines = lines[order]
        for j in range(width):
            lookup = {v: k for k, v in enumerate(values[j])}
            extra = [lookup.setdefault(row[j], len(lookup)) for _, row in rows]
            values[j] = list(lookup)
            indices[j] = np.concatenate((indices[j], np.asarray(extra, dtype=np.int64)))[order]
    rejections.sort(key=lambda r: r.record)
    return Columns(header, values, indices, lines, rejections)


def _wrong_width(line: int, fields: int, width: int) -> Rejection:
    return Rejection(line, None, f"malformed CSV line: {fields} fields, the header has {width}")


def encode_columns(schema: Schema, columns: Columns) -> tuple[Table, list[Rejection]]:
    """`encode_rows` for columns: each distinct value is encoded once, and each row
    with an unusable value becomes the same Rejection."""
    header = columns.header
    missing = [a.name for a in schema.attributes if a.name not in header]
    if missing:
        raise SchemaError(
            f"the input has no column {missing[0]!r}; its header is {', '.join(header)}"
        )
    codes = {}
    bad = np.zeros(len(columns), dtype=bool)
    for attribute in schema.attributes:
        j = header.index(attribute.name)
        lookup = np.asarray(attribute.codes_of(columns.values[j]), dtype=np.int32)
        encoded = lookup[columns.indices[j]] if len(lookup) else np.zeros(0, dtype=np.int32)
        bad |= encoded < 0
        codes[attribute.name] = encoded
    rejections = list(columns.rejections)
    for position in np.flatnonzero(bad).tolist():
        line = int(columns.lines[position])
        rejections.append(_first_problem(schema, columns.record(position), line))
    rejections.sort(key=lambda r: r.record)
    table = Table(schema, codes, columns.lines).take(~bad)
    return table, rejections


def read_table(
    stream: TextIO,
    schema: Schema | None = None,
    quasi: Sequence[str] = (),
    sensitive: Sequence[str] = (),
    bins: Mapping[str, float | Sequence[float]] | None = None,
    delimiter: str | None = None,
) -> tuple[Table, list[Rejection]]:
    """Read a CSV into a Table, with a given schema or one scanned from the data.

    The text is split by `read_columns` (Arrow's CSV parser where it gives what the
    csv module would, the csv module elsewhere), so acceptance, line numbers and
    rejection reasons are those of `read_table_exact`. Without a `delimiter`, the
    header line's is sniffed.
    """
    try:
        start = stream.tell() if stream.seekable() else None
    except OSError:  # a text stream someone has iterated with next() cannot tell
        start = None
    text = stream.read()
    delimiter = delimiter or sniff_delimiter(text)
    columns = read_columns(text, delimiter)
    if columns is None:
        if start is not None:  # the stream's own line splitting, whatever its newline mode
            stream.seek(start)
        else:
            stream = io.StringIO(text, newline="")
        return read_table_exact(stream, schema, quasi, sensitive, bins, delimiter)
    if schema is None:
        schema = Schema.scan_values(columns.header, columns.values, quasi, sensitive, bins)
    return encode_columns(schema, columns)


def read_table_exact(
    stream: TextIO,
    schema: Schema | None = None,
    quasi: Sequence[str] = (),
    sensitive: Sequence[str] = (),
    bins: Mapping[str, float | Sequence[float]] | None = None,
    delimiter: str | None = None,
) -> tuple[Table, list[Rejection]]:
    """`read_table` row by row with the csv module: the reference, and the fallback."""
    raw = read_rows(stream, delimiter)
    if schema is None:
        schema = Schema.scan(raw.header, raw.rows, quasi, sensitive, bins)
    return encode_rows(schema, raw)


def write_table(table: Table, stream: TextIO, order: np.ndarray | None = None) -> None:
    """Write the schema's columns of `table` (rows in `order`) as CSV text.

    The text is csv.writer's (minimal quoting, "\\n" line ends): each distinct row is
    rendered once from its labels, each quoted by csv.writer as it would be in a row.
    """
    names = table.schema.names
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(names)
    codes = [table.codes[n] if order is None else table.codes[n][order] for n in names]
    if len(codes[0]) == 0:  # a schema has at least one (sensitive) column
        return
    labels = [[_csv_field(v) for v in table.schema[n].domain] for n in names]
    rows, inverse, _ = distinct_rows(codes, [table.schema[n].size for n in names])
    texts = np.array(
        [",".join(labels[j][c] for j, c in enumerate(row)) + "\n" for row in rows.tolist()],
        dtype=object,
    )
    for start in range(0, len(inverse), WRITE_CHUNK):
        stream.write("".join(texts[inverse[start : start + WRITE_CHUNK]]))


def _csv_field(value: str) -> str:
    """`value` as csv.writer writes it in a row (quoted only where needed; never empty)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow([value])
    return out.getvalue()[:-1]
