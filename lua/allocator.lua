-- sluice least-used library.
--
-- A pool is a sorted set: member = a member's id (its URL), score = the number of assignments
-- it has received from every gateway instance together. Redis orders a sorted set by score,
-- then by member bytes, so its first member is the least used, ties going to the lexically
-- smallest id: exactly the selection rule, found in O(log n) whatever the pool's size.

-- `n` as a command argument. Redis formats a Lua number argument with "%.17g", which costs it
-- about 2,000 instructions more than text for a 0 and 4,000 for a timestamp (more than a cheap
-- command; `scripts/redis-script-cost --primitives`), and string.format('%d') costs about 1,700:
-- 0 and 1 (the first offset, a single assignment) go as constants.
local function pool_text(n)
  return n == 0 and '0' or n == 1 and '1' or string.format('%d', n)
end

-- No member excluded: the usual case, shared by every call that has it, so that it costs neither
-- a table nor a number parse. Nothing writes into an excluded set.
local pool_none_excluded = {}

-- The excluded ids (members this instance sees as down, or already tried by the request):
-- ARGV[at] is their count, ARGV[at + 1 ..] the ids. Returns the set and the index after them.
local function pool_excluded(at)
  if ARGV[at] == '0' then
    return pool_none_excluded, 0, at + 1
  end
  local count = ARGV[at] + 0
  local set = {}
  for i = at + 1, at + count do
    set[ARGV[i]] = true
  end
  return set, count, at + count + 1
end

-- The least-used member that is not excluded, or nil. Excluded members are few, so the first
-- read of `count + 1` members almost always settles it. `first` is that read when the caller
-- has made it already (an empty one also says the pool does not exist).
local function pool_pick(pool, excluded, count, first)
  local offset, batch = 0, count + 1
  while true do
    local members = first
      or redis.call('ZRANGE', pool, pool_text(offset), pool_text(offset + batch - 1))
    first = nil
    if #members == 0 then
      return nil
    end
    for _, m in ipairs(members) do
      if not excluded[m] then
        return m
      end
    end
    offset = offset + batch
    batch = batch * 2
  end
end

-- One more assignment for `member`.
local function pool_assign(pool, member)
  redis.call('ZINCRBY', pool, '1', member)
end

-- Several picks in one call (fused_run.lua) without a read and a write per pick: the pool's
-- first members are read once with their counts, each pick is made on that view, and the
-- counts it added are written once, by pool_settle.
--
-- The view must pick exactly what pool_pick would after each earlier pick's ZINCRBY: the least
-- (count, id bytes). It holds enough of the pool when it holds one member per pick, one more,
-- and one per member any pick excludes: the k-th pick's first k + (its exclusions) members
-- hold one that no earlier pick counted and this one does not exclude, still at its stored
-- place, so nothing after it (never counted, since no pick reaches that far) can come first.
--
-- The read gives the ids of equal stored counts in byte order; ids whose counts became equal
-- only through this call's picks are compared byte by byte (Lua's `<` will not do: it follows
-- the locale Redis runs in).
--
-- The view is one flat table: per member, its id, its stored count, and the assignments added
-- since (three slots from 3i - 2), in the pool's order.

-- A view of `pool`'s first `size` members; v.n == 0 says the pool does not exist. (One pick
-- costs less without it, by pool_pick: about 18k instructions of Lua, and a count per member
-- read, which Redis formats with "%.17g".)
local function pool_view(pool, size)
  local read = redis.call('ZRANGE', pool, '0', pool_text(size - 1), 'WITHSCORES')
  local n = #read / 2
  local v = { pool = pool, n = n, less = false }
  for i = 1, n do
    local j = 3 * i
    v[j - 2], v[j - 1], v[j] = read[2 * i - 1], read[2 * i] + 0, 0
  end
  return v
end

-- Whether id `a` comes before id `b` in Redis's order of equal scores (memcmp), remembered for
-- the rest of the call: a round over a small pool asks about the same pairs again and again.
local function pool_id_less(v, a, b)
  local known = v.less
  if not known then
    known = {}
    v.less = known
  end
  local of_a = known[a]
  if of_a then
    local answer = of_a[b]
    if answer ~= nil then
      return answer
    end
  else
    of_a = {}
    known[a] = of_a
  end
  -- Compared eight bytes a call of string.byte (each call costs more than its comparisons;
  -- ids often share a long prefix). Bytes past the shorter id are not read, so a position
  -- either id lacks is nil on both sides.
  local n = #a < #b and #a or #b
  local answer = #a < #b
  for i = 1, n, 8 do
    local j = i + 7
    if j > n then
      j = n
    end
    local a1, a2, a3, a4, a5, a6, a7, a8 = string.byte(a, i, j)
    local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(b, i, j)
    if a1 ~= b1 then
      answer = a1 < b1
      break
    elseif a2 ~= b2 then
      answer = a2 < b2
      break
    elseif a3 ~= b3 then
      answer = a3 < b3
      break
    elseif a4 ~= b4 then
      answer = a4 < b4
      break
    elseif a5 ~= b5 then
      answer = a5 < b5
      break
    elseif a6 ~= b6 then
      answer = a6 < b6
      break
    elseif a7 ~= b7 then
      answer = a7 < b7
      break
    elseif a8 ~= b8 then
      answer = a8 < b8
      break
    end
  end
  of_a[b] = answer
  return answer
end

-- Picks and counts the least-used member not `excluded`, or returns nil: what pool_pick and
-- pool_assign would do at this point of the call.
local function pool_view_pick(v, excluded)
  local best, least, stored = false, 0, 0
  for i = 1, v.n do
    local j = 3 * i
    local id = v[j - 2]
    if not excluded[id] then
      local count = v[j - 1] + v[j]
      -- On a tie, the read's order settles it when the stored counts are equal (the earlier
      -- one stays best); otherwise the ids' bytes do.
      if not best or count < least
        or (count == least and v[j - 1] ~= stored and pool_id_less(v, id, v[best - 2])) then
        best, least, stored = j, count, v[j - 1]
      end
    end
  end
  if not best then
    return nil
  end
  v[best] = v[best] + 1
  return v[best - 2]
end

-- Writes the assignments the view added.
local function pool_settle(v)
  for i = 1, v.n do
    local j = 3 * i
    local added = v[j]
    if added > 0 then
      redis.call('ZINCRBY', v.pool, pool_text(added), v[j - 2])
    end
  end
end

-- Makes the pool hold exactly `members`. A newcomer joins at the current minimum among the
-- eligible members (ZADD NX: a member already there keeps its count, so an instance that starts
-- later never resets the others'), and members no longer configured leave.
local function pool_sync(pool, members, excluded, count)
  local wanted = {}
  for _, m in ipairs(members) do
    wanted[m] = true
  end
  for _, m in ipairs(redis.call('ZRANGE', pool, 0, -1)) do
    if not wanted[m] then
      redis.call('ZREM', pool, m)
    end
  end
  local least = pool_pick(pool, excluded, count)
  local floor = 0
  if least then
    floor = tonumber(redis.call('ZSCORE', pool, least))
  end
  for _, m in ipairs(members) do
    redis.call('ZADD', pool, 'NX', floor, m)
  end
end

-- The `min` restore policy: raise `member` to the least count among the other eligible members,
-- so that it is not flooded while it "catches up". GT never lowers a count, so instances that
-- restore the same member at different moments cannot make its count flap; XX never adds one:
-- a member a reload removed (sync took it out) may still come back up in a health check that
-- began before, and it must not return to the pool, where a pick would name it.
local function pool_restore_min(pool, member, excluded, count)
  local others = { [member] = true }
  for m in pairs(excluded) do
    others[m] = true
  end
  local least = pool_pick(pool, others, count + 1)
  if least then
    redis.call('ZADD', pool, 'XX', 'GT', redis.call('ZSCORE', pool, least), member)
  end
end
