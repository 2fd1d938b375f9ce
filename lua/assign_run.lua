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
--       member's come each window's amount, then each window's score ("" for now, or a fixed
--       window's period start), and the reply ends with the route's entry number, the client's,
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
-- ARGV[1] is "*", then per request its key count, its argument count and its arguments as
-- above; KEYS are each request's keys, one request after another. Each is decided as if it had
-- come in a call of its own, in order, on one clock (the first request's Redis TIME). Returns
-- each request's reply, one array per request. Requests with a lease or a sticky session, or a
-- client's windows, or windows that reserve usage, are never sent this way.

local function assign_one()
  local cost = ARGV[2]
  local order = ARGV[3]
  local leasing = string.sub(order, -1) == 'l'
  if leasing then
    order = string.sub(order, 1, -2)
  end
  local sticking = string.sub(order, -1) == 's'
  if sticking then
    order = string.sub(order, 1, -2)
  end
  local least_used = string.sub(order, 1, 1) == 'L'
  local usage = string.sub(order, -1) == 'u'
  -- Arguments per window: name, limit, length, and with usage its amount and score.
  local per = usage and 5 or 3
  local route_windows = tonumber(ARGV[5]) or 0
  local client_at = 7 + per * route_windows
  local client_windows = 0
  if string.sub(order, 2, 2) == 'c' then
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

if ARGV[1] ~= '*' then
  return assign_one()
end
local all_keys, all_args = KEYS, ARGV
local out, k, i = {}, 0, 2
while i <= #all_args do
  local nk, na = tonumber(all_args[i]), tonumber(all_args[i + 1])
  local keys, args = {}, {}
  for j = 1, nk do
    keys[j] = all_keys[k + j]
  end
  for j = 1, na do
    args[j] = all_args[i + 1 + j]
  end
  -- One clock for the call, as when its requests' own calls come at the same moment.
  if args[1] == '' and quota_now_text then
    args[1] = quota_now_text
  end
  KEYS, ARGV = keys, args
  out[#out + 1] = assign_one()
  k, i = k + nk, i + 2 + na
end
KEYS, ARGV = all_keys, all_args
return out
