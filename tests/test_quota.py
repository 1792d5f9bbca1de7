"""
Issue 12: usage windows (protocol.md 7.3) and quota-aware scheduling
(L{relay.scheduling.quota}, the load-balance layer of L{relay.scheduling.scheduler}).
"""

from __future__ import annotations

import json
import random

from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.memory import MemorySlotAdmission
from relay.base.records import Account, GatewaySettings, SchedulingSettings
from relay.oauth.windows import windowsFromEvent, windowsFromHeaders
from relay.scheduling.quota import UsageCollector, UsageWindows
from relay.scheduling.scheduler import AccountScheduler
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore
from tests.test_scheduler import turn

NOW = 1_800_000_000.0


def oauth(accountId, priority=50) -> Account:
    return Account(id=accountId, type="oauth", base_url="https://chatgpt.com/backend-api/codex",
                   credential="t", chatgpt_account_id="c", priority=priority)


def headers(primary, secondary=None, reset=3600, after=False) -> dict:
    out = {"x-codex-primary-used-percent": str(primary), "x-codex-primary-window-minutes": "300",
           "x-codex-plan-type": "plus"}
    if after:
        out["x-codex-primary-reset-after-seconds"] = str(reset)
    else:
        out["x-codex-primary-reset-at"] = str(int(NOW + reset))
    if secondary is not None:
        out["x-codex-secondary-used-percent"] = str(secondary)
        out["x-codex-secondary-reset-at"] = str(int(NOW + 7 * 86400))
    return out


class ParseTests(SynchronousTestCase):
    """
    protocol.md 7.3: headers and C{codex.rate_limits} events.
    """

    def test_headers(self):
        """
        Both windows, the relative reset form, the plan; nothing without a
        used-percent.
        """
        snap = windowsFromHeaders(headers(42.5, 10), NOW)
        self.assertEqual(snap.primary.used_percent, 42.5)
        self.assertEqual(snap.primary.reset_at, NOW + 3600)
        self.assertEqual(snap.secondary.used_percent, 10)
        self.assertEqual(snap.plan, "plus")
        self.assertEqual(windowsFromHeaders(headers(5, after=True, reset=90), NOW)
                         .primary.reset_at, NOW + 90)
        self.assertIsNone(windowsFromHeaders({"x-codex-primary-reset-at": "1"}, NOW))

    def test_event(self):
        """
        A C{codex.rate_limits} event gives the same snapshot.
        """
        event = {"type": "codex.rate_limits", "plan_type": "pro", "rate_limits": {
            "primary": {"used_percent": 12, "window_minutes": 300, "reset_at": NOW + 60},
            "secondary": {"used_percent": 3, "window_minutes": 10080, "resets_in_seconds": 600}}}
        snap = windowsFromEvent(event, NOW)
        self.assertEqual((snap.primary.used_percent, snap.secondary.reset_at, snap.plan),
                         (12, NOW + 600, "pro"))
        self.assertIsNone(windowsFromEvent({"type": "codex.rate_limits"}, NOW))

    def test_recordAndExpire(self):
        """
        Observations from headers and frames replace each other; a window
        whose reset has passed counts as empty; other frames are ignored.
        """
        clock = Clock()
        clock.advance(NOW)
        windows = UsageWindows(clock=clock)
        a = oauth("a")
        windows.observeHeaders(a, {"content-type": "text/event-stream"})
        self.assertIsNone(windows.get("a"))
        windows.observeHeaders(a, headers(80, 20, reset=100))
        self.assertEqual(windows.get("a").used(NOW), 80)
        windows.observeFrame(a, b'{"type":"response.created"}')
        frame = {"type": "codex.rate_limits", "rate_limits": {
            "primary": {"used_percent": 90, "reset_at": NOW + 100}}}
        windows.observeFrame(a, json.dumps(frame).encode())
        self.assertEqual(windows.get("a").used(NOW), 90)
        self.assertEqual(windows.get("a").source, "event")
        clock.advance(101)
        self.assertEqual(windows.get("a").used(clock.seconds()), 0)
        self.assertEqual(windows.view("a")["primary"]["used_percent"], 0)

    def test_rank(self):
        """
        The quota key: over the threshold (either window) last, then whole
        used points of the fuller window, then the earliest reset; unknown
        accounts count as empty.
        """
        clock = Clock()
        clock.advance(NOW)
        windows = UsageWindows(clock=clock)
        windows.observeHeaders(oauth("a"), headers(40.7, 10, reset=500))
        windows.observeHeaders(oauth("b"), headers(10, 96))
        self.assertEqual(windows.rank("a", 95), (False, 40, NOW + 500))
        self.assertEqual(windows.rank("b", 95)[:2], (True, 96))
        self.assertEqual(windows.rank("b", 97)[:2], (False, 96))
        self.assertEqual(windows.rank("zzz", 95)[:2], (False, 0))

    def test_collector(self):
        """
        The Prometheus gauges carry each account's windows.
        """
        clock = Clock()
        clock.advance(NOW)
        windows = UsageWindows(clock=clock)
        windows.observeHeaders(oauth("a"), headers(40, 10))
        registry = CollectorRegistry()
        registry.register(UsageCollector(windows))
        text = generate_latest(registry).decode()
        self.assertIn('relay_account_usage_percent{account="a",window="primary"} 40.0', text)
        self.assertIn('relay_account_usage_reset_timestamp_seconds{account="a",window="primary"}',
                      text)


class QuotaOrderTests(SynchronousTestCase):
    """
    The load-balance layer with quota-aware ordering.
    """

    def build(self, accounts, **scheduling):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.windows = UsageWindows(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)
        self.scheduler = AccountScheduler(
            accounts=list(accounts), admission=self.admission,
            store=MemoryStateStore(clock=self.clock), clock=self.clock,
            settings=RuntimeSettings(GatewaySettings(scheduling=SchedulingSettings(**scheduling))),
            random=random.Random(3), quota=self.windows,
        )

    def pick(self):
        selection = self.successResultOf(self.scheduler.select(turn()))
        selection.lease.release()
        return selection

    def test_mostRemainingFirst(self):
        """
        Among equal priority the account with the most remaining window is
        chosen even when it was used last; the record says quota decided.
        """
        self.build([oauth("a"), oauth("b"), oauth("c")])
        self.windows.observeHeaders(oauth("a"), headers(60))
        self.windows.observeHeaders(oauth("b"), headers(20))
        self.windows.observeHeaders(oauth("c"), headers(45))
        picks = [self.pick() for _ in range(3)]
        self.assertEqual([p.account.id for p in picks], ["b", "b", "b"])
        self.assertTrue(picks[1].record.quota_decided)
        self.assertEqual(picks[0].record.quota_used_percent, 20)

    def test_tieBreakEarliestReset(self):
        """
        Equal used points: the window that resets first is drained first.
        """
        self.build([oauth("a"), oauth("b")])
        self.windows.observeHeaders(oauth("a"), headers(30.2, reset=9000))
        self.windows.observeHeaders(oauth("b"), headers(30.9, reset=100))
        self.assertEqual(self.pick().account.id, "b")

    def test_thresholdOnlyWhenNoneBelow(self):
        """
        An account at or above the threshold in either window is used only
        when no account of its priority below it can serve; priority still
        comes first.
        """
        self.build([oauth("a"), oauth("b"), oauth("p", priority=10)], quota_threshold_percent=95)
        self.windows.observeHeaders(oauth("a"), headers(10, 97))
        self.windows.observeHeaders(oauth("b"), headers(94))
        self.windows.observeHeaders(oauth("p"), headers(99))
        self.assertEqual(self.pick().account.id, "p")
        self.successResultOf(self.admission.tryAcquire("account", "p", 0))
        self.successResultOf(self.admission.tryAcquire("account", "p", 0))
        self.successResultOf(self.admission.tryAcquire("account", "p", 0))
        self.assertEqual(self.pick().account.id, "b")
        for _ in range(3):
            self.successResultOf(self.admission.tryAcquire("account", "b", 0))
        self.assertEqual(self.pick().account.id, "a")

    def test_blockedWhileAcquiring(self):
        """
        Found by the chaos soak (issue 14): when the chosen account becomes
        unschedulable while its slot acquire is in flight (another turn's
        429 or breaker, a Redis round trip), the selection still returns
        the slot it took -- before, working out C{quota_decided} met no
        compatible peer, C{min()} of nothing raised, the turn died with a
        502 and the slot it held was never given back.
        """
        blocked = set()
        pending = []

        class SlowAdmission(MemorySlotAdmission):
            def tryAcquire(self, kind, id, limit):
                d = Deferred()
                pending.append((d, super().tryAcquire(kind, id, limit)))
                return d

        self.clock = Clock()
        self.clock.advance(NOW)
        self.windows = UsageWindows(clock=self.clock)
        self.admission = SlowAdmission(clock=self.clock)
        self.scheduler = AccountScheduler(
            accounts=[oauth("a")], admission=self.admission,
            store=MemoryStateStore(clock=self.clock), clock=self.clock,
            settings=RuntimeSettings(GatewaySettings()), random=random.Random(3),
            quota=self.windows,
            extraBlock=lambda a, now, model: ("rate_limited", now + 5) if a.id in blocked
            else None,
        )
        d = self.scheduler.select(turn())
        blocked.add("a")
        acquired, inner = pending.pop()
        inner.chainDeferred(acquired)
        selection = self.successResultOf(d)
        self.assertEqual(selection.account.id, "a")
        self.assertFalse(selection.record.quota_decided)
        self.assertEqual(self.successResultOf(self.admission.load("account", ["a"]))["a"][0], 1)
        selection.lease.release()

    def test_plainWhenOff(self):
        """
        With C{quota_aware: false} usage is ignored (least recently used
        first) and the record never says quota decided.
        """
        self.build([oauth("a"), oauth("b")], quota_aware=False)
        self.windows.observeHeaders(oauth("a"), headers(90))
        self.windows.observeHeaders(oauth("b"), headers(1))
        first = self.pick()
        self.clock.advance(2)
        second = self.pick()
        self.assertEqual({first.account.id, second.account.id}, {"a", "b"})
        self.assertFalse(first.record.quota_decided or second.record.quota_decided)
