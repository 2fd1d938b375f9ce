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
local windows = #KEYS - 2
local excluded, count = pool_excluded(3 + 3 * windows)
-- The pick's first read, made first: an empty one says the pool does not exist.
local first = redis.call('ZRANGE', pool, '0', pool_text(count))
if #first == 0 then
  return {3, ''}
end
local q = quota_check(1, windows, 3, ARGV[1], quota_clock(ARGV[2]))
if q.admitted == 0 then
  quota_finish(q)
  return quota_reply(q, 0, {0, '', 0, 0, 0, 0}, 2)
end
local member = pool_pick(pool, excluded, count, first)
if not member then
  quota_finish(q)
  -- Admissible, but not admitted: report the quota as it stands, with nothing recorded.
  return quota_reply(q, 1, {2, '', 0, 0, 0, 0}, 2)
end
quota_record(q)
quota_finish(q)
pool_assign(pool, member)
return quota_reply(q, 1, {1, member, 0, 0, 0, 0}, 2)
