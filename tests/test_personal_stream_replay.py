"""The Python replay of a personal stream (`service.core.mechanisms.personal_stream`) against
`service/store/lua/personal.lua` on the embedded Redis server.

Adult's occupation (m = 14) with public sex and race merged to White / non-White (4
groups, as in ../shared/notes/personal-borrowed-copies.md), through both hops to the Lua
step on one partition in ingest calls of a fixed size, rare occupations last in their
groups, then a tail that drifts one group past its bounded budget's bound (frozen) and
brings it a value it never held (borrowed copies). The replay must make every record's
decision (trial, copy, borrowed copy) and publish every record's value as the Lua step
did, and `PersonalStream.publish` the same cells.
"""

from __future__ import annotations

import asyncio
import csv
import json
import tomllib
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import tomli_w
from harness import GroupedHops

from service.core.config import StreamConfig, load_config
from service.core.ingest import Preparer, RawMessage
from service.core.mechanisms.personal_stream import (
    BORROWED,
    COPY,
    TRIAL,
    PersonalStream,
    stream_trials,
)
from service.core.merge import ValueMap
from service.core.prf import ServiceKey
from service.core.table import Table, open_sample
from service.core.wire import PoolEntry
from service.store.auditor import TrustedState
from service.store.buffer import StreamBuffer

pytestmark = pytest.mark.redis

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
KEY = ServiceKey.from_seed(32)
T0 = 1_700_000_000_000
# Occupations with fewer than 1,000 of Adult's 45,222 records, the note's.
RARE = ("Armed-Forces", "Priv-house-serv", "Protective-serv")
# Records per ingest call.
CALL = 500
MARKS = {TRIAL: b"t", COPY: b"c", BORROWED: b"b"}


def occupation_stream(
    directory: Path,
    budget: str,
    retention: float = 0.5,
    lam: float = 0.3,
    release_size: int = 25,
    **stream: object,
) -> tuple[Path, StreamConfig]:
    """Adult's personal example recast: occupation sensitive, public sex and race, race
    merged to White and the rest; no standing queries, and no test pauses publishing
    (high retentions fail the adversary test by design)."""
    document = tomllib.loads((EXAMPLES / "adult-personal.toml").read_text())
    rows = adult_occupations()
    domains = {c: sorted({r[c] for r in rows}) for c in ("sex", "race", "occupation")}
    document["schema"] = {
        "public": {c: {"domain": domains[c]} for c in ("sex", "race")},
        "sensitive": {"occupation": {"domain": domains["occupation"]}},
    }
    others = tuple(r for r in domains["race"] if r != "White")
    merge = ValueMap(
        "occupation", tuple(domains["occupation"]), 0.05, {"race": (("White",), others)}
    )
    (directory / "occupation.merge.toml").write_text(merge.to_toml())
    document["personal"].update(
        retention=retention, budget=budget, release_size=release_size,
        merge_map="occupation.merge.toml", **{"lambda": lam},
    )  # fmt: skip
    document["stream"].update(name=f"o{uuid.uuid4().hex[:8]}", partitions=1, **stream)
    document["reports"].update(fail_closed=[], queries=[])
    document["reports"].pop("dp_epsilon", None)
    path = directory / f"{document['stream']['name']}.toml"
    path.write_text(tomli_w.dumps(document))
    return path, load_config(path)


def adult_occupations() -> list[dict[str, str]]:
    with open_sample() as source:
        return [{c: r[c] for c in ("sex", "race", "occupation")} for r in csv.DictReader(source)]


def rare_last(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """Every record of a common occupation in random order, then the rare ones."""
    rng = np.random.default_rng(seed)
    shuffled = [rows[i] for i in rng.permutation(len(rows))]
    return [r for r in shuffled if r["occupation"] not in RARE] + [
        r for r in shuffled if r["occupation"] in RARE
    ]


def drifting_tail(flood: int = 1500, newcomers: int = 5) -> list[dict[str, str]]:
    """Female, non-White records: `flood` Adm-clerical ones, which push the group's
    largest share past the bound its trials were planned with, then `newcomers`
    Armed-Forces ones, a value the group never held."""
    person = {"sex": "Female", "race": "Black"}
    return [{**person, "occupation": "Adm-clerical"}] * flood + [
        {**person, "occupation": "Armed-Forces"}
    ] * newcomers


async def through_lua(
    config: StreamConfig, rows: list[dict[str, str]], url: str
) -> tuple[list, list[PoolEntry], dict]:
    """Rows through both hops to personal.lua in calls of CALL records, then every group
    released (max_wait passed): the prepared batches, the pool and the groups' tallies."""
    client = aioredis.from_url(url)
    buffer, preparer = StreamBuffer(client, config, KEY), Preparer(config, KEY)
    hops = GroupedHops(buffer)
    names = config.schema.names
    messages = [
        RawMessage(0, i, b"r%d" % i, json.dumps({n: r[n] for n in names}).encode())
        for i, r in enumerate(rows)
    ]
    batches = []
    now = T0
    for start in range(0, len(messages), CALL):
        prepared, rejected = preparer.prepare(messages[start : start + CALL])
        assert not rejected and len(prepared) == 1
        batches += prepared
        await hops.store(prepared[0], now)
        now += 100
    await buffer.ingest(0, None, now + int(config.max_wait * 1000))
    pool = await client.hvals(f"{buffer.prefix(0)}:pool")
    groups = await TrustedState(client, config).personal_groups()
    await client.aclose()
    return batches, [PoolEntry.parse(e) for e in pool], groups


@pytest.mark.parametrize("budget", ["bounded", "conservative", "adaptive"])
def test_the_replay_decides_and_publishes_as_the_lua_step(servers, tmp_path, budget):
    _, config = occupation_stream(tmp_path, budget, max_wait=3600.0)
    settings = config.personal
    assert settings is not None
    rows = rare_last(adult_occupations(), seed=32) + drifting_tail()
    batches, pool, groups = asyncio.run(through_lua(config, rows, servers.redis_url))
    assert len(pool) == len(rows)
    by_id = {entry.id: entry for entry in pool}

    ids = np.concatenate([b.ids for b in batches])
    values = np.concatenate([b.sensitive[:, 0] for b in batches])
    perturbed = np.concatenate([b.perturbed for b in batches])
    group_keys = np.array([g for b in batches for g in b.groups])
    record_ids = [i for b in batches for i in b.id_bytes()]
    m = config.schema.sensitive[0].size
    replay = stream_trials(
        group_keys, values, m, budget, settings.retention, settings.lam, settings.delta,
        settings.release_size, batch=CALL,
    )  # fmt: skip
    decided = [
        (by_id[record_id].audit, int(by_id[record_id].published)) for record_id in record_ids
    ]
    replayed = [
        (MARKS[int(kind)], int(perturbed[source]))
        for kind, source in zip(replay.kind.tolist(), replay.source.tolist(), strict=True)
    ]
    mismatched = [i for i, (a, b) in enumerate(zip(decided, replayed, strict=True)) if a != b]
    assert not mismatched, (len(mismatched), decided[mismatched[0]], replayed[mismatched[0]])

    kinds = Counter(kind for kind, _ in decided)
    borrowed = sum(g.get("borrowed", 0) for g in groups.values())
    assert kinds[b"b"] == borrowed
    if budget == "bounded":
        # The tail freezes its group, whose newcomers then borrow, and only they.
        frozen = [g for g, tally in groups.items() if tally.get("frozen")]
        assert len(frozen) == 1 and borrowed == groups[frozen[0]].get("borrowed") == 5, groups
    elif budget == "conservative":
        # The limit is fixed above m: every value a group holds has a trial.
        assert borrowed == 0
    # (The adaptive limit follows every move of the shares, and falls under the trials
    # spent: it borrows too, and is kept for comparison only.)

    # The publication as a table: the same cells.
    codes = np.array([[int(c) for c in p.split(b",")] for b in batches for p in b.public])
    table = Table(
        config.schema,
        {
            **{a.name: codes[:, i] for i, a in enumerate(config.schema.public)},
            "occupation": values.astype(np.int32),
        },
    )
    stream = PersonalStream(
        settings.retention, settings.lam, settings.delta, budget, settings.value_map,
        settings.release_size, batch=CALL,
    )  # fmt: skip
    release = stream.publish(table, ids, KEY)
    published = release.published
    replayed_cells = Counter(
        zip(
            *(published.codes[a.name].tolist() for a in config.schema.public),
            published.codes["occupation"].tolist(),
            strict=True,
        )
    )
    lua_cells = Counter((*(int(c) for c in e.public.split(b",")), int(e.published)) for e in pool)
    assert replayed_cells == lua_cells
    assert release.borrowed_rows == kinds[b"b"]
    assert release.sampled_rows == kinds[b"t"] == sum(g["trials"] for g in groups.values())
