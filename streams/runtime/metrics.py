"""Operator metrics: the publish-delay histogram and the Prometheus exposition.

Each process shows what it answers for, so that no process hides the others' numbers
when it is down (deploy/prometheus/prometheus.yml scrapes them all):

- a worker, the partitions of the raw topic it owns now (`worker_families`): records by
  state, the buffer against its cap, the mixing pool, records in flight and the
  publish-delay histogram, each labelled with its partition;
- the consumer, the stream as a whole (`consumer_families`): its counts and lag, the
  privacy tests, the pause, the standing queries and Redis's memory. Its `/metrics` is
  rendered from the document `/status` serves, so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from service.store.buffer import DELAY_BOUNDS_MS

_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)

# Seconds over stream.max_wait a record may take to be published at p99 in a stream that
# fills its mixing pool (bench/stream_throughput.py holds the pipeline to it): the emit
# timer's period and the broker's acknowledgement.
DELAY_SLACK = 1.0
# Records of a partition by what became of them (`BufferState.stats`).
RECORD_STATES = (
    "ingested", "published", "suppressed", "rejected", "redelivered", "conflicts", "expired"
)  # fmt: skip


def delay_histogram(raw: Mapping[str, int]) -> dict[str, Any]:
    """Cumulative buckets in seconds (Prometheus style), count, sum and p50/p99 from
    the non-cumulative counts per bound in ms that the emit script keeps."""
    buckets, running = [], 0
    for bound in DELAY_BOUNDS_MS:
        running += raw.get(str(bound), 0)
        buckets.append([bound / 1000, running])
    buckets.append(["+Inf", running + raw.get("+Inf", 0)])
    count = raw.get("count", 0)
    return {
        "buckets": buckets,
        "count": count,
        "sum": raw.get("sum_ms", 0) / 1000,
        "p50": histogram_quantile(0.5, buckets),
        "p99": histogram_quantile(0.99, buckets),
    }


def histogram_quantile(q: float, buckets: Sequence[Sequence[Any]]) -> float | None:
    """The q-quantile by linear interpolation inside its bucket, as Prometheus does;
    None for an empty histogram, the last finite bound when it falls in +Inf."""
    total = buckets[-1][1]
    if total == 0:
        return None
    rank = q * total
    lower, below = 0.0, 0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == "+Inf":
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def difference(later: Mapping[str, int], earlier: Mapping[str, int]) -> dict[str, int]:
    """Raw histogram counts added between two readings."""
    return {k: v - earlier.get(k, 0) for k, v in later.items()}


class DocumentCollector:
    """A prometheus-client collector of the families `families(document)` yields.

    A page reads its document from Redis (asynchronously) and then renders it on a registry
    of its own, so the numbers are those of that one reading, never a mix of two.
    """

    def __init__(
        self, document: Mapping[str, Any], families: Callable[[Mapping[str, Any]], Iterable[Metric]]
    ) -> None:
        self.document = document
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families(self.document)


def exposition(
    document: Mapping[str, Any], families: Callable[[Mapping[str, Any]], Iterable[Metric]]
) -> bytes:
    """The families of a document in the Prometheus text format; serve it with
    prometheus_client.CONTENT_TYPE_LATEST."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DocumentCollector(document, families))
    return generate_latest(registry)


def _family(
    kind: type[_Family],
    name: str,
    help_text: str,
    stream: str,
    samples: Iterable[tuple[Mapping[str, str], float | None]],
) -> _Family:
    """A gauge or counter family of labelled samples, each also labelled with its stream. A
    number not known yet (None, before the first report) is left out, not shown as a value."""
    known = [(labels, value) for labels, value in samples if value is not None]
    names = ["stream", *(known[0][0] if known else ())]
    family = kind(name, help_text, labels=names)
    for labels, value in known:
        family.add_metric([stream, *(labels[n] for n in names[1:])], float(value))
    return family


def _delay_family(stream: str, histograms: Mapping[str, Mapping[str, Any]]) -> Metric:
    """The publish-delay histogram of each partition (`delay_histogram` documents)."""
    family = HistogramMetricFamily(
        "splu_publish_delay_seconds",
        "Time from a record's arrival to its publication.",
        labels=["stream", "partition"],
    )
    for partition, delay in histograms.items():
        buckets = [(floatToGoString(bound), count) for bound, count in delay["buckets"]]
        family.add_metric([stream, partition], buckets, float(delay["sum"]))
    return family


def worker_families(document: Mapping[str, Any]) -> Iterable[Metric]:
    """A worker's families from its document: "stream", "delay_bound" (seconds) and
    "partitions": {partition: `BufferState.stats` plus "buffer_cap" and "delay" (a
    `delay_histogram`)} for the partitions it owns now."""
    stream = document["stream"]
    partitions = {str(p): numbers for p, numbers in document["partitions"].items()}
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield _family(
        gauge,
        "splu_worker_partitions",
        "Partitions of the raw topic this worker owns.",
        stream,
        [({}, len(partitions))],
    )
    by_state = [
        ({"partition": p, "state": state}, numbers.get(state, 0))
        for p, numbers in partitions.items()
        for state in RECORD_STATES
    ]
    yield _family(
        counter, "splu_records_total", "Raw records by what became of them.", stream, by_state
    )
    for name, field, help_text in (
        ("splu_buffer_pending", "pending", "Records waiting in Redis for their group."),
        ("splu_mixing_pool", "pool", "Records in the mixing pool."),
        ("splu_buffer_cap", "buffer_cap", "Waiting and pooled records before ingest pauses."),
        ("splu_in_flight", "in_flight", "Records sent but not yet acknowledged by the broker."),
        (
            "splu_undecodable_batches",
            "undecodable",
            "Raw batches the worker cannot decode, holding their partition.",
        ),
    ):
        samples = [({"partition": p}, numbers.get(field, 0)) for p, numbers in partitions.items()]
        yield _family(gauge, name, help_text, stream, samples)
    yield _delay_family(stream, {p: numbers["delay"] for p, numbers in partitions.items()})
    yield _family(
        gauge,
        "splu_publish_delay_bound_seconds",
        "stream.max_wait plus the slack a stream that fills its mixing pool needs at p99.",
        stream,
        [({}, document["delay_bound"])],
    )


def consumer_families(status: Mapping[str, Any]) -> Iterable[Metric]:
    """The consumer's families from its /status document: the stream as a whole."""
    stream = status["stream"]
    consumer, tests, standing = status["consumer"], status["tests"], status["standing"]
    gauge = GaugeMetricFamily
    for name, field, help_text in (
        ("splu_consumer_records", "records", "Published records counted once by token."),
        ("splu_consumer_cells", "cells", "Distinct published cells."),
        ("splu_consumer_lag", "lag", "Published records the consumer has not counted yet."),
    ):
        yield _family(gauge, name, help_text, stream, [({}, consumer[field])])
    yield _family(
        CounterMetricFamily,
        "splu_consumer_duplicates_total",
        "Published records skipped as re-sent copies.",
        stream,
        [({}, consumer["duplicates"])],
    )
    yield _family(
        gauge,
        "splu_privacy_test_passed",
        "1 if the privacy test passed at its last run.",
        stream,
        [({"test": t["test"]}, int(t["passed"])) for t in tests],
    )
    yield _family(
        gauge,
        "splu_privacy_test_value",
        "Key numbers of each privacy test's last run.",
        stream,
        [({"test": t["test"], "number": k}, v) for t in tests for k, v in t["numbers"].items()],
    )
    yield _family(
        gauge,
        "splu_publishing_paused",
        "1 while publishing is paused (a failed test fails closed).",
        stream,
        [({}, int(bool(status["paused"])))],
    )
    yield _family(
        gauge,
        "splu_suppressed_max_ratio",
        "reports.max_suppressed: the suppressed share over which eligibility fails.",
        stream,
        [({}, status["max_suppressed"])],
    )
    yield _family(
        gauge,
        "splu_standing_estimate",
        "Reconstructed count of each standing query.",
        stream,
        [({"query": q["name"]}, q["estimate"]) for q in standing],
    )
    yield _family(
        gauge,
        "splu_standing_published",
        "Published count of each standing query.",
        stream,
        [({"query": q["name"]}, q["published"]) for q in standing],
    )
    yield _family(
        gauge,
        "splu_redis_memory_bytes",
        "Memory used by the Redis server.",
        stream,
        [({}, status["worker"]["redis_memory_bytes"])],
    )
    yield _family(
        gauge,
        "splu_redis_memory_limit_bytes",
        "Redis's maxmemory, or the host's memory when it sets none.",
        stream,
        [({}, status["worker"]["redis_memory_limit_bytes"])],
    )


def render_prometheus(status: Mapping[str, Any]) -> bytes:
    """The consumer's /metrics: its /status document in the Prometheus text format."""
    return exposition(status, consumer_families)


def render_worker(document: Mapping[str, Any]) -> bytes:
    """A worker's /metrics (`worker_families`) in the Prometheus text format."""
    return exposition(document, worker_families)
