"""The stream's bounded trial budget for personal groups (issue 15, item 2).

The bound (`service.core.guarantees.share_upper_bound`, `service/store/lua/bound.lua`) against
scipy's Clopper–Pearson quantile; the Lua budget on a drifting stream at a virtual
clock, where the adaptive budget overruns and the bounded one does not; and the
same drifting stream, and Adult, through the worker on the embedded servers.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import math
import time
import tomllib
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from harness import RECORDS, TIMEOUT, GroupedHops, Harness, adult_rows
from scipy import stats

from service.core.config import StreamConfig, parse_config
from service.core.guarantees import (
    budget_epoch,
    epoch_level,
    share_upper_bound,
)
from service.core.ingest import Preparer, RawMessage
from service.core.prf import ServiceKey
from service.core.privacy_tests import budget
from service.core.table import open_sample
from service.store.auditor import TrustedState
from service.store.buffer import StreamBuffer, lua_script
from streams.tools.produce import produce

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(15)
T0 = 1_700_000_000_000  # a fixed clock, advanced by hand
# The drifting stream: Adult's public values, income a fair coin in the first half and
# >50K with this chance in the second, so every large group's largest frequency moves
# from about 0.5 to about (0.5 + DRIFT) / 2 = 0.55 after its trials were planned.
DRIFT = 0.6
# A drift past the bounds' margin: the largest frequency moves to about 0.7.
SEVERE_DRIFT = 0.9
DRIFT_RECORDS = 20_000


def drifting_rows(count: int = DRIFT_RECORDS, drift: float = DRIFT, seed: int = 0) -> list[dict]:
    """Adult records in order, their income replaced by the drifting draw."""
    rng = np.random.default_rng(seed)
    with open_sample() as stream:
        rows = list(itertools.islice(csv.DictReader(stream), count))
    high = np.r_[rng.random(count // 2) < 0.5, rng.random(count - count // 2) < drift]
    return [{**row, "income": ">50K" if h else "<=50K"} for row, h in zip(rows, high, strict=True)]


def personal_config(budget_mode: str, partitions: int = 2) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / "adult-personal.toml").read_text())
    document["stream"].update(name=f"t{uuid.uuid4().hex[:8]}", partitions=partitions)
    document["personal"]["budget"] = budget_mode
    return parse_config(document, "adult-personal.toml", EXAMPLES)


async def run_lua(
    config: StreamConfig, rows: list[dict], url: str, first: int = 0, size: int = 500
) -> dict[str, dict[str, int]]:
    """Rows (raw offsets from `first`, partition = offset mod partitions) through both
    hops to personal.lua at a virtual clock, then every group released after max_wait; the
    groups' tallies the consumer's budget test reads."""
    client = aioredis.from_url(url)
    buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
    hops = GroupedHops(buffer)
    names = config.schema.names
    messages = [
        RawMessage(
            i % config.partitions, i, b"%d" % i, json.dumps({n: r[n] for n in names}).encode()
        )
        for i, r in enumerate(rows, start=first)
    ]
    now = T0 + first
    for start in range(0, len(messages), size):
        prepared, rejected = preparer.prepare(messages[start : start + size])
        assert not rejected
        for batch in prepared:
            await hops.store(batch, now)
        now += 100
    for partition in range(config.partitions):
        await buffer.ingest(partition, None, now + int(config.max_wait * 1000))
    groups = await TrustedState(client, config).personal_groups()
    await client.aclose()
    return groups


@pytest.mark.parametrize("level", [1e-3, 1e-5])
def test_share_bound_dominates_clopper_pearson(level):
    counts = np.array([0, 1, 3, 10, 25, 50, 99, 150, 380, 500, 999])
    for n in (1, 10, 100, 400, 1000, 5000):
        count = counts[counts <= n]
        bound = share_upper_bound(count, n, level)
        exact = np.where(
            count < n, stats.beta.ppf(1 - level, count + 1, np.maximum(n - count, 1)), 1
        )
        assert (bound >= exact - 1e-12).all(), (n, bound, exact)
        # Chernoff's bound is not much looser: within ln(1/α)/n plus its √ term.
        slack = math.log(1 / level) / n + math.sqrt(2 * math.log(1 / level) / n) / 4
        assert (bound <= exact + slack).all(), (n, bound - exact, slack)
    assert share_upper_bound(7, 0, level) == 1.0


@pytest.mark.redis
def test_lua_bound_is_the_python_bound(servers):
    script = lua_script("bound") + (
        "return string.format('%.17g', share_upper_bound(tonumber(ARGV[1]), "
        "tonumber(ARGV[2]), tonumber(ARGV[3])))"
    )
    cases = [
        (c, n, level)
        for n in (1, 7, 100, 256, 4096)
        for c in {0, 1, n // 3, n // 2, n - 1, n}
        for level in (1e-3 / 6, 1e-3 / 132)
    ]

    async def lua() -> list[float]:
        client = aioredis.from_url(servers.redis_url)
        out = [float(await client.eval(script, 0, c, n, repr(level))) for c, n, level in cases]
        await client.aclose()
        return out

    got = asyncio.run(lua())
    want = [float(share_upper_bound(c, n, level)) for c, n, level in cases]
    assert np.allclose(got, want, rtol=0, atol=1e-12), list(zip(cases, got, want, strict=True))


def test_epochs_share_the_level():
    assert [budget_epoch(n) for n in (1, 2, 3, 4, 1023, 1024)] == [0, 1, 1, 2, 9, 10]
    assert sum(epoch_level(e) for e in range(10_000)) == pytest.approx(1e-3, rel=1e-3)
    assert epoch_level(3) == pytest.approx(1e-3 / 20)


@pytest.mark.redis
@pytest.mark.parametrize("partitions", [1, 2])
def test_bounded_budget_absorbs_a_drift_the_adaptive_one_overruns(servers, partitions):
    """v_g = 0 for the bounded budget where adaptive leaves many groups over their limit.

    The second half moves a large group's largest frequency from about 0.5 to 0.55,
    within the margin of its bound; `test_a_drift_beyond_the_bound_freezes_its_groups`
    shows what a larger drift does."""
    rows = drifting_rows()
    outcomes = {
        mode: budget(
            personal_config(mode, partitions),
            asyncio.run(run_lua(personal_config(mode, partitions), rows, servers.redis_url)),
        )
        for mode in ("adaptive", "bounded", "conservative")
    }
    adaptive, bounded, conservative = outcomes.values()
    assert not adaptive.passed and adaptive.numbers["groups_over"] >= 10
    assert bounded.passed and bounded.numbers["v_g"] == 0 and bounded.numbers["max_exact_use"] <= 1
    assert conservative.passed
    # Safe, and far closer to the thesis's trials than f = 1.
    assert bounded.numbers["trials"] > 1.2 * conservative.numbers["trials"]


@pytest.mark.redis
def test_a_drift_beyond_the_bound_freezes_its_groups(servers):
    """The bound cannot foresee a drift past its margin: trials planned before it stay
    spent. The groups it catches are frozen and spend no trial after, however their
    frequencies move; only the conservative budget is safe under any drift."""
    rows = drifting_rows(drift=SEVERE_DRIFT)
    results = {}
    for mode in ("adaptive", "bounded", "conservative"):
        config = personal_config(mode, 1)
        results[mode] = (config, asyncio.run(run_lua(config, rows, servers.redis_url)))
    config, groups = results["bounded"]
    frozen = {g for g, tally in groups.items() if tally.get("frozen")}
    assert frozen
    adaptive, bounded, conservative = (budget(*results[m]) for m in results)
    assert conservative.passed
    assert bounded.numbers["groups_over"] < adaptive.numbers["groups_over"]
    assert bounded.numbers["max_exact_use"] < adaptive.numbers["max_exact_use"]
    # The frozen groups drift back to a fair coin: they still spend no trial.
    later = drifting_rows(drift=0.5, seed=1)
    after = asyncio.run(run_lua(config, later, servers.redis_url, first=len(rows)))
    assert all(after[g]["trials"] == groups[g]["trials"] for g in frozen)
    assert sum(after[g]["trials"] for g in after) > sum(groups[g]["trials"] for g in groups)


def worker_groups(harness: Harness, rows: list[tuple[bytes, bytes]]) -> dict:
    """Produce `rows` to a worker on the embedded servers; the groups' tallies once every
    record left its group's buffer (max_wait after the last one came in)."""
    config = harness.config
    harness.start_worker()

    async def scenario() -> dict:
        client = aioredis.from_url(config.redis_url)
        try:
            await produce(config, iter(rows), progress=False)
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                totals = await harness.totals(client)
                if totals.get("ingested", 0) == len(rows) and totals["pending"] == 0:
                    return await TrustedState(client, config).personal_groups()
                await asyncio.sleep(0.5)
            raise TimeoutError(f"{len(rows)} records sent, worker at {totals}")
        finally:
            await client.aclose()

    try:
        return asyncio.run(scenario())
    finally:
        harness.stop()


@pytest.mark.stream
@pytest.mark.parametrize(("mode", "safe"), [("bounded", True), ("adaptive", False)])
def test_drifting_stream_through_the_worker(servers, tmp_path, mode, safe):
    """The drifting stream on the real pipeline: the default budget leaves no group over
    its limit at its final frequency; the adaptive one does (so this test can fail)."""
    harness = Harness(
        servers, tmp_path, "adult-personal.toml", row_column=False, personal={"budget": mode}
    )
    names = harness.config.schema.names
    rows = [
        (f"d{i}".encode(), json.dumps({n: r[n] for n in names}).encode())
        for i, r in enumerate(drifting_rows())
    ]
    result = budget(harness.config, worker_groups(harness, rows))
    assert result.numbers["records"] == len(rows)
    if safe:
        assert result.passed and result.numbers["v_g"] == 0, result.numbers
    else:
        assert not result.passed and result.numbers["groups_over"] >= 5, result.numbers


@pytest.mark.stream
def test_adult_through_the_worker_keeps_every_group_within_its_limit(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-personal.toml", personal={"budget": "bounded"})
    rows = adult_rows(harness.config)
    result = budget(harness.config, worker_groups(harness, rows))
    assert result.numbers["records"] == RECORDS
    assert result.passed and result.numbers["v_g"] == 0, result.numbers
