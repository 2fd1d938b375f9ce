-- sluice member library: what a member of a pool may refuse on its own — its quota windows (a
-- provider's per-key limits) and its cooldown (learnt from its 429s) — and the walk that picks
-- the first candidate that admits a request. Runs after quota.lua and allocator.lua, whose
-- functions it uses: a member's windows are logs exactly like a route's.
--
-- Keys (all under the route's hash tag):
-- - cool: a sorted set, member = member id, score = the time in µs until which it cools;
-- - per member with windows: its helper hash, then one log per window, as quota.lua keeps them.

-- The members cooling at `now`: id → µs left. The set holds only recent cooldowns (entries past
-- are trimmed by members_cool, and the key expires with its longest), so it is read whole.
local function members_cooling(cool, now)
  local cooling = {}
  local list = redis.call('ZRANGE', cool, 0, -1, 'WITHSCORES')
  for i = 1, #list, 2 do
    local left = tonumber(list[i + 1]) - now
    if left > 0 then
      cooling[list[i]] = left
    end
  end
  return cooling
end

-- Reads the members from ARGV[at] on: their count, then per member its id, its window count k
-- and k windows (name, limit, length). Their keys are taken from KEYS[k_at] on: for a member
-- with windows, its helper hash then one log per window. Returns the members in order, by id,
-- and the index after them in ARGV.
local function members_read(at, k_at)
  local list, by_id = {}, {}
  local n = tonumber(ARGV[at])
  at = at + 1
  for i = 1, n do
    local id, windows = ARGV[at], tonumber(ARGV[at + 1])
    local m = { id = id, w = quota_windows(at + 2, windows), logs = {} }
    if windows > 0 then
      m.meta = KEYS[k_at]
      for j = 1, windows do
        m.logs[j] = KEYS[k_at + j]
      end
      k_at = k_at + 1 + windows
    end
    at = at + 2 + 3 * windows
    list[i], by_id[id] = m, m
  end
  return list, by_id, at
end

-- A walk over candidates: `offer(id)` for each in order, until one is taken.
-- w.chosen     the id taken, once one is (its windows recorded);
-- w.eligible   whether any candidate was not excluded;
-- w.wait       the least wait found so far over the eligible candidates that refused;
-- w.deferred   cooling candidates whose own quota wait is computed only if nobody admits.
local function members_walk(by_id, excluded, cooling, cost, now)
  return {
    by_id = by_id, excluded = excluded, cooling = cooling, cost = cost, now = now,
    chosen = nil, eligible = false, wait = nil, deferred = {},
  }
end

local function members_note(w, wait)
  if not w.wait or wait < w.wait then
    w.wait = wait
  end
end

-- Offers one candidate; returns true when it is taken. A member this script was not told about
-- (another instance synced a newer pool a moment ago) has no windows here.
local function members_offer(w, id)
  if w.excluded[id] then
    return false
  end
  w.eligible = true
  local left = w.cooling[id]
  if left then
    w.deferred[#w.deferred + 1] = { id, left }
    return false
  end
  local m = w.by_id[id]
  if m and #m.logs > 0 then
    local mq = quota_check(m.meta, m.logs, w.cost, w.now, m.w)
    if mq.admitted == 1 then
      quota_record(mq)
    end
    quota_finish(mq)
    if mq.admitted == 0 then
      members_note(w, mq.retry_after)
      return false
    end
  end
  w.chosen = id
  return true
end

-- Once nobody admitted: each cooling candidate admits once its cooldown is over and its windows
-- fit, whichever comes last (a window only frees up while nothing else arrives). Its windows are
-- read only when its cooldown alone would not already be the longer wait.
local function members_settle(w)
  for _, d in ipairs(w.deferred) do
    local id, wait = d[1], d[2]
    if not w.wait or wait < w.wait then
      local m = w.by_id[id]
      if m and #m.logs > 0 then
        local mq = quota_check(m.meta, m.logs, w.cost, w.now, m.w)
        quota_finish(mq)
        if mq.retry_after > wait then
          wait = mq.retry_after
        end
      end
      members_note(w, wait)
    end
  end
end

-- Offers the pool's members in its order (count, then id), read in batches as pool_pick does:
-- the first read of `count + 1` members settles it unless members refuse.
local function members_walk_pool(w, pool, count)
  local offset, batch = 0, count + 1
  while true do
    local members = redis.call('ZRANGE', pool, offset, offset + batch - 1)
    if #members == 0 then
      return
    end
    for _, id in ipairs(members) do
      if members_offer(w, id) then
        return
      end
    end
    offset = offset + batch
    batch = batch * 2
  end
end

-- Cools `member` until now + for_us, never shortening a longer cooldown (ZADD GT), trims the
-- cooldowns that are over, and keeps the key as long as its longest. Returns the µs left.
local function members_cool(cool, member, for_us, now)
  redis.call('ZREMRANGEBYSCORE', cool, '-inf', now)
  if for_us > 0 then
    redis.call('ZADD', cool, 'GT', now + for_us, member)
  end
  local last = redis.call('ZRANGE', cool, -1, -1, 'WITHSCORES')
  if #last > 0 then
    redis.call('PEXPIRE', cool, math.ceil((tonumber(last[2]) - now) / 1000))
  end
  local score = redis.call('ZSCORE', cool, member)
  if not score then
    return 0
  end
  return tonumber(score) - now
end
