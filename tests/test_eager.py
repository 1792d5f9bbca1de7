"""
Tests for L{relay.base.eager.eagerDeferred} (issue 16).
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from relay.base.eager import eagerDeferred


class EagerDeferredTests(SynchronousTestCase):
    """
    L{eagerDeferred} behaves like C{Deferred.fromCoroutine}.
    """

    def test_finishesAtOnce(self):
        """
        A coroutine that awaits only fired Deferreds gives a fired
        Deferred with its value.
        """

        async def coro():
            a = await succeed(1)
            b = await succeed(2)
            return a + b

        self.assertEqual(self.successResultOf(eagerDeferred(coro())), 3)

    def test_raisesAtOnce(self):
        """
        An exception before any wait is the Deferred's failure.
        """

        async def coro():
            raise ValueError("no")

        self.failureResultOf(eagerDeferred(coro()), ValueError)

    def test_waitsThenFinishes(self):
        """
        A coroutine that waits resumes with each awaited value, in order.
        """
        first, second = Deferred(), Deferred()
        seen = []

        async def coro():
            seen.append(await first)
            seen.append(await second)
            return "done"

        d = eagerDeferred(coro())
        self.assertNoResult(d)
        first.callback("a")
        self.assertNoResult(d)
        second.callback("b")
        self.assertEqual(self.successResultOf(d), "done")
        self.assertEqual(seen, ["a", "b"])

    def test_failureThrownIn(self):
        """
        A failed awaited Deferred raises inside the coroutine, which may
        handle it.
        """
        waiting = Deferred()

        async def coro():
            try:
                await waiting
            except KeyError:
                return "handled"
            return "not raised"

        d = eagerDeferred(coro())
        waiting.errback(KeyError("k"))
        self.assertEqual(self.successResultOf(d), "handled")

    def test_unhandledFailureAfterWait(self):
        """
        An exception after a wait is the Deferred's failure.
        """
        waiting = Deferred()

        async def coro():
            await waiting
            raise ValueError("late")

        d = eagerDeferred(coro())
        waiting.callback(None)
        self.failureResultOf(d, ValueError)

    def test_cancel(self):
        """
        Cancelling cancels what the coroutine waits on; the coroutine sees
        L{CancelledError}.
        """
        cancelled = []
        waiting = Deferred(lambda d: cancelled.append(True))
        seen = []

        async def coro():
            try:
                await waiting
            except CancelledError:
                seen.append("cancelled")
                raise

        d = eagerDeferred(coro())
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(cancelled, [True])
        self.assertEqual(seen, ["cancelled"])


class RaceCancelTests(SynchronousTestCase):
    """
    L{relay.engine.cancel.raceCancel} on L{CancelSignal.onCancel} (issue 16).
    """

    def test_firedPassesThrough(self):
        """
        A Deferred that already has its result is returned as it is and
        leaves no watcher behind.
        """
        from relay.engine.cancel import raceCancel
        from relay.base.records import CancelSignal

        signal = CancelSignal()
        d = succeed(5)
        self.assertIs(raceCancel(d, signal), d)
        self.assertEqual(signal._waiters, [])

    def test_clientGoneCancelsTheWait(self):
        """
        A pending wait is cancelled when the client goes and fails with
        L{ClientGone}.
        """
        from relay.engine.cancel import ClientGone, raceCancel
        from relay.base.records import CancelSignal

        signal = CancelSignal()
        cancelled = []
        d = raceCancel(Deferred(lambda _: cancelled.append(True)), signal)
        self.assertNoResult(d)
        signal.cancel("client_gone")
        self.assertEqual(cancelled, [True])
        self.failureResultOf(d, ClientGone)

    def test_watcherRemovedOnResult(self):
        """
        Once the wait has its result the signal holds no watcher; a later
        cancel does not touch it.
        """
        from relay.engine.cancel import raceCancel
        from relay.base.records import CancelSignal

        signal = CancelSignal()
        waiting = Deferred()
        d = raceCancel(waiting, signal)
        self.assertEqual(len(signal._waiters), 1)
        waiting.callback("ok")
        self.assertEqual(self.successResultOf(d), "ok")
        self.assertEqual(signal._waiters, [])
        signal.cancel()


class RaceDepartureTests(SynchronousTestCase):
    """
    L{relay.engine.cancel.raceDeparture}: a pump's C{done} raced against the
    client's departure without cancelling it (issue 24).
    """

    def test_resultPassesThroughAndStays(self):
        """
        The view fires with the pump's result, which C{done} keeps; the
        signal holds no watcher afterwards.
        """
        from relay.engine.cancel import raceDeparture
        from relay.base.records import CancelSignal

        signal = CancelSignal()
        done = Deferred()
        view = raceDeparture(done, signal)
        self.assertNoResult(view)
        done.callback("result")
        self.assertEqual(self.successResultOf(view), "result")
        self.assertEqual(self.successResultOf(done), "result")
        self.assertEqual(signal._waiters, [])
        early = succeed("early")
        self.assertIs(raceDeparture(early, signal), early)
        self.assertEqual(signal._waiters, [])

    def test_departureLeavesTheDoneAlone(self):
        """
        The client going fails the view with L{ClientGone} (its reason) and
        does not cancel C{done}; its later result is ignored by the view.
        """
        from relay.engine.cancel import ClientGone, raceDeparture
        from relay.base.records import CancelSignal

        signal = CancelSignal()
        cancelled = []
        done = Deferred(lambda _: cancelled.append(True))
        view = raceDeparture(done, signal)
        signal.cancel("client_gone")
        self.assertEqual(str(self.failureResultOf(view, ClientGone).value), "client_gone")
        self.assertEqual(cancelled, [])
        done.callback("departed")
        self.assertEqual(self.successResultOf(done), "departed")
        gone = raceDeparture(Deferred(), signal)
        self.failureResultOf(gone, ClientGone)

    def test_cancellingTheViewLeavesTheDoneAlone(self):
        """
        Cancelling the view (the turn's own Deferred was cancelled) does
        not cancel C{done}.
        """
        from relay.engine.cancel import raceDeparture
        from relay.base.records import CancelSignal

        cancelled = []
        done = Deferred(lambda _: cancelled.append(True))
        view = raceDeparture(done, CancelSignal())
        view.cancel()
        self.failureResultOf(view, CancelledError)
        self.assertEqual(cancelled, [])
