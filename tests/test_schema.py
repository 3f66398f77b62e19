"""Schema and CSV edge: domains, binning, config errors, rejected rows with reasons."""

from __future__ import annotations

import io

import numpy as np
import pytest

from service.core.schema import Attribute, RecordError, Schema, SchemaError
from service.core.table import Table, read_table, write_table

CSV = """age,sex,job,note
39,Male,Sales,x
50,Female,Tech,y
23,Female,Sales,z
"""


def read(text: str, **kwargs) -> tuple[Table, list]:
    return read_table(io.StringIO(text), **kwargs)


def test_scan_builds_sorted_domains_and_drops_undeclared_columns():
    table, rejections = read(CSV, quasi=["age", "sex"], sensitive=["job"])
    assert not rejections
    assert table.schema.names == ["age", "sex", "job"]
    assert table.schema["sex"].domain == ("Female", "Male")
    assert table.schema["job"].sensitive and not table.schema["age"].sensitive
    assert list(table.labels("job")) == ["Sales", "Tech", "Sales"]


def test_binning_by_width_and_by_edges():
    table, _ = read(CSV, quasi=["age", "sex"], sensitive=["job"], bins={"age": 10})
    assert table.schema["age"].domain == ("[20,30)", "[30,40)", "[40,50)", "[50,60)")
    assert list(table.labels("age")) == ["[30,40)", "[50,60)", "[20,30)"]
    table, rejections = read(
        CSV, quasi=["age", "sex"], sensitive=["job"], bins={"age": [0, 40, 60]}
    )
    assert list(table.labels("age")) == ["[0,40)", "[40,60)", "[0,40)"]
    assert not rejections


def test_unknown_column_is_named_with_the_available_ones():
    with pytest.raises(
        SchemaError, match=r"unknown column 'jobs'; the input has age, sex, job, note"
    ):
        read(CSV, quasi=["age"], sensitive=["jobs"])


def test_rows_with_bad_values_are_rejected_with_line_and_field():
    schema = Schema(
        (
            Attribute("age", False, (), (0.0, 40.0, 60.0)),
            Attribute("sex", False, ("Female", "Male")),
            Attribute("job", True, ("Sales", "Tech")),
        )
    )
    text = (
        "age,sex,job\n"
        "39,Male,Sales\n"
        "39,Other,Sales\n"  # public value outside the domain
        "39,Male,\n"  # missing sensitive value
        "39,Male,Astronaut\n"  # sensitive value outside the domain
        "70,Male,Sales\n"  # outside the bins
        "abc,Male,Sales\n"  # not a number
        "39,Male\n"  # malformed: too few fields
        "50,Female,Tech\n"
    )
    table, rejections = read_table(io.StringIO(text), schema)
    assert len(table) == 2
    assert list(table.lines) == [2, 9]
    found = {(r.record, r.field): r.reason for r in rejections}
    assert found[(3, "sex")] == "value 'Other' is outside the domain (2 values)"
    assert found[(4, "job")] == "missing value for a sensitive attribute"
    assert found[(5, "job")] == "value is outside the attribute's domain"
    assert found[(6, "age")] == "value 70 is outside the bins [0, 60)"
    assert found[(7, "age")] == "expected a number"
    assert found[(8, None)] == "malformed CSV line: 2 fields, the header has 3"
    assert len(rejections) == 6
    assert (
        str(rejections[0])
        == "record 3, field 'sex': value 'Other' is outside the domain (2 values)"
    )


def test_rejection_reasons_never_echo_a_sensitive_value():
    schema = Schema(
        (Attribute("sex", False, ("F", "M")), Attribute("diagnosis", True, ("flu", "cold")))
    )
    secret = "rare-disease-xyz"
    _, rejections = read_table(io.StringIO(f"sex,diagnosis\nF,{secret}\nF,flu\n"), schema)
    assert len(rejections) == 1
    assert secret not in str(rejections[0])
    binned = Schema((Attribute("sex", False, ("F",)), Attribute("income", True, (), (0.0, 10.0))))
    _, rejections = read_table(io.StringIO("sex,income\nF,123456\n"), binned)
    assert "123456" not in str(rejections[0])


def test_undecodable_bytes_are_rejected_not_fatal(tmp_path):
    from service.core.table import open_text

    path = tmp_path / "in.csv"
    path.write_bytes(b"sex,job\nMale,Sales\nMa\xffle,Sales\nFemale,Tech\n")
    with open_text(path) as stream:
        table, rejections = read_table(stream, quasi=["sex"], sensitive=["job"])
    assert len(table) == 2
    assert [(r.record, r.field, r.reason) for r in rejections] == [
        (3, "sex", "value is not valid UTF-8")
    ]


def test_empty_input_and_duplicate_header_fail_clearly():
    with pytest.raises(SchemaError, match="empty"):
        read("", quasi=[], sensitive=["job"])
    with pytest.raises(SchemaError, match="names a column twice"):
        read("a,a\n1,2\n", quasi=[], sensitive=["a"])


def test_toml_round_trip(tmp_path):
    table, _ = read(CSV, quasi=["age", "sex"], sensitive=["job"], bins={"age": 10})
    path = tmp_path / "stream.toml"
    path.write_text(table.schema.to_toml())
    assert Schema.load(path) == table.schema


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[schema.public]\nsex = {domain = []}\n[schema.sensitive]\njob = {domain = ['a']}\n",
            "schema.public.sex: public attribute 'sex' has an empty domain",
        ),
        (
            "[schema.sensitive]\njob = {values = ['a']}\n",
            "schema.sensitive.job needs exactly one of 'domain' or 'bins'",
        ),
        (
            "[schema.public]\nage = {bins = [10, 5]}\n[schema.sensitive]\njob = {domain = ['a']}\n",
            "schema.public.age: bins of 'age' must be at least two finite, increasing edges",
        ),
        ("[schema.public]\nsex = {domain = ['F']}\n", "at least one sensitive attribute"),
        ("[schema.extra]\n", "unknown key schema.extra"),
        ("[other]\n", "no \\[schema\\] table"),
        ("[schema\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_field(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SchemaError, match=message):
        Schema.load(path)


def test_encode_record_names_the_field_of_a_stream_record():
    schema = Schema((Attribute("sex", False, ("F", "M")), Attribute("job", True, ("a", "b"))))
    assert schema.encode_record({"sex": "M", "job": "b"}, "r1") == [1, 1]
    cases = [
        ({"sex": "M", "job": "b", "zip": "1"}, "zip", "unknown attribute"),
        ({"sex": "M"}, "job", "missing value"),
        ({"sex": 3.5, "job": "a"}, "sex", "expected a string, got float"),
        ({"sex": "X", "job": "a"}, "sex", "value 'X' is outside the domain (2 values)"),
    ]
    for record, field, reason in cases:
        with pytest.raises(RecordError) as caught:
            schema.encode_record(record, "r1")
        assert (caught.value.rejection.field, caught.value.rejection.reason) == (field, reason)
    with pytest.raises(RecordError, match="a record must be an object"):
        schema.encode_record(["M", "a"], "r2")  # type: ignore[arg-type]


def test_write_table_writes_labels_in_schema_order():
    table, _ = read(CSV, quasi=["sex"], sensitive=["job"])
    out = io.StringIO()
    write_table(table, out, order=np.array([2, 0, 1]))
    assert out.getvalue() == "sex,job\nFemale,Sales\nMale,Sales\nFemale,Tech\n"
