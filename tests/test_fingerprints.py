"""A fingerprint set (service/store/lua/fingerprints.lua) whose buckets split: every member
is found after any number of splits, with what was kept with it, no new member is, each
entry sits in the bucket its fingerprint names, and no bucket holds more than
`per_bucket` entries. A young set is the 2-byte buckets it always was.

The stream's sets split a bucket past 64 entries; the test passes 1, so that a few
thousand members split buckets of the 2^16 many times, some over several levels.
"""

from __future__ import annotations

import random

import pytest

from service.store.buffer import lua_script

pytestmark = pytest.mark.redis

# A fingerprint as ingest.lua takes one: bucket (2 bytes), key (6), digest kept (4).
PROBE = """
local set = Fingerprints.new(KEYS[1], 10, tonumber(ARGV[1]))
set:load_args(2, #ARGV, 1, 1)
local out = {}
for i = 2, #ARGV do
  local bucket, key = string.sub(ARGV[i], 1, 2), string.sub(ARGV[i], 3, 8)
  local known = set:find(bucket, key)
  if known then
    out[#out + 1] = known
  else
    set:add(bucket, key .. string.sub(ARGV[i], 9, 12))
    out[#out + 1] = ''
  end
end
set:store()
return out
"""
SPLIT = b"/"


def field_of(fingerprint: bytes, fields: dict[bytes, bytes]) -> bytes:
    """The field that holds `fingerprint` among `fields` (fingerprints.lua, `field`)."""
    bucket, bits = fingerprint[:2], int.from_bytes(fingerprint[2:8], "little")
    field, depth = bucket, 0
    while fields.get(field) == SPLIT:
        depth += 1
        field = bucket + bytes([depth]) + b"%d" % (bits % 2**depth)
    return field


def test_members_are_found_across_splits_and_buckets_stay_small(redis_client):
    probe = redis_client.register_script(lua_script("fingerprints") + PROBE)
    key = f"splu:{{fp{random.getrandbits(32)}}}:seen"
    generator = random.Random(7)
    stored: dict[bytes, bytes] = {}  # bucket + key -> digest
    per_bucket = 1
    for _ in range(60):
        batch = []
        for _ in range(500):
            if stored and generator.random() < 0.2:
                fingerprint = generator.choice(list(stored))
                digest = generator.choice([stored[fingerprint], generator.randbytes(4)])
            else:
                # Few buckets, so that many split and some over several levels.
                fingerprint = generator.randbytes(1) * 2 + generator.randbytes(6)
                digest = generator.randbytes(4)
            batch.append(fingerprint + digest)
        expected, seen_now = [], {}
        for record in batch:
            fingerprint = record[:8]
            known = stored.get(fingerprint, seen_now.get(fingerprint))
            expected.append(known or b"")
            if known is None:
                seen_now[fingerprint] = record[8:]
        assert probe(keys=[key], args=[per_bucket, *batch]) == expected
        stored |= seen_now
    fields = redis_client.hgetall(key)
    depths = [field[2] for field, entries in fields.items() if len(field) > 2]
    assert depths and max(depths) >= 5, "the test never split a bucket five levels deep"
    placed = {}
    for field, entries in fields.items():
        if entries == SPLIT:
            continue
        assert len(entries) <= per_bucket * 10
        for at in range(0, len(entries), 10):
            placed[field[:2] + entries[at : at + 6]] = (field, entries[at + 6 : at + 10])
    assert {fp: digest for fp, (_, digest) in placed.items()} == stored
    assert all(field == field_of(fp, fields) for fp, (field, _) in placed.items())


def test_a_young_set_is_its_two_byte_buckets(redis_client):
    probe = redis_client.register_script(lua_script("fingerprints") + PROBE)
    key = f"splu:{{fp{random.getrandbits(32)}}}:seen"
    generator = random.Random(3)
    old = [generator.randbytes(12) for _ in range(300)]
    for record in old:
        redis_client.hset(key, record[:2], (redis_client.hget(key, record[:2]) or b"") + record[2:])
    fresh = [generator.randbytes(12) for _ in range(300)]
    found = probe(keys=[key], args=[64, *old, *fresh])
    assert found == [record[8:] for record in old] + [b""] * len(fresh)
    assert all(len(field) == 2 for field in redis_client.hkeys(key))
