# -*- test-case-name: tests.test_tenants_policy -*-
"""
Per-key request and token rates (C{keys[].rpm}, C{keys[].tpm},
behaviour.md R102): two providers of L{relay.interfaces.IRateLimiter}.

The windows are B{sliding}: a key may start a turn while fewer than C{rpm}
turns started in the last 60 seconds and fewer than C{tpm} tokens (input +
output) were counted for turns that finished in the last 60 seconds. A
refused turn counts nothing. Tokens are known only once a turn ends, so at
most the turns already running when the window fills overshoot C{tpm}
(like the token budgets, R102); requests are counted atomically at
admission, so C{rpm} is never exceeded, across processes too.

  - L{MemoryRateLimiter}: one process (C{state.backend: memory}), on the
    injected clock;
  - L{RedisRateLimiter}: every relay process on one Redis shares the
    windows. One C{EVAL} per admission checks and counts atomically, on the
    Redis server's clock (C{TIME}), so processes on hosts whose clocks
    differ still agree. Keys: C{<prefix>:<key name>:r} (a sorted set of
    admitted turns, scored by milliseconds) and C{<prefix>:<key name>:t}
    (token entries C{"<tokens>:<id>"}), each expiring one window after
    its last write.

A Redis error follows C{state.on_redis_error} (R35): C{fail_open} admits
the turn (logged), C{fail_closed} raises L{RateLimitUnavailable} (relay
answers 503, R101).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Optional

from attrs import define, field, frozen
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IRateLimiter
from relay.base.records import RelayError

__all__ = [
    "WINDOW",
    "MemoryRateLimiter",
    "RateDecision",
    "RateLimitUnavailable",
    "RedisRateLimiter",
]

WINDOW = 60.0
"""The sliding window, seconds (requests and tokens per minute)."""


class RateLimitUnavailable(RelayError):
    """
    The shared rate windows could not be read (Redis down) and
    C{on_redis_error} is C{fail_closed}.
    """


@frozen
class RateDecision:
    """
    What the windows say about one key now.

    @ivar allowed: the turn may start (and, from L{IRateLimiter.admit},
        was counted).
    @ivar refusedBy: C{rpm} or C{tpm} when refused, else L{None}.
    @ivar requests: turns counted in the window (with this one when admitted).
    @ivar tokens: tokens counted in the window.
    @ivar rpm: the key's request limit, or L{None}.
    @ivar tpm: the key's token limit, or L{None}.
    @ivar retryAfter: when refused, seconds until the window lets a turn
        start again; else 0.
    @ivar resetRequests: seconds until the request window is empty.
    @ivar resetTokens: seconds until the token window is empty.
    @ivar degraded: the shared windows could not be read; the turn was let
        through (C{fail_open}).
    """

    allowed: bool
    refusedBy: Optional[str] = None
    requests: int = 0
    tokens: int = 0
    rpm: Optional[int] = None
    tpm: Optional[int] = None
    retryAfter: float = 0.0
    resetRequests: float = 0.0
    resetTokens: float = 0.0
    degraded: bool = False

    def asDict(self) -> dict:
        """
        @return: the decision for C{/admin/explain} (seconds, counts).
        """
        return {
            "allowed": self.allowed, "refused_by": self.refusedBy,
            "requests": self.requests, "rpm": self.rpm,
            "tokens": self.tokens, "tpm": self.tpm,
            "retry_after_seconds": round(self.retryAfter, 3),
            "reset_requests_seconds": round(self.resetRequests, 3),
            "reset_tokens_seconds": round(self.resetTokens, 3),
        }


def _retryForTokens(entries, total: int, tpm: int, now: float, window: float) -> float:
    """
    Seconds until the tokens of C{entries} (C{(time, tokens)}, oldest
    first) still in the window drop below C{tpm}.
    """
    for at, tokens in entries:
        total -= tokens
        if total < tpm:
            return max(0.0, at + window - now)
    return window


@implementer(IRateLimiter)
@define(eq=False)
class MemoryRateLimiter:
    """
    Sliding windows in this process's memory (see L{IRateLimiter}).

    @ivar clock: the injected L{IReactorTime}.
    @ivar window: seconds.
    """

    clock: Any
    window: float = WINDOW
    _requests: dict = field(factory=dict)
    _tokens: dict = field(factory=dict)
    _sums: dict = field(factory=dict)

    def _prune(self, name: str, now: float):
        edge = now - self.window
        requests = self._requests.get(name)
        if requests is not None:
            while requests and requests[0] <= edge:
                requests.popleft()
        tokens = self._tokens.get(name)
        if tokens is not None:
            while tokens and tokens[0][0] <= edge:
                self._sums[name] -= tokens.popleft()[1]
        return requests or (), tokens or ()

    def _decide(self, name: str, rpm, tpm, count: bool) -> RateDecision:
        now = self.clock.seconds()
        requests, tokens = self._prune(name, now)
        used, spent = len(requests), self._sums.get(name, 0)
        refused, retry = None, 0.0
        if rpm and used >= rpm:
            refused = "rpm"
            retry = max(0.0, requests[used - rpm] + self.window - now)
        elif tpm and spent >= tpm:
            refused = "tpm"
            retry = _retryForTokens(tokens, spent, tpm, now, self.window)
        elif count and rpm:
            self._requests.setdefault(name, deque()).append(now)
            requests = self._requests[name]
            used += 1
        return RateDecision(
            allowed=refused is None, refusedBy=refused, requests=used, tokens=spent,
            rpm=rpm, tpm=tpm, retryAfter=retry,
            resetRequests=max(0.0, requests[-1] + self.window - now) if requests else 0.0,
            resetTokens=max(0.0, tokens[-1][0] + self.window - now) if tokens else 0.0,
        )

    def admit(self, name, rpm, tpm) -> Deferred:
        """
        See L{IRateLimiter.admit}.
        """
        return succeed(self._decide(name, rpm, tpm, count=True))

    def peek(self, name, rpm, tpm) -> Deferred:
        """
        See L{IRateLimiter.peek}.
        """
        return succeed(self._decide(name, rpm, tpm, count=False))

    def addTokens(self, name, tokens) -> Deferred:
        """
        See L{IRateLimiter.addTokens}.
        """
        if tokens > 0:
            now = self.clock.seconds()
            self._prune(name, now)
            self._tokens.setdefault(name, deque()).append((now, int(tokens)))
            self._sums[name] = self._sums.get(name, 0) + int(tokens)
        return succeed(None)


# KEYS[1] the request set, KEYS[2] the token set. ARGV: rpm (0: none), tpm
# (0: none), window ms, a unique member, "1" to count an admitted turn.
# Returns {refused ('' | 'rpm' | 'tpm'), requests, tokens, retry ms,
# reset-requests ms, reset-tokens ms}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
local used = redis.call('ZCARD', KEYS[1])
local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
local spent = 0
for i = 1, #entries, 2 do
  spent = spent + tonumber(string.match(entries[i], '^(%d+)'))
end
local refused, retry = '', 0
if rpm > 0 and used >= rpm then
  refused = 'rpm'
  local at = redis.call('ZRANGE', KEYS[1], used - rpm, used - rpm, 'WITHSCORES')
  retry = tonumber(at[2]) + window - now
elseif tpm > 0 and spent >= tpm then
  refused = 'tpm'
  local left = spent
  retry = window
  for i = 1, #entries, 2 do
    left = left - tonumber(string.match(entries[i], '^(%d+)'))
    if left < tpm then
      retry = tonumber(entries[i + 1]) + window - now
      break
    end
  end
elseif ARGV[5] == '1' and rpm > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], window)
  used = used + 1
end
local resetR, resetT = 0, 0
local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if #newest > 0 then resetR = tonumber(newest[2]) + window - now end
if #entries > 0 then resetT = tonumber(entries[#entries]) + window - now end
return {refused, used, spent, retry, resetR, resetT}
"""

# KEYS[1] the token set. ARGV: "<tokens>:<unique id>", window ms.
_TOKENS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


def _int(value) -> int:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


@implementer(IRateLimiter)
@define(eq=False)
class RedisRateLimiter:
    """
    Sliding windows shared through Redis (see the module docstring).

    @ivar redis: a L{relay.wire.redisclient.RedisService} (anything with its
        C{execute(timeout, method, *args)}).
    @ivar onRedisError: C{fail_open} or C{fail_closed} (R35).
    @ivar prefix: the key prefix.
    @ivar window: seconds.
    @ivar timeout: seconds per Redis call.
    """

    redis: Any
    onRedisError: str = "fail_open"
    prefix: str = "relay:rl"
    window: float = WINDOW
    timeout: float = 5.0
    _log = Logger()

    def _keys(self, name: str) -> list:
        return [f"{self.prefix}:{name}:r", f"{self.prefix}:{name}:t"]

    def _call(self, name, rpm, tpm, count: bool) -> Deferred:
        args = [str(rpm or 0), str(tpm or 0), str(int(self.window * 1000)),
                os.urandom(8).hex(), "1" if count else "0"]
        d = self.redis.execute(self.timeout, "eval", _ADMIT, self._keys(name), args)

        def _cbDecision(reply):
            reply = list(reply or [])
            refused = reply[0].decode() if isinstance(reply[0], bytes) else (reply[0] or "")
            return RateDecision(
                allowed=not refused, refusedBy=refused or None,
                requests=_int(reply[1]), tokens=_int(reply[2]), rpm=rpm, tpm=tpm,
                retryAfter=max(0, _int(reply[3])) / 1000.0,
                resetRequests=max(0, _int(reply[4])) / 1000.0,
                resetTokens=max(0, _int(reply[5])) / 1000.0,
            )

        def _ebRedis(f):
            self._log.error(
                "rate window of key {key_name} unreadable ({error}); {action}",
                event="relay.rate_limit_unavailable", key_name=name,
                error=f.getErrorMessage(),
                action="refusing" if self.onRedisError == "fail_closed" else "letting it through",
            )
            if self.onRedisError == "fail_closed":
                raise RateLimitUnavailable(f.getErrorMessage())
            return RateDecision(allowed=True, rpm=rpm, tpm=tpm, degraded=True)

        return d.addCallbacks(_cbDecision, _ebRedis)

    def admit(self, name, rpm, tpm) -> Deferred:
        """
        See L{IRateLimiter.admit}: one C{EVAL}.
        """
        return self._call(name, rpm, tpm, count=True)

    def peek(self, name, rpm, tpm) -> Deferred:
        """
        See L{IRateLimiter.peek}.
        """
        return self._call(name, rpm, tpm, count=False)

    def addTokens(self, name, tokens) -> Deferred:
        """
        See L{IRateLimiter.addTokens}: one C{EVAL}; an error is logged
        (the window then misses these tokens).
        """
        if tokens <= 0:
            return succeed(None)
        member = f"{int(tokens)}:{os.urandom(8).hex()}"
        d = self.redis.execute(self.timeout, "eval", _TOKENS, self._keys(name)[1:],
                               [member, str(int(self.window * 1000))])
        d.addCallback(lambda _: None)
        d.addErrback(lambda f: self._log.error(
            "counting tokens for key {key_name} failed ({error})",
            event="relay.rate_limit_unavailable", key_name=name, error=f.getErrorMessage(),
        ))
        return d
