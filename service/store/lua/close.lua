-- A raw partition's gate and a survey's end (SPEC §3): the steps that decide which records
-- a stream accepts, and move a closed partition's remainder to the stream's final pool.
--
-- KEYS[1]  the partition's key prefix, "splu:{<stream>:<partition>}".
-- ARGV[1]  the step:
--
-- "gate"    highest raw offset of a fetch: called for each raw partition of a fetch before
--           its records are screened (identity.lua) and stored. Returns the partition's
--           close offset, or -1 while it is open; a record at or past the close offset is
--           rejected. While open, the highest offset gated is remembered, so that a close
--           never falls below a record the stream has already accepted.
-- "close"   the raw topic's end offset when the close was requested, now_ms: fix the
--           partition's close offset, once, at the larger of that end offset and one past
--           the highest offset gated. Returns the close offset (the first one fixed, if the
--           close is repeated).
-- "through" highest raw offset: a personal stream's first hop forwarded every record up
--           to it and the broker acknowledged them (the grouped topic's close waits for it).
-- "grouped" end offset: a personal stream's grouped close offset (below).
-- "handed"  the remainder in :handoff is in the final pool (receive.lua): drop it here.
--           Returns the number of records handed off (0 if done before).
--
-- Keys: :close hash: raw (close offset), gated (highest raw offset gated), requested (ms),
-- raw_through (personal first hop), grouped (a personal stream's grouped close offset),
-- state (set by the ingest scripts when the partition is finalized: releasing, handoff,
-- done); :handoff the pool's remainder below the floor at the close; :stats handed_off.

local base = KEYS[1]
local step = ARGV[1]
local k_close = base .. ':close'

if step == 'gate' then
  local closed = redis.call('HGET', k_close, 'raw')
  if closed then return tonumber(closed) end
  local highest = tonumber(ARGV[2])
  if highest > tonumber(redis.call('HGET', k_close, 'gated') or '-1') then
    redis.call('HSET', k_close, 'gated', highest)
  end
  return -1
end

if step == 'close' then
  local closed = redis.call('HGET', k_close, 'raw')
  if closed then return tonumber(closed) end
  local gated = tonumber(redis.call('HGET', k_close, 'gated') or '-1')
  local offset = math.max(tonumber(ARGV[2]), gated + 1)
  redis.call('HSET', k_close, 'raw', offset, 'requested', ARGV[3])
  return offset
end

if step == 'through' then
  local highest = tonumber(ARGV[2])
  if highest > tonumber(redis.call('HGET', k_close, 'raw_through') or '-1') then
    redis.call('HSET', k_close, 'raw_through', highest)
  end
  return highest
end

if step == 'grouped' then
  -- A personal stream's grouped partition: its close offset is the grouped topic's end
  -- offset once every raw partition's first hop is through (ARGV[2]); fixed once.
  redis.call('HSETNX', k_close, 'grouped', ARGV[2])
  return tonumber(redis.call('HGET', k_close, 'grouped'))
end

if step == 'handed' then
  if redis.call('HGET', k_close, 'state') ~= 'handoff' then return 0 end
  local count = redis.call('HLEN', base .. ':handoff')
  redis.call('DEL', base .. ':handoff')
  redis.call('HSET', k_close, 'state', 'done')
  redis.call('HINCRBY', base .. ':stats', 'handed_off', count)
  redis.call('HSET', base .. ':stats', 'handoff', 0)
  return count
end

return redis.error_reply('unknown step ' .. tostring(step))
