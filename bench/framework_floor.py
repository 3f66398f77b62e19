"""The worker's framework floor: the anchor stage beside Faust stages built from the worker's
own Kafka parts, with no privacy work, so a pipeline figure can be split into what the
framework costs and what the worker's own per-record work costs.

Each round, on the embedded servers (``deploy.embedded``) and on fresh topics of --partitions
partitions, --records records resampled from the bundled UCI Adult sample (seed --seed) are
produced to a raw topic and then copied to a published topic by one stage, a child process
(this file with --run-stage):

- **anchor**: ``bench/stream_throughput.py``'s plain aiokafka stage (getmany, ``json.loads``
  and compact ``json.dumps`` per record, send_batch, commit);
- **faust, bytes**: a Faust app made as the worker's is (``streams.runtime.app.faust_app``),
  whose raw topic goes through ``consume_in_bulk`` (the worker's bulk consumer: its consumer
  thread, GuardedRecords' batch checks, a fetch handled while the one before it is, a commit
  per fetch) to the worker's ``Publisher.send_all``, each value sent as it came;
- **faust, json**: the same, each value decoded and re-encoded as the anchor does.

Throughput is N / (last − first CreateTime on the published topic), as for the anchor in
``bench/stream_throughput.py``: group joins are left out. CPU per record is the stage's and
the broker's utime + stime over the same clock. The stages run one after another in each
round, so the machine's drift hits them alike; the table gives each round and the medians.

Run from the repository root:

    .venv/bin/python bench/framework_floor.py                # 5 rounds, ~3 minutes
    .venv/bin/python bench/framework_floor.py --records 5000 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from aiokafka.structs import ConsumerRecord
from report import log, print_table
from stream_throughput import (
    Capacity,
    adult_rows,
    anchor_capacity,
    anchor_progress_path,
    copying_capacity,
    messages_of,
    resample,
    stream_document,
    write_config,
)

from deploy.embedded import EmbeddedServers, stream_env
from service.core.config import StreamConfig, load_config

STAGES = ("bytes", "json")  # what a Faust stage does to each value


def copied(records: Iterable[ConsumerRecord], stage: str) -> Iterable[tuple[bytes, bytes]]:
    """The (key, value) a Faust stage sends for each fetched record."""
    if stage == "json":
        return (
            (r.key, json.dumps(json.loads(r.value), separators=(",", ":")).encode())
            for r in records
        )
    return ((r.key, r.value) for r in records)


def run_faust_stage(config: StreamConfig, stage: str) -> None:
    """Copy raw to published through the worker's Faust parts until stopped, writing the
    anchor's "fetched done" progress lines."""
    from streams.runtime.app import app_publisher, faust_app, stream_topic
    from streams.runtime.bulk import consume_in_bulk
    from streams.runtime.process import StreamWorker

    topic = config.topics["published"]
    fetched = sent = 0
    with (
        tempfile.TemporaryDirectory(prefix="splu-floor-") as datadir,
        anchor_progress_path(config.source).open("w") as progress,
    ):
        app = faust_app(config, f"bench-floor-{config.name}", Path(datadir))
        publisher = app_publisher(app, config)

        async def handle(fetch: Mapping[object, list[ConsumerRecord]]) -> None:
            nonlocal fetched, sent
            records = [record for records in fetch.values() for record in records]
            fetched += len(records)
            progress.write(f"{fetched} {sent}\n")
            progress.flush()
            # The bulk consumer handles two fetches at once: either may finish first, so the
            # count is read only after the send (`sent += await ...` would read it before).
            count = await publisher.send_all(topic, copied(records, stage))
            sent += count
            progress.write(f"{fetched} {sent}\n")
            progress.flush()

        consume_in_bulk(app, handle, stream_topic(app, config, "raw"))
        StreamWorker(app, loglevel="warning", quiet=True).execute_from_commandline()


def cpu_usec(capacity: Capacity, process: str) -> float:
    return capacity.cpu.get(process, 0.0) / capacity.records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(
            "The anchor stage beside Faust stages built from the worker's Kafka parts (bulk "
            "consumer, publisher) doing no privacy work: throughput and CPU per record, "
            "side by side in each round."
        ),
    )
    parser.add_argument(
        "--records", type=int, default=200_000, help="records per stage (default 200000)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all stages (default 5)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the records (default 0)")
    parser.add_argument(
        "--run-stage",
        nargs=2,
        metavar=("CONFIG", "STAGE"),
        help="internal: run a Faust stage (started by the benchmark itself)",
    )
    args = parser.parse_args()
    if args.run_stage:
        run_faust_stage(load_config(args.run_stage[0]), args.run_stage[1])
        return
    if min(args.records, args.rounds, args.partitions) < 1:
        parser.error("--records, --rounds and --partitions must be positive")

    rows = adult_rows()
    records = resample(rows, args.records, np.random.default_rng(args.seed))
    results: list[dict[str, Capacity]] = []
    with tempfile.TemporaryDirectory(prefix="splu-bench-") as directory:
        work = Path(directory)
        with EmbeddedServers(work / "servers") as servers:
            env = stream_env(servers)
            os.environ.update(env)

            def config(name: str) -> StreamConfig:
                document = stream_document(
                    name, servers.kafka_bootstrap, servers.redis_url, args.partitions, 5.0
                )
                return write_config(document, work)

            for round_ in range(args.rounds):
                log(f"round {round_ + 1} of {args.rounds}")
                anchor_config = config(f"floor-anchor-{round_}")
                messages = messages_of(records, anchor_config.schema.names)
                measured = {
                    "anchor": asyncio.run(
                        anchor_capacity(anchor_config, messages, env, work, servers)
                    )
                }
                for stage in STAGES:
                    stage_config = config(f"floor-{stage}-{round_}")
                    command = [
                        sys.executable, str(Path(__file__).resolve()), "--run-stage",
                        stage_config.source, stage,
                    ]  # fmt: skip
                    measured[f"faust, {stage}"] = asyncio.run(
                        copying_capacity(
                            stage_config, messages, command, "stage", env, work, servers
                        )
                    )
                results.append(measured)

    print(
        f"\nFramework floor: {args.records:,} Adult records per stage, {args.partitions} "
        f"partitions, {args.rounds} rounds; embedded tansu broker"
    )
    rows_out = []
    for name in results[0]:
        ratios = [r[name].throughput / r["anchor"].throughput for r in results]
        stage_cpu = [
            cpu_usec(r[name], "anchor stage" if name == "anchor" else "stage") for r in results
        ]
        rows_out.append(
            [
                name,
                ", ".join(f"{r[name].throughput:,.0f}" for r in results),
                ", ".join(f"{x:.2f}" for x in ratios)
                + f" (median {statistics.median(ratios):.2f})",
                ", ".join(f"{x:.1f}" for x in stage_cpu)
                + f" (median {statistics.median(stage_cpu):.1f})",
                f"{statistics.median(cpu_usec(r[name], 'broker') for r in results):.1f}",
            ]
        )
    print_table(
        ["stage", "records/s", "/ anchor", "stage CPU µs per record", "broker µs (median)"],
        rows_out,
    )


if __name__ == "__main__":
    main()
