"""
Tests for L{relay.entry.adminguard}: the back-off of admin key guesses per
address, on an injected clock.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from relay.entry import adminguard
from relay.entry.adminguard import AdminGuard


class AdminGuardTests(SynchronousTestCase):
    """
    L{AdminGuard} on a L{Clock}.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.guard = AdminGuard(clock=self.clock)
        self.lines = []
        observer = lambda e: self.lines.append(e) if e.get("event") == "relay.admin_key_backoff" else None  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def wait(self, address="10.0.0.1"):
        """
        @return: the C{Retry-After} seconds C{address} is told, or L{None}.
        """
        error = self.guard.refusal(address)
        if error is None:
            return None
        self.assertEqual((error.status, error.code), (429, "admin_key_backoff"))
        return int(dict(error.headers)["Retry-After"])

    def test_threshold_then_doubling_capped(self):
        """
        Four wrong keys pass; the fifth starts a 1 s wait; each wrong key
        after a wait doubles it, up to L{adminguard.MAX_SECONDS}.
        """
        for _ in range(adminguard.THRESHOLD - 1):
            self.guard.failed("10.0.0.1")
            self.assertIsNone(self.wait())
        self.guard.failed("10.0.0.1")
        waits = [self.wait()]
        for _ in range(12):
            self.clock.advance(waits[-1])
            self.assertIsNone(self.wait())
            self.guard.failed("10.0.0.1")
            waits.append(self.wait())
        self.assertEqual(waits[:6], [1, 2, 4, 8, 16, 32])
        self.assertEqual(waits[-1], adminguard.MAX_SECONDS)
        self.assertIsNone(self.wait("10.0.0.2"))  # per address

    def test_ipv6_counts_its_64(self):
        """
        The addresses of one IPv6 /64 are counted together.
        """
        for i in range(adminguard.THRESHOLD):
            self.guard.failed(f"2001:db8:1:2::{i + 1:x}")
        self.assertEqual(self.wait("2001:db8:1:2:ffff::9"), 1)
        self.assertIsNone(self.wait("2001:db8:1:3::1"))

    def test_success_resets_and_time_forgets(self):
        """
        A right key resets the address; so does a long quiet time.
        """
        for _ in range(adminguard.THRESHOLD):
            self.guard.failed("a")
        self.clock.advance(1)
        self.guard.succeeded("a")
        for _ in range(adminguard.THRESHOLD - 1):
            self.guard.failed("a")
        self.assertIsNone(self.wait("a"))
        for _ in range(adminguard.THRESHOLD + 3):
            self.guard.failed("b")
            self.clock.advance(adminguard.MAX_SECONDS)
        self.clock.advance(adminguard.FORGET_SECONDS + 1)
        self.guard.failed("b")
        self.assertIsNone(self.wait("b"))

    def test_window(self):
        """
        Wrong keys spread wider than the window never start a wait.
        """
        for _ in range(50):
            self.guard.failed("a")
            self.clock.advance(adminguard.WINDOW / (adminguard.THRESHOLD - 1) + 0.1)
            self.assertIsNone(self.wait("a"))

    def test_memory_bounded(self):
        """
        At most C{maxAddresses} addresses are tracked, the least recently
        seen dropped first.
        """
        guard = AdminGuard(clock=self.clock, maxAddresses=100)
        for i in range(10_000):
            guard.failed(f"10.{i // 256}.{i % 256}.1")
        self.assertEqual(len(guard._addresses), 100)

    def test_one_throttled_warning(self):
        """
        Thousands of guesses from many addresses: one warning a minute,
        the next one counting those left out.
        """
        for i in range(2400):
            self.guard.failed(f"10.0.{i % 50}.1")
        self.assertEqual(len(self.lines), 1)
        self.clock.advance(adminguard.LOG_INTERVAL)
        for i in range(50):
            self.clock.advance(1)
            self.guard.failed(f"10.0.{i % 50}.1")
        self.assertEqual(len(self.lines), 2)
        self.assertGreater(self.lines[1]["suppressed"], 0)
