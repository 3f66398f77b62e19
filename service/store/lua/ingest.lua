-- Shared by the ingest scripts (decoy.lua, personal.lua, window.lua), prepended to each
-- when it is registered: argument parsing, idempotent storage, gauges and the reply.

-- A record argument: id (32 hex digits), its fingerprint if the partition keeps
-- fingerprints (12 bytes, below), then count '|'-separated fields, the last being the
-- raw offset. The id by string.sub, the rest by one string.match from byte 33: in Redis's
-- Lua each C call costs about as much as the string it cuts, so two calls per record is
-- the fewest, and matching the fixed-width id with a pattern item per byte would cost
-- more than both. Returns the id, the fingerprint's bucket (2 bytes), key (6) and digest
-- (4), or three nils, then the fields.
local record_patterns = {}
local fingerprinted
local function fields_of(arg, count)
  local pattern = record_patterns[count]
  if pattern == nil then
    pattern = string.rep('([^|]*)|', count - 1) .. '(.*)$'
    pattern = fingerprinted and '^(..)(......)(....)' .. pattern or '^' .. pattern
    record_patterns[count] = pattern
  end
  if fingerprinted then return string.sub(arg, 1, 32), string.match(arg, pattern, 33) end
  return string.sub(arg, 1, 32), nil, nil, nil, string.match(arg, pattern, 33)
end

-- A record is randomized once at any age (SPEC §3). The stream's identity screen
-- (identity.lua) lets through only the first copy of each id: on its first partition, at
-- its first offset. So a raw partition's buffer tells a new record from a replay of one
-- it stored by its offset alone: every offset up to the watermark ':off' was handled (the
-- worker stores a partition's fetches in order). A personal stream's grouped partition
-- also receives the first hop's forwards again after a crash, at new offsets, so it
-- remembers every record id it stored (fingerprints.lua, in ':seen'): an entry is a 6-byte
-- keyed fingerprint of the producer's record id and a 4-byte keyed digest of the validated
-- content (service/core/ingest.py): a new id passes for a known one with probability
-- (ids stored) / 2^64, a reused id with other content for a redelivery with 2^-32.
local status, redelivered, conflicts, replayed, late = {}, 0, 0, 0, 0
local seen, watermark, highest

-- `through`: the highest offset of the consumed topic's partition that the worker handled
-- in this call, stored records or not (-1: a tick). `fingerprinted`: whether the
-- partition keeps fingerprints (above).
local function open_dedup(base, records, before, through, keeps_fingerprints)
  watermark = tonumber(redis.call('GET', base .. ':off') or '-1')
  highest = math.max(watermark, through)
  fingerprinted = keeps_fingerprints
  if fingerprinted then
    seen = Fingerprints.new(base .. ':seen', 10)
    seen:load_args(before + 1, before + records, 1, 33)
  end
end

-- True for a record seen first now. A replay, a redelivery (same digest) or an id reused
-- with other content is skipped, reported as status 1 or 2; a conflict is counted once,
-- not again when its message is redelivered (its offset is then at or below the
-- watermark). The fingerprint comes as its bucket, key and digest (`fields_of`).
local function first_seen(r, bucket, key, digest, offset)
  offset = tonumber(offset)
  if offset > highest then highest = offset end
  local known
  if seen == nil then
    if offset > watermark then return true end
    known = digest
  else
    known = seen:find(bucket, key)
    if not known then
      seen:add(bucket, key .. digest)
      return true
    end
  end
  local found = known == digest and 1 or 2
  status[#status + 1] = r
  status[#status + 1] = found
  if found == 2 then
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
  if seen ~= nil then seen:store() end
  if late > 0 then redis.call('HINCRBY', k_stats, 'late', late) end
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

-- A survey's end (SPEC §3; close.lua fixes a partition's close offset). `field` names the
-- close offset of the topic this partition consumes: 'raw', or 'grouped' for a personal
-- stream's buffers. Returns the close offset (nil while open) and whether the partition
-- was finalized already: a record stored after that would never leave (status 3, late).
local function close_state(base, field)
  local close = redis.call('HMGET', base .. ':close', field, 'state')
  return tonumber(close[1]), close[2] ~= false
end

-- A record seen first now on a finalized partition: refused (status 3), counted as late.
local function refuse_late(r)
  status[#status + 1] = r
  status[#status + 1] = 3
  late = late + 1
end

-- Whether this call finalizes the partition: its close offset is known, every offset
-- below it is handled (the watermark, after this call's records), and it was not
-- finalized before.
local function finalizing(offset, finalized)
  return offset ~= nil and not finalized and highest >= offset - 1
end

-- A finalized partition's pool: at least `floor` records leave whole (emit.lua, state
-- releasing); a smaller remainder waits in :handoff for the stream's final pool, where the
-- remainders of every partition are mixed (close.lua, receive.lua). A windowed stream
-- (floor -1) has no pool: its partition is done. What holds true values and is no longer
-- needed expires `retention` ms from now (0: kept); counters and the close state stay, so
-- late records are still refused.
local function finish_close(base, floor, retention, keys)
  local k_pool, state = base .. ':pool', 'done'
  if floor >= 0 then
    local size = redis.call('HLEN', k_pool)
    if size > 0 and size >= floor then
      state = 'releasing'
    else
      state = 'handoff'
      if size > 0 then redis.call('RENAME', k_pool, base .. ':handoff') end
      redis.call('DEL', base .. ':pooled')
      redis.call('HSET', base .. ':stats', 'handoff', size)
    end
  end
  redis.call('HSET', base .. ':close', 'state', state)
  if seen ~= nil then keys[#keys + 1] = base .. ':seen' end
  expire_with_ttl(retention, keys)
end
