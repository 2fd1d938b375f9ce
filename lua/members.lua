-- sluice member library: what a member of a pool may refuse on its own — its quota windows (a
-- provider's per-key limits) and its cooldown (learnt from its 429s) — and the walk that picks
-- the first candidate that admits a request. Runs after quota.lua and allocator.lua, whose
-- functions it uses: a member's windows are logs exactly like a route's.
--
-- Keys (all under the route's hash tag):
-- - cool: a sorted set, member = member id, score = the time in µs until which it cools;
-- - per member with windows: its helper hash, then one log per window, as quota.lua keeps them.

-- Raises each member of `ended` (whose cooldowns are over) to the least count in the least-used
-- `pool` among the members that could take requests meanwhile: not cooling, not `excluded`, not
-- just back themselves. As on_restore: min does for a member back from ill health: at its old
-- count it would take every request until it caught up, which tends to bring the provider's
-- 429 straight back. GT never lowers a count and XX never adds a member the pool no longer has,
-- so instances that settle the same cooldown at once agree.
local function members_raise(pool, ended, cooling, excluded)
  local others, count = {}, 0
  for m in pairs(excluded) do
    others[m] = true
    count = count + 1
  end
  for m in pairs(cooling or {}) do
    others[m] = true
    count = count + 1
  end
  for _, m in ipairs(ended) do
    others[m] = true
    count = count + 1
  end
  local least = pool_pick(pool, others, count)
  if not least then
    return
  end
  local floor = redis.call('ZSCORE', pool, least)
  for _, m in ipairs(ended) do
    redis.call('ZADD', pool, 'XX', 'GT', floor, m)
  end
end

-- The members cooling at `now`: id → µs left, or false when none does (no table to collect),
-- and whether a count in `pool` may have changed (a read of the pool made before is stale).
-- The set holds only cooldowns not yet settled, so it is read whole. A cooldown that is over
-- is settled here, once, by the first assignment that sees it: on a least-used `pool` (nil for
-- other orders) its member is raised (members_raise), then it leaves the set.
local function members_cooling(cool, now, pool, excluded)
  local cooling = false
  -- Usually nobody cools and the key does not exist: EXISTS costs Redis a third of a ZRANGE.
  if redis.call('EXISTS', cool) == 0 then
    return cooling, false
  end
  local list = redis.call('ZRANGE', cool, '0', '-1', 'WITHSCORES')
  local ended = false
  for i = 1, #list, 2 do
    local left = list[i + 1] - now
    if left > 0 then
      cooling = cooling or {}
      cooling[list[i]] = left
    else
      ended = ended or {}
      ended[#ended + 1] = list[i]
    end
  end
  if ended then
    if pool then
      members_raise(pool, ended, cooling, excluded)
    end
    redis.call('ZREM', cool, unpack(ended))
  end
  return cooling, ended and pool and true or false
end

-- The members are read from ARGV[at] on: their count, then per member its id, then its window
-- count k and k windows (name, limit, length), or "=" when its windows are those of the member
-- before it (a pool's keys usually share their limits, and every argument costs Redis about as
-- much as a small command). Their keys are taken from KEYS[k_at] on: for a member with windows,
-- its helper hash then one log per window. They are not copied into tables (the walk usually
-- needs one): members_find looks one up where it lies.

-- Steps over the member at ARGV[at], whose predecessor had `windows` windows from ARGV[wat]:
-- the index of the next member, and this one's window count and first window. `extra` is the
-- number of arguments per window after the windows themselves: 2 (amount, score) when the
-- assignment reserves usage, else 0.
local function members_step(at, windows, wat, extra)
  local k = ARGV[at + 1]
  if k == '=' then
    return at + 2, windows, wat
  end
  windows = k + 0
  return at + 2 + (3 + extra) * windows, windows, at + 2
end

-- Where member `id`'s windows lie: the index in ARGV of the first, their count and the index
-- in KEYS of its helper hash; nil when this script was not told about the member.
local function members_find(w, id, direct)
  -- Requests after the first of a batched call that are sent as "=" have the same arguments:
  -- what this found for one of them holds for all (w.found, kept by assign_run.lua).
  local found = not direct and w.found
  if found then
    local f = found[id]
    if f then
      return f[1], f[2], f[3]
    elseif f == false then
      return nil
    end
    local at, windows, k = members_find(w, id, true)
    found[id] = at and {at, windows, k} or false
    return at, windows, k
  end
  local at, k, windows, wat = w.at + 1, w.k_at, 0, 0
  for _ = 1, ARGV[w.at] + 0 do
    local next_at
    next_at, windows, wat = members_step(at, windows, wat, w.extra)
    if ARGV[at] == id then
      return wat, windows, k
    end
    if windows > 0 then
      k = k + 1 + windows
    end
    at = next_at
  end
end

-- A walk over candidates: `offer(id)` for each in order, until one is taken.
-- w.chosen     the id taken, once one is (its windows recorded);
-- w.eligible   whether any candidate was not excluded;
-- w.wait       the least wait found so far over the eligible candidates that refused;
-- w.deferred   cooling candidates (id, then its cooldown left), whose own quota wait is
--              computed only if nobody admits.
-- w.extra      2 when each member window reserves its own amount (usage): after a member's
--              windows come their amounts, then their scores ('' or a fixed window's period
--              start); 0 when each is charged `cost`.
-- w.seq        the chosen member's entry number, when its windows reserved usage.
-- w.cache      false, or (several requests decided in one call, assign_run.lua) the function
--              that gives a member's quota state as this call holds it, read once: its
--              decisions are written once, at the end of the call, not by each offer.
local function members_walk(at, k_at, excluded, cooling, cost, now, extra)
  return {
    at = at, k_at = k_at, excluded = excluded, cooling = cooling, cost = cost, now = now,
    chosen = nil, eligible = false, wait = nil, deferred = false, extra = extra or 0, seq = 0,
    cache = false,
  }
end

-- Decides the member whose `windows` windows lie at ARGV[at] and KEYS[k]; records nothing.
-- Returns its quota state, and (usage) what quota_record_each records.
local function members_check(w, k, windows, at)
  if w.cache then
    local q = w.cache(k, windows, at)
    quota_admit(q, w.cost)
    return q
  end
  if w.extra == 0 then
    return quota_check(k, windows, at, w.cost, w.now)
  end
  return quota_check_each(k, windows, at, w.now)
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
  local left = w.cooling and w.cooling[id]
  if left then
    w.deferred = w.deferred or {}
    w.deferred[#w.deferred + 1] = id
    w.deferred[#w.deferred + 1] = left
    return false
  end
  local at, windows, k = members_find(w, id)
  if at and windows > 0 then
    local mq, amounts, texts, scores = members_check(w, k, windows, at)
    if mq.admitted == 1 then
      if amounts then
        quota_record_each(mq, amounts, texts, scores)
        w.seq = mq.seq
      else
        quota_record(mq)
      end
    end
    if not w.cache then
      quota_finish(mq)
    end
    if mq.admitted == 0 then
      members_note(w, mq.retry_after)
      return false
    end
  end
  w.chosen = id
  return true
end

-- Offers the members in the order the script was told them (a preference, best first).
local function members_walk_listed(w)
  local at, windows, wat = w.at + 1, 0, 0
  for _ = 1, ARGV[w.at] + 0 do
    if members_offer(w, ARGV[at]) then
      return
    end
    at, windows, wat = members_step(at, windows, wat, w.extra)
  end
end

-- Once nobody admitted: each cooling candidate admits once its cooldown is over and its windows
-- fit, whichever comes last (a window only frees up while nothing else arrives). Its windows are
-- read only when its cooldown alone would not already be the longer wait.
local function members_settle(w)
  if not w.deferred then
    return
  end
  for i = 1, #w.deferred, 2 do
    local id, wait = w.deferred[i], w.deferred[i + 1]
    if not w.wait or wait < w.wait then
      local at, windows, k = members_find(w, id)
      if at and windows > 0 then
        local mq = members_check(w, k, windows, at)
        if not w.cache then
          quota_finish(mq)
        end
        if mq.retry_after > wait then
          wait = mq.retry_after
        end
      end
      members_note(w, wait)
    end
  end
end

-- The pool's first batch for members_walk_pool: `count + 1` members, the most the walk needs
-- unless members refuse. Empty when the pool does not exist (Redis keeps no empty sorted set),
-- which makes an EXISTS unnecessary.
local function members_first(pool, count)
  return redis.call('ZRANGE', pool, '0', pool_text(count))
end

-- Offers the pool's members in its order (count, then id), read in batches as pool_pick does,
-- starting with `first` (members_first).
local function members_walk_pool(w, pool, count, first)
  local offset, batch, members = 0, count + 1, first
  while true do
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
    members = redis.call('ZRANGE', pool, pool_text(offset), pool_text(offset + batch - 1))
  end
end

-- How long the cooldowns key outlives its longest cooldown: a cooldown that is over stays in
-- the set until an assignment settles it (members_cooling), so that its member is raised to the
-- pool's least count even when the first request after it comes much later.
local MEMBERS_SETTLE_MS = 86400000

-- Cools `member` until now + for_us, never shortening a longer cooldown (ZADD GT), and keeps the
-- key as long as its longest, and a day more for the settling. Cooldowns that are over are not
-- trimmed here: members_cooling settles them. Returns the µs left.
local function members_cool(cool, member, for_us, now)
  if for_us > 0 then
    redis.call('ZADD', cool, 'GT', now + for_us, member)
  end
  local last = redis.call('ZRANGE', cool, -1, -1, 'WITHSCORES')
  if #last > 0 then
    local left_ms = math.max(0, math.ceil((tonumber(last[2]) - now) / 1000))
    redis.call('PEXPIRE', cool, left_ms + MEMBERS_SETTLE_MS)
  end
  local score = redis.call('ZSCORE', cool, member)
  if not score or tonumber(score) <= now then
    return 0
  end
  return tonumber(score) - now
end
