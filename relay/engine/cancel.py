# -*- test-case-name: tests.test_runner -*-
"""
Cancellation of a turn's waits and attempts by its client (behaviour.md R2):
L{raceCancel} ties a Deferred to the turn's L{relay.base.records.CancelSignal}; a
client that left ends the wait with L{ClientGone}.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure


class ClientGone(Exception):
    """
    The client went away (behaviour.md R2); the turn stops silently.
    """


def raceCancel(d: Deferred, cancel) -> Deferred:
    """
    Tie C{d} to the turn's cancellation: when the client goes, C{d} is
    cancelled and the result fails with L{ClientGone}.

    @param d: any cancellable Deferred.
    @param cancel: the turn's L{relay.base.records.CancelSignal}.
    """
    if cancel.cancelled:
        d.cancel()
        d.addErrback(lambda f: None)
        result = Deferred()
        result.errback(ClientGone(cancel.reason))
        return result
    if d.called and not isinstance(d.result, Deferred):
        # Already has its result (the memory store and admission answer at
        # once): nothing to race.
        return d

    def _cancelled(reason):
        d.cancel()

    cancel.onCancel(_cancelled)

    def _done(result):
        cancel.removeOnCancel(_cancelled)
        if cancel.cancelled and isinstance(result, Failure):
            return Failure(ClientGone(cancel.reason))
        return result

    return d.addBoth(_done)


def raceDeparture(d: Deferred, cancel) -> Deferred:
    """
    C{raceCancel(uncancellable(d), cancel)} with one Deferred and one
    callback fewer (once per streamed attempt): when the client
    goes, the result fails with L{ClientGone} and C{d} is left alone (its
    owner, the pump, ends it on departure); else it fires with C{d}'s
    result, which C{d} keeps (C{d} itself when it already has it).

    @param d: a Deferred that never fails (a pump's C{done}).
    @param cancel: the turn's L{relay.base.records.CancelSignal}.
    """
    if cancel.cancelled:
        return fail(ClientGone(cancel.reason))
    if d.called and not isinstance(d.result, (Deferred, Failure)):
        # The pump ended while it started (its whole body was in): nothing
        # to race; awaiting C{d} leaves it its result.
        return d
    view = Deferred(_ignoreCancel)

    def _cancelled(reason):
        if not view.called:
            view.errback(ClientGone(reason))

    cancel.onCancel(_cancelled)

    def _done(result):
        cancel.removeOnCancel(_cancelled)
        if not view.called:
            if cancel.cancelled and isinstance(result, Failure):
                view.errback(ClientGone(cancel.reason))
            elif isinstance(result, Failure):
                view.errback(result)
            else:
                view.callback(result)
        return result

    d.addBoth(_done)
    return view


def drained(pump) -> Deferred:
    """
    Wait for a pump the client left to end: at once before its first
    output (R2), after its usage drain otherwise (R107). Never fails and is
    not cancelled by its waiter: the drain is bounded by its own timer.

    @param pump: a L{relay.engine.pump.StreamPump} after its C{depart}.
    @return: a Deferred firing with L{None}.
    """
    if pump.done.called:
        return succeed(None)
    view = Deferred(_ignoreCancel)
    pump.done.addBoth(lambda r: (view.callback(None) if not view.called else None, r)[1])
    return view


def _ignoreCancel(d: Deferred) -> None:
    """
    A view's canceller: cancelling it does not touch what it watches.
    """


def uncancellable(d: Deferred) -> Deferred:
    """
    A view of C{d} whose cancellation does not errback C{d} itself (the
    pump owns its Deferred and ends it on abort).
    """
    view = Deferred(lambda _: None)
    d.addBoth(lambda r: (view.callback(r) if not view.called else None, r)[1])
    return view
