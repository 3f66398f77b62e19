-- A set of fingerprints kept for the life of a stream in bounded memory, prepended to the
-- scripts that need one (ingest.lua for record ids, count.lua for published tokens).
-- The hash `key` maps a 2-byte bucket to the packed, fixed-size entries of its members,
-- whose first 6 bytes are the rest of a 64-bit fingerprint: a new member is mistaken for
-- a stored one with probability (members stored) / 2^64. A call loads the buckets its
-- arguments touch once (`load`), looks up and adds in memory, and writes back only the
-- buckets it changed (`store`).

local Fingerprints = {}
Fingerprints.__index = Fingerprints

function Fingerprints.new(key, entry_size)
  return setmetatable({key = key, size = entry_size, buckets = {}, changed = {}}, Fingerprints)
end

-- Load the buckets of the fingerprints starting at byte `at` of ARGV[first],
-- ARGV[first + step], ... up to ARGV[last].
function Fingerprints:load_args(first, last, step, at)
  local buckets = {}
  for i = first, last, step do buckets[#buckets + 1] = string.sub(ARGV[i], at, at + 1) end
  self:load_distinct(buckets)
end

-- Load the buckets of the fingerprints packed in `blob`, one every `stride` bytes, each
-- starting with its bucket.
function Fingerprints:load_packed(blob, stride)
  local buckets = {}
  for at = 1, #blob, stride do buckets[#buckets + 1] = string.sub(blob, at, at + 1) end
  self:load_distinct(buckets)
end

-- Load each bucket of `buckets` once, however often it is named there.
function Fingerprints:load_distinct(buckets)
  local wanted, order = {}, {}
  for i = 1, #buckets do
    local bucket = buckets[i]
    if not wanted[bucket] then
      wanted[bucket] = true
      order[#order + 1] = bucket
    end
  end
  self:load(order)
end

function Fingerprints:load(bucket_list)
  for start = 1, #bucket_list, 1000 do
    local stop = math.min(start + 999, #bucket_list)
    local found = redis.call('HMGET', self.key, unpack(bucket_list, start, stop))
    for j = start, stop do
      self.buckets[bucket_list[j]] = found[j - start + 1] or ''
    end
  end
end

-- The stored entry's bytes after the 6-byte key (empty string if none), or nil.
function Fingerprints:find(bucket, key)
  local entries, init = self.buckets[bucket], 1
  -- Most buckets of a young stream are empty: no C call for them.
  if entries == '' then return nil end
  while true do
    local at = string.find(entries, key, init, true)
    if not at then return nil end
    if (at - 1) % self.size == 0 then return string.sub(entries, at + 6, at + self.size - 1) end
    init = at + 1
  end
end

function Fingerprints:add(bucket, entry)
  self.buckets[bucket] = self.buckets[bucket] .. entry
  self.changed[bucket] = true
end

function Fingerprints:store()
  local fields = {}
  for bucket in pairs(self.changed) do
    fields[#fields + 1] = bucket
    fields[#fields + 1] = self.buckets[bucket]
    if #fields >= 1000 then
      redis.call('HSET', self.key, unpack(fields))
      fields = {}
    end
  end
  if #fields > 0 then redis.call('HSET', self.key, unpack(fields)) end
end
