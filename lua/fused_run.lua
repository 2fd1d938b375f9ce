-- sluice quota + least-used in one atomic call: one round trip per request on a route that has
-- both. Runs after quota.lua and allocator.lua.
--
-- KEYS[1]              the quota key's helper hash; KEYS[2 .. #KEYS - 1] the window logs;
-- KEYS[#KEYS]          the pool.
-- ARGV                 the quota's (cost, clock, then name, limit, length per window), then the
--                      excluded members (count, ids).
-- Returns {status, member, admitted, retry_after_us, remaining_1, reset_us_1, ...}:
--   status 1  assigned `member`, and the quota recorded the request;
--   status 0  the quota refused: nothing was assigned;
--   status 2  no eligible member: the quota recorded nothing;
--   status 3  the pool does not exist: nothing changed; sync and ask again.
-- The quota goes first, as on every route, and records only once a member is assigned.

local pool = KEYS[#KEYS]
if redis.call('EXISTS', pool) == 0 then
  return {3, ''}
end
local logs = {}
for i = 2, #KEYS - 1 do
  logs[#logs + 1] = KEYS[i]
end
local windows = #logs
local q = quota_check(KEYS[1], logs, tonumber(ARGV[1]), quota_clock(ARGV[2]), quota_windows(3, windows))
if q.admitted == 0 then
  quota_finish(q)
  return quota_reply(q, 0, {0, ''})
end
local excluded, count = pool_excluded(3 + 3 * windows)
local member = pool_pick(pool, excluded, count)
if not member then
  quota_finish(q)
  -- Admissible, but not admitted: report the quota as it stands, with nothing recorded.
  return quota_reply(q, 1, {2, ''})
end
quota_record(q)
quota_finish(q)
pool_assign(pool, member)
return quota_reply(q, 1, {1, member})
