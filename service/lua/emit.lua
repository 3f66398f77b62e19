-- Move records from a partition's mixing pool to its in-flight hash for publication.
-- Only the excess over the pool size leaves, drawn at random, so the members of one
-- group are spread over many emissions; a pool whose oldest record is older than the
-- flush interval is emitted whole, so a quiet stream still publishes.
--
-- KEYS[1]  the partition's key prefix.
-- ARGV     now_ms, pool size to keep, flush_after_ms, most records to move, a fresh
--          random seed for this call's tokens.
-- Returns  one string, "token entry" lines (entries hold no space or newline), because
--          one reply parses far faster than two per record.

local base = KEYS[1]
local k_pool, k_inflight = base .. ':pool', base .. ':inflight'
local now, keep, flush_after = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local size = redis.call('ZCARD', k_pool)
if size == 0 then return '' end
local count = size - keep
local oldest = redis.call('ZRANGE', k_pool, 0, 0, 'WITHSCORES')
if now - tonumber(oldest[2]) >= flush_after then count = size end
count = math.min(count, tonumber(ARGV[4]))
if count <= 0 then return '' end
local lines = {}
for j, entry in ipairs(redis.call('ZRANDMEMBER', k_pool, count)) do
  -- 128 bits of SHA-1 of the caller's random seed: unique and unpredictable per record.
  local token = string.sub(redis.sha1hex(ARGV[5] .. ':' .. j), 1, 32)
  redis.call('ZREM', k_pool, entry)
  redis.call('HSET', k_inflight, token, entry)
  lines[j] = token .. ' ' .. entry
end
return table.concat(lines, '\n')
