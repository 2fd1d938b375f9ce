-- sluice client quota driver: a request against its route's quota and its client's own
-- windows, decided together: admitted only when both admit it, and recorded in both or in
-- neither. Runs after quota.lua. (Assignments take the client's windows in assign_run.lua.)
--
-- On Redis Cluster a client's keys live in a slot of their own, apart from every route's: the
-- client's windows are then decided alone first (no route windows), and "back" takes their
-- charge back when the route refuses.
--
-- ARGV[1] the operation:
--   "decide"  KEYS: the route quota's helper hash and one log per window (when it has
--             windows), then the client's helper hash and one log per window.
--             ARGV[2] the cost (an integer); ARGV[3] "" for Redis TIME, or µs (tests);
--             ARGV[4] the route's window count, then name, limit and length (µs) per window of
--             the route, then of the client.
--             Returns {admitted (1|0), retry_after_us, remaining and reset_us per window, the
--             route's then the client's, then the client's entry ("<seq>:<cost>", as
--             "back" takes it; "" when nothing was recorded)}.
--   "back"    KEYS: the client's helper hash and logs; ARGV[2] the entry "decide" returned,
--             ARGV[3 ..] the window names. Returns 1.

if ARGV[1] == 'back' then
  quota_give_back(1, 3, ARGV[2])
  return 1
end
local cost, now, n = ARGV[2], quota_clock(ARGV[3]), ARGV[4] + 0
local q, meta = nil, 1
if n > 0 then
  q = quota_check(1, n, 5, cost, now)
  meta = 2 + n
end
local c = quota_check(meta, #KEYS - meta, 5 + 3 * n, cost, now)
local admitted = c.admitted
if q and q.admitted == 0 then
  admitted = 0
end
if admitted == 1 and c.cost > 0 then
  if q then
    quota_record(q)
  end
  quota_record(c)
end
local out = quota_finish_both(q, c, admitted, {0, 0, 0, 0}, 0)
out[#out + 1] = c.recorded and (c.seq_text .. ':' .. c.cost_text) or ''
return out
