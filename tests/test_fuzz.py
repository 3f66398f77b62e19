"""Bad input (issue 6, item 3): fuzzed raw messages and stream configs.

- `Preparer.prepare` on arbitrary bytes and on valid records with one thing made odd
  never raises, accepts exactly the valid records (checked against a reading of the
  schema written here, independently of `service.core.schema`), and rejects everything else
  with a reason that never echoes a sensitive value. The rejected-topic payload is JSON
  holding the reason and, as documented, the raw record.
- `parse_config` on the example configs with one thing broken either succeeds or raises
  `SchemaError` (`ConfigError` outside [schema]) with a message naming what was broken.
- A worker on the embedded servers, fed good Adult rows among seeded bad messages, sends
  every bad one to `<stream>.rejected` with a reason, publishes or suppresses every good
  one, and is still running at the end.

The odd messages come from one generator, `odd_message`, driven by hypothesis in the
property tests and by a seeded `random.Random` in the stream test.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import functools
import json
import math
import random
import re
import time
import tomllib
import unicodedata
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from harness import Harness, adult_rows
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from service.core.config import ConfigError, StreamConfig, parse_config
from service.core.ingest import MAX_MESSAGE_BYTES, Preparer, RawMessage
from service.core.prf import ServiceKey
from service.core.schema import Attribute, Schema, SchemaError
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

T = TypeVar("T")
Pick = Callable[[Sequence[T]], T]

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(63)
FUZZ = settings(
    derandomize=True,
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def example(name: str) -> dict[str, Any]:
    return tomllib.loads((EXAMPLES / name).read_text())


def decoy_config() -> StreamConfig:
    """The decoy example with a second, binned sensitive attribute, so that numeric
    sensitive values are fuzzed too."""
    document = example("adult-decoy.toml")
    document["schema"]["sensitive"]["hours"] = {"bins": [1, 20, 35, 40, 45, 60, 100]}
    return parse_config(document, "adult-decoy.toml", EXAMPLES)


CONFIGS = {
    "decoy": decoy_config(),
    "personal": parse_config(example("adult-personal.toml"), "adult-personal.toml", EXAMPLES),
}
PREPARERS = {name: Preparer(config, KEY) for name, config in CONFIGS.items()}


# ---------------------------------------------------------------------------------------------
# What a valid record is, read from SPEC §1 rather than from service.core.schema.

# A binned value may also be a string holding a plain decimal number (a CSV field),
# padded with ASCII whitespace at most.
_SPACE = r"[ \t\n\r\x0b\x0c\x1c-\x1f]*"
DECIMAL = re.compile(_SPACE + r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?" + _SPACE, re.ASCII)


class _InvalidError(ValueError):
    pass


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise _InvalidError("a key twice")
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise _InvalidError(name)  # NaN and Infinity are not JSON


def _number(raw: object) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int | float):
        try:
            return float(raw)
        except OverflowError:
            return None
    if isinstance(raw, str) and DECIMAL.fullmatch(raw):
        return float(raw)
    return None


def expected_codes(schema: Schema, value: bytes | None) -> list[int] | None:
    """The codes a message must be accepted with, in schema order; None if it is invalid."""
    if not value or len(value) > MAX_MESSAGE_BYTES:
        return None
    try:
        record = json.loads(
            value.decode("utf-8"), object_pairs_hook=_strict_object, parse_constant=_no_constant
        )
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or set(record) != set(schema.names):
        return None
    codes = []
    for attribute in schema.attributes:
        raw = record[attribute.name]
        if attribute.bins is None:
            if isinstance(raw, int) and not isinstance(raw, bool):
                raw = str(raw)  # a label like "7" may come as a number
            if not isinstance(raw, str) or raw not in attribute.domain:
                return None
            codes.append(attribute.domain.index(raw))
        else:
            x = _number(raw)
            if x is None or not attribute.bins[0] <= x < attribute.bins[-1]:
                return None
            codes.append(bisect_right(attribute.bins, x) - 1)
    return codes


# ---------------------------------------------------------------------------------------------
# Odd messages.

FULLWIDTH = {c: c + 0xFEE0 for c in range(0x21, 0x7F)}
MARKER_NUMBER = 9_876_000  # binned sensitive markers: far outside every bin

# A string made odd; the sensitive ones start from a marker, the public ones from a valid value.
TEXT_ODDITIES: dict[str, Callable[[str], str]] = {
    "NUL": lambda s: s + "\x00",
    "leading NUL": lambda s: "\x00" + s,
    "right-to-left mark": lambda s: "\u200f" + s,
    "right-to-left override": lambda s: "\u202e" + s + "\u202c",
    "combining accent": lambda s: s + "\u0301",
    "decomposed": lambda s: unicodedata.normalize("NFD", s + "\u00e9"),
    "zero-width space": lambda s: s + "\u200b",
    "emoji": lambda s: s + "\U0001f600",
    "emoji sequence": lambda s: s + "\U0001f3f3\ufe0f\u200d\U0001f308",
    "BOM in the string": lambda s: "\ufeff" + s,
    "lone high surrogate": lambda s: s + "\ud800",
    "lone low surrogate": lambda s: s + "\udcff",
    "no-break space": lambda s: "\u00a0" + s,
    "fullwidth": lambda s: s.translate(FULLWIDTH),
    "look-alike letters": lambda s: s.replace("a", "\u0430").replace("e", "\u0435") + "\u0430",
    "Arabic-Indic digits": lambda s: s.translate({c: 0x0660 + c - 0x30 for c in range(48, 58)}),
    "upper case": str.upper,
    "lower case": str.lower,
    "padded": lambda s: f" {s} ",
    "underscore": lambda s: s[:1] + "_" + s[1:],
    "repeated": lambda s: s * 300,
    "huge": lambda s: s + "x" * MAX_MESSAGE_BYTES,
    "half": lambda s: s[: len(s) // 2],
}

# The value replaced by another JSON value.
VALUE_ODDITIES: dict[str, Callable[[str], object]] = {
    "true": lambda s: True,
    "false": lambda s: False,
    "zero": lambda s: 0,
    "negative": lambda s: -1,
    "fraction": lambda s: 0.5,
    "negative zero": lambda s: -0.0,
    "as a number": lambda s: float(s) if DECIMAL.fullmatch(s) else len(s),
    "in a list": lambda s: [s],
    "in an object": lambda s: {"value": s},
    "as a key": lambda s: {s: 1},
    "nested": lambda s: [[[{"value": [s]}]]],
}


@dataclass(frozen=True)
class Raw:
    """JSON text put verbatim where a value goes."""

    text: bytes


# The value replaced by JSON text that json.dumps would not write.
FRAGMENTS: dict[str, Callable[[str], bytes]] = {
    "1e999": lambda s: b"1e999",
    "-1e999": lambda s: b"-1e999",
    "NaN": lambda s: b"NaN",
    "Infinity": lambda s: b"Infinity",
    "-Infinity": lambda s: b"-Infinity",
    "-0": lambda s: b"-0",
    "1E400": lambda s: b"1E400",
    "1e-400": lambda s: b"1e-400",
    "integer of 2**64": lambda s: str(2**64).encode(),
    "integer of 400 digits": lambda s: b"9" * 400,
    "integer of 5000 digits": lambda s: b"9" * 5000,
    "escaped lone surrogate": lambda s: json.dumps(s)[:-1].encode() + b'\\ud800"',
    "escaped low surrogate": lambda s: b'"\\udc80' + json.dumps(s)[1:].encode(),
    "escaped NUL": lambda s: json.dumps(s)[:-1].encode() + b'\\u0000"',
    "bad escape": lambda s: json.dumps(s)[:-1].encode() + b'\\x41"',
    "deep array": lambda s: b"[" * 900 + json.dumps(s).encode() + b"]" * 900,
    "too deep array": lambda s: b"[" * 5000 + json.dumps(s).encode() + b"]" * 5000,
    "deep object": lambda s: b'{"a":' * 900 + json.dumps(s).encode() + b"}" * 900,
    "too deep object": lambda s: b'{"a":' * 5000 + json.dumps(s).encode() + b"}" * 5000,
    "object with a key twice": lambda s: b'{"v": %s, "v": 1}' % json.dumps(s).encode(),
    "unterminated string": lambda s: json.dumps(s)[:-1].encode(),
    "single quotes": lambda s: b"'" + s.encode("utf-8", "surrogatepass") + b"'",
}

# Bytes put inside the value's string.
BAD_BYTES: dict[str, bytes] = {
    "0xff": b"\xff",
    "lone continuation byte": b"\x80",
    "overlong '/'": b"\xc0\xaf",
    "overlong 3-byte": b"\xe0\x80\xaf",
    "overlong 4-byte": b"\xf0\x80\x80\xaf",
    "UTF-8 encoded surrogate": b"\xed\xa0\x80",
    "truncated sequence": b"\xe2\x82",
    "beyond U+10FFFF": b"\xf4\x90\x80\x80",
    "Latin-1": "\u00e9".encode("latin-1"),
    "raw NUL": b"\x00",
    "raw newline": b"\n",
    "raw tab": b"\t",
}

# The whole message made odd; some of these leave a valid record ("exactly the limit").
MESSAGE_ODDITIES: dict[str, Callable[[bytes], bytes | None]] = {
    "BOM": lambda b: b"\xef\xbb\xbf" + b,
    "UTF-16": lambda b: b.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"),
    "truncated": lambda b: b[:-1],
    "cut in half": lambda b: b[: len(b) // 2],
    "trailing garbage": lambda b: b + b"x",
    "two records": lambda b: b + b,
    "trailing NUL": lambda b: b + b"\x00",
    "in a list": lambda b: b"[" + b + b"]",
    "as a JSON string": lambda b: json.dumps(b.decode("utf-8", "surrogatepass")).encode(),
    "one over the limit": lambda b: b + b" " * (MAX_MESSAGE_BYTES + 1 - len(b)),
    "exactly the limit": lambda b: b + b" " * (MAX_MESSAGE_BYTES - len(b)),
    "far over the limit": lambda b: b" " * (4 * MAX_MESSAGE_BYTES) + b,
    "empty": lambda b: b"",
    "whitespace": lambda b: b" \n\t",
    "null": lambda b: b"null",
    "number": lambda b: b"-0",
    "tombstone": lambda b: None,
}

ODD_NAMES = ["zip", "", " ", "\x00", "\ud800", "\U0001f600", "__proto__", "row ", "Sex", "n\u0303"]
MUTATIONS = [
    "none", "text", "value", "fragment", "bytes", "missing", "unknown", "duplicate", "message",
]  # fmt: skip


def render(pairs: Sequence[tuple[str, object]], ascii_only: bool = True) -> bytes:
    """A JSON object from (key, value) pairs: keys may repeat and Raw values go in verbatim.

    Without ascii_only, text goes out as UTF-8, lone surrogates as the (invalid) bytes
    that `surrogatepass` writes for them.
    """

    def dump(value: object) -> bytes:
        if isinstance(value, Raw):
            return value.text
        return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")

    return b"{" + b", ".join(dump(k) + b": " + dump(v) for k, v in pairs) + b"}"


@dataclass(frozen=True)
class Odd:
    value: bytes | None
    markers: tuple[str, ...]  # bad sensitive values that no reason may contain
    what: str


def odd_message(schema: Schema, record: Mapping[str, object], pick: Pick, serial: int) -> Odd:
    """A valid record with (at most) one thing made odd, chosen by `pick`."""
    pairs: list[tuple[str, object]] = list(record.items())
    attribute: Attribute = pick(schema.attributes)
    index = schema.names.index(attribute.name)
    markers: tuple[str, ...] = ()
    if attribute.sensitive:
        # A value no domain holds and that no reason may echo.
        number = MARKER_NUMBER + serial
        base = f"Zq{serial:07d}x" if attribute.bins is None else str(number)
        markers = (base,) if attribute.bins is None else (base, f"{number:g}", f"{number:.1f}")
    else:
        base = str(record[attribute.name])
    mutation = pick(MUTATIONS)
    ascii_only = pick([True, False])
    what = f"{attribute.name}: {mutation}"

    def put(value: object) -> None:
        pairs[index] = (attribute.name, value)

    if mutation == "text":
        name = pick(sorted(TEXT_ODDITIES))
        odd = TEXT_ODDITIES[name](base)
        put(odd)
        what += f" {name}"
        if attribute.sensitive and len(odd) >= 3:
            markers += (odd,)
    elif mutation == "value":
        name = pick(sorted(VALUE_ODDITIES))
        put(VALUE_ODDITIES[name](base))
        what += f" {name}"
    elif mutation == "fragment":
        name = pick(sorted(FRAGMENTS))
        put(Raw(FRAGMENTS[name](base)))
        what += f" {name}"
    elif mutation == "bytes":
        name = pick(sorted(BAD_BYTES))
        where = pick([0, len(base) // 2, len(base)])
        text = base.encode()
        put(Raw(b'"' + text[:where] + BAD_BYTES[name] + text[where:] + b'"'))
        what += f" {name}"
    elif mutation == "missing":
        how = pick(["absent", "null", "empty string"])
        if how == "absent":
            del pairs[index]
        else:
            put(None if how == "null" else "")
        what += f" {how}"
    elif mutation == "unknown":
        name = pick([*ODD_NAMES, *(f(attribute.name) for f in TEXT_ODDITIES.values())])
        pairs.insert(pick([0, len(pairs)]), (name, pick([base, 1, None])))
        what += f" {name!r}"
    elif mutation == "duplicate":
        # A key twice: parsers differ on which value counts, so neither may.
        how = pick(["same value", "bad value first", "bad value last"])
        bad = base if attribute.sensitive else f"{base}!"
        if how == "same value":
            pairs.append((attribute.name, record[attribute.name]))
        else:
            pairs.insert(0 if how == "bad value first" else len(pairs), (attribute.name, bad))
        what += f" {how}"
    value = render(pairs, ascii_only)
    if mutation == "message":
        name = pick(sorted(MESSAGE_ODDITIES))
        return Odd(MESSAGE_ODDITIES[name](value), (), f"message: {name}")
    return Odd(value, markers, what)


@st.composite
def valid_records(draw: st.DrawFn, schema: Schema) -> dict[str, object]:
    record: dict[str, object] = {}
    for attribute in schema.attributes:
        if attribute.bins is None:
            record[attribute.name] = draw(st.sampled_from(attribute.domain))
        else:
            low, high = attribute.bins[0], attribute.bins[-1]
            whole = st.integers(math.ceil(low), math.ceil(high) - 1)
            inside = st.floats(low, high, exclude_max=True)
            record[attribute.name] = draw(st.one_of(whole, whole.map(str), inside))
    return record


@functools.cache
def _sampled(options: tuple[T, ...]) -> st.SearchStrategy[T]:
    return st.sampled_from(options)


def odd_messages(schema: Schema) -> st.SearchStrategy[Odd]:
    records, serials = valid_records(schema), st.integers(0, 9_999_999)

    @st.composite
    def odd(draw: st.DrawFn) -> Odd:
        record, serial = draw(records), draw(serials)
        return odd_message(schema, record, lambda options: draw(_sampled(tuple(options))), serial)

    return odd()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def arbitrary_values(schema: Schema) -> st.SearchStrategy[bytes | None]:
    """Bytes of every kind, from noise to objects over the schema's names and labels."""
    numbers = ["17", "39", "90", "91", "1", "99", " 30 ", "3e1", "-0", "nan", "inf", "0x1f"]
    labels = [v for a in schema.attributes for v in a.domain] + numbers

    def values(attribute: Attribute) -> st.SearchStrategy[object]:
        own = st.sampled_from(attribute.domain if attribute.bins is None else numbers)
        return own | st.integers(-5, 120) | JSON_VALUES

    records = st.fixed_dictionaries({a.name: values(a) for a in schema.attributes})
    objects = st.dictionaries(
        st.sampled_from(schema.names) | st.text(max_size=6),
        st.sampled_from(labels) | st.integers(-5, 120) | JSON_VALUES,
        max_size=len(schema.names) + 1,
    )
    near = records | objects
    return st.one_of(
        st.none(),
        st.binary(max_size=200),
        st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        near.map(lambda r: json.dumps(r).encode()),
        near.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    )


def _not_a_constant(name: str) -> None:
    raise AssertionError(f"a payload holds {name}")


def check_prepare(
    preparer: Preparer, messages: list[RawMessage], markers: Mapping[int, Sequence[str]]
) -> None:
    """prepare() on messages with distinct offsets: see the module docstring."""
    schema = preparer.schema
    batches, rejected = preparer.prepare(messages)
    accepted: dict[int, list[int]] = {}
    for batch in batches:
        assert len(batch.dedup_keys) == len(batch.ids) == len(batch.public) == len(batch)
        assert len(batch.sensitive) == len(batch)
        for j, message in enumerate(batch.messages):
            assert message.partition == batch.partition
            sensitive = b",".join(b"%d" % int(c) for c in batch.sensitive[j])
            member = batch.public[j] + b"|" + sensitive + b"|"
            accepted[message.offset] = preparer.codes_of(member)
            json.loads(preparer.published_json(member))
    refused = {r.message.offset: r for r in rejected}
    assert sorted([*accepted, *refused]) == sorted(m.offset for m in messages)  # each once

    for message in messages:
        expected = expected_codes(schema, message.value)
        if message.offset in accepted:
            assert expected is not None, f"accepted an invalid record {message.value!r:.300}"
            assert accepted[message.offset] == expected
            continue
        rejection = refused[message.offset].rejection
        assert expected is None, f"rejected a valid record ({rejection}): {message.value!r:.300}"
        assert isinstance(rejection.reason, str) and rejection.reason.strip()
        for marker in markers.get(message.offset, ()):
            # A bad sensitive value is neither in the reason nor in the logged text.
            assert marker.casefold() not in rejection.reason.casefold()
            assert marker.casefold() not in str(rejection).casefold()
        payload = refused[message.offset].payload()
        assert payload.isascii()
        assert json.loads(payload, parse_constant=_not_a_constant) == {
            "reason": rejection.reason,
            "field": rejection.field,
            "partition": message.partition,
            "offset": message.offset,
            "key": message.key.decode("utf-8", "replace") if message.key else None,
            # The raw record, as the rejected topic documents: nothing is lost.
            "value": (message.value or b"").decode("utf-8", "replace"),
        }


# Built once: hypothesis validates a strategy again whenever one is built.
ODD_LISTS = {
    name: st.lists(odd_messages(c.schema), min_size=1, max_size=6) for name, c in CONFIGS.items()
}
ARBITRARY_LISTS = {
    name: st.lists(arbitrary_values(c.schema), min_size=1, max_size=6)
    for name, c in CONFIGS.items()
}
KEYS = st.binary(min_size=1, max_size=12)


@pytest.mark.parametrize("stream", sorted(CONFIGS))
@FUZZ
@given(data=st.data())
def test_prepare_rejects_odd_records_and_accepts_exactly_the_valid_ones(stream, data):
    preparer = PREPARERS[stream]
    odds = data.draw(ODD_LISTS[stream])
    messages, markers = [], {}
    for offset, odd in enumerate(odds):
        note(f"offset {offset}: {odd.what}")
        partition = data.draw(st.integers(0, 1))
        key = data.draw(KEYS)
        messages.append(RawMessage(partition, offset, key, odd.value))
        markers[offset] = odd.markers
    check_prepare(preparer, messages, markers)


@pytest.mark.parametrize("stream", sorted(CONFIGS))
@FUZZ
@given(data=st.data())
def test_prepare_survives_arbitrary_bytes(stream, data):
    preparer = PREPARERS[stream]
    values = data.draw(ARBITRARY_LISTS[stream])
    messages = [RawMessage(i % 2, i, data.draw(KEYS), v) for i, v in enumerate(values)]
    check_prepare(preparer, messages, {})


def test_each_oddity_once_on_each_sensitive_attribute():
    """Every entry of the tables above, deterministically, with no echo of the marker."""
    choices = {
        "text": sorted(TEXT_ODDITIES), "value": sorted(VALUE_ODDITIES),
        "fragment": sorted(FRAGMENTS), "bytes": sorted(BAD_BYTES),
        "missing": ["absent", "null", "empty string"],
        "unknown": ODD_NAMES,
        "duplicate": ["same value", "bad value first", "bad value last"],
        "message": sorted(MESSAGE_ODDITIES), "none": [""],
    }  # fmt: skip
    for preparer in PREPARERS.values():
        schema = preparer.schema
        record = {a.name: a.domain[-1] if a.bins is None else a.bins[0] for a in schema.attributes}
        messages, markers, what = [], {}, {}
        for attribute in schema.sensitive:
            for mutation in MUTATIONS:
                for choice in choices[mutation]:

                    def pick(options: Sequence[T], wanted=(attribute, mutation, choice)) -> T:
                        return next((w for w in wanted if w in options), options[0])

                    serial = len(messages)
                    odd = odd_message(schema, record, pick, serial)
                    messages.append(RawMessage(0, serial, b"%d" % serial, odd.value))
                    markers[serial], what[serial] = odd.markers, odd.what
        check_prepare(preparer, messages, markers)
        rejected = {r.message.offset for r in preparer.prepare(messages)[1]}
        accepted = {what[i].split(": ")[-1] for i in range(len(messages)) if i not in rejected}
        assert accepted == {"none", "exactly the limit"}


# ---------------------------------------------------------------------------------------------
# Configs: the example documents with one thing broken.

DELETE = object()
EXAMPLE_NAMES = ["adult-decoy.toml", "adult-personal.toml"]
WRONG_TYPES: list[object] = [
    "text", 7, 1.5, True, [], ["x"], [7], {}, {"x": 1},
    datetime.date(2024, 2, 29), datetime.time(12, 30),
]  # fmt: skip
# Not 10**400 for settings: see test_config_gaps_outside_this_change.
INTEGER_EXTREMES: list[object] = [0, -1, 1, -(2**63), 2**63, 65_536]
FLOAT_EXTREMES: list[object] = [
    0.0, -0.0, -1.0, 1.0, 1.5, 100.0, 1e-300, 1e308, math.inf, -math.inf, math.nan, 0, -1, 2**63,
]  # fmt: skip
BAD_DOMAINS: list[object] = [
    [], [""], ["a", "a"], [1, 2], [["a"]], [{"a": 1}], [True, False], "abc", ["a"],
    [datetime.date(2024, 2, 29)], ["a", None],
]  # fmt: skip
BAD_BINS: list[object] = [
    [], [17], [25, 17], [17, 17, 25], [17, math.nan], [17, math.inf], [-math.inf, 17],
    ["17", "25"], [True, 2], [17, 10**400], [-(10**400), 17], "17", [[17, 25]], {},
    [17.0, 25.0, 25.0],
]  # fmt: skip
ODD_KEYS = ["bogus", "Name", "max-wait", "gamma ", "na\u00efve", "\u200bname", "\U0001f600", ""]
SETTING_VALUES: dict[tuple[str, ...], list[object]] = {
    ("stream", "name"): ["", "a b", "a/b", "adult\n", "a:b"],
    ("stream", "mechanism"): ["anatomy", "Decoy", "decoy ", "decoy", "personal"],
    ("decoy", "grouping"): ["anatomy", ""],
    ("personal", "budget"): ["bogus", "Conservative"],
    ("key", "env"): [""],
    ("kafka", "bootstrap"): [""],
    ("redis", "url"): [""],
    ("reports", "fail_closed"): [
        ["bogus"], ["budget"], ["eligibility"], ["guarantees"], "adversary", [["adversary"]],
    ],
    ("reports", "queries"): [
        [7], ["sex"], [{"where": "sex"}], [{"bogus": {}}], [{"where": {"sex": "Nope"}}],
        [{"where": {"nosuch": "x"}}], [{"value": {"sex": "Male"}}],
        [{"where": {"occupation": "Sales"}}], [{"where": {"sex": ["Male", "Nope"]}}],
        [{"value": {"occupation": ["Sales"]}}], [{"value": {"income": ["<=50K"]}}],
    ],
    ("reports", "epsilon"): [0, -0.3, math.nan, "0.3"],
    ("reports", "alpha"): [0, 2.5, -3],
    ("reports", "error_tolerance"): [1, 1.5, 0],
    ("reports", "min_privacy"): [1, 2.0, 0],
    ("reports", "max_suppressed"): [-0.1, 1.5, math.nan],
    ("reports", "max_small_within"): [0, 1.5, math.nan, "half"],
    ("reports", "dp_epsilon"): [0, -1, "x"],
    ("reports", "port"): [-1, 1.5, "6066"],
    ("reports", "min_rows"): [0],
    ("reports", "large_count"): [0],
}  # fmt: skip
CONFIG_MUTATIONS = [
    "delete", "wrong type", "extreme number", "unknown key", "unknown table", "bad domain",
    "bad bins", "bad setting", "declared twice",
]  # fmt: skip


def walk(node: object, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """(path, value) of every key and list item under node."""
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return []
    found = []
    for key, child in items:
        found.append(((*prefix, key), child))
        found += walk(child, (*prefix, key))
    return found


def same_kind(a: object, b: object) -> bool:
    def kind(x: object) -> str:
        if isinstance(x, bool):
            return "bool"
        if isinstance(x, int | float):
            return "int" if isinstance(x, int) else "float"
        return type(x).__name__

    numbers = {"int", "float"}
    if kind(a) in numbers and kind(b) in numbers:
        return kind(b) == "float" or kind(a) == "int"  # an integer is a float, not vice versa
    return kind(a) == kind(b)


@dataclass(frozen=True)
class ConfigMutation:
    example: str
    kind: str
    path: tuple
    value: object
    names: tuple[str, ...]  # one of these must appear in the error message

    def apply(self, document: dict[str, Any]) -> None:
        node: Any = document
        for step in self.path[:-1]:
            node = node[step]
        if self.value is DELETE:
            del node[self.path[-1]]
        else:
            node[self.path[-1]] = copy.deepcopy(self.value)


def named(path: tuple, parent: bool) -> tuple[str, ...]:
    """The key a message must name: the last one, or (parent) either of the last two."""
    keys = [p for p in path if isinstance(p, str)]
    return tuple(keys[-2:] if parent or not isinstance(path[-1], str) else keys[-1:])


@st.composite
def config_mutations(draw: st.DrawFn) -> ConfigMutation:
    name = draw(st.sampled_from(EXAMPLE_NAMES))
    document = example(name)
    everything = walk(document)
    kind = draw(st.sampled_from(CONFIG_MUTATIONS))
    if kind == "delete":
        path = draw(st.sampled_from([p for p, _ in everything]))
        return ConfigMutation(name, kind, path, DELETE, named(path, parent=True))
    if kind == "wrong type":
        path, original = draw(st.sampled_from(everything))
        value = draw(st.sampled_from([v for v in WRONG_TYPES if not same_kind(original, v)]))
        return ConfigMutation(name, kind, path, value, named(path, parent=False))
    if kind == "extreme number":
        numbers = [
            (p, v) for p, v in everything
            if isinstance(v, int | float) and not isinstance(v, bool) and isinstance(p[-1], str)
        ]  # fmt: skip
        path, original = draw(st.sampled_from(numbers))
        extremes = INTEGER_EXTREMES if isinstance(original, int) else FLOAT_EXTREMES
        value = draw(st.sampled_from(extremes))
        return ConfigMutation(name, kind, path, value, named(path, parent=False))
    if kind in ("unknown key", "unknown table"):
        tables = [((), document)] if kind == "unknown table" else []
        tables += [(p, v) for p, v in everything if isinstance(v, dict) and kind == "unknown key"]
        table, _ = draw(st.sampled_from(tables))
        key = draw(st.sampled_from(ODD_KEYS))
        value = draw(st.sampled_from([{}, 1, "x", {"domain": ["a", "b"]}, {"x": 1}]))
        return ConfigMutation(name, kind, (*table, key), value, (key,))
    if kind in ("bad domain", "bad bins"):
        field = kind.split()[1]
        bad = draw(st.sampled_from(BAD_BINS if field == "bins" else BAD_DOMAINS))
        # An attribute's spec, with a bad domain or bins in place of what it had.
        specs = [p for p, v in everything if p[:1] == ("schema",) and len(p) == 3]
        path = draw(st.sampled_from(specs))
        return ConfigMutation(name, kind, path, {field: bad}, (path[-1], field))
    if kind == "bad setting":
        paths = [p for p in SETTING_VALUES if p[0] in document]
        path = draw(st.sampled_from(paths))
        value = draw(st.sampled_from(SETTING_VALUES[path]))
        return ConfigMutation(name, kind, path, value, (path[-1],))
    # declared twice: a sensitive attribute also declared public
    attribute = draw(st.sampled_from(sorted(document["schema"]["sensitive"])))
    spec = document["schema"]["sensitive"][attribute]
    return ConfigMutation(name, kind, ("schema", "public", attribute), spec, (attribute,))


def mentions(message: str, name: str) -> bool:
    return name in message or repr(name)[1:-1] in message


# Messages of service/core/config.py that name the table but not the field: the [personal]
# parameter checks (the sensitive domain's size, the trial limit against stream.partitions)
# and the one-sensitive-attribute rule. See test_config_gaps_outside_this_change.
TABLE_ONLY = ("fuzz.toml: [personal] ", "fuzz.toml: personal groups protect exactly one")


@FUZZ
@given(config_mutations())
def test_a_broken_config_fails_naming_the_field(mutation):
    document = example(mutation.example)
    mutation.apply(document)
    try:
        parse_config(document, "fuzz.toml", EXAMPLES)
    except SchemaError as err:  # ConfigError, or SchemaError from the [schema] table
        message = str(err)
        note(message)
        assert message.startswith("fuzz.toml: ")
        if not message.startswith(TABLE_ONLY):
            assert any(mentions(message, name) for name in mutation.names), message
        if mutation.path[0] != "schema":
            assert isinstance(err, ConfigError)


@pytest.mark.parametrize(
    ("name", "path", "value", "field"),
    [
        ("adult-decoy.toml", ("stream", "max_wait"), 10**400, "stream.max_wait"),
        ("adult-decoy.toml", ("stream", "max_wait"), math.inf, "stream.max_wait"),
        ("adult-personal.toml", ("stream", "partitions"), 10**400, "stream.partitions"),
        ("adult-decoy.toml", ("schema", "public", "sex", "domain"), [], "schema.public.sex"),
        ("adult-personal.toml", ("personal", "merge_map"), "missing.toml", "personal.merge_map"),
        ("adult-personal.toml", ("schema", "sensitive", "income", "domain"), [">50K"], "income"),
        ("adult-decoy.toml", ("reports", "port"), 70_000, "reports.port"),
        ("adult-decoy.toml", ("stream", "name"), "\u540d\u524d", "stream.name"),
    ],
)
def test_configs_the_fuzz_broke_fail_naming_the_field(name, path, value, field):
    """Found by the fuzz above (overflowing numbers, infinities, schema errors of the wrong
    type, messages without the field); each now fails with a ConfigError naming it."""
    document = example(name)
    ConfigMutation(name, "gap", path, value, ()).apply(document)
    with pytest.raises(ConfigError) as caught:
        parse_config(document, "fuzz.toml", EXAMPLES)
    assert field in str(caught.value)


# ---------------------------------------------------------------------------------------------
# A worker on the embedded servers.

GOOD, BAD = 3000, 300


def seeded_bad_messages(
    schema: Schema, records: list[bytes], seed: int
) -> list[tuple[bytes, bytes | None, tuple[str, ...]]]:
    """(key, value, markers) of one invalid message made from each record, reproducibly."""
    rng = random.Random(seed)
    out = []
    for serial, value in enumerate(records):
        record = json.loads(value)
        odd = odd_message(schema, record, rng.choice, serial)
        while expected_codes(schema, odd.value) is not None:  # left valid: draw again
            odd = odd_message(schema, record, rng.choice, serial)
        out.append((b"bad-%d" % serial, odd.value, odd.markers))
    return out


@pytest.mark.stream
def test_a_worker_rejects_fuzzed_messages_and_publishes_the_good_ones(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml")
    config = harness.config
    asyncio.run(create_topics(config.kafka, dict.fromkeys(config.topics.values(), 2)))
    rows = adult_rows(config)
    good = rows[:GOOD]
    bad = seeded_bad_messages(config.schema, [v for _, v in rows[GOOD : GOOD + BAD]], 6003)
    stream: list[tuple[bytes, bytes | None]] = list(good)
    rng = random.Random(6003)
    for key, value, _ in bad:
        stream.insert(rng.randrange(len(stream) + 1), (key, value))
    harness.start_worker()

    async def run_stream() -> dict[str, int]:
        client = aioredis.from_url(config.redis_url)
        try:
            await produce(config, iter(stream), progress=False)
            deadline = time.monotonic() + 60
            while True:
                totals = await harness.totals(client)
                done = totals.get("settled", 0)
                finished = done == GOOD and totals.get("rejected", 0) >= BAD
                if finished and totals["in_flight"] == 0:
                    return totals
                if time.monotonic() > deadline or not harness.worker.running:
                    return totals
                await asyncio.sleep(0.2)
        finally:
            await client.aclose()

    try:
        totals = asyncio.run(run_stream())
        running = harness.worker.running
        rejected = asyncio.run(harness.read(config.topics["rejected"], BAD, key=lambda m: m.key))
        published = asyncio.run(
            harness.read(config.topics["published"], totals.get("published", 0))
        )
    finally:
        harness.worker.stop()
    log = harness.log.read_text(errors="replace")
    assert running, f"the worker died:\n{log[-3000:]}"
    for trouble in ("could not be stored", "crashed", "Logging error"):
        assert trouble not in log, log[-3000:]

    # Every bad message is on the rejected topic with a reason, and nothing else is.
    assert set(rejected) == {key for key, _, _ in bad}
    for key, value, markers in bad:
        payload = json.loads(rejected[key])
        assert payload["reason"] and payload["key"] == key.decode()
        assert payload["value"] == (value or b"").decode("utf-8", "replace")
        assert not any(m.casefold() in payload["reason"].casefold() for m in markers)
    # The worker's log line names each rejection's field (never its value).
    fields = {json.loads(rejected[key])["field"] for key, _, _ in bad} - {None}
    assert fields and all(f"field {f!r}: " in log for f in fields), log[-3000:]

    # Every good record is published once or suppressed; nothing waits.
    assert totals["rejected"] == BAD and totals["ingested"] == GOOD, totals
    assert totals["settled"] == GOOD, totals
    rows_out = [json.loads(v)["row"] for v in published.values()]
    assert len(rows_out) == len(set(rows_out)) == totals["published"]
    assert set(rows_out) <= {json.loads(v)["row"] for _, v in good}


def fast_codes(preparer: Preparer, values: list[bytes | None]) -> list[list[int] | None]:
    """Each record's codes where the fast path vouches for them, else None (where
    `_validate` decides)."""
    positions, codes = preparer._fast_rows(values)
    out: list[list[int] | None] = [None] * len(values)
    for position, row in zip(positions.tolist(), codes.tolist(), strict=True):
        out[position] = row
    return out


@pytest.mark.parametrize("stream", sorted(CONFIGS))
@FUZZ
@given(data=st.data())
def test_the_fast_path_vouches_only_for_what_the_exact_reading_accepts(stream, data):
    """The fast path (`Preparer._fast_rows`: msgspec, column lookups) gives a record's
    codes only where `_validate` gives the same codes; everything else it leaves to
    `_validate`."""
    preparer = PREPARERS[stream]
    values = [odd.value for odd in data.draw(ODD_LISTS[stream])]
    values += data.draw(ARBITRARY_LISTS[stream])
    for offset, (value, fast) in enumerate(zip(values, fast_codes(preparer, values), strict=True)):
        if fast is not None:
            assert fast == preparer._validate(RawMessage(0, offset, None, value))


def test_a_repeated_key_is_never_taken_by_the_fast_path():
    """msgspec keeps the last of two equal keys: a repeat, with or without whitespace
    before the colon or written with an escape, goes to the exact reading, which
    rejects it."""
    config = CONFIGS["personal"]
    preparer = PREPARERS["personal"]
    compact = json.dumps(json.loads(adult_rows(config)[0][1]), separators=(",", ":"))
    assert fast_codes(preparer, [compact.encode()])[0] is not None
    repeats = [
        compact[:-1] + ',"sex":"Female"}',
        compact[:-1] + ', "sex" : "Female"}',
        compact[:-1] + ',"\\u0073ex":"Female"}',
    ]
    for text in repeats:
        value = text.encode()
        assert fast_codes(preparer, [value]) == [None], text
        batches, rejected = preparer.prepare([RawMessage(0, 0, b"r", value)])
        assert not batches and rejected[0].rejection.reason == "an object has the same key twice"
