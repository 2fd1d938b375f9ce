-- sluice quota + least-used in one atomic call, for one or more requests of one route and one
-- quota key: the gateway sends every such request that arrived while the previous call was out
-- in one call (crates/state/src/batch.rs). Runs after quota.lua and allocator.lua.
--
-- Each request is decided exactly as if it had come in a call of its own, in the order given,
-- on one clock: the quota goes first and records only once a member is assigned. What the
-- batch saves is Redis's fixed cost per call, and the quota's reads and writes: its hash and
-- logs are read once, and written once (one ZADD per log for every request admitted).
--
-- KEYS[1]              the quota key's helper hash; KEYS[2 .. #KEYS - 1] the window logs;
-- KEYS[#KEYS]          the pool.
-- ARGV[1]              "" to read the clock with Redis TIME; tests pass a time in µs.
-- ARGV[2 ..]           name, limit and length (µs) per window;
-- then                 the number of requests, and per request its cost, then its excluded
--                      members (count, ids).
-- Returns one reply per request, in order, each {status, member, admitted, retry_after_us,
-- remaining_1, reset_us_1, ...}:
--   status 1  assigned `member`, and the quota recorded the request;
--   status 0  the quota refused: nothing was assigned;
--   status 2  no eligible member: the quota recorded nothing;
--   status 3  the pool does not exist: nothing changed; sync and ask again.

local pool = KEYS[#KEYS]
local windows = #KEYS - 2
local at = 2 + 3 * windows
local requests = ARGV[at] + 0
local replies = {}
-- The pool's first member: none says the pool does not exist, and nothing is decided. It is
-- also the first pick's read, while no member has been counted and nothing is excluded.
local first = redis.call('ZRANGE', pool, '0', '0')
if #first == 0 then
  for k = 1, requests do
    replies[k] = {3, ''}
  end
  return replies
end
local q = quota_read(1, windows, 2, quota_clock(ARGV[1]))
local i = at + 1
for k = 1, requests do
  local cost = ARGV[i]
  local excluded, count
  excluded, count, i = pool_excluded(i + 1)
  quota_admit(q, cost)
  if q.admitted == 0 then
    replies[k] = quota_reply(q, 0, {0, '', 0, 0, 0, 0}, 2)
  else
    local member = pool_pick(pool, excluded, count, count == 0 and first or nil)
    if not member then
      -- Admissible, but not admitted: report the quota as it stands, with nothing recorded.
      replies[k] = quota_reply(q, 1, {2, '', 0, 0, 0, 0}, 2)
    else
      quota_record(q)
      pool_assign(pool, member)
      first = nil
      replies[k] = quota_reply(q, 1, {1, member, 0, 0, 0, 0}, 2)
    end
  end
end
quota_finish(q)
return replies
