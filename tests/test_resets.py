"""
L{relay.oauth.resets.BankedResets} on a L{Clock}: automatic redeeming
(C{accounts[].auto_redeem_resets}, protocol.md 7.3a) fires only when the
account's window is spent AND no other account of its group can serve,
and never when the option is off; a reset lifts the account's blocks.
"""

from __future__ import annotations

import json

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import Account
from relay.oauth.resets import BankedResets, resetsURL
from relay.oauth.windows import Snapshot, Window
from relay.state.runtime import AccountRuntime

NOW = 1_796_515_200.0


class _Accounts(list):
    def byId(self, accountId):
        return next((a for a in self if a.id == accountId), None)


class _Dial:
    credential = "tok"
    chatgpt_account_id = "acct"


class _Credentials:
    def current(self, account):
        return _Dial()


class _Reply:
    def __init__(self, body, status=200):
        self.status, self._body = status, body

    def json(self):
        return self._body


class _Egress:
    def __init__(self):
        self.calls = []
        self.count = 0

    def request(self, proxy, method, url, headers, body, timeout):
        self.calls.append((method, url, json.loads(body) if body else None))
        if method == "GET":
            return succeed(_Reply({"available_count": self.count, "credits": []}))
        return succeed(_Reply({"code": "reset", "windows_reset": 1}))


class _Quota:
    def __init__(self):
        self.snapshots = {}

    def get(self, accountId):
        return self.snapshots.get(accountId)


class _Store:
    def __init__(self):
        self.states = {}

    def getAccountStates(self, ids):
        return succeed({i: self.states[i] for i in ids if i in self.states})


def oauth(accountId, auto=True):
    return Account(id=accountId, type="oauth", base_url="https://chatgpt.com/backend-api/codex",
                   credential="tok", chatgpt_account_id="acct", auto_redeem_resets=auto)


class AutoRedeemTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.egress, self.quota, self.store = _Egress(), _Quota(), _Store()
        self.cleared, self.groups = [], {}

    def resets(self, *accounts):
        def clear(account):
            self.cleared.append(account.id)
            return succeed(None)

        return BankedResets(clock=self.clock, accounts=_Accounts(accounts),
                            credentials=_Credentials(), egress=self.egress, quota=self.quota,
                            store=self.store, clear=clear, groups=lambda: self.groups)

    def spend(self, accountId):
        self.quota.snapshots[accountId] = Snapshot(Window(100.0, 300.0, NOW + 3600), None,
                                                   "plus", NOW)

    def consumed(self):
        return [url for method, url, _ in self.egress.calls if method == "POST"]

    def test_fires_when_spent_and_no_other_account_serves(self):
        """
        The only account of the pool is spent and has a credit: one redeem
        (a C{redeem_request_id}), its blocks lifted, the count lowered;
        the next tick (a credit left, window now fresh) does nothing.
        """
        resets = self.resets(oauth("a"))
        resets.available["a"] = 2
        self.spend("a")
        self.successResultOf(resets.tick())
        self.assertEqual(self.consumed(), [resetsURL(oauth("a").base_url) + "/consume"])
        self.assertTrue(self.egress.calls[0][2]["redeem_request_id"])
        self.assertEqual(self.cleared, ["a"])
        self.assertEqual(resets.available["a"], 1)
        self.quota.snapshots.clear()
        self.clock.advance(5)
        self.successResultOf(resets.tick())
        self.assertEqual(len(self.consumed()), 1)

    def test_cooldown_counts_as_spent(self):
        """
        A cooldown (R12's usage-limit mark) is a spent window too.
        """
        resets = self.resets(oauth("a"))
        resets.available["a"] = 1
        self.store.states["a"] = AccountRuntime(rateLimitedUntil=NOW + 600)
        self.successResultOf(resets.tick())
        self.assertEqual(len(self.consumed()), 1)

    def test_not_while_another_account_of_the_group_serves(self):
        """
        While another account of its group can serve, nothing is redeemed;
        once that one is spent too, one is; an account outside the group
        does not count.
        """
        self.groups = {"g": ["a", "b"]}
        resets = self.resets(oauth("a"), oauth("b", auto=False), oauth("c", auto=False))
        resets.available["a"] = 1
        self.spend("a")
        self.successResultOf(resets.tick())
        self.assertEqual(self.consumed(), [])
        self.spend("b")
        self.clock.advance(5)
        self.successResultOf(resets.tick())  # c serves, but it is not in a's group
        self.assertEqual(len(self.consumed()), 1)

    def test_without_a_group_the_pool_counts(self):
        """
        An account in no group waits while any other account of the pool
        serves.
        """
        resets = self.resets(oauth("a"), oauth("b", auto=False))
        resets.available["a"] = 1
        self.spend("a")
        self.successResultOf(resets.tick())
        self.assertEqual(self.consumed(), [])

    def test_never_when_off_or_without_a_window_spent_or_a_credit(self):
        """
        C{auto_redeem_resets: false}, a window not spent, or no credit
        known: never a redeem.
        """
        off = self.resets(oauth("a", auto=False))
        off.available["a"] = 3
        self.spend("a")
        self.successResultOf(off.tick())
        fresh = self.resets(oauth("b"))
        fresh.available["b"] = 3
        self.successResultOf(fresh.tick())
        none = self.resets(oauth("c"))
        none.available["c"] = 0
        self.spend("c")
        self.successResultOf(none.tick())
        self.assertEqual(self.egress.calls, [])
        self.assertEqual(self.cleared, [])

    def test_unknown_count_is_asked_first(self):
        """
        A spent account whose count was never heard (not probed while it
        cools down) is asked for its credits, then redeemed if it has one.
        """
        resets = self.resets(oauth("a"))
        self.spend("a")
        self.successResultOf(resets.tick())
        self.assertEqual([m for m, _, _ in self.egress.calls], ["GET"])
        self.assertEqual(resets.available["a"], 0)
        self.egress.count = 1
        del resets.available["a"]
        self.clock.advance(5)
        self.successResultOf(resets.tick())
        self.assertEqual([m for m, _, _ in self.egress.calls], ["GET", "GET", "POST"])

    def test_note_reads_the_usage_answer_and_the_list(self):
        """
        The count comes from a usage answer's summary or a list.
        """
        resets = self.resets(oauth("a"))
        resets.note("a", {"plan_type": "plus", "rate_limit_reset_credits": {"available_count": 4}})
        self.assertEqual(resets.available["a"], 4)
        resets.note("a", {"available_count": 2, "credits": []})
        self.assertEqual(resets.available["a"], 2)
        resets.note("a", {"plan_type": "plus"})
        self.assertEqual(resets.available["a"], 2)
