-- sluice usage driver: reservations and their settlements, on quota keys whose windows each
-- take an amount of their own (a request's cost, tokens, spend in millionths). Runs after
-- quota.lua.
--
-- ARGV[1] the operation; ARGV[2] "" to read the clock with Redis TIME (always, in the gateway),
-- or a time in µs (tests).
--   "reserve"  KEYS: the quota key's helper hash, then one log per window.
--              ARGV[3 ..]: name, limit and length (µs) per window, then each window's amount
--              (an integer).
--              Returns {admitted (1|0), retry_after_us, remaining_i, reset_us_i ..., seq,
--              at_us}: the entry recorded in every window ("<seq>:<amount>" at score at_us),
--              or seq 0 when refused (nothing recorded).
--   "settle"   KEYS: per settlement, its quota key's helper hash and one log per window.
--              ARGV[3] the number of settlements; then per settlement: the entry's seq and
--              at_us, its window count n, name, limit and length per window, then reserved
--              and settled amount per window.
--              Returns, per settlement and window in order: 0 (the entry left the window:
--              nothing changed), 1 (settled) or 2 (settled past the window's limit).
-- One call settles many requests: each is read, changed and written back in turn.

local now = quota_clock(ARGV[2])
if ARGV[1] == 'reserve' then
  local n = #KEYS - 1
  local q = quota_read(1, n, 3, now)
  local amounts, texts, at = {}, {}, 2 + 3 * n
  for i = 1, n do
    local text = ARGV[at + i]
    texts[i], amounts[i] = text, text + 0
  end
  quota_admit_each(q, amounts)
  if q.admitted == 1 then
    quota_record_each(q, amounts, texts)
  end
  quota_finish(q)
  local out = quota_reply(q, q.admitted, {0, 0, 0, 0}, 0)
  out[#out + 1] = q.admitted == 1 and q.seq or 0
  out[#out + 1] = q.admitted == 1 and now or 0
  return out
end

local m, k, a, out = ARGV[3] + 0, 1, 4, {}
for _ = 1, m do
  local seq, at, n = ARGV[a], ARGV[a + 1], ARGV[a + 2] + 0
  local q = quota_read(k, n, a + 3, now)
  local reserved, settled, b = {}, {}, a + 3 + 3 * n
  for i = 1, n do
    reserved[i], settled[i] = ARGV[b + 2 * i - 2], ARGV[b + 2 * i - 1]
  end
  quota_settle(q, seq, at, reserved, settled, out)
  quota_finish(q)
  k, a = k + 1 + n, b + 2 * n
end
return out
