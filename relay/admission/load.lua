-- relay: slot load for many ids (R34), one round trip.
-- KEYS = slot, queue, alive for each id in turn, then (optional) the process
-- registry ZSET relay:processes; ARGV[1] slot ttl seconds.
-- Returns {inUse1, waiting1, inUse2, waiting2, ...} after pruning: members
-- older than the slot TTL, and members of processes whose liveness entry
-- has expired (crashed; see acquire.lua).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local n = #KEYS
local registry = nil
if n % 3 == 1 then
  registry = KEYS[n]
  n = n - 1
end
local verdict = {}
local out = {}
for i = 1, n, 3 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - ttl)
  if registry then
    local members = redis.call('ZRANGE', KEYS[i], 0, -1)
    for j = 1, #members do
      local p = string.match(members[j], '^(.*)%-[^%-]*$')
      if p then
        if verdict[p] == nil then
          local expiry = redis.call('ZSCORE', registry, p)
          verdict[p] = (expiry and tonumber(expiry) <= now) or false
        end
        if verdict[p] then redis.call('ZREM', KEYS[i], members[j]) end
      end
    end
  end
  local dead = redis.call('ZRANGEBYSCORE', KEYS[i + 2], '-inf', now)
  for j = 1, #dead do redis.call('ZREM', KEYS[i + 1], dead[j]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[i + 2], '-inf', now)
  out[#out + 1] = redis.call('ZCARD', KEYS[i])
  out[#out + 1] = redis.call('ZCARD', KEYS[i + 1])
end
return out
