# -*- test-case-name: tests.test_emulator -*-
"""
Pacing of emulated event streams on an injected clock, and in-flight turn accounting.
"""

from __future__ import annotations

from typing import Any, Callable

from attrs import define, field
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from relay.emulator.state import EmulatorState


@define(eq=False)
class TurnTracker:
    """
    Counts one turn as in flight from creation until L{end} (idempotent).

    @ivar state: the emulator state holding the counters.
    @ivar credential: the account's bearer token.
    """

    state: EmulatorState
    credential: str | None
    _ended: bool = False

    def __attrs_post_init__(self) -> None:
        """
        Count the turn as started.
        """
        self.state.turnStarted(self.credential)

    def end(self, _ignored: Any = None) -> Any:
        """
        Count the turn as finished; later calls do nothing.

        @param _ignored: anything (so this can be a Deferred callback).
        @return: C{_ignored}, passed through.
        """
        if not self._ended:
            self._ended = True
            self.state.turnEnded(self.credential)
        return _ignored


def _nothing() -> None:
    """
    Do nothing (a default callback).
    """


def stallOf(fault: Any) -> dict:
    """
    The L{EventPump} arguments of a C{stall_after_events} fault.

    @param fault: a L{relay.emulator.state.Fault}, or L{None}.
    @return: C{stallAt}/C{stallFor} keyword arguments (empty for any other fault).
    @rtype: L{dict}
    """
    if fault is None or fault.kind != "stall_after_events":
        return {}
    return {"stallAt": int(fault.get("events")), "stallFor": float(fault.get("seconds"))}


@define(eq=False)
class EventPump:
    """
    Sends planned events one by one, honouring the per-event delay, a delay before the first
    output event, and a cut after K events.

    @ivar clock: where delays are scheduled.
    @ivar events: the events to send.
    @ivar send: called with each event.
    @ivar finish: called after the last event was sent.
    @ivar cut: called instead of sending event number C{cutAfter}.
    @ivar beforeTerminal: called just before the last event is sent.
    @ivar delay: seconds between events.
    @ivar firstOutput: index of the first output event.
    @ivar firstDelay: extra seconds to wait before event C{firstOutput}.
    @ivar cutAfter: how many events to send before cutting, or L{None}.
    @ivar stallAt: index of the event a stall waits before, or L{None}.
    @ivar stallFor: seconds of that stall (C{stall_after_events}).
    """

    clock: IReactorTime
    events: list
    send: Callable[[dict], None]
    finish: Callable[[], None] = _nothing
    cut: Callable[[], None] = _nothing
    beforeTerminal: Callable[[], None] = _nothing
    delay: float = 0.0
    firstOutput: int = 1
    firstDelay: float = 0.0
    cutAfter: int | None = None
    stallAt: int | None = None
    stallFor: float = 0.0
    _index: int = 0
    _ready: bool = False
    _stopped: bool = False
    _call: IDelayedCall | None = field(default=None)

    def start(self) -> None:
        """
        Start sending; events without delay are sent synchronously.
        """
        self._next()

    def stop(self) -> None:
        """
        Stop sending (the peer went away); no callback runs afterwards.
        """
        self._stopped = True
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    @property
    def sent(self) -> int:
        """
        How many events were sent so far.

        @rtype: L{int}
        """
        return self._index

    def _waitBefore(self, index: int) -> float:
        """
        The pause before an event.

        @param index: the event's index.
        @type index: L{int}
        @rtype: L{float}
        """
        wait = self.delay if index > 0 else 0.0
        if index == self.firstOutput:
            wait += self.firstDelay
        if index == self.stallAt:
            wait += self.stallFor
        return wait

    def _resume(self) -> None:
        """
        A scheduled pause is over.
        """
        self._call = None
        self._ready = True
        self._next()

    def _next(self) -> None:
        """
        Send events until a pause, the cut, or the end.
        """
        while not self._stopped:
            if self._index >= len(self.events):
                self._stopped = True
                self.finish()
                return
            if self.cutAfter is not None and self._index >= self.cutAfter:
                self._stopped = True
                self.cut()
                return
            wait = self._waitBefore(self._index)
            if wait > 0 and not self._ready:
                self._call = self.clock.callLater(wait, self._resume)
                return
            self._ready = False
            event = self.events[self._index]
            self._index += 1
            if self._index == len(self.events):
                self.beforeTerminal()
            self.send(event)
