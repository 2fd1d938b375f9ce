-- sluice: sliding-window quota, checked and recorded atomically over every window of one
-- quota key.
--
-- KEYS[1]       the quota key's helper hash. Field "seq" numbers admitted requests, so that
--               two requests in the same microsecond never collapse into one log entry; field
--               "s:<window>" is the window's running total of units, so that no call has to sum
--               a log.
-- KEYS[1 + i]   window i's log: a sorted set with ONE member per admitted request, whatever its
--               cost, scored by the admission time in microseconds and named "<seq>:<cost>".
-- ARGV[1]       the cost of this request, in units.
-- ARGV[2]       "" to read the clock with Redis TIME (always, in the gateway). Tests pass a time
--               in microseconds here to replay a trace exactly.
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2]
--               window i's name, limit (units) and length (microseconds).
--
-- A request admitted at t counts in a window of length L while now < t + L.
-- Returns {admitted (1|0), retry_after_us, remaining_1, reset_us_1, remaining_2, reset_us_2, ...}
-- where reset_us_i is the time until window i's oldest counted request leaves it.
-- A refused request records nothing; only the expiry of old entries is written back.

local meta = KEYS[1]
local cost = tonumber(ARGV[1])
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[2])
end

local function cost_of(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

local windows = #KEYS - 1
local names, limits, lengths, totals, changed = {}, {}, {}, {}, {}
local admitted = 1
local retry_after = 0
local longest = 0

for i = 1, windows do
  local log = KEYS[1 + i]
  local name, limit, length = ARGV[3 * i], tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  names[i], limits[i], lengths[i] = name, limit, length
  if length > longest then longest = length end

  -- Expire what left the window, keeping the running total in step.
  local total = tonumber(redis.call('HGET', meta, 's:' .. name) or '0')
  local horizon = now - length
  local expired = redis.call('ZRANGEBYSCORE', log, '-inf', horizon)
  if #expired > 0 then
    for _, member in ipairs(expired) do
      total = total - cost_of(member)
    end
    redis.call('ZREMRANGEBYSCORE', log, '-inf', horizon)
    changed[i] = true
  end
  -- An empty (or vanished) log holds nothing, whatever a stale total says.
  if total < 0 or (total > 0 and redis.call('EXISTS', log) == 0) then
    total = 0
    changed[i] = true
  end
  totals[i] = total

  if total + cost > limit then
    admitted = 0
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
          freed = freed + cost_of(batch[j])
          if freed >= need then
            wait = tonumber(batch[j + 1]) + length - now
            break
          end
        end
        offset = offset + 32
      end
    end
    if wait > retry_after then retry_after = wait end
  end
end

if admitted == 1 then
  local member = redis.call('HINCRBY', meta, 'seq', 1) .. ':' .. cost
  for i = 1, windows do
    redis.call('ZADD', KEYS[1 + i], now, member)
    redis.call('PEXPIRE', KEYS[1 + i], math.ceil(lengths[i] / 1000))
    totals[i] = totals[i] + cost
    changed[i] = true
  end
end

local wrote = false
for i = 1, windows do
  if changed[i] then
    redis.call('HSET', meta, 's:' .. names[i], totals[i])
    wrote = true
  end
end
if wrote then
  redis.call('PEXPIRE', meta, math.ceil(longest / 1000))
end

local result = {admitted, retry_after}
for i = 1, windows do
  local remaining = limits[i] - totals[i]
  if remaining < 0 then remaining = 0 end
  local reset = 0
  local oldest = redis.call('ZRANGE', KEYS[1 + i], 0, 0, 'WITHSCORES')
  if #oldest > 0 then
    reset = tonumber(oldest[2]) + lengths[i] - now
  end
  result[#result + 1] = remaining
  result[#result + 1] = reset
end
return result
