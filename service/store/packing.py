"""Commands packed by hiredis's C encoder in redis-py's asyncio clients.

redis-py's synchronous connections pack a command with `hiredis.pack_command` when hiredis
is installed; its asyncio connections always pack in Python, argument by argument, and
a buffer step carries an argument per record. `packing_with_hiredis` gives
a client connection classes that pack with hiredis, which writes the same bytes and
refuses what redis-py's own packer refuses (a bool, None) with the same `DataError`.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import DataError

Client = TypeVar("Client", aioredis.Redis, aioredis.RedisCluster)


class HiredisPacking:
    """Mixed in before a redis-py asyncio connection class."""

    def pack_command(self, *args: Any) -> list[bytes]:
        # As redis-py's packer: a first argument such as "CONFIG GET" is two arguments.
        first = args[0]
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError as error:
            raise DataError(str(error)) from error


@functools.cache
def hiredis_packing(connection_class: type) -> type:
    """`connection_class` (plain, TLS or Unix socket) packing its commands with hiredis."""
    if issubclass(connection_class, HiredisPacking):
        return connection_class
    return type(connection_class.__name__, (HiredisPacking, connection_class), {})


def packing_with_hiredis(client: Client) -> Client:
    """`client`, whose connections, opened from now on, pack with hiredis. A cluster
    client opens its connections through the nodes it knows and the keyword arguments it
    gives the nodes it discovers (one dict, shared with its nodes manager)."""
    if isinstance(client, aioredis.RedisCluster):
        options, manager = client.connection_kwargs, client.nodes_manager
        options["connection_class"] = hiredis_packing(options["connection_class"])
        for node in (*manager.startup_nodes.values(), *manager.nodes_cache.values()):
            node.connection_class = hiredis_packing(node.connection_class)
    else:
        pool = client.connection_pool
        pool.connection_class = hiredis_packing(pool.connection_class)
    return client
