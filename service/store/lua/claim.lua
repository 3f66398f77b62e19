-- A worker claims a partition's buffer before it writes there (fence.lua). It keeps the
-- generation it held (ARGV[1], '' if none) when no other worker claimed the partition
-- since, so a worker that keeps a partition through a rebalance does not fence off its
-- own steps still under way; otherwise its claim is a new generation, which refuses
-- every older one.
-- KEYS[1] the partition's key prefix. Returns the generation to write with.
local key = KEYS[1] .. ':owner'
local current = redis.call('GET', key)
if ARGV[1] ~= '' and current == ARGV[1] then return tonumber(current) end
return redis.call('INCR', key)
