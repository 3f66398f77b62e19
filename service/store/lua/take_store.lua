-- One take the worker drew (service/core/takes.py) from a partition's pool it holds,
-- checked and stored in one atomic call: the same writes emit.lua makes for the same seed,
-- which Redis no longer draws. emit.lua's comment names the keys and the rule.
--
-- KEYS[1]  the partition's key prefix.
-- ARGV     the pool's size the worker assumed, the take's seed (its id), its records, its
--          entries in the order drawn, one per line, then (position, entry) of each record left in
--          the pool that moved.
-- Returns  the records left in the pool; or 'STALE' (the pool is not the size the worker
--          assumed) or 'CLOSING' (a close is under way, whose release emit.lua makes),
--          having written nothing: the worker then runs emit.lua on Redis's own state.

local base = KEYS[1]
local k_pool, k_takes = base .. ':pool', base .. ':takes'
local size, seed, count, take = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4]
assert(#seed >= 32, 'the shuffle needs a seed of at least 128 bits')

local close = redis.call('HMGET', base .. ':close', 'raw', 'state')
if close[1] or close[2] then return 'CLOSING' end
if redis.call('HLEN', k_pool) ~= size then return 'STALE' end
if redis.call('HEXISTS', k_takes, seed) == 1 then
  return redis.error_reply('a take seed was used before: the entropy source repeats')
end

local left = size - count
-- HMSET, as emit.lua moves records within the pool (tests/test_faults.py counts them).
for start = 5, #ARGV, 2000 do
  redis.call('HMSET', k_pool, unpack(ARGV, start, math.min(start + 1999, #ARGV)))
end
pool_took(base, seed, take, count, left, size)
return left
