# -*- test-case-name: tests.integration.test_redis_state,tests.test_redisbatch -*-
"""
L{RedisBatch}: the Redis state store's commands of one reactor turn sent as
one round trip.

A relayed turn used to send its state commands one by one: the account
states and the sticky-session read before the dial, the binding write, and
at the end the two response-owner writes and the streak reset, each paying
a txredisapi command, a timeout, a send and a reply. Most of them are
issued in the same reactor turn (the owner writes and the streak reset; the
states and binding reads; the binding touch and write), and at load many
relayed turns finish in the same reactor turn. L{RedisBatch} queues every
operation issued during one reactor turn and sends them, in issue order, at
its end (C{callLater(0)}: after the I/O events of that turn are handled) as
one C{EVALSHA} of L{BATCH_LUA}, which runs each operation and returns one
reply per operation. A batch of one operation is sent as the plain command
(or script) the store used before, so one-off calls look as they did.

Semantics kept: each operation's L{Deferred} fires once its command has run
in Redis, with the reply the plain command gives, or fails with
L{relay.wire.redisclient.RedisUnavailable} (a Redis error of that operation
alone -- the others of the batch still run, C{redis.pcall} -- or the
failure of the whole call: timeout, lost connection); the store applies
C{on_redis_error} to it as before. Operations run in issue order, so a read
issued after a write in the same batch sees it.

One fold: a C{PEXPIRE} of a key followed in the same batch by a C{SET ...
PX} of the same key, with nothing else on that key in between, is not sent:
the C{SET} gives the key its value and TTL anyway (the sticky binding's
touch after admission followed by its write, R38), and the C{PEXPIRE}'s
Deferred fires with the C{SET}'s outcome.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from relay.wire.redisclient import RedisService, RedisUnavailable

#: relay's own state operations, as standalone scripts (KEYS / ARGV), run
#: alone for a batch of one and wrapped as functions in the batch script:
#:   MHGETALL      HGETALL of each of its keys: a list of flat lists;
#:   RELAY_INCR    KEYS counter; ARGV ttl ms, refresh flag: INCR, and
#:                 PEXPIRE when new or refreshed; the new value;
#:   RELAY_STREAK  KEYS account hash (and optionally the change sequence
#:                 and change ZSET); ARGV streak field, now, ttl seconds (and
#:                 the account id): the R11 streak bump ("count:last
#:                 failure"), noted as a change when the keys are given; the
#:                 account's other streaks past the TTL are deleted; the
#:                 count;
#:   RELAY_MSET    KEYS values; ARGV a TTL ms and a value per key: SET ...
#:                 PX of each, together (a response's routing
#:                 binding and owner record, R39/R40/R104);
#:   RELAY_MARK    KEYS account hash, change sequence, change ZSET; ARGV
#:                 account id, then the hash's field/value pairs: HSET, and
#:                 the account noted as changed;
#:   RELAY_CLEAR   KEYS account hash, its 403 counter, change sequence,
#:                 change ZSET; ARGV account id: DEL both, noted as changed;
#:   RELAY_SYNC    KEYS change sequence, change ZSET, epoch; ARGV the
#:                 sequence and epoch the caller knows: {epoch, sequence,
#:                 ids of the accounts changed since} (no ids when the epoch
#:                 differs: the caller reads everything again).
SOLO = {
    "MHGETALL": """
local out = {}
for i, k in ipairs(KEYS) do out[i] = redis.call('HGETALL', k) end
return out
""",
    "RELAY_INCR": """
local v = redis.call('INCR', KEYS[1])
if v == 1 or ARGV[2] == '1' then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return v
""",
    "RELAY_MARK": """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[2]), ARGV[1])
return 1
""",
    "RELAY_CLEAR": """
local n = redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZADD', KEYS[4], redis.call('INCR', KEYS[3]), ARGV[1])
return n
""",
    "RELAY_MSET": """
for i, k in ipairs(KEYS) do redis.call('SET', k, ARGV[2 * i], 'PX', ARGV[2 * i - 1]) end
return #KEYS
""",
    "RELAY_SYNC": """
local epoch = redis.call('GET', KEYS[3])
if not epoch then
  local t = redis.call('TIME')
  epoch = t[1] .. '.' .. t[2]
  redis.call('SET', KEYS[3], epoch)
end
local seq = tonumber(redis.call('GET', KEYS[1]) or '0')
local out = {epoch, tostring(seq)}
if epoch == ARGV[2] and seq > tonumber(ARGV[1]) then
  local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf')
  for i = 1, #ids do out[#out + 1] = ids[i] end
end
return out
""",
    "RELAY_STREAK": """
if KEYS[3] then redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[2]), ARGV[4]) end
local v = redis.call('HGET', KEYS[1], ARGV[1])
local n = 0
if v then
  local c, t = string.match(v, '^(%d+):(.+)$')
  if c and (tonumber(ARGV[2]) - tonumber(t)) <= tonumber(ARGV[3]) then n = tonumber(c) end
end
n = n + 1
redis.call('HSET', KEYS[1], ARGV[1], n .. ':' .. ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] and string.sub(all[i], 1, 7) == 'streak:' then
    local t = tonumber(string.match(all[i + 1], '^%d+:(.+)$') or '')
    if t and (tonumber(ARGV[2]) - t) > tonumber(ARGV[3]) then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end
return n
""",
}

_DISPATCH = """
local ops = cjson.decode(ARGV[1])
local out = {}
local k = 1
for i = 1, #ops do
  local name, nk, args = ops[i][1], ops[i][2], ops[i][3]
  local keys = {}
  for j = 1, nk do keys[j] = KEYS[k + j - 1] end
  k = k + nk
  local f = own[name]
  if f then
    local ok, r = pcall(f, keys, args)
    if ok then
      out[i] = r
    elseif type(r) == 'table' and r.err then
      out[i] = r
    else
      out[i] = redis.error_reply(tostring(r))
    end
  else
    for j = 1, #args do keys[nk + j] = args[j] end
    out[i] = redis.pcall(name, unpack(keys))
  end
end
return out
"""


def batchScript(solo: dict) -> str:
    """
    The batch script for a set of own operations.

    ARGV[1] is the batch as one JSON array (one argument, so the client
    encodes one string however many operations there are): per operation
    C{[name, how many of KEYS it takes (in order), [its other arguments as
    strings]]}; KEYS are every operation's keys, in order (a script names
    every key it touches). Each operation runs protected: one that fails
    gives an error element and the rest still run. A name of C{solo} runs
    that standalone script as a function of its keys and arguments; any
    other name is a plain command.

    @param solo: operation name -> standalone Lua script (KEYS / ARGV).
    @return: the Lua text; its reply is one element per operation.
    """
    parts = ["local own = {}"]
    for name, script in sorted(solo.items()):
        parts.append(f"own[{name!r}] = function(KEYS, ARGV)\n{script.strip()}\nend")
    return "\n".join(parts) + "\n" + _DISPATCH


#: the state store's batch script
BATCH_LUA = batchScript(SOLO)


class _Op:
    """
    One queued operation (a plain class with slots: one is made per
    operation).

    @ivar name: the Redis command (or C{MHGETALL}).
    @ivar keys: the keys it touches.
    @ivar args: the other arguments, as text.
    @ivar timeout: its timeout, seconds.
    @ivar deferred: fired with its reply.
    @ivar folded: the later operation whose outcome this one takes, when
        it is not sent itself.
    """

    __slots__ = ("args", "deferred", "folded", "keys", "name", "timeout")

    def __init__(self, name: str, keys: list, args: list, timeout: float):
        self.name = name
        self.keys = keys
        self.args = args
        self.timeout = timeout
        self.deferred = Deferred()
        self.folded: Optional[_Op] = None


@define(eq=False)
class RedisBatch:
    """
    Coalesces the commands of one reactor turn into one round trip.

    @ivar _redis: the running L{RedisService}.
    @ivar _clock: schedules the end-of-turn send.
    @ivar solo: relay's own operations: name -> standalone script.
    @ivar script: the batch script (L{batchScript} of C{solo}).
    @ivar leading: send an operation at once, alone, when nothing of this
        batcher is queued or waiting for its reply (so a lone caller sees
        its command leave synchronously, as without batching); only the
        operations that come while one is in flight are batched.
    @ivar batches: round trips sent so far (for tests and benchmarks).
    @ivar operations: operations sent so far, folded ones included.
    """

    _redis: RedisService
    _clock: IReactorTime
    solo: dict = field(factory=lambda: dict(SOLO))
    script: str = BATCH_LUA
    leading: bool = False
    batches: int = 0
    operations: int = 0
    _ops: list = field(factory=list, init=False)
    _call: Optional[IDelayedCall] = field(default=None, init=False)
    _inflight: int = field(default=0, init=False)

    def call(self, timeout: float, name: str, keys: list, args: list,
             lead: Optional[bool] = None) -> Deferred:
        """
        Queue one operation for the end of this reactor turn.

        @param timeout: seconds (the batch takes the smallest of its
            operations').
        @param name: a Redis command (C{GET}, C{SET}, C{PEXPIRE}, C{DEL},
            C{HSET}, C{HDEL}, ...) or one of relay's own operations
            (L{SOLO}: C{MHGETALL}, C{RELAY_INCR}, C{RELAY_STREAK}).
        @param keys: the keys the operation touches (Redis scripts must
            name every key they touch).
        @param args: the remaining arguments.
        @param lead: this operation's L{leading} (a batcher shared by the
            state store, which never leads, and the admission, which does);
            L{None} for the batcher's own.
        @return: a L{Deferred} firing with the reply, or failing with
            L{RedisUnavailable}.
        """
        op = _Op(name, list(keys), [
            a if a.__class__ is str else str(a) if a.__class__ is int else _text(a)
            for a in args] if args else [], timeout)
        if (self.leading if lead is None else lead) and not self._ops and not self._inflight:
            self.operations += 1
            self._send([op], [op])
            return op.deferred
        self._ops.append(op)
        if self._call is None:
            self._call = self._clock.callLater(0, self.flush)
        return op.deferred

    def flush(self) -> None:
        """
        Send what is queued now (normally called at the end of the reactor
        turn).
        """
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        ops, self._ops = self._ops, []
        if not ops:
            return
        self.operations += len(ops)
        self._send(_fold(ops), ops)

    def _send(self, sent: list, ops: list) -> None:
        """
        One round trip for C{sent} (the operations of C{ops} not folded);
        deliver every operation's outcome when it ends.
        """
        self.batches += 1
        self._inflight += 1
        if len(sent) == 1:
            op = sent[0]
            script = self.solo.get(op.name)
            if script is not None:
                d = self._redis.execute(op.timeout, "eval", script, op.keys, op.args)
            else:
                d = self._redis.execute(op.timeout, "execute_command", op.name, *op.keys,
                                        *op.args)
            d.addCallbacks(self._deliverOne, self._fail, callbackArgs=(op, ops),
                           errbackArgs=(ops,))
            return
        keys: list = []
        spec = []
        timeout = sent[0].timeout
        for op in sent:
            keys.extend(op.keys)
            spec.append((op.name, len(op.keys), op.args))
            timeout = min(timeout, op.timeout)
        d = self._redis.execute(timeout, "eval", self.script, keys,
                                [json.dumps(spec, separators=(",", ":"))])
        d.addCallbacks(self._deliver, self._fail, callbackArgs=(sent, ops), errbackArgs=(ops,))

    def _deliverOne(self, reply: Any, sent: _Op, ops: list) -> None:
        """
        The reply of an operation sent alone (its plain command).
        """
        self._deliver([reply], [sent], ops)

    def _deliver(self, replies: Any, sent: list, ops: list) -> None:
        """
        A round trip ended: fire each operation's Deferred with its reply
        (a folded one with the outcome of the operation that replaced it).
        """
        self._inflight -= 1
        replies = replies or ()
        if len(sent) == len(ops) and len(replies) == len(sent):
            # Nothing folded, a reply for each.
            for op, reply in zip(ops, replies):
                _settle(op, op, reply)
            return
        outcome = {}
        for op, reply in zip(sent, replies):
            outcome[id(op)] = reply
        for op in ops:
            target = op
            while target.folded is not None:
                target = target.folded
            _settle(op, target, outcome.get(id(target), _MISSING))

    def _fail(self, failure: Failure, ops: list) -> None:
        """
        The whole round trip failed: every operation fails with it.
        """
        self._inflight -= 1
        for op in ops:
            if not op.deferred.called:
                op.deferred.errback(failure)


def _settle(op: _Op, target: _Op, reply) -> None:
    """
    Fire C{op}'s Deferred with C{reply}, the reply of C{target} (C{op}
    itself, or the operation it was folded into).
    """
    if op.deferred.called:
        # Cancelled by its caller meanwhile (a turn that left while its
        # slot acquire was in flight): the reply is not wanted.
        return
    if reply is _MISSING:
        op.deferred.errback(RedisUnavailable(op.name.lower(), "no reply in the batch"))
    elif isinstance(reply, Exception):
        op.deferred.errback(RedisUnavailable(op.name.lower(), f"{type(reply).__name__}: "
                                                              f"{reply}"))
    elif target is not op and op.name == "PEXPIRE":
        op.deferred.callback(1)
    else:
        op.deferred.callback(reply)


_MISSING = object()


def _text(value) -> str:
    """
    An argument as text (the batch carries its arguments as JSON strings).
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def _fold(ops: list) -> list:
    """
    The operations to send: a C{PEXPIRE} followed (nothing else on its key
    in between) by a C{SET ... PX} of the same key is folded into it.
    """
    last = {}
    for op in ops:
        if len(op.keys) == 1:
            key = op.keys[0]
            before = last.get(key)
            if (op.name == "SET" and before is not None and before.name == "PEXPIRE"
                    and "PX" in op.args):
                before.folded = op
            last[key] = op
        else:
            for key in op.keys:
                last[key] = op
    return [op for op in ops if op.folded is None]


__all__ = ["BATCH_LUA", "SOLO", "RedisBatch", "batchScript"]
