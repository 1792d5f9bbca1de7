"""
C{GET /admin/overview} (L{relay.console.overview}): capacity, the next
resets, requests and failures per minute, spend today.
"""

from __future__ import annotations

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.console.overview import OverviewResource
from relay.policy.outcomes import AttemptOutcomes
from relay.usage.ledger import UsageLedger
from relay.usage.store import MemoryUsageStore, hourOf
from relay.usage.tokens import TokenCounts
from tests.test_admin import jsonBody, makeRequest, render

T0 = 1_769_860_000.0
KEY = "admin-secret"


class OverviewTests(SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.outcomes = AttemptOutcomes(clock=self.clock)
        self.store = MemoryUsageStore()
        self.ledger = UsageLedger(clock=self.clock, store=self.store)
        self.rows = [
            {"id": "a", "schedulable": True, "concurrency": 4, "in_use": 1, "waiting": 0,
             "blocks": [], "health": {"state": "ok"},
             "usage": {"primary": {"used_percent": 40.0, "reset_at": T0 + 600},
                       "secondary": {"used_percent": 10.0, "reset_at": T0 + 86400}}},
            {"id": "b", "schedulable": False, "concurrency": 2, "in_use": 0, "waiting": 0,
             "blocks": [{"kind": "cooldown", "reason": "503", "until": T0 + 30,
                         "model": None}], "health": {"state": "blocked"}},
            {"id": "c", "schedulable": True, "concurrency": 2, "in_use": 0, "waiting": 0,
             "blocks": [], "health": {"state": "failing"}},
            {"id": "d", "schedulable": False, "concurrency": 1, "paused": True,
             "blocks": [{"kind": "paused", "reason": "why", "until": None, "model": None}],
             "health": {"state": "paused"}},
        ]
        self.resource = OverviewResource(KEY, lambda: succeed(self.rows), self.outcomes,
                                         self.ledger, self.clock)

    def test_overview(self):
        for _ in range(4):
            self.outcomes.succeeded("a")
        self.outcomes.failed("c", "status_500", 500)
        self.successResultOf(self.store.add([
            ((hourOf(T0), "alice", "a", "m"), TokenCounts(1, 100, 0, 50, 0, 2_500_000)),
            ((hourOf(T0) - 86400, "alice", "a", "m"), TokenCounts(1, 1, 0, 1, 0, 9)),
        ]))
        request = makeRequest("overview", key=KEY)
        request.postpath = []
        render(self.resource, request)
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        self.assertEqual(body["capacity"], {
            "accounts": 4, "schedulable": 2, "failing": 1, "degraded": 0, "paused": 1,
            "blocked": 1, "slots": 9, "in_use": 1, "waiting": 0})
        self.assertEqual([(r["account"], r["kind"]) for r in body["next_resets"]],
                         [("b", "cooldown"), ("a", "window_primary"), ("a", "window_secondary")])
        self.assertEqual(body["next_resets"][0]["seconds_left"], 30)
        self.assertEqual(len(body["per_minute"]), 15)
        self.assertEqual(body["per_minute"][-1], {"time": int(T0 // 60) * 60, "requests": 5,
                                                  "failed": 1})
        self.assertEqual((body["requests_per_minute"], body["failures_per_minute"]), (1.0, 0.2))
        self.assertEqual(body["spend_today_usd"], 0.0025)
        self.assertEqual(body["tokens_today"], 150)
        self.assertEqual(body["spend_today_by_key"],
                         [{"key": "alice", "cost_usd": 0.0025, "total_tokens": 150}])

    def test_needs_key(self):
        request = makeRequest("overview", key=None)
        request.postpath = []
        render(self.resource, request)
        self.assertEqual(request.responseCode, 401)

    def test_spendUnknownWhenStoreFails(self):
        """
        The usage store cannot be read: the spend is unknown (null), the
        rest of the overview answers.
        """
        from twisted.internet.defer import fail

        class Broken(MemoryUsageStore):
            def costTotals(self, day, month):
                return fail(ConnectionError("down"))

        self.ledger.store = Broken()
        request = makeRequest("overview", key=KEY)
        request.postpath = []
        render(self.resource, request)
        body = jsonBody(request)
        self.assertEqual(request.responseCode, 200)
        self.assertIsNone(body["spend_today_usd"])
        self.assertEqual(body["capacity"]["accounts"], 4)
        self.flushLoggedErrors()
