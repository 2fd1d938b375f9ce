-- sluice least-used drivers. Runs after allocator.lua. KEYS[1] is the pool.
-- ARGV[1] is the operation:
--   "assign"   ARGV[2..]: excluded (count, ids), and for each further request sent in the same
--              call, its own.   Returns {1, member}, {2, ""} when no member is eligible, or
--              {3, ""} when the pool does not exist (never synced, or Redis restarted empty):
--              the caller syncs and asks again; one such pair per request, in one flat array.
--   "sync"     ARGV[2]: member count, then the ids, then excluded (count, ids). Returns 1.
--   "restore"  ARGV[2]: the member, then excluded (count, ids). Returns 1.

local pool, op = KEYS[1], ARGV[1]
if op == 'assign' then
  local excluded, count, i = pool_excluded(2)
  if i > #ARGV then
    -- One request. The pick's first read, made first: an empty one says the pool does not
    -- exist (Redis keeps no empty sorted set), which saves an EXISTS.
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
  end
  -- Several requests of the route sent together (crates/store/src/batch.rs), each decided as
  -- if it had come alone, in order; as fused_run.lua does, from 6 requests they pick on one
  -- view of the pool, read once and written once.
  -- The requests and their exclusions counted first, for the view's size, without a table of
  -- them: each request's own are read again as it is decided.
  local nargs, requests, all, j = #ARGV, 1, count, i
  while j <= nargs do
    local n = ARGV[j]
    if n == '0' then
      j = j + 1
    else
      n = n + 0
      all, j = all + n, j + 1 + n
    end
    requests = requests + 1
  end
  if j ~= nargs + 1 then
    -- A count of ids that the arguments do not hold: refused before anything is written.
    return redis.error_reply('a request excludes more members than the call names')
  end
  local out, view, first, exists = {}, nil, nil, nil
  if requests >= 6 then
    view = pool_view(pool, requests + 1 + all)
    exists = view.n > 0
  else
    -- A pick's first read while it excludes none (pool_pick), until a pick changes the pool.
    first = redis.call('ZRANGE', pool, '0', '0')
    exists = #first > 0
  end
  for k = 1, requests do
    if k > 1 then
      excluded, count, i = pool_excluded(i)
    end
    local member
    if exists then
      if view then
        member = pool_view_pick(view, excluded)
      else
        member = pool_pick(pool, excluded, count, count == 0 and first or nil)
        if member then
          pool_assign(pool, member)
          first = nil
        end
      end
    end
    out[2 * k - 1] = (not exists and 3) or (member and 1) or 2
    out[2 * k] = member or ''
  end
  if view then
    pool_settle(view)
  end
  return out
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
