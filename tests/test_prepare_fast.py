"""The worker's vectorized preparation gives byte for byte what a plain one gives.

`ReferencePreparer` below prepares record by record (per-record dict parse and key
count, per-row hashing and joins): slow, and simple enough to read as the definition.
Both prepare the same messages, from resampled Adult records written in several ways to
the fuzz tests' odd and arbitrary messages, and everything a batch carries must be equal:
the accepted/rejected split, the rejection reasons and payloads, dedup keys,
fingerprints, ids, public bytes, sensitive codes, draws, personal groups and perturbed
values; so must the published JSON of pool entries, odd ones included.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import hashlib
import json
import random
import tomllib
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz import ARBITRARY_LISTS, CONFIGS, FUZZ, KEYS, ODD_LISTS

from service.core.config import StreamConfig, parse_config
from service.core.ingest import (
    MAX_MESSAGE_BYTES,
    NO_KEY,
    PreparedBatch,
    Preparer,
    RawMessage,
    Rejected,
)
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.personal import PersonalGroups, UniformPerturbation
from service.core.prf import ServiceKey, prf128
from service.core.schema import Attribute, RecordError, Rejection, Schema
from service.core.table import Table, open_sample
from service.core.windows import WindowPreparer

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(13)
KNOWN_BIN_VALUES = 10_000


def reference_ids(key: ServiceKey, names: list[bytes]) -> np.ndarray:
    """`service.core.prf.ids_for` as it was."""
    digests = b"".join(hashlib.blake2b(name, digest_size=16).digest() for name in names)
    blocks = np.frombuffer(digests, dtype=">u8").astype(np.uint64).reshape(-1, 2)
    return prf128(key, "record ids", blocks)


class ReferencePreparer:
    """`service.core.ingest.Preparer`, record by record: the reference its batch paths match."""

    def __init__(self, config: StreamConfig, key: ServiceKey) -> None:
        self.config = config
        self.key = key
        self._fingerprint_key = key.subkey("dedup fingerprints")
        self._digest_key = key.subkey("dedup digests")
        self.schema = config.schema
        self._public = [i for i, a in enumerate(self.schema.attributes) if not a.sensitive]
        # '"name":"label"' per attribute and code: published records are joined from these.
        self._fragments = [
            [json.dumps({a.name: label})[1:-1].encode() for label in a.domain]
            for a in self.schema.attributes
        ]
        self._sensitive = [i for i, a in enumerate(self.schema.attributes) if a.sensitive]
        self._decoder = msgspec.json.Decoder()
        self._quoted_names = [b'"%s"' % a.name.encode() for a in self.schema.attributes]
        # Text -> code per attribute: the domain's labels, or the binned texts seen so far.
        self._known_codes = [
            dict(a._codes) if a.bins is None else {}  # type: ignore[attr-defined]
            for a in self.schema.attributes
        ]
        if config.decoy is not None:
            self._decoy = DecoyGroups(config.decoy.gamma, config.decoy.grouping)
        if config.personal is not None:
            settings = config.personal
            # For its grouping only: the stream's trial budget is personal.lua's.
            self._personal = PersonalGroups(
                settings.retention, settings.lam, settings.delta, value_map=settings.value_map
            )
            self._perturbation = UniformPerturbation(
                settings.retention, self.schema.sensitive[0].size
            )

    def prepare(self, messages: list[RawMessage]) -> tuple[list[PreparedBatch], list[Rejected]]:
        """Split messages into per-partition batches of accepted records and rejections.

        Most records take a fast path, checked over the whole batch: one msgspec parse,
        then a dictionary lookup per attribute and column. A record the fast path cannot
        vouch for goes through `_validate`, the exact reference, so the outcome and the
        reason of a rejection are the same either way.
        """
        # Issue 29: a message without a key is rejected first.
        rejected = [
            Rejected(m, Rejection(f"{m.partition}/{m.offset}", None, NO_KEY))
            for m in messages
            if not m.key
        ]
        messages = [m for m in messages if m.key]
        codes = self._fast_codes([m.value for m in messages])
        accepted: dict[int, list[tuple[RawMessage, list[int]]]] = {}
        for message, fast in zip(messages, codes, strict=True):
            if fast is None:
                try:
                    fast = self._validate(message)
                except RecordError as err:
                    rejected.append(Rejected(message, err.rejection))
                    continue
            accepted.setdefault(message.partition, []).append((message, fast))
        return [self._batch(p, rows) for p, rows in sorted(accepted.items())], rejected

    def _fast_codes(self, values: list[bytes | None]) -> list[list[int] | None]:
        """Each record's codes in schema order, or None where `_validate` must decide.

        Only flat objects without backslashes whose every attribute name appears once,
        quoted, in the text are taken here: msgspec keeps the last of two equal keys,
        which `_validate` rejects, and without escapes a key is always written as its
        quoted name, so the count shows a repeated key.
        """
        loads, quoted, n = self._decoder.decode, self._quoted_names, len(self._quoted_names)
        parsed: list[dict | None] = []
        for value in values:
            record = None
            if value and len(value) <= MAX_MESSAGE_BYTES and b"\\" not in value:
                with contextlib.suppress(msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
                    record = loads(value)
                if not (
                    type(record) is dict
                    and len(record) == n
                    and sum(value.count(name) for name in quoted) == n
                ):
                    record = None
            parsed.append(record)
        rows = [i for i, record in enumerate(parsed) if record is not None]
        columns = []
        for attribute, known in zip(self.schema.attributes, self._known_codes, strict=True):
            raw = [parsed[i].get(attribute.name) for i in rows]  # type: ignore[union-attr]
            try:
                column = [known.get(v, -1) for v in raw]
            except TypeError:  # a list or an object: unhashable, and never a code
                column = [known.get(v, -1) if type(v) is str else -1 for v in raw]
            for j in (j for j, code in enumerate(column) if code < 0):
                try:
                    column[j] = attribute.code_of(raw[j])
                except ValueError:
                    continue
                if type(raw[j]) is str and len(known) < KNOWN_BIN_VALUES:
                    known[raw[j]] = column[j]
            columns.append(column)
        out: list[list[int] | None] = [None] * len(values)
        for j, row in enumerate(zip(*columns, strict=True)):
            if min(row, default=0) >= 0:
                out[rows[j]] = list(row)
        return out

    # Shared with Preparer, not re-derived: the exact path, and how pool entries are read.
    _validate = Preparer._validate
    codes_of = Preparer.codes_of
    decode = Preparer.decode

    def identify(
        self, partition: int, messages: list[RawMessage], codes: np.ndarray
    ) -> PreparedBatch:
        """A batch of validated records (`codes` in schema order) with their dedup keys, ids
        and fingerprints, and no randomization inputs yet."""
        # Issue 29: a response's identity is the stream's, its key alone.
        dedup_keys = [b"k:" + m.key for m in messages]
        return PreparedBatch(
            partition=partition,
            messages=messages,
            dedup_keys=dedup_keys,
            # The content digest is of the validated record, so a resend formatted
            # differently is still the same; keyed, because it stays in Redis after
            # publication and an unkeyed hash of a few thousand possible records would give
            # the record back.
            fingerprints=[
                hashlib.blake2b(dedup, digest_size=8, key=self._fingerprint_key).digest()
                + hashlib.blake2b(row.tobytes(), digest_size=4, key=self._digest_key).digest()
                for dedup, row in zip(dedup_keys, codes, strict=True)
            ],
            ids=reference_ids(self.key, dedup_keys),
            public=[b",".join(b"%d" % c for c in row) for row in codes[:, self._public].tolist()],
            sensitive=codes[:, self._sensitive],
        )

    def _batch(self, partition: int, rows: list[tuple[RawMessage, list[int]]]) -> PreparedBatch:
        codes = np.asarray([c for _, c in rows], dtype=np.int64).reshape(len(rows), -1)
        batch = self.identify(partition, [m for m, _ in rows], codes)
        ids = batch.ids
        names = [a.name for a in self.schema.sensitive]
        if self.config.decoy is not None:
            batch.draws = np.column_stack(
                [self._decoy.draws(ids, self.key, name) for name in names]
            ).reshape(len(rows), len(names))
        else:
            table = Table(
                self.schema,
                {
                    a.name: codes[:, i].astype(np.int32)
                    for i, a in enumerate(self.schema.attributes)
                },
            )
            keys, _, _ = self._personal.group_keys(table)
            batch.groups = [".".join(map(str, row)).encode() for row in keys.tolist()]
            batch.perturbed = self._perturbation.perturb(
                codes[:, self._sensitive[0]], ids, self.key, names[0]
            )
        return batch

    def published_json(self, member: bytes) -> bytes:
        """`decode` as JSON bytes, from fragments encoded once per attribute value."""
        fragments = self._fragments
        return b"{%s}" % b",".join(
            fragments[i][code] for i, code in enumerate(self.codes_of(member))
        )


class WindowReference(ReferencePreparer):
    """`service.core.windows.WindowPreparer` over the reference: no per-record draws."""

    def _batch(self, partition: int, rows: list[tuple[RawMessage, list[int]]]) -> PreparedBatch:
        codes = np.asarray([c for _, c in rows], dtype=np.int64).reshape(len(rows), -1)
        return self.identify(partition, [m for m, _ in rows], codes)


def example(name: str) -> StreamConfig:
    return parse_config(tomllib.loads((EXAMPLES / name).read_text()), name, EXAMPLES)


DECOY = example("adult-decoy.toml")
PERSONAL = example("adult-personal.toml")
assert PERSONAL.personal is not None
STREAMS = {
    "decoy": DECOY,
    "decoy, two sensitive": CONFIGS["decoy"],
    "personal": PERSONAL,
    "personal, no merge map": dataclasses.replace(
        PERSONAL, personal=dataclasses.replace(PERSONAL.personal, value_map=None)
    ),
    "windowed": example("adult-windowed.toml"),
}


def preparers(config: StreamConfig) -> tuple[Preparer, ReferencePreparer]:
    if config.windowed is not None:
        return WindowPreparer(config, KEY), WindowReference(config, KEY)
    return Preparer(config, KEY), ReferencePreparer(config, KEY)


def same_array(new: np.ndarray, old: np.ndarray) -> bool:
    return new.dtype == old.dtype and new.shape == old.shape and np.array_equal(new, old)


def assert_same_batches(
    new: tuple[list[PreparedBatch], list[Rejected]], old: tuple[list[PreparedBatch], list[Rejected]]
) -> None:
    (batches, rejected), (expected_batches, expected_rejected) = new, old
    assert rejected == expected_rejected
    assert [r.payload() for r in rejected] == [r.payload() for r in expected_rejected]
    assert len(batches) == len(expected_batches)
    for batch, expected in zip(batches, expected_batches, strict=True):
        assert batch.partition == expected.partition
        assert batch.messages == expected.messages
        assert batch.dedup_keys == expected.dedup_keys
        assert batch.fingerprints == expected.fingerprints
        assert same_array(batch.ids, expected.ids)
        assert batch.id_bytes() == expected.id_bytes()
        assert batch.public == expected.public
        for name in ("sensitive", "draws", "perturbed"):
            assert same_array(getattr(batch, name), getattr(expected, name)), name
        assert batch.groups == expected.groups


def outcome(call, *args) -> object:
    """What a call returns, or the type and text of what it raises."""
    try:
        return call(*args)
    except Exception as err:  # both sides must fail alike, however they fail
        return type(err), str(err)


def assert_same_json(new: Preparer, old: ReferencePreparer, members: list[bytes]) -> None:
    for member in members:
        # Twice: the second reading may come from what the first remembered.
        for _ in range(2):
            assert outcome(new.published_json, member) == outcome(old.published_json, member)
        assert outcome(new.codes_of, member) == outcome(old.codes_of, member)


def pool_entries(batches: list[PreparedBatch], rng: random.Random) -> list[bytes]:
    """Each accepted record as a pool entry, with a random published value."""
    entries = []
    for batch in batches:
        for public, values in zip(batch.public, batch.sensitive.tolist(), strict=True):
            published = b",".join(b"%d" % rng.randrange(v + 1) for v in values)
            entries.append(b"%s|%s|0:1,2|%s|1764130000000|%s" % (public, published, b"", b"f" * 32))
    return entries


def odd_entries(entries: list[bytes]) -> list[bytes]:
    """Pool entries written in every way `codes_of` reads, and some it refuses."""
    odd = []
    for entry in entries[:20]:
        public, sensitive, rest = entry.split(b"|", 2)
        odd += [
            b" %s|%s|%s" % (public, sensitive, rest),
            b"%s|+%s|%s" % (public, sensitive, rest),
            b"%s|0%s|%s" % (public, sensitive, rest),
            b"%s,0|%s|%s" % (public, sensitive, rest),
            b"%s|%s,0|%s" % (public, sensitive, rest),
            public.rpartition(b",")[0] + b"|" + sensitive + b"|" + rest,
            b"%s|-1|%s" % (public, rest),
            b"%s|99999|%s" % (public, rest),
            b"%s|x|%s" % (public, rest),
            b"%s|%s" % (public, sensitive),
            b"%s||%s" % (public, rest),
            b"|%s|" % sensitive,
            public,
            b"",
        ]
    return odd


@functools.cache
def adult_sample() -> list[dict[str, str]]:
    with open_sample() as stream:
        return list(csv.DictReader(stream))


def adult_messages(config: StreamConfig, count: int, seed: int) -> list[RawMessage]:
    """Resampled Adult records in the stream's schema, written in the ways producers write
    JSON, some twice, keyed by a record id or not, over three partitions."""
    rng = random.Random(seed)
    rows = adult_sample()
    messages = []
    names = config.schema.names
    for offset in range(count):
        row = rng.choice(rows)
        record = {}
        for attribute in config.schema.attributes:
            value: object = row.get(attribute.name, "")
            if attribute.bins is not None:
                value = rng.choice([value, value, int(value), float(value)]) if value else 40
            record[attribute.name] = value
        items = list(record.items())
        if rng.random() < 0.2:
            rng.shuffle(items)
        style = rng.choice(["compact", "spaced", "ascii"])
        text = json.dumps(
            dict(items),
            separators=(",", ":") if style == "compact" else None,
            ensure_ascii=style == "ascii",
        ).encode()
        assert set(record) == set(names)
        key = None if rng.random() < 0.1 else b"c:%d:1" % rng.randrange(count)
        messages.append(RawMessage(offset % 3, offset, key, text))
    return messages


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_adult_records_are_prepared_byte_for_byte_as_before(stream):
    config = STREAMS[stream]
    new, old = preparers(config)
    messages = adult_messages(config, 3000, seed=len(stream))
    rng = random.Random(0)
    start = 0
    while start < len(messages):
        size = rng.choice([1, 2, 50, 700])
        batch = messages[start : start + size]
        start += size
        assert_same_batches(new.prepare(batch), old.prepare(batch))
    entries = pool_entries(new.prepare(messages)[0], rng)
    if config.windowed is None:
        assert_same_json(new, old, entries[:2000] + odd_entries(entries))


MESSY_LISTS = {
    name: st.lists(ODD_LISTS[name].map(lambda odds: [o.value for o in odds]) | lists)
    for name, lists in ARBITRARY_LISTS.items()
}


@pytest.mark.parametrize("stream", sorted(CONFIGS))
@FUZZ
@given(data=st.data())
def test_messy_batches_are_prepared_as_before(stream, data):
    """Odd and arbitrary messages among valid ones, so that both the batch-wide reading and
    the per-record one run."""
    config = CONFIGS[stream]
    new, old = preparers(config)
    valid = [m.value for m in adult_messages(config, 8, seed=1)]
    values = [v for chunk in data.draw(MESSY_LISTS[stream]) for v in chunk]
    if data.draw(st.booleans()):
        values = valid + values
    messages = [RawMessage(i % 2, i, data.draw(KEYS), v) for i, v in enumerate(values)]
    prepared = new.prepare(messages)
    assert_same_batches(prepared, old.prepare(messages))
    entries = pool_entries(prepared[0], random.Random(1))
    assert_same_json(new, old, entries + odd_entries(entries))


OCCUPATION = DECOY.schema["occupation"]
HOURS = Attribute("hours", True, (), (1, 20, 35, 40, 45, 60, 100))
SCHEMAS = {
    # Sensitive attributes between public ones, and labels that JSON may write as numbers.
    "interleaved": Schema(
        (
            OCCUPATION,
            Attribute("sex", False, ("Female", "Male")),
            HOURS,
            Attribute("n", False, ("1", "2", "3", "10")),
        )
    ),
    "no public attribute": Schema((OCCUPATION, HOURS)),
    # Names that JSON writes with an escape, and an empty one.
    "escaped names": Schema(
        (
            Attribute('a"b', False, ("x", "y")),
            Attribute("c\\d", False, ("x", "y")),
            Attribute("", False, ("x", "y")),
            OCCUPATION,
        )
    ),
    # Names among the labels: a record's text holds a quoted name as a value too.
    "names as labels": Schema(
        (
            Attribute("Male", False, ("Male", "Female", "x")),
            Attribute("x", False, ("Male", "x", "é")),
            Attribute("", False, ("y", "x")),
            OCCUPATION,
            HOURS,
        )
    ),
}


def tricky_messages(schema: Schema, count: int, seed: int) -> list[bytes | None]:
    """Records of `schema`, valid or nearly: values as strings or numbers, keys repeated
    with values of either kind (the quote count's cases), missing, unknown or nested."""
    rng = random.Random(seed)
    out: list[bytes | None] = []
    for _ in range(count):
        pairs: list[tuple[str, object]] = []
        for attribute in schema.attributes:
            if attribute.bins is None:
                value: object = rng.choice(attribute.domain)
                if str(value).isdigit() and rng.random() < 0.5:
                    value = int(str(value))
            else:
                value = rng.choice([rng.randrange(1, 100), rng.uniform(1, 100), "40", 40.0])
            pairs.append((attribute.name, value))
        name = rng.choice(schema.names)
        twice = rng.choice([1, 2, 1.5, "x", "40", [1], ["x"], {"x": "y"}, None, True])
        mutation = rng.choice(["none", "none", "twice first", "twice last", "drop", "add", "nest"])
        if mutation == "twice first":
            pairs.insert(0, (name, twice))
        elif mutation == "twice last":
            pairs.append((name, twice))
        elif mutation == "drop":
            pairs.pop(rng.randrange(len(pairs)))
        elif mutation == "add":
            pairs.append((rng.choice(["extra", "x", "Male", name + " "]), "x"))
        elif mutation == "nest":
            index = rng.randrange(len(pairs))
            pairs[index] = (pairs[index][0], rng.choice([[pairs[index][1]], {"v": "x"}]))
        spaced = rng.random() < 0.3
        text = (
            b"{"
            + b", ".join(
                json.dumps(k, ensure_ascii=False).encode()
                + (b" : " if spaced else b":")
                + json.dumps(v, ensure_ascii=False).encode()
                for k, v in pairs
            )
            + b"}"
        )
        out.append(text)
    # A record at the size limit and one past it, a tombstone and an empty message.
    first = out[0]
    assert first is not None
    padding = MAX_MESSAGE_BYTES - len(first)
    return [*out, first + b" " * padding, first + b" " * (padding + 1), None, b""]


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", ["decoy", "personal, no merge map"])
def test_tricky_records_and_schemas_are_prepared_as_before(stream, schema):
    config = dataclasses.replace(STREAMS[stream], schema=SCHEMAS[schema])
    new, old = preparers(config)
    values = tricky_messages(config.schema, 3000, seed=7)
    rng = random.Random(3)
    messages = [RawMessage(rng.randrange(2), i, b"%d" % i, v) for i, v in enumerate(values)]
    # Whole batches, so that the batch-wide reading and its quote total are exercised, and
    # single messages.
    for start in range(0, len(messages), 500):
        chunk = messages[start : start + 500]
        assert_same_batches(new.prepare(chunk), old.prepare(chunk))
    for message in messages[:300]:
        assert_same_batches(new.prepare([message]), old.prepare([message]))
    prepared = new.prepare(messages)
    assert sum(map(len, prepared[0])) > 300  # many were valid
    entries = pool_entries(prepared[0], rng)
    assert_same_json(new, old, entries + odd_entries(entries))
