"""Operator metrics: the publish-delay histogram and the Prometheus text format.

`/metrics` is rendered from the same status document as `/status`, so the two
never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# Upper bounds of the delay histogram in ms (service/lua/emit.lua counts with these). Slow
# streams wait for the mixing pool's floor to fill, so the bounds reach a day.
DELAY_BOUNDS_MS = (
    100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000, 900000,
    3600000, 14400000, 86400000,
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


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _line(name: str, labels: Mapping[str, str], value: float) -> str:
    text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        shown = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    else:
        shown = repr(value) if isinstance(value, float) else str(value)
    return f"{name}{{{text}}} {shown}"


def render_prometheus(status: Mapping[str, Any]) -> str:
    """The status document in the Prometheus text exposition format (version 0.0.4)."""
    stream = {"stream": status["stream"]}
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        # A number not known yet (before the first report) is left out, not written as null.
        out.extend(
            _line(name, {**stream, **labels}, value)
            for labels, value in samples
            if value is not None
        )

    worker = status["worker"]
    states = (
        "ingested", "published", "suppressed", "rejected", "redelivered", "conflicts", "expired"
    )  # fmt: skip
    family(
        "splu_records_total", "counter", "Raw records by what became of them.",
        [({"state": s}, worker.get(s, 0)) for s in states],
    )  # fmt: skip
    for name, field, help_text in (
        ("splu_buffer_pending", "pending", "Records waiting in Redis for their group."),
        ("splu_buffer_cap", "buffer_cap", "Pending records per partition before ingest pauses."),
        ("splu_mixing_pool", "pool", "Records in the mixing pools."),
        ("splu_in_flight", "in_flight", "Records sent but not yet acknowledged by the broker."),
        ("splu_redis_memory_bytes", "redis_memory_bytes", "Memory used by the Redis server."),
    ):
        family(name, "gauge", help_text, [({}, worker.get(field, 0))])

    delay = status["delay"]
    out.append("# HELP splu_publish_delay_seconds Time from arrival to publication.")
    out.append("# TYPE splu_publish_delay_seconds histogram")
    for bound, cumulative in delay["buckets"]:
        le = bound if bound == "+Inf" else repr(float(bound))
        out.append(_line("splu_publish_delay_seconds_bucket", {**stream, "le": le}, cumulative))
    out.append(_line("splu_publish_delay_seconds_sum", stream, float(delay["sum"])))
    out.append(_line("splu_publish_delay_seconds_count", stream, delay["count"]))

    consumer = status["consumer"]
    family(
        "splu_consumer_records", "gauge", "Published records counted once by token.",
        [({}, consumer["records"])],
    )  # fmt: skip
    family("splu_consumer_cells", "gauge", "Distinct published cells.", [({}, consumer["cells"])])
    family(
        "splu_consumer_duplicates_total", "counter", "Published records skipped as re-sent copies.",
        [({}, consumer["duplicates"])],
    )  # fmt: skip
    tests = status["tests"]
    family(
        "splu_privacy_test_passed", "gauge", "1 if the privacy test passed at its last run.",
        [({"test": t["test"]}, int(t["passed"])) for t in tests],
    )  # fmt: skip
    family(
        "splu_privacy_test_value", "gauge", "Key numbers of each privacy test's last run.",
        [
            ({"test": t["test"], "number": name}, float(value))
            for t in tests
            for name, value in t["numbers"].items()
        ],
    )  # fmt: skip
    family(
        "splu_publishing_paused", "gauge", "1 while a failed test holds publishing (fail closed).",
        [({}, int(bool(status["paused"])))],
    )  # fmt: skip
    standing = status["standing"]
    family(
        "splu_standing_estimate", "gauge", "Reconstructed count of each standing query.",
        [({"query": q["name"]}, q["estimate"]) for q in standing],
    )  # fmt: skip
    family(
        "splu_standing_published", "gauge", "Published count of each standing query.",
        [({"query": q["name"]}, q["published"]) for q in standing],
    )  # fmt: skip
    return "\n".join(out) + "\n"
