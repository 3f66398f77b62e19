"""Kafka SASL and the [kafka] security settings (issue 31; `service.core.config`,
`streams/runtime/kafka.py`).

The embedded broker (tansu 0.6) takes no SASL mechanism without `--authentication`,
and with it only SCRAM logins of users held in its storage, which memory storage
starts empty and which only a logged-in client may add. So a SASL login can only be
refused here; a successful one, and the ACLs, need a production broker (docs/security.md,
*Kafka: TLS, SASL and each role's ACLs*). What the embedded broker can show:

- every mechanism against a broker that takes none, and a SCRAM login the broker
  refuses, end in one line naming the setting to change (from `splu produce` and
  `splu worker`), quickly;
- our SCRAM client gets as far as the broker's verdict on the credentials, and aiokafka's
  DEBUG log of the exchange holds no SASL payload (a PLAIN payload is the password).

And without a broker: where the password comes from (KAFKA_PASSWORD, an owner-only
file, the variable password_env names; never the config), every KAFKA_* override, the
settings refused, and the client arguments built for each protocol, the Faust apps'
included.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import ssl
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w
from aiokafka.conn import create_conn
from aiokafka.protocol.admin import SaslAuthenticateRequest_v1
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from test_cli_errors import EXAMPLES, assert_one_line, clean_env, csv_input, run

from deploy.certificates import make_certificates
from deploy.embedded import KafkaBroker
from service.core.config import ConfigError, parse_config
from service.core.kafka_settings import KAFKA_ENV, SASL_MECHANISMS, KafkaSettings, kafka_from_env
from streams.runtime.kafka import (
    client_options,
    faust_options,
    security_options,
)

REFUSAL_SECONDS = 15.0  # a refused client fails at its first connection
PASSWORD = "correct-horse-battery-staple"


@pytest.fixture(autouse=True)
def no_kafka_variables(monkeypatch):  # type: ignore[no-untyped-def]
    for name in os.environ:
        if name.startswith("KAFKA_"):
            monkeypatch.delenv(name)


def document(**kafka: object) -> dict:
    text = (EXAMPLES / "adult-decoy.toml").read_text()
    result = tomllib.loads(text)
    result["kafka"] = {"bootstrap": "kafka:9093", **kafka}
    return result


def settings(base: Path, **kafka: object) -> KafkaSettings:
    return parse_config(document(**kafka), "stream.toml", base).kafka


SASL = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "username": "w"}


# --- against the embedded broker ---------------------------------------------------------


def write_config(directory: Path, redis_url: str, kafka: dict[str, str]) -> Path:
    path = directory / "stream.toml"
    contents = document(**kafka)
    contents["stream"]["name"] = f"sasl{time.time_ns() % 10**9}"
    contents["redis"]["url"] = redis_url
    path.write_text(tomli_w.dumps(contents))
    return path


def refused(directory: Path, redis_url: str, command: str, kafka: dict[str, str]) -> str:
    """The one line `splu command` fails with, in time."""
    arguments = [command, "--config", str(write_config(directory, redis_url, kafka))]
    if command == "produce":
        arguments += ["--input", str(csv_input(directory))]
    started = time.monotonic()
    result = run(arguments, clean_env(KAFKA_PASSWORD=PASSWORD), directory)
    elapsed = time.monotonic() - started
    line = assert_one_line(result)
    assert line.startswith(f"splu {command}: error:") and PASSWORD not in result.stderr
    assert elapsed < REFUSAL_SECONDS, (elapsed, line)
    return line


@pytest.mark.parametrize("mechanism", SASL_MECHANISMS)
def test_a_broker_without_sasl_is_one_line_naming_the_mechanism(servers, tmp_path, mechanism):
    kafka = {
        "bootstrap": servers.kafka_bootstrap, "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": mechanism, "username": "splu-producer",
    }  # fmt: skip
    line = refused(tmp_path, servers.redis_url, "produce", kafka)
    assert f"does not take SASL mechanism {mechanism}" in line
    assert "KAFKA_SASL_MECHANISM" in line and "KAFKA_SECURITY_PROTOCOL" in line


@pytest.fixture(scope="module")
def login_broker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """An embedded broker that wants a SCRAM login and knows no user."""
    broker = KafkaBroker(
        log_path=tmp_path_factory.mktemp("sasl") / "kafka.log", authentication=True
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.mark.parametrize(
    ("command", "mechanism"),
    [("produce", "SCRAM-SHA-512"), ("worker", "SCRAM-SHA-256"), ("produce", "PLAIN")],
)
def test_a_refused_login_is_one_line_naming_the_username(
    servers, login_broker, tmp_path, command, mechanism
):
    kafka = {
        "bootstrap": login_broker.bootstrap, "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": mechanism, "username": "splu-worker",
    }  # fmt: skip
    line = refused(tmp_path, servers.redis_url, command, kafka)
    assert f"refused SASL {mechanism} authentication as 'splu-worker'" in line
    assert all(name in line for name in ("KAFKA_USERNAME", "KAFKA_PASSWORD"))


def test_no_sasl_payload_reaches_the_debug_log(login_broker):
    """aiokafka logs every request it sends at DEBUG; with PLAIN the payload is the
    username and password, with SCRAM the client's nonce and proof."""
    kafka = KafkaSettings(
        login_broker.bootstrap, "SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
        username="splu-worker",
    )  # fmt: skip
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    logger = logging.getLogger("aiokafka")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    host, _, port = login_broker.bootstrap.rpartition(":")
    try:
        os.environ["KAFKA_PASSWORD"] = PASSWORD
        # A client's connection, with the arguments every client is built with: the
        # broker refuses the unknown user at the exchange's last step.
        with pytest.raises(KeyError):  # aiokafka's SCRAM, at the refusal
            asyncio.run(create_conn(host, int(port), **security_options(kafka)))
        # As aiokafka.conn logs a request, here a PLAIN one.
        request = SaslAuthenticateRequest_v1(f"\0splu-worker\0{PASSWORD}".encode())
        logging.getLogger("aiokafka.conn").debug("Request to %s:%d %d: %s", "h", 1, 2, request)
    finally:
        del os.environ["KAFKA_PASSWORD"]
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    logged = text.getvalue()
    # SCRAM's first and final client messages, and the PLAIN one.
    assert logged.count("SaslAuthenticateRequest_v1(withheld)") == 3, logged
    assert "n=splu-worker" not in logged and PASSWORD not in logged


# --- the settings, without a broker ----------------------------------------------------------


def test_the_password_comes_from_the_environment_or_an_owner_only_file(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKER_KAFKA_PASSWORD", "from-variable")
    assert settings(tmp_path, **SASL, password_env="WORKER_KAFKA_PASSWORD").password() == (
        "from-variable"
    )
    secret = tmp_path / "kafka-password"
    secret.write_text("from-file\n")
    secret.chmod(0o600)
    from_file = settings(tmp_path, **SASL, password_file="kafka-password")
    assert from_file.password_file == secret and from_file.password() == "from-file"
    # KAFKA_PASSWORD is the password itself, over both.
    monkeypatch.setenv("KAFKA_PASSWORD", "from-kafka-password")
    assert from_file.password() == "from-kafka-password"
    monkeypatch.delenv("KAFKA_PASSWORD")

    secret.chmod(0o640)
    with pytest.raises(ConfigError, match=r"kafka\.password_file .*readable by others.*chmod 600"):
        from_file.password()
    secret.unlink()
    with pytest.raises(ConfigError, match=r"kafka\.password_file .*No such file"):
        from_file.password()
    monkeypatch.delenv("WORKER_KAFKA_PASSWORD")
    with pytest.raises(ConfigError, match="password_env names WORKER_KAFKA_PASSWORD, which is not"):
        settings(tmp_path, **SASL, password_env="WORKER_KAFKA_PASSWORD").password()
    with pytest.raises(ConfigError, match="needs a password: set KAFKA_PASSWORD"):
        settings(tmp_path, **SASL).password()


def test_the_service_key_file_shares_the_owner_only_check(tmp_path):
    key = tmp_path / "splu.key"
    key.write_text("ab" * 32)
    key.chmod(0o644)
    contents = document()
    contents["key"] = {"file": "splu.key"}
    config = parse_config(contents, "stream.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"key\.file .*readable by others.*chmod 600"):
        config.service_key()
    key.chmod(0o600)
    assert config.service_key() is not None


@pytest.mark.parametrize("table", ["kafka", "redis"])
def test_a_password_in_the_config_is_refused(tmp_path, table):
    contents = document(**SASL)
    contents[table]["password"] = "hunter2"
    with pytest.raises(ConfigError) as refusal:
        parse_config(contents, "stream.toml", tmp_path)
    message = str(refusal.value)
    assert message.startswith(f"stream.toml: {table}.password is refused") and "\n" not in message
    assert "password_env" in message and "hunter2" not in message


@pytest.mark.parametrize(
    ("key", "value"),
    [("bootstrap", "broker-1:9093,broker-2:9093"), ("security_protocol", "SASL_SSL"),
     ("ca_file", "ca.pem"), ("cert_file", "client.pem"), ("key_file", "client.key"),
     ("sasl_mechanism", "SCRAM-SHA-256"), ("username", "splu-consumer"),
     ("password_file", "secret")],
)  # fmt: skip
def test_each_kafka_variable_overrides_its_setting(tmp_path, monkeypatch, key, value):
    monkeypatch.chdir(tmp_path)
    config_file = {"cert_file": "config.pem", "key_file": "config.key"}
    kafka = {**SASL, "ca_file": "config-ca.pem", **config_file, "password_file": "config"}
    monkeypatch.setenv(KAFKA_ENV[key], value)
    found = getattr(settings(tmp_path / "etc", **kafka), key)
    # A path from the environment is the working directory's; one from the config its own.
    assert found == (Path(value) if key.endswith("_file") else value)
    if key != "ca_file":
        assert settings(tmp_path / "etc", **kafka).ca_file == tmp_path / "etc" / "config-ca.pem"


def test_the_reader_takes_its_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "kafka:9093")
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("KAFKA_USERNAME", "downstream")
    monkeypatch.setenv("KAFKA_PASSWORD", PASSWORD)
    kafka = kafka_from_env("elsewhere:9093")
    assert (kafka.bootstrap, kafka.username, kafka.password()) == (
        "elsewhere:9093", "downstream", PASSWORD,
    )  # fmt: skip
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "TLS")
    with pytest.raises(ConfigError, match=r"kafka\.security_protocol \(KAFKA_SECURITY_PROTOCOL\)"):
        kafka_from_env()


@pytest.mark.parametrize(
    ("kafka", "message"),
    [
        ({"ca_file": "ca.pem"}, r"kafka\.ca_file \(KAFKA_CA_FILE\) is a TLS setting.*PLAINTEXT"),
        ({"security_protocol": "SASL_PLAINTEXT", "ca_file": "ca.pem", "sasl_mechanism": "PLAIN",
          "username": "u"}, r"ca_file .* is a TLS setting"),
        ({"security_protocol": "SSL", "username": "u"}, r"kafka\.username .* is a SASL setting"),
        ({"password_env": "P"}, r"kafka\.password_env .* is a SASL setting"),
        ({"security_protocol": "SASL_SSL", "username": "u"},
         r"sasl_mechanism .* must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "username": "u"},
         r"sasl_mechanism .* got 'GSSAPI'"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"},
         r"kafka\.username .* required"),
        ({"security_protocol": "SSL", "key_file": "k.pem"}, r"key_file .* needs cert_file"),
        ({**SASL, "password_env": "P", "password_file": "f"}, "give one of them"),
        ({"security_protocol": "SASL"}, r"security_protocol .* must be one of PLAINTEXT, SSL"),
        ({"sasl": "PLAIN"}, r"kafka\.sasl is not a known setting"),
    ],
)  # fmt: skip
def test_inconsistent_kafka_settings_are_refused(tmp_path, kafka, message):
    with pytest.raises(ConfigError, match=message):
        settings(tmp_path, **kafka)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return make_certificates(tmp_path_factory.mktemp("certificates"), ["kafka"], days=1)


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
def test_every_client_is_built_for_the_protocol(tmp_path, monkeypatch, tls_files, protocol):
    monkeypatch.setenv("KAFKA_PASSWORD", PASSWORD)
    kafka: dict[str, object] = {"security_protocol": protocol}
    if "SSL" in protocol:
        kafka.update(ca_file=str(tls_files.ca), cert_file=str(tls_files.certificate),
                     key_file=str(tls_files.key))  # fmt: skip
    if "SASL" in protocol:
        kafka.update(sasl_mechanism="SCRAM-SHA-512", username="splu-worker")
    found = settings(tmp_path, **kafka)
    options = client_options(found)
    assert options["bootstrap_servers"] == "kafka:9093"
    assert options["security_protocol"] == protocol
    context = options["ssl_context"]
    if "SSL" in protocol:
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        assert [c["subject"] for c in context.get_ca_certs()] == [
            ((("commonName", "SPLU Stream private CA"),),)
        ]
    else:
        assert context is None
    sasl = {k: v for k, v in options.items() if k.startswith("sasl")}
    expected = {"sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "splu-worker",
                "sasl_plain_password": PASSWORD}  # fmt: skip
    assert sasl == (expected if "SASL" in protocol else {})
    # The Faust apps connect as every other client does.
    faust = faust_options(found)
    assert faust["broker"] == "kafka://kafka:9093"
    auth = dict(credentials_to_aiokafka_auth(faust["broker_credentials"]))
    ours = security_options(found)
    assert {k: v for k, v in auth.items() if k != "ssl_context"} == {
        k: v for k, v in ours.items() if k != "ssl_context"
    }
    assert (auth.get("ssl_context") is None) == (ours["ssl_context"] is None)


def test_unreadable_tls_files_name_their_setting(tmp_path, tls_files):
    missing = settings(tmp_path, security_protocol="SSL", ca_file="nowhere.pem")
    with pytest.raises(ConfigError, match=r"kafka\.ca_file \(KAFKA_CA_FILE\) .*nowhere\.pem"):
        client_options(missing)
    not_a_certificate = settings(
        tmp_path, security_protocol="SSL", ca_file=str(tls_files.ca), cert_file=str(tls_files.ca)
    )
    with pytest.raises(ConfigError, match=r"kafka\.cert_file \(KAFKA_CERT_FILE\)"):
        client_options(not_a_certificate)
    many = faust_options(KafkaSettings("a:9092, b:9092"))["broker"]
    assert many == "kafka://a:9092;kafka://b:9092"
