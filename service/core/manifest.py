"""A stream's public manifest and answers from its published records alone (issue 17).

A downstream team that can read ``<stream>.manifest`` and ``<stream>.published`` needs no
config file, no key and no Redis to debias the stream: the manifest says how the records
were randomized, and `Publication` answers count queries from the records exactly as the
stream's consumer answers ``/estimate``. Reading the two topics is `streams.tools.reader`; this
module is the pure part, for teams that read Kafka with their own tools::

    manifest = Manifest.from_json(value_of_the_manifest_record)
    publication = Publication.from_records(manifest, (key, value) for each published record)
    answers = publication.answer([{"where": {"sex": "Female"}, "value": {"occupation": "Sales"}}])
    pandas.DataFrame(answers)          # estimate, low, high, published, rows per query

The manifest holds only what the papers publish with the data: the mechanism and its
parameters (γ and the grouping rule; p, λ, δ and the budget mode; a windowed mechanism's
options), the schema's domains and bins, the personal merge map, a layout version and a
digest. Never the key, a seed, an id, or anything a mechanism derives from the records
(SDR's sub-table parameters and Anatomy's or F′-privacy's sensitive tables travel per
window on the published topic, as the seeds publish them). Every worker derives it from its
config alone, so workers of one stream write byte-identical manifests with one digest.

A stream's manifest never changes: a worker whose config yields another manifest refuses
to start (`streams.runtime.manifest`), so one manifest debiases every record of the topic.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from service.core.config import WINDOWED, StreamConfig
from service.core.mechanism_settings import WindowedSettings
from service.core.mechanisms.registry import MECHANISMS, Evidence, checked_settings
from service.core.merge import ValueMap
from service.core.publication import PublicationError, shown_option, spelled
from service.core.published import PublishedRecordError, PublishedWindows, WindowCodec
from service.core.reconstruct import Answers, PublishedCells, Reconstruction, answer_queries
from service.core.schema import Attribute, Schema, SchemaError

# The manifest's layout; a reader refuses layouts it does not know.
VERSION = 1
# Kafka settings of the manifest topic: one partition (one order of records) and compaction,
# so the topic keeps the manifest for the life of the stream, whatever its retention.
MANIFEST_PARTITIONS = 1
MANIFEST_CONFIG = {"cleanup.policy": "compact"}
# The Kafka key of the manifest record: compaction keeps the latest record per key, and every
# record of a stream's manifest topic holds the same manifest.
MANIFEST_KEY = b"manifest"


class ManifestError(ValueError):
    """A manifest that cannot be read, or a publication it cannot answer."""


def manifest_topic(stream: str) -> str:
    """The topic holding a stream's manifest."""
    return f"{stream}.manifest"


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _attributes(attributes: Iterable[Attribute]) -> list[dict[str, Any]]:
    # A list, not an object: the schema's order decides the published columns' order.
    out = []
    for attribute in attributes:
        entry: dict[str, Any] = {"name": attribute.name, "domain": list(attribute.domain)}
        if attribute.bins is not None:
            entry["bins"] = list(attribute.bins)
        out.append(entry)
    return out


def _parameters(config: StreamConfig) -> dict[str, Any]:
    if config.windowed is not None:
        options = {name: shown_option(v) for name, v in config.windowed.options.items()}
        return {"mechanism": config.windowed.mechanism, "options": options}
    options = config.options()
    return {spelled(option): options[option] for option in config.spec.manifest}


def _merge_map(config: StreamConfig) -> dict[str, Any] | None:
    """The personal merge map over the published public attributes, its classes in order
    (their order numbers the groups, which the interval sums over)."""
    if config.personal is None:
        return None
    value_map = config.personal.value_map
    public = {a.name for a in config.schema.public}
    classes = {n: [list(c) for c in cs] for n, cs in value_map.classes.items() if n in public}
    return {"alpha": value_map.alpha, "classes": classes}


@dataclass(frozen=True)
class Manifest:
    """What a stream publishes about itself (see the module docstring); `document` holds
    every field but the digest, which is the SHA-256 of its canonical JSON."""

    document: Mapping[str, Any]

    @classmethod
    def of_config(cls, config: StreamConfig) -> Manifest:
        """The manifest a stream's config yields: the same config, the same bytes."""
        return cls(
            {
                "version": VERSION,
                "stream": config.name,
                "published": config.topics["published"],
                "mechanism": config.mechanism,
                "parameters": _parameters(config),
                "schema": {
                    "public": _attributes(config.schema.public),
                    "sensitive": _attributes(config.schema.sensitive),
                },
                "merge_map": _merge_map(config),
            }
        )

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(_canonical(self.document)).hexdigest()

    def to_json(self) -> bytes:
        return _canonical({**self.document, "digest": self.digest})

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """A manifest record's value, checked: a known layout and a digest that matches."""
        try:
            document = json.loads(data)
        except (ValueError, UnicodeDecodeError) as err:
            raise ManifestError(f"the manifest is not valid JSON ({err})") from None
        if not isinstance(document, dict):
            raise ManifestError("the manifest is not a JSON object")
        if document.get("version") != VERSION:
            raise ManifestError(
                f"manifest version {document.get('version')!r}: this reader knows version "
                f"{VERSION}; upgrade splu"
            )
        digest = document.pop("digest", None)
        manifest = cls(document)
        if digest != manifest.digest:
            raise ManifestError("the manifest's digest does not match its content")
        try:
            manifest.schema()
        except (KeyError, TypeError, AttributeError, SchemaError) as err:
            raise ManifestError(f"the manifest's schema is unusable ({err})") from None
        return manifest

    @property
    def mechanism(self) -> str:
        return str(self.document["mechanism"])

    @property
    def parameters(self) -> Mapping[str, Any]:
        return self.document["parameters"]

    @property
    def published_topic(self) -> str:
        return str(self.document["published"])

    def schema(self) -> Schema:
        attributes = []
        for kind in ("public", "sensitive"):
            for entry in self.document["schema"][kind]:
                sensitive = kind == "sensitive"
                if "bins" in entry:
                    attribute = Attribute(entry["name"], sensitive, (), tuple(entry["bins"]))
                    if list(attribute.domain) != entry["domain"]:
                        raise SchemaError(f"{entry['name']}: the domain does not match the bins")
                else:
                    attribute = Attribute(entry["name"], sensitive, tuple(entry["domain"]))
                attributes.append(attribute)
        return Schema(tuple(attributes))

    def windowed_settings(self) -> WindowedSettings | None:
        """A windowed stream's mechanism and options (None for decoy and personal streams).
        Its window sizes and waits are operational, so not in the manifest: reading does
        not use them, and they are 0 here."""
        if self.mechanism != WINDOWED:
            return None
        mechanism = self.parameters["mechanism"]
        try:
            options = checked_settings(mechanism, dict(self.parameters["options"]))
        except PublicationError as err:
            raise ManifestError(
                f"the manifest's {mechanism} options are unusable ({err})"
            ) from None
        return WindowedSettings(mechanism, 0, 0.0, 0, options)

    def tally(self) -> Tally | WindowTally:
        """An empty count of this stream's published records, to `add` them to."""
        settings = self.windowed_settings()
        return Tally(self.schema()) if settings is None else WindowTally(self.schema(), settings)

    def changes(self, other: Manifest) -> list[str]:
        """What differs from `other`, one line per field: "parameters.gamma: 5 → 6"."""
        mine, theirs = _flat(self.document), _flat(other.document)
        changed = [
            f"{path}: {_shown(mine.get(path))} → {_shown(theirs.get(path))}"
            for path in sorted(mine.keys() | theirs.keys())
            if mine.get(path) != theirs.get(path)
        ]
        if not changed and self.digest != other.digest:
            # Attributes are compared by name above; only their order is left.
            return ["schema: the order of the attributes"]
        return changed

    def reconstruction(self, cells: PublishedCells, confidence: float = 0.95) -> Reconstruction:
        """The reconstruction the stream's consumer builds over the same cells (decoy and
        personal streams; a windowed one's is `WindowTally.estimator`)."""
        spec = MECHANISMS.get(self.mechanism)
        if spec is None or spec.reconstruct is None:
            raise ManifestError(
                f"stream {self.document['stream']!r} runs {self.parameters['mechanism']} on "
                "windows: its answers need its side messages too (`WindowTally`)"
            )
        given = {option: self.parameters[spelled(option)] for option in spec.manifest}
        options = {**spec.defaults, **given, **spec.stream_options}
        sensitive = self.schema().sensitive
        merge = self.document["merge_map"]
        if merge is not None:
            classes = {
                name: tuple(tuple(members) for members in groups)
                for name, groups in merge["classes"].items()
            }
            attribute = sensitive[0]
            options["value_map"] = ValueMap(
                attribute.name, attribute.domain, merge["alpha"], classes
            )
        evidence = Evidence(
            options, [a.name for a in sensitive], cells, {a.name: a.domain for a in sensitive},
            confidence,
        )  # fmt: skip
        return cast(Reconstruction, spec.reconstruct(evidence))


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    """Leaves of a JSON document by dotted path; attributes by name, not position."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{path}.{key}" if path else str(key)))
        return out
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, Mapping) and "name" in v for v in value)
    ):
        return _flat({v["name"]: {k: x for k, x in v.items() if k != "name"} for v in value}, path)
    return {path: value}


def _shown(value: Any) -> str:
    if value is None:
        return "(none)"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


class Tally:
    """Published records counted into cells once per token, by the consumer's rules: a
    message without a token, or whose value the schema cannot read, is `invalid` and not
    counted; a token seen before is a re-sent copy, counted in `duplicates` only."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self._codes = {a.name: {v: i for i, v in enumerate(a.domain)} for a in schema.attributes}
        self._tokens: set[bytes] = set()
        # Workers write a cell's records byte for byte alike: each value is parsed once.
        self._known: dict[bytes, tuple[int, ...] | None] = {}
        self._counts: dict[tuple[int, ...], int] = {}
        self.duplicates = 0
        self.invalid = 0

    def add(self, token: bytes | None, value: bytes) -> None:
        if value not in self._known:
            self._known[value] = self._parse(value)
        row = self._known[value]
        if not token or row is None:
            self.invalid += 1
        elif token in self._tokens:
            self.duplicates += 1
        else:
            self._tokens.add(token)
            self._counts[row] = self._counts.get(row, 0) + 1

    def _parse(self, value: bytes) -> tuple[int, ...] | None:
        """A value's codes in schema order, or None unless it holds exactly the schema's
        attributes with labels of their domains (`service.core.published.CellCodec`)."""
        try:
            record = json.loads(value)
            row = tuple(self._codes[name][record[name]] for name in self.schema.names)
        except (ValueError, KeyError, TypeError):
            return None
        return row if len(record) == len(row) else None

    def cells(self) -> PublishedCells:
        names = self.schema.names
        rows = np.array(list(self._counts), dtype=np.int32).reshape(len(self._counts), len(names))
        counts = np.fromiter(self._counts.values(), dtype=np.int64, count=len(self._counts))
        domains = {a.name: a.domain for a in self.schema.attributes}
        return PublishedCells(names, domains, rows, counts)


class WindowTally:
    """A windowed stream's published messages, rows and side messages alike, counted once
    per token by its consumer's rules (`service.core.published.WindowCodec`): an unreadable
    message or one without a token is `invalid`, a token seen before a re-sent copy."""

    def __init__(self, schema: Schema, settings: WindowedSettings) -> None:
        self.schema, self.settings = schema, settings
        self._codec = WindowCodec(schema, settings)
        self._tokens: set[bytes] = set()
        self._cells: dict[bytes, int] = {}
        self.duplicates = 0
        self.invalid = 0

    def add(self, token: bytes | None, value: bytes) -> None:
        try:
            cell = self._codec.key_of(value)
        except PublishedRecordError:
            self.invalid += 1
            return
        if not token:
            self.invalid += 1
        elif token in self._tokens:
            self.duplicates += 1
        else:
            self._tokens.add(token)
            self._cells[cell] = self._cells.get(cell, 0) + 1

    def windows(self) -> PublishedWindows:
        """The units (sub-tables, groups, buckets) counted whole, as the consumer keeps them."""
        return PublishedWindows.from_tally(self.schema, self.settings, self._cells)


class Publication:
    """A stream's published records, counted once per token (`Tally`, or `WindowTally` for
    a windowed stream), and the estimator over them: its answers equal the stream
    consumer's ``/estimate``. `records` is the rows the answers include (for a windowed
    stream, of the units counted whole; `held` the others)."""

    def __init__(
        self, manifest: Manifest, tally: Tally | WindowTally, confidence: float = 0.95
    ) -> None:
        self.manifest = manifest
        self.duplicates = tally.duplicates
        self.invalid = tally.invalid
        # A windowed stream's values outside their domain are errors, as on its consumer.
        self.windowed = isinstance(tally, WindowTally)
        self.domains = {a.name: frozenset(a.domain) for a in manifest.schema().sensitive}
        self.reconstruction: Answers | None
        if isinstance(tally, WindowTally):
            windows = tally.windows()
            self.records, self.held = windows.rows, windows.held
            self.reconstruction = windows.estimator(confidence) if self.records else None
        else:
            cells = tally.cells()
            self.records, self.held = cells.total, 0
            self.reconstruction = (
                manifest.reconstruction(cells, confidence) if cells.total else None
            )

    @classmethod
    def from_records(
        cls,
        manifest: Manifest,
        records: Iterable[tuple[bytes | None, bytes]],
        confidence: float = 0.95,
    ) -> Publication:
        """From (Kafka key, value) pairs of the published topic, in any order."""
        tally = manifest.tally()
        for token, value in records:
            tally.add(token, value)
        return cls(manifest, tally, confidence)

    def answer(self, queries: Iterable[object]) -> list[dict[str, Any]]:
        """Each query object ({"where": {...}, "value": {...}}, as `splu query` reads) with
        "estimate", the interval "low"/"high" where defined, the "published" count and the
        predicate's "rows"; a query that cannot be answered gets an "error" instead."""
        domains = self.domains if self.windowed else None
        unanswered = "no published records have been counted yet"
        return answer_queries(self.reconstruction, queries, domains, unanswered)[0]
