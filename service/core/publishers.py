"""The batch publishers: each mechanism run on a whole table (`splu publish`, and a
windowed stream on each window), with its account on stderr and its figures for --report.

`publish_decoy` and `publish_personal` return the published table; the batch-only
mechanisms a `Batch`, whose files `service.core.batch_files.write_batch` writes. The
registry (`service.core.mechanisms.registry`) names each mechanism's publisher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.core.mechanisms.anatomy import Anatomy
from service.core.mechanisms.dbr import DistributionBasedRandomization
from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.fprivacy import FPrivacyBucketization
from service.core.mechanisms.global_randomization import GlobalRandomization
from service.core.mechanisms.personal import GroupAudit, PersonalGroups
from service.core.mechanisms.sdr import SUBTABLE_COLUMN, SmallDomainRandomization
from service.core.merge import ValueMap, fit_value_map
from service.core.prf import ServiceKey
from service.core.publication import SHOWN, PublicationError, log
from service.core.schema import Attribute, SchemaError
from service.core.table import Table

# The public column a bucketing mechanism adds to its QIT (OUT.csv) and its ST: Anatomy's
# QI-group and F′-privacy's bucket id (the BID of the QIT); SDR adds SUBTABLE_COLUMN.
GROUP_COLUMN = "group"
BUCKET_COLUMN = "bucket"
COUNT_COLUMN = "count"


def only_sensitive(table: Table, command: str) -> str:
    """The table's one sensitive column; `command` is what needs exactly one."""
    if len(table.schema.sensitive) != 1:
        raise PublicationError(f"{command} takes exactly one --sensitive column")
    return table.schema.sensitive[0].name


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


def publish_sdr(settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey) -> Batch:
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


def publish_fprivacy(
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
        header=[*(a.name for a in public), BUCKET_COLUMN],
        columns=[*(_labels(a, published.qit[a.name]) for a in public), published.bucket],
        st_header=[BUCKET_COLUMN, attribute.name, COUNT_COLUMN],
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


def publish_anatomy(
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
        header=[*(a.name for a in public), GROUP_COLUMN],
        columns=[*(_labels(a, release.qit[a.name]) for a in public), release.qit_group],
        st_header=[GROUP_COLUMN, release.sensitive, COUNT_COLUMN],
        st_columns=[release.st_group, _labels(attribute, release.st_value), release.st_count],
        params={"groups": release.groups},
        details={"ell": ell, "groups": release.groups},
    )


def publish_dbr(settings: dict[str, Any], table: Table, ids: np.ndarray, key: ServiceKey) -> Batch:
    published = DistributionBasedRandomization().publish(table, ids, key)
    log("  every sensitive value redrawn from its column's distribution, whatever the row held")
    names = published.schema.names
    return Batch(header=names, columns=[published.labels(n) for n in names])


def publish_global(
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
