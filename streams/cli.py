"""The ``splu`` entry point: the batch commands of `service/cli/batch.py` and the stream's own,
``splu demo``, ``run``, ``close``, ``skip``, ``up``, ``worker``, ``consumer`` and
``produce``.

Each stream command imports its module when it runs: the batch commands start without Kafka
and Faust, and start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from service.cli import batch as cli
from service.cli.commands.common import FORMATTER, CommandError, Commands, add_delimiter_option
from service.core.config import load_config
from service.core.kafka_settings import KafkaSettings
from service.core.manifest import Publication
from service.core.mechanisms.registry import DEFAULT_MECHANISM, STREAM_MECHANISMS
from service.core.publication import log, open_input


def command_demo(args: argparse.Namespace) -> int:
    from streams.tools.demo import run_demo

    return run_demo(
        mechanism=args.mechanism, records=args.records, rate=args.rate, serve=args.serve,
        port=args.port,
    )  # fmt: skip


def command_worker(args: argparse.Namespace) -> int:
    from streams.worker.run import run_worker

    run_worker(load_config(args.config), loglevel=args.loglevel, host=args.host, port=args.port)
    return 0


def command_consumer(args: argparse.Namespace) -> int:
    from streams.consumer.run import run_consumer

    config = load_config(args.config)
    port = config.reports.port if args.port is None else args.port
    run_consumer(config, args.host, port, loglevel=args.loglevel)
    return 0


def command_produce(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError

    from streams.tools.produce import count_rows, produce, rows_of

    config = load_config(args.config)
    total = None if args.input == "-" else count_rows(Path(args.input))
    with open_input(args.input) as stream:
        rows = rows_of(stream, config, args.id_column, args.delimiter)
        try:
            sent = asyncio.run(produce(config, rows, total, args.rate))
        except KafkaError as err:
            raise CommandError(f"cannot produce to {config.kafka.bootstrap}: {err}") from None

    log(
        f"splu produce: {sent:,} records from {args.input} acknowledged by "
        f"{config.topics['raw']} at {config.kafka.bootstrap}"
    )
    if args.id_column is None:
        log(
            "splu produce: ids from each row's content and occurrence (no --id-column): the "
            "same export produced again, with rows appended or reordered, stores nothing "
            "twice; produce the whole export each time, not only its new rows"
        )
    return 0


def command_run(args: argparse.Namespace) -> int:
    from streams.tools.run import run_stream

    source = Path(args.input)
    if not source.is_file():
        raise CommandError(f"cannot read {args.input}: no such file")
    return run_stream(
        Path(args.config), source, id_column=args.id_column, rate=args.rate,
        serve=args.serve, port=args.port,
        published_out=Path(args.published_out) if args.published_out else None,
        rejected_out=Path(args.rejected_out) if args.rejected_out else None,
        delimiter=args.delimiter,
    )  # fmt: skip


def command_close(args: argparse.Namespace) -> int:
    from streams.worker.closing import describe_closed, request_close, wait_closed

    config = load_config(args.config)
    offsets = asyncio.run(request_close(config))
    shown = ", ".join(f"{p}: {o:,}" for p, o in sorted(offsets.items()))
    log(
        f"splu close: stream {config.name!r} accepts no record past these offsets of "
        f"{config.topics['raw']} (partition: offset): {shown}"
    )
    if args.no_wait:
        log("splu close: the workers publish or suppress every accepted record; not waiting")
        return 0
    timeout = None if args.timeout == 0 else args.timeout
    try:
        status, totals = asyncio.run(wait_closed(config, timeout, show=log))
    except TimeoutError as err:
        raise CommandError(
            f"no progress for {args.timeout:g} s ({err}): is a worker running for "
            f"{config.name!r}? The close goes on once one runs; run this again to wait"
        ) from None
    for line in describe_closed(config, status, totals):
        log(line)
    return 0


def command_skip(args: argparse.Namespace) -> int:
    from streams.worker.undecodable import request_skip

    config = load_config(args.config)
    entry = asyncio.run(request_skip(config, args.partition, args.offset))
    log(
        f"splu skip: the worker owning partition {args.partition} of {config.topics['raw']} "
        f"reads on past offsets {args.offset:,}..{entry['last']:,} within a second; the "
        f"records there ({entry['reason']}) are not accepted, and the skip is reported on "
        f"{config.topics['rejected']}"
    )
    return 0


def command_up(args: argparse.Namespace) -> int:
    from streams.tools.up import run_up

    if args.redis_cluster is not None and args.redis_cluster < 1:
        raise CommandError(
            f"--redis-cluster takes a number of masters >= 1, got {args.redis_cluster}"
        )
    return run_up(args.data_dir, args.redis_cluster or 0)


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """What `splu demo` and `splu run` share: the producer's pace and the live page."""
    parser.add_argument("--rate", type=float, help="producer rate in records/s (default: flat out)")
    parser.add_argument(
        "--serve", action="store_true",
        help="keep the servers and the live page running after the summary, until Ctrl-C",
    )  # fmt: skip
    parser.add_argument("--port", type=int, help="the live page's port (default: a free one)")


def _add_loglevel(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loglevel", choices=["crit", "error", "warn", "info", "debug"], default="warn",
        help="log level (default warn)",
    )  # fmt: skip


def register(commands: Commands) -> None:
    """Add the stream's commands."""
    demo = commands.add_parser(
        "demo", formatter_class=FORMATTER,
        help="the main job on embedded servers: stream the bundled sample end to end",
        description=(
            "Start an embedded Kafka-protocol broker and Redis-protocol server, a worker, a\n"
            "consumer and a producer over the bundled UCI Adult sample; show live progress\n"
            "and the consumer's live page (URL printed); ask the consumer for large and\n"
            "small reconstructed counts and compare them with the truth. Everything started\n"
            "is stopped again, also on Ctrl-C (--serve keeps the page up until then)."
        ),
    )  # fmt: skip
    demo.add_argument(
        "--mechanism",
        choices=STREAM_MECHANISMS,
        default=DEFAULT_MECHANISM,
        help="decoy groups on occupation (default) or personal groups on income",
    )
    demo.add_argument("--records", type=int, help="stream only the first N records")
    _add_run_options(demo)
    demo.set_defaults(run=command_demo)

    run = commands.add_parser(
        "run", formatter_class=FORMATTER,
        help="stream your own CSV through a stream's config, start to end, on embedded servers",
        description=(
            "The demo's flow for any stream config and CSV: start the embedded broker and\n"
            "Redis (unless KAFKA_BOOTSTRAP and REDIS_URL name others), the stream's topics, a\n"
            "worker and a consumer, produce the CSV with live progress, close the stream at\n"
            "the end of the input, then print a summary: records sent, in, published,\n"
            "suppressed and rejected (the first 20 with their line, field and reason), the\n"
            "standing queries' estimates with their intervals, and the privacy tests'\n"
            "verdicts. Everything started is stopped again, also on Ctrl-C.\n\n"
            "example (`splu plan --config-out` writes the config from your data):\n"
            "  splu run --config my-stream.toml --input answers.csv --id-column respondent \\\n"
            "      --published-out published.csv --rejected-out rejected.csv"
        ),
    )  # fmt: skip
    run.add_argument("--config", required=True, help="the stream's TOML file")
    run.add_argument("--input", required=True, help="CSV with a header line (.gz ok)")
    add_delimiter_option(run)
    run.add_argument("--id-column", metavar="COL", help="column holding each record's id")
    run.add_argument(
        "--published-out", metavar="FILE.csv",
        help="write the published records here as CSV (the embedded broker forgets them)",
    )  # fmt: skip
    run.add_argument(
        "--rejected-out", metavar="FILE.csv",
        help="write every rejected row here as CSV: line (of --input), id, field, reason "
        "(never the value); the summary lists the first 20",
    )  # fmt: skip
    _add_run_options(run)
    run.set_defaults(run=command_run)

    close = commands.add_parser(
        "close", formatter_class=FORMATTER,
        help="end a survey: publish or suppress every accepted record, accept no more",
        description=(
            "Close a stream: every raw partition accepts no record past its end offset at\n"
            "this moment (a later one goes to <stream>.rejected with its reason), and the\n"
            "workers finish what they hold: decoy groups are cut one last time and the\n"
            "records no group can take are suppressed, personal groups are released, each\n"
            "partition's pool leaves whole if it holds the mixing floor, and the rest of\n"
            "every partition leaves in one take mixed across the partitions. If that\n"
            "remainder holds fewer than 10 groups, stream.small_remainder decides: suppress\n"
            "(the default) or publish it. It then waits, printing progress, until every\n"
            "accepted record is published or suppressed, and prints what became of them.\n"
            "Running it again changes nothing. `splu run` closes at the end of its input.\n\n"
            "example:\n"
            "  splu close --config my-stream.toml"
        ),
    )  # fmt: skip
    close.add_argument("--config", required=True, help="the stream's TOML file")
    close.add_argument(
        "--no-wait", action="store_true",
        help="record the close and return; the workers finish it",
    )  # fmt: skip
    close.add_argument(
        "--timeout", type=float, default=300.0, metavar="SECONDS",
        help="give up waiting after this long without progress (default 300; 0: never)",
    )  # fmt: skip
    close.set_defaults(run=command_close)

    skip = commands.add_parser(
        "skip", formatter_class=FORMATTER,
        help="read on past a raw batch the worker cannot decode (it holds its partition)",
        description=(
            "A raw batch the worker cannot decode (a compression codec whose library it\n"
            "lacks, a corrupt batch) holds its partition: it is reported on\n"
            "<stream>.rejected with its partition and offsets, and the SpluUndecodableBatch\n"
            "alert fires. Either run a worker that can decode it, or skip it: the worker\n"
            "owning the partition reads on past the batch, whose records are then never\n"
            "accepted, and reports the skip on <stream>.rejected\n"
            "(docs/operations.md, SpluUndecodableBatch).\n\n"
            "example:\n"
            "  splu skip --config my-stream.toml --partition 2 --offset 18350"
        ),
    )  # fmt: skip
    skip.add_argument("--config", required=True, help="the stream's TOML file")
    skip.add_argument("--partition", type=int, required=True, help="the raw partition held")
    skip.add_argument(
        "--offset", type=int, required=True, help="the first offset of the batch, as reported"
    )
    skip.set_defaults(run=command_skip)

    up = commands.add_parser(
        "up", formatter_class=FORMATTER,
        help="run the embedded broker and Redis in the foreground for the stream commands",
        description=(
            "Start the embedded Kafka-protocol broker and Redis-protocol server and print\n"
            "the two lines to paste into the terminals of `splu worker`, `splu consumer`\n"
            "and `splu produce`:\n"
            "  export KAFKA_BOOTSTRAP=127.0.0.1:PORT\n"
            "  export REDIS_URL=redis://127.0.0.1:PORT/0\n"
            "Ctrl-C stops both. The broker keeps messages in memory only; with --data-dir\n"
            "Redis keeps its append-only file there across restarts.\n\n"
            "With --redis-cluster N it starts a Redis Cluster of N masters on loopback\n"
            "ports instead of one server, and prints a third line, export REDIS_CLUSTER=1,\n"
            "so the stream's processes use a cluster client (docs/scaling.md)."
        ),
    )  # fmt: skip
    up.add_argument("--data-dir", type=Path, help="keep Redis's data here (default: nothing kept)")
    up.add_argument(
        "--redis-cluster", type=int, metavar="N",
        help="run a Redis Cluster of N masters instead of one server",
    )  # fmt: skip
    up.set_defaults(run=command_up)

    worker = commands.add_parser(
        "worker", formatter_class=FORMATTER,
        help="run the stream worker for a stream's config (production)",
        description=(
            "Consume <stream>.raw, buffer and randomize in Redis, publish to\n"
            "<stream>.published. Start one per machine or container; Kafka spreads the\n"
            "partitions over them. Kafka and Redis come from the config, KAFKA_BOOTSTRAP\n"
            "and REDIS_URL override them; the service key from the environment variable\n"
            "or file the config names."
        ),
    )  # fmt: skip
    worker.add_argument("--config", required=True, help="the stream's TOML file")
    worker.add_argument(
        "--host", default="127.0.0.1", help="address of the pages (default 127.0.0.1)"
    )
    worker.add_argument(
        "--port", type=int,
        help="serve /healthz (alive), /readyz (Redis and Kafka answer, partitions assigned) "
        "and /metrics (Prometheus: the partitions it owns) on this port (default: no pages)",
    )  # fmt: skip
    _add_loglevel(worker)
    worker.set_defaults(run=command_worker)

    consumer = commands.add_parser(
        "consumer", formatter_class=FORMATTER,
        help="run a stream's consumer: running counts, queries, privacy reports, live page",
        description=(
            "Count <stream>.published once per token into Redis (the counts survive\n"
            "restarts), run the privacy tests every stream.report_interval seconds and\n"
            "publish them to <stream>.reports, and serve:\n"
            "  /          the live page (plots update themselves)\n"
            "  /status    JSON: counters, delays, tests, standing queries\n"
            "  /metrics   Prometheus text format\n"
            "  /estimate  GET ?where=col:val,col:val&value=sacol:val, or POST a JSON\n"
            "             array of query objects (as `splu query --url` does)\n"
            "  /healthz   200 while the process runs (checks nothing else)\n"
            "  /readyz    200 once Redis and Kafka answer and partitions are assigned\n"
            "Several consumers of a stream split the counting by published partition and all\n"
            "answer for the whole stream; the one holding partition 0 publishes the reports.\n"
            "The config's [reports] table sets the tests' thresholds, the standing queries\n"
            "and which failed tests pause publishing (fail_closed). It needs no service key."
        ),
    )  # fmt: skip
    consumer.add_argument("--config", required=True, help="the stream's TOML file")
    consumer.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)"
    )
    consumer.add_argument(
        "--port", type=int, help="port to serve on (default: reports.port of the config, 6066)"
    )
    _add_loglevel(consumer)
    consumer.set_defaults(run=command_consumer)

    produce = commands.add_parser(
        "produce", formatter_class=FORMATTER,
        help="stream a CSV into <stream>.raw",
        description=(
            "Send each row's schema columns as a JSON object to <stream>.raw, keyed by the\n"
            "response's id: the --id-column value, or else c:<digest of the row>:<n>, the\n"
            "n-th row of the file with that content. The stream recognises every id again,\n"
            "on any partition, at any age: an export produced again, with rows appended or\n"
            "reordered, stores nothing twice. Without an id column, produce the whole export\n"
            "each time, not only its new rows."
        ),
    )  # fmt: skip
    produce.add_argument("--config", required=True, help="the stream's TOML file")
    produce.add_argument("--input", required=True, help="CSV with a header line (- for stdin)")
    add_delimiter_option(produce)
    produce.add_argument("--rate", type=float, help="records per second (default: flat out)")
    produce.add_argument("--id-column", metavar="COL", help="column holding each record's id")
    produce.set_defaults(run=command_produce)


def read_topic(stream: str, kafka: KafkaSettings, confidence: float) -> Publication:
    """`splu query --topic`'s reader, which the batch command cannot import (layers)."""
    from streams.tools.reader import read_publication

    return read_publication(stream, confidence=confidence, kafka=kafka)


def build_parser() -> argparse.ArgumentParser:
    """Every ``splu`` command: the stream's first, as ``splu --help`` lists them."""
    parser, commands = cli.new_parser()
    register(commands)
    cli.register(commands)
    commands.choices["query"].set_defaults(read_topic=read_topic)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
