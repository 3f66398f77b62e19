"""`splu run`: one stream config and one CSV through the whole stream, start to end.

The flow of production on one machine: servers (the embedded broker and Redis, unless
KAFKA_BOOTSTRAP and REDIS_URL name others), the stream's topics, a worker and a
consumer (child processes, each as its own least-privilege Redis user when the run
started Redis itself), a producer over the CSV, live progress, the stream's close once
the worker has taken in every row (`streams.worker.closing`: every accepted record is then
published or suppressed, the remainders below the mixing floor mixed across partitions),
and a summary: records in, published, suppressed (and why), rejected (each with the line
of the input, the field and the reason, read back from ``<stream>.rejected``; all of them
in ``--rejected-out``), the standing queries' estimates with their intervals and what
they mean, the privacy tests' verdicts from the consumer's last report, and where the
published records can be read (``--published-out`` writes them as CSV, in the schema's
column order; the embedded broker forgets them when the run ends). A server that does
not answer, or refuses the stream's user, is one line before anything starts. Every
process it starts is stopped again on success, error or Ctrl-C; with ``--serve`` it
keeps serving the live page until Ctrl-C. `splu demo` is this run on the bundled sample.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from deploy.embedded import (
    EmbeddedServers,
    free_port,
    service_user_envs,
    spawn_consumer,
    spawn_worker,
)
from service.cli import client
from service.cli.progress import progress_bar
from service.core.config import StreamConfig, load_config
from service.core.planning import floor_note
from service.core.table import open_text
from service.core.wire import read_published
from service.store.buffer import BufferState, check_redis, connect
from service.store.lifecycle import close_status
from streams.runtime.kafka import client_options, start_client
from streams.runtime.topics import create_topics, end_offsets
from streams.tools.produce import count_rows, numbered_rows, produce, rows_of
from streams.worker.closing import describe_closed, request_close

TIMEOUT = 120.0  # seconds without progress before a run gives up
PROGRESS_EVERY = 5.0  # seconds between progress lines in a log (a terminal redraws)
REJECTIONS_SHOWN = 20  # rejected rows the summary lists; --rejected-out keeps them all
REJECTED_COLUMNS = ("line", "id", "field", "reason")


class RunError(ValueError):
    """The run cannot go on: the message says why, or how far the stream got."""


def run_stream(
    config_path: Path,
    input_path: Path,
    *,
    id_column: str | None = None,
    rate: float | None = None,
    serve: bool = False,
    port: int | None = None,
    published_out: Path | None = None,
    rejected_out: Path | None = None,
    delimiter: str | None = None,
    command: str = "splu run",
    afterwards: Callable[[StreamConfig, str], None] | None = None,
) -> int:
    """Run the stream over the CSV and print the summary; `afterwards(config, url)` runs
    while the consumer still answers (the demo compares its estimates with the truth)."""
    started = time.monotonic()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="splu-run-")))
        # Servers named by KAFKA_BOOTSTRAP / REDIS_URL are used; the others start here.
        servers = stack.enter_context(EmbeddedServers(work / "servers"))
        os.environ.update(KAFKA_BOOTSTRAP=servers.kafka_bootstrap, REDIS_URL=servers.redis_url)
        config = load_config(config_path)
        if published_out is not None and config.windowed is not None:
            raise RunError(
                "--published-out writes decoy and personal streams; a windowed stream also "
                f"publishes side messages (ST rows, sub-tables): answer from "
                f"{config.topics['published']} with `splu query --topic {config.name}`"
            )
        # One line, before anything starts, for a server that does not answer or refuses.
        asyncio.run(check_redis(config))
        asyncio.run(create_topics(config.kafka, config.topic_partitions))
        env = _key_env(config, command)
        print(
            f"{command}: {config.mechanism} stream {config.name!r} (Kafka "
            f"{config.kafka.bootstrap}{'' if servers.kafka is None else ', embedded'}; Redis "
            f"{config.redis_url.rpartition('@')[2]}{'' if servers.redis is None else ', embedded'}"
            f"), {config.partitions} partitions"
        )
        # Rejections of this run only: the topic may hold earlier runs' on other servers.
        rejected_from = asyncio.run(
            end_offsets(config.kafka, config.topics["rejected"], range(config.partitions))
        )
        # As in production: each process under its own least-privilege Redis user, when
        # this run started the Redis server (and so administers it).
        envs = (
            service_user_envs(config, env)
            if servers.redis is not None and config.redis_password_env is not None
            else {"worker": env, "consumer": env}
        )
        url = f"http://127.0.0.1:{port or free_port()}"
        worker = spawn_worker(config_path, envs["worker"], work / "worker.log")
        stack.callback(worker.stop)
        consumer = spawn_consumer(
            config_path, int(url.rsplit(":", 1)[1]), envs["consumer"], work / "consumer.log"
        )
        stack.callback(consumer.stop)
        print(f"live page: {url}/  (counts, privacy tests, delays; it updates itself)")
        totals, sent, closed = asyncio.run(
            _stream(config, input_path, id_column, delimiter, rate, url)
        )
        rejections = asyncio.run(
            _rejections(config, rejected_from, totals.get("rejected", 0), input_path,
                        id_column, delimiter)
        )  # fmt: skip
        _summary(config, totals, sent, closed, _last_report(url, config), rejections)
        if rejected_out is not None:
            _write_rejections(rejections, rejected_out)
            print(f"rejected records: {len(rejections):,} rows written to {rejected_out}")
        if published_out is not None:
            published = totals.get("published", 0)
            written = asyncio.run(_write_published(config, published, published_out))
            print(f"published records: {written:,} rows written to {published_out}")
        print(
            f"published records: topic {config.topics['published']} at "
            f"{config.kafka.bootstrap}"
            + (
                f" (gone when this run ends{'' if config.windowed else ': use --published-out'})"
                if servers.kafka
                else ""
            )
        )
        if afterwards is not None:
            afterwards(config, url)
        if serve:
            _serve(url)
    print(f"done in {time.monotonic() - started:.0f} s; every process it started has stopped")
    return 0


def _key_env(config: StreamConfig, command: str) -> dict[str, str]:
    """The environment of the stream's processes; a fresh key if the config's is unset."""
    if config.key_env is not None and config.key_env not in os.environ:
        os.environ[config.key_env] = secrets.token_hex(32)
        print(
            f"{command}: {config.key_env} is not set; this run uses a fresh service key "
            "(ids and draws will differ from any other run)"
        )
    return dict(os.environ)


async def _stream(
    config: StreamConfig,
    input_path: Path,
    id_column: str | None,
    delimiter: str | None,
    rate: float | None,
    url: str,
) -> tuple[dict[str, int], int, dict[str, Any]]:
    """Produce the CSV and show progress until the worker has taken in every row, close
    the stream, and go on until every record is settled (published, suppressed or
    rejected) and counted; (totals, records sent, close status)."""
    redis = connect(config)
    buffer = BufferState(redis, config)
    total = count_rows(input_path)
    print(f"producing {total or 'the'} records of {input_path} to {config.topics['raw']}")
    note = total and floor_note(total, config.mixing_pool, config.partitions, config.min_mixing)
    if note:
        print(note)
    with open_text(input_path) as stream:
        rows = rows_of(stream, config, id_column, delimiter)
        producing = asyncio.create_task(produce(config, rows, total, rate, progress=False))
        totals: dict[str, int] = {}
        closed: dict[str, Any] = {}
        counted, moved, shown = 0, time.monotonic(), 0.0
        # A terminal gets a redrawn bar on stderr, a log a line every PROGRESS_EVERY s.
        live = sys.stderr.isatty()
        progress: tuple[int, ...] = ()
        print("waiting for the worker and consumer to join their groups (a few seconds)")
        try:
            with progress_bar(total, "settled", "rec", scale=True) as bar:
                while True:
                    await asyncio.sleep(0.5)
                    totals = await buffer.totals()
                    counted = await _counted(url)
                    sent = producing.result() if producing.done() else None
                    taken_in = sum(
                        totals.get(k, 0) for k in ("ingested", "redelivered", "rejected")
                    )
                    if sent is not None and taken_in >= sent and not closed:
                        # Every row is in (or rejected): the survey ends here.
                        await request_close(config)
                        closed = {"state": "closing"}
                        print("every row is in: closing the stream (splu close)")
                    if closed:
                        closed = await close_status(buffer)
                    done = sum(
                        totals.get(k, 0)
                        for k in ("published", "suppressed", "expired", "rejected", "redelivered")
                    )
                    finished = closed.get("state") == "closed"
                    finished = finished and counted >= totals.get("published", 0)
                    if live:
                        bar.update(done - bar.n)
                        bar.set_postfix_str(
                            f"published {totals.get('published', 0):,}, buffered "
                            f"{totals.get('pending', 0) + totals.get('pool', 0):,}, "
                            f"counted {counted:,}"
                        )
                    elif finished or time.monotonic() - shown >= PROGRESS_EVERY:
                        shown = time.monotonic()
                        print(_progress_line(totals, counted))
                    if finished:
                        break
                    if (now := (totals.get("ingested", 0), done, counted)) != progress:
                        progress, moved = now, time.monotonic()
                    elif time.monotonic() - moved > TIMEOUT:
                        paused = await buffer.paused()
                        raise RunError(
                            f"nothing moved for {TIMEOUT:.0f} s: {totals.get('ingested', 0):,} "
                            f"records in, {done:,} settled, {counted:,} counted"
                            + (f"; publishing is paused ({paused})" if paused else "")
                        )
        finally:
            if not producing.done():
                producing.cancel()
            await redis.aclose()
    return totals, sent, closed


def _progress_line(totals: Mapping[str, int], counted: int) -> str:
    return (
        f"  in {totals.get('ingested', 0):7,}  "
        f"buffered {totals.get('pending', 0):6,}  "
        f"mixing pool {totals.get('pool', 0):6,}  "
        f"published {totals.get('published', 0):7,}  "
        f"suppressed {totals.get('suppressed', 0):4,}  "
        f"rejected {totals.get('rejected', 0):4,}  "
        f"counted {counted:7,}"
    )


async def _counted(url: str) -> int:
    """Published records the consumer's estimates include; 0 while it starts."""
    try:
        status = await asyncio.to_thread(client.status, url, 2.0)
    except client.ConsumerError:
        return 0
    return int(status["consumer"]["records"])


def _last_report(url: str, config: StreamConfig) -> dict[str, Any]:
    """The consumer's status once a privacy report covers every record it counted."""
    deadline = time.monotonic() + 2 * config.report_interval + 10
    status = client.status(url)
    counted_at = status["time"]
    while time.monotonic() < deadline:
        # A windowed stream may have no test that applies: its not-applicable entries say
        # when the report ran.
        reported = status["tests"] + status.get("not_applicable", [])
        if reported and min(t["time"] for t in reported) >= counted_at:
            break
        time.sleep(0.5)
        status = client.status(url)
    return status


def _summary(
    config: StreamConfig,
    totals: Mapping[str, int],
    sent: int,
    closed: dict[str, Any],
    status: dict,
    rejections: list[RejectedRow],
) -> None:
    print(
        f"\nrecords: {sent:,} sent, {totals.get('ingested', 0):,} in, "
        f"{totals.get('published', 0):,} published, {totals.get('suppressed', 0):,} "
        f"suppressed, {totals.get('rejected', 0):,} rejected"
        + (f", {totals['redelivered']:,} sent again" if totals.get("redelivered") else "")
    )
    for line in describe_closed(config, closed, dict(totals))[1:]:
        print(line)
    if rejections:
        print("rejected rows (line of the input, field: reason):")
        for row in rejections[:REJECTIONS_SHOWN]:
            print(f"  {row.where()}: {row.reason}")
        if len(rejections) > REJECTIONS_SHOWN:
            print(f"  and {len(rejections) - REJECTIONS_SHOWN:,} more (--rejected-out keeps all)")
    if status["standing"]:
        print("standing queries: estimate [95% interval], ± half its width:")
        for answer in status["standing"]:
            print(f"  {answer['name']}: {estimate_text(answer)}")
        print(INTERVALS_IN_WORDS)
    verdicts = [f"{t['test']} {'pass' if t['passed'] else 'FAIL'}" for t in status["tests"]]
    verdicts += [f"{t['test']} n/a" for t in status.get("not_applicable", [])]
    if verdicts:
        print(f"privacy tests (last report): {', '.join(verdicts)}")


INTERVALS_IN_WORDS = (
    "  The true count lies inside its 95% interval 19 times in 20. A large count comes out\n"
    "  within the ± shown; a count of a few people (10 or fewer) is noisy on purpose, so\n"
    "  that no one can tell from the published records who holds a sensitive value: that\n"
    "  noise is the privacy."
)


def count_text(value: float) -> str:
    """A count as estimates show it: fractions kept (0.46, not 0), thousands separated."""
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"


def estimate_text(answer: Mapping[str, Any]) -> str:
    """An answer's estimate, its interval where the mechanism gives one, and the interval's
    half-width relative to the estimate."""
    text = count_text(answer["estimate"])
    if answer.get("low") is None or answer.get("high") is None:
        return text
    text += f" [{count_text(answer['low'])}, {count_text(answer['high'])}]"
    if answer["estimate"] >= 1:
        text += f" ±{(answer['high'] - answer['low']) / 2 / answer['estimate']:.0%}"
    return text


@dataclass(frozen=True)
class RejectedRow:
    """A record the worker rejected, with the line of the input it came from."""

    line: int | None
    key: str | None
    field: str | None
    reason: str

    def where(self) -> str:
        place = f"line {self.line:,}" if self.line is not None else f"id {self.key!r}"
        return place if self.field is None else f"{place}, field {self.field!r}"


async def _rejections(
    config: StreamConfig,
    start: Mapping[int, int],
    expected: int,
    input_path: Path,
    id_column: str | None,
    delimiter: str | None,
) -> list[RejectedRow]:
    """The run's rejections from `<stream>.rejected` (from the offsets `start`), each with
    the line of the input its record came from, in the input's order."""
    if not expected:
        return []
    messages = await _read_topic(
        config, config.topics["rejected"], expected, start, identity=_raw_position
    )
    entries = [json.loads(value) for value in messages.values()]
    wanted = {(e["key"], e["value"]) for e in entries}
    lines: dict[tuple[str, str], int] = {}
    with open_text(input_path) as stream:
        for line, key, value in numbered_rows(stream, config, id_column, delimiter):
            record = (key.decode("utf-8", "replace"), value.decode("utf-8", "replace"))
            if record in wanted:
                lines.setdefault(record, line)
    rows = [
        RejectedRow(lines.get((e["key"], e["value"])), e["key"], e["field"], e["reason"])
        for e in entries
    ]
    return sorted(rows, key=lambda r: (r.line is None, r.line or 0, r.key or ""))


def _raw_position(message: ConsumerRecord) -> tuple[int, int]:
    """Where a rejected record was read: a rejection sent twice (a worker retried) is one."""
    entry = json.loads(message.value)
    return entry["partition"], entry["offset"]


def _write_rejections(rows: list[RejectedRow], path: Path) -> None:
    """Every rejected row as CSV: its line in the input, its id, the field and the reason
    (never the value)."""
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(REJECTED_COLUMNS)
        writer.writerows((r.line, r.key, r.field, r.reason) for r in rows)


async def _write_published(config: StreamConfig, expected: int, path: Path) -> int:
    """Write each published record once (by token) as CSV; how many rows."""
    records = await _read_topic(
        config, config.topics["published"], expected, identity=lambda m: m.key
    )
    names = config.schema.names
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(names)
        writer.writerows([read_published(value)[n] for n in names] for value in records.values())
    return len(records)


async def _read_topic(
    config: StreamConfig,
    topic: str,
    expected: int,
    start: Mapping[int, int] | None = None,
    *,
    identity: Callable[[ConsumerRecord], Hashable],
) -> dict[Hashable, bytes]:
    """The values of `topic`'s messages from `start` (partition: offset; default: the
    earliest), one per `identity`, until `expected` are read or TIMEOUT passes."""
    consumer = AIOKafkaConsumer(
        *([topic] if start is None else []), **client_options(config.kafka),
        auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await start_client(consumer, config.kafka)
    records: dict[Hashable, bytes] = {}
    deadline = time.monotonic() + TIMEOUT
    try:
        if start is not None:
            partitions = [TopicPartition(topic, p) for p in start]
            consumer.assign(partitions)
            for tp in partitions:
                consumer.seek(tp, start[tp.partition])
        while len(records) < expected and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                for message in messages:
                    records.setdefault(identity(message), message.value)
    finally:
        await consumer.stop()
    return records


def _serve(url: str) -> None:
    print(f"\nserving the live page at {url}/ until Ctrl-C", flush=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM stops it as cleanly as Ctrl-C (and a background job may ignore SIGINT).
    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print()
