# -*- test-case-name: tests.integration.test_redis_state -*-
"""
The one place relay talks to txredisapi (style.md pattern d).

L{RedisService} owns a txredisapi C{lazyConnectionPool} built from
C{state.redis_url} and runs every command through L{RedisService.execute},
which puts a timeout on the injected clock on each call (trap T16) and
counts commands (for the benchmark and tests).

txredisapi imports the global reactor at import time (trap T5), so it is
imported lazily in L{RedisService.startService}; this module is safe to
import anywhere.
"""

from __future__ import annotations

from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from attrs import define, field
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from relay.model import RelayError


class RedisUnavailable(RelayError):
    """
    A Redis command failed: connection error, timeout, refused connection
    or a server error reply. Carries the operation name.

    @ivar operation: what relay was doing, e.g. C{slot_acquire}.
    """

    def __init__(self, operation: str, detail: str = ""):
        super().__init__(f"{operation}: {detail}" if detail else operation)
        self.operation = operation


def parseRedisUrl(url: str) -> dict:
    """
    Parse C{redis://[user:password@]host:port/db}.

    @param url: the C{state.redis_url} value.
    @return: keyword arguments for C{txredisapi.lazyConnectionPool}:
        C{host}, C{port}, C{dbid}, C{password}, C{username}.
    @raise ValueError: for another scheme.
    """
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"state.redis_url: unsupported scheme {parts.scheme!r}")
    path = parts.path.strip("/")
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 6379,
        # None skips SELECT for db 0 (fewer moving parts on reconnect).
        "dbid": int(path) if path and int(path) != 0 else None,
        "password": unquote(parts.password) if parts.password else None,
        "username": unquote(parts.username) if parts.username else None,
    }


def isRedisFailure(reason: Any) -> bool:
    """
    Whether an exception or L{Failure} is one of the Redis errors R35 maps
    to C{on_redis_error}: txredisapi's C{ConnectionError} (and its
    C{TimeoutError}), C{ResponseError} (and C{ScriptDoesNotExist}),
    C{ValueError} from a refused non-lazy connection (trap T18),
    L{defer.TimeoutError} from C{addTimeout}, L{RedisUnavailable}, and
    L{defer.CancelledError}.

    @param reason: an exception or a L{Failure}.
    """
    value = reason.value if isinstance(reason, Failure) else reason
    if isinstance(value, (RedisUnavailable, defer.TimeoutError, defer.CancelledError, ValueError)):
        return True
    import sys

    txredisapi = sys.modules.get("txredisapi")
    return txredisapi is not None and isinstance(value, txredisapi.RedisError)


def describe(reason: Any) -> str:
    """
    @param reason: an exception or a L{Failure}.
    @return: short text for logs, e.g. C{TimeoutError: ...}.
    """
    value = reason.value if isinstance(reason, Failure) else reason
    return f"{type(value).__name__}: {value}"


@define(eq=False)
class RedisService(Service):
    """
    Owns the txredisapi connection pool.

    @ivar url: C{redis://host:port/db}.
    @ivar _clock: the clock for per-call timeouts.
    @ivar poolsize: connections in the pool.
    @ivar connectTimeout: TCP connect timeout, seconds.
    @ivar replyTimeout: txredisapi's reply timeout on a live connection,
        seconds (the per-call timeout of L{execute} bounds the rest).
    @ivar reconnectMaxDelay: cap of the reconnect back-off, seconds, so
        relay notices a restarted Redis quickly.
    @ivar pool: the pool while running, else L{None}.
    @ivar commandCount: commands sent through L{execute} so far.
    """

    url: str
    _clock: IReactorTime
    poolsize: int = 4
    connectTimeout: float = 2.0
    replyTimeout: float = 5.0
    reconnectMaxDelay: float = 1.0
    pool: Optional[Any] = field(default=None, init=False)
    commandCount: int = field(default=0, init=False)

    _log = Logger()

    def __attrs_post_init__(self) -> None:
        """
        Initialise L{Service}'s own attributes.
        """
        self.running = 0
        self.name = None
        self.parent = None

    def startService(self) -> None:
        """
        Create the lazy pool; it connects in the background and reconnects
        by itself.
        """
        import txredisapi

        Service.startService(self)
        self.pool = txredisapi.lazyConnectionPool(
            poolsize=self.poolsize,
            connectTimeout=self.connectTimeout,
            replyTimeout=self.replyTimeout,
            convertNumbers=False,
            **parseRedisUrl(self.url),
        )
        factory = getattr(self.pool, "_factory", None)
        if factory is not None:
            factory.initialDelay = min(factory.initialDelay, 0.1)
            factory.maxDelay = self.reconnectMaxDelay

    def stopService(self) -> Deferred:
        """
        Disconnect the pool.

        @return: a L{Deferred} that fires when the connections are closed.
        """
        Service.stopService(self)
        pool, self.pool = self.pool, None
        if pool is None:
            return defer.succeed(None)
        return pool.disconnect().addErrback(lambda f: None)

    def execute(self, timeout: float, method: str, *args: Any, **kwargs: Any) -> Deferred:
        """
        Run one pool command with a timeout on the injected clock (T16).

        @param timeout: seconds.
        @param method: a txredisapi method name, e.g. C{eval} or
            C{execute_command}.
        @return: a L{Deferred} with the reply; it fails with
            L{RedisUnavailable} on any Redis error (see L{isRedisFailure})
            and with L{RedisUnavailable} when the service is not running.
        """
        self.commandCount += 1
        if self.pool is None:
            return defer.fail(RedisUnavailable(method, "redis service not running"))
        try:
            d = getattr(self.pool, method)(*args, **kwargs)
        except Exception as e:
            return defer.fail(RedisUnavailable(method, describe(e)))
        d.addTimeout(timeout, self._clock)

        def _ebMap(f: Failure) -> Failure:
            if isRedisFailure(f) and not f.check(RedisUnavailable):
                raise RedisUnavailable(method, describe(f))
            return f

        return d.addErrback(_ebMap)
