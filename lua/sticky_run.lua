-- sluice sticky driver. Runs after quota.lua, allocator.lua, members.lua and sticky.lua. KEYS
-- are a route's sticky keys (sticky.lua: z, h, c). ARGV[1] is the operation, ARGV[2] the clock
-- ("" for Redis TIME, or µs in tests):
--   "unbind"  ARGV[3] a session's hash, ARGV[4] a member: the binding goes if it points there.
--   "read"    Returns {bindings, unbound, moved}, expired bindings dropped first (at most
--             BINDINGS_EXPIRED_PER_CALL).

local op = ARGV[1]
if op == 'unbind' then
  -- Nothing expires here: no need for the clock.
  sticky_unbind({ z = KEYS[1], h = KEYS[2], c = KEYS[3] }, ARGV[3], ARGV[4])
  return 0
end
local s = sticky_open(1, quota_clock(ARGV[2]))
local counts = redis.call('HMGET', s.c, 'unbound', 'moved')
return { redis.call('ZCARD', s.z), tonumber(counts[1]) or 0, tonumber(counts[2]) or 0 }
