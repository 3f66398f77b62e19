"""Calibration of the 95% intervals of conjunctive counts, decoy and personal groups (issue 32).

A 95% interval should cover the true count 95% of the time, at every N. This
measures how often it does, for large and for small conjunctive counts, on UCI
Adult resampled to each N, over many publications:

- data: the bundled Adult sample (45,222 records) with age binned by decade;
  public age, sex, race, marital_status, education; sensitive occupation (m = 14).
  Each N is one resample with replacement (seed --seed), fixed across its
  publications, so the spread over publications is the mechanism's alone.
- queries: "A_1 = a_1 ∧ … ∧ A_d = a_d ∧ occupation = s", d = 1–3. Large: every such
  query whose true count on Adult is ≥ 1% of the rows (about 570). Small: --small
  of those with a true count of 1–10 at that N (fixed seed).
- publications: --publications per N, each with its own service key and ids. The
  truth is counted on the rows each publication publishes (decoy groups suppress
  values above 1/γ and trim to a multiple of γ; a stream suppresses what still waits
  at its close). Every estimator answers all queries with one `estimate_many` call.
- mechanisms and modes:
  - decoy batch: `DecoyGroups.publish` (γ = 5) with the size-weighted cut or, with
    --grouping anatomy, Anatomy's largest-first cut;
  - decoy stream: a Python replay of `service/store/lua/decoy.lua`'s cut for one stream
    partition (`replay_decoy_stream`): records arrive in random order, --stream-batch
    per call; each call counts its arrivals into the buckets and cuts while γ buckets
    are non-empty, taking every value whose backlog is ≥ 1/γ of the waiting records
    and the rest one by one with probability proportional to bucket size, in code
    order, as the script does; each bucket gives its smallest ids; what waits at the
    end is suppressed (no record waits past max_wait in a stream this fast);
  - personal batch: `PersonalGroups.publish` (SPS, p = 0.5, λ = δ = 0.3, adaptive
    budget, merge map fitted on the resampled table, as `splu publish` does);
  - personal stream: `PersonalStream` (`service/core/mechanisms/personal_stream.py`), the
    replay of `service/store/lua/personal.lua`'s reserve trials that a test holds against
    the script (bounded budget, the stream's default), records in random order;
  - --budgets conservative adds the personal budget planned with f = 1.
- estimators, side by side: decoy's 2×2 model (``matrix="corrected"``, t = (γ−1)f/(γ(N−f)))
  and the m×m model of the cutting rule (``matrix="mixing"``, `service.core.mixing`, the
  default); personal's SPS interval.

Per row of the table: coverage of the answers given (identifiable ones) with its
standard error over publications (queries of one publication share one draw, so
their coverage moves together: the error is that of the mean of per-publication
coverages), the worst query's coverage over the publications, the mean relative
error |estimate − true| / true of every answer (declined ones answer |P|·f′_s/N)
with its standard error over publications, and the share declined as not
identifiable (interval wider than [0, |P|]).

Run from the repository root (the full run takes tens of minutes on 2 cores):

    .venv/bin/python bench/calibration.py
    .venv/bin/python bench/calibration.py --rows 45222 --publications 20 --modes batch
    .venv/bin/python bench/calibration.py --mechanisms decoy --grouping anatomy --modes batch
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from report import log, print_table, status

from service.core.mechanisms.decoy import GROUPINGS, DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.mechanisms.personal import BUDGETS, STREAM_BUDGETS, PersonalGroups
from service.core.mechanisms.personal_reconstruction import PersonalReconstruction
from service.core.mechanisms.personal_stream import PersonalStream
from service.core.merge import ValueMap, fit_value_map
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query, Reconstruction
from service.core.table import Table, distinct_rows, open_sample, read_table

PUBLIC = ("age", "sex", "race", "marital_status", "education")
SENSITIVE = "occupation"
AGE_BIN = 10
GAMMA = 5
RETENTION, LAMBDA, DELTA = 0.5, 0.3, 0.3
LARGE_SHARE = 0.01
MAX_ATTRIBUTES = 3
SMALL_MAX = 10
ROWS = (45_222, 300_000, 1_000_000)
PUBLICATIONS = {45_222: 100, 300_000: 40, 1_000_000: 40}
# Raw records per worker call: a stream config's default batch_size.
STREAM_BATCH = 2000
# Records a personal group buffers before a release: a stream config's default.
RELEASE_SIZE = 100


@dataclass(frozen=True)
class Published:
    """One publication: its table and which input rows it publishes."""

    table: Table
    kept: np.ndarray  # boolean over the input rows


@dataclass(frozen=True)
class Setting:
    """What a publication function needs besides the table and key."""

    grouping: str
    stream_batch: int
    value_map: ValueMap | None
    budget: str


Publisher = Callable[[Table, ServiceKey, Setting], Published]


def adult() -> Table:
    with open_sample() as stream:
        table, _ = read_table(stream, quasi=PUBLIC, sensitive=[SENSITIVE], bins={"age": AGE_BIN})
    return table


def resample(base: Table, rows: int, seed: int) -> Table:
    """`rows` rows of `base` drawn with replacement (the base itself at its own size)."""
    if rows == len(base):
        return base
    picked = np.random.default_rng(seed).integers(0, len(base), rows)
    return Table(base.schema, {name: codes[picked] for name, codes in base.codes.items()})


def conjunctions(table: Table) -> tuple[list[Query], np.ndarray]:
    """Every "public values ∧ sensitive value" of 1 to MAX_ATTRIBUTES public attributes
    that the table holds, with its count."""
    schema, queries, counts = table.schema, [], []
    for d in range(1, MAX_ATTRIBUTES + 1):
        for columns in itertools.combinations(PUBLIC, d):
            names = [*columns, SENSITIVE]
            cells, _, found = distinct_rows(
                [table.codes[c] for c in names], [schema[c].size for c in names]
            )
            for cell, count in zip(cells.tolist(), found.tolist(), strict=True):
                where = {c: (schema[c].domain[v],) for c, v in zip(columns, cell[:-1], strict=True)}
                queries.append(Query(where, {SENSITIVE: schema[SENSITIVE].domain[cell[-1]]}))
                counts.append(count)
    return queries, np.asarray(counts)


def large_queries(base: Table) -> list[Query]:
    queries, counts = conjunctions(base)
    return [q for q, c in zip(queries, counts, strict=True) if c >= LARGE_SHARE * len(base)]


def small_queries(table: Table, wanted: int, seed: int) -> list[Query]:
    queries, counts = conjunctions(table)
    small = np.flatnonzero(counts <= SMALL_MAX)
    picked = np.random.default_rng(seed).permutation(small)[:wanted]
    return [queries[i] for i in np.sort(picked)]


def true_counts(table: Table, queries: Sequence[Query], sensitive: str = SENSITIVE) -> np.ndarray:
    """Each query's count on `table` (its true values)."""
    cells = PublishedCells.from_table(table)
    column = cells.column[sensitive]
    return np.asarray(
        [
            cells.weights[
                cells.predicate(q.where) & (column == cells.code(sensitive, q.value[sensitive]))
            ].sum()
            for q in queries
        ]
    )


def publish_decoy_batch(table: Table, key: ServiceKey, setting: Setting) -> Published:
    release = DecoyGroups(GAMMA, setting.grouping).publish(table, random_ids(len(table), key), key)
    kept = np.zeros(len(table), dtype=bool)
    kept[release.grouped_rows] = True
    return Published(release.published, kept)


def replay_decoy_stream(
    values: np.ndarray, gamma: int, batch: int, rng: np.random.Generator
) -> list[list[int]]:
    """The groups `service/store/lua/decoy.lua` cuts from one attribute's values arriving in this
    order, `batch` per call, as lists of row positions in value order.

    Per call: the arrivals join their buckets; while γ buckets are non-empty a group
    takes every value whose bucket holds ≥ 1/γ of the waiting records, then draws the
    rest one by one, x uniform on [0, waiting − taken), scanning the values in code
    order and subtracting each untaken non-empty bucket's size until x < 0. Each value
    then gives its groups its smallest ids, in the order the groups were cut. Ids are
    uniform random numbers (the stream's are 128 random bits).
    """
    m = int(values.max(initial=0)) + 1
    ids = rng.random(len(values))
    buckets: list[list[tuple[float, int]]] = [[] for _ in range(m)]
    size = [0] * m
    pending = nonempty = 0
    groups: list[list[int]] = []
    uniforms = rng.random(1 << 16).tolist()
    used = 0
    for start in range(0, len(values), batch):
        for row in range(start, min(start + batch, len(values))):
            v = int(values[row])
            heapq.heappush(buckets[v], (ids[row], row))
            if size[v] == 0:
                nonempty += 1
            size[v] += 1
            pending += 1
        plan = []
        while nonempty >= gamma:
            taken = [i for i in range(m) if size[i] and size[i] * gamma >= pending]
            weight = sum(size[i] for i in taken)
            while len(taken) < gamma:
                if used == len(uniforms):
                    uniforms, used = rng.random(1 << 16).tolist(), 0
                x = uniforms[used] * (pending - weight)
                used += 1
                pick = -1
                for i in range(m):
                    s = size[i]
                    if s and i not in taken:
                        pick = i
                        x -= s
                        if x < 0:
                            break
                taken.append(pick)
                weight += size[pick]
            taken.sort()
            for i in taken:
                size[i] -= 1
                if size[i] == 0:
                    nonempty -= 1
            pending -= gamma
            plan.append(taken)
        for taken in plan:
            groups.append([heapq.heappop(buckets[i])[1] for i in taken])
    return groups


def stream_publication(
    table: Table, sensitive: str, gamma: int, batch: int, rng: np.random.Generator
) -> Published:
    """A stream partition's publication of `table` (one sensitive attribute), replayed:
    records in a random order, groups by `replay_decoy_stream`, each member publishing
    its group's value at a uniform draw index."""
    order = rng.permutation(len(table))
    groups = replay_decoy_stream(table.codes[sensitive][order], gamma, batch, rng)
    members = order[np.asarray(groups, dtype=np.int64).reshape(-1, gamma)]
    values = table.codes[sensitive][members]  # each row in code order
    drawn = np.take_along_axis(values, rng.integers(0, gamma, members.shape), axis=1)
    kept = np.zeros(len(table), dtype=bool)
    kept[members.ravel()] = True
    rows = members.ravel()
    codes = {name: column[rows] for name, column in table.codes.items()}
    codes[sensitive] = drawn.ravel().astype(table.codes[sensitive].dtype)
    return Published(Table(table.schema, codes), kept)


def publish_decoy_stream(table: Table, key: ServiceKey, setting: Setting) -> Published:
    rng = np.random.default_rng(int.from_bytes(key.subkey("stream replay")[:8], "little"))
    return stream_publication(table, SENSITIVE, GAMMA, setting.stream_batch, rng)


def publish_personal_batch(table: Table, key: ServiceKey, setting: Setting) -> Published:
    mechanism = PersonalGroups(RETENTION, LAMBDA, DELTA, setting.budget, setting.value_map)
    release = mechanism.publish(table, random_ids(len(table), key), key)
    return Published(release.published, np.ones(len(table), dtype=bool))


def publish_personal_stream(table: Table, key: ServiceKey, setting: Setting) -> Published:
    """`PersonalStream`, the replay of personal.lua's trial rule that
    tests/test_personal_stream_replay.py holds against the script, with the records
    arriving in a random order."""
    stream = PersonalStream(
        RETENTION, LAMBDA, DELTA, setting.budget, setting.value_map, release_size=RELEASE_SIZE
    )
    arrival = np.random.default_rng(
        int.from_bytes(key.subkey("personal stream replay")[:8], "little")
    ).permutation(len(table))
    release = stream.publish(table, random_ids(len(table), key), key, order=arrival)
    return Published(release.published, np.ones(len(table), dtype=bool))


PUBLISHERS: dict[tuple[str, str], Publisher] = {
    ("decoy", "batch"): publish_decoy_batch,
    ("decoy", "stream"): publish_decoy_stream,
    ("personal", "batch"): publish_personal_batch,
    ("personal", "stream"): publish_personal_stream,
}
# Each mode's default personal budget: the batch's and the stream's.
PERSONAL_BUDGET = {"batch": "adaptive", "stream": "bounded"}


def estimators(
    mechanism: str, mode: str, grouping: str, value_map: ValueMap | None
) -> dict[str, Callable[[PublishedCells], Reconstruction]]:
    """The estimators compared on each publication, by label."""
    if mechanism == "decoy":
        return {
            label: functools.partial(
                DecoyReconstruction,
                gamma=GAMMA,
                sensitive=[SENSITIVE],
                matrix=matrix,
                grouping=grouping,
            )
            for label, matrix in (("2×2", "corrected"), ("m×m", "mixing"))
        }
    assert value_map is not None
    size = len(value_map.sensitive_domain)
    return {
        "SPS": lambda cells: PersonalReconstruction(
            cells,
            SENSITIVE,
            RETENTION,
            size,
            LAMBDA,
            DELTA,
            grouping,
            value_map,
            stream=mode == "stream",
        )
    }


@dataclass(frozen=True)
class Case:
    """One line of cases: `grouping` is a decoy case's cutting rule, a personal case's
    budget."""

    rows: int
    mechanism: str
    mode: str
    grouping: str


@dataclass
class Answers:
    """Per publication × query, for one estimator and band."""

    covered: np.ndarray
    error: np.ndarray
    declined: np.ndarray


# What worker processes read (set before the pool forks).
_shared: dict[str, object] = {}


def one_publication(index: int) -> dict[str, tuple[np.ndarray, ...]]:
    """Publish once and answer every query with every estimator: per label, (covered,
    relative error, declined) over the queries."""
    case: Case = _shared["case"]  # type: ignore[assignment]
    table: Table = _shared["table"]  # type: ignore[assignment]
    queries: list[Query] = _shared["queries"]  # type: ignore[assignment]
    setting: Setting = _shared["setting"]  # type: ignore[assignment]
    seed: int = _shared["seed"]  # type: ignore[assignment]
    publisher = PUBLISHERS[(case.mechanism, case.mode)]
    key = ServiceKey.from_seed(seed * 1_000_003 + case.rows + index)
    published = publisher(table, key, setting)
    truth = true_counts(table.take(published.kept), queries)
    cells = PublishedCells.from_table(published.table)
    out = {}
    for label, build in estimators(
        case.mechanism, case.mode, case.grouping, setting.value_map
    ).items():
        answers = build(cells).estimate_many(queries)
        estimate = np.asarray([a.estimate for a in answers])
        low = np.asarray([a.low for a in answers], dtype=float)
        high = np.asarray([a.high for a in answers], dtype=float)
        declined = ~np.asarray([a.identifiable for a in answers])
        covered = (low <= truth) & (truth <= high)
        with np.errstate(divide="ignore", invalid="ignore"):
            error = np.abs(estimate - truth) / truth
        out[label] = (covered, error, declined, truth)
    return out


def personal_budgets(mode: str, chosen: Sequence[str]) -> list[str]:
    """The personal budgets of `mode` among `chosen`, 'default' standing for the mode's."""
    named = [PERSONAL_BUDGET[mode] if b == "default" else b for b in chosen]
    usable = STREAM_BUDGETS if mode == "stream" else BUDGETS
    return [b for b in dict.fromkeys(named) if b in usable]


def run_case(
    case: Case,
    table: Table,
    bands: dict[str, list[Query]],
    publications: int,
    args: argparse.Namespace,
) -> dict[tuple[str, str], Answers]:
    value_map = fit_value_map(table, SENSITIVE) if case.mechanism == "personal" else None
    queries = [q for band in bands.values() for q in band]
    _shared.update(
        case=case, table=table, queries=queries, seed=args.seed,
        setting=Setting(case.grouping, args.stream_batch, value_map, case.grouping),
    )  # fmt: skip
    started = time.monotonic()
    results = []
    label = f"N = {case.rows:,}, {case.mechanism} {case.mode}, {case.grouping}"
    with ProcessPoolExecutor(args.jobs) as pool:
        for done, result in enumerate(pool.map(one_publication, range(publications)), start=1):
            results.append(result)
            elapsed = time.monotonic() - started
            status(f"{label}: {done}/{publications} publications, {elapsed:.0f} s")
    status(f"{label}: {publications} publications in {time.monotonic() - started:.0f} s", last=True)
    out = {}
    position = 0
    for band, band_queries in bands.items():
        part = slice(position, position + len(band_queries))
        position += len(band_queries)
        for estimator in results[0]:
            covered, error, declined, _ = (
                np.stack([r[estimator][k][part] for r in results]) for k in range(4)
            )
            out[(band, estimator)] = Answers(covered, error, declined)
    return out


def summary(answers: Answers) -> list[str]:
    """coverage ± SE over publications, worst query, mean relative error ± SE over
    publications, declined."""
    given = ~answers.declined
    counted = given.sum(axis=1)
    per_publication = np.where(counted > 0, (answers.covered & given).sum(axis=1), 0) / np.maximum(
        counted, 1
    )
    weights = counted / max(counted.sum(), 1)
    coverage = float((per_publication * weights).sum())
    publications = len(per_publication)
    spread = float(np.std(per_publication[counted > 0], ddof=1)) if publications > 1 else math.nan
    per_query_given = given.sum(axis=0)
    per_query = (answers.covered & given).sum(axis=0) / np.maximum(per_query_given, 1)
    worst = float(per_query[per_query_given > 0].min()) if per_query_given.any() else math.nan
    error = np.nanmean(answers.error, axis=1)
    error_spread = float(np.std(error, ddof=1)) if publications > 1 else math.nan
    return [
        f"{coverage:.3f} ± {spread / math.sqrt(publications):.3f}" if counted.sum() else "–",
        f"{worst:.2f}" if per_query_given.any() else "–",
        f"{error.mean():.3f} ± {error_spread / math.sqrt(publications):.3f}",
        f"{answers.declined.mean():.1%}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:-1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=list(ROWS),
        help="N: Adult resampled to each (default 45222 300000 1000000; 45222 is Adult itself)",
    )  # fmt: skip
    parser.add_argument(
        "--publications", type=int,
        help="publications per N (default 100 at 45,222, 40 at 300,000 and 1,000,000, and "
        "40 at any other N)",
    )  # fmt: skip
    parser.add_argument(
        "--mechanisms", nargs="+", choices=("decoy", "personal"), default=["decoy", "personal"]
    )
    parser.add_argument(
        "--modes", nargs="+", choices=("batch", "stream"), default=["batch", "stream"]
    )
    parser.add_argument(
        "--grouping", nargs="+", choices=GROUPINGS, default=["size-weighted"],
        help="decoy cutting rule(s) in batch (a stream always cuts size-weighted); anatomy "
        "is Anatomy's largest-first rule, for comparison",
    )  # fmt: skip
    parser.add_argument(
        "--budgets", nargs="+", choices=("default", *STREAM_BUDGETS), default=["default"],
        help="personal budgets: 'default' is each mode's own (batch adaptive, stream "
        "bounded); a budget a batch publication has not (bounded) is left out of batch",
    )  # fmt: skip
    parser.add_argument(
        "--stream-batch", type=int, default=STREAM_BATCH,
        help=f"decoy stream: records per worker call (default {STREAM_BATCH}, the config "
        "default; 1 is a stream so slow that each record is cut on arrival)",
    )  # fmt: skip
    parser.add_argument(
        "--small", type=int, default=200, help="small queries (true count 1–10) per N (default 200)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of resamples, queries and keys")
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1),
        help="worker processes, one publication each at a time (default 2)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.publications is not None and args.publications < 2:
        parser.error("--publications must be at least 2 (the error bar needs a spread)")

    base = adult()
    large = large_queries(base)
    log(f"{len(large)} large queries (true count ≥ {LARGE_SHARE:.0%} of Adult's rows)")
    rows_out = []
    for rows in args.rows:
        table = resample(base, rows, args.seed)
        small = small_queries(table, args.small, args.seed)
        bands = {"large": large, **({"small": small} if small else {})}
        publications = args.publications or PUBLICATIONS.get(rows, 40)
        cases = [
            Case(rows, mechanism, mode, grouping)
            for mechanism in args.mechanisms
            for mode in args.modes
            for grouping in (
                args.grouping if mechanism == "decoy" else personal_budgets(mode, args.budgets)
            )
            if mode == "batch" or grouping != "anatomy"
        ]
        for case in cases:
            results = run_case(case, table, bands, publications, args)
            for (band, estimator), answers in results.items():
                rows_out.append(
                    [
                        f"{rows:,}", f"{case.mechanism} {case.mode}", case.grouping, band,
                        estimator, str(publications), *summary(answers),
                    ]
                )  # fmt: skip
    print(
        f"Adult resampled (seed {args.seed}); public {', '.join(PUBLIC)} (age by decade), "
        f"sensitive {SENSITIVE}; decoy γ = {GAMMA}, personal p = {RETENTION}, "
        f"λ = {LAMBDA}, δ = {DELTA}; stream calls of {args.stream_batch} records"
    )
    print(
        f"large: {len(large)} queries with a true count ≥ {LARGE_SHARE:.0%} of N; small: "
        f"up to {args.small} with a true count 1–{SMALL_MAX}\n"
    )
    print_table(
        [
            "N", "mechanism", "grouping or budget", "band", "model", "pubs", "coverage ± SE",
            "worst query", "mean rel. error", "declined",
        ],
        rows_out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
