"""`service/core/drafting.py`, what `splu plan --config-out` decides: which public columns are
binned and where, the stream's size, which setting is written (recommended, or the most
private when none meets the bound), and that every draft loads as `splu run` loads it."""

from __future__ import annotations

import io
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from service.cli.batch import main
from service.core import drafting, planning
from service.core.config import DEFAULT_MIXING_POOL, load_config
from service.core.prf import ServiceKey, random_ids
from service.core.schema import Rejection
from service.core.table import read_table


def survey_text(rows: int = 400, seed: int = 1) -> str:
    """id, age: 18..89 (and one 'unknown'), sex, a 5-valued numeric code, an answer."""
    rng = np.random.default_rng(seed)
    lines = ["id,age,sex,code,answer"]
    for i in range(rows):
        age = "unknown" if i == 7 else str(18 + i % 72)
        answer = ("a", "b", "c", "d", "e")[rng.choice(5, p=[0.3, 0.25, 0.2, 0.15, 0.1])]
        lines.append(f"r{i},{age},{'FM'[rng.integers(2)]},{rng.integers(1, 6)},{answer}")
    return "\n".join(lines) + "\n"


def survey_table():
    table, rejections = read_table(
        io.StringIO(survey_text()), quasi=["age", "sex", "code"], sensitive=["answer"]
    )
    assert not rejections
    return table


def test_quantile_edges_take_in_every_value_at_round_numbers():
    # 72 whole ages, one row each: quartiles at 35, 53 and 71, rounded to a step of 5
    # (5 is the largest of 1, 2, 5 × 10^k within (89 − 18) / (2·4)).
    ages = np.arange(18, 90, dtype=float)
    edges = drafting.quantile_edges(ages, np.ones(72), bins=4)
    assert edges == (15.0, 35.0, 55.0, 70.0, 90.0)
    # Fractions get a fractional step, and the outer edges still hold the extremes.
    values = np.linspace(0.11, 0.97, 50)
    edges = drafting.quantile_edges(values, np.ones(50), bins=3)
    assert edges[0] <= 0.11 and edges[-1] > 0.97 and list(edges) == sorted(set(edges))
    # Nine rows in ten hold 0: the quantiles fall together, and the range is halved.
    values = np.arange(21, dtype=float)
    edges = drafting.quantile_edges(values, np.array([180, *[1] * 20]), bins=4)
    assert edges == (0.0, 10.0, 22.0)


def test_numeric_columns_of_many_values_are_binned_and_their_other_values_rejected():
    table = survey_table()
    binned_table, rejections, binned = drafting.bin_numeric_columns(table, ["age", "sex", "code"])
    # age holds 72 numbers (and 'unknown'): binned; code holds 5: kept; sex is not numeric.
    assert [b.column for b in binned] == ["age"]
    age = binned_table.schema["age"]
    assert age.bins == binned[0].edges and (binned[0].low, binned[0].high) == (18, 89)
    assert binned_table.schema["code"] == table.schema["code"]
    assert binned_table.schema["sex"] == table.schema["sex"]
    # The row of 'unknown' (line 9: the header is line 1) is rejected as a stream would.
    assert rejections == [Rejection(9, "age", "expected a number")]
    assert len(binned_table) == len(table) - 1
    # 400 rows: 4 bins, each holding about a quarter of the rows.
    shares = np.bincount(binned_table.codes["age"]) / len(binned_table)
    assert len(shares) == 4 and shares.min() > 0.15
    # Each row's bin is the one its age falls in.
    labels = binned_table.labels("age")
    original = table.take(np.flatnonzero(table.labels("age") != "unknown")).labels("age")
    for label, value in zip(labels, original, strict=True):
        low, high = (float(x) for x in label.strip("[)").split(","))
        assert low <= float(value) < high


def test_a_column_named_for_no_binning_is_kept():
    table = survey_table()
    same, rejections, binned = drafting.bin_numeric_columns(table, ["sex", "code"])
    assert binned == [] and rejections == [] and same.schema == table.schema


@pytest.mark.parametrize(
    ("rows", "rate", "min_mixing", "expected"),
    [
        (400, None, 30, (1, 200, 30.0)),  # the survey fills a floor of 200 twice over
        (12, None, 30, (1, 30, 30.0)),  # never below the minimum mixing of 10 groups
        (1_000_000, 20_000.0, 50, (4, DEFAULT_MIXING_POOL, 30.0)),  # 5,000/s a partition
        (5_000, 0.01, 10, (1, DEFAULT_MIXING_POOL, 10_000.0)),  # 100 arrivals take 10,000 s
        (300, 20_000.0, 50, (3, 50, 30.0)),  # no partition without two floors of rows
    ],
)
def test_the_stream_is_sized_to_the_rows_and_the_rate(rows, rate, min_mixing, expected):
    sizing = drafting.size_stream(rows, rate, min_mixing)
    assert (sizing.partitions, sizing.mixing_pool, sizing.max_wait) == expected


def test_rates_are_read_per_second():
    assert drafting.parse_rate("2") == 2.0
    assert drafting.parse_rate("30/min") == 0.5
    assert drafting.parse_rate("500/day") == pytest.approx(500 / 86400)
    for bad in ("fast", "3/week", "0", "-1/h", "nan"):
        with pytest.raises(ValueError, match="--expected-rate"):
            drafting.parse_rate(bad)


@pytest.fixture(scope="module")
def planned():
    table = survey_table()
    table, _, binned = drafting.bin_numeric_columns(table, ["age"])
    pool = planning.query_pool(
        table, "answer", ["age", "sex", "code"], 100, np.random.default_rng(0), 10_000
    )
    key = ServiceKey.from_seed(1)
    releases = [(key, random_ids(len(table), key))]
    settings = [
        planning.plan_decoy(table, "answer", g, pool, releases, 0.3, 10, 0.02, 0.3, 10.0)
        for g in planning.feasible_gammas(table, "answer")
    ]
    settings += [
        planning.plan_personal(table, "answer", p, 0.3, 0.3, "adaptive", None, pool, releases)
        for p in (0.3, 0.7)
    ]
    return table, binned, settings


def recommendations(settings, max_error):
    decoy = planning.recommend("decoy", settings, max_error)
    personal = planning.recommend("personal", settings, max_error)
    return [
        {"mechanism": "decoy", "setting": decoy and decoy.parameters},
        {"mechanism": "personal", "setting": personal and personal.parameters},
    ]


def test_the_recommended_setting_is_written_else_the_most_private(planned):
    _, _, settings = planned
    errors = sorted(s.large_mean() for s in settings)
    loose = recommendations(settings, errors[-1])
    chosen, recommended = drafting.choose_setting(settings, loose)
    assert recommended and chosen.parameters == loose[0]["setting"]
    # No setting within the bound: decoy groups at the largest γ, not recommended.
    none = recommendations(settings, errors[0] / 2)
    chosen, recommended = drafting.choose_setting(settings, none)
    gammas = [s.parameters["gamma"] for s in settings if s.mechanism == "decoy"]
    assert not recommended and chosen.parameters["gamma"] == max(gammas)
    # Personal groups alone: the lowest retention SPS keeps private.
    personal = [s for s in settings if s.mechanism == "personal"]
    chosen, _ = drafting.choose_setting(personal, none[1:])
    assert chosen.parameters["retention"] == 0.3


def test_advice_names_the_bound_the_rows_and_the_columns(planned):
    table, binned, settings = planned
    best = min((s for s in settings if s.mechanism == "decoy"), key=lambda s: s.large_mean())
    lines = drafting.advice(settings, "decoy", best.large_mean() / 2, table, binned)
    assert f"--max-error {math.ceil(best.large_mean() * 100) / 100:g} accepts" in lines[0]
    # Errors shrink like 1/√rows: half the error takes four times the rows.
    assert f"about {4 * len(table):,} at the same shares" in lines[1]
    assert "age (4 bins)" in lines[2] and "--bin age=" in lines[2]


@pytest.mark.parametrize("mechanism", ["decoy", "personal"])
@pytest.mark.parametrize("recommended", [True, False])
def test_every_draft_loads_as_splu_run_loads_it(planned, tmp_path, mechanism, recommended):
    table, binned, settings = planned
    setting = next(s for s in settings if s.mechanism == mechanism)
    gamma = setting.parameters.get("gamma", 1)
    path = tmp_path / "my survey!.toml"
    draft = drafting.Draft(
        path=path, input="survey.csv", rows=len(table), schema=table.schema, binned=binned,
        setting=setting, recommended=recommended, max_error=0.25,
        advice=["a looser bound", "more rows", "fewer columns"],
        sizing=drafting.size_stream(len(table), 0.5, 10 * gamma),
        queries=drafting.standing_queries(table, "answer"), run_command="splu run ...",
    )  # fmt: skip
    text = drafting.render(draft)
    config = drafting.checked(text, path)
    assert config.name == "my-survey" and config.mechanism == mechanism
    assert config.schema == table.schema
    assert config.mixing_pool == draft.sizing.mixing_pool and config.partitions == 1
    assert len(config.reports.queries) == 3  # one per public column
    assert ("SAFEST SETTING, NOT A RECOMMENDATION" in text) != recommended
    written = tomllib.loads(text)[mechanism]
    assert tomllib.loads(planning.toml_block(setting))[mechanism].items() <= written.items()
    Path(path).write_text(text)  # a file name with a space and a '!' is a fine file


def test_plan_writes_the_safest_config_when_no_setting_meets_the_bound(tmp_path, capsys):
    source, config = tmp_path / "survey.csv", tmp_path / "survey.toml"
    source.write_text(survey_text())
    arguments = [
        "plan", "--input", str(source), "--sensitive", "answer", "--quasi", "age,sex,code",
        "--publications", "1", "--queries", "100", "--seed", "1",
    ]  # fmt: skip
    written = [*arguments, "--config-out", str(config), "--id-column", "id"]
    assert main([*written, "--max-error", "0.0001", "--expected-rate", "50/h"]) == 0
    out = capsys.readouterr().out
    assert "SAFEST SETTING, NOT A RECOMMENDATION" in out
    assert "SAFEST SETTING, NOT A RECOMMENDATION" in config.read_text()
    assert "What would help:" in out and "more rows: about" in out
    assert f"splu run --config {config} --input {source} --id-column id" in out
    loaded = load_config(config)
    assert loaded.decoy is not None and loaded.schema["age"].bins is not None
    assert loaded.max_wait == 100 / (50 / 3600)  # 100 arrivals at 50 an hour
    # The flags of the config, and an id column that would be published, are refused.
    for extra, message in (
        (["--expected-rate", "2"], "--expected-rate applies to --config-out"),
        ([*written[len(arguments) : -1], "age"], "a stream never publishes ids"),
        ([*written[len(arguments) : -1], "nope"], "'nope' is not a column"),
    ):
        assert main([*arguments, *extra]) == 1
        assert message in capsys.readouterr().err
