"""
Tests for L{relay.control} (issue 21): accounts and pauses changed through
the admin API and applied to the running relay like a reload, the
file-versus-admin rule, the audit trail, and the admin key guard (R99), on
a relay built with a L{MemoryReactorClock} and the memory control store.
"""

from __future__ import annotations

import json
import os
from io import BytesIO

import jwt
from attrs import evolve
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import getChildForRequest
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from relay.process.app import buildApplication
from relay.configuration.parse import settingsFromString
from relay.control.accounts.records import describeConfigError, publicAccount, safeURL
from relay.control.audit.service import actionOf, scrub
from relay.control.plane import LOADING_GRACE_SECONDS
from relay.control.store import ANY
from relay.control.web import ControlError, readJSONBody
from relay.base.logs import _registered
from relay.base.records import ConfigError

ADMIN = "adm-control-key-0123456789"
NOW = 1_700_000_000.0
FILE_KEY = "sk-file-account-a1-secret"
ADMIN_SECRET = "sk-admin-added-x1-secret"

CONFIG = f"""
listen: "tcp:0:interface=127.0.0.1"
admin_key: {ADMIN}
keys: [{{name: t, key: sk-relay-control-test}}]
proxies: [{{id: p1, url: "http://user:proxypass123@127.0.0.1:3128"}}]
accounts:
  - {{id: a1, type: apikey, api_key: {FILE_KEY}, base_url: "http://127.0.0.1:9/v1"}}
"""


def oauthToken(account="acct-x", plan="plus", ttl=3600, sub="o"):
    """
    A JWT shaped like a ChatGPT access or id token (relay reads its claims
    without checking the signature).
    """
    claims = {"sub": sub, "exp": int(NOW + ttl), "iat": int(NOW),
              "https://api.openai.com/auth": {"chatgpt_account_id": account,
                                              "chatgpt_plan_type": plan}}
    return jwt.encode(claims, "test-secret-" * 3, algorithm="HS256")


class ControlFixture:
    """
    A relay (no listening, no services started) with one file account.
    """

    configText = CONFIG

    def setUp(self):
        self.reactor = MemoryReactorClock()
        self.reactor.advance(NOW)
        self.path = self.mktemp()
        with open(self.path, "w") as f:
            f.write(self.configText)
        config = evolve(settingsFromString(self.configText), database="")
        self.app = buildApplication(config, self.reactor, configPath=self.path)
        self.parts = self.app.extras["controlParts"]
        self.plane = self.parts.plane

    def call(self, method, path, body=None, key=ADMIN, client="10.1.2.3"):
        """
        One admin request through the site's resource tree.

        @return: C{(status, decoded JSON)}.
        """
        segments = [s.encode() for s in ("admin/" + path).strip("/").split("/")]
        request = DummyRequest(segments)
        request.method = method
        request.uri = ("/admin/" + path).encode()
        request.client = IPv4Address("TCP", client, 50000)
        if key is not None:
            request.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {key}".encode()])
        if body is not None:
            request.content = BytesIO(body if isinstance(body, bytes)
                                      else json.dumps(body).encode())
        leaf = getChildForRequest(self.app.site.resource, request)
        result = leaf.render(request)
        if result is not NOT_DONE_YET:
            request.write(result)
            request.finish()
        self.assertTrue(request.finished, "answer pending")
        raw = b"".join(request.written)
        self.lastRaw = raw
        return request.responseCode, json.loads(raw) if raw else None

    def ids(self):
        return [a.id for a in self.app.live.accounts]

    def apikey(self, accountId="x1", **extra):
        body = {"id": accountId, "type": "apikey", "api_key": ADMIN_SECRET,
                "base_url": "http://127.0.0.1:9/v1", "priority": 5}
        body.update(extra)
        return body

    def audit(self):
        status, body = self.call(b"GET", "audit")
        self.assertEqual(status, 200)
        return body["audit"]

    def rows(self):
        d = self.app.extras["operator"].accountsView()
        return {r["id"]: r for r in self.successResultOf(d)}


class AddAccountTests(ControlFixture, SynchronousTestCase):
    """
    C{POST /admin/accounts}.
    """

    def test_addAPIKeyAccount(self):
        """
        An API-key account added through the API is in force at once
        (after the file's), answered without its key, marked C{source:
        admin}, registered for log redaction, and audited with the
        admin's address and the fields' names only.
        """
        status, body = self.call(b"POST", "accounts", self.apikey())
        self.assertEqual(status, 201, body)
        self.assertEqual(self.ids(), ["a1", "x1"])
        view = body["account"]
        self.assertEqual((view["source"], view["type"], view["priority"]), ("admin", "apikey", 5))
        self.assertEqual(view["credential"], "set")
        self.assertNotIn(ADMIN_SECRET, self.lastRaw.decode())
        self.assertIn(ADMIN_SECRET, set(_registered))
        account = self.app.live.accounts.byId("x1")
        self.assertEqual(account.credential, ADMIN_SECRET)
        self.assertIsNone(self.app.scheduler._extraBlock(account, NOW, None))
        entry = self.audit()[0]
        self.assertEqual((entry["action"], entry["account"], entry["address"], entry["status"]),
                         ("account.create", "x1", "10.1.2.3", 201))
        self.assertIn("api_key", entry["detail"]["fields"])
        self.assertNotIn(ADMIN_SECRET, json.dumps(self.audit()))
        rows = self.rows()
        self.assertEqual((rows["x1"]["source"], rows["a1"]["source"]), ("admin", "file"))

    def test_othersKeepTheirState(self):
        """
        Adding, pausing and deleting an account keeps the cooldowns of the
        others (state is keyed by id; they did not change).
        """
        store = self.app.store
        self.successResultOf(store.markAccount("a1", "rate_limited", NOW + 600, "429"))
        self.call(b"POST", "accounts", self.apikey())
        self.call(b"POST", "accounts/x1/disable")
        self.call(b"DELETE", "accounts/x1")
        states = self.successResultOf(store.getAccountStates(["a1"]))
        self.assertEqual(states["a1"].rateLimitedUntil, NOW + 600)

    def test_addOAuthAccount(self):
        """
        An OAuth account added with tokens (or a Codex C{auth.json}) takes
        its ChatGPT account id from their claim, and relay manages its
        tokens like a file account's.
        """
        access, idToken = oauthToken("acct-77"), oauthToken("acct-77")
        status, body = self.call(b"POST", "accounts", {
            "id": "o1", "type": "oauth", "access_token": access, "refresh_token": "rt-secret-o1",
            "id_token": idToken, "base_url": "http://127.0.0.1:9/backend-api/codex"})
        self.assertEqual(status, 201, body)
        self.assertEqual(body["account"]["chatgpt_account_id"], "acct-77")
        for secret in (access, "rt-secret-o1", idToken):
            self.assertNotIn(secret, self.lastRaw.decode())
        self.assertTrue(self.app.extras["credentials"].hasAccount("o1"))
        # Protocol.md 7.3a: an admin OAuth account may redeem its banked
        # resets by itself (off by default).
        self.assertFalse(self.app.live.accounts.byId("o1").auto_redeem_resets)
        status, body = self.call(b"PATCH", "accounts/o1", {"auto_redeem_resets": True})
        self.assertEqual(status, 200, body)
        self.assertTrue(self.app.live.accounts.byId("o1").auto_redeem_resets)
        status, body = self.call(b"POST", "accounts", {
            "id": "o2", "type": "oauth", "auth_json": {"tokens": {
                "access_token": oauthToken("acct-88"), "refresh_token": "rt-secret-o2"}}})
        self.assertEqual(status, 201, body)
        self.assertEqual(self.app.live.accounts.byId("o2").chatgpt_account_id, "acct-88")

    def test_validation(self):
        """
        The file's validation, one clear 400 per problem naming the field;
        nothing is added.
        """
        cases = [
            ({"foo": 1}, "foo", "unknown field foo"),
            ({"api_key_env": "X"}, "api_key_env", "not accepted through the admin API"),
            ({"id": "bad/id"}, "id", "id: required"),
            ({"priority": "ten"}, "priority", "priority: expected an integer"),
            ({"concurrency": -1}, "concurrency", "concurrency: must be at least 0"),
            ({"ws_mode": "fast"}, "ws_mode", "ws_mode: expected"),
            ({"access_token": "x"}, "access_token", "only allowed on an oauth account"),
            ({"proxy": "ftp://x:1"}, "proxy", "invalid proxy URL"),
            ({"proxy_id": "nope"}, "proxy_id", "unknown proxy id"),
            ({"models": []}, "models", "must not be empty"),
            ({"label": 5}, "label", "label: expected a string"),
        ]
        for change, param, text in cases:
            status, body = self.call(b"POST", "accounts", self.apikey(**change))
            self.assertEqual(status, 400, (change, body))
            self.assertEqual(body["error"]["param"], param, change)
            self.assertIn(text, body["error"]["message"], change)
            self.assertEqual(body["error"]["code"], "invalid_account")
        status, body = self.call(b"POST", "accounts", {"id": "o9", "type": "oauth"})
        self.assertEqual(status, 400)
        self.assertIn("access_token or access_token_env is required", body["error"]["message"])
        status, body = self.call(b"POST", "accounts", {"id": "z", "api_key": "sk-zzzzzzzz"})
        self.assertIn("type is required", body["error"]["message"])
        self.assertEqual(self.ids(), ["a1"])
        self.assertEqual(self.audit(), [])


    def test_unusableURLs(self):
        """
        A base_url (or auth_base_url, or proxy) that could never be dialled
        -- a space, port 0, a C{?query} or C{#fragment} -- is the file's
        error as a 400 naming the field, not an account whose every turn
        fails over as a transport fault; nothing is added.
        """
        before = self.ids()
        for url in ("http://exa mple.com/v1", "https://host:0/v1", "https://host/v1?x=1",
                    "https://host/v1#frag"):
            for field in ("base_url", "auth_base_url"):
                if field == "base_url":
                    spec = self.apikey(base_url=url)
                else:
                    spec = {"id": "o1", "type": "oauth", "access_token": oauthToken("acct-1"),
                            "auth_base_url": url}
                status, body = self.call(b"POST", "accounts", spec)
                self.assertEqual(status, 400, (field, url, body))
                self.assertEqual(body["error"]["param"], field, url)
                self.assertIn(f"{field}: invalid URL", body["error"]["message"], url)
        status, body = self.call(b"POST", "accounts",
                                 self.apikey(proxy="socks5://u:proxy-pass@h:0"))
        self.assertEqual((status, body["error"]["param"]), (400, "proxy"), body)
        self.assertIn("bad port 0", body["error"]["message"])
        self.assertNotIn("proxy-pass", self.lastRaw.decode())
        self.assertEqual(self.ids(), before)
    def test_idClash(self):
        """
        An id the file uses is a 409 naming the file; an id an admin
        account has, a 409 too.
        """
        status, body = self.call(b"POST", "accounts", self.apikey("a1"))
        self.assertEqual(status, 409)
        self.assertIn(self.path, body["error"]["message"])
        self.assertEqual(self.call(b"POST", "accounts", self.apikey())[0], 201)
        status, body = self.call(b"POST", "accounts", self.apikey())
        self.assertEqual((status, body["error"]["code"]), (409, "account_exists"))

    def test_badBodies(self):
        """
        The one body helper: not JSON, not an object, too deep, too large.
        """
        for raw, code in ((b"{nope", 400), (b"[1]", 400), (b"[" * 40 + b"]" * 40, 400),
                          (b'{"a": "' + b"x" * 70000 + b'"}', 413), (b"", 400),
                          (b"\xff\xfe", 400)):
            status, body = self.call(b"POST", "accounts", raw)
            self.assertEqual(status, code, raw[:20])
        deep = {"id": "x1"}
        for _ in range(20):
            deep = {"a": deep}
        self.assertEqual(self.call(b"POST", "accounts", deep)[0], 400)

    def test_storeUnavailable(self):
        """
        A store that cannot be reached is a 503 and nothing changes.
        """
        self.parts.store.failing = True
        status, body = self.call(b"POST", "accounts", self.apikey())
        self.assertEqual((status, body["error"]["code"]), (503, "control_store_unavailable"))
        self.assertEqual(self.ids(), ["a1"])


class EditDeleteTests(ControlFixture, SynchronousTestCase):
    """
    C{PATCH} and C{DELETE /admin/accounts/{id}}.
    """

    def setUp(self):
        super().setUp()
        self.assertEqual(self.call(b"POST", "accounts", self.apikey())[0], 201)

    def test_update(self):
        """
        Priority, concurrency, models, mapping, ws_mode, proxy and label
        change the account in force (its pooled sockets retired, as a
        reload does); a proxy is shown without its password (R100); C{null}
        resets a field; the account's learnt state is kept (a change, not
        a renewal) unless its key or proxy changed.
        """
        changes, retired = [], []
        self.app.live.accounts.subscribe(changes.append)
        pool = self.app.extras["wsPool"]
        self.patch(type(pool), "retire", lambda this, accountId: retired.append(accountId))
        status, body = self.call(b"PATCH", "accounts/x1", {
            "priority": 1, "concurrency": 7, "models": ["gpt-5.5"], "ws_mode": "passthrough",
            "model_mapping": {"gpt-5": "gpt-5.5"}, "label": "team b"})
        self.assertEqual(status, 200, body)
        account = self.app.live.accounts.byId("x1")
        self.assertEqual((account.priority, account.concurrency, account.models, account.ws_mode),
                         (1, 7, ("gpt-5.5",), "passthrough"))
        self.assertEqual(body["account"]["label"], "team b")
        self.assertEqual(changes[-1].changed, frozenset({"x1"}))
        self.assertEqual(changes[-1].renewed, frozenset())
        # As a reload does: the changed account's pooled upstream WebSockets
        # are retired once idle; no other account's.
        self.assertEqual(retired, ["x1"])
        status, body = self.call(b"PATCH", "accounts/x1", {"proxy_id": "p1"})
        self.assertEqual(body["account"]["proxy"], {"id": "p1", "scheme": "http",
                                                    "host": "127.0.0.1", "port": 3128})
        self.assertNotIn("proxypass123", self.lastRaw.decode())
        self.assertEqual(changes[-1].renewed, frozenset({"x1"}))
        status, body = self.call(b"PATCH", "accounts/x1", {"models": None, "proxy": None})
        account = self.app.live.accounts.byId("x1")
        self.assertEqual((account.models, account.proxy), (None, None))
        status, body = self.call(b"PATCH", "accounts/x1", {"api_key": "sk-rotated-key-x1"})
        self.assertEqual(status, 200)
        self.assertEqual(self.app.live.accounts.byId("x1").credential, "sk-rotated-key-x1")
        self.assertNotIn("sk-rotated-key-x1", self.lastRaw.decode())
        self.assertEqual([e["action"] for e in self.audit()][:2],
                         ["account.update", "account.update"])

    def test_updateRefused(self):
        """
        A file account's fields are the file's (409 naming the file); a
        field that is not editable, an empty change, a bad value or an
        unknown account is refused; nothing changes.
        """
        status, body = self.call(b"PATCH", "accounts/a1", {"priority": 1})
        self.assertEqual((status, body["error"]["code"]), (409, "file_account"))
        self.assertIn(self.path, body["error"]["message"])
        for change, param in (({"base_url": "http://x:1/v1"}, "base_url"), ({}, None),
                              ({"priority": "x"}, "priority"), ({"type": "oauth"}, "type")):
            status, body = self.call(b"PATCH", "accounts/x1", change)
            self.assertEqual(status, 400, change)
            self.assertEqual(body["error"]["param"], param)
        self.assertEqual(self.call(b"PATCH", "accounts/nope", {"priority": 1})[0], 404)
        self.assertEqual(self.app.live.accounts.byId("x1").priority, 5)

    def test_concurrentEditIsAConflict(self):
        """
        Two admins editing one account: the second write, made from a
        stale read, is a 409 and loses nothing.
        """
        store = self.parts.store
        stale = self.successResultOf(store.get("account", "x1"))
        fresh = dict(stale.data, label="other admin")
        self.successResultOf(store.put("account", "x1", fresh, stale.version))
        original = type(store).get
        self.patch(type(store), "get", lambda this, kind, id: succeed(stale)
                   if kind == "account" else original(this, kind, id))
        status, body = self.call(b"PATCH", "accounts/x1", {"priority": 2})
        self.patch(type(store), "get", original)
        self.assertEqual((status, body["error"]["code"]), (409, "conflict"))
        self.assertEqual(self.successResultOf(store.get("account", "x1")).data["label"],
                         "other admin")

    def test_delete(self):
        """
        An admin account is removed (its pause with it); a file account is
        a 409 naming the file; an unknown one a 404.
        """
        self.call(b"POST", "accounts/x1/disable")
        status, body = self.call(b"DELETE", "accounts/x1")
        self.assertEqual((status, body), (200, {"deleted": "x1"}))
        self.assertEqual(self.ids(), ["a1"])
        self.assertIsNone(self.successResultOf(self.parts.store.get("pause", "x1")))
        status, body = self.call(b"DELETE", "accounts/a1")
        self.assertEqual(status, 409)
        self.assertIn(self.path, body["error"]["message"])
        self.assertEqual(self.call(b"DELETE", "accounts/x1")[0], 404)
        self.assertEqual(self.audit()[0]["action"], "account.delete")

    def test_getOne(self):
        """
        C{GET /admin/accounts/{id}}: the configuration view of a file or an
        admin account, no secret.
        """
        status, body = self.call(b"GET", "accounts/a1")
        self.assertEqual((status, body["account"]["source"]), (200, "file"))
        self.assertNotIn(FILE_KEY, self.lastRaw.decode())
        self.assertEqual(self.call(b"GET", "accounts/x1")[1]["account"]["source"], "admin")
        self.assertEqual(self.call(b"GET", "accounts/zz")[0], 404)


class PauseTests(ControlFixture, SynchronousTestCase):
    """
    C{POST /admin/accounts/{id}/disable} and C{/enable}.
    """

    def test_pauseAFileAccount(self):
        """
        A paused account (here a file account) is never scheduled: the
        scheduler's block hook says so, the view shows a C{paused} block
        and C{schedulable: false}; a clear (R95) keeps the pause; enable
        lifts it.
        """
        status, body = self.call(b"POST", "accounts/a1/disable", {"reason": "flaky upstream"})
        self.assertEqual((status, body["account"]["paused"]), (200, True))
        account = self.app.live.accounts.byId("a1")
        self.assertEqual(self.app.scheduler._extraBlock(account, NOW, None),
                         ("paused: flaky upstream", 0))
        row = self.rows()["a1"]
        self.assertEqual((row["paused"], row["schedulable"]), (True, False))
        self.assertEqual(row["blocks"][0]["kind"], "paused")
        self.assertIn("paused", row["reason"])
        self.assertEqual(self.call(b"POST", "accounts/a1/clear")[0], 200)
        self.assertIsNotNone(self.app.scheduler._extraBlock(account, NOW, None))
        self.assertEqual(self.call(b"POST", "accounts/a1/enable")[0], 200)
        self.assertIsNone(self.app.scheduler._extraBlock(account, NOW, None))
        self.assertTrue(self.rows()["a1"]["schedulable"])
        self.assertEqual([e["action"] for e in self.audit()],
                         ["account.enable", "account.clear", "account.disable"])

    def test_refused(self):
        """
        Unknown accounts are 404; a reason must be short text.
        """
        self.assertEqual(self.call(b"POST", "accounts/zz/disable")[0], 404)
        self.assertEqual(self.call(b"POST", "accounts/a1/disable", {"reason": 5})[0], 400)
        self.assertEqual(self.call(b"POST", "accounts/a1/disable", {"why": "x"})[0], 400)
        self.assertFalse(self.plane.isPaused("a1"))

    def test_anotherProcessesChangeApplies(self):
        """
        A change written by another process (its store write's
        notification) is applied here: a pause, then an added account.
        """
        store = self.parts.store
        self.successResultOf(store.put("pause", "a1", {"paused_at": NOW}, None))
        self.assertTrue(self.plane.isPaused("a1"))
        spec = self.apikey("y1")
        self.successResultOf(store.put("account", "y1", {"spec": spec, "created_at": NOW}, None))
        self.assertEqual(self.ids(), ["a1", "y1"])
        self.successResultOf(store.delete("account", "y1", ANY))
        self.assertEqual(self.ids(), ["a1"])

    def test_loadingHoldsTheStartupGate(self):
        """
        Until the store's first read at start, the plane holds the one
        start-up gate's C{control} flag (turns wait there, R105) and the key
        ring is pending; it blocks no account (before the merge of issue 19
        every account was "control_loading", so a turn that got past the
        gate was refused as if the account were cooling down). The grace
        settles it.
        """
        from relay.process.readiness import StartupGate

        never = Deferred()
        self.patch(type(self.parts.store), "list", lambda this, kind: never)
        gate = StartupGate()
        gate.mark(gate.settings)()
        gate.mark(gate.tokens)()
        self.plane.onSettled = gate.mark(gate.add("control"))
        self.plane._loaded = False
        self.plane.start()
        waiting = gate.wait()
        self.assertNoResult(waiting)
        self.assertTrue(self.app.keys.pending)
        account = self.app.live.accounts.byId("a1")
        self.assertIsNone(self.plane.blockReason(account, NOW))
        self.reactor.advance(LOADING_GRACE_SECONDS + 1)
        self.successResultOf(waiting)
        self.assertFalse(self.app.keys.pending)
        self.assertFalse(self.plane.ready)  # /readyz still lists control

    def test_failedFirstReadOpensTheGate(self):
        """
        R35/R101: a first read that fails settles at once (fail open,
        logged) -- a silent store ends the wait instead of holding every
        turn for the grace -- and the read is tried again by itself, so a
        store that comes back is applied (and C{/readyz} ready) without a
        change to announce it.
        """
        from relay.control.plane import RETRY_SECONDS

        from twisted.internet.defer import fail
        from twisted.logger import capturedLogs

        from relay.control.store import ControlStoreUnavailable
        from relay.process.readiness import StartupGate

        store = self.parts.store
        original = type(store).list
        self.patch(type(store), "list",
                   lambda this, kind: fail(ControlStoreUnavailable("redis down")))
        gate = StartupGate()
        gate.mark(gate.settings)()
        gate.mark(gate.tokens)()
        self.plane.onSettled = gate.mark(gate.add("control"))
        self.plane._loaded = False
        with capturedLogs() as events:
            self.plane.start()
        self.assertTrue(gate.isOpen)
        self.assertFalse(self.app.keys.pending)
        self.assertFalse(self.plane.ready)
        self.assertIn("relay.control_sync_failed", [e.get("event") for e in events])
        self.patch(type(store), "list", original)
        self.reactor.advance(RETRY_SECONDS)
        self.assertTrue(self.plane.ready)

    def test_silentRedisSettlesTheFirstRead(self):
        """
        R101: when the Redis client finds Redis silent, a first read still
        in flight (answered only at its timeout) settles at once.
        """
        from relay.process.readiness import StartupGate

        never = Deferred()
        self.patch(type(self.parts.store), "list", lambda this, kind: never)
        gate = StartupGate()
        self.plane.onSettled = gate.mark(gate.add("control"))
        self.plane._loaded = False
        self.plane.start()
        self.assertFalse(gate.isSet(["control"]))
        self.plane.storeUnreachable()
        self.assertTrue(gate.isSet(["control"]))
        self.assertFalse(self.app.keys.pending)
        self.flushLoggedErrors()


class EmbeddedStartTests(SynchronousTestCase):
    """
    With the embedded store, the control plane knows the pauses before
    relay listens (R105: no turn meets a paused account, none waits).
    """

    def test_pausesKnownAtStart(self):
        """
        A pause written before a restart blocks the account from the
        plane's start, with no loading window.
        """
        from relay.control.plane import ControlPlane
        from relay.control.store.sqlite import SQLiteControlStore
        from relay.process.live import LiveConfiguration
        from relay.state.settingsdb import SQLiteSettingsStore
        from tests.test_settings import synchronousPool

        path = self.mktemp()
        database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(database.close)
        reactor = MemoryReactorClock()
        reactor.advance(NOW)
        store = SQLiteControlStore(database=database, clock=reactor)
        self.successResultOf(store.put("pause", "a1", {"paused_at": NOW}, None))
        live = LiveConfiguration.fromConfig(settingsFromString(CONFIG))
        plane = ControlPlane(clock=reactor, live=live)
        plane.attach(store)
        # The store's asynchronous read has not answered yet (a thread).
        self.patch(SQLiteControlStore, "list", lambda this, kind: Deferred())
        plane.start()
        account = live.accounts.byId("a1")
        self.assertEqual(plane.blockReason(account, NOW), ("paused: by admin", 0))


class ReloadTests(ControlFixture, SynchronousTestCase):
    """
    A reload keeps what the control plane added and refuses a clash.
    """

    def write(self, text):
        with open(self.path, "w") as f:
            f.write(text)

    def test_reloadKeepsAdminAccountsAndPauses(self):
        """
        A reload never touches admin accounts, and a paused file account
        stays paused; the file's own change applies.
        """
        self.call(b"POST", "accounts", self.apikey())
        self.call(b"POST", "accounts/a1/disable")
        self.write(CONFIG.replace("base_url:", "priority: 9, base_url:"))
        result = self.app.reloader.reload("admin")
        self.assertTrue(result.applied, result.problems)
        self.assertEqual(self.ids(), ["a1", "x1"])
        self.assertEqual(result.accounts.removed, frozenset())
        self.assertEqual(self.app.live.accounts.byId("a1").priority, 9)
        self.assertTrue(self.plane.isPaused("a1"))

    def test_reloadRefusesAClash(self):
        """
        A file that would add an id an admin account has is a reload
        problem naming the id; nothing changes.
        """
        self.call(b"POST", "accounts", self.apikey())
        self.write(CONFIG + "  - {id: x1, type: apikey, api_key: sk-file-x1-secret}\n")
        result = self.app.reloader.reload("admin")
        self.assertFalse(result.applied)
        self.assertIn("'x1' is already an account added through the admin API",
                      " ".join(result.problems))
        self.assertEqual(self.app.live.accounts.byId("x1").credential, ADMIN_SECRET)

    def test_reloadRefusesRemovingAnAdminAccountsProxy(self):
        """
        A file that drops a proxy an admin account uses is refused.
        """
        self.call(b"POST", "accounts", self.apikey(proxy_id="p1"))
        self.write(CONFIG.replace('proxies: [{id: p1, url: "http://user:proxypass123@127.0.0.1:'
                                  '3128"}]\n', ""))
        result = self.app.reloader.reload("admin")
        self.assertFalse(result.applied)
        self.assertIn("'p1' is the proxy of the admin account 'x1'", " ".join(result.problems))

    def test_clashAtStartAdminWins(self):
        """
        A file edited while relay was stopped can still clash: the admin
        account is in force and the file's entry is ignored (logged).
        """
        self.call(b"POST", "accounts", self.apikey())
        fileX1 = settingsFromString(
            CONFIG + "  - {id: x1, type: apikey, api_key: sk-file-x1-secret}\n").accounts
        accounts = self.plane.overlay(fileX1)
        self.assertEqual([a.id for a in accounts], ["a1", "x1"])
        self.assertEqual(accounts[1].credential, ADMIN_SECRET)
        self.flushLoggedErrors()


class GuardTests(ControlFixture, SynchronousTestCase):
    """
    R99: the control routes need the admin key and change nothing without.
    """

    def test_adminKeyRequired(self):
        """
        Without the key (or with a client key) every control route is a
        401 and nothing changes or is audited.
        """
        for key in (None, "sk-relay-control-test"):
            for method, path, body in ((b"POST", "accounts", self.apikey()),
                                       (b"POST", "accounts/a1/disable", {}),
                                       (b"PATCH", "accounts/a1", {"priority": 1}),
                                       (b"DELETE", "accounts/a1", None),
                                       (b"POST", "logins", {"flow": "device"}),
                                       (b"GET", "logins", None), (b"GET", "audit", None)):
                status, _ = self.call(method, path, body, key=key)
                self.assertEqual(status, 401, (key, method, path))
        self.assertEqual(self.ids(), ["a1"])
        self.assertFalse(self.plane.isPaused("a1"))
        self.assertEqual(self.audit(), [])


class NoAdminKeyTests(ControlFixture, SynchronousTestCase):
    """
    Without an admin key the control routes do not exist (404).
    """

    configText = CONFIG.replace(f"admin_key: {ADMIN}\n", "")

    def test_disabled(self):
        """
        Every control route answers 404.
        """
        for method, path in ((b"POST", "accounts"), (b"GET", "audit"), (b"POST", "logins")):
            self.assertEqual(self.call(method, path, {}, key=None)[0], 404)


class AuditTests(ControlFixture, SynchronousTestCase):
    """
    C{GET /admin/audit} and the trail's rules.
    """

    def test_newestFirstFilteredBounded(self):
        """
        Records come newest first; C{account} filters, C{limit} bounds (a
        bad one is a 400); a refused request is not a change.
        """
        self.call(b"POST", "accounts", self.apikey())
        self.call(b"POST", "accounts/a1/disable")
        self.call(b"PATCH", "accounts/a1", {"priority": 1})
        entries = self.audit()
        self.assertEqual([e["action"] for e in entries], ["account.disable", "account.create"])
        self.assertEqual([e["account"] for e in self.query(account="x1")["audit"]], ["x1"])
        self.assertEqual(len(self.query(limit="1")["audit"]), 1)

    def query(self, **args):
        request = DummyRequest([b"admin", b"audit"])
        request.method = b"GET"
        request.args = {k.encode(): [v.encode()] for k, v in args.items()}
        request.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {ADMIN}".encode()])
        leaf = getChildForRequest(self.app.site.resource, request)
        leaf.render(request)
        self.responseCode = request.responseCode
        return json.loads(b"".join(request.written))

    def test_actions(self):
        """
        Every admin change has a name, the unknown ones (keys, issue 22)
        after their route.
        """
        cases = [
            (("POST", ["accounts"]), ("account.create", None)),
            (("POST", ["accounts", "a1", "disable"]), ("account.disable", "a1")),
            (("PUT", ["accounts", "a1", "tokens"]), ("account.tokens", "a1")),
            (("POST", ["logins", "l1", "complete"]), ("login.complete", "l1")),
            (("PUT", ["settings"]), ("settings.update", None)),
            (("POST", ["reload"]), ("config.reload", None)),
            (("POST", ["keys"]), ("key.create", None)),
            (("DELETE", ["keys", "bob"]), ("key.delete", "bob")),
            (("POST", ["keys", "bob", "revoke"]), ("key.revoke", "bob")),
        ]
        for (method, segments), expected in cases:
            self.assertEqual(actionOf(method, segments), expected)

    def test_scrub(self):
        """
        A secret-looking name's value never reaches a record.
        """
        self.assertEqual(scrub({"api_key": "sk-x", "fields": ["api_key"], "nested": {
            "refresh_token": "rt", "priority": 3}, "code": "c"}),
            {"api_key": "***", "fields": ["api_key"], "nested": {"refresh_token": "***",
                                                                 "priority": 3}, "code": "***"})

    def test_operatorChangesAudited(self):
        """
        The operator surface's own changes (settings, clear) are recorded
        too.
        """
        self.assertEqual(self.call(b"PUT", "settings", {"retry_interval_ms": 5})[0], 200)
        self.assertEqual(self.call(b"POST", "accounts/a1/clear")[0], 200)
        self.assertEqual([e["action"] for e in self.audit()],
                         ["account.clear", "settings.update"])

    def test_badLimit(self):
        """
        C{limit} outside 1..1000 is a 400 naming it.
        """
        for bad in ("0", "1001", "ten"):
            body = self.query(limit=bad)
            self.assertEqual(self.responseCode, 400)
            self.assertEqual(body["error"]["param"], "limit")


class HelperTests(SynchronousTestCase):
    """
    Small pieces: messages, URLs, views.
    """

    def test_describeConfigError(self):
        """
        File messages become field messages with the field as C{param}.
        """
        self.assertEqual(describeConfigError(ConfigError("account.priority: expected x")),
                         ("priority: expected x", "priority"))
        self.assertEqual(describeConfigError(ConfigError("account (a1): type is required")),
                         ("type is required", None))
        self.assertEqual(describeConfigError(ConfigError("unknown key account.foo")),
                         ("unknown field foo", "foo"))

    def test_safeURL(self):
        """
        R100: no userinfo, query or fragment.
        """
        self.assertEqual(safeURL("https://u:p@h.example:8443/v1?k=s#f"), "https://h.example:8443/v1")
        self.assertIsNone(safeURL(None))

    def test_publicAccountHasNoSecret(self):
        """
        The view carries no credential, token or proxy password.
        """
        config = settingsFromString(CONFIG)
        account = evolve(config.accounts[0], proxy=config.proxies[0])
        view = json.dumps(publicAccount(account, "file"))
        self.assertNotIn(FILE_KEY, view)
        self.assertNotIn("proxypass123", view)

    def test_readJSONBody(self):
        """
        An empty body may read as C{{}}.
        """
        request = DummyRequest([])
        request.content = BytesIO(b"")
        self.assertEqual(readJSONBody(request, allowEmpty=True), {})
        self.assertRaises(ControlError, readJSONBody, request)

    def test_noImportOfTheTapModule(self):
        """
        The control plane does not need the twistd plugin module.
        """
        import relay.control.assemble  # noqa: F401

        self.assertTrue(os.path.exists(relay.control.assemble.__file__))
