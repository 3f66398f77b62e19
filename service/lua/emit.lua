-- Move records from a partition's mixing pool to its in-flight hash for publication.
-- Only the excess over the pool size leaves, drawn at random, so the members of one
-- group are spread over many emissions; a pool whose oldest record is older than the
-- flush interval is emitted whole, so a quiet stream still publishes. Each emission's
-- delay since arrival is counted in :delay (non-cumulative buckets in ms, count, sum_ms).
--
-- KEYS[1]  the partition's key prefix.
-- ARGV     now_ms, pool size to keep, flush_after_ms, most records to move, a fresh
--          random seed for this call's tokens, record ttl (ms, 0: none).
-- Returns  one string, "token entry" lines (entries hold no space or newline), because
--          one reply parses far faster than two per record.

local base = KEYS[1]
local k_pool, k_inflight, k_delay = base .. ':pool', base .. ':inflight', base .. ':delay'
local now, keep, flush_after = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl = tonumber(ARGV[6])
if ttl > 0 then
  -- As the buffered records (ingest.lua): pool and in-flight entries expire with them.
  redis.call('PEXPIRE', k_pool, ttl)
  redis.call('PEXPIRE', k_inflight, ttl)
end
local size = redis.call('ZCARD', k_pool)
if size == 0 then return '' end
local count = size - keep
local oldest = redis.call('ZRANGE', k_pool, 0, 0, 'WITHSCORES')
if now - tonumber(oldest[2]) >= flush_after then count = size end
count = math.min(count, tonumber(ARGV[4]))
if count <= 0 then return '' end
-- Time from arrival to emission, as a histogram: operators see delays, never per record.
local bounds = {100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000}
local in_bucket, total_ms = {}, 0
-- ZRANDMEMBER returns the whole set, or any small one, in score order: the order the
-- records entered the pool, which would publish a group's members side by side.
-- Shuffle (Fisher-Yates) with a linear congruential stream seeded from this call's
-- secret random seed: one SHA-1 per take instead of one per record.
local members = redis.call('ZRANDMEMBER', k_pool, count)
local state = tonumber(string.sub(redis.sha1hex(ARGV[5] .. ':shuffle'), 1, 8), 16)
for j = #members, 2, -1 do
  state = (1664525 * state + 1013904223) % 4294967296
  local k = math.floor(state / 4294967296 * j) + 1
  members[j], members[k] = members[k], members[j]
end
local lines = {}
for j, entry in ipairs(members) do
  -- 128 bits of SHA-1 of the caller's random seed: unique and unpredictable per record.
  local token = string.sub(redis.sha1hex(ARGV[5] .. ':' .. j), 1, 32)
  redis.call('ZREM', k_pool, entry)
  redis.call('HSET', k_inflight, token, entry)
  lines[j] = token .. ' ' .. entry
  local delay = math.max(now - tonumber(string.match(entry, '|(%d+)|[^|]*$')), 0)
  local bucket = '+Inf'
  for _, bound in ipairs(bounds) do
    if delay <= bound then
      bucket = bound
      break
    end
  end
  in_bucket[bucket] = (in_bucket[bucket] or 0) + 1
  total_ms = total_ms + delay
end
for bucket, n in pairs(in_bucket) do
  redis.call('HINCRBY', k_delay, bucket, n)
end
redis.call('HINCRBY', k_delay, 'count', #lines)
redis.call('HINCRBY', k_delay, 'sum_ms', total_ms)
return table.concat(lines, '\n')
