-- A response's identity is the stream's, not a partition's (SPEC §3): one shard of the
-- stream's record ids, screened before any buffer stores a record. A record's shard is
-- its fingerprint's bucket modulo the shard count, so every copy of a response meets its
-- first copy here, whichever client sent it to whichever raw partition, at any age.
--
-- The first copy seen owns the id: its raw partition and offset are kept with the
-- fingerprint. The first copy itself, read again (a replay after a crash, a rebalance),
-- is passed on, and its partition's buffer knows by its offset whether it stored it
-- (ingest.lua). Any other copy of the same content is a re-send: skipped here. A copy with
-- other content is an id reused: rejected. Marking happens before the owner stores the
-- record, so a crash in between loses nothing: the replay is passed on again.
--
-- KEYS[1]  the shard's prefix, "splu:{<stream>:ids:<shard>}".
-- ARGV[1]  the records, 20 bytes each, concatenated: fingerprint (12 bytes: 2-byte bucket,
--          6-byte key, 4-byte content digest; service/core/ingest.py), then where it was read:
--          raw partition (2 bytes) and offset (6 bytes), big-endian. One argument, for the
--          worker to build and Redis to read at once.
-- ARGV     then, per raw partition of the records: the partition (2 bytes) and the highest
--          offset among its records here (decimal).
-- Returns  position and status of each record not passed on: 1 a re-send of an earlier
--          copy, 2 id reused with other content.
--
-- Keys: :seen (a Fingerprints set of 18-byte entries: key, digest, where the first copy
-- was read); :screened raw partition (2 bytes) -> highest offset screened, so a re-send
-- or a conflict is counted once, not again when its fetch is replayed; :stats
-- redelivered, conflicts.

local base = KEYS[1]
local packed = ARGV[1]
local count = #packed / 20
local seen = Fingerprints.new(base .. ':seen', 18)
local buckets = seen:load_packed(packed, 20)
local k_screened = base .. ':screened'
local watermarks = {}
for j = 2, #ARGV, 2 do
  local owner = ARGV[j]
  local watermark = tonumber(redis.call('HGET', k_screened, owner) or '-1')
  watermarks[owner] = watermark
  if tonumber(ARGV[j + 1]) > watermark then redis.call('HSET', k_screened, owner, ARGV[j + 1]) end
end

-- Whether a skipped record was read past its partition's watermark: counted the first
-- time only. Only skipped records need their offset.
local function first_time(read_at)
  local b1, b2, b3, b4, b5, b6 = string.byte(read_at, 3, 8)
  local offset = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
  return offset > watermarks[string.sub(read_at, 1, 2)]
end

local redelivered, conflicts, found = 0, 0, {}
for r = 1, count do
  local at = 20 * r - 19
  local bucket, key = buckets[r], string.sub(packed, at + 2, at + 7)
  local known = seen:find(bucket, key)
  if not known then
    seen:add(bucket, string.sub(packed, at + 2, at + 19))
  else
    local digest, read_at = string.sub(packed, at + 8, at + 11), string.sub(packed, at + 12, at + 19)
    if string.sub(known, 1, 4) ~= digest then
      found[#found + 1] = r
      found[#found + 1] = 2
      if first_time(read_at) then conflicts = conflicts + 1 end
    elseif string.sub(known, 5, 12) ~= read_at then
      found[#found + 1] = r
      found[#found + 1] = 1
      if first_time(read_at) then redelivered = redelivered + 1 end
    end
  end
end
seen:store()
redis.call('HINCRBY', base .. ':stats', 'redelivered', redelivered)
redis.call('HINCRBY', base .. ':stats', 'conflicts', conflicts)
return found
