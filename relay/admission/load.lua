-- relay: slot load for many ids (R34), one round trip.
-- KEYS = slot, queue, alive for each id in turn; ARGV[1] slot ttl seconds.
-- Returns {inUse1, waiting1, inUse2, waiting2, ...} after pruning.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS, 3 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - ttl)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[i + 2], '-inf', now)
  for j = 1, #dead do redis.call('ZREM', KEYS[i + 1], dead[j]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[i + 2], '-inf', now)
  out[#out + 1] = redis.call('ZCARD', KEYS[i])
  out[#out + 1] = redis.call('ZCARD', KEYS[i + 1])
end
return out
