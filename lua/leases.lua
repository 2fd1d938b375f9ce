-- sluice lease library: the requests in flight on a route's members, shared by every instance.
-- Runs after quota.lua, allocator.lua and members.lua (it walks members with members_step and
-- members_offer).
--
-- Keys (all under the route's hash tag, so one script reads them with the route's others):
-- - z: a sorted set, member = lease id, score = the time in µs when it expires;
-- - h: a hash, lease id → the member it is on;
-- - c: a hash, member → its leases in flight (members with none are absent).
-- The route's total is ZCARD z.
-- A client with a max_in_flight has its leases in one more sorted set, under the client's own
-- hash tag (lease id → expiry): its count is its ZCARD, on every route.

-- Every call that reads or takes leases first drops at most this many expired ones: bounded work
-- per call. Those left go in later calls and count meanwhile, which only ever refuses early.
local LEASES_EXPIRED_PER_CALL = 64

-- Drops at most LEASES_EXPIRED_PER_CALL expired leases of a client's set `z`.
local function leases_trim(z, now)
  local over = redis.call('ZRANGEBYSCORE', z, '-inf', string.format('%d', now), 'LIMIT', 0,
    LEASES_EXPIRED_PER_CALL)
  if #over > 0 then
    redis.call('ZREM', z, unpack(over))
  end
end

-- Adds lease `id` to a client's set `z` for ttl_us from `now`; the set lives as long as its
-- longest lease, and a minute more.
local function leases_client_take(z, id, now, ttl_us)
  redis.call('ZADD', z, string.format('%d', now + ttl_us), id)
  local keep = math.ceil(ttl_us / 1000) + 60000
  if redis.call('PTTL', z) < keep then
    redis.call('PEXPIRE', z, keep)
  end
end

-- The most leases one command names: Lua's unpack stops at a few thousand values, and a
-- gateway that was cut off from Redis may release many at once when it is back.
local LEASES_PER_COMMAND = 512

-- Forgets the leases `ids` (distinct) in h, and each in its member's count (their entries in z
-- are the caller's). A lease h does not hold (released, expired) changes nothing. Its commands
-- do not grow with the leases: one HMGET and one HDEL per LEASES_PER_COMMAND of them, and one
-- HINCRBY per member whose count drops. A gateway releases every lease of a route that came due
-- meanwhile in one call (crates/gateway/src/lease.rs), and each command a script runs costs
-- Redis about as much as a small command sent alone: a few commands for the whole call, not
-- four a lease.
local function leases_forget(l, ids)
  local drop = {}
  for from = 1, #ids, LEASES_PER_COMMAND do
    local to = math.min(#ids, from + LEASES_PER_COMMAND - 1)
    local held, gone = redis.call('HMGET', l.h, unpack(ids, from, to)), {}
    for i = 1, #held do
      local member = held[i]
      if member then
        gone[#gone + 1] = ids[from + i - 1]
        drop[member] = (drop[member] or 0) + 1
      end
    end
    if #gone > 0 then
      redis.call('HDEL', l.h, unpack(gone))
    end
  end
  for member, n in pairs(drop) do
    if redis.call('HINCRBY', l.c, member, string.format('%d', -n)) <= 0 then
      redis.call('HDEL', l.c, member)
    end
  end
end

-- The lease keys at KEYS[k], KEYS[k + 1], KEYS[k + 2], with the expired leases dropped (at most
-- LEASES_EXPIRED_PER_CALL) unless `now` is nil (a release, which reads nothing).
local function leases_open(k, now)
  local l = { z = KEYS[k], h = KEYS[k + 1], c = KEYS[k + 2], now = now }
  if not now then
    return l
  end
  local over = redis.call('ZRANGEBYSCORE', l.z, '-inf', string.format('%d', now), 'LIMIT', 0,
    LEASES_EXPIRED_PER_CALL)
  if #over > 0 then
    leases_forget(l, over)
    redis.call('ZREM', l.z, unpack(over))
  end
  return l
end

-- Member id → leases in flight, read whole (a route has few members).
local function leases_counts(l)
  local counts = {}
  local flat = redis.call('HGETALL', l.c)
  for i = 1, #flat, 2 do
    counts[flat[i]] = tonumber(flat[i + 1])
  end
  return counts
end

-- The keys live as long as their longest lease, and a minute more.
local function leases_keep(l, ttl_ms)
  local keep = ttl_ms + 60000
  if redis.call('PTTL', l.z) < keep then
    redis.call('PEXPIRE', l.z, keep)
    redis.call('PEXPIRE', l.h, keep)
    redis.call('PEXPIRE', l.c, keep)
  end
end

-- Takes lease `id` on `member` for ttl_us from now. A lease id is taken once: a call that comes
-- again after its answer was lost (the client library sends it again on a dropped connection)
-- finds its id held, and moves it to the member it chooses this time rather than count it
-- twice, so that the one release gives back exactly what was taken.
local function leases_take(l, id, member, ttl_us)
  redis.call('ZADD', l.z, string.format('%d', l.now + ttl_us), id)
  if redis.call('HSETNX', l.h, id, member) == 1 then
    redis.call('HINCRBY', l.c, member, 1)
  else
    local before = redis.call('HGET', l.h, id)
    if before ~= member then
      redis.call('HSET', l.h, id, member)
      if redis.call('HINCRBY', l.c, before, '-1') <= 0 then
        redis.call('HDEL', l.c, before)
      end
      redis.call('HINCRBY', l.c, member, 1)
    end
  end
  leases_keep(l, math.ceil(ttl_us / 1000))
  if l.cz then
    leases_client_take(l.cz, id, l.now, ttl_us)
  end
end

-- The distinct values of ARGV[from ..], in order: a lease named twice in one call is released
-- once.
local function leases_ids(from)
  local ids, seen = {}, {}
  for i = from, #ARGV do
    local id = ARGV[i]
    if not seen[id] then
      seen[id] = true
      ids[#ids + 1] = id
    end
  end
  return ids
end

-- Releases lease `id`, if still held, in four commands and no table: cheaper than
-- leases_release's way for up to three leases.
local function leases_release_one(l, id)
  local member = redis.call('HGET', l.h, id)
  if member then
    redis.call('HDEL', l.h, id)
    if redis.call('HINCRBY', l.c, member, '-1') <= 0 then
      redis.call('HDEL', l.c, member)
    end
  end
  redis.call('ZREM', l.z, id)
end

-- Releases the leases ARGV[from ..]: each still held stops counting; one already gone
-- (released, expired) changes nothing. h says which of them are held and by which member:
-- every script writes a lease to z and h together and drops it from both together.
local function leases_release(l, from)
  if #ARGV - from < 3 then
    for i = from, #ARGV do
      leases_release_one(l, ARGV[i])
    end
    return
  end
  local ids = leases_ids(from)
  leases_forget(l, ids)
  for at = 1, #ids, LEASES_PER_COMMAND do
    redis.call('ZREM', l.z, unpack(ids, at, math.min(#ids, at + LEASES_PER_COMMAND - 1)))
  end
end

-- Moves lease `id`, if still held, to expire ttl_us from now (XX: a lease already gone is not
-- taken again).
local function leases_renew(l, id, ttl_us)
  redis.call('ZADD', l.z, 'XX', string.format('%d', l.now + ttl_us), id)
end

-- How many keys the lease ask takes: the route's three, and the client's set when the ask
-- carries the client's cap (six lease arguments rather than five).
local function leases_keys()
  return tonumber(ARGV[#ARGV]) == 6 and 4 or 3
end

-- The lease ask an assignment ends with (assign_run.lua): its last ARGV is the number of lease
-- arguments before it: the lease id, its ttl in µs, the member's most leases and the route's
-- ("" for none), "I" to walk the candidates fewest leases first (least_in_flight) or "-", and
-- the client's most leases when it has a cap. Its keys are the last three, then the client's
-- set when it has a cap.
local function leases_ask(now)
  local n = #ARGV
  local at = n - tonumber(ARGV[n])
  local nk = leases_keys()
  local l = leases_open(#KEYS - nk + 1, now)
  if nk == 4 then
    l.cz = KEYS[#KEYS]
    l.client_max = tonumber(ARGV[at + 5])
    leases_trim(l.cz, now)
  end
  l.id = ARGV[at]
  l.ttl = tonumber(ARGV[at + 1])
  l.member_max = tonumber(ARGV[at + 2])
  l.route_max = tonumber(ARGV[at + 3])
  l.fewest = ARGV[at + 4] == 'I'
  l.counts = leases_counts(l)
  return l
end

-- Whether the route holds its most leases.
local function leases_full(l)
  return l.route_max and redis.call('ZCARD', l.z) >= l.route_max
end

-- Whether the calling client holds its most leases.
local function leases_client_full(l)
  return l.cz and redis.call('ZCARD', l.cz) >= l.client_max
end

-- The excluded set with the members at their most leases added (they are not candidates), and
-- whether any was. A new table: nothing writes into an excluded set (allocator.lua shares an
-- empty one between calls).
local function leases_cap(l, excluded)
  if not l.member_max then
    return excluded, false
  end
  local out, capped = nil, false
  for member, n in pairs(l.counts) do
    if n >= l.member_max and not excluded[member] then
      if not out then
        out = {}
        for id in pairs(excluded) do
          out[id] = true
        end
      end
      out[member] = true
      capped = true
    end
  end
  return out or excluded, capped
end

-- Offers the candidates listed in the script's arguments (as members_walk_listed) fewest
-- leases first, then the smallest id byte by byte, as the memory store orders them: Lua's `<`
-- on strings follows the locale Redis runs in (allocator.lua, pool_id_less).
local function leases_walk_fewest(w, l)
  local ids = {}
  local at, windows, wat = w.at + 1, 0, 0
  for _ = 1, ARGV[w.at] + 0 do
    ids[#ids + 1] = ARGV[at]
    at, windows, wat = members_step(at, windows, wat, w.extra)
  end
  local counts, bytes = l.counts, { less = false }
  table.sort(ids, function(a, b)
    local x, y = counts[a] or 0, counts[b] or 0
    if x ~= y then
      return x < y
    end
    return pool_id_less(bytes, a, b)
  end)
  for _, id in ipairs(ids) do
    if members_offer(w, id) then
      return
    end
  end
end
