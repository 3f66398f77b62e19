"""A stream config drafted from a survey's own data and `splu plan`'s evaluation of it
(`splu plan --config-out`): a complete, commented TOML file that `splu run` accepts as it
is. No printing here; the command (`service/cli/commands/plan.py`) reports.

What it decides, and from what:

- the schema, from the values seen (as `splu schema` scans it), with each numeric public
  column of more than `MAX_CATEGORIES` values cut into a few bins of about equal size
  (`bin_numeric_columns`): a public column with a value per person makes nearly every
  row's public values unique, and every conjunctive count small;
- the mechanism and its parameters, the plan's recommendation, or, when none keeps the
  large-count error within the bound, the most private setting planned (`choose_setting`),
  with what would help (`advice`): more rows, fewer or coarser public columns, a looser
  bound;
- the partitions, the mixing floor and the waits, from the rows and an expected arrival
  rate (`size_stream`): the floor is as large as the survey fills twice over, so records
  leave while responses arrive, within the floor's bounds (10 groups, the default 1,000);
- standing queries on the survey's own columns (`standing_queries`).

The draft reads the raw data: like the plan, it stays on the trusted side. It holds the
values seen in each column (as `splu schema` writes them) and the most frequent public
values, never a record.
"""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.core import planning
from service.core.config import DEFAULT_MIXING_POOL, StreamConfig, parse_config
from service.core.mechanisms.registry import MECHANISMS
from service.core.schema import Attribute, Rejection, Schema
from service.core.table import Table

# A numeric public column with more distinct values than this is binned.
MAX_CATEGORIES = 10
# Bins per binned column: one per ROWS_PER_BIN rows, within [MIN_BINS, MAX_BINS].
MIN_BINS, MAX_BINS, ROWS_PER_BIN = 3, 8, 100
# A column is numeric when at least this share of its rows hold a number.
NUMERIC_SHARE = 0.9
# Records/s one partition is sized for: a partition is read by one worker at a time, so
# this stays well below what one worker moves (docs/scaling.md, *Capacity measured here*),
# leaving headroom for bursts and a busy host.
PARTITION_RATE = 5000.0
# max_wait lets this many records arrive at a partition: a record of a value over its
# share waits for other values to join it in a group.
WAIT_ARRIVALS = 100
DEFAULT_MAX_WAIT = 30.0
# Seconds between privacy reports: a third of the default, so a run's summary, which
# waits for the report after its last record, comes sooner.
REPORT_INTERVAL = 10.0
STANDING_QUERIES = 4
RATE_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0, "day": 86400.0}


@dataclass(frozen=True)
class Binning:
    """A numeric public column cut into bins of about equal size."""

    column: str
    values: int
    low: float
    high: float
    edges: tuple[float, ...]


def parse_rate(text: str) -> float:
    """--expected-rate as records per second: "2", "2/s", "30/min", "40/h", "500/day"."""
    number, _, unit = text.strip().partition("/")
    try:
        rate = float(number) / RATE_UNITS[unit.strip() or "s"]
    except (ValueError, KeyError):
        raise ValueError(
            f"--expected-rate {text!r}: write a number of records per second, or per "
            "min, h or day, like 500/day"
        ) from None
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--expected-rate {text!r} must be positive")
    return rate


def rate_text(rate: float) -> str:
    """Records per second in the unit that shows at least one: 2/s, 30/min, 8.33/h."""
    unit, seconds = next(
        ((u, t) for u, t in RATE_UNITS.items() if rate * t >= 1), list(RATE_UNITS.items())[-1]
    )
    return f"{rate * seconds:,.3g}/{unit}"


def duration_text(seconds: float) -> str:
    """Seconds as people say them: 45 s, 20 min, 12 h, 3 days."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.3g} {unit}"
    return f"{seconds:,.0f} s"


def _numbers(domain: Sequence[str]) -> np.ndarray:
    """Each label as a number where a stream reads it as one (`Attribute.code_of` on
    bins: written in ASCII, finite), else NaN."""
    widest = Attribute("probe", False, (), (-sys.float_info.max, sys.float_info.max))
    numeric = np.asarray(widest.codes_of(list(domain))) == 0
    return np.array([float(v) if ok else np.nan for v, ok in zip(domain, numeric, strict=True)])


def _nice_step(span: float) -> float:
    """The largest of 1, 2 and 5 times a power of ten that is at most `span`."""
    base = 10.0 ** math.floor(math.log10(span))
    return next(m * base for m in (5, 2, 1) if m * base <= span)


def quantile_edges(values: np.ndarray, counts: np.ndarray, bins: int) -> tuple[float, ...]:
    """Edges of about `bins` half-open bins holding about equal shares of the rows: the
    quantiles of `values` (weighted by `counts`), rounded to a step of 1, 2 or 5 times a
    power of ten (whole numbers for whole values), the outer edges taking in every value."""
    order = np.argsort(values)
    values, counts = values[order], counts[order]
    smallest, largest = float(values[0]), float(values[-1])
    step = _nice_step(max((largest - smallest) / (2 * bins), 1e-9))
    if np.all(values == np.round(values)):
        step = max(step, 1.0)
    cumulative = np.cumsum(counts) / counts.sum()
    inner = {
        round(float(values[np.searchsorted(cumulative, k / bins)]) / step) for k in range(1, bins)
    }
    low, high = math.floor(smallest / step), math.floor(largest / step) + 1
    inner = {m for m in inner if low < m < high}
    if not inner and high - low > 1:
        # Most rows share one value: the quantiles fall together; halve the range instead.
        inner = {(low + high) // 2}
    multiples = [low, *sorted(inner), high]
    return tuple(float(f"{m * step:.12g}") for m in multiples)


def bin_numeric_columns(
    table: Table, columns: Sequence[str]
) -> tuple[Table, list[Rejection], list[Binning]]:
    """`table` with each numeric public column of `columns` that holds more than
    MAX_CATEGORIES values cut into bins of about equal size, the rows whose value there is
    not a number (rejected as a stream rejects them), and what was binned."""
    bins = min(MAX_BINS, max(MIN_BINS, len(table) // ROWS_PER_BIN))
    attributes = list(table.schema.attributes)
    codes = dict(table.codes)
    bad = np.zeros(len(table), dtype=bool)
    binned: list[Binning] = []
    for position, attribute in enumerate(attributes):
        if attribute.sensitive or attribute.bins is not None or attribute.name not in columns:
            continue
        numbers = _numbers(attribute.domain)
        counts = np.bincount(codes[attribute.name], minlength=attribute.size)
        numeric = ~np.isnan(numbers)
        if numeric.sum() <= MAX_CATEGORIES or counts[numeric].sum() < NUMERIC_SHARE * len(table):
            continue
        edges = quantile_edges(numbers[numeric], counts[numeric], bins)
        cut = Attribute(attribute.name, False, (), edges)
        lookup = np.asarray(cut.codes_of(list(attribute.domain)), dtype=np.int32)
        codes[attribute.name] = lookup[codes[attribute.name]]
        bad |= codes[attribute.name] < 0
        attributes[position] = cut
        finite = numbers[numeric]
        binned.append(
            Binning(attribute.name, int(numeric.sum()), finite.min(), finite.max(), edges)
        )
    schema = Schema(tuple(attributes))
    rejections = []
    for row in np.flatnonzero(bad).tolist():
        for attribute in schema.attributes:
            if codes[attribute.name][row] < 0:
                label = table.schema[attribute.name].domain[table.codes[attribute.name][row]]
                try:
                    attribute.code_of(label)
                except ValueError as err:
                    rejections.append(Rejection(int(table.lines[row]), attribute.name, str(err)))
                break
    return Table(schema, codes, table.lines).take(~bad), rejections, binned


@dataclass(frozen=True)
class Sizing:
    """The [stream] settings that depend on the survey's size and pace."""

    rows: int
    rate: float | None
    partitions: int
    mixing_pool: int
    max_wait: float
    min_mixing: int

    @property
    def pool_wait(self) -> float | None:
        """Seconds a record waits about in its partition's pool at the expected rate."""
        return None if self.rate is None else self.mixing_pool * self.partitions / self.rate


def size_stream(rows: int, rate: float | None, min_mixing: int) -> Sizing:
    """Partitions for the expected rate (each partition at most PARTITION_RATE, none left
    without two floors' worth of the survey), and the largest floor the survey fills twice
    over in every partition, within [min_mixing, DEFAULT_MIXING_POOL]: records then leave
    while responses arrive, and the close publishes the rest."""
    partitions = 1 if rate is None else math.ceil(rate / PARTITION_RATE)
    partitions = max(1, min(partitions, rows // (2 * min_mixing)))
    floor = min(DEFAULT_MIXING_POOL, max(min_mixing, rows // (2 * partitions)))
    wait = DEFAULT_MAX_WAIT
    if rate is not None:
        wait = max(DEFAULT_MAX_WAIT, math.ceil(WAIT_ARRIVALS * partitions / rate))
    return Sizing(rows, rate, partitions, floor, wait, min_mixing)


def choose_setting(
    settings: Sequence[planning.Setting],
    recommendations: Sequence[Mapping[str, Any]],
) -> tuple[planning.Setting, bool]:
    """The recommended setting of the first mechanism that has one (True), else the most
    private setting planned of the first mechanism (False): decoy groups at the largest γ,
    personal groups at the lowest retention SPS keeps private in every group."""
    for recommendation in recommendations:
        for setting in settings:
            if (setting.mechanism, setting.parameters) == (
                recommendation["mechanism"],
                recommendation["setting"],
            ):
                return setting, True
    for recommendation in recommendations:
        mechanism = recommendation["mechanism"]
        keeps = MECHANISMS[mechanism].keeps_guarantee
        planned = [s for s in settings if s.mechanism == mechanism and keeps(s.guarantees)]
        chosen = planning.most_private(mechanism, planned)
        if chosen is not None:
            return chosen, False
    raise ValueError("no setting of decoy or personal groups was planned that keeps its guarantee")


def advice(
    settings: Sequence[planning.Setting],
    mechanism: str,
    max_error: float,
    table: Table,
    binned: Sequence[Binning],
) -> list[str]:
    """What would bring a mechanism's large-count error within `max_error`: the bound its
    best setting meets, the rows at which it would meet this one (errors of large counts
    shrink like 1/√rows), and the public columns whose values split the rows finest."""
    measured = [s for s in settings if s.mechanism == mechanism and s.large_mean() is not None]
    if not measured:
        return []
    best = min(measured, key=lambda s: s.large_mean() or 0.0)
    error = best.large_mean() or 0.0
    rows = len(table)
    public = table.schema.public
    combinations = len(
        {tuple(row) for row in np.column_stack([table.codes[a.name] for a in public]).tolist()}
    ) if public else 1  # fmt: skip
    widest = sorted(public, key=lambda a: -a.size)[:3]
    shown = ", ".join(
        f"{a.name} ({a.size} {'bins' if a.bins is not None else 'values'})" for a in widest
    )
    lines = [
        f"a looser bound: --max-error {math.ceil(error * 100) / 100:g} accepts "
        f"{planning_label(best)} ({error:.1%})",
        f"more rows: about {math.ceil(rows * (error / max_error) ** 2):,} at the same "
        f"shares (large-count errors shrink like 1/√rows)",
        f"fewer or coarser public columns: the {rows:,} rows hold {combinations:,} distinct "
        f"combinations of public values; the most values: {shown}",
    ]
    if binned:
        cuts = ", ".join(f"--bin {b.column}=..." for b in binned)
        lines[-1] += f" (wider bins: {cuts})"
    return lines


def planning_label(setting: planning.Setting) -> str:
    return MECHANISMS[setting.mechanism].label.format(**setting.parameters)


def standing_queries(
    table: Table, sensitive: str, avoid: Sequence[str] = ()
) -> list[dict[str, dict[str, str]]]:
    """One query per public column (up to STANDING_QUERIES): its most frequent value ∧ a
    sensitive value, the most frequent ones in turn, skipping `avoid` (values whose
    conjunctive counts the mechanism cannot estimate well)."""
    values = [v for v, _ in planning.value_shares(table, sensitive) if v not in avoid]
    values = values or [v for v, _ in planning.value_shares(table, sensitive)]
    queries = []
    for i, attribute in enumerate(table.schema.public[:STANDING_QUERIES]):
        counts = np.bincount(table.codes[attribute.name], minlength=attribute.size)
        top = attribute.domain[int(counts.argmax())]
        queries.append(
            {"where": {attribute.name: top}, "value": {sensitive: values[i % len(values)]}}
        )
    return queries


def stream_name(path: Path) -> str:
    """A stream name from the config's file name: letters, digits, '-', '_', '.'."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "survey"
    return name[:200]


def _toml(value: Any) -> str:
    """A TOML value: strings and lists of them as JSON writes them (valid TOML basic
    strings), numbers as Python prints them."""
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _toml(name)


def _inline(table: Mapping[str, Any]) -> str:
    return "{ " + ", ".join(f"{_key(k)} = {_inline_value(v)}" for k, v in table.items()) + " }"


def _inline_value(value: Any) -> str:
    return _inline(value) if isinstance(value, Mapping) else _toml(value)


@dataclass(frozen=True)
class Draft:
    """Everything a drafted config says, and where it came from."""

    path: Path
    input: str
    rows: int
    schema: Schema
    binned: Sequence[Binning]
    setting: planning.Setting
    recommended: bool
    max_error: float
    advice: Sequence[str]
    sizing: Sizing
    queries: Sequence[Mapping[str, Any]]
    run_command: str


def render(draft: Draft) -> str:
    """The config's text: every setting written out, with what it does and why it has
    this value above it."""
    error = draft.setting.large_mean()
    error_text = "not measured" if error is None else f"{error:.1%}"
    lines = [
        f"# Stream config drafted by `splu plan` from {draft.input} ({draft.rows:,} rows).",
        f"# Run it as it is:  {draft.run_command}",
        "# Every setting is documented in service/core/config.py. It was drafted from the raw",
        "# data (the values seen, the most frequent public ones): keep it on the trusted side.",
        "",
    ]
    if not draft.recommended:
        lines += [
            "# SAFEST SETTING, NOT A RECOMMENDATION: no setting planned kept the large-count",
            f"# mean error within --max-error {draft.max_error:g}. This is the most private one",
            f"# ({planning_label(draft.setting)}: large counts off by {error_text} on average).",
            "# What would help:",
            *(
                wrapped
                for line in draft.advice
                for wrapped in textwrap.wrap(
                    line, 88, initial_indent="#   - ", subsequent_indent="#     "
                )
            ),
            "",
        ]
    lines += [*_stream_lines(draft), "", *_connection_lines(), ""]
    lines += [*_mechanism_lines(draft, error_text), "", *_report_lines(draft), ""]
    lines += _schema_lines(draft)
    return "\n".join(lines) + "\n"


def _stream_lines(draft: Draft) -> list[str]:
    s = draft.sizing
    name = stream_name(draft.path)
    if s.rate is None:
        sized = ["# Sized for the input alone (plan with --expected-rate to size it for a pace)."]
        wait = "# A slow survey needs minutes to hours: plan with --expected-rate."
        pool_wait = []
    else:
        pace = rate_text(s.rate)
        sized = [f"# Sized for {pace}; one partition moves thousands of records a second."]
        wait = f"# The time {WAIT_ARRIVALS} records take to reach a partition at {pace}."
        pool_wait = [
            f"# At {pace} a record waits about {duration_text(s.pool_wait or 0)} in its pool."
        ]
    if MECHANISMS[draft.setting.mechanism].group_size is not None:
        mixing = [
            "# The mixing floor: a pool never drops below it while it releases, so a published",
            "# record's neighbours are its group-mates with probability at most (γ-1)/floor.",
        ]
    else:
        mixing = [
            "# The mixing floor: a pool never drops below it while it releases, so a published",
            "# record leaves mixed among at least this many.",
        ]
    return [
        "[stream]",
        f"# Topics {name}.raw, .published, .rejected and .reports.",
        f"name = {_toml(name)}",
        f"mechanism = {_toml(draft.setting.mechanism)}",
        *sized,
        f"partitions = {s.partitions}",
        *mixing,
        f"# {s.rows:,} rows fill it twice over: records leave while responses arrive, and the",
        f"# close publishes the rest (at least {s.min_mixing}, 10 groups; at most "
        f"{DEFAULT_MIXING_POOL:,}).",
        *pool_wait,
        f"mixing_pool = {s.mixing_pool}",
        "# Seconds a record may wait for its group (decoy: then it is suppressed).",
        wait,
        f"max_wait = {_toml(float(s.max_wait))}",
        "# A pool at its floor that received nothing this long leaves whole.",
        "flush_interval = 5.0",
        "# At the close, a whole stream's remainder of fewer than 10 groups is suppressed and",
        '# counted ("publish": published, with the weaker guarantee reported).',
        'small_remainder = "suppress"',
        "# Seconds after the close that true values and record fingerprints are kept.",
        "closed_retention = 86400.0",
        "# Records per partition (waiting and pooled) before consumption pauses.",
        "buffer_cap = 100000",
        "# Seconds between privacy reports (`splu run` waits for one after the last record).",
        f"report_interval = {REPORT_INTERVAL}",
        "batch_size = 2000",
        "batch_wait = 0.2",
    ]


def _connection_lines() -> list[str]:
    return [
        "[key]",
        "# 64 hex characters (openssl rand -hex 32), never in this file; `splu run` makes a",
        "# fresh one when it is unset. Keep it for the life of the stream.",
        'env = "SPLU_SERVICE_KEY"',
        "",
        "# `splu run` starts an embedded broker and Redis unless these variables are set.",
        "[kafka]",
        'bootstrap = "127.0.0.1:9092"  # KAFKA_BOOTSTRAP overrides',
        "",
        "[redis]",
        'url = "redis://127.0.0.1:6379/0"  # REDIS_URL overrides',
        'password_env = "REDIS_PASSWORD"',
    ]


def _mechanism_lines(draft: Draft, error_text: str) -> list[str]:
    setting, p = draft.setting, draft.setting.parameters
    if draft.recommended:
        why = [
            f"# Recommended by `splu plan`: large counts off by {error_text} on average on the",
            f"# sample, within --max-error {draft.max_error:g}.",
        ]
    else:
        why = [
            f"# The most private setting planned (see the top): large counts off by {error_text}."
        ]
    block = planning.toml_block(setting).rstrip("\n").splitlines()
    what = [
        line.format(**p, **setting.guarantees)
        for line in MECHANISMS[setting.mechanism].draft_explanation
    ]
    if "merge_map" not in p:
        return [block[0], *why, *what, *block[1:]]
    release = ["# Records a group releases at once (or after max_wait).", "release_size = 100"]
    if not p["merge_map"]:
        release += [
            "# No merge_map: each combination of public values is a group of its own",
            "# (`splu merge` fits one that merges values, so groups allow more trials).",
        ]
    return [block[0], *why, *what, *block[1:], *release]


def _report_lines(draft: Draft) -> list[str]:
    spec = MECHANISMS[draft.setting.mechanism]
    lines = [
        "# The consumer's privacy tests, every stream.report_interval seconds: counts of",
        "# 1..alpha should rarely be reconstructed within ±epsilon.",
        "[reports]",
        "epsilon = 0.3",
        "alpha = 10",
    ]
    if "guarantees" not in spec.never_runs:
        lines += ["error_tolerance = 0.02", "min_privacy = 0.1", "max_suppressed = 0.01"]
    if "budget" in spec.fail_closed:
        lines += [
            "# Hold publication while small counts are reconstructible or a group is over its",
            "# trials.",
        ]
    else:
        lines.append("# Hold publication while small counts are reconstructible.")
    lines.append(f"fail_closed = {json.dumps(list(spec.fail_closed))}")
    lines.append("# Standing queries on your own columns: the live page and the summary show them.")
    if not draft.queries:
        return [*lines, "queries = []"]
    return [*lines, "queries = [", *(f"  {_inline(q)}," for q in draft.queries), "]"]


def _schema_lines(draft: Draft) -> list[str]:
    lines = [
        "# The values seen in the input: a later answer outside them is rejected, with its",
        "# field and reason (add values to a domain to accept them).",
        "[schema.public]",
    ]
    binned = {b.column: b for b in draft.binned}
    for attribute in draft.schema.public:
        if attribute.name in binned:
            b = binned[attribute.name]
            lines += [
                f"# {b.column}: {b.values} numeric values from {b.low:g} to {b.high:g}, cut into "
                f"{len(b.edges) - 1} bins of about",
                f"# equal size, published as their labels ({', '.join(attribute.domain)});",
                f"# a value outside [{b.edges[0]:g}, {b.edges[-1]:g}) is rejected.",
            ]
        lines.append(f"{_key(attribute.name)} = {_inline(attribute.to_mapping())}")
    lines += ["", "[schema.sensitive]"]
    lines += [f"{_key(a.name)} = {_inline(a.to_mapping())}" for a in draft.schema.sensitive]
    return lines


def checked(text: str, path: Path) -> StreamConfig:
    """The drafted config as `splu run` will load it: a draft it refused would be a bug."""
    return parse_config(tomllib.loads(text), str(path), path.parent)
