# -*- test-case-name: tests.test_keepalive -*-
"""
Downstream keepalives for one streaming turn (behaviour.md R24, R31, R85).

From the moment a streaming turn starts until its terminal event, a client
that has been sent nothing for C{gateway.stream_keepalive_interval} seconds
gets a keepalive: an SSE comment (C{:} and a blank line) on HTTP, a ping
frame on the WebSocket. That covers slot waits, retry sleeps, and an
upstream that is silent before or after its first output, so an idle-cutting
proxy (nginx, a CDN, a 30 s client timeout) never sees a silent connection.

What the sink does with it is the sink's business (L{ITurnSink.keepalive}):
the SSE sink commits 200 and the SSE headers with the first one, so any
later failure is written in-stream (R17, R19.2); a keepalive is never
output, so failover stays possible.

A keepalive is written only between whole events: sinks write whole events
(the pass-through writes complete C{\\n\\n}-terminated runs), and the timer
runs on the reactor, never inside a write.
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import define, field
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

_SLACK = 1e-6
"""Seconds of float rounding tolerated when a timer fires exactly on time."""


@define(eq=False)
class StreamKeepalive:
    """
    Sends C{send()} whenever nothing was written to the client for
    C{interval} seconds, between L{start} and L{stop}.

    While a slot wait or retry sleep runs (L{beginWait}), the wait's own
    pace (R31 C{scheduling.ping_interval}) applies when it is shorter.

    @ivar clock: the injected L{IReactorTime}.
    @ivar send: writes one keepalive (e.g. L{ITurnSink.keepalive}); an
        exception from it is logged and the keepalive continues.
    @ivar interval: seconds of silence before a keepalive (R24, R85);
        0 or less means none outside waits.
    @ivar requestId: the turn's request id, for logs.
    @ivar sent: how many keepalives were sent.
    """

    clock: IReactorTime
    send: Callable[[], None]
    interval: float
    requestId: str = ""
    sent: int = 0
    _waitInterval: float | None = None
    _last: float = 0.0
    _call: IDelayedCall | None = None
    _running: bool = field(default=False)
    _log = Logger()

    @property
    def running(self) -> bool:
        """
        Whether the keepalive is between L{start} and L{stop}.
        """
        return self._running

    def start(self, since: float | None = None) -> None:
        """
        Start counting silence from now (the turn's start), or from
        C{since} (seconds on C{clock}: when the client was last written
        to, if earlier).
        """
        if self._running:
            return
        self._running = True
        now = self.clock.seconds()
        self._last = now if since is None else min(since, now)
        self._schedule()

    def stop(self) -> None:
        """
        Stop for good (the terminal event was written, or the turn ended).
        Idempotent.
        """
        self._running = False
        self._cancel()

    def touch(self) -> None:
        """
        Something was written to the client just now; the silence starts
        over. Cheap: called on every write (no timer is moved).
        """
        self._last = self.clock.seconds()

    def beginWait(self, interval: float) -> None:
        """
        A slot wait or a retry sleep begins: keepalives come at least every
        C{interval} seconds (R31) until L{endWait}.

        @param interval: seconds; 0 or less adds nothing.
        """
        self._waitInterval = interval if interval > 0 else None
        self._reschedule()

    def endWait(self) -> None:
        """
        The wait is over: back to C{interval}.
        """
        self._waitInterval = None
        self._reschedule()

    # -- internals ---------------------------------------------------------

    def _effective(self) -> float | None:
        """
        @return: the current pace in seconds, or L{None} for none.
        """
        paces = [p for p in (self.interval, self._waitInterval) if p is not None and p > 0]
        return min(paces) if paces else None

    def _cancel(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _reschedule(self) -> None:
        if self._running:
            self._cancel()
            self._schedule()

    def _schedule(self) -> None:
        pace = self._effective()
        if pace is None:
            return
        due = max(0.0, self._last + pace - self.clock.seconds())
        self._call = self.clock.callLater(due, self._fire)

    def _fire(self) -> None:
        self._call = None
        if not self._running:
            return
        pace = self._effective()
        if pace is None:
            return
        now = self.clock.seconds()
        if now - self._last >= pace - _SLACK:
            self._last = now
            self.sent += 1
            try:
                self.send()
            except Exception:  # noqa: BLE001 - logged; the keepalive goes on
                self._log.failure(
                    "writing a keepalive failed",
                    event="relay.keepalive_failed",
                    request_id=self.requestId,
                )
        self._schedule()
