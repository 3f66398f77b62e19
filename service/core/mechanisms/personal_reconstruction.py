"""Count reconstruction from a personal-group publication (SPEC §2.2).

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.guarantees import (
    budget_epoch,
    check_reconstruction_parameters,
    epoch_level,
    share_upper_bound,
    trial_limit,
)
from service.core.mechanisms.personal import STREAM_BUDGETS, UniformPerturbation
from service.core.merge import ValueMap
from service.core.reconstruct import Estimate, PublishedCells, Query, Reconstruction
from service.core.table import distinct_rows


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
