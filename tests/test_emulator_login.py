"""
Issue 21: the emulator's ChatGPT login endpoints (L{relay.emulator.login},
protocol.md 7.5) through its resource, on a Clock: the browser flow's
authorize page, redirect and C{authorization_code} exchange (PKCE checked),
the device-code flow, and the faults (denied, expired, slow poll, wrong
state). relay's own wire helpers (L{relay.control.logins.wire}) build the
requests, so both sides of the format are checked against each other.
"""

from __future__ import annotations

import json
from io import BytesIO
from urllib.parse import parse_qs, urlsplit

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from relay.control.logins import wire
from relay.emulator import Emulator, EmulatorConfigError, validateConfig
from relay.emulator.login import CODEX_CLIENT_ID
from relay.oauth.tokens import accountIdOf, planOf

NOW = 1_800_000_000.0


def call(emulator, method, path, body=None, form=False, args=None, host=b"127.0.0.1:9"):
    """
    Send one request to the emulator's resource.

    @return: C{(status, headers, body bytes)}.
    """
    request = DummyRequest([s.encode() for s in path.strip("/").split("/")])
    request.method = method
    request.path = path.encode()
    request.uri = path.encode()
    request.args = {k.encode(): [v.encode()] for k, v in (args or {}).items()}
    request.requestHeaders.setRawHeaders(b"host", [host])
    if body is not None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        request.content = BytesIO(raw)
        request.requestHeaders.setRawHeaders(
            b"content-type", [b"application/x-www-form-urlencoded" if form
                              else b"application/json"])
    else:
        request.content = BytesIO(b"")
    result = emulator.site.resource.render(request)
    if result is not NOT_DONE_YET:
        request.write(result)
    return request.responseCode or 200, request.responseHeaders, b"".join(request.written)


class LoginEndpointTests(SynchronousTestCase):
    """
    Both flows against the emulator, with relay's request shapes.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.emulator = Emulator(reactor=self.clock, config={
            "oauth": {"device_interval": 2},
            "accounts": [{"name": "o-new", "type": "oauth", "chatgpt_account_id": "acct-new",
                          "plan_type": "pro"},
                         {"name": "o2", "type": "oauth"}]})

    def authorize(self, state="st-1", verifier=None):
        verifier = verifier or wire.newVerifier()
        url = wire.authorizeURL("http://127.0.0.1:9", CODEX_CLIENT_ID,
                                wire.challengeOf(verifier), state)
        params = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
        return verifier, params

    def decide(self, params, account="o-new", decision="allow"):
        form = dict(params, account=account, decision=decision)
        from urllib.parse import urlencode

        status, headers, _ = call(self.emulator, b"POST", "/oauth/authorize/decision",
                                  urlencode(form).encode(), form=True)
        self.assertEqual(status, 302)
        return wire.parseCallback(headers.getRawHeaders(b"location")[0].decode())

    def exchange(self, code, verifier, redirect=wire.BROWSER_REDIRECT_URI):
        body = wire.exchangeBody(code, verifier, redirect, CODEX_CLIENT_ID)
        status, _, raw = call(self.emulator, b"POST", "/oauth/token", body, form=True)
        return status, json.loads(raw)

    def test_browserFlow(self):
        """
        protocol.md 7.5: relay's authorize URL is accepted and shows one
        sign-in button per login; the redirect carries a code and the same
        state; the code exchanges once (form body, S256 verifier) for an
        access, refresh and id token whose claims name the account and plan.
        """
        verifier, params = self.authorize()
        status, _, page = call(self.emulator, b"GET", "/oauth/authorize", args=params)
        self.assertEqual(status, 200)
        self.assertIn(b"Continue as o-new", page)
        self.assertIn(b"Continue as o2", page)
        callback = self.decide(params)
        self.assertEqual(callback.state, "st-1")
        status, tokens = self.exchange(callback.code, verifier)
        self.assertEqual(status, 200, tokens)
        self.assertEqual(accountIdOf(tokens["id_token"]), "acct-new")
        self.assertEqual(planOf(tokens["access_token"]), "pro")
        self.assertTrue(tokens["refresh_token"].startswith("rt_"))
        status, again = self.exchange(callback.code, verifier)
        self.assertEqual((status, again["error"]), (400, "invalid_grant"))
        # The refresh token it issued rotates like any other.
        status, body = self.emulator.oauth.exchange(
            {"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual(status, 200)

    def test_pkceAndRedirectChecked(self):
        """
        A wrong verifier or redirect URI is C{invalid_grant}; a malformed
        authorize request (no S256 challenge, unknown client, unregistered
        redirect) is refused with a 400 page.
        """
        verifier, params = self.authorize()
        callback = self.decide(params)
        status, body = self.exchange(callback.code, wire.newVerifier())
        self.assertEqual((status, body["error"]), (400, "invalid_grant"))
        self.assertIn("code_verifier", body["error_description"])
        verifier, params = self.authorize()
        callback = self.decide(params)
        status, body = self.exchange(callback.code, verifier, "http://localhost:9/x")
        self.assertEqual(status, 400)
        for broken in ({"code_challenge_method": "plain"}, {"client_id": "app_other"},
                       {"redirect_uri": "http://evil.example/cb"}, {"state": ""}):
            status, _, page = call(self.emulator, b"GET", "/oauth/authorize",
                                   args=dict(params, **broken))
            self.assertEqual(status, 400, broken)
            self.assertIn(b"refused", page)

    def test_faults(self):
        """
        The rehearsal faults: C{denied} sends C{error=access_denied};
        C{wrong_state} another state; C{expired} an expired code; Cancel
        is a refusal too.
        """
        _, params = self.authorize()
        callback = self.decide(params, decision="deny")
        self.assertEqual((callback.error, callback.code), ("access_denied", None))
        self.assertEqual(callback.state, "st-1")
        call(self.emulator, b"PUT", "/_emulator/oauth/login", {"fault": "denied", "times": 1})
        self.assertEqual(self.decide(params).error, "access_denied")
        self.assertIsNotNone(self.decide(params).code)
        call(self.emulator, b"PUT", "/_emulator/oauth/login", {"fault": "wrong_state"})
        callback = self.decide(params)
        self.assertNotEqual(callback.state, "st-1")
        call(self.emulator, b"DELETE", "/_emulator/oauth/login")
        call(self.emulator, b"PUT", "/_emulator/oauth/login", {"fault": "expired"})
        verifier, params = self.authorize()
        callback = self.decide(params)
        status, body = self.exchange(callback.code, verifier)
        self.assertEqual(status, 400)
        self.assertIn("expired", body["error_description"])
        status, _, raw = call(self.emulator, b"PUT", "/_emulator/oauth/login", {"fault": "x"})
        self.assertEqual(status, 400)

    def userCode(self):
        status, _, raw = call(self.emulator, b"POST", "/api/accounts/deviceauth/usercode",
                              {"client_id": CODEX_CLIENT_ID})
        self.assertEqual(status, 200)
        return json.loads(raw)

    def poll(self, answer):
        status, _, raw = call(self.emulator, b"POST", "/api/accounts/deviceauth/token",
                              {"device_auth_id": answer["device_auth_id"],
                               "user_code": answer["user_code"]})
        return status, json.loads(raw)

    def test_deviceFlow(self):
        """
        protocol.md 7.5: a user code with a string interval; polls are 403
        pending until approved (through the page's form), then 200 with a
        code and its verifier, exchanged with the issuer's
        C{/deviceauth/callback}; early polls are counted.
        """
        answer = self.userCode()
        self.assertEqual(answer["interval"], "2")
        self.assertEqual(self.poll(answer)[0], 403)
        self.assertEqual(self.poll(answer)[1]["error"]["code"],
                         "deviceauth_authorization_pending")
        self.assertEqual(self.emulator.oauth.login.status()["early_polls"], 1)
        status, _, page = call(self.emulator, b"GET", "/codex/device")
        self.assertIn(b"<option value=\"o-new\">", page)
        from urllib.parse import urlencode

        status, _, page = call(self.emulator, b"POST", "/codex/device", urlencode(
            {"user_code": answer["user_code"].lower(), "account": "o-new",
             "decision": "allow"}).encode(), form=True)
        self.assertEqual(status, 200, page)
        self.assertIn(b"approved", page)
        self.clock.advance(2)
        status, code = self.poll(answer)
        self.assertEqual(status, 200, code)
        self.assertEqual(wire.challengeOf(code["code_verifier"]), code["code_challenge"])
        status, tokens = self.exchange(code["authorization_code"], code["code_verifier"],
                                       wire.deviceRedirectURI("http://127.0.0.1:9"))
        self.assertEqual(status, 200, tokens)
        self.assertEqual(accountIdOf(tokens["id_token"]), "acct-new")
        self.assertEqual(self.poll(answer)[0], 400)  # used

    def test_deviceFaults(self):
        """
        A refusal (script or C{denied} fault) is 400 C{access_denied}; an
        expired code (time or C{expired} fault) 400 C{expired_token};
        C{slow_poll} answers 429 C{slow_down}.
        """
        answer = self.userCode()
        status, _, raw = call(self.emulator, b"POST", "/_emulator/oauth/device/approve",
                              {"user_code": answer["user_code"], "decision": "deny"})
        self.assertEqual(status, 200)
        self.assertEqual(self.poll(answer)[1]["error"]["code"], "access_denied")
        answer = self.userCode()
        self.clock.advance(15 * 60)
        self.assertEqual(self.poll(answer)[1]["error"]["code"], "expired_token")
        call(self.emulator, b"PUT", "/_emulator/oauth/login", {"fault": "expired", "times": 1})
        answer = self.userCode()
        self.assertEqual(self.poll(answer)[1]["error"]["code"], "expired_token")
        call(self.emulator, b"PUT", "/_emulator/oauth/login", {"fault": "slow_poll", "times": 2})
        answer = self.userCode()
        self.assertEqual([self.poll(answer)[0] for _ in range(3)], [429, 429, 403])
        self.assertEqual(self.emulator.oauth.login.status()["slow_downs"], 2)

    def test_secretsNotRecorded(self):
        """
        The emulator's request recording masks codes, verifiers and device
        codes.
        """
        answer = self.userCode()
        self.poll(answer)
        verifier, params = self.authorize()
        callback = self.decide(params)
        self.exchange(callback.code, verifier)
        shown = json.dumps([r.toJSON() for r in self.emulator.requests])
        for secret in (answer["device_auth_id"], answer["user_code"], verifier, callback.code):
            self.assertNotIn(secret, shown)

    def test_config(self):
        """
        C{oauth.device_interval} is an integer from 1 to 60.
        """
        validateConfig({"oauth": {"device_interval": 1}})
        for bad in (0, 61, "5", True):
            self.assertRaises(EmulatorConfigError, validateConfig,
                              {"oauth": {"device_interval": bad}})
