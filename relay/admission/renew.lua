-- relay: renew a held slot lease (R34). KEYS[1] slot ZSET; ARGV[1] request id,
-- ARGV[2] slot ttl seconds. Returns 1 when renewed, 0 when the lease was lost.
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.floor(tonumber(ARGV[2]) * 1000))
return 1
