-- sluice cooldown drivers. Runs after quota.lua, allocator.lua and members.lua. KEYS[1] is the
-- route's cooldowns. ARGV[1] is the operation:
--   "cool"  ARGV[2] the member, ARGV[3] µs to cool it, ARGV[4] the clock ("" for Redis TIME,
--           or µs in tests). Returns the member's remaining cooldown in µs.
--   "list"  Returns {member, µs left, ...} for the members cooling now, soonest to end first.

local cool, op = KEYS[1], ARGV[1]
if op == 'cool' then
  return members_cool(cool, ARGV[2], tonumber(ARGV[3]), quota_clock(ARGV[4]))
elseif op == 'list' then
  local now = quota_clock('')
  local out = {}
  local list = redis.call('ZRANGE', cool, 0, -1, 'WITHSCORES')
  for i = 1, #list, 2 do
    local left = tonumber(list[i + 1]) - now
    if left > 0 then
      out[#out + 1] = list[i]
      out[#out + 1] = left
    end
  end
  return out
end
return redis.error_reply('unknown operation ' .. tostring(op))
