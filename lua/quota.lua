-- sluice quota library: a sliding-window quota, checked and recorded atomically over every
-- window of one quota key. Drivers (quota_run.lua, and the allocator's fused script) call
-- these functions; Redis runs a driver concatenated after this file, as one script.
--
-- Keys of one quota key:
-- - meta: a hash. Field "seq" numbers admitted requests, so that two requests in the same
--   microsecond never collapse into one log entry; field "s:<window>" is the window's running
--   total of units, so that no call has to sum a log.
-- - one log per window: a sorted set with ONE member per admitted request, whatever its cost,
--   scored by the admission time in microseconds and named "<seq>:<cost>".
--
-- A request admitted at t counts in a window of length L while now < t + L.

-- The time in microseconds: Redis TIME, unless a test passes one.
local function quota_clock(given)
  if given == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return tonumber(given)
end

local function quota_cost_of(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

-- Reads the windows of ARGV from `at` on: name, limit, length (µs), `count` times.
local function quota_windows(at, count)
  local w = { names = {}, limits = {}, lengths = {} }
  for i = 1, count do
    local j = at + 3 * (i - 1)
    w.names[i], w.limits[i], w.lengths[i] = ARGV[j], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  end
  return w
end

-- Expires old entries and decides; records nothing. Returns the state the other functions use.
local function quota_check(meta, logs, cost, now, w)
  local q = {
    meta = meta, logs = logs, cost = cost, now = now, w = w,
    totals = {}, changed = {}, admitted = 1, retry_after = 0,
  }
  for i = 1, #logs do
    local log, name, limit, length = logs[i], w.names[i], w.limits[i], w.lengths[i]
    -- Expire what left the window, keeping the running total in step.
    local total = tonumber(redis.call('HGET', meta, 's:' .. name) or '0')
    local horizon = now - length
    local expired = redis.call('ZRANGEBYSCORE', log, '-inf', horizon)
    if #expired > 0 then
      for _, member in ipairs(expired) do
        total = total - quota_cost_of(member)
      end
      redis.call('ZREMRANGEBYSCORE', log, '-inf', horizon)
      q.changed[i] = true
    end
    -- An empty (or vanished) log holds nothing, whatever a stale total says.
    if total < 0 or (total > 0 and redis.call('EXISTS', log) == 0) then
      total = 0
      q.changed[i] = true
    end
    q.totals[i] = total

    if total + cost > limit then
      q.admitted = 0
      -- The request fits once enough of the oldest entries have left this window.
      local wait
      if cost > limit then
        wait = length
      else
        local need, freed, offset = total + cost - limit, 0, 0
        while not wait do
          local batch = redis.call('ZRANGE', log, offset, offset + 31, 'WITHSCORES')
          if #batch == 0 then
            wait = length
          end
          for j = 1, #batch, 2 do
            freed = freed + quota_cost_of(batch[j])
            if freed >= need then
              wait = tonumber(batch[j + 1]) + length - now
              break
            end
          end
          offset = offset + 32
        end
      end
      if wait > q.retry_after then q.retry_after = wait end
    end
  end
  return q
end

-- Records an admitted request in every window.
local function quota_record(q)
  local member = redis.call('HINCRBY', q.meta, 'seq', 1) .. ':' .. q.cost
  for i = 1, #q.logs do
    redis.call('ZADD', q.logs[i], q.now, member)
    redis.call('PEXPIRE', q.logs[i], math.ceil(q.w.lengths[i] / 1000))
    q.totals[i] = q.totals[i] + q.cost
    q.changed[i] = true
  end
end

-- Writes back the running totals that changed, and keeps the helper hash alive as long as the
-- longest window. Call it whatever the decision.
local function quota_finish(q)
  local wrote, longest = false, 0
  for i = 1, #q.logs do
    if q.w.lengths[i] > longest then longest = q.w.lengths[i] end
    if q.changed[i] then
      redis.call('HSET', q.meta, 's:' .. q.w.names[i], q.totals[i])
      wrote = true
    end
  end
  if wrote then
    redis.call('PEXPIRE', q.meta, math.ceil(longest / 1000))
  end
end

-- Appends {admitted, retry_after_us, remaining_1, reset_us_1, ...} to `out`, where reset_us_i
-- is the time until window i's oldest counted request leaves it.
local function quota_reply(q, admitted, out)
  out[#out + 1] = admitted
  out[#out + 1] = admitted == 1 and 0 or q.retry_after
  for i = 1, #q.logs do
    local remaining = q.w.limits[i] - q.totals[i]
    if remaining < 0 then remaining = 0 end
    local reset = 0
    local oldest = redis.call('ZRANGE', q.logs[i], 0, 0, 'WITHSCORES')
    if #oldest > 0 then
      reset = tonumber(oldest[2]) + q.w.lengths[i] - q.now
    end
    out[#out + 1] = remaining
    out[#out + 1] = reset
  end
  return out
end
