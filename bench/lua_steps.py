"""Redis's cost per record of two Lua steps, this checkout's scripts against another
revision's, side by side on one embedded server.

- **acknowledge**: ``acknowledge.lua`` forgetting one take of --take entries a call (the
  worker's ``acknowledgement`` arguments; entries with seeded random codes, nearly one
  truth cell each), --calls calls a round.
- **screen**: ``identity.lua`` (with ``fingerprints.lua``) screening --take fresh random
  fingerprints a call, read evenly from --partitions raw partitions, against a set first
  filled with --members members, --calls calls a round; a side whose screen is told what
  its buffers handled is told each partition's offsets up to the call before.

Each round runs both sides, alternately, on keys of their own, on the embedded
Redis-protocol server (``deploy.embedded.RedisServer``, ``appendfsync always``). Per side
and round: the server's CPU (utime + stime from ``/proc/<pid>/stat``) and, from
``INFO commandstats``, the scripts' time and the part of it outside the commands they
call (the Lua interpreter), each per record. Medians over --rounds rounds.

    .venv/bin/python bench/lua_steps.py --base 29090cc
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from deploy.embedded import RedisServer  # noqa: E402
from service.store.buffer import acknowledgement  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
COMMANDS = ("hmget", "hset", "hget", "hdel", "hincrby", "pexpire", "unlink")
NOW = 1_795_000_000_000


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def script_source(revision: str | None, names: list[str]) -> str:
    """The scripts `names`, concatenated, from this checkout or from `revision`."""
    out = []
    for name in names:
        path = f"service/store/lua/{name}.lua"
        if revision is None:
            out.append((ROOT / path).read_text())
        else:
            shown = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{revision}:{path}"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            out.append(shown.stdout)
    return "".join(out)


def entries(rng: random.Random, count: int) -> list[bytes]:
    """Pool entries with seeded random codes: nearly every one its own truth cell."""
    out = []
    for i in range(count):
        public = b"%d,%d,%d,%d" % tuple(rng.randrange(n) for n in (5, 9, 16, 7))
        published, true = rng.randrange(14), rng.randrange(14)
        audit = b"%d:1,2,3,4,5" % (i // 5)
        record_id = b"%032x" % rng.getrandbits(128)
        out.append(b"%b|%d|%b|%d|%d|%b" % (public, published, audit, true, NOW, record_id))
    return out


class Screen:
    """identity.lua's arguments: fresh random fingerprints read evenly from `partitions` raw
    partitions, and, for a script told what its buffers handled (`told_handled`), each
    partition's offsets up to the call before as handled."""

    def __init__(self, rng: random.Random, partitions: int, told_handled: bool) -> None:
        self.rng, self.told_handled = rng, told_handled
        self.offsets = [0] * partitions

    def args(self, count: int) -> list[bytes | int]:
        records: list[bytes] = []
        partitions: list[bytes | int] = []
        share = count // len(self.offsets)
        for partition, first in enumerate(self.offsets):
            raw = partition.to_bytes(2, "big")
            records += [
                self.rng.randbytes(12) + raw + o.to_bytes(6, "big")
                for o in range(first, first + share)
            ]
            partitions += [raw, first + share - 1, *([first - 1] if self.told_handled else [])]
            self.offsets[partition] = first + share
        return [b"".join(records), *partitions]


async def measure(args: argparse.Namespace) -> dict[str, dict[str, list[tuple[float, ...]]]]:
    server = RedisServer(Path(tempfile.mkdtemp(prefix="splu-lua-steps-")) / "redis")
    server.start()
    client = aioredis.from_url(server.url)
    try:
        sides = {"base": args.base, "this": None}
        acknowledge = {
            side: client.register_script(script_source(rev, ["acknowledge"]))
            for side, rev in sides.items()
        }
        sources = {
            side: script_source(rev, ["fingerprints", "identity"]) for side, rev in sides.items()
        }
        screen = {side: client.register_script(source) for side, source in sources.items()}
        rng = random.Random(0)
        fingerprints = {
            side: Screen(random.Random(side), args.partitions, ":handled" in source)
            for side, source in sources.items()
        }
        for side in sides:
            for _ in range(args.members // args.take):
                await screen[side](keys=[f"s{side}"], args=fingerprints[side].args(args.take))

        async def acknowledging(side: str) -> None:
            take = f"{rng.getrandbits(128):032x}"
            await client.hset(f"a{side}:takes", take, b"x")
            arguments = [NOW, 86_400_000, *acknowledgement(take, entries(rng, args.take), NOW)]
            await acknowledge[side](keys=[f"a{side}"], args=arguments)

        async def screening(side: str) -> None:
            await screen[side](keys=[f"s{side}"], args=fingerprints[side].args(args.take))

        steps: dict[str, Callable[[str], Awaitable[None]]] = {
            "acknowledge": acknowledging,
            "screen": screening,
        }
        results: dict[str, dict[str, list[tuple[float, ...]]]] = {}
        for round_number in range(args.rounds):
            print(f"round {round_number + 1} of {args.rounds}", file=sys.stderr)
            for step, run in steps.items():
                for side in sides:
                    await client.config_resetstat()
                    started = cpu_seconds(server.pid)
                    for _ in range(args.calls):
                        await run(side)
                    records = args.calls * args.take
                    used = cpu_seconds(server.pid) - started
                    stats = await client.info("commandstats")
                    script = stats["cmdstat_evalsha"]["usec"]
                    commands = sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in COMMANDS)
                    per_record = (used * 1e6 / records, script / records)
                    per_record += ((script - commands) / records,)
                    results.setdefault(step, {}).setdefault(side, []).append(per_record)
        return results
    finally:
        await client.aclose()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Redis CPU per record of acknowledge.lua and of the identity screen, "
        "this checkout's scripts against another revision's, side by side."
    )
    parser.add_argument("--base", required=True, help="the revision to compare (git rev)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--calls", type=int, default=100, help="calls per round (default 100)")
    parser.add_argument("--take", type=int, default=2_000, help="records a call (default 2000)")
    parser.add_argument(
        "--partitions", type=int, default=1,
        help="raw partitions a screening call's records come from (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--members", type=int, default=300_000, help="screen set's first members (300000)"
    )
    args = parser.parse_args()
    if min(args.rounds, args.calls, args.take) < 1 or args.members < 0:
        parser.error("--rounds, --calls and --take must be positive, --members not negative")
    if not 1 <= args.partitions <= args.take:
        parser.error("--partitions must be from 1 to --take")
    results = asyncio.run(measure(args))
    print(
        f"{args.calls} calls of {args.take:,} records a round ({args.partitions} raw "
        f"partitions a screening call), {args.rounds} rounds; "
        f"base {args.base}, this {ROOT}"
    )
    header = "step        | side | Redis CPU µs/rec | script µs/rec | Lua outside commands µs/rec"
    print(header)
    for step, sides in results.items():
        for side, rounds in sides.items():
            medians = [statistics.median(r[k] for r in rounds) for k in range(3)]
            print(
                f"{step:11} | {side:4} | {medians[0]:16.2f} | {medians[1]:13.2f} | "
                f"{medians[2]:27.2f}"
            )


if __name__ == "__main__":
    main()
