"""
Tests for L{relay.eager.eagerDeferred} (issue 16).
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from relay.eager import eagerDeferred


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
