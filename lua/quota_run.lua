-- sluice quota driver: one request against one quota key. Runs after quota.lua.
--
-- KEYS[1]      the quota key's helper hash; KEYS[1 + i] window i's log.
-- ARGV[1]      the request's cost in units, an integer; 0 reads the windows' state and records nothing
--              (the gateway's metrics, at scrape time).
-- ARGV[2]      "" to read the clock with Redis TIME (always, in the gateway); tests pass a time
--              in microseconds to replay a trace exactly.
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2]   window i's name, limit and length in microseconds.
-- Returns {admitted (1|0), retry_after_us, remaining_1, reset_us_1, ...}; a refused request
-- records nothing.

local q = quota_check(1, #KEYS - 1, 3, ARGV[1], quota_clock(ARGV[2]))
if q.admitted == 1 and q.cost > 0 then quota_record(q) end
quota_finish(q)
return quota_reply(q, q.admitted, {0, 0, 0, 0}, 0)
