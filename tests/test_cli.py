"""The `splu` command line, end to end on files."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from service.cli.batch import main

QUASI = "age,sex,race,marital_status,education"


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


def test_a_fitted_merge_map_goes_beside_the_publication_and_query_needs_it(
    adult_csv, tmp_path, capsys
):
    """Without --merge-map, publish fits one and writes it as OUT.merge.toml; query reads
    it back (the answer equals one given the map by name) and refuses without it: other
    groups would give intervals that do not cover (tests/test_coverage.py)."""
    published, queries = tmp_path / "p.csv", tmp_path / "q.jsonl"
    options = ["--mechanism", "personal", "--retention", "0.5", "--lambda", "0.3", "--delta", "0.3"]
    assert main(["publish", "--input", str(adult_csv), "--output", str(published), *PERSONAL,
                 *options, "--seed", "1"]) == 0  # fmt: skip
    fitted = tmp_path / "p.merge.toml"
    assert fitted.exists() and str(fitted) in capsys.readouterr().err
    queries.write_text('{"where": {"sex": "Male"}, "value": {"income": ">50K"}}\n')
    answers = []
    for extra in ([], ["--merge-map", str(fitted)]):
        output = tmp_path / f"a{len(extra)}.jsonl"
        command = ["query", "--published", str(published), "--sensitive", "income", *options]
        assert main([*command, *extra, "--queries", str(queries), "--output", str(output)]) == 0
        answers.append(json.loads(output.read_text()))
    assert answers[0] == answers[1] and answers[0]["low"] < 9539 < answers[0]["high"]
    fitted.unlink()
    capsys.readouterr()
    query = ["query", "--published", str(published), "--sensitive", "income", *options]
    assert main([*query, "--queries", str(queries), "--output", str(tmp_path / "x.jsonl")]) == 1
    assert "needs the merge map the publication grouped with" in capsys.readouterr().err
    assert main(["publish", "--input", str(adult_csv), "--output", "-", *PERSONAL,
                 *options]) == 1  # fmt: skip
    assert "give a file name or --merge-map" in capsys.readouterr().err


def test_options_of_the_other_mechanism_are_refused(adult_csv, tmp_path, capsys):
    code = main(["publish", "--input", str(adult_csv), "--output", str(tmp_path / "o.csv"),
                 *PERSONAL, "--gamma", "5", "--mechanism", "personal"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "--gamma applies to --mechanism decoy, anatomy or global, not personal" in err


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


# The batch-only mechanisms: sdr, fprivacy, anatomy, dbr, global; laplace answers from raw data.

OCCUPATION = ["--sensitive", "occupation", "--quasi", QUASI]
BATCH_QUERIES = [
    {"where": {"sex": "Female"}},
    {"where": {"education": ["Bachelors", "Masters"], "race": "White"}},
    {"value": {"occupation": "Sales"}},
    {"where": {"sex": "Female"}, "value": {"occupation": "Adm-clerical"}},
]


@pytest.fixture(scope="module")
def adult_rows(adult_csv) -> list[dict[str, str]]:
    with adult_csv.open(newline="") as stream:
        return list(csv.DictReader(stream))


def true_count(rows: list[dict[str, str]], query: dict) -> int:
    def wanted(row: dict[str, str]) -> bool:
        for column, values in {**query.get("where", {}), **query.get("value", {})}.items():
            if row[column] not in (values if isinstance(values, list) else [values]):
                return False
        return True

    return sum(wanted(row) for row in rows)


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="") as stream:
        header, *rows = list(csv.reader(stream))
    return header, rows


def ask(tmp_path: Path, queries: list[dict], *argv: str) -> tuple[int, list[dict]]:
    asked, answered = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    asked.write_text("".join(json.dumps(q) + "\n" for q in queries))
    answered.unlink(missing_ok=True)
    code = main(["query", *argv, "--queries", str(asked), "--output", str(answered)])
    lines = answered.read_text().splitlines() if answered.exists() else []
    return code, [json.loads(line) for line in lines]


# mechanism -> (publish options, extra column of OUT.csv, whether OUT.st.csv holds the values)
BATCH = {
    "sdr": (["--rho1", "1/13", "--rho2", "1/6", "--delta", "0.05"], ["subtable"], False),
    "fprivacy": (["--theta", "8", "--beta", "0.02", "--max-size", "50"], ["bucket"], True),
    "anatomy": (["--gamma", "5"], ["group"], True),
    "dbr": ([], [], False),
    "global": (["--gamma", "5"], [], False),
}


@pytest.mark.parametrize("mechanism", list(BATCH))
def test_batch_mechanism_publishes_files_alone_that_query_reads_back(
    mechanism, adult_csv, adult_rows, tmp_path
):
    options, extra, bucketized = BATCH[mechanism]
    out, again = tmp_path / "out", tmp_path / "again"
    out.mkdir()
    again.mkdir()
    report = tmp_path / "report.json"
    for directory, extra_argv in ((out, ["--report", str(report)]), (again, [])):
        argv = ["--output", str(directory / "p.csv"), "--mechanism", mechanism, *options]
        argv += [*OCCUPATION, "--seed", "1", *extra_argv]
        assert main(["publish", "--input", str(adult_csv), *argv]) == 0
    names = {"p.csv", "p.params.json"} | ({"p.st.csv"} if bucketized else set())
    assert {p.name for p in out.iterdir()} == names
    for name in names:  # --seed reproduces every file
        assert (out / name).read_bytes() == (again / name).read_bytes()
    # Trusted-side accounting goes to --report only, never into the published files.
    accounting = json.loads(report.read_text())
    assert accounting["published_rows"] == 45_222 and accounting["rejected"] == []
    if mechanism == "fprivacy":
        assert len(accounting["thresholds"]) == 14 and accounting["suppressed_lines"] == []
    for name in names:
        text = (out / name).read_text()
        assert "threshold" not in text and "lines" not in text and "protected" not in text

    quasi = QUASI.split(",")
    header, rows = read_csv(out / "p.csv")
    assert header == [*quasi, *([] if bucketized else ["occupation"]), *extra]
    assert len(rows) == 45_222
    # Public columns verbatim, every row, but not in input order.
    published = [tuple(row[: len(quasi)]) for row in rows]
    original = [tuple(row[c] for c in quasi) for row in adult_rows]
    assert sorted(published) == sorted(original) and published[:50] != original[:50]
    params = json.loads((out / "p.params.json").read_text())
    assert params["mechanism"] == mechanism and params["sensitive"] == ["occupation"]
    expected_keys = {"mechanism", "published", "rows", "quasi", "sensitive", "domain", "options",
                     "sha256", *{"sdr": ["subtables"], "fprivacy": ["buckets"],
                                 "anatomy": ["groups"]}.get(mechanism, [])}  # fmt: skip
    assert set(params) == expected_keys
    if bucketized:
        st_header, st_rows = read_csv(out / "p.st.csv")
        assert st_header == [extra[0], "occupation", "count"]
        assert sum(int(r[2]) for r in st_rows) == 45_222
    if mechanism == "sdr":
        subtables = params["subtables"]
        assert sum(s["rows"] for s in subtables) == 45_222
        assert {r[-1] for r in rows} == {str(i) for i in range(len(subtables))}
        for i, sub in enumerate(subtables):  # every row stays in its sub-table's SA_i
            assert {r[-2] for r in rows if r[-1] == str(i)} <= set(sub["values"])

    argv = ["--published", str(out / "p.csv"), "--mechanism", mechanism, *options]
    code, answers = ask(tmp_path, BATCH_QUERIES, *argv, "--sensitive", "occupation")
    assert code == 0 and len(answers) == len(BATCH_QUERIES)
    truths = [true_count(adult_rows, q) for q in BATCH_QUERIES]
    for query, answer in zip(BATCH_QUERIES, answers, strict=True):
        assert {k: answer[k] for k in query} == query and "estimate" in answer
    for answer, truth in zip(answers[:2], truths[:2], strict=True):  # public-only: exact
        assert answer["estimate"] == answer["low"] == answer["high"] == truth
    sales, conjunction = answers[2], answers[3]
    if mechanism in ("anatomy", "fprivacy"):  # the ST counts are exact
        assert sales["estimate"] == truths[2]
    if mechanism in ("sdr", "global"):  # unbiased, with a 95% interval (seed 1 covers)
        for answer, truth in ((sales, truths[2]), (conjunction, truths[3])):
            assert answer["low"] < truth < answer["high"]
            assert abs(answer["estimate"] - truth) < 0.2 * truth
    if mechanism == "fprivacy":  # low/high: the counts the buckets allow, always covering
        assert conjunction["low"] <= truths[3] <= conjunction["high"]
    if mechanism == "dbr":  # the published counts themselves
        shown = [r for r in rows if r[-1] == "Sales"]
        assert sales["estimate"] == len(shown) and sales["low"] < len(shown) < sales["high"]
        assert conjunction["estimate"] == sum(
            r[1] == "Female" for r in rows if r[-1] == "Adm-clerical"
        )
        assert "low" not in conjunction
    if mechanism == "anatomy":  # Xiao and Tao: Σ_g |P ∩ g|·c_g(s)/|g|, from the files
        in_group: dict[str, int] = {}
        for row in rows:
            if row[1] == "Female":
                in_group[row[-1]] = in_group.get(row[-1], 0) + 1
        _, st_rows = read_csv(out / "p.st.csv")
        size: dict[str, int] = {}
        for group, _, count in st_rows:
            size[group] = size.get(group, 0) + int(count)
        formula = sum(in_group.get(g, 0) * int(c) / size[g] for g, v, c in st_rows
                      if v == "Adm-clerical")  # fmt: skip
        assert conjunction["estimate"] == pytest.approx(formula, abs=1e-3)
        assert "low" not in conjunction


def test_query_checks_the_files_belong_together(adult_csv, tmp_path, capsys):
    published = tmp_path / "p.csv"
    assert main(["publish", "--input", str(adult_csv), "--output", str(published), "--mechanism",
                 "anatomy", *OCCUPATION, "--seed", "3"]) == 0  # fmt: skip
    query = [{"value": {"occupation": "Sales"}}]
    base = ["--published", str(published)]
    # Options and --sensitive may be left out: the files say them.
    assert ask(tmp_path, query, *base, "--mechanism", "anatomy")[0] == 0
    failures = [
        (
            ["--mechanism", "anatomy", "--gamma", "4"],
            "--gamma 4 does not match the publication's 5",
        ),
        (["--mechanism", "fprivacy"], "was published with --mechanism anatomy, not fprivacy"),
        (["--mechanism", "anatomy", "--clip"], "--clip applies to --mechanism decoy, personal"),
        (["--mechanism", "anatomy", "--sensitive", "income"], "--sensitive income: "),
    ]
    for argv, message in failures:
        capsys.readouterr()
        assert main(["query", *base, *argv, "--queries", str(tmp_path / "q.jsonl"),
                     "--output", str(tmp_path / "x.jsonl")]) == 1  # fmt: skip
        assert message in capsys.readouterr().err
    st = tmp_path / "p.st.csv"
    st.write_text(st.read_text().replace(",1\n", ",2\n", 1))
    assert ask(tmp_path, query, *base, "--mechanism", "anatomy")[0] == 1
    assert "p.st.csv belongs to another publication than" in capsys.readouterr().err
    # Say a later publication replaced OUT.csv and left a stale OUT.params.json behind.
    published.write_text("".join(published.read_text().splitlines(keepends=True)[:-1]))
    assert ask(tmp_path, query, *base, "--mechanism", "anatomy")[0] == 1
    assert "p.params.json belongs to another publication than" in capsys.readouterr().err
    (tmp_path / "p.params.json").unlink()
    assert ask(tmp_path, query, *base, "--mechanism", "anatomy")[0] == 1
    assert "writes it beside" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--mechanism", "sdr", "--rho1", "0.3", "--rho2", "0.2"],
            "--rho1 (3/10) must be below --rho2 (1/5)",
        ),
        (["--mechanism", "sdr", "--rho2", "abc"], "--rho2 must be a number or a ratio like 1/13"),
        (["--mechanism", "sdr", "--delta", "1.5"], "--delta must lie in (0, 1)"),
        (["--mechanism", "fprivacy", "--theta", "0"], "--theta must be positive"),
        (
            ["--mechanism", "fprivacy", "--min-size", "60"],
            "--min-size must lie in 1..50 (--max-size)",
        ),
        (["--mechanism", "fprivacy", "--fake-values", "2"], "--fake-values 2: fake values need"),
        (
            ["--mechanism", "anatomy", "--gamma", "8"],
            "--gamma 8 (Anatomy's ℓ): the table is not eligible",
        ),
        (["--mechanism", "anatomy", "--gamma", "1"], "--gamma must be at least 2"),
        (["--mechanism", "global", "--gamma", "14"], "--gamma 14: global randomization"),
        (
            ["--mechanism", "anatomy", "--theta", "8"],
            "--theta applies to --mechanism fprivacy, not anatomy",
        ),
        (["--mechanism", "decoy", "--rho1", "0.1"], "--rho1 applies to --mechanism sdr, not decoy"),
        (
            ["--mechanism", "dbr", "--delta", "0.1"],
            "--delta applies to --mechanism personal or sdr, not dbr",
        ),
        (
            ["--mechanism", "dbr", "--output", "-"],
            "--output -: --mechanism dbr writes OUT.params.json",
        ),
        (["--mechanism", "laplace"], "--mechanism laplace publishes nothing"),
    ],
)
def test_bad_batch_options_name_their_flag(adult_csv, tmp_path, capsys, argv, message):
    out = tmp_path / "o.csv"
    code = main(["publish", "--input", str(adult_csv), "--output", str(out), *OCCUPATION, *argv])
    assert code == 1
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_laplace_answers_from_raw_data_with_noise_of_scale_m_over_epsilon(
    adult_csv, adult_rows, tmp_path, capsys
):
    queries = [
        {"where": {"sex": "Female"}},
        {"value": {"occupation": "Sales"}},
        {"where": {"education": ["Bachelors", "Masters"]}, "value": {"occupation": "Sales"}},
        {"where": {"education": ["Masters", "Bachelors"]}, "value": {"occupation": "Sales"}},
        {"value": {"occupation": "Sales"}},
    ]
    raw = ["--mechanism", "laplace", "--input", str(adult_csv), "--epsilon", "0.5", *OCCUPATION]
    code, answers = ask(tmp_path, queries, *raw, "--seed", "4")
    assert code == 0
    assert "2 distinct sensitive queries share ε = 0.5: noise Lap(b), b = m/ε = 4" in (
        capsys.readouterr().err
    )
    truths = [true_count(adult_rows, q) for q in queries]
    for query, answer in zip(queries, answers, strict=True):
        assert {k: answer[k] for k in query} == query
    assert answers[0]["estimate"] == answers[0]["low"] == answers[0]["high"] == truths[0]
    # m = 2 distinct sensitive queries, b = m/ε = 4; interval ±b·ln(1/(1 − 0.95)).
    for answer, truth in zip(answers[1:], truths[1:], strict=True):
        assert answer["estimate"] != truth and abs(answer["estimate"] - truth) < 20 * 4
        assert answer["high"] - answer["low"] == pytest.approx(2 * 4 * math.log(20), abs=2e-3)
    assert answers[1] == answers[4] and answers[2]["estimate"] == answers[3]["estimate"]
    assert ask(tmp_path, queries, *raw, "--seed", "4")[1] == answers
    assert ask(tmp_path, queries, *raw, "--seed", "5")[1][1] != answers[1]
    assert {p.name for p in tmp_path.iterdir()} == {"q.jsonl", "a.jsonl"}
    capsys.readouterr()
    assert ask(tmp_path, queries, *raw[:4], *OCCUPATION)[0] == 1  # no --epsilon
    assert "--mechanism laplace needs its privacy budget: give --epsilon" in capsys.readouterr().err
    published = ["--published", str(adult_csv), "--epsilon", "1"]
    assert ask(tmp_path, queries, "--mechanism", "laplace", *published)[0] == 1
    assert "give --input RAW.csv (trusted side)" in capsys.readouterr().err
    assert ask(tmp_path, queries, "--mechanism", "sdr", "--input", str(adult_csv))[0] == 1
    assert "--input applies to --mechanism laplace" in capsys.readouterr().err


def test_help_documents_the_batch_files_and_laplace(capsys):
    with pytest.raises(SystemExit):
        main(["publish", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "OUT.params.json" in text and "OUT.st.csv" in text and "plus subtable" in text
    with pytest.raises(SystemExit):
        main(["query", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "RUNS ON THE TRUSTED SIDE" in text and "noise of scale m/ε" in text


def test_query_takes_the_options_given_to_publish(adult_csv, tmp_path, capsys):
    """SPEC §5: `splu query` with the same options as `splu publish`. --quasi is checked
    against the published columns; --seed, --bin and --schema shaped the publication and
    change nothing here, so the answers equal those without them."""
    published = tmp_path / "p.csv"
    assert publish(adult_csv, published, "--seed", "1") == 0
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"where": {"sex": "Female"}, "value": {"occupation": "Sales"}}\n')

    def ask(*extra: str) -> tuple[int, str]:
        answers = tmp_path / "a.jsonl"
        code = main([
            "query", "--published", str(published), "--mechanism", "decoy", "--gamma", "5",
            "--sensitive", "occupation", "--queries", str(queries), "--output", str(answers),
            *extra,
        ])  # fmt: skip
        return code, answers.read_text() if code == 0 else capsys.readouterr().err

    plain = ask()
    assert plain[0] == 0
    assert ask("--quasi", QUASI, "--seed", "1", "--bin", "age=10") == plain
    code, error = ask("--quasi", "age,income")
    assert code == 1 and "--quasi 'income' is not a column of" in error
