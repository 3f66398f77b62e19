"""Commands packed by hiredis (`service.store.packing`): the bytes redis-py's own packer
writes, and every connection a stream's client opens packs that way."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from deploy.embedded import RedisCluster
from service.core.config import load_config
from service.store.buffer import connect
from service.store.packing import HiredisPacking, hiredis_packing

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
COMMANDS = [
    ("EVALSHA", "a" * 40, 2, "splu:{s:0}:rec", b"splu:{s:0}:pool", 17, -3, 2**70, 1.5, 0.1),
    ("CONFIG GET", "maxmemory"),
    (b"CLIENT SETNAME", "w\u00e9"),
    ("HSET", b"\x00\r\n\xff", "", 1e20),
    ("EVALSHA", "b" * 40, 0, *(f"{i:032x}|1|Private|{i}" for i in range(500))),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_hiredis_writes_the_bytes_of_redis_pys_packer(command):
    python, hiredis = Connection(), hiredis_packing(Connection)()
    assert b"".join(hiredis.pack_command(*command)) == b"".join(python.pack_command(*command))


@pytest.mark.parametrize("argument", [True, None, object()])
def test_hiredis_refuses_what_redis_pys_packer_refuses(argument):
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", argument)
    with pytest.raises(DataError):
        hiredis_packing(Connection)().pack_command("SET", "k", argument)


@pytest.mark.parametrize("base", [Connection, SSLConnection, UnixDomainSocketConnection])
def test_every_kind_of_connection_keeps_its_kind(base):
    packed = hiredis_packing(base)
    assert issubclass(packed, base) and issubclass(packed, HiredisPacking)
    assert hiredis_packing(packed) is packed


async def _connections_after_round_trips(client: aioredis.Redis, keys: list[str]) -> list:
    script = client.register_script("return redis.call('SET', KEYS[1], ARGV[1])")
    async with client:
        for key in keys:
            await script(keys=[key], args=["v" * 100])
            assert await client.get(key) == b"v" * 100
        if isinstance(client, aioredis.RedisCluster):
            nodes = [*client.get_nodes(), *client.nodes_manager.startup_nodes.values()]
            return [c for node in nodes for c in node._connections]
        pool = client.connection_pool
        return [*pool._available_connections, *pool._in_use_connections]


def _stream_client(redis_url: str, cluster: bool) -> aioredis.Redis:
    example = load_config(EXAMPLES / "adult-decoy.toml")
    return connect(replace(example, redis_url=redis_url, redis_cluster=cluster))


@pytest.mark.redis
def test_a_streams_client_opens_only_hiredis_packing_connections(servers):
    client = _stream_client(servers.redis_url, cluster=False)
    connections = asyncio.run(_connections_after_round_trips(client, ["splu:{packing}:k"]))
    assert connections and all(isinstance(c, HiredisPacking) for c in connections)


@pytest.mark.redis
def test_a_cluster_client_packs_with_hiredis_on_every_node(tmp_path):
    cluster = RedisCluster(tmp_path / "redis", masters=3)
    cluster.start()
    try:
        keys = {cluster.master_of(f"k{i}").url: f"k{i}" for i in range(100)}
        assert len(keys) == 3
        client = _stream_client(cluster.url, cluster=True)
        connections = asyncio.run(_connections_after_round_trips(client, list(keys.values())))
    finally:
        cluster.stop()
    assert len(connections) >= 3 and all(isinstance(c, HiredisPacking) for c in connections)
