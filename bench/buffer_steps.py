"""Redis CPU and worker CPU per record of each step of the stream's buffer.

Drives the worker's steps directly on an embedded Redis-protocol server
(``deploy.embedded.RedisServer``, ``appendfsync always``), with no broker and no worker
process, so each step's cost stands alone: --records Adult records resampled with
replacement (seed 0), decoy groups (``deploy/examples/adult-decoy.toml``), --partitions
partitions, fetches of --fetch records. Per fetch: ``Preparer.prepare`` (worker CPU),
the gate and the identity screen (``Lifecycle``), then per partition the ingest step,
every take it allows (``StreamBuffer.take``, limit 20,000) and its acknowledgement, as
the emission round does. Per step, per record: wall time, the CPU of this process (the
worker's part: Python, the client's encoding and parsing) and the server process's CPU
(utime + stime from ``/proc/<pid>/stat``).

--checkout DIR imports ``service`` and ``deploy`` from another checkout (e.g. a
``git worktree`` of an earlier commit), so two versions can be measured side by side by
the same script: run it alternately with and without --checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import inspect
import os
import secrets
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

STEPS = ("prepare", "gate", "screen", "ingest", "take", "acknowledge")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TAKE_LIMIT = 20_000


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def measure(args: argparse.Namespace) -> dict[str, tuple[float, float, float]]:
    import tomli_w

    from deploy.embedded import RedisServer
    from service.core.config import load_config
    from service.core.ingest import Preparer, RawMessage
    from service.core.table import open_sample
    from service.store.buffer import StreamBuffer, connect
    from service.store.lifecycle import Lifecycle

    work = Path(tempfile.mkdtemp(prefix="splu-steps-"))
    server = RedisServer(work / "redis")
    server.start()
    try:
        examples = Path(__file__).resolve().parents[1] / "deploy" / "examples"
        document = tomllib.loads((examples / "adult-decoy.toml").read_text())
        document["stream"].update(name="steps", partitions=args.partitions)
        document["redis"]["url"] = server.url
        path = work / "steps.toml"
        path.write_text(tomli_w.dumps(document))
        os.environ.setdefault("SPLU_SERVICE_KEY", secrets.token_hex(32))
        config = load_config(path)
        key = config.service_key()
        with open_sample() as stream:
            rows = list(csv.DictReader(stream))
        chosen = np.random.default_rng(0).integers(0, len(rows), args.records)
        names = config.schema.names
        import json

        messages = [
            (f"steps:{i}".encode(), json.dumps({n: rows[j][n] for n in names}).encode())
            for i, j in enumerate(chosen.tolist())
        ]
        preparer = Preparer(config, key)
        # As the worker freezes what its start-up made (`streams.runtime.process`): the
        # inputs built here are no part of a step's cost.
        gc.collect()
        gc.freeze()
        # The worker's own client: its encoder is part of the worker's cost.
        client = connect(config)
        buffer, lifecycle = StreamBuffer(client, config, key), Lifecycle(client, config)
        # A checkout before the screen was told what its buffers handled screens without it.
        screens_handled = "handled" in inspect.signature(lifecycle.screen).parameters
        handled: dict[int, int] = {}
        wall = dict.fromkeys(STEPS, 0.0)
        worker_cpu = dict.fromkeys(STEPS, 0.0)
        server_cpu = dict.fromkeys(STEPS, 0.0)

        @contextmanager
        def timed(step: str) -> Iterator[None]:
            started, cpu = time.perf_counter(), cpu_seconds(server.pid)
            own = time.process_time()
            yield
            wall[step] += time.perf_counter() - started
            worker_cpu[step] += time.process_time() - own
            server_cpu[step] += cpu_seconds(server.pid) - cpu

        now = 1_000_000
        for start in range(0, args.records, args.fetch):
            raw = [
                RawMessage(i % args.partitions, i // args.partitions, k, v)
                for i, (k, v) in enumerate(messages[start : start + args.fetch], start)
            ]
            with timed("prepare"):
                batches, rejected = preparer.prepare(raw)
            if rejected:
                raise SystemExit(f"rejected: {rejected[0].rejection}")
            highest: dict[int, int] = {}
            for m in raw:
                highest[m.partition] = max(highest.get(m.partition, -1), m.offset)
            with timed("gate"):
                await lifecycle.gate(highest)
            with timed("screen"):
                if screens_handled:
                    await lifecycle.screen(batches, handled)
                else:
                    await lifecycle.screen(batches)
            for batch in batches:
                with timed("ingest"):
                    await buffer.ingest(batch.partition, batch, now, highest[batch.partition])
                handled[batch.partition] = highest[batch.partition]
                with timed("take"):
                    items = await buffer.take(batch.partition, now, TAKE_LIMIT)
                # An earlier buffer acknowledges tokens, this one takes.
                acknowledged = items if hasattr(items, "takes") else [t for t, _ in items]
                with timed("acknowledge"):
                    await buffer.acknowledge(batch.partition, acknowledged, now)
            now += 100
        await client.aclose()
        return {
            s: (wall[s] / args.records, worker_cpu[s] / args.records, server_cpu[s] / args.records)
            for s in STEPS
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Wall time, worker CPU and Redis CPU per record of each step of the "
        "stream's buffer "
        "(prepare, gate, screen, ingest, take, acknowledge) on an embedded server."
    )
    parser.add_argument("--records", type=int, default=40_000, help="records (default 40000)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions (default 4)")
    parser.add_argument("--fetch", type=int, default=2_000, help="records per fetch (default 2000)")
    parser.add_argument(
        "--checkout", type=Path, help="import service and deploy from this checkout instead"
    )
    args = parser.parse_args()
    if min(args.records, args.partitions, args.fetch) < 1:
        parser.error("--records, --partitions and --fetch must be positive")
    root = (args.checkout or Path(__file__).resolve().parents[1]).resolve()
    sys.path.insert(0, str(root))
    print(
        f"{args.records:,} records, {args.partitions} partitions, fetches of {args.fetch:,}; "
        f"code from {root}"
    )
    results = asyncio.run(measure(args))
    header = ("wall µs/record", "worker CPU µs/record", "Redis CPU µs/record")

    def row(name: str, times: Iterable[float]) -> str:
        cells = (f"{t * 1e6:{len(h)}.1f}" for t, h in zip(times, header, strict=True))
        return f"{name:12} | " + " | ".join(cells)

    print(f"{'step':12} | " + " | ".join(header))
    for step, times in results.items():
        print(row(step, times))
    print(row("all", [sum(times[k] for times in results.values()) for k in range(3)]))


if __name__ == "__main__":
    main()
