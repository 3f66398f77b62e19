-- A mixing pool (emit.lua draws from it), prepended to the scripts that fill it
-- (decoy.lua, personal.lua, receive.lua) and to emit.lua: ':pool', a hash from position
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
