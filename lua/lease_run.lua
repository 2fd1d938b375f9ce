-- sluice lease driver. Runs after quota.lua, allocator.lua, members.lua and leases.lua. KEYS are
-- a route's lease keys (leases.lua: z, h, c). ARGV[1] is the operation, ARGV[2] the clock (""
-- for Redis TIME, or µs in tests):
--   "release"  ARGV[3..] lease ids: each stops counting (one already gone changes nothing).
--   "renew"    ARGV[3] the ttl in µs, ARGV[4..] lease ids: each still held expires ttl from now.
--   "read"     Returns {member, leases, ...}, sorted by member.
-- Renew and read first drop expired leases (at most LEASES_EXPIRED_PER_CALL).

local op = ARGV[1]
if op == 'release' then
  -- Nothing is read: no need for the clock, nor to drop expired leases.
  local l = leases_open(1, nil)
  for i = 3, #ARGV do
    leases_release(l, ARGV[i])
  end
  return 0
end
local l = leases_open(1, quota_clock(ARGV[2]))
if op == 'renew' then
  local ttl = tonumber(ARGV[3])
  for i = 4, #ARGV do
    leases_renew(l, ARGV[i], ttl)
  end
  leases_keep(l, math.ceil(ttl / 1000))
  return 0
elseif op == 'read' then
  local flat = redis.call('HGETALL', l.c)
  local members = {}
  for i = 1, #flat, 2 do
    members[#members + 1] = flat[i]
  end
  table.sort(members)
  local counts = leases_counts(l)
  local out = {}
  for _, m in ipairs(members) do
    out[#out + 1] = m
    out[#out + 1] = counts[m]
  end
  return out
end
return redis.error_reply('unknown operation ' .. tostring(op))
