"""The fast CSV path (issue 18): `read_table` splits text with Arrow where that gives
what the csv module gives, and must accept, number and reject exactly the rows that
`read_table_exact` (the csv module, row by row) does, with the same messages.

Every case is read both ways from a file opened as `splu` opens one (`open_text`), and
the two results must be equal: the schema, every code column, the source lines, the
Rejections in order, or the same SchemaError. The cases are hand-made messy files
(quotes, blank lines, CRLF, BOM, bad UTF-8, wrong widths, long fields, ...) and files
that hypothesis assembles from the same kinds of pieces. `test_the_comparison_can_fail`
breaks the fast path in a few ways and checks that the cases catch each one.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import service.core.table as table_module
from service.core.schema import Attribute, Rejection, Schema, SchemaError
from service.core.table import (
    Table,
    open_text,
    read_columns,
    read_rows,
    read_table,
    read_table_exact,
    write_table,
)

SCHEMA = Schema(
    (
        Attribute("age", False, (), (0.0, 40.0, 60.0)),
        Attribute("sex", False, ("Female", "Male")),
        Attribute("job", True, ("Sales", "Tech", "a,b", 'x"y', "é")),
    )
)
# Ways `splu` reads a table: scanned from --quasi/--sensitive (with --bin), or --schema.
READS: dict[str, dict] = {
    "scan": {"quasi": ["age", "sex"], "sensitive": ["job"]},
    "scan, binned": {"quasi": ["age", "sex"], "sensitive": ["job"], "bins": {"age": 10}},
    "scan, edges": {"quasi": ["sex"], "sensitive": ["age"], "bins": {"age": [0, 40, 60]}},
    "schema": {"schema": SCHEMA},
}

GOOD = b"age,sex,job\n39,Male,Sales\n50,Female,Tech\n23,Female,Sales\n"
CASES: dict[str, bytes] = {
    "plain": GOOD,
    "no final newline": GOOD.rstrip(b"\n"),
    "header only": b"age,sex,job\n",
    "header only, no newline": b"age,sex,job",
    "empty": b"",
    "only a newline": b"\n",
    "CRLF": GOOD.replace(b"\n", b"\r\n"),
    "CRLF, no final newline": GOOD.replace(b"\n", b"\r\n").rstrip(b"\r\n"),
    "mixed line ends": b"age,sex,job\r\n39,Male,Sales\n50,Female,Tech\r\n23,Female,Sales",
    "bare CR": b"age,sex,job\r39,Male,Sales\r50,Female,Tech\n",
    "blank lines": b"age,sex,job\n\n39,Male,Sales\n\r\n\n50,Female,Tech\n\n",
    "blank line after header": b"age,sex,job\n\n39,Male,Sales\n",
    "blank first line": b"\nage,sex,job\n39,Male,Sales\n",
    "whitespace lines": b"age,sex,job\n \n39,Male,Sales\n\t\n , , \n",
    "spaces kept": b"age,sex,job\n 39,Male,Sales\n39, Male,Sales\n39,Male,Sales \n",
    "bad values": (
        b"age,sex,job\n39,Male,Sales\n39,Other,Sales\n39,Male,\n39,Male,Astronaut\n"
        b"70,Male,Sales\nabc,Male,Sales\n2_5,Male,Sales\n1e400,Male,Sales\nnan,Male,Tech\n"
        b"-1,Male,Tech\n,Male,Tech\n39,,Tech\n50,Female,Tech\n"
    ),
    "wrong widths": (
        b"age,sex,job\n39,Male\n39,Male,Sales,extra\n39\n,,,\n,,\n39,Male,Sales,\n50,Female,Tech\n"
    ),
    "quoted commas": b'age,sex,job\n39,Male,"a,b"\n"39",Male,Sales\n50,"Female",Tech\n',
    "quoted commas among bad lines": (
        b'age,sex,job\n39,Male,"a,b"\n\n"3,9",Male,Sales\n39,"Male,",Sales,x\n50,"Fe""male",Tech\n'
    ),
    "quoted header": b'"age","sex","job"\n39,Male,Sales\n',
    "header over two lines": b'age,sex,"jo\nb"\n39,Male,Sales\n',
    "header over two lines, quoted body": b'age,"sex\n",job\n39,"Male",Sales\n39,Male\n',
    "doubled quotes": b'age,sex,job\n39,Male,"x""y"\n39,Male,""\n39,Male,""""\n',
    "quote inside a field": b'age,sex,job\n39,Male,x"y\n39,Ma"le,Sales\n50,Female,Tech\n',
    "text after a closing quote": b'age,sex,job\n39,Male,"Sa"les\n39,"Male"x,Tech\n',
    "quoted newline": b'age,sex,job\n39,Male,"Sa\nles"\n50,Female,Tech\n23,"Fe\r\nmale",Tech\n',
    "quoted field over many lines": b'age,sex,job\n39,Male,"a\n\n,b\n"\n50,Female,Tech\n',
    "unterminated quote": b'age,sex,job\n39,Male,Sales\n39,Male,"Sales\n50,Female,Tech\n',
    "unterminated quote at the end": b'age,sex,job\n39,Male,Sales\n39,Male,"Sal',
    "quote only": b'age,sex,job\n"\n39,Male,Sales\n',
    "quoted blank": b'age,sex,job\n""\n39,Male,Sales\n',
    "unicode": "age,sex,job\n39,Male,é\n39,Male,e\u0301\n39,Mâle,Sales\n39,Male,日本\n".encode(),
    "bad UTF-8": b"age,sex,job\n39,Ma\xffle,Sales\n39,Male,\xe2\x82\n39,Male,\xe2\x82,x\n"
    b'39,Male,"\xff"\n\xc3,Male,Sales\n39,Male,Sales\xc3\n39,Male,a"\xff\n39,"\xffa"b,Tech\n'
    b"50,Female,Tech\n",
    "escaped bytes that form a character": b"age,sex,job\n39,Male,\xc3\xa9\n39,Male,\xc3\n",
    "BOM": b"\xef\xbb\xbfage,sex,job\n39,Male,Sales\n",
    "BOM in a data line": b"age,sex,job\n\xef\xbb\xbf39,Male,Sales\n50,Female,Tech\n",
    "BOM starting the body": b"age,sex,job\n\xef\xbb\xbf39,Male,Sales\n",
    "NUL": b"age,sex,job\n39,Male,Sa\x00les\n50,Female,Tech\n",
    "duplicate header": b"age,age,job\n39,40,Sales\n",
    "missing column": b"age,job\n39,Sales\n",
    "extra columns": (
        b"note,age,sex,job,x\nn,39,Male,Sales,1\nn,50,Female,Tech\nn,23,Female,Tech,2\n"
    ),
    "reordered columns": b"job,sex,age\nSales,Male,39\nTech,Female,50\n",
    "one column": b"age\n39\n\n50\n",
    "one column, quoted blank": b'age\n""\n39\n\n"50"\n"',
    "long field": b"age,sex,job\n39,Male,Sales\n39,Male," + b"S" * 140_000 + b"\n50,Female,Tech\n",
    "long quoted field": b'age,sex,job\n39,Male,"' + b"S" * 140_000 + b'"\n50,Female,Tech\n',
    "long line of short fields": b"age,sex,job\n" + b"39," * 70_000 + b"x\n50,Female,Tech\n",
    "tab and semicolon": b"age,sex,job\n39\tMale\tSales\n39;Male;Sales\n39,Male,Sales\n",
    "backslashes": b"age,sex,job\n39,Male,Sa\\les\n39,Male,\\\n39,Male,Sales\\\n",
    "only bad rows": b"age,sex,job\n39,Male\n,,\n",
    "one good row among quotes": (
        b'age,sex,job\n"39","Male","Sales"\n39,Male,Sales\n"50",Female,"Tech"\n'
    ),
}
# Where the fast path gives up: a lone CR, or no header to split by.
LEFT_TO_CSV = {"bare CR", "empty", "only a newline", "blank first line"}


def outcome(
    read: Callable[..., tuple[Table, list]], stream: io.TextIOBase, arguments: dict
) -> tuple:
    """What a reader gives, in a form == compares: its table and rejections, or its error."""
    try:
        table, rejections = read(stream, **arguments)
    except SchemaError as err:
        return ("SchemaError", str(err))
    codes = {name: (column.dtype.str, column.tolist()) for name, column in table.codes.items()}
    return (table.schema, codes, table.lines.dtype.str, table.lines.tolist(), rejections)


def both(tmp_path, data: bytes, arguments: dict, gz: bool = False) -> tuple[tuple, tuple]:
    path = tmp_path / ("in.csv.gz" if gz else "in.csv")
    path.write_bytes(gzip.compress(data) if gz else data)
    with open_text(path) as stream:
        fast = outcome(read_table, stream, arguments)
    with open_text(path) as stream:
        exact = outcome(read_table_exact, stream, arguments)
    return fast, exact


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("case", CASES)
def test_fast_reader_matches_the_csv_module(tmp_path, case, read):
    fast, exact = both(tmp_path, CASES[case], READS[read])
    assert fast == exact


@pytest.mark.parametrize("case", sorted(set(CASES) - LEFT_TO_CSV - {"duplicate header"}))
def test_columns_are_the_rows_of_the_csv_module(case):
    text = CASES[case].decode("utf-8", "surrogateescape")
    columns = read_columns(text)
    raw = read_rows(io.StringIO(text, newline=""))
    assert columns is not None
    assert columns.header == raw.header
    assert [list(columns.record(i).values()) for i in range(len(columns))] == raw.rows
    assert columns.lines.tolist() == raw.lines
    assert columns.rejections == raw.rejections


def test_text_that_is_not_the_decoding_of_bytes_is_left_to_the_csv_module():
    # Escaped bytes that together are valid UTF-8 ("é"), and a surrogate no bytes escape.
    for job in ("\udcc3\udca9", "\ud800"):
        text = f"age,sex,job\n39,Male,{job}\n39,Male,é\n"
        assert read_columns(text) is None
        for arguments in READS.values():
            assert outcome(read_table, io.StringIO(text), arguments) == outcome(
                read_table_exact, io.StringIO(text), arguments
            )


@pytest.mark.parametrize(
    ("line", "arrow"),
    [
        (b"39,Male,Sales", True),
        (b"", True),
        (b'"39","Male","a,b"', True),
        (b'39,"x""y",""', True),
        (b'"""",,"\xff"', True),
        (b'39,Male,x"y', False),  # a quote inside an unquoted field
        (b'39,Male,"Sa"les', False),  # text after a closing quote
        (b'39, "Male",Sales', False),  # a space before an opening quote
        (b'39,Male,"Sales', False),  # a quoted field going on to the next line
        (b'39,Male,"Sa\rles"', False),
    ],
)
def test_which_lines_arrow_splits(line, arrow):
    # Arrow happens to split most other lines as the csv module does, but only these
    # are certain to; the rest go to the csv module.
    plain_line, plain_body = table_module._plain_patterns(",")
    assert (plain_line.fullmatch(line) is not None) == arrow
    assert (plain_body.fullmatch(b"a,b\n" + line + b"\r\n") is not None) == arrow


def test_arrow_sees_only_lines_it_splits_as_the_csv_module_does(monkeypatch):
    seen = []

    def checked(body: bytes, width: int, delimiter: str):
        seen.extend(body.splitlines())
        return _REAL_SPLIT(body, width, delimiter)

    monkeypatch.setattr(table_module, "_split", checked)
    for data in CASES.values():
        with contextlib.suppress(SchemaError):
            read_columns(data.decode("utf-8", "surrogateescape"))
    plain_line = table_module._plain_patterns(",")[0]
    assert seen and all(plain_line.fullmatch(line) for line in seen)
    assert b'39,Male,"a,b"' in seen  # well quoted: Arrow's


def test_the_cases_take_the_fast_path():
    for case, data in CASES.items():
        if case not in LEFT_TO_CSV and case != "duplicate header":
            assert read_columns(data.decode("utf-8", "surrogateescape")) is not None, case


def test_a_clean_file_is_read_by_arrow_alone(monkeypatch):
    def never(*_):
        raise AssertionError("a clean file went line by line")

    monkeypatch.setattr(table_module, "_read_columns_by_line", never)
    rows = [f"{20 + i % 40},{('Male', 'Female')[i % 2]},{('Sales', 'Tech')[i % 3 % 2]}\n"
            for i in range(2000)]  # fmt: skip
    text = "age,sex,job\n" + "".join(rows)
    table, rejections = read_table(io.StringIO(text), SCHEMA)
    assert len(table) == 2000 and not rejections
    assert table.lines.tolist() == list(range(2, 2002))


@pytest.mark.parametrize("delimiter", [";", "\t", "|"])
@pytest.mark.parametrize("case", CASES)
def test_other_delimiters_read_the_same_both_ways(tmp_path, case, delimiter):
    data = CASES[case].replace(b",", delimiter.encode())
    for arguments in READS.values():
        fast, exact = both(tmp_path, data, arguments)
        assert fast == exact
    if case not in LEFT_TO_CSV | {"duplicate header", "one column", "one column, quoted blank"}:
        # Sniffed from the header, and split by Arrow as a comma file is.
        assert read_columns(data.decode("utf-8", "surrogateescape")) is not None


@pytest.mark.parametrize("case", ["plain", "CRLF", "BOM", "bad values", "wrong widths"])
def test_a_semicolon_export_reads_as_its_comma_original(tmp_path, case):
    for arguments in READS.values():
        original = both(tmp_path, CASES[case], arguments)[0]
        semicolons = CASES[case].replace(b",", b";")
        assert both(tmp_path, semicolons, arguments) == (original, original)
        # Told the wrong delimiter, the header is one column and names none of them.
        comma = {**arguments, "delimiter": ","}
        told = outcome(read_table, io.StringIO(semicolons.decode()), comma)
        assert told[0] == "SchemaError"


@pytest.mark.parametrize(
    ("header", "delimiter"),
    [
        ("rid;age;sex", ";"), ("rid,age,sex", ","), ("rid\tage", "\t"), ("rid|age", "|"),
        ("\ufeffrid;age\r\n1;2", ";"), ('"a;b",c', ","), ("respondent", ","), ("", ","),
    ],
)  # fmt: skip
def test_the_delimiter_is_sniffed_from_the_header_line(header, delimiter):
    assert table_module.sniff_delimiter(header) == delimiter


def test_gzip_and_unseekable_streams(tmp_path):
    data = CASES["bad values"] + b'39,Male,"a,b"\n\n39,Male\n'
    fast, exact = both(tmp_path, data, READS["schema"], gz=True)
    assert fast == exact
    # stdin is not seekable: a file left to the csv module is read again from its text.
    for case in ("NUL", "quoted newline"):
        text = CASES[case].decode("utf-8", "surrogateescape")
        pipe = io.TextIOWrapper(io.BufferedReader(io.BytesIO(CASES[case])), newline="")
        pipe.seekable = lambda: False  # type: ignore[method-assign]
        assert outcome(read_table, pipe, READS["scan"]) == outcome(
            read_table_exact, io.StringIO(text, newline=""), READS["scan"]
        )


def test_a_stream_without_universal_newlines_keeps_its_own_lines():
    # io.StringIO splits lines at "\n" only; csv then objects to the lone "\r".
    text = "age,sex,job\n39,Male,Sales\r50,Female,Tech\n23,Female,Sales\n"
    assert outcome(read_table, io.StringIO(text), READS["schema"]) == outcome(
        read_table_exact, io.StringIO(text), READS["schema"]
    )


def test_a_lower_field_limit_is_the_csv_modules(tmp_path):
    old = csv.field_size_limit(5)
    try:
        for case in ("plain", "bad values", "quoted commas", "long field"):
            fast, exact = both(tmp_path, CASES[case], READS["scan"])
            assert fast == exact, case
    finally:
        csv.field_size_limit(old)


# Pieces hypothesis assembles into files: every kind of field and line end above.
FIELDS = [
    b"39", b"50", b"70", b"abc", b"1e400", b"", b" ", b"Male", b"Female", b"Other", b"Sales",
    b"Tech", b"Astronaut", b"\xc3\xa9", b"\xff", b"\xe2\x82", b"\xef\xbb\xbf", b"a\"b", b'"a,b"',
    b'"x""y"', b'"Sa\nles"', b'"Sa\r\nles"', b'"open', b'"q"x', b'""', b"\t", b"a\\", b'"',
    b"\x00", b"S\x00",
]  # fmt: skip
ENDS = [b"\n", b"\n", b"\n", b"\r\n", b"\r\n", b"\n\n", b"\r\n\r\n", b"\n \n"]


@st.composite
def messy_csv(draw) -> bytes:
    header = draw(
        st.sampled_from([b"age,sex,job", b'"age",sex,"job"', b"note,job,sex,age", b"age,sex,job,x"])
    )
    width = header.count(b",") + 1
    out = header + draw(st.sampled_from(ENDS))
    for _ in range(draw(st.integers(0, 12))):
        count = draw(st.sampled_from([width, width, width, width - 1, width + 1, 1]))
        fields = [draw(st.sampled_from(FIELDS[:12] if draw(st.booleans()) else FIELDS))
                  for _ in range(count)]  # fmt: skip
        out += b",".join(fields) + draw(st.sampled_from(ENDS))
    if draw(st.booleans()):
        out = out.rstrip(b"\r\n")
    return out


@settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=messy_csv(), read=st.sampled_from(sorted(READS)))
def test_fuzzed_files_read_the_same_both_ways(tmp_path, data, read):
    fast, exact = both(tmp_path, data, READS[read])
    assert fast == exact
    text = data.decode("utf-8", "surrogateescape")
    columns = read_columns(text)
    if columns is not None:
        raw = read_rows(io.StringIO(text, newline=""))
        assert [list(columns.record(i).values()) for i in range(len(columns))] == raw.rows
        assert (columns.lines.tolist(), columns.rejections) == (raw.lines, raw.rejections)


class _ReplacingLines(table_module._Lines):
    def __next__(self) -> str:
        line = super().__next__()
        return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _split_stripped(body: bytes, width: int, delimiter: str):
    parsed = _REAL_SPLIT(body, width, delimiter)
    if parsed is not None:
        parsed[0][:] = [[v.strip() for v in column] for column in parsed[0]]
    return parsed


def _by_line_without_blank_lines(data, header, first, delimiter):
    parsed = _REAL_BY_LINE(data, header, first, delimiter)
    if parsed is not None:
        parsed.lines = np.arange(first + 1, first + 1 + len(parsed.lines), dtype=np.int64)
    return parsed


_REAL_SPLIT = table_module._split
_REAL_BY_LINE = table_module._read_columns_by_line
BROKEN = {
    "lines decoded with replacement characters": ("_Lines", _ReplacingLines),
    "fields stripped of spaces": ("_split", _split_stripped),
    "line numbers that ignore blank lines": ("_read_columns_by_line", _by_line_without_blank_lines),
    "wrong widths counted off by one": (
        "_wrong_width",
        lambda line, fields, width: Rejection(
            line, None, f"malformed CSV line: {fields - 1} fields, the header has {width}"
        ),
    ),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_the_comparison_can_fail(tmp_path, monkeypatch, broken):
    name, replacement = BROKEN[broken]
    monkeypatch.setattr(table_module, name, replacement)
    pairs = [both(tmp_path, data, read) for data in CASES.values() for read in READS.values()]
    assert any(fast != exact for fast, exact in pairs), f"no case notices: {broken}"


@pytest.mark.parametrize(
    "domain",
    [
        ("Female", "Male"),
        ("a,b", 'x"y', "é", "line\nbreak", "cr\rhere", " spaced ", "'", "日本"),
    ],
)
def test_write_table_writes_what_csv_writer_writes(domain):
    schema = Schema(
        (
            Attribute("age", False, (), (0.0, 40.0, 60.0)),
            Attribute("v", True, domain),
        )
    )
    rng = np.random.default_rng(1)
    n = 5000
    table = Table(schema, {"age": rng.integers(0, 2, n), "v": rng.integers(0, len(domain), n)})
    order = rng.permutation(n)
    for chosen in (None, order):
        expected = io.StringIO()
        writer = csv.writer(expected, lineterminator="\n")
        writer.writerow(schema.names)
        labels = [table.labels(name) for name in schema.names]
        if chosen is not None:
            labels = [column[chosen] for column in labels]
        writer.writerows(zip(*labels, strict=True))
        written = io.StringIO()
        write_table(table, written, chosen)
        assert written.getvalue() == expected.getvalue()
    empty = io.StringIO()
    write_table(table.take(np.zeros(n, dtype=bool)), empty)
    assert empty.getvalue() == "age,v\n"


def test_written_table_reads_back(tmp_path):
    # Bin labels hold a comma and job values a quote: the published file quotes them.
    table, _ = read_table(io.StringIO(CASES["quoted commas"].decode()), SCHEMA)
    path = tmp_path / "out.csv"
    with path.open("w", encoding="utf-8", newline="") as stream:
        write_table(table, stream)
    assert '"[0,40)"' in path.read_text()
    with open_text(path) as stream:
        again, rejections = read_table(stream, quasi=["age", "sex"], sensitive=["job"])
    assert not rejections
    assert all((again.labels(n) == table.labels(n)).all() for n in SCHEMA.names)
