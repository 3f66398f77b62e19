"""What a fingerprint set (``service/store/lua/fingerprints.lua``) costs Redis per new member
as it ages: this checkout's set and the one at --base, side by side in one run.

Each version fills its own set on an embedded Redis-protocol server
(``deploy.embedded.RedisServer``, ``appendfsync always``) with random entries of --entry
bytes (10 by default, as the identity screen stores them), in calls of --fill records. At
each age of --ages it adds --probe members more in calls of 500 (a fetch's share of one
shard) and reports, per member added: the server's CPU (utime + stime from
``/proc/<pid>/stat``), the bytes its writes rewrite (each changed bucket's field and
value, which the append-only file and replicas receive whole), and the server's memory
per member stored (``used_memory`` over the members).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from deploy.embedded import RedisServer
from service.store.buffer import lua_script

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STORE = """
local set = Fingerprints.new(KEYS[1], tonumber(ARGV[1]))
set:load_args(2, #ARGV, 1, 1)
for i = 2, #ARGV do
  local bucket, key = string.sub(ARGV[i], 1, 2), string.sub(ARGV[i], 3, 8)
  if not set:find(bucket, key) then set:add(bucket, string.sub(ARGV[i], 3)) end
end
set:store()
local written = 0
for field in pairs(set.changed) do written = written + #field + #set.buckets[field] end
return written
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def base_script(revision: str) -> str:
    """fingerprints.lua as of `revision`."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:service/store/lua/fingerprints.lua"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def add(client: redis.Redis, script, key: str, count: int, per_call: int, entry: int) -> int:
    """Add `count` random members of `entry` bytes; returns the bytes the calls rewrote."""
    written = 0
    for start in range(0, count, per_call):
        n = min(per_call, count - start)
        blob = os.urandom(n * (2 + entry))
        members = [blob[i : i + 2 + entry] for i in range(0, len(blob), 2 + entry)]
        written += script(keys=[key], args=[entry, *members])
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="00a010a", help="the other version (default 00a010a)")
    parser.add_argument(
        "--ages", default="0,1000000,4000000,8000000,16000000",
        help="members stored before each probe (default 0,1M,4M,8M,16M)",
    )  # fmt: skip
    parser.add_argument("--probe", type=int, default=20_000, help="members added per probe")
    parser.add_argument("--fill", type=int, default=5_000, help="members per filling call")
    parser.add_argument(
        "--entry", type=int, default=10,
        help="bytes per entry: the key (6) and what the set keeps with it (default 10, as the "
        "identity screen and a personal stream's grouped partitions keep)",
    )  # fmt: skip
    args = parser.parse_args()
    ages = [int(age) for age in args.ages.split(",")]
    versions = {args.base: base_script(args.base), "this checkout": lua_script("fingerprints")}
    work = Path(tempfile.mkdtemp(prefix="splu-fingerprints-"))
    server = RedisServer(work / "redis")
    server.start()
    rows = []
    try:
        client = redis.Redis.from_url(server.url)
        for name, fingerprints in versions.items():
            script = client.register_script(fingerprints + STORE)
            key = f"splu:{{age:{len(rows)}}}:seen"
            stored = 0
            for age in ages:
                add(client, script, key, age - stored, args.fill, args.entry)
                stored = age
                cpu, started = cpu_seconds(server.pid), time.perf_counter()
                grown = add(client, script, key, args.probe, 500, args.entry)
                cpu = cpu_seconds(server.pid) - cpu
                stored += args.probe
                memory = client.info("memory")["used_memory"] / stored
                rows.append((name, stored, cpu / args.probe * 1e6, grown / args.probe, memory))
                print(f"  {name}: {stored:,} members ({time.perf_counter() - started:.1f} s)")
            client.delete(key)
        client.close()
    finally:
        server.stop()
    print("version       |    members | Redis CPU µs | bytes rewritten | memory B  (per member)")
    for name, stored, cpu, grown, memory in rows:
        print(f"{name:<13} | {stored:>10,} | {cpu:>12.1f} | {grown:>15,.0f} | {memory:>8.1f}")


if __name__ == "__main__":
    main()
