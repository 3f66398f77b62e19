"""The consumer (SPEC §4): running counts, queries, privacy reports and the operator surface.

One Faust app per stream, in its own consumer group on ``<stream>.published``:

- ``count`` (whole fetches, `streams.runtime.bulk`) counts each published record once by its
  token, into cells kept in Redis (`service.store.running_counts`); offsets are committed only
  after Redis has the batch, so counts survive any restart.
- ``refresh`` (timer) rebuilds the in-memory reconstruction when the counts
  changed; queries never scan rows, only the distinct cells. A windowed stream's
  side messages (ST rows, sub-tables) are counted beside its rows, and its estimator is
  the one `splu query` builds from the same rows and side messages
  (`service.core.published.PublishedWindows`): over every sub-table, group or bucket
  counted whole, i.e. the sum of the per-window reconstructions.
- ``report`` (timer, ``stream.report_interval``) runs the privacy tests
  (`service.core.privacy_tests`), answers the standing queries, publishes both to
  ``<stream>.reports``, logs failures and, for tests configured to fail
  closed, pauses publishing until they pass again.
- ``sample`` (timer) keeps a short history of the buffer and delays for the
  live page.

Web: ``/`` the live page, ``/status`` JSON, ``/metrics`` Prometheus,
``/estimate`` (GET with ``where=col:val,...&value=sacol:val``, or POST a
JSON array of query objects as in ``splu query``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import faust
import redis.asyncio as aioredis
from aiokafka.structs import ConsumerRecord
from faust.types import TP
from faust.web import Request, Response, View
from prometheus_client import CONTENT_TYPE_LATEST

from service.core.config import StreamConfig
from service.core.privacy_tests import (
    NotApplicable,
    TestResult,
    guarantee_curve,
    windowed_tests,
)
from service.core.published import CellCodec, PublishedRecordError, PublishedWindows
from service.core.reconstruct import (
    Answers,
    Estimate,
    Query,
    QueryError,
    Reconstruction,
    answer_queries,
)
from service.store.buffer import BufferState
from service.store.lifecycle import close_status
from service.store.running_counts import RunningCounts
from streams.runtime.app import (
    TRANSIENT,
    Publisher,
    add_health_pages,
    app_publisher,
    assigned_partitions,
    describe,
    faust_app,
    redis_client,
    retrying,
    stream_topic,
)
from streams.runtime.bulk import consume_in_bulk
from streams.runtime.metrics import (
    delay_histogram,
    difference,
    histogram_quantile,
    render_prometheus,
)

log = logging.getLogger("splu.consumer")

REFRESH_INTERVAL = 1.0  # seconds between checks for new counts
SAMPLE_INTERVAL = 2.0  # seconds between history samples for the live page
HISTORY = 600  # samples kept: 20 minutes
# Published records per fetch: counting one is a Lua call and a commit, whatever its size.
COUNT_FETCH = 10_000
PAIR_SEPARATOR = re.compile(r",(?=[^,:]+:)")


def query_name(query: Query) -> str:
    parts = [f"{c}={'|'.join(v)}" for c, v in query.where.items()]
    return " ∧ ".join(parts + [f"{c}={v}" for c, v in query.value.items()])


class Consumer:
    """State behind the consumer's counting, timers and pages."""

    def __init__(
        self,
        config: StreamConfig,
        client: aioredis.Redis,
        publisher: Publisher,
        leads: Callable[[], bool],
    ) -> None:
        """`leads()` tells whether this consumer is the one of its group that publishes the
        reports; every consumer shows the tests."""
        self.config = config
        self.leads = leads
        self.counts = RunningCounts(client, config)
        self.buffer = BufferState(client, config)
        self.publisher = publisher
        self.invalid = 0
        self.counted = -1  # records and side messages the reconstruction was built from
        self.records = 0  # published rows the reconstruction includes
        self.reconstruction: Answers | None = None
        self.windows: PublishedWindows | None = None
        self.domains = {a.name: a.domain for a in config.schema.sensitive}
        self.tests: list[TestResult] = []
        self.not_applicable: list[NotApplicable] = []
        self.tested_at: float | None = None
        self.standing: list[dict[str, Any]] = []
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.last_delays: dict[str, int] = {}
        self.curve = guarantee_curve(config)
        self.standing_queries = [Query.from_json(q) for q in config.reports.queries] or [
            Query({}, {a.name: label}) for a in config.schema.sensitive for label in a.domain
        ]

    async def count(self, fetched: Mapping[TP, list[ConsumerRecord]]) -> None:
        """Count a fetch into the shards of its partitions, one Lua call each, together."""
        steps = []
        for tp, records in fetched.items():
            tokens, cells = [], []
            for message in records:
                try:
                    if not message.key:
                        raise PublishedRecordError("a published record without a token")
                    cells.append(self.counts.codec.key_of(message.value))
                    tokens.append(message.key)
                except PublishedRecordError as err:
                    self.invalid += 1
                    log.error("published %d/%d: %s", message.partition, message.offset, err)
            if tokens:
                steps.append(
                    retrying("counting a batch", self.counts.add, tp.partition, tokens, cells)
                )
        await asyncio.gather(*steps)

    async def refresh(self) -> None:
        """Rebuild the reconstruction if records (or side messages) were counted since the
        last build."""
        stats = await self.counts.stats()
        # A side message alone can complete a window's unit, and so change the estimates.
        if stats.get("records", 0) + stats.get("side", 0) == self.counted:
            return
        tally = await self.counts.tally()
        # Off the event loop: a rebuild over tens of thousands of cells must not hold up
        # counting or queries.
        self.reconstruction, self.windows, self.records = await asyncio.to_thread(
            self.rebuild, tally
        )
        self.counted = sum(tally.values())

    def rebuild(
        self, tally: dict[bytes, int]
    ) -> tuple[Answers | None, PublishedWindows | None, int]:
        """The estimator of the counts, a windowed stream's windows, and the rows included."""
        if self.config.windowed is not None:
            windows = PublishedWindows.from_tally(self.config.schema, self.config.windowed, tally)
            return (windows.estimator() if windows.rows else None), windows, windows.rows
        assert isinstance(self.counts.codec, CellCodec)
        cells = self.counts.codec.cells(tally)
        reconstruction = self.config.reconstruction(cells) if cells.total else None
        return reconstruction, None, cells.total

    def estimate(self, objects: list[Any]) -> list[dict[str, Any]]:
        """Answer query objects like `splu query` does; bad ones get an "error"."""
        unanswered = (
            f"{self.windows.held:,} published rows are counted, but no sub-table, group "
            "or bucket is whole yet (its side messages or rows are still to come)"
            if self.windows is not None and self.windows.held
            else "no published records have been counted yet"
        )
        domains = self.domains if self.windows is not None else None
        results, answered = answer_queries(self.reconstruction, objects, domains, unanswered)
        for i, query, estimate in answered:
            results[i].update(records=self.records, method=self.method(query, estimate))
        return results

    def method(self, query: Query, estimate: Estimate) -> str:
        if not query.value:
            return "exact: public values are published unchanged"
        if self.config.windowed is not None:
            return self.config.spec.estimates
        if self.config.personal is not None:
            return "MLE of uniform perturbation (seed 004 Lemma 3), SPS design-effect interval"
        if not estimate.identifiable:
            return (
                "not identifiable (its interval would be wider than [0, |P|], or a value "
                "sits in every group): |P|·f′/N with the interval [0, |P|]"
            )
        if not query.where:
            return "published count (the MLE), exact binomial interval"
        return (
            "inversion of the decoy groups' m×m transition model (size-weighted cuts, from "
            "the published counts); delta-method interval"
        )

    async def report(self) -> None:
        """One round of privacy tests and standing queries; published by the leading
        consumer only, so N consumers send one report. A decoy or personal stream's tests
        need true values and run in the worker (`service.store.auditor`): this shows the last
        audit's verdicts and publishable numbers, and the worker raises and clears the
        pause. A windowed stream's tests read the published side alone and run here."""
        await self.refresh()
        skipped: list[NotApplicable] = []
        if self.config.windowed is not None:
            results, skipped = windowed_tests(self.config, self.windows)
            tested_at: float | None = time.time()
        else:
            audit = await self.buffer.audit()
            results = [TestResult(**t) for t in audit["tests"]] if audit else []
            tested_at = audit["time"] if audit else None
        standing = self.answer_standing()
        now = time.time()
        self.tests, self.tested_at, self.standing = results, tested_at, standing
        self.not_applicable = skipped
        if not self.leads():
            return
        messages = [
            {"kind": "test", "stream": self.config.name, "time": tested_at, **r.to_json()}
            for r in [*results, *skipped]
        ] + [{"kind": "standing", "stream": self.config.name, "time": now, "queries": standing}]
        if (close := await close_status(self.buffer))["state"] != "open":
            messages.append({"kind": "close", "stream": self.config.name, "time": now, **close})
        await retrying(
            "publishing reports",
            self.publisher.send_all,
            self.config.topics["reports"],
            [(None, json.dumps(m).encode()) for m in messages],
        )

    def answer_standing(self) -> list[dict[str, Any]]:
        if self.reconstruction is None:
            return []
        estimates = self.reconstruction.estimate_many(self.standing_queries)
        return [
            {
                "name": query_name(query),
                "where": {c: list(v) for c, v in query.where.items()},
                "value": dict(query.value),
                "published": estimate.published,
                **estimate.answer(),
            }
            for query, estimate in zip(self.standing_queries, estimates, strict=True)
        ]

    async def worker_side(self) -> tuple[dict[str, int | None], dict[str, int]]:
        totals: dict[str, int | None] = dict(await self.buffer.totals())
        if self.config.windowed is not None:
            # A windowed worker keeps no gauge the consumer may read (they count records
            # in windows): what is neither published nor suppressed waits in a window.
            totals["pending"], totals["expired"] = totals.get("expired", 0), 0
        totals["buffer_cap"] = self.config.buffer_cap
        # The worker's audit reads the server's memory: INFO would also count its keys.
        # Unknown (None: the page shows a dash, /metrics leaves it out) until it first ran.
        audit = await self.buffer.audit() or {}
        totals["redis_memory_bytes"] = audit.get("redis_memory_bytes")
        totals["redis_memory_limit_bytes"] = audit.get("redis_memory_limit_bytes")
        return totals, await self.buffer.delays()

    async def sample(self) -> None:
        totals, delays = await self.worker_side()
        recent = delay_histogram(difference(delays, self.last_delays))["buckets"]
        self.last_delays = delays
        self.history.append(
            {
                "time": time.time(),
                **{
                    k: totals.get(k, 0)
                    for k in ("ingested", "published", "suppressed", "pending", "pool")
                },
                "records": self.records,
                "delay_p50": histogram_quantile(0.5, recent),
                "delay_p99": histogram_quantile(0.99, recent),
                "redis_memory_bytes": totals["redis_memory_bytes"],
            }
        )

    async def ready(self) -> None:
        """Counts loaded, even before the timers run (they wait for the group join)."""
        if self.counted < 0:
            await self.refresh()

    async def status(self) -> dict[str, Any]:
        await self.ready()
        totals, delays = await self.worker_side()
        counted = await self.counts.stats()
        if self.windows is not None:
            cells = len(self.windows.counts) + self.windows.side
        elif isinstance(self.reconstruction, Reconstruction):
            cells = len(self.reconstruction.cells.counts)
        else:
            cells = 0
        return {
            "stream": self.config.name,
            "mechanism": self.config.mechanism,
            "time": time.time(),
            "paused": await self.buffer.paused() is not None,
            "max_suppressed": self.config.reports.max_suppressed,
            "worker": totals,
            "consumer": {
                # What estimates include; "counted" runs ahead by up to REFRESH_INTERVAL.
                "records": self.records,
                "counted": counted.get("records", 0),
                "cells": cells,
                "duplicates": counted.get("duplicates", 0),
                # Published (acknowledged by the broker) and not counted yet: it grows while
                # the consumer falls behind the workers, whatever holds it up.
                "lag": max(totals.get("published", 0) - counted.get("records", 0), 0),
                "invalid": self.invalid,
                # Windowed streams: side messages counted, and rows held out of the
                # estimates until their sub-table, group or bucket is counted whole.
                "side": counted.get("side", 0),
                "held": self.windows.held if self.windows is not None else 0,
            },
            "delay": delay_histogram(delays),
            # What the mixing rule costs: records wait until a partition's pool holds its
            # floor, so in a slow stream the delay is about floor / arrival rate.
            "mixing": {
                "floor": self.config.mixing_pool,
                "flush_interval": self.config.flush_interval,
                "pool": totals.get("pool", 0),
                "held": totals.get("held", 0),
                "partitions": self.config.partitions,
            },
            # A survey's end: whether the stream is open, closing or closed, and what its
            # final remainder was and told (`service.store.lifecycle.close_status`).
            "close": await close_status(self.buffer),
            "standing": self.standing,
            "tests": [{**r.to_json(), "time": self.tested_at} for r in self.tests],
            "not_applicable": [
                {**n.to_json(), "time": self.tested_at} for n in self.not_applicable
            ],
            "guarantee": self.curve,
            "history": list(self.history),
        }


def _where_from_text(parameters: list[str]) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for parameter in parameters:
        # A comma starts a new pair only before "column:", so labels such as age bins
        # ("[17, 25)") keep theirs.
        for pair in filter(None, PAIR_SEPARATOR.split(parameter)):
            column, sep, label = pair.partition(":")
            if not sep or not column:
                raise QueryError(f"where: expected col:val pairs separated by commas, got {pair!r}")
            where.setdefault(column, []).append(label)
    return where


def query_from_parameters(request: Request) -> dict[str, Any]:
    """GET /estimate parameters as a query object; a column named twice means any of."""
    query = request.query
    unknown = set(query) - {"where", "value"}
    if unknown:
        raise QueryError(f"unknown parameter {sorted(unknown)[0]!r}; use where and value")
    where = _where_from_text(query.getall("where", []))
    value: dict[str, str] = {}
    for column, labels in _where_from_text(query.getall("value", [])).items():
        if len(labels) > 1:
            raise QueryError(f"value: {column} is named twice; a count takes one value each")
        value[column] = labels[0]
    return {"where": where, "value": value}


def create_consumer_app(config: StreamConfig, datadir: Path, host: str, port: int) -> faust.App:
    """The consumer app for one stream, serving its pages on host:port."""
    app = faust_app(
        config, f"splu-{config.name}-consumer", datadir, web=(host, port),
        fetch_records=COUNT_FETCH,
    )  # fmt: skip
    published = stream_topic(app, config, "published")
    publisher = app_publisher(app, config)
    client = redis_client(app, config)
    # The holder of the published topic's partition 0 leads: one per group at a time.
    consumer = Consumer(
        config, client, publisher, leads=lambda: 0 in assigned_partitions(app, published)
    )
    page = resources.files("streams.consumer").joinpath("static", "index.html").read_text()

    consume_in_bulk(app, consumer.count, published)
    add_health_pages(app, published, client, publisher)

    async def guarded(what: str, step) -> None:  # type: ignore[no-untyped-def]
        try:
            await step()
        except TRANSIENT as err:
            log.warning("%s failed (%s); trying again later", what, describe(err))

    @app.timer(interval=REFRESH_INTERVAL)
    async def refresh() -> None:
        await guarded("refreshing counts", consumer.refresh)

    @app.timer(interval=config.report_interval)
    async def report() -> None:
        await guarded("the privacy report", consumer.report)

    @app.timer(interval=SAMPLE_INTERVAL)
    async def sample() -> None:
        await guarded("sampling the buffer", consumer.sample)

    @app.page("/")
    class LivePage(View):
        async def get(self, request: Request) -> Response:
            return self.html(page)

    @app.page("/status")
    class Status(View):
        async def get(self, request: Request) -> Response:
            return self.json(await consumer.status())

    @app.page("/metrics")
    class Metrics(View):
        async def get(self, request: Request) -> Response:
            body = render_prometheus(await consumer.status())
            # In the headers: aiohttp refuses a content_type argument with a charset.
            return self.bytes(body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.page("/estimate")
    class Estimates(View):
        async def get(self, request: Request) -> Response:
            await consumer.ready()
            try:
                obj = query_from_parameters(request)
            except QueryError as err:
                return self.json({"error": str(err)}, status=400)
            result = consumer.estimate([obj])[0]
            if "error" in result:
                status = 503 if consumer.reconstruction is None else 400
                return self.json(result, status=status)
            return self.json(result)

        async def post(self, request: Request) -> Response:
            await consumer.ready()
            try:
                objects = json.loads(await self.read_request_content(request))
            except (ValueError, UnicodeDecodeError) as err:
                return self.json({"error": f"the body is not valid JSON: {err}"}, status=400)
            if not isinstance(objects, list):
                return self.json({"error": "POST a JSON array of query objects"}, status=400)
            return self.json(consumer.estimate(objects))

    app.splu_consumer = consumer  # type: ignore[attr-defined]
    return app
