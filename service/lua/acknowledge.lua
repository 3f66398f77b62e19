-- Forget emissions the broker acknowledged; until then they stay in flight and a
-- restarted worker re-sends them with the same tokens.
-- KEYS[1] the partition's key prefix; ARGV the acknowledged tokens.
local removed = redis.call('HDEL', KEYS[1] .. ':inflight', unpack(ARGV))
redis.call('HINCRBY', KEYS[1] .. ':stats', 'published', removed)
return removed
