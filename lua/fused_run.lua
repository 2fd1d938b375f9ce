-- sluice quota + least-used in one atomic call, for one or more requests of one route and one
-- quota key: the gateway sends every such request that arrived while the previous call was out
-- in one call (crates/store/src/batch.rs). Runs after quota.lua and allocator.lua.
--
-- Each request is decided exactly as if it had come in a call of its own, in the order given,
-- on one clock: the quota goes first and records only once a member is assigned. What the
-- batch saves is Redis's fixed cost per call, and the reads and writes: the quota's hash and
-- logs are read once and written once (one ZADD per log, of one entry for every request
-- admitted), and from 6 requests a call so is the pool (one read, then one ZINCRBY per member
-- chosen; allocator.lua, pool_view).
--
-- KEYS[1]              the quota key's helper hash; KEYS[2 .. #KEYS - 1] the window logs;
-- KEYS[#KEYS]          the pool.
-- ARGV[1]              "" to read the clock with Redis TIME; tests pass a time in µs.
-- ARGV[2 ..]           name, limit and length (µs) per window;
-- then                 the number of requests, and per request its cost, then its excluded
--                      members (count, ids).
-- Returns the requests' replies one after another in one flat array (a table per request
-- would be garbage to collect), each {status, member, admitted, retry_after_us, remaining_1,
-- reset_us_1, ...}, 4 + 2 * windows long:
--   status 1  assigned `member`, and the quota recorded the request;
--   status 0  the quota refused: nothing was assigned;
--   status 2  no eligible member: the quota recorded nothing;
--   status 3  the pool does not exist: nothing changed; sync and ask again.

local pool = KEYS[#KEYS]
local windows = #KEYS - 2
local at = 2 + 3 * windows
local requests = ARGV[at] + 0
local width = 4 + 2 * windows
-- Sized for one request of one window, the usual reply when requests come one at a time: a
-- table that outgrows its constructor is rehashed at each power of two.
local out = { false, false, false, false, false, false }
-- Many requests pick on a view of the pool's first members, as many as every pick needs (see
-- pool_view): one per request, one more, and one per member excluded anywhere in the call
-- (#ARGV counts them: each request has two arguments besides its excluded ids). A view costs
-- more to set up than it saves on a few picks (scripts/redis-script-cost --batch: the two cost
-- the same at about 5 requests a call), so fewer requests pick one by one (pool_pick,
-- pool_assign), after a read of the pool's first member, which is also the first pick's first
-- read while it excludes none. Either read coming back empty says the pool does not exist.
local view, first, exists
if requests >= 6 then
  view = pool_view(pool, requests + 1 + (#ARGV - at - 2 * requests))
  exists = view.n > 0
else
  first = redis.call('ZRANGE', pool, '0', '0')
  exists = #first > 0
end
if not exists then
  for k = 0, requests - 1 do
    out[k * width + 1], out[k * width + 2] = 3, ''
    for j = k * width + 3, (k + 1) * width do
      out[j] = 0
    end
  end
  -- Placeholders past the rows (a quota with no window): a false would reply as a nil.
  for j = requests * width + 1, 6 do
    out[j] = nil
  end
  return out
end
local q = quota_read(1, windows, 2, quota_clock(ARGV[1]))
local i, o = at + 1, 0
for k = 1, requests do
  local cost = ARGV[i]
  local excluded, count
  excluded, count, i = pool_excluded(i + 1)
  if not quota_fits(q, cost) then
    quota_admit(q, cost)
    out[o + 1], out[o + 2] = 0, ''
    quota_reply(q, 0, out, o + 2)
  else
    local member
    if view then
      member = pool_view_pick(view, excluded)
    else
      member = pool_pick(pool, excluded, count, count == 0 and first or nil)
      if member then
        pool_assign(pool, member)
        first = nil
      end
    end
    if member then
      out[o + 1], out[o + 2] = 1, member
      quota_record(q, out, o + 2)
    else
      -- Admissible, but not admitted: report the quota as it stands, with nothing recorded.
      out[o + 1], out[o + 2] = 2, ''
      quota_reply(q, 1, out, o + 2)
    end
  end
  o = o + width
end
if view then
  pool_settle(view)
end
-- Placeholders past the rows (a quota with no window): a false would reply as a nil.
for j = o + 1, 6 do
  out[j] = nil
end
quota_finish(q)
return out
