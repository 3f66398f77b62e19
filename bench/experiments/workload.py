"""Data sets and query pools of the experiments: UCI Adult, Adult resampled to N rows, and
count queries "1–3 public attributes = values ∧ sensitive = s" stratified by the size of
their true count.

The two workloads are the ones the existing benchmarks use (imported from them):

- occupation (bench/decoy_accuracy.py): public age, sex, race, marital_status,
  education; sensitive occupation (m = 14). Every mechanism with one categorical
  sensitive attribute answers it: decoy groups, Anatomy, global randomization, SDR,
  F′-privacy, DBR, Laplace.
- income (bench/personal_accuracy.py): public education, occupation, race, sex;
  sensitive income (m = 2). Personal groups with SPS are defined for it (seed 004
  uses exactly this table); DBR, plain uniform perturbation and Laplace answer it
  too, for scale.

Queries. The papers draw d ∈ {1, 2, 3} public attributes, a value for each and a
sensitive value at random, and bin the queries by selectivity (true count / N).
On Adult the high bands are narrow: only 38 distinct occupation queries have a
selectivity of 5% or more. So we enumerate every distinct query of that form
whose predicate is non-empty (all value combinations that occur in the data, times
every sensitive value) and sample up to `per_band` distinct queries uniformly
within each band below 1% selectivity, with a fixed seed; the bands from 1% up
(a few hundred queries on Adult) and any band with fewer distinct queries are
taken whole. The bands:

- small: true count 1–10 (the privacy side: its error should stay high);
- selectivity [0.1%, 0.5%), [0.5%, 1%), [1%, 2%), [2%, 5%), ≥ 5% (utility side);
  "large" is every sampled query with selectivity ≥ 1% (the last three bands).
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.core.reconstruct import Query
from service.core.table import Table, distinct_rows, open_sample, read_table

BENCH = Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    # The benchmarks are scripts that import their helpers as top-level modules.
    sys.path.insert(0, str(BENCH))

import decoy_accuracy  # noqa: E402
import personal_accuracy  # noqa: E402
from report import log  # noqa: E402

OCCUPATION = "occupation"
INCOME = "income"
# workload name -> (public columns, sensitive column)
WORKLOADS: dict[str, tuple[tuple[str, ...], str]] = {
    OCCUPATION: (tuple(decoy_accuracy.QUASI), decoy_accuracy.SENSITIVE),
    INCOME: (tuple(personal_accuracy.PUBLIC), personal_accuracy.SENSITIVE),
}
SMALL_MAX = decoy_accuracy.SMALL_MAX
MAX_ATTRIBUTES = 3


@dataclass(frozen=True)
class Band:
    key: str  # as written in the CSVs
    label: str  # as shown in plots and the report
    low: float  # selectivity bounds [low, high); unused by the small band
    high: float


BANDS = (
    Band("small", f"count 1–{SMALL_MAX}", 0.0, 0.0),
    Band("0.1-0.5%", "0.1–0.5%", 0.001, 0.005),
    Band("0.5-1%", "0.5–1%", 0.005, 0.01),
    Band("1-2%", "1–2%", 0.01, 0.02),
    Band("2-5%", "2–5%", 0.02, 0.05),
    Band(">=5%", "≥ 5%", 0.05, math.inf),
)
SMALL = 0
LARGE = tuple(i for i, b in enumerate(BANDS) if b.low >= 0.01)
LARGE_KEY = "large>=1%"
LARGE_LABEL = "large (selectivity ≥ 1%)"
# Every band but the small one: the thesis's workload keeps queries of selectivity ≥ 0.1%.
UTILITY = tuple(i for i, b in enumerate(BANDS) if b.low >= 0.001)
UTILITY_KEY = "all>=0.1%"
UTILITY_LABEL = "selectivity ≥ 0.1%"


def band_of(counts: np.ndarray, n: int) -> np.ndarray:
    """Band index of every true count, −1 for counts in no band (0, 11 … 0.1%·N)."""
    counts = np.asarray(counts)
    band = np.full(len(counts), -1, dtype=np.int64)
    for i, b in enumerate(BANDS[1:], start=1):
        band[(counts >= b.low * n) & (counts < b.high * n)] = i
    band[(counts >= 1) & (counts <= SMALL_MAX)] = SMALL
    return band


@dataclass
class Pool:
    """Queries with their true counts, predicate sizes |P| and bands, on one table."""

    workload: str
    sensitive: str
    queries: list[Query]
    true: np.ndarray
    rows: np.ndarray
    band: np.ndarray
    available: np.ndarray  # distinct queries per band before sampling

    def __len__(self) -> int:
        return len(self.queries)


def load(workload: str) -> Table:
    """The bundled Adult sample (45,222 records) encoded for `workload`."""
    public, sensitive = WORKLOADS[workload]
    with open_sample() as stream:
        table, rejected = read_table(stream, quasi=public, sensitive=[sensitive])
    if rejected:
        raise SystemExit(f"the bundled Adult sample has {len(rejected)} unreadable rows")
    return table


def resample(table: Table, rows: int, seed: int) -> Table:
    """`rows` records drawn with replacement from `table` (same seed, same rows)."""
    picks = np.random.default_rng(seed).integers(0, len(table), rows)
    return table.take(picks)


def subsample(table: Table, rows: int, seed: int) -> Table:
    """`rows` distinct records of `table` (for the quick mode)."""
    picks = np.sort(np.random.default_rng(seed).choice(len(table), rows, replace=False))
    return table.take(picks)


def query_pool(table: Table, workload: str, per_band: int, seed: int) -> Pool:
    """Up to `per_band` distinct queries per band below 1% (the large bands whole),
    sampled uniformly with `seed`."""
    public, sensitive = WORKLOADS[workload]
    schema = table.schema
    n, m = len(table), schema[sensitive].size
    names = [*public, sensitive]
    sizes = [schema[c].size for c in names]
    cells, _, weights = distinct_rows([table.codes[c] for c in names], sizes)
    values = cells[:, -1]
    # Every candidate: (attribute subset, predicate key, sensitive code, count, |P|).
    subsets, keys, codes, counts, rows = [], [], [], [], []
    combos = [
        c
        for d in range(1, MAX_ATTRIBUTES + 1)
        for c in itertools.combinations(range(len(public)), d)
    ]
    for s, columns in enumerate(combos):
        radix = np.cumprod([1, *[sizes[c] for c in columns[:0:-1]]])[::-1]
        predicate = cells[:, list(columns)] @ radix
        p_keys, p_inverse = np.unique(predicate, return_inverse=True)
        p_rows = np.bincount(p_inverse, weights=weights)
        ps_keys, ps_inverse = np.unique(p_inverse * m + values, return_inverse=True)
        ps_counts = np.bincount(ps_inverse, weights=weights)
        subsets.append(np.full(len(ps_keys), s))
        keys.append(p_keys[ps_keys // m])
        codes.append(ps_keys % m)
        counts.append(ps_counts)
        rows.append(p_rows[ps_keys // m])
    subset, key, code = np.concatenate(subsets), np.concatenate(keys), np.concatenate(codes)
    count, predicate_rows = np.concatenate(counts), np.concatenate(rows)
    band = band_of(count, n)
    available = np.bincount(band[band >= 0], minlength=len(BANDS))
    rng = np.random.default_rng(seed)
    chosen = np.concatenate(
        [
            np.sort(rng.choice(members, min(quota, len(members)), replace=False))
            for members, quota in (
                (np.flatnonzero(band == i), len(band) if i in LARGE else per_band)
                for i in range(len(BANDS))
            )
        ]
    ).astype(np.int64)
    queries = []
    for i in chosen:
        columns = combos[subset[i]]
        digits = np.unravel_index(key[i], [sizes[c] for c in columns])
        where = {
            public[c]: (schema[public[c]].domain[int(v)],)
            for c, v in zip(columns, digits, strict=True)
        }
        queries.append(Query(where, {sensitive: schema[sensitive].domain[int(code[i])]}))
    log(f"  {workload} pool on {n:,} rows: {len(queries):,} queries")
    return Pool(
        workload, sensitive, queries, count[chosen], predicate_rows[chosen], band[chosen], available
    )
