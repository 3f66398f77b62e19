"""Stream schema: public and sensitive attributes over finite domains (SPEC §1).

Public (non-sensitive) values are published verbatim; numeric attributes may
be binned first, and the bin label is what gets published (and, for a
sensitive attribute, what gets randomized).
Sensitive values are the only thing a mechanism randomizes. Every value is
encoded as an integer code into its attribute's domain, so mechanisms and
reconstruction work on integer arrays.

A schema is written in TOML under a ``[schema]`` table::

    [schema.public]
    age = { bins = [17, 25, 35, 45, 55, 65, 91] }
    sex = { domain = ["Female", "Male"] }

    [schema.sensitive]
    occupation = { domain = ["Adm-clerical", "Armed-Forces", "..."] }

or built by scanning a CSV for the columns named by ``--quasi``/``--sensitive``.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w


class SchemaError(ValueError):
    """The schema itself is unusable (bad config, unknown column, empty domain)."""


@dataclass(frozen=True)
class Rejection:
    """Why one input record was not accepted. Never carries a raw sensitive value."""

    record: int | str
    field: str | None
    reason: str

    def __str__(self) -> str:
        where = f"record {self.record}"
        if self.field is not None:
            where += f", field {self.field!r}"
        return f"{where}: {self.reason}"


class RecordError(ValueError):
    def __init__(self, rejection: Rejection) -> None:
        super().__init__(str(rejection))
        self.rejection = rejection


def read_toml(path: Path, error: type[SchemaError] = SchemaError) -> dict[str, Any]:
    """A TOML file as a dict, or `error` naming the file and what is wrong with it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid TOML: {err}") from None


def _number_text(x: float) -> str:
    return f"{x:g}"


def bin_labels(edges: Sequence[float]) -> tuple[str, ...]:
    """Labels of the half-open bins [e0,e1), [e1,e2), ... as published."""
    return tuple(f"[{_number_text(lo)},{_number_text(hi)})" for lo, hi in itertools.pairwise(edges))


def _has_undecodable_bytes(text: str) -> bool:
    # Files are read with errors="surrogateescape": bad UTF-8 bytes become lone surrogates.
    return any("\udc80" <= ch <= "\udcff" for ch in text)


@dataclass(frozen=True)
class Attribute:
    """One column: its finite domain, whether it is sensitive, optional numeric bins."""

    name: str
    sensitive: bool
    domain: tuple[str, ...]
    bins: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        kind = "sensitive" if self.sensitive else "public"
        if self.bins is not None:
            if len(self.bins) < 2 or any(
                not math.isfinite(lo) or lo >= hi
                for lo, hi in zip(self.bins, self.bins[1:], strict=False)
            ):
                raise SchemaError(
                    f"bins of {self.name!r} must be at least two finite, increasing edges"
                )
            object.__setattr__(self, "domain", bin_labels(self.bins))
        if not self.domain:
            raise SchemaError(f"{kind} attribute {self.name!r} has an empty domain")
        # Before the set below: a list or table in a TOML domain is unhashable.
        if any(not isinstance(v, str) or v == "" for v in self.domain):
            raise SchemaError(f"domain of {self.name!r} must be non-empty strings")
        if len(set(self.domain)) != len(self.domain):
            raise SchemaError(f"{kind} attribute {self.name!r} lists a value twice in its domain")
        object.__setattr__(self, "_codes", {v: i for i, v in enumerate(self.domain)})

    @property
    def size(self) -> int:
        return len(self.domain)

    def code_of(self, raw: object) -> int:
        """Code of one raw value; raises ValueError with a reason that is safe to log."""
        if raw is None or raw == "":
            raise ValueError("missing value")
        if self.bins is not None:
            return self._bin_code(raw)
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise ValueError(f"expected a string, got {type(raw).__name__}")
        text = str(raw)
        code = self._codes.get(text)  # type: ignore[attr-defined]
        if code is None:
            raise ValueError(self.outside_domain_reason(text))
        return code

    def outside_domain_reason(self, text: str) -> str:
        if _has_undecodable_bytes(text):
            return "value is not valid UTF-8"
        if self.sensitive:
            # The raw value is sensitive data: name the attribute, never echo the value.
            return "value is outside the attribute's domain"
        shown = text if len(text) <= 40 else text[:37] + "..."
        return f"value {shown!r} is outside the domain ({self.size} values)"

    def _bin_code(self, raw: object) -> int:
        if isinstance(raw, bool):
            raise ValueError("expected a number, got bool")
        if isinstance(raw, str) and not (raw.isascii() and "_" not in raw):
            # float() also reads "2_5", "２５" and other digits; a number is written in ASCII.
            raise ValueError("expected a number")
        try:
            x = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError("expected a number") from None
        except OverflowError:  # an integer beyond any float: outside every bin
            x = math.inf if raw > 0 else -math.inf  # type: ignore[operator]
        assert self.bins is not None
        if not (self.bins[0] <= x < self.bins[-1]):
            shown = "value" if self.sensitive else f"value {_number_text(x)}"
            raise ValueError(
                f"{shown} is outside the bins "
                f"[{_number_text(self.bins[0])}, {_number_text(self.bins[-1])})"
            )
        return bisect_right(self.bins, x) - 1

    def codes_of(self, column: Sequence[str]) -> list[int]:
        """Codes for a column of raw strings, -1 where a value is not accepted."""
        if self.bins is None:
            lookup = self._codes.get  # type: ignore[attr-defined]
            return [lookup(v, -1) for v in column]
        out = []
        for v in column:
            try:
                out.append(self._bin_code(v))
            except ValueError:
                out.append(-1)
        return out

    def to_mapping(self) -> dict[str, Any]:
        if self.bins is not None:
            return {"bins": list(self.bins)}
        return {"domain": list(self.domain)}


@dataclass(frozen=True)
class Schema:
    """The attributes of a stream, public ones first, in a fixed order."""

    attributes: tuple[Attribute, ...]

    def __post_init__(self) -> None:
        names = [a.name for a in self.attributes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SchemaError(f"attribute {twice[0]!r} is declared twice (public and sensitive?)")
        if not any(a.sensitive for a in self.attributes):
            raise SchemaError("a schema needs at least one sensitive attribute")
        object.__setattr__(self, "_by_name", {a.name: a for a in self.attributes})

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.attributes]

    @property
    def public(self) -> list[Attribute]:
        return [a for a in self.attributes if not a.sensitive]

    @property
    def sensitive(self) -> list[Attribute]:
        return [a for a in self.attributes if a.sensitive]

    def __getitem__(self, name: str) -> Attribute:
        try:
            return self._by_name[name]  # type: ignore[attr-defined]
        except KeyError:
            raise SchemaError(
                f"unknown attribute {name!r}; the schema has {', '.join(self.names)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name  # type: ignore[attr-defined]

    def encode_record(self, record: Mapping[str, object], record_id: int | str) -> list[int]:
        """Codes of a whole record, in schema order; raises RecordError naming the field."""
        if not isinstance(record, Mapping):
            raise RecordError(Rejection(record_id, None, "a record must be an object"))
        for name in record:
            if name not in self:
                raise RecordError(Rejection(record_id, str(name), "unknown attribute"))
        codes = []
        for attribute in self.attributes:
            try:
                codes.append(attribute.code_of(record.get(attribute.name)))
            except ValueError as err:
                raise RecordError(Rejection(record_id, attribute.name, str(err))) from None
        return codes

    def to_mapping(self) -> dict[str, Any]:
        return {
            "public": {a.name: a.to_mapping() for a in self.public},
            "sensitive": {a.name: a.to_mapping() for a in self.sensitive},
        }

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], source: str = "schema") -> Schema:
        """Build from a parsed ``[schema]`` table, with errors naming the offending key."""
        if not isinstance(table, Mapping):
            raise SchemaError(f"{source}: [schema] must be a table")
        unknown = set(table) - {"public", "sensitive"}
        if unknown:
            raise SchemaError(
                f"{source}: unknown key schema.{sorted(unknown)[0]}; use public and sensitive"
            )
        attributes = []
        for kind in ("public", "sensitive"):
            section = table.get(kind, {})
            if not isinstance(section, Mapping):
                raise SchemaError(f"{source}: schema.{kind} must be a table of attributes")
            for name, spec in section.items():
                attributes.append(_attribute_from_spec(name, spec, kind, source))
        try:
            return cls(tuple(attributes))
        except SchemaError as err:
            raise SchemaError(f"{source}: schema: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        path = Path(path)
        document = read_toml(path)
        if "schema" not in document:
            raise SchemaError(f"{path}: no [schema] table")
        return cls.from_mapping(document["schema"], source=str(path))

    def to_toml(self) -> str:
        return tomli_w.dumps({"schema": self.to_mapping()})

    @classmethod
    def scan(
        cls,
        header: Sequence[str],
        rows: Iterable[Sequence[str]],
        quasi: Sequence[str],
        sensitive: Sequence[str],
        bins: Mapping[str, float | Sequence[float]] | None = None,
    ) -> Schema:
        """Domains from the values seen in `rows` (lists aligned with `header`).

        A ``bins`` entry is either a list of edges or a single bin width, in which
        case edges covering the observed range are chosen at multiples of it.
        Empty and undecodable values are not taken into domains; the rows that
        hold them are rejected later, when the table is encoded.
        """
        bins = dict(bins or {})
        columns = list(quasi) + list(sensitive)
        _check_columns(header, quasi, sensitive, bins)
        index = [header.index(c) for c in columns]
        seen: list[set[str]] = [set() for _ in columns]
        for row in rows:
            if len(row) != len(header):
                continue
            for position, i in enumerate(index):
                seen[position].add(row[i])
        return cls._from_seen(columns, seen, sensitive, bins)

    @classmethod
    def scan_values(
        cls,
        header: Sequence[str],
        values: Sequence[Iterable[str]],
        quasi: Sequence[str],
        sensitive: Sequence[str],
        bins: Mapping[str, float | Sequence[float]] | None = None,
    ) -> Schema:
        """Like `scan`, from the distinct values of each header column (a columnar reader's)."""
        bins = dict(bins or {})
        columns = list(quasi) + list(sensitive)
        _check_columns(header, quasi, sensitive, bins)
        seen = [set(values[header.index(c)]) for c in columns]
        return cls._from_seen(columns, seen, sensitive, bins)

    @classmethod
    def _from_seen(
        cls,
        columns: Sequence[str],
        seen: Sequence[set[str]],
        sensitive: Sequence[str],
        bins: Mapping[str, float | Sequence[float]],
    ) -> Schema:
        attributes = []
        for position, name in enumerate(columns):
            values = {v for v in seen[position] if v != "" and not _has_undecodable_bytes(v)}
            is_sensitive = name in sensitive
            if name in bins:
                attributes.append(
                    Attribute(name, is_sensitive, (), _bin_edges(name, bins[name], values))
                )
            else:
                attributes.append(Attribute(name, is_sensitive, tuple(sorted(values))))
        return cls(tuple(attributes))


def _check_columns(
    header: Sequence[str],
    quasi: Sequence[str],
    sensitive: Sequence[str],
    bins: Mapping[str, object],
) -> None:
    if not sensitive:
        raise SchemaError("name at least one sensitive column (--sensitive)")
    for name in list(quasi) + list(sensitive):
        if name not in header:
            raise SchemaError(f"unknown column {name!r}; the input has {', '.join(header)}")
    overlap = set(quasi) & set(sensitive)
    if overlap:
        raise SchemaError(f"column {sorted(overlap)[0]!r} is both public and sensitive")
    for name in bins:
        if name not in quasi and name not in sensitive:
            raise SchemaError(f"--bin {name}: bin only columns named by --quasi or --sensitive")


def _bin_edges(
    name: str, spec: float | Sequence[float], values: Iterable[str]
) -> tuple[float, ...]:
    if isinstance(spec, int | float):
        width = float(spec)
        if not width > 0:
            raise SchemaError(f"bin width of {name!r} must be positive")
        numbers = []
        for v in values:
            try:
                numbers.append(float(v))
            except ValueError:
                continue
        numbers = [x for x in numbers if math.isfinite(x)]
        if not numbers:
            raise SchemaError(f"column {name!r} has no numeric values to bin")
        low = math.floor(min(numbers) / width) * width
        high = (math.floor(max(numbers) / width) + 1) * width
        count = round((high - low) / width)
        return tuple(low + i * width for i in range(count + 1))
    return tuple(float(e) for e in spec)


def _attribute_from_spec(name: str, spec: object, kind: str, source: str) -> Attribute:
    where = f"{source}: schema.{kind}.{name}"
    if not isinstance(spec, Mapping):
        raise SchemaError(f"{where} must be a table with 'domain' or 'bins'")
    keys = set(spec)
    if keys not in ({"domain"}, {"bins"}):
        raise SchemaError(f"{where} needs exactly one of 'domain' or 'bins', got {sorted(keys)}")
    try:
        if "bins" in spec:
            edges = spec["bins"]
            if not isinstance(edges, list) or not all(
                isinstance(e, int | float) and not isinstance(e, bool) for e in edges
            ):
                raise SchemaError(f"{where}.bins must be a list of numbers")
            try:
                numbers = tuple(float(e) for e in edges)
            except OverflowError:  # a TOML integer beyond any float
                raise SchemaError(f"{where}.bins must be finite numbers") from None
            return Attribute(name, kind == "sensitive", (), numbers)
        domain = spec["domain"]
        if not isinstance(domain, list):
            raise SchemaError(f"{where}.domain must be a list of strings")
        return Attribute(name, kind == "sensitive", tuple(domain))
    except SchemaError as err:
        message = str(err)
        raise SchemaError(
            message if message.startswith(source) else f"{where}: {message}"
        ) from None
