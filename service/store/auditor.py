"""The privacy tests, run in the trusted zone (SPEC §3 trust boundary, §4).

Three of the privacy tests need true values: the adversary simulation scores its
reconstruction against the records' true values (the truth tallies, ``:truth:true:<e>``
and ``:truth:shown:<e>``), the budget test weighs each personal group's trials against
its true frequencies (``:gstat``), and the DP audit counts what Laplace counts would
disclose of the true records. The consumer is the web-facing process and reads no key
that holds a true value, so the worker that owns partition 0 runs every privacy test of
a decoy or personal stream here, each ``stream.report_interval``
(`streams/runtime/app.py`), and leaves the consumer what it may show (`publishable`):

- ``splu:{<stream>}:audit``: the verdicts, with the numbers an operator needs and no count
  computed from true values (below), the time, and the server's memory (the consumer may
  not run INFO, whose keyspace section counts keys);
- ``splu:{<stream>}:paused``: raised while a test listed in ``reports.fail_closed`` fails,
  cleared when it passes again.

What leaves the trusted zone (the audit record, hence ``/status``, ``/metrics``, the live
page and ``<stream>.reports``): verdicts, thresholds, p-values, shares and the sizes of what
is public anyway (public combinations and groups, records in all). Never a count of
records or cells computed from true values (how many small cells there are, how many
records a disclosing group holds): two reports a record apart would tell where that
record's true value fell.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from service.core.config import StreamConfig
from service.core.privacy_tests import (
    TestResult,
    adversary,
    budget,
    dp_audit,
    eligibility,
    guarantees,
)
from service.core.published import CellCodec
from service.store.buffer import FINAL_POOL, BufferState
from service.store.running_counts import RunningCounts

# The truth tallies of a partition and retention period, ':truth:<side>:<e>' (acknowledge.lua).
TRUTH_SIDES = ("true", "shown")
# The message a failed test leaves in the pause flag.
PAUSE_PREFIX = "privacy test failed: "
# The numbers each test may report beyond the trusted zone (module docstring).
PUBLISHABLE = {
    "eligibility": (
        "min_margin", "values_over_share", "suppressed", "suppressed_share", "margin:*",
    ),
    "guarantees": ("*",),
    "budget": (
        "groups", "records", "v_g", "v_r", "groups_over", "plain_v_g", "plain_v_r",
        "budget_use", "max_group_use", "max_exact_use", "groups_frozen", "groups_borrowing",
    ),
    "adversary": (
        "combinations", "small_within_share", "small_within_share_naive", "small_bound",
        "p_value", "large_within_share", "epsilon", "alpha",
    ),
    "dp_audit": ("epsilon", "groups", "groups_disclosing_share"),
}  # fmt: skip


def publishable(result: TestResult) -> TestResult:
    """`result` with only the numbers that may leave the trusted zone."""
    allowed = PUBLISHABLE[result.test]
    numbers = dict(result.numbers)
    if result.test == "dp_audit" and numbers.get("groups"):
        numbers["groups_disclosing_share"] = numbers["groups_disclosing"] / numbers["groups"]
    kept = {
        name: value
        for name, value in numbers.items()
        if "*" in allowed
        or name in allowed
        or any(p.endswith("*") and name.startswith(p[:-1]) for p in allowed)
    }
    return TestResult(result.test, result.passed, kept)


@dataclass(frozen=True)
class AuditInputs:
    """What the tests read: the published cells (the consumer's running counts), the truth
    tally's true and published cells, records suppressed or expired, personal groups."""

    published: dict[bytes, int]
    true: dict[bytes, int]
    shown: dict[bytes, int]
    suppressed: int
    groups: dict[str, dict[str, int]]


def run_tests(config: StreamConfig, inputs: AuditInputs) -> list[TestResult]:
    """Every privacy test of a decoy or personal stream, with all its numbers."""
    codec = CellCodec(config.schema)
    results = []
    if config.decoy is not None:
        if inputs.published:
            cells = codec.cells(inputs.published)
            results.append(eligibility(config, cells, inputs.suppressed))
        results.append(guarantees(config))
    else:
        results.append(budget(config, inputs.groups))
    truth = codec.cells(inputs.true)
    if truth.total:
        # Scored on the records acknowledged in the truth tally's retention period, as an
        # adversary holding exactly those published records would reconstruct them.
        published = config.reconstruction(codec.cells(inputs.shown))
        results.append(adversary(config, published, truth))
        if config.reports.dp_epsilon is not None and len(config.sensitive) == 1:
            results.append(dp_audit(config, truth))
    return results


class TrustedState(BufferState):
    """The keys only the trusted zone reads: tallies and aggregates of true values."""

    async def truth(self) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """The adversary test's tallies of the records the broker acknowledged in the last
        one to two `reports.truth_retention` periods, summed over partitions and the final
        pool: true cells and shown (published) cells, "public codes|sensitive codes".

        acknowledge.lua writes both tallies of a take in one step, so the two always count
        the same records."""
        tallies: dict[str, dict[bytes, int]] = {side: {} for side in TRUTH_SIDES}
        for partition in [*range(self.config.partitions), FINAL_POOL]:
            prefix = self.prefix(partition)
            epoch = await self.client.hget(f"{prefix}:stats", "truth_epoch")
            if epoch is None:
                continue
            for number in (int(epoch) - 1, int(epoch)):
                for side, tally in tallies.items():
                    cells = await self.client.hgetall(f"{prefix}:truth:{side}:{number}")
                    for cell, count in cells.items():
                        tally[cell] = tally.get(cell, 0) + int(count)
        return tallies["true"], tallies["shown"]

    async def suppressed(self) -> dict[tuple[str, str], int]:
        """Decoy records suppressed, per (attribute, value) of their true value."""
        attributes = self.config.schema.sensitive
        out: dict[tuple[str, str], int] = {}
        for partition in range(self.config.partitions):
            counts = await self.client.hgetall(f"{self.prefix(partition)}:sup")
            for field, count in counts.items():
                position, _, code = field.decode().partition(":")
                attribute = attributes[int(position) - 1]
                name = (attribute.name, attribute.domain[int(code)])
                out[name] = out.get(name, 0) + int(count)
        return out

    async def personal_groups(self) -> dict[str, dict[str, int]]:
        """Each personal group's aggregates summed over partitions: total, trials, c:<v>
        (true counts), borrowed, frozen."""
        out: dict[str, dict[str, int]] = {}
        for partition in range(self.config.partitions):
            fields = await self.client.hgetall(f"{self.prefix(partition)}:gstat")
            for field, value in fields.items():
                group, _, name = field.decode().partition("|")
                merged = out.setdefault(group, {})
                merged[name] = merged.get(name, 0) + int(value)
        return out

    async def _memory_info(self) -> list[dict[str, Any]]:
        """INFO memory of the Redis server, or of each master of a cluster."""
        if isinstance(self.client, aioredis.RedisCluster):
            nodes = await self.client.info("memory", target_nodes=aioredis.RedisCluster.PRIMARIES)
            return list(nodes.values())
        return [await self.client.info("memory")]

    async def memory(self) -> int:
        """Bytes the Redis server uses (all streams share it); in a cluster, its masters."""
        return sum(int(info["used_memory"]) for info in await self._memory_info())

    async def memory_limit(self) -> int:
        """Bytes the Redis server may use: its maxmemory or, when it sets none, the host's
        memory (a container's limit is not visible to Redis); in a cluster, its masters'."""
        return sum(
            int(info["maxmemory"]) or int(info["total_system_memory"])
            for info in await self._memory_info()
        )


class Auditor(TrustedState):
    """One stream's privacy tests in the trusted zone, and the record the consumer reads."""

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        super().__init__(client, config)
        self.counts = RunningCounts(client, config)

    async def inputs(self) -> AuditInputs:
        true, shown = await self.truth()
        totals = await self.totals()
        groups = await self.personal_groups() if self.config.personal is not None else {}
        return AuditInputs(
            published=await self.counts.tally(),
            true=true,
            shown=shown,
            # Records a record TTL removed count as suppressed: neither is published.
            suppressed=totals["suppressed"] + totals["expired"],
            groups=groups,
        )

    async def audit(self) -> list[TestResult]:
        """Run the tests, leave their publishable record for the consumer, and raise or
        clear the pause flag for the tests that fail closed. Returns the full results."""
        results = await asyncio.to_thread(run_tests, self.config, await self.inputs())
        record = {
            "time": time.time(),
            "tests": [publishable(r).to_json() for r in results],
            "redis_memory_bytes": await self.memory(),
            "redis_memory_limit_bytes": await self.memory_limit(),
        }
        await self.client.set(self.audit_key, json.dumps(record))
        closing = [
            r.test for r in results if not r.passed and r.test in self.config.reports.fail_closed
        ]
        paused = await self.paused()
        if closing:
            await self.pause(PAUSE_PREFIX + ", ".join(closing))
        elif paused is not None and paused.startswith(PAUSE_PREFIX):
            await self.pause(None)
        return results
