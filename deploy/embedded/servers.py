"""The servers a stream needs, started here unless the environment names others."""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from deploy.embedded.kafka_broker import KafkaBroker
from deploy.embedded.redis_server import RedisCluster, RedisServer
from service.core.config import REDIS_CLUSTER_ENV, env_flag

logger = logging.getLogger("splu.deploy")

KAFKA_BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP"
REDIS_URL_ENV = "REDIS_URL"


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
