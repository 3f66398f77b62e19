-- Count published records into the consumer's cells, each token once (SPEC §3: consumers
-- dedup by token), so re-sent emissions and redelivered batches change no count. Tokens
-- are remembered for one to two dedup windows, one set per window (":tokens:<n>"),
-- older windows dropped whole, so memory stays bounded.
-- KEYS[1] the consumer's key prefix; ARGV now_ms, dedup window (ms), then token, cell,
-- token, cell, ...
-- Returns {records counted now, duplicates skipped}.
local base = KEYS[1]
local k_cells, k_stats = base .. ':cells', base .. ':stats'
local current = math.floor(tonumber(ARGV[1]) / tonumber(ARGV[2]))
local last = tonumber(redis.call('HGET', k_stats, 'window') or current)
for old = last - 1, math.min(last, current - 2) do
  redis.call('UNLINK', base .. ':tokens:' .. old)
end
redis.call('HSET', k_stats, 'window', current)
local k_current, k_previous = base .. ':tokens:' .. current, base .. ':tokens:' .. (current - 1)
local new, duplicates = 0, 0
for i = 3, #ARGV, 2 do
  if redis.call('SISMEMBER', k_previous, ARGV[i]) == 0
      and redis.call('SADD', k_current, ARGV[i]) == 1 then
    redis.call('HINCRBY', k_cells, ARGV[i + 1], 1)
    new = new + 1
  else
    duplicates = duplicates + 1
  end
end
redis.call('HINCRBY', k_stats, 'records', new)
redis.call('HINCRBY', k_stats, 'duplicates', duplicates)
return {new, duplicates}
