"""`splu plan`: the amplification warnings, the recommendation against --max-error, the JSON
against docs/plan.schema.json, and the errors against bench/decoy_accuracy.py on Adult."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.cli.batch import main
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells
from service.core.table import open_sample, read_table

ROOT = Path(__file__).parents[1]
SCHEMA = json.loads((ROOT / "docs" / "plan.schema.json").read_text())
QUASI = "age,sex,race,marital_status,education"


def plan(tmp_path: Path, source: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"plan{len(list(tmp_path.glob('plan*.json')))}.json"
    assert main(["plan", "--input", str(source), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


# A small validator of the JSON Schema keywords docs/plan.schema.json uses (jsonschema is not
# a dependency); test_the_validator_knows_every_keyword keeps the two in step.
ANNOTATIONS = {"$schema", "title", "description", "$defs"}
TYPES = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
    "number": lambda x: isinstance(x, int | float) and not isinstance(x, bool),
    "null": lambda x: x is None,
}
KEYWORDS = {
    "type", "required", "additionalProperties", "properties", "items", "oneOf", "$ref",
    "const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
}  # fmt: skip


def problems(instance: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    if "$ref" in schema:
        target = SCHEMA
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return problems(instance, target, path)
    out = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(TYPES[t](instance) for t in types):
            return [f"{path}: {instance!r} is not of type {types}"]
    if "const" in schema and instance != schema["const"]:
        out.append(f"{path}: {instance!r} is not {schema['const']!r}")
    if "enum" in schema and instance not in schema["enum"]:
        out.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if "oneOf" in schema:
        matching = [s for s in schema["oneOf"] if not problems(instance, s, path)]
        if len(matching) != 1:
            out.append(f"{path}: matches {len(matching)} of oneOf")
    if TYPES["number"](instance):
        for keyword, holds in (
            ("minimum", lambda bound: instance >= bound),
            ("maximum", lambda bound: instance <= bound),
            ("exclusiveMinimum", lambda bound: instance > bound),
            ("exclusiveMaximum", lambda bound: instance < bound),
        ):
            if keyword in schema and not holds(schema[keyword]):
                out.append(f"{path}: {instance} breaks {keyword} {schema[keyword]}")
    if isinstance(instance, dict):
        out += [f"{path}: no {k!r}" for k in schema.get("required", ()) if k not in instance]
        properties = schema.get("properties", {})
        for key, value in instance.items():
            if key in properties:
                out += problems(value, properties[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{path}: unexpected {key!r}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            out += problems(item, schema["items"], f"{path}[{i}]")
    return out


def keywords(schema: Any, inside_properties: bool = False) -> set[str]:
    if isinstance(schema, list):
        return set().union(*(keywords(s) for s in schema))
    if not isinstance(schema, dict):
        return set()
    found = set() if inside_properties else set(schema)
    for key, value in schema.items():
        found |= keywords(value, inside_properties=key in ("properties", "$defs"))
    return found


def test_the_validator_knows_every_keyword():
    assert keywords(SCHEMA) - ANNOTATIONS <= KEYWORDS


def skewed_csv(path: Path, top: int) -> Path:
    """1,000 rows: value A holds `top` rows, B..J share the rest evenly."""
    values = ["A"] * top + [v for v in "BCDEFGHIJ" for _ in range((1000 - top) // 9)]
    values += ["J"] * (1000 - len(values))
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["p", "q", "s"])
        writer.writerows([f"p{i % 10}", f"q{i % 3}", v] for i, v in enumerate(values))
    return path


@pytest.mark.parametrize(
    ("top", "warned"),
    # Under the m×m model, with B..J alike, A's amplification is 1/(1/γ − t_A),
    # t = (γ−1)f/(γ(N−f)): at 15% 17.0 at γ = 5 (B..J 8.6), 8.5 at γ = 4; at 19% 13.5 at
    # γ = 4, at 20% 16.0. A value within 3 SDs of N/γ (f′ ~ Bin(N, 1/γ)) may sit in every
    # group, and then no conjunctive count is identifiable: every value is unbounded, at
    # γ = 6 for 15% (1/6 = 16.7%) and at γ = 5 for 19% and 20% (1/5, 38 rows within 3 SD).
    [
        (150, {5: (1, "17.0×"), 6: (10, "unbounded")}),
        (190, {4: (1, "13.5×"), 5: (10, "unbounded")}),
        (200, {4: (1, "16.0×"), 5: (10, "unbounded")}),
    ],
)
def test_warnings_fire_for_a_value_near_one_over_gamma(tmp_path, capsys, top, warned):
    source = skewed_csv(tmp_path / "skewed.csv", top)
    document = plan(
        tmp_path, source, "--sensitive", "s", "--quasi", "p,q", "--mechanism", "decoy",
        "--publications", "1", "--queries", "50", "--seed", "1",
    )  # fmt: skip
    rows = {r["parameters"]["gamma"]: r for r in document["settings"]}
    assert sorted(rows) == list(range(2, 1000 // top + 1))  # the eligibility limit
    amplified = {
        gamma: [w for w in row["warnings"] if "amplified" in w] for gamma, row in rows.items()
    }
    assert [gamma for gamma, found in amplified.items() if found] == sorted(warned)
    output = capsys.readouterr().out
    for gamma, (count, shown) in warned.items():
        assert len(amplified[gamma]) == count
        assert (
            amplified[gamma][0].startswith("s=A ") and f"amplified {shown}" in amplified[gamma][0]
        )
        factor = rows[gamma]["guarantees"]["values"][0]["amplification"]
        assert factor is None if shown == "unbounded" else f"{factor:.1f}×" == shown
        assert f"warning, γ = {gamma}: {count} of 10 values amplify" in output
    assert not problems(document, SCHEMA)


@pytest.fixture(scope="module")
def adult_plan(adult_csv, tmp_path_factory) -> dict[str, Any]:
    # A 10,000-row subsample keeps it quick; --seed fixes subsample, queries and keys.
    return plan(
        tmp_path_factory.mktemp("plan"), adult_csv, "--sensitive", "occupation",
        "--quasi", QUASI, "--records", "10000", "--publications", "1", "--queries", "300",
        "--retention", "0.5,0.7", "--seed", "5",
    )  # fmt: skip


def test_the_json_validates_against_the_schema(adult_plan):
    assert adult_plan["rows"] == 10_000
    assert [r["mechanism"] for r in adult_plan["settings"]].count("personal") == 2
    assert not problems(adult_plan, SCHEMA)
    broken = json.loads(json.dumps(adult_plan))
    del broken["settings"][0]["errors"]["large"]["median"]
    broken["settings"][-1]["guarantees"]["sps"]["v_g"] = 2
    assert len(problems(broken, SCHEMA)) == 2


def test_the_recommendation_respects_max_error(adult_plan, adult_csv, tmp_path, capsys):
    decoy = {r["parameters"]["gamma"]: r["errors"]["large"]["mean"]
             for r in adult_plan["settings"] if r["mechanism"] == "decoy"}  # fmt: skip
    # Between two neighbouring γ's errors: the smaller γ is the largest one under it.
    gamma = min(decoy, key=lambda g: abs(decoy[g] - 0.15))
    assert decoy[gamma] < decoy[gamma + 1]
    threshold = (decoy[gamma] + decoy[gamma + 1]) / 2
    document = plan(
        tmp_path, adult_csv, "--sensitive", "occupation", "--quasi", QUASI,
        "--records", "10000", "--publications", "1", "--queries", "300",
        "--retention", "0.5,0.7", "--seed", "5", "--max-error", str(threshold),
    )  # fmt: skip
    assert [r["errors"] for r in document["settings"]] == [
        r["errors"] for r in adult_plan["settings"]
    ]
    chosen = {r["mechanism"]: r for r in document["recommendations"]}
    assert chosen["decoy"]["setting"] == {"gamma": gamma, "grouping": "size-weighted"}
    assert chosen["decoy"]["toml"] == f'[decoy]\ngamma = {gamma}\ngrouping = "size-weighted"\n'
    personal = [r for r in document["settings"] if r["mechanism"] == "personal"]
    best = min(personal, key=lambda r: r["errors"]["large"]["mean"])
    assert best["errors"]["large"]["mean"] <= threshold
    assert chosen["personal"]["setting"] == best["parameters"]
    assert f"retention = {best['parameters']['retention']:g}\n" in chosen["personal"]["toml"]
    out = capsys.readouterr().out
    assert f"    gamma = {gamma}\n" in out and "then: splu run --config" in out

    strict = plan(
        tmp_path, adult_csv, "--sensitive", "occupation", "--quasi", QUASI,
        "--records", "2000", "--publications", "1", "--queries", "100",
        "--retention", "0.5", "--seed", "5", "--max-error", "0.0001",
    )  # fmt: skip
    assert [r["setting"] for r in strict["recommendations"]] == [None, None]
    assert "decoy: none; no setting keeps" in capsys.readouterr().out


def test_errors_agree_with_bench_decoy_accuracy_on_adult(adult_csv, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import decoy_accuracy
    finally:
        sys.path.remove(str(ROOT / "bench"))
    document = plan(
        tmp_path, adult_csv, "--sensitive", "occupation", "--quasi", QUASI,
        "--mechanism", "decoy", "--seed", "11",
    )  # fmt: skip
    planned = next(r for r in document["settings"] if r["parameters"]["gamma"] == 5)["errors"]

    # bench/decoy_accuracy.py's default configuration, its own query seed and keys.
    with open_sample() as stream:
        table, _ = read_table(
            stream, quasi=decoy_accuracy.QUASI, sensitive=[decoy_accuracy.SENSITIVE]
        )
    per_band, publications = 1000, 5
    queries, true, _ = decoy_accuracy.query_pool(table, per_band, np.random.default_rng(0))
    errors = []
    for seed in range(100, 100 + publications):
        key = ServiceKey.from_seed(seed)
        release = DecoyGroups(5).publish(table, random_ids(len(table), key), key)
        cells = PublishedCells.from_table(release.published)
        answers = DecoyReconstruction(cells, 5, [decoy_accuracy.SENSITIVE]).estimate_many(queries)
        errors.append(np.abs(np.asarray([a.estimate for a in answers]) - true) / true)
    errors = np.asarray(errors)  # (publications, queries)

    # Each side's mean is over P publications of one random pool of Q queries, so its
    # variance is σ²_pub/P (key to key) + σ²_query/Q (pool to pool), both estimated from
    # bench's errors; the sides are independent and bench has P = 5, the plan 3.
    for name, columns in (("large", slice(0, per_band)), ("small", slice(per_band, None))):
        band = errors[:, columns]
        between_publications = band.mean(axis=1).var(ddof=1)
        between_queries = band.mean(axis=0).var(ddof=1)
        variance = between_queries / per_band
        variance = 2 * variance + between_publications * (1 / publications + 1 / 3)
        difference = planned[name]["mean"] - band.mean()
        assert abs(difference) <= 4 * math.sqrt(variance), (name, planned[name], band.mean())


def test_mechanism_all_plans_the_batch_mechanisms_on_the_same_queries(adult_csv, tmp_path, capsys):
    image = tmp_path / "plan.png"
    document = plan(
        tmp_path, adult_csv, "--sensitive", "occupation", "--quasi", QUASI,
        "--records", "3000", "--publications", "1", "--queries", "100", "--retention", "0.5",
        "--seed", "7", "--mechanism", "all", "--plot", str(image),
    )  # fmt: skip
    assert not problems(document, SCHEMA)
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in document["settings"]:
        rows.setdefault(row["mechanism"], []).append(row)
    gammas = [r["parameters"]["gamma"] for r in rows["decoy"]]
    assert [r["parameters"]["ell"] for r in rows["anatomy"]] == gammas
    assert [r["parameters"]["gamma"] for r in rows["sdr"]] == gammas
    # Global randomization needs more values than γ; occupation has 14.
    assert [r["parameters"]["gamma"] for r in rows["global"]] == [g for g in gammas if g < 14]
    assert len(rows["fprivacy"]) == len(rows["dbr"]) == len(rows["personal"]) == 1
    # Every row answered the same queries: the same count in each band.
    counts = {
        (b, r["errors"][b]["queries"]) for rs in rows.values() for r in rs for b in r["errors"]
    }
    assert counts == {
        ("large", document["queries"]["large"]),
        ("small", document["queries"]["small"]),
    }
    assert [r["mechanism"] for r in document["recommendations"]] == ["decoy", "personal"]
    captured = capsys.readouterr()
    assert "Batch mechanisms on the same queries" in captured.out
    assert "anatomy: ℓ-diversity" in captured.out
    # stderr is not a terminal here: no progress bar is drawn into it.
    assert "\r" not in captured.err and "planning:" not in captured.err
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 20_000


def test_mechanism_all_needs_a_feasible_gamma(tmp_path, capsys):
    # 60% of the rows hold one value: no γ ≥ 2 is feasible for decoy groups or the baselines.
    source = skewed_csv(tmp_path / "skewed.csv", 600)
    arguments = ["plan", "--input", str(source), "--sensitive", "s", "--quasi", "p,q"]
    assert main([*arguments, "--mechanism", "all"]) == 1
    assert "no γ ≥ 2 is feasible" in capsys.readouterr().err
    # Personal groups alone need no γ.
    assert main([*arguments, "--mechanism", "personal", "--queries", "20"]) == 0
