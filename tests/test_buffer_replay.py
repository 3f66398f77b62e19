"""The buffer of this checkout publishes what the buffer before issue 35 published
(`replay_buffer`), in the regimes users live in: a burst of thousands, and a slow survey
on a virtual clock whose records wait past max_wait and for the pool's floor. From the
same records and clock:

- the same takes, by size and in order: the mixing rule, not the draw, decides them;
- the same randomized records (public and published codes), published over the run or
  left in a pool below its floor: the groups and every randomized value come from keyed
  draws, which no change of the take may alter;
- the same counters.

Which records a take draws, and their order, may differ: the take's shuffle may use its
fresh seed otherwise (uniformity is tested in test_buffer.py and test_grouping_leak.py).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from harness import Harness, adult_rows, buffer_steps
from replay_buffer import replay_both

pytestmark = pytest.mark.redis

COUNTERS = ("ingested", "published", "suppressed", "pool", "pending", "in_flight", "groups")


def seeded(seed: int):
    def entropy():
        generator = random.Random(seed)
        return lambda n: generator.randbytes(n).hex()

    return entropy


@pytest.mark.parametrize(
    ("records", "per_step", "step_ms", "max_wait"),
    [(4_000, 500, 200, 3.0), (1_500, 3, 20_000, 600.0)],
    ids=["burst", "slow survey"],
)
def test_the_new_buffer_publishes_what_the_old_one_did(
    servers, tmp_path, records, per_step, step_ms, max_wait
):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    config = replace(harness.config, max_wait=max_wait)
    key = config.service_key()
    rows = adult_rows(config)[:records]
    steps = buffer_steps(config, rows, per_step, step_ms, ticks=10)

    async def run():
        client = aioredis.from_url(config.redis_url)
        try:
            return await replay_both(client, config, key, steps, seeded(11), tmp_path / "old")
        finally:
            await client.aclose()

    old_takes, new_takes, old_pooled, new_pooled, old_totals, new_totals = asyncio.run(run())
    assert old_takes, "nothing was published: the replay compares nothing"
    assert [len(take) for take in new_takes] == [len(take) for take in old_takes]
    assert Counter(r for take in new_takes for r in take) + Counter(new_pooled) == Counter(
        r for take in old_takes for r in take
    ) + Counter(old_pooled)
    assert {c: new_totals[c] for c in COUNTERS} == {c: old_totals[c] for c in COUNTERS}
