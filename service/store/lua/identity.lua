-- A response's identity is the stream's, not a partition's (SPEC §3): one shard of the
-- stream's record ids, screened before any buffer stores a record. A record's shard is
-- its fingerprint's bucket modulo the shard count, so every copy of a response meets its
-- first copy here, whichever client sent it to whichever raw partition, at any age.
--
-- The first copy seen owns the id. The first copy itself, read again (a replay after a
-- crash, a rebalance), is passed on, and its partition's buffer knows by its offset whether
-- it stored it (ingest.lua). Any other copy of the same content is a re-send: skipped here.
-- A copy with other content is an id reused: rejected. Marking happens before the owner
-- stores the record, so a crash in between loses nothing: the replay is passed on again.
--
-- Telling the first copy from a re-send needs where the first copy was read only until its
-- raw partition has handled that offset: from then on every copy read at a handled offset
-- is a replay, which its buffer recognises by the offset whichever copy it is, and a copy
-- read past the partition's handled offset cannot be the first. So an id keeps its key and
-- content digest for life (10 bytes), and where its first copy was read only while that
-- offset is unhandled.
--
-- KEYS[1]  the shard's prefix, "splu:{<stream>:ids:<shard>}".
-- ARGV[1]  the records, 20 bytes each, concatenated: fingerprint (12 bytes: 2-byte bucket,
--          6-byte key, 4-byte content digest; service/core/ingest.py), then where it was read:
--          raw partition (2 bytes) and offset (6 bytes), big-endian. One argument, for the
--          worker to build and Redis to read at once.
-- ARGV     then, per raw partition of the records: the partition (2 bytes), the highest
--          offset among its records here, and the highest offset its buffer is known to have
--          handled, stored or not (-1 if none; decimal). A handled offset is a lower bound:
--          one told too low only keeps first reads longer, but one told too high would let a
--          re-send through as a replay its buffer does not know.
-- Returns  position and status of each record not passed on: 1 a re-send of an earlier
--          copy, 2 id reused with other content.
--
-- Keys: :known (a Fingerprints set of 10-byte entries: key, digest); :unsettled, per call
-- that read first copies: its raw partitions with their highest offsets ("<partition
-- (2 bytes)><offset>;" each) -> a byte per record of it, "1" for a first copy and "0"
-- otherwise, then its ARGV[1]; dropped once every one of those offsets is handled;
-- :handled raw partition -> highest offset handled; :screened raw partition -> highest
-- offset screened, so a re-send or a conflict is counted once, not again when its fetch
-- is replayed; :stats redelivered, conflicts.

local base = KEYS[1]
local packed = ARGV[1]
local count = #packed / 20
local known = Fingerprints.new(base .. ':known', 10)
local buckets = known:load_packed(packed, 20)
local k_screened, k_handled = base .. ':screened', base .. ':handled'
local k_unsettled = base .. ':unsettled'

local function offset_at(bytes, at)
  local b1, b2, b3, b4, b5, b6 = string.byte(bytes, at, at + 5)
  return ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
end

-- The watermarks: handled offsets of every partition, raised by this call's; screened
-- offsets of this call's partitions.
local handled, screened, call = {}, {}, {}
local stored = redis.call('HGETALL', k_handled)
for i = 1, #stored, 2 do handled[stored[i]] = tonumber(stored[i + 1]) end
for j = 2, #ARGV, 3 do
  local partition, highest, through = ARGV[j], ARGV[j + 1], tonumber(ARGV[j + 2])
  local watermark = tonumber(redis.call('HGET', k_screened, partition) or '-1')
  screened[partition] = watermark
  if tonumber(highest) > watermark then redis.call('HSET', k_screened, partition, highest) end
  if through > (handled[partition] or -1) then redis.call('HSET', k_handled, partition, through) end
  handled[partition] = math.max(through, handled[partition] or -1)
  call[#call + 1] = partition .. highest .. ';'
end

-- The first reads of earlier calls whose every offset is now handled.
local calls = redis.call('HKEYS', k_unsettled)
for i = 1, #calls do
  local settled = true
  for partition, highest in string.gmatch(calls[i], '(..)(%d+);') do
    if tonumber(highest) > (handled[partition] or -1) then settled = false end
  end
  if settled then redis.call('HDEL', k_unsettled, calls[i]) end
end

-- Where each unsettled first copy was read (partition and offset, 8 bytes), by bucket and
-- key: read once, only when a call meets a copy past its partition's handled offset. The
-- first copies this call adds are not needed there: any other copy in the call is not one.
local first_reads
local function first_read_of(member)
  if first_reads == nil then
    first_reads = {}
    local unsettled = redis.call('HVALS', k_unsettled)
    for i = 1, #unsettled do
      local call = unsettled[i]
      local records = #call / 21
      local r = string.find(call, '1', 1, true)
      while r and r <= records do
        local at = records + 20 * r - 19
        first_reads[string.sub(call, at, at + 7)] = string.sub(call, at + 12, at + 19)
        r = string.find(call, '1', r + 1, true)
      end
    end
  end
  return first_reads[member]
end

local redelivered, conflicts, found, firsts, first = 0, 0, {}, {}, false
for r = 1, count do
  local at = 20 * r - 19
  local bucket = buckets[r]
  local digest = known:find(bucket, string.sub(packed, at + 2, at + 7))
  if not digest then
    known:add(bucket, string.sub(packed, at + 2, at + 11))
    firsts[r], first = '1', true
  else
    firsts[r] = '0'
    local partition, offset = string.sub(packed, at + 12, at + 13), offset_at(packed, at + 14)
    if digest ~= string.sub(packed, at + 8, at + 11) then
      found[#found + 1] = r
      found[#found + 1] = 2
      if offset > screened[partition] then conflicts = conflicts + 1 end
    elseif offset > handled[partition]
        and first_read_of(string.sub(packed, at, at + 7)) ~= string.sub(packed, at + 12, at + 19)
    then
      found[#found + 1] = r
      found[#found + 1] = 1
      if offset > screened[partition] then redelivered = redelivered + 1 end
    end
  end
end
known:store()
if first then
  -- A call ending where an earlier one did finds its ids known while fetches read the log
  -- in order; whatever the calls, no first read is overwritten.
  local field, read = table.concat(call), table.concat(firsts) .. packed
  local suffix = 0
  while redis.call('HSETNX', k_unsettled, field, read) == 0 do
    suffix = suffix + 1
    field = table.concat(call) .. '#' .. suffix
  end
end
redis.call('HINCRBY', base .. ':stats', 'redelivered', redelivered)
redis.call('HINCRBY', base .. ':stats', 'conflicts', conflicts)
return found
