"""The Redis buffer between the raw and the published topic (SPEC §3).

Per partition, all state lives under the prefix ``splu:{<stream>:<partition>}``;
the braces make it a Redis Cluster hash tag, so one slot holds a partition's
keys and every step below is a single atomic Lua call (scripts in
``service/store/lua``, registered once). The partition is the raw topic's, except in a
personal stream, whose buffers are those of ``<stream>.grouped``, the topic that
holds each personal group in one partition (`StreamBuffer.grouped_messages`);
there the raw partition of the same number keeps only its gate (``close.lua``).
What reaches a buffer has passed the stream's gate and identity screen
(`service.store.lifecycle`):

- ``ingest``: store a batch idempotently and cut/release every group it
  allows, randomizing members and handing them to the mixing pool; records
  that waited past ``max_wait`` are suppressed (decoy) or released (personal);
- ``take``: move records from the mixing pool to a take in flight, for
  publication, by the mixing rule of ``emit.lua``: only the excess over the pool's
  floor, drawn uniformly and shuffled from 128 fresh bits of OS randomness per
  take, which also give the records' tokens; a quiet pool leaves whole only if it
  holds at least the floor; at a survey's close a pool of at least the floor leaves
  whole, and the stream's final pool (`FINAL_POOL`), every partition's remainder,
  leaves whole once all are in;
- ``acknowledge``: forget takes the broker acknowledged, and count their records,
  with their true values, into the truth tallies of the adversary test (kept for one
  to two ``reports.truth_retention`` periods), and their delays. Whatever is still
  in flight after a crash is re-sent with the same tokens.

What the consumer (the web-facing process) may read is `BufferState`: counters,
gauges and aggregates, never a record; `acl_rules` enforces it in Redis.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from hashlib import shake_128
from importlib import resources
from itertools import chain
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from service.core.config import StreamConfig
from service.core.decoy_cuts import Arrivals, DecoyPartition, DecoyStep, Waiting
from service.core.guarantees import budget_level, trial_limit
from service.core.ingest import PreparedBatch
from service.core.prf import ServiceKey
from service.core.takes import MixingPool, shuffle_digests
from service.core.wire import truth_cells_and_arrivals
from service.store.packing import packing_with_hiredis

# Upper bounds of the delay histogram in ms (`StreamBuffer.acknowledge` counts with these).
# Slow streams wait for the mixing pool's floor to fill, so the bounds reach a day.
DELAY_BOUNDS_MS = (
    100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000, 900000,
    3600000, 14400000, 86400000,
)  # fmt: skip
# Counters every partition reports, 0 until a script first counts one.
COUNTERS = ("ingested", "published", "suppressed", "rejected", "redelivered", "conflicts")
# Fresh OS randomness behind each take's shuffle and tokens: 128 bits, beyond any search.
SHUFFLE_SEED_BYTES = 16
TOKEN_HEX = 32  # an emission token: 128 bits, as hex (`take_tokens`)
TAKE_SEPARATOR = b"\n"  # between the entries of a take in flight (emit.lua)
# The stream's final pool, where a closed stream's partitions leave the remainders below
# their floor to be mixed together (SPEC §3, a survey's end; `service.store.lifecycle`). It is
# taken, acknowledged and re-sent like a partition's pool, by the owner of partition 0.
FINAL_POOL = -1


def _csv(codes: list[int]) -> bytes:
    return b",".join(b"%d" % c for c in codes)


# What each process does in Redis, as ACL rules: data commands only (the Lua steps run
# with the caller's permissions), scripts by hash, nothing dangerous (KEYS, FLUSHALL,
# CONFIG, DEBUG, MONITOR, SLOWLOG ...), and only the stream's own keys.
_ACL_COMMANDS = (
    "-@all +@read +@write +@transaction -@dangerous +evalsha +eval +script|load "
    "+script|exists +ping +hello"
)
# A cluster client reads the slot map (CLUSTER SLOTS) from any node and the command
# table (COMMAND) to find the keys of each command; replica_acks needs WAIT.
_ACL_CLUSTER_COMMANDS = " +cluster|slots +command"
_ACL_REPLICA_COMMANDS = " +wait"
ROLES = ("worker", "consumer")
# Keys of a partition the consumer may read: counters and gauges, the delay histogram and
# the close's state. Never a record, a bucket, the pool, a take in flight, a
# fingerprint, nor a tally or aggregate of true values (the truth tallies, personal group
# counts, suppression per value): the privacy tests that need those run in the worker
# (`service.store.auditor`), and the consumer reads their verdicts.
CONSUMER_READS = ("stats", "waiting", "delay", "close")
# Commands the consumer may not run though they read: they list or count key names, which
# say which personal groups hold trials of which values (KEYS is dangerous already; INFO,
# whose keyspace section counts keys, is never granted to it).
CONSUMER_DENIED = "-scan -randomkey -dbsize"


def acl_rules(config: StreamConfig, role: str) -> str:
    """The ACL SETUSER rules (without password) for a stream's worker or consumer."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    stream = config.name
    commands = _ACL_COMMANDS + (_ACL_CLUSTER_COMMANDS if config.redis_cluster else "")
    commands += _ACL_REPLICA_COMMANDS if config.redis_replica_acks else ""
    if role == "worker":
        # INFO: the server's memory, which the worker's audit reports (`service.store.auditor`).
        keys = f"~splu:{{{stream}:* ~splu:{{{stream}}}:*"
        return f"reset on resetchannels {keys} {commands} +info"
    reads = " ".join(f"%R~splu:{{{stream}:*}}:{key}" for key in CONSUMER_READS)
    # Its own counts ("consumer*": one shard per published partition), and what the worker
    # tells it: the pause flag, the close, the audit.
    own = f"~splu:{{{stream}:consumer*" + "".join(
        f" %R~splu:{{{stream}}}:{key}" for key in ("paused", "close", "audit")
    )
    return f"reset on resetchannels {reads} {own} {commands} {CONSUMER_DENIED}"


def connect(config: StreamConfig) -> aioredis.Redis:
    """A client for the stream's Redis with its ACL user, password and TLS settings: a
    cluster client (`[redis] cluster`, REDIS_CLUSTER) routes each command and script by its
    keys, all in one slot per call (the hash tags above)."""
    if config.redis_cluster:
        cluster = aioredis.RedisCluster.from_url(config.redis_url, **config.redis_options())
        return packing_with_hiredis(cluster)  # type: ignore[return-value]
    return node_client(config, config.redis_url)


def node_client(config: StreamConfig, url: str) -> aioredis.Redis:
    """A client of the one Redis node at `url`, with the stream's credentials and TLS."""
    return packing_with_hiredis(aioredis.from_url(url, **config.redis_options()))


def node_url(url: str, host: str, port: int) -> str:
    """`url` (its scheme, credentials and database) pointed at another node's host:port."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{user}@" * bool(user) + f"{host}:{port}"))


class ReplicationError(redis_errors.RedisError):
    """A master's replicas did not confirm its writes in time, or the master changed."""


# Milliseconds a master's replicas get to confirm; past them the step is retried.
REPLICA_TIMEOUT_MS = 5000


class Replication:
    """Confirms that a master's replicas hold every write it acknowledged (`[redis]
    replica_acks`), before the stream relies on them: before a raw offset is committed,
    a record published, or a published offset committed.

    Redis replicates asynchronously, so a failover can lose a master's last writes. WAIT
    blocks until replicas reached the replication offset of the calling connection's last
    write, and that offset grows with every write the master took, from any connection:
    one write of our own (in the slot of `key`, so a master that lost the slot answers
    MOVED) and a WAIT on one connection cover every write made before it.
    """

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        self.client = client
        self.config = config
        self.replicas = config.redis_replica_acks
        self._links: dict[str, aioredis.Redis] = {}

    def _link(self, key: str) -> aioredis.Redis:
        """A client of the master of `key`'s slot alone (a cluster client would route the
        keyless WAIT to any node)."""
        if not isinstance(self.client, aioredis.RedisCluster):
            name, url = "", self.config.redis_url
        else:
            node = self.client.get_node_from_key(key)
            name, url = node.name, node_url(self.config.redis_url, node.host, node.port)
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = node_client(self.config, url)
        return link

    async def confirm(self, key: str) -> None:
        """Return once `replicas` replicas hold every write the master of `key` took so
        far; raise ReplicationError (retried as an outage) if they do not in time."""
        if not self.replicas:
            return
        try:
            # A pipeline: the write and the WAIT on one connection, in order.
            async with self._link(key).pipeline(transaction=False) as pipe:
                pipe.incr(f"{key}:replicated")
                pipe.wait(self.replicas, REPLICA_TIMEOUT_MS)
                _, acknowledged = await pipe.execute()
        except redis_errors.RedisError as err:
            if isinstance(self.client, aioredis.RedisCluster):
                # The master died or lost the slot: learn where the slot is now.
                with suppress(redis_errors.RedisError, redis_errors.RedisClusterException):
                    await self.client.nodes_manager.initialize()
            raise ReplicationError(f"confirming replication of {key}: {err}") from err
        if acknowledged < self.replicas:
            raise ReplicationError(
                f"{acknowledged} of {self.replicas} replicas confirmed the writes to {key} "
                f"within {REPLICA_TIMEOUT_MS} ms"
            )


class RedisUnavailableError(ConnectionError):
    """The stream's Redis cannot be used: nothing answers, or it refuses the user."""


class RedisRefusedError(RedisUnavailableError):
    """Redis answers but refuses the stream's user: waiting will not help."""


async def check_redis(config: StreamConfig) -> None:
    """Raise RedisUnavailableError, one line naming what to change, unless Redis answers
    the stream's user: a process should not start only to retry forever."""
    client = connect(config)
    where = config.redis_url.rpartition("@")[2]
    try:
        await client.ping()
    except redis_errors.AuthenticationError:
        user = config.redis_username or "default"
        source = config.redis_password_env or "no password_env"
        raise RedisRefusedError(
            f"Redis at {where} refused user {user!r} with the password from {source}: set "
            "REDIS_USERNAME and the password variable ([redis] username, password_env)"
        ) from None
    except redis_errors.ResponseError as err:
        raise RedisRefusedError(f"Redis at {where} refused the stream's user: {err}") from None
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
        raise RedisUnavailableError(
            f"no Redis answers at {where}: start one (`splu up` runs an embedded one) or set "
            "REDIS_URL or [redis] url in the stream's config"
        ) from None
    finally:
        await client.aclose()


def lua_script(*names: str) -> str:
    scripts = resources.files("service.store").joinpath("lua")
    return "".join(scripts.joinpath(f"{name}.lua").read_text() for name in names)


def shuffle_blocks(seed: str, count: int) -> str:
    """What emit.lua hashes for the shuffle of a take of `count` records, hashed here
    instead: Redis is the pipeline's busiest process, and hashing would be most of its
    work in a take. The take's blocks (`shuffle_digests`) as hex; emit.lua hashes
    whatever more it needs."""
    return shuffle_digests(seed, max(count, 0)).hex()


def take_tokens(seed: str, count: int) -> list[str]:
    """The tokens of a take's `count` records, in the order drawn: consecutive 128-bit
    slices of SHAKE-128(seed:tokens), as hex. One keystream per take; unpredictable
    without the seed, which never leaves the worker and Redis, and unique as 128-bit
    random strings are. A take re-sent after a crash derives the same ones."""
    stream = shake_128(seed.encode() + b":tokens").hexdigest(TOKEN_HEX // 2 * count)
    return [stream[start : start + TOKEN_HEX] for start in range(0, len(stream), TOKEN_HEX)]


class Emission(list[tuple[str, bytes]]):
    """Records to publish, (token, entry) in publication order: one take, or every take a
    partition has in flight (`StreamBuffer.in_flight`). `takes` maps each take's id to
    its entries; the acknowledgement forgets those takes whole and counts their records."""

    def __init__(
        self,
        items: Iterable[tuple[str, bytes]] = (),
        takes: Mapping[str, list[bytes]] | None = None,
    ) -> None:
        super().__init__(items)
        self.takes = dict(takes or {})

    @classmethod
    def of_take(cls, take_id: str, entries: list[bytes]) -> Emission:
        """One take's entries, in the order drawn, under the tokens its id derives."""
        tokens = take_tokens(take_id, len(entries))
        return cls(zip(tokens, entries, strict=True), {take_id: entries})


def takes_in_flight(takes: Mapping[bytes, bytes]) -> Emission:
    """The records of takes in flight as Redis holds them (':takes', take id → its entries,
    emit.lua), under the tokens their takes derive, in the order drawn."""
    emission = Emission()
    for take_id, joined in takes.items():
        take = Emission.of_take(take_id.decode(), joined.split(TAKE_SEPARATOR))
        emission += take
        emission.takes |= take.takes
    return emission


def acknowledgement(take_id: str, entries: list[bytes], now_ms: int) -> list:
    """What acknowledge.lua adds for one take of `entries` published at `now_ms`: the take's
    id, the numbers of its true cells, shown cells and delay fields, then (cell, records)
    pairs of each tally (`service.core.wire.truth_cells_and_arrivals`) and (field, count)
    pairs of the delay histogram (`DELAY_BOUNDS_MS`, "count", "sum_ms")."""
    totals = truth_cells_and_arrivals(entries)
    # Records stored by one ingest call share their arrival, so a take holds few distinct ones.
    delays: Counter[str] = Counter(count=len(entries))
    total_ms = 0
    for arrival, count in totals.arrivals.items():
        delay = max(now_ms - int(arrival), 0)
        bucket = bisect.bisect_left(DELAY_BOUNDS_MS, delay)
        delays["+Inf" if bucket == len(DELAY_BOUNDS_MS) else str(DELAY_BOUNDS_MS[bucket])] += count
        total_ms += delay * count
    delays["sum_ms"] = total_ms
    fields: list = [take_id, len(totals.true), len(totals.shown), len(delays)]
    for counts in (totals.true, totals.shown, delays):
        fields += chain.from_iterable(counts.items())
    return fields


@dataclass(frozen=True)
class IngestOutcome:
    """Per record: 0 stored, 1 redelivered (ignored), 2 id reused with other content."""

    statuses: list[int]
    pending: int
    pool: int


class FencedError(RuntimeError):
    """A newer worker claimed the partition (a rebalance gave it away): this worker must no
    longer write it. Not a Redis error, so no step retries it."""


class BufferState:
    """What the consumer and operators may read of a stream's buffers: counters, gauges,
    the delay histogram, the close, and the audit's verdicts (`service.store.auditor`).

    Needs no service key and reads no record nor anything computed from true values
    (`CONSUMER_READS`); nothing here changes what gets published, except the stream-wide
    pause flag, which the audit raises when a privacy test fails (fail closed).
    """

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        self.client = client
        self.config = config
        self.replication = Replication(client, config)

    def prefix(self, partition: int) -> str:
        """The keys of a partition's buffer, or of the stream's final pool (FINAL_POOL)."""
        if partition == FINAL_POOL:
            return f"splu:{{{self.config.name}:final}}"
        return f"splu:{{{self.config.name}:{partition}}}"

    def shard_prefix(self, shard: int) -> str:
        """The keys of one shard of the stream's record ids (`service.store.lifecycle`)."""
        return f"splu:{{{self.config.name}:ids:{shard}}}"

    @property
    def close_key(self) -> str:
        """The stream's close request: when it was asked for, and when it completed."""
        return f"splu:{{{self.config.name}}}:close"

    @property
    def pause_key(self) -> str:
        return f"splu:{{{self.config.name}}}:paused"

    @property
    def audit_key(self) -> str:
        """The last audit's publishable record (`service.store.auditor`)."""
        return f"splu:{{{self.config.name}}}:audit"

    async def audit(self) -> dict[str, Any] | None:
        """The last audit: its time, the tests' verdicts and publishable numbers, and the
        server's memory; None before the first."""
        record = await self.client.get(self.audit_key)
        return None if record is None else json.loads(record)

    async def paused(self) -> str | None:
        """Why publishing is paused, or None."""
        reason = await self.client.get(self.pause_key)
        return None if reason is None else reason.decode()

    async def pause(self, reason: str | None) -> None:
        """Pause publishing with a reason, or resume it with None."""
        if reason is None:
            await self.client.delete(self.pause_key)
        else:
            await self.client.set(self.pause_key, reason)

    async def stats(self, partition: int) -> dict[str, int]:
        """Counters and gauges of one partition (or of the final pool): `pending` (records
        waiting for a group or release, of which `held` wait for a group-mate), `pool`,
        `in_flight`, `handoff` (a closed partition's remainder on its way to the final
        pool), `undecodable` (raw batches holding the partition, `streams.worker.undecodable`),
        `expired`, and `below_floor`: the pool while it holds fewer than
        `stream.mixing_pool` records, which the mixing rule never releases alone (they wait
        for more records, or for the stream's close), and `settled`: published, suppressed
        or below the floor."""
        prefix = self.prefix(partition)
        # One transaction: a snapshot between two Lua steps, so the counts add up. The
        # waiting gauges expire with the records they count (record_ttl).
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(f"{prefix}:stats")
            pipe.hgetall(f"{prefix}:waiting")
            counters, waiting = await pipe.execute()
        out = {k.decode(): int(v) for k, v in (counters | waiting).items()}
        for name in ("pending", "held", "pool", "in_flight", "handoff", "undecodable", *COUNTERS):
            out.setdefault(name, 0)
        # Records a record TTL removed before they were published or suppressed.
        resolved = out.get("published", 0) + out.get("suppressed", 0)
        came = out.get("ingested", 0) + out.get("received", 0) - out.get("handed_off", 0)
        waiting_now = out["pending"] + out["pool"] + out["in_flight"] + out["handoff"]
        out["expired"] = max(came - resolved - waiting_now, 0)
        out["below_floor"] = out["pool"] if out["pool"] < self.config.mixing_pool else 0
        # Records the stream has nothing more to do for until more arrive.
        out["settled"] = resolved + out["below_floor"]
        return out

    async def totals(self) -> dict[str, int]:
        """`stats` summed over every partition of the stream and its final pool, with the
        re-sends and reused ids its identity shards caught (`service.store.lifecycle`)."""
        totals: dict[str, int] = {}
        for partition in [*range(self.config.partitions), FINAL_POOL]:
            for name, value in (await self.stats(partition)).items():
                totals[name] = totals.get(name, 0) + value
        for shard in range(self.config.partitions):
            counters = await self.client.hgetall(f"{self.shard_prefix(shard)}:stats")
            for name, value in counters.items():
                totals[name.decode()] = totals.get(name.decode(), 0) + int(value)
        return totals

    async def count_rejected(
        self, counts: Mapping[int, int], closed: Mapping[int, int] | None = None
    ) -> None:
        """Add records sent to the rejected topic, per partition, and of them those that
        came after the partition's close (`rejected_closed`)."""
        # One call per partition: a cluster pipeline may not span slots in every client.
        for partition, n in counts.items():
            key = f"{self.prefix(partition)}:stats"
            await self.client.hincrby(key, "rejected", n)
            if closed and closed.get(partition):
                await self.client.hincrby(key, "rejected_closed", closed[partition])

    async def delays(self, partitions: Iterable[int] | None = None) -> dict[str, int]:
        """The emission-delay histogram summed over `partitions` (default: all of the
        stream's, and its final pool): non-cumulative counts per upper bound in ms (and
        "+Inf"), plus "count" and "sum_ms"."""
        out: dict[str, int] = {}
        every = [*range(self.config.partitions), FINAL_POOL]
        for partition in every if partitions is None else partitions:
            for field, count in (
                await self.client.hgetall(f"{self.prefix(partition)}:delay")
            ).items():
                out[field.decode()] = out.get(field.decode(), 0) + int(count)
        return out


class StreamBuffer(BufferState):
    """One stream's buffers in Redis, for the partitions a worker owns."""

    def __init__(
        self,
        client: aioredis.Redis,
        config: StreamConfig,
        key: ServiceKey,
        entropy: Callable[[int], str] = secrets.token_hex,
    ) -> None:
        """`entropy(n)` gives n fresh random bytes as hex for each take; only tests that
        need a reproducible run replace the operating system's."""
        super().__init__(client, config)
        self._entropy = entropy
        # Records in each partition's pool when this worker last stored or took there: how
        # many shuffle blocks a take will need (`shuffle_blocks`).
        self._pooled: dict[int, int] = {}
        # Every step that writes a partition's buffer passes its owner fence (fence.lua).
        self._ingest = client.register_script(
            lua_script(
                "fence", "fingerprints", "uniforms", "pool", "ingest", *config.spec.stream_scripts
            )
        )
        self._take = client.register_script(lua_script("fence", "uniforms", "pool", "emit"))
        # A partition whose decoy steps the worker decides has its pool held too: the worker
        # draws each take from it, and Redis checks and stores the take (take_store.lua).
        self._take_store = client.register_script(lua_script("fence", "pool", "take_store"))
        self._acknowledge = client.register_script(lua_script("fence", "acknowledge"))
        self._claim = client.register_script(lua_script("claim"))
        # With one sensitive attribute the worker decides each decoy step from the
        # partition's state it holds, and Redis checks and stores it (decoy_store.lua);
        # decoy.lua stays the step for several attributes, a partition's close, and a step
        # whose assumptions Redis refuses.
        self._decides = config.decoy is not None and len(config.sensitive) == 1
        self._decoy_store = client.register_script(lua_script("fence", "pool", "decoy_store"))
        self._decoy: dict[int, DecoyPartition] = {}
        self._closing: set[int] = set()
        self._stepping: dict[int, asyncio.Lock] = {}
        # The generation of this worker's claim on each partition it wrote (claim.lua), and
        # the partitions a rebalance assigned since, whose claim is checked again first.
        self._claims: dict[int, int] = {}
        self._reclaim: set[int] = set()
        self._claiming: dict[int, asyncio.Lock] = {}
        self._ttl = int((config.record_ttl or 0) * 1000)
        self._retention = int(config.reports.truth_retention * 1000)
        self._closed_retention = int(config.closed_retention * 1000)
        # Secret per-partition seeds for the keyed choice of decoy groups.
        self._seed_key = key.subkey("decoy cuts").hex()
        if config.personal is not None:
            settings, m = config.personal, config.schema.sensitive[0].size
            limit = trial_limit(1.0, settings.retention, m, settings.lam, settings.delta)
            self._personal_args = [
                settings.release_size, settings.budget, int(limit), settings.retention, m,
                settings.lam, settings.delta, repr(budget_level()),
            ]  # fmt: skip

    def assigned(self, partitions: Iterable[int]) -> None:
        """A rebalance assigned `partitions` to this worker: before it next writes one, it
        claims it again, keeping its generation if no other worker claimed it meanwhile."""
        self._reclaim.update(partitions)

    async def _generation(self, partition: int) -> int:
        # One claim at a time per partition: two first steps claiming at once would take
        # two generations, and the older would fence off this worker's own steps.
        async with self._claiming.setdefault(partition, asyncio.Lock()):
            held = self._claims.get(partition)
            if held is None or partition in self._reclaim:
                claimed = int(await self._claim(keys=[self.prefix(partition)], args=[held or ""]))
                if claimed != held:
                    # Another worker may have written the partition: its state is reloaded.
                    self._decoy.pop(partition, None)
                held = self._claims[partition] = claimed
                self._reclaim.discard(partition)
            return held

    async def _fenced(self, script: Any, partition: int, args: list) -> Any:
        """Run a step that writes `partition`'s buffer under this worker's claim on it;
        FencedError if a newer worker claimed it since."""
        generation = await self._generation(partition)
        try:
            return await script(keys=[self.prefix(partition)], args=[generation, *args])
        except redis_errors.ResponseError as err:
            if not str(err).startswith("FENCED"):
                raise
            raise FencedError(
                f"partition {partition} of stream {self.config.name} was claimed by a newer "
                f"worker (this worker's claim: generation {generation})"
            ) from None

    async def ingest(
        self, partition: int, batch: PreparedBatch | None, now_ms: int, through: int = -1
    ) -> IngestOutcome:
        """Store a batch (or nothing: a timer tick) and do every cut or release now due;
        `through`: the highest raw offset of the partition the worker handled with it,
        stored or rejected (a close waits for every offset below its own)."""
        offsets = [] if batch is None else [m.offset for m in batch.messages]
        if self._decides and partition not in self._closing:
            async with self._stepping.setdefault(partition, asyncio.Lock()):
                outcome = await self._decide(partition, batch, offsets, now_ms, through)
            if outcome is not None:
                return outcome
        records = None if batch is None else self._records(batch, offsets)
        return await self._store(partition, records, now_ms, through)

    async def _decide(
        self,
        partition: int,
        batch: PreparedBatch | None,
        offsets: list[int],
        now_ms: int,
        through: int,
    ) -> IngestOutcome | None:
        """The decoy step decided here (`service.core.decoy_cuts`), stored by
        decoy_store.lua; None if Redis refused it unwritten (a close under way, or a
        partition not as this worker holds it), for decoy.lua to do on Redis's state."""
        await self._generation(partition)  # a new claim drops the state held
        state = self._decoy.pop(partition, None) or await self._load_decoy(partition)
        if state is None:
            return None
        arrivals = None
        if batch is not None:
            columns = (batch.sensitive[:, 0].tolist(), batch.draws[:, 0].tolist(), offsets)
            arrivals = Arrivals(batch.id_bytes(), batch.public, *columns)
        config = self.config
        step = state.step(
            arrivals,
            now_ms,
            through,
            int(config.max_wait * 1000),
            config.decoy.gamma,  # type: ignore[union-attr]
            f"{self._seed_key}:{partition}",
        )
        result = await self._fenced(
            self._decoy_store, partition, self._decoy_store_args(step, now_ms)
        )
        if result == b"CLOSING":
            self._closing.add(partition)
        if isinstance(result, bytes):
            return None
        if state.pool is not None and len(state.pool) != int(result):
            # Redis's pool changed behind the worker: emit.lua takes until the next load.
            state.pool = None
        self._decoy[partition] = state
        if batch is not None or through >= 0:
            await self.replication.confirm(self.prefix(partition))
        statuses = [0] * len(offsets)
        for position, status in step.statuses.items():
            statuses[position - 1] = status
        self._pooled[partition] = int(result)
        return IngestOutcome(statuses, step.waiting, int(result))

    def _decoy_store_args(self, step: DecoyStep, now_ms: int) -> list:
        """decoy_store.lua's arguments for `step`."""
        decided = [step.watermark, step.draws, step.added, step.redelivered, step.replayed]
        decided += [step.groups, sum(step.suppressed.values())]
        lengths = [len(step.pool_entries), len(step.new_waiting), len(step.left)]
        lengths += [len(step.suppressed), len(step.sizes)]
        args: list = [now_ms, self._ttl, *step.assumed, *decided, *lengths, *step.pool_entries]
        for record_id, record in step.new_waiting:
            # As decoy.lua keeps a record waiting on its one attribute (cmsgpack).
            packed = [record.arrival, record.public.decode(), [str(record.value)]]
            packed += [[record.draw], [], 1, [], []]
            args += (record_id, msgspec.msgpack.encode(packed), record.value)
        for left in step.left:
            args += left
        for counts in (step.suppressed, step.sizes):
            for value, count in counts.items():
                args += (value, count)
        return args

    async def _load_decoy(self, partition: int) -> DecoyPartition | None:
        """A partition's decoy state as Redis holds it; None once its close is under way."""
        prefix = self.prefix(partition)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hmget(f"{prefix}:close", "raw", "state")
            pipe.get(f"{prefix}:off")
            pipe.hmget(f"{prefix}:stats", "draws", "groups")
            pipe.hgetall(f"{prefix}:rec")
            pipe.hgetall(f"{prefix}:pool")
            pipe.get(f"{prefix}:pooled")
            close, watermark, (draws, groups), records, pooled, pooled_ms = await pipe.execute()
        if any(close):
            self._closing.add(partition)
            return None
        waiting = {}
        for record_id, packed in records.items():
            arrival, public, values, draws_of = msgspec.msgpack.decode(packed)[:4]
            waiting[record_id] = Waiting(
                int(arrival), public.encode(), int(values[0]), int(draws_of[0])
            )
        state = DecoyPartition(int(watermark or -1), int(draws or 0), int(groups or 0), waiting)
        entries = [pooled.get(b"%d" % position) for position in range(1, len(pooled) + 1)]
        if None not in entries:  # dense, as pool.lua keeps it
            state.pool = MixingPool(entries, int(pooled_ms or 0))
        return state

    def grouped_messages(self, batch: PreparedBatch) -> list[tuple[bytes, bytes]]:
        """A personal stream's first hop: each record of a raw batch as a message of
        <stream>.grouped, keyed by its group, so that every record of a group lands in
        one partition (`streams.runtime.app.partition_of`) and one budget holds the group.

        The value is the record as personal.lua takes it, less the offset: its id and
        fingerprint, both of its dedup key, so a record the first hop sends twice is
        stored once, then its public codes, group, value and perturbed value. Raw
        sensitive values: the topic is as private as the raw one.
        """
        return list(zip(batch.groups, self._records(batch), strict=True))

    async def ingest_grouped(
        self, partition: int, messages: list[tuple[int, bytes]], now_ms: int
    ) -> IngestOutcome:
        """A personal stream's second hop: store (grouped offset, `grouped_messages`
        value) pairs of one partition of <stream>.grouped, and release what is due."""
        return await self._store(
            partition,
            [value + b"|%d" % offset for offset, value in messages],
            now_ms,
            max((offset for offset, _ in messages), default=-1),
        )

    async def _store(
        self, partition: int, records: list[bytes] | None, now_ms: int, through: int
    ) -> IngestOutcome:
        """One ingest step on a partition: `records` are the script's record arguments, each
        ending in its offset in the consumed topic (None: a timer tick)."""
        max_wait, ttl = int(self.config.max_wait * 1000), self._ttl
        count = len(records or [])
        closing = [through, self.config.mixing_pool, self._closed_retention]
        if self.config.decoy is not None:
            w = len(self.config.sensitive)
            seed = f"{self._seed_key}:{partition}"
            args: list = [now_ms, max_wait, self.config.decoy.gamma, w, seed, ttl, *closing, count]
        else:
            args = [now_ms, max_wait, *self._personal_args, ttl, *closing, count]
        result = await self._fenced(self._ingest, partition, args + (records or []))
        if records is not None or through >= 0:
            await self.replication.confirm(self.prefix(partition))
        statuses = [0] * count
        for position in range(2, len(result), 2):
            statuses[int(result[position]) - 1] = int(result[position + 1])
        self._pooled[partition] = int(result[1])
        return IngestOutcome(statuses, int(result[0]), int(result[1]))

    def _records(self, batch: PreparedBatch, offsets: list[int] | None = None) -> list[bytes]:
        """Each record as the ingest script takes it: id (32 hex digits), a personal
        record's fingerprint (12 bytes), then '|'-separated fields, ending in its offset if
        `offsets` are given.

        One formatting step per record: the worker builds these for every record, so a
        join per field would be a cost per field per record.
        """
        if self.config.decoy is None:
            # A personal stream's grouped partitions keep fingerprints (ingest.lua).
            columns: list[list] = [batch.id_bytes(), batch.fingerprints, batch.public]
            columns += [batch.groups, batch.sensitive[:, 0].tolist(), batch.perturbed.tolist()]
            template = b"%b%b%b|%b|%d|%d"
        elif batch.sensitive.shape[1] == 1:
            columns = [batch.id_bytes(), batch.public]
            columns += [batch.sensitive[:, 0].tolist(), batch.draws[:, 0].tolist()]
            template = b"%b%b|%d|%d"
        else:
            columns = [batch.id_bytes(), batch.public]
            columns += [
                [_csv(values) for values in batch.sensitive.tolist()],
                [_csv(draws) for draws in batch.draws.tolist()],
            ]
            template = b"%b%b|%b|%b"
        if offsets is not None:
            columns.append(offsets)
            template += b"|%d"
        return [template % row for row in zip(*columns, strict=True)]

    async def take(self, partition: int, now_ms: int, limit: int) -> Emission:
        """Records due for publication by the mixing rule, each under a fresh random token:
        at most `limit` of the excess over the floor, or of the whole pool when it is quiet
        or closed; from the final pool (FINAL_POOL), the whole stream's remainder once every
        partition's is in. Each take draws 128 fresh bits from the OS for its shuffle and
        tokens."""
        seed = self._entropy(SHUFFLE_SEED_BYTES)
        if partition in self._decoy and partition not in self._closing:
            async with self._stepping.setdefault(partition, asyncio.Lock()):
                emission = await self._take_held(partition, now_ms, limit, seed)
            if emission is not None:
                return emission
        config = self.config
        expected = min(limit, self._pooled.get(partition, 0) - config.mixing_pool)
        waits_for = config.partitions if partition == FINAL_POOL else 0
        args = [
            now_ms, config.mixing_pool, int(config.flush_interval * 1000), limit, seed,
            waits_for, config.min_mixing, config.small_remainder, shuffle_blocks(seed, expected),
        ]  # fmt: skip
        left, joined = await self._fenced(self._take, partition, args)
        self._pooled[partition] = int(left)
        if not joined:
            return Emission()
        await self.replication.confirm(self.prefix(partition))
        return Emission.of_take(seed, joined.split(TAKE_SEPARATOR))

    async def _take_held(
        self, partition: int, now_ms: int, limit: int, seed: str
    ) -> Emission | None:
        """A take drawn here from the pool held (`service.core.takes`), stored by
        take_store.lua; None if no pool is held or Redis refused the take unwritten (a
        close under way, or a pool not as this worker holds it), for emit.lua to draw on
        Redis's state."""
        await self._generation(partition)  # a new claim drops the state held
        state = self._decoy.get(partition)
        if state is None or state.pool is None:
            return None
        config, pool = self.config, state.pool
        due = pool.due(now_ms, config.mixing_pool, int(config.flush_interval * 1000), limit)
        self._pooled[partition] = len(pool)
        if not due:
            return Emission()
        # Held again only once Redis stored the take.
        del self._decoy[partition]
        take = pool.take(due, seed)
        args: list = [take.size, seed, due, TAKE_SEPARATOR.join(take.entries)]
        for position, entry in take.moved:
            args += (position, entry)
        result = await self._fenced(self._take_store, partition, args)
        if result == b"CLOSING":
            self._closing.add(partition)
        if isinstance(result, bytes):
            return None
        self._decoy[partition] = state
        self._pooled[partition] = int(result)
        await self.replication.confirm(self.prefix(partition))
        return Emission.of_take(seed, take.entries)

    async def in_flight(self, partition: int) -> Emission:
        """Emissions not yet acknowledged, to re-send with their tokens, in an order drawn
        from the OS (a hash's order is not random)."""
        prefix = self.prefix(partition)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.exists(f"{prefix}:inflight")
            pipe.type(f"{prefix}:pool")
            pipe.hgetall(f"{prefix}:takes")
            legacy, pool_type, takes = await pipe.execute()
        if legacy or pool_type == b"zset":
            raise RuntimeError(
                f"{prefix} holds a pool or records in flight of an earlier version: drain the "
                "stream with that version before upgrading (docs/operations.md, Migrating "
                "from earlier versions)"
            )
        emission = takes_in_flight(takes)
        if emission:
            await self.replication.confirm(prefix)
        secrets.SystemRandom().shuffle(emission)
        return emission

    async def acknowledge(self, partition: int, emission: Emission, now_ms: int) -> None:
        """Forget the takes of an emission the broker acknowledged, counting their records
        into the truth tallies and their delays (to `now_ms`) into the delay histogram."""
        if emission.takes:
            args: list = [now_ms, self._retention]
            for take_id, entries in emission.takes.items():
                args += acknowledgement(take_id, entries, now_ms)
            await self._fenced(self._acknowledge, partition, args)
