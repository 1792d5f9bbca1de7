"""
Tests for L{relay.console.history}: the per-account, per-minute history behind the
status page's charts (issue 15).
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.console.history import BUCKET_SECONDS, LATENCY_BINS, AccountHistory
from relay.interfaces import IAccountHistory


class AccountHistoryTests(SynchronousTestCase):
    """
    L{AccountHistory} on a L{Clock}.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_800_000_000)  # a whole minute
        self.history = AccountHistory(clock=self.clock)

    def test_interface(self):
        """
        It provides L{IAccountHistory}.
        """
        self.assertTrue(verifyObject(IAccountHistory, self.history))

    def test_emptySnapshot(self):
        """
        Nothing recorded: no accounts, and the window ends with the current
        minute.
        """
        snap = self.history.snapshot()
        self.assertEqual(snap["minutes"], 15)
        self.assertEqual(snap["bucket_seconds"], BUCKET_SECONDS)
        self.assertEqual(snap["start"], 1_800_000_000 - 14 * 60)
        self.assertEqual(snap["accounts"], {})

    def test_countsPerMinute(self):
        """
        Attempts and failovers land in the current minute's bucket, oldest
        bucket first, each list 15 long.
        """
        h = self.history
        h.attempt("a1")
        h.attempt("a2")
        h.failover("a2")
        self.clock.advance(60)
        h.attempt("a1")
        h.attempt("a1")
        a1 = h.snapshot()["accounts"]["a1"]
        a2 = h.snapshot()["accounts"]["a2"]
        self.assertEqual(a1["requests"], [0] * 13 + [1, 2])
        self.assertEqual(a1["failovers"], [0] * 15)
        self.assertEqual(a2["requests"], [0] * 13 + [1, 0])
        self.assertEqual(a2["failovers"], [0] * 13 + [1, 0])
        self.assertEqual(a1["first_output_p50_ms"], [None] * 15)

    def test_windowSlides(self):
        """
        Minutes older than the window drop out of the snapshot, and at
        most 15 buckets are kept per account (bounded memory).
        """
        h = self.history
        for _ in range(40):
            h.attempt("a1")
            self.clock.advance(60)
        h.attempt("a1")
        self.assertEqual(h.snapshot()["accounts"]["a1"]["requests"], [1] * 15)
        self.assertEqual(len(h._accounts["a1"]), 15)
        self.clock.advance(20 * 60)
        self.assertEqual(h.snapshot()["accounts"]["a1"]["requests"], [0] * 15)

    def test_medianLatency(self):
        """
        The first-output p50 of a minute is its median, within the bins'
        resolution (about 5 %), in milliseconds.
        """
        h = self.history
        for seconds in (0.1, 0.2, 0.3, 0.4, 5.0):
            h.firstOutput("a1", seconds)
        (p50,) = [v for v in h.snapshot()["accounts"]["a1"]["first_output_p50_ms"] if v]
        self.assertLessEqual(abs(p50 - 300), 300 * 0.06, p50)
        self.clock.advance(60)
        h.firstOutput("a1", 0.0004)
        self.assertEqual(h.snapshot()["accounts"]["a1"]["first_output_p50_ms"][-1], 0.5)

    def test_latencyMemoryBounded(self):
        """
        However many and however slow, a minute's latencies take at most
        L{LATENCY_BINS} counters.
        """
        h = self.history
        for i in range(5000):
            h.firstOutput("a1", i * 3.7)
        h.firstOutput("a1", 10**9)
        (bucket,) = h._accounts["a1"]
        self.assertLessEqual(len(bucket.latencies), LATENCY_BINS)
        self.assertEqual(sum(bucket.latencies.values()), 5001)
