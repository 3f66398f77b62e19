-- Windowed streams (service/store/windowed.py): the atomic Redis steps of one stream partition.
-- Registered behind the shared prelude (ingest.lua), which gives fields_of, open_dedup,
-- first_seen, reply and expire_with_ttl.
--
-- KEYS[1]  the partition's key prefix, "splu:{<stream>:<partition>}"; every key below
--          extends it, so one Redis Cluster hash slot holds them all.
-- ARGV[1]  the step:
--
-- "ingest" now_ms, window (records), max_window_wait (ms), record ttl (ms, 0: none),
--          through (the highest raw offset handled, ingest.lua), closed retention (ms), n,
--          then one argument per record: id (32 hex digits), then "public
--          codes|sensitive codes|raw offset".
--          Stores the new records idempotently in the open window; the open window
--          closes when it is full or, at the start of a call (a tick has no records),
--          when its first record came max_window_wait ago, or at the stream's close,
--          once every raw offset below the partition's close offset is handled.
--          Returns the records buffered (open and closed windows), the closed windows
--          waiting, then position and status of each record not stored anew (1
--          redelivered, 2 id reused with other content, 3 late: the partition was
--          finalized), as the other ingest scripts.
-- "stage"  window number, output: keep the window's output (messages under their
--          tokens) unless one is kept already. Returns 1 if this output was kept, the
--          output kept before if there was one, nil if the window is published already.
-- "finish" window number, rows published, side messages published, records suppressed,
--          1 if the whole window was suppressed else 0: the broker acknowledged (or there
--          was nothing to send), so drop the window's records and output and count it.
--          Returns 1, or 0 if it was finished before (and counts nothing again).
--
-- Keys: :off (dedup, ingest.lua); :open id -> "public|sensitive" of the open
-- window; :w:<number> the same for a closed window; :wq closed windows waiting for
-- publication (member and score: the window number); :wout:<number> the staged output;
-- :stats counters (ingested, redelivered, replayed, conflicts, rejected, windows (the
-- last window number), closed_full, closed_wait, windows_published, windows_suppressed,
-- published (rows), side (side messages), suppressed (records)), opened (ms the open
-- window received its first record), and the gauges of ingest.lua.

local base = KEYS[1]
local step = ARGV[1]
local k_open, k_queue, k_stats = base .. ':open', base .. ':wq', base .. ':stats'

local function window_key(number)
  return base .. ':w:' .. number
end

local function output_key(number)
  return base .. ':wout:' .. number
end

if step == 'stage' then
  local number = ARGV[2]
  if not redis.call('ZSCORE', k_queue, number) then return nil end
  local kept = redis.call('GET', output_key(number))
  if kept then return kept end
  redis.call('SET', output_key(number), ARGV[3])
  return 1
end

if step == 'finish' then
  local number = ARGV[2]
  if redis.call('ZREM', k_queue, number) == 0 then return 0 end
  redis.call('DEL', window_key(number), output_key(number))
  redis.call('HINCRBY', k_stats, 'published', tonumber(ARGV[3]))
  redis.call('HINCRBY', k_stats, 'side', tonumber(ARGV[4]))
  redis.call('HINCRBY', k_stats, 'suppressed', tonumber(ARGV[5]))
  if ARGV[6] == '1' then
    redis.call('HINCRBY', k_stats, 'windows_suppressed', 1)
  else
    redis.call('HINCRBY', k_stats, 'windows_published', 1)
  end
  return 1
end

assert(step == 'ingest', 'unknown step')
local now, size, max_wait = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ttl, through, retention = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local n = tonumber(ARGV[8])

open_dedup(base, n, 8, through, false)
local close_offset, finalized = close_state(base, 'raw')
local count = redis.call('HLEN', k_open)
local opened = tonumber(redis.call('HGET', k_stats, 'opened') or now)

-- The open window becomes closed window number `windows + 1`, queued for publication.
local function close(reason)
  local number = redis.call('HINCRBY', k_stats, 'windows', 1)
  redis.call('RENAME', k_open, window_key(number))
  redis.call('ZADD', k_queue, number, number)
  redis.call('HINCRBY', k_stats, reason, 1)
  redis.call('HDEL', k_stats, 'opened')
  count = 0
end

if count > 0 and now - opened >= max_wait then
  close('closed_wait')
end

local added = 0
for r = 1, n do
  local id, bucket, key, digest, public, sensitive, offset = fields_of(ARGV[8 + r], 3)
  local fresh = first_seen(r, bucket, key, digest, offset)
  if fresh and finalized then
    refuse_late(r)
  elseif fresh then
    -- HSETNX: an id stored twice would be published twice.
    if redis.call('HSETNX', k_open, id, public .. '|' .. sensitive) == 1 then
      if count == 0 then
        redis.call('HSET', k_stats, 'opened', now)
      end
      count = count + 1
      added = added + 1
      if count >= size then
        close('closed_full')
      end
    else
      status[#status + 1] = r
      status[#status + 1] = 1
      redelivered = redelivered + 1
    end
  end
end

-- At the close the open window closes, whatever its size: published whole, or suppressed
-- below min_window as any partial window.
if finalizing(close_offset, finalized) then
  if count > 0 then close('closed_wait') end
  finish_close(base, -1, retention, {})
end

local queued = redis.call('ZRANGE', k_queue, 0, -1)
local buffered = count
local keys = {k_open, k_queue}
for _, number in ipairs(queued) do
  buffered = buffered + redis.call('HLEN', window_key(number))
  keys[#keys + 1] = window_key(number)
  keys[#keys + 1] = output_key(number)
end
expire_with_ttl(ttl, keys)
-- No mixing pool: a window's records stay buffered until the window is published whole.
return reply(base, k_stats, added, buffered, 0, ttl)
