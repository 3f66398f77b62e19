"""`splu run` on a user's own data: a CSV and a config written here, not Adult.

A synthetic survey of 400 responses (region, plan, and a sensitive answer) with a few
invalid rows, run once as a decoy stream and once as a personal stream with no merge map,
each on fresh embedded servers, with a config that leaves the mixing floor at its default
of 1,000 records, which 400 never fill: `splu run` closes the stream at the end of its
input, and the close publishes what the floor held (issue 29). The summary's accounting
must add up (every record sent is in and published or suppressed, or rejected), and the
CSV --published-out writes must hold exactly the published records: the schema's columns
in its order, values from their domains, no id column, and the public values of the
input. A survey of 12 responses (4 groups, fewer than the minimum mixing of 10) is
suppressed whole at the close, as stream.small_remainder says by default: the summary
says so and --published-out writes a header alone.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tomli_w

pytestmark = pytest.mark.stream

SPLU = [sys.executable, "-m", "streams.cli"]
REGIONS = ("north", "south", "east", "west")
PLANS = ("basic", "plus", "pro")
ANSWERS = ("never", "rarely", "sometimes", "often", "always", "refused")
ROWS = 400
INVALID = 3
PERSONAL_ANSWERS = 3  # the personal stream's sensitive domain: its first answers
SUMMARY = re.compile(
    r"records: ([\d,]+) sent, ([\d,]+) in, ([\d,]+) published, ([\d,]+) suppressed, "
    r"([\d,]+) rejected"
)


def write_survey(path: Path, rows: int = ROWS, answers: int = len(ANSWERS)) -> list[dict[str, str]]:
    """`rows` valid responses whose answers are the first `answers` of ANSWERS, then the
    INVALID ones."""
    rng = np.random.default_rng(5)
    shares = np.array([0.3, 0.25, 0.2, 0.12, 0.08, 0.05][:answers])
    rows = [
        {
            "respondent": f"r{i:05d}",
            "region": REGIONS[rng.integers(len(REGIONS))],
            "plan": PLANS[rng.choice(len(PLANS), p=[0.6, 0.3, 0.1])],
            "answer": ANSWERS[rng.choice(answers, p=shares / shares.sum())],
        }
        for i in range(rows)
    ]
    rows += [
        {"respondent": f"bad{i}", "region": "mars", "plan": "basic", "answer": "never"}
        for i in range(INVALID)
    ]
    with path.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def write_config(path: Path, mechanism: str) -> None:
    sensitive = ANSWERS if mechanism == "decoy" else ANSWERS[:PERSONAL_ANSWERS]
    document: dict = {
        "stream": {
            "name": f"survey-{mechanism}", "mechanism": mechanism, "partitions": 2,
            "max_wait": 5.0, "flush_interval": 1.0, "report_interval": 2.0,
            "batch_size": 500, "batch_wait": 0.1,
        },
        "key": {"env": "SPLU_SERVICE_KEY"},
        "kafka": {"bootstrap": "127.0.0.1:9092"},
        "redis": {"url": "redis://127.0.0.1:6379/0", "password_env": "REDIS_PASSWORD"},
        "reports": {
            "fail_closed": [],
            "queries": [{"where": {"region": "north"}, "value": {"answer": sensitive[0]}}],
        },
        "schema": {
            "public": {"region": {"domain": list(REGIONS)}, "plan": {"domain": list(PLANS)}},
            "sensitive": {"answer": {"domain": list(sensitive)}},
        },
    }  # fmt: skip
    if mechanism == "decoy":
        document["decoy"] = {"gamma": 3}
    else:
        document["personal"] = {"retention": 0.6, "lambda": 0.3, "delta": 0.3,
                                "budget": "conservative", "release_size": 20}  # fmt: skip
    path.write_text(tomli_w.dumps(document))


def splu_run(
    directory: Path, config: Path, source: Path, *options: str
) -> subprocess.CompletedProcess:
    """`splu run` on the survey, keyed by its respondent column, in a clean environment
    (no servers or key named: the run starts its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "REDIS_", "SPLU_"))}
    return subprocess.run(
        [*SPLU, "run", "--config", str(config), "--input", str(source),
         "--id-column", "respondent", *options],
        env=env, cwd=directory, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def number(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.mark.parametrize("mechanism", ["decoy", "personal"])
def test_run_streams_a_users_csv_and_writes_what_was_published(tmp_path, mechanism):
    source, config, out = tmp_path / "survey.csv", tmp_path / "survey.toml", tmp_path / "out.csv"
    answers = len(ANSWERS) if mechanism == "decoy" else PERSONAL_ANSWERS
    rows = write_survey(source, answers=answers)
    assert len(rows) - INVALID == ROWS < 1000  # the default floor, which the config keeps
    write_config(config, mechanism)
    result = splu_run(tmp_path, config, source, "--published-out", str(out))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "is not set; this run uses a fresh service key" in output

    summary = SUMMARY.search(output)
    assert summary, output
    sent, ingested, published, suppressed, rejected = map(number, summary.groups())
    assert sent == len(rows) and rejected == INVALID, output
    assert ingested == sent - rejected == published + suppressed == ROWS, output
    assert published > 0.9 * ingested, output
    assert "responses never fill the mixing floor of 1,000" in output, output
    assert "left as one take of" in output, output
    assert "standing queries" in output and "privacy tests (last report):" in output

    with out.open(newline="") as stream:
        reader = csv.DictReader(stream)
        published_rows = list(reader)
        assert reader.fieldnames == ["region", "plan", "answer"]
    assert len(published_rows) == published
    domains = {"region": REGIONS, "plan": PLANS, "answer": ANSWERS}
    assert all(r[c] in domains[c] for r in published_rows for c in domains)
    # Public values are published as they are: each (region, plan) at most as often as sent.
    sent_public = Counter((r["region"], r["plan"]) for r in rows if r["region"] != "mars")
    shown_public = Counter((r["region"], r["plan"]) for r in published_rows)
    assert all(shown_public[k] <= sent_public[k] for k in shown_public)
    assert sum(sent_public.values()) - sum(shown_public.values()) == suppressed


def test_a_survey_too_small_to_mix_is_suppressed_and_says_so(tmp_path):
    source, config, out = tmp_path / "survey.csv", tmp_path / "survey.toml", tmp_path / "out.csv"
    write_survey(source, rows=12)
    write_config(config, "decoy")
    result = splu_run(tmp_path, config, source, "--published-out", str(out))
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output
    counts = tuple(map(number, SUMMARY.search(output).groups()))
    # sent, in, published, suppressed, rejected
    assert counts == (12 + INVALID, 12, 0, 12, INVALID), output
    assert "fewer than the minimum mixing of 30 records" in output, output
    assert "published records: 0 rows written" in output, output
    assert out.read_text().splitlines() == ["region,plan,answer"]


def test_run_counts_a_windowed_stream_with_its_consumer(tmp_path):
    """A windowed stream is counted too: the summary's standing query and privacy tests
    come from its consumer, the tests without meaning for Anatomy reported n/a."""
    source, config = tmp_path / "survey.csv", tmp_path / "survey.toml"
    write_survey(source)
    write_config(config, "decoy")
    document = tomllib.loads(config.read_text())
    del document["decoy"]
    document["stream"].update(name="survey-windowed", mechanism="windowed")
    document["windowed"] = {
        "mechanism": "anatomy", "gamma": 3, "window": 400, "max_window_wait": 3.0,
        "min_window": 50,
    }  # fmt: skip
    config.write_text(tomli_w.dumps(document))
    result = splu_run(tmp_path, config, source)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = SUMMARY.search(output)
    assert summary, output
    sent, ingested, published, suppressed, rejected = map(number, summary.groups())
    assert (sent, rejected) == (ROWS + INVALID, INVALID) and published + suppressed == ingested
    assert published > 0.9 * ingested, output
    standing = re.search(r"  region=north ∧ answer=never: ([\d,.]+)\n", output)
    assert standing and float(standing.group(1).replace(",", "")) > 0, output
    assert "guarantees pass" in output and "adversary n/a" in output, output
