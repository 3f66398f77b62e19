-- Shared by the ingest scripts, prepended to each when it is registered.

-- Remember a record's dedup key. Returns 0 for a record seen first now, 1 for a
-- redelivery (same digest: skip it) and 2 for an id reused with other content.
local function remember(k_dedup, dedup, digest)
  local known = redis.call('HGET', k_dedup, dedup)
  if not known then
    redis.call('HSET', k_dedup, dedup, digest)
    return 0
  end
  return known == digest and 1 or 2
end

