-- relay: leave a slot queue and drop a slot that may have been taken by an
-- abandoned attempt (cancel, timeout, error). One round trip.
-- KEYS[1] slot ZSET, KEYS[2] queue ZSET, KEYS[3] alive ZSET
-- ARGV[1] request id / ticket; ARGV[2] '1' to also remove the slot member
if ARGV[2] == '1' then redis.call('ZREM', KEYS[1], ARGV[1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
