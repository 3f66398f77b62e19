"""`splu demo`: `splu run` on the bundled UCI Adult sample, with a check against the truth.

Writes the example stream config (decoy or personal, with shorter waits) and the first
--records records of the sample to a temporary directory and runs them through the
stream (`streams.tools.run.run_stream`: embedded servers, a worker and a consumer as child
processes, a producer, live progress, the summary). While the consumer still answers,
the demo asks it for a few large and small counts and compares them with the truth.
"""

from __future__ import annotations

import csv
import math
import tempfile
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import tomli_w

from service.cli import client
from service.core.config import StreamConfig
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.mechanisms.registry import DEFAULT_MECHANISM
from service.core.reconstruct import PublishedCells, Query
from service.core.table import open_sample, read_table
from streams.tools.run import estimate_text, run_stream

# Shorter than production so the tail of the demo stream is not left waiting long.
DEMO_SETTINGS = {"max_wait": 5.0, "flush_interval": 2.0, "partitions": 2, "report_interval": 5.0}


def _write_config(mechanism: str, work: Path) -> Path:
    # Each stream mechanism's bundled example: deploy/examples/adult-<mechanism>.toml.
    name = f"adult-{mechanism}.toml"
    examples = resources.files("deploy").joinpath("examples")
    document = tomllib.loads(examples.joinpath(name).read_text())
    document["stream"].update(DEMO_SETTINGS)
    merge = document.get(mechanism, {}).get("merge_map")
    if merge is not None:
        (work / merge).write_text(examples.joinpath(merge).read_text())
    path = work / name
    path.write_text(tomli_w.dumps(document))
    return path


def _write_sample(work: Path, records: int | None) -> Path:
    """The first `records` records of the sample as a CSV."""
    with open_sample() as stream:
        reader = csv.DictReader(stream)
        rows = list(reader)[:records]
        header = reader.fieldnames or []
    path = work / "adult.csv"
    with path.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _truth(path: Path, config: StreamConfig) -> PublishedCells:
    with path.open(newline="") as stream:
        table, _ = read_table(stream, config.schema)
    return PublishedCells.from_table(table)


def run_demo(
    mechanism: str = DEFAULT_MECHANISM,
    records: int | None = None,
    rate: float | None = None,
    serve: bool = False,
    port: int | None = None,
) -> int:
    with tempfile.TemporaryDirectory(prefix="splu-demo-") as directory:
        work = Path(directory)
        config_path = _write_config(mechanism, work)
        sample = _write_sample(work, records)
        return run_stream(
            config_path, sample, rate=rate, serve=serve, port=port, command="splu demo",
            afterwards=lambda config, url: _summary(config, _truth(sample, config), url),
        )  # fmt: skip


def _summary(config: StreamConfig, truth: PublishedCells, url: str) -> None:
    """The consumer's answers to the standing queries and a few small counts, against truth."""
    sensitive = config.sensitive[0]
    queries = [Query.from_json(q) for q in config.reports.queries]
    # Counts of 1..alpha are small: the privacy tests check that they stay noisy.
    small = config.reports.alpha
    queries += _small_queries(truth, sensitive, small, count=4)
    true_counts = [
        e.published for e in DecoyReconstruction(truth, 2, [sensitive]).estimate_many(queries)
    ]
    objects = [
        {"where": {c: list(v) for c, v in q.where.items()}, "value": dict(q.value)} for q in queries
    ]
    answers = client.ask(url, objects)
    texts = [
        " ∧ ".join(
            [*(f"{c}={v[0]}" for c, v in q.where.items()), f"{sensitive}={q.value[sensitive]}"]
        )
        for q in queries
    ]
    shown = [estimate_text(answer) for answer in answers]
    width, estimate_width = max(map(len, texts)), max(map(len, shown))
    print(
        f"\n{'count of':{width}} {'true':>6}  {'estimate [95% interval] ±':{estimate_width}} "
        f"{'error':>6}  inside"
    )
    errors: dict[bool, list[float]] = {True: [], False: []}
    inside: dict[bool, list[bool]] = {True: [], False: []}
    for text, answer, estimate, true in zip(texts, answers, shown, true_counts, strict=True):
        error = abs(answer["estimate"] - true) / true
        covered = answer.get("low", -math.inf) <= true <= answer.get("high", math.inf)
        errors[true > small].append(error)
        inside[true > small].append(covered)
        print(
            f"{text:{width}} {true:6,}  {estimate:{estimate_width}} {error:6.0%}  "
            f"{'yes' if covered else 'no'}"
        )
    if errors[True]:
        print(
            f"\nLarge counts (over {small}): off by {np.mean(errors[True]):.0%} on average; the "
            f"truth lies inside the 95% interval in {sum(inside[True])} of {len(inside[True])}."
        )
    if errors[False]:
        print(
            f"Small counts (1 to {small}): off by {np.mean(errors[False]):.0%} on average, on "
            "purpose: from the published\nrecords no one can tell whether a few people with "
            "these public values hold the value,\nor none. That noise is the privacy."
        )


def _small_queries(truth: PublishedCells, sensitive: str, small: int, count: int) -> list[Query]:
    """Deterministic conjunctions of three public columns whose true count is 1 to `small`."""
    public = [c for c in truth.columns if c != sensitive][-3:]
    positions = [truth.columns.index(c) for c in (*public, sensitive)]
    candidates = [
        Query(
            {c: (truth.domains[c][key[i]],) for i, c in enumerate(public)},
            {sensitive: truth.domains[sensitive][key[-1]]},
        )
        for key in np.unique(truth.cells[:, positions], axis=0)
    ]
    exact = DecoyReconstruction(truth, 2, [sensitive]).estimate_many(candidates)
    chosen = [q for q, e in zip(candidates, exact, strict=True) if 1 <= e.published <= small]
    step = max(len(chosen) // count, 1)
    return chosen[::step][:count]
