-- Shared by the ingest scripts (decoy.lua, personal.lua, window.lua), prepended to each
-- when it is registered: argument parsing, idempotent storage, gauges and the reply.

-- A record argument: id (32 hex digits), fingerprint (12 bytes, below), then
-- count '|'-separated fields, the last being the raw offset. The id by string.sub, the
-- rest by one string.match from byte 33: in Redis's Lua each C call costs as much as the
-- string it cuts, and a pattern item per byte of the id cost more than both (a third of
-- the parse). Returns the id, the fingerprint's bucket (2 bytes), key (6) and digest (4),
-- then the fields.
local record_patterns = {}
local function fields_of(arg, count)
  local pattern = record_patterns[count]
  if pattern == nil then
    pattern = '^(..)(......)(....)' .. string.rep('([^|]*)|', count - 1) .. '(.*)$'
    record_patterns[count] = pattern
  end
  return string.sub(arg, 1, 32), string.match(arg, pattern, 33)
end

-- Every record id a partition ever stored is remembered (fingerprints.lua, in ':seen'),
-- so a record is randomized once at any age (SPEC §3). An entry is a 6-byte keyed
-- fingerprint of the producer's record id and a 4-byte keyed digest of the validated
-- content (service/ingest.py): a new id passes for a known one with probability
-- (ids stored) / 2^64, a reused id with other content for a redelivery with 2^-32.
local status, redelivered, conflicts, replayed = {}, 0, 0, 0
local seen, watermark, highest

local function open_dedup(base, records, before)
  seen = Fingerprints.new(base .. ':seen', 10)
  watermark = tonumber(redis.call('GET', base .. ':off') or '-1')
  highest = watermark
  seen:load_args(before + 1, before + records, 1, 33)
end

-- True for a record seen first now. A redelivery (same digest) or an id reused with other
-- content is skipped, reported as status 1 or 2; a conflict is counted once, not again
-- when its message is redelivered (its offset is then at or below the watermark).
-- The fingerprint comes as its bucket, key and digest (`fields_of`).
local function first_seen(r, bucket, key, digest, offset)
  offset = tonumber(offset)
  local known = seen:find(bucket, key)
  if offset > highest then highest = offset end
  if not known then
    seen:add(bucket, key .. digest)
    return true
  end
  local seen = known == digest and 1 or 2
  status[#status + 1] = r
  status[#status + 1] = seen
  if seen == 2 then
    if offset > watermark then conflicts = conflicts + 1 end
  else
    redelivered = redelivered + 1
    if offset <= watermark then replayed = replayed + 1 end
  end
  return false
end

-- Store the new fingerprints and counters; reply with the records waiting, the pool size,
-- then the position and status of each skipped record. The same numbers stay as gauges
-- (':waiting', which expires with the records it counts, and ':stats'), so readers never
-- need the record keys themselves.
local function reply(base, k_stats, added, waiting, pool, ttl)
  seen:store()
  redis.call('HINCRBY', k_stats, 'ingested', added)
  redis.call('HINCRBY', k_stats, 'redelivered', redelivered)
  redis.call('HINCRBY', k_stats, 'replayed', replayed)
  redis.call('HINCRBY', k_stats, 'conflicts', conflicts)
  redis.call('HSET', k_stats, 'pool', pool)
  redis.call('HSET', base .. ':waiting', 'pending', waiting)
  if ttl > 0 then redis.call('PEXPIRE', base .. ':waiting', ttl) end
  redis.call('SET', base .. ':off', highest)
  table.insert(status, 1, pool)
  table.insert(status, 1, waiting)
  return status
end

-- With a record TTL, a partition's raw buffered records (not yet randomized) expire
-- together ttl ms after a worker last touched the partition: while a worker runs its
-- ticks keep them alive, and raw records of a stream nobody runs any more leave Redis by
-- themselves. Randomized records (pool, in flight) never expire: they are published.
-- Counters stay, so what expired shows as records ingested but neither published,
-- suppressed nor waiting.
local function expire_with_ttl(ttl, keys)
  if ttl <= 0 then return end
  for _, key in ipairs(keys) do
    redis.call('PEXPIRE', key, ttl)
  end
end
