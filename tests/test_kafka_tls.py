"""Kafka over TLS, certificates verified (issue 31; `streams/runtime/kafka.py`).

The embedded broker (tansu 0.6) serves no TLS handshake aiokafka completes, so Debian's
stunnel (deploy/system-packages.sh) terminates TLS in front of it, with a certificate for
``localhost`` signed by a CA made here (`deploy.certificates`), and the broker advertises
the proxy's address: every connection a client makes, the first and those to the
advertised broker and group coordinator, goes through TLS.

- A decoy stream runs end to end with every client on TLS: `produce`, the worker and the
  consumer (Faust apps and their own producers), `splu close`, and the downstream reader
  configured by the KAFKA_* variables alone. Every accepted record is published or
  suppressed, the published topic read back over TLS holds each once, and the consumer
  and the reader count them all.
- A client without the CA, one connecting by a name the certificate does not hold, and a
  plaintext client facing the TLS listener each fail in one line naming the setting to
  change, within seconds, from `splu produce`, `splu worker` and `splu query --topic`.
"""

from __future__ import annotations

import asyncio
import time
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w
from harness import Harness, adult_rows
from test_cli_errors import EXAMPLES, assert_one_line, clean_env, csv_input, run
from test_codecs import state
from test_consumer import wait_for

from deploy.certificates import TlsFiles, make_certificates
from deploy.embedded import KafkaBroker, TlsProxy, free_port
from service.core.kafka_settings import kafka_from_env
from streams.tools.produce import produce
from streams.tools.reader import read_publication
from streams.worker.closing import request_close

pytestmark = pytest.mark.stream

RECORDS = 1000
# Seconds a refused client may take to say so: it fails at its first connection.
REFUSAL_SECONDS = 15.0


@dataclass(frozen=True)
class TlsBroker:
    """The embedded broker behind a TLS proxy: clients reach it at `bootstrap` only."""

    bootstrap: str
    port: int
    files: TlsFiles

    def settings(self, **changes: str) -> dict[str, str]:
        """[kafka] settings of a client that trusts the CA, with `changes`."""
        return {
            "bootstrap": self.bootstrap, "security_protocol": "SSL",
            "ca_file": str(self.files.ca), **changes,
        }  # fmt: skip


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("kafka-tls")
    files = make_certificates(directory / "certificates", ["localhost"], days=1)
    port = free_port()
    broker = KafkaBroker(log_path=directory / "kafka.log", advertised=f"localhost:{port}")
    broker.start()
    proxy = TlsProxy(broker.port, files.certificate, files.key, directory, port=port)
    try:
        proxy.start()
        yield TlsBroker(f"localhost:{port}", port, files)
    finally:
        proxy.stop()
        broker.stop()


def test_a_stream_runs_end_to_end_over_tls(servers, tls_broker, tmp_path, monkeypatch):
    harness = Harness(
        servers, tmp_path, "adult-decoy.toml", row_column=False, reports={"fail_closed": []},
        kafka=tls_broker.settings(),
    )  # fmt: skip
    config = harness.config
    assert config.kafka.tls and config.kafka.ca_file == tls_broker.files.ca
    rows = adult_rows(config)[:RECORDS]
    harness.start_worker()
    harness.start_consumer()
    try:
        assert asyncio.run(produce(config, iter(rows), progress=False)) == RECORDS
        wait_for(
            lambda: asyncio.run(state(config))[0]["ingested"] == RECORDS,
            "the worker to take in every record over TLS",
        )
        asyncio.run(request_close(config))
        totals, _ = wait_for(
            lambda: (
                (s := asyncio.run(state(config)))[0]["published"] + s[0]["suppressed"] == RECORDS
                and sum(s[1].values()) == s[0]["published"]
                and s
            ),
            "every record published or suppressed, and counted by the consumer",
        )
        published = asyncio.run(harness.read_all(config.topics["published"]))
    finally:
        harness.stop()
    assert totals["ingested"] == RECORDS and totals["rejected"] == 0
    assert totals["published"] > RECORDS // 2
    assert len({m.key for m in published}) == totals["published"]

    # A downstream team's reader, configured by the environment alone.
    for variable in ("KAFKA_BOOTSTRAP", "KAFKA_SECURITY_PROTOCOL", "KAFKA_CA_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SSL")
    monkeypatch.setenv("KAFKA_CA_FILE", str(tls_broker.files.ca))
    assert kafka_from_env(tls_broker.bootstrap).tls
    publication = read_publication(config.name, tls_broker.bootstrap)
    assert publication.records == totals["published"]


def write_config(directory: Path, redis_url: str, kafka: dict[str, str]) -> Path:
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"].update(name=f"tls{uuid.uuid4().hex[:8]}", partitions=2)
    document["kafka"] = kafka
    document["redis"]["url"] = redis_url
    path = directory / "stream.toml"
    path.write_text(tomli_w.dumps(document))
    return path


REFUSALS = {
    # case: (how the client differs from one that trusts the CA, what the line names)
    "without the CA": ({"ca_file": None}, ("is not trusted", "KAFKA_CA_FILE")),
    "by a name the certificate lacks": (
        {"bootstrap": "127.0.0.1:{port}"}, ("does not name 127.0.0.1", "KAFKA_BOOTSTRAP"),
    ),
    "in plaintext": (
        {"security_protocol": "PLAINTEXT", "ca_file": None},
        ("plaintext", "KAFKA_SECURITY_PROTOCOL"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSALS)
@pytest.mark.parametrize("command", ["produce", "worker", "query"])
def test_a_refused_tls_connection_is_one_line_naming_the_setting(
    servers, tls_broker, tmp_path, command, case
):
    changes, names = REFUSALS[case]
    kafka = {k: v for k, v in {**tls_broker.settings(), **changes}.items() if v is not None}
    kafka["bootstrap"] = kafka["bootstrap"].format(port=tls_broker.port)
    env = clean_env()
    if command == "query":
        # A downstream reader has no config: the KAFKA_* variables name everything.
        env.update({f"KAFKA_{key.upper()}": value for key, value in kafka.items()})
        queries = tmp_path / "q.jsonl"
        queries.write_text('{"where": {"sex": "Female"}}\n')
        arguments = ["query", "--topic", "adult", "--queries", str(queries), "--output", "-"]
    else:
        arguments = [command, "--config", str(write_config(tmp_path, servers.redis_url, kafka))]
        if command == "produce":
            arguments += ["--input", str(csv_input(tmp_path))]
    started = time.monotonic()
    result = run(arguments, env, tmp_path)
    elapsed = time.monotonic() - started
    line = assert_one_line(result, *names)
    assert line.startswith(f"splu {command}: error:")
    assert elapsed < REFUSAL_SECONDS, (elapsed, line)
