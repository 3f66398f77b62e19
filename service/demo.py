"""`splu demo` in batch form: publish the bundled sample and compare counts with the truth."""

from __future__ import annotations

import time

import numpy as np

from service.guarantees import privacy_threshold
from service.mechanisms.decoy import DecoyGroups
from service.prf import ServiceKey, random_ids
from service.reconstruct import DecoyReconstruction, PublishedCells, Query
from service.table import open_sample, read_table

QUASI = ["age", "sex", "race", "marital_status", "education"]
SENSITIVE = "occupation"
LARGE_COUNTS = [
    ({"sex": "Male"}, "Craft-repair"),
    ({"sex": "Female"}, "Adm-clerical"),
    ({"education": "Bachelors"}, "Prof-specialty"),
    ({"marital_status": "Married-civ-spouse"}, "Exec-managerial"),
    ({"race": "White", "sex": "Female"}, "Other-service"),
]


def run_demo(gamma: int, seed: int | None) -> None:
    print(
        f"splu demo: decoy groups (γ={gamma}) over the bundled UCI Adult sample, "
        f"sensitive = {SENSITIVE}, public = {', '.join(QUASI)}"
    )
    with open_sample() as stream:
        table, rejections = read_table(stream, quasi=QUASI, sensitive=[SENSITIVE])
    key = ServiceKey.fresh() if seed is None else ServiceKey.from_seed(seed)
    ids = random_ids(len(table), None if seed is None else key)
    started = time.perf_counter()
    release = DecoyGroups(gamma).publish(table, ids, key)
    print(
        f"published {len(release.published):,} of {len(table) + len(rejections):,} records "
        f"in {time.perf_counter() - started:.2f} s ({len(release.trimmed_lines)} trimmed to a "
        f"multiple of γ)"
    )
    truth = PublishedCells.from_table(table)
    reconstruction = DecoyReconstruction(
        PublishedCells.from_table(release.published), gamma, [SENSITIVE]
    )
    queries = [
        Query({c: (v,) for c, v in where.items()}, {SENSITIVE: s}) for where, s in LARGE_COUNTS
    ] + _small_count_queries(truth, count=5)
    true_counts = [
        e.published for e in DecoyReconstruction(truth, gamma, [SENSITIVE]).estimate_many(queries)
    ]
    texts = [
        " ∧ ".join(
            [*(f"{c}={v[0]}" for c, v in q.where.items()), f"{SENSITIVE}={q.value[SENSITIVE]}"]
        )
        for q in queries
    ]
    width = max(map(len, texts))
    print(f"\n{'count of':{width}} {'true':>6} {'estimate':>9} {'rel.err':>8}")
    errors: dict[bool, list[float]] = {True: [], False: []}
    for text, estimate, true in zip(
        texts, reconstruction.estimate_many(queries), true_counts, strict=True
    ):
        error = abs(estimate.estimate - true) / true
        errors[true > 10].append(error)
        print(f"{text:{width}} {true:6,} {estimate.estimate:9,.0f} {error:8.0%}")
    privacy = privacy_threshold(gamma, 0.3, 10)
    print(
        f"\nlarge counts: mean relative error {np.mean(errors[True]):.0%}; "
        f"small counts (1-10): {np.mean(errors[False]):.0%}"
    )
    print(
        f"guarantee: a value held by 1-10 people is published off by more than 30% "
        f"with probability ≥ {privacy.threshold:.2f}"
    )


def _small_count_queries(truth: PublishedCells, count: int) -> list[Query]:
    """Deterministic conjunctive queries whose true count is between 1 and 10."""
    public = ("sex", "race", "education")
    positions = [truth.columns.index(c) for c in (*public, SENSITIVE)]
    chosen = [
        Query(
            {c: (truth.domains[c][key[i]],) for i, c in enumerate(public)},
            {SENSITIVE: truth.domains[SENSITIVE][key[-1]]},
        )
        for key in np.unique(truth.cells[:, positions], axis=0)
    ]
    exact = DecoyReconstruction(truth, 2, [SENSITIVE]).estimate_many(chosen)
    small = [q for q, e in zip(chosen, exact, strict=True) if 1 <= e.published <= 10]
    step = max(len(small) // count, 1)
    return small[::step][:count]
