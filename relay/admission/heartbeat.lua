-- relay: a process's liveness heartbeat (behaviour.md R34 crash recovery).
-- KEYS[1] process registry ZSET relay:processes
--         member = process prefix, score = liveness expiry (Redis TIME s)
-- ARGV[1] process prefix
-- ARGV[2] liveness ttl seconds (0 retires the process: expired at once)
-- ARGV[3] slot ttl seconds: an entry expired longer ago than this is
--         dropped, since every slot member of that process has outlived
--         the slot TTL by then (acquire.lua and load.lua prune those).
-- Returns the new expiry (a string).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local live = tonumber(ARGV[2])
local slotTtl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - slotTtl)
redis.call('ZADD', KEYS[1], now + live, ARGV[1])
local keep = math.floor((live + slotTtl) * 1000)
if redis.call('PTTL', KEYS[1]) < keep then redis.call('PEXPIRE', KEYS[1], keep) end
return tostring(now + live)
