"""The mechanism registry: one `MechanismSpec` per mechanism, in `MECHANISMS`.

A spec holds everything the rest of the service asks about a mechanism: its options and
their defaults (named as `splu publish`'s flags, `service.core.publication.flag_of`), how
they are checked, its batch publisher (`service.core.publishers`), its reconstruction from
what was published (`Evidence`), the Lua steps a stream of it runs
(`service/store/lua/`), the consumer's privacy tests that apply to it, and what a stream's
manifest carries of it. The command line's choices, the stream configuration
(`service.core.config`), the file formats (`service.core.batch_files`) and the consumer
read them here, so no other module compares mechanism names.

Kinds: `stream` mechanisms (decoy, personal) run as a stream of their own and in batch;
`batch_only` ones (sdr, fprivacy, anatomy, dbr, global) write OUT.params.json beside
OUT.csv and run on windows of a stream (`stream.mechanism = "windowed"`); laplace
publishes nothing and answers queries from the raw data on the trusted side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from service.core.mechanisms.anatomy import AnatomyReconstruction, AnatomyRelease
from service.core.mechanisms.dbr import DBRReconstruction
from service.core.mechanisms.decoy_reconstruction import MATRICES, METHODS, DecoyReconstruction
from service.core.mechanisms.fprivacy import METHODS as BUCKET_METHODS
from service.core.mechanisms.fprivacy import BucketPublication, FPrivacyReconstruction
from service.core.mechanisms.global_randomization import GlobalRandomizationReconstruction
from service.core.mechanisms.personal_reconstruction import PersonalReconstruction
from service.core.mechanisms.sdr import SUBTABLE_COLUMN, SDRReconstruction, SubTable
from service.core.publication import PublicationError, exact_number, flag_of
from service.core.publishers import (
    BUCKET_COLUMN,
    GROUP_COLUMN,
    publish_anatomy,
    publish_dbr,
    publish_decoy,
    publish_fprivacy,
    publish_global,
    publish_personal,
    publish_sdr,
)
from service.core.reconstruct import Answers, PublishedCells, Reconstruction
from service.core.schema import Attribute, Schema

# Every test the consumer may run on a stream's publication (`service.core.privacy_tests`).
TESTS = ("eligibility", "guarantees", "budget", "adversary", "dp_audit")


@dataclass(frozen=True)
class Buckets:
    """A bucketing mechanism's publication (Anatomy, F′-privacy): the QIT's public codes and
    unit of each row, and the ST, one entry per unit and sensitive value with its count."""

    public: tuple[Attribute, ...]
    sensitive: Attribute
    qit: Mapping[str, np.ndarray]
    unit: np.ndarray
    st_unit: np.ndarray
    st_value: np.ndarray
    st_count: np.ndarray


@dataclass(frozen=True)
class Evidence:
    """What a reconstruction reads: the mechanism's options (checked, defaults filled in),
    the sensitive columns and, where known, their whole domains, and what was published:
    cells (every mechanism but the bucketing ones), SDR's sub-tables, or buckets.
    `clip` None leaves clipping to the mechanism (`MechanismSpec.clips`)."""

    options: Mapping[str, Any]
    sensitive: Sequence[str]
    cells: PublishedCells | None = None
    domains: Mapping[str, Sequence[str]] = field(default_factory=dict)
    confidence: float = 0.95
    clip: bool | None = None
    subtables: Sequence[SubTable] = ()
    buckets: Buckets | None = None

    def domain(self, name: str) -> Sequence[str]:
        """A sensitive column's domain: the whole one where known, else the values published."""
        if name in self.domains:
            return self.domains[name]
        assert self.cells is not None
        return self.cells.domains[name]


@dataclass(frozen=True)
class MechanismSpec:
    """One mechanism, as the rest of the service sees it (see the module docstring)."""

    name: str
    summary: str  # one line for --help
    options: tuple[str, ...]
    defaults: Mapping[str, Any]
    # (settings, table, ids, key) → a published table and its figures (stream kinds), or
    # a `Batch` (batch-only kinds); None: publishes nothing.
    publish: Callable[..., Any] | None
    reconstruct: Callable[[Evidence], Answers] | None
    check: Callable[[dict[str, Any]], None] | None = None
    # What its options need of the sensitive attribute's domain: the problem, or None.
    check_domain: Callable[[Mapping[str, Any], Attribute], str | None] | None = None
    stream: bool = False
    batch_only: bool = False
    clippable: bool = False
    clips: bool = False  # clipping when a query leaves it to the mechanism
    sensitive_columns: int | None = 1  # how many it protects; None: any number
    # The public column it adds to OUT.csv (and to its ST when bucketed).
    extra_column: str | None = None
    bucketed: bool = False  # publishes a QIT (OUT.csv) and an ST (OUT.st.csv)
    # A stream: the Lua steps that follow `ingest` (service/store/lua/<step>.lua), whether
    # it repartitions its raw records by group (the internal grouped topic), the option that
    # sizes its groups (the mixing floor holds 10 of them), the options its manifest
    # carries, those its publication implies, and the consumer's tests: those that fail
    # closed by default and those it never runs.
    stream_scripts: tuple[str, ...] = ()
    grouped_topic: bool = False
    group_size: str | None = None
    manifest: tuple[str, ...] = ()
    stream_options: Mapping[str, Any] = field(default_factory=dict)
    fail_closed: tuple[str, ...] = ()
    never_runs: tuple[str, ...] = ()
    # On windows of a stream: the consumer's tests of it (`service.core.privacy_tests`),
    # why the guarantees test says nothing of it, and how its estimates are made.
    window_tests: tuple[str, ...] = ()
    unchecked_guarantee: str | None = None
    estimates: str = ""
    guarantee: str = ""  # its guarantee in words (`splu plan`)
    # `splu plan` of a stream mechanism: the option a plan varies, whether more of it is
    # more private, whether a planned setting keeps the guarantee (its figures), how a
    # setting is named, and which one is recommended within the error bound: the most
    # private, or the most accurate (`recommend_rule` says which in words).
    knob: str | None = None
    private_upward: bool = True
    keeps_guarantee: Callable[[Mapping[str, Any]], bool] = lambda _: True
    label: str = ""
    recommends_most_private: bool = False
    recommend_rule: str = ""
    # What a drafted config says of it, formatted with the setting's parameters and figures.
    draft_explanation: tuple[str, ...] = ()

    def flags(self) -> str:
        return ", ".join(flag_of(o) for o in self.options)


def checked_settings(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Check a mechanism's options, so each error names its flag; exact numbers (ρ, θ, β)
    become Fractions."""
    out = dict(settings)
    if "gamma" in out and out["gamma"] < 2:
        raise PublicationError(f"--gamma must be at least 2, got {out['gamma']}")
    check = MECHANISMS[name].check
    if check is not None:
        check(out)
    return out


def _check_decoy(out: dict[str, Any]) -> None:
    if out.get("method") == "iterative" and out.get("matrix") == "mixing":
        raise PublicationError(
            "--method iterative is the papers' method on their 2×2 model: give --matrix "
            "corrected or --matrix paper with it"
        )


def _check_sdr(out: dict[str, Any]) -> None:
    for option in ("rho1", "rho2"):
        out[option] = exact_number(out[option], flag_of(option))
        if not 0 < out[option] < 1:
            raise PublicationError(f"{flag_of(option)} must lie in (0, 1), got {out[option]}")
    if not out["rho1"] < out["rho2"]:
        raise PublicationError(
            f"--rho1 ({out['rho1']}) must be below --rho2 ({out['rho2']}): the posterior "
            "bound must exceed the prior it protects"
        )
    if not 0 < out["delta"] < 1:
        raise PublicationError(f"--delta must lie in (0, 1), got {out['delta']}")


def _check_fprivacy(out: dict[str, Any]) -> None:
    out["theta"] = exact_number(out["theta"], "--theta")
    out["beta"] = exact_number(out["beta"], "--beta")
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
    if out["bucket_method"] not in BUCKET_METHODS:
        choices = ", ".join(BUCKET_METHODS)
        raise PublicationError(
            f"--bucket-method must be one of {choices}, got {out['bucket_method']!r}"
        )
    if out["fake_values"] < 0:
        raise PublicationError(f"--fake-values must be 0 or more, got {out['fake_values']}")


def _check_anatomy_domain(options: Mapping[str, Any], attribute: Attribute) -> str | None:
    gamma = options["gamma"]
    if attribute.size >= gamma:
        return None
    return (
        f"--gamma = {gamma} needs {gamma} values of {attribute.name!r}, which has {attribute.size}"
    )


def _check_global_domain(options: Mapping[str, Any], attribute: Attribute) -> str | None:
    gamma = options["gamma"]
    if attribute.size > gamma:
        return None
    return (
        f"--gamma = {gamma}: global randomization needs more than γ values of "
        f"{attribute.name!r}, which has {attribute.size}"
    )


def _check_laplace(out: dict[str, Any]) -> None:
    epsilon = out["epsilon"]
    if epsilon is None:
        raise PublicationError("--mechanism laplace needs its privacy budget: give --epsilon E")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise PublicationError(f"--epsilon must be a positive number, got {epsilon}")


def _sps_keeps_every_group(guarantees: Mapping[str, Any]) -> bool:
    """Whether SPS leaves no personal group over its trial limit (v_g = 0)."""
    return guarantees["sps"]["v_g"] == 0


def _clip(spec_name: str, evidence: Evidence) -> bool:
    return MECHANISMS[spec_name].clips if evidence.clip is None else evidence.clip


def _decoy(evidence: Evidence) -> Reconstruction:
    o, cells = evidence.options, evidence.cells
    assert cells is not None
    return DecoyReconstruction(
        cells, o["gamma"], evidence.sensitive, method=o["method"], matrix=o["matrix"],
        tolerance=o["tolerance"], max_iterations=o["max_iterations"],
        confidence=evidence.confidence, clip=_clip("decoy", evidence), grouping=o["grouping"],
    )  # fmt: skip


def _personal(evidence: Evidence) -> Reconstruction:
    o, cells = evidence.options, evidence.cells
    assert cells is not None
    if len(evidence.sensitive) != 1:
        raise PublicationError("--mechanism personal takes exactly one --sensitive column")
    name, value_map = evidence.sensitive[0], o.get("value_map")
    if value_map is not None:
        domain_size = len(value_map.sensitive_domain)
    elif name in evidence.domains or name in cells.columns:
        # Without the map, m is the number of values published; with p < 1 every value
        # appears after a few hundred rows, but give --merge-map to be exact.
        domain_size = len(evidence.domain(name))
    else:
        domain_size = 2
    return PersonalReconstruction(
        cells, name, o["retention"], domain_size, lam=o["lam"], delta=o["delta"],
        budget=o["budget"], value_map=value_map, confidence=evidence.confidence,
        clip=_clip("personal", evidence), stream=o["stream"],
    )  # fmt: skip


def _sdr(evidence: Evidence) -> Reconstruction:
    assert evidence.cells is not None
    name = evidence.sensitive[0]
    return SDRReconstruction(
        evidence.cells, name, evidence.subtables, evidence.domain(name),
        SUBTABLE_COLUMN, evidence.confidence, _clip("sdr", evidence),
    )  # fmt: skip


def _global(evidence: Evidence) -> Reconstruction:
    assert evidence.cells is not None
    name = evidence.sensitive[0]
    return GlobalRandomizationReconstruction(
        evidence.cells, name, int(evidence.options["gamma"]), len(evidence.domain(name)),
        evidence.confidence, _clip("global", evidence),
    )  # fmt: skip


def _dbr(evidence: Evidence) -> Reconstruction:
    assert evidence.cells is not None
    return DBRReconstruction(evidence.cells, list(evidence.sensitive), evidence.confidence)


def _anatomy(evidence: Evidence) -> Answers:
    b = evidence.buckets
    assert b is not None
    release = AnatomyRelease(
        Schema((*b.public, b.sensitive)), b.sensitive.name, int(evidence.options["gamma"]),
        b.qit, b.unit, b.st_unit, b.st_value, b.st_count,
    )  # fmt: skip
    return AnatomyReconstruction(release)


def _fprivacy(evidence: Evidence) -> Answers:
    b = evidence.buckets
    assert b is not None
    published = BucketPublication(
        b.public, b.qit, b.unit, b.sensitive, b.st_unit, b.st_value, b.st_count,
        int(evidence.options["fake_values"]),
    )  # fmt: skip
    return FPrivacyReconstruction(published)


_SPECS = (
    MechanismSpec(
        "decoy",
        "SPLU-Gen decoy groups (default)",
        ("gamma", "grouping", "method", "matrix", "tolerance", "max_iterations"),
        # The estimator's own defaults, so `splu query` answers as `/estimate` and the
        # reader do.
        {
            "gamma": 5,
            "grouping": "size-weighted",
            "method": METHODS[0],
            "matrix": MATRICES[0],
            "tolerance": 0.01,
            "max_iterations": 10_000,
        },
        publish_decoy,
        _decoy,
        check=_check_decoy,
        stream=True,
        clippable=True,
        clips=True,
        sensitive_columns=None,
        stream_scripts=("decoy",),
        group_size="gamma",
        manifest=("gamma", "grouping"),
        knob="gamma",
        label="decoy groups of γ = {gamma}",
        recommends_most_private=True,
        recommend_rule="the largest γ whose",
        draft_explanation=(
            "# Each value is replaced by one drawn from the {gamma} distinct values of a",
            "# hidden group: a count of 1..{alpha} is published off by more than "
            "{epsilon:.0%} with probability at least {T_P:.3f} (T_P).",
        ),
        fail_closed=("adversary",),
        never_runs=("budget",),
    ),
    MechanismSpec(
        "personal",
        "personal groups with reconstruction privacy, SPS",
        ("retention", "lam", "delta", "budget", "merge_map", "stream"),
        {"retention": 0.5, "lam": 0.3, "delta": 0.3, "budget": "adaptive", "stream": False},
        publish_personal,
        _personal,
        stream=True,
        clippable=True,
        # The bounded budget's share bound is personal.lua's only helper of its own.
        stream_scripts=("bound", "personal"),
        grouped_topic=True,
        manifest=("retention", "lam", "delta", "budget"),
        knob="retention",
        private_upward=False,
        keeps_guarantee=_sps_keeps_every_group,
        label="personal groups at p = {retention:g}",
        recommend_rule="among settings SPS keeps private (v_g = 0), the lowest",
        draft_explanation=(
            "# Each value is kept with probability {retention:g}, else redrawn; no group of",
            "# people sharing public values gets more draws than its (λ, δ) limit allows.",
        ),
        stream_options={"stream": True},
        fail_closed=("budget", "adversary"),
        never_runs=("eligibility", "guarantees"),
    ),
    MechanismSpec(
        "sdr",
        "small domain randomization",
        ("rho1", "rho2", "delta"),
        {"rho1": Fraction(1, 13), "rho2": Fraction(1, 6), "delta": 0.05},
        publish_sdr,
        _sdr,
        check=_check_sdr,
        batch_only=True,
        clippable=True,
        extra_column=SUBTABLE_COLUMN,
        window_tests=("posterior_bound",),
        estimates="SDR: Eq. 7 inverted in each sub-table, summed over the sub-tables of "
        "every window; normal interval",
        guarantee="restricted (ρ1, ρ2)-privacy: a value of prior share at most ρ1 has a "
        "posterior at most ρ2",
    ),
    MechanismSpec(
        "fprivacy",
        "F′-privacy bucketization",
        ("theta", "beta", "max_size", "min_size", "bucket_method", "fake_values"),
        {
            "theta": Fraction(8),
            "beta": Fraction(1, 50),
            "max_size": 50,
            "min_size": 1,
            "bucket_method": "multi",
            "fake_values": 0,
        },
        publish_fprivacy,
        _fprivacy,
        check=_check_fprivacy,
        batch_only=True,
        extra_column=BUCKET_COLUMN,
        bucketed=True,
        unchecked_guarantee="each bucket's bound f′ = min(1, θ·f + β) depends on the "
        "window's true frequencies f, which are not published; the worker bucketizes to "
        "meet them",
        estimates="F′-privacy: Σ_g |P ∩ g|·c_g(s)/|ST_g| over the buckets of every window; "
        "[low, high] the counts consistent with them",
        guarantee="F′-privacy: each value's share in a bucket stays below its threshold "
        "f′ = min{1, θ·f + β}",
    ),
    MechanismSpec(
        "anatomy",
        "Anatomy",
        ("gamma",),
        {"gamma": 5},
        publish_anatomy,
        _anatomy,
        check_domain=_check_anatomy_domain,
        batch_only=True,
        extra_column=GROUP_COLUMN,
        bucketed=True,
        window_tests=("diversity",),
        estimates="Anatomy: Σ_g |P ∩ g|·c_g(s)/|g| over the QI-groups of every window; no interval",
        guarantee="ℓ-diversity: each QI-group holds ℓ distinct values, so a value is linked "
        "to a record with probability at most 1/ℓ",
    ),
    MechanismSpec(
        "dbr",
        "distribution-based randomization",
        (),
        {},
        publish_dbr,
        _dbr,
        batch_only=True,
        sensitive_columns=None,
        unchecked_guarantee="DBR has no privacy parameter: every published value is drawn "
        "from the column's distribution, whatever the record held",
        estimates="DBR: the published count; exact interval for a value's total",
        guarantee="every value is redrawn from the column's distribution: nothing of a "
        "record's own value is published, and conjunctive counts carry no signal",
    ),
    MechanismSpec(
        "global",
        "global randomization, mechanism A",
        ("gamma",),
        {"gamma": 5},
        publish_global,
        _global,
        check_domain=_check_global_domain,
        batch_only=True,
        clippable=True,
        unchecked_guarantee="its guarantee, the keep/switch ratio, is fixed by "
        "windowed.gamma; nothing published can change it",
        estimates="global randomization: inverse-matrix MLE; normal interval",
        guarantee="a record keeps its value with probability p = 1/γ (decoy groups' "
        "retention) and publishes each other value with q; one record's change moves the "
        "likelihood by p/q = (m − 1)/(γ − 1)",
    ),
    MechanismSpec(
        "laplace",
        "answers queries from the raw data with Laplace noise (`splu query --input`, "
        "trusted side); publishes nothing",
        ("epsilon",),
        {},
        None,
        None,
        check=_check_laplace,
    ),
)
MECHANISMS: dict[str, MechanismSpec] = {spec.name: spec for spec in _SPECS}
# The kinds, in the registry's order (the first stream mechanism is every default).
STREAM_MECHANISMS = tuple(name for name, spec in MECHANISMS.items() if spec.stream)
BATCH_ONLY = tuple(name for name, spec in MECHANISMS.items() if spec.batch_only)
CLIPPABLE = tuple(name for name, spec in MECHANISMS.items() if spec.clippable)
# Every mechanism's options, each once: a command refuses those of other mechanisms.
ALL_OPTIONS = tuple(dict.fromkeys(o for spec in MECHANISMS.values() for o in spec.options))
DEFAULT_MECHANISM = STREAM_MECHANISMS[0]
