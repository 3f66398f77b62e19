"""A stream mechanism's table of the stream configuration: [decoy], [personal], or
[windowed] (a batch mechanism run on each window, its options those of the registry,
`service.core.mechanisms.registry`). `SETTINGS_READERS` reads the table of a stream's kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from service.core.config_tables import ConfigError, TableReader, table_of
from service.core.guarantees import check_reconstruction_parameters, trial_limit
from service.core.mechanisms.personal import STREAM_BUDGETS
from service.core.mechanisms.registry import BATCH_ONLY, MECHANISMS, checked_settings
from service.core.merge import ValueMap
from service.core.publication import PublicationError, configured
from service.core.publishers import COUNT_COLUMN
from service.core.schema import Schema, SchemaError

# A stream runs a stream mechanism, or a batch-only one on each of its windows
# (`service/store/windowed.py`).
WINDOWED = "windowed"


@dataclass(frozen=True)
class DecoySettings:
    """[decoy]: decoy groups (SPEC §2.1)."""

    gamma: int = 5  # group size γ: each sensitive attribute needs γ values
    # The cutting rule. Anatomy's is a batch comparison (`splu publish --grouping
    # anatomy`); streams cut with the size-weighted rule only.
    grouping: str = "size-weighted"


@dataclass(frozen=True)
class PersonalSettings:
    """[personal]: personal groups (SPEC §2.2)."""

    retention: float = 0.5  # p: a record keeps its value with this probability
    lam: float = 0.3  # λ (the key `lambda`) and δ: the trial limit of each group
    delta: float = 0.3
    # Trials planned with an upper confidence bound on each group's final largest
    # frequency (docs/architecture.md); "conservative" plans with frequency 1, safe under
    # any drift but less accurate; "adaptive" with the frequency so far, overrun when it
    # drifts; "none": plain perturbation.
    budget: str = "bounded"
    release_size: int = 100  # records a group releases at once (or after max_wait)
    # merge_map (optional, relative to the config; `splu merge` fits one): public values
    # merged into larger groups, so each group allows more trials. Without it every public
    # combination is a group of its own: safe, but small groups publish more copies and
    # fewer trials.
    value_map: ValueMap = field(kw_only=True)


@dataclass(frozen=True)
class WindowedSettings:
    """A batch mechanism run on windows of the stream (`service/store/windowed.py`).

    `options` holds the mechanism's options under the names of `splu publish`
    (`service.core.mechanisms.registry`), checked, with its defaults filled in; ρ, θ and
    β as exact Fractions.
    """

    mechanism: str  # sdr, fprivacy, anatomy, dbr or global
    window: int = 1000  # records per window, per partition
    max_window_wait: float = 60.0  # seconds after which a partial window closes
    # A partial window with fewer records is suppressed (left out: a tenth of window).
    min_window: int = 0
    # Then the mechanism's options, named and defaulted as the `splu publish` flags
    # (gamma; rho1, rho2, delta; theta, beta, max_size, min_size, bucket_method,
    # fake_values). Exact numbers may be written as ratios: rho1 = "1/13".
    options: Mapping[str, Any] = field(default_factory=dict)


def _decoy_settings(
    source: str, name: str, document: Mapping[str, Any], schema: Schema, base: Path
) -> DecoySettings:
    table = table_of(source, document, name, required=False) or TableReader(source, {}, name)
    gamma = table.integer("gamma", DecoySettings.gamma, minimum=2)
    grouping = table.text("grouping", DecoySettings.grouping, choices=(DecoySettings.grouping,))
    table.finish()
    for attribute in schema.sensitive:
        if attribute.size < gamma:
            raise ConfigError(
                f"{source}: decoy.gamma = {gamma} needs {gamma} values of each sensitive "
                f"attribute; {attribute.name!r} has {attribute.size}"
            )
    return DecoySettings(gamma, grouping)


def _windowed_settings(
    source: str, name: str, document: Mapping[str, Any], schema: Schema, base: Path
) -> WindowedSettings:
    table = table_of(source, document, name, required=True)
    assert table is not None
    mechanism = table.text("mechanism", choices=BATCH_ONLY)
    spec = MECHANISMS[mechanism]
    window = table.integer("window", WindowedSettings.window)
    max_window_wait = table.number("max_window_wait", WindowedSettings.max_window_wait)
    min_window = table.integer("min_window", -(-window // 10))
    if min_window > window:
        raise table.fail(
            "min_window", f"must be at most windowed.window = {window}, got {min_window}"
        )
    for option in dict.fromkeys(o for other in BATCH_ONLY for o in MECHANISMS[other].options):
        if option not in spec.options and option in table.table:
            owners = [m for m in BATCH_ONLY if option in MECHANISMS[m].options]
            raise table.fail(option, f"applies to mechanism {' or '.join(owners)}, not {mechanism}")
    options: dict[str, Any] = {}
    for option, default in spec.defaults.items():
        # Exact numbers may be written as ratios ("1/13"); the registry reads them.
        if isinstance(default, bool | Fraction):
            options[option] = table.get(option, default)
        elif isinstance(default, int):
            options[option] = table.integer(option, default, minimum=0)
        elif isinstance(default, float):
            options[option] = table.number(option, default)
        else:
            options[option] = table.text(option, default)
    table.finish()
    try:
        options = checked_settings(mechanism, options)
    except PublicationError as err:
        raise ConfigError(f"{source}: {configured(str(err), name)}") from None
    if spec.sensitive_columns is not None and len(schema.sensitive) != spec.sensitive_columns:
        raise ConfigError(
            f"{source}: windowed.mechanism = {mechanism!r} protects exactly one sensitive "
            f"attribute; the schema has {len(schema.sensitive)}"
        )
    if spec.check_domain is not None:
        problem = spec.check_domain(options, schema.sensitive[0])
        if problem is not None:
            raise ConfigError(f"{source}: {configured(problem, name)}")
    # Names the published messages use themselves (`service/store/windowed.py`).
    reserved = set()
    if spec.extra_column is not None:
        reserved = {spec.extra_column, "kind"}
        if spec.bucketed:
            reserved.add(COUNT_COLUMN)
    for attribute in schema.attributes:
        if attribute.name in reserved:
            raise ConfigError(
                f"{source}: schema attribute {attribute.name!r}: windowed.mechanism = "
                f"{mechanism!r} publishes a field of that name itself; rename the attribute"
            )
    return WindowedSettings(mechanism, window, max_window_wait, min_window, options)


def _personal_settings(
    source: str, name: str, document: Mapping[str, Any], schema: Schema, base: Path
) -> PersonalSettings:
    table = table_of(source, document, name, required=True)
    assert table is not None
    if len(schema.sensitive) != 1:
        raise ConfigError(
            f"{source}: schema.sensitive: personal groups protect exactly one sensitive "
            f"attribute, got {len(schema.sensitive)}"
        )
    attribute = schema.sensitive[0]
    retention = table.number("retention", PersonalSettings.retention)
    lam = table.number("lambda", PersonalSettings.lam)
    delta = table.number("delta", PersonalSettings.delta)
    budget = table.text("budget", PersonalSettings.budget, choices=STREAM_BUDGETS)
    release_size = table.integer("release_size", PersonalSettings.release_size)
    map_name = table.text("merge_map") if table.get("merge_map") is not None else None
    table.finish()
    if attribute.size < 2:
        raise ConfigError(
            f"{source}: schema.sensitive.{attribute.name} needs at least 2 values for "
            f"personal groups, got {attribute.size}"
        )
    try:
        check_reconstruction_parameters(retention, attribute.size, lam, delta)
    except ValueError as err:
        raise ConfigError(f"{source}: personal (retention, lambda, delta): {err}") from None
    smallest = float(trial_limit(1.0, retention, attribute.size, lam, delta))
    if budget != "none" and smallest < 1:
        # A group's copies repeat its trials: it needs at least one.
        raise ConfigError(
            f"{source}: personal.lambda: a group may hold {smallest:.2f} trials, fewer than "
            f"one: lower retention or lambda, or raise delta"
        )
    if map_name is None:
        value_map = ValueMap.identity(attribute)
        return PersonalSettings(retention, lam, delta, budget, release_size, value_map=value_map)
    try:
        value_map = ValueMap.load(base / map_name)
    except SchemaError as err:
        raise ConfigError(f"{source}: personal.merge_map: {err}") from None
    if value_map.sensitive != attribute.name:
        raise ConfigError(
            f"{source}: personal.merge_map was fitted for {value_map.sensitive!r}, "
            f"not {attribute.name!r}"
        )
    return PersonalSettings(retention, lam, delta, budget, release_size, value_map=value_map)


# Each kind of stream reads its settings from the table of its name.
SETTINGS_READERS = {
    "decoy": _decoy_settings,
    "personal": _personal_settings,
    WINDOWED: _windowed_settings,
}
