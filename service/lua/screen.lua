-- A personal stream's first hop (streams/app.py) for one raw partition, before its
-- records go to <stream>.grouped: find the records whose id this raw partition already
-- stored with other content. Such a record may belong to another group than the first,
-- hence to another grouped partition, whose dedup (ingest.lua) would never see the first:
-- only here, where every record of the id arrives, can the reuse be caught (SPEC §3).
-- A record seen before with the same content is no conflict: it is forwarded again, and
-- the grouped partition's dedup drops it, so a crash between marking it here and the
-- grouped produce loses nothing.
--
-- KEYS[1]  the partition's key prefix, "splu:{<stream>:<raw partition>}".
-- ARGV     one argument per record: fingerprint (12 bytes, as ingest.lua's), raw offset.
-- Returns  the positions of the records whose id was stored with other content.
--
-- Keys: :rawseen (a Fingerprints set, as ingest.lua's :seen), :rawoff the highest raw
-- offset screened, so a conflict is counted once, not again when it is redelivered;
-- :stats "conflicts".

local base = KEYS[1]
local seen = Fingerprints.new(base .. ':rawseen', 10)
local watermark = tonumber(redis.call('GET', base .. ':rawoff') or '-1')
local highest, conflicts, found = watermark, 0, {}
seen:load_args(1, #ARGV, 1, 1)
for r = 1, #ARGV do
  local arg = ARGV[r]
  local bucket, key, digest = string.sub(arg, 1, 2), string.sub(arg, 3, 8), string.sub(arg, 9, 12)
  local offset = tonumber(string.sub(arg, 13))
  if offset > highest then highest = offset end
  local known = seen:find(bucket, key)
  if not known then
    seen:add(bucket, key .. digest)
  elseif known ~= digest then
    found[#found + 1] = r
    if offset > watermark then conflicts = conflicts + 1 end
  end
end
seen:store()
redis.call('SET', base .. ':rawoff', highest)
redis.call('HINCRBY', base .. ':stats', 'conflicts', conflicts)
return found
