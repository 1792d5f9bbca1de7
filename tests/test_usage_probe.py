"""
Tests for L{relay.oauth.usageprobe} (issue 21): usage probes of idle OAuth
accounts on an interval and after a cooldown, never more often than
traffic tells, through the account's proxy (R97), once per interval
between processes sharing a state store; and the C{wham/usage} reader of
L{relay.scheduling.quota}.
"""

from __future__ import annotations

import json

from attrs import evolve
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import Account, GatewaySettings, OAuthSettings, ProxySpec
from relay.oauth.usageprobe import UsageProbe, usageURL
from relay.oauth.windows import windowsFromWham
from relay.scheduling.quota import UsageWindows
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore
from tests.test_control_logins import FakeEgress, reply

NOW = 1_800_000_000.0

WHAM = {"plan_type": "pro", "rate_limit": {
    "primary_window": {"used_percent": 42, "limit_window_seconds": 18000,
                       "reset_after_seconds": 600, "reset_at": int(NOW + 600)},
    "secondary_window": {"used_percent": 7, "limit_window_seconds": 604800,
                         "reset_after_seconds": 86400}}}


class FakeCredentials:
    """
    Token state: usable unless the account is in C{blocked}.
    """

    def __init__(self):
        self.blocked = set()

    def blockReason(self, account, now):
        return ("needs_login: test", 0) if account.id in self.blocked else None

    def current(self, account):
        return evolve(account, credential="access-" + account.id)


class ProbeFixture:
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.store = MemoryStateStore(clock=self.clock)
        self.proxy = ProxySpec(id="p1", scheme="http", host="127.0.0.1", port=3128)
        self.accounts = [
            Account(id="o1", type="oauth", base_url="https://chatgpt.com/backend-api/codex",
                    credential="x", chatgpt_account_id="acct-o1", proxy=self.proxy),
            Account(id="k1", type="apikey", base_url="https://api.openai.com/v1",
                    credential="sk"),
        ]
        self.paused = set()
        self.settings = RuntimeSettings(current=GatewaySettings(
            oauth=OAuthSettings(usage_probe_interval_seconds=300)))
        self.probes = [self.makeProbe()]

    def makeProbe(self):
        egress = FakeEgress()
        egress.answer("/backend-api/wham/usage", reply(200, WHAM))
        self.credentials = FakeCredentials()
        return UsageProbe(clock=self.clock, accounts=self.accounts,
                          credentials=self.credentials, quota=UsageWindows(clock=self.clock),
                          egress=egress, settings=self.settings, store=self.store,
                          paused=lambda i: i in self.paused)

    @property
    def probe(self):
        return self.probes[0]

    def tick(self, probe=None):
        self.successResultOf((probe or self.probe).tick())

    def sent(self, probe=None):
        return len((probe or self.probe).egress.requests)


class UsageProbeTests(ProbeFixture, SynchronousTestCase):
    """
    When an account is probed, and how.
    """

    def test_idleAccountIsProbed(self):
        """
        An OAuth account nothing was heard of is probed at once: C{GET
        wham/usage} beside its Codex base URL with its current bearer and
        ChatGPT account id, through its proxy; the windows and resets are
        in the view (source C{probe}). API-key accounts are never probed.
        """
        self.tick()
        self.assertEqual(self.sent(), 1)
        request = self.probe.egress.requests[0]
        self.assertEqual((request["method"], request["url"]),
                         ("GET", "https://chatgpt.com/backend-api/wham/usage"))
        self.assertEqual(request["proxy"], self.proxy)
        self.assertEqual(request["headers"]["authorization"], "Bearer access-o1")
        self.assertEqual(request["headers"]["chatgpt-account-id"], "acct-o1")
        view = self.probe.quota.view("o1")
        self.assertEqual((view["source"], view["plan"]), ("probe", "pro"))
        self.assertEqual(view["primary"], {"used_percent": 42.0, "window_minutes": 300.0,
                                           "reset_at": NOW + 600})
        self.assertEqual(view["secondary"]["reset_at"], NOW + 86400)
        self.assertIsNone(self.probe.quota.view("k1"))

    def test_neverMoreOftenThanTraffic(self):
        """
        An account whose traffic reported its windows within the interval
        is not probed; once the interval has passed it is, once.
        """
        self.probe.quota.observeHeaders(self.accounts[0], {
            "x-codex-primary-used-percent": "10", "x-codex-primary-reset-at": str(NOW + 900)})
        self.tick()
        self.clock.advance(299)
        self.tick()
        self.assertEqual(self.sent(), 0)
        self.clock.advance(1)
        self.tick()
        self.tick()
        self.assertEqual(self.sent(), 1)

    def test_intervalZeroTurnsPeriodicProbesOff(self):
        """
        C{usage_probe_interval_seconds: 0}: no periodic probe (after a
        cooldown still, unless that is off too).
        """
        self.settings.current = evolve(self.settings.current, oauth=evolve(
            self.settings.current.oauth, usage_probe_interval_seconds=0))
        self.tick()
        self.assertEqual(self.sent(), 0)

    def test_afterACooldown(self):
        """
        A cooling account is not probed; when its cooldown has ended it is
        probed once (even within the interval), unless traffic told its
        windows after the end.
        """
        self.tick()
        self.successResultOf(self.store.markAccount("o1", "rate_limited", NOW + 60, "429"))
        self.clock.advance(30)
        self.tick()
        self.assertEqual(self.sent(), 1)
        self.clock.advance(31)
        self.tick()
        self.assertEqual(self.sent(), 2)
        self.tick()
        self.assertEqual(self.sent(), 2)
        self.successResultOf(self.store.markAccount("o1", "rate_limited", NOW + 120, "429"))
        self.clock.advance(30)
        self.tick()
        self.clock.advance(30)
        self.probe.quota.observeHeaders(self.accounts[0], {"x-codex-primary-used-percent": "1"})
        self.tick()
        self.assertEqual(self.sent(), 2)

    def test_pausedOrLoggedOutNotProbed(self):
        """
        Paused accounts and accounts whose tokens are not usable are left
        alone.
        """
        self.paused.add("o1")
        self.tick()
        self.paused.clear()
        self.credentials.blocked.add("o1")
        self.tick()
        self.assertEqual(self.sent(), 0)

    def test_failuresAreQuiet(self):
        """
        An answer without windows, or no answer, records nothing and is
        tried again after the interval.
        """
        self.probe.egress.answer("/backend-api/wham/usage", reply(401, {"detail": "x"}),
                                 ConnectionRefusedError("x"))
        self.tick()
        self.assertIsNone(self.probe.quota.view("o1"))
        self.clock.advance(300)
        self.tick()
        self.assertEqual(self.sent(), 2)

    def test_processesShareOneProbe(self):
        """
        Two processes on one state store: one probe per interval between
        them; the other adopts its result.
        """
        other = self.makeProbe()
        self.tick()
        self.tick(other)
        self.assertEqual((self.sent(), self.sent(other)), (1, 0))
        self.assertEqual(other.quota.view("o1")["primary"]["used_percent"], 42.0)


class ReaderTests(SynchronousTestCase):
    """
    The readers of usage.
    """

    def test_usageURL(self):
        """
        The usage endpoint beside the Codex base URL, or at the host.
        """
        self.assertEqual(usageURL("https://chatgpt.com/backend-api/codex/"),
                         "https://chatgpt.com/backend-api/wham/usage")
        self.assertEqual(usageURL("http://127.0.0.1:9/backend-api/codex"),
                         "http://127.0.0.1:9/backend-api/wham/usage")
        self.assertEqual(usageURL("https://gw.example:8443/custom"),
                         "https://gw.example:8443/backend-api/wham/usage")

    def test_windowsFromWham(self):
        """
        protocol.md 7.4's usage snapshot: windows in seconds become
        minutes; C{reset_after_seconds} counts from now; no windows is
        L{None}.
        """
        snapshot = windowsFromWham(WHAM, NOW)
        self.assertEqual((snapshot.primary.used_percent, snapshot.primary.window_minutes),
                         (42.0, 300.0))
        self.assertEqual(snapshot.secondary.reset_at, NOW + 86400)
        self.assertEqual(snapshot.source, "probe")
        self.assertIsNone(windowsFromWham({"rate_limit": {}}, NOW))
        self.assertIsNone(windowsFromWham(json.loads("[]"), NOW))
