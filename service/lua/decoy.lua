-- Decoy groups for one stream partition (SPEC §2.1, §3), one atomic step per batch:
-- store new records idempotently, cut every group the buffer allows, randomize its
-- members, hand finished records to the mixing pool, suppress records that waited
-- past max_wait.
--
-- KEYS[1]  the partition's key prefix, "splu:{<stream>:<partition>}"; every key below
--          extends it, so one Redis Cluster hash slot holds them all.
-- ARGV     now_ms, max_wait_ms, gamma, w (sensitive attributes), seed, dedup window
--          (ms), record ttl (ms, 0: none), n, then one argument per record: id (32 hex digits), digest (8 bytes),
--          then "public codes|values|draws|raw offset|dedup key" (codes comma-separated).
-- Returns  the number of pending records, the pool size, then position and status of
--          each record not stored anew (1 redelivered, 2 id reused with other content).
--
-- Keys: :d:<window> dedup key -> digest, :off highest raw offset stored (ingest.lua); :rec id -> msgpack {arrival, public, values, draws,
-- published, pending, group values}; :t arrival index; :b:<a>:<v> bucket of attribute a,
-- value v (members are ids, score 0, so ZPOPMIN takes the smallest random id); :n:<a>
-- value -> bucket size; :pool entry -> time, an entry being "public|published|group
-- number:values|arrival|id" (group number, values and arrival stay inside, for audits
-- and the delay histogram; the emitter publishes only the first two fields); :stats
-- counters; :sup "<a>:<v>" -> suppressed; :truth "public|true values" -> records
-- pooled, the producer-side truth the consumer's adversary simulation scores against.

local base = KEYS[1]
local now, max_wait, gamma = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local w, seed, window, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local k_rec, k_time = base .. ':rec', base .. ':t'
local k_pool, k_stats, k_sup = base .. ':pool', base .. ':stats', base .. ':sup'
local k_truth = base .. ':truth'

local function split(text)
  local out = {}
  for item in string.gmatch(text, '[^,]+') do out[#out + 1] = item end
  return out
end

open_dedup(base, k_stats, now, window)
local added = 0
for r = 1, n do
  local id, digest, fields = parse(ARGV[8 + r], 5)
  if first_seen(r, fields[5], digest, fields[4]) then
    local public, values, draws = fields[1], split(fields[2]), split(fields[3])
    for a = 1, w do
      draws[a] = tonumber(draws[a])
      redis.call('ZADD', base .. ':b:' .. a .. ':' .. values[a], 0, id)
      redis.call('HINCRBY', base .. ':n:' .. a, values[a], 1)
    end
    redis.call('HSET', k_rec, id, cmsgpack.pack({now, public, values, draws, {}, w, {}}))
    redis.call('ZADD', k_time, now, id)
    added = added + 1
  end
end

-- Keyed uniforms: SHA-1 of a secret per-partition seed and a persistent counter, so
-- no two cuts reuse randomness and a replay of the same state cuts the same groups.
local counter = tonumber(redis.call('HGET', k_stats, 'draws') or '0')
local block, position = '', 41
local function uniform()
  if position > 33 then
    counter = counter + 1
    block = redis.sha1hex(seed .. ':' .. counter)
    position = 1
  end
  local x = tonumber(string.sub(block, position, position + 7), 16)
  position = position + 8
  return x / 4294967296
end

local function numeric(x, y)
  return tonumber(x) < tonumber(y)
end

local pooled = 0
local function finish(id, record)
  local entry = record[2] .. '|' .. table.concat(record[5], ',') .. '|'
    .. table.concat(record[7], ';') .. '|' .. record[1] .. '|' .. id
  redis.call('ZADD', k_pool, now, entry)
  redis.call('HINCRBY', k_truth, record[2] .. '|' .. table.concat(record[3], ','), 1)
  redis.call('HDEL', k_rec, id)
  redis.call('ZREM', k_time, id)
  pooled = pooled + 1
end

-- Each member publishes its group's (sorted) value at its own keyed draw index. The
-- audit keeps the group's number in this partition and its values.
local function assign(id, a, values, number)
  local record = cmsgpack.unpack(redis.call('HGET', k_rec, id))
  record[5][a] = values[record[4][a] + 1]
  record[7][a] = number .. ':' .. table.concat(values, ',')
  record[6] = record[6] - 1
  if record[6] == 0 then
    finish(id, record)
  else
    redis.call('HSET', k_rec, id, cmsgpack.pack(record))
  end
end

-- Cut groups of gamma distinct values while gamma buckets are non-empty. A value whose
-- bucket holds at least 1/gamma of the pending records is always taken (skipping it
-- would push it further over its share); the rest are chosen one by one with
-- probability proportional to bucket size among the values not yet in the group.
local groups = 0
local numbered = tonumber(redis.call('HGET', k_stats, 'groups') or '0')
local function cut(a)
  local key_counts = base .. ':n:' .. a
  local flat = redis.call('HGETALL', key_counts)
  local values, size, pending, nonempty = {}, {}, 0, 0
  for j = 1, #flat, 2 do
    local c = tonumber(flat[j + 1])
    values[#values + 1] = flat[j]
    size[flat[j]] = c
    pending = pending + c
    if c > 0 then nonempty = nonempty + 1 end
  end
  table.sort(values, numeric)
  while nonempty >= gamma do
    local chosen, taken, weight = {}, {}, 0
    for _, v in ipairs(values) do
      if size[v] > 0 and size[v] * gamma >= pending then
        chosen[#chosen + 1] = v
        taken[v] = true
        weight = weight + size[v]
      end
    end
    while #chosen < gamma do
      local x = uniform() * (pending - weight)
      local pick
      for _, v in ipairs(values) do
        if size[v] > 0 and not taken[v] then
          pick = v
          x = x - size[v]
          if x < 0 then break end
        end
      end
      chosen[#chosen + 1] = pick
      taken[pick] = true
      weight = weight + size[pick]
    end
    table.sort(chosen, numeric)
    local members = {}
    for j, v in ipairs(chosen) do
      members[j] = redis.call('ZPOPMIN', base .. ':b:' .. a .. ':' .. v)[1]
      size[v] = size[v] - 1
      pending = pending - 1
      if size[v] == 0 then nonempty = nonempty - 1 end
    end
    groups = groups + 1
    for _, id in ipairs(members) do
      assign(id, a, chosen, numbered + groups)
    end
  end
  for _, v in ipairs(values) do
    if size[v] > 0 then
      redis.call('HSET', key_counts, v, size[v])
    else
      redis.call('HDEL', key_counts, v)
    end
  end
end

if added > 0 then
  for a = 1, w do
    cut(a)
  end
end

-- Records still waiting after max_wait belong to values over their share (or to the
-- last few values of a quiet stream): suppress them, never publish, count per value.
local expired = redis.call('ZRANGEBYSCORE', k_time, '-inf', now - max_wait)
for _, id in ipairs(expired) do
  local record = cmsgpack.unpack(redis.call('HGET', k_rec, id))
  for a = 1, w do
    if record[5][a] == nil then
      local v = record[3][a]
      redis.call('ZREM', base .. ':b:' .. a .. ':' .. v, id)
      if redis.call('HINCRBY', base .. ':n:' .. a, v, -1) <= 0 then
        redis.call('HDEL', base .. ':n:' .. a, v)
      end
      redis.call('HINCRBY', k_sup, a .. ':' .. v, 1)
    end
  end
  redis.call('HDEL', k_rec, id)
  redis.call('ZREM', k_time, id)
end

local buffered = {k_rec, k_time}
for a = 1, w do
  buffered[#buffered + 1] = base .. ':n:' .. a
  for _, v in ipairs(redis.call('HKEYS', base .. ':n:' .. a)) do
    buffered[#buffered + 1] = base .. ':b:' .. a .. ':' .. v
  end
end
expire_with_ttl(ttl, buffered)

redis.call('HSET', k_stats, 'draws', counter)
redis.call('HINCRBY', k_stats, 'groups', groups)
redis.call('HINCRBY', k_stats, 'pooled', pooled)
redis.call('HINCRBY', k_stats, 'suppressed', #expired)
return reply(base, k_stats, added, redis.call('ZCARD', k_time), redis.call('ZCARD', k_pool))
