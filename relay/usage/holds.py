# -*- test-case-name: tests.test_usage_holds -*-
"""
Budget reservations (behaviour.md R108): two providers of
L{relay.interfaces.IBudgetHolds}, the store where a turn of a key with a
token or money budget holds its estimate from admission to its end.

A turn is admitted while, for each of its key's budgets,
C{limit - spent - outstanding > 0}: C{spent} is the larger of what the
caller knows (the usage ledger's totals) and what turns settled here this
period (kept per key and period, so a turn settled by another process
counts at once, before any usage flush), C{outstanding} the sum of the
key's live holds. The check and the new hold are one atomic step, so N
parallel admissions see each other's holds. A hold is dropped when its
turn settles (its real tokens and cost then count as settled) or is
released (refused, failed before output), and expires after C{ttl}
seconds in any case, so a crashed process's holds do not stay.

Units: tokens (C{t}) and nano-dollars (C{n}), whole numbers.

  - L{MemoryBudgetHolds}: one process (C{state.backend: memory}), on the
    injected clock;
  - L{RedisBudgetHolds}: every process on one Redis. Keys:
    C{<prefix>:h:<key name>} (a hash hold id -> C{"<tokens> <nanos>
    <expiry>"}), C{<prefix>:s:<key name>:<period>} (a hash C{t}, C{n}:
    settled this period, expiring after the period), C{<prefix>:c:<response
    id>} (a chain's last input + output, R108). One C{EVAL} per reserve and
    per settle; expiry is on the Redis server's clock (C{TIME}), as the
    rate windows' (L{relay.tenants.ratelimit}), so processes agree.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from zope.interface import implementer

from relay.interfaces import IBudgetHolds

__all__ = ["CHAIN_CAPACITY", "MemoryBudgetHolds", "RedisBudgetHolds"]

CHAIN_CAPACITY = 10000
"""How many chains' token counts the memory provider keeps (oldest out)."""


def _check(limits, outstanding: dict, settled) -> Any:
    """
    The first of C{limits} with no room left, as C{(name, used)}, or
    L{None}.

    @param limits: C{(name, period, unit, limit, known)} tuples.
    @param outstanding: unit -> the key's live holds.
    @param settled: C{(period, unit)} -> settled amount.
    """
    for name, period, unit, limit, known in limits:
        used = max(int(known), settled(period, unit)) + outstanding.get(unit, 0)
        if limit - used <= 0:
            return (name, used)
    return None


@implementer(IBudgetHolds)
@define(eq=False)
class MemoryBudgetHolds:
    """
    Holds in this process (see L{IBudgetHolds}).

    @ivar clock: the injected L{IReactorTime}.
    """

    clock: Any
    _holds: dict = field(factory=dict)
    _settled: dict = field(factory=dict)
    _chains: OrderedDict = field(factory=OrderedDict)

    def _live(self, key: str) -> dict:
        now = self.clock.seconds()
        holds = self._holds.get(key, {})
        for holdId in [h for h, (_, _, expiry) in holds.items() if expiry <= now]:
            del holds[holdId]
        return holds

    def _settledAmount(self, key: str, period: str, unit: str) -> int:
        entry = self._settled.get((key, period))
        if entry is None or entry[2] <= self.clock.seconds():
            return 0
        return entry[0] if unit == "t" else entry[1]

    def reserve(self, key, holdId, tokens, nanos, limits, ttl) -> Deferred:
        """
        See L{IBudgetHolds.reserve}.
        """
        holds = self._live(key)
        outstanding = {"t": sum(h[0] for h in holds.values()),
                       "n": sum(h[1] for h in holds.values())}
        refused = _check(limits, outstanding,
                         lambda period, unit: self._settledAmount(key, period, unit))
        if refused is None:
            self._holds.setdefault(key, {})[holdId] = (
                int(tokens), int(nanos), self.clock.seconds() + ttl)
        return succeed(refused)

    def settle(self, key, holdId, tokens, nanos, periods) -> Deferred:
        """
        See L{IBudgetHolds.settle}.
        """
        self._holds.get(key, {}).pop(holdId, None)
        now = self.clock.seconds()
        for slot in [s for s, entry in self._settled.items() if s[0] == key and entry[2] <= now]:
            del self._settled[slot]  # past periods
        for period, ttl in periods:
            entry = self._settled.get((key, period))
            if entry is None or entry[2] <= now:
                entry = (0, 0, 0)
            self._settled[(key, period)] = (entry[0] + int(tokens), entry[1] + int(nanos),
                                            now + ttl)
        return succeed(None)

    def release(self, key, holdId) -> Deferred:
        """
        See L{IBudgetHolds.release}.
        """
        self._holds.get(key, {}).pop(holdId, None)
        return succeed(None)

    def outstanding(self, key) -> Deferred:
        """
        See L{IBudgetHolds.outstanding}.
        """
        holds = self._live(key)
        return succeed((sum(h[0] for h in holds.values()), sum(h[1] for h in holds.values())))

    def rememberChain(self, responseId, tokens, ttl) -> Deferred:
        """
        See L{IBudgetHolds.rememberChain}.
        """
        self._chains.pop(responseId, None)
        self._chains[responseId] = (int(tokens), self.clock.seconds() + ttl)
        while len(self._chains) > CHAIN_CAPACITY:
            self._chains.popitem(last=False)
        return succeed(None)

    def chainTokens(self, responseId) -> Deferred:
        """
        See L{IBudgetHolds.chainTokens}.
        """
        entry = self._chains.get(responseId)
        if entry is None or entry[1] <= self.clock.seconds():
            return succeed(0)
        return succeed(entry[0])


# KEYS[1]: the key's holds; KEYS[1 + i]: the settled hash of limit i.
# ARGV: hold id, tokens, nanos, ttl, then per limit: name, unit, limit, known.
# Returns nil when held, else {name, used}.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = redis.call('HGETALL', KEYS[1])
local out = {t = 0, n = 0}
for i = 1, #held, 2 do
  local ht, hn, he = string.match(held[i + 1], '^(%d+) (%d+) ([%d%.]+)$')
  if ht == nil or tonumber(he) <= now then
    redis.call('HDEL', KEYS[1], held[i])
  else
    out.t = out.t + tonumber(ht)
    out.n = out.n + tonumber(hn)
  end
end
local limits = (#ARGV - 4) / 4
for i = 0, limits - 1 do
  local a = 4 + 4 * i
  local unit = ARGV[a + 2]
  local settled = tonumber(redis.call('HGET', KEYS[2 + i], unit) or '0')
  local used = math.max(tonumber(ARGV[a + 4]), settled) + out[unit]
  if tonumber(ARGV[a + 3]) - used <= 0 then
    return {ARGV[a + 1], string.format('%.0f', used)}
  end
end
local ttl = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1],
  ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. string.format('%.3f', now + ttl))
redis.call('EXPIRE', KEYS[1], math.ceil(ttl))
return false
"""

# KEYS[1]: the key's holds; KEYS[1 + i]: a period's settled hash.
# ARGV: hold id, tokens, nanos, then per period its TTL (seconds).
_SETTLE = """
redis.call('HDEL', KEYS[1], ARGV[1])
for i = 2, #KEYS do
  if ARGV[2] ~= '0' then redis.call('HINCRBY', KEYS[i], 't', ARGV[2]) end
  if ARGV[3] ~= '0' then redis.call('HINCRBY', KEYS[i], 'n', ARGV[3]) end
  redis.call('EXPIRE', KEYS[i], ARGV[2 + i])
end
return 1
"""

# KEYS[1]: the key's holds. Returns {tokens, nanos} of the live holds.
_OUTSTANDING = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = redis.call('HGETALL', KEYS[1])
local tokens, nanos = 0, 0
for i = 1, #held, 2 do
  local ht, hn, he = string.match(held[i + 1], '^(%d+) (%d+) ([%d%.]+)$')
  if ht ~= nil and tonumber(he) > now then
    tokens = tokens + tonumber(ht)
    nanos = nanos + tonumber(hn)
  end
end
return {string.format('%.0f', tokens), string.format('%.0f', nanos)}
"""


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _clean(text: str) -> str:
    return str(text).replace("\n", " ")


@implementer(IBudgetHolds)
@define(eq=False)
class RedisBudgetHolds:
    """
    Holds in Redis, shared by every relay process (see the module
    docstring). Each call is one C{EVAL} (or C{GET}/C{SET}) bounded by
    C{timeout}; errors reach the caller (the ledger decides, R35).

    @ivar redis: a L{relay.wire.redisclient.RedisService}.
    @ivar prefix: the key prefix.
    @ivar timeout: seconds per call.
    """

    redis: Any
    prefix: str = "relay:budget"
    timeout: float = 5.0

    def _holdsKey(self, key: str) -> str:
        return f"{self.prefix}:h:{_clean(key)}"

    def _settledKey(self, key: str, period: str) -> str:
        return f"{self.prefix}:s:{_clean(key)}:{period}"

    def reserve(self, key, holdId, tokens, nanos, limits, ttl) -> Deferred:
        """
        See L{IBudgetHolds.reserve}: one C{EVAL}.
        """
        keys = [self._holdsKey(key)]
        args = [str(holdId), str(int(tokens)), str(int(nanos)), repr(float(ttl))]
        for name, period, unit, limit, known in limits:
            keys.append(self._settledKey(key, period))
            args += [name, unit, str(int(limit)), str(int(known))]
        d = self.redis.execute(self.timeout, "eval", _RESERVE, keys, args)

        def _cbReply(reply):
            if not reply:
                return None
            name, used = reply[0], reply[1]
            return (_text(name), int(_text(used)))

        return d.addCallback(_cbReply)

    def settle(self, key, holdId, tokens, nanos, periods) -> Deferred:
        """
        See L{IBudgetHolds.settle}: one C{EVAL}.
        """
        keys = [self._holdsKey(key)] + [self._settledKey(key, p) for p, _ in periods]
        args = [str(holdId), str(int(tokens)), str(int(nanos))] + [
            str(int(ttl)) for _, ttl in periods]
        return self.redis.execute(self.timeout, "eval", _SETTLE, keys, args).addCallback(
            lambda _: None)

    def release(self, key, holdId) -> Deferred:
        """
        See L{IBudgetHolds.release}.
        """
        return self.redis.execute(
            self.timeout, "execute_command", "HDEL", self._holdsKey(key), str(holdId)
        ).addCallback(lambda _: None)

    def outstanding(self, key) -> Deferred:
        """
        See L{IBudgetHolds.outstanding}.
        """
        d = self.redis.execute(self.timeout, "eval", _OUTSTANDING, [self._holdsKey(key)], [])
        return d.addCallback(lambda reply: (int(_text(reply[0])), int(_text(reply[1]))))

    def rememberChain(self, responseId, tokens, ttl) -> Deferred:
        """
        See L{IBudgetHolds.rememberChain}.
        """
        return self.redis.execute(
            self.timeout, "execute_command", "SET", f"{self.prefix}:c:{_clean(responseId)}",
            str(int(tokens)), "EX", str(max(1, int(ttl))),
        ).addCallback(lambda _: None)

    def chainTokens(self, responseId) -> Deferred:
        """
        See L{IBudgetHolds.chainTokens}.
        """
        d = self.redis.execute(self.timeout, "execute_command", "GET",
                               f"{self.prefix}:c:{_clean(responseId)}")

        def _cbTokens(value):
            try:
                return int(_text(value)) if value is not None else 0
            except ValueError:
                return 0

        return d.addCallback(_cbTokens)
