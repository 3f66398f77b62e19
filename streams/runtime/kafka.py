"""Every Kafka client of every process, built from the stream's [kafka] settings.

`client_options` gives the arguments of any aiokafka client (producer, consumer, admin):
the bootstrap servers, the security protocol, a TLS context that verifies the brokers'
certificates and host names, and the SASL mechanism, username and password of the
process's role; `faust_options` gives the same to a Faust app. Nothing else builds a
client's connection settings.

`start_client` starts a client and turns a failure into one line naming the setting to
change (`diagnose`): no broker answering, a certificate not trusted or not valid for the
host, a plaintext client facing a TLS listener (or the reverse), a SASL mechanism the
broker does not take, a refused login. aiokafka's bootstrap logs each such cause and
raises "Unable to bootstrap" without it, so `diagnose` connects once more, step by step
(TCP, then TLS and a plaintext request, then SASL), to find it.

`topic_grants` is each role's access to the stream's topics and consumer groups: the ACL
table of docs/security.md, granted by docker-compose.yml's kafka-init
(tests/test_compose.py keeps the three equal), and the topics each process checks at its
start.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import faust
from aiokafka import errors as kafka_errors
from aiokafka.conn import create_conn
from aiokafka.protocol.admin import SaslAuthenticateRequest_v0, SaslAuthenticateRequest_v1
from aiokafka.protocol.metadata import MetadataRequest

from service.core.config import ConfigError, KafkaSettings, StreamConfig
from service.core.kafka_settings import KAFKA_PASSWORD_ENV, kafka_setting
from service.core.manifest import MANIFEST_PARTITIONS, manifest_topic

T = TypeVar("T")

# How a stream's process is pointed at another broker.
CONFIG_HINT = "set KAFKA_BOOTSTRAP or [kafka] bootstrap in the stream's config"
# Seconds a client may take to start: aiokafka waits its request timeout (40 s) for a
# TLS handshake or an answer that never comes, as from a server that reads a TLS hello
# as the length of a request and waits for the rest.
START_TIMEOUT = 10.0
PROBE_TIMEOUT = 5.0  # seconds each step of `diagnose` may take
# Certificate verification's code for a certificate that does not name the host
# (OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, and _IP_ADDRESS_MISMATCH for an address).
HOSTNAME_MISMATCH = (62, 64)
ROLES = ("worker", "consumer", "producer", "reader")


class BrokerUnreachableError(ConnectionError):
    """No Kafka broker answers at a stream's bootstrap address (it may be restarting)."""


class BrokerRefusedError(ConnectionError):
    """A broker answers but refuses this client's TLS or SASL settings: retrying with the
    same settings cannot help."""


def ssl_context(kafka: KafkaSettings) -> ssl.SSLContext | None:
    """The TLS context of a TLS protocol: the brokers' certificates are verified against
    ca_file (else the system's CAs) and must name the host connected to; with cert_file,
    the client's certificate is offered (mutual TLS)."""
    if not kafka.tls:
        return None
    setting = "ca_file"
    try:
        context = ssl.create_default_context(cafile=kafka.ca_file)
        if kafka.cert_file is not None:
            setting = "cert_file"
            context.load_cert_chain(kafka.cert_file, kafka.key_file)
    except OSError as err:  # ssl.SSLError is one: a file that holds no certificate or key
        path = getattr(kafka, setting)
        reason = getattr(err, "reason", None) or err.strerror or str(err)
        raise ConfigError(f"{kafka.source}: {kafka_setting(setting)} {path}: {reason}") from None
    return context


def security_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The security arguments of an aiokafka client or connection."""
    options: dict[str, Any] = {
        "security_protocol": kafka.security_protocol,
        "ssl_context": ssl_context(kafka),
    }
    if kafka.sasl:
        options.update(
            sasl_mechanism=kafka.sasl_mechanism,
            sasl_plain_username=kafka.username,
            sasl_plain_password=kafka.password(),
        )
    return options


def client_options(kafka: KafkaSettings) -> dict[str, Any]:
    """The arguments every aiokafka client (producer, consumer, admin) starts with."""
    return {"bootstrap_servers": kafka.bootstrap, **security_options(kafka)}


def faust_options(kafka: KafkaSettings) -> dict[str, Any]:
    """A Faust app's broker and credentials: the same connections as `client_options`."""
    broker = ";".join(f"kafka://{server.strip()}" for server in kafka.bootstrap.split(","))
    context = ssl_context(kafka)
    credentials: faust.types.auth.CredentialsT | None = None
    if kafka.sasl:
        credentials = faust.SASLCredentials(
            username=kafka.username, password=kafka.password(), ssl_context=context,
            mechanism=kafka.sasl_mechanism,
        )  # fmt: skip
    elif context is not None:
        credentials = faust.SSLCredentials(context)
    return {"broker": broker, "broker_credentials": credentials}


async def start_client(client: T, kafka: KafkaSettings, hint: str = CONFIG_HINT) -> T:
    """`client` (an aiokafka producer, consumer or admin client) started, or stopped and
    BrokerUnreachableError / BrokerRefusedError raised: one line naming the setting to
    change, `hint` when no broker answers."""
    try:
        # Our one line says it; aiokafka would log each failed connection as well.
        with silenced("aiokafka"):
            await asyncio.wait_for(client.start(), START_TIMEOUT)  # type: ignore[attr-defined]
    except BaseException as err:
        # An admin client closes, producers and consumers stop.
        await getattr(client, "close", getattr(client, "stop", None))()
        if not isinstance(err, Exception):
            raise
        problem = await diagnose(kafka, hint)
        if isinstance(problem, BrokerUnreachableError) and not isinstance(
            err, kafka_errors.KafkaConnectionError
        ):
            raise
        raise problem from None
    return client


async def diagnose(kafka: KafkaSettings, hint: str = CONFIG_HINT) -> ConnectionError:
    """Why a client could not start, as one line naming the setting to change, found by
    connecting to the first bootstrap server step by step: TCP; TLS (if configured) and
    a plaintext request; SASL (if configured)."""
    where = kafka.bootstrap.split(",")[0].strip()
    host, _, port_text = where.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT)
        writer.close()
    except (OSError, TimeoutError):
        return BrokerUnreachableError(
            f"no Kafka broker answers at {kafka.bootstrap}: start one (`splu up` runs an "
            f"embedded one) or {hint}"
        )
    options = security_options(kafka)
    transport = {
        "security_protocol": "SSL" if kafka.tls else "PLAINTEXT",
        "ssl_context": options["ssl_context"],
    }
    protocol = kafka_setting("security_protocol")
    try:
        with silenced("aiokafka"):
            connection = await _connect(host, port, **transport)
    except ssl.SSLCertVerificationError as err:
        if err.verify_code in HOSTNAME_MISMATCH:
            return BrokerRefusedError(
                f"the TLS certificate of the broker at {where} does not name {host} "
                f"({err.verify_message}): set {kafka_setting('bootstrap')} to a name it "
                f"holds, or give the broker a certificate for {host}"
            )
        return BrokerRefusedError(
            f"the TLS certificate of the broker at {where} is not trusted "
            f"({err.verify_message}): set {kafka_setting('ca_file')} to the CA that signed it"
        )
    except ssl.SSLError as err:
        return BrokerRefusedError(
            f"the broker at {where} did not complete a TLS handshake ({err.reason or err}): "
            f"if its listener is plaintext, set {protocol} to PLAINTEXT or SASL_PLAINTEXT"
        )
    except (kafka_errors.KafkaError, OSError, TimeoutError) as err:
        if kafka.tls:
            return BrokerRefusedError(
                f"the broker at {where} did not answer a Kafka request over TLS "
                f"({_reason(err)}): if its listener is plaintext, set {protocol} to "
                "PLAINTEXT or SASL_PLAINTEXT"
            )
        return BrokerRefusedError(
            f"the broker at {where} did not answer a plaintext Kafka request "
            f"({_reason(err)}): if its listener takes TLS, set {protocol} to SSL or SASL_SSL"
        )
    try:
        if not kafka.sasl:
            # A SASL listener answers the version lookup, then closes at the first request.
            await asyncio.wait_for(connection.send(MetadataRequest([])), PROBE_TIMEOUT)
    except (kafka_errors.KafkaError, OSError, TimeoutError) as err:
        return BrokerRefusedError(
            f"the broker at {where} closed the connection at the first request "
            f"({_reason(err)}): if its listener wants SASL, set {protocol} to "
            f"{'SASL_SSL' if kafka.tls else 'SASL_PLAINTEXT'} with a username and password"
        )
    finally:
        connection.close()
    if kafka.sasl:
        mechanism = kafka.sasl_mechanism
        try:
            with silenced("aiokafka"):
                (await _connect(host, port, **options)).close()
        except kafka_errors.UnsupportedSaslMechanismError:
            return BrokerRefusedError(
                f"the broker at {where} does not take SASL mechanism {mechanism}: set "
                f"{kafka_setting('sasl_mechanism')} to one it takes, or {protocol} to "
                f"{'SSL' if kafka.tls else 'PLAINTEXT'} if it wants no SASL"
            )
        except Exception as err:  # aiokafka's SCRAM raises KeyError on a server's refusal
            return BrokerRefusedError(
                f"the broker at {where} refused SASL {mechanism} authentication as "
                f"{kafka.username!r} ({_reason(err)}): check {kafka_setting('username')}, "
                f"the password ({KAFKA_PASSWORD_ENV}, kafka.password_env or password_file) "
                f"and {kafka_setting('sasl_mechanism')}"
            )
    return BrokerUnreachableError(
        f"the Kafka broker at {where} answers, but no broker of {kafka.bootstrap} could be "
        f"used: check the addresses the brokers advertise, or {hint}"
    )


async def _connect(host: str, port: int, **options: Any) -> Any:
    return await create_conn(host, port, request_timeout_ms=int(PROBE_TIMEOUT * 1000), **options)


def _reason(err: BaseException) -> str:
    """An error's type and text (aiokafka's texts start with the type), without reprs."""
    name, text = type(err).__name__, str(err)
    if not text or "<" in text:
        return name
    return text if text.startswith(name) else f"{name}: {text}"


@contextmanager
def silenced(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


class _WithholdSaslPayloads(logging.Filter):
    """aiokafka logs each request it sends at DEBUG; a SASL PLAIN request's payload is the
    username and the password in clear text, and a SCRAM one holds the client's proof."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                f"{type(a).__name__}(withheld)" if isinstance(a, _SASL_PAYLOADS) else a
                for a in record.args
            )
        return True


class _DropUnreadResets(logging.Filter):
    """A broker that resets a connection it refuses (a TLS listener reading a plaintext
    request) leaves asyncio's stream protocol holding the reset, which nobody reads; when
    the garbage collector frees the protocol's cycle in the wrong order, asyncio logs it
    with a traceback, after the one line that already said why."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            isinstance(error, ConnectionResetError)
            and record.getMessage().startswith("Future exception was never retrieved")
        )


_SASL_PAYLOADS = (SaslAuthenticateRequest_v0, SaslAuthenticateRequest_v1)
logging.getLogger("aiokafka.conn").addFilter(_WithholdSaslPayloads())
logging.getLogger("asyncio").addFilter(_DropUnreadResets())


def topic_grants(config: StreamConfig) -> dict[str, dict[str, tuple[str, ...]]]:
    """Each role's operations on the stream's topics and consumer groups ("group:NAME"),
    least privilege: the worker reads raw and writes what it publishes and rejects, the
    consumer reads published and writes reports, a producer writes raw, a downstream
    reader reads published and the manifest. Read and Write include Describe. The admin
    (topics, ACLs, `splu close`) is a super user. A personal stream's grouped topic holds
    raw values, as raw does: only the worker reaches it."""
    topics, manifest = config.topics, manifest_topic(config.name)
    worker: dict[str, tuple[str, ...]] = {
        topics["raw"]: ("Read",), topics["published"]: ("Write",),
        topics["rejected"]: ("Write",), manifest: ("Read", "Write"),
    }  # fmt: skip
    if "grouped" in topics:
        worker[topics["grouped"]] = ("Read", "Write")
    worker[f"group:splu-{config.name}"] = ("Read",)
    consumer: dict[str, tuple[str, ...]] = {
        topics["published"]: ("Read",), topics["reports"]: ("Write",), manifest: ("Read",),
        f"group:splu-{config.name}-consumer": ("Read",),
    }  # fmt: skip
    return {
        "worker": worker,
        "consumer": consumer,
        "producer": {topics["raw"]: ("Write",)},
        "reader": {topics["published"]: ("Read",), manifest: ("Read",)},
    }


def role_topics(config: StreamConfig, role: str) -> dict[str, int]:
    """The stream's topics `role` reaches, with their partition counts: those its process
    checks, and creates if missing and allowed, as it starts."""
    counts = {**config.topic_partitions, manifest_topic(config.name): MANIFEST_PARTITIONS}
    return {name: counts[name] for name in topic_grants(config)[role] if name in counts}
