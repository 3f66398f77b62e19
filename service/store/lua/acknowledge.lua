-- Forget takes the broker acknowledged (emit.lua, ':takes'); until then they stay in
-- flight and a restarted worker re-sends them with the same tokens.
--
-- The worker holds the entries it took, so it totals what each take adds and sends the
-- totals: its truth cells and its delay histogram. A take is counted once, when its
-- entry is deleted here; acknowledging a take that is gone adds nothing, so a repeated
-- acknowledgement (a re-send after a crash) never counts twice.
--
-- Each acknowledged record is counted, at this moment and not before, into the two
-- tallies of the adversary test (service/store/auditor.py, in the worker): its true cell
-- (public codes|true sensitive codes) into ':truth:true:<epoch>' and its shown cell
-- (public codes|published codes) into ':truth:shown:<epoch>' (service/core/wire.py), so
-- they describe exactly the records published, however long a pause held others back.
-- Both are written here in one step, so they always count the same records. Two
-- tallies rather than one of (public, published, true) cells: a stream's shown and true
-- cells recur long before its joint ones do, so they stop growing far sooner. An epoch
-- lasts the retention period; the current and the previous one are kept, older ones
-- dropped, and each expires by itself two periods after its last write, so exact
-- tallies never outlive their use even if no worker runs.
--
-- Time from arrival to emission goes to the histogram ':delay' (operators see delays,
-- never per record): bucket counts by upper bound (ms), 'count' and 'sum_ms'.
--
-- KEYS[1] the partition's key prefix; ARGV now_ms, retention (ms), then per take: its id
-- (seed), the numbers of its true cells t, shown cells s and delay fields d, then t and
-- s (cell, records) pairs and d (field, count) pairs.
-- Returns the records acknowledged.
local base = KEYS[1]
local k_takes, k_stats, k_delay = base .. ':takes', base .. ':stats', base .. ':delay'
local now, retention = tonumber(ARGV[1]), tonumber(ARGV[2])
local epoch = math.floor(now / retention)
local last = tonumber(redis.call('HGET', k_stats, 'truth_epoch') or epoch)
local SIDES = {'true', 'shown'}
for old = last - 1, math.min(last, epoch - 2) do
  for _, side in ipairs(SIDES) do
    redis.call('UNLINK', base .. ':truth:' .. side .. ':' .. old)
  end
end
redis.call('HSET', k_stats, 'truth_epoch', math.max(epoch, last))

-- Cells of each side and delay fields, in the order first named, with their records: a
-- take's cells are distinct (the worker totalled them), so only a cell named by two takes
-- of one call is looked up again.
local function tally()
  return {names = {}, counts = {}, at = {}}
end
local function add(t, name, n)
  local i = t.at[name]
  if i then
    t.counts[i] = t.counts[i] + n
  else
    i = #t.names + 1
    t.names[i], t.counts[i], t.at[name] = name, n, i
  end
end
-- The first take's cells are distinct: appended without a lookup, and indexed only
-- when a second take may name them again.
local function append(t, name, n)
  local i = #t.names + 1
  t.names[i], t.counts[i] = name, n
end
local function index(t)
  for i = 1, #t.names do t.at[t.names[i]] = i end
end
local sides = {['true'] = tally(), shown = tally()}
local delays = tally()
local published, takes = 0, 0
local a = 3
while a <= #ARGV do
  local n_true, n_shown = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local n_fields = tonumber(ARGV[a + 3])
  local first = a + 4
  local shown_from = first + 2 * n_true
  a = shown_from + 2 * (n_shown + n_fields)
  if redis.call('HDEL', k_takes, ARGV[first - 4]) == 1 then
    takes = takes + 1
    if takes == 2 then
      index(sides['true'])
      index(sides.shown)
    end
    local put = takes == 1 and append or add
    for k = first, shown_from - 1, 2 do
      put(sides['true'], ARGV[k], tonumber(ARGV[k + 1]))
    end
    for k = shown_from, shown_from + 2 * n_shown - 1, 2 do
      local n = tonumber(ARGV[k + 1])
      published = published + n
      put(sides.shown, ARGV[k], n)
    end
    for k = shown_from + 2 * n_shown, a - 1, 2 do
      add(delays, ARGV[k], tonumber(ARGV[k + 1]))
    end
  end
end

-- Cells are many (thousands in the takes of a flowing stream):
-- one HMGET and one HSET per thousand cells cost Redis far less than an HINCRBY each.
local function add_counts(key, t)
  local names, counts = t.names, t.counts
  for start = 1, #names, 1000 do
    local stop = math.min(start + 999, #names)
    local current = redis.call('HMGET', key, unpack(names, start, stop))
    local writes = {}
    for j = start, stop do
      local k = 2 * (j - start)
      writes[k + 1] = names[j]
      writes[k + 2] = (tonumber(current[j - start + 1]) or 0) + counts[j]
    end
    redis.call('HSET', key, unpack(writes))
  end
end
if published > 0 then
  for _, side in ipairs(SIDES) do
    local key = base .. ':truth:' .. side .. ':' .. epoch
    add_counts(key, sides[side])
    redis.call('PEXPIRE', key, 2 * retention)
  end
  add_counts(k_delay, delays)
  redis.call('HINCRBY', k_stats, 'published', published)
  redis.call('HINCRBY', k_stats, 'in_flight', -published)
end
return published
