"""The mechanism registry: which mechanisms there are, their options and defaults, and how a
batch publication is made, written beside OUT.csv and read back.

`MECHANISMS` run on the stream and in batch, `BATCH_ONLY` in batch only (and on windows of a
stream, `service/store/windowed.py`); `MECHANISM_OPTIONS` names each one's options, `DEFAULTS` gives
their values and `checked_settings` checks them. The publishers turn a table into the published
rows: `publish_decoy` and `publish_personal` a table, `BATCH_PUBLISHERS` a `Batch` whose files
`write_batch` writes (OUT.csv, OUT.st.csv, OUT.params.json) and `load_batch` reads back as an
estimator. The command line (`service/cli/batch.py`) and the stream configuration
(`service/core/config.py`) take their option names and defaults from here, so a batch run and a
windowed stream publish alike.

Errors are `PublicationError`s naming the command line's flags (--gamma); a windowed stream
renames them to its configuration keys.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import numpy as np

from service.core.mechanisms.anatomy import Anatomy, AnatomyReconstruction, AnatomyRelease
from service.core.mechanisms.dbr import DBRReconstruction, DistributionBasedRandomization
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.fprivacy import (
    BucketPublication,
    FPrivacyBucketization,
    FPrivacyReconstruction,
)
from service.core.mechanisms.global_randomization import (
    GlobalRandomization,
    GlobalRandomizationReconstruction,
)
from service.core.mechanisms.personal import GroupAudit, PersonalGroups
from service.core.mechanisms.sdr import (
    SUBTABLE_COLUMN,
    SDRReconstruction,
    SmallDomainRandomization,
    SubTable,
)
from service.core.merge import ValueMap, fit_value_map
from service.core.prf import ServiceKey
from service.core.reconstruct import (
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
from service.core.schema import Attribute, Schema, SchemaError
from service.core.table import RawRows, Table, open_text, read_columns, read_rows

if TYPE_CHECKING:  # the config reads this registry's options: no import at run time
    from service.core.config import StreamConfig

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
# The merge map a personal publication grouped with, when `splu publish` fitted it on its
# input: `splu query` needs the same groups, or its intervals cover 50-85% (issue 15).
MERGE_SUFFIX = "merge.toml"
# The public column each mechanism adds to OUT.csv: SDR's sub-table, Anatomy's QI-group
# and F′-privacy's bucket id (the BID of the QIT).
EXTRA_COLUMN = {"sdr": SUBTABLE_COLUMN, "anatomy": "group", "fprivacy": "bucket"}
COUNT_COLUMN = "count"

MECHANISM_OPTIONS = {
    "decoy": ("gamma", "grouping", "method", "matrix", "tolerance", "max_iterations"),
    "personal": ("retention", "lam", "delta", "budget", "merge_map", "stream"),
    "sdr": ("rho1", "rho2", "delta"),
    "fprivacy": ("theta", "beta", "max_size", "min_size", "bucket_method", "fake_values"),
    "anatomy": ("gamma",),
    "dbr": (),
    "global": ("gamma",),
    "laplace": ("epsilon",),
}
OPTION_FLAGS = {"lam": "--lambda"}
PERSONAL_DEFAULTS = {
    "retention": 0.5,
    "lam": 0.3,
    "delta": 0.3,
    "budget": "adaptive",
    "stream": False,
}
# The estimator's own defaults, so `splu query` answers as `/estimate` and the reader do.
DECOY_DEFAULTS = {
    "gamma": 5,
    "grouping": "size-weighted",
    "method": METHODS[0],
    "matrix": MATRICES[0],
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


class PublicationError(ValueError):
    """A failure to report as one clear line, with nothing half-written."""


def log(message: str) -> None:
    """The publishers' account on stderr: the CLI shows it, a windowed worker logs it."""
    print(message, file=sys.stderr, flush=True)


def flag_of(option: str) -> str:
    """The command-line flag of an option (`lam` is --lambda)."""
    return OPTION_FLAGS.get(option, "--" + option.replace("_", "-"))


@contextmanager
def open_input(path: str) -> Iterator[TextIO]:
    """The text of `path` (.gz too), or stdin for "-"."""
    try:
        stream = sys.stdin if path == "-" else open_text(path)
    except OSError as err:
        raise PublicationError(f"cannot read {path}: {err.strerror}") from None
    try:
        yield stream
    finally:
        if stream is not sys.stdin:
            stream.close()


def _fraction(value: object, flag: str) -> Fraction:
    """An exact number from a decimal or a ratio as written (0.02 is 1/50, not a float)."""
    if isinstance(value, Fraction):
        return value
    try:
        return Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError):
        raise PublicationError(
            f"{flag} must be a number or a ratio like 1/13, got {value!r}"
        ) from None


def checked_settings(chosen: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Check the options the CLI validates itself, so each error names its flag; exact
    numbers (ρ, θ, β) become Fractions."""
    out = dict(settings)
    if "gamma" in out and out["gamma"] < 2:
        raise PublicationError(f"--gamma must be at least 2, got {out['gamma']}")
    if out.get("method") == "iterative" and out.get("matrix") == "mixing":
        raise PublicationError(
            "--method iterative is the papers' method on their 2×2 model: give --matrix "
            "corrected or --matrix paper with it"
        )
    if chosen == "sdr":
        for option in ("rho1", "rho2"):
            out[option] = _fraction(out[option], flag_of(option))
            if not 0 < out[option] < 1:
                raise PublicationError(f"{flag_of(option)} must lie in (0, 1), got {out[option]}")
        if not out["rho1"] < out["rho2"]:
            raise PublicationError(
                f"--rho1 ({out['rho1']}) must be below --rho2 ({out['rho2']}): the posterior "
                "bound must exceed the prior it protects"
            )
        if not 0 < out["delta"] < 1:
            raise PublicationError(f"--delta must lie in (0, 1), got {out['delta']}")
    elif chosen == "fprivacy":
        out["theta"] = _fraction(out["theta"], "--theta")
        out["beta"] = _fraction(out["beta"], "--beta")
        if out["theta"] <= 0:
            raise PublicationError(f"--theta must be positive, got {out['theta']}")
        if not 0 <= out["beta"] <= 1:
            raise PublicationError(f"--beta must lie in [0, 1], got {out['beta']}")
        if out["max_size"] < 1:
            raise PublicationError(f"--max-size must be at least 1, got {out['max_size']}")
        if not 1 <= out["min_size"] <= out["max_size"]:
            raise PublicationError(
                f"--min-size must lie in 1..{out['max_size']} (--max-size), got {out['min_size']}"
            )
        if out["fake_values"] < 0:
            raise PublicationError(f"--fake-values must be 0 or more, got {out['fake_values']}")
    elif chosen == "laplace":
        epsilon = out["epsilon"]
        if epsilon is None:
            raise PublicationError("--mechanism laplace needs its privacy budget: give --epsilon E")
        if not (math.isfinite(epsilon) and epsilon > 0):
            raise PublicationError(f"--epsilon must be a positive number, got {epsilon}")
    return out


def _shown(value: object) -> object:
    """An option's value as OUT.params.json records it (exact numbers as text: "1/13")."""
    return str(value) if isinstance(value, Fraction) else value


def only_sensitive(table: Table, command: str) -> str:
    """The table's one sensitive column; `command` is what needs exactly one."""
    if len(table.schema.sensitive) != 1:
        raise PublicationError(f"{command} takes exactly one --sensitive column")
    return table.schema.sensitive[0].name


def personal_merge_map(settings: dict[str, Any], published: str) -> None:
    """Fill in the merge map of a personal publication read back from `published`: the
    one named, else the one `splu publish` wrote beside it; without either the groups are
    unknown, and estimates and intervals would be those of other groups: refuse."""
    if settings["merge_map"]:
        return
    fitted = beside(published, MERGE_SUFFIX)
    if published == "-" or not Path(fitted).exists():
        raise PublicationError(
            "--mechanism personal needs the merge map the publication grouped with: give "
            f"--merge-map FILE (`splu publish` writes OUT.{MERGE_SUFFIX} beside OUT.csv when "
            "it fitted one on its input); with other groups the intervals do not cover"
        )
    log(f"  merge map: {fitted}, written by splu publish beside {published}")
    settings["merge_map"] = fitted


def value_map_for(path: str | None, table: Table, sensitive: str) -> ValueMap:
    """The merge map at `path`, or without one a map fitted on the table itself."""
    if path:
        return ValueMap.load(path)
    log("  no --merge-map: merging public values on the input itself (χ², α = 0.05)")
    return fit_value_map(table, sensitive)


def merge_summary(value_map: ValueMap) -> str:
    return ", ".join(f"{n} {v}→{c}" for n, (v, c) in value_map.class_counts().items())


def audit_summary(audit: GroupAudit) -> str:
    return (
        f"{len(audit.sizes):,} groups, {(~audit.passed).sum():,} over their limit: "
        f"v_g = {audit.groups_failing:.1%} of groups, v_r = {audit.records_failing:.1%} of records"
    )


def publish_decoy(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> tuple[Table, dict[str, Any]]:
    """Decoy groups: the published table and the figures for --report."""
    release = DecoyGroups(settings["gamma"], settings["grouping"]).publish(table, ids, key)
    for name, counts in release.suppressed.items():
        if counts:
            listed = ", ".join(f"{v}: {c:,}" for v, c in sorted(counts.items()))
            log(f"  suppressed (value above 1/γ of the data) in {name}: {listed}")
    if len(release.trimmed_lines):
        lines = ", ".join(str(x) for x in release.trimmed_lines)
        log(f"  trimmed {len(release.trimmed_lines)} rows to a multiple of γ (lines {lines})")
    log(
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


def publish_personal(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> tuple[Table, dict[str, Any]]:
    """Personal groups (SPS): the published table and the figures for --report."""
    sensitive = only_sensitive(table, "--mechanism personal")
    value_map = value_map_for(settings["merge_map"], table, sensitive)
    mechanism = PersonalGroups(
        settings["retention"], settings["lam"], settings["delta"], settings["budget"], value_map
    )
    release = mechanism.publish(table, ids, key)
    log(f"  merged public values: {merge_summary(value_map)}")
    log(f"  plain perturbation would leave {audit_summary(release.plain)}")
    log(
        f"  SPS ({settings['budget']} budget): {release.sampled_rows:,} rows perturbed, "
        f"{len(table) - release.sampled_rows:,} published as copies; "
        f"{audit_summary(release.audit)}"
    )
    if release.borrowed_rows:
        log(
            f"  {release.borrowed_rows:,} rows carry a copy from another value: their group's "
            "limit allows fewer trials than it has values"
        )
    return release.published, {
        "value_map": value_map,
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
class Batch:
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


def check_reserved(table: Table, mechanism: str) -> None:
    """OUT.csv adds the mechanism's column to the public ones; ST holds it, the sensitive
    column and a count. A data column of the same name would make a header ambiguous."""
    extra = EXTRA_COLUMN.get(mechanism)
    if extra is None:
        return
    reserved = {extra, COUNT_COLUMN} if mechanism in ("anatomy", "fprivacy") else {extra}
    for attribute in table.schema.attributes:
        if attribute.name in (reserved if attribute.sensitive else {extra}):
            raise PublicationError(
                f"column {attribute.name!r}: --mechanism {mechanism} publishes a column of that "
                "name itself; rename it in the input"
            )


def _publish_sdr(settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey) -> Batch:
    mechanism = SmallDomainRandomization(settings["rho1"], settings["rho2"], settings["delta"])
    release = mechanism.publish(table, ids, key)
    published, partition = release.published, release.partition
    attribute = table.schema[release.sensitive]
    present = partition.counts > 0
    protected = [attribute.domain[v] for v in np.flatnonzero(partition.protected)]
    unprotected = [attribute.domain[v] for v in np.flatnonzero(present & ~partition.protected)]
    log(
        f"  protected values (relative frequency ≤ ρ1 = {settings['rho1']}): "
        f"{len(protected)} of {int(present.sum())}"
    )
    if unprotected:
        log(f"  not protected (more frequent than ρ1): {', '.join(unprotected)}")
    shown = "; ".join(f"{s.size:,}, {s.m}, {float(s.gamma):.3g}" for s in release.subtables)
    log(f"  {len(release.subtables)} sub-tables (rows, m_i, γ_i): {shown}")
    log(
        f"  error bound at confidence {1 - settings['delta']:g}: {partition.error_bound:.4f} "
        f"(unpartitioned: {partition.unpartitioned_error:.4f})"
    )
    names = published.schema.names
    return Batch(
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
) -> Batch:
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
        raise PublicationError(f"--fake-values {sigma}: {err}") from None
    published = release.published
    attribute = published.sensitive
    if release.suppressed:
        listed = ", ".join(f"{v}: {c:,}" for v, c in sorted(release.suppressed.items()))
        log(f"  suppressed (above the share buckets ≤ --max-size allow): {listed}")
    if len(release.trimmed_lines):
        lines = ", ".join(str(x) for x in release.trimmed_lines[:SHOWN])
        log(f"  trimmed {len(release.trimmed_lines)} rows no bucket setting could take ({lines})")
    log(
        f"  {published.buckets:,} buckets {release.setting}, loss {release.loss:,} "
        f"(MSE {release.mse:.3f})" + (f", {sigma} fake values each" if sigma else "")
    )
    unprotected = [label for label, f in release.thresholds.items() if f == 1]
    alone = int((published.sizes == 1).sum())
    if unprotected:
        log(f"  f′ = 1 (not protected) for {', '.join(unprotected)}")
    if alone:
        log(f"  {alone:,} rows sit alone in a bucket (f′ = 1 values): --min-size 2 hides them")
    public = list(published.public)
    return Batch(
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
) -> Batch:
    ell = settings["gamma"]
    try:
        release = Anatomy(ell).publish(table, ids, key)
    except ValueError as err:
        if isinstance(err, SchemaError):
            raise
        raise PublicationError(f"--gamma {ell} (Anatomy's ℓ): {err}") from None
    attribute = table.schema[release.sensitive]
    larger = int((np.bincount(release.qit_group) > ell).sum())
    log(f"  {release.groups:,} groups of ℓ={ell} distinct values ({larger:,} took a residue row)")
    public = table.schema.public
    return Batch(
        header=[*(a.name for a in public), EXTRA_COLUMN["anatomy"]],
        columns=[*(_labels(a, release.qit[a.name]) for a in public), release.qit_group],
        st_header=[EXTRA_COLUMN["anatomy"], release.sensitive, COUNT_COLUMN],
        st_columns=[release.st_group, _labels(attribute, release.st_value), release.st_count],
        params={"groups": release.groups},
        details={"ell": ell, "groups": release.groups},
    )


def _publish_dbr(settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey) -> Batch:
    published = DistributionBasedRandomization().publish(table, ids, key)
    log("  every sensitive value redrawn from its column's distribution, whatever the row held")
    names = published.schema.names
    return Batch(header=names, columns=[published.labels(n) for n in names])


def _publish_global(
    settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey
) -> Batch:
    name = only_sensitive(table, "--mechanism global")
    gamma, m = settings["gamma"], table.schema[name].size
    if m <= gamma:
        raise PublicationError(
            f"--gamma {gamma}: global randomization keeps a value with probability 1/γ, "
            f"above each other value's, only with more than γ values; {name!r} has {m}"
        )
    mechanism = GlobalRandomization(gamma, m)
    published = mechanism.publish(table, ids, key)
    log(
        f"  keep the value with p = 1/γ = {mechanism.keep:.4f}, publish each other one with "
        f"q = {mechanism.switch:.4f} (m = {m})"
    )
    names = published.schema.names
    return Batch(
        header=names,
        columns=[published.labels(n) for n in names],
        details={"gamma": gamma, "m": m, "keep": mechanism.keep, "switch": mechanism.switch},
    )


BATCH_PUBLISHERS: dict[str, Callable[..., Batch]] = {
    "sdr": _publish_sdr,
    "fprivacy": _publish_fprivacy,
    "anatomy": _publish_anatomy,
    "dbr": _publish_dbr,
    "global": _publish_global,
}


def beside(path: str, suffix: str) -> str:
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
                raise PublicationError(
                    f"cannot write {path}: directory {target.parent} does not exist"
                )
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


def write_batch(
    output: str, mechanism: str, settings: dict[str, Any], table: Table, batch: Batch
) -> list[str]:
    """OUT.csv, OUT.st.csv (anatomy, fprivacy) and OUT.params.json; nothing from the trusted
    side: no ids, no source lines, no true values, no thresholds fitted on the data."""
    text = _csv_text(batch.header, batch.columns)
    files = [(output, text)]
    digests = {"published": _digest(text)}
    if batch.st_header is not None and batch.st_columns is not None:
        st_text = _csv_text(batch.st_header, batch.st_columns)
        files.append((beside(output, ST_SUFFIX), st_text))
        digests["st"] = _digest(st_text)
    sensitive = [a.name for a in table.schema.sensitive]
    params = {
        "mechanism": mechanism,
        "published": Path(output).name,
        "rows": len(batch.columns[0]),
        "quasi": [a.name for a in table.schema.public],
        "sensitive": sensitive,
        "domain": {name: list(table.schema[name].domain) for name in sensitive},
        "options": {o: _shown(settings[o]) for o in MECHANISM_OPTIONS[mechanism]},
        **batch.params,
        # Ties the files together: `splu query` refuses a stale or foreign OUT.st.csv.
        "sha256": digests,
    }
    document = json.dumps(params, indent=2, ensure_ascii=False) + "\n"
    files.append((beside(output, PARAMS_SUFFIX), document))
    _write_files(files)
    return [path for path, _ in files]


class Answers(Protocol):
    """What answers queries: every Reconstruction, and F′-privacy's estimator."""

    def check(self, query: Query) -> None: ...

    def estimate_many(self, queries: Sequence[Query]) -> list[Estimate]: ...


def answer_queries(
    answerer: Answers | None,
    objects: Iterable[object],
    domains: Mapping[str, Collection[str]] | None,
    unanswered: str,
) -> tuple[list[dict[str, Any]], list[tuple[int, Query, Estimate]]]:
    """Query objects ({"where": {...}, "value": {...}}) answered as `/estimate` answers them:
    each with its estimate, the interval "low"/"high" where defined, the "published" count
    and the predicate's "rows", or an "error" (`unanswered` while there is no `answerer`).
    With `domains`, a sensitive value outside its domain is an error. Also (position, query,
    estimate) of each query answered, for callers that add fields of their own."""
    results: list[dict[str, Any]] = []
    valid: list[tuple[int, Query]] = []
    for i, obj in enumerate(objects):
        results.append(dict(obj) if isinstance(obj, dict) else {"query": obj})
        if answerer is None:
            results[-1]["error"] = unanswered
            continue
        try:
            query = Query.from_json(obj)
            answerer.check(query)
            if domains is not None:
                query.check_values(domains)
        except QueryError as err:
            results[-1]["error"] = str(err)
            continue
        valid.append((i, query))
    if answerer is None or not valid:
        return results, []
    estimates = answerer.estimate_many([q for _, q in valid])
    for (i, _), estimate in zip(valid, estimates, strict=True):
        results[i].update(
            estimate.answer(), published=estimate.published, rows=estimate.predicate_rows
        )
    return results, [(i, q, e) for (i, q), e in zip(valid, estimates, strict=True)]


def reconstruction_of(
    mechanism: str,
    settings: dict[str, Any],
    cells: PublishedCells,
    sensitive: Sequence[str],
    confidence: float,
    clip: bool | None,
) -> Reconstruction:
    """The estimator of a decoy or personal publication; `clip` None leaves it to the
    mechanism (decoy clips, personal does not)."""
    if mechanism == "decoy":
        return DecoyReconstruction(
            cells, settings["gamma"], sensitive, method=settings["method"],
            matrix=settings["matrix"], tolerance=settings["tolerance"],
            max_iterations=settings["max_iterations"], confidence=confidence,
            clip=clip is not False, grouping=settings["grouping"],
        )  # fmt: skip
    if len(sensitive) != 1:
        raise PublicationError("--mechanism personal takes exactly one --sensitive column")
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
        confidence=confidence, clip=bool(clip), stream=settings["stream"],
    )  # fmt: skip


def stream_reconstruction(
    config: StreamConfig, cells: PublishedCells, confidence: float = 0.95
) -> Reconstruction:
    """The reconstruction of a decoy or personal stream's publication, as its consumer
    builds it and `splu query --config` answers from the stream's published records."""
    if config.decoy is not None:
        return DecoyReconstruction(
            cells, config.decoy.gamma, config.sensitive, grouping=config.decoy.grouping,
            confidence=confidence,
        )  # fmt: skip
    settings = config.personal
    assert settings is not None
    return PersonalReconstruction(
        cells, config.sensitive[0], settings.retention, config.schema.sensitive[0].size,
        lam=settings.lam, delta=settings.delta, budget=settings.budget,
        value_map=settings.value_map, confidence=confidence, stream=True,
    )  # fmt: skip


def _read_text(path: str) -> str:
    with open_input(path) as stream:
        return stream.read()


def _rows(text: str, path: str, delimiter: str | None = None) -> RawRows:
    raw = read_rows(io.StringIO(text, newline=""), delimiter)
    if raw.rejections:
        raise PublicationError(f"{path}: {raw.rejections[0]} (is it a published file?)")
    return raw


def published_cells(text: str, path: str, delimiter: str | None = None) -> PublishedCells:
    """A published CSV's rows aggregated into cells, each column's domain the values it
    shows in order of appearance (as `PublishedCells.from_rows`); split by Arrow where it
    splits as the csv module does (`read_columns`), so a malformed line is refused alike.
    Without a `delimiter`, the header line's is sniffed."""
    columns = read_columns(text, delimiter)
    if columns is None:
        raw = _rows(text, path, delimiter)
        return PublishedCells.from_rows(raw.header, raw.rows)
    if columns.rejections:
        raise PublicationError(f"{path}: {columns.rejections[0]} (is it a published file?)")
    if len(set(columns.header)) != len(columns.header):
        raise PublicationError(f"{path}: a column name appears twice in the header")
    domains = dict(zip(columns.header, columns.values, strict=True))
    return PublishedCells.from_codes(columns.header, domains, columns.indices)


def _integers(values: Sequence[str], path: str, column: str) -> np.ndarray:
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        try:
            out[i] = int(value)
        except ValueError:
            raise PublicationError(
                f"{path}: {column!r} holds {value!r}, not a whole number"
            ) from None
    return out


def _encoded(values: Sequence[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """A column of labels as (its sorted distinct labels, codes into them)."""
    domain = tuple(sorted(set(values)))
    index = {v: i for i, v in enumerate(domain)}
    return domain, np.fromiter((index[v] for v in values), np.int64, len(values))


def _load_buckets(
    mechanism: str, params: dict[str, Any], qit: RawRows, st: RawRows, paths: tuple[str, str]
) -> Answers:
    """Anatomy's or F′-privacy's QIT (OUT.csv) and ST (OUT.st.csv) as its estimator."""
    extra, name = EXTRA_COLUMN[mechanism], params["sensitive"][0]
    quasi, domain = list(params["quasi"]), list(params["domain"][name])
    for path, raw, header in (
        (paths[0], qit, [*quasi, extra]),
        (paths[1], st, [extra, name, COUNT_COLUMN]),
    ):
        if raw.header != header:
            raise PublicationError(f"{path}: expected the columns {', '.join(header)}")
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
        raise PublicationError(f"{paths[1]}: {unknown[0]!r} is not in the domain of {name!r}")
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


def load_batch(
    mechanism: str,
    published: str,
    named: Sequence[str],
    given: Mapping[str, Any],
    settings: dict[str, Any],
    confidence: float,
    clip: bool | None,
) -> tuple[Answers, int, dict[str, frozenset[str]]]:
    """The estimator of a batch-only publication from OUT.csv (`published`) and the files
    beside it, checked against each other (checksums) and against the options given (which
    must agree): `named` the sensitive columns named, if any, `given` the options by name as
    given (None where not), `settings` the same checked and completed with the defaults."""
    if published == "-":
        raise PublicationError(
            f"--published -: --mechanism {mechanism} reads OUT.{PARAMS_SUFFIX} beside OUT.csv, "
            "so give the file name"
        )
    params_path = beside(published, PARAMS_SUFFIX)
    if not Path(params_path).exists():
        raise PublicationError(
            f"cannot read {params_path}: `splu publish --mechanism {mechanism}` writes it beside "
            f"{published}; query the files it wrote together"
        )
    try:
        params = json.loads(_read_text(params_path))
    except json.JSONDecodeError as err:
        raise PublicationError(f"{params_path}: not valid JSON ({err.msg})") from None
    try:
        if params["mechanism"] != mechanism:
            raise PublicationError(
                f"{published} was published with --mechanism {params['mechanism']}, "
                f"not {mechanism} (says {params_path})"
            )
        text = _read_text(published)
        if _digest(text) != params["sha256"]["published"]:
            raise PublicationError(
                f"{params_path} belongs to another publication than {published} (checksums "
                "differ): query the files one `splu publish` wrote together"
            )
        sensitive = list(params["sensitive"])
        if named and list(named) != sensitive:
            raise PublicationError(
                f"--sensitive {','.join(named)}: {published} protects {', '.join(sensitive)}"
            )
        for option, recorded in params["options"].items():
            if given.get(option) is not None and _shown(settings[option]) != recorded:
                raise PublicationError(
                    f"{flag_of(option)} {given[option]} does not match the publication's "
                    f"{recorded} (from {params_path})"
                )
        domains = {name: frozenset(params["domain"][name]) for name in sensitive}
        if mechanism in ("anatomy", "fprivacy"):
            raw = _rows(text, published)
            st_path = beside(published, ST_SUFFIX)
            st_text = _read_text(st_path)
            if _digest(st_text) != params["sha256"]["st"]:
                raise PublicationError(
                    f"{st_path} belongs to another publication than {published} "
                    "(checksums differ): query the files one `splu publish` wrote together"
                )
            paths = (published, st_path)
            answers = _load_buckets(mechanism, params, raw, _rows(st_text, st_path), paths)
            return answers, len(raw.rows), domains
        extra = [EXTRA_COLUMN[mechanism]] if mechanism in EXTRA_COLUMN else []
        header = [*params["quasi"], *sensitive, *extra]
        cells = published_cells(text, published)
        if cells.columns != header:
            raise PublicationError(f"{published}: expected the columns {', '.join(header)}")
        if mechanism == "dbr":
            return DBRReconstruction(cells, sensitive, confidence), cells.total, domains
        name, domain = sensitive[0], list(params["domain"][sensitive[0]])
        if mechanism == "global":
            gamma = int(params["options"]["gamma"])
            reconstruction: Reconstruction = GlobalRandomizationReconstruction(
                cells, name, gamma, len(domain), confidence, bool(clip)
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
            cells, name, subtables, domain, SUBTABLE_COLUMN, confidence, bool(clip)
        )
        return reconstruction, cells.total, domains
    except (KeyError, TypeError, IndexError) as err:
        raise PublicationError(
            f"{params_path}: not the parameters `splu publish` writes (at {err!r})"
        ) from None
