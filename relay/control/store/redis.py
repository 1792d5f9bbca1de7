# -*- test-case-name: tests.integration.test_control_store_redis -*-
"""
L{RedisControlStore}: the control store in Redis
(L{relay.interfaces.IControlStore}, C{state.backend: redis}), shared by
every relay process on that Redis.

Keys:

  - C{relay:control:{kind}}: a hash, field = record id, value =
    C{"<version>\\t<updated_at>\\t<data JSON>"};
  - C{relay:control:revision}: the store's version counter (C{INCR});
  - C{relay:control:seq:{kind}} and the list C{relay:control:order:{kind}}:
    the id sequence and the order of appended records (the trim).

Every write is one Lua script that checks the version, writes, and
C{PUBLISH}es C{{"kind", "id", "version"}} (version C{null} for a delete)
on the channel C{relay:control:changes} in the same step, so a change is
never announced before it is readable. Each process keeps one subscriber
connection (Twisted's L{ClientService}, reconnecting within a second);
after every (re)subscription it tells its listeners to re-read everything
(a L{ControlChange} with no kind), since messages sent while it was
disconnected are lost (Redis pub/sub keeps nothing).

Every command is bounded by C{timeout} on the injected clock (trap T16)
through L{relay.wire.redisclient.RedisService.execute}; a Redis error is
L{ControlStoreUnavailable}. txredisapi is imported lazily (trap T5).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.control.store import (
    ANY,
    STORE_TIMEOUT_SECONDS,
    ControlChange,
    ControlRecord,
    ControlStoreUnavailable,
    Listeners,
    VersionConflict,
    checkKey,
    decodeData,
    encodeData,
)
from relay.interfaces import IControlStore

__all__ = ["CHANNEL", "RedisControlStore"]

PREFIX = "relay:control:"
REVISION_KEY = PREFIX + "revision"
CHANNEL = PREFIX + "changes"
"""The pub/sub channel every write is announced on."""

FEED_CONNECT_TIMEOUT = 2.0
"""Seconds L{RedisControlStore.start} waits for the first subscription."""

_CHECK_VERSION = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local cv = false
if cur then cv = string.match(cur, '^(%d+)') end
if ARGV[2] ~= '*' then
  if ARGV[2] == '' then
    if cur then return {0, cv} end
  elseif cv ~= ARGV[2] then
    return {0, cv or ''}
  end
end
"""
"""The version check both writes start with (KEYS[1] the kind's hash,
ARGV[1] the id, ARGV[2] the expected version: C{*} any, empty for absent):
on a mismatch the script answers C{{0, current version}} and writes
nothing. It leaves C{cur} (the stored value, or false) for the rest."""

_PUT = _CHECK_VERSION + """\
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], v .. '\\t' .. ARGV[4] .. '\\t' .. ARGV[3])
redis.call('PUBLISH', ARGV[5], cjson.encode({kind=ARGV[6], id=ARGV[1], version=v}))
return {1, v}
"""

_DELETE = _CHECK_VERSION + """\
if not cur then return {1, 0} end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[3], cjson.encode({kind=ARGV[4], id=ARGV[1], version=cjson.null}))
return {1, 1}
"""

_APPEND = """
local n = redis.call('INCR', KEYS[3])
local id = string.format('%012d', n)
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], id, v .. '\\t' .. ARGV[2] .. '\\t' .. ARGV[1])
redis.call('RPUSH', KEYS[4], id)
local keep = tonumber(ARGV[3])
while redis.call('LLEN', KEYS[4]) > keep do
  local old = redis.call('LPOP', KEYS[4])
  redis.call('HDEL', KEYS[1], old)
end
redis.call('PUBLISH', ARGV[4], cjson.encode({kind=ARGV[5], id=id, version=v}))
return {id, v}
"""


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _parse(kind: str, id: str, raw) -> Optional[ControlRecord]:
    """
    @return: the record of a stored hash value, or L{None} when malformed.
    """
    if raw is None:
        return None
    version, _, rest = _text(raw).partition("\t")
    at, _, data = rest.partition("\t")
    try:
        return ControlRecord(kind=kind, id=id, version=int(version), data=decodeData(data),
                             updated_at=float(at))
    except ValueError:
        return None


def _hashKey(kind: str) -> str:
    return PREFIX + kind


@implementer(IControlStore)
@define(eq=False)
class RedisControlStore:
    """
    See the module docstring.

    @ivar _redis: the L{relay.wire.redisclient.RedisService} (its C{url} is also
        where the change feed connects).
    @ivar _clock: stamps records and bounds every call.
    @ivar timeout: seconds per command.
    @ivar channel: the change channel (tests may isolate themselves).
    """

    _redis: Any
    _clock: IReactorTime
    timeout: float = STORE_TIMEOUT_SECONDS
    channel: str = CHANNEL
    _listeners: Listeners = field(factory=Listeners, init=False)
    _feed: Any = field(default=None, init=False)
    _subscribed: list = field(factory=list, init=False)
    _announced: dict = field(factory=dict, init=False)
    _log = Logger()

    def _announce(self, change: ControlChange) -> None:
        """
        Tell this process's listeners of its own write at once, and note it
        so the same message coming back through the feed is skipped.
        """
        key = (change.kind, change.id, change.version)
        if len(self._announced) > 10000:
            self._announced.clear()  # the feed has been away long: resync covers it
        self._announced[key] = self._announced.get(key, 0) + 1
        self._listeners.notify(change)

    def _execute(self, method: str, *args, **kwargs) -> Deferred:
        d = self._redis.execute(self.timeout, method, *args, **kwargs)

        def _ebMap(failure):
            from relay.wire.redisclient import isRedisFailure

            if isRedisFailure(failure):
                raise ControlStoreUnavailable(f"control store (Redis): {failure.value}")
            return failure

        return d.addErrback(_ebMap)

    def get(self, kind: str, id: str) -> Deferred:
        """
        See L{IControlStore.get}.
        """
        checkKey(kind, id)
        d = self._execute("hget", _hashKey(kind), id)
        return d.addCallback(lambda raw: _parse(kind, id, raw))

    def list(self, kind: str) -> Deferred:
        """
        See L{IControlStore.list}.
        """
        checkKey(kind, "-")
        d = self._execute("hgetall", _hashKey(kind))

        def _cbRecords(fields):
            if isinstance(fields, list):  # a flat reply, should a client give one
                fields = dict(zip(fields[::2], fields[1::2]))
            records = (_parse(kind, _text(k), v) for k, v in (fields or {}).items())
            return sorted((r for r in records if r is not None), key=lambda r: r.id)

        return d.addCallback(_cbRecords)

    @staticmethod
    def _expected(expected) -> str:
        if expected is ANY:
            return "*"
        if expected is None:
            return ""
        return str(int(expected))

    def put(self, kind: str, id: str, data: dict, expected) -> Deferred:
        """
        See L{IControlStore.put}: one script checks, writes and publishes.
        """
        checkKey(kind, id)
        raw = encodeData(data)
        now = self._clock.seconds()
        d = self._execute(
            "eval", _PUT, keys=[_hashKey(kind), REVISION_KEY],
            args=[id, self._expected(expected), raw, repr(float(now)), self.channel, kind],
        )

        def _cbWritten(reply):
            ok, version = int(reply[0]), reply[1]
            if not ok:
                raise VersionConflict(kind, id, int(version) if version not in (None, "", b"")
                                      else None)
            record = ControlRecord(kind=kind, id=id, version=int(version),
                                   data=decodeData(raw), updated_at=now)
            self._announce(ControlChange(kind, id, record.version))
            return record

        return d.addCallback(_cbWritten)

    def delete(self, kind: str, id: str, expected=ANY) -> Deferred:
        """
        See L{IControlStore.delete}.
        """
        checkKey(kind, id)
        d = self._execute(
            "eval", _DELETE, keys=[_hashKey(kind), REVISION_KEY],
            args=[id, self._expected(expected), self.channel, kind],
        )

        def _cbDeleted(reply):
            ok, detail = int(reply[0]), reply[1]
            if not ok:
                raise VersionConflict(kind, id, int(detail) if detail not in (None, "", b"")
                                      else None)
            deleted = int(detail) == 1
            if deleted:
                self._announce(ControlChange(kind, id, None))
            return deleted

        return d.addCallback(_cbDeleted)

    def append(self, kind: str, data: dict, keep: int) -> Deferred:
        """
        See L{IControlStore.append}: sequence, write, trim and publish in
        one script.
        """
        checkKey(kind, "-")
        raw = encodeData(data)
        now = self._clock.seconds()
        d = self._execute(
            "eval", _APPEND,
            keys=[_hashKey(kind), REVISION_KEY, PREFIX + "seq:" + kind, PREFIX + "order:" + kind],
            args=[raw, repr(float(now)), str(max(1, int(keep))), self.channel, kind],
        )

        def _cbAppended(reply):
            record = ControlRecord(kind=kind, id=_text(reply[0]), version=int(reply[1]),
                                   data=decodeData(raw), updated_at=now)
            self._announce(ControlChange(kind, record.id, record.version))
            return record

        return d.addCallback(_cbAppended)

    # -- the change feed ------------------------------------------------------------

    def subscribe(self, listener):
        """
        See L{IControlStore.subscribe}. A change published by this process
        reaches its listeners once, at write time: the feed skips
        messages it already announced (same kind, id and version).
        """
        return self._listeners.subscribe(listener)

    def start(self) -> Deferred:
        """
        See L{IControlStore.start}: open the subscriber connection.
        """
        if self._feed is not None:
            return succeed(None)
        from twisted.application.internet import ClientService, backoffPolicy

        from relay.wire.redisclient import parseRedisUrl

        # TCP, TLS, a unix socket or the Sentinels' current master: the
        # Redis client knows how to reach the Redis it writes to.
        factory = _feedFactory(self, parseRedisUrl(self._redis.url))
        endpoint = self._redis.endpoint()
        self._feed = ClientService(
            endpoint, factory, retryPolicy=backoffPolicy(initialDelay=0.1, maxDelay=1.0),
            clock=self._clock,
        )
        self._feed.startService()
        first = Deferred()
        self._subscribed.append(first)
        first.addTimeout(FEED_CONNECT_TIMEOUT, self._clock, onTimeoutCancel=lambda *_: None)
        return first

    def stop(self) -> Deferred:
        """
        See L{IControlStore.stop}: close the subscriber connection.
        """
        feed, self._feed = self._feed, None
        waiting, self._subscribed = self._subscribed, []
        for d in waiting:
            if not d.called:
                d.callback(None)
        if feed is None:
            return succeed(None)
        return feed.stopService()

    def feedSubscribed(self) -> None:
        """
        The feed (re)subscribed: messages may have been missed while it was
        away, so every listener re-reads everything.
        """
        self._log.info("control change feed subscribed to {channel}",
                       event="relay.control_feed_subscribed", channel=self.channel)
        waiting, self._subscribed = self._subscribed, []
        for d in waiting:
            if not d.called:
                d.callback(None)
        self._listeners.notify(ControlChange())

    def feedMessage(self, channel, message) -> None:
        """
        One published change: tell the listeners (a listener already at
        that version ignores it).
        """
        if _text(channel) != self.channel:
            return
        change = ControlChange.fromJSON(message)
        key = (change.kind, change.id, change.version)
        seen = self._announced.get(key)
        if seen:
            if seen == 1:
                del self._announced[key]
            else:
                self._announced[key] = seen - 1
            return
        self._listeners.notify(change)

    def feedLost(self) -> None:
        """
        The subscriber connection went; the service reconnects.
        """
        if self._feed is not None:
            self._log.warn("control change feed disconnected; reconnecting",
                           event="relay.control_feed_lost", channel=self.channel)


def _feedFactory(store: RedisControlStore, params):
    """
    A protocol factory for the change feed: a txredisapi
    C{SubscriberProtocol} that subscribes to C{store.channel} once it is
    ready and hands every message to C{store}.
    """
    import txredisapi
    from twisted.internet.protocol import Factory

    def _subscribeFailed(failure) -> None:
        # The connection went while subscribing (a Redis that stopped
        # answering, a failover): the service reconnects and re-subscribes
        # (feedLost); a warning, not a traceback (R101). Anything else is a bug.
        from twisted.internet.error import ConnectionDone, ConnectionLost

        if failure.check(txredisapi.ConnectionError, ConnectionLost, ConnectionDone):
            store._log.warn("control feed subscription failed: {error}; reconnecting",
                            event="relay.control_feed_lost", error=str(failure.value))
            return
        store._log.failure("control feed subscription failed", failure)

    class _FeedProtocol(txredisapi.SubscriberProtocol):
        def connectionMade(self):
            d = super().connectionMade()

            def _cbSubscribe(_):
                if not self.connected:
                    return None
                return self.subscribe(store.channel).addCallback(
                    lambda _: store.feedSubscribed())

            d.addCallback(_cbSubscribe)
            d.addErrback(_subscribeFailed)
            return d

        def messageReceived(self, pattern, channel, message):
            store.feedMessage(channel, message)

        def connectionLost(self, why):
            super().connectionLost(why)
            store.feedLost()

    class _FeedFactory(Factory):
        isLazy = True

        def buildProtocol(self, addr):
            protocol = _FeedProtocol(
                charset="utf-8", password=params.password, dbid=None,
                convertNumbers=False, username=params.username,
            )
            protocol.factory = self
            return protocol

        def stopTrying(self):
            """
            txredisapi calls this on a failed AUTH; the service keeps
            retrying (the password may be fixed on the server).
            """

        def connectionError(self, message):
            store._log.error("control change feed: {message}",
                             event="relay.control_feed_failed", message=message)

    return _FeedFactory()
