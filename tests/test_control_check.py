"""
C{POST /admin/accounts/{id}/test} (L{relay.control.accounts.check}): an
API key lists the models, OAuth reads the usage probe; the answer says
what the upstream said and never holds the credential.
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import Account
from relay.control.accounts.check import CredentialCheck
from relay.control.web import ControlError
from relay.oauth.egress import EgressReply

T0 = 1_769_860_000.0
APIKEY = Account(id="k1", type="apikey", base_url="http://up/v1", credential="sk-secret-123456")
OAUTH = Account(id="o1", type="oauth", base_url="http://up/backend-api/codex",
                credential="tok-abcdef", chatgpt_account_id="chatgpt-1")


class Accounts:
    def byId(self, accountId):
        return {"k1": APIKEY, "o1": OAUTH}.get(accountId)


class Egress:
    def __init__(self):
        self.sent = []
        self.replies = []

    def request(self, proxy, method, url, headers, body, timeout):
        self.sent.append((method, url, headers))
        reply = self.replies.pop(0)
        return fail(reply) if isinstance(reply, Exception) else succeed(reply)


class Credentials:
    blocked = None

    def current(self, account):
        return account

    def blockReason(self, account, now):
        return self.blocked


class CheckTests(SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.egress = Egress()
        self.credentials = Credentials()
        self.check = CredentialCheck(Accounts(), self.egress, self.credentials, self.clock)

    def checkNow(self, accountId):
        note = {}
        status, answer = self.successResultOf(Deferred.fromCoroutine(
            self.check.test(accountId, note)))
        return status, answer, note

    def test_apikeyListsModels(self):
        self.egress.replies.append(EgressReply(200, {}, json.dumps(
            {"object": "list", "data": [{"id": "gpt-5.5"}, {"id": "o3"}]}).encode()))
        status, answer, note = self.checkNow("k1")
        self.assertEqual((status, answer["ok"], answer["check"], answer["models"]),
                         (200, True, "models", ["gpt-5.5", "o3"]))
        [(method, url, headers)] = self.egress.sent
        self.assertEqual((method, url), ("GET", "http://up/v1/models"))
        self.assertEqual(headers["authorization"], "Bearer sk-secret-123456")
        self.assertEqual(note["action"], "account.test")
        self.assertEqual(note["detail"], {"check": "models", "ok": True, "status": 200})

    def test_apikeyRefusedNoSecretInAnswer(self):
        self.egress.replies.append(EgressReply(401, {}, json.dumps({"error": {
            "message": "Incorrect API key provided: sk-secret-123456.",
            "code": "invalid_api_key"}}).encode()))
        status, answer, _ = self.checkNow("k1")
        self.assertEqual((answer["ok"], answer["status"], answer["error"]["code"]),
                         (False, 401, "invalid_api_key"))
        self.assertNotIn("sk-secret-123456", json.dumps(answer))

    def test_oauthUsageProbe(self):
        self.egress.replies.append(EgressReply(200, {}, json.dumps({
            "plan_type": "plus",
            "rate_limit": {"primary_window": {"used_percent": 12, "limit_window_seconds": 18000,
                                              "reset_after_seconds": 600}}}).encode()))
        status, answer, _ = self.checkNow("o1")
        self.assertEqual((answer["ok"], answer["check"]), (True, "usage"))
        self.assertEqual(answer["usage"]["plan"], "plus")
        [(_, url, headers)] = self.egress.sent
        self.assertEqual(url, "http://up/backend-api/wham/usage")
        self.assertEqual(headers["chatgpt-account-id"], "chatgpt-1")

    def test_oauthNeedsLoginNotSent(self):
        self.credentials.blocked = ("needs_login: refresh token revoked", 0)
        _, answer, _ = self.checkNow("o1")
        self.assertEqual((answer["ok"], answer["error"]["code"]), (False, "needs_login"))
        self.assertEqual(self.egress.sent, [])

    def test_unreachable(self):
        self.egress.replies.append(ConnectionRefusedError("refused"))
        _, answer, _ = self.checkNow("k1")
        self.assertEqual((answer["ok"], answer["error"]["code"]), (False, "unreachable"))

    def test_unknownAccount(self):
        d = Deferred.fromCoroutine(self.check.test("nope", {}))
        self.assertEqual(self.failureResultOf(d, ControlError).value.status, 404)
