-- sluice quota library: a sliding-window quota, checked and recorded atomically over every
-- window of one quota key. Drivers (quota_run.lua, and the allocator's fused script) call
-- these functions. Redis runs them as one function library with every driver (Redis 7), or
-- as one script per driver, the driver concatenated after this file (crates/store/src/scripts.rs).
--
-- Keys of one quota key:
-- - meta: a hash. Field "seq" numbers admitted requests, so that two requests in the same
--   microsecond never collapse into one log entry; field "s:<window>" is the window's running
--   total of units, so that no call has to sum a log; field "x:<window>" is the time (Redis
--   clock, µs) until which the window's log was last made to live, so that its expiry is
--   pushed back now and then rather than on every request.
-- - one log per window: a sorted set scored by admission time in microseconds, with one member
--   per admission time: "<seq>:<cost>", where cost is what the requests admitted at that time
--   cost together and seq the last of their numbers. The requests one call admits share its
--   clock, so they leave every window at the same moment: one entry of their summed cost counts
--   exactly as theirs would, costs Redis one insertion instead of one each (and one removal when
--   it leaves), and keeps a busy log to one entry per call rather than per request. A usage
--   reservation not settled yet is "r<seq>:<amount>", one per reservation (it is settled on its
--   own), and field "r:<window>" of the hash sums those, so that what a window holds splits into
--   settled usage and open reservations.
--
-- A request admitted at t counts in a window of length L while now < t + L.
--
-- What a call costs is mostly what it asks of Redis and what it allocates in Lua (every table
-- is garbage to collect), so the common call reads the hash once (HMGET) and each log's oldest
-- entry once (which also says whether the log exists, whatever a stale total says), writes one
-- entry per log and the hash once, and keeps its state in one table. Expired entries are read
-- and removed only when the oldest one has left its window.
--
-- Numbers arrive as strings (ARGV, and every reply but an integer one). They are converted by
-- arithmetic (`s + 0`, or used in a sum), not by tonumber: Redis's Lua 5.1 tonumber parses the
-- string twice (lua_isnumber, then lua_tonumber), and each parse is a glibc strtod of about 800
-- instructions, a tenth of a small command (scripts/redis-script-cost). Numbers go out as
-- strings formatted once: every string.format costs about 2,000.

-- Redis's own clock in µs, read at most once per call: key expiries follow it even when a test
-- runs the decisions on a clock of its own.
local quota_redis_now
-- The decisions' clock as a string, for log scores: Redis formats a Lua number argument with
-- "%.17g", which costs more than the command it is passed to. Every number this library sends
-- on the common path is a string for that reason.
local quota_now_text

local function quota_time()
  local t = redis.call('TIME')
  local us = t[2]
  quota_redis_now = t[1] * 1000000 + us
  if #us < 6 then
    us = string.rep('0', 6 - #us) .. us
  end
  return quota_redis_now, t[1] .. us
end

-- The time in microseconds: Redis TIME, unless a test passes one.
local function quota_clock(given)
  if given == '' then
    local now
    now, quota_now_text = quota_time()
    return now
  end
  quota_now_text = given
  return given + 0
end

local function quota_cost_of(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

-- Adds `delta` to window i's sum of open reservations, written by quota_finish.
local function quota_open(q, i, delta)
  local dr = q.dr
  if not dr then
    dr = {}
    for j = 1, q.n do dr[j] = 0 end
    q.dr = dr
  end
  dr[i] = dr[i] + delta
end

-- The windows are read from ARGV where the caller says: name, limit, length (µs) per window,
-- and their logs from KEYS, one per window, right after the helper hash. Window i's state is
-- the five slots of q from 5i - 4: its running total; its oldest entry's score once this call
-- is done with it (false: the log is empty); the time until which its log lives (false:
-- unknown; read as stored, and parsed only when the log is written); its limit and its length,
-- parsed once here rather than again by each function that needs them.

-- Reads the quota's state and expires old entries; decides nothing. `meta` is the index in KEYS
-- of the helper hash (the logs follow it), `n` the window count, `at` the index in ARGV of the
-- first window. Returns the state the other functions use: quota_admit decides a request on it,
-- and it can decide several, one after another, as separate calls would (fused_run.lua).
local function quota_read(meta, n, at, now)
  -- Built with every field it will hold when it has one window (the first five slots are that
  -- window's), so that it is allocated once: a table that outgrows its constructor is rehashed.
  local q = { false, false, false, false, false,
    key = meta, n = n, at = at, cost = 0, cost_text = '0', now = now,
    admitted = 1, retry_after = 0, dirty = false, exists = false, recorded = false,
    seq = 0, seq_text = false, pending = false, pending_seq = 0, pending_cost = 0,
    pending_text = false, dr = false, r_abs = false }
  local hash = KEYS[meta]
  local stored
  if n == 1 then
    local name = ARGV[at]
    stored = redis.call('HMGET', hash, 'seq', 'v', 's:' .. name, 'x:' .. name)
  else
    local fields = { 'seq', 'v' }
    for i = 1, n do
      local name = ARGV[at + 3 * (i - 1)]
      fields[2 * i + 1], fields[2 * i + 2] = 's:' .. name, 'x:' .. name
    end
    stored = redis.call('HMGET', hash, unpack(fields))
  end
  q.seq = (stored[1] or 0) + 0
  -- "v" is the entry number this library last wrote. A sluice from before it (a rolling
  -- upgrade) numbers entries without it, and sets each log's expiry to one window from its own
  -- write: then the expiries remembered here may be too late, so they are set again.
  local remembered = stored[1] == stored[2]
  for j = 1, 2 * n + 2 do
    if stored[j] then
      q.exists = true
      break
    end
  end
  for i = 1, n do
    local log, j, s = KEYS[meta + i], at + 3 * (i - 1), 5 * i
    local limit, length = ARGV[j + 1] + 0, ARGV[j + 2] + 0
    local total = (stored[2 * i + 1] or 0) + 0
    local horizon = now - length
    local first = redis.call('ZRANGE', log, '0', '0', 'WITHSCORES')
    local oldest = first[2] and first[2] + 0 or false
    if oldest and oldest <= horizon then
      -- Expire what left the window, keeping the running total in step. The bound is
      -- formatted once for both commands (a number argument would be formatted by each).
      local bound = string.format('%d', horizon)
      local expired = redis.call('ZRANGEBYSCORE', log, '-inf', bound)
      for _, member in ipairs(expired) do
        local cost = quota_cost_of(member)
        total = total - cost
        -- 114 is "r": a reservation that left its window unsettled.
        if string.byte(member, 1) == 114 then
          quota_open(q, i, -cost)
        end
      end
      redis.call('ZREMRANGEBYSCORE', log, '-inf', bound)
      q.dirty = true
      first = redis.call('ZRANGE', log, '0', '0', 'WITHSCORES')
      oldest = first[2] and first[2] + 0 or false
    end
    if oldest and not q.exists then
      -- The helper hash is gone (deleted, evicted) but not the log: count the log itself, and
      -- number new entries after its own, rather than admit over the limit.
      total = 0
      local open = 0
      for _, member in ipairs(redis.call('ZRANGE', log, '0', '-1')) do
        local cost = quota_cost_of(member)
        total = total + cost
        if string.byte(member, 1) == 114 then
          open = open + cost
        end
        local seq = tonumber(string.match(member, '^r?(%d+):'))
        if seq > q.seq then q.seq = seq end
      end
      -- The hash is gone, and its sum of open reservations with it: counted again, when any.
      if open > 0 then
        q.r_abs = q.r_abs or {}
        q.r_abs[i] = open
      end
      q.dirty = true
    end
    -- An empty (or vanished) log holds nothing, whatever a stale total says.
    if total < 0 or (total > 0 and not oldest) then
      total = 0
      q.dirty = true
    end
    q[s - 4], q[s - 3], q[s - 2], q[s - 1], q[s] =
      total, oldest, remembered and stored[2 * i + 2], limit, length
  end
  return q
end

-- Writes the entry of the requests recorded since the last write (quota_record), one ZADD per
-- log. Its name is formatted here, once for all of them: each string.format costs about as much
-- as a small command.
local function quota_flush(q)
  if not q.pending then
    return
  end
  q.pending = false
  local seq = string.format('%d', q.pending_seq)
  if q.pending_seq == q.seq then
    q.seq_text = seq
  end
  local member = seq .. ':' .. (q.pending_text or string.format('%d', q.pending_cost))
  q.pending_cost, q.pending_text = 0, false
  for i = 1, q.n do
    redis.call('ZADD', KEYS[q.key + i], quota_now_text, member)
  end
end

-- Microseconds until `cost` fits in window i, which holds `total`: once enough of the oldest
-- entries have left it.
local function quota_wait(q, i, total, cost, limit, length)
  if cost > limit then
    return length
  end
  -- The walk reads the log, which must hold what this call has recorded so far.
  quota_flush(q)
  local log, now = KEYS[q.key + i], q.now
  local need, freed, offset = total + cost - limit, 0, 0
  while true do
    local batch = redis.call('ZRANGE', log, string.format('%d', offset),
      string.format('%d', offset + 31), 'WITHSCORES')
    if #batch == 0 then
      return length
    end
    for k = 1, #batch, 2 do
      freed = freed + quota_cost_of(batch[k])
      if freed >= need then
        return batch[k + 1] + length - now
      end
    end
    offset = offset + 32
  end
end

-- Whether a request of `cost` (a string, as its caller received it: it is also part of the
-- entry) fits every window of `q` as it stands. It records nothing: it parses the cost into
-- q.cost, and moves a window's oldest entry up to the call's clock as quota_admit does, but
-- leaves q.admitted and q.retry_after as they were. A batched call's usual request fits: this
-- is its whole decision, without the refusal's wait (quota_admit works that out).
local function quota_fits(q, cost)
  -- Parsed once per cost a call decides on, not per request (each parse is a strtod).
  if cost ~= q.cost_text then
    q.cost_text, q.cost = cost, cost + 0
  end
  cost = q.cost
  local recorded, now = q.recorded, q.now
  for s = 5, 5 * q.n, 5 do
    -- An entry recorded by an earlier request of this call is the log's oldest if the clock
    -- went back since the others were written (an NTP step), as a call of its own would read.
    local oldest = q[s - 3]
    if recorded and oldest and oldest > now then
      q[s - 3] = now
    end
    if q[s - 4] + cost > q[s - 1] then
      return false
    end
  end
  return true
end

-- Decides a request of `cost` on the state as it stands; records nothing. Sets q.admitted and
-- q.retry_after.
local function quota_admit(q, cost)
  if quota_fits(q, cost) then
    q.admitted, q.retry_after = 1, 0
    return
  end
  cost = q.cost
  q.admitted, q.retry_after = 0, 0
  for i = 1, q.n do
    local s = 5 * i
    -- The oldest entry moved up as quota_fits does, for the windows it did not reach.
    if q.recorded and q[s - 3] and q[s - 3] > q.now then
      q[s - 3] = q.now
    end
    local total, limit, length = q[s - 4], q[s - 1], q[s]
    if total + cost > limit then
      local wait = quota_wait(q, i, total, cost, limit, length)
      if wait > q.retry_after then q.retry_after = wait end
    end
  end
end

-- A reservation (usage_run.lua): like quota_admit, but window i is charged amounts[i] (a
-- number), each window its own unit.
local function quota_admit_each(q, amounts)
  q.admitted, q.retry_after = 1, 0
  for i = 1, q.n do
    local s = 5 * i
    if q.recorded and q[s - 3] and q[s - 3] > q.now then
      q[s - 3] = q.now
    end
    local total, limit, length, cost = q[s - 4], q[s - 1], q[s], amounts[i]
    if total + cost > limit then
      q.admitted = 0
      local wait = quota_wait(q, i, total, cost, limit, length)
      if wait > q.retry_after then q.retry_after = wait end
    end
  end
end

-- Expires old entries and decides one request; records nothing (quota_read, then quota_admit).
local function quota_check(meta, n, at, cost, now)
  local q = quota_read(meta, n, at, now)
  quota_admit(q, cost)
  return q
end

-- Records an admitted request in every window. Its cost joins the entry quota_flush writes for
-- every request recorded since the last write (by quota_finish, or by a retry walk before it):
-- they are recorded on the call's one clock, so one entry holds them all. With `out`, also
-- writes the request's reply, {1, 0, remaining_1, reset_us_1, ...} as quota_reply would, after
-- the first `at` elements of `out` (a batched call's one table for every request's reply): in
-- the same pass, since a batched call does this for most of its requests, and every table
-- access is a Lua instruction Redis interprets. Unlike quota_reply it does not clear what lies
-- past the reply: a caller whose table was made with placeholders clears those left after its
-- last reply.
local function quota_record(q, out, at)
  local cost, now, seq = q.cost, q.now, q.seq + 1
  q.seq, q.pending_seq, q.recorded, q.dirty, q.seq_text = seq, seq, true, true, false
  if q.pending then
    q.pending_cost, q.pending_text = q.pending_cost + cost, false
  else
    -- A lone request's entry names its cost as the gateway sent it, unformatted.
    q.pending, q.pending_cost, q.pending_text = true, cost, q.cost_text
  end
  if out then
    out[at + 1], out[at + 2] = 1, 0
  end
  local k = at
  for s = 5, 5 * q.n, 5 do
    local oldest = q[s - 3]
    if not oldest then
      oldest = now
      q[s - 3] = now
      -- A new log: what the hash remembers of an expiry was its predecessor's.
      q[s - 2] = false
    end
    local total = q[s - 4] + cost
    q[s - 4] = total
    if out then
      local remaining = q[s - 1] - total
      if remaining < 0 then remaining = 0 end
      out[k + 3], out[k + 4], k = remaining, oldest + q[s] - now, k + 2
    end
  end
end

-- Records an admitted reservation: window i's entry is "<seq>:<texts[i]>", its own amount,
-- written at once (reservations are decided one per call). `amounts` are the same as numbers.
-- scores[i] is where the entry lies: '' for now; for a fixed window, its period's end less the
-- window's length (the same span for every period of the window, longer than any), so that
-- the entry leaves exactly at its own period's end whichever period is read.
local function quota_record_each(q, amounts, texts, scores)
  q.seq = q.seq + 1
  q.recorded, q.dirty = true, true
  q.seq_text = string.format('%d', q.seq)
  for i = 1, q.n do
    local s, score = 5 * i, scores[i]
    if score == '' then
      score = quota_now_text
    end
    redis.call('ZADD', KEYS[q.key + i], score, 'r' .. q.seq_text .. ':' .. texts[i])
    quota_open(q, i, amounts[i])
    score = score + 0
    if not q[s - 3] or score < q[s - 3] then
      if not q[s - 3] then
        q[s - 2] = false
      end
      q[s - 3] = score
    end
    q[s - 4] = q[s - 4] + amounts[i]
  end
end

-- Reads a quota whose n windows lie at ARGV[at] (name, limit, length each), followed by each
-- window's amount, then each window's score ('' for now, or where a fixed window's entry lies),
-- and decides a reservation of those amounts on it; records nothing. Returns the state and
-- what quota_record_each records.
local function quota_check_each(meta, n, at, now)
  local q = quota_read(meta, n, at, now)
  local amounts, texts, scores, b = {}, {}, {}, at + 3 * n
  for i = 1, n do
    local text = ARGV[b + i - 1]
    texts[i], amounts[i], scores[i] = text, text + 0, ARGV[b + n + i - 1]
  end
  quota_admit_each(q, amounts)
  return q, amounts, texts, scores
end

-- Settles entries of the quota `q` (read by quota_read, so what left its windows is gone),
-- each of `group` = {seq, at, reserved, settled}: in window i, the entry
-- "r<seq>:<reserved[i]>" at score at[i] (µs, a string) becomes "<seq>:<settled[i]>" at the same
-- score, and the window's total moves by the difference. Each log takes one ZREM and one ZADD
-- for the whole group. Writes nothing to the hash itself (quota_finish does). Returns per
-- entry, per window: 0 (the entry is not there: nothing changed), 1 (settled) or 2 (settled,
-- and it took the window past its limit).
local function quota_settle_group(q, group)
  local states = {}
  for g = 1, #group do states[g] = {} end
  for i = 1, q.n do
    local s, log = 5 * i, KEYS[q.key + i]
    local gone, added, taken = {}, {}, {}
    for g = 1, #group do
      local seq, at, reserved, settled = group[g][1], group[g][2], group[g][3], group[g][4]
      local member = 'r' .. seq .. ':' .. reserved[i]
      -- An entry settles once, even when a call names it twice: its removal waits for the
      -- group's ZREM.
      local score = not taken[member] and redis.call('ZSCORE', log, member)
      local state = 0
      if score and score + 0 == at[i] + 0 then
        taken[member] = true
        local before, after = reserved[i] + 0, settled[i] + 0
        state = 1
        gone[#gone + 1] = member
        added[#added + 1], added[#added + 2] = score, seq .. ':' .. settled[i]
        q[s - 4] = q[s - 4] - before + after
        quota_open(q, i, -before)
        q.dirty = true
        if after > before and q[s - 4] > q[s - 1] then
          state = 2
        end
      end
      states[g][i] = state
    end
    if #gone > 0 then
      -- Added before the removal: a log whose every entry settles would otherwise be empty for
      -- a moment, which deletes the key and its expiry, and the ZADD would make it anew with
      -- none (this call records nothing, so nothing sets one again): a log that lives forever.
      redis.call('ZADD', log, unpack(added))
      redis.call('ZREM', log, unpack(gone))
    end
  end
  return states
end

-- Writes back what changed, in one HSET, whatever the decision. A log must live until its
-- newest entry leaves its window: its expiry is pushed back when it would come sooner, and
-- then by an eighth of the window more, so that a busy log has it set about eight times per
-- window rather than on every request (an idle log lingers at most that eighth longer). The
-- hash lives as long as its longest-lived log. A hash this call did not find is written only
-- with a record, which gives it an expiry.
local function quota_finish(q)
  quota_flush(q)
  if not q.dirty or not (q.recorded or q.exists) then
    return
  end
  -- Sized for one window with every field (seq, v, s:, x:), so that it is not rehashed as it
  -- fills; unpack is told how much of it is filled.
  local set = { false, false, false, false, false, false, false, false }
  local c, renewed, last = 0, false, 0
  if q.recorded then
    local seq = q.seq_text or string.format('%d', q.seq)
    q.seq_text = seq
    set[1], set[2], set[3], set[4], c = 'seq', seq, 'v', seq, 4
  end
  local clock = q.recorded and (quota_redis_now or quota_time())
  for i = 1, q.n do
    local name, s = ARGV[q.at + 3 * (i - 1)], 5 * i
    set[c + 1], set[c + 2], c = 's:' .. name, string.format('%d', q[s - 4]), c + 2
    if q.recorded then
      local length, lives = q[s], (q[s - 2] or 0) + 0
      if lives < clock + length then
        local ms = math.ceil((length + math.floor(length / 8)) / 1000)
        redis.call('PEXPIRE', KEYS[q.key + i], string.format('%d', ms))
        lives = clock + ms * 1000
        set[c + 1], set[c + 2], c = 'x:' .. name, string.format('%d', lives), c + 2
        renewed = true
      end
      if lives > last then last = lives end
    end
  end
  redis.call('HSET', KEYS[q.key], unpack(set, 1, c))
  -- Open reservations: counted again from the log when the hash was lost, else moved. A quota
  -- of requests alone never has any, and pays one test for them.
  if q.dr or q.r_abs then
    for i = 1, q.n do
      local name = ARGV[q.at + 3 * (i - 1)]
      if q.r_abs and q.r_abs[i] then
        local open = q.r_abs[i] + (q.dr and q.dr[i] or 0)
        redis.call('HSET', KEYS[q.key], 'r:' .. name, string.format('%d', open))
      elseif q.dr and q.dr[i] ~= 0 then
        redis.call('HINCRBY', KEYS[q.key], 'r:' .. name, string.format('%d', q.dr[i]))
      end
    end
  end
  if renewed then
    redis.call('PEXPIRE', KEYS[q.key], string.format('%d', math.ceil((last - clock) / 1000)))
  end
end

-- Writes {remaining_i, reset_us_i} per window of `q` into `out`, after its first `at` elements,
-- where reset_us_i is the time until window i's oldest counted request leaves it.
local function quota_reply_windows(q, out, at)
  local now, k = q.now, at
  for s = 5, 5 * q.n, 5 do
    local remaining = q[s - 1] - q[s - 4]
    if remaining < 0 then remaining = 0 end
    local oldest = q[s - 3]
    out[k + 1], out[k + 2], k = remaining, oldest and oldest + q[s] - now or 0, k + 2
  end
end

-- Writes {admitted, retry_after_us, remaining_1, reset_us_1, ...} into `out` after its first
-- `at` elements, where reset_us_i is the time until window i's oldest counted request leaves
-- it. A caller passes `out` built as long as the reply usually is (placeholders after its own
-- elements), so that it is not rehashed as it fills; placeholders past the reply (a quota with
-- no window, read for a member's metrics) are removed.
-- A caller may also pass its one table for every request's reply (a batched call's), and
-- clears the placeholders left after its last reply.
local function quota_reply(q, admitted, out, at)
  out[at + 1] = admitted
  out[at + 2] = admitted == 1 and 0 or q.retry_after
  for k = #out, at + 3 + 2 * q.n, -1 do
    out[k] = nil
  end
  quota_reply_windows(q, out, at + 2)
  return out
end

-- A client's own windows (`c`), decided in the same call as the quota whose reply
-- quota_reply wrote into `out` at `at`: their states follow that reply's, and a refusal waits
-- for the later of the two.
local function quota_reply_also(c, admitted, out, at)
  if admitted == 0 and c.retry_after > out[at + 2] then
    out[at + 2] = c.retry_after
  end
  quota_reply_windows(c, out, #out)
  return out
end

-- Writes back a route's quota `q` and a client's windows `c` (either may be nil) decided on one
-- request, then their reply into `out` after its first `at` elements: the route's windows,
-- then the client's.
local function quota_finish_both(q, c, admitted, out, at)
  if q then
    quota_finish(q)
  end
  if c then
    quota_finish(c)
  end
  if q then
    quota_reply(q, admitted, out, at)
    if c then
      quota_reply_also(c, admitted, out, at)
    end
  elseif c then
    quota_reply(c, admitted, out, at)
  end
  return out
end

-- Takes back an entry (`<seq>:<cost>`) that a call recorded in the quota whose helper hash is
-- KEYS[meta] and whose logs follow it, one per window named in ARGV from `at`: on Redis
-- Cluster a client's windows are charged in a call of their own before the route decides, and
-- given back when it refuses. An entry that already left a window (and its total) is not
-- taken twice; a total whose hash is gone is not made again, without an expiry.
local function quota_give_back(meta, at, entry)
  local cost = quota_cost_of(entry)
  for i = at, #ARGV do
    local field = 's:' .. ARGV[i]
    if redis.call('ZREM', KEYS[meta + 1 + i - at], entry) == 1
      and redis.call('HEXISTS', KEYS[meta], field) == 1 then
      redis.call('HINCRBY', KEYS[meta], field, string.format('%d', -cost))
    end
  end
end
