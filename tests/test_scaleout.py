"""Scale-out on Kafka partitions and a real Redis Cluster (issue 14; docs/scaling.md).

A 3-master Redis Cluster started here (`deploy.embedded.RedisCluster`, from the same server
binary as every Redis test; CI runs the decoy variant and the failover again on Debian's
redis-server, and personal.lua on both in test_buffer.py), 6 partitions,
3 worker processes and 2 consumer processes, all as their least-privilege ACL users (set
on every node). 20,000 Adult records stream in; mid-stream one worker and one consumer are
SIGKILLed and started again. Once the stream has settled it is closed (`splu close`'s
steps) after a survey's tail, a few hundred responses that leave each partition's pool
below its floor, and a worker is SIGKILLed again during the close. Then:

- exact accounting: every record ingested is published or suppressed (decoy records past
  max_wait, or that no group could take at the close), nothing pending, pooled below a
  floor or in flight: the close mixed the partitions' remainders, which live in other
  slots than the final pool, across the cluster;
- each published record under exactly one token: the topic's distinct tokens equal the
  workers' published count (a record taken twice would count twice, and the accounting
  above would not add up), whatever copies a crash re-sent, and every message sits in
  its token's partition;
- the consumers' counts, summed over their shards, equal the topic's distinct tokens;
- both consumers answer /estimate alike, and as `splu query` does on the published rows;
- on no node can the consumer's user list or count keys (RANDOMKEY, SCAN, KEYS, DBSIZE,
  INFO, CLUSTER COUNTKEYSINSLOT and GETKEYSINSLOT);
- /healthz and /readyz answer 200 on all five processes.

A second test kills the master of a partition's slot on a cluster with replicas and fails
over to its replica (CLUSTER FAILOVER FORCE), mid-stream: the worker and the consumer ride
through and nothing is lost, though that master is the only node they were told of.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from harness import RECORDS, Harness, adult_rows
from redis.exceptions import NoPermissionError
from test_consumer import BATCH_OPTIONS, random_queries, wait_for, write_published_csv

from deploy.embedded import (
    EmbeddedServers,
    RedisCluster,
    free_port,
    node_urls,
    service_user_envs,
    spawn_consumer,
    spawn_worker,
)
from service.cli import client
from service.cli.batch import main
from service.store.buffer import BufferState
from service.store.lifecycle import close_status
from service.store.running_counts import RunningCounts
from streams.runtime.app import ClusterMap, partition_of
from streams.runtime.topics import create_topics
from streams.tools.produce import produce
from streams.worker.closing import request_close

PARTITIONS = 6
WORKERS = 3
CONSUMERS = 2
RATE = 2_000  # records/s: the stream lasts ~10 s, time to kill processes mid-way
KILL_AT = 6_000  # records ingested when a worker and a consumer are SIGKILLed


@pytest.fixture(scope="module")
def cluster_servers(tmp_path_factory):
    with EmbeddedServers(tmp_path_factory.mktemp("cluster"), redis_cluster=3) as endpoints:
        assert endpoints.redis_cluster
        yield endpoints


def admin(harness: Harness) -> aioredis.RedisCluster:
    return aioredis.RedisCluster.from_url(harness.config.redis_url)


async def totals(harness: Harness) -> dict[str, int]:
    redis = admin(harness)
    try:
        return await harness.totals(redis)
    finally:
        await redis.aclose()


async def counted(harness: Harness) -> dict[str, int]:
    redis = admin(harness)
    try:
        return await RunningCounts(redis, harness.config).stats()
    finally:
        await redis.aclose()


def page(url: str) -> int:
    """The page's HTTP status, or 0 while nothing answers there."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except urllib.error.URLError:
        return 0


class Fleet:
    """The stream's worker and consumer processes, each with its health pages."""

    def __init__(
        self,
        harness: Harness,
        tmp_path: Path,
        workers: int,
        consumers: int,
        redis_url: str | None = None,
    ) -> None:
        """`redis_url`: the node the processes are told of (REDIS_URL), if not the
        harness's."""
        self.harness = harness
        env = harness.env if redis_url is None else {**harness.env, "REDIS_URL": redis_url}
        self.envs = service_user_envs(harness.config, env)
        self.logs = tmp_path
        self.worker_ports = [free_port() for _ in range(workers)]
        self.consumer_ports = [free_port() for _ in range(consumers)]
        self.workers = [self.start_worker(i) for i in range(workers)]
        self.consumers = [self.start_consumer(i) for i in range(consumers)]

    def start_worker(self, i: int):  # type: ignore[no-untyped-def]
        log = self.logs / f"worker-{i}.log"
        return spawn_worker(self.harness.path, self.envs["worker"], log, port=self.worker_ports[i])

    def start_consumer(self, i: int):  # type: ignore[no-untyped-def]
        log = self.logs / f"consumer-{i}.log"
        return spawn_consumer(self.harness.path, self.consumer_ports[i], self.envs["consumer"], log)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.consumer_ports]

    @property
    def pages(self) -> list[str]:
        ports = self.worker_ports + self.consumer_ports
        return [f"http://127.0.0.1:{port}" for port in ports]

    def stop(self) -> None:
        for process in self.consumers + self.workers:
            process.stop()


def settled_and_counted(
    harness: Harness, records: int = RECORDS
) -> tuple[dict[str, int], list, dict[bytes, bytes]]:
    """Once every record is published, suppressed or held below the floor, with nothing
    pending or in flight: the totals, every published message (copies included) and each
    distinct token's value, after checking that the accounting adds up, that the distinct
    tokens are the records published, and that the consumers counted each once."""
    final = wait_for(
        lambda: (
            (t := asyncio.run(totals(harness)))["settled"] == records
            and t["pending"] == t["in_flight"] == 0
            and t
        ),
        "every record published, suppressed or held below the floor",
    )
    assert final["ingested"] == records
    resolved = final["published"] + final.get("suppressed", 0)
    assert final["ingested"] == resolved + final["below_floor"]
    messages = asyncio.run(harness.read_all(harness.config.topics["published"]))
    distinct = {m.key: m.value for m in messages}
    assert len(distinct) == final["published"]
    wait_for(
        lambda: asyncio.run(counted(harness)).get("records") == len(distinct),
        "the consumers to count every distinct token",
    )
    return final, messages, distinct


TAIL = 300  # responses after the stream settled: fewer than any partition's floor


def close_through_a_kill(harness: Harness, fleet: Fleet) -> tuple[dict[str, int], list, dict]:
    """A survey's tail, then its close: SIGKILL a worker while the close goes on and start
    it again, then `settled_and_counted` once the close is complete: every record
    published or suppressed, none below a floor."""
    config = harness.config
    tail = adult_rows(config, start=RECORDS)[:TAIL]
    asyncio.run(produce(config, iter(tail), rate=RATE / 10, progress=False))
    below = wait_for(
        lambda: (
            (t := asyncio.run(totals(harness)))["settled"] == RECORDS + TAIL
            and t["pending"] == t["in_flight"] == 0
            and t["below_floor"]
        ),
        "the tail to settle below the floors",
    )
    assert 0 < below < PARTITIONS * config.mixing_pool
    asyncio.run(request_close(config))
    fleet.workers[1].kill()
    status = asyncio.run(close_state(harness))
    assert status["state"] == "closing", "the kill must come during the close"
    time.sleep(1.0)
    fleet.workers[1] = fleet.start_worker(1)
    status = wait_for(
        lambda: (s := asyncio.run(close_state(harness)))["state"] == "closed" and s, "the close"
    )
    final, messages, distinct = settled_and_counted(harness, RECORDS + TAIL)
    assert final["below_floor"] == final["pool"] == final["handoff"] == 0
    assert final["published"] + final["suppressed"] == RECORDS + TAIL
    assert status["remainder"]["records"] >= below  # mixed across the partitions' slots
    return final, messages, distinct


async def close_state(harness: Harness) -> dict:
    redis = admin(harness)
    try:
        return await close_status(BufferState(redis, harness.config))
    finally:
        await redis.aclose()


# Commands that list or count a node's keys, or a slot's.
LISTING = (
    ("RANDOMKEY",), ("SCAN", "0"), ("KEYS", "*"), ("DBSIZE",), ("INFO", "keyspace"),
    ("CLUSTER", "COUNTKEYSINSLOT", "0"), ("CLUSTER", "GETKEYSINSLOT", "0", "10"),
)  # fmt: skip


async def listings(config, env: dict[str, str]) -> list[str]:  # type: ignore[no-untyped-def]
    """The listing commands the consumer's user could run on some node of the cluster."""
    allowed = []
    for url in node_urls(config):
        node = aioredis.from_url(
            url, username=env["REDIS_USERNAME"], password=env[config.redis_password_env]
        )
        try:
            for command in LISTING:
                try:
                    await node.execute_command(*command)
                except NoPermissionError:
                    continue
                allowed.append(f"{' '.join(command)} on {url}")
        finally:
            await node.aclose()
    return allowed


WARM_UP = 500  # records ingested before the paced stream starts


def produce_in_background(harness: Harness, fleet: Fleet, rate: float = RATE) -> threading.Thread:
    """The paced stream, once every worker has partitions and a first few records went in:
    group joins take seconds each, and a paced stream started before them would be over
    by the time the workers read it, leaving no mid-stream moment for the kills."""
    for port in fleet.worker_ports:
        wait_for(lambda p=port: page(f"http://127.0.0.1:{p}/readyz") == 200, "a worker ready")
    rows = adult_rows(harness.config)
    asyncio.run(produce(harness.config, iter(rows[:WARM_UP]), progress=False))
    wait_for(
        lambda: asyncio.run(totals(harness)).get("ingested", 0) >= WARM_UP, "the warm-up records"
    )
    paced = rows[WARM_UP:]
    thread = threading.Thread(
        target=lambda: asyncio.run(produce(harness.config, iter(paced), rate=rate, progress=False))
    )
    thread.start()
    return thread


@pytest.mark.parametrize(
    "mechanism",
    [
        pytest.param("decoy", marks=pytest.mark.redis),
        pytest.param("personal", marks=pytest.mark.stream),
    ],
)
def test_three_workers_and_two_consumers_on_a_redis_cluster_through_kills(
    cluster_servers, tmp_path, mechanism
):
    harness = Harness(
        cluster_servers, tmp_path, f"adult-{mechanism}.toml", row_column=False,
        reports={"fail_closed": []}, partitions=PARTITIONS,
    )  # fmt: skip
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    fleet = Fleet(harness, tmp_path, WORKERS, CONSUMERS)
    try:
        # On every node the consumer can neither list nor count keys (issue 30).
        assert asyncio.run(listings(config, fleet.envs["consumer"])) == []
        producer = produce_in_background(harness, fleet)
        ingested = wait_for(
            lambda: (n := asyncio.run(totals(harness)).get("ingested", 0)) >= KILL_AT and n,
            "records to arrive",
        )
        fleet.workers[0].kill()
        fleet.consumers[0].kill()
        assert ingested < RECORDS, "the kills must come mid-stream"
        time.sleep(1.0)
        fleet.workers[0] = fleet.start_worker(0)
        fleet.consumers[0] = fleet.start_consumer(0)
        producer.join()

        final, messages, distinct = settled_and_counted(harness)
        assert final.get("rejected", 0) == 0
        assert final["below_floor"] < PARTITIONS * config.mixing_pool
        final, messages, distinct = close_through_a_kill(harness, fleet)
        # Copies a killed worker re-sent sit in the partition of their token, with the first.
        assert all(m.partition == partition_of(m.key, PARTITIONS) for m in messages)

        for url in fleet.pages:
            assert page(f"{url}/healthz") == 200, url
            wait_for(lambda u=url: page(f"{u}/readyz") == 200, f"{url}/readyz")

        # Both consumers answer for every shard, alike, and as `splu query` does.
        statuses = [
            wait_for(
                lambda u=url: (s := client.status(u))["consumer"]["records"] == len(distinct) and s,
                f"{url} to include every count",
            )
            for url in fleet.urls
        ]
        assert all(s["worker"]["ingested"] == RECORDS + TAIL for s in statuses)
        write_published_csv(
            tmp_path / "published.csv", config, [json.loads(v) for v in distinct.values()]
        )
        queries = random_queries(config, 40, seed=14)
        (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
        options = list(BATCH_OPTIONS[mechanism])
        if mechanism == "personal":
            options += ["--merge-map", str(harness.merge_map)]
        assert main([
            "query", "--published", str(tmp_path / "published.csv"), *options,
            "--queries", str(tmp_path / "q.jsonl"), "--output", str(tmp_path / "batch.jsonl"),
        ]) == 0  # fmt: skip
        batch = [json.loads(line) for line in (tmp_path / "batch.jsonl").read_text().splitlines()]
        answers = [client.ask(url, queries) for url in fleet.urls]
        assert answers[0] == answers[1]
        for query, expected, answer in zip(queries, batch, answers[0], strict=True):
            for field in ("estimate", "low", "high"):
                assert answer.get(field) == expected.get(field), (query, expected, answer)
    finally:
        fleet.stop()


@pytest.mark.redis
def test_a_process_learns_every_node_of_the_cluster_as_it_starts(tmp_path):
    """A cluster client knows only the node its URL names until it reads the cluster's map.
    A process reads it as it starts (`streams.runtime.app.ClusterMap`), so a command it sends only
    after that node failed still finds its slot's master. Before, a consumer that had
    counted nothing yet when the failover test killed that node failed every command."""
    cluster = RedisCluster(tmp_path / "redis", masters=3)
    cluster.start()
    try:
        seed = cluster.nodes[0]
        key = next(
            key for key in (f"key-{i}" for i in range(100)) if cluster.master_of(key) is not seed
        )

        async def set_after_the_seed_died() -> None:
            client = aioredis.RedisCluster.from_url(seed.url)
            try:
                await ClusterMap(client).on_start()
                seed.kill()
                await client.set(key, "value")
            finally:
                await client.aclose()

        asyncio.run(set_after_the_seed_died())
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("replicated")
    with EmbeddedServers(directory, redis_cluster=3, cluster_replicas=1) as endpoints:
        yield endpoints


@pytest.mark.redis
def test_a_worker_and_a_consumer_ride_through_a_master_failover(replicated_cluster, tmp_path):
    """Kill the master of partition 0's slot mid-stream, promote its replica with CLUSTER
    FAILOVER FORCE, start the old master again (it follows the new one): no process exits,
    and every record is accounted for and counted. The stream confirms each write with one
    replica (`replica_acks = 1`, Redis WAIT) before it commits an offset or publishes, so
    the replica holds whatever was relied on.

    That master is the node the processes' REDIS_URL names, the one a cluster client first
    asks for the cluster's map: a process must have learnt the other nodes from it by the
    time it fails, also one (the consumer) that had sent no command yet."""
    harness = Harness(
        replicated_cluster, tmp_path, "adult-decoy.toml", row_column=False,
        reports={"fail_closed": []}, redis_settings={"replica_acks": 1},
    )  # fmt: skip
    config = harness.config
    cluster = replicated_cluster.redis
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    slot_key = f"splu:{{{config.name}:0}}"
    master = cluster.master_of(slot_key)
    fleet = Fleet(harness, tmp_path, workers=1, consumers=1, redis_url=master.url)
    try:
        # Slower: the failover must come well before the stream's end.
        producer = produce_in_background(harness, fleet, rate=RATE / 2)
        wait_for(
            lambda: asyncio.run(totals(harness)).get("ingested", 0) >= KILL_AT,
            "records to arrive",
        )
        replica = cluster.replica_of(master)
        assert replica is not None
        master.kill()
        replica.client().cluster("failover", "force")
        wait_for(lambda: cluster.master_of(slot_key) is replica, "the replica to take over", 30)
        assert producer.is_alive(), "the failover came after the stream's end"
        # The new master has no replica to confirm writes until the old one is back: the
        # stream waits (nothing relies on a write only one node holds), then goes on.
        master.start()
        wait_for(lambda: cluster.replica_of(replica) is master, "the old master to follow", 30)
        cluster.wait_until_ok()
        producer.join()

        settled_and_counted(harness)
        for process in fleet.workers + fleet.consumers:
            assert process.running, f"exited with {process.returncode}"
    finally:
        fleet.stop()
