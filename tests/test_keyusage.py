"""
L{relay.tenants.keyusage}: a key's windows in Codex's shapes (behaviour.md
R114; protocol.md 7.3, 7.3a), on a L{Clock}.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import ClientKey
from relay.oauth.windows import Snapshot, Window
from relay.tenants.keyusage import (
    KeyUsage, KeyWindow, accountsCheckBody, limitHeaders, limitsEvent, merge, poolWindows,
    usageBody, whoamiBody,
)
from relay.tenants.ratelimit import RateDecision

NOW = 1_796_515_200 + 6 * 3600  # 2026-12-06 06:00 UTC


class _Ledger:
    def __init__(self, day=0, month=0, spentDay=0, spentMonth=0):
        self.tokens, self.nanos = (day, month), (spentDay, spentMonth)

    def used(self, key, now):
        return self.tokens

    def spent(self, key, now):
        return self.nanos


class _Policy:
    def __init__(self, decision=None, accounts=None):
        self.decision = decision
        self.accounts = accounts

    def peekRate(self, key):
        return succeed(self.decision)

    def reachable(self, key, accounts):
        return [a for a in accounts if self.accounts is None or a.id in self.accounts]


class _Account:
    def __init__(self, id):
        self.id = id


class _Windows:
    def __init__(self, snapshots):
        self.snapshots = snapshots

    def get(self, accountId):
        return self.snapshots.get(accountId)


class KeyUsageTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)

    def limits(self, usage, key):
        return self.successResultOf(Deferred.fromCoroutine(usage.limits(key)))

    def test_budgets_are_the_utc_day_and_month(self):
        """
        A daily token budget is the UTC day (window 86400 s, reset at the
        next midnight), a monthly money budget the UTC month; the shorter
        is Codex's primary.
        """
        key = ClientKey(name="k", key="sk-k", daily_tokens=1000, monthly_usd=10.0)
        usage = KeyUsage(self.clock, ledger=_Ledger(day=250, spentMonth=int(7.5e9)))
        limits = self.limits(usage, key)
        body = usageBody(limits)
        primary = body["rate_limit"]["primary_window"]
        secondary = body["rate_limit"]["secondary_window"]
        self.assertEqual(primary, {"used_percent": 25, "limit_window_seconds": 86400,
                                   "reset_after_seconds": 18 * 3600,
                                   "reset_at": 1_796_515_200 + 86400})
        self.assertEqual(secondary["used_percent"], 75)
        self.assertEqual(secondary["limit_window_seconds"], 31 * 86400)  # December
        self.assertEqual(secondary["reset_at"], 1_798_761_600)  # 2027-01-01
        self.assertEqual(body["plan_type"], "team")
        self.assertFalse(body["rate_limit"]["limit_reached"])

    def test_rates_are_the_minute_and_merge(self):
        """
        rpm and tpm are one minute window at the higher percent; a spent
        window reads 100 and limit_reached.
        """
        key = ClientKey(name="k", key="sk-k", rpm=10, tpm=1000, daily_tokens=100)
        decision = RateDecision(allowed=True, requests=3, tokens=900, rpm=10, tpm=1000,
                                resetRequests=20.0, resetTokens=45.0)
        usage = KeyUsage(self.clock, ledger=_Ledger(day=100), policy=_Policy(decision))
        limits = self.limits(usage, key)
        self.assertEqual([w.seconds for w in limits.windows], [60, 86400])
        self.assertEqual(limits.primary.usedPercent, 90.0)
        self.assertEqual(limits.primary.resetAt, NOW + 45)
        body = usageBody(limits)
        self.assertTrue(body["rate_limit"]["limit_reached"])
        self.assertEqual(body["rate_limit"]["secondary_window"]["used_percent"], 100)

    def test_headers_and_event(self):
        """
        The C{x-codex-*} headers and the C{codex.rate_limits} event carry
        the same windows (minutes, Unix seconds).
        """
        limits = merge([KeyWindow("rpm", 12.5, 60, NOW + 30),
                        KeyWindow("daily_tokens", 40.0, 86400, NOW + 3600)], NOW)
        headers = limitHeaders(limits)
        self.assertEqual(headers["x-codex-primary-used-percent"], "12.5")
        self.assertEqual(headers["x-codex-primary-window-minutes"], "1")
        self.assertEqual(headers["x-codex-primary-reset-at"], str(NOW + 30))
        self.assertEqual(headers["x-codex-secondary-window-minutes"], "1440")
        self.assertEqual(headers["x-codex-secondary-reset-after-seconds"], "3600")
        event = limitsEvent(limits)
        self.assertEqual(event["type"], "codex.rate_limits")
        self.assertEqual(event["rate_limits"]["secondary"],
                         {"used_percent": 40.0, "window_minutes": 1440, "reset_at": NOW + 3600})
        self.assertEqual(limitHeaders(None), {})
        self.assertIsNone(limitsEvent(None))

    def test_no_budget_is_the_pools_headroom(self):
        """
        A key without a budget sees the mean use of the accounts it may
        reach (an account with no window counts as unused), the earliest
        reset; accounts it may not reach do not count.
        """
        windows = _Windows({
            "a": Snapshot(Window(90.0, 300.0, NOW + 600), Window(50.0, 10080.0, NOW + 9000),
                          "plus", NOW),
            "b": Snapshot(Window(30.0, 300.0, NOW + 1200), None, "plus", NOW),
            "x": Snapshot(Window(100.0, 300.0, NOW + 60), None, "plus", NOW),
        })
        policy = _Policy(accounts={"a", "b", "c"})
        accounts = [_Account(i) for i in ("a", "b", "c", "x")]
        usage = KeyUsage(self.clock, ledger=_Ledger(), policy=policy,
                         pool=poolWindows(self.clock, windows, policy, accounts))
        limits = self.limits(usage, ClientKey(name="k", key="sk-k"))
        self.assertEqual(limits.primary, KeyWindow("pool_primary", 40.0, 18000, NOW + 600))
        self.assertEqual(limits.secondary.usedPercent, 50.0 / 3)
        budgeted = self.limits(usage, ClientKey(name="k", key="sk-k", daily_tokens=10))
        self.assertEqual([w.name for w in budgeted.windows], ["daily_tokens"])

    def test_pool_windows_past_their_reset(self):
        """
        An account window whose reset has passed counts as unused and its
        reset is not the pool's; with no reset to come the pool's window
        resets its longest length from now (300 minutes when none is
        known).
        """
        windows = _Windows({
            "a": Snapshot(Window(80.0, None, NOW - 1), Window(20.0, 10080.0, NOW), "plus", NOW),
            "b": Snapshot(Window(40.0, None, None), Window(60.0, 300.0, NOW + 60), "plus", NOW),
        })
        pool = poolWindows(self.clock, windows, None, [_Account("a"), _Account("b")])
        self.assertEqual(pool(ClientKey(name="k", key="sk-k")), [
            KeyWindow("pool_primary", 20.0, 18000, NOW + 18000),
            KeyWindow("pool_secondary", 30.0, 604800, NOW + 60),
        ])

    def test_limitsNow_is_limits_without_a_wait(self):
        """
        A key without rpm/tpm windows to read has its windows at once
        (L{KeyUsage.limitsNow}), the same as L{KeyUsage.limits}; a key
        with them is read by L{KeyUsage.limits} only.
        """
        windows = _Windows({"a": Snapshot(Window(30.0, 300.0, NOW + 600), None, "plus", NOW)})
        policy = _Policy(RateDecision(allowed=True, requests=1, tokens=0, rpm=10, tpm=0))
        accounts = [_Account("a")]
        usage = KeyUsage(self.clock, ledger=_Ledger(day=5, spentMonth=int(1e9)), policy=policy,
                         pool=poolWindows(self.clock, windows, policy, accounts))
        for key in (ClientKey(name="k", key="sk-k"),
                    ClientKey(name="k", key="sk-k", daily_tokens=10, monthly_usd=4.0)):
            now = usage.limitsNow(key)
            self.assertEqual(now, self.limits(usage, key))
            self.assertTrue(now.windows)
        self.assertIsNone(usage.limitsNow(ClientKey(name="k", key="sk-k", rpm=10)))
        self.assertEqual(KeyUsage(self.clock).limitsNow(ClientKey(name="k", key="sk-k", rpm=10)),
                         self.limits(KeyUsage(self.clock), ClientKey(name="k", key="sk-k", rpm=10)))

    def test_no_budget_reads_no_ledger(self):
        """
        A key without a budget has no budget windows and costs no ledger
        read; with no account window reported the pool has none either.
        """

        class Unread:
            def used(self, key, now):
                raise AssertionError("read")

            spent = used

        usage = KeyUsage(self.clock, ledger=Unread(), policy=_Policy(),
                         pool=poolWindows(self.clock, _Windows({}), _Policy(), [_Account("a")]))
        self.assertEqual(usage.limitsNow(ClientKey(name="k", key="sk-k")).windows, ())


class IdentityTests(SynchronousTestCase):
    """
    Who a key is, for Codex signed in with it as a personal access token.
    """

    def test_whoami(self):
        """
        The metadata Codex 0.171 reads (every field it requires present):
        ids naming the key, never an account; the plan relay reports.
        """
        body = whoamiBody(ClientKey(name="alice", key="at-secret"))
        self.assertEqual(body, {"email": None, "chatgpt_user_id": "relay-key-alice",
                                "chatgpt_account_id": "relay-key-alice",
                                "chatgpt_plan_type": "team",
                                "chatgpt_account_is_fedramp": False})
        self.assertNotIn("at-secret", repr(body))

    def test_accountsCheck(self):
        """
        One workspace, whoami's account id, with no routing constraint (so
        Codex keeps its configured base URL).
        """
        body = accountsCheckBody(ClientKey(name="alice", key="at-secret"))
        [entry] = body["accounts"]
        self.assertEqual(entry["id"], "relay-key-alice")
        self.assertEqual((entry["workspace_backend_origin"], entry["account_routing_override"]),
                         ("NO_CONSTRAINT", "NO_CONSTRAINT"))
        self.assertEqual(body["default_account_id"], "relay-key-alice")
        self.assertNotIn("at-secret", repr(body))


class ErrorEventTests(SynchronousTestCase):
    def test_account_windows_dropped_from_a_passed_error(self):
        """
        R114: an upstream C{error} event passed on keeps its other headers
        but loses the account's C{x-codex-*} ones.
        """
        import json

        from relay.engine.pump import withoutAccountWindows
        from relay.wire.sse import Event

        data = json.dumps({"type": "error", "status": 429, "error": {"type": "usage_limit_reached"},
                           "headers": {"x-codex-primary-used-percent": "100",
                                       "X-Codex-Plan-Type": "plus", "retry-after": "60"}})
        event = withoutAccountWindows(Event(b"error", data.encode()))
        self.assertEqual(event.json()["headers"], {"retry-after": "60"})
        self.assertEqual(event.json()["error"], {"type": "usage_limit_reached"})
