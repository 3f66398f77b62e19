-- The owner fence, prepended to every step that writes a partition's buffer (ingest,
-- take, acknowledgement): a rebalance never lets two workers write one partition. A
-- worker claims a partition (claim.lua) before it writes there and passes the generation
-- of its claim as ARGV[1], which the fence consumes, so the step below reads its own
-- arguments from ARGV[1] on. A newer claim, another worker's since a rebalance, refuses
-- the call before it writes anything.
local owner_generation = table.remove(ARGV, 1)
if redis.call('GET', KEYS[1] .. ':owner') ~= owner_generation then
  return redis.error_reply('FENCED a newer worker claimed this partition')
end
