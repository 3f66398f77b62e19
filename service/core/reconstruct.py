"""Count reconstruction from a publication (SPEC §2.1, §2.2).

The published rows are first aggregated into *cells* (distinct combinations
of all published columns with their counts), so a query costs a pass over
the cells, not over the rows. Queries on public values alone are exact.

Each mechanism's estimator is a `Reconstruction` (decoy groups in
`service.core.mechanisms.decoy_reconstruction`, personal groups in
`service.core.mechanisms.personal_reconstruction`, the batch mechanisms beside their
publishers); the registry (`service.core.mechanisms.registry`) builds the one a
publication needs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from service.core.table import Table, distinct_rows


class QueryError(ValueError):
    """A query that cannot be answered as written."""


@dataclass(frozen=True)
class Query:
    """Rows with public column c in `where[c]` (any listed value) and the given
    published sensitive values."""

    where: Mapping[str, tuple[str, ...]]
    value: Mapping[str, str]

    @classmethod
    def from_json(cls, obj: object) -> Query:
        if not isinstance(obj, Mapping):
            raise QueryError('a query is an object like {"where": {...}, "value": {...}}')
        unknown = set(obj) - {"where", "value"}
        if unknown:
            raise QueryError(f"unknown query key {sorted(unknown)[0]!r}; use where and value")
        where = obj.get("where", {})
        value = obj.get("value", {})
        if not isinstance(where, Mapping) or not isinstance(value, Mapping):
            raise QueryError('"where" and "value" must be objects')
        parsed_where = {}
        for column, wanted in where.items():
            options = wanted if isinstance(wanted, list) else [wanted]
            if not options:
                raise QueryError(f"where.{column}: the list of values is empty")
            parsed_where[column] = tuple(_label(column, v) for v in options)
        parsed_value = {column: _label(column, v) for column, v in value.items()}
        return cls(parsed_where, parsed_value)

    def check_values(self, domains: Mapping[str, Collection[str]]) -> None:
        """Raise QueryError for a sensitive value outside its attribute's domain: the
        estimators of the batch mechanisms would answer 0 for it, which reads like a count."""
        for column, label in self.value.items():
            if label not in domains[column]:
                raise QueryError(f"value.{column}: {label!r} is not in the domain")


def _label(column: str, value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise QueryError(f"{column}: values are strings (or integers), got {type(value).__name__}")


@dataclass(frozen=True)
class Estimate:
    estimate: float
    low: float | None
    high: float | None
    published: int
    predicate_rows: int
    identifiable: bool = True
    iterations: int = 0

    def answer(self) -> dict[str, float]:
        """As `splu query` and `/estimate` write it: three decimals, interval where defined."""
        out = {"estimate": round(self.estimate, 3)}
        if self.low is not None and self.high is not None:
            out.update(low=round(self.low, 3), high=round(self.high, 3))
        return out


class PublishedCells:
    """A published table aggregated to distinct cells with counts."""

    def __init__(
        self,
        columns: Sequence[str],
        domains: Mapping[str, Sequence[str]],
        cells: np.ndarray,
        counts: np.ndarray,
    ) -> None:
        self.columns = list(columns)
        self.domains = {c: tuple(domains[c]) for c in self.columns}
        self._codes = {c: {v: i for i, v in enumerate(self.domains[c])} for c in self.columns}
        self.cells = cells
        self.counts = counts.astype(np.int64)
        self.total = int(self.counts.sum())
        # Queries scan whole columns: contiguous copies and float weights, made once.
        self.column = {c: np.ascontiguousarray(cells[:, i]) for i, c in enumerate(self.columns)}
        self.weights = self.counts.astype(np.float64)

    @classmethod
    def from_codes(
        cls,
        columns: Sequence[str],
        domains: Mapping[str, Sequence[str]],
        codes: Sequence[np.ndarray],
    ) -> PublishedCells:
        sizes = [len(domains[c]) for c in columns]
        cells, _, counts = distinct_rows(codes, sizes)
        return cls(columns, domains, cells.astype(np.int32), counts)

    @classmethod
    def from_table(cls, table: Table) -> PublishedCells:
        names = table.schema.names
        domains = {n: table.schema[n].domain for n in names}
        return cls.from_codes(names, domains, [table.codes[n] for n in names])

    @classmethod
    def from_rows(cls, header: Sequence[str], rows: Sequence[Sequence[str]]) -> PublishedCells:
        """From published CSV rows; each column's domain is the values it shows."""
        codes, domains = [], {}
        for i, name in enumerate(header):
            lookup: dict[str, int] = {}
            codes.append(
                np.fromiter(
                    (lookup.setdefault(row[i], len(lookup)) for row in rows), np.int64, len(rows)
                )
            )
            domains[name] = list(lookup)
        return cls.from_codes(header, domains, codes)

    def code(self, column: str, label: str) -> int:
        """Code of `label`, or -1 when the published data never shows it."""
        return self._codes[column].get(label, -1)

    def predicate(self, where: Mapping[str, tuple[str, ...]]) -> np.ndarray:
        """Boolean mask over cells: every named column takes one of the listed values."""
        mask = np.ones(len(self.counts), dtype=bool)
        for column, labels in where.items():
            wanted = [c for c in (self.code(column, v) for v in labels) if c >= 0]
            column_codes = self.column[column]
            if len(wanted) == 1:
                mask &= column_codes == wanted[0]
            else:
                mask &= np.isin(column_codes, wanted)
        return mask


class Reconstruction:
    """What every mechanism's reconstruction shares: checks, batching, state counts.

    Parameters
    ----------
    cells: the published table, aggregated.
    sensitive: names of the randomized columns; every other column is public.
    confidence: coverage of the [low, high] interval.
    clip: keep estimates and intervals inside [0, |P|]. The raw estimate is
        unbiased; clipping trades that for feasible answers, so sums of many
        estimates should use clip=False.
    """

    def __init__(
        self, cells: PublishedCells, sensitive: Sequence[str], confidence: float, clip: bool
    ) -> None:
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
        missing = [c for c in sensitive if c not in cells.columns]
        if missing:
            raise ValueError(
                f"sensitive column {missing[0]!r} is not in the published data "
                f"(columns: {', '.join(cells.columns)})"
            )
        self.cells = cells
        self.sensitive = list(sensitive)
        self.public = [c for c in cells.columns if c not in self.sensitive]
        self.confidence = confidence
        self.clip = clip
        from scipy import stats

        self._z = float(stats.norm.ppf(0.5 + confidence / 2))

    def check(self, query: Query) -> None:
        for column in query.where:
            if column in self.sensitive:
                raise QueryError(
                    f'where.{column}: {column!r} is sensitive; ask for it under "value"'
                )
            if column not in self.public:
                raise QueryError(f"where.{column}: no such public column")
        for column in query.value:
            if column not in self.sensitive:
                raise QueryError(f"value.{column}: {column!r} is not a sensitive column")

    def estimate(self, query: Query) -> Estimate:
        return self.estimate_many([query])[0]

    def estimate_many(self, queries: Sequence[Query]) -> list[Estimate]:
        """Answer many queries, solving those over the same sensitive columns together.

        Public values are never perturbed, so a query without sensitive values
        is answered exactly.
        """
        for query in queries:
            self.check(query)
        answers: list[Estimate | None] = [None] * len(queries)
        batches: dict[tuple[str, ...], list[int]] = {}
        for i, query in enumerate(queries):
            batches.setdefault(tuple(c for c in self.sensitive if c in query.value), []).append(i)
        for columns, members in batches.items():
            batch = [queries[i] for i in members]
            if columns:
                solved = self._solve(batch, list(columns))
            else:
                rows = self._states(batch, [])[:, -1]
                solved = [Estimate(float(r), float(r), float(r), int(r), int(r)) for r in rows]
            for i, answer in zip(members, solved, strict=True):
                answers[i] = answer
        return answers  # type: ignore[return-value]

    def _states(self, queries: Sequence[Query], columns: list[str]) -> np.ndarray:
        """Published counts per state, (Q, 2^(w+1)): P-bit highest, then one bit per column."""
        cells = self.cells
        w = len(columns)
        out = np.zeros((len(queries), 2 ** (w + 1)), dtype=np.float64)
        for q, query in enumerate(queries):
            state = cells.predicate(query.where).astype(np.intp)
            for column in columns:
                state <<= 1
                state |= cells.column[column] == cells.code(column, query.value[column])
            out[q] = np.bincount(state, weights=cells.weights, minlength=2 ** (w + 1))
        return out

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        raise NotImplementedError

    def _interval(
        self, raw: np.ndarray, variance: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        margin = self._z * np.sqrt(np.clip(variance, 0, None))
        if not self.clip:
            return raw, raw - margin, raw + margin
        return np.clip(raw, 0, rows), np.clip(raw - margin, 0, rows), np.clip(raw + margin, 0, rows)


class Answers(Protocol):
    """What answers queries: every Reconstruction, and F′-privacy's estimator."""

    def check(self, query: Query) -> None: ...

    def estimate_many(self, queries: Sequence[Query]) -> list[Estimate]: ...


def checked_query(
    obj: object, answerer: Answers, domains: Mapping[str, Collection[str]] | None
) -> Query:
    """A query object parsed and checked against what `answerer` can answer and, with
    `domains`, against each sensitive column's domain; raises QueryError otherwise."""
    query = Query.from_json(obj)
    answerer.check(query)
    if domains is not None:
        query.check_values(domains)
    return query


def answer_queries(
    answerer: Answers | None,
    objects: Iterable[object],
    domains: Mapping[str, Collection[str]] | None,
    unanswered: str,
) -> tuple[list[dict[str, Any]], list[tuple[int, Query, Estimate]]]:
    """Query objects ({"where": {...}, "value": {...}}) answered as `/estimate` answers them:
    each with its estimate, the interval "low"/"high" where defined, the "published" count
    and the predicate's "rows", or an "error" (`unanswered` while there is no `answerer`).
    With `domains`, a sensitive value outside its domain is an error. Also (position, query,
    estimate) of each query answered, for callers that add fields of their own."""
    results: list[dict[str, Any]] = []
    valid: list[tuple[int, Query]] = []
    for i, obj in enumerate(objects):
        results.append(dict(obj) if isinstance(obj, dict) else {"query": obj})
        if answerer is None:
            results[-1]["error"] = unanswered
            continue
        try:
            query = checked_query(obj, answerer, domains)
        except QueryError as err:
            results[-1]["error"] = str(err)
            continue
        valid.append((i, query))
    if answerer is None or not valid:
        return results, []
    estimates = answerer.estimate_many([q for _, q in valid])
    for (i, _), estimate in zip(valid, estimates, strict=True):
        results[i].update(
            estimate.answer(), published=estimate.published, rows=estimate.predicate_rows
        )
    return results, [(i, q, e) for (i, q), e in zip(valid, estimates, strict=True)]
