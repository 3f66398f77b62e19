-- Decoy groups for one stream partition (SPEC §2.1, §3), one atomic step per batch:
-- store new records idempotently, cut every group the buffer allows, randomize its
-- members, hand finished records to the mixing pool, suppress records that waited
-- past max_wait.
--
-- KEYS[1]  the partition's key prefix, "splu:{<stream>:<partition>}"; every key below
--          extends it, so one Redis Cluster hash slot holds them all.
-- ARGV     now_ms, max_wait_ms, gamma, w (sensitive attributes), seed, record ttl (ms,
--          0: none), through (the highest raw offset handled, ingest.lua), floor (the
--          mixing pool's), closed retention (ms), n, then one argument per record: id (32
--          hex digits), then "public codes|values|draws|raw offset" (codes
--          comma-separated).
-- Returns  the number of records waiting, the pool size, then position and status of
--          each record not stored anew (1 redelivered, 2 id reused with other content, 3
--          late: the partition was finalized).
--
-- At the close (ingest.lua, close_state): once every raw offset below the partition's
-- close offset is handled, the call that sees it cuts what it can as always, then
-- suppresses every record still waiting or held, whatever its wait: no record arrives any
-- more to group it or fill its group's holes. Then the pool leaves (finish_close).
--
-- Keys: :off (ingest.lua); :rec id -> msgpack {arrival, public, values, draws,
-- published, attributes still to group, audit per attribute, group number per
-- attribute}; :t arrival index of records still waiting for a group; :b:<a>:<v> bucket
-- of attribute a, value v (members are ids, score 0, so ZPOPMIN takes the smallest
-- random id); :n:<a> value -> bucket size; :grp:<number> a group that is not sealed yet
-- (below); :hole:<a>:<v> groups missing a member of value v of attribute a; :pool the
-- mixing pool (pool.lua), an entry being "public|published|audit|true values|arrival|id"
-- (audit: the group's number and values per attribute; the emitter publishes only the
-- first two fields); :stats counters and gauges; :sup "<a>:<v>" -> suppressed.
--
-- Group integrity. A published count is Binomial(γf, 1/γ) only if every group that
-- publishes any member publishes all γ of them. With several sensitive attributes a
-- record can be grouped on one attribute and still wait on another, and be suppressed
-- there. So a record enters the pool only once every group it belongs to is *sealed*:
-- all its members are grouped on every attribute (a record that is, can no longer be
-- suppressed). A group with a member still waiting is kept in :grp:<number> (members,
-- values, `open` = members not done plus holes). When a waiting member is suppressed,
-- its place becomes a hole, filled by the next record of the same value of that
-- attribute: the smallest id of its bucket now, or the next arrival. Until then the
-- group's members wait (they show as held); a group never publishes short.

local base = KEYS[1]
local now, max_wait, gamma = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
-- Scores and pool entries take the time as text: converting a Lua number to a string
-- formats it with sprintf, once per record otherwise.
local now_text = ARGV[1]
local w, seed, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local through, floor, retention = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local n = tonumber(ARGV[10])
local k_rec, k_time = base .. ':rec', base .. ':t'
local k_stats, k_sup = base .. ':stats', base .. ':sup'
local k_open, k_holes = base .. ':open', base .. ':holes'

local function split(text)
  local out = {}
  for item in string.gmatch(text, '[^,]+') do out[#out + 1] = item end
  return out
end

local function numeric(x, y)
  return tonumber(x) < tonumber(y)
end

local function bucket_key(a, v) return base .. ':b:' .. a .. ':' .. v end
local function group_key(number) return base .. ':grp:' .. number end
local function hole_key(a, v) return base .. ':hole:' .. a .. ':' .. v end

-- Work a call would otherwise repeat per record is done once for the call: records
-- grouped in the call they arrived never touch :rec or :t, bucket additions and pool
-- entries are written with one command per key, and whether a group cut in this call is
-- still open is known here without asking Redis.
local records = {}  -- id -> record, read and written once per call
local dirty = {}
-- With one sensitive attribute, an arrival is {public, value, draw} until it is grouped
-- or left waiting (then it becomes a record, `keep_waiting`): most are grouped in the
-- call, and a record's three tables cost Redis more than their whole pool entry.
local plain = {}
-- ids that arrived in this call (true until grouped or indexed): not in :rec, and in :t
-- only if still waiting at the end
local arrived = {}
local finished = {}  -- ids pooled in this call
local pool_entries, unstored = {}, {}
local numbered = tonumber(redis.call('HGET', k_stats, 'groups') or '0')
local cut_open = {}  -- group number -> true while a group cut in this call is open

local function group_open(number)
  if number > numbered then return cut_open[number] == true end
  return redis.call('EXISTS', group_key(number)) == 1
end

local function load(id)
  local record = records[id]
  if record == nil then
    record = cmsgpack.unpack(redis.call('HGET', k_rec, id))
    records[id] = record
  end
  return record
end

local pooled, refills = 0, 0
-- One attribute, the usual case, needs no table.concat: a C call per field per record.
local function joined(list, separator)
  if w == 1 then return list[1] end
  return table.concat(list, separator)
end

-- A pool entry: "public|published|audit|true values|arrival|id", the layout
-- service/core/wire.py owns.
local function pool_entry(id, arrival, public, published, audit, values)
  pooled = pooled + 1
  pool_entries[pooled] = public .. '|' .. published .. '|' .. audit .. '|' .. values .. '|'
    .. arrival .. '|' .. id
  finished[id] = true
end

-- A record whose groups are all sealed enters the pool and leaves the record hash.
local function to_pool(id, record, published, audit)
  local arrival = record[1] == now and now_text or record[1]
  pool_entry(id, arrival, record[2], published, audit, joined(record[3], ','))
  if not arrived[id] then unstored[#unstored + 1] = id end
  records[id], dirty[id] = nil, nil
end

local function finish(id, record)
  to_pool(id, record, joined(record[5], ','), joined(record[7], ';'))
end

-- With one sensitive attribute a cut group is sealed at once: each member is done and
-- goes to the pool, with no record of the group kept. What assign(), completed() and
-- finish() would do, less their per-member bookkeeping of groups.
local function pool_group(members, chosen, audit)
  for j = 1, #members do
    local id = members[j]
    local arrival = plain[id]
    if arrival then
      plain[id], arrived[id] = nil, 'grouped'
      pool_entry(id, now_text, arrival[1], chosen[arrival[3] + 1], audit, arrival[2])
    else
      local record = records[id] or load(id)
      if arrived[id] == true then
        arrived[id] = 'grouped'
      else
        redis.call('ZREM', k_time, id)
      end
      to_pool(id, record, chosen[record[4][1] + 1], audit)
    end
  end
end

local function sealed(record)
  for a = 1, w do
    if group_open(record[8][a]) then return false end
  end
  return true
end

-- A record that is grouped on every attribute leaves for the pool once all its groups
-- are sealed.
local function try_pool(id)
  local record = records[id] or load(id)
  if record[6] == 0 and sealed(record) then finish(id, record) end
end

local function members_of(number)
  return split(redis.call('HGET', group_key(number), 'members'))
end

local seal_queue = {}
local function close_slot(number)
  if redis.call('HINCRBY', group_key(number), 'open', -1) == 0 then
    seal_queue[#seal_queue + 1] = {number, members_of(number)}
    redis.call('DEL', group_key(number))
    redis.call('SREM', k_open, number)
    cut_open[number] = nil
  end
end

-- A record grouped on its last attribute: it can no longer be suppressed, so each of its
-- other open groups has one member fewer to wait for.
local function completed(id, record, except)
  if arrived[id] == true then arrived[id] = 'grouped' else redis.call('ZREM', k_time, id) end
  for a = 1, w do
    if record[8][a] ~= except and group_open(record[8][a]) then
      close_slot(record[8][a])
    end
  end
end

-- Each member publishes its group's (sorted) value at its own keyed draw index. The
-- audit keeps the group's number in this partition and its values (`audit_of`, once per
-- group).
local function audit_of(number, values)
  return number .. ':' .. table.concat(values, ',')
end

local function assign(id, a, values, number, audit)
  local record = load(id)
  record[5][a] = values[record[4][a] + 1]
  record[7][a] = audit
  record[8][a] = number
  record[6] = record[6] - 1
  dirty[id] = true
  return record
end

local function drain_seals()
  while #seal_queue > 0 do
    local sealed_group = table.remove(seal_queue)
    for _, member in ipairs(sealed_group[2]) do
      if not finished[member]
        and (records[member] or redis.call('HEXISTS', k_rec, member) == 1) then
        try_pool(member)
      end
    end
  end
end

-- A record takes a hole's place in an open group: it publishes the group's value at its
-- own draw index, and the group waits for it as it waited for the member it replaces.
local function fill(id, a, number)
  number = tonumber(number)
  local key = group_key(number)
  local values = split(redis.call('HGET', key, 'values'))
  local record = assign(id, a, values, number, audit_of(number, values))
  refills = refills + 1
  local members = redis.call('HGET', key, 'members')
  redis.call('HSET', key, 'members', members == '' and id or members .. ',' .. id)
  if record[6] == 0 then
    completed(id, record, number)
    close_slot(number)
    drain_seals()
  end
end

local to_bucket = {}  -- attribute -> value -> ids arriving in this call, in order
for a = 1, w do to_bucket[a] = {} end
local function add_to_bucket(id, a, v)
  local ids = to_bucket[a][v]
  if ids == nil then
    ids = {}
    to_bucket[a][v] = ids
  end
  ids[#ids + 1] = id
end

-- This call's arrivals count in :n:<a> before the cut, but enter their bucket only if the
-- cut leaves them waiting (store_leftovers): most are grouped in the call they arrive,
-- and a bucket write and pop each would cost Redis more than the rest of their grouping.
local function count_bucket_additions()
  for a = 1, w do
    for v, ids in pairs(to_bucket[a]) do
      redis.call('HINCRBY', base .. ':n:' .. a, v, #ids)
    end
  end
end

local function store_leftovers(a)
  for v, ids in pairs(to_bucket[a]) do
    for start = 1, #ids, 1000 do
      local members = {}
      for j = start, math.min(start + 999, #ids) do
        members[#members + 1] = '0'
        members[#members + 1] = ids[j]
      end
      redis.call('ZADD', bucket_key(a, v), unpack(members))
    end
  end
end

-- The `count` smallest ids among value v's bucket and this call's arrivals of v, in
-- ascending order: what ZPOPMIN would pop had the arrivals been added first (bucket
-- scores are all 0, so the order is the ids' bytes, which Lua's comparison of hex digits
-- follows). The arrivals not taken stay in to_bucket for store_leftovers.
local function smallest(a, v, count)
  local key, arrivals = bucket_key(a, v), to_bucket[a][v]
  local ids = {}
  if arrivals == nil then
    local popped = redis.call('ZPOPMIN', key, count)
    for j = 1, #popped, 2 do ids[#ids + 1] = popped[j] end
    return ids
  end
  table.sort(arrivals)
  local waiting = redis.call('ZRANGE', key, 0, count - 1)
  local i, j = 1, 1
  for k = 1, count do
    local x, y = waiting[i], arrivals[j]
    if y == nil or (x ~= nil and x < y) then
      ids[k] = x
      i = i + 1
    else
      ids[k] = y
      j = j + 1
    end
  end
  if i > 1 then redis.call('ZPOPMIN', key, i - 1) end
  local rest = {}
  for k = j, #arrivals do rest[#rest + 1] = arrivals[k] end
  to_bucket[a][v] = rest
  return ids
end

open_dedup(base, n, 10, through, false)
local close_offset, finalized = close_state(base, 'raw')
-- HSETNX: an id stored twice would count twice in its buckets, and a cut would then pop
-- an empty bucket. Which ids :rec holds is asked once for the whole batch.
local stored = {}
for start = 1, n, 1000 do
  local ids = {}
  for r = start, math.min(start + 999, n) do ids[#ids + 1] = string.sub(ARGV[10 + r], 1, 32) end
  local found = redis.call('HMGET', k_rec, unpack(ids))
  for j, id in ipairs(ids) do
    if found[j] then stored[id] = true end
  end
end
local any_holes = redis.call('SCARD', k_holes) > 0
local added = 0
-- A record waiting on one attribute has no published values, audits or groups yet, and
-- never gets them in place (pool_group builds its entry): one shared empty table stands
-- for the three. Holes, which would fill them, need two attributes.
local NONE = {}
local function keep_waiting(id)
  local arrival = plain[id]
  records[id] = {now, arrival[1], {arrival[2]}, {arrival[3]}, NONE, 1, NONE, NONE}
  dirty[id], plain[id] = true, nil
end
for r = 1, n do
  local id, bucket, key, digest, public, value_text, draw_text, offset =
    fields_of(ARGV[10 + r], 4)
  local fresh = first_seen(r, bucket, key, digest, offset)
  if fresh and finalized then
    refuse_late(r)
  elseif fresh and (records[id] or arrived[id] or stored[id]) then
    status[#status + 1] = r
    status[#status + 1] = 1
    redelivered = redelivered + 1
  elseif fresh and w == 1 and not any_holes then
    -- The usual case, without the general case's per-attribute loop and calls.
    plain[id], arrived[id] = {public, value_text, tonumber(draw_text)}, true
    local ids = to_bucket[1][value_text]
    if ids == nil then
      to_bucket[1][value_text] = {id}
    else
      ids[#ids + 1] = id
    end
    added = added + 1
  elseif fresh then
    local values, draws
    if w == 1 then
      values, draws = {value_text}, {tonumber(draw_text)}
    else
      values, draws = split(value_text), split(draw_text)
      for a = 1, w do draws[a] = tonumber(draws[a]) end
    end
    local record = {now, public, values, draws, {}, w, {}, {}}
    records[id], dirty[id], arrived[id] = record, true, true
    for a = 1, w do
      local number = any_holes and redis.call('LPOP', hole_key(a, values[a]))
      if number then
        if redis.call('LLEN', hole_key(a, values[a])) == 0 then
          redis.call('SREM', k_holes, a .. ':' .. values[a])
        end
        fill(id, a, number)
      else
        add_to_bucket(id, a, values[a])
      end
    end
    added = added + 1
  end
end

count_bucket_additions()

-- Keyed uniforms: SHA-1 of a secret per-partition seed and a persistent counter, so
-- no two cuts reuse randomness and a replay of the same state cuts the same groups.
local drawn = tonumber(redis.call('HGET', k_stats, 'draws') or '0')
local uniform, draws = sha1_uniforms(seed, drawn, 8)

-- Cut groups of gamma distinct values while gamma buckets are non-empty. A value whose
-- bucket holds at least 1/gamma of the pending records is always taken (skipping it
-- would push it further over its share); the rest are chosen one by one with
-- probability proportional to bucket size among the values not yet in the group.
local groups = 0
local function cut(a)
  local key_counts = base .. ':n:' .. a
  local flat = redis.call('HGETALL', key_counts)
  local values, counted = {}, {}
  for j = 1, #flat, 2 do
    values[#values + 1] = flat[j]
    counted[flat[j]] = tonumber(flat[j + 1])
  end
  table.sort(values, numeric)
  -- Sizes and marks by position in `values`: array reads, not a string hash per value.
  local nv, size, pending, nonempty = #values, {}, 0, 0
  for i = 1, nv do
    local c = counted[values[i]]
    size[i] = c
    pending = pending + c
    if c > 0 then nonempty = nonempty + 1 end
  end
  -- The values of every group first: they depend on bucket sizes only. Then each bucket
  -- gives all the members it owes at once, its smallest ids (`smallest`), the same ids in
  -- the same order as one pop per group would take. Loops here run per group over every
  -- value: numeric for loops, as ipairs costs a C call per step in Redis's Lua.
  local plan, owed, taken = {}, {}, {}
  for i = 1, nv do taken[i], owed[i] = 0, 0 end
  local group = 0
  while nonempty >= gamma do
    group = group + 1
    local weight, forced = 0, 0
    for i = 1, nv do
      local s = size[i]
      if s > 0 and s * gamma >= pending then
        taken[i] = group
        forced = forced + 1
        weight = weight + s
      end
    end
    for _ = forced + 1, gamma do
      local x = uniform() * (pending - weight)
      local pick
      for i = 1, nv do
        local s = size[i]
        if s > 0 and taken[i] ~= group then
          pick = i
          x = x - s
          if x < 0 then break end
        end
      end
      taken[pick] = group
      weight = weight + size[pick]
    end
    -- In numeric order, as `values` is: no comparisons, each a tonumber of both sides.
    local chosen = {}
    for i = 1, nv do
      if taken[i] == group then
        chosen[#chosen + 1] = values[i]
        owed[i] = owed[i] + 1
        local left = size[i] - 1
        size[i] = left
        if left == 0 then nonempty = nonempty - 1 end
      end
    end
    pending = pending - gamma
    plan[#plan + 1] = chosen
  end
  local popped = {}
  for i = 1, nv do
    if owed[i] > 0 then popped[values[i]] = {list = smallest(a, values[i], owed[i]), next = 1} end
  end
  for p = 1, #plan do
    local chosen = plan[p]
    local members = {}
    for j = 1, gamma do
      local from = popped[chosen[j]]
      members[j] = from.list[from.next]
      from.next = from.next + 1
    end
    groups = groups + 1
    local number = numbered + groups
    local audit = audit_of(number, chosen)
    if w == 1 then
      pool_group(members, chosen, audit)
    else
      local open, done = 0, {}
      for j = 1, gamma do
        local id = members[j]
        local record = assign(id, a, chosen, number, audit)
        if record[6] == 0 then done[#done + 1] = id else open = open + 1 end
      end
      if open > 0 then
        redis.call('HSET', group_key(number), 'open', open, 'values', table.concat(chosen, ','),
          'members', table.concat(members, ','))
        redis.call('SADD', k_open, number)
        cut_open[number] = true
      end
      for _, id in ipairs(done) do completed(id, records[id], number) end
      drain_seals()
      for _, id in ipairs(done) do
        if records[id] then try_pool(id) end
      end
    end
  end
  store_leftovers(a)
  for i = 1, nv do
    if size[i] > 0 then
      redis.call('HSET', key_counts, values[i], size[i])
    else
      redis.call('HDEL', key_counts, values[i])
    end
  end
end

if added > 0 then
  for a = 1, w do
    cut(a)
  end
end

-- Records still waiting for a group after max_wait belong to values over their share (or
-- to the last few values of a quiet stream): suppress them, never publish, count per
-- value. Where such a record was grouped on another attribute already, its place in that
-- group becomes a hole for the next record of the same value.
local function suppress(id)
  local record = load(id)
  redis.call('HDEL', k_rec, id)
  redis.call('ZREM', k_time, id)
  records[id], dirty[id] = nil, nil
  for a = 1, w do
    local v, number = record[3][a], record[8][a]
    local counts = base .. ':n:' .. a
    if number == nil then
      redis.call('ZREM', bucket_key(a, v), id)
      if redis.call('HINCRBY', counts, v, -1) <= 0 then redis.call('HDEL', counts, v) end
      redis.call('HINCRBY', k_sup, a .. ':' .. v, 1)
    else
      local rest = {}
      for _, member in ipairs(members_of(number)) do
        if member ~= id then rest[#rest + 1] = member end
      end
      redis.call('HSET', group_key(number), 'members', table.concat(rest, ','))
      local replacement = redis.call('ZPOPMIN', bucket_key(a, v))[1]
      if replacement then
        if redis.call('HINCRBY', counts, v, -1) <= 0 then redis.call('HDEL', counts, v) end
        fill(replacement, a, number)
      else
        redis.call('RPUSH', hole_key(a, v), number)
        redis.call('SADD', k_holes, a .. ':' .. v)
      end
    end
  end
end

-- Arrivals of this call that still wait for a group enter the arrival index now.
local waiting_arrivals = {}
for id, state in pairs(arrived) do
  if state == true and not finished[id] then
    if plain[id] then keep_waiting(id) end
    waiting_arrivals[#waiting_arrivals + 1] = now_text
    waiting_arrivals[#waiting_arrivals + 1] = id
    arrived[id] = 'indexed'
  end
end
for start = 1, #waiting_arrivals, 2000 do
  redis.call('ZADD', k_time, unpack(waiting_arrivals, start, math.min(start + 1999, #waiting_arrivals)))
end

-- At the close nothing arrives any more: every record still waiting is suppressed now.
local final = finalizing(close_offset, finalized)
if final then max_wait = 0 end
local suppressed = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', k_time, '-inf', now - max_wait)) do
  -- A replacement taken earlier in this loop may have been grouped on its last attribute.
  if redis.call('ZSCORE', k_time, id) then
    suppress(id)
    suppressed = suppressed + 1
  end
end

-- What is left at the close is held (several attributes): grouped on each, in a group
-- whose hole no record will fill. Its groups never seal, so it is suppressed with them.
if final then
  local held = {}
  for _, id in ipairs(redis.call('HKEYS', k_rec)) do held[id] = true end
  for id in pairs(records) do held[id] = true end
  for id in pairs(held) do
    redis.call('HDEL', k_rec, id)
    records[id], dirty[id] = nil, nil
    suppressed = suppressed + 1
  end
  for _, number in ipairs(redis.call('SMEMBERS', k_open)) do
    redis.call('DEL', group_key(number))
  end
  for _, hole in ipairs(redis.call('SMEMBERS', k_holes)) do
    redis.call('DEL', base .. ':hole:' .. hole)
  end
  redis.call('DEL', k_open, k_holes, k_time)
  redis.call('HINCRBY', k_stats, 'suppressed_at_close', suppressed)
end

for id in pairs(dirty) do
  redis.call('HSET', k_rec, id, cmsgpack.pack(records[id]))
end
for start = 1, #unstored, 1000 do
  redis.call('HDEL', k_rec, unpack(unstored, start, math.min(start + 999, #unstored)))
end
pool_add(base, pool_entries, now_text)

if ttl > 0 then
  local buffered = {k_rec, k_time, k_open, k_holes}
  for _, number in ipairs(redis.call('SMEMBERS', k_open)) do
    buffered[#buffered + 1] = group_key(number)
  end
  for _, hole in ipairs(redis.call('SMEMBERS', k_holes)) do
    buffered[#buffered + 1] = base .. ':hole:' .. hole
  end
  for a = 1, w do
    buffered[#buffered + 1] = base .. ':n:' .. a
    for _, v in ipairs(redis.call('HKEYS', base .. ':n:' .. a)) do
      buffered[#buffered + 1] = bucket_key(a, v)
    end
  end
  expire_with_ttl(ttl, buffered)
end

if final then finish_close(base, floor, retention, {k_sup}) end
local waiting = redis.call('HLEN', k_rec)
redis.call('HSET', k_stats, 'draws', draws())
redis.call('HSET', base .. ':waiting', 'held', waiting - redis.call('ZCARD', k_time))
redis.call('HINCRBY', k_stats, 'groups', groups)
redis.call('HINCRBY', k_stats, 'pooled', pooled)
redis.call('HINCRBY', k_stats, 'suppressed', suppressed)
redis.call('HINCRBY', k_stats, 'refills', refills)
return reply(base, k_stats, added, waiting, redis.call('HLEN', base .. ':pool'), ttl)
