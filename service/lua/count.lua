-- Count published records into the consumer's cells, each token once (SPEC §3: consumers
-- dedup by token), so re-sent emissions and redelivered batches change no count.
-- KEYS[1] the consumer's key prefix; ARGV token, cell, token, cell, ...
-- Returns {records counted now, duplicates skipped}.
local k_tokens, k_cells, k_stats = KEYS[1] .. ':tokens', KEYS[1] .. ':cells', KEYS[1] .. ':stats'
local new, duplicates = 0, 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', k_tokens, ARGV[i]) == 1 then
    redis.call('HINCRBY', k_cells, ARGV[i + 1], 1)
    new = new + 1
  else
    duplicates = duplicates + 1
  end
end
redis.call('HINCRBY', k_stats, 'records', new)
redis.call('HINCRBY', k_stats, 'duplicates', duplicates)
return {new, duplicates}
