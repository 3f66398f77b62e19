-- Move records from a partition's mixing pool to its in-flight hash for publication.
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
-- space to undo a shuffle. Redis's own PRNG (ZRANDMEMBER, math.random) is not used.
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
--          and optionally the first tokens of the take (below), 32 hex digits each,
--          concatenated, and the first SHA-1 blocks of its shuffle (uniforms.lua).
-- Returns  token, entry, token, entry, ... in the order drawn.

local base = KEYS[1]
local k_pool, k_inflight = base .. ':pool', base .. ':inflight'
local k_delay, k_stats = base .. ':delay', base .. ':stats'
local now, floor, quiet_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, seed = tonumber(ARGV[4]), ARGV[5]
local partitions, min_mixing, small = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local given, given_blocks = ARGV[9] or '', ARGV[10]
assert(#seed >= 32, 'the shuffle needs a seed of at least 128 bits')

local size = redis.call('ZCARD', k_pool)
local count
if partitions > 0 then
  -- The final pool: whole, once every partition's remainder is in.
  if redis.call('SCARD', base .. ':from') < partitions or size == 0 then return {} end
  if not redis.call('HGET', k_stats, 'final_take') then
    redis.call('HSET', k_stats, 'final_take', size)
    if size < min_mixing and small == 'suppress' then
      redis.call('DEL', k_pool)
      redis.call('HINCRBY', k_stats, 'suppressed', size)
      redis.call('HINCRBY', k_stats, 'suppressed_remainder', size)
      redis.call('HSET', k_stats, 'pool', 0)
      return {}
    end
  end
  count = math.min(size, limit)
elseif redis.call('HGET', base .. ':close', 'state') == 'releasing' then
  -- A closed partition's pool of at least the floor: whole, in takes of at most `limit`.
  if size == 0 then
    redis.call('HSET', base .. ':close', 'state', 'handoff')
    return {}
  end
  count = math.min(size, limit)
else
  count = math.min(size - floor, limit)
  if count <= 0 and size > 0 and size >= floor then
    local newest = redis.call('ZRANGE', k_pool, -1, -1, 'WITHSCORES')
    if now - tonumber(newest[2]) >= quiet_ms then count = size end
  end
end
if count <= 0 then return {} end

local uniform = sha1_uniforms(seed, 0, 12, given_blocks)

-- A partial Fisher-Yates shuffle of the whole pool: its first `count` positions are a
-- uniformly drawn, uniformly ordered sample. A small take from a large pool (a backlog)
-- reads only the positions it touches, by rank, instead of the whole pool each time:
-- the same swaps on the same positions, so the same sample in the same order. A take
-- touches up to 2 × count positions, and one ZRANGE per position costs Redis about as
-- much as reading 7 members in one (docs/performance.md, *The mixing pool's take*).
local members
if 14 * count >= size then
  members = redis.call('ZRANGE', k_pool, 0, -1)
else
  members = setmetatable({}, {__index = function(read, position)
    local member = redis.call('ZRANGE', k_pool, position - 1, position - 1)[1]
    rawset(read, position, member)
    return member
  end})
end
for i = 1, count do
  local j = i + math.floor(uniform() * (size - i + 1))
  members[i], members[j] = members[j], members[i]
end

-- Time from arrival to emission, as a histogram: operators see delays, never per record.
-- DELAY_BOUNDS (ms) is prepended at registration from service.store.buffer.DELAY_BOUNDS_MS.
-- Records stored by one ingest call share their arrival, so a take holds few distinct
-- ones: each is placed in its bucket once.
local bucket_of = {}
local function delay_bucket(arrival)
  local delay = math.max(now - tonumber(arrival), 0)
  local bucket = '+Inf'
  for _, bound in ipairs(DELAY_BOUNDS) do
    if delay <= bound then
      bucket = bound
      break
    end
  end
  bucket_of[arrival] = {bucket, delay}
  return bucket_of[arrival]
end

-- Token j is the first 128 bits of SHA-1(seed:t:j): unique and unpredictable per
-- record. The worker sends those of the records it expects (service/store/buffer.py computes
-- them alike), as hashing costs Redis more than its whole part of the take otherwise;
-- the rest are hashed here.
local given_count = math.floor(#given / 32)
local in_bucket, total_ms, flight = {}, 0, {}
for j = 1, count do
  local entry = members[j]
  local token
  if j <= given_count then
    token = string.sub(given, 32 * j - 31, 32 * j)
  else
    token = string.sub(redis.sha1hex(seed .. ':t:' .. j), 1, 32)
  end
  flight[2 * j - 1], flight[2 * j] = token, entry
  -- An entry ends "|arrival|id", the id 32 hex digits: the scan starts 64 characters
  -- from the end rather than at every position of the entry.
  local arrival = string.match(entry, '|(%d+)|[^|]*$', -64)
  local placed = bucket_of[arrival] or delay_bucket(arrival)
  in_bucket[placed[1]] = (in_bucket[placed[1]] or 0) + 1
  total_ms = total_ms + placed[2]
end
-- In chunks: Lua's unpack() stops at a few thousand values. The shuffle left the take in
-- the pool's first `count` positions.
for start = 1, count, 4000 do
  redis.call('ZREM', k_pool, unpack(members, start, math.min(start + 3999, count)))
end
for start = 1, count, 1000 do
  redis.call('HSET', k_inflight, unpack(flight, 2 * start - 1, 2 * math.min(start + 999, count)))
end
for bucket, n in pairs(in_bucket) do
  redis.call('HINCRBY', k_delay, bucket, n)
end
redis.call('HINCRBY', k_delay, 'count', count)
redis.call('HINCRBY', k_delay, 'sum_ms', total_ms)
redis.call('HSET', k_stats, 'pool', size - count, 'in_flight', redis.call('HLEN', k_inflight))
return flight
