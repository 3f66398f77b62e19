-- Uniforms in [0, 1) from SHA-1 in counter mode, prepended to the scripts that draw
-- (decoy.lua: keyed cuts; emit.lua: each take's shuffle). Block k is
-- sha1hex(seed .. ':' .. k), k = start + 1, start + 2, ..., cut into slices of `digits`
-- hex digits (8: 32-bit uniforms, 12: 48-bit), the rest of a block unused. `given`, if
-- any, holds the first blocks already hashed (40 hex digits each, concatenated).
-- Returns the generator and a function giving the last block number used.
local function sha1_uniforms(seed, start, digits, given)
  local counter, block, position = start, '', 41
  local scale = 16 ^ digits
  local given_blocks = math.floor(#(given or '') / 40)
  local function uniform()
    if position > 41 - digits then
      counter = counter + 1
      local k = counter - start
      if k <= given_blocks then
        block = string.sub(given, 40 * k - 39, 40 * k)
      else
        block = redis.sha1hex(seed .. ':' .. counter)
      end
      position = 1
    end
    local x = tonumber(string.sub(block, position, position + digits - 1), 16)
    position = position + digits
    return x / scale
  end
  return uniform, function() return counter end
end
