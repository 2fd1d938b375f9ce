-- sluice assignment with member windows, cooldowns or a preference order: the route's quota,
-- the walk over the candidates, and every record, in one atomic call (one round trip). Runs
-- after quota.lua, allocator.lua and members.lua. (A least-used route whose members have no
-- windows and no cooldown takes allocator_run.lua or fused_run.lua instead: fewer commands.)
--
-- KEYS, in this order, each part only when it applies:
--   the pool                         (least-used order);
--   the cooldowns                    (the route has cooldowns);
--   the route quota's helper hash, then one log per window   (the route has a quota);
--   the client's helper hash, then one log per window         (the client has windows);
--   per member sent with windows, its helper hash, then one log per window.
-- ARGV:
--   [1] clock: "" for Redis TIME, or µs (tests)      [2] the member cost (an integer)
--   [3] "L" least-used, or "P" the members below are the candidates, best first; "Lc" or
--       "Pc" when the client's own windows follow the route quota's; "Lu", "Pu", "Lcu" or "Pcu"
--       when the windows reserve usage: after the route quota's windows, the client's and each
--       member's come each window's amount, then each window's score ("" for now, or where a
--       fixed window's entry lies), and the reply ends with the route's entry number, the client's,
--       the member's (0: none) and the admission time
--   [4] "1" skip cooling members, "0" ignore cooldowns
--   [5] the route quota's window count, "" for none   [6] the quota's cost (the route's, and the client's)
--   then the route quota's windows (name, limit, length)
--   then, for "Lc" and "Pc", the client's window count and windows, charged [6] too, in the
--   same step as the route's quota, the member windows and the selection
--   then the excluded ids (count, ids)
--   then the members (count; per member: id, then window count and windows, or "=" for the
--   previous member's windows). For "L", only the members with windows (the others admit
--   anything); for "P", every candidate.
-- Returns {status, member, wait_us, then the quota reply when there is a route quota or a
-- client's windows: admitted, retry_after_us, then the route's windows, then the client's}:
--   1 assigned `member`; 0 the route quota or the client's windows refused; 2 no eligible member;
--   3 the pool does not exist (nothing changed: sync and ask again);
--   4 busy: every eligible member cools or refuses; wait_us is the least time until one admits.
--   5 concurrency: the route holds its most leases, or every candidate holds its own.
--   6 the calling client holds its most leases (its cap came with the lease ask).
-- With a lease ask, ARGV[3] ends with "l" and the arguments and keys end with it (leases.lua,
-- leases_ask): the chosen member's lease is taken in the same step, members at their most
-- leases are not candidates, and "I" walks the candidates fewest leases first.
-- With a sticky ask, ARGV[3] ends with "s" (before any "l"): its arguments (sticky.lua,
-- sticky_ask) and its three keys come right before the lease's, or last. The session's bound
-- member is offered first when it is a candidate; the member chosen, whichever, is bound.
-- Nothing is recorded unless a member is assigned.
--
-- Several requests of one route (and quota key) sent together (crates/store/src/batch.rs):
-- ARGV[1] is "*", then per request either its key count, its argument count and its arguments
-- as above, or "=": the same keys and arguments as the request before it (whose keys are not
-- sent again). KEYS are the requests' keys, one request after another. Each is decided as if it
-- had come in a call of its own, in order, on one clock (the first request's Redis TIME).
-- Returns the requests' replies one after another in one flat array (a table per request would
-- be garbage to collect, and Redis checks each table of a reply for a dozen fields), each
-- {status, member, wait_us}, then, with a route quota, its reply; a status 3 is followed by
-- zeros. Only orders "L" and "P" are sent this way: a lease, a sticky session, a client's
-- windows and usage keep a call of their own.

local function assign_one()
  local cost = ARGV[2]
  local order = ARGV[3]
  -- The usual orders, "L" and "P", are known without taking the text apart (each string.sub
  -- is a call and a string).
  local least_used = order == 'L'
  local leasing, sticking, usage, client = false, false, false, false
  if not least_used and order ~= 'P' then
    leasing = string.sub(order, -1) == 'l'
    if leasing then
      order = string.sub(order, 1, -2)
    end
    sticking = string.sub(order, -1) == 's'
    if sticking then
      order = string.sub(order, 1, -2)
    end
    least_used = string.sub(order, 1, 1) == 'L'
    usage = string.sub(order, -1) == 'u'
    client = string.sub(order, 2, 2) == 'c'
  end
  -- Arguments per window: name, limit, length, and with usage its amount and score.
  local per = usage and 5 or 3
  local route_windows = tonumber(ARGV[5]) or 0
  local client_at = 7 + per * route_windows
  local client_windows = 0
  if client then
    client_windows = ARGV[client_at] + 0
  end
  local excluded, count, at =
    pool_excluded(client_windows > 0 and client_at + 1 + per * client_windows or client_at)
  local k = 1
  local pool, first, cool
  if least_used then
    pool = KEYS[k]
    k = k + 1
    first = members_first(pool, count)
    if #first == 0 then
      if usage then
        return {3, '', 0, 0, 0, 0, 0}
      end
      return {3, '', 0}
    end
  end
  if ARGV[4] == '1' then
    cool = KEYS[k]
    k = k + 1
  end

  local now = quota_clock(ARGV[1])
  local q, c
  -- With usage, what quota_record_each records for the route's windows (r) and the client's (u).
  local r_amounts, r_texts, r_scores, u_amounts, u_texts, u_scores
  if ARGV[5] ~= '' and usage then
    q, r_amounts, r_texts, r_scores = quota_check_each(k, route_windows, 7, now)
    k = k + 1 + route_windows
  elseif ARGV[5] ~= '' then
    q = quota_check(k, route_windows, 7, ARGV[6], now)
    k = k + 1 + route_windows
  end
  if client_windows > 0 and usage then
    c, u_amounts, u_texts, u_scores = quota_check_each(k, client_windows, client_at + 1, now)
    k = k + 1 + client_windows
  elseif client_windows > 0 then
    c = quota_check(k, client_windows, client_at + 1, ARGV[6], now)
    k = k + 1 + client_windows
  end

  -- The entries a usage reply ends with: the route's, the client's, the member's, and the
  -- admission time.
  local w_seq = 0
  local function entries(out, recorded)
    if usage then
      out[#out + 1] = recorded and q and q.seq or 0
      out[#out + 1] = recorded and c and c.seq or 0
      out[#out + 1] = recorded and w_seq or 0
      out[#out + 1] = now
    end
    return out
  end

  if (q and q.admitted == 0) or (c and c.admitted == 0) then
    return entries(quota_finish_both(q, c, 0, {0, '', 0, 0, 0, 0, 0}, 3), false)
  end

  local sticky
  if sticking then
    local last, sk = #ARGV, #KEYS - 2
    if leasing then
      last = last - tonumber(ARGV[last]) - 1
      sk = sk - leases_keys()
    end
    sticky = sticky_ask(sk, last, now)
  end

  local lease, capped
  if leasing then
    lease = leases_ask(now)
    if leases_full(lease) then
      if not q and not c then
        return entries({5, '', 0}, false)
      end
      return entries(quota_finish_both(q, c, 1, {5, '', 0}, 3), false)
    end
    if leases_client_full(lease) then
      if not q and not c then
        return entries({6, '', 0}, false)
      end
      return entries(quota_finish_both(q, c, 1, {6, '', 0}, 3), false)
    end
    excluded, capped = leases_cap(lease, excluded)
  end

  local cooling = false
  if cool then
    local raised
    cooling, raised = members_cooling(cool, now, pool, excluded)
    if raised then
      -- The pool's first read came before a member back from its cooldown was raised.
      first = members_first(pool, count)
    end
  end
  local w = members_walk(at, k, excluded, cooling, cost, now, usage and 2 or 0)
  local bound = sticky and sticky_bound(sticky)
  if bound then
    -- Only a candidate of this order: a member of the pool, or one the gateway listed.
    local candidate
    if least_used then
      candidate = redis.call('ZSCORE', pool, bound)
    else
      candidate = members_find(w, bound)
    end
    if candidate then
      members_offer(w, bound)
    end
  end
  if w.chosen then
    -- The session's member took it.
  elseif least_used then
    members_walk_pool(w, pool, count, first)
  elseif lease and lease.fewest then
    leases_walk_fewest(w, lease)
  else
    members_walk_listed(w)
  end

  local out
  if w.chosen then
    if q and usage then
      quota_record_each(q, r_amounts, r_texts, r_scores)
    elseif q then
      quota_record(q)
    end
    w_seq = w.seq
    if c and usage then
      quota_record_each(c, u_amounts, u_texts, u_scores)
    elseif c then
      quota_record(c)
    end
    if least_used then
      pool_assign(pool, w.chosen)
    end
    if lease then
      leases_take(lease, lease.id, w.chosen, lease.ttl)
    end
    if sticky then
      sticky_bind(sticky, w.chosen)
    end
    out = {1, w.chosen, 0}
  elseif w.eligible then
    members_settle(w)
    out = {4, '', w.wait or 0}
  elseif capped then
    out = {5, '', 0}
  else
    out = {2, '', 0}
  end
  if not q and not c then
    return entries(out, w.chosen)
  end
  -- Admissible, but recorded only when a member was assigned.
  return entries(quota_finish_both(q, c, 1, out, 3), w.chosen)
end

-- A call of one request defines none of the functions below (a library creates them anew on
-- every call of its operation, a script on every call).
if ARGV[1] ~= '*' then
  return assign_one()
end

-- Several requests in one call. Each is decided as a call of its own would decide it, one after
-- another on one clock; what they share is read once and written once, which a call of their
-- own each cannot do:
-- - the quota state of each helper hash (the route quota's, each member's): read when a request
--   first needs it (as its own call would read it then), decided on in Lua by the requests after
--   it (quota_admit, quota_record), and written once at the end (quota_finish): one ZADD per log
--   of one entry for every request recorded there, one HSET per hash. This is what
--   fused_run.lua does for a route quota; on one clock, a read made again later would find what
--   the first left (nothing more leaves a window), so only the first is made;
-- - the cooldowns: read and settled by the first request that needs them, as its own call
--   would; on one clock, the later requests would find the same members cooling, and nothing
--   left to settle;
-- - a least-used pool of at most ASSIGN_VIEW_MAX members: read whole once, with its counts, kept
--   in its order (count, then id bytes) as requests are assigned, and its changed counts written
--   once, in one ZADD. A larger pool is read and counted per request, as alone.
-- A request with a lease, a sticky session, a client's windows or usage is never sent in a
-- batch (sluice keeps each in a call of its own): a batch holding one is refused before anything
-- is decided (its order is neither "L" nor "P", below). A request on another clock (never sent
-- by sluice either) is decided after what the call holds is written.

local ASSIGN_VIEW_MAX = 32

-- What the call holds, reset at its start (a library's locals outlive a call).
local assign_quotas, assign_finish, assign_cool, assign_views, assign_now, assign_clock

-- The quota state of the n windows whose helper hash is KEYS[meta], their logs after it and
-- their definitions at ARGV[at]: the call's, read at the first request that needs it. Windows
-- defined otherwise under the same hash (a reload between two requests of one call) end the
-- state held: it is written, and read again, as a call of their own would.
local function assign_quota(meta, n, at)
  local name = KEYS[meta]
  local q = assign_quotas[name]
  if q then
    local same = q.n == n
    if same and q.at ~= at then
      -- Arguments and keys are interned strings: each comparison is a pointer's.
      for j = 0, 3 * n - 1 do
        if ARGV[q.at + j] ~= ARGV[at + j] then
          same = false
          break
        end
      end
      for i = 1, n do
        if KEYS[q.key + i] ~= KEYS[meta + i] then
          same = false
          break
        end
      end
    end
    if same then
      return q
    end
    quota_finish(q)
    for i = 1, #assign_finish do
      if assign_finish[i] == q then
        assign_finish[i] = false
      end
    end
  end
  q = quota_read(meta, n, at, assign_now)
  assign_quotas[name] = q
  assign_finish[#assign_finish + 1] = q
  return q
end

-- A count as a ZADD score: an integer (which every count is) as one, anything else in full.
local function assign_count_text(n)
  if n % 1 == 0 then
    return pool_text(n)
  end
  return string.format('%.17g', n)
end

-- A view of `pool`, which has at most ASSIGN_VIEW_MAX members: per member, in the pool's order
-- (count, then id bytes), three slots from 3i - 2: its id, its count as stored, its count now.
-- v.n == 0: the pool does not exist. False when the pool is larger.
local function assign_view(pool)
  local v = assign_views[pool]
  if v ~= nil then
    return v
  end
  local read = redis.call('ZRANGE', pool, '0', pool_text(ASSIGN_VIEW_MAX), 'WITHSCORES')
  local n = #read / 2
  if n > ASSIGN_VIEW_MAX then
    v = false
  else
    -- Built with the slots of a pool of up to four members, so that a small pool's view is
    -- allocated once (a table that outgrows its constructor is rehashed, each time it does).
    v = { false, false, false, false, false, false, false, false, false, false, false, false,
      n = n, less = false }
    for i = 1, n do
      local j, count = 3 * i, read[2 * i] + 0
      v[j - 2], v[j - 1], v[j] = read[2 * i - 1], count, count
    end
  end
  assign_views[pool] = v
  return v
end

-- Writes the counts view v changed, in one command.
local function assign_view_write(pool, v)
  local set, c = false, 0
  for j = 1, 3 * v.n, 3 do
    if v[j + 2] ~= v[j + 1] then
      set = set or {}
      set[c + 1], set[c + 2], c = assign_count_text(v[j + 2]), v[j], c + 2
      v[j + 1] = v[j + 2]
    end
  end
  if c > 0 then
    redis.call('ZADD', pool, unpack(set, 1, c))
  end
end

-- Writes everything the call holds, and (unless the call ends here: `last`) holds nothing more.
local function assign_write(last)
  for pool, v in pairs(assign_views) do
    if v then
      assign_view_write(pool, v)
    end
  end
  for i = 1, #assign_finish do
    if assign_finish[i] then
      quota_finish(assign_finish[i])
    end
  end
  if not last then
    assign_quotas, assign_finish, assign_cool, assign_views = {}, {}, {}, {}
  end
end

-- The members cooling (cooldowns key `cool`), as the first request that reads them sees them:
-- it settles the cooldowns that are over (members_cooling), on the pool as it stands, so the
-- counts the call holds are written first; a raise makes the call read the pool again.
local function assign_cooling(cool, pool, excluded)
  local cooling = assign_cool[cool]
  if cooling ~= nil then
    return cooling
  end
  local v = pool and assign_views[pool]
  if v then
    assign_view_write(pool, v)
  end
  local raised
  cooling, raised = members_cooling(cool, assign_now, pool, excluded)
  if raised then
    assign_views[pool] = nil
  end
  assign_cool[cool] = cooling
  return cooling
end

-- One walk per call, reset for each request (members_walk's fields).
local assign_w

-- The request being decided, as assign_prepare read it from its arguments (once for a run of
-- requests sent as "="): its cost, order, route quota (the window count's text, the count, the
-- cost, where its keys and windows lie), excluded members, where its members' arguments and
-- keys start, its pool and cooldowns keys, and per member id its quota state (false: none).
local r_cost, r_least, r_windows_text, r_windows, r_quota_cost, r_qk, r_qa
local r_excluded, r_count, r_at, r_k, r_pool, r_cool, r_qof

local function assign_prepare(k, a)
  r_cost, r_least = ARGV[a + 2], ARGV[a + 3] == 'L'
  r_windows_text = ARGV[a + 5]
  r_windows = r_windows_text == '' and 0 or r_windows_text + 0
  r_quota_cost, r_qa = ARGV[a + 6], a + 7
  r_excluded, r_count, r_at = pool_excluded(a + 7 + 3 * r_windows)
  k = k + 1
  r_pool, r_cool = false, false
  if r_least then
    r_pool, k = KEYS[k], k + 1
  end
  if ARGV[a + 4] == '1' then
    r_cool, k = KEYS[k], k + 1
  end
  r_qk = k
  if r_windows_text ~= '' then
    k = k + 1 + r_windows
  end
  r_k, r_qof = k, {}
  -- What the walks of members.lua read of the request (members_find, members_settle), once
  -- per run of requests. members_find's cache of where each member's arguments lie is made
  -- only for a walk of members.lua's: assign_decide's own keeps what it finds per member.
  local w = assign_w
  w.at, w.k_at, w.excluded, w.cost, w.found = r_at, r_k, r_excluded, r_cost, false
end

-- The quota state this call holds for member `id` of the request assign_prepare read (false:
-- it has no windows), found once per run of requests.
local function assign_member_quota(id)
  -- Found directly: what it finds is kept here, per member (members_find's own cache is for
  -- the walks of members.lua).
  local at, windows, k = members_find(assign_w, id, true)
  local mq = at and windows > 0 and assign_quota(k, windows, at) or false
  r_qof[id] = mq
  return mq
end

-- Decides `n` requests on the arguments assign_prepare read (one, then those sent as "="), each
-- exactly as assign_one would in a call of its own, and writes their replies into `out` after
-- its first `o` values. Returns the index of the last reply's last value. What every request
-- of the run would find the same is found once: the pool's view, the route quota's state and
-- the cooldowns, which the call holds. On a pool the call holds in a view, the walk is
-- members_offer's, written out here on the call's own state: most requests of a batch take
-- this path, and each function call and table write they skip is a part of a request's cost.
local function assign_decide(out, o, n)
  local pool, v, first = r_pool, false, false
  if pool then
    v = assign_views[pool]
    if v == nil then
      v = assign_view(pool)
    end
    if v then
      first = v.n > 0
    else
      first = members_first(pool, r_count)
      if #first == 0 then
        first = false
      end
    end
    if not first then
      -- The pool does not exist: nothing changed, for any request of the run (only a member
      -- assigned from an existing pool writes it).
      local last = o + n * (3 + (r_windows_text == '' and 0 or 2 + 2 * r_windows))
      for j = o + 1, last do
        out[j] = 0
      end
      for j = o + 2, last, 3 + (r_windows_text == '' and 0 or 2 + 2 * r_windows) do
        out[j - 1], out[j] = 3, ''
      end
      return last
    end
  end
  local q = false
  if r_windows_text ~= '' then
    q = assign_quota(r_qk, r_windows, r_qa)
  end
  local cooling, cooled = false, false
  local excluded, qof, cost = r_excluded, r_qof, r_cost
  for r = 1, n do
    if r > 1 and pool and not v then
      -- A larger pool is read again for each request, as a call of its own reads it.
      first = members_first(pool, r_count)
    end
    local refused = false
    if q then
      quota_admit(q, r_quota_cost)
      refused = q.admitted == 0
    end
    if refused then
      out[o + 1], out[o + 2], out[o + 3] = 0, '', 0
      quota_reply(q, 0, out, o + 3)
      o = o + 5 + 2 * q.n
    else
      if r_cool and not cooled then
        -- The first request of the run that gets this far reads them (the call's, once).
        cooled = true
        cooling = assign_cool[r_cool]
        if cooling == nil then
          cooling = assign_cooling(r_cool, pool, r_excluded)
          if pool then
            v = assign_view(pool)
            if not v then
              -- A raise may have changed counts since the first read.
              first = members_first(pool, r_count)
            end
          end
        end
      end
      local chosen, eligible, wait, deferred = nil, false, nil, false
      if v then
        -- members_offer over the view, in its order, each member's quota state held by the
        -- call.
        local last = 3 * v.n
        for j = 1, last, 3 do
          local id = v[j]
          if not excluded[id] then
            eligible = true
            local left = cooling and cooling[id]
            if left then
              deferred = deferred or {}
              deferred[#deferred + 1] = id
              deferred[#deferred + 1] = left
            else
              local mq = qof[id]
              if mq == nil then
                mq = assign_member_quota(id)
              end
              if not mq or quota_fits(mq, cost) then
                if mq then
                  quota_record(mq)
                end
                chosen = id
                -- One more assignment for it, which moves it after the members that now
                -- come before it: those of a lower count, or of the same count and a lower id.
                local stored, count, k = v[j + 1], v[j + 2] + 1, j + 3
                while k <= last do
                  local c = v[k + 2]
                  if c > count or (c == count and pool_id_less(v, id, v[k])) then
                    break
                  end
                  v[k - 3], v[k - 2], v[k - 1] = v[k], v[k + 1], c
                  k = k + 3
                end
                v[k - 3], v[k - 2], v[k - 1] = id, stored, count
                break
              end
              -- Refused: its wait.
              quota_admit(mq, cost)
              if not wait or mq.retry_after < wait then
                wait = mq.retry_after
              end
            end
          end
        end
      else
        local w = assign_w
        w.cooling, w.chosen, w.eligible, w.wait, w.deferred = cooling, nil, false, nil, false
        if not w.found then
          w.found = {}
        end
        if not pool then
          members_walk_listed(w)
        else
          members_walk_pool(w, pool, r_count, first)
          if w.chosen then
            pool_assign(pool, w.chosen)
          end
        end
        chosen, eligible, wait, deferred = w.chosen, w.eligible, w.wait, w.deferred
      end
      if chosen then
        out[o + 1], out[o + 2], out[o + 3] = 1, chosen, 0
        if q then
          -- Its reply too (the quota's part of it), in the same pass.
          quota_record(q, out, o + 3)
        end
      elseif eligible then
        if deferred and v then
          -- members_settle's rule, on the quota states the loop above holds per member: a
          -- cooling member's windows are found once per run, not by a walk of the request's
          -- arguments for every request that finds it cooling.
          for i = 1, #deferred, 2 do
            local id, left = deferred[i], deferred[i + 1]
            if not wait or left < wait then
              local mq = qof[id]
              if mq == nil then
                mq = assign_member_quota(id)
              end
              if mq then
                quota_admit(mq, cost)
                if mq.retry_after > left then
                  left = mq.retry_after
                end
              end
              if not wait or left < wait then
                wait = left
              end
            end
          end
        elseif deferred then
          -- The walk above made w.found, where members_settle finds each member once a run.
          local w = assign_w
          w.cooling, w.wait, w.deferred = cooling, wait, deferred
          members_settle(w)
          wait = w.wait
        end
        out[o + 1], out[o + 2], out[o + 3] = 4, '', wait or 0
      else
        out[o + 1], out[o + 2], out[o + 3] = 2, '', 0
      end
      if q then
        if not chosen then
          -- Admissible, but recorded only when a member was assigned.
          quota_reply(q, 1, out, o + 3)
        end
        o = o + 5 + 2 * q.n
      else
        o = o + 3
      end
    end
  end
  return o
end

assign_quotas, assign_finish, assign_cool, assign_views = {}, {}, {}, {}
assign_now, assign_clock = nil, nil
assign_w = members_walk(0, 0, pool_none_excluded, false, '0', 0, 0)
assign_w.cache = assign_quota
-- Checked before anything is decided, so that a call refused changes nothing.
local i, a, nargs = 2, nil, #ARGV
while i <= nargs do
  if ARGV[i] == '=' and a then
    i = i + 1
  else
    a = ARGV[i + 4]
    if a ~= 'L' and a ~= 'P' then
      return redis.error_reply('a batched assignment takes orders L and P only')
    end
    i = i + 2 + ARGV[i + 1]
  end
end
local out, o, k, nk = {}, 0, 0, 0
i = 2
while i <= nargs do
  if ARGV[i] == '=' then
    -- The request before, again: its keys and arguments where they lie.
    i = i + 1
  else
    local na
    k, a, nk, na = k + nk, i + 1, ARGV[i] + 0, ARGV[i + 1] + 0
    i = i + 2 + na
    -- One clock for the call, as when its requests' own calls come at the same moment.
    local clock = ARGV[a + 1]
    if clock == '' then
      clock = quota_now_text or ''
    end
    if clock ~= assign_clock then
      -- Another clock (never from sluice): what the call holds was decided on the last one.
      assign_write()
      assign_now = quota_clock(clock)
      assign_clock = quota_now_text
      assign_w.now = assign_now
    end
    assign_prepare(k, a)
  end
  -- It, and the requests after it sent as "=", decided on the same arguments.
  local n = 1
  while i <= nargs and ARGV[i] == '=' do
    n, i = n + 1, i + 1
  end
  o = assign_decide(out, o, n)
end
assign_write(true)
return out
