-- Forget emissions the broker acknowledged; until then they stay in flight and a
-- restarted worker re-sends them with the same tokens.
--
-- Each acknowledged record is counted, at this moment and not before, into the tally of
-- the adversary test (service/store/auditor.py, in the worker), ':truth:<epoch>' (public
-- codes|published codes|true sensitive codes), so it describes exactly the records
-- published, however long a pause held others back. One cell holds both sides of a
-- record: the test's true and published cells are its sums (TrustedState.truth). An
-- epoch lasts the retention period; the current and the previous one are kept, older
-- ones dropped, and each expires by itself two periods after its last write, so exact
-- tallies never outlive their use even if no worker runs.
--
-- KEYS[1] the partition's key prefix; ARGV now_ms, retention (ms), the tokens (32 hex
-- digits each) concatenated: one argument rather than one per record, for the client to
-- encode and Redis to read.
local base = KEYS[1]
local k_inflight, k_stats = base .. ':inflight', base .. ':stats'
local now, retention = tonumber(ARGV[1]), tonumber(ARGV[2])
local epoch = math.floor(now / retention)
local last = tonumber(redis.call('HGET', k_stats, 'truth_epoch') or epoch)
for old = last - 1, math.min(last, epoch - 2) do
  redis.call('UNLINK', base .. ':truth:' .. old)
end
redis.call('HSET', k_stats, 'truth_epoch', math.max(epoch, last))
local k_truth = base .. ':truth:' .. epoch

-- Loops here run once per record: numeric for loops and counters, as ipairs costs a C
-- call per step in Redis's Lua and # a search of the table.
local given, tokens = ARGV[3], {}
local count = math.floor(#given / 32)
for j = 1, count do tokens[j] = string.sub(given, 32 * j - 31, 32 * j) end

-- One call per take, however large: tokens go to Redis in slices, as Lua's unpack() stops
-- at a few thousand values.
local entries = {}
for start = 1, count, 1000 do
  local stop = math.min(start + 999, count)
  local found = redis.call('HMGET', k_inflight, unpack(tokens, start, stop))
  for j = start, stop do entries[j] = found[j - start + 1] end
end
local removed, truth = 0, {}
for j = 1, count do
  local entry = entries[j]
  if entry then
    -- An entry starts "public|published|audit|true|" (service/core/wire.py).
    local shown, true_values = string.match(entry, '^([^|]*|[^|]*)|[^|]*|([^|]*)|')
    local cell = shown .. '|' .. true_values
    truth[cell] = (truth[cell] or 0) + 1
    removed = removed + 1
  end
end
-- Cells are many (all public attributes and the sensitive ones: one per two Adult records):
-- one HMGET and one HSET per thousand cells cost Redis far less than an HINCRBY each.
local function add_counts(key, counts)
  local cells = {}
  for cell in pairs(counts) do cells[#cells + 1] = cell end
  for start = 1, #cells, 1000 do
    local stop = math.min(start + 999, #cells)
    local current = redis.call('HMGET', key, unpack(cells, start, stop))
    local fields = {}
    for j = start, stop do
      local cell = cells[j]
      fields[#fields + 1] = cell
      fields[#fields + 1] = (tonumber(current[j - start + 1]) or 0) + counts[cell]
    end
    redis.call('HSET', key, unpack(fields))
  end
end
add_counts(k_truth, truth)
if removed > 0 then
  for start = 1, count, 1000 do
    redis.call('HDEL', k_inflight, unpack(tokens, start, math.min(start + 999, count)))
  end
  redis.call('PEXPIRE', k_truth, 2 * retention)
end
redis.call('HINCRBY', k_stats, 'published', removed)
redis.call('HSET', k_stats, 'in_flight', redis.call('HLEN', k_inflight))
return removed
