"""The ``splu`` command line (SPEC §5)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from service.config import load_config
from service.dp_audit import audit_disclosures
from service.guarantees import chebyshev_thresholds, privacy_threshold, utility_threshold
from service.mechanisms.decoy import GROUPINGS, DecoyGroups
from service.mechanisms.personal import BUDGETS, GroupAudit, PersonalGroups
from service.merge import ValueMap, fit_value_map
from service.prf import ServiceKey, random_ids
from service.reconstruct import (
    MATRICES,
    METHODS,
    DecoyReconstruction,
    PersonalReconstruction,
    PublishedCells,
    Query,
    QueryError,
    Reconstruction,
)
from service.schema import Rejection, Schema, SchemaError
from service.table import Table, open_sample, open_text, read_rows, read_table, write_table

MECHANISMS = ("decoy", "personal")
SHOWN = 10

GAMMA_HELP = (
    "decoy: group size γ ≥ 2 (default 5). Each record publishes a value drawn "
    "uniformly from the γ distinct values of its hidden group, so no output can "
    "tell which of γ values a person had. A value with true count f is published "
    "as Binomial(γf, 1/γ): small counts get relative noise ≈ √((γ−1)/(γf)), large "
    "counts stay accurate. The papers recommend γ ≥ 5."
)
RETENTION_HELP = (
    "personal: retention probability p in (0, 1) (default 0.5): a record keeps its "
    "value with probability p, else gets a uniform draw from all m values"
)
LAMBDA_HELP = (
    "personal: relative error λ (default 0.3) and bound δ (default 0.3): no one can "
    "prove a personal group's reconstruction is within λ with probability above 1 − δ"
)
BUDGET_HELP = (
    "personal: trials allowed per group: adaptive (its true largest frequency, default), "
    "conservative (frequency 1, safe under drift), none (plain perturbation, for comparison)"
)
MECHANISM_OPTIONS = {
    "decoy": ("gamma", "grouping", "method", "matrix", "tolerance", "max_iterations"),
    "personal": ("retention", "lam", "delta", "budget", "merge_map"),
}
OPTION_FLAGS = {"lam": "--lambda", "max_iterations": "--max-iterations", "merge_map": "--merge-map"}
PERSONAL_DEFAULTS = {"retention": 0.5, "lam": 0.3, "delta": 0.3, "budget": "adaptive"}
DECOY_DEFAULTS = {
    "gamma": 5,
    "grouping": "size-weighted",
    "method": "closed",
    "matrix": "corrected",
    "tolerance": 0.01,
    "max_iterations": 10_000,
}


class CommandError(Exception):
    """A failure to report as one clear line, with nothing half-written."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _columns(values: Sequence[str] | None) -> list[str]:
    """Flags that may be repeated or comma-separated: --quasi a,b --quasi c."""
    return [c.strip() for v in values or () for c in v.split(",") if c.strip()]


def _bins(values: Sequence[str] | None) -> dict[str, float | list[float]]:
    out: dict[str, float | list[float]] = {}
    for spec in values or ():
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise CommandError(f"--bin {spec!r}: write COL=WIDTH or COL=EDGE,EDGE,...")
        try:
            numbers = [float(x) for x in rest.split(",")]
        except ValueError:
            raise CommandError(f"--bin {spec!r}: the width or edges must be numbers") from None
        out[name] = numbers[0] if len(numbers) == 1 else numbers
    return out


@contextmanager
def _input(path: str) -> Iterator[TextIO]:
    try:
        stream = sys.stdin if path == "-" else open_text(path)
    except OSError as err:
        raise CommandError(f"cannot read {path}: {err.strerror}") from None
    try:
        yield stream
    finally:
        if stream is not sys.stdin:
            stream.close()


def _write_atomically(path: str, write: Callable[[TextIO], None]) -> None:
    """Write via a temporary file in the same directory, so a failure leaves no partial file."""
    if path == "-":
        write(sys.stdout)
        return
    target = Path(path)
    if not target.parent.exists():
        raise CommandError(f"cannot write {path}: directory {target.parent} does not exist")
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
            write(stream)
        Path(temporary).replace(target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _write_json(path: str, document: Any) -> None:
    _write_atomically(path, lambda s: s.write(json.dumps(document, indent=2) + "\n"))


def _mechanism_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options of --mechanism with defaults filled in; others given are an error."""
    chosen = args.mechanism
    for mechanism, options in MECHANISM_OPTIONS.items():
        if mechanism == chosen:
            continue
        for option in options:
            if option in MECHANISM_OPTIONS[chosen] or getattr(args, option, None) is None:
                continue
            flag = OPTION_FLAGS.get(option, f"--{option}")
            raise CommandError(f"{flag} applies to --mechanism {mechanism}, not {chosen}")
    defaults = DECOY_DEFAULTS if chosen == "decoy" else PERSONAL_DEFAULTS
    settings = {o: getattr(args, o, None) for o in MECHANISM_OPTIONS[chosen]}
    return {o: defaults[o] if v is None and o in defaults else v for o, v in settings.items()}


def _read_input_table(args: argparse.Namespace) -> tuple[Table, list[Rejection]]:
    quasi, sensitive = _columns(args.quasi), _columns(args.sensitive)
    if getattr(args, "schema", None) and (quasi or sensitive or args.bin):
        raise CommandError("give either --schema or --quasi/--sensitive/--bin, not both")
    if not getattr(args, "schema", None) and not sensitive:
        raise CommandError("name the sensitive column(s) with --sensitive (or give --schema)")
    schema = Schema.load(args.schema) if getattr(args, "schema", None) else None
    with _input(args.input) as stream:
        return read_table(stream, schema, quasi, sensitive, _bins(args.bin))


def _report_rejections(rejections: Sequence[Rejection]) -> None:
    if not rejections:
        return
    _log(f"  rejected {len(rejections):,} rows:")
    for r in rejections[:SHOWN]:
        field = f", field {r.field!r}" if r.field is not None else ""
        _log(f"    line {r.record}{field}: {r.reason}")
    if len(rejections) > SHOWN:
        _log(f"    ... and {len(rejections) - SHOWN:,} more (all listed by --report)")


def _only_sensitive(table: Table, command: str) -> str:
    if len(table.schema.sensitive) != 1:
        raise CommandError(f"{command} takes exactly one --sensitive column")
    return table.schema.sensitive[0].name


def _key_and_ids(seed: int | None, n: int) -> tuple[ServiceKey, np.ndarray]:
    if seed is None:
        return ServiceKey.fresh(), random_ids(n)
    key = ServiceKey.from_seed(seed)
    return key, random_ids(n, key)


def _value_map(path: str | None, table: Table, sensitive: str) -> ValueMap:
    if path:
        return ValueMap.load(path)
    _log("  no --merge-map: merging public values on the input itself (χ², α = 0.05)")
    return fit_value_map(table, sensitive)


def _merge_summary(value_map: ValueMap) -> str:
    return ", ".join(f"{n} {v}→{c}" for n, (v, c) in value_map.class_counts().items())


def _audit_summary(audit: GroupAudit) -> str:
    return (
        f"{len(audit.sizes):,} groups, {(~audit.passed).sum():,} over their limit: "
        f"v_g = {audit.groups_failing:.1%} of groups, v_r = {audit.records_failing:.1%} of records"
    )


def _publish_decoy(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> tuple[Table, dict[str, Any]]:
    release = DecoyGroups(settings["gamma"], settings["grouping"]).publish(table, ids, key)
    for name, counts in release.suppressed.items():
        if counts:
            listed = ", ".join(f"{v}: {c:,}" for v, c in sorted(counts.items()))
            _log(f"  suppressed (value above 1/γ of the data) in {name}: {listed}")
    if len(release.trimmed_lines):
        lines = ", ".join(str(x) for x in release.trimmed_lines)
        _log(f"  trimmed {len(release.trimmed_lines)} rows to a multiple of γ (lines {lines})")
    _log(
        f"  {len(release.published) // release.gamma:,} decoy groups of γ={release.gamma} "
        f"({release.grouping})"
    )
    return release.published, {
        "gamma": release.gamma,
        "grouping": release.grouping,
        "suppressed": release.suppressed,
        "suppressed_lines": release.suppressed_lines.tolist(),
        "trimmed_lines": release.trimmed_lines.tolist(),
    }


def _publish_personal(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> tuple[Table, dict[str, Any]]:
    sensitive = _only_sensitive(table, "--mechanism personal")
    value_map = _value_map(settings["merge_map"], table, sensitive)
    mechanism = PersonalGroups(
        settings["retention"], settings["lam"], settings["delta"], settings["budget"], value_map
    )
    release = mechanism.publish(table, ids, key)
    _log(f"  merged public values: {_merge_summary(value_map)}")
    _log(f"  plain perturbation would leave {_audit_summary(release.plain)}")
    _log(
        f"  SPS ({settings['budget']} budget): {release.sampled_rows:,} rows perturbed, "
        f"{len(table) - release.sampled_rows:,} published as copies; "
        f"{_audit_summary(release.audit)}"
    )
    if release.borrowed_rows:
        _log(
            f"  {release.borrowed_rows:,} rows carry a copy from another value: their group's "
            "limit allows fewer trials than it has values"
        )
    return release.published, {
        "retention": settings["retention"],
        "lambda": settings["lam"],
        "delta": settings["delta"],
        "budget": settings["budget"],
        "merge": {n: list(map(list, c)) for n, c in value_map.classes.items()},
        "groups": len(release.audit.sizes),
        "plain": {"v_g": release.plain.groups_failing, "v_r": release.plain.records_failing},
        "sps": {"v_g": release.audit.groups_failing, "v_r": release.audit.records_failing},
        "perturbed_rows": release.sampled_rows,
        "borrowed_rows": release.borrowed_rows,
    }


def command_publish(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    settings = _mechanism_settings(args)
    table, rejections = _read_input_table(args)
    rows_read = len(table) + len(rejections)
    _log(f"splu publish: read {rows_read:,} rows from {args.input}")
    _report_rejections(rejections)
    key, ids = _key_and_ids(args.seed, len(table))
    publish = _publish_decoy if args.mechanism == "decoy" else _publish_personal
    published, details = publish(settings, table, ids, key)
    _write_atomically(args.output, lambda s: write_table(published, s))
    if args.report:
        _write_json(args.report, {
            "mechanism": args.mechanism,
            "input_rows": rows_read,
            "published_rows": len(published),
            "rejected": [
                {"line": r.record, "field": r.field, "reason": r.reason} for r in rejections
            ],
            **details,
        })  # fmt: skip
    _log(
        f"  published {len(published):,} rows to {args.output} "
        f"in {time.perf_counter() - started:.2f} s"
    )
    return 0


def _reconstruction(
    args: argparse.Namespace, settings: dict[str, Any], cells: PublishedCells
) -> Reconstruction:
    sensitive = _columns(args.sensitive)
    if args.mechanism == "decoy":
        return DecoyReconstruction(
            cells, settings["gamma"], sensitive, method=settings["method"],
            matrix=settings["matrix"], tolerance=settings["tolerance"],
            max_iterations=settings["max_iterations"], confidence=args.confidence,
            clip=args.clip is not False,
        )  # fmt: skip
    if len(sensitive) != 1:
        raise CommandError("--mechanism personal takes exactly one --sensitive column")
    value_map = ValueMap.load(settings["merge_map"]) if settings["merge_map"] else None
    if value_map is not None:
        domain_size = len(value_map.sensitive_domain)
    elif sensitive[0] in cells.columns:
        # Without the map, m is the number of values published; with p < 1 every value
        # appears after a few hundred rows, but give --merge-map to be exact.
        domain_size = len(cells.domains[sensitive[0]])
    else:
        domain_size = 2
    return PersonalReconstruction(
        cells, sensitive[0], settings["retention"], domain_size, lam=settings["lam"],
        delta=settings["delta"], budget=settings["budget"], value_map=value_map,
        confidence=args.confidence, clip=bool(args.clip),
    )  # fmt: skip


def _read_queries(
    path: str, reconstruction: Reconstruction
) -> tuple[list[dict[str, Any]], list[Query | None]]:
    """Every non-blank line: its object (with "error" if unusable) and its parsed query."""
    objects: list[dict[str, Any]] = []
    parsed: list[Query | None] = []
    with _input(path) as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                objects.append({"line": number, "error": f"not valid JSON: {err.msg}"})
                parsed.append(None)
                continue
            try:
                query = Query.from_json(obj)
                reconstruction.check(query)
            except QueryError as err:
                shown = obj if isinstance(obj, dict) else {"line": number}
                objects.append({**shown, "error": str(err)})
                parsed.append(None)
                continue
            objects.append(obj)
            parsed.append(query)
    return objects, parsed


def _query_service(args: argparse.Namespace) -> int:
    given = [flag for flag in ("sensitive", "gamma", "retention", "lam", "delta", "budget",
             "merge_map", "method", "matrix", "tolerance", "max_iterations", "clip")
             if getattr(args, flag, None) is not None]  # fmt: skip
    if given:
        flag = OPTION_FLAGS.get(given[0], f"--{given[0]}")
        raise CommandError(f"{flag} does not apply with --url: the stream's config decides")
    lines: list[Any] = []
    with _input(args.queries) as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError as err:
                    lines.append(_BadLine(number, f"not valid JSON: {err.msg}"))
    asked = [obj for obj in lines if not isinstance(obj, _BadLine)]
    from streams.client import ConsumerError, ask

    try:
        answers = iter(ask(args.url, asked))
    except ConsumerError as err:
        raise CommandError(str(err)) from None
    results = [
        {"line": obj.number, "error": obj.error} if isinstance(obj, _BadLine) else next(answers)
        for obj in lines
    ]
    return _write_answers(args, results, f"from {args.url}")


class _BadLine:
    def __init__(self, number: int, error: str) -> None:
        self.number, self.error = number, error


def _write_answers(args: argparse.Namespace, results: list[dict[str, Any]], source: str) -> int:
    _write_atomically(
        args.output,
        lambda s: s.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in results),
    )
    failures = sum("error" in r for r in results)
    _log(f"splu query: answered {len(results) - failures:,} queries {source} into {args.output}")
    if failures:
        _log(f'  {failures:,} queries could not be answered; their lines carry an "error"')
        return 1
    return 0


def command_query(args: argparse.Namespace) -> int:
    if (args.url is None) == (args.published is None):
        raise CommandError(
            "give --published FILE (a batch publication) or --url URL (a running consumer)"
        )
    if args.url is not None:
        return _query_service(args)
    settings = _mechanism_settings(args)
    if not _columns(args.sensitive):
        raise CommandError("name the sensitive column(s) of the published file with --sensitive")
    with _input(args.published) as stream:
        raw = read_rows(stream)
    if raw.rejections:
        raise CommandError(f"{args.published}: {raw.rejections[0]} (is it a published file?)")
    cells = PublishedCells.from_rows(raw.header, raw.rows)
    reconstruction = _reconstruction(args, settings, cells)
    objects, parsed = _read_queries(args.queries, reconstruction)
    valid = [q for q in parsed if q is not None]
    answers = iter(reconstruction.estimate_many(valid))
    results = [
        obj if q is None else {**obj, **next(answers).answer()}
        for obj, q in zip(objects, parsed, strict=True)
    ]
    source = f"over {cells.total:,} published rows ({args.mechanism})"
    return _write_answers(args, results, source)


def command_guarantees(args: argparse.Namespace) -> int:
    if args.mechanism != "decoy":
        raise CommandError("guarantees are for --mechanism decoy; see `splu audit personal`")
    privacy = privacy_threshold(args.gamma, args.epsilon, args.alpha)
    utility_epsilon = args.utility_epsilon or args.epsilon
    utility = utility_threshold(args.gamma, utility_epsilon, args.te)
    chebyshev = chebyshev_thresholds(args.gamma, utility_epsilon, args.te)
    if args.json:
        print(json.dumps({
            "mechanism": "decoy",
            "gamma": args.gamma,
            "privacy": {
                "epsilon": args.epsilon,
                "alpha": args.alpha,
                "T_P": privacy.threshold,
                "worst_count": privacy.worst_count,
                "deviation_probability": {str(f): p for f, p in enumerate(privacy.curve, 1)},
            },
            "utility": {
                "epsilon": utility_epsilon,
                "T_E": args.te,
                "T_f": utility.threshold,
                "checked_exactly_up_to": utility.checked_up_to,
                "chebyshev_T_f_paper": chebyshev["paper"],
                "chebyshev_T_f_corrected": chebyshev["corrected"],
            },
        }, indent=2))  # fmt: skip
        return 0
    print(f"Decoy groups, γ = {args.gamma}; published count of a value f ~ Binomial(γf, 1/γ)")
    print(
        f"Small-sum privacy (ε = {args.epsilon}, α = {args.alpha}): "
        f"T_P = {privacy.threshold:.4f}, reached at f = {privacy.worst_count}"
    )
    print(
        f"  any value with true count 1..{args.alpha} is published off by more than "
        f"{args.epsilon:.0%} with probability ≥ {privacy.threshold:.4f}"
    )
    print(f"Large-sum utility (ε = {utility_epsilon}, T_E = {args.te}): T_f = {utility.threshold}")
    print(
        f"  any value with true count ≥ {utility.threshold} is published within "
        f"±{utility_epsilon:.0%} with probability ≥ {1 - args.te:g}"
    )
    print(
        f"  (the papers' Chebyshev formula claims T_f = {chebyshev['paper']:.1f}, which is "
        f"wrong; corrected Chebyshev gives {chebyshev['corrected']:.0f}, which is loose)"
    )
    return 0


def command_merge(args: argparse.Namespace) -> int:
    sensitive = _columns(args.sensitive)
    if len(sensitive) != 1:
        raise CommandError("merge public values against exactly one --sensitive column")
    table, rejections = _read_input_table(args)
    _report_rejections(rejections)
    value_map = fit_value_map(table, sensitive[0], args.alpha)
    _write_atomically(args.output, lambda s: s.write(value_map.to_toml()))
    counts = value_map.class_counts()
    before = math.prod(v for v, _ in counts.values())
    after = math.prod(c for _, c in counts.values())
    if args.json:
        print(json.dumps({
            "sensitive": sensitive[0],
            "alpha": args.alpha,
            "attributes": {n: {"values": v, "merged": c} for n, (v, c) in counts.items()},
            "possible_groups": {"before": before, "after": after},
            "classes": {n: [list(c) for c in cs] for n, cs in value_map.classes.items()},
        }, indent=2))  # fmt: skip
    else:
        for name, classes in value_map.classes.items():
            print(f"{name}: {counts[name][0]} values → {counts[name][1]}")
            for members in classes:
                if len(members) > 1:
                    print(f"    merged: {', '.join(members)}")
        print(f"possible personal groups: {before:,} → {after:,}")
    _log(f"splu merge: wrote {args.output}")
    return 0


def command_audit_personal(args: argparse.Namespace) -> int:
    table, rejections = _read_input_table(args)
    _report_rejections(rejections)
    sensitive = _only_sensitive(table, "the personal-group audit")
    value_map = _value_map(args.merge_map, table, sensitive)
    mechanism = PersonalGroups(args.retention, args.lam, args.delta, args.budget, value_map)
    key, ids = _key_and_ids(args.seed, len(table))
    release = mechanism.publish(table, ids, key)
    plain, sps = release.plain, release.audit
    if args.json:
        print(json.dumps({
            "retention": args.retention, "lambda": args.lam, "delta": args.delta,
            "budget": args.budget, "groups": len(plain.sizes), "records": len(table),
            "plain": {"v_g": plain.groups_failing, "v_r": plain.records_failing},
            "sps": {"v_g": sps.groups_failing, "v_r": sps.records_failing},
            "per_group": [
                {"group": list(label), "size": int(size), "max_frequency": float(f),
                 "limit": float(limit), "trials_plain": int(size), "trials_sps": int(trials),
                 "passed_plain": bool(size <= limit), "passed_sps": bool(trials <= limit)}
                for label, size, f, limit, trials in zip(
                    plain.labels, plain.sizes, plain.max_frequency, plain.limit, sps.trials,
                    strict=True,
                )
            ],
        }, indent=2))  # fmt: skip
        return 0
    print(
        f"(λ, δ) = ({args.lam}, {args.delta}) reconstruction privacy, p = {args.retention}, "
        f"m = {table.schema[sensitive].size}; merged public values: {_merge_summary(value_map)}"
    )
    print(f"plain perturbation: {_audit_summary(plain)}")
    print(f"SPS, {args.budget} budget:  {_audit_summary(sps)}")
    failing = np.flatnonzero(~plain.passed)
    failing = failing[np.argsort(-plain.sizes[failing])][:SHOWN]
    if len(failing):
        print(
            f"\nlargest groups over their limit under plain perturbation (of {len(plain.sizes)}):"
        )
        print(f"  {'size':>7} {'max f':>6} {'s_g':>7} {'SPS trials':>10}  group")
        for g in failing:
            label = " ∧ ".join(v if len(v) <= 24 else v[:21] + "..." for v in plain.labels[g])
            print(
                f"  {plain.sizes[g]:7,} {plain.max_frequency[g]:6.3f} {plain.limit[g]:7.1f} "
                f"{sps.trials[g]:10,}  {label}"
            )
    return 0


def command_audit_dp(args: argparse.Namespace) -> int:
    table, rejections = _read_input_table(args)
    _report_rejections(rejections)
    sensitive = _only_sensitive(table, "the DP audit")
    reports = [
        audit_disclosures(
            table, sensitive, epsilon, tau=args.tau, k_cp=args.k_cp, k_j=args.k_j,
            sensitivity=args.sensitivity,
        )
        for epsilon in args.epsilon
    ]  # fmt: skip
    if args.json:
        print(json.dumps([{
            "epsilon": r.epsilon, "laplace_scale": r.scale, "tau": r.tau, "k_cp": r.k_cp,
            "k_j": r.k_j, "groups": r.groups, "disclosures": r.disclosures,
            "groups_disclosing": r.groups_disclosing,
            "records_in_disclosing_groups": r.records_in_disclosing_groups,
            "disclosed": [
                {"group": list(g), "value": v, "theta": t, "phi": f, "jump": j, "cp": c}
                for g, v, t, f, j, c in r.disclosed[: args.show]
            ],
        } for r in reports], indent=2))  # fmt: skip
        return 0
    first = reports[0]
    print(
        f"Laplace counts of personal groups (Δ = {args.sensitivity}, b = Δ/ε); disclosure: "
        f"CP_{first.tau:g} ≥ {first.k_cp:g} and jump ≥ {first.k_j:g}; "
        f"{first.groups:,} groups, {first.records:,} records"
    )
    print(f"{'ε':>6} {'b':>8} {'disclosures':>11} {'groups':>7} {'records in them':>15}")
    for r in reports:
        print(
            f"{r.epsilon:6g} {r.scale:8.2f} {r.disclosures:11,} {r.groups_disclosing:7,} "
            f"{r.records_in_disclosing_groups:15,}"
        )
    for r in reports:
        for group, value, theta, phi, jump, cp in r.disclosed[: args.show]:
            print(
                f"  ε = {r.epsilon:g}: {' ∧ '.join(group)} → {value}: {theta}/{phi} = "
                f"{theta / phi:.2f}, jump {jump:.1f}, CP {cp:.3f}"
            )
    return 0


def command_schema(args: argparse.Namespace) -> int:
    with _input(args.input) as stream:
        raw = read_rows(stream)
    schema = Schema.scan(
        raw.header, raw.rows, _columns(args.quasi), _columns(args.sensitive), _bins(args.bin)
    )
    _write_atomically(args.output, lambda s: s.write(schema.to_toml()))
    sizes = ", ".join(f"{a.name} ({a.size})" for a in schema.attributes)
    _log(f"splu schema: wrote {args.output}: {sizes}")
    return 0


def command_sample(args: argparse.Namespace) -> int:
    with open_sample() as sample:
        text = sample.read()
    _write_atomically(args.output, lambda s: s.write(text))
    _log(f"splu sample: wrote the UCI Adult sample (45,222 records) to {args.output}")
    return 0


def command_demo(args: argparse.Namespace) -> int:
    from streams.demo import run_demo

    return run_demo(
        mechanism=args.mechanism, records=args.records, rate=args.rate, serve=args.serve,
        port=args.port,
    )  # fmt: skip


def command_worker(args: argparse.Namespace) -> int:
    from streams.worker import run_worker

    run_worker(load_config(args.config), loglevel=args.loglevel)
    return 0


def command_consumer(args: argparse.Namespace) -> int:
    from streams.worker import run_consumer

    config = load_config(args.config)
    port = config.reports.port if args.port is None else args.port
    run_consumer(config, args.host, port, loglevel=args.loglevel)
    return 0


def command_produce(args: argparse.Namespace) -> int:
    import asyncio

    from aiokafka.errors import KafkaError

    from streams.produce import count_rows, file_digest, produce, rows_of

    config = load_config(args.config)
    total = None if args.input == "-" else count_rows(Path(args.input))
    if args.input == "-" and args.id_column is None:
        raise CommandError("from stdin, name the column holding record ids with --id-column")
    source = None if args.input == "-" else file_digest(Path(args.input))
    _log(f"splu produce: {args.input} → {config.topics['raw']} at {config.kafka_bootstrap}")
    with _input(args.input) as stream:
        rows = rows_of(stream, config, source, args.id_column)
        try:
            sent = asyncio.run(produce(config, rows, total, args.rate))
        except KafkaError as err:
            raise CommandError(f"cannot produce to {config.kafka_bootstrap}: {err}") from None
    _log(f"  {sent:,} records acknowledged")
    return 0


def _add_table_options(parser: argparse.ArgumentParser, schema: bool = True) -> None:
    parser.add_argument("--input", required=True, help="CSV with a header line (.gz or - ok)")
    parser.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="sensitive column(s); repeat or comma-separate",
    )
    parser.add_argument(
        "--quasi",
        action="append",
        metavar="COL,COL",
        help="public columns; other columns are dropped",
    )
    parser.add_argument(
        "--bin",
        action="append",
        metavar="COL=SPEC",
        help="bin a numeric column: COL=WIDTH or COL=EDGE,EDGE,... "
        "(half-open bins [a,b); the label is published)",
    )
    if schema:
        parser.add_argument(
            "--schema",
            help="TOML file with a [schema] table instead of "
            "--quasi/--sensitive (see `splu schema`)",
        )


def _add_mechanism_options(parser: argparse.ArgumentParser, reconstruction: bool) -> None:
    parser.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        default="decoy",
        help="decoy (SPLU-Gen decoy groups, default) or personal "
        "(personal groups with reconstruction privacy, SPS)",
    )
    decoy = parser.add_argument_group("decoy groups")
    decoy.add_argument("--gamma", type=int, help=GAMMA_HELP)
    personal = parser.add_argument_group("personal groups")
    personal.add_argument("--retention", type=float, help=RETENTION_HELP)
    personal.add_argument("--lambda", dest="lam", type=float, help=LAMBDA_HELP)
    personal.add_argument("--delta", type=float, help="personal: δ in (0, 1), see --lambda")
    personal.add_argument("--budget", choices=BUDGETS, help=BUDGET_HELP)
    personal.add_argument(
        "--merge-map",
        metavar="FILE",
        help="personal: merged public values from `splu merge`; publish "
        "fits one on its input without it, query needs it for exact m "
        "and intervals",
    )
    if reconstruction:
        decoy.add_argument(
            "--method",
            choices=METHODS,
            help="closed form (default) or the papers' iterative Bayesian method",
        )
        decoy.add_argument(
            "--matrix",
            choices=MATRICES,
            help="transition entry t=(γ−1)f/(γ(N−f)) (default) or the papers' "
            "f/N, which biases conjunctive counts low",
        )
        decoy.add_argument(
            "--tolerance",
            type=float,
            help="iterative method: stop when no state count moves more than this (default 0.01)",
        )
        decoy.add_argument(
            "--max-iterations", type=int, help="iterative method: iteration cap (default 10000)"
        )
    else:
        decoy.add_argument(
            "--grouping",
            choices=GROUPINGS,
            help="cutting rule: size-weighted keyed choice (default) or anatomy "
            "(largest buckets first; biases conjunctive counts, for "
            "comparison)",
        )


def _add_personal_audit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retention", type=float, default=0.5, help=RETENTION_HELP)
    parser.add_argument("--lambda", dest="lam", type=float, default=0.3, help=LAMBDA_HELP)
    parser.add_argument("--delta", type=float, default=0.3, help="δ in (0, 1), see --lambda")
    parser.add_argument("--budget", choices=BUDGETS, default="adaptive", help=BUDGET_HELP)
    parser.add_argument(
        "--merge-map",
        metavar="FILE",
        help="merged public values from `splu merge` (default: fit on the input)",
    )
    parser.add_argument("--seed", type=int, help="reproducible SPS run (default: a fresh key)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splu",
        description=(
            "SPLU Stream: publish survey responses so that large counts stay accurate and "
            "small counts stay private. Public attributes are published as they are; "
            "sensitive ones are randomized (decoy groups or personal groups)."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formatter = argparse.RawDescriptionHelpFormatter

    demo = commands.add_parser(
        "demo", formatter_class=formatter,
        help="the main job on embedded servers: stream the bundled sample end to end",
        description=(
            "Start an embedded Kafka-protocol broker and Redis-protocol server, a worker, a\n"
            "consumer and a producer over the bundled UCI Adult sample; show live progress\n"
            "and the consumer's live page (URL printed); ask the consumer for large and\n"
            "small reconstructed counts and compare them with the truth. Everything started\n"
            "is stopped again, also on Ctrl-C (--serve keeps the page up until then)."
        ),
    )  # fmt: skip
    demo.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        default="decoy",
        help="decoy groups on occupation (default) or personal groups on income",
    )
    demo.add_argument("--records", type=int, help="stream only the first N records")
    demo.add_argument("--rate", type=float, help="producer rate in records/s (default: flat out)")
    demo.add_argument(
        "--serve",
        action="store_true",
        help="keep the servers and the live page running after the summary, until Ctrl-C",
    )
    demo.add_argument("--port", type=int, help="the live page's port (default: a free one)")
    demo.set_defaults(run=command_demo)

    worker = commands.add_parser(
        "worker", formatter_class=formatter,
        help="run the stream worker for a stream's config (production)",
        description=(
            "Consume <stream>.raw, buffer and randomize in Redis, publish to\n"
            "<stream>.published. Start one per machine or container; Kafka spreads the\n"
            "partitions over them. Kafka and Redis come from the config, KAFKA_BOOTSTRAP\n"
            "and REDIS_URL override them; the service key from the environment variable\n"
            "or file the config names."
        ),
    )  # fmt: skip
    worker.add_argument("--config", required=True, help="the stream's TOML file")
    worker.add_argument(
        "--loglevel",
        choices=["crit", "error", "warn", "info", "debug"],
        default="warn",
        help="worker log level (default warn)",
    )
    worker.set_defaults(run=command_worker)

    consumer = commands.add_parser(
        "consumer", formatter_class=formatter,
        help="run a stream's consumer: running counts, queries, privacy reports, live page",
        description=(
            "Count <stream>.published once per token into Redis (the counts survive\n"
            "restarts), run the privacy tests every stream.report_interval seconds and\n"
            "publish them to <stream>.reports, and serve:\n"
            "  /          the live page (plots update themselves)\n"
            "  /status    JSON: counters, delays, tests, standing queries\n"
            "  /metrics   Prometheus text format\n"
            "  /estimate  GET ?where=col:val,col:val&value=sacol:val, or POST a JSON\n"
            "             array of query objects (as `splu query --url` does)\n"
            "The config's [reports] table sets the tests' thresholds, the standing queries\n"
            "and which failed tests pause publishing (fail_closed). It needs no service key."
        ),
    )  # fmt: skip
    consumer.add_argument("--config", required=True, help="the stream's TOML file")
    consumer.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)"
    )
    consumer.add_argument(
        "--port", type=int, help="port to serve on (default: reports.port of the config, 6066)"
    )
    consumer.add_argument(
        "--loglevel",
        choices=["crit", "error", "warn", "info", "debug"],
        default="warn",
        help="log level (default warn)",
    )
    consumer.set_defaults(run=command_consumer)

    produce = commands.add_parser(
        "produce", formatter_class=formatter,
        help="stream a CSV into <stream>.raw",
        description=(
            "Send each row's schema columns as a JSON object to <stream>.raw, keyed by a\n"
            "record id (<file digest>:<line>, or --id-column), so producing the same file\n"
            "again stores nothing twice."
        ),
    )  # fmt: skip
    produce.add_argument("--config", required=True, help="the stream's TOML file")
    produce.add_argument("--input", required=True, help="CSV with a header line (- for stdin)")
    produce.add_argument("--rate", type=float, help="records per second (default: flat out)")
    produce.add_argument("--id-column", metavar="COL", help="column holding each record's id")
    produce.set_defaults(run=command_produce)

    publish = commands.add_parser(
        "publish", formatter_class=formatter,
        help="publish a CSV once (batch), with the same mechanism code the stream uses",
        description=(
            "Publish IN.csv as OUT.csv: public columns unchanged, sensitive columns\n"
            "randomized, rows in random order, no ids. Nothing is dropped without being\n"
            "counted: rows that break the schema are rejected and listed; decoy groups cut\n"
            "values above 1/γ of the data to their share and trim N to a multiple of γ.\n\n"
            "examples:\n"
            "  splu publish --input adult.csv --output published.csv --mechanism decoy \\\n"
            "      --gamma 5 --sensitive occupation --quasi age,sex,race,marital_status,education\n"
            "  splu merge --input adult.csv --sensitive income \\\n"
            "      --quasi education,occupation,race,sex --output merge.toml\n"
            "  splu publish --input adult.csv --output published.csv --mechanism personal \\\n"
            "      --retention 0.5 --lambda 0.3 --delta 0.3 --merge-map merge.toml \\\n"
            "      --sensitive income --quasi education,occupation,race,sex"
        ),
    )  # fmt: skip
    _add_table_options(publish)
    publish.add_argument("--output", required=True, help="published CSV (- for stdout)")
    _add_mechanism_options(publish, reconstruction=False)
    publish.add_argument(
        "--seed",
        type=int,
        help="derive the key and ids from this seed so the publication can be "
        "repeated exactly; anyone with the seed can too, so experiments "
        "only (default: a fresh random key)",
    )
    publish.add_argument(
        "--report",
        metavar="FILE.json",
        help="write the full accounting: rejected rows with reasons, "
        "suppressed and trimmed rows, per-mechanism figures",
    )
    publish.set_defaults(run=command_publish)

    query = commands.add_parser(
        "query", formatter_class=formatter,
        help="answer count queries (JSONL) from a published CSV or a running consumer",
        description=(
            'Each input line is {"where": {"col": "val", ...}, "value": {"sacol": "val"}};\n'
            "a where value may also be a list (any of). Each output line is the same\n"
            'object plus "estimate" and, where defined, an interval "low"/"high".\n'
            "Give the same mechanism options as `splu publish`.\n\n"
            "Large counts come back accurately; small counts deliberately do not.\n\n"
            "example:\n"
            "  echo '{\"where\": {\"sex\": \"Female\"},' \\\n"
            "       '\"value\": {\"occupation\": \"Sales\"}}' > q.jsonl\n"
            "  splu query --published published.csv --mechanism decoy --gamma 5 \\\n"
            "      --sensitive occupation --queries q.jsonl --output answers.jsonl\n"
            "  splu query --url http://127.0.0.1:6066 --queries q.jsonl --output -"
        ),
    )  # fmt: skip
    source = query.add_mutually_exclusive_group()
    source.add_argument("--published", help="CSV written by `splu publish`")
    source.add_argument(
        "--url",
        help="instead, ask a running consumer (`splu consumer`), e.g. http://127.0.0.1:6066; "
        "its stream's config decides mechanism and options",
    )
    query.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="the randomized column(s) of the published file",
    )
    query.add_argument("--queries", required=True, help="JSONL file of queries (- for stdin)")
    query.add_argument("--output", required=True, help="JSONL answers (- for stdout)")
    _add_mechanism_options(query, reconstruction=True)
    query.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="coverage of the [low, high] interval (default 0.95)",
    )
    query.add_argument(
        "--clip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep answers in [0, |P|]; decoy clips by default, personal does "
        "not (its raw MLE is unbiased)",
    )
    query.set_defaults(run=command_query)

    guarantees = commands.add_parser(
        "guarantees", formatter_class=formatter,
        help="exact small-sum privacy T_P and large-sum utility T_f for a γ",
        description=(
            "Exact binomial tails of f′ ~ Binomial(γf, 1/γ):\n"
            "  T_P(ε, α) = min over f = 1..α of P(|f′ − f| > εf)  (privacy of small counts)\n"
            "  T_f       = smallest f with P(|f′ − f| ≥ εf) ≤ T_E for every larger f (utility)"
        ),
    )  # fmt: skip
    guarantees.add_argument(
        "--mechanism",
        choices=["decoy"],
        default="decoy",
        help="decoy groups (personal groups: see `splu audit personal`)",
    )
    guarantees.add_argument("--gamma", type=int, default=5, help=GAMMA_HELP)
    guarantees.add_argument(
        "--epsilon", type=float, default=0.3, help="relative error ε (default 0.3)"
    )
    guarantees.add_argument(
        "--alpha", type=int, default=10, help="largest count that must stay private (default 10)"
    )
    guarantees.add_argument(
        "--te",
        type=float,
        default=0.02,
        help="utility: tolerated probability T_E of an error ≥ ε (default 0.02)",
    )
    guarantees.add_argument(
        "--utility-epsilon",
        type=float,
        help="relative error for the utility threshold (default: --epsilon)",
    )
    guarantees.add_argument("--json", action="store_true", help="machine-readable output")
    guarantees.set_defaults(run=command_guarantees)

    merge = commands.add_parser(
        "merge", formatter_class=formatter,
        help="merge public values with the same effect on a sensitive column (χ² test)",
        description=(
            "For each public column, join values whose sensitive-value counts a χ²\n"
            "two-sample test (α = 0.05, df = values with data) cannot tell apart, by\n"
            "connected components, and write the classes as a merge map for personal\n"
            "groups. Without it an adversary could pool groups that differ only in an\n"
            "irrelevant attribute and reconstruct more accurately than each allows."
        ),
    )  # fmt: skip
    _add_table_options(merge, schema=False)
    merge.add_argument("--alpha", type=float, default=0.05, help="test level (default 0.05)")
    merge.add_argument("--output", required=True, help="merge map (TOML) to write")
    merge.add_argument("--json", action="store_true", help="machine-readable output")
    merge.set_defaults(run=command_merge)

    audit = commands.add_parser("audit", help="privacy audits of raw data (trusted side)")
    audits = audit.add_subparsers(dest="audit", required=True, metavar="AUDIT")
    personal = audits.add_parser(
        "personal", formatter_class=formatter,
        help="the (λ, δ) test for every personal group: s_g, v_g, v_r",
        description=(
            "A personal group with largest true frequency f may hold at most\n"
            "  s_g = −2·(f·p + (1−p)/m)·ln δ / (λ·p·f)²\n"
            "perturbed records (seed 004 Cor. 6). Reports the groups over that limit under\n"
            "plain perturbation (v_g, v_r) and after SPS. Runs on raw data: keep its output\n"
            "on the trusted side."
        ),
    )  # fmt: skip
    _add_table_options(personal)
    _add_personal_audit_options(personal)
    personal.add_argument("--json", action="store_true", help="machine-readable, per group")
    personal.set_defaults(run=command_audit_personal)

    dp = audits.add_parser(
        "dp", formatter_class=formatter,
        help="disclosures Laplace counts at ε would allow (seed 004 ch. 3)",
        description=(
            "For every personal group g and value sa, an analyst asking |g| and |g ∧ sa|\n"
            "with Laplace noise b = Δ/ε learns the confidence θ/φ within τ with probability\n"
            "CP_τ (closed form, Lemma 2). A disclosure is CP_τ ≥ K_CP with a jump\n"
            "(θ/φ)/prior ≥ K_J. Runs on raw data: keep its output on the trusted side."
        ),
    )  # fmt: skip
    _add_table_options(dp)
    dp.add_argument(
        "--epsilon",
        type=float,
        action="append",
        required=True,
        help="privacy budget ε; repeat for several",
    )
    dp.add_argument("--tau", type=float, default=0.2, help="closeness τ (default 0.2)")
    dp.add_argument("--k-cp", type=float, default=0.7, help="K_CP threshold (default 0.7)")
    dp.add_argument("--k-j", type=float, default=3.0, help="K_J jump threshold (default 3)")
    dp.add_argument(
        "--sensitivity",
        type=float,
        default=2.0,
        help="Δ of the two counts (default 2: one edit changes both)",
    )
    dp.add_argument("--show", type=int, default=5, help="disclosures listed per ε (default 5)")
    dp.add_argument("--json", action="store_true", help="machine-readable output")
    dp.set_defaults(run=command_audit_dp)

    schema = commands.add_parser(
        "schema",
        formatter_class=formatter,
        help="scan a CSV and write its schema (domains, bins) as TOML",
        description="Write a [schema] table for the named columns, with every value seen in "
        "the input as the domain. Edit it, then pass it to --schema.",
    )
    schema.add_argument("--input", required=True, help="CSV with a header line")
    schema.add_argument("--sensitive", action="append", metavar="COL", required=True)
    schema.add_argument("--quasi", action="append", metavar="COL,COL")
    schema.add_argument(
        "--bin", action="append", metavar="COL=SPEC", help="COL=WIDTH or COL=EDGE,EDGE,..."
    )
    schema.add_argument("--output", required=True, help="TOML file to write")
    schema.set_defaults(run=command_schema)

    sample = commands.add_parser(
        "sample",
        help="write the bundled UCI Adult sample (45,222 records) as CSV",
    )
    sample.add_argument("--output", default="adult.csv", help="where to write (default adult.csv)")
    sample.set_defaults(run=command_sample)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (CommandError, SchemaError, QueryError, ValueError) as err:
        print(f"splu {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"splu {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
