"""Stream configuration: one TOML file per stream, validated on load.

    [stream]
    name = "adult"               # topics: adult.raw, adult.published, adult.rejected, adult.reports
                                 # (personal: also adult.grouped, internal, see below)
    mechanism = "decoy"          # or "personal", or "windowed" (a batch mechanism per window)
    partitions = 1               # of every topic (at most 1,024); one worker can own
                                 # several, and one partition moves tens of thousands of
                                 # records a second
    max_wait = 30.0              # seconds a record may wait for its group (decoy: then it
                                 # is suppressed; a slow survey needs minutes to hours)
    mixing_pool = 1000           # the mixing pool's floor, in records (decoy: at least 10
                                 # groups of γ): the pool never holds fewer while it
                                 # releases, so a published record's neighbours are its
                                 # group-mates with probability at most (γ-1)/floor; records
                                 # wait until it fills (about floor / arrival rate), or
                                 # until the stream closes (`splu close`)
    small_remainder = "suppress" # at the close, the remainders below every partition's
                                 # floor leave together; if all of them hold fewer than 10
                                 # groups (the minimum mixing), "suppress" them, counted,
                                 # or "publish" them, the take's weaker guarantee reported
    closed_retention = 86400.0   # seconds after a partition's close that what it still
                                 # keeps of true values (personal group state, suppression
                                 # counts) and record fingerprints expire
    flush_interval = 5.0         # seconds without new pooled records after which a pool
                                 # holding at least its floor is released whole
    buffer_cap = 100000          # records per partition (waiting and pooled) before
                                 # consumption pauses; at least twice mixing_pool
    report_interval = 30.0       # seconds between privacy reports
    batch_size = 2000            # raw records per batch (at most 5,000)
    batch_wait = 0.2             # seconds to wait for a batch to fill
    record_ttl = 86400.0         # optional: raw buffered records (not yet randomized) expire
                                 # this long after a worker last touched their partition;
                                 # at least 60 s and twice max_wait. Randomized records
                                 # (pooled, in flight) never expire: they are published

    [key]                        # the service key is never written in this file
    env = "SPLU_SERVICE_KEY"     # 64 hex characters, or
    file = "/run/secrets/splu"   # a file readable by its owner only

    [kafka]                      # each setting overridden by the variable named beside it
    bootstrap = "kafka:19092"    # KAFKA_BOOTSTRAP: host:port[,host:port...]
    security_protocol = "SASL_SSL"   # KAFKA_SECURITY_PROTOCOL: PLAINTEXT (the default), SSL,
                                 # SASL_PLAINTEXT or SASL_SSL (`streams.runtime.kafka`)
    ca_file = "kafka-ca.crt"     # KAFKA_CA_FILE: TLS, the CA that signed the brokers'
                                 # certificates (default: the system's CAs); certificates
                                 # and host names are always verified
    cert_file = "client.crt"     # KAFKA_CERT_FILE, KAFKA_KEY_FILE: mutual TLS, the client's
    key_file = "client.key"      # certificate and key (paths relative to this file)
    sasl_mechanism = "SCRAM-SHA-512" # KAFKA_SASL_MECHANISM: PLAIN, SCRAM-SHA-256 or
                                 # SCRAM-SHA-512; required with SASL_*
    username = "splu-worker"     # KAFKA_USERNAME: the role's own principal (README: the
                                 # ACL table, `streams.runtime.kafka.topic_grants`)
    password_env = "WORKER_KAFKA_PASSWORD"  # the variable holding the password, or
    password_file = "/run/secrets/kafka"    # a file readable by its owner only
                                 # (KAFKA_PASSWORD_FILE); KAFKA_PASSWORD, if set, is the
                                 # password and overrides both. A password is never
                                 # written in this file

    [redis]
    url = "redis://redis:6379/0" # REDIS_URL overrides; rediss:// for TLS
    cluster = false              # a Redis Cluster, url naming any node; REDIS_CLUSTER overrides
    replica_acks = 0             # replicas holding a write before it is relied on (Redis WAIT)
    password_env = "REDIS_PASSWORD"
    username = "splu-worker"     # an ACL user (store.buffer.acl_rules); REDIS_USERNAME overrides
    ca_file = "ca.crt"           # TLS: the CA that signed the server's certificate, and
    cert_file = "client.crt"     # for mutual TLS the client's certificate and key
    key_file = "client.key"      # (paths relative to this file)

    [decoy]
    gamma = 5
    grouping = "size-weighted"

    [personal]
    retention = 0.5
    lambda = 0.3
    delta = 0.3
    budget = "bounded"           # trials planned with an upper confidence bound on each
                                 # group's final largest frequency (docs/architecture.md);
                                 # "conservative" plans with frequency 1, safe under any
                                 # drift but less accurate; "adaptive" with the frequency
                                 # so far, overrun when it drifts; "none": plain perturbation
    release_size = 100
    merge_map = "adult.merge.toml"   # optional, relative to this file (`splu merge` fits one):
                                     # public values merged into larger groups, so each
                                     # group allows more trials. Without it every public
                                     # combination is a group of its own: safe, but small
                                     # groups publish more copies and fewer trials

    [windowed]                   # stream.mechanism = "windowed" (`service/store/windowed.py`)
    mechanism = "anatomy"        # sdr, fprivacy, anatomy, dbr or global, run on each window
    window = 1000                # records per window, per partition
    max_window_wait = 60.0       # seconds after which a partial window closes
    min_window = 100             # a partial window with fewer records is suppressed
                                 # (default: a tenth of window)
    gamma = 5                    # then the mechanism's options, named and defaulted as the
                                 # `splu publish` flags: gamma (anatomy, global); rho1, rho2,
                                 # delta (sdr); theta, beta, max_size, min_size,
                                 # bucket_method, fake_values (fprivacy). Exact numbers may
                                 # be written as ratios: rho1 = "1/13"

    [reports]                    # the consumer's periodic privacy tests (stream.report_interval)
    epsilon = 0.3                # relative error ε of the guarantees and the adversary simulation
    alpha = 10                   # counts 1..α are small: they should not be estimated within ε
    error_tolerance = 0.02       # T_E of the utility threshold T_f
    min_privacy = 0.1            # decoy: T_P(ε, α) must reach this
    max_suppressed = 0.01        # decoy: share of resolved records suppressed at most
    min_rows = 20                # adversary: public combinations with at least this many rows
    large_count = 100            # adversary: true counts from this on are large
    max_small_within = 0.5       # adversary: share of small cells within ε at most (decoy: 1 − T_P)
    dp_epsilon = 0.5             # personal: also audit Laplace counts at this ε (optional)
    truth_retention = 86400.0    # seconds: the adversary test scores the records published
                                 # in the last one to two such periods; the exact tallies
                                 # it needs are dropped after that
    fail_closed = ["adversary"]  # tests whose failure pauses publishing until they pass again
                                 # (default: adversary; personal: budget and adversary)
    port = 6066                  # the consumer's web port
    queries = [{where = {sex = "Male"}, value = {occupation = "Craft-repair"}}]  # standing

    [schema]
    ...                          # as in `service.core.schema`

Every error names the file and the offending field.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

from service.core.guarantees import check_reconstruction_parameters, trial_limit
from service.core.mechanisms.personal import STREAM_BUDGETS
from service.core.mechanisms.registry import (
    BATCH_ONLY,
    MECHANISMS,
    STREAM_MECHANISMS,
    TESTS,
    Evidence,
    MechanismSpec,
    checked_settings,
)
from service.core.merge import ValueMap
from service.core.prf import KEY_BYTES, ServiceKey
from service.core.publication import PublicationError, configured
from service.core.publishers import COUNT_COLUMN
from service.core.reconstruct import PublishedCells, Reconstruction
from service.core.schema import Schema, SchemaError, read_toml

# A stream runs a stream mechanism, or a batch-only one on each of its windows
# (`service/store/windowed.py`).
WINDOWED = "windowed"
STREAM_KINDS = (*STREAM_MECHANISMS, WINDOWED)
# [redis] options naming TLS files, and the redis-py argument each becomes.
TLS_FILES = {"ca_file": "ssl_ca_certs", "cert_file": "ssl_certfile", "key_file": "ssl_keyfile"}
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
TOPIC_ROLES = ("raw", "published", "rejected", "reports")
# A personal stream's internal topic: its raw records, validated and repartitioned by
# personal group, so that each group has one owner and one trial budget (issue 15). It
# holds raw sensitive values: it is as private as the raw topic.
GROUPED_ROLE = "grouped"
# The mixing pool's floor holds at least this many groups (SPEC §3; docs/architecture.md).
MIN_MIXING_GROUPS = 10
# Seconds: a record TTL shorter than this could expire records while partitions move.
MIN_RECORD_TTL = 60.0
# Defaults a survey gets when its config leaves them out.
DEFAULT_PARTITIONS = 1
DEFAULT_MIXING_POOL = 1000
# What the close does with a whole stream's remainder below the minimum mixing.
SMALL_REMAINDER = ("suppress", "publish")


class ConfigError(SchemaError):
    """The stream configuration is unusable; the message names the field."""


@dataclass(frozen=True)
class DecoySettings:
    gamma: int
    grouping: str


@dataclass(frozen=True)
class PersonalSettings:
    retention: float
    lam: float
    delta: float
    budget: str
    release_size: int
    value_map: ValueMap


@dataclass(frozen=True)
class WindowedSettings:
    """A batch mechanism run on windows of the stream (`service/store/windowed.py`).

    `options` holds the mechanism's options under the names of `splu publish`
    (`service.core.mechanisms.registry`), checked, with its defaults filled in; ρ, θ and
    β as exact Fractions.
    """

    mechanism: str
    window: int
    max_window_wait: float
    min_window: int
    options: Mapping[str, Any]


# Raw records per batch at most: one ingest call's arguments stay well below the size
# (1 MB) from which a server's command log would keep them.
MAX_BATCH_SIZE = 5000


def kafka_setting(key: str) -> str:
    """How an error names a [kafka] setting: the config key and its environment variable."""
    return f"kafka.{key} ({KAFKA_ENV.get(key, KAFKA_PASSWORD_ENV)})"


@dataclass(frozen=True)
class KafkaSettings:
    """Where the brokers are and how every Kafka client of a process reaches them
    (`streams.runtime.kafka.client_options`): TLS with verification, SASL with the role's own
    principal. The password is read when a client is built, never kept here."""

    bootstrap: str
    security_protocol: str = "PLAINTEXT"
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    sasl_mechanism: str | None = None
    username: str | None = None
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


@dataclass(frozen=True)
class ReportSettings:
    """Thresholds of the consumer's periodic privacy tests and its standing queries."""

    epsilon: float
    alpha: int
    error_tolerance: float
    min_privacy: float
    max_suppressed: float
    min_rows: int
    large_count: int
    max_small_within: float | None
    dp_epsilon: float | None
    truth_retention: float
    fail_closed: tuple[str, ...]
    port: int
    queries: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class StreamConfig:
    """Everything a worker, producer or consumer of one stream needs, validated."""

    source: str
    name: str
    mechanism: str
    partitions: int
    max_wait: float
    mixing_pool: int
    flush_interval: float
    buffer_cap: int
    small_remainder: str
    closed_retention: float
    report_interval: float
    batch_size: int
    batch_wait: float
    record_ttl: float | None
    topics: Mapping[str, str]
    key_env: str | None
    key_file: Path | None
    kafka: KafkaSettings
    redis_url: str
    redis_password_env: str | None
    redis_username: str | None
    redis_tls: Mapping[str, Path]
    redis_cluster: bool
    redis_replica_acks: int
    schema: Schema
    decoy: DecoySettings | None
    personal: PersonalSettings | None
    reports: ReportSettings
    windowed: WindowedSettings | None = None

    @property
    def sensitive(self) -> list[str]:
        return [a.name for a in self.schema.sensitive]

    @property
    def spec(self) -> MechanismSpec:
        """The registry's entry of the mechanism that publishes: the stream's own, or the
        one a windowed stream runs on each window."""
        return MECHANISMS[self.windowed.mechanism if self.windowed else self.mechanism]

    def options(self) -> dict[str, Any]:
        """The publishing mechanism's options under the registry's names, with the
        defaults and what a stream's publication implies filled in."""
        if self.windowed is not None:
            return dict(self.windowed.options)
        chosen = self.decoy if self.decoy is not None else self.personal
        assert chosen is not None, "a stream has one of the three kinds of settings"
        given = {f.name: getattr(chosen, f.name) for f in fields(chosen)}
        return {**self.spec.defaults, **given, **self.spec.stream_options}

    def reconstruction(self, cells: PublishedCells, confidence: float = 0.95) -> Reconstruction:
        """The reconstruction of a decoy or personal stream's publication, as its consumer
        builds it and `splu query --config` answers from the stream's published records."""
        spec = self.spec
        assert spec.stream and spec.reconstruct is not None, "a windowed stream: WindowTally"
        domains = {a.name: a.domain for a in self.schema.sensitive}
        evidence = Evidence(self.options(), self.sensitive, cells, domains, confidence)
        return cast(Reconstruction, spec.reconstruct(evidence))

    @property
    def min_mixing(self) -> int:
        """The fewest records any take may be drawn from: 10 groups (decoy: of γ)."""
        size = self.spec.group_size
        return MIN_MIXING_GROUPS * (self.options()[size] if size is not None else 1)

    @property
    def topic_partitions(self) -> dict[str, int]:
        """Each of the stream's topics with the stream's partition count."""
        return dict.fromkeys(self.topics.values(), self.partitions)

    def service_key(self) -> ServiceKey:
        """The key behind every keyed draw, from the environment or a private file."""
        if self.key_env is not None:
            text = os.environ.get(self.key_env)
            if text is None:
                raise ConfigError(f"{self.source}: key.env names {self.key_env}, which is not set")
            return _parse_key(text, f"environment variable {self.key_env}")
        assert self.key_file is not None
        text = read_private_file(self.key_file, f"{self.source}: key.file")
        return _parse_key(text.strip(), f"key file {self.key_file}")

    def redis_password(self) -> str | None:
        if self.redis_password_env is None:
            return None
        return os.environ.get(self.redis_password_env)

    def redis_options(self) -> dict[str, Any]:
        """Connection options for `redis.asyncio.from_url`: ACL user, password, TLS files."""
        options: dict[str, Any] = {"password": self.redis_password()}
        if self.redis_username is not None:
            options["username"] = self.redis_username
        options.update({k: str(v) for k, v in self.redis_tls.items()})
        return options


def read_private_file(path: Path, setting: str) -> str:
    """The text of a secret's file, which must be readable by its owner only; errors
    start with `setting` (the file and key that name it)."""
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{setting} {path} is readable by others (mode {stat.filemode(mode)}); chmod 600 it"
            )
        return path.read_text()
    except OSError as err:
        raise ConfigError(f"{setting} {path}: {err.strerror}") from None


def _parse_key(text: str, where: str) -> ServiceKey:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{where} must hold {2 * KEY_BYTES} hex characters") from None
    if len(secret) != KEY_BYTES:
        raise ConfigError(f"{where} must hold {2 * KEY_BYTES} hex characters")
    return ServiceKey(secret)


class _Reader:
    """Typed access to one TOML table with errors that name the field."""

    def __init__(self, source: str, table: Mapping[str, Any], path: str) -> None:
        self.source, self.table, self.path = source, table, path
        self.used: set[str] = set()

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.path}.{key} {message}")

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.table.get(key, default)

    def number(self, key: str, default: float | None = None, positive: bool = True) -> float:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise self.fail(key, "must be a finite number")
        if positive and not number > 0:
            raise self.fail(key, f"must be positive, got {value}")
        return number

    def integer(
        self, key: str, default: int | None = None, minimum: int = 1, maximum: int = 10**9
    ) -> int:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {value}")
        if value > maximum:
            shown = f"{value:,}" if value < 10**15 else "more"
            raise self.fail(key, f"must be at most {maximum:,}, got {shown}")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def refuse_password(self, instead: str) -> None:
        """A literal password would sit in a file that is copied, mounted and committed."""
        if "password" in self.table:
            raise self.fail(
                "password", f"is refused: a password is never written in the config; {instead}"
            )

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.fail(unknown[0], "is not a known setting")


def _table(source: str, document: Mapping[str, Any], name: str, required: bool) -> _Reader | None:
    table = document.get(name)
    if table is None:
        if required:
            raise ConfigError(f"{source}: the [{name}] table is required")
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: {name} must be a table")
    return _Reader(source, table, name)


REDIS_CLUSTER_ENV = "REDIS_CLUSTER"
_FLAG_TEXTS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def env_flag(name: str, default: bool) -> bool:
    """A true/false environment variable (1/0, true/false, yes/no), or `default` if unset."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return _FLAG_TEXTS[text.strip().lower()]
    except KeyError:
        raise ConfigError(f"{name} must be 1 or 0 (true or false), got {text!r}") from None


def load_config(path: str | Path) -> StreamConfig:
    """Read and validate a stream's TOML file."""
    path = Path(path)
    return parse_config(read_toml(path, ConfigError), str(path), path.parent)


def parse_config(document: Mapping[str, Any], source: str, base: Path) -> StreamConfig:
    known = {
        "stream", "key", "kafka", "redis", *STREAM_KINDS, "reports", "schema",
    }  # fmt: skip
    unknown = sorted(set(document) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown table [{unknown[0]}]")
    stream = _table(source, document, "stream", required=True)
    assert stream is not None
    name = stream.text("name")
    # Kafka topic names: ASCII letters, digits, '-', '_', '.', at most 249 with the suffix.
    if not name.isascii() or len(name) > 200 or not all(c.isalnum() or c in "-_." for c in name):
        raise stream.fail("name", f"may hold letters, digits, '-', '_' and '.', got {name!r}")
    mechanism = stream.text("mechanism", choices=STREAM_KINDS)
    topics_table = stream.get("topics", {})
    if not isinstance(topics_table, Mapping):
        raise stream.fail("topics", "must be a table")
    topics_reader = _Reader(source, topics_table, "stream.topics")
    grouped = mechanism in MECHANISMS and MECHANISMS[mechanism].grouped_topic
    roles = TOPIC_ROLES + (GROUPED_ROLE,) * grouped
    topics = {role: topics_reader.text(role, f"{name}.{role}") for role in roles}
    topics_reader.finish()
    if len(set(topics.values())) != len(topics):
        raise stream.fail("topics", f"must name {len(topics)} different topics")
    settings = {
        "partitions": stream.integer("partitions", DEFAULT_PARTITIONS, maximum=1024),
        "max_wait": stream.number("max_wait", 30.0),
        "mixing_pool": stream.integer("mixing_pool", DEFAULT_MIXING_POOL),
        "flush_interval": stream.number("flush_interval", 5.0),
        "buffer_cap": stream.integer("buffer_cap", 100_000),
        "small_remainder": stream.text("small_remainder", "suppress", choices=SMALL_REMAINDER),
        "closed_retention": stream.number("closed_retention", 86400.0),
        "report_interval": stream.number("report_interval", 30.0),
        "batch_size": stream.integer("batch_size", 2000, maximum=MAX_BATCH_SIZE),
        "batch_wait": stream.number("batch_wait", 0.2),
        "record_ttl": stream.number("record_ttl") if stream.get("record_ttl") else None,
    }
    if "dedup_window" in stream.table:
        raise stream.fail(
            "dedup_window",
            "is no longer a setting: record ids and tokens are remembered for the life of "
            "the stream; remove it",
        )
    stream.finish()
    _check_stream_settings(stream, settings)

    key = _table(source, document, "key", required=True)
    assert key is not None
    key_env, key_file = key.get("env"), key.get("file")
    if (key_env is None) == (key_file is None):
        raise ConfigError(f"{source}: [key] needs exactly one of env or file")
    if key_env is not None:
        key_env = key.text("env")
    else:
        key_file = base / key.text("file")
    key.finish()

    kafka = _table(source, document, "kafka", required=False)
    redis = _table(source, document, "redis", required=False)
    redis_url = (
        redis.text("url", "redis://127.0.0.1:6379/0") if redis else "redis://127.0.0.1:6379/0"
    )
    password_env = username = None
    tls: dict[str, Path] = {}
    cluster = redis.flag("cluster") if redis else False
    replica_acks = redis.integer("replica_acks", 0, minimum=0, maximum=16) if redis else 0
    if redis:
        redis.refuse_password("name the environment variable holding it (password_env)")
        if redis.get("password_env") is not None:
            password_env = redis.text("password_env")
        if redis.get("username") is not None:
            username = redis.text("username")
        for option, argument in TLS_FILES.items():
            if redis.get(option) is not None:
                tls[argument] = base / redis.text(option)
        redis.finish()
    redis_url = os.environ.get("REDIS_URL", redis_url)
    cluster = env_flag(REDIS_CLUSTER_ENV, cluster)
    if tls and not redis_url.startswith("rediss://"):
        raise ConfigError(
            f"{source}: redis.{next(iter(TLS_FILES))} and the other TLS files need a "
            f"rediss:// url, got {redis_url.split('@')[-1]!r}"
        )

    if "schema" not in document:
        raise ConfigError(f"{source}: the [schema] table is required")
    try:
        schema = Schema.from_mapping(document["schema"], source=source)
    except SchemaError as err:
        raise ConfigError(str(err)) from None

    for other in STREAM_KINDS:
        if other != mechanism and other in document:
            raise ConfigError(f"{source}: [{other}] is set but stream.mechanism is {mechanism!r}")
    # Each kind's settings sit in the table of its name.
    chosen = _SETTINGS_READERS[mechanism](source, mechanism, document, schema, base)
    decoy = chosen if isinstance(chosen, DecoySettings) else None
    personal = chosen if isinstance(chosen, PersonalSettings) else None
    windowed = chosen if isinstance(chosen, WindowedSettings) else None

    reports = _report_settings(source, document, mechanism, schema)
    if reports.truth_retention < 2 * settings["report_interval"]:
        raise ConfigError(
            f"{source}: reports.truth_retention ({reports.truth_retention:g} s) must be at least "
            f"twice stream.report_interval ({settings['report_interval']:g} s), or the "
            "adversary test would score next to nothing"
        )
    group = decoy.gamma if decoy is not None else 1
    if settings["mixing_pool"] < MIN_MIXING_GROUPS * group:
        size = f"{MIN_MIXING_GROUPS} groups of γ = {group}" if decoy else f"{MIN_MIXING_GROUPS}"
        raise ConfigError(
            f"{source}: stream.mixing_pool must be at least {MIN_MIXING_GROUPS * group} "
            f"({size}), got {settings['mixing_pool']}: a published record's neighbours would "
            "too often be its group-mates"
        )

    return StreamConfig(
        source=source,
        name=name,
        mechanism=mechanism,
        topics=topics,
        key_env=key_env,
        key_file=key_file,
        kafka=kafka_settings(kafka or _Reader(source, {}, "kafka"), base),
        redis_url=redis_url,
        redis_password_env=password_env,
        redis_username=os.environ.get("REDIS_USERNAME", username),
        redis_tls=tls,
        redis_cluster=cluster,
        redis_replica_acks=replica_acks,
        schema=schema,
        decoy=decoy,
        personal=personal,
        reports=reports,
        windowed=windowed,
        **settings,
    )


def kafka_from_env(bootstrap: str | None = None) -> KafkaSettings:
    """Kafka settings without a config file, for a downstream reader: the KAFKA_*
    variables (paths relative to the working directory), `bootstrap` if given."""
    settings = kafka_settings(_Reader("the environment", {}, "kafka"), Path.cwd())
    return settings if bootstrap is None else replace(settings, bootstrap=bootstrap)


def kafka_settings(table: _Reader, base: Path) -> KafkaSettings:
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


def _check_stream_settings(stream: _Reader, settings: Mapping[str, Any]) -> None:
    """Combinations of [stream] settings that would stall the stream or lose records."""
    if settings["buffer_cap"] < 2 * settings["mixing_pool"]:
        raise stream.fail(
            "buffer_cap",
            f"({settings['buffer_cap']}) must be at least twice stream.mixing_pool "
            f"({settings['mixing_pool']}): the pool never drops below mixing_pool while it "
            "releases, so a smaller cap stops consumption for good",
        )
    ttl = settings["record_ttl"]
    if ttl is not None and ttl < max(MIN_RECORD_TTL, 2 * settings["max_wait"]):
        raise stream.fail(
            "record_ttl",
            f"({ttl:g} s) must be at least {MIN_RECORD_TTL:g} s and twice stream.max_wait "
            f"({settings['max_wait']:g} s): records would expire while a worker still runs "
            "or while partitions move between workers",
        )


def _report_settings(
    source: str, document: Mapping[str, Any], mechanism: str, schema: Schema
) -> ReportSettings:
    table = _table(source, document, "reports", required=False) or _Reader(source, {}, "reports")
    epsilon = table.number("epsilon", 0.3)
    tolerance = table.number("error_tolerance", 0.02)
    min_privacy = table.number("min_privacy", 0.1)
    max_suppressed = table.number("max_suppressed", 0.01, positive=False)
    for key, value in (("error_tolerance", tolerance), ("min_privacy", min_privacy)):
        if not value < 1:
            raise table.fail(key, f"must lie in (0, 1), got {value}")
    if not 0 <= max_suppressed <= 1:
        raise table.fail("max_suppressed", f"must lie in [0, 1], got {max_suppressed}")
    small = table.get("max_small_within")
    if small is not None:
        small = table.number("max_small_within")
        if not small <= 1:
            raise table.fail("max_small_within", f"must lie in (0, 1], got {small}")
    dp_epsilon = table.get("dp_epsilon")
    if dp_epsilon is not None:
        dp_epsilon = table.number("dp_epsilon")
    # The tests whose failure pauses publishing unless the config says otherwise: those
    # that catch a leak as it happens (small counts reconstructible, a group over its
    # trials). A windowed stream's tests read published data only and never fail closed;
    # the privacy tests that fail closed are written for decoy and personal groups.
    spec = MECHANISMS.get(mechanism)
    default = spec.fail_closed if spec is not None else ()
    fail_closed = table.get("fail_closed", list(default))
    if not isinstance(fail_closed, list) or not all(t in TESTS for t in fail_closed):
        raise table.fail("fail_closed", f"must be a list of test names from {', '.join(TESTS)}")
    queries = table.get("queries", [])
    if not isinstance(queries, list) or not all(isinstance(q, Mapping) for q in queries):
        raise table.fail("queries", "must be a list of tables like {where = {...}, value = {...}}")
    for number, query in enumerate(queries, start=1):
        _check_standing_query(table, number, query, schema)
    settings = ReportSettings(
        epsilon=epsilon,
        alpha=table.integer("alpha", 10),
        error_tolerance=tolerance,
        min_privacy=min_privacy,
        max_suppressed=max_suppressed,
        min_rows=table.integer("min_rows", 20),
        large_count=table.integer("large_count", 100),
        max_small_within=small,
        dp_epsilon=dp_epsilon,
        truth_retention=table.number("truth_retention", 86400.0),
        fail_closed=tuple(fail_closed),
        port=table.integer("port", 6066, minimum=0, maximum=65535),
        queries=tuple(queries),
    )
    table.finish()
    never_runs = spec.never_runs if spec is not None else TESTS
    for test in settings.fail_closed:
        if test in never_runs:
            raise table.fail(
                "fail_closed", f"names {test!r}, which a {mechanism} stream never runs"
            )
    return settings


def _decoy_settings(
    source: str, name: str, document: Mapping[str, Any], schema: Schema, base: Path
) -> DecoySettings:
    table = _table(source, document, name, required=False) or _Reader(source, {}, name)
    gamma = table.integer("gamma", 5, minimum=2)
    # Anatomy's rule is a batch comparison (`splu publish --grouping anatomy`); streams cut
    # with the size-weighted rule only.
    grouping = table.text("grouping", "size-weighted", choices=("size-weighted",))
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
    table = _table(source, document, name, required=True)
    assert table is not None
    mechanism = table.text("mechanism", choices=BATCH_ONLY)
    spec = MECHANISMS[mechanism]
    window = table.integer("window", 1000)
    max_window_wait = table.number("max_window_wait", 60.0)
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
    table = _table(source, document, name, required=True)
    assert table is not None
    if len(schema.sensitive) != 1:
        raise ConfigError(
            f"{source}: schema.sensitive: personal groups protect exactly one sensitive "
            f"attribute, got {len(schema.sensitive)}"
        )
    attribute = schema.sensitive[0]
    retention = table.number("retention", 0.5)
    lam = table.number("lambda", 0.3)
    delta = table.number("delta", 0.3)
    budget = table.text("budget", "bounded", choices=STREAM_BUDGETS)
    release_size = table.integer("release_size", 100)
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
        return PersonalSettings(
            retention, lam, delta, budget, release_size, ValueMap.identity(attribute)
        )
    try:
        value_map = ValueMap.load(base / map_name)
    except SchemaError as err:
        raise ConfigError(f"{source}: personal.merge_map: {err}") from None
    if value_map.sensitive != attribute.name:
        raise ConfigError(
            f"{source}: personal.merge_map was fitted for {value_map.sensitive!r}, "
            f"not {attribute.name!r}"
        )
    return PersonalSettings(retention, lam, delta, budget, release_size, value_map)


def _check_standing_query(
    table: _Reader, number: int, query: Mapping[str, Any], schema: Schema
) -> None:
    """A standing query names public columns under where and sensitive ones under value."""
    unknown = set(query) - {"where", "value"}
    if unknown:
        raise table.fail("queries", f"#{number}: unknown key {sorted(unknown)[0]!r}")
    for part, sensitive in (("where", False), ("value", True)):
        items = query.get(part, {})
        if not isinstance(items, Mapping):
            raise table.fail("queries", f"#{number}: {part} must be a table")
        for column, wanted in items.items():
            if column not in schema or schema[column].sensitive != sensitive:
                kind = "sensitive" if sensitive else "public"
                raise table.fail("queries", f"#{number}: {part}.{column} is not a {kind} column")
            options = wanted if isinstance(wanted, list) and not sensitive else [wanted]
            for option in options:
                if str(option) not in schema[column].domain:
                    raise table.fail(
                        "queries", f"#{number}: {part}.{column} = {option!r} is not in its domain"
                    )


# Each kind of stream reads its settings from the table of its name.
_SETTINGS_READERS = {
    "decoy": _decoy_settings,
    "personal": _personal_settings,
    WINDOWED: _windowed_settings,
}
