-- Personal groups for one partition of <stream>.grouped (SPEC §2.2, §3), which holds
-- every record of its groups (streams/runtime/app.py routes each group to one partition), so a
-- group's budget here is its whole budget. One atomic step per batch:
-- store new records idempotently in their group's buffer, release a group when its
-- buffer reaches the release size or its oldest record waited max_wait, and publish
-- each released record either as a trial (its own perturbed value) or as a copy of an
-- earlier trial of the same original value (streaming scaling). Copies add rows, not
-- trials.
--
-- Reserve trials: with L the group's trial limit now and U = m - (values with a trial
-- in the group), a record is a trial if trials < L - U, or if its value has no trial yet
-- and trials < L; otherwise it copies a trial of its own value. U trials stay reserved
-- for the values not seen yet, so while L >= m every value a group ever holds gets a
-- trial, every row's source holds the row's own value, and the estimate is unbiased in
-- any arrival order; trials never exceed L, so the (lambda, delta) test is unchanged.
-- Only a record whose value has no trial when none may be spent (L < m, a bounded limit
-- that fell, a frozen group) still copies another value's trial: a borrowed copy,
-- counted per group in :gstat ("<group>|borrowed") for the budget test, which reports
-- how many groups borrow. It is published rather than dropped: a missing row would show
-- in the group's public count that this record's value had no trial there, while a
-- borrowed row says nothing of its record's value.
--
-- KEYS[1]  the partition's key prefix, "splu:{<stream>:<partition>}".
-- ARGV     now_ms, max_wait_ms, release_size, budget (bounded, adaptive, conservative or
--          none), fixed budget (conservative), p, m, lambda, delta, level (the bounded
--          budget's 1 - confidence), record ttl (ms, 0: none), through (the highest
--          grouped offset handled, ingest.lua), floor (the mixing pool's), closed retention
--          (ms), n, then one argument per record: id (32 hex digits), fingerprint
--          (ingest.lua), then "public codes|group key|value|perturbed value|offset" (the
--          grouped offset).
-- Returns  the number of buffered records, the pool size, then position and status of
--          each record not stored anew (1 redelivered, 2 id reused with other content, 3
--          late: the partition was finalized).
--
-- At the close (ingest.lua, close_state): once every grouped offset below the partition's
-- close offset is handled, every group still buffering is released whatever its size or
-- wait, then the pool leaves (finish_close); group state, which holds true values, then
-- expires after the closed retention.
--
-- Keys: :seen and :off (ingest.lua); :rec id -> msgpack {arrival, public, group, value,
-- perturbed}; :gq group -> arrival of its oldest buffered record; :g:<group>:buf
-- buffered ids; :g:<group>:s copy counters (cc:<v>) and the bounded budget's state
-- (epoch, bound, frozen); :g:<group>:tr:<v> perturbed values of the trials of original
-- value v; :g:<group>:tv values with trials; :gstat "<group>|total", "<group>|trials",
-- "<group>|c:<v>" (true counts), "<group>|borrowed" (borrowed copies) and
-- "<group>|frozen" (1 once its bound failed): the aggregates the budget test reads
-- (service/store/auditor.py, in the worker); :pool the mixing pool (pool.lua), an entry
-- being "public|published|t, c or b (trial, copy, borrowed copy)|true value|arrival|id",
-- of which the emitter publishes the first two fields; :stats counters and gauges, none of
-- them counting trials or copies: whether a record is a trial depends on its value.

local base = KEYS[1]
local now, max_wait, release_size = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local budget_mode, fixed_budget = ARGV[4], tonumber(ARGV[5])
local p, m, lambda, delta = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local level, ttl = tonumber(ARGV[10]), tonumber(ARGV[11])
local through, floor, retention = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local n = tonumber(ARGV[15])
local k_rec, k_queue, k_gstat = base .. ':rec', base .. ':gq', base .. ':gstat'
local k_stats = base .. ':stats'

open_dedup(base, n, 15, through, true)
local close_offset, finalized = close_state(base, 'grouped')
local touched, added = {}, 0
for r = 1, n do
  local id, bucket, key, digest, public, group, value, perturbed, offset =
    fields_of(ARGV[15 + r], 5)
  local fresh = first_seen(r, bucket, key, digest, offset)
  -- HSETNX: an id stored twice would be buffered and released twice.
  if fresh and finalized then
    refuse_late(r)
  elseif fresh and redis.call('HSETNX', k_rec, id, cmsgpack.pack({now, public, group, value,
      perturbed})) == 0 then
    status[#status + 1] = r
    status[#status + 1] = 1
    redelivered = redelivered + 1
  elseif fresh then
    local g = base .. ':g:' .. group
    if redis.call('RPUSH', g .. ':buf', id) == 1 then
      redis.call('ZADD', k_queue, now, group)
    end
    redis.call('HINCRBY', k_gstat, group .. '|total', 1)
    redis.call('HINCRBY', k_gstat, group .. '|c:' .. value, 1)
    touched[group] = true
    added = added + 1
  end
end

-- s_g = -2 (f p + (1-p)/m) ln(delta) / (lambda p f)^2 (seed 004 Cor. 6), whole: no other
-- partition holds records of the group. It falls as f rises, so planning with an upper
-- bound on f is safe.
local function trial_limit(f)
  return -2 * (f * p + (1 - p) / m) * math.log(delta) / (lambda * p * f) ^ 2
end

-- Trials the group may hold here, `trials` of them spent: conservative plans with f = 1,
-- adaptive with its largest frequency so far (overrun when it drifts), bounded with an
-- upper confidence bound on its final largest frequency, replanned once per doubling of
-- its records at level / ((e + 1)(e + 2)) for epoch e = floor(log2 records), so the
-- bounds of all epochs hold together with probability 1 - level (service.core.guarantees).
-- A bound below the frequency seen since, or trials over the limit at the current
-- frequency, mean the group drifted as the bound did not foresee: it is frozen, and
-- publishes copies only from then on.
local function budget(group, trials)
  if budget_mode == 'none' then return math.huge end
  if budget_mode == 'conservative' then return fixed_budget end
  local fields = {group .. '|total'}
  for v = 0, m - 1 do fields[#fields + 1] = group .. '|c:' .. v end
  local counts = redis.call('HMGET', k_gstat, unpack(fields))
  local total, largest = tonumber(counts[1]), 0
  for j = 2, #counts do
    local c = tonumber(counts[j] or '0')
    if c > largest then largest = c end
  end
  local f = largest / total
  if budget_mode == 'adaptive' then return math.floor(trial_limit(f)) end
  local k_state = base .. ':g:' .. group .. ':s'
  local state = redis.call('HMGET', k_state, 'epoch', 'bound', 'frozen')
  if state[3] then return 0 end
  local planned, bound = tonumber(state[1] or '-1'), tonumber(state[2] or '1')
  local epoch = 0
  while 2 ^ (epoch + 1) <= total do epoch = epoch + 1 end
  if epoch > planned then
    bound = share_upper_bound(largest, total, level / ((epoch + 1) * (epoch + 2)))
    -- %.17g: the bound read back is the double computed, not a 14-digit rounding.
    redis.call('HSET', k_state, 'epoch', epoch, 'bound', string.format('%.17g', bound))
  end
  if f > bound or trials > math.floor(trial_limit(f)) then
    redis.call('HSET', k_state, 'frozen', 1)
    redis.call('HSET', k_gstat, group .. '|frozen', 1)
    return 0
  end
  return math.floor(trial_limit(bound))
end

local released, pooled, pool_entries = 0, 0, {}
local function release(group)
  local g = base .. ':g:' .. group
  local ids = redis.call('LRANGE', g .. ':buf', 0, -1)
  redis.call('DEL', g .. ':buf')
  redis.call('ZREM', k_queue, group)
  local stat = redis.call('HMGET', k_gstat, group .. '|trials', group .. '|borrowed')
  local trials, borrowed = tonumber(stat[1] or '0'), tonumber(stat[2] or '0')
  local limit = budget(group, trials)
  local unseen = m - redis.call('SCARD', g .. ':tv')
  -- The values with trials in turn, for borrowed copies: read when first needed.
  local lenders = nil
  local borrowed_before = borrowed
  for _, id in ipairs(ids) do
    local record = cmsgpack.unpack(redis.call('HGET', k_rec, id))
    local value, out, kind = record[4], record[5], 't'
    local fresh = redis.call('LLEN', g .. ':tr:' .. value) == 0
    if trials < limit - unseen or (fresh and trials < limit) then
      trials = trials + 1
      redis.call('RPUSH', g .. ':tr:' .. value, out)
      if fresh then
        redis.call('SADD', g .. ':tv', value)
        unseen = unseen - 1
        lenders = nil
      end
    else
      local source = value
      if fresh then
        if lenders == nil then
          lenders = redis.call('SMEMBERS', g .. ':tv')
          table.sort(lenders, function(x, y) return tonumber(x) < tonumber(y) end)
        end
        source = lenders[borrowed % #lenders + 1]
        borrowed = borrowed + 1
        kind = 'b'
      else
        kind = 'c'
      end
      local list = g .. ':tr:' .. source
      local turn = redis.call('HINCRBY', g .. ':s', 'cc:' .. source, 1) - 1
      out = redis.call('LINDEX', list, turn % redis.call('LLEN', list))
    end
    -- A pool entry (service/core/wire.py).
    pooled = pooled + 1
    pool_entries[pooled] = record[2] .. '|' .. out .. '|' .. kind .. '|' .. value .. '|'
      .. record[1] .. '|' .. id
    redis.call('HDEL', k_rec, id)
  end
  redis.call('HSET', k_gstat, group .. '|trials', trials)
  if borrowed > borrowed_before then
    redis.call('HSET', k_gstat, group .. '|borrowed', borrowed)
  end
  released = released + 1
end

for group in pairs(touched) do
  if redis.call('LLEN', base .. ':g:' .. group .. ':buf') >= release_size then
    release(group)
  end
end
-- At the close no record arrives any more: every group still buffering is released.
local final = finalizing(close_offset, finalized)
for _, group in ipairs(redis.call('ZRANGEBYSCORE', k_queue, '-inf', final and '+inf' or now - max_wait)) do
  release(group)
end
pool_add(base, pool_entries, ARGV[1])
if final then
  local state = {k_gstat}
  for _, field in ipairs(redis.call('HKEYS', k_gstat)) do
    local group = string.match(field, '^(.*)|total$')
    if group then
      local g = base .. ':g:' .. group
      state[#state + 1] = g .. ':s'
      state[#state + 1] = g .. ':tv'
      for v = 0, m - 1 do state[#state + 1] = g .. ':tr:' .. v end
    end
  end
  finish_close(base, floor, retention, state)
end

-- Group state (trials, their values, counts) never expires: a group that started over
-- would get a second trial budget.
local buffered = {k_rec, k_queue}
for _, group in ipairs(redis.call('ZRANGE', k_queue, 0, -1)) do
  buffered[#buffered + 1] = base .. ':g:' .. group .. ':buf'
end
expire_with_ttl(ttl, buffered)

redis.call('HINCRBY', k_stats, 'releases', released)
redis.call('HINCRBY', k_stats, 'pooled', pooled)
return reply(base, k_stats, added, redis.call('HLEN', k_rec), redis.call('HLEN', base .. ':pool'), ttl)
