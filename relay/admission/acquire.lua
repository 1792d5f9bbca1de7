-- relay slot acquire / enqueue / poll (behaviour.md R34, R-B2). One round trip.
-- KEYS[1] slot ZSET   concurrency:{kind}:{id}      member = request id, score = TIME
-- KEYS[2] queue ZSET  wait:account:{id} | concurrency:wait:{id}  member = ticket, score = arrival order
-- KEYS[3] alive ZSET  <queue>:alive                member = ticket, score = heartbeat expiry
-- ARGV[1] limit (<= 0: unlimited)
-- ARGV[2] slot ttl seconds
-- ARGV[3] request id (slot member and ticket)
-- ARGV[4] mode: try | enqueue | poll
-- ARGV[5] max waiting (enqueue)
-- ARGV[6] ticket heartbeat ttl seconds
-- KEYS[4] (optional) process registry ZSET relay:processes
--         member = process prefix, score = liveness expiry (Redis TIME s)
-- Returns {status, now, position, waiting}:
--   status 1 acquired, 0 waiting (or missed a try), -1 queue full.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local rid = ARGV[3]
local mode = ARGV[4]
local aliveTtl = tonumber(ARGV[6])

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #dead > 0 then
  for i = 1, #dead, 1000 do
    redis.call('ZREM', KEYS[2], unpack(dead, i, math.min(i + 999, #dead)))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
end

if redis.call('ZSCORE', KEYS[1], rid) then
  redis.call('ZADD', KEYS[1], now, rid)
  redis.call('PEXPIRE', KEYS[1], math.floor(ttl * 1000))
  redis.call('ZREM', KEYS[2], rid)
  redis.call('ZREM', KEYS[3], rid)
  return {1, tostring(now), 0, redis.call('ZCARD', KEYS[2])}
end

-- FIFO (R-B2): with F free slots, only the first F tickets may take one; a
-- caller without a ticket only when F exceeds the whole queue.
local rank = redis.call('ZRANK', KEYS[2], rid)
local ahead = rank
if ahead == false or ahead == nil then ahead = redis.call('ZCARD', KEYS[2]) end
local free = limit - redis.call('ZCARD', KEYS[1])
-- Crash recovery (R34 "purge slots of dead process prefixes"): only when
-- the key is full for this caller, drop members whose process's liveness
-- entry has expired (killed without releasing). A prefix with no entry is
-- unknown (an older relay, a lost registry) and keeps the slot TTL only.
-- Cost: one ZRANGE of this key plus one ZSCORE per distinct prefix.
if limit > 0 and ahead >= free and KEYS[4] and free < limit then
  local verdict = {}
  local members = redis.call('ZRANGE', KEYS[1], 0, -1)
  for i = 1, #members do
    local p = string.match(members[i], '^(.*)%-[^%-]*$')
    if p then
      if verdict[p] == nil then
        local expiry = redis.call('ZSCORE', KEYS[4], p)
        verdict[p] = (expiry and tonumber(expiry) <= now) or false
      end
      if verdict[p] then
        redis.call('ZREM', KEYS[1], members[i])
        free = free + 1
      end
    end
  end
end
if limit <= 0 or ahead < free then
  redis.call('ZADD', KEYS[1], now, rid)
  redis.call('PEXPIRE', KEYS[1], math.floor(ttl * 1000))
  if rank then
    redis.call('ZREM', KEYS[2], rid)
    redis.call('ZREM', KEYS[3], rid)
  end
  return {1, tostring(now), 0, redis.call('ZCARD', KEYS[2])}
end

if mode == 'try' then
  return {0, tostring(now), 0, redis.call('ZCARD', KEYS[2])}
end

if rank == false or rank == nil then
  local waiting = redis.call('ZCARD', KEYS[2])
  if mode == 'enqueue' and waiting >= tonumber(ARGV[5]) then
    return {-1, tostring(now), 0, waiting}
  end
  -- Arrival order: microseconds, strictly increasing within the queue.
  local score = math.floor(now * 1000000)
  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if last[2] and tonumber(last[2]) >= score then score = tonumber(last[2]) + 1 end
  redis.call('ZADD', KEYS[2], score, rid)
  rank = waiting
end
redis.call('ZADD', KEYS[3], now + aliveTtl, rid)
redis.call('PEXPIRE', KEYS[2], math.floor(aliveTtl * 1000))
redis.call('PEXPIRE', KEYS[3], math.floor(aliveTtl * 1000))
return {0, tostring(now), rank + 1, redis.call('ZCARD', KEYS[2])}
