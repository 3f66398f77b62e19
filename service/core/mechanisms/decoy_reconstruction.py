"""Count reconstruction from a decoy-group publication (SPEC §2.1).

Sensitive-only count: the published count f′_s is unbiased and the MLE.

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
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from service.core.mechanisms.decoy import GROUPINGS
from service.core.mixing import Mixing, transition_model
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction

METHODS = ("closed", "iterative")
MATRICES = ("mixing", "corrected", "paper")


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
        from scipy import stats

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
