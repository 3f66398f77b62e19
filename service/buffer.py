"""The Redis buffer between the raw and the published topic (SPEC §3).

Per raw partition, all state lives under the prefix ``splu:{<stream>:<partition>}``;
the braces make it a Redis Cluster hash tag, so one slot holds a partition's
keys and every step below is a single atomic Lua call (scripts in
``service/lua``, registered once):

- ``ingest``: store a batch idempotently and cut/release every group it
  allows, randomizing members and handing them to the mixing pool; records
  that waited past ``max_wait`` are suppressed (decoy) or released (personal);
- ``take``: move random records from the mixing pool to the in-flight hash
  under fresh tokens, for publication;
- ``acknowledge``: drop tokens the broker acknowledged. Whatever is still in
  flight after a crash is re-sent with the same tokens.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis

from service.config import StreamConfig
from service.guarantees import trial_limit
from service.ingest import PreparedBatch
from service.prf import ServiceKey

# Tokens per acknowledgement call: Lua's unpack() has a stack limit of a few thousand.
_ACK_CHUNK = 1000


def _csv(codes: list[int]) -> bytes:
    return b",".join(b"%d" % c for c in codes)


# What each process does in Redis, as ACL rules: data commands only (the Lua steps run
# with the caller's permissions), scripts by hash, nothing dangerous (KEYS, FLUSHALL,
# CONFIG, DEBUG ...), and only the stream's own keys.
_ACL_COMMANDS = (
    "-@all +@read +@write +@transaction -@dangerous +evalsha +eval +script|load "
    "+script|exists +ping +hello"
)
ROLES = ("worker", "consumer")


def acl_rules(config: StreamConfig, role: str) -> str:
    """The ACL SETUSER rules (without password) for a stream's worker or consumer."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    stream = config.name
    keys = f"~splu:{{{stream}:* ~splu:{{{stream}}}:*"
    # The consumer also reads the server's memory use and scans personal group state.
    extra = " +info +scan" if role == "consumer" else ""
    return f"reset on resetchannels {keys} {_ACL_COMMANDS}{extra}"


def connect(config: StreamConfig) -> aioredis.Redis:
    """A client for the stream's Redis with its ACL user, password and TLS settings."""
    return aioredis.from_url(config.redis_url, **config.redis_options())


def lua_script(*names: str) -> str:
    scripts = resources.files("service").joinpath("lua")
    return "".join(scripts.joinpath(f"{name}.lua").read_text() for name in names)


@dataclass(frozen=True)
class IngestOutcome:
    """Per record: 0 stored, 1 redelivered (ignored), 2 id reused with other content."""

    statuses: list[int]
    pending: int
    pool: int


class BufferState:
    """What the consumer and operators may read of a stream's buffers: counters,
    the delay histogram, suppression, personal group state and the truth tally.

    Needs no service key; nothing here changes what gets published, except the
    stream-wide pause flag a failed privacy test raises (fail closed).
    """

    def __init__(self, client: aioredis.Redis, config: StreamConfig) -> None:
        self.client = client
        self.config = config

    def prefix(self, partition: int) -> str:
        return f"splu:{{{self.config.name}:{partition}}}"

    @property
    def pause_key(self) -> str:
        return f"splu:{{{self.config.name}}}:paused"

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
        """Counters of one partition plus its current pending and pool sizes."""
        prefix = self.prefix(partition)
        # One transaction: a snapshot between two Lua steps, so the counts add up.
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(f"{prefix}:stats")
            pipe.hlen(f"{prefix}:rec")
            pipe.zcard(f"{prefix}:pool")
            pipe.hlen(f"{prefix}:inflight")
            counters, pending, pool, in_flight = await pipe.execute()
        out = {k.decode(): int(v) for k, v in counters.items()}
        out.update(pending=pending, pool=pool, in_flight=in_flight)
        # Records a record TTL removed before they were published or suppressed.
        resolved = out.get("published", 0) + out.get("suppressed", 0)
        out["expired"] = max(out.get("ingested", 0) - resolved - pending - pool - in_flight, 0)
        return out

    async def totals(self) -> dict[str, int]:
        """`stats` summed over every partition of the stream."""
        totals: dict[str, int] = {}
        for partition in range(self.config.partitions):
            for name, value in (await self.stats(partition)).items():
                totals[name] = totals.get(name, 0) + value
        return totals

    async def count_rejected(self, counts: dict[int, int]) -> None:
        """Add records sent to the rejected topic, per partition."""
        async with self.client.pipeline(transaction=False) as pipe:
            for partition, n in counts.items():
                pipe.hincrby(f"{self.prefix(partition)}:stats", "rejected", n)
            await pipe.execute()

    async def suppressed(self) -> dict[tuple[str, str], int]:
        """Decoy records suppressed for waiting past max_wait, per (attribute, value)."""
        attributes = self.config.schema.sensitive
        out: dict[tuple[str, str], int] = {}
        for partition in range(self.config.partitions):
            counts = await self.client.hgetall(f"{self.prefix(partition)}:sup")
            for field, count in counts.items():
                position, _, code = field.decode().partition(":")
                attribute = attributes[int(position) - 1]
                name = (attribute.name, attribute.domain[int(code)])
                out[name] = out.get(name, 0) + int(count)
        return out

    async def truth(self) -> dict[bytes, int]:
        """True cells ("public codes|true sensitive codes") of every record handed to the
        mixing pool, summed over partitions. Producer-side only: it holds true values."""
        out: dict[bytes, int] = {}
        for partition in range(self.config.partitions):
            for cell, count in (
                await self.client.hgetall(f"{self.prefix(partition)}:truth")
            ).items():
                out[cell] = out.get(cell, 0) + int(count)
        return out

    async def delays(self) -> dict[str, int]:
        """The emission-delay histogram summed over partitions: non-cumulative counts
        per upper bound in ms (and "+Inf"), plus "count" and "sum_ms"."""
        out: dict[str, int] = {}
        for partition in range(self.config.partitions):
            for field, count in (
                await self.client.hgetall(f"{self.prefix(partition)}:delay")
            ).items():
                out[field.decode()] = out.get(field.decode(), 0) + int(count)
        return out

    async def personal_groups(self) -> dict[str, dict[str, int]]:
        """Each personal group's state summed over partitions: total, trials, c:<v>."""
        out: dict[str, dict[str, int]] = {}
        for partition in range(self.config.partitions):
            prefix = self.prefix(partition)
            keys = [k async for k in self.client.scan_iter(match=f"{prefix}:g:*:s", count=1000)]
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                states = await pipe.execute()
            for key, state in zip(keys, states, strict=True):
                group = key.decode()[len(prefix) + 3 : -2]
                merged = out.setdefault(group, {})
                for field, value in state.items():
                    name = field.decode()
                    if name == "total" or name == "trials" or name.startswith("c:"):
                        merged[name] = merged.get(name, 0) + int(value)
        return out

    async def memory(self) -> int:
        """Bytes the Redis server uses (all streams share it)."""
        return int((await self.client.info("memory"))["used_memory"])


class StreamBuffer(BufferState):
    """One stream's buffers in Redis, for the partitions a worker owns."""

    def __init__(self, client: aioredis.Redis, config: StreamConfig, key: ServiceKey) -> None:
        super().__init__(client, config)
        self._ingest = client.register_script(lua_script("ingest", config.mechanism))
        self._take = client.register_script(lua_script("emit"))
        self._acknowledge = client.register_script(lua_script("acknowledge"))
        self._ttl = int((config.record_ttl or 0) * 1000)
        # Secret per-partition seeds for the keyed choice of decoy groups.
        self._seed_key = key.subkey("decoy cuts").hex()
        if config.personal is not None:
            settings, m = config.personal, config.schema.sensitive[0].size
            limit = trial_limit(1.0, settings.retention, m, settings.lam, settings.delta)
            self._personal_args = [
                settings.release_size, settings.budget, int(limit // config.partitions),
                settings.retention, m, settings.lam, settings.delta, config.partitions,
            ]  # fmt: skip

    async def ingest(
        self, partition: int, batch: PreparedBatch | None, now_ms: int
    ) -> IngestOutcome:
        """Store a batch (or nothing: a timer tick) and do every cut or release now due."""
        records = len(batch) if batch is not None else 0
        max_wait = int(self.config.max_wait * 1000)
        window, ttl = int(self.config.dedup_window * 1000), self._ttl
        if self.config.decoy is not None:
            w = len(self.config.sensitive)
            seed = f"{self._seed_key}:{partition}"
            args: list = [now_ms, max_wait, self.config.decoy.gamma, w, seed, window, ttl, records]
        else:
            args = [now_ms, max_wait, *self._personal_args, window, ttl, records]
        if batch is not None:
            # One argument per record: id (32 hex digits), digest (8 bytes), then '|'-separated
            # fields, the raw offset and then the dedup key last, since a producer's record
            # id may hold '|'.
            args += [
                record_id + digest + fields
                for record_id, digest, fields in zip(
                    batch.id_bytes(), batch.digests, self._fields(batch), strict=True
                )
            ]
        result = await self._ingest(keys=[self.prefix(partition)], args=args)
        statuses = [0] * records
        for position in range(2, len(result), 2):
            statuses[int(result[position]) - 1] = int(result[position + 1])
        return IngestOutcome(statuses, int(result[0]), int(result[1]))

    def _fields(self, batch: PreparedBatch) -> list[bytes]:
        sensitive = batch.sensitive.tolist()
        tails = [
            b"%d|%s" % (m.offset, d) for m, d in zip(batch.messages, batch.dedup_keys, strict=True)
        ]
        if self.config.decoy is not None:
            return [
                b"|".join([public, _csv(values), _csv(draws), tail])
                for public, values, draws, tail in zip(
                    batch.public, sensitive, batch.draws.tolist(), tails, strict=True
                )
            ]
        return [
            b"|".join([public, group, b"%d" % values[0], b"%d" % perturbed, tail])
            for public, group, values, perturbed, tail in zip(
                batch.public, batch.groups, sensitive, batch.perturbed.tolist(), tails,
                strict=True,
            )
        ]  # fmt: skip

    async def take(self, partition: int, now_ms: int, limit: int) -> list[tuple[str, bytes]]:
        """Up to `limit` records due for publication, each under a fresh random token."""
        args = [
            now_ms, self.config.mixing_pool, int(self.config.flush_interval * 1000), limit,
            secrets.token_hex(16), self._ttl,
        ]  # fmt: skip
        blob = await self._take(keys=[self.prefix(partition)], args=args)
        return [
            (token.decode(), entry)
            for token, _, entry in (line.partition(b" ") for line in blob.split(b"\n") if line)
        ]

    async def in_flight(self, partition: int) -> list[tuple[str, bytes]]:
        """Emissions not yet acknowledged, to re-send with their tokens."""
        entries = await self.client.hgetall(f"{self.prefix(partition)}:inflight")
        return [(token.decode(), entry) for token, entry in entries.items()]

    async def acknowledge(self, partition: int, tokens: list[str]) -> None:
        for start in range(0, len(tokens), _ACK_CHUNK):
            chunk = tokens[start : start + _ACK_CHUNK]
            await self._acknowledge(keys=[self.prefix(partition)], args=chunk)
