"""The ``splu`` command line (SPEC §5)."""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np

from service.config import load_config
from service.dp_audit import audit_disclosures
from service.guarantees import chebyshev_thresholds, privacy_threshold, utility_threshold
from service.mechanisms.anatomy import Anatomy, AnatomyReconstruction, AnatomyRelease
from service.mechanisms.dbr import DBRReconstruction, DistributionBasedRandomization
from service.mechanisms.decoy import GROUPINGS, DecoyGroups
from service.mechanisms.fprivacy import METHODS as BUCKET_METHODS
from service.mechanisms.fprivacy import (
    BucketPublication,
    FPrivacyBucketization,
    FPrivacyReconstruction,
)
from service.mechanisms.global_randomization import (
    GlobalRandomization,
    GlobalRandomizationReconstruction,
)
from service.mechanisms.laplace import LaplaceCounts
from service.mechanisms.laplace import _canonical as laplace_query_key
from service.mechanisms.personal import BUDGETS, GroupAudit, PersonalGroups
from service.mechanisms.sdr import (
    SUBTABLE_COLUMN,
    SDRReconstruction,
    SmallDomainRandomization,
    SubTable,
)
from service.merge import ValueMap, fit_value_map
from service.prf import ServiceKey, random_ids
from service.reconstruct import (
    MATRICES,
    METHODS,
    DecoyReconstruction,
    Estimate,
    PersonalReconstruction,
    PublishedCells,
    Query,
    QueryError,
    Reconstruction,
)
from service.schema import Attribute, Rejection, Schema, SchemaError
from service.table import (
    RawRows,
    Table,
    open_sample,
    open_text,
    read_rows,
    read_table,
    write_table,
)

# The stream mechanisms (`splu demo`, `--url`); batch publication also has the others.
MECHANISMS = ("decoy", "personal")
BATCH_ONLY = ("sdr", "fprivacy", "anatomy", "dbr", "global")
# laplace publishes nothing: `splu query --mechanism laplace --input RAW.csv` (trusted side).
QUERYABLE = (*MECHANISMS, *BATCH_ONLY, "laplace")
CLIPPABLE = ("decoy", "personal", "sdr", "global")
SHOWN = 10

# Files a batch-only publication writes beside OUT.csv (OUT = its name without .csv).
PARAMS_SUFFIX = "params.json"  # public parameters, domains and checksums: every batch-only one
ST_SUFFIX = "st.csv"  # the sensitive table ST of anatomy and fprivacy
# The public column each mechanism adds to OUT.csv: SDR's sub-table, Anatomy's QI-group
# and F′-privacy's bucket id (the BID of the QIT).
EXTRA_COLUMN = {"sdr": SUBTABLE_COLUMN, "anatomy": "group", "fprivacy": "bucket"}
COUNT_COLUMN = "count"

GAMMA_HELP = (
    "decoy: group size γ ≥ 2 (default 5). Each record publishes a value drawn "
    "uniformly from the γ distinct values of its hidden group, so no output can "
    "tell which of γ values a person had. A value with true count f is published "
    "as Binomial(γf, 1/γ): small counts get relative noise ≈ √((γ−1)/(γf)), large "
    "counts stay accurate. The papers recommend γ ≥ 5."
)
GAMMA_BASELINES_HELP = (
    " anatomy: ℓ = γ distinct sensitive values per group (default 5; the papers compare "
    "Anatomy at ℓ = γ). global: keep the value with probability 1/γ, else publish one of "
    "the other m − 1 values uniformly (default 5; needs m > γ)."
)
RETENTION_HELP = (
    "personal: retention probability p in (0, 1) (default 0.5): a record keeps its "
    "value with probability p, else gets a uniform draw from all m values"
)
LAMBDA_HELP = (
    "personal: relative error λ (default 0.3) and bound δ (default 0.3): no one can "
    "prove a personal group's reconstruction is within λ with probability above 1 − δ"
)
DELTA_HELP = (
    "personal: δ in (0, 1), see --lambda (default 0.3). sdr: the error bound PP "
    "minimizes holds with confidence 1 − δ (default 0.05); it scales the reported bound "
    "and never changes the partition"
)
BUDGET_HELP = (
    "personal: trials allowed per group: adaptive (its true largest frequency, default), "
    "conservative (frequency 1, safe under drift), none (plain perturbation, for comparison)"
)
RHO_HELP = (
    "sdr: restricted (ρ1, ρ2)-privacy, 0 < ρ1 < ρ2 < 1 (default 1/13 and 1/6, the paper's "
    "setting on occupation): a value with relative frequency ≤ ρ1 is never inferred with "
    "posterior above ρ2; more frequent values are not protected. Decimals or ratios (1/13)"
)
MECHANISM_OPTIONS = {
    "decoy": ("gamma", "grouping", "method", "matrix", "tolerance", "max_iterations"),
    "personal": ("retention", "lam", "delta", "budget", "merge_map"),
    "sdr": ("rho1", "rho2", "delta"),
    "fprivacy": ("theta", "beta", "max_size", "min_size", "bucket_method", "fake_values"),
    "anatomy": ("gamma",),
    "dbr": (),
    "global": ("gamma",),
    "laplace": ("epsilon",),
}
OPTION_FLAGS = {"lam": "--lambda"}
PERSONAL_DEFAULTS = {"retention": 0.5, "lam": 0.3, "delta": 0.3, "budget": "adaptive"}
DECOY_DEFAULTS = {
    "gamma": 5,
    "grouping": "size-weighted",
    "method": "closed",
    "matrix": "corrected",
    "tolerance": 0.01,
    "max_iterations": 10_000,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "decoy": DECOY_DEFAULTS,
    "personal": PERSONAL_DEFAULTS,
    "sdr": {"rho1": Fraction(1, 13), "rho2": Fraction(1, 6), "delta": 0.05},
    "fprivacy": {
        "theta": Fraction(8),
        "beta": Fraction(1, 50),
        "max_size": 50,
        "min_size": 1,
        "bucket_method": "multi",
        "fake_values": 0,
    },
    "anatomy": {"gamma": 5},
    "dbr": {},
    "global": {"gamma": 5},
    "laplace": {},
}


def _flag(option: str) -> str:
    return OPTION_FLAGS.get(option, "--" + option.replace("_", "-"))


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
    """The options of --mechanism, checked, with defaults filled in; others given are an error."""
    chosen = args.mechanism
    for option in dict.fromkeys(o for options in MECHANISM_OPTIONS.values() for o in options):
        if option in MECHANISM_OPTIONS[chosen] or getattr(args, option, None) is None:
            continue
        owners = [m for m, options in MECHANISM_OPTIONS.items() if option in options]
        listed = ", ".join(owners[:-1]) + " or " + owners[-1] if len(owners) > 1 else owners[0]
        raise CommandError(f"{_flag(option)} applies to --mechanism {listed}, not {chosen}")
    defaults = DEFAULTS[chosen]
    settings = {o: getattr(args, o, None) for o in MECHANISM_OPTIONS[chosen]}
    settings = {o: defaults[o] if v is None and o in defaults else v for o, v in settings.items()}
    return _checked_settings(chosen, settings)


def _fraction(value: object, flag: str) -> Fraction:
    """An exact number from a decimal or a ratio as written (0.02 is 1/50, not a float)."""
    if isinstance(value, Fraction):
        return value
    try:
        return Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError):
        raise CommandError(f"{flag} must be a number or a ratio like 1/13, got {value!r}") from None


def _checked_settings(chosen: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Check the options the CLI validates itself, so each error names its flag; exact
    numbers (ρ, θ, β) become Fractions."""
    out = dict(settings)
    if "gamma" in out and out["gamma"] < 2:
        raise CommandError(f"--gamma must be at least 2, got {out['gamma']}")
    if chosen == "sdr":
        for option in ("rho1", "rho2"):
            out[option] = _fraction(out[option], _flag(option))
            if not 0 < out[option] < 1:
                raise CommandError(f"{_flag(option)} must lie in (0, 1), got {out[option]}")
        if not out["rho1"] < out["rho2"]:
            raise CommandError(
                f"--rho1 ({out['rho1']}) must be below --rho2 ({out['rho2']}): the posterior "
                "bound must exceed the prior it protects"
            )
        if not 0 < out["delta"] < 1:
            raise CommandError(f"--delta must lie in (0, 1), got {out['delta']}")
    elif chosen == "fprivacy":
        out["theta"] = _fraction(out["theta"], "--theta")
        out["beta"] = _fraction(out["beta"], "--beta")
        if out["theta"] <= 0:
            raise CommandError(f"--theta must be positive, got {out['theta']}")
        if not 0 <= out["beta"] <= 1:
            raise CommandError(f"--beta must lie in [0, 1], got {out['beta']}")
        if out["max_size"] < 1:
            raise CommandError(f"--max-size must be at least 1, got {out['max_size']}")
        if not 1 <= out["min_size"] <= out["max_size"]:
            raise CommandError(
                f"--min-size must lie in 1..{out['max_size']} (--max-size), got {out['min_size']}"
            )
        if out["fake_values"] < 0:
            raise CommandError(f"--fake-values must be 0 or more, got {out['fake_values']}")
    elif chosen == "laplace":
        epsilon = out["epsilon"]
        if epsilon is None:
            raise CommandError("--mechanism laplace needs its privacy budget: give --epsilon E")
        if not (math.isfinite(epsilon) and epsilon > 0):
            raise CommandError(f"--epsilon must be a positive number, got {epsilon}")
    return out


def _shown(value: object) -> object:
    """An option's value as OUT.params.json records it (exact numbers as text: "1/13")."""
    return str(value) if isinstance(value, Fraction) else value


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


@dataclass
class _Batch:
    """A batch-only publication: OUT.csv's columns, ST where there is one, the public
    parameters for OUT.params.json, and the trusted-side accounting for --report."""

    header: list[str]
    columns: list[np.ndarray]
    params: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    st_header: list[str] | None = None
    st_columns: list[np.ndarray] | None = None


def _labels(attribute: Attribute, codes: np.ndarray) -> np.ndarray:
    return np.asarray(attribute.domain, dtype=object)[codes]


def _check_reserved(table: Table, mechanism: str) -> None:
    """OUT.csv adds the mechanism's column to the public ones; ST holds it, the sensitive
    column and a count. A data column of the same name would make a header ambiguous."""
    extra = EXTRA_COLUMN.get(mechanism)
    if extra is None:
        return
    reserved = {extra, COUNT_COLUMN} if mechanism in ("anatomy", "fprivacy") else {extra}
    for attribute in table.schema.attributes:
        if attribute.name in (reserved if attribute.sensitive else {extra}):
            raise CommandError(
                f"column {attribute.name!r}: --mechanism {mechanism} publishes a column of that "
                "name itself; rename it in the input"
            )


def _publish_sdr(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> _Batch:
    mechanism = SmallDomainRandomization(settings["rho1"], settings["rho2"], settings["delta"])
    release = mechanism.publish(table, ids, key)
    published, partition = release.published, release.partition
    attribute = table.schema[release.sensitive]
    present = partition.counts > 0
    protected = [attribute.domain[v] for v in np.flatnonzero(partition.protected)]
    unprotected = [attribute.domain[v] for v in np.flatnonzero(present & ~partition.protected)]
    _log(
        f"  protected values (relative frequency ≤ ρ1 = {settings['rho1']}): "
        f"{len(protected)} of {int(present.sum())}"
    )
    if unprotected:
        _log(f"  not protected (more frequent than ρ1): {', '.join(unprotected)}")
    shown = "; ".join(f"{s.size:,}, {s.m}, {float(s.gamma):.3g}" for s in release.subtables)
    _log(f"  {len(release.subtables)} sub-tables (rows, m_i, γ_i): {shown}")
    _log(
        f"  error bound at confidence {1 - settings['delta']:g}: {partition.error_bound:.4f} "
        f"(unpartitioned: {partition.unpartitioned_error:.4f})"
    )
    names = published.schema.names
    return _Batch(
        header=[*names, SUBTABLE_COLUMN],
        columns=[*(published.labels(n) for n in names), release.subtable],
        # What the paper publishes for reconstruction (App. 10.3): SA_i and γ_i (ρ_1i
        # follows from γ_i and ρ2; |T_i| is the number of rows labelled i).
        params={
            "subtables": [
                {
                    "values": [attribute.domain[v] for v in s.values],
                    "rows": s.size,
                    "rho1": str(s.rho1),
                    "gamma": str(s.gamma),
                }
                for s in release.subtables
            ]
        },
        details={
            "protected": protected,
            "unprotected": unprotected,
            "error_bound": partition.error_bound,
            "unpartitioned_error": partition.unpartitioned_error,
            "subtables": [
                {"rows": s.size, "m": s.m, "gamma": float(s.gamma), "retention": float(s.retention)}
                for s in release.subtables
            ],
        },
    )


def _publish_fprivacy(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> _Batch:
    sigma = settings["fake_values"]
    mechanism = FPrivacyBucketization(
        settings["theta"], settings["beta"], max_size=settings["max_size"],
        min_size=settings["min_size"], method=settings["bucket_method"], fake_values=sigma,
    )  # fmt: skip
    try:
        release = mechanism.publish(table, ids, key)
    except ValueError as err:
        if isinstance(err, SchemaError) or not sigma:
            raise
        raise CommandError(f"--fake-values {sigma}: {err}") from None
    published = release.published
    attribute = published.sensitive
    if release.suppressed:
        listed = ", ".join(f"{v}: {c:,}" for v, c in sorted(release.suppressed.items()))
        _log(f"  suppressed (above the share buckets ≤ --max-size allow): {listed}")
    if len(release.trimmed_lines):
        lines = ", ".join(str(x) for x in release.trimmed_lines[:SHOWN])
        _log(f"  trimmed {len(release.trimmed_lines)} rows no bucket setting could take ({lines})")
    _log(
        f"  {published.buckets:,} buckets {release.setting}, loss {release.loss:,} "
        f"(MSE {release.mse:.3f})" + (f", {sigma} fake values each" if sigma else "")
    )
    unprotected = [label for label, f in release.thresholds.items() if f == 1]
    alone = int((published.sizes == 1).sum())
    if unprotected:
        _log(f"  f′ = 1 (not protected) for {', '.join(unprotected)}")
    if alone:
        _log(f"  {alone:,} rows sit alone in a bucket (f′ = 1 values): --min-size 2 hides them")
    public = list(published.public)
    return _Batch(
        header=[*(a.name for a in public), EXTRA_COLUMN["fprivacy"]],
        columns=[*(_labels(a, published.qit[a.name]) for a in public), published.bucket],
        st_header=[EXTRA_COLUMN["fprivacy"], attribute.name, COUNT_COLUMN],
        st_columns=[
            published.st_bucket,
            _labels(attribute, published.st_value),
            published.st_count,
        ],
        params={"buckets": published.buckets},
        details={
            "setting": str(release.setting),
            "loss": release.loss,
            "mse": release.mse,
            "thresholds": {label: str(f) for label, f in release.thresholds.items()},
            "suppressed": release.suppressed,
            "suppressed_lines": release.suppressed_lines.tolist(),
            "trimmed_lines": release.trimmed_lines.tolist(),
        },
    )


def _publish_anatomy(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> _Batch:
    ell = settings["gamma"]
    try:
        release = Anatomy(ell).publish(table, ids, key)
    except ValueError as err:
        if isinstance(err, SchemaError):
            raise
        raise CommandError(f"--gamma {ell} (Anatomy's ℓ): {err}") from None
    attribute = table.schema[release.sensitive]
    larger = int((np.bincount(release.qit_group) > ell).sum())
    _log(f"  {release.groups:,} groups of ℓ={ell} distinct values ({larger:,} took a residue row)")
    public = table.schema.public
    return _Batch(
        header=[*(a.name for a in public), EXTRA_COLUMN["anatomy"]],
        columns=[*(_labels(a, release.qit[a.name]) for a in public), release.qit_group],
        st_header=[EXTRA_COLUMN["anatomy"], release.sensitive, COUNT_COLUMN],
        st_columns=[release.st_group, _labels(attribute, release.st_value), release.st_count],
        params={"groups": release.groups},
        details={"ell": ell, "groups": release.groups},
    )


def _publish_dbr(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> _Batch:
    published = DistributionBasedRandomization().publish(table, ids, key)
    _log("  every sensitive value redrawn from its column's distribution, whatever the row held")
    names = published.schema.names
    return _Batch(header=names, columns=[published.labels(n) for n in names])


def _publish_global(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> _Batch:
    name = _only_sensitive(table, "--mechanism global")
    gamma, m = settings["gamma"], table.schema[name].size
    if m <= gamma:
        raise CommandError(
            f"--gamma {gamma}: global randomization keeps a value with probability 1/γ, "
            f"above each other value's, only with more than γ values; {name!r} has {m}"
        )
    mechanism = GlobalRandomization(gamma, m)
    published = mechanism.publish(table, ids, key)
    _log(
        f"  keep the value with p = 1/γ = {mechanism.keep:.4f}, publish each other one with "
        f"q = {mechanism.switch:.4f} (m = {m})"
    )
    names = published.schema.names
    return _Batch(
        header=names,
        columns=[published.labels(n) for n in names],
        details={"gamma": gamma, "m": m, "keep": mechanism.keep, "switch": mechanism.switch},
    )


BATCH_PUBLISHERS: dict[str, Callable[..., _Batch]] = {
    "sdr": _publish_sdr,
    "fprivacy": _publish_fprivacy,
    "anatomy": _publish_anatomy,
    "dbr": _publish_dbr,
    "global": _publish_global,
}


def _beside(path: str, suffix: str) -> str:
    """OUT.csv → OUT.<suffix> in the same directory (OUT.csv.gz too; other names keep theirs)."""
    target = Path(path)
    name = target.name
    for ending in (".csv.gz", ".csv"):
        if name.endswith(ending) and len(name) > len(ending):
            name = name[: -len(ending)]
            break
    return str(target.with_name(f"{name}.{suffix}"))


def _csv_text(header: Sequence[str], columns: Sequence[np.ndarray]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(zip(*columns, strict=True))
    return buffer.getvalue()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _write_files(files: Sequence[tuple[str, str]]) -> None:
    """Write every (path, text) to a temporary beside it, then rename them all, the first
    last: a failure leaves no partial file, and the first appears only with the others."""
    temporaries: list[str] = []
    try:
        for path, text in files:
            target = Path(path)
            if not target.parent.exists():
                raise CommandError(f"cannot write {path}: directory {target.parent} does not exist")
            handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            temporaries.append(temporary)
            # newline="": the bytes written are the text the checksum was taken of.
            with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
                stream.write(text)
        for (path, _), temporary in reversed(list(zip(files, temporaries, strict=True))):
            Path(temporary).replace(path)
    except BaseException:
        for temporary in temporaries:
            Path(temporary).unlink(missing_ok=True)
        raise


def _write_batch(
    args: argparse.Namespace, settings: dict[str, Any], table: Table, batch: _Batch
) -> list[str]:
    """OUT.csv, OUT.st.csv (anatomy, fprivacy) and OUT.params.json; nothing from the trusted
    side: no ids, no source lines, no true values, no thresholds fitted on the data."""
    text = _csv_text(batch.header, batch.columns)
    files = [(args.output, text)]
    digests = {"published": _digest(text)}
    if batch.st_header is not None and batch.st_columns is not None:
        st_text = _csv_text(batch.st_header, batch.st_columns)
        files.append((_beside(args.output, ST_SUFFIX), st_text))
        digests["st"] = _digest(st_text)
    sensitive = [a.name for a in table.schema.sensitive]
    params = {
        "mechanism": args.mechanism,
        "published": Path(args.output).name,
        "rows": len(batch.columns[0]),
        "quasi": [a.name for a in table.schema.public],
        "sensitive": sensitive,
        "domain": {name: list(table.schema[name].domain) for name in sensitive},
        "options": {o: _shown(settings[o]) for o in MECHANISM_OPTIONS[args.mechanism]},
        **batch.params,
        # Ties the files together: `splu query` refuses a stale or foreign OUT.st.csv.
        "sha256": digests,
    }
    document = json.dumps(params, indent=2, ensure_ascii=False) + "\n"
    files.append((_beside(args.output, PARAMS_SUFFIX), document))
    _write_files(files)
    return [path for path, _ in files]


def command_publish(args: argparse.Namespace) -> int:
    if args.mechanism == "laplace":
        raise CommandError(
            "--mechanism laplace publishes nothing: it answers queries from the raw data with "
            "noise, on the trusted side; run `splu query --mechanism laplace --input IN.csv "
            "--epsilon E --sensitive COL --quasi ... --queries Q.jsonl --output R.jsonl`"
        )
    started = time.perf_counter()
    settings = _mechanism_settings(args)
    batch_only = args.mechanism in BATCH_ONLY
    if batch_only and args.output == "-":
        raise CommandError(
            f"--output -: --mechanism {args.mechanism} writes OUT.{PARAMS_SUFFIX} beside "
            "OUT.csv (see --help), so give a file name"
        )
    table, rejections = _read_input_table(args)
    rows_read = len(table) + len(rejections)
    _log(f"splu publish: read {rows_read:,} rows from {args.input}")
    _report_rejections(rejections)
    if batch_only:
        _check_reserved(table, args.mechanism)
    key, ids = _key_and_ids(args.seed, len(table))
    if batch_only:
        batch = BATCH_PUBLISHERS[args.mechanism](settings, table, ids, key)
        files = _write_batch(args, settings, table, batch)
        rows, details = len(batch.columns[0]), {**batch.details, "files": files}
        beside = f" (and {', '.join(files[1:])})"
    else:
        publish = _publish_decoy if args.mechanism == "decoy" else _publish_personal
        published, details = publish(settings, table, ids, key)
        _write_atomically(args.output, lambda s: write_table(published, s))
        rows, beside = len(published), ""
    if args.report:
        _write_json(args.report, {
            "mechanism": args.mechanism,
            "input_rows": rows_read,
            "published_rows": rows,
            "rejected": [
                {"line": r.record, "field": r.field, "reason": r.reason} for r in rejections
            ],
            **details,
        })  # fmt: skip
    _log(
        f"  published {rows:,} rows to {args.output}{beside} "
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


class _Answers(Protocol):
    """What answers queries: every Reconstruction, and F′-privacy's estimator."""

    def check(self, query: Query) -> None: ...

    def estimate_many(self, queries: Sequence[Query]) -> list[Estimate]: ...


def _read_queries(
    path: str, reconstruction: _Answers, domains: Mapping[str, Collection[str]] | None = None
) -> tuple[list[dict[str, Any]], list[Query | None]]:
    """Every non-blank line: its object (with "error" if unusable) and its parsed query.

    With `domains`, a sensitive value outside its column's domain is an error of its line.
    """
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
                for column, label in query.value.items():
                    if domains is not None and label not in domains[column]:
                        raise QueryError(f"value.{column}: {label!r} is not in the domain")
            except QueryError as err:
                shown = obj if isinstance(obj, dict) else {"line": number}
                objects.append({**shown, "error": str(err)})
                parsed.append(None)
                continue
            objects.append(obj)
            parsed.append(query)
    return objects, parsed


def _query_service(args: argparse.Namespace) -> int:
    if args.mechanism not in MECHANISMS:
        raise CommandError(
            f"--mechanism {args.mechanism} runs in batch only: query its files with --published"
        )
    options = [o for options in MECHANISM_OPTIONS.values() for o in options]
    given = [o for o in dict.fromkeys(["sensitive", *options, "clip", "quasi", "bin", "schema",
             "seed"]) if getattr(args, o, None) is not None]  # fmt: skip
    if given:
        flag = _flag(given[0])
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


def _read_text(path: str) -> str:
    with _input(path) as stream:
        return stream.read()


def _rows(text: str, path: str) -> RawRows:
    raw = read_rows(io.StringIO(text, newline=""))
    if raw.rejections:
        raise CommandError(f"{path}: {raw.rejections[0]} (is it a published file?)")
    return raw


def _integers(values: Sequence[str], path: str, column: str) -> np.ndarray:
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        try:
            out[i] = int(value)
        except ValueError:
            raise CommandError(f"{path}: {column!r} holds {value!r}, not a whole number") from None
    return out


def _encoded(values: Sequence[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """A column of labels as (its sorted distinct labels, codes into them)."""
    domain = tuple(sorted(set(values)))
    index = {v: i for i, v in enumerate(domain)}
    return domain, np.fromiter((index[v] for v in values), np.int64, len(values))


def _load_buckets(
    mechanism: str, params: dict[str, Any], qit: RawRows, st: RawRows, paths: tuple[str, str]
) -> _Answers:
    """Anatomy's or F′-privacy's QIT (OUT.csv) and ST (OUT.st.csv) as its estimator."""
    extra, name = EXTRA_COLUMN[mechanism], params["sensitive"][0]
    quasi, domain = list(params["quasi"]), list(params["domain"][name])
    for path, raw, header in (
        (paths[0], qit, [*quasi, extra]),
        (paths[1], st, [extra, name, COUNT_COLUMN]),
    ):
        if raw.header != header:
            raise CommandError(f"{path}: expected the columns {', '.join(header)}")
    public, codes = [], {}
    for i, column in enumerate(quasi):
        labels, codes[column] = _encoded([row[i] for row in qit.rows])
        public.append(Attribute(column, False, labels))
    group = _integers([row[-1] for row in qit.rows], paths[0], extra)
    st_group = _integers([row[0] for row in st.rows], paths[1], extra)
    st_count = _integers([row[2] for row in st.rows], paths[1], COUNT_COLUMN)
    index = {v: i for i, v in enumerate(domain)}
    unknown = [row[1] for row in st.rows if row[1] not in index]
    if unknown:
        raise CommandError(f"{paths[1]}: {unknown[0]!r} is not in the domain of {name!r}")
    st_value = np.array([index[row[1]] for row in st.rows], dtype=np.int64)
    sensitive = Attribute(name, True, tuple(domain))
    if mechanism == "anatomy":
        release = AnatomyRelease(
            Schema((*public, sensitive)), name, int(params["options"]["gamma"]), codes, group,
            st_group, st_value, st_count,
        )  # fmt: skip
        return AnatomyReconstruction(release)
    published = BucketPublication(
        tuple(public), codes, group, sensitive, st_group, st_value, st_count,
        int(params["options"]["fake_values"]),
    )  # fmt: skip
    return FPrivacyReconstruction(published)


def _load_batch(
    args: argparse.Namespace, settings: dict[str, Any]
) -> tuple[_Answers, int, dict[str, frozenset[str]]]:
    """The estimator of a batch-only publication from OUT.csv and the files beside it, checked
    against each other (checksums) and against the options given (which must agree)."""
    mechanism = args.mechanism
    if args.published == "-":
        raise CommandError(
            f"--published -: --mechanism {mechanism} reads OUT.{PARAMS_SUFFIX} beside OUT.csv, "
            "so give the file name"
        )
    params_path = _beside(args.published, PARAMS_SUFFIX)
    if not Path(params_path).exists():
        raise CommandError(
            f"cannot read {params_path}: `splu publish --mechanism {mechanism}` writes it beside "
            f"{args.published}; query the files it wrote together"
        )
    try:
        params = json.loads(_read_text(params_path))
    except json.JSONDecodeError as err:
        raise CommandError(f"{params_path}: not valid JSON ({err.msg})") from None
    try:
        if params["mechanism"] != mechanism:
            raise CommandError(
                f"{args.published} was published with --mechanism {params['mechanism']}, "
                f"not {mechanism} (says {params_path})"
            )
        text = _read_text(args.published)
        if _digest(text) != params["sha256"]["published"]:
            raise CommandError(
                f"{params_path} belongs to another publication than {args.published} (checksums "
                "differ): query the files one `splu publish` wrote together"
            )
        sensitive = list(params["sensitive"])
        given = _columns(args.sensitive)
        if given and given != sensitive:
            raise CommandError(
                f"--sensitive {','.join(given)}: {args.published} protects {', '.join(sensitive)}"
            )
        for option, recorded in params["options"].items():
            if getattr(args, option, None) is not None and _shown(settings[option]) != recorded:
                raise CommandError(
                    f"{_flag(option)} {getattr(args, option)} does not match the publication's "
                    f"{recorded} (from {params_path})"
                )
        domains = {name: frozenset(params["domain"][name]) for name in sensitive}
        raw = _rows(text, args.published)
        if mechanism in ("anatomy", "fprivacy"):
            st_path = _beside(args.published, ST_SUFFIX)
            st_text = _read_text(st_path)
            if _digest(st_text) != params["sha256"]["st"]:
                raise CommandError(
                    f"{st_path} belongs to another publication than {args.published} "
                    "(checksums differ): query the files one `splu publish` wrote together"
                )
            paths = (args.published, st_path)
            answers = _load_buckets(mechanism, params, raw, _rows(st_text, st_path), paths)
            return answers, len(raw.rows), domains
        extra = [EXTRA_COLUMN[mechanism]] if mechanism in EXTRA_COLUMN else []
        header = [*params["quasi"], *sensitive, *extra]
        if raw.header != header:
            raise CommandError(f"{args.published}: expected the columns {', '.join(header)}")
        cells = PublishedCells.from_rows(raw.header, raw.rows)
        if mechanism == "dbr":
            return DBRReconstruction(cells, sensitive, args.confidence), cells.total, domains
        name, domain = sensitive[0], list(params["domain"][sensitive[0]])
        if mechanism == "global":
            gamma = int(params["options"]["gamma"])
            reconstruction: Reconstruction = GlobalRandomizationReconstruction(
                cells, name, gamma, len(domain), args.confidence, bool(args.clip)
            )
            return reconstruction, cells.total, domains
        index = {v: i for i, v in enumerate(domain)}
        subtables = [
            SubTable(
                tuple(sorted(index[v] for v in sub["values"])), int(sub["rows"]),
                Fraction(sub["rho1"]), Fraction(sub["gamma"]),
            )
            for sub in params["subtables"]
        ]  # fmt: skip
        reconstruction = SDRReconstruction(
            cells, name, subtables, domain, SUBTABLE_COLUMN, args.confidence, bool(args.clip)
        )
        return reconstruction, cells.total, domains
    except (KeyError, TypeError, IndexError) as err:
        raise CommandError(
            f"{params_path}: not the parameters `splu publish` writes (at {err!r})"
        ) from None


def _query_laplace(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """Noisy counts on the raw data: trusted side. m = distinct queries naming a sensitive
    value (public-only ones are exact and outside the budget, as in LaplaceCounts)."""
    if args.input is None:
        raise CommandError(
            "--mechanism laplace answers from the raw data: give --input RAW.csv (trusted "
            "side), not --published"
        )
    table, rejections = _read_input_table(args)
    _log(f"splu query: read {len(table) + len(rejections):,} raw rows from {args.input}")
    _report_rejections(rejections)
    sensitive = [a.name for a in table.schema.sensitive]
    checker = Reconstruction(PublishedCells.from_table(table), sensitive, args.confidence, False)
    domains = {a.name: frozenset(a.domain) for a in table.schema.sensitive}
    objects, parsed = _read_queries(args.queries, checker, domains)
    valid = [q for q in parsed if q is not None]
    budgeted = len({laplace_query_key(q) for q in valid if q.value})
    mechanism = LaplaceCounts(settings["epsilon"], max(budgeted, 1), args.confidence)
    key = ServiceKey.fresh() if args.seed is None else ServiceKey.from_seed(args.seed)
    answers = iter(mechanism.answer(table, valid, key))
    results = [
        obj if q is None else {**obj, **next(answers).answer()}
        for obj, q in zip(objects, parsed, strict=True)
    ]
    _log(
        f"  {budgeted:,} distinct sensitive queries share ε = {mechanism.epsilon:g}: "
        f"noise Lap(b), b = m/ε = {mechanism.scale:g}"
    )
    return _write_answers(args, results, f"from {len(table):,} raw rows (laplace)")


def command_query(args: argparse.Namespace) -> int:
    if sum(source is not None for source in (args.published, args.url, args.input)) != 1:
        raise CommandError(
            "give --published FILE (a batch publication) or --url URL (a running consumer); "
            "--mechanism laplace takes --input RAW.csv instead"
        )
    if args.url is not None:
        return _query_service(args)
    chosen = args.mechanism
    if args.clip is not None and chosen not in CLIPPABLE:
        raise CommandError(
            f"--clip applies to --mechanism {', '.join(CLIPPABLE[:-1])} or {CLIPPABLE[-1]}, "
            f"not {chosen}"
        )
    if chosen != "laplace":
        for option in ("input", "quasi", "bin", "schema", "seed"):
            if getattr(args, option, None) is not None:
                raise CommandError(
                    f"{_flag(option)} applies to --mechanism laplace (raw data), not {chosen}"
                )
    settings = _mechanism_settings(args)
    if chosen == "laplace":
        return _query_laplace(args, settings)
    if chosen in BATCH_ONLY:
        answerer, rows, domains = _load_batch(args, settings)
    else:
        if not _columns(args.sensitive):
            raise CommandError(
                "name the sensitive column(s) of the published file with --sensitive"
            )
        with _input(args.published) as stream:
            raw = read_rows(stream)
        if raw.rejections:
            raise CommandError(f"{args.published}: {raw.rejections[0]} (is it a published file?)")
        cells = PublishedCells.from_rows(raw.header, raw.rows)
        answerer, rows, domains = _reconstruction(args, settings, cells), cells.total, None
    objects, parsed = _read_queries(args.queries, answerer, domains)
    valid = [q for q in parsed if q is not None]
    answers = iter(answerer.estimate_many(valid))
    results = [
        obj if q is None else {**obj, **next(answers).answer()}
        for obj, q in zip(objects, parsed, strict=True)
    ]
    source = f"over {rows:,} published rows ({chosen})"
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
    with _input(args.input) as stream:
        rows = rows_of(stream, config, source, args.id_column)
        try:
            sent = asyncio.run(produce(config, rows, total, args.rate))
        except KafkaError as err:
            raise CommandError(f"cannot produce to {config.kafka_bootstrap}: {err}") from None
    _log(
        f"splu produce: {sent:,} records from {args.input} acknowledged by "
        f"{config.topics['raw']} at {config.kafka_bootstrap}"
    )
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
        choices=QUERYABLE,
        default="decoy",
        help="decoy (SPLU-Gen decoy groups, default), personal (personal groups with "
        "reconstruction privacy, SPS), or, in batch only: sdr (small domain randomization), "
        "fprivacy (F′-privacy bucketization), anatomy, dbr (distribution-based "
        "randomization), global (global randomization, mechanism A); laplace answers "
        "queries from the raw data (`splu query --input`, trusted side)",
    )
    decoy = parser.add_argument_group("decoy groups (--gamma also: anatomy, global)")
    decoy.add_argument("--gamma", type=int, help=GAMMA_HELP + GAMMA_BASELINES_HELP)
    personal = parser.add_argument_group("personal groups (--delta also: sdr)")
    personal.add_argument("--retention", type=float, help=RETENTION_HELP)
    personal.add_argument("--lambda", dest="lam", type=float, help=LAMBDA_HELP)
    personal.add_argument("--delta", type=float, help=DELTA_HELP)
    personal.add_argument("--budget", choices=BUDGETS, help=BUDGET_HELP)
    personal.add_argument(
        "--merge-map",
        metavar="FILE",
        help="personal: merged public values from `splu merge`; publish "
        "fits one on its input without it, query needs it for exact m "
        "and intervals",
    )
    sdr = parser.add_argument_group(
        "small domain randomization (sdr)",
        "Partition the rows into sub-tables, perturb each within its own values SA_i\n"
        "with its own γ_i; --delta: confidence of the error bound (see above).",
    )
    sdr.add_argument("--rho1", metavar="R", help=RHO_HELP)
    sdr.add_argument("--rho2", metavar="R", help="sdr: see --rho1")
    fprivacy = parser.add_argument_group(
        "F′-privacy bucketization (fprivacy)",
        "Buckets in which each value x holds at most ⌊f′_x·|bucket|⌋ rows, published as\n"
        "QIT (public columns, bucket) and ST (bucket, value, count).",
    )
    fprivacy.add_argument(
        "--theta",
        metavar="X",
        help="fprivacy: thresholds f′_x = min(1, θ·f_x + β), f_x the value's share "
        "(default θ = 8, β = 0.02, the paper's); values with f′ = 1 are not protected",
    )
    fprivacy.add_argument("--beta", metavar="X", help="fprivacy: see --theta")
    fprivacy.add_argument(
        "--max-size",
        type=int,
        metavar="N",
        help="fprivacy: largest bucket M′ (default 50); a value needing more is suppressed",
    )
    fprivacy.add_argument(
        "--min-size",
        type=int,
        metavar="N",
        help="fprivacy: smallest bucket (default 1); 2 keeps rows of values with f′ = 1 "
        "out of buckets of one",
    )
    fprivacy.add_argument(
        "--bucket-method",
        choices=BUCKET_METHODS,
        help="fprivacy: bucket sizes by Algorithm 2 (multi, default) or the optimal "
        "two-size setting (two)",
    )
    fprivacy.add_argument(
        "--fake-values",
        type=int,
        metavar="N",
        help="fprivacy: σ fake values added to each bucket's ST (default 0); needs buckets "
        "of distinct values",
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
            "      --sensitive income --quasi education,occupation,race,sex\n"
            "  splu publish --input adult.csv --output sdr.csv --mechanism sdr \\\n"
            "      --rho1 1/13 --rho2 1/6 --sensitive occupation --quasi age,sex,race\n"
            "  splu publish --input adult.csv --output buckets.csv --mechanism fprivacy \\\n"
            "      --theta 8 --beta 0.02 --max-size 50 --sensitive occupation --quasi age,sex\n\n"
            "files beside OUT.csv (batch-only mechanisms: sdr, fprivacy, anatomy, dbr, global):\n"
            "OUT is the --output name without .csv; `splu query` reads them back and checks\n"
            "that they belong together.\n"
            "  OUT.params.json  every one: mechanism, options, columns, the sensitive\n"
            "                   domain, sdr's SA_i, |T_i| and γ_i per sub-table, checksums\n"
            "  OUT.st.csv       anatomy, fprivacy: the sensitive table ST, columns\n"
            "                   group|bucket, the sensitive column, count\n"
            "OUT.csv holds the --quasi columns, then the --sensitive ones, except:\n"
            "  sdr        ... plus subtable: each row's sub-table (public, as in the paper)\n"
            "  anatomy    the QIT: --quasi columns plus group; the values are in OUT.st.csv\n"
            "  fprivacy   the QIT: --quasi columns plus bucket; the values are in OUT.st.csv\n"
            "Rows come in the mechanism's keyed random order. No file holds ids, source\n"
            "lines, true values or thresholds fitted on the data: those are in --report,\n"
            "which stays on the trusted side."
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
            "  splu query --url http://127.0.0.1:6066 --queries q.jsonl --output -\n"
            "  splu query --published sdr.csv --mechanism sdr --queries q.jsonl --output a.jsonl\n"
            "  splu query --mechanism laplace --input adult.csv --epsilon 0.05 \\\n"
            "      --sensitive occupation --quasi age,sex --queries q.jsonl --output a.jsonl\n\n"
            "Batch-only mechanisms (sdr, fprivacy, anatomy, dbr, global) read OUT.params.json\n"
            "and, for anatomy and fprivacy, OUT.st.csv beside --published OUT.csv (see\n"
            "`splu publish --help`); --sensitive and their options may be left out, and must\n"
            "match the publication if given. low/high is a normal interval for sdr and\n"
            "global, exact (Clopper–Pearson) for a dbr value's total and absent for its\n"
            "conjunctions, the range of counts consistent with the buckets for fprivacy (not\n"
            "a confidence interval), and absent for anatomy (its estimator has no error model).\n\n"
            "--mechanism laplace publishes nothing and RUNS ON THE TRUSTED SIDE: it answers\n"
            "from the raw data (--input RAW.csv, columns as for publish), each count plus\n"
            "Laplace noise of scale m/ε, m = the number of distinct queries in the file that\n"
            "name a sensitive value (public-only queries are exact and outside the budget).\n"
            "A run with a fresh key spends ε again; --seed repeats a run's noise."
        ),
    )  # fmt: skip
    source = query.add_mutually_exclusive_group()
    source.add_argument("--published", help="CSV written by `splu publish`")
    source.add_argument(
        "--url",
        help="instead, ask a running consumer (`splu consumer`), e.g. http://127.0.0.1:6066; "
        "its stream's config decides mechanism and options",
    )
    source.add_argument(
        "--input",
        metavar="RAW.csv",
        help="laplace: the raw data (trusted side), with --sensitive and --quasi as for publish",
    )
    query.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="the randomized column(s) of the published file (laplace: of the raw data)",
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
        help="keep answers in [0, |P|]; decoy clips by default, personal, sdr and global "
        "do not (their raw estimates are unbiased)",
    )
    laplace = query.add_argument_group("laplace (answers from the raw data: trusted side)")
    laplace.add_argument(
        "--epsilon",
        type=float,
        help="laplace: privacy budget ε > 0 shared by the file's queries (required)",
    )
    laplace.add_argument(
        "--quasi", action="append", metavar="COL,COL", help="laplace: public columns of --input"
    )
    laplace.add_argument(
        "--bin", action="append", metavar="COL=SPEC", help="laplace: as for `splu publish`"
    )
    laplace.add_argument("--schema", help="laplace: as for `splu publish`")
    laplace.add_argument(
        "--seed",
        type=int,
        help="laplace: derive the noise from this seed (experiments only: anyone with the "
        "seed can remove it; default: a fresh random key)",
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
    # ConnectionError: a broker or Redis that does not answer or refuses the stream's user.
    except (CommandError, SchemaError, QueryError, ValueError, ConnectionError) as err:
        print(f"splu {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"splu {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
