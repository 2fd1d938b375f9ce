-- sluice lease driver. Runs after quota.lua, allocator.lua, members.lua and leases.lua. KEYS are
-- a route's lease keys (leases.lua: z, h, c). ARGV[1] is the operation, ARGV[2] the clock (""
-- for Redis TIME, or µs in tests):
--   "release"  ARGV[3..] lease ids: each stops counting (one already gone changes nothing).
--   "renew"    ARGV[3] the ttl in µs, ARGV[4..] lease ids: each still held expires ttl from now.
--   "read"     Returns {member, leases, ...}, sorted by member.
-- Renew and read first drop expired leases (at most LEASES_EXPIRED_PER_CALL).
-- A client's leases (KEYS[1] its set alone), with the same ARGV[2]:
--   "client_release"  ARGV[3..] lease ids.
--   "client_renew"    ARGV[3] the ttl in µs, ARGV[4..] lease ids.
--   "client_take"     ARGV[3] a lease id, ARGV[4] its ttl in µs, ARGV[5] the client's most
--                     leases: takes it unless the client holds that many. Returns 1 taken, 0
--                     not. (On Redis Cluster, where the client's set is not in the route's slot.)

local op = ARGV[1]
if op == 'client_release' then
  for at = 3, #ARGV, LEASES_PER_COMMAND do
    redis.call('ZREM', KEYS[1], unpack(ARGV, at, math.min(#ARGV, at + LEASES_PER_COMMAND - 1)))
  end
  return 0
elseif op == 'client_renew' or op == 'client_take' then
  local now = quota_clock(ARGV[2])
  leases_trim(KEYS[1], now)
  if op == 'client_take' then
    if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[5]) then
      return 0
    end
    leases_client_take(KEYS[1], ARGV[3], now, tonumber(ARGV[4]))
    return 1
  end
  local ttl = tonumber(ARGV[3])
  for i = 4, #ARGV do
    redis.call('ZADD', KEYS[1], 'XX', string.format('%d', now + ttl), ARGV[i])
  end
  local keep = math.ceil(ttl / 1000) + 60000
  if redis.call('PTTL', KEYS[1]) < keep then
    redis.call('PEXPIRE', KEYS[1], keep)
  end
  return 0
end
if op == 'release' then
  -- Nothing is read: no need for the clock, nor to drop expired leases.
  leases_release(leases_open(1, nil), 3)
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
