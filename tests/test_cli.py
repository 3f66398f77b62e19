"""The `splu` command line, end to end on files."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from service.cli import main

QUASI = "age,sex,race,marital_status,education"


@pytest.fixture(scope="module")
def adult_csv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "adult.csv"
    assert main(["sample", "--output", str(path)]) == 0
    return path


def publish(adult_csv: Path, out: Path, *extra: str) -> int:
    return main([
        "publish", "--input", str(adult_csv), "--output", str(out), "--mechanism", "decoy",
        "--gamma", "5", "--sensitive", "occupation", "--quasi", QUASI, *extra,
    ])  # fmt: skip


def test_publish_then_query(adult_csv, tmp_path, capsys):
    published, report = tmp_path / "p.csv", tmp_path / "report.json"
    assert publish(adult_csv, published, "--seed", "1", "--report", str(report)) == 0
    with published.open() as stream:
        rows = list(csv.reader(stream))
    assert rows[0] == [*QUASI.split(","), "occupation"]
    accounting = json.loads(report.read_text())
    assert accounting["input_rows"] == 45_222
    assert len(rows) - 1 == accounting["published_rows"] == 45_220
    assert len(accounting["trimmed_lines"]) == 2 and accounting["rejected"] == []
    err = capsys.readouterr().err
    assert "9,044 decoy groups of γ=5 (size-weighted)" in err
    assert "published 45,220 rows to" in err

    sales = sum(1 for row in rows[1:] if row[-1] == "Sales")
    queries = tmp_path / "q.jsonl"
    queries.write_text(
        '{"where": {"sex": "Female"}, "value": {"occupation": "Adm-clerical"}}\n'
        "\n"
        '{"value": {"occupation": "Sales"}}\n'
        '{"where": {"education": ["Bachelors", "Masters"], "sex": "Male"}, '
        '"value": {"occupation": "Prof-specialty"}}\n'
    )
    answers = tmp_path / "a.jsonl"
    assert main([
        "query", "--published", str(published), "--mechanism", "decoy", "--gamma", "5",
        "--sensitive", "occupation", "--queries", str(queries), "--output", str(answers),
    ]) == 0  # fmt: skip
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(lines) == 3
    assert lines[0]["where"] == {"sex": "Female"}
    assert all({"estimate", "low", "high"} <= set(line) for line in lines)
    assert lines[1]["estimate"] == sales
    assert lines[0]["low"] <= lines[0]["estimate"] <= lines[0]["high"]
    # True count of Female ∧ Adm-clerical in Adult is 3,730; γ = 5 keeps it within ±30%.
    assert 0.7 * 3730 < lines[0]["estimate"] < 1.3 * 3730


def test_seed_reproduces_and_fresh_keys_differ(adult_csv, tmp_path):
    paths = [tmp_path / f"{name}.csv" for name in ("a", "b", "c")]
    assert publish(adult_csv, paths[0], "--seed", "7") == 0
    assert publish(adult_csv, paths[1], "--seed", "7") == 0
    assert publish(adult_csv, paths[2]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()


def test_iterative_method_and_paper_matrix_are_selectable(adult_csv, tmp_path):
    published = tmp_path / "p.csv"
    assert publish(adult_csv, published, "--seed", "2", "--grouping", "anatomy") == 0
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"where": {"sex": "Male"}, "value": {"occupation": "Craft-repair"}}\n')
    answers = tmp_path / "a.jsonl"
    assert main([
        "query", "--published", str(published), "--gamma", "5", "--sensitive", "occupation",
        "--queries", str(queries), "--output", str(answers), "--method", "iterative",
        "--matrix", "paper",
    ]) == 0  # fmt: skip
    answer = json.loads(answers.read_text())
    assert "estimate" in answer and "low" not in answer


def test_bad_rows_are_rejected_and_reported_not_dropped(tmp_path, capsys):
    source = tmp_path / "in.csv"
    good = [f"{20 + i % 40},{'FM'[i % 2]},job{i % 7}" for i in range(300)]
    source.write_text(
        "age,sex,job\n" + "\n".join(good[:100]) + "\n30,F\n40,M,\n" + "\n".join(good[100:]) + "\n"
    )
    out, report = tmp_path / "out.csv", tmp_path / "r.json"
    code = main([
        "publish", "--input", str(source), "--output", str(out), "--gamma", "5",
        "--sensitive", "job", "--quasi", "age,sex", "--report", str(report), "--seed", "1",
    ])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "rejected 2 rows" in err
    assert "line 102: malformed CSV line: 2 fields, the header has 3" in err
    assert "field 'job': missing value for a sensitive attribute" in err
    accounting = json.loads(report.read_text())
    assert [r["line"] for r in accounting["rejected"]] == [102, 103]
    assert accounting["input_rows"] == 302
    published = len(out.read_text().splitlines()) - 1
    trimmed = len(accounting["trimmed_lines"])
    suppressed = sum(accounting["suppressed"]["job"].values())
    assert published + trimmed + suppressed + 2 == 302


def test_unknown_column_fails_clearly_and_writes_nothing(adult_csv, tmp_path, capsys):
    out = tmp_path / "p.csv"
    code = main([
        "publish", "--input", str(adult_csv), "--output", str(out), "--gamma", "5",
        "--sensitive", "occupatoin", "--quasi", "age",
    ])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "splu publish: error: unknown column 'occupatoin'; the input has age, workclass" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gamma", "1"], "gamma must be at least 2"),
        (["--quasi", "age", "--schema", "x.toml"], "either --schema or --quasi"),
        (["--bin", "age"], "write COL=WIDTH or COL=EDGE"),
        (["--gamma", "20"], "has 14 distinct values in the data; groups of γ=20"),
    ],
)
def test_bad_options_are_explained(adult_csv, tmp_path, capsys, argv, message):
    base = ["publish", "--input", str(adult_csv), "--output", str(tmp_path / "o.csv")]
    sensitive = [] if "--schema" in argv else ["--sensitive", "occupation"]
    assert main(base + sensitive + argv) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.csv").exists()


def test_missing_schema_file(adult_csv, tmp_path, capsys):
    code = main(["publish", "--input", str(adult_csv), "--output", "-",
                 "--schema", str(tmp_path / "none.toml")])  # fmt: skip
    assert code == 1
    assert "cannot read" in capsys.readouterr().err


def test_missing_input_file(tmp_path, capsys):
    code = main(["publish", "--input", str(tmp_path / "nope.csv"), "--output", "-",
                 "--sensitive", "x"])  # fmt: skip
    assert code == 1
    assert "cannot read" in capsys.readouterr().err


def test_query_errors_are_reported_per_line(adult_csv, tmp_path, capsys):
    published = tmp_path / "p.csv"
    assert publish(adult_csv, published, "--seed", "3") == 0
    queries = tmp_path / "q.jsonl"
    queries.write_text(
        '{"where": {"occupation": "Sales"}}\n{not json\n{"value": {"occupation": "Sales"}}\n'
    )
    answers = tmp_path / "a.jsonl"
    code = main(["query", "--published", str(published), "--gamma", "5", "--sensitive",
                 "occupation", "--queries", str(queries), "--output", str(answers)])  # fmt: skip
    assert code == 1
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    assert lines[0]["error"].startswith("where.occupation: 'occupation' is sensitive")
    assert lines[0]["where"] == {"occupation": "Sales"}
    assert lines[1] == {"line": 2, "error": lines[1]["error"]}
    assert lines[1]["error"].startswith("not valid JSON")
    assert "estimate" in lines[2]
    assert "2 queries could not be answered" in capsys.readouterr().err


def test_schema_file_round_trip(adult_csv, tmp_path):
    schema = tmp_path / "stream.toml"
    assert (
        main(
            [
                "schema",
                "--input",
                str(adult_csv),
                "--quasi",
                "sex,race",
                "--sensitive",
                "occupation",
                "--bin",
                "age=10",
                "--quasi",
                "age",
                "--output",
                str(schema),
            ]
        )
        == 0
    )
    text = schema.read_text()
    assert "[schema.public.age]" in text and "bins = [" in text
    out = tmp_path / "p.csv"
    assert main(["publish", "--input", str(adult_csv), "--output", str(out), "--schema",
                 str(schema), "--seed", "4"]) == 0  # fmt: skip
    with out.open() as stream:
        header, first = list(csv.reader(stream))[:2]
    assert header == ["sex", "race", "age", "occupation"]
    assert first[2].startswith("[") and first[2].endswith(")")


def test_guarantees_json(capsys):
    assert (
        main(
            [
                "guarantees",
                "--mechanism",
                "decoy",
                "--gamma",
                "10",
                "--epsilon",
                "0.3",
                "--alpha",
                "5",
                "--te",
                "0.02",
                "--utility-epsilon",
                "0.2",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["privacy"]["T_P"] == pytest.approx(0.4291, abs=1e-4)
    assert result["privacy"]["deviation_probability"]["5"] == pytest.approx(0.4801, abs=1e-4)
    assert result["utility"]["T_f"] == 126
    assert result["utility"]["chebyshev_T_f_paper"] == pytest.approx(11.18, abs=0.01)


def test_help_explains_gamma(capsys):
    for command in ("publish", "query", "guarantees"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "distinct values of its hidden group" in " ".join(capsys.readouterr().out.split())


def test_console_script_is_installed():
    splu = shutil.which("splu") or str(Path(__file__).parents[1] / ".venv" / "bin" / "splu")
    result = subprocess.run(
        [splu, "guarantees", "--gamma", "5", "--json"], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout)["privacy"]["worst_count"] == 10


PERSONAL = ["--sensitive", "income", "--quasi", "education,occupation,race,sex"]


def test_personal_workflow_merge_publish_query(adult_csv, tmp_path, capsys):
    merge_map, published, report = tmp_path / "m.toml", tmp_path / "p.csv", tmp_path / "r.json"
    assert main(["merge", "--input", str(adult_csv), *PERSONAL, "--output", str(merge_map),
                 "--json"]) == 0  # fmt: skip
    merged = json.loads(capsys.readouterr().out)
    assert merged["possible_groups"] == {"before": 2240, "after": 84}
    options = ["--mechanism", "personal", "--retention", "0.5", "--lambda", "0.3", "--delta", "0.3",
               "--merge-map", str(merge_map)]  # fmt: skip
    assert main(["publish", "--input", str(adult_csv), "--output", str(published), *PERSONAL,
                 *options, "--seed", "1", "--report", str(report)]) == 0  # fmt: skip
    accounting = json.loads(report.read_text())
    assert accounting["published_rows"] == 45_222
    assert accounting["sps"] == {"v_g": 0.0, "v_r": 0.0}
    assert accounting["plain"]["v_r"] > 0.98
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"where": {"sex": "Male"}, "value": {"income": ">50K"}}\n')
    answers = tmp_path / "a.jsonl"
    assert main(["query", "--published", str(published), "--sensitive", "income", *options,
                 "--queries", str(queries), "--output", str(answers)]) == 0  # fmt: skip
    answer = json.loads(answers.read_text())
    # 9,539 men earn >50K; SPS leaves few trials per group, hence the wide interval.
    assert answer["low"] < 9539 < answer["high"]


def test_options_of_the_other_mechanism_are_refused(adult_csv, tmp_path, capsys):
    code = main(["publish", "--input", str(adult_csv), "--output", str(tmp_path / "o.csv"),
                 *PERSONAL, "--gamma", "5", "--mechanism", "personal"])  # fmt: skip
    assert code == 1
    assert "--gamma applies to --mechanism decoy, not personal" in capsys.readouterr().err


def test_audit_personal_reports_the_test(adult_csv, capsys):
    assert main(["audit", "personal", "--input", str(adult_csv), *PERSONAL, "--seed", "2",
                 "--json"]) == 0  # fmt: skip
    audit = json.loads(capsys.readouterr().out)
    assert audit["groups"] == len(audit["per_group"]) == 74
    assert audit["sps"]["v_g"] == 0.0 and audit["plain"]["v_g"] > 0.5
    assert all(g["trials_sps"] <= g["limit"] for g in audit["per_group"])
    assert main(["audit", "personal", "--input", str(adult_csv), *PERSONAL, "--seed", "2"]) == 0
    assert "plain perturbation: 74 groups" in capsys.readouterr().out


def test_audit_dp_counts_disclosures_per_epsilon(adult_csv, capsys):
    assert main(["audit", "dp", "--input", str(adult_csv), *PERSONAL, "--epsilon", "0.01",
                 "--epsilon", "0.5", "--json"]) == 0  # fmt: skip
    quiet, loud = json.loads(capsys.readouterr().out)
    assert quiet["disclosures"] == 0 < loud["disclosures"]
    assert loud["disclosed"][0]["value"] == ">50K"
