"""Raw stream messages to buffer-ready records (SPEC §3), without I/O.

A raw message is a JSON object of attribute values; its Kafka key, if any, is
the producer's record id. Each accepted record gets:

- a *dedup key*: ``k:<producer id>``, else ``o:<offset>`` (per raw partition), so
  a redelivered record is recognised and stored once, at any age;
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

import contextlib
import hashlib
import json
import sys
from dataclasses import dataclass, field

import msgspec
import numpy as np

from service.config import StreamConfig
from service.mechanisms.decoy import DecoyGroups
from service.mechanisms.personal import PersonalGroups, UniformPerturbation
from service.prf import ServiceKey, ids_for
from service.schema import RecordError, Rejection
from service.table import Table

MAX_MESSAGE_BYTES = 64 * 1024
# Binned values (their text) remembered with their code, per attribute: ages and the like.
KNOWN_BIN_VALUES = 10_000


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are all different: with a key twice it means two things."""
    record = dict(pairs)
    if len(record) != len(pairs):
        raise _DuplicateKeyError
    return record


@dataclass(frozen=True)
class RawMessage:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Rejected:
    message: RawMessage
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
    messages: list[RawMessage] = field(default_factory=list)
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

    def id_bytes(self) -> list[bytes]:
        """Each id as 32 hex digits: Redis keys and pool entries stay free of separators."""
        raw = self.ids.astype(">u8").tobytes().hex().encode()
        return [raw[32 * i : 32 * i + 32] for i in range(len(self.ids))]


class Preparer:
    """Validates and prepares raw messages for one stream's configuration."""

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
        codes = self._fast_codes([m.value for m in messages])
        accepted: dict[int, list[tuple[RawMessage, list[int]]]] = {}
        rejected = []
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

    def _validate(self, message: RawMessage) -> list[int]:
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

    def identify(
        self, partition: int, messages: list[RawMessage], codes: np.ndarray
    ) -> PreparedBatch:
        """A batch of validated records (`codes` in schema order) with their dedup keys, ids
        and fingerprints, and no randomization inputs yet."""
        dedup_keys = [b"k:" + m.key if m.key else b"o:%d" % m.offset for m in messages]
        # A personal stream stores a record in the partition of its group
        # (`service.buffer.StreamBuffer.grouped_messages`), where records of every raw
        # partition meet: there a fingerprint names the raw partition too, as the id does,
        # or "o:<offset>" of two raw partitions would pass for one record.
        named = (
            [b"%d:" % partition + d for d in dedup_keys]
            if self.config.personal is not None
            else dedup_keys
        )
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
                for dedup, row in zip(named, codes, strict=True)
            ],
            ids=ids_for(self.key, [b"%d:" % partition + d for d in dedup_keys]),
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

    def codes_of(self, member: bytes) -> list[int]:
        """A pool entry's codes in schema order.

        Entries are "public codes|published sensitive codes|audit|true sensitive
        codes|arrival|id" (`service.buffer.PoolEntry`); only the first two fields are ever
        published.
        """
        public_text, sensitive_text, _ = member.split(b"|", 2)
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
        """`decode` as JSON bytes, from fragments encoded once per attribute value."""
        fragments = self._fragments
        return b"{%s}" % b",".join(
            fragments[i][code] for i, code in enumerate(self.codes_of(member))
        )
