"""Stream configuration: one TOML file per stream, validated once, on load.

    [stream]                 # StreamConfig: name, mechanism, partitions, max_wait,
                             # mixing_pool, flush_interval, buffer_cap, small_remainder,
                             # closed_retention, report_interval, batch_size, batch_wait,
                             # record_ttl, topics = {raw = ..., published = ...}
    [key]                    # env or file (StreamConfig.key_env, key_file)
    [kafka]                  # KafkaSettings (service.core.kafka_settings)
    [redis]                  # url, cluster, replica_acks, username, password_env, ca_file,
                             # cert_file, key_file (StreamConfig.redis_*)
    [decoy]                  # DecoySettings      } the table of stream.mechanism only
    [personal]               # PersonalSettings   } (service.core.mechanism_settings)
    [windowed]               # WindowedSettings   }
    [reports]                # ReportSettings
    [schema]                 # service.core.schema

Each setting's meaning and default is written once, on its field; a setting left out of
the file takes that default. The bundled examples (deploy/examples/adult-*.toml) show
every table filled in. Every error names the file and the offending field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
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
# What the close does with a whole stream's remainder below the minimum mixing.
SMALL_REMAINDER = ("suppress", "publish")


# Raw records per batch at most: one ingest call's arguments stay well below the size
# (1 MB) from which a server's command log would keep them.
MAX_BATCH_SIZE = 5000


@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """[reports]: thresholds of the consumer's periodic privacy tests (every
    stream.report_interval seconds) and its standing queries."""

    epsilon: float = 0.3  # relative error ε of the guarantees and the adversary simulation
    alpha: int = 10  # counts 1..α are small: they should not be estimated within ε
    error_tolerance: float = 0.02  # T_E of the utility threshold T_f
    min_privacy: float = 0.1  # decoy: T_P(ε, α) must reach this
    max_suppressed: float = 0.01  # decoy: share of resolved records suppressed at most
    min_rows: int = 20  # adversary: public combinations with at least this many rows
    large_count: int = 100  # adversary: true counts from this on are large
    # Adversary: share of small cells within ε at most (decoy default: 1 − T_P).
    max_small_within: float | None = None
    dp_epsilon: float | None = None  # personal: also audit Laplace counts at this ε
    # Seconds: the adversary test scores the records published in the last one to two such
    # periods; the exact tallies it needs are dropped after that.
    truth_retention: float = 86400.0
    # Tests whose failure pauses publishing until they pass again (default: the
    # mechanism's, `MechanismSpec.fail_closed`).
    fail_closed: tuple[str, ...]
    port: int = 6066  # the consumer's web port
    # Standing queries: [{where = {sex = "Male"}, value = {occupation = "Craft-repair"}}].
    queries: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """Everything a worker, producer or consumer of one stream needs, validated. A setting
    left out of the file takes the default written on its field here."""

    source: str
    # [stream]
    # Topics <name>.raw, .published, .rejected and .reports (a personal stream's also
    # .grouped, internal: its raw records repartitioned by group, as private as .raw);
    # stream.topics may rename each.
    name: str
    mechanism: str  # decoy, personal, or windowed (a batch mechanism on each window)
    topics: Mapping[str, str]
    # Of every topic (at most 1,024); one worker can own several, and one partition moves
    # tens of thousands of records a second.
    partitions: int = 1
    # Seconds a record may wait for its group (decoy: then it is suppressed; a slow survey
    # needs minutes to hours).
    max_wait: float = 30.0
    # The mixing pool's floor, in records (decoy: at least 10 groups of γ): the pool never
    # holds fewer while it releases, so a published record's neighbours are its group-mates
    # with probability at most (γ-1)/floor; records wait until it fills (about floor /
    # arrival rate), or until the stream closes (`splu close`).
    mixing_pool: int = 1000
    # Seconds without new pooled records after which a pool holding at least its floor is
    # released whole.
    flush_interval: float = 5.0
    # Records per partition (waiting and pooled) before consumption pauses; at least twice
    # mixing_pool.
    buffer_cap: int = 100_000
    # At the close, the remainders below every partition's floor leave together; if all of
    # them hold fewer than 10 groups (the minimum mixing), "suppress" them, counted, or
    # "publish" them, the take's weaker guarantee reported.
    small_remainder: str = "suppress"
    # Seconds after a partition's close that what it still keeps of true values (personal
    # group state, suppression counts) and record fingerprints expire.
    closed_retention: float = 86400.0
    report_interval: float = 30.0  # seconds between privacy reports
    batch_size: int = 2000  # raw records per batch (at most MAX_BATCH_SIZE)
    batch_wait: float = 0.2  # seconds to wait for a batch to fill
    # Optional: raw buffered records (not yet randomized) expire this long after a worker
    # last touched their partition; at least 60 s and twice max_wait. Randomized records
    # (pooled, in flight) never expire: they are published.
    record_ttl: float | None = None
    # [key]: the service key (64 hex characters) from the variable key.env names, or from
    # key.file, readable by its owner only; never written in the config.
    key_env: str | None = None
    key_file: Path | None = None
    kafka: KafkaSettings  # [kafka], `service.core.kafka_settings`
    # [redis], each but the TLS files overridden by its variable: REDIS_URL (rediss:// for
    # TLS), REDIS_CLUSTER (a Redis Cluster, the url naming any node), REDIS_USERNAME (an
    # ACL user, `service.store.buffer.acl_rules`); the password from the variable
    # redis.password_env names, never written in the config.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password_env: str | None = None
    redis_username: str | None = None
    # redis.ca_file, cert_file and key_file (paths relative to the config) as redis-py's
    # TLS arguments (`TLS_FILES`).
    redis_tls: Mapping[str, Path] = field(default_factory=dict)
    redis_cluster: bool = False
    redis_replica_acks: int = 0  # replicas holding a write before it is relied on (WAIT)
    schema: Schema  # [schema], `service.core.schema`
    # The table of the stream's kind (`service.core.mechanism_settings`); the others None.
    decoy: DecoySettings | None = None
    personal: PersonalSettings | None = None
    windowed: WindowedSettings | None = None
    reports: ReportSettings  # [reports]

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


# Defaults a survey gets when its config leaves them out (`splu plan` sizes a stream).
DEFAULT_PARTITIONS = StreamConfig.partitions
DEFAULT_MIXING_POOL = StreamConfig.mixing_pool


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
    d = StreamConfig
    settings = {
        "partitions": stream.integer("partitions", d.partitions, maximum=1024),
        "max_wait": stream.number("max_wait", d.max_wait),
        "mixing_pool": stream.integer("mixing_pool", d.mixing_pool),
        "flush_interval": stream.number("flush_interval", d.flush_interval),
        "buffer_cap": stream.integer("buffer_cap", d.buffer_cap),
        "small_remainder": stream.text(
            "small_remainder", d.small_remainder, choices=SMALL_REMAINDER
        ),
        "closed_retention": stream.number("closed_retention", d.closed_retention),
        "report_interval": stream.number("report_interval", d.report_interval),
        "batch_size": stream.integer("batch_size", d.batch_size, maximum=MAX_BATCH_SIZE),
        "batch_wait": stream.number("batch_wait", d.batch_wait),
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
    redis = table_of(source, document, "redis", required=False) or TableReader(source, {}, "redis")
    redis_url = redis.text("url", d.redis_url)
    password_env = username = None
    tls: dict[str, Path] = {}
    cluster = redis.flag("cluster", d.redis_cluster)
    replica_acks = redis.integer("replica_acks", d.redis_replica_acks, minimum=0, maximum=16)
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
    d = ReportSettings
    epsilon = table.number("epsilon", d.epsilon)
    tolerance = table.number("error_tolerance", d.error_tolerance)
    min_privacy = table.number("min_privacy", d.min_privacy)
    max_suppressed = table.number("max_suppressed", d.max_suppressed, positive=False)
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
        alpha=table.integer("alpha", d.alpha),
        error_tolerance=tolerance,
        min_privacy=min_privacy,
        max_suppressed=max_suppressed,
        min_rows=table.integer("min_rows", d.min_rows),
        large_count=table.integer("large_count", d.large_count),
        max_small_within=small,
        dp_epsilon=dp_epsilon,
        truth_retention=table.number("truth_retention", d.truth_retention),
        fail_closed=tuple(fail_closed),
        port=table.integer("port", d.port, minimum=0, maximum=65535),
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
