-- Count published records into the consumer's cells, each token once at any age (SPEC §3:
-- consumers dedup by token), so re-sent emissions and redelivered batches change no
-- count. Tokens are remembered for the life of the stream in bounded memory
-- (fingerprints.lua, ':seen': 6 bytes per token; a new token passes for a counted one
-- with probability (tokens counted) / 2^64).
-- KEYS the consumer's :seen, :cells and :stats; ARGV fingerprint (8 bytes), cell, fingerprint, cell, ...
-- A windowed stream's side messages (ST rows, sub-tables) are counted as cells too, under
-- their JSON text, which starts with "{" (a row's cell starts with a code): they count as
-- 'side' in :stats, not as 'records', which are the published rows.
-- Returns {rows counted now, duplicates skipped, side messages counted now}.
local seen = Fingerprints.new(KEYS[1], 6)
seen:load_args(1, #ARGV, 2, 1)
local new, duplicates, side, cells = 0, 0, 0, {}
for i = 1, #ARGV, 2 do
  local bucket, key = string.sub(ARGV[i], 1, 2), string.sub(ARGV[i], 3, 8)
  if seen:find(bucket, key) then
    duplicates = duplicates + 1
  else
    seen:add(bucket, key)
    cells[ARGV[i + 1]] = (cells[ARGV[i + 1]] or 0) + 1
    if string.sub(ARGV[i + 1], 1, 1) == '{' then
      side = side + 1
    else
      new = new + 1
    end
  end
end
seen:store()
for cell, n in pairs(cells) do
  redis.call('HINCRBY', KEYS[2], cell, n)
end
redis.call('HINCRBY', KEYS[3], 'records', new)
redis.call('HINCRBY', KEYS[3], 'duplicates', duplicates)
if side > 0 then
  redis.call('HINCRBY', KEYS[3], 'side', side)
end
return {new, duplicates, side}
