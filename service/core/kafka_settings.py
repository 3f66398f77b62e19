"""The [kafka] table: where the brokers are and how a process's Kafka clients reach them
(TLS, SASL with the role's own principal), each setting overridden by its KAFKA_*
environment variable (`KAFKA_ENV`). `streams.runtime.kafka.client_options` builds the
clients' options from a `KafkaSettings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from service.core.config_tables import ConfigError, TableReader, read_private_file

# [kafka] settings and the environment variable that overrides each (`KafkaSettings`).
KAFKA_ENV = {
    "bootstrap": "KAFKA_BOOTSTRAP", "security_protocol": "KAFKA_SECURITY_PROTOCOL",
    "ca_file": "KAFKA_CA_FILE", "cert_file": "KAFKA_CERT_FILE", "key_file": "KAFKA_KEY_FILE",
    "sasl_mechanism": "KAFKA_SASL_MECHANISM", "username": "KAFKA_USERNAME",
    "password_file": "KAFKA_PASSWORD_FILE",
}  # fmt: skip
# The password itself, overriding [kafka] password_env and password_file.
KAFKA_PASSWORD_ENV = "KAFKA_PASSWORD"
KAFKA_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def kafka_setting(key: str) -> str:
    """How an error names a [kafka] setting: the config key and its environment variable."""
    return f"kafka.{key} ({KAFKA_ENV.get(key, KAFKA_PASSWORD_ENV)})"


@dataclass(frozen=True)
class KafkaSettings:
    """Where the brokers are and how every Kafka client of a process reaches them
    (`streams.runtime.kafka.client_options`): TLS with verification, SASL with the role's own
    principal. The password is read when a client is built, never kept here. Each setting
    is overridden by the variable `KAFKA_ENV` names beside it; file paths are relative to
    the config."""

    bootstrap: str  # host:port[,host:port...] (left out: DEFAULT_BOOTSTRAP)
    # PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (`streams.runtime.kafka`).
    security_protocol: str = "PLAINTEXT"
    # TLS: the CA that signed the brokers' certificates (left out: the system's CAs);
    # certificates and host names are always verified.
    ca_file: Path | None = None
    cert_file: Path | None = None  # mutual TLS: the client's certificate and key
    key_file: Path | None = None
    sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; with SASL_*
    # The role's own principal (README: the ACL table, `streams.runtime.kafka.topic_grants`).
    username: str | None = None
    # The variable holding the password, or a file readable by its owner only;
    # KAFKA_PASSWORD, if set, is the password and overrides both. A password is never
    # written in the config.
    password_env: str | None = None
    password_file: Path | None = None
    source: str = "the environment"

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    def password(self) -> str:
        """The SASL password: KAFKA_PASSWORD, else the password file, else the variable
        password_env names."""
        if KAFKA_PASSWORD_ENV in os.environ:
            return os.environ[KAFKA_PASSWORD_ENV]
        if self.password_file is not None:
            setting = f"{self.source}: {kafka_setting('password_file')}"
            return read_private_file(self.password_file, setting).rstrip("\r\n")
        if self.password_env is not None:
            if self.password_env not in os.environ:
                raise ConfigError(
                    f"{self.source}: kafka.password_env names {self.password_env}, which is not set"
                )
            return os.environ[self.password_env]
        raise ConfigError(
            f"{self.source}: kafka.security_protocol {self.security_protocol} needs a "
            f"password: set {KAFKA_PASSWORD_ENV}, or kafka.password_env or password_file"
        )


def kafka_from_env(bootstrap: str | None = None) -> KafkaSettings:
    """Kafka settings without a config file, for a downstream reader: the KAFKA_*
    variables (paths relative to the working directory), `bootstrap` if given."""
    settings = kafka_settings(TableReader("the environment", {}, "kafka"), Path.cwd())
    return settings if bootstrap is None else replace(settings, bootstrap=bootstrap)


def kafka_settings(table: TableReader, base: Path) -> KafkaSettings:
    """The [kafka] table with the KAFKA_* variables over it, checked: TLS files only with
    a TLS protocol; SASL settings only with a SASL protocol, which needs a mechanism and a
    username (the password is read when a client is built)."""
    table.refuse_password(
        "name the environment variable holding it (password_env) or a file readable by "
        f"its owner only (password_file), or set {KAFKA_PASSWORD_ENV}"
    )
    if table.get("password_env") is not None and table.get("password_file") is not None:
        raise table.fail("password_env", "and kafka.password_file: give one of them")
    values: dict[str, Any] = {}
    for key in (*KAFKA_ENV, "password_env"):
        if table.get(key) is not None:
            text = table.text(key)
            values[key] = base / text if key.endswith("_file") else text
        variable = KAFKA_ENV.get(key)
        text = os.environ.get(variable) if variable else None
        if text:
            values[key] = Path(text) if key.endswith("_file") else text
    table.finish()

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(f"{table.source}: {kafka_setting(key)} {message}")

    protocol = values.setdefault("security_protocol", "PLAINTEXT")
    if protocol not in KAFKA_PROTOCOLS:
        choices = ", ".join(KAFKA_PROTOCOLS)
        raise fail("security_protocol", f"must be one of {choices}, got {protocol!r}")
    values.setdefault("bootstrap", DEFAULT_BOOTSTRAP)
    settings = KafkaSettings(source=table.source, **values)
    for keys, applies, kind, use in (
        (("ca_file", "cert_file", "key_file"), settings.tls, "TLS", "SSL or SASL_SSL"),
        (("sasl_mechanism", "username", "password_env", "password_file"), settings.sasl,
         "SASL", "SASL_SSL or SASL_PLAINTEXT"),
    ):  # fmt: skip
        for key in keys:
            if key in values and not applies:
                raise fail(
                    key, f"is a {kind} setting, but security_protocol is {protocol}: use {use}"
                )
    if settings.key_file is not None and settings.cert_file is None:
        raise fail("key_file", "needs cert_file, the certificate the key belongs to")
    if settings.sasl:
        if settings.sasl_mechanism not in SASL_MECHANISMS:
            got = "" if settings.sasl_mechanism is None else f", got {settings.sasl_mechanism!r}"
            choices = ", ".join(SASL_MECHANISMS)
            raise fail("sasl_mechanism", f"must be one of {choices} with {protocol}{got}")
        if settings.username is None:
            raise fail("username", f"is required with {protocol}: the principal of this role")
    return settings
