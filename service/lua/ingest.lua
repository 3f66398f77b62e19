-- Shared by the ingest scripts (decoy.lua, personal.lua), prepended to each when it
-- is registered: argument parsing, idempotent storage and the reply.

-- A record argument: id (32 hex digits), digest (8 bytes), then count '|'-separated
-- fields, the last two being the raw offset and the dedup key (which holds the
-- producer's record id and takes the rest, '|' included).
local function parse(arg, count)
  local fields, start = {}, 41
  for f = 1, count - 1 do
    local stop = string.find(arg, '|', start, true)
    fields[f] = string.sub(arg, start, stop - 1)
    start = stop + 1
  end
  fields[count] = string.sub(arg, start)
  return string.sub(arg, 1, 32), string.sub(arg, 33, 40), fields
end

local status, redelivered, conflicts, replayed = {}, 0, 0, 0
local k_current, k_previous, watermark, highest

-- The dedup index keeps each record's dedup key for one to two dedup windows, in one
-- hash per window (":d:<window number>"), so its memory is bounded; older windows are
-- dropped whole. Past the window, a replay is still recognised by its raw offset: a
-- partition's offsets only grow, and ":off" holds the highest one stored.
local function open_dedup(base, k_stats, now, window)
  local current = math.floor(now / window)
  local last = tonumber(redis.call('HGET', k_stats, 'dedup_window') or current)
  for old = last - 1, math.min(last, current - 2) do
    redis.call('UNLINK', base .. ':d:' .. old)
  end
  redis.call('HSET', k_stats, 'dedup_window', current)
  k_current, k_previous = base .. ':d:' .. current, base .. ':d:' .. (current - 1)
  watermark = tonumber(redis.call('GET', base .. ':off') or '-1')
  highest = watermark
end

-- True for a record seen first now. A redelivery (same digest, or an offset at or
-- below the watermark) or an id reused with other content is skipped, reported as
-- status 1 or 2 and counted.
local function first_seen(r, dedup, digest, offset)
  offset = tonumber(offset)
  if offset > highest then highest = offset end
  local known = redis.call('HGET', k_current, dedup) or redis.call('HGET', k_previous, dedup)
  if not known and offset > watermark then
    redis.call('HSET', k_current, dedup, digest)
    return true
  end
  local seen = (not known or known == digest) and 1 or 2
  status[#status + 1] = r
  status[#status + 1] = seen
  if seen == 2 then
    conflicts = conflicts + 1
  else
    redelivered = redelivered + 1
    if not known then replayed = replayed + 1 end
  end
  return false
end

-- Count the batch's stored and skipped records; reply with the records still waiting,
-- the pool size, then the position and status of each skipped record.
local function reply(base, k_stats, added, waiting, pool)
  redis.call('HINCRBY', k_stats, 'ingested', added)
  redis.call('HINCRBY', k_stats, 'redelivered', redelivered)
  redis.call('HINCRBY', k_stats, 'replayed', replayed)
  redis.call('HINCRBY', k_stats, 'conflicts', conflicts)
  redis.call('SET', base .. ':off', highest)
  table.insert(status, 1, pool)
  table.insert(status, 1, waiting)
  return status
end

-- With a record TTL, a partition's buffered records (and its pool and in-flight entries,
-- see emit.lua) expire together ttl ms after a worker last touched the partition: while
-- a worker runs its ticks keep them alive, and raw records of a stream nobody runs any
-- more leave Redis by themselves. Counters and aggregates stay, so what expired shows
-- as ingested records neither published, suppressed nor waiting.
local function expire_with_ttl(ttl, keys)
  if ttl <= 0 then return end
  for _, key in ipairs(keys) do
    redis.call('PEXPIRE', key, ttl)
  end
end
