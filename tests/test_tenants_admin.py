"""
Tests for C{GET /admin/requests} and C{GET /admin/explain}
(L{relay.console.tenants}): the admin key (R99), parameters, answers.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from relay.entry.http import KeyRing
from relay.console.tenants import ExplainResource, RequestsResource
from relay.console.explain import Explainer
from tests.tenantsrig import TenantsRig, account, key
from tests.test_admin import KEY, jsonBody, makeRequest, render
from tests.test_tenants_requestlog import record


def get(resource, args=None, adminKey=KEY):
    request = makeRequest("", key=adminKey)
    request.args = {k.encode(): [v.encode()] for k, v in (args or {}).items()}
    render(resource, request)
    return request


class RequestsResourceTests(SynchronousTestCase):
    def setUp(self):
        self.rig = TenantsRig([account("a1")])
        for n in range(5):
            self.rig.log.add(record(n, outcome="failed" if n == 3 else "completed"))
        self.resource = RequestsResource(KEY, self.rig.log, self.rig.clock)

    def test_admin_key(self):
        """
        Without the admin key: 401; with a client key: 401; no admin key
        configured: 404.
        """
        self.assertEqual(get(self.resource, adminKey=None).responseCode, 401)
        self.assertEqual(get(self.resource, adminKey="sk-bob").responseCode, 401)
        self.assertEqual(get(RequestsResource(None, self.rig.log, self.rig.clock)).responseCode,
                         404)

    def test_query(self):
        """
        Filters and paging reach the log; records are JSON with their
        attempts; the cursor pages on.
        """
        body = jsonBody(get(self.resource, {"outcome": "failed"}))
        self.assertEqual([r["request_id"] for r in body["requests"]], ["req-3"])
        body = jsonBody(get(self.resource, {"limit": "2"}))
        self.assertEqual([r["request_id"] for r in body["requests"]], ["req-4", "req-3"])
        more = jsonBody(get(self.resource, {"limit": "2", "cursor": body["next"]}))
        self.assertEqual([r["request_id"] for r in more["requests"]], ["req-2", "req-1"])
        one = jsonBody(get(self.resource, {"request_id": "req-2"}))["requests"][0]
        self.assertEqual(one["attempts"][-1]["decision"], "served")
        since = jsonBody(get(self.resource, {"since": "2023-11-14T22:13:23Z"}))
        self.assertEqual(len(since["requests"]), 2)

    def test_bad_parameters(self):
        for args, param in (({"outcome": "nope"}, "outcome"), ({"limit": "0"}, "limit"),
                            ({"limit": "x"}, "limit"), ({"since": "yesterday"}, "since"),
                            ({"cursor": "a;b"}, "cursor")):
            request = get(self.resource, args)
            self.assertEqual(request.responseCode, 400)
            self.assertEqual(jsonBody(request)["error"]["param"], param)


class ExplainResourceTests(SynchronousTestCase):
    def setUp(self):
        self.rig = TenantsRig([account("a1"), account("a2", priority=5)])
        explainer = Explainer(
            clock=self.rig.clock, scheduler=self.rig.scheduler, keys=KeyRing([key()]),
            accounts=self.rig.live.accounts, policy=self.rig.policy,
            admission=self.rig.admission, ledger=self.rig.ledger, settings=self.rig.settings)
        self.resource = ExplainResource(KEY, explainer)

    def test_explain(self):
        body = jsonBody(get(self.resource, {"key": "bob", "model": "gpt-5.5",
                                            "session": "thread-1"}))
        self.assertEqual(body["decision"]["account"], "a1")
        self.assertEqual([a["id"] for a in body["accounts"]], ["a1", "a2"])
        self.assertEqual(len(body["session_hash"]), 16)
        self.assertNotIn("sk-bob", str(body))

    def test_errors(self):
        for args, code, param in (({"model": "m"}, 400, "key"), ({"key": "bob"}, 400, "model"),
                                  ({"key": "nobody", "model": "m"}, 404, "key"),
                                  ({"key": "bob", "model": "m", "entrypoint": "x"}, 400,
                                   "entrypoint")):
            request = get(self.resource, args)
            self.assertEqual(request.responseCode, code)
            self.assertEqual(jsonBody(request)["error"]["param"], param)
        self.assertEqual(get(self.resource, {"key": "bob", "model": "m"},
                             adminKey=None).responseCode, 401)
