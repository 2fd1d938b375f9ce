-- sluice quota driver: one or more requests against one quota key. Runs after quota.lua.
--
-- KEYS[1]      the quota key's helper hash; KEYS[1 + i] window i's log.
-- ARGV[1]      the first request's cost in units, an integer; 0 reads the windows' state and
--              records nothing (the gateway's metrics, at scrape time).
-- ARGV[2]      "" to read the clock with Redis TIME (always, in the gateway); tests pass a time
--              in microseconds to replay a trace exactly.
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2]   window i's name, limit and length in microseconds.
-- ARGV[3 + 3n ..]   the costs of more requests, when the gateway sends every request of the
--              route and key that waited for a call in one (crates/store/src/batch.rs).
-- Each request is decided as if it had come in a call of its own, in order, on one clock; the
-- state is read once and written once. Returns each request's {admitted (1|0), retry_after_us,
-- remaining_1, reset_us_1, ...} one after another in one flat array; a refused request records
-- nothing.

local windows = #KEYS - 1
local q = quota_read(1, windows, 3, quota_clock(ARGV[2]))
local width, next_cost = 2 + 2 * windows, 3 + 3 * windows
-- Sized for one request of one window, the usual reply.
local out = { 0, 0, 0, 0 }
local cost, o = ARGV[1], 0
while cost do
  if quota_fits(q, cost) and q.cost > 0 then
    quota_record(q, out, o)
  else
    -- Refused (quota_admit works out the wait), or a read that records nothing.
    quota_admit(q, cost)
    quota_reply(q, q.admitted, out, o)
  end
  o = o + width
  cost, next_cost = ARGV[next_cost], next_cost + 1
end
-- Placeholders past the rows (a quota with no window): a 0 would be a value too many.
for j = o + 1, 4 do
  out[j] = nil
end
quota_finish(q)
return out
