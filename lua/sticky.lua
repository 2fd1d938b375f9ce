-- sluice sticky library: sessions bound to members, shared by every instance. Runs after
-- quota.lua, allocator.lua and members.lua.
--
-- Keys (all under the route's hash tag, so one script reads them with the route's others):
-- - z: a sorted set, member = a session's hash, score = the time in µs when its binding expires
--   (Redis 7.0 keeps no expiry per hash field, so the set keeps them);
-- - h: a hash, session hash → the member it is bound to;
-- - c: a hash of counters: `unbound` (new sessions a full table left unbound), `moved`.
-- The route's bindings are ZCARD z.

-- Every call that reads or takes bindings first drops at most this many expired ones: bounded
-- work per call. Those left go in later calls; an expired binding is never followed meanwhile.
local BINDINGS_EXPIRED_PER_CALL = 64

-- The sticky keys at KEYS[k], KEYS[k + 1], KEYS[k + 2], with expired bindings dropped (at most
-- BINDINGS_EXPIRED_PER_CALL).
local function sticky_open(k, now)
  local s = { z = KEYS[k], h = KEYS[k + 1], c = KEYS[k + 2], now = now }
  local over = redis.call('ZRANGEBYSCORE', s.z, '-inf', string.format('%d', now), 'LIMIT', 0,
    BINDINGS_EXPIRED_PER_CALL)
  if #over > 0 then
    redis.call('ZREM', s.z, unpack(over))
    redis.call('HDEL', s.h, unpack(over))
  end
  return s
end

-- The sticky ask an assignment carries (assign_run.lua): ARGV[last] is "3", after the session's
-- hash, the binding's ttl in µs and the route's most bindings. Its keys start at KEYS[k].
local function sticky_ask(k, last, now)
  local s = sticky_open(k, now)
  s.session = ARGV[last - 3]
  s.ttl = tonumber(ARGV[last - 2])
  s.max = tonumber(ARGV[last - 1])
  return s
end

-- The member the session is bound to, or nil. A binding that expired but was not dropped yet
-- is not followed, and is taken over by the next bind without growing the table.
local function sticky_bound(s)
  local score = redis.call('ZSCORE', s.z, s.session)
  s.present = score and true or false
  if not score or tonumber(score) <= s.now then
    return nil
  end
  s.member = redis.call('HGET', s.h, s.session) or nil
  return s.member
end

-- Gives `key` at least `keep` ms more to live (never less than it has).
local function sticky_expire(key, keep)
  if redis.call('PTTL', key) < keep then
    redis.call('PEXPIRE', key, keep)
  end
end

-- The keys live as long as their longest binding, and a minute more. Each key is looked at on
-- its own: the bindings (z, h) go empty and are deleted by Redis while the counters (c) live
-- on, so the next bind makes them anew without an expiry while c still has its own; judged by
-- c alone they were left to live forever.
local function sticky_keep(s)
  local keep = math.ceil(s.ttl / 1000) + 60000
  sticky_expire(s.z, keep)
  sticky_expire(s.h, keep)
  sticky_expire(s.c, keep)
end

-- Binds the session to `member` (the one just assigned) for s.ttl more: a binding held moves,
-- counted when its member changes; a new one is added only below the route's most bindings,
-- else counted as unbound (the request goes on all the same).
local function sticky_bind(s, member)
  if not s.present and redis.call('ZCARD', s.z) >= s.max then
    redis.call('HINCRBY', s.c, 'unbound', 1)
    sticky_keep(s)
    return
  end
  if s.member and s.member ~= member then
    redis.call('HINCRBY', s.c, 'moved', 1)
  end
  redis.call('ZADD', s.z, string.format('%d', s.now + s.ttl), s.session)
  if s.member ~= member then
    redis.call('HSET', s.h, s.session, member)
  end
  sticky_keep(s)
end

-- Drops the binding of `session` if it still points to `member`.
local function sticky_unbind(s, session, member)
  if redis.call('HGET', s.h, session) == member then
    redis.call('ZREM', s.z, session)
    redis.call('HDEL', s.h, session)
    redis.call('HINCRBY', s.c, 'moved', 1)
    -- The counters may be made anew here; they live a minute, or until the next bind keeps them.
    sticky_expire(s.c, 60000)
  end
end
