"""
Tests for L{relay.keypage.resource} (C{/me}): a key holder sees their own
use, windows, budget and requests, and nothing of another key or of an
account (R114 gives them windows, never an account).
"""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from relay.base.records import ClientKey
from relay.keypage.resource import REQUEST_FIELDS, KeyPage
from relay.tenants.keyusage import KeyLimits, KeyWindow
from relay.tenants.requestlog import MemoryRequestLog
from tests.test_tenants_requestlog import record

T0 = 1_700_000_000.0

ALICE = ClientKey(name="alice", key="sk-relay-alice-0123456789", daily_tokens=1000, rpm=60)
BOB = ClientKey(name="bob", key="sk-relay-bob-0123456789")


class Keys:
    def authenticate(self, request):
        header = (request.getHeader(b"authorization") or b"").decode()
        return {f"Bearer {k.key}": k for k in (ALICE, BOB)}.get(header)


class Usage:
    async def limits(self, key):
        return KeyLimits(windows=(KeyWindow("rpm", 10.0, 60, T0 + 30),
                                  KeyWindow("daily_tokens", 25.0, 86400, T0 + 3600)), at=T0)


class Ledger:
    def budgetView(self, now):
        return [{"key": "alice", "daily_tokens": 1000, "daily_used": 250,
                 "daily_resets_at": T0 + 3600, "monthly_tokens": None, "monthly_used": 250,
                 "monthly_resets_at": T0 + 86400},
                {"key": "bob", "daily_tokens": 77777, "daily_used": 66666,
                 "daily_resets_at": T0 + 3600, "monthly_tokens": None, "monthly_used": 1,
                 "monthly_resets_at": T0 + 86400}]


class KeyPageTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.log = MemoryRequestLog(clock=self.clock)
        for n in range(3):
            self.log.add(record(n, key="alice", account="acct-secret-a1", t=T0 - 100 + n,
                                rid=f"req-alice-{n}"))
        for n in range(4):
            self.log.add(record(n, key="bob", account="acct-secret-b2", t=T0 - 50 + n,
                                rid=f"req-bob-{n}", tried=["acct-secret-b3"]))
        self.page = KeyPage(Keys(), Usage(), Ledger(), self.log, self.clock)

    def get(self, path, key=ALICE, args=None):
        request = DummyRequest(path)
        request.postpath = list(path[1:])
        if key is not None:
            request.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {key.key}"])
        request.args = args or {}
        resource = self.page.getChildWithDefault(path[0], request)
        result = resource.render(request)
        if isinstance(result, bytes):
            request.write(result)
            request.finish()
        self.assertTrue(request.finished)
        raw = b"".join(request.written)
        return request, raw

    def test_summaryIsTheKeysOwn(self):
        request, raw = self.get([b"api", b"summary"])
        self.assertEqual(request.responseCode, 200)
        answer = json.loads(raw)
        self.assertEqual(answer["key"]["name"], "alice")
        self.assertEqual([w["name"] for w in answer["windows"]], ["rpm", "daily_tokens"])
        self.assertEqual(answer["windows"][1]["left_percent"], 75.0)
        self.assertEqual(answer["budget"]["daily_tokens_left"], 750)
        self.assertEqual(answer["limits"]["rpm"], 60)
        self.assertEqual(answer["usage"]["last_24h"]["requests"], 3)
        self.assertEqual(answer["usage"]["last_24h"]["tokens"], 45)
        self.assertEqual(len(answer["usage"]["hours"]), 24)
        for foreign in (b"bob", b"acct-secret", b"77777", b"66666", b"req-bob", b"group",
                        b"accounts"):
            self.assertNotIn(foreign, raw)

    def test_requestsAreTheKeysOwn(self):
        request, raw = self.get([b"api", b"requests"])
        answer = json.loads(raw)
        self.assertEqual([r["request_id"] for r in answer["requests"]],
                         ["req-alice-2", "req-alice-1", "req-alice-0"])
        self.assertEqual(set(answer["requests"][0]), set(REQUEST_FIELDS))
        for foreign in (b"bob", b"acct-secret", b"client_ip", b"upstream_request_id",
                        b"attempts", b"user_agent"):
            self.assertNotIn(foreign, raw)
        _, raw = self.get([b"api", b"requests"], key=BOB)
        self.assertNotIn(b"alice", raw)
        self.assertEqual(len(json.loads(raw)["requests"]), 4)

    def test_keyRequired(self):
        request, raw = self.get([b"api", b"summary"], key=None)
        self.assertEqual(request.responseCode, 401)

    def test_badLimit(self):
        request, _ = self.get([b"api", b"requests"], args={b"limit": [b"0"]})
        self.assertEqual(request.responseCode, 400)

    def test_page(self):
        request, raw = self.get([b""], key=None)
        self.assertIn(b"Your relay key", raw)
        self.assertIn(b"default-src 'self'",
                      request.responseHeaders.getRawHeaders(b"content-security-policy")[0])
