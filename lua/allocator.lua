-- sluice least-used library.
--
-- A pool is a sorted set: member = a member's id (its URL), score = the number of assignments
-- it has received from every gateway instance together. Redis orders a sorted set by score,
-- then by member bytes, so its first member is the least used, ties going to the lexically
-- smallest id: exactly the selection rule, found in O(log n) whatever the pool's size.

-- `n` as a command argument. Redis formats a Lua number argument with "%.17g", which costs it
-- about 2,000 instructions more than text for a 0 and 4,000 for a timestamp (more than a cheap
-- command; `scripts/redis-script-cost --primitives`), and string.format('%d') costs about 1,700.
local function pool_text(n)
  return n == 0 and '0' or string.format('%d', n)
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
-- restore the same member at different moments cannot make its count flap.
local function pool_restore_min(pool, member, excluded, count)
  local others = { [member] = true }
  for m in pairs(excluded) do
    others[m] = true
  end
  local least = pool_pick(pool, others, count + 1)
  if least then
    redis.call('ZADD', pool, 'GT', redis.call('ZSCORE', pool, least), member)
  end
end
