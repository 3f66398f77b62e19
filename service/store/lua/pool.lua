-- A mixing pool (emit.lua draws from it), prepended to the scripts that fill it
-- (decoy.lua, decoy_store.lua, personal.lua, receive.lua) and to those that take from it
-- (emit.lua, take_store.lua): ':pool', a hash from position
-- 1..size to a pool entry (service/core/wire.py), dense, so that a take reads and moves
-- only the positions it draws instead of the whole pool; ':pooled', when the pool last
-- received records (its quiet release), dropped with the pool's last record.

-- Append `entries` at the pool's end; returns its size. `now` as text (a number would be
-- formatted by sprintf).
local function pool_add(base, entries, now)
  local k_pool = base .. ':pool'
  local size = redis.call('HLEN', k_pool)
  local count = #entries
  if count == 0 then return size end
  -- In chunks: Lua's unpack() stops at a few thousand values.
  for start = 1, count, 1000 do
    local stop, fields = math.min(start + 999, count), {}
    for j = start, stop do
      fields[2 * (j - start) + 1] = size + j
      fields[2 * (j - start) + 2] = entries[j]
    end
    redis.call('HSET', k_pool, unpack(fields))
  end
  redis.call('SET', base .. ':pooled', now)
  return size + count
end

-- After a take moved what the pool keeps into positions 1..left: drop the positions past
-- `left` up to `size`, or the whole pool and ':pooled' when it keeps nothing; then keep
-- the take in flight (':takes', its seed -> its entries, until acknowledge.lua forgets it)
-- and count its `count` records out of the pool.
local function pool_took(base, seed, take, count, left, size)
  if left == 0 then
    redis.call('DEL', base .. ':pool', base .. ':pooled')
  else
    for start = left + 1, size, 1000 do
      local positions = {}
      for p = start, math.min(start + 999, size) do positions[p - start + 1] = p end
      redis.call('HDEL', base .. ':pool', unpack(positions))
    end
  end
  redis.call('HSET', base .. ':takes', seed, take)
  redis.call('HSET', base .. ':stats', 'pool', left)
  redis.call('HINCRBY', base .. ':stats', 'in_flight', count)
end
