# -*- test-case-name: tests.test_runner -*-
"""
Reading a bounded upstream body (an error body, a non-streaming answer):
tells a clean end from a broken one and gives up after an idle period
(behaviour.md R7, R24).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Protocol
from twisted.web.client import PotentialDataLoss, ResponseDone

from relay.engine.pump import shortReason

ERROR_BODY_LIMIT = 512 * 2**10
"""Upstream error bodies are read up to 512 KiB (behaviour.md R7)."""

JSON_BODY_LIMIT = 40 * 2**20
"""A non-streaming upstream body, at most (behaviour.md R22 line cap)."""


class BodyBroken(Exception):
    """
    An upstream body ended uncleanly or went idle before its end.

    @ivar partial: the bytes read so far.
    @ivar detail: a short reason.
    @ivar idle: the body went silent (relay's R24 timeout), rather than
        breaking.
    """

    def __init__(self, partial: bytes, detail: str, idle: bool = False):
        super().__init__(detail)
        self.partial = partial
        self.detail = detail
        self.idle = idle


class _BodyReader(Protocol):
    """
    Reads a bounded upstream body for L{readBody}.
    """

    def __init__(self, limit: int, idle: float, clock):
        self._limit = limit
        self._idle = idle
        self._clock = clock
        self._parts = []
        self._size = 0
        self._timer = None
        self.done = Deferred(self._cancel)

    def _cancel(self, d) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.stopProducing()

    def _arm(self) -> None:
        # Armed by L{readBody} once the body is handed over (a
        # body that was already in ends without a timer); from then on each
        # read restarts the idle period.
        if self._idle <= 0 or self.done.called:
            return
        if self._timer is not None and self._timer.active():
            self._timer.reset(self._idle)
        else:
            self._timer = self._clock.callLater(self._idle, self._expired)

    def _touch(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.reset(self._idle)

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self.done.called:
            self.done.errback(BodyBroken(b"".join(self._parts), "body idle timeout", idle=True))
            if self.transport is not None:
                self.transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self._touch()
        room = self._limit - self._size
        self._parts.append(data[:room])
        self._size += min(len(data), room)
        if self._size >= self._limit:
            self._disarm()
            self.done.callback(b"".join(self._parts))
            self.transport.stopProducing()

    def connectionLost(self, reason) -> None:
        self._disarm()
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss) is not None:
            self.done.callback(b"".join(self._parts))
        else:
            self.done.errback(BodyBroken(b"".join(self._parts), shortReason(reason)))


def readBody(response, limit: int, idle: float, clock) -> Deferred:
    """
    Read at most C{limit} bytes of an upstream body. Unlike
    L{IUpstreamResponse.readBody} it tells a clean end from a broken one,
    and gives up after C{idle} seconds without bytes (R24's idle timeout
    also covers non-streaming bodies).

    @return: Deferred firing with bytes, or failing with L{BodyBroken};
        fired already when the whole body was in (a response's
        C{takeBody}, L{relay.upstream.httpclient.Response.takeBody}).
    """
    take = getattr(response, "takeBody", None)
    if take is not None:
        body = take(limit)
        if body is not None:
            return succeed(body)
    reader = _BodyReader(limit, idle, clock)
    response.deliverBody(reader)
    reader._arm()
    return reader.done
