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

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

from service.core.config_tables import (
    ConfigError,
    TableReader,
    env_flag,
    read_private_file,
    table_of,
)
from service.core.kafka_settings import KafkaSettings, kafka_settings
from service.core.mechanism_settings import (
    SETTINGS_READERS,
    WINDOWED,
    DecoySettings,
    PersonalSettings,
    WindowedSettings,
)
from service.core.mechanisms.registry import (
    MECHANISMS,
    STREAM_MECHANISMS,
    TESTS,
    Evidence,
    MechanismSpec,
)
from service.core.prf import KEY_BYTES, ServiceKey
from service.core.reconstruct import PublishedCells, Reconstruction
from service.core.schema import Schema, SchemaError, read_toml

STREAM_KINDS = (*STREAM_MECHANISMS, WINDOWED)
# [redis] options naming TLS files, and the redis-py argument each becomes.
TLS_FILES = {"ca_file": "ssl_ca_certs", "cert_file": "ssl_certfile", "key_file": "ssl_keyfile"}
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


# Raw records per batch at most: one ingest call's arguments stay well below the size
# (1 MB) from which a server's command log would keep them.
MAX_BATCH_SIZE = 5000


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


def _parse_key(text: str, where: str) -> ServiceKey:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{where} must hold {2 * KEY_BYTES} hex characters") from None
    if len(secret) != KEY_BYTES:
        raise ConfigError(f"{where} must hold {2 * KEY_BYTES} hex characters")
    return ServiceKey(secret)


REDIS_CLUSTER_ENV = "REDIS_CLUSTER"


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
    stream = table_of(source, document, "stream", required=True)
    assert stream is not None
    name = stream.text("name")
    # Kafka topic names: ASCII letters, digits, '-', '_', '.', at most 249 with the suffix.
    if not name.isascii() or len(name) > 200 or not all(c.isalnum() or c in "-_." for c in name):
        raise stream.fail("name", f"may hold letters, digits, '-', '_' and '.', got {name!r}")
    mechanism = stream.text("mechanism", choices=STREAM_KINDS)
    topics_table = stream.get("topics", {})
    if not isinstance(topics_table, Mapping):
        raise stream.fail("topics", "must be a table")
    topics_reader = TableReader(source, topics_table, "stream.topics")
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
    stream.finish()
    _check_stream_settings(stream, settings)

    key = table_of(source, document, "key", required=True)
    assert key is not None
    key_env, key_file = key.get("env"), key.get("file")
    if (key_env is None) == (key_file is None):
        raise ConfigError(f"{source}: [key] needs exactly one of env or file")
    if key_env is not None:
        key_env = key.text("env")
    else:
        key_file = base / key.text("file")
    key.finish()

    kafka = table_of(source, document, "kafka", required=False)
    redis = table_of(source, document, "redis", required=False)
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
    chosen = SETTINGS_READERS[mechanism](source, mechanism, document, schema, base)
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
        kafka=kafka_settings(kafka or TableReader(source, {}, "kafka"), base),
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


def _check_stream_settings(stream: TableReader, settings: Mapping[str, Any]) -> None:
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
    table = table_of(source, document, "reports", required=False) or TableReader(
        source, {}, "reports"
    )
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


def _check_standing_query(
    table: TableReader, number: int, query: Mapping[str, Any], schema: Schema
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
