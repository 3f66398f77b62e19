"""Count reconstruction from a publication (SPEC §2.1, §2.2).

The published rows are first aggregated into *cells* (distinct combinations
of all published columns with their counts), so a query costs a pass over
the cells, not over the rows. Queries on public values alone are exact.

Personal groups (seed 004 Lemma 3): uniform perturbation publishes s with
probability a = p + (1−p)/m from a record holding s and b = (1−p)/m from any
other, so over the rows S* matching the predicate the MLE is

    |S*|·F′ = (O* − |S*|·b) / p,

unbiased for plain perturbation, for SPS and for a stream's reserve trials:
each row publishes a draw of a trial of its own value, so whatever the
allocation of trials E[X̂] = x. Its interval follows the design stratum by
stratum. Group g holds n_gv trials of value v (N_gv rows), each copied to
about N_gv/n_gv of its rows; SPS allocates them one per value present and the
rest in proportion, a stream by arrival order (`PersonalReconstruction._design`).
N^P of the stratum's rows in the predicate publish s with variance
π(1−π)·(N^P + (N^P)²·(1/n_gv − 1/N_gv)), π = a for v = s and b otherwise.
Summed over strata and groups, with the predicate's count x of s as the
unknown, Var X̂ = c0 + c1·x + c2·x², and the interval is every x with
(X̂ − x)² ≤ z²·Var(X̂ | x) (a score interval, as Wilson's for a binomial
proportion, E. B. Wilson, JASA 22, 1927), so the error bar is taken at the
count being tested, not at the estimate.

A group-level design effect, 1 + (|g|/n_g − 1)(r − 1)/(|g| − 1) on the
binomial variance, is the same only for proportional allocation. With many
values the one-trial floor leaves the largest stratum a small share of n_g:
on Adult with native_country sensitive (m = 41, United-States 91%) its
plug-in 95% interval covered 159 of 200 large counts, this one 187
(tests/test_coverage.py). Plain perturbation (budget ``none``) has no
copies, and the interval is then the score interval of a sum of binomials.

The interval is right only for the publication's own groups:
reconstructing with another merge map (or none, for a publication grouped
with one) puts rows that share draws in different groups, and on Adult
covers 50 to 85% of large counts.

Decoy groups. Sensitive-only count: the published count f′_s is unbiased and the MLE.

Conjunctive count "public predicate P ∧ s_1 ∧ … ∧ s_w" (``matrix="mixing"``, the
default). Public values never change, so the records inside P publish among
themselves: with x_P their true counts over the joint values of the w sensitive
attributes and y_P the published ones, E[y_P] = Mᵀ x_P with M = M_1 ⊗ … ⊗ M_w, each
attribute grouped and drawn independently. M_k is the m×m model of attribute k's
cutting rule, computed from its published counts f′_k (`service.core.mixing`: a record
of s′ publishes s with probability G(s, s′)/(γ·f_{s′}), G the expected number of
groups holding both). So

    x̂_P = M^{-T} y_P,   x̂_{P,s} = Σ_j y_{P,j}·Π_k W_k[j_k],   W_k = column s_k of M_k⁻¹,

clipped to [0, |P|]; its components add up to |P|, and over the whole table it
gives back f′.

Variance by the delta method, each record publishing from its row of M. The
estimate moves with y_P directly (weights ⊗W_k) and through M, which the
published counts of every record, inside P or not, estimate: with g_k[i] =
∂x̂_{P,s}/∂f′_{k,i} = −u_kᵀ (∂M_k/∂f′_{k,i}) W_k, where u_k = M_k^{-T} z_k and z_k is y_P
contracted with W_l on every other attribute, a record inside P of true value v
contributes Var_{j ~ M[v]}(Π_k W_k[j_k] + Σ_k g_k[j_k]) and one outside P
Var(Σ_k g_k[j_k]), weighted by the plug-in counts x̂_P and x̂_¬P = M^{-T}(f′ − y_P),
negatives set to 0. The two terms partly cancel (the counts inside P also move
M), so leaving g out overstates the interval.

Identifiability. An answer is identifiable when its interval, 2·z·SD wide, is
narrower than the range [0, |P|] every answer lies in; otherwise the data do not
say more than that range, and the answer is the proportional share
|P|·Π_k f′_{s_k}/N with the interval [0, |P|]. A value at the eligibility bound N/γ
sits in every group and makes M_k singular (`service.core.mixing`): then no
conjunctive count on attribute k is identifiable.

The papers' 2×2 model stays selectable for comparison (``matrix="corrected"`` or
``"paper"``): original state i (P-bit, then one bit per sensitive attribute) goes
to published state j with probability M[i, j], M = I₂ ⊗ M_1 ⊗ … ⊗ M_w,

    M_k = [[1 − t_k, t_k], [(γ−1)/γ, 1/γ]],  t_k = (γ−1)·f_k / (γ·(N − f_k)),

where t_k is the chance a record without s_k publishes s_k, the same whatever its
value. The papers use t_k = f_k/N, which makes E f′_s ≠ f_s (seed notes 001
§10.7; ``matrix="paper"``); the corrected t_k still assumes uniform mixing, which
no cutting rule achieves, and biases conjunctive counts in proportion to N. With
f_k estimated by its published count, E[y] = Mᵀx inverts in closed form inside
the P block:

    x̂ = Σ_j W_j·y_j,  W = ⊗_k [−t_k, 1 − t_k] / (1/γ − t_k),

with variance Σ_i x_i·(Σ_j M_ij W_j² − δ_i,last) under the model, x̂ plugged in,
and the same identifiability rule. The papers' iterative Bayesian method (x⁰ = y,
t recomputed from x every iteration) is kept as ``method="iterative"`` with an
absolute stopping tolerance, because their 1% relative rule stops after one step
(seed notes 001 §10.10); it gives no interval, and an answer is identifiable while
1/γ − t_k > 0.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats

from service.core.guarantees import (
    budget_epoch,
    check_reconstruction_parameters,
    epoch_level,
    share_upper_bound,
    trial_limit,
)
from service.core.mechanisms.decoy import GROUPINGS
from service.core.mechanisms.personal import STREAM_BUDGETS, UniformPerturbation
from service.core.merge import ValueMap
from service.core.mixing import Mixing, transition_model
from service.core.table import Table, distinct_rows

METHODS = ("closed", "iterative")
MATRICES = ("mixing", "corrected", "paper")


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


class DecoyReconstruction(Reconstruction):
    """Answers count queries on a decoy-group publication with group size γ.

    Parameters
    ----------
    cells, sensitive, confidence: as for `Reconstruction`.
    gamma: the published group size γ.
    grouping: the publication's cutting rule, ``"size-weighted"`` (default, every
        stream's) or ``"anatomy"``; the ``"mixing"`` model is that rule's.
    method: ``"closed"`` (default) or ``"iterative"`` (the papers' EM, 2×2 models only).
    matrix: ``"mixing"`` (default: m×m, `service.core.mixing`), ``"corrected"`` (2×2,
        t = (γ−1)f/(γ(N−f))) or ``"paper"`` (2×2, t = f/N).
    tolerance, max_iterations: stopping rule of the iterative method, in
        tuples (absolute change of every state count).
    clip: clipped to [0, |P|] by default, since a conjunctive estimate's noise
        is amplified several times and raw values often leave that range.
    """

    def __init__(
        self,
        cells: PublishedCells,
        gamma: int,
        sensitive: Sequence[str],
        method: str = "closed",
        matrix: str = "mixing",
        tolerance: float = 0.01,
        max_iterations: int = 10_000,
        confidence: float = 0.95,
        clip: bool = True,
        grouping: str = "size-weighted",
    ) -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer) or gamma < 2:
            raise ValueError(f"gamma must be an integer ≥ 2, got {gamma!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if matrix not in MATRICES:
            raise ValueError(f"matrix must be one of {', '.join(MATRICES)}, got {matrix!r}")
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
        if method == "iterative" and matrix == "mixing":
            raise ValueError(
                "the iterative method uses the papers' 2×2 model: give matrix corrected or paper"
            )
        if not tolerance > 0 or max_iterations < 1:
            raise ValueError("the iterative method needs tolerance > 0 and max_iterations ≥ 1")
        super().__init__(cells, sensitive, confidence, clip)
        self.gamma = int(gamma)
        self.method = method
        self.matrix = matrix
        self.grouping = grouping
        self.tolerance = tolerance
        self.max_iterations = max_iterations
        self._models: dict[str, Mixing] = {}

    def model(self, column: str) -> Mixing:
        """The m×m model of one sensitive column, from its published counts (built once)."""
        if column not in self._models:
            cells = self.cells
            counts = np.bincount(
                cells.column[column],
                weights=cells.weights,
                minlength=len(cells.domains[column]),
            )
            if self.grouping == "anatomy":
                # The rule breaks ties by code, and codes follow the sorted labels in a
                # scanned schema; published CSV rows list values in order of appearance.
                order = np.argsort(np.asarray(cells.domains[column], dtype=object))
                ordered = transition_model(counts[order], self.gamma, self.grouping)
                self._models[column] = replace(ordered, values=order[ordered.values])
            else:
                self._models[column] = transition_model(counts, self.gamma, self.grouping)
        return self._models[column]

    def _off_diagonal(self, f: np.ndarray, n: float) -> np.ndarray:
        """t: probability that a record without s publishes s (2×2 models)."""
        g = self.gamma
        if self.matrix == "paper":
            return f / n
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(f < n, (g - 1) * f / (g * (n - f)), np.inf)

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        n = float(self.cells.total)
        iterations = np.zeros(len(queries), dtype=np.int64)
        if self.matrix == "mixing":
            values, low, high, identifiable, published, rows, f = self._mixing(queries, columns)
        else:
            y = self._states(queries, columns)
            half = y.shape[1] // 2
            rows = y[:, half:].sum(axis=1)
            published = y[:, -1].astype(np.int64)
            f = y @ _state_bits(len(columns), y.shape[1])  # published count of each s_k
            t = self._off_diagonal(f, n)
            identifiable = (1.0 / self.gamma - t > 0).all(axis=1)
            if self.method == "iterative":
                values, iterations = self._iterate(y, len(columns))
                low, high = np.full(len(queries), np.nan), np.full(len(queries), np.nan)
            else:
                values, low, high, narrow = self._closed_form(y[:, half:], t, rows, identifiable)
                identifiable &= narrow
        sensitive_only = np.asarray([not q.where for q in queries]) & (len(columns) == 1)
        if sensitive_only.any():
            # A value's published count over the whole table is its unbiased MLE
            # (seed 001 Thm. 3) whichever model answers conjunctions.
            values[sensitive_only] = published[sensitive_only]
            low[sensitive_only], high[sensitive_only] = self._sensitive_only_interval(
                published[sensitive_only]
            )
            identifiable = identifiable | sensitive_only
        fallback = rows * np.prod(np.minimum(f / n, 1.0), axis=1) if n else rows * 0
        answers = []
        for q in range(len(queries)):
            if identifiable[q]:
                estimate = (float(values[q]), _optional(low[q]), _optional(high[q]))
            else:
                estimate = (float(fallback[q]), 0.0, float(rows[q]))
            answers.append(
                Estimate(
                    *estimate,
                    published=int(published[q]),
                    predicate_rows=int(rows[q]),
                    identifiable=bool(identifiable[q]),
                    iterations=int(iterations[q]),
                )
            )
        return answers

    def _narrow(self, variance: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The identifiability rule: the interval is narrower than [0, |P|]."""
        return 2 * self._z * np.sqrt(np.clip(variance, 0, None)) < rows

    def _mixing(self, queries: Sequence[Query], columns: list[str]) -> tuple[np.ndarray, ...]:
        """x̂_{P,s} = ⟨y_P, ⊗_k W_k⟩ and its delta-method interval (module docstring), with
        the identifiability rule; queries naming a value never published answer 0. Returns
        estimates, lows, highs, identifiable, then each query's published count, |P| and
        the published count of each of its values (Q, w)."""
        cells = self.cells
        models = [self.model(c) for c in columns]
        sizes = [len(m.values) for m in models]
        # Each cell's joint state over the models' values, and each query's value in them.
        joint = np.zeros(len(cells.counts), dtype=np.int64)
        chosen = np.empty((len(queries), len(columns)), dtype=np.int64)
        for k, (column, model) in enumerate(zip(columns, models, strict=True)):
            state = np.full(len(cells.domains[column]), -1, dtype=np.int64)
            state[model.values] = np.arange(len(model.values))
            joint = joint * sizes[k] + state[cells.column[column]]
            codes = [cells.code(column, q.value[column]) for q in queries]
            chosen[:, k] = [state[c] if c >= 0 else -1 for c in codes]
        shape = (len(queries), *sizes)
        total = np.bincount(joint, weights=cells.weights, minlength=math.prod(sizes))
        inside = np.empty((len(queries), math.prod(sizes)))
        for q, query in enumerate(queries):
            mask = cells.predicate(query.where)
            inside[q] = np.bincount(joint[mask], weights=cells.weights[mask], minlength=len(total))
        y_inside = inside.reshape(shape)
        y_outside = (total[None, :] - inside).reshape(shape)
        rows = inside.sum(axis=1)
        absent = (chosen < 0).any(axis=1)
        cell = np.ravel_multi_index(tuple(np.where(chosen < 0, 0, chosen).T), sizes)
        published = np.where(absent, 0, inside[np.arange(len(queries)), cell]).astype(np.int64)
        counts = np.column_stack(
            [np.where(c < 0, 0.0, m.counts[c]) for c, m in zip(chosen.T, models, strict=True)]
        )
        capped = np.full(len(queries), any(m.capped for m in models))
        solvable = ~absent & ~capped
        values, variance = np.zeros(len(queries)), np.zeros(len(queries))
        if solvable.any():
            picked = np.flatnonzero(solvable)
            values[picked], variance[picked] = _mixing_estimates(
                models, chosen[picked], y_inside[picked], y_outside[picked]
            )
        values, low, high = self._interval(values, variance, rows)
        identifiable = solvable & self._narrow(variance, rows)
        if absent.any():
            # Never published: f′ = 0 allows a true count up to the exact interval's bound.
            bound = self._sensitive_only_interval(np.zeros(1, dtype=np.int64))[1][0]
            values[absent], low[absent] = 0.0, 0.0
            high[absent] = np.minimum(rows[absent], bound)
            identifiable |= absent & ~capped
        return values, low, high, identifiable, published, rows, counts

    def _closed_form(
        self, y_predicate: np.ndarray, t: np.ndarray, rows: np.ndarray, identifiable: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        g = self.gamma
        safe_t = np.where(identifiable[:, None], t, 0.0)
        determinant = 1.0 / g - safe_t
        transition = np.ones((len(t), 1, 1))
        inverse_transposed = np.ones((len(t), 1, 1))
        for k in range(t.shape[1]):
            tk, dk = safe_t[:, k], determinant[:, k]
            m = np.empty((len(t), 2, 2))
            m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = 1 - tk, tk, (g - 1) / g, 1 / g
            transition = _batched_kron(transition, m)
            inv_t = np.empty((len(t), 2, 2))
            inv_t[:, 0, 0], inv_t[:, 0, 1] = 1 / g, -(g - 1) / g
            inv_t[:, 1, 0], inv_t[:, 1, 1] = -tk, 1 - tk
            inverse_transposed = _batched_kron(inverse_transposed, inv_t / dk[:, None, None])
        # The estimate is the last state of x̂ = M⁻ᵀ y; its row of M⁻ᵀ is the weight vector.
        weights = inverse_transposed[:, -1, :]
        raw = np.einsum("qj,qj->q", weights, y_predicate)
        states = np.clip(np.einsum("qij,qj->qi", inverse_transposed, y_predicate), 0, None)
        spread = np.einsum("qij,qj->qi", transition, weights**2)
        spread[:, -1] -= 1.0
        variance = np.clip(np.einsum("qi,qi->q", states, spread), 0, None)
        return *self._interval(raw, variance, rows), self._narrow(variance, rows)

    def _sensitive_only_interval(self, published: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact interval for f from f′ ~ Bin(γf, 1/γ): the f not rejected at either tail."""
        g, tail = self.gamma, (1 - self.confidence) / 2
        low, high = np.empty(len(published)), np.empty(len(published))
        for q, observed in enumerate(published):
            spread = int(10 * math.sqrt(observed + 1)) + 10
            f = np.arange(max(observed - spread, 0), observed + spread + 1)
            upper_tail = stats.binom.sf(observed - 1, g * f, 1 / g)  # P(f′ ≥ observed | f)
            lower_tail = stats.binom.cdf(observed, g * f, 1 / g)  # P(f′ ≤ observed | f)
            low[q] = f[upper_tail > tail].min()
            high[q] = f[lower_tail > tail].max()
        return low, high

    def _iterate(self, y: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
        """The papers' iterative Bayesian reconstruction, vectorized over queries."""
        g, q_count, size = self.gamma, len(y), y.shape[1]
        n = y.sum(axis=1)
        x = y.copy()
        iterations = np.zeros(q_count, dtype=np.int64)
        active = np.ones(q_count, dtype=bool)
        bits = _state_bits(w, size)
        for _ in range(self.max_iterations):
            if not active.any():
                break
            xa, ya = x[active], y[active]
            f = xa @ bits  # current f_k = mass of states with bit k set
            with np.errstate(divide="ignore", invalid="ignore"):
                t = np.clip(self._off_diagonal(f, n[active][:, None]), 0.0, 1.0)
            transition = np.broadcast_to(np.eye(2), (len(xa), 2, 2))
            for k in range(w):
                m = np.empty((len(xa), 2, 2))
                m[:, 0, 0], m[:, 0, 1] = 1 - t[:, k], t[:, k]
                m[:, 1, 0], m[:, 1, 1] = (g - 1) / g, 1 / g
                transition = _batched_kron(transition, m)
            expected = np.einsum("qij,qi->qj", transition, xa)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(expected > 0, ya / expected, 0.0)
            updated = xa * np.einsum("qij,qj->qi", transition, ratio)
            converged = np.abs(updated - xa).max(axis=1) < self.tolerance
            x[active] = updated
            iterations[active] += 1
            active[np.flatnonzero(active)[converged]] = False
        return x[:, -1], iterations


class PersonalReconstruction(Reconstruction):
    """MLE counts from a personal-group publication (plain perturbation or SPS).

    Parameters
    ----------
    cells, confidence: as for `Reconstruction`.
    sensitive: the one perturbed column.
    retention, domain_size: p and m of the perturbation.
    lam, delta, budget: the publication's (λ, δ) and budget, which fix how
        many trials each group had; budget ``none`` is plain perturbation,
        ``bounded`` a stream's default budget.
    value_map: the merge map the publication grouped with (None: raw groups).
        The interval is only as good as this: a map other than the
        publication's puts rows that share draws into different groups.
    clip: False by default, keeping the MLE unbiased (seed 004 Thm. 7).
    stream: the publication is a stream's (`service/store/lua/personal.lua`), whose
        trials follow arrival order rather than SPS's stratified sample; the
        ``bounded`` budget is a stream's, so it implies this. The estimate is
        the same either way, the interval differs.
    """

    def __init__(
        self,
        cells: PublishedCells,
        sensitive: str,
        retention: float,
        domain_size: int,
        lam: float = 0.3,
        delta: float = 0.3,
        budget: str = "adaptive",
        value_map: ValueMap | None = None,
        confidence: float = 0.95,
        clip: bool = False,
        stream: bool = False,
    ) -> None:
        super().__init__(cells, [sensitive], confidence, clip)
        self.perturbation = UniformPerturbation(retention, domain_size)
        if budget not in STREAM_BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(STREAM_BUDGETS)}, got {budget!r}")
        check_reconstruction_parameters(retention, domain_size, lam, delta)
        self.stream = stream or budget == "bounded"
        self._group = self._cell_groups(value_map)
        self._strata, self._sharing = self._design(lam, delta, budget)

    def _cell_groups(self, value_map: ValueMap | None) -> np.ndarray:
        cells = self.cells
        if not self.public:
            return np.zeros(len(cells.counts), dtype=np.int64)
        columns = []
        for name in self.public:
            if value_map is None:
                columns.append(cells.column[name].astype(np.int64))
            else:
                per_label, _ = value_map.classes_of(name, cells.domains[name])
                columns.append(per_label[cells.column[name]])
        return distinct_rows(columns, [int(c.max(initial=0)) + 1 for c in columns])[1]

    def _design(self, lam: float, delta: float, budget: str) -> tuple[np.ndarray, np.ndarray]:
        """The design as estimated from the publication, both (groups, labels): stratum
        sizes N_gv and the sharing w_gv = E[1/n_gv] − 1/N_gv of their n_gv trials.

        N_gv = |g|·F′_gv, Lemma 3 within the group, negatives set to 0. The
        group's limit L_g follows from the budget: ⌊s_g⌋ with f = 1
        (conservative), the group's largest frequency (adaptive), or the
        stream's upper bound on it as its epochs planned it (bounded, one owner
        per group: at most the previous epoch's limit when the last began, plus
        one per record since); plain perturbation (``none``) has no copies, w = 0.
        L_g falls as f rises, and a value shared by few trials has a noisy F′,
        so f is taken as max_v F′_gv plus z standard errors of it under the
        design with the fewest trials any budget allows (f = 1): the limit is
        then the lowest plausible, never understating the sharing. (The
        errors under the plain estimate's own design are too small exactly
        when it underestimates f.)

        *Batch* (SPS): n_g = min(|g|, L_g) trials, one per value present and the
        rest in proportion, so a stratum gets

            n_gv = 1 + (N_gv − 1)(n_g − K)/(|g| − K),  or N_gv·n_g/|g| if n_g < K.

        Rare values hide in the noise, so K is taken as min(m, |g|), the most
        it can be: that leaves the fewest trials to the large strata and never
        understates their sharing.

        *Stream* (reserve trials, `service/store/lua/personal.lua`): a record is a
        trial while trials < L_g − U, U = m − (values with a trial), or when its
        value has none yet. The slack L_g − U − trials starts at L_g − m, a
        value's first record leaves it unchanged (U and trials both move) and
        any later record spent as a trial lowers it by one. So while L_g ≥ m
        every value's first record is a trial, and so are the first k = L_g − m
        of the group's *repeat* records (a value's second record on), and no
        other: n_gv = 1 + J_v, J_v the repeats of v among those k. In random
        arrival order (exchangeable, as the bounded budget assumes) they are a
        random sample of the |g| − K repeats, so J_v ~ Binomial(k, π_v) (the
        hypergeometric law is narrower; the binomial errs wide) with
        π_v = (N_gv − 1)/(|g| − K), and

            E[1/n_gv] = E[1/(1 + J_v)] = (1 − (1 − π_v)^(k+1)) / ((k + 1)·π_v).

        As in the batch K is taken as m: clipped noise in the estimates of
        absent values would inflate Σ_v (N_gv − 1)⁺, and K ≤ m errs by
        (m − K)/|g| only. This is SPS's allocation with L_g − m extra trials in
        place of n_g − K, drawn rather than rounded. Only a group of at most
        k + K records publishes trials only (w = 0), so copies are assumed
        unless |g| ≤ k + 1. Given n_gv the copies split the stratum evenly and
        X̂ stays unbiased, so the variance averages the conditional one over J_v.
        """
        cells, perturbation = self.cells, self.perturbation
        p, m = perturbation.retention, perturbation.domain_size
        labels = len(cells.domains[self.sensitive[0]])
        groups = int(self._group.max(initial=-1)) + 1
        joint = np.bincount(
            self._group * labels + cells.column[self.sensitive[0]],
            weights=cells.weights,
            minlength=groups * labels,
        ).reshape(groups, labels)
        sizes = joint.sum(axis=1)
        frequency = (joint / np.maximum(sizes, 1)[:, None] - perturbation.switch) / p
        strata = np.clip(frequency, 0, None) * sizes[:, None]
        if budget == "none":
            return strata, np.zeros_like(strata)
        fewest = np.clip(np.floor(trial_limit(1.0, p, m, lam, delta)), 1, None)
        sharing = self._sharing_of(strata, sizes, np.full(groups, fewest))
        if budget == "conservative":
            return strata, sharing
        # The limit falls as the largest share rises, and copies make its estimate noisy:
        # plan with an upper bound, the estimate plus z standard errors under the design
        # with the fewest trials any budget allows (f = 1), which never understates them.
        largest = np.clip(frequency.max(axis=1, initial=0), 1.0 / m, 1.0)
        top = frequency.argmax(axis=1) if labels else np.zeros(groups, np.int64)
        spread = strata + strata**2 * sharing
        a, b = perturbation.keep, perturbation.switch
        own = np.take_along_axis(spread, top[:, None], axis=1)[:, 0]
        variance = a * (1 - a) * own + b * (1 - b) * (spread.sum(axis=1) - own)
        error = np.sqrt(variance) / (p * np.maximum(sizes, 1))
        upper = np.clip(largest + self._z * error, 1.0 / m, 1.0)
        return strata, self._sharing_of(
            strata, sizes, self._limit(upper, sizes, budget, lam, delta)
        )

    def _limit(
        self, largest: np.ndarray, sizes: np.ndarray, budget: str, lam: float, delta: float
    ) -> np.ndarray:
        """Each group's trial limit L_g when its largest share is `largest` (`_design`)."""
        p, m = self.perturbation.retention, self.perturbation.domain_size
        if budget != "bounded":
            return np.clip(np.floor(trial_limit(largest, p, m, lam, delta)), 1, None)
        # Each epoch e planned the group's trials with the bound taken when it first held
        # 2^e records (service/store/lua/personal.lua): the group then held at most the previous
        # epoch's limit, and one more per record since, up to its last epoch's.
        epoch = np.array([budget_epoch(int(n)) for n in sizes], dtype=np.int64)

        def planned(e: np.ndarray) -> np.ndarray:
            bound = share_upper_bound(largest * 2.0**e, 2.0**e, epoch_level(e))
            return np.floor(trial_limit(bound, p, m, lam, delta))

        earlier = planned(np.maximum(epoch - 1, 0)) + sizes - 2.0**epoch
        return np.clip(np.minimum(planned(epoch), earlier), 1, None)

    def _sharing_of(self, strata: np.ndarray, sizes: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """w_gv = E[1/n_gv] − 1/N_gv given each group's limit (`_design`)."""
        m = self.perturbation.domain_size
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.stream:
                extra = np.clip(limit - m, 0, None)[:, None]
                repeats = np.maximum(sizes - m, 1)[:, None]
                share = np.clip((strata - 1) / repeats, 0, 1)
                # E[1/(1 + J)], J ~ Binomial(k, π): (1 − (1 − π)^(k+1)) / ((k + 1)π).
                inverse = np.where(
                    share > 0,
                    -np.expm1((extra + 1) * np.log1p(-np.minimum(share, 1 - 1e-16)))
                    / ((extra + 1) * share),
                    1.0,
                )
                copied = (sizes > limit - m + 1)[:, None]
            else:
                trials = np.minimum(sizes, limit)
                present = np.minimum(m, sizes)
                draws = np.where(
                    (trials >= present)[:, None],
                    1 + (strata - 1) * ((trials - present) / (sizes - present))[:, None],
                    strata * (trials / sizes)[:, None],
                )
                inverse = 1 / draws
                copied = (sizes > trials)[:, None] & (draws > 0)
            sharing = np.where((strata > 0) & copied, inverse - 1 / strata, 0.0)
        return np.clip(sharing, 0, None)

    def _solve(self, queries: Sequence[Query], columns: list[str]) -> list[Estimate]:
        cells, perturbation = self.cells, self.perturbation
        b, p = perturbation.switch, perturbation.retention
        column = cells.column[columns[0]]
        groups = len(self._strata)
        raw, rows = np.empty(len(queries)), np.empty(len(queries))
        published = np.empty(len(queries), dtype=np.int64)
        coefficients = np.empty((len(queries), 3))
        for q, query in enumerate(queries):
            inside = cells.predicate(query.where)
            code = cells.code(columns[0], query.value[columns[0]])
            hit = inside & (column == code)
            r = np.bincount(self._group[inside], weights=cells.weights[inside], minlength=groups)
            o = np.bincount(self._group[hit], weights=cells.weights[hit], minlength=groups)
            raw[q] = (o.sum() - b * r.sum()) / p
            rows[q], published[q] = r.sum(), int(o.sum())
            coefficients[q] = self._variance_coefficients(r, o, code)
        low, high = self._score_interval(raw, coefficients, rows)
        estimate = np.clip(raw, 0, rows) if self.clip else raw
        return [
            Estimate(float(e), float(lo), float(hi), int(pub), int(n))
            for e, lo, hi, pub, n in zip(estimate, low, high, published, rows, strict=True)
        ]

    def _variance_coefficients(self, r: np.ndarray, o: np.ndarray, code: int) -> np.ndarray:
        """(c0, c1, c2) with Var X̂ = c0 + c1·x + c2·x² when x rows of the predicate hold s.

        In stratum v of group g (N rows, n draws, each copied to about k = N/n
        rows in keyed random order), N^P rows of the predicate publish s with
        variance π(1−π)·(N^P + (N^P)²·w_gv), π = a for the stratum of s and b
        for the others. With equal copy counts the exact factor is
        N^P + N^P(N^P − 1)(k − 1)/(N − 1), smaller by N^P(k − 1)(N − N^P)/(N(N − 1)),
        so this errs wide. x is spread over groups like the plug-in counts
        (o − b·r)/p; the predicate's other rows are spread over the other
        strata like the group's.
        """
        a, b, p = self.perturbation.keep, self.perturbation.switch, self.perturbation.retention
        strata, sharing = self._strata, self._sharing
        holding = np.clip((o - b * r) / p, 0, r)
        total = holding.sum()
        spread = holding / total if total > 0 else r / max(r.sum(), 1.0)
        others = strata.copy()
        own_sharing = np.zeros(len(r))
        if code >= 0:
            others[:, code] = 0.0
            own_sharing = sharing[:, code]
        weight = others.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            mix = np.where(weight[:, None] > 0, others / weight[:, None], 0.0)
        other_sharing = (mix**2 * sharing).sum(axis=1)
        own, other = a * (1 - a), b * (1 - b)
        c0 = other * (r + r**2 * other_sharing).sum()
        c1 = ((own - other) * spread - 2 * other * r * spread * other_sharing).sum()
        c2 = (spread**2 * (own * own_sharing + other * other_sharing)).sum()
        return np.array([c0, c1, c2]) / p**2

    def _score_interval(
        self, raw: np.ndarray, coefficients: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every count x with (X̂ − x)² ≤ z²·Var(X̂ | x): the roots of a quadratic.

        The variance is taken at the count being tested, not at the estimate
        (Wilson's score interval for a binomial, here for SPS). With few
        draws the standard error is nearly proportional to the count, so a
        plug-in interval is short exactly when the estimate is low, and then
        misses a truth above it. When z²·c2 ≥ 1 no count is excluded on one side and
        the answer is the feasible range [0, |P|].
        """
        z2 = self._z**2
        c0, c1, c2 = coefficients.T
        leading = 1 - z2 * c2
        middle = -(2 * raw + z2 * c1)
        constant = raw**2 - z2 * c0
        bounded = leading > 0
        safe = np.where(bounded, leading, 1.0)
        root = np.sqrt(np.clip(middle**2 - 4 * safe * constant, 0, None))
        low = np.where(bounded, (-middle - root) / (2 * safe), 0.0)
        high = np.where(bounded, (-middle + root) / (2 * safe), rows)
        if self.clip:
            return np.clip(low, 0, rows), np.clip(high, 0, rows)
        return low, high


def _state_bits(w: int, size: int) -> np.ndarray:
    """(size, w) matrix: whether state j has sensitive bit k set (bit 0 is the highest)."""
    return (np.arange(size)[:, None] >> (w - 1 - np.arange(w))[None, :]) & 1


def _batched_kron(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Kronecker product of matching (Q, m, m) and (Q, n, n) stacks."""
    q, m, _ = a.shape
    n = b.shape[1]
    return (a[:, :, None, :, None] * b[:, None, :, None, :]).reshape(q, m * n, m * n)


def _mixing_estimates(
    models: Sequence[Mixing], chosen: np.ndarray, inside: np.ndarray, outside: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Raw estimates and delta-method variances of "P ∧ s_1 ∧ … ∧ s_w" under M_1 ⊗ … ⊗ M_w.

    chosen: (Q, w) each query's value, as a state of each model; inside, outside:
    (Q, k_1, …, k_w) published counts of the joint states inside and outside P.
    """
    w = len(models)
    weights = [m.inverse[:, chosen[:, k]].T for k, m in enumerate(models)]  # W_k, (Q, k_k)
    estimate = _contract(inside, weights)
    # g_k[i] = −u_kᵀ (∂M_k/∂f′_i) W_k, u_k = M_k^{-T} z_k, z_k: y_P contracted on the others.
    slopes = []
    for k, model in enumerate(models):
        u = _contract(inside, [v if j != k else None for j, v in enumerate(weights)])
        u = u @ model.inverse
        slopes.append(-np.einsum("qa,iab,qb->qi", u, model.derivative, weights[k]))
    # x̂ inside P (negatives set to 0) and its marginals; x̂ outside P by its marginals.
    states = inside
    for k, model in enumerate(models):
        states = np.moveaxis(np.tensordot(states, model.inverse, axes=([k + 1], [0])), -1, k + 1)
    states = np.clip(states, 0, None)
    # Moments over a record's published value j ~ M_k[v] given its true value v.
    mean = [w_k @ m.matrix.T for w_k, m in zip(weights, models, strict=True)]
    square = [(w_k**2) @ m.matrix.T for w_k, m in zip(weights, models, strict=True)]
    slope_mean = [g @ m.matrix.T for g, m in zip(slopes, models, strict=True)]
    cross = [(w_k * g) @ m.matrix.T for w_k, g, m in zip(weights, slopes, models, strict=True)]
    slope_spread = [
        (g**2) @ m.matrix.T - gm**2 for g, gm, m in zip(slopes, slope_mean, models, strict=True)
    ]
    # Inside P: Var(Π W + Σ g) = ΠE W² − (ΠE W)² + 2Σ_k (E W_k g_k − E W_k E g_k)·Π_{l≠k} E W_l
    # + Σ_k Var g_k, attributes independent; outside P: Σ_k Var g_k.
    variance = _contract(states, square) - _contract(states, [v**2 for v in mean])
    for k in range(w):
        covariance = cross[k] - slope_mean[k] * mean[k]
        variance += 2 * _contract(states, [covariance if j == k else v for j, v in enumerate(mean)])
        unit = [np.ones_like(v) for v in mean]
        margin_inside = _contract(states, [None if j == k else u for j, u in enumerate(unit)])
        margin_outside = _contract(outside, [None if j == k else u for j, u in enumerate(unit)])
        margin_outside = np.clip(margin_outside @ models[k].inverse, 0, None)
        variance += np.einsum("qv,qv->q", margin_inside + margin_outside, slope_spread[k])
    return estimate, variance


def _contract(tensor: np.ndarray, vectors: Sequence[np.ndarray | None]) -> np.ndarray:
    """Σ over each axis k ≥ 1 of `tensor` (Q, k_1, …, k_w) weighted by vectors[k − 1] (Q, k_k),
    per query; an axis whose vector is None is kept."""
    letters = "abcdefghijklmnopstuvwxyz"[: len(vectors)]
    operands = [tensor]
    inputs = ["q" + letters]
    for letter, vector in zip(letters, vectors, strict=True):
        if vector is not None:
            operands.append(vector)
            inputs.append("q" + letter)
    kept = "".join(a for a, v in zip(letters, vectors, strict=True) if v is None)
    return np.einsum(",".join(inputs) + "->q" + kept, *operands)


def _optional(value: float) -> float | None:
    return None if np.isnan(value) else float(value)
