-- A set of fingerprints kept for the life of a stream in bounded memory, prepended to the
-- scripts that need one (ingest.lua for record ids, identity.lua for the stream's ids,
-- count.lua for published tokens). A fingerprint is a 2-byte bucket and a 6-byte key, 64
-- bits: a new member is mistaken for a stored one with probability (members) / 2^64.
-- The hash `key` maps a bucket to the packed, fixed-size entries of its members, each the
-- member's key then what the set keeps with it. A call loads the buckets its arguments
-- touch once (`load`), looks up and adds in memory, and writes back only the buckets it
-- changed (`store`).
--
-- A bucket's size, and so what a write rewrites, stays bounded at any age: a bucket that
-- would hold more than `per_bucket` entries is split in two by the next bit of its
-- members' keys, and keeps only the mark SPLIT, which sends a lookup one level deeper. A
-- bucket's field is its 2 bytes at depth 0 (all a young set has), else its 2 bytes, its
-- depth (1 byte) and its further key bits, the lowest first (decimal).

local PER_BUCKET = 64  -- entries a bucket holds at most before it splits
local SPLIT = '/'  -- a split bucket's mark: no entry is 1 byte long

local Fingerprints = {}
Fingerprints.__index = Fingerprints

function Fingerprints.new(key, entry_size, per_bucket)
  return setmetatable({key = key, size = entry_size, buckets = {}, changed = {},
    per_bucket = per_bucket or PER_BUCKET, deep = false}, Fingerprints)
end

-- The key's bits as a number, its first byte lowest.
local function key_bits(key)
  local b1, b2, b3, b4, b5, b6 = string.byte(key, 1, 6)
  return ((((b6 * 256 + b5) * 256 + b4) * 256 + b3) * 256 + b2) * 256 + b1
end

-- The field of the bucket at `depth` that holds a member of `bucket` and `key`.
local function field_at(bucket, key, depth)
  if depth == 0 then return bucket end
  return bucket .. string.char(depth) .. string.format('%d', key_bits(key) % 2 ^ depth)
end

-- The field of the loaded bucket that holds (bucket, key): past the split ones.
function Fingerprints:field(bucket, key)
  local field, depth = bucket, 0
  while self.buckets[field] == SPLIT do
    depth = depth + 1
    field = field_at(bucket, key, depth)
  end
  return field
end

-- Load the buckets of the fingerprints starting at byte `at` of ARGV[first],
-- ARGV[first + step], ... up to ARGV[last].
function Fingerprints:load_args(first, last, step, at)
  local buckets = {}
  for i = first, last, step do buckets[#buckets + 1] = string.sub(ARGV[i], at, at + 1) end
  if self:load_distinct(buckets) then
    local members = {}
    for i = first, last, step do members[#members + 1] = string.sub(ARGV[i], at, at + 7) end
    self:load_deeper(members)
  end
end

-- Load the buckets of the fingerprints packed in `blob`, one every `stride` bytes, each
-- starting with its bucket and key; returns each fingerprint's bucket, in order.
function Fingerprints:load_packed(blob, stride)
  local buckets, n = {}, 0
  for at = 1, #blob, stride do
    n = n + 1
    buckets[n] = string.sub(blob, at, at + 1)
  end
  if self:load_distinct(buckets) then
    local members = {}
    for at = 1, #blob, stride do members[#members + 1] = string.sub(blob, at, at + 7) end
    self:load_deeper(members)
  end
  return buckets
end

-- Load each of `fields` once, however often it is named there; whether any is split.
function Fingerprints:load_distinct(fields)
  local wanted, order = {}, {}
  for i = 1, #fields do
    local field = fields[i]
    if not wanted[field] then
      wanted[field] = true
      order[#order + 1] = field
    end
  end
  return self:load(order)
end

-- Load, level by level, the buckets past the split ones that hold `members` (bucket and
-- key, 8 bytes each).
function Fingerprints:load_deeper(members)
  local depth = 0
  while #members > 0 do
    local deeper, fields = {}, {}
    depth = depth + 1
    for i = 1, #members do
      local bucket, key = string.sub(members[i], 1, 2), string.sub(members[i], 3, 8)
      if self.buckets[field_at(bucket, key, depth - 1)] == SPLIT then
        deeper[#deeper + 1] = members[i]
        fields[#fields + 1] = field_at(bucket, key, depth)
      end
    end
    self:load_distinct(fields)
    members = deeper
  end
end

-- Load `fields`; whether any is split.
function Fingerprints:load(fields)
  local split = false
  for start = 1, #fields, 1000 do
    local stop = math.min(start + 999, #fields)
    local found = redis.call('HMGET', self.key, unpack(fields, start, stop))
    for j = start, stop do
      local entries = found[j - start + 1] or ''
      self.buckets[fields[j]] = entries
      if entries == SPLIT then split = true end
    end
  end
  -- Lookups go past split buckets only in a set that has any among those loaded.
  self.deep = self.deep or split
  return split
end

-- The stored entry's bytes after the 6-byte key (empty string if none), or nil.
function Fingerprints:find(bucket, key)
  local field = bucket
  if self.deep then field = self:field(bucket, key) end
  local entries, init = self.buckets[field], 1
  -- Most buckets of a young stream are empty: no C call for them.
  if entries == '' then return nil end
  while true do
    local at = string.find(entries, key, init, true)
    if not at then return nil end
    if (at - 1) % self.size == 0 then return string.sub(entries, at + 6, at + self.size - 1) end
    init = at + 1
  end
end

-- Add an entry (its key, then what the set keeps with it) to a loaded bucket.
function Fingerprints:add(bucket, entry)
  local field = bucket
  if self.deep then field = self:field(bucket, string.sub(entry, 1, 6)) end
  self.buckets[field] = self.buckets[field] .. entry
  self.changed[field] = true
end

-- Split a bucket over per_bucket entries in two by the next bit of its members' keys,
-- and those again while one is.
function Fingerprints:split(field)
  local entries = self.buckets[field]
  if #entries <= self.per_bucket * self.size then return end
  local bucket, depth = string.sub(field, 1, 2), 0
  if #field > 2 then depth = string.byte(field, 3) end
  local halves = {{}, {}}
  for at = 1, #entries, self.size do
    local entry = string.sub(entries, at, at + self.size - 1)
    local half = math.floor(key_bits(entry) / 2 ^ depth) % 2 + 1
    halves[half][#halves[half] + 1] = entry
  end
  self.buckets[field] = SPLIT
  for half = 1, 2 do
    local members = halves[half]
    -- An empty half is no field: a lookup reads it as an empty bucket.
    if #members > 0 then
      local child = field_at(bucket, members[1], depth + 1)
      self.buckets[child] = table.concat(members)
      self.changed[child] = true
      self:split(child)
    end
  end
end

function Fingerprints:store()
  local buckets, limit = self.buckets, self.per_bucket * self.size
  local changed, n = {}, 0
  for field in pairs(self.changed) do
    n = n + 1
    changed[n] = field
  end
  local split = false
  for i = 1, n do
    if #buckets[changed[i]] > limit then
      self:split(changed[i])
      split = true
    end
  end
  if split then  -- the halves written are changed fields too
    changed, n = {}, 0
    for field in pairs(self.changed) do
      n = n + 1
      changed[n] = field
    end
  end
  for start = 1, n, 500 do
    local fields, k = {}, 0
    for i = start, math.min(start + 499, n) do
      fields[k + 1], fields[k + 2] = changed[i], buckets[changed[i]]
      k = k + 2
    end
    redis.call('HSET', self.key, unpack(fields))
  end
end
