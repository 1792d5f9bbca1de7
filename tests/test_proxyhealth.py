"""
Tests for L{relay.policy.proxyhealth.ProxyHealth} (issue 8: proxy quarantine after
mid-stream cuts) and its use as the scheduler's C{isQuarantined} hook
(behaviour.md R41), with a L{Clock}.
"""

from __future__ import annotations

import random

from twisted.internet.task import Clock
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.memory import MemorySlotAdmission
from relay.base.records import Account, ClientKey, GatewaySettings, ProxySpec, Turn
from relay.policy.proxyhealth import ProxyHealth
from relay.scheduling.scheduler import AccountScheduler
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore

PROXY_A = ProxySpec(
    id="px-a", scheme="socks5h", host="10.9.8.7", port=1080, username="u", password="sekrit"
)
PROXY_B = ProxySpec(id="px-b", scheme="http", host="proxy-b.example", port=3128)
START = 1_000_000.0


def account(id, proxy=None):
    """
    An API-key L{Account} behind C{proxy}.
    """
    return Account(
        id=id, type="apikey", base_url="https://api.example/v1", credential="c", proxy=proxy
    )


def turn():
    """
    An HTTP streaming L{Turn} for C{gpt-5}.
    """
    return Turn(
        entrypoint="http",
        endpoint="responses",
        client=ClientKey(name="alice", key="sk-alice"),
        model="gpt-5",
        body={},
        stream=True,
        requestId="req-1",
    )


class ProxyHealthTests(SynchronousTestCase):
    """
    Quarantine bookkeeping.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(START)
        self.health = ProxyHealth(clock=self.clock)
        self.events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)

    def logged(self, name):
        """
        The logged events named C{name}.
        """
        return [e for e in self.events if e.get("event") == name]

    def test_twoCutsWithinWindowQuarantine(self):
        """
        Two mid-stream cuts through one proxy within 60 s quarantine that
        proxy for 600 s from the second cut, and log
        C{relay.proxy_quarantined} with id, host, port and until.
        """
        a1 = account("a1", PROXY_A)
        self.assertIsNone(self.health.streamCut(a1))
        self.assertFalse(self.health.isQuarantined(a1))
        self.clock.advance(59)
        until = self.health.streamCut(a1)
        self.assertEqual(until, START + 59 + 600)
        self.assertTrue(self.health.isQuarantined(a1))
        [event] = self.logged("relay.proxy_quarantined")
        self.assertEqual(event["proxy_id"], "px-a")
        self.assertEqual(event["proxy_host"], "10.9.8.7")
        self.assertEqual(event["proxy_port"], 1080)
        self.assertEqual(event["until"], until)

    def test_cutsSixtyOneSecondsApartDoNot(self):
        """
        Two cuts 61 s apart are not in one window: no quarantine.
        """
        a1 = account("a1", PROXY_A)
        self.health.streamCut(a1)
        self.clock.advance(61)
        self.assertIsNone(self.health.streamCut(a1))
        self.assertFalse(self.health.isQuarantined(a1))
        self.assertEqual(self.logged("relay.proxy_quarantined"), [])

    def test_sharedByAccountsOnTheSameProxy(self):
        """
        Cuts count per proxy id, not per account: one cut on each of two
        accounts behind the same proxy quarantines both; an account on
        another proxy or without one is unaffected.
        """
        a1, a2 = account("a1", PROXY_A), account("a2", PROXY_A)
        b1, direct = account("b1", PROXY_B), account("d1")
        self.health.streamCut(a1)
        self.health.streamCut(a2)
        self.assertTrue(self.health.isQuarantined(a1))
        self.assertTrue(self.health.isQuarantined(a2))
        self.assertFalse(self.health.isQuarantined(b1))
        self.assertFalse(self.health.isQuarantined(direct))

    def test_directAccountIgnored(self):
        """
        A cut on an account without a proxy records nothing.
        """
        direct = account("d1")
        self.assertIsNone(self.health.streamCut(direct))
        self.assertIsNone(self.health.streamCut(direct))
        self.assertFalse(self.health.isQuarantined(direct))
        self.assertEqual(self.health.snapshot(), {})

    def test_expiresAfterSixHundredSeconds(self):
        """
        The quarantine ends 600 s after it started, logging
        C{relay.proxy_quarantine_lifted} once; a new cut after that starts
        counting from zero.
        """
        a1 = account("a1", PROXY_A)
        self.health.streamCut(a1)
        self.health.streamCut(a1)
        self.clock.advance(599)
        self.assertTrue(self.health.isQuarantined(a1))
        self.assertEqual(self.logged("relay.proxy_quarantine_lifted"), [])
        self.clock.advance(1)
        self.assertFalse(self.health.isQuarantined(a1))
        self.assertFalse(self.health.isQuarantined(a1))
        [lifted] = self.logged("relay.proxy_quarantine_lifted")
        self.assertEqual(lifted["proxy_id"], "px-a")
        self.assertEqual(lifted["proxy_port"], 1080)
        self.assertIsNone(self.health.streamCut(a1))
        self.assertFalse(self.health.isQuarantined(a1))

    def test_cutsDuringQuarantineDoNotExtendIt(self):
        """
        Cuts recorded while quarantined do not move its end.
        """
        a1 = account("a1", PROXY_A)
        self.health.streamCut(a1)
        until = self.health.streamCut(a1)
        self.clock.advance(10)
        self.assertIsNone(self.health.streamCut(a1))
        self.assertIsNone(self.health.streamCut(a1))
        self.assertEqual(self.health.quarantinedUntil("px-a"), until)

    def test_snapshot(self):
        """
        L{ProxyHealth.snapshot} maps proxy id to state, until and recent
        cuts (plus host and port), and never contains credentials.
        """
        a1, b1 = account("a1", PROXY_A), account("b1", PROXY_B)
        self.health.streamCut(a1)
        self.health.streamCut(a1)
        self.health.streamCut(b1)
        snap = self.health.snapshot()
        self.assertEqual(snap["px-a"]["state"], "quarantined")
        self.assertEqual(snap["px-a"]["until"], START + 600)
        self.assertEqual(snap["px-a"]["total_cuts"], 2)
        self.assertEqual(snap["px-a"]["quarantines"], 1)
        self.assertEqual((snap["px-a"]["host"], snap["px-a"]["port"]), ("10.9.8.7", 1080))
        self.assertEqual(snap["px-b"], {
            "state": "ok", "until": None, "cuts": 1, "total_cuts": 1, "quarantines": 0,
            "host": "proxy-b.example", "port": 3128,
        })
        self.assertNotIn("sekrit", repr(snap))
        self.clock.advance(600)
        snap = self.health.snapshot()
        self.assertEqual(snap["px-a"]["state"], "ok")
        self.assertIsNone(snap["px-a"]["until"])
        self.assertEqual(snap["px-b"]["cuts"], 0)

    def test_logsNeverCarryCredentials(self):
        """
        No logged event of a cut, quarantine or lift holds the proxy
        password or user name.
        """
        a1 = account("a1", PROXY_A)
        self.health.streamCut(a1)
        self.health.streamCut(a1)
        self.clock.advance(600)
        self.health.snapshot()
        self.assertTrue(self.events)
        for event in self.events:
            self.assertNotIn("sekrit", repr(event))
            self.assertNotIn("'u'", repr({k: v for k, v in event.items() if k != "log_logger"}))


class SchedulerIntegrationTests(SynchronousTestCase):
    """
    L{ProxyHealth.isQuarantined} as the L{AccountScheduler} hook.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(START)
        self.health = ProxyHealth(clock=self.clock)
        self.events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)

    def scheduler(self, accounts):
        """
        A scheduler over memory providers using C{self.health}.
        """
        return AccountScheduler(
            accounts=list(accounts),
            admission=MemorySlotAdmission(clock=self.clock),
            store=MemoryStateStore(clock=self.clock),
            clock=self.clock,
            settings=RuntimeSettings(GatewaySettings()),
            random=random.Random(1),
            isQuarantined=self.health.isQuarantined,
        )

    def test_quarantinedAccountSkipped(self):
        """
        The preferred (first) account is behind a quarantined proxy, so the
        scheduler picks the direct one; once the quarantine ends the first
        account is chosen again.
        """
        a1, d1 = account("a1", PROXY_A), account("d1")
        sched = self.scheduler([a1, d1])
        self.health.streamCut(a1)
        self.health.streamCut(a1)
        selection = self.successResultOf(sched.select(turn()))
        self.assertEqual(selection.account.id, "d1")
        selection.lease.release()
        self.clock.advance(600)
        selection = self.successResultOf(sched.select(turn()))
        self.assertEqual(selection.account.id, "a1")

    def test_allQuarantinedFailsOpen(self):
        """
        When every candidate is behind a quarantined proxy the scheduler
        fails open (and logs C{openai.proxy_quarantine_fail_open}).
        """
        a1, a2 = account("a1", PROXY_A), account("a2", PROXY_B)
        sched = self.scheduler([a1, a2])
        for a in (a1, a1, a2, a2):
            self.health.streamCut(a)
        selection = self.successResultOf(sched.select(turn()))
        self.assertIn(selection.account.id, ("a1", "a2"))
        self.assertTrue(
            [e for e in self.events if e.get("event") == "openai.proxy_quarantine_fail_open"]
        )
