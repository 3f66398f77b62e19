-- One decoy step the worker decided (service/core/decoy_cuts.py) for a partition with one
-- sensitive attribute, checked and stored in one atomic call: the same writes decoy.lua
-- makes for the same step, which Redis no longer computes. decoy.lua's comment names the
-- keys.
--
-- KEYS[1]  the partition's key prefix.
-- ARGV     now_ms, record ttl (ms, 0: none), then what the worker assumed: the watermark
--          (':off'), the keyed draws used and the records waiting; then the step: the
--          new watermark and draws used, records added, redelivered, replayed, groups cut
--          and suppressed, then the lengths of five lists, then the lists: pool entries;
--          (id, msgpack record, value) of each record stored to wait; (id, value) of each
--          stored record grouped or suppressed now; (value, records) suppressed per value;
--          (value, records waiting) of each value whose bucket changed, 0 to drop it.
-- Returns  the pool's size; or 'STALE' (the partition is not as the worker assumed) or
--          'CLOSING' (a close is under way, which decoy.lua handles), having written
--          nothing: the worker then runs decoy.lua on Redis's own state.

local base = KEYS[1]
local k_rec, k_time, k_stats = base .. ':rec', base .. ':t', base .. ':stats'
local now, ttl = ARGV[1], tonumber(ARGV[2])

local close = redis.call('HMGET', base .. ':close', 'raw', 'state')
if close[1] or close[2] then return 'CLOSING' end
if tonumber(redis.call('GET', base .. ':off') or '-1') ~= tonumber(ARGV[3])
  or tonumber(redis.call('HGET', k_stats, 'draws') or '0') ~= tonumber(ARGV[4])
  or redis.call('HLEN', k_rec) ~= tonumber(ARGV[5]) then
  return 'STALE'
end

local watermark, draws = ARGV[6], ARGV[7]
local added, redelivered, replayed = ARGV[8], ARGV[9], ARGV[10]
local groups, suppressed = ARGV[11], ARGV[12]
local n_pool, n_new, n_left = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local n_suppressed, n_sizes = tonumber(ARGV[16]), tonumber(ARGV[17])
local at = 17

local entries = {}
for j = 1, n_pool do entries[j] = ARGV[at + j] end
at = at + n_pool

local function bucket_key(v) return base .. ':b:1:' .. v end

-- Records left waiting: :rec, the arrival index and their bucket. In chunks: Lua's
-- unpack() stops at a few thousand values.
for start = 1, n_new, 300 do
  local stop, records, arrivals = math.min(start + 299, n_new), {}, {}
  for j = 1, stop - start + 1 do
    local id, v = ARGV[at + 1], ARGV[at + 3]
    records[2 * j - 1], records[2 * j] = id, ARGV[at + 2]
    arrivals[2 * j - 1], arrivals[2 * j] = now, id
    redis.call('ZADD', bucket_key(v), 0, id)
    at = at + 3
  end
  redis.call('HSET', k_rec, unpack(records))
  redis.call('ZADD', k_time, unpack(arrivals))
end
for start = 1, n_left, 1000 do
  local stop, ids = math.min(start + 999, n_left), {}
  for j = 1, stop - start + 1 do
    ids[j] = ARGV[at + 1]
    redis.call('ZREM', bucket_key(ARGV[at + 2]), ids[j])
    at = at + 2
  end
  redis.call('HDEL', k_rec, unpack(ids))
  redis.call('ZREM', k_time, unpack(ids))
end
for _ = 1, n_suppressed do
  redis.call('HINCRBY', base .. ':sup', '1:' .. ARGV[at + 1], ARGV[at + 2])
  at = at + 2
end
for _ = 1, n_sizes do
  local v, size = ARGV[at + 1], ARGV[at + 2]
  at = at + 2
  if size == '0' then
    redis.call('HDEL', base .. ':n:1', v)
  else
    redis.call('HSET', base .. ':n:1', v, size)
  end
end
local pool = pool_add(base, entries, now)

if ttl > 0 then
  local buffered = {k_rec, k_time, base .. ':open', base .. ':holes', base .. ':n:1'}
  for _, v in ipairs(redis.call('HKEYS', base .. ':n:1')) do
    buffered[#buffered + 1] = bucket_key(v)
  end
  for _, key in ipairs(buffered) do redis.call('PEXPIRE', key, ttl) end
end

local waiting = redis.call('HLEN', k_rec)
redis.call('HSET', k_stats, 'draws', draws, 'pool', pool)
redis.call('HINCRBY', k_stats, 'groups', groups)
redis.call('HINCRBY', k_stats, 'pooled', n_pool)
redis.call('HINCRBY', k_stats, 'suppressed', suppressed)
redis.call('HINCRBY', k_stats, 'refills', 0)
redis.call('HINCRBY', k_stats, 'ingested', added)
redis.call('HINCRBY', k_stats, 'redelivered', redelivered)
redis.call('HINCRBY', k_stats, 'replayed', replayed)
redis.call('HINCRBY', k_stats, 'conflicts', 0)
redis.call('HSET', base .. ':waiting', 'held', 0, 'pending', waiting)
if ttl > 0 then redis.call('PEXPIRE', base .. ':waiting', ttl) end
redis.call('SET', base .. ':off', watermark)
return pool
