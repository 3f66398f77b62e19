"""Raw stream messages to buffer-ready records (SPEC §3), without I/O.

A raw message is a JSON object of attribute values; its Kafka key is the
producer's id of the response, the same whichever client sends it to whichever
partition, however often. A message without a key is rejected: nothing could tell
a re-send of it from a new response. Each accepted record gets:

- a *dedup key*: ``k:<producer id>``, the same for the stream's every partition, so
  a redelivered or re-sent record is recognised and stored once, at any age;
- a *fingerprint*, what Redis keeps of it for the life of the stream: a keyed
  64-bit hash of the dedup key (2 bytes pick a bucket, 6 are stored) and a keyed
  32-bit digest of its validated values, so a record id reused with different
  content is rejected instead of silently replacing or duplicating anything.
  Keyed, so nobody can test a guessed record against what Redis holds;
- a 128-bit *id*: a keyed PRF of its dedup key. A redelivery gets back the same
  id, and ids are independent of content and unguessable without the key;
- its randomization inputs, computed here by the mechanism classes the batch
  tools use: for decoy groups each sensitive value's draw index (PRF(id) mod
  γ), for personal groups the record's group key and perturbed value.

Everything else is rejected with a reason that never echoes a sensitive value.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple, Protocol

import msgspec
import numpy as np
from msgspec.structs import astuple

from service.core.config import StreamConfig
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.personal import PersonalGroups, UniformPerturbation
from service.core.prf import ServiceKey, ids_for
from service.core.schema import RecordError, Rejection
from service.core.table import Table
from service.core.wire import published_member, shown_fields

MAX_MESSAGE_BYTES = 64 * 1024
NO_KEY = (
    "the message has no key: a response's id must be its Kafka key, the same in every "
    "copy, or a re-send could not be recognised (README: Producing)"
)
# Binned values (their text) remembered with their code, per attribute: ages and the like.
KNOWN_BIN_VALUES = 10_000
# Public and sensitive code texts of pool entries remembered with their part of the
# published JSON, each: every combination of public values of the Adult sample fits.
KNOWN_ENTRY_TEXTS = 1 << 14
# Validated records remembered with their content digest: the Adult sample's combinations
# of values fit, in a few MB.
KNOWN_CONTENT_DIGESTS = 1 << 16


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are all different: with a key twice it means two things."""
    record = dict(pairs)
    if len(record) != len(pairs):
        raise _DuplicateKeyError
    return record


class Message(Protocol):
    """A raw record as consumed: what the worker reads of it. A fetched record is one
    (aiokafka's ConsumerRecord, or the worker's `FetchedRecord` with the same fields), so
    the worker prepares the records of a fetch as they come, without a copy each."""

    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...


class RawMessage(NamedTuple):
    """A raw record built by hand (tests, benchmarks, the rejected topic's tools)."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


partition_of, offset_of = attrgetter("partition"), attrgetter("offset")
key_of, value_of = attrgetter("key"), attrgetter("value")


@dataclass(frozen=True)
class Rejected:
    message: Message
    rejection: Rejection

    def payload(self) -> bytes:
        """The rejected-topic message: the reason plus the raw record, so nothing is lost."""
        value = self.message.value or b""
        return json.dumps(
            {
                "reason": self.rejection.reason,
                "field": self.rejection.field,
                "partition": self.message.partition,
                "offset": self.message.offset,
                "key": self.message.key.decode("utf-8", "replace") if self.message.key else None,
                "value": value.decode("utf-8", "replace"),
            }
        ).encode()


@dataclass
class PreparedBatch:
    """Accepted records of one partition, in arrival order, ready for the Redis buffer."""

    partition: int
    messages: list[Message] = field(default_factory=list)
    dedup_keys: list[bytes] = field(default_factory=list)
    fingerprints: list[bytes] = field(default_factory=list)
    ids: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.uint64))
    public: list[bytes] = field(default_factory=list)
    sensitive: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int64))
    draws: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int64))
    groups: list[bytes] = field(default_factory=list)
    perturbed: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self.messages)

    def subset(self, keep: list[int]) -> PreparedBatch:
        """The records at positions `keep`, in that order."""
        rows = np.asarray(keep, dtype=np.int64)

        def pick(values: list) -> list:
            return [values[i] for i in keep] if values else []

        def rows_of(array: np.ndarray) -> np.ndarray:
            return array[rows] if len(array) else array

        return PreparedBatch(
            partition=self.partition,
            messages=pick(self.messages),
            dedup_keys=pick(self.dedup_keys),
            fingerprints=pick(self.fingerprints),
            ids=rows_of(self.ids),
            public=pick(self.public),
            sensitive=rows_of(self.sensitive),
            draws=rows_of(self.draws),
            groups=pick(self.groups),
            perturbed=rows_of(self.perturbed),
        )

    def id_bytes(self) -> list[bytes]:
        """Each id as 32 hex digits: Redis keys and pool entries stay free of separators."""
        raw = self.ids.astype(">u8").tobytes().hex().encode()
        # Cut in C: hex digits hold no NUL, which a bytes dtype would strip.
        return np.frombuffer(raw, dtype="S32").tolist()


@dataclass(frozen=True)
class AcceptedRows:
    """The accepted records of one partition, in arrival order: their messages and codes in
    schema order, one row each."""

    messages: list[Message]
    codes: np.ndarray


class Preparer:
    """Validates and prepares raw messages for one stream's configuration."""

    def __init__(self, config: StreamConfig, key: ServiceKey) -> None:
        self.config = config
        self.key = key
        self.schema = config.schema
        attributes = self.schema.attributes
        # Keyed BLAKE2b states to copy: absorbing the key block once per stream instead of
        # once per record gives the same digests at half the cost.
        self._fingerprint_state = hashlib.blake2b(
            digest_size=8, key=key.subkey("dedup fingerprints")
        )
        self._digest_state = hashlib.blake2b(digest_size=4, key=key.subkey("dedup digests"))
        self._known_digests: dict[bytes, bytes] = {}
        self._public = [i for i, a in enumerate(attributes) if not a.sensitive]
        self._sensitive = [i for i, a in enumerate(attributes) if a.sensitive]
        # Decimal texts of codes (public codes, personal group keys), grown as needed.
        self._code_texts = np.empty(0, dtype=object)
        # '"name":"label"' per attribute and code: published records are joined from these,
        # looked up by the code's text as pool entries write it.
        self._fragments = [
            [published_member(a.name, label) for label in a.domain] for a in attributes
        ]
        self._fragment_of = [
            {b"%d" % code: fragment for code, fragment in enumerate(fragments)}
            for fragments in self._fragments
        ]
        # Pool entries list the public codes, then the sensitive ones: (schema position,
        # position in the entry) per attribute, in schema order.
        self._schema_order = sorted((i, k) for k, i in enumerate(self._public + self._sensitive))
        # As in every configured schema, public attributes first: then a published record
        # is a head of its public codes and a tail of its sensitive ones.
        self._public_first = self._public == list(range(len(self._public)))
        self._json_heads: dict[bytes, bytes] = {}
        self._json_tails: dict[bytes, bytes] = {}
        record_type = _record_type(self.schema.names)
        self._record_decoder = (
            msgspec.json.Decoder(record_type).decode if record_type is not None else None
        )
        fields = record_type.__struct_fields__ if record_type is not None else ()
        self._field_getters = [attrgetter(f) for f in fields]
        # Text -> code per attribute: the domain's labels, or the binned texts seen so far.
        self._known_codes = [
            dict(a._codes) if a.bins is None else {}  # type: ignore[attr-defined]
            for a in attributes
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

    def prepare(self, messages: Sequence[Message]) -> tuple[list[PreparedBatch], list[Rejected]]:
        """Split messages into per-partition batches of accepted records and rejections.

        Most records take a fast path, checked over the whole batch: one msgspec parse
        each, then a dictionary lookup per attribute and column. A record the fast path
        cannot vouch for goes through `_validate`, the exact reference, so the outcome and
        the reason of a rejection are the same either way.
        """
        rejected = []
        if not all(map(key_of, messages)):
            rejected = [
                Rejected(m, Rejection(f"{m.partition}/{m.offset}", None, NO_KEY))
                for m in messages
                if not m.key
            ]
            messages = [m for m in messages if m.key]
        n = len(messages)
        positions, fast = self._fast_rows(list(map(value_of, messages)))
        codes = np.empty((n, len(self.schema.attributes)), np.int64)
        codes[positions] = fast
        accepted = np.zeros(n, bool)
        accepted[positions] = True
        for position in np.flatnonzero(~accepted).tolist():
            message = messages[position]
            try:
                codes[position] = self._validate(message)
            except RecordError as err:
                rejected.append(Rejected(message, err.rejection))
            else:
                accepted[position] = True
        kept = np.flatnonzero(accepted)
        partitions = np.fromiter(map(partition_of, messages), np.int64, n)[kept]
        # Stable: each partition's records stay in arrival order.
        order = np.argsort(partitions, kind="stable")
        ends = np.flatnonzero(np.diff(partitions[order])) + 1
        batches = []
        for rows in np.split(kept[order], ends) if len(kept) else ():
            batch_messages = list(map(messages.__getitem__, rows.tolist()))
            batches.append(
                self._batch(batch_messages[0].partition, AcceptedRows(batch_messages, codes[rows]))
            )
        return batches, rejected

    def _fast_rows(self, values: list[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
        """The positions of the records the fast path vouches for, ascending, and their
        codes in schema order, one row each.

        Only flat objects that hold every attribute once, each a string or a number, are
        taken here, and only if written without escapes: msgspec and json do not read
        every escape alike (a lone surrogate). msgspec keeps the last of two equal keys,
        which `_validate` rejects, so the quotes are counted: without escapes each one opens
        or closes a string, and a record of n keys whose values hold s strings has
        2n + 2s quotes exactly when no key repeats (a repeat adds its key's two quotes, and
        the value it hides no fewer strings than none).
        """
        width = len(self.schema.attributes)
        positions, records, texts = self._parsed(values)
        if not records:
            return np.empty(0, np.int64), np.empty((0, width), np.int64)
        columns = []
        strings_only = True
        for attribute, known, field_of in zip(
            self.schema.attributes, self._known_codes, self._field_getters, strict=True
        ):
            # A column at a time, through no per-record container: those would wake the
            # garbage collector every few hundred records.
            raw = list(map(field_of, records))
            column = list(map(known.get, raw, repeat(-1)))
            if -1 in column:
                for j in [j for j, code in enumerate(column) if code < 0]:
                    value = raw[j]
                    if type(value) is not str:
                        strings_only = False
                    try:
                        column[j] = attribute.code_of(value)
                    except ValueError:
                        continue
                    if type(value) is str and len(known) < KNOWN_BIN_VALUES:
                        known[value] = column[j]
            columns.append(column)
        codes = np.array(columns, dtype=np.int64).T
        valid = (codes >= 0).all(axis=1)
        # A record whose values are all strings has at least 4n quotes, so when every value
        # is a string, a batch total of 4n per record says that no record repeats a key.
        if not (strings_only and b"".join(texts).count(b'"') == 4 * width * len(records)):
            for j, (record, text) in enumerate(zip(records, texts, strict=True)):
                strings = sum(type(v) is str for v in astuple(record))
                if text.count(b'"') != 2 * width + 2 * strings:
                    valid[j] = False
        return np.asarray(positions, np.int64)[valid], codes[valid]

    def _parsed(self, values: list[bytes | None]) -> tuple[list[int], list, list[bytes]]:
        """The values msgspec reads as records of the schema's attributes (none longer than
        MAX_MESSAGE_BYTES or holding a backslash): their positions, records and texts."""
        decode = self._record_decoder
        if decode is None:
            return [], [], []
        # One pass over the whole batch when every record parses, as almost all do.
        texts = [value for value in values if value]
        if (
            len(texts) == len(values)
            and b"\\" not in b"".join(texts)
            and max(map(len, texts), default=0) <= MAX_MESSAGE_BYTES
        ):
            try:
                return list(range(len(texts))), list(map(decode, texts)), texts
            except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
                pass
        positions, records, texts = [], [], []
        for position, value in enumerate(values):
            if value and len(value) <= MAX_MESSAGE_BYTES and b"\\" not in value:
                try:
                    records.append(decode(value))
                except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
                    continue
                positions.append(position)
                texts.append(value)
        return positions, records, texts

    def _validate(self, message: Message) -> list[int]:
        where = f"{message.partition}/{message.offset}"

        def reject(reason: str) -> RecordError:
            return RecordError(Rejection(where, None, reason))

        value = message.value
        if not value:
            raise reject("empty message")
        if len(value) > MAX_MESSAGE_BYTES:
            raise reject(f"message of {len(value):,} bytes exceeds {MAX_MESSAGE_BYTES:,}")
        try:
            record = json.loads(value.decode("utf-8"), object_pairs_hook=_unique_keys)
        except UnicodeDecodeError:
            raise reject("not valid UTF-8") from None
        except json.JSONDecodeError as err:
            raise reject(f"not valid JSON: {err.msg}") from None
        except RecursionError:
            raise reject("not valid JSON: nested too deeply") from None
        except _DuplicateKeyError:
            # Not named: a nested object's key may be part of a sensitive value.
            raise reject("an object has the same key twice") from None
        except ValueError:  # int() refuses longer numbers, and an exception here ends the worker
            raise reject(
                f"a number has more than {sys.get_int_max_str_digits():,} digits"
            ) from None
        return self.schema.encode_record(record, where)

    def identify(self, partition: int, messages: list[Message], codes: np.ndarray) -> PreparedBatch:
        """A batch of validated records (`codes` in schema order) with their dedup keys, ids
        and fingerprints, and no randomization inputs yet."""
        dedup_keys = list(map(b"k:".__add__, map(key_of, messages)))
        named_copy = self._fingerprint_state.copy
        named_digests = []
        for dedup in dedup_keys:
            named = named_copy()
            named.update(dedup)
            named_digests.append(named.digest())
        rows = np.ascontiguousarray(codes)
        contents = rows.view(np.dtype((np.void, rows.itemsize * rows.shape[1]))).ravel()
        fingerprints = list(map(bytes.__add__, named_digests, self._content_digests(contents)))
        return PreparedBatch(
            partition=partition,
            messages=messages,
            dedup_keys=dedup_keys,
            fingerprints=fingerprints,
            ids=ids_for(self.key, dedup_keys),
            public=self._joined(rows[:, self._public], b","),
            sensitive=codes[:, self._sensitive],
        )

    def _content_digests(self, contents: np.ndarray) -> list[bytes]:
        """The keyed digest of each validated record (its codes' bytes), remembered for the
        records seen before: a stream's records repeat a few thousand combinations of values.

        The digest is of the validated record, so a resend formatted differently is still
        the same; keyed, because it stays in Redis after publication and an unkeyed hash
        of a few thousand possible records would give the record back.
        """
        texts = contents.tolist()
        known = self._known_digests
        digests = list(map(known.get, texts))
        if None in digests:
            digest_copy = self._digest_state.copy
            for j in [j for j, digest in enumerate(digests) if digest is None]:
                digest = digest_copy()
                digest.update(texts[j])
                digests[j] = digest.digest()
                if len(known) < KNOWN_CONTENT_DIGESTS:
                    known[texts[j]] = digests[j]
        return digests

    def _joined(self, codes: np.ndarray, separator: bytes) -> list[bytes]:
        """Each row of (non-negative) codes as decimal texts joined by `separator`."""
        if codes.shape[1] == 0:
            return [b""] * len(codes)
        size = int(codes.max(initial=0)) + 1
        if size > len(self._code_texts):
            self._code_texts = np.array([b"%d" % c for c in range(size)], dtype=object)
        texts = self._code_texts
        return list(map(separator.join, zip(*(texts[c].tolist() for c in codes.T), strict=True)))

    def _batch(self, partition: int, rows: AcceptedRows) -> PreparedBatch:
        codes = rows.codes
        batch = self.identify(partition, rows.messages, codes)
        ids = batch.ids
        names = [a.name for a in self.schema.sensitive]
        if self.config.decoy is not None:
            batch.draws = np.column_stack(
                [self._decoy.draws(ids, self.key, name) for name in names]
            ).reshape(len(codes), len(names))
        else:
            table = Table(
                self.schema,
                {
                    a.name: codes[:, i].astype(np.int32)
                    for i, a in enumerate(self.schema.attributes)
                },
            )
            keys, _, _ = self._personal.group_keys(table)
            batch.groups = self._joined(keys, b".")
            batch.perturbed = self._perturbation.perturb(
                codes[:, self._sensitive[0]], ids, self.key, names[0]
            )
        return batch

    def codes_of(self, member: bytes) -> list[int]:
        """A pool entry's codes in schema order.

        Only an entry's first two fields are ever published (`service.core.wire`).
        """
        public_text, sensitive_text = shown_fields(member)
        public = iter(public_text.split(b",") if public_text else ())
        sensitive = iter(sensitive_text.split(b","))
        return [int(next(sensitive if a.sensitive else public)) for a in self.schema.attributes]

    def decode(self, member: bytes) -> dict[str, str]:
        """A pool entry as the published record: attribute → label."""
        return {
            a.name: a.domain[code]
            for a, code in zip(self.schema.attributes, self.codes_of(member), strict=True)
        }

    def published_json(self, member: bytes) -> bytes:
        """`decode` as JSON bytes, from fragments encoded once per attribute value.

        The text of an entry's public codes and that of its sensitive codes each give their
        part of the JSON text (`service.core.wire.published_record`), remembered from
        entries published before.
        """
        public_text, sensitive_text = shown_fields(member)
        head = self._json_heads.get(public_text)
        tail = self._json_tails.get(sensitive_text)
        if head is not None and tail is not None:
            return head + tail
        return self._uncached_json(member, public_text, sensitive_text)

    def _uncached_json(self, member: bytes, public_text: bytes, sensitive_text: bytes) -> bytes:
        """`published_json` from each code's text, as pool entries write it; an entry
        written any other way (never, by the buffer's scripts) goes through `codes_of`."""
        public = public_text.split(b",") if public_text else []
        sensitive = sensitive_text.split(b",")
        if len(public) == len(self._public) and len(sensitive) == len(self._sensitive):
            texts = public + sensitive
            try:
                fragments = [self._fragment_of[i][texts[k]] for i, k in self._schema_order]
            except KeyError:
                pass
            else:
                if not self._public_first:
                    return b"{%s}" % b",".join(fragments)
                # The JSON text is a head of the public codes and a tail of the sensitive.
                head = b"{" + b"".join(f + b"," for f in fragments[: len(public)])
                tail = b",".join(fragments[len(public) :]) + b"}"
                if len(self._json_heads) < KNOWN_ENTRY_TEXTS:
                    self._json_heads[public_text] = head
                if len(self._json_tails) < KNOWN_ENTRY_TEXTS:
                    self._json_tails[sensitive_text] = tail
                return head + tail
        fragments = self._fragments
        return b"{%s}" % b",".join(
            fragments[i][code] for i, code in enumerate(self.codes_of(member))
        )


def _record_type(names: list[str]) -> type[msgspec.Struct] | None:
    """A msgspec type of JSON objects that hold exactly the attributes `names`, each a string
    or a number, or None if a name needs an escape in JSON: such records are never fast."""
    if any(ch in '"\\' or ch < " " for name in names for ch in name):
        return None
    fields = [f"a{i}" for i in range(len(names))]
    return msgspec.defstruct(
        "Record",
        [(f, str | int | float) for f in fields],
        rename=dict(zip(fields, names, strict=True)),
        forbid_unknown_fields=True,
        # Strings and numbers only: nothing for the garbage collector to follow.
        gc=False,
    )
