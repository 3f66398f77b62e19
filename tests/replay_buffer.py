"""The replay harness of issue 35: the Redis buffer as it was before the worker took over
its decisions (`BASELINE`, read from the repository's history) and the buffer of this
checkout, driven with the same records, clock and entropy, and compared by what they
publish. Kept until the new buffer is trusted; then it and `BASELINE` go together.

Each side runs on its own stream name in one Redis, so their keys never meet. A step is
an ingest of a batch (or a tick) at a virtual time, then every take the mixing rule
allows and its acknowledgement, as the worker's emission round does. What a side
publishes is the sequence of its takes, each the list of (public codes, published codes)
of its records in the order drawn: tokens are left out, as the new buffer may derive them
otherwise from the same seed.
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import redis.asyncio as aioredis

from service.core.config import StreamConfig
from service.core.ingest import PreparedBatch
from service.core.prf import ServiceKey
from service.core.wire import PoolEntry
from service.store.buffer import StreamBuffer

BASELINE = "24bfd42"  # main before issue 35 changed the buffer
ROOT = Path(__file__).resolve().parent.parent
TAKE_LIMIT = 20_000


def baseline_buffer_module(directory: Path) -> ModuleType:
    """`service/store/buffer.py` and its Lua scripts as of BASELINE, extracted under
    `directory` and imported under another name; its scripts are read from there."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BASELINE, "service/store"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    store = directory / "service" / "store"
    spec = importlib.util.spec_from_file_location("baseline_buffer", store / "buffer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

    def lua_script(*names: str) -> str:
        return "".join((store / "lua" / f"{name}.lua").read_text() for name in names)

    module.lua_script = lua_script  # type: ignore[attr-defined]
    return module


Step = tuple[int, int, PreparedBatch | None, int]  # partition, now_ms, batch or tick, through


async def publications(buffer: Any, steps: Iterable[Step]) -> list[list[tuple[bytes, bytes]]]:
    """Run `steps` on `buffer`, each followed by every take it allows and the take's
    acknowledgement; the takes in order, each its records' (public, published) codes."""
    takes = []
    for partition, now, batch, through in steps:
        await buffer.ingest(partition, batch, now, through)
        while items := await buffer.take(partition, now, TAKE_LIMIT):
            entries = [PoolEntry.parse(entry) for _, entry in items]
            takes.append([(entry.public, entry.published) for entry in entries])
            # This checkout's buffer acknowledges takes, the baseline's tokens.
            tokens = [token for token, _ in items]
            await buffer.acknowledge(partition, items if hasattr(items, "takes") else tokens, now)
    return takes


async def pooled(buffer: Any) -> list[tuple[bytes, bytes]]:
    """(public, published) of every record left in `buffer`'s pools, whichever layout the
    pool has (the baseline's sorted set, or a hash)."""
    out = []
    for partition in range(buffer.config.partitions):
        key = f"{buffer.prefix(partition)}:pool"
        kind = await buffer.client.type(key)
        if kind == b"zset":
            entries = await buffer.client.zrange(key, 0, -1)
        else:
            entries = await buffer.client.hvals(key) if kind == b"hash" else []
        out += [(e.public, e.published) for e in map(PoolEntry.parse, entries)]
    return out


async def replay_both(
    client: aioredis.Redis,
    config: StreamConfig,
    key: ServiceKey,
    steps: list[Step],
    entropy: Callable[[], Callable[[int], str]],
    directory: Path,
) -> tuple[list, list, list, list, dict[str, int], dict[str, int]]:
    """What the baseline and this checkout's buffer publish from the same `steps`, each
    with a fresh `entropy()` of the same seed, what each leaves in its pools, and their
    counters summed over partitions."""
    baseline = baseline_buffer_module(directory)
    old_config = replace(config, name=f"{config.name}o")
    new_config = replace(config, name=f"{config.name}n")
    old = baseline.StreamBuffer(client, old_config, key, entropy=entropy())
    new = StreamBuffer(client, new_config, key, entropy=entropy())
    old_takes = await publications(old, steps)
    new_takes = await publications(new, steps)
    return (
        old_takes, new_takes, await pooled(old), await pooled(new),
        await old.totals(), await new.totals(),
    )  # fmt: skip
