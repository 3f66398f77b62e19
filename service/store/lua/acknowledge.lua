-- Forget takes the broker acknowledged (emit.lua, ':takes'); until then they stay in
-- flight and a restarted worker re-sends them with the same tokens.
--
-- The worker holds the entries it took, so it totals what each take adds and sends the
-- totals: its truth cells and its delay histogram. A take is counted once, when its
-- entry is deleted here; acknowledging a take that is gone adds nothing, so a repeated
-- acknowledgement (a re-send after a crash) never counts twice.
--
-- Each acknowledged record is counted, at this moment and not before, into the tally of
-- the adversary test (service/store/auditor.py, in the worker), ':truth:<epoch>' (public
-- codes|published codes|true sensitive codes, service/core/wire.py `truth_cell_of`), so it
-- describes exactly the records published, however long a pause held others back. One
-- cell holds both sides of a record: the test's true and published cells are its sums
-- (TrustedState.truth). An epoch lasts the retention period; the current and the previous
-- one are kept, older ones dropped, and each expires by itself two periods after its last
-- write, so exact tallies never outlive their use even if no worker runs.
--
-- Time from arrival to emission goes to the histogram ':delay' (operators see delays,
-- never per record): bucket counts by upper bound (ms), 'count' and 'sum_ms'.
--
-- KEYS[1] the partition's key prefix; ARGV now_ms, retention (ms), then per take: its id
-- (seed), the number of its truth cells c and of its delay fields d, then c (cell, records)
-- pairs and d (field, count) pairs.
-- Returns the records acknowledged.
local base = KEYS[1]
local k_takes, k_stats, k_delay = base .. ':takes', base .. ':stats', base .. ':delay'
local now, retention = tonumber(ARGV[1]), tonumber(ARGV[2])
local epoch = math.floor(now / retention)
local last = tonumber(redis.call('HGET', k_stats, 'truth_epoch') or epoch)
for old = last - 1, math.min(last, epoch - 2) do
  redis.call('UNLINK', base .. ':truth:' .. old)
end
redis.call('HSET', k_stats, 'truth_epoch', math.max(epoch, last))
local k_truth = base .. ':truth:' .. epoch

-- Cells and delay fields, in the order first named, with their records: a take's cells
-- are distinct (the worker totalled them), so only a cell named by two takes of one call
-- is looked up again.
local cells, cell_counts, cell_at = {}, {}, {}
local fields, field_counts, field_at = {}, {}, {}
local function add(names, counts, at, name, n)
  local i = at[name]
  if i then
    counts[i] = counts[i] + n
  else
    i = #names + 1
    names[i], counts[i], at[name] = name, n, i
  end
end
local published, takes = 0, 0
local a = 3
while a <= #ARGV do
  local n_cells, n_fields = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local first = a + 3
  a = first + 2 * (n_cells + n_fields)
  if redis.call('HDEL', k_takes, ARGV[first - 3]) == 1 then
    takes = takes + 1
    if takes == 2 then
      for i = 1, #cells do cell_at[cells[i]] = i end
    end
    for k = first, first + 2 * n_cells - 1, 2 do
      local n = tonumber(ARGV[k + 1])
      published = published + n
      if takes == 1 then
        local i = #cells + 1
        cells[i], cell_counts[i] = ARGV[k], n
      else
        add(cells, cell_counts, cell_at, ARGV[k], n)
      end
    end
    for k = first + 2 * n_cells, a - 1, 2 do
      add(fields, field_counts, field_at, ARGV[k], tonumber(ARGV[k + 1]))
    end
  end
end

-- Cells are many (all public attributes and the sensitive ones: one per two Adult records):
-- one HMGET and one HSET per thousand cells cost Redis far less than an HINCRBY each.
local function add_counts(key, names, counts)
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
  add_counts(k_truth, cells, cell_counts)
  redis.call('PEXPIRE', k_truth, 2 * retention)
  add_counts(k_delay, fields, field_counts)
  redis.call('HINCRBY', k_stats, 'published', published)
  redis.call('HINCRBY', k_stats, 'in_flight', -published)
end
return published
