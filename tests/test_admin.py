"""
Tests for L{relay.console.admin}: the admin API and the C{/metrics} resource.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from io import BytesIO

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SkipTest, SynchronousTestCase
from twisted.web.resource import getChildForRequest
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from relay.console.admin import buildAdminResource, metricsResource
from relay.console.metrics import RelayMetrics
from relay.state.settings import RuntimeSettings

KEY = "admin-secret"

ACCOUNTS = [
    {
        "id": "a1", "type": "oauth", "priority": 50, "concurrency": 3, "in_use": 2,
        "waiting": 1, "schedulable": False, "reason": "upstream transport error",
        "until": 1_700_000_600.0, "rate_limited_until": 0, "breaker": "closed",
        "disabled": False, "last_error": "connection refused", "turns": 12,
        "failovers": 3, "proxy_id": "p1", "proxy_state": "ok",
    },
]


def render(resource, request):
    """
    Render C{request} on C{resource} as twisted.web would: traverse, then
    render, finishing synchronous results.

    @return: the request, finished or pending.
    """
    leaf = getChildForRequest(resource, request)
    result = leaf.render(request)
    if result is not NOT_DONE_YET:
        request.write(result)
        request.finish()
    return request


def makeRequest(path, method=b"GET", key=KEY, body=None, scheme="Bearer"):
    """
    A L{DummyRequest} for C{/admin/<path>}.

    @param path: the path below C{/admin/}, e.g. C{"settings"}.
    """
    segments = [s.encode("utf-8") for s in path.split("/")] if path is not None else []
    request = DummyRequest(segments)
    request.method = method
    request.uri = b"/admin/" + (path or "").encode("utf-8")
    if key is not None:
        request.requestHeaders.setRawHeaders(
            b"authorization", [f"{scheme} {key}".encode("utf-8")]
        )
    if body is not None:
        request.content = BytesIO(body if isinstance(body, bytes) else json.dumps(body).encode())
    return request


def jsonBody(request):
    """
    @return: the decoded JSON the request was answered with.
    """
    return json.loads(b"".join(request.written))


class AdminFixture:
    """
    Builds the admin resource over fakes.
    """

    def setUp(self):
        self.settings = RuntimeSettings()
        self.cleared = []
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.metrics = RelayMetrics(clock=self.clock)
        self.accountsResult = ACCOUNTS
        self.root = self.build(KEY)

    def build(self, key):
        return buildAdminResource(
            key,
            self.settings,
            lambda: succeed(self.accountsResult),
            self.clearAccount,
            self.metrics.registry,
            recentFailovers=self.metrics.recentFailovers,
            clock=self.clock,
        )

    def clearAccount(self, accountId):
        if accountId not in {a["id"] for a in ACCOUNTS}:
            raise KeyError(accountId)
        self.cleared.append(accountId)
        return succeed(None)


class AuthTests(AdminFixture, SynchronousTestCase):
    """
    The admin key guards every route; without one the API does not exist.
    """

    def test_disabledIs404(self):
        """
        With no admin key configured every admin route answers 404, with or
        without a key, the status page included.
        """
        root = self.build(None)
        for path, method in [("settings", b"GET"), ("settings", b"PUT"), ("accounts", b"GET"),
                             ("accounts/a1/clear", b"POST"), ("", b"GET"), ("metrics", b"GET"),
                             ("nothing", b"GET")]:
            for key in (None, KEY, "None"):
                request = render(root, makeRequest(path, method, key=key, body={}))
                self.assertEqual(request.responseCode, 404, (path, key))
        request = render(root, makeRequest(None))
        self.assertEqual(request.responseCode, 404)

    def test_missingKeyIs401(self):
        """
        A missing key answers 401 with OpenAI's error envelope, carrying
        the request's id (issue 15) in the body and C{X-Request-Id}.
        """
        for path in ("settings", "accounts", "metrics"):
            request = render(self.root, makeRequest(path, key=None))
            self.assertEqual(request.responseCode, 401)
            requestId = request.responseHeaders.getRawHeaders(b"x-request-id")[0].decode()
            self.assertEqual(
                jsonBody(request),
                {"error": {"message": "Missing or invalid admin key",
                           "type": "authentication_error", "param": None,
                           "code": "invalid_admin_key", "request_id": requestId}},
            )

    def test_wrongKeyIs401(self):
        """
        A wrong key, an empty one, or the right key with another scheme
        answers 401; nothing changes.
        """
        for key, scheme in [("nope", "Bearer"), ("", "Bearer"), (KEY, "Basic"),
                            (KEY + "x", "Bearer")]:
            request = render(
                self.root,
                makeRequest("settings", b"PUT", key=key, scheme=scheme,
                            body={"retry_interval_ms": 5}),
            )
            self.assertEqual(request.responseCode, 401, (key, scheme))
        self.assertEqual(self.settings.current.retry_interval_ms, 0)

    def test_rightKey(self):
        """
        The right key (scheme in any case) is let through.
        """
        request = render(self.root, makeRequest("settings", scheme="bearer"))
        self.assertEqual(request.responseCode, 200)

    def test_statusPageWithoutKey(self):
        """
        The status page itself is served without the key, as HTML.
        """
        request = render(self.root, makeRequest("", key=None))
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(
            request.responseHeaders.getRawHeaders(b"content-type"), [b"text/html; charset=utf-8"]
        )
        page = b"".join(request.written)
        self.assertIn(b"relay status", page)
        # Issue 40: the shell loads its own files only (no other origin);
        # the key is kept by static/js/auth.js.
        self.assertIn(b'<script type="module" src="static/js/app.js">', page)
        self.assertNotIn(b"://", page)
        csp = request.responseHeaders.getRawHeaders(b"content-security-policy")[0]
        self.assertIn(b"script-src 'self';", csp)

    def test_adminRedirects(self):
        """
        C{/admin} redirects to C{/admin/} so the page's relative fetches
        work.
        """
        request = makeRequest(None, key=None)
        request.uri = b"/admin"
        render(self.root, request)
        self.assertEqual(request.responseCode, 301)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"location"), [b"/admin/"])

    def test_unknownRoute(self):
        """
        An unknown route answers 404 JSON.
        """
        request = render(self.root, makeRequest("bogus"))
        self.assertEqual(request.responseCode, 404)
        self.assertEqual(jsonBody(request)["error"]["code"], "not_found")

    def test_methodNotAllowed(self):
        """
        An unsupported method answers 405 JSON with C{Allow}.
        """
        request = render(self.root, makeRequest("settings", b"DELETE"))
        self.assertEqual(request.responseCode, 405)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"allow"), [b"GET, HEAD, PUT"])


class SettingsResourceTests(AdminFixture, SynchronousTestCase):
    """
    C{GET}/C{PUT /admin/settings} (R74).
    """

    def test_get(self):
        """
        GET returns the runtime settings, nested.
        """
        request = render(self.root, makeRequest("settings"))
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        self.assertEqual(body, self.settings.snapshot())
        self.assertEqual(body["breaker"]["failures"], 3)

    def test_schema(self):
        """
        C{GET /admin/settings/schema}: every runtime setting with its value,
        type and range, for an editor; a value put outside the range is
        clamped into it.
        """
        from relay.state.settings import RUNTIME_KEYS

        request = render(self.root, makeRequest("settings/schema"))
        self.assertEqual(request.responseCode, 200)
        rows = {r["name"]: r for r in jsonBody(request)["settings"]}
        self.assertEqual(set(rows), set(RUNTIME_KEYS))
        self.assertEqual(rows["breaker.failures"], {
            "name": "breaker.failures", "value": 3, "type": "integer", "minimum": 1,
            "maximum": 1000, "choices": None, "note": None})
        self.assertEqual(rows["transport_retry_policy"]["choices"], ["rotate", "sticky"])
        self.assertEqual(rows["breaker.enabled"]["type"], "boolean")
        self.assertTrue(all(r["type"] for r in rows.values()))
        render(self.root, makeRequest("settings", method=b"PUT", body={"breaker.failures": 5000}))
        self.assertEqual(self.settings.current.breaker.failures, 1000)

    def test_putPartial(self):
        """
        PUT applies only the keys present, normalised, at once; other keys
        keep their values. Flat and nested spellings both work.
        """
        request = render(
            self.root,
            makeRequest("settings", b"PUT",
                        body={"retry_interval_ms": 40000, "breaker.failures": 5,
                              "scheduling": {"fallback_max_waiting": -1}}),
        )
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        self.assertEqual(
            body["changed"],
            {"retry_interval_ms": 30000, "breaker.failures": 5,
             "scheduling.fallback_max_waiting": 0},
        )
        self.assertEqual(body["settings"]["retry_interval_ms"], 30000)
        self.assertEqual(body["settings"]["max_account_switches"], 10)
        self.assertEqual(self.settings.current.retry_interval_ms, 30000)
        self.assertEqual(self.settings.current.breaker.failures, 5)
        self.assertEqual(self.settings.current.transport_retry_policy, "rotate")

        request = render(self.root, makeRequest("settings", b"PUT",
                                                body={"transport_retry_policy": "bogus"}))
        self.assertEqual(jsonBody(request)["settings"]["transport_retry_policy"], "rotate")
        self.assertEqual(self.settings.current.retry_interval_ms, 30000)

    def test_unknownKey(self):
        """
        Unknown keys answer 400 naming every one; nothing is applied.
        """
        request = render(
            self.root,
            makeRequest("settings", b"PUT",
                        body={"retry_interval_ms": 5, "colour": "red",
                              "breaker": {"size": 1}}),
        )
        self.assertEqual(request.responseCode, 400)
        error = jsonBody(request)["error"]
        self.assertEqual(error["type"], "invalid_request_error")
        self.assertEqual(error["code"], "unknown_setting")
        self.assertIn("colour", error["message"])
        self.assertIn("breaker.size", error["message"])
        self.assertEqual(error["param"], "breaker.size")
        self.assertEqual(self.settings.current.retry_interval_ms, 0)

    def test_wrongType(self):
        """
        A value of the wrong type answers 400 naming it.
        """
        request = render(self.root, makeRequest("settings", b"PUT",
                                                body={"retry_interval_ms": "later"}))
        self.assertEqual(request.responseCode, 400)
        error = jsonBody(request)["error"]
        self.assertEqual(error["code"], "invalid_setting_value")
        self.assertEqual(error["param"], "retry_interval_ms")

    def test_invalidJSON(self):
        """
        A body that is not JSON, or not an object, answers 400.
        """
        for body in (b"{nope", b"[1]", b"", b"\xff"):
            request = render(self.root, makeRequest("settings", b"PUT", body=body))
            self.assertEqual(request.responseCode, 400, body)
            self.assertEqual(jsonBody(request)["error"]["code"], "invalid_json")

    def test_putWaitsForPersisting(self):
        """
        The answer is sent once the store has saved; the change is in
        memory before that.
        """
        saved = []

        class HoldingStore:
            def load(self):
                return succeed({})

            def save(self, values):
                d = Deferred()
                saved.append(d)
                return d

        self.settings.store = HoldingStore()
        request = render(self.root, makeRequest("settings", b"PUT",
                                                body={"retry_interval_ms": 9}))
        self.assertEqual(request.finished, 0)
        self.assertEqual(self.settings.current.retry_interval_ms, 9)
        saved[0].callback(None)
        self.assertEqual(request.finished, 1)
        self.assertEqual(request.responseCode, 200)

    def test_persistFailure(self):
        """
        A store failure answers 500 and is logged.
        """

        class FailingStore:
            def load(self):
                return succeed({})

            def save(self, values):
                return fail(OSError("disk full"))

        self.settings.store = FailingStore()
        request = render(self.root, makeRequest("settings", b"PUT",
                                                body={"retry_interval_ms": 9}))
        self.assertEqual(request.responseCode, 500)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)

    def test_clientGoneBeforeAnswer(self):
        """
        When the client goes before the store answers, nothing is written
        and the request is not finished again.
        """
        saved = []

        class HoldingStore:
            def load(self):
                return succeed({})

            def save(self, values):
                d = Deferred()
                saved.append(d)
                return d

        self.settings.store = HoldingStore()
        request = render(self.root, makeRequest("settings", b"PUT",
                                                body={"retry_interval_ms": 9}))
        request.processingFailed(Exception("connection lost"))
        saved[0].callback(None)
        self.assertEqual(request.written, [])
        self.assertEqual(request.finished, 0)


class AccountsResourceTests(AdminFixture, SynchronousTestCase):
    """
    C{GET /admin/accounts} and C{POST /admin/accounts/{id}/clear}.
    """

    def test_list(self):
        """
        The accounts view, the recent failovers and the server's time.
        """
        self.metrics.failover("transport_transient", "a1", "a2", "ws", 502)
        request = render(self.root, makeRequest("accounts"))
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        self.assertEqual(body["accounts"], ACCOUNTS)
        self.assertEqual(body["now"], 1_700_000_000)
        self.assertEqual(body["failovers"][0]["account_id"], "a1")
        self.assertEqual(body["failovers"][0]["next_account_id"], "a2")

    def test_viewFailure(self):
        """
        A failing accounts view answers 500 and is logged.
        """
        self.accountsResult = None
        root = buildAdminResource(KEY, self.settings, lambda: fail(ValueError("boom")),
                                  self.clearAccount)
        request = render(root, makeRequest("accounts"))
        self.assertEqual(request.responseCode, 500)
        self.assertEqual(jsonBody(request)["error"]["type"], "api_error")
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)

    def test_clear(self):
        """
        POST clear calls C{clearAccount} with the id.
        """
        request = render(self.root, makeRequest("accounts/a1/clear", b"POST"))
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(jsonBody(request), {"cleared": "a1"})
        self.assertEqual(self.cleared, ["a1"])

    def test_clearUnknown(self):
        """
        An unknown id (C{clearAccount} raises L{KeyError}) answers 404.
        """
        request = render(self.root, makeRequest("accounts/zz/clear", b"POST"))
        self.assertEqual(request.responseCode, 404)
        self.assertEqual(jsonBody(request)["error"]["code"], "account_not_found")

    def test_clearNeedsKey(self):
        """
        Clearing needs the key.
        """
        request = render(self.root, makeRequest("accounts/a1/clear", b"POST", key="x"))
        self.assertEqual(request.responseCode, 401)
        self.assertEqual(self.cleared, [])

    def test_badPaths(self):
        """
        Other paths under C{accounts} answer 404.
        """
        for path, method in [("accounts/a1", b"POST"), ("accounts/a1/reset", b"POST"),
                             ("accounts/a1/clear", b"GET")]:
            request = render(self.root, makeRequest(path, method))
            self.assertEqual(request.responseCode, 404, path)


class MetricsResourceTests(AdminFixture, SynchronousTestCase):
    """
    C{/metrics} and C{/admin/metrics}.
    """

    def test_metrics(self):
        """
        C{/metrics} serves the registry in Prometheus text format.
        """
        self.metrics.turnFinished("http", "ok")
        request = DummyRequest([])
        result = metricsResource(self.metrics.registry).render(request)
        self.assertIn(b'relay_turns_total{entrypoint="http",outcome="ok"} 1.0', result)
        self.assertIn(b"text/plain", request.responseHeaders.getRawHeaders(b"content-type")[0])

    def test_adminMetricsNeedsKey(self):
        """
        C{/admin/metrics} serves the same behind the key.
        """
        self.assertEqual(render(self.root, makeRequest("metrics", key=None)).responseCode, 401)
        request = render(self.root, makeRequest("metrics"))
        self.assertEqual(request.responseCode, 200)
        self.assertIn(b"relay_turns_total", b"".join(request.written))


class ClearLogTests(SynchronousTestCase):
    """
    C{POST /admin/accounts/{id}/clear} through a built relay.
    """

    def test_oneLine(self):
        """
        A clear is logged once, as C{relay.account_cleared} with its cause
        (it was logged twice: by the account state and by the admin route).
        """
        from twisted.internet.testing import MemoryReactorClock, StringTransport
        from twisted.logger import capturedLogs, formatEvent

        from relay.process.app import buildApplication
        from relay.configuration.parse import settingsFromString

        config = settingsFromString(
            'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
            "admin_key: admin-k-0123456789-Qx7v\nkeys: [{name: team, key: sk-team}]\n"
            "accounts: [{id: a1, type: apikey, api_key: sk-up, "
            'base_url: "http://127.0.0.1:1/v1"}]\n'
        )
        site = buildApplication(config, MemoryReactorClock()).site
        protocol = site.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        with capturedLogs() as logs:
            protocol.dataReceived(
                b"POST /admin/accounts/a1/clear HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer admin-k-0123456789-Qx7v\r\nContent-Length: 0\r\n\r\n"
            )
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value()[:200])
        cleared = [e for e in logs if e.get("event") == "relay.account_cleared"]
        self.assertEqual([formatEvent(e) for e in cleared], ["account a1 cleared (operator)"])
        self.assertEqual(cleared[0]["cause"], "operator")


class StatusPageScriptTests(SynchronousTestCase):
    """
    The status page's own logic (C{stateOf} of C{static/js/health.js}) run
    in Node.js, and its CSS; the page in a real browser is
    C{tests/integration/test_status_page.py} and C{test_console_page.py}.
    """

    def static(self, name: str) -> str:
        from importlib import resources

        return resources.files("relay.console").joinpath("static", name).read_text("utf-8")

    def stateOf(self, account: dict) -> list:
        """
        Run the page's C{stateOf(account, 1000)} in Node.js.
        """
        node = shutil.which("node") or shutil.which("nodejs")
        if node is None:
            raise SkipTest("Node.js is not installed")
        from importlib import resources

        path = resources.files("relay.console").joinpath("static", "js", "health.js")
        script = ("import {stateOf} from " + json.dumps(Path(str(path)).as_uri()) + ";\n"
                  "process.stdout.write(JSON.stringify(stateOf(" + json.dumps(account)
                  + ", 1000)));")
        result = subprocess.run([node, "--input-type=module", "-e", script], capture_output=True,
                                text=True, timeout=30, check=False)
        self.assertEqual(result.returncode, 0, result.stderr)
        return json.loads(result.stdout)

    def test_inDoubtIsAWarning(self):
        """
        Issue 12: a schedulable account whose refresh token is in doubt
        gets the warning badge "token in doubt", not the green "ok"; an ok
        token stays "ok" and needs_login stays "needs login".
        """
        base = {"schedulable": True, "disabled": False, "breaker": None}
        self.assertEqual(self.stateOf({**base, "token_status": "in_doubt"}),
                         ["doubt", "token in doubt"])
        self.assertEqual(self.stateOf({**base, "token_status": "ok"}), ["ok", "ok"])
        self.assertEqual(self.stateOf({**base, "token_status": "needs_login",
                                       "schedulable": False}), ["disabled", "needs login"])

    def test_failingIsNeverOk(self):
        """
        Issue 40: an account whose attempts fail is shown failing once its
        cooldown has lapsed (schedulable again), from the relay's health,
        and -- from a relay without it -- from 0 turns and failovers with an
        error after the last success; a degraded one is a warning.
        """
        base = {"schedulable": True, "disabled": False, "breaker": None}
        self.assertEqual(self.stateOf({**base, "health": {"state": "failing"}}),
                         ["failing", "failing"])
        self.assertEqual(self.stateOf({**base, "health": {"state": "degraded"}}),
                         ["doubt", "degraded"])
        self.assertEqual(self.stateOf({**base, "health": {"state": "ok"}}), ["ok", "ok"])
        self.assertEqual(self.stateOf({**base, "turns": 0, "failovers": 7,
                                       "last_error": "server_error", "last_error_at": 990}),
                         ["failing", "failing"])
        self.assertEqual(self.stateOf({**base, "health": {"state": "paused"}}),
                         ["disabled", "paused"])

    def test_tokenTextNotClipped(self):
        """
        The lines under an account (token state, reasons) wrap instead of
        being cut, and the doubt and failing states have their own badge
        colours.
        """
        css = self.static("css/console.css")
        rule = re.search(r"\n\.sub \{([^}]*)\}", css)
        self.assertIsNotNone(rule)
        self.assertIn("overflow-wrap: anywhere", rule.group(1))
        self.assertIn(".state-doubt .badge { background: var(--doubt); }", css)
        self.assertIn(".state-failing .badge { background: var(--failing); }", css)
        self.assertIn('"sub token"', self.static("js/sections/accounts.js"))


class OAuthRefreshRouteTests(SynchronousTestCase):
    """
    C{POST /admin/accounts/{id}/refresh} over the real
    L{relay.console.view.OperatorView} and L{relay.oauth.credentials.OAuthCredentials}.
    """

    def setUp(self):
        from relay.base.records import GatewaySettings, OAuthSettings
        from relay.oauth.credentials import OAuthCredentials
        from relay.oauth.store import MemoryTokenStore
        from relay.console.view import OperatorView
        from tests.test_oauth import NOW, FakeEndpoint, account, token

        self.clock = Clock()
        self.clock.advance(NOW)
        self.endpoint = FakeEndpoint()
        self.account = account("o2", access=token(NOW + 3600, NOW))
        self.credentials = OAuthCredentials(
            clock=self.clock,
            settings=RuntimeSettings(current=GatewaySettings(
                oauth=OAuthSettings(refresh_margin_seconds=600))),
            store=MemoryTokenStore(clock=self.clock), endpoint=self.endpoint,
            accounts=[self.account],
        )
        self.successResultOf(self.credentials.start())
        self.addCleanup(self.credentials.stop)
        class _Health:
            def clear(self, accountId, why):
                return succeed(None)

        view = OperatorView(accounts=[self.account], store=None, admission=None, health=_Health(),
                            runner=None, clock=self.clock, credentials=self.credentials)
        self.root = buildAdminResource(KEY, RuntimeSettings(), lambda: succeed([]),
                                       lambda accountId: succeed(None), None,
                                       clock=self.clock, tokenActions=view)

    def test_inDoubtAnswerSaysRetryInDoubt(self):
        """
        A forced refresh of an in-doubt account answers C{refreshed: false}
        with C{reason: refresh_in_doubt} and a hint naming
        C{retry_in_doubt}; the log line says it was not refreshed and why.
        With C{retry_in_doubt} the token is sent and the answer has no
        reason.
        """
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher

        from tests.test_oauth import rotated

        self.endpoint.auto = lambda rt: ConnectionResetError("lost after sending")
        self.assertFalse(self.successResultOf(
            self.credentials.refresh(self.account, force=True)))
        calls = len(self.endpoint.calls)
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        request = render(self.root, makeRequest("accounts/o2/refresh", b"POST", body={}))
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        self.assertEqual((body["refreshed"], body["reason"]), (False, "refresh_in_doubt"))
        self.assertIn('"retry_in_doubt": true', body["hint"])
        self.assertEqual(len(self.endpoint.calls), calls)
        [event] = [e for e in events if e.get("event") == "relay.oauth_admin_refresh"]
        self.assertEqual(event["reason"], "refresh_in_doubt")
        self.assertIn("not refreshed (refresh_in_doubt)", event["outcome"])

        self.endpoint.auto = lambda rt: rotated(1)
        request = render(self.root, makeRequest("accounts/o2/refresh", b"POST",
                                                body={"retry_in_doubt": True}))
        body = jsonBody(request)
        self.assertTrue(body["refreshed"])
        self.assertNotIn("reason", body)
        self.assertEqual(body["token"]["token_status"], "ok")

    def test_tokenExpiryInISO(self):
        """
        The token view carries C{token_expires_at_iso} (ISO-8601 UTC, as
        blocks' C{until_iso}) beside C{token_expires_at}, in the answers of
        the refresh and tokens routes.
        """
        from relay.console.view import isoTime
        from tests.test_oauth import NOW, token

        request = render(self.root, makeRequest("accounts/o2/tokens", b"PUT", body={
            "access_token": token(NOW + 7200, NOW), "refresh_token": "rt-put"}))
        view = jsonBody(request)["token"]
        self.assertEqual(view["token_expires_at"], NOW + 7200)
        self.assertEqual(view["token_expires_at_iso"], isoTime(NOW + 7200))
        self.assertTrue(view["token_expires_at_iso"].endswith("Z"))
        self.endpoint.auto = lambda rt: tokenReplyFor(NOW + 9000)
        body = jsonBody(render(self.root, makeRequest("accounts/o2/refresh", b"POST", body={})))
        self.assertEqual(body["token"]["token_expires_at_iso"], isoTime(NOW + 9000))


def tokenReplyFor(exp):
    """
    A successful token reply whose access token expires at C{exp}.
    """
    from relay.oauth.endpoint import TokenReply
    from tests.test_oauth import NOW, token

    return TokenReply(200, {"access_token": token(exp, NOW), "refresh_token": "rt-next"})
