-- sluice usage driver: reservations and their settlements, on quota keys whose windows each
-- take an amount of their own (a request's cost, tokens, spend in millionths). Runs after
-- quota.lua.
--
-- ARGV[1] the operation; ARGV[2] "" to read the clock with Redis TIME (always, in the gateway),
-- or a time in µs (tests).
--   "reserve"  KEYS: the quota key's helper hash, then one log per window.
--              ARGV[3 ..]: name, limit and length (µs) per window, then each window's amount
--              (an integer), then each window's score: "" for now, or where a fixed window's
--              entry lies (its period's end less the window's length, a span longer than the period).
--              Returns {admitted (1|0), retry_after_us, remaining_i, reset_us_i ..., seq,
--              at_us}: the entry recorded in every window ("<seq>:<amount>" at score at_us),
--              or seq 0 when refused (nothing recorded).
--   "read"     KEYS and ARGV[3 ..] as "reserve", without amounts or scores. Returns per window
--              {total, open}: what the window holds, and how much of it is reservations not
--              settled yet (the rest is settled usage). Records nothing.
--   "settle"   KEYS: per settlement, its quota key's helper hash and one log per window.
--              ARGV[3] the number of settlements; then per settlement: the entry's seq, its
--              window count n, name, limit and length per window, then per window the entry's
--              score (at_us, or where a fixed window's entry lies), reserved and settled amount.
--              Returns, per settlement and window in order: 0 (the entry left the window:
--              nothing changed), 1 (settled) or 2 (settled past the window's limit).
-- One call settles many requests: each is read, changed and written back in turn.

local now = quota_clock(ARGV[2])
if ARGV[1] == 'read' then
  local n = #KEYS - 1
  local q = quota_read(1, n, 3, now)
  quota_finish(q)
  local out = {}
  for i = 1, n do
    local open
    if not q.exists then
      -- No hash: only what was counted again from the log (nothing when none).
      open = (q.r_abs and q.r_abs[i] or 0) + (q.dr and q.dr[i] or 0)
    else
      open = (redis.call('HGET', KEYS[1], 'r:' .. ARGV[3 + 3 * (i - 1)]) or 0) + 0
    end
    if open < 0 then open = 0 end
    out[2 * i - 1], out[2 * i] = q[5 * i - 4], open
  end
  return out
end
if ARGV[1] == 'reserve' then
  local n = #KEYS - 1
  local q = quota_read(1, n, 3, now)
  local amounts, texts, scores, at = {}, {}, {}, 2 + 3 * n
  for i = 1, n do
    local text = ARGV[at + i]
    texts[i], amounts[i], scores[i] = text, text + 0, ARGV[at + n + i]
  end
  quota_admit_each(q, amounts)
  if q.admitted == 1 then
    quota_record_each(q, amounts, texts, scores)
  end
  quota_finish(q)
  local out = quota_reply(q, q.admitted, {0, 0, 0, 0}, 0)
  out[#out + 1] = q.admitted == 1 and q.seq or 0
  out[#out + 1] = q.admitted == 1 and now or 0
  return out
end

-- Settlements of the same quota key that come one after another (a route's own key, in a busy
-- call nearly all of them) share one read of the key and one write back, and each of its logs
-- takes one ZREM and one ZADD for all of them: the per-settlement work is one ZSCORE per window.
local m, k, a, out = ARGV[3] + 0, 1, 4, {}
local c = 0
while c < m do
  local n = ARGV[a + 1] + 0
  local q = quota_read(k, n, a + 2, now)
  -- This settlement and the following ones with the same keys.
  local group = {}
  repeat
    local seq, b = ARGV[a], a + 2 + 3 * n
    local at, reserved, settled = {}, {}, {}
    for i = 1, n do
      local j = b + 3 * (i - 1)
      at[i], reserved[i], settled[i] = ARGV[j], ARGV[j + 1], ARGV[j + 2]
    end
    group[#group + 1] = { seq, at, reserved, settled }
    c, k, a = c + 1, k + 1 + n, b + 3 * n
    local same = c < m and ARGV[a + 1] + 0 == n
    if same then
      for j = 0, n do
        if KEYS[k + j] ~= KEYS[q.key + j] then
          same = false
          break
        end
      end
    end
  until not same
  local states = quota_settle_group(q, group)
  quota_finish(q)
  for g = 1, #group do
    for i = 1, n do
      out[#out + 1] = states[g][i]
    end
  end
end
return out
