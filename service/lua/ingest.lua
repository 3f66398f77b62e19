-- Shared by the ingest scripts (decoy.lua, personal.lua), prepended to each when it
-- is registered: argument parsing, idempotent storage and the reply.

-- A record argument: id (32 hex digits), digest (8 bytes), then count '|'-separated
-- fields, the last (the dedup key, which holds the producer's record id) taking the
-- rest, '|' included.
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

local status, redelivered, conflicts = {}, 0, 0

-- Remember record r's dedup key. True for a record seen first now; a redelivery (same
-- digest) or an id reused with other content is skipped, reported as status 1 or 2
-- and counted.
local function first_seen(k_dedup, r, dedup, digest)
  local known = redis.call('HGET', k_dedup, dedup)
  if not known then
    redis.call('HSET', k_dedup, dedup, digest)
    return true
  end
  local seen = known == digest and 1 or 2
  status[#status + 1] = r
  status[#status + 1] = seen
  if seen == 1 then
    redelivered = redelivered + 1
  else
    conflicts = conflicts + 1
  end
  return false
end

-- Count the batch's stored and skipped records; reply with the records still waiting,
-- the pool size, then the position and status of each skipped record.
local function reply(k_stats, added, waiting, pool)
  redis.call('HINCRBY', k_stats, 'ingested', added)
  redis.call('HINCRBY', k_stats, 'redelivered', redelivered)
  redis.call('HINCRBY', k_stats, 'conflicts', conflicts)
  table.insert(status, 1, pool)
  table.insert(status, 1, waiting)
  return status
end
