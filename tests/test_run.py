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
import json
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


# A survey as a new user has one: respondent id, age, sex, region, education, and a health
# condition (sensitive), with three broken rows at known lines of the file.
CONDITIONS = ("none", "asthma", "diabetes", "hypertension", "arthritis", "depression", "migraine")
BROKEN = {
    52: ("condition", ["r9001", "34", "F", "north", "bachelor", ""]),
    202: ("age", ["r9002", "unknown", "M", "south", "master", "asthma"]),
    352: ("region", ["r9003", "61", "F"]),  # a short row: its last fields are missing
}


def write_health_survey(path: Path, excel: bool = False) -> int:
    """400 rows and the broken ones; `excel` writes it as a spreadsheet in many locales
    exports it: semicolons, CRLF line ends, a byte-order mark. Returns the good rows."""
    rng = np.random.default_rng(33)
    rows = [
        [
            f"r{i:04d}", str(rng.integers(18, 90)), ("F", "M")[rng.integers(2)],
            REGIONS[rng.integers(len(REGIONS))],
            ("primary", "secondary", "vocational", "bachelor", "master")[rng.integers(5)],
            CONDITIONS[rng.choice(len(CONDITIONS), p=[0.3, 0.14, 0.12, 0.16, 0.1, 0.1, 0.08])],
        ]
        for i in range(ROWS)
    ]  # fmt: skip
    for line, (_, row) in sorted(BROKEN.items()):
        rows.insert(line - 2, row)  # line 1 is the header
    with path.open("w", newline="", encoding="utf-8-sig" if excel else "utf-8") as stream:
        writer = csv.writer(stream, delimiter=";" if excel else ",",
                            lineterminator="\r\n" if excel else "\n")  # fmt: skip
        writer.writerow(["respondent", "age", "sex", "region", "education", "condition"])
        writer.writerows(rows)
    return ROWS


@pytest.mark.parametrize("export", ["comma", "excel"])
def test_a_survey_planned_into_a_config_runs_unedited(tmp_path, export):
    """`splu plan --config-out` writes a config from the survey alone; `splu run` takes it
    as it is, publishes every accepted record and names the broken rows by line and field;
    `splu query --config` answers from what it published."""
    source, config = tmp_path / "survey.csv", tmp_path / "health.toml"
    good = write_health_survey(source, excel=export == "excel")
    plan = subprocess.run(
        [*SPLU, "plan", "--input", str(source), "--sensitive", "condition",
         "--quasi", "age,sex,region,education", "--id-column", "respondent",
         "--config-out", str(config), "--seed", "3", "--publications", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"Wrote {config}" in plan.stdout and "splu run --config" in plan.stdout, plan.stdout
    document = tomllib.loads(config.read_text())
    # age holds a number per person: it is binned, and the config says so.
    assert "bins" in document["schema"]["public"]["age"], document["schema"]
    assert "# age: " in config.read_text()
    assert document["reports"]["queries"], document["reports"]

    result = splu_run(tmp_path, config, source, "--published-out", str(tmp_path / "out.csv"),
                      "--rejected-out", str(tmp_path / "rejected.csv"))  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output
    sent, ingested, published, suppressed, rejected = map(number, SUMMARY.search(output).groups())
    assert (sent, ingested, rejected) == (good + len(BROKEN), good, len(BROKEN)), output
    assert published == ingested and suppressed == 0, output
    for line, (field, _) in BROKEN.items():
        assert f"line {line}, field '{field}'" in output, output
    with (tmp_path / "rejected.csv").open(newline="") as stream:
        kept = list(csv.DictReader(stream))
    assert [(int(r["line"]), r["field"]) for r in kept] == [
        (line, field) for line, (field, _) in sorted(BROKEN.items())
    ]
    assert "standing queries: estimate [95% interval]" in output, output

    queries = tmp_path / "queries.jsonl"
    queries.write_text(json.dumps(document["reports"]["queries"][0]) + "\n")
    answered = subprocess.run(
        [*SPLU, "query", "--published", str(tmp_path / "out.csv"), "--config", str(config),
         "--queries", str(queries), "--output", "-"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert answered.returncode == 0, answered.stderr
    answer = json.loads(answered.stdout)
    assert answer["low"] <= answer["estimate"] <= answer["high"]
