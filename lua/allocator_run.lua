-- sluice least-used drivers. Runs after allocator.lua. KEYS[1] is the pool.
-- ARGV[1] is the operation:
--   "assign"   ARGV[2..]: excluded (count, ids).        Returns {1, member}, {2, ""} when no
--              member is eligible, or {3, ""} when the pool does not exist (never synced, or
--              Redis restarted empty): the caller syncs and asks again.
--   "sync"     ARGV[2]: member count, then the ids, then excluded (count, ids). Returns 1.
--   "restore"  ARGV[2]: the member, then excluded (count, ids). Returns 1.

local pool, op = KEYS[1], ARGV[1]
if op == 'assign' then
  local excluded, count = pool_excluded(2)
  -- The pick's first read, made first: an empty one says the pool does not exist (Redis keeps
  -- no empty sorted set), which saves an EXISTS.
  local first = redis.call('ZRANGE', pool, '0', pool_text(count))
  if #first == 0 then
    return {3, ''}
  end
  local member = pool_pick(pool, excluded, count, first)
  if not member then
    return {2, ''}
  end
  pool_assign(pool, member)
  return {1, member}
elseif op == 'sync' then
  local n = tonumber(ARGV[2])
  local members = {}
  for i = 3, 2 + n do
    members[#members + 1] = ARGV[i]
  end
  local excluded, count = pool_excluded(3 + n)
  pool_sync(pool, members, excluded, count)
  return 1
elseif op == 'restore' then
  local excluded, count = pool_excluded(3)
  pool_restore_min(pool, ARGV[2], excluded, count)
  return 1
end
return redis.error_reply('unknown operation ' .. tostring(op))
