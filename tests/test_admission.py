"""
Tests for L{relay.admission.memory}: slots, wait plans, FIFO order,
cancellation, deadlines and a randomized no-leak soak (behaviour.md group D,
R-B2).
"""

from __future__ import annotations

import random

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.admission.memory import MemorySlotAdmission
from relay.interfaces import ISlotAdmission, ISlotLease
from relay.base.records import AdmissionError, CancelSignal, WaitPlan

T0 = 1_700_000_000.0


def plan(id="a", limit=1, timeout=30.0, maxWaiting=10, kind="account"):
    """
    @return: a L{WaitPlan} for tests.
    """
    return WaitPlan(kind=kind, id=id, max_concurrency=limit, timeout=timeout, max_waiting=maxWaiting)


class MemorySlotAdmissionTests(SynchronousTestCase):
    """
    L{MemorySlotAdmission} on a L{Clock}.
    """

    def setUp(self):
        """
        A clock at L{T0} and a fresh admission.
        """
        self.clock = Clock()
        self.clock.advance(T0)
        self.adm = MemorySlotAdmission(clock=self.clock)

    def load(self, id="a", kind="account"):
        """
        @return: C{(inUse, waiting)} for one id.
        """
        return self.successResultOf(self.adm.load(kind, [id]))[id]

    def reason(self, d):
        """
        @return: the L{AdmissionError} a Deferred failed with.
        """
        return self.failureResultOf(d, AdmissionError).value

    def test_interfaces(self):
        """
        The admission and its leases provide their interfaces.
        """
        self.assertTrue(verifyObject(ISlotAdmission, self.adm))
        lease = self.successResultOf(self.adm.tryAcquire("account", "a", 1))
        self.assertTrue(verifyObject(ISlotLease, lease))
        self.assertEqual((lease.kind, lease.id, lease.waitedSeconds, lease.queuePosition),
                         ("account", "a", 0.0, 0))
        self.assertIsNone(self.successResultOf(lease.renew()))

    def test_tryAcquireLimit(self):
        """
        C{tryAcquire} grants up to C{limit} slots per key and kind; release
        frees one; release is idempotent.
        """
        a = self.successResultOf(self.adm.tryAcquire("account", "a", 2))
        b = self.successResultOf(self.adm.tryAcquire("account", "a", 2))
        self.assertIsNone(self.successResultOf(self.adm.tryAcquire("account", "a", 2)))
        self.assertIsNotNone(self.successResultOf(self.adm.tryAcquire("user", "a", 1)))
        self.assertIsNotNone(self.successResultOf(self.adm.tryAcquire("account", "b", 1)))
        self.assertEqual(self.load(), (2, 0))
        a.release()
        a.release()
        self.assertEqual(self.load(), (1, 0))
        b.release()
        self.assertEqual(self.load(), (0, 0))

    def test_unlimited(self):
        """
        R27: a limit <= 0 is unlimited.
        """
        for limit in (0, -1):
            leases = [self.successResultOf(self.adm.tryAcquire("account", "u", limit))
                      for _ in range(50)]
            self.assertNotIn(None, leases)
            for lease in leases:
                lease.release()
        lease = self.successResultOf(self.adm.acquire(plan("u", limit=0), CancelSignal()))
        lease.release()
        self.assertEqual(self.load("u"), (0, 0))

    def test_acquireFastPath(self):
        """
        R27 step 1: a free slot is taken at once without queueing.
        """
        lease = self.successResultOf(self.adm.acquire(plan(), CancelSignal()))
        self.assertEqual((lease.waitedSeconds, lease.queuePosition), (0.0, 0))
        self.assertEqual(self.load(), (1, 0))

    def test_queueFull(self):
        """
        R27 step 2: with C{max_waiting} waiters queued, the next is refused
        with C{queue_full} at once and the count stays.
        """
        self.adm.tryAcquire("account", "a", 1)
        waits = [self.adm.acquire(plan(maxWaiting=2), CancelSignal()) for _ in range(2)]
        for d in waits:
            self.assertNoResult(d)
        self.assertEqual(self.load(), (1, 2))
        err = self.reason(self.adm.acquire(plan(maxWaiting=2), CancelSignal()))
        self.assertEqual(err.reason, "queue_full")
        self.assertEqual(err.queuePosition, 0)
        self.assertEqual(self.load(), (1, 2))

    def test_noQueue(self):
        """
        C{max_waiting} 0 refuses a busy slot with C{queue_full}.
        """
        self.adm.tryAcquire("account", "a", 1)
        self.assertEqual(self.reason(self.adm.acquire(plan(maxWaiting=0), CancelSignal())).reason,
                         "queue_full")

    def test_fifo(self):
        """
        R-B2: three waiters are served in arrival order, each as soon as a
        slot is released (no polling), with its queue position and wait.
        """
        first = self.successResultOf(self.adm.tryAcquire("account", "a", 1))
        waits = [self.adm.acquire(plan(), CancelSignal()) for _ in range(3)]
        self.assertEqual(self.load(), (1, 3))
        got = []
        for i, d in enumerate(waits):
            d.addCallback(lambda lease, i=i: got.append((i, lease)) or lease)
        self.clock.advance(1)
        first.release()
        self.assertEqual([i for i, _ in got], [0])
        self.assertEqual(got[0][1].queuePosition, 1)
        self.assertEqual(got[0][1].waitedSeconds, 1.0)
        self.clock.advance(2)
        got[0][1].release()
        self.assertEqual([i for i, _ in got], [0, 1])
        self.assertEqual(got[1][1].queuePosition, 2)
        got[1][1].release()
        self.assertEqual([i for i, _ in got], [0, 1, 2])
        self.assertEqual(self.load(), (1, 0))
        got[2][1].release()
        self.assertEqual(self.load(), (0, 0))

    def test_newcomerDoesNotJump(self):
        """
        R-B2: while someone waits, a fast try by a newcomer fails even if a
        slot frees at that instant; the head gets it.
        """
        first = self.successResultOf(self.adm.tryAcquire("account", "a", 1))
        waiting = self.adm.acquire(plan(), CancelSignal())
        self.assertIsNone(self.successResultOf(self.adm.tryAcquire("account", "a", 1)))
        first.release()
        self.assertIsNone(self.successResultOf(self.adm.tryAcquire("account", "a", 1)))
        self.successResultOf(waiting).release()
        self.assertIsNotNone(self.successResultOf(self.adm.tryAcquire("account", "a", 1)))

    def test_timeout(self):
        """
        R27 step 3: the wait times out after the plan timeout with
        C{timeout}; the wait count is back to 0 and the holder is untouched.
        """
        self.adm.tryAcquire("account", "a", 1)
        d = self.adm.acquire(plan(timeout=30), CancelSignal())
        self.clock.advance(29.9)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        err = self.reason(d)
        self.assertEqual((err.reason, err.queuePosition), ("timeout", 1))
        self.assertAlmostEqual(err.waitedSeconds, 30.0)
        self.assertEqual(self.load(), (1, 0))

    def test_cancelSignal(self):
        """
        R30/R33: a client cancellation ends the wait with C{client_gone};
        the wait count is back to 0 and later waiters keep their order.
        """
        holder = self.successResultOf(self.adm.tryAcquire("account", "a", 1))
        cancel = CancelSignal()
        d1 = self.adm.acquire(plan(), cancel)
        d2 = self.adm.acquire(plan(), CancelSignal())
        cancel.cancel()
        self.assertEqual(self.reason(d1).reason, "client_gone")
        self.assertEqual(self.load(), (1, 1))
        holder.release()
        self.assertEqual(self.successResultOf(d2).queuePosition, 2)
        self.assertEqual(self.load(), (1, 0))
        self.assertEqual(cancel._waiters, [])

    def test_alreadyCancelled(self):
        """
        An already-cancelled turn is refused with C{client_gone} even when a
        slot is free.
        """
        cancel = CancelSignal()
        cancel.cancel()
        self.assertEqual(self.reason(self.adm.acquire(plan(), cancel)).reason, "client_gone")
        self.assertEqual(self.load(), (0, 0))

    def test_deferredCancel(self):
        """
        Cancelling the returned Deferred leaves the queue with
        C{client_gone} and detaches from the L{CancelSignal}.
        """
        self.adm.tryAcquire("account", "a", 1)
        cancel = CancelSignal()
        d = self.adm.acquire(plan(), cancel)
        d.cancel()
        self.assertEqual(self.reason(d).reason, "client_gone")
        self.assertEqual(self.load(), (1, 0))
        self.assertEqual(cancel._waiters, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_deadlineBoundsWait(self):
        """
        R33: a deadline earlier than the plan timeout ends the wait with
        C{timeout} at the deadline.
        """
        self.adm.tryAcquire("account", "a", 1)
        d = self.adm.acquire(plan(timeout=120), CancelSignal(), deadline=T0 + 5)
        self.clock.advance(5)
        self.assertEqual(self.reason(d).reason, "timeout")
        self.assertEqual(self.load(), (1, 0))

    def test_deadlinePassed(self):
        """
        R33: a deadline already passed fails with C{timeout} without taking
        a free slot.
        """
        d = self.adm.acquire(plan(), CancelSignal(), deadline=T0)
        self.assertEqual(self.reason(d).reason, "timeout")
        self.assertEqual(self.load(), (0, 0))

    def test_slotAtDeadlineReleased(self):
        """
        R33: a slot freed at the same moment the deadline passes is not
        given to the expired waiter; it goes to the next one.
        """
        holder = self.successResultOf(self.adm.tryAcquire("account", "a", 1))
        late = self.adm.acquire(plan(), CancelSignal(), deadline=T0 + 5)
        nxt = self.adm.acquire(plan(), CancelSignal())
        # Move time without running the timer: the release comes first.
        self.clock.rightNow = T0 + 5
        holder.release()
        self.assertEqual(self.reason(late).reason, "timeout")
        self.successResultOf(nxt).release()
        self.clock.advance(0)
        self.assertEqual(self.load(), (0, 0))

    def test_releaseInCallback(self):
        """
        A waiter that releases inside its callback hands the slot on to the
        next waiter.
        """
        holder = self.successResultOf(self.adm.tryAcquire("account", "a", 1))
        d1 = self.adm.acquire(plan(), CancelSignal())
        d1.addCallback(lambda lease: lease.release())
        d2 = self.adm.acquire(plan(), CancelSignal())
        holder.release()
        self.successResultOf(d1)
        self.successResultOf(d2).release()
        self.assertEqual(self.load(), (0, 0))

    def test_sharedWaitCounter(self):
        """
        R29: every entrypoint waiting on one account shares its counter and
        its C{max_waiting}; users have their own queues.
        """
        self.adm.tryAcquire("account", "a", 1)
        self.adm.tryAcquire("user", "a", 1)
        self.adm.acquire(plan(maxWaiting=1), CancelSignal())
        err = self.reason(self.adm.acquire(plan(maxWaiting=1), CancelSignal()))
        self.assertEqual(err.reason, "queue_full")
        self.assertNoResult(self.adm.acquire(plan(kind="user", maxWaiting=1), CancelSignal()))
        self.assertEqual(self.load(), (1, 1))
        self.assertEqual(self.load(kind="user"), (1, 1))

    def test_soak(self):
        """
        A seeded random mix of acquires, releases, cancellations, timeouts
        and deadlines never exceeds a limit and leaves no slot or wait count
        behind.
        """
        rng = random.Random(1234)
        ids = ["a", "b", "c"]
        limits = {"a": 1, "b": 2, "c": 3}
        held, cancels = [], []
        for step in range(3000):
            op = rng.random()
            aid = rng.choice(ids)
            if op < 0.45:
                cancel = CancelSignal()
                deadline = self.clock.seconds() + rng.uniform(0, 5) if rng.random() < 0.2 else None
                d = self.adm.acquire(
                    plan(aid, limit=limits[aid], timeout=rng.uniform(0, 4), maxWaiting=rng.randint(0, 4)),
                    cancel, deadline=deadline,
                )
                d.addCallbacks(held.append, lambda f: f.trap(AdmissionError))
                cancels.append(cancel)
            elif op < 0.7 and held:
                held.pop(rng.randrange(len(held))).release()
            elif op < 0.8 and cancels:
                cancels.pop(rng.randrange(len(cancels))).cancel()
            else:
                self.clock.advance(rng.uniform(0, 1))
            for i in ids:
                inUse, _ = self.load(i)
                self.assertLessEqual(inUse, limits[i])
        self.clock.advance(10)
        for lease in held:
            lease.release()
            lease.release()
        for i in ids:
            self.assertEqual(self.load(i), (0, 0))
        self.assertEqual(self.adm._held, {})
        self.assertEqual(self.adm._queues, {})
        self.assertEqual(self.clock.getDelayedCalls(), [])
