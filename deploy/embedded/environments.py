"""What a stream's processes run with: their environments (servers, service key, each
role's Redis user), and the worker and consumer launched as children."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

from deploy.embedded.processes import ManagedProcess, spawn
from deploy.embedded.servers import Endpoints
from service.core.config import REDIS_CLUSTER_ENV, StreamConfig
from service.store.buffer import ROLES, acl_rules, node_url

# The command that runs splu: this Python's, so that a child runs the code its parent does.
SPLU = (sys.executable, "-m", "streams.cli")


def stream_env(servers: Endpoints) -> dict[str, str]:
    """The environment of a stream's processes on these servers, with a fresh service key:
    this process's own, with the servers' addresses and the key over it. This process's
    environment stays as it is; a caller that loads the config or draws with the key here
    passes it on (`os.environ.update`) itself."""
    return {
        **os.environ,
        "SPLU_SERVICE_KEY": secrets.token_hex(32),
        "KAFKA_BOOTSTRAP": servers.kafka_bootstrap,
        "REDIS_URL": servers.redis_url,
        REDIS_CLUSTER_ENV: "1" if servers.redis_cluster else "0",
    }


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
    splu: Sequence[str] = SPLU,
) -> ManagedProcess:
    """Start `splu worker --config config_path` as spawn() starts a command; with a port, its
    health pages on loopback. `splu`: the command that runs splu."""
    command = [*splu, "worker", "--config", str(config_path)]
    pages = [] if port is None else ["--port", str(port)]
    return spawn([*command, "--loglevel", loglevel, *pages], env, log_path)


def spawn_consumer(
    config_path: str | Path,
    port: int,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    loglevel: str = "warn",
    splu: Sequence[str] = SPLU,
) -> ManagedProcess:
    """Start `splu consumer --config config_path --port port` on loopback, as spawn() does.
    `splu`: the command that runs splu."""
    command = [*splu, "consumer", "--config", str(config_path)]
    options = ["--host", "127.0.0.1", "--port", str(port), "--loglevel", loglevel]
    return spawn([*command, *options], env, log_path)
