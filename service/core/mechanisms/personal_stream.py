"""A personal stream's publication, replayed in Python (`service/store/lua/personal.lua`).

The stream spends each group's trials in arrival order with *reserve trials*: with
L the group's trial limit when a release is planned and U = m − (values with a trial
in the group),

    a record is a trial        if trials < L − U, or its value has no trial and trials < L;
    else a copy of a trial     of its own value, the value's trials in turn;
    else (no trial of its value and none may be spent) a *borrowed* copy of another
    value's trial, the values with trials in turn (ascending code).

A group's buffer is released when it holds `release_size` records after an ingest
call, and every buffer at the close. The limit is the budget's (`PersonalGroups`
budgets plus the stream's ``bounded``) from the group's true counts at its release:
``conservative`` ⌊s_g(f = 1)⌋, ``adaptive`` ⌊s_g(f)⌋ at its largest share so far,
``bounded`` ⌊s_g(U_e)⌋ with the upper bound U_e on its final largest share planned
once per doubling of its records (`service.core.guarantees.share_upper_bound`, at level
`epoch_level(e)`), frozen at 0 once the share seen exceeds that bound or its trials
exceed ⌊s_g(f)⌋. `PersonalStream.publish` gives what `PersonalGroups.publish` gives for
SPS, from the same keyed perturbation of each record as the worker's
(`service.core.ingest`), so benchmarks can measure the stream without running one;
tests/test_personal_stream_replay.py holds it to the Lua step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.core.guarantees import (
    budget_epoch,
    check_reconstruction_parameters,
    epoch_level,
    share_upper_bound,
    trial_limit,
)
from service.core.mechanisms.personal import (
    STREAM_BUDGETS,
    GroupAudit,
    PersonalGroups,
    PersonalRelease,
    UniformPerturbation,
    publication,
)
from service.core.merge import ValueMap
from service.core.prf import ServiceKey
from service.core.table import Table

# What each record published (`StreamTrials.kind`), as personal.lua's pool entries mark it.
TRIAL, COPY, BORROWED = 0, 1, 2


@dataclass(frozen=True)
class StreamTrials:
    """Per record, in the order given: TRIAL, COPY or BORROWED, and the record whose
    perturbed value it publishes (itself for a trial)."""

    kind: np.ndarray
    source: np.ndarray


@dataclass(frozen=True)
class _Releases:
    """Every release of every group, in the group's order: the end (exclusive) of each
    in the group's records, the limit it plans with, and for the bounded budget the
    share seen, its bound and ⌊s_g⌋ at that share, against which a release freezes the
    group (the only part that depends on the trials spent, so the replay applies it)."""

    end: np.ndarray
    limit: np.ndarray
    share: np.ndarray
    bound: np.ndarray
    exact: np.ndarray


def _release_plans(
    group_sizes: np.ndarray,
    values: np.ndarray,
    budget: str,
    settings: tuple[float, int, float, float],
    release_size: int,
    arrival: np.ndarray,
    batch: int,
) -> list[_Releases]:
    """personal.lua's `budget(group, trials)` at every release of every group, computed
    together (one bound per planned epoch, all in one call). `values` holds each group's
    records in turn, `arrival` their positions in the stream."""
    starts = np.cumsum(group_sizes) - group_sizes
    ends = [
        _release_ends(arrival[a : a + n], release_size, batch)
        for a, n in zip(starts.tolist(), group_sizes.tolist(), strict=True)
    ]
    counts = np.array([len(e) for e in ends])
    owner = np.repeat(np.arange(len(group_sizes)), counts)
    end = np.concatenate(ends) if ends else np.empty(0, np.int64)
    # The largest count of one value among a group's first t records: the highest
    # occurrence number (1 for a value's first record, ...) seen up to t.
    order = np.lexsort((np.arange(len(values)), values, np.repeat(starts, group_sizes)))
    key = np.repeat(starts, group_sizes)[order] * (int(values.max(initial=0)) + 1) + values[order]
    block = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    occurrence = np.empty(len(values), np.int64)
    occurrence[order] = (
        np.arange(len(values)) - np.repeat(block, np.diff(np.r_[block, len(values)])) + 1
    )
    running = np.empty(len(values), np.int64)
    for a, n in zip(starts.tolist(), group_sizes.tolist(), strict=True):
        running[a : a + n] = np.maximum.accumulate(occurrence[a : a + n])
    largest = running[starts[owner] + end - 1] if len(end) else np.empty(0, np.int64)
    share = largest / np.maximum(end, 1)
    nothing = np.zeros(len(end))
    if budget == "none":
        limit = np.full(len(end), np.inf)
        bound = exact = nothing
    elif budget == "conservative":
        # buffer.py passes the conservative limit to the script as an integer.
        limit = np.full(len(end), float(int(trial_limit(1.0, *settings))))
        bound = exact = nothing
    else:
        exact = np.floor(trial_limit(share, *settings))
        limit, bound = exact, nothing
        if budget == "bounded":
            # A group plans at its first release in each epoch ⌊log₂ records⌋ it reaches.
            epoch = np.array([budget_epoch(int(t)) for t in end], dtype=np.int64)
            first = np.r_[True, (owner[1:] != owner[:-1]) | (epoch[1:] > epoch[:-1])]
            planned = np.flatnonzero(first)
            bounds = share_upper_bound(largest[planned], end[planned], epoch_level(epoch[planned]))
            bound = bounds[np.cumsum(first) - 1]
            limit = np.floor(trial_limit(bound, *settings))
    pieces = np.cumsum(counts)[:-1]
    return [
        _Releases(*parts)
        for parts in zip(
            *(np.split(a, pieces) for a in (end, limit, share, bound, exact)), strict=True
        )
    ]


def _release_ends(arrival: np.ndarray, release_size: int, batch: int) -> np.ndarray:
    """End (exclusive, in the group's records) of each release: after the ingest call
    (`batch` records of the whole stream) in which the group's buffer reached
    `release_size`, and the rest at the close."""
    n = len(arrival)
    if batch == 1:
        whole = np.arange(release_size, n + 1, release_size)
        return np.r_[whole, [n] * (n % release_size > 0)].astype(np.int64)
    calls = (arrival // batch).tolist()
    ends, buffered = [], 0
    for i, call in enumerate(calls):
        buffered += 1
        last_of_call = i + 1 == n or calls[i + 1] != call
        if last_of_call and buffered >= release_size:
            ends.append(i + 1)
            buffered = 0
    if buffered:
        ends.append(n)
    return np.array(ends, dtype=np.int64)


def stream_trials(
    groups: np.ndarray,
    values: np.ndarray,
    m: int,
    budget: str,
    retention: float,
    lam: float,
    delta: float,
    release_size: int,
    batch: int = 1,
    reserve: bool = True,
) -> StreamTrials:
    """Replay personal.lua on records in arrival order: each record's group (any
    labels) and true value code (0..m−1); `batch` records per ingest call, after each
    of which the groups holding `release_size` records are released. `reserve` False
    keeps no trial for values not seen yet (a trial while trials < L, whatever the
    value), the rule reserve trials replace, for comparison (bench/personal_reserve.py).

    Groups never share state, so each is replayed alone over its own records; within a
    group the decisions depend only on its arrival order, its release points and its
    counts at each release.
    """
    if budget not in STREAM_BUDGETS:
        raise ValueError(f"budget must be one of {', '.join(STREAM_BUDGETS)}, got {budget!r}")
    if release_size < 1 or batch < 1:
        raise ValueError("release_size and batch must be positive")
    check_reconstruction_parameters(retention, m, lam, delta)
    values = np.asarray(values, dtype=np.int64)
    n = len(values)
    if n == 0:
        return StreamTrials(np.zeros(0, np.int8), np.zeros(0, np.int64))
    # Each group's records, in arrival order.
    codes = np.unique(np.asarray(groups), return_inverse=True)[1].ravel()
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(codes)
    settings = (retention, m, lam, delta)
    plans = _release_plans(sizes, values[order], budget, settings, release_size, order, batch)
    kind = np.zeros(n, dtype=np.int8)
    source = np.arange(n, dtype=np.int64)
    starts = (np.cumsum(sizes) - sizes).tolist()
    for start, size, plan in zip(starts, sizes.tolist(), plans, strict=True):
        rows = order[start : start + size]
        _replay_group(
            rows.tolist(), values[rows].tolist(), plan, budget, m if reserve else 0, kind, source
        )
    return StreamTrials(kind, source)


def _replay_group(
    rows: list[int],
    values: list[int],
    plan: _Releases,
    budget: str,
    reserved: int,
    kind: np.ndarray,
    source: np.ndarray,
) -> None:
    """One group's records (`rows`, their positions in arrival order) through
    personal.lua, writing their kind and source; `reserved` trials are kept for values
    not seen yet (m, or 0 for the rule without a reserve)."""
    trials, borrowed, unseen = 0, 0, reserved
    frozen = False
    m = max(values, default=0) + 1
    trials_of: list[list[int]] = [[] for _ in range(m)]
    copies = [0] * m
    lenders: list[int] | None = None
    start = 0
    for end, limit, share, bound, exact in zip(
        plan.end.tolist(), plan.limit.tolist(), plan.share.tolist(), plan.bound.tolist(),
        plan.exact.tolist(), strict=True,
    ):  # fmt: skip
        if budget == "bounded":
            # A bound below the share seen, or trials over the limit at it: frozen.
            frozen = frozen or share > bound or trials > exact
            limit = 0 if frozen else limit
        for i in range(start, end):
            value, row = values[i], rows[i]
            own = trials_of[value]
            fresh = not own
            if trials < limit - unseen or (fresh and trials < limit):
                trials += 1
                own.append(row)
                if fresh:
                    unseen = max(unseen - 1, 0)
                    lenders = None
                continue
            lender = value
            if fresh:
                if lenders is None:
                    lenders = [v for v in range(m) if trials_of[v]]
                lender = lenders[borrowed % len(lenders)]
                borrowed += 1
                kind[row] = BORROWED
            else:
                kind[row] = COPY
            pool = trials_of[lender]
            source[row] = pool[copies[lender] % len(pool)]
            copies[lender] += 1
        start = end


class PersonalStream:
    """A personal stream's publication of a table, replayed (module docstring).

    Parameters
    ----------
    retention, lam, delta, value_map: as for `PersonalGroups`.
    budget: ``bounded`` (the stream's default), ``conservative``, ``adaptive`` or ``none``.
    release_size: a group's buffer is released when it holds this many records.
    batch: records per ingest call; a group releases after the call in which its
        buffer reached `release_size`.
    reserve: False for the rule without reserve trials (`stream_trials`), for comparison.
    """

    def __init__(
        self,
        retention: float,
        lam: float,
        delta: float,
        budget: str = "bounded",
        value_map: ValueMap | None = None,
        release_size: int = 100,
        batch: int = 1,
        reserve: bool = True,
    ) -> None:
        if budget not in STREAM_BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(STREAM_BUDGETS)}, got {budget!r}")
        if release_size < 1 or batch < 1:
            raise ValueError("release_size and batch must be positive")
        # Grouping, perturbation and the audits are SPS's; the bounded budget promises at
        # most the exact limit, as adaptive does.
        self.groups = PersonalGroups(
            retention, lam, delta, "adaptive" if budget == "bounded" else budget, value_map
        )
        self.budget = budget
        self.release_size = release_size
        self.batch = batch
        self.reserve = reserve

    def __repr__(self) -> str:
        g = self.groups
        return (
            f"PersonalStream(retention={g.retention}, lam={g.lam}, delta={g.delta}, "
            f"budget={self.budget!r}, release_size={self.release_size}, batch={self.batch}, "
            f"reserve={self.reserve})"
        )

    def publish(
        self, table: Table, ids: np.ndarray, key: ServiceKey, order: np.ndarray | None = None
    ) -> PersonalRelease:
        """What the stream publishes when the rows of `table` arrive in `order` (row
        indexes; default: row order), each perturbed by its id's keyed draw."""
        if len(ids) != len(table):
            raise ValueError(f"{len(ids)} ids for {len(table)} rows")
        arrival = np.arange(len(table)) if order is None else np.asarray(order, dtype=np.int64)
        if len(arrival) != len(table) or not np.array_equal(
            np.sort(arrival), np.arange(len(table))
        ):
            raise ValueError("order must list every row once")
        g = self.groups
        name = g.sensitive_attribute(table)
        m = table.schema[name].size
        values = table.codes[name].astype(np.int64)
        group_of_row, labels = g.groups(table)
        plain = g._audit(table, group_of_row, labels)
        replay = stream_trials(
            group_of_row[arrival], values[arrival], m, self.budget, g.retention, g.lam,
            g.delta, self.release_size, self.batch, self.reserve,
        )  # fmt: skip
        perturbed = UniformPerturbation(g.retention, m).perturb(values, ids, key, name)
        published_values = np.empty(len(table), dtype=table.codes[name].dtype)
        published_values[arrival] = perturbed[arrival[replay.source]]
        sampled = np.zeros(len(table), dtype=bool)
        sampled[arrival[replay.kind == TRIAL]] = True
        trials = np.bincount(group_of_row[sampled], minlength=len(labels))
        limit = g._budget(plain, m)
        audit = GroupAudit(labels, plain.sizes, plain.max_frequency, limit, trials)
        return PersonalRelease(
            publication(table, name, published_values, ids, key), plain, audit,
            int(sampled.sum()), int((replay.kind == BORROWED).sum()), group_of_row, sampled,
        )  # fmt: skip
