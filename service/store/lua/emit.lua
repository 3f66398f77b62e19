-- Move records from a partition's mixing pool to a take in flight, for publication.
--
-- The mixing rule (SPEC §3, docs/architecture.md): the pool never drops below its floor
-- of `floor` records; each call releases only the excess over the floor, drawn uniformly
-- and in uniformly random order; a pool that received nothing for `quiet_ms` (the
-- stream's end) is released whole, but only if it holds at least the floor. So every
-- record leaves in a uniformly shuffled take drawn from at least `floor` records, at any
-- arrival rate; in a slow stream records wait until the floor fills (the delay
-- histogram in :delay shows what that costs).
--
-- The draws come from SHA-1 in counter mode over a 128-bit seed the caller takes fresh
-- from the operating system for each call: three 48-bit uniforms per SHA-1 block, so no
-- short internal state limits the orders a take can have, and nobody can search the seed
-- space to undo a shuffle. Redis's own PRNG (HRANDFIELD, math.random) is not used.
--
-- A take is kept whole until the broker acknowledged it (acknowledge.lua): one field of
-- ':takes', its seed -> its entries in the order drawn, one per line. The seed is the
-- take's id and never leaves the worker and Redis; the worker derives the take's tokens
-- from it (service/store/buffer.py, `take_tokens`), so a take re-sent after a crash goes
-- out under the same tokens, and Redis keeps nothing per record in flight.
--
-- At a survey's end (SPEC §3) a partition's pool leaves whole if it holds at least the
-- floor (state releasing, ingest.lua's finish_close); a smaller remainder joins the
-- stream's final pool (close.lua, receive.lua), where every partition's remainder is
-- mixed. The final pool waits until every partition's remainder is in, then leaves whole,
-- a uniformly shuffled take of the whole stream's remainder. If it holds fewer than the
-- minimum mixing (10 groups), the configured choice applies: it is suppressed, counted,
-- or published as the stream's smallest take, its size kept (`final_take`) so the reports
-- state what a take that small tells.
--
-- KEYS[1]  the partition's key prefix, or the final pool's ("splu:{<stream>:final}").
-- ARGV     now_ms, floor (records), quiet_ms, most records to move at once, a fresh
--          random seed (32 hex digits), partitions (0 for a partition's pool; for the final
--          pool, the stream's partition count, whose remainders it waits for), minimum
--          mixing (records), what a smaller final remainder gets ('publish' or 'suppress'),
--          and optionally the first SHA-1 blocks of the take's shuffle (uniforms.lua),
--          hashed by the worker.
-- Returns  the records left in the pool, and the take's entries in the order drawn, one
--          per line (empty if nothing was taken).

local base = KEYS[1]
local k_pool, k_takes, k_stats = base .. ':pool', base .. ':takes', base .. ':stats'
local now, floor, quiet_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, seed = tonumber(ARGV[4]), ARGV[5]
local partitions, min_mixing, small = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local given_blocks = ARGV[9]
assert(#seed >= 32, 'the shuffle needs a seed of at least 128 bits')

local size = redis.call('HLEN', k_pool)
local count
if partitions > 0 then
  -- The final pool: whole, once every partition's remainder is in.
  if redis.call('SCARD', base .. ':from') < partitions or size == 0 then return {size, ''} end
  if not redis.call('HGET', k_stats, 'final_take') then
    redis.call('HSET', k_stats, 'final_take', size)
    if size < min_mixing and small == 'suppress' then
      redis.call('DEL', k_pool, base .. ':pooled')
      redis.call('HINCRBY', k_stats, 'suppressed', size)
      redis.call('HINCRBY', k_stats, 'suppressed_remainder', size)
      redis.call('HSET', k_stats, 'pool', 0)
      return {0, ''}
    end
  end
  count = math.min(size, limit)
elseif redis.call('HGET', base .. ':close', 'state') == 'releasing' then
  -- A closed partition's pool of at least the floor: whole, in takes of at most `limit`.
  if size == 0 then
    redis.call('HSET', base .. ':close', 'state', 'handoff')
    return {0, ''}
  end
  count = math.min(size, limit)
else
  count = math.min(size - floor, limit)
  if count <= 0 and size > 0 and size >= floor then
    local pooled = tonumber(redis.call('GET', base .. ':pooled') or 0)
    if now - pooled >= quiet_ms then count = size end
  end
end
if count <= 0 then return {size, ''} end
-- A seed is drawn fresh for each take: one seen before means the entropy is broken, and
-- the take would overwrite one still in flight.
if redis.call('HEXISTS', k_takes, seed) == 1 then
  return redis.error_reply('a take seed was used before: the entropy source repeats')
end

-- A partial Fisher-Yates shuffle from the pool's end: for last = size down to
-- size - count + 1, draw j uniformly from 1..last, take position j and move the record at
-- `last` into it. The takes are a uniformly drawn, uniformly ordered sample, and the pool
-- stays dense in 1..size - count. The draw is the textbook one over the positions read
-- from the end (tests/test_grouping_leak.py writes it again). It runs on positions first:
-- `from[p]`, the position whose record now sits at p (p itself if absent), so that every
-- record the take touches is read in one HMGET and written in one HMSET.
local uniform = sha1_uniforms(seed, 0, 12, given_blocks)
local from, drawn = {}, {}
for step = 1, count do
  local last = size - step + 1
  local j = last - math.floor(uniform() * last)
  drawn[step] = from[j] or j
  from[j] = from[last] or last
end
local left = size - count
local moved_to, read = {}, {}
for j in pairs(from) do
  if j <= left then moved_to[#moved_to + 1] = j end
end
for step = 1, count do read[step] = drawn[step] end
for k = 1, #moved_to do read[count + k] = from[moved_to[k]] end

-- In chunks: Lua's unpack() stops at a few thousand values.
local entry_at = {}
for start = 1, #read, 1000 do
  local stop = math.min(start + 999, #read)
  local found = redis.call('HMGET', k_pool, unpack(read, start, stop))
  for k = start, stop do entry_at[read[k]] = found[k - start + 1] end
end
local taken = {}
for step = 1, count do taken[step] = entry_at[drawn[step]] end
-- HMSET, with HSET's effect, so that a MONITOR feed tells a record moved within the pool
-- from one entering it (pool.lua), which tests/test_faults.py counts.
for start = 1, #moved_to, 1000 do
  local fields = {}
  for k = start, math.min(start + 999, #moved_to) do
    local j = moved_to[k]
    fields[#fields + 1] = j
    fields[#fields + 1] = entry_at[from[j]]
  end
  redis.call('HMSET', k_pool, unpack(fields))
end
local take = table.concat(taken, '\n')
pool_took(base, seed, take, count, left, size)
return {left, take}
