-- relay: the busy ones among many ids of one kind (R34's load,
-- for the load-balance layer). One round trip whose request and reply do
-- not grow with the ids: they travel as one argument, and only the ids
-- with a load come back. (The slot keys are named here from the ids, not
-- passed as KEYS: relay runs on one Redis or a Sentinel group, never a
-- cluster.)
-- KEYS[1] (optional) process registry ZSET relay:processes
-- ARGV[1] slot ttl seconds
-- ARGV[2] the kind's slot key prefix   (concurrency:{kind}:)
-- ARGV[3] the kind's queue key prefix  (wait:account: | concurrency:wait:)
-- ARGV[4] the ids, one per line
-- An id whose slot and queue keys are empty costs two ZCARDs; the others
-- are pruned as load.lua prunes them, then counted.
-- Returns {id1, inUse1, waiting1, id2, ...} of the ids with a load.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local registry = KEYS[1]
local verdict = {}
local out = {}
for id in string.gmatch(ARGV[4], '[^\n]+') do
  local slot = ARGV[2] .. id
  local queue = ARGV[3] .. id
  if redis.call('ZCARD', slot) > 0 or redis.call('ZCARD', queue) > 0 then
    local alive = queue .. ':alive'
    redis.call('ZREMRANGEBYSCORE', slot, '-inf', now - ttl)
    if registry then
      local members = redis.call('ZRANGE', slot, 0, -1)
      for j = 1, #members do
        local p = string.match(members[j], '^(.*)%-[^%-]*$')
        if p then
          if verdict[p] == nil then
            local expiry = redis.call('ZSCORE', registry, p)
            verdict[p] = (expiry and tonumber(expiry) <= now) or false
          end
          if verdict[p] then redis.call('ZREM', slot, members[j]) end
        end
      end
    end
    local dead = redis.call('ZRANGEBYSCORE', alive, '-inf', now)
    for j = 1, #dead do redis.call('ZREM', queue, dead[j]) end
    redis.call('ZREMRANGEBYSCORE', alive, '-inf', now)
    local inUse = redis.call('ZCARD', slot)
    local waiting = redis.call('ZCARD', queue)
    if inUse > 0 or waiting > 0 then
      out[#out + 1] = id
      out[#out + 1] = inUse
      out[#out + 1] = waiting
    end
  end
end
return out
