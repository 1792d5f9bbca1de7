# -*- test-case-name: tests.test_runner -*-
"""
Cancellation of a turn's waits and attempts by its client (behaviour.md R2):
L{raceCancel} ties a Deferred to the turn's L{relay.model.CancelSignal}; a
client that left ends the wait with L{ClientGone}.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
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
    @param cancel: the turn's L{relay.model.CancelSignal}.
    """
    if cancel.cancelled:
        d.cancel()
        d.addErrback(lambda f: None)
        result = Deferred()
        result.errback(ClientGone(cancel.reason))
        return result
    if d.called and not isinstance(d.result, Deferred):
        # Already has its result (the memory store and admission answer at
        # once): nothing to race (issue 16).
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


def uncancellable(d: Deferred) -> Deferred:
    """
    A view of C{d} whose cancellation does not errback C{d} itself (the
    pump owns its Deferred and ends it on abort).
    """
    view = Deferred(lambda _: None)
    d.addBoth(lambda r: (view.callback(r) if not view.called else None, r)[1])
    return view
