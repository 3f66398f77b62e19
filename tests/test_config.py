"""Stream settings that would expose groups, stall a partition or lose records are refused.

Each unsafe combination fails at load time with a `ConfigError` naming the setting, and
the closest safe value loads: the checks refuse what is unsafe and nothing more.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from service.core.config import MIN_MIXING_GROUPS, ConfigError, StreamConfig, parse_config

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"


def load(name: str, stream: dict[str, object], reports: dict[str, object]) -> StreamConfig:
    document = tomllib.loads((EXAMPLES / name).read_text())
    document["stream"].update(stream)
    document.setdefault("reports", {}).update(reports)
    return parse_config(document, name, EXAMPLES)


GAMMA = 5  # adult-decoy.toml's γ
UNSAFE = [
    # (example, unsafe [stream], unsafe [reports], the message, the nearest safe change)
    ("adult-decoy.toml", {"mixing_pool": 0}, {}, "stream.mixing_pool must be at least",
     ({"mixing_pool": MIN_MIXING_GROUPS * GAMMA, "buffer_cap": 100}, {})),
    ("adult-decoy.toml", {"mixing_pool": MIN_MIXING_GROUPS * GAMMA - 1}, {},
     f"{MIN_MIXING_GROUPS} groups of γ = {GAMMA}",
     ({"mixing_pool": MIN_MIXING_GROUPS * GAMMA}, {})),
    ("adult-personal.toml", {"mixing_pool": MIN_MIXING_GROUPS - 1}, {},
     f"stream.mixing_pool must be at least {MIN_MIXING_GROUPS}",
     ({"mixing_pool": MIN_MIXING_GROUPS}, {})),
    ("adult-decoy.toml", {"dedup_window": 600.0}, {},
     "stream.dedup_window is not a known setting", ({}, {})),
    ("adult-decoy.toml", {"mixing_pool": 1000, "buffer_cap": 1999}, {},
     r"stream.buffer_cap \(1999\) must be at least twice stream.mixing_pool",
     ({"mixing_pool": 1000, "buffer_cap": 2000}, {})),
    ("adult-decoy.toml", {"record_ttl": 59.0}, {},
     r"stream.record_ttl \(59 s\) must be at least 60 s",
     ({"record_ttl": 60.0}, {})),
    ("adult-decoy.toml", {"max_wait": 100.0, "record_ttl": 199.0}, {},
     r"twice stream.max_wait \(100 s\)",
     ({"max_wait": 100.0, "record_ttl": 200.0}, {})),
    ("adult-decoy.toml", {"report_interval": 30.0}, {"truth_retention": 59.0},
     r"reports.truth_retention \(59 s\) must be at least twice stream.report_interval",
     ({"report_interval": 30.0}, {"truth_retention": 60.0})),
]  # fmt: skip


@pytest.mark.parametrize(("example", "stream", "reports", "message", "safe"), UNSAFE)
def test_unsafe_stream_settings_are_refused_naming_the_setting(
    example, stream, reports, message, safe
):
    with pytest.raises(ConfigError, match=message):
        load(example, stream, reports)
    config = load(example, *safe)
    assert config.mixing_pool >= MIN_MIXING_GROUPS


def test_defaults_are_safe():
    for example in ("adult-decoy.toml", "adult-personal.toml", "adult-windowed.toml"):
        config = load(example, {}, {})
        assert config.buffer_cap >= 2 * config.mixing_pool
        assert config.reports.truth_retention >= 2 * config.report_interval


def test_redis_cluster_and_replica_acks_from_the_file_and_the_environment(monkeypatch):
    """`[redis] cluster` and `replica_acks` load; REDIS_CLUSTER overrides the first, and a
    word that is no yes or no is refused naming the variable."""
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    monkeypatch.delenv("REDIS_CLUSTER", raising=False)
    assert not parse_config(document, "a.toml", EXAMPLES).redis_cluster
    document["redis"].update(cluster=True, replica_acks=1)
    config = parse_config(document, "a.toml", EXAMPLES)
    assert config.redis_cluster and config.redis_replica_acks == 1
    monkeypatch.setenv("REDIS_CLUSTER", "0")
    assert not parse_config(document, "a.toml", EXAMPLES).redis_cluster
    monkeypatch.setenv("REDIS_CLUSTER", "maybe")
    with pytest.raises(ConfigError, match="REDIS_CLUSTER must be 1 or 0"):
        parse_config(document, "a.toml", EXAMPLES)
    monkeypatch.delenv("REDIS_CLUSTER")
    for key, value, message in [
        ("cluster", "yes", "redis.cluster must be true or false"),
        ("replica_acks", -1, "redis.replica_acks must be at least 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(
                {**document, "redis": {**document["redis"], key: value}}, "a.toml", EXAMPLES
            )


def test_personal_budget_defaults_to_bounded_and_keeps_the_others():
    document = tomllib.loads((EXAMPLES / "adult-personal.toml").read_text())
    del document["personal"]["budget"]
    assert parse_config(document, "x.toml", EXAMPLES).personal.budget == "bounded"
    for budget in ("bounded", "adaptive", "conservative", "none"):
        document["personal"]["budget"] = budget
        assert parse_config(document, "x.toml", EXAMPLES).personal.budget == budget
    document["personal"]["budget"] = "safe"
    with pytest.raises(ConfigError, match=r"personal\.budget.*bounded, adaptive, conservative"):
        parse_config(document, "x.toml", EXAMPLES)
