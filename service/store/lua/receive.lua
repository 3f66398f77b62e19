-- The stream's final pool (SPEC §3, a survey's end) receives one partition's remainder:
-- the records its pool held below the floor when the partition was finalized (close.lua,
-- :handoff). A remainder comes in chunks; each chunk is taken once, so a worker that
-- crashed after sending it and sends it again adds nothing. The pool waits for every
-- partition (:from) before anything leaves (emit.lua).
--
-- KEYS[1]  the final pool's prefix, "splu:{<stream>:final}".
-- ARGV     now_ms, partition, chunk number, 1 if it is the partition's last chunk, then
--          the chunk's pool entries.
-- Returns  1 if the chunk was added, 0 if it was added before.

local base = KEYS[1]
local chunk = ARGV[2] .. ':' .. ARGV[3]
if redis.call('SADD', base .. ':chunks', chunk) == 0 then return 0 end
local entries = {}
for j = 5, #ARGV do entries[j - 4] = ARGV[j] end
local size = pool_add(base, entries, ARGV[1])
if ARGV[4] == '1' then redis.call('SADD', base .. ':from', ARGV[2]) end
redis.call('HINCRBY', base .. ':stats', 'received', #ARGV - 4)
redis.call('HSET', base .. ':stats', 'pool', size)
return 1
