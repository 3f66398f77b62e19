"""The decoy cut, written twice, agrees with itself: Python's batch cut
(`service.core.mechanisms.decoy`) and the stream's Lua step (`service/store/lua/decoy.lua`,
run on the real Redis-protocol server) are fed the same ids, values and draws.

The two cannot be compared group for group as they stand, and need not be: both choose
each group's non-forced values by successive sampling proportional to bucket size, but
from different keyed uniforms (Python: `KeyedUniforms` of the service key; Lua: SHA-1 of a
secret per-partition seed and a counter that persists across calls, since a partition cuts
over many calls) and by different procedures with the same law (Python: thinning against a
snapshot of the sizes; Lua: one scan over the sizes per pick). What must agree, and is
asserted here:

- exactly: which rows are grouped (every row of an eligible set: N a multiple of γ, no
  value above N/γ), the number of groups, and the cutting rule, every cut taking γ distinct
  non-empty values including every value at its share R/γ (`assert_rule`);
- exactly: given a cut plan (each group's values, in cut order), which ids form which
  group (the k-th group holding v takes the k-th smallest id of v) and what each publishes
  (its group's sorted values at its keyed draw index): the Python assignment of the Lua
  step's own plan must rebuild the Lua step's groups and published values;
- exactly, with no plan injected: where the rule leaves no choice (γ values, each at N/γ,
  so every cut takes them all), the two partitions and published values are identical;
- in law: the share of cuts that take each value matches the successive-sampling inclusion
  probability of the state it was cut from (`inclusion_z`), for both sides;
- fed raw, a value over its share: both take its smallest ids, though the online Lua
  cut may stop a few groups short of the batch's;
- where no group can be cut (fewer than γ distinct values) neither groups a record, and the
  Lua step suppresses them all once they waited past max_wait.
"""

from __future__ import annotations

import asyncio
import tomllib
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from scipy.stats import norm

from service.core.config import parse_config
from service.core.ingest import PreparedBatch, RawMessage
from service.core.mechanisms import decoy
from service.core.mechanisms.decoy import DecoyGroups
from service.core.prf import ServiceKey, random_ids
from service.core.wire import PoolEntry
from service.store.buffer import StreamBuffer

# Talks to a Redis-protocol server: .ci/run repeats these against Debian's redis-server.
pytestmark = pytest.mark.redis

EXAMPLE = Path(__file__).parents[1] / "deploy" / "examples" / "adult-decoy.toml"
KEY = ServiceKey.from_seed(34)
PURPOSE = "occupation"
T0 = 1_700_000_000_000
GAMMA = 5
# Sizes: one group, the fewest records a take may mix (10 groups), the example's mixing
# pool floor, and several thousand.
SIZES = (GAMMA, 10 * GAMMA, 1000, 5000)


class LuaCut:
    """What one Lua step made of a batch: its groups in cut order (each a tuple of
    (values, member ids)), each grouped id's published value, and how many records it
    suppressed once they had waited past max_wait."""

    def __init__(self, entries: list[bytes], suppressed: int) -> None:
        members: dict[int, list[bytes]] = defaultdict(list)
        listed: dict[int, tuple[int, ...]] = {}
        self.published: dict[bytes, int] = {}
        for entry in map(PoolEntry.parse, entries):
            number, _, values = entry.audit.partition(b":")
            members[int(number)].append(entry.id)
            listed[int(number)] = tuple(int(v) for v in values.split(b","))
            self.published[entry.id] = int(entry.published)
        self.groups = [(listed[number], members[number]) for number in sorted(members)]
        self.suppressed = suppressed

    def plan(self) -> np.ndarray:
        return np.asarray([values for values, _ in self.groups], dtype=np.int64)


def id_hex(ids: np.ndarray) -> list[bytes]:
    return PreparedBatch(partition=0, ids=ids).id_bytes()


def lua_cut(redis_url: str, gamma: int, ids: np.ndarray, values: np.ndarray) -> LuaCut:
    """Run the real Lua step on one batch of (ids, values), with the draws the worker
    computes, then a timer tick past max_wait."""
    document = tomllib.loads(EXAMPLE.read_text())
    document["stream"].update(name=f"p{uuid.uuid4().hex[:8]}", partitions=1)
    document["decoy"]["gamma"] = gamma
    config = parse_config(document, EXAMPLE.name, EXAMPLE.parent)
    n = len(values)
    batch = PreparedBatch(
        partition=0,
        messages=[RawMessage(0, offset, None, None) for offset in range(n)],
        ids=ids,
        public=[b"0"] * n,
        sensitive=values.reshape(-1, 1),
        draws=DecoyGroups(gamma).draws(ids, KEY, PURPOSE).reshape(-1, 1),
    )

    async def scenario() -> LuaCut:
        client = aioredis.from_url(redis_url)
        buffer = StreamBuffer(client, config, KEY)
        outcome = await buffer.ingest(0, batch, T0)
        assert set(outcome.statuses) <= {0}
        entries = await client.hvals(f"{buffer.prefix(0)}:pool")
        await buffer.ingest(0, None, T0 + int(config.max_wait * 1000) + 1)
        suppressed = (await buffer.stats(0))["suppressed"]
        await client.aclose()
        return LuaCut(entries, suppressed)

    return asyncio.run(scenario())


def python_groups(
    gamma: int, ids: np.ndarray, values: np.ndarray, monkeypatch=None, plan=None
) -> tuple[list[tuple[tuple[int, ...], list[bytes]]], dict[bytes, int]]:
    """Python's groups (sorted values, member ids) in cut order and each id's published
    value; with `plan`, the cut's values are Lua's and only the assignment is Python's."""
    mechanism = DecoyGroups(gamma)
    if plan is not None:
        monkeypatch.setattr(decoy, "_size_weighted_cuts", lambda counts, gamma, uniforms: plan)
    groups = mechanism.group(ids, values, KEY, PURPOSE)
    published = mechanism.randomize(groups, values, ids, KEY, PURPOSE)
    names = id_hex(ids)
    listed = [
        (tuple(sorted(values[row].tolist())), [names[i] for i in row]) for row in groups.tolist()
    ]
    return listed, {names[i]: int(published[i]) for i in range(len(ids))}


def partition_of(groups: list[tuple[tuple[int, ...], list[bytes]]]) -> set[frozenset[bytes]]:
    return {frozenset(members) for _, members in groups}


def eligible(gamma: int, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    kept, _, _ = DecoyGroups(gamma).eligible_rows(ids, {PURPOSE: values})
    return ids[kept], values[kept]


def values_of(distribution: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sensitive codes for `n` records, drawn by a named law over 8 to 10 values."""
    if distribution == "uniform":
        return rng.integers(0, 8, n)
    if distribution == "skewed":
        weights = 1 / np.arange(1, 11) ** 1.2
        return rng.choice(10, n, p=weights / weights.sum())
    if distribution == "dominant":
        # One value above its share 1/γ: eligibility keeps exactly its share.
        return np.where(rng.random(n) < 0.5, 0, rng.integers(1, 9, n))
    raise ValueError(distribution)


def assert_rule(plan: np.ndarray, values: np.ndarray, gamma: int) -> None:
    """Each cut takes γ distinct non-empty values, among them every value at its share."""
    counts = np.bincount(values, minlength=int(values.max()) + 1)
    remaining = len(values)
    for cut in plan.tolist():
        assert len(set(cut)) == gamma and all(counts[v] > 0 for v in cut)
        forced = set(np.flatnonzero(counts * gamma >= remaining).tolist())
        assert forced <= set(cut), (forced, cut)
        counts[cut] -= 1
        remaining -= gamma
    assert remaining == 0 and not counts.any()


def inclusion(sizes: np.ndarray, forced: np.ndarray, picks: int) -> np.ndarray:
    """P(value in the cut) when `picks` values are added to `forced` one at a time, each
    with probability proportional to its size among the non-empty values not yet in.

    Exact, by the chance of each unordered set of picks: the next pick from a set S
    depends on S alone, P(v | S) = s_v / (W − s(S)), so the sets' chances add up level
    by level (at most C(V, γ) sets).
    """
    candidates = [v for v in np.flatnonzero(sizes).tolist() if not forced[v]]
    total = float(sizes[candidates].sum())
    level: dict[frozenset[int], float] = {frozenset(): 1.0}
    for _ in range(picks):
        following: dict[frozenset[int], float] = defaultdict(float)
        for chosen, chance in level.items():
            left = total - sum(sizes[v] for v in chosen)
            for v in candidates:
                if v not in chosen:
                    following[chosen | {v}] += chance * sizes[v] / left
        level = following
    out = forced.astype(float)
    for chosen, chance in level.items():
        for v in chosen:
            out[v] += chance
    return out


def inclusion_z(plan: np.ndarray, values: np.ndarray, gamma: int) -> np.ndarray:
    """Per value, (cuts taking it − Σ its inclusion probabilities) / √Σ p(1 − p), over
    the plan's cuts, each probability given the state before its cut. The terms are
    martingale differences with those conditional variances, so each z is approximately
    standard normal if the plan follows the successive-sampling law."""
    counts = np.bincount(values, minlength=int(values.max()) + 1).astype(float)
    remaining = len(values)
    excess = np.zeros(len(counts))
    variance = np.zeros(len(counts))
    for cut in plan.tolist():
        forced = (counts > 0) & (counts * gamma >= remaining)
        p = inclusion(counts, forced, gamma - int(forced.sum()))
        taken = np.zeros(len(counts))
        taken[cut] = 1
        excess += taken - p
        variance += p * (1 - p)
        counts[cut] -= 1
        remaining -= gamma
    informative = variance > 0
    return excess[informative] / np.sqrt(variance[informative])


CASES = [
    (distribution, n)
    for distribution in ("uniform", "skewed", "dominant")
    for n in SIZES
    if not (distribution != "uniform" and n == GAMMA)  # one group: uniform covers it
]


@pytest.mark.parametrize(("distribution", "n"), CASES)
def test_lua_and_python_group_the_same_rows_by_the_same_rule(servers, monkeypatch, distribution, n):
    rng = np.random.default_rng(n)
    ids, values = random_ids(n, KEY), values_of(distribution, n, rng)
    if n == GAMMA:
        values = rng.permutation(GAMMA)
    ids, values = eligible(GAMMA, ids, values)
    assert len(values) >= GAMMA
    lua = lua_cut(servers.redis_url, GAMMA, ids, values)
    python, _ = python_groups(GAMMA, ids, values)

    assert lua.suppressed == 0
    assert len(lua.groups) == len(python) == len(values) // GAMMA
    assert set(lua.published) == set(id_hex(ids))
    assert_rule(lua.plan(), values, GAMMA)
    assert_rule(np.asarray([v for v, _ in python]), values, GAMMA)

    # Lua's own plan, assigned and randomized by Python: the same groups, the same values.
    replayed, published = python_groups(GAMMA, ids, values, monkeypatch, lua.plan())
    assert [(tuple(v), sorted(m)) for v, m in lua.groups] == [(v, sorted(m)) for v, m in replayed]
    assert lua.published == published


def test_a_plan_without_choices_gives_identical_groups(servers):
    """γ values with N/γ records each: every cut must take all γ, so the two sides owe the
    same partition and the same published values, with nothing injected."""
    rng = np.random.default_rng(7)
    n = 600
    ids, values = random_ids(n, ServiceKey.from_seed(8)), rng.permutation(np.arange(n) % GAMMA)
    lua = lua_cut(servers.redis_url, GAMMA, ids, values)
    python, published = python_groups(GAMMA, ids, values)
    assert partition_of(lua.groups) == partition_of(python)
    assert lua.published == published
    assert len(set(published.values())) == GAMMA


def test_both_cut_by_the_successive_sampling_law(servers):
    """Each side's plan over several thousand records, for γ = 3 and 5 and two laws of
    values: every value's z (`inclusion_z`) within the two-sided normal quantile that
    leaves 10⁻³ to the whole family of z's (Bonferroni)."""
    runs = []
    for gamma, distribution in ((3, "uniform"), (5, "skewed"), (5, "dominant")):
        rng = np.random.default_rng(gamma)
        n = 6000
        ids, values = eligible(gamma, random_ids(n, KEY), values_of(distribution, n, rng))
        lua = lua_cut(servers.redis_url, gamma, ids, values)
        python = DecoyGroups(gamma).group(ids, values, KEY, PURPOSE)
        for plan in (lua.plan(), values[python]):
            runs.append(inclusion_z(plan, values, gamma))
    family = sum(len(z) for z in runs)
    bound = norm.isf(1e-3 / (2 * family))
    for z in runs:
        assert np.abs(z).max() < bound, (z, bound)


def test_neither_side_groups_values_that_cannot_fill_a_group(servers):
    """γ − 1 distinct values: no cut is possible. Python's eligibility keeps no row; the
    Lua step groups none and suppresses all once they waited past max_wait."""
    n = 200
    ids, values = random_ids(n, KEY), np.arange(n) % (GAMMA - 1)
    kept, _, _ = DecoyGroups(GAMMA).eligible_rows(ids, {PURPOSE: values})
    assert not kept.any()
    lua = lua_cut(servers.redis_url, GAMMA, ids, values)
    assert lua.groups == [] and lua.suppressed == n


@pytest.mark.parametrize("n", SIZES[1:])
def test_a_value_over_its_share_is_cut_from_its_smallest_ids_on_both_sides(servers, n):
    """Half the records hold one value, fed raw. The batch cut keeps that value's
    smallest ids up to its share and trims N to a multiple of γ from the largest ids;
    the stream cuts while γ values wait, the value in every group (it stays at or over
    its share), and leaves the rest waiting (later arrivals could still group them),
    then suppresses them past max_wait. So the group counts may differ, but on both
    sides the value's grouped ids are its smallest, and no record is lost."""
    rng = np.random.default_rng(n)
    ids, values = random_ids(n, KEY), values_of("dominant", n, rng)
    kept, _, _ = DecoyGroups(GAMMA).eligible_rows(ids, {PURPOSE: values})
    lua = lua_cut(servers.redis_url, GAMMA, ids, values)
    names = np.asarray(id_hex(ids))
    dominant = sorted(names[values == 0].tolist())
    grouped = {m for _, members in lua.groups for m in members}
    lua_dominant = sorted(grouped & set(dominant))
    python_dominant = sorted(names[kept & (values == 0)].tolist())
    assert lua.groups and all(0 in group for group, _ in lua.groups)
    assert lua_dominant == dominant[: len(lua.groups)]
    assert python_dominant == dominant[: len(python_dominant)]
    # Each group takes γ − 1 records of the other values.
    assert len(lua.groups) <= (n - len(dominant)) // (GAMMA - 1)
    assert lua.suppressed == n - GAMMA * len(lua.groups)
