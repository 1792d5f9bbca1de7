"""
Tests for L{relay.control.logins} (issue 21, protocol.md 7.5,
behaviour.md R96, R97): the browser (PKCE) and device-code ChatGPT
logins started from the admin API, on a L{MemoryReactorClock} with a fake
L{IEgressClient} standing for the auth server (the real one, the
emulator, is in tests/integration/test_control_logins_page.py).
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

from twisted.internet.defer import fail, succeed
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.control.logins import wire
from relay.control.logins.service import LOGIN_TTL_SECONDS
from relay.interfaces import IEgressClient
from relay.oauth.egress import EgressClient, EgressReply
from tests.test_control import CONFIG, NOW, ControlFixture, oauthToken

ISSUER = "http://127.0.0.1:9"

LOGIN_CONFIG = CONFIG + f"""
  - {{id: o1, type: oauth, access_token: "{oauthToken('acct-o1', ttl=-60)}",
     chatgpt_account_id: acct-o1, auth_base_url: "{ISSUER}", proxy_id: p1,
     base_url: "http://127.0.0.1:9/backend-api/codex"}}
gateway: {{oauth: {{auth_base_url: "{ISSUER}"}}}}
"""


@implementer(IEgressClient)
class FakeEgress:
    """
    The auth server: answers by path from queues of replies (the last one
    repeats); records every request.
    """

    def __init__(self):
        self.requests = []
        self.replies = {}

    def answer(self, path, *replies):
        self.replies[path] = list(replies)

    def request(self, proxy, method, url, headers, body, timeout):
        path = urlsplit(url).path
        self.requests.append({"proxy": proxy, "method": method, "url": url, "path": path,
                              "headers": dict(headers), "body": body})
        queue = self.replies.get(path) or [EgressReply(500, {}, b"{}")]
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(reply, Exception):
            return fail(reply)
        return succeed(reply)

    def paths(self):
        return [r["path"] for r in self.requests]


def reply(status, body):
    return EgressReply(status, {"content-type": "application/json"}, json.dumps(body).encode())


def tokens(account="acct-new", plan="pro"):
    return {"access_token": oauthToken(account, plan, sub="access"),
            "refresh_token": "rt-login-secret-" + account,
            "id_token": oauthToken(account, plan, sub="id")}


class LoginFixture(ControlFixture):
    configText = LOGIN_CONFIG

    def setUp(self):
        super().setUp()
        self.egress = FakeEgress()
        self.parts.logins.egress = self.egress
        self.successResultOf(self.app.extras["credentials"].start())
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def loginRecord(self, loginId):
        return self.successResultOf(self.parts.store.get("login", loginId))

    def assertNotLogged(self, *secrets):
        """
        None of C{secrets} is in any log line relay would write, in either
        format, even without its redaction (the values were never logged).
        """
        import io

        from relay.base.logs import SecretSet, observerFor

        for fmt in ("json", "text"):
            stream = io.StringIO()
            observer = observerFor(fmt, stream, secrets=SecretSet(), worker=None)
            for event in self.events:
                observer(dict(event))
            for secret in secrets:
                self.assertNotIn(secret, stream.getvalue(), fmt)
        self.assertGreater(len(self.events), 2)


class BrowserLoginTests(LoginFixture, SynchronousTestCase):
    """
    The PKCE flow with the paste-back.
    """

    def begin(self, **account):
        account = dict({"id": "new1", "proxy_id": "p1", "priority": 3, "label": "Ana"},
                       **account)
        status, body = self.call(b"POST", "logins", {"flow": "browser", "account": account})
        self.assertEqual(status, 201, body)
        return body["login"]

    def test_authorizeURL(self):
        """
        protocol.md 7.5: Codex's client id, its localhost:1455 redirect, the
        scopes, an S256 challenge of the (stored, never answered) verifier
        and a state; the login lasts 10 minutes.
        """
        login = self.begin()
        url = urlsplit(login["authorize_url"])
        self.assertEqual(f"{url.scheme}://{url.netloc}{url.path}", ISSUER + "/oauth/authorize")
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        secret = self.loginRecord(login["id"]).data["secret"]
        self.assertEqual(query, {
            "response_type": "code", "client_id": "app_EMoamEEZ73f0CkXaXp7hrann",
            "redirect_uri": "http://localhost:1455/auth/callback",
            "scope": "openid profile email offline_access",
            "code_challenge": wire.challengeOf(secret["verifier"]),
            "code_challenge_method": "S256", "id_token_add_organizations": "true",
            "codex_cli_simplified_flow": "true", "state": secret["state"],
            "originator": "codex_cli_rs"})
        self.assertEqual(len(secret["verifier"]), 86)
        self.assertEqual(login["expires_at"], NOW + LOGIN_TTL_SECONDS)
        self.assertNotIn(secret["verifier"], self.lastRaw.decode())
        self.assertEqual(self.audit()[0]["action"], "login.start")

    def test_pastedAddressCreatesTheAccount(self):
        """
        The pasted address's code is exchanged (form body, the verifier,
        the same redirect URI) at the account's auth base URL through its
        proxy (R97); the new account takes its ChatGPT id and plan from the
        id token, serves at once, and relay manages its tokens; the login
        is single-use; no secret is answered or logged.
        """
        login = self.begin()
        secret = self.loginRecord(login["id"]).data["secret"]
        issued = tokens()
        self.egress.answer("/oauth/token", reply(200, issued))
        pasted = (f"http://localhost:1455/auth/callback?code=ac_secret_code"
                  f"&state={secret['state']}")
        status, body = self.call(b"POST", f"logins/{login['id']}/complete",
                                 {"redirect_url": pasted})
        self.assertEqual(status, 200, body)
        request = self.egress.requests[-1]
        self.assertEqual(request["url"], ISSUER + "/oauth/token")
        self.assertEqual(request["proxy"].id, "p1")
        form = {k: v[0] for k, v in parse_qs(request["body"].decode()).items()}
        self.assertEqual(form, {"grant_type": "authorization_code", "code": "ac_secret_code",
                                "redirect_uri": "http://localhost:1455/auth/callback",
                                "client_id": "app_EMoamEEZ73f0CkXaXp7hrann",
                                "code_verifier": secret["verifier"]})
        self.assertEqual(body["login"]["status"], "completed")
        self.assertEqual(body["account"]["chatgpt_account_id"], "acct-new")
        self.assertEqual(body["account"]["login"]["plan"], "pro")
        self.assertEqual((body["account"]["source"], body["account"]["label"]), ("admin", "Ana"))
        account = self.app.live.accounts.byId("new1")
        self.assertEqual((account.credential, account.priority, account.proxy.id),
                         (issued["access_token"], 3, "p1"))
        credentials = self.app.extras["credentials"]
        self.assertTrue(credentials.hasAccount("new1"))
        self.assertIsNone(self.app.scheduler._extraBlock(account, NOW, None))
        for value in list(issued.values()) + [secret["verifier"], "ac_secret_code"]:
            self.assertNotIn(value, self.lastRaw.decode())
        self.assertNotIn("secret", self.loginRecord(login["id"]).data)
        status, body = self.call(b"POST", f"logins/{login['id']}/complete",
                                 {"redirect_url": pasted})
        self.assertEqual((status, body["error"]["code"]), (409, "login_used"))
        self.assertNotLogged(secret["verifier"], secret["state"], "ac_secret_code",
                             *issued.values())
        actions = [e["action"] for e in self.audit()]
        self.assertEqual(actions[:2], ["login.complete", "login.start"])

    def test_justTheCode(self):
        """
        Pasting only the code works too (no state to check then).
        """
        login = self.begin()
        self.egress.answer("/oauth/token", reply(200, tokens()))
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {"code": "ac_1"})
        self.assertEqual(status, 200, body)
        self.assertIn("new1", [a.id for a in self.app.live.accounts])

    def test_wrongState(self):
        """
        An address with another login's state is refused before any
        exchange; the login ends and no account is created.
        """
        login = self.begin()
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {
            "redirect_url": "http://localhost:1455/auth/callback?code=ac_1&state=other"})
        self.assertEqual((status, body["error"]["code"]), (400, "state_mismatch"))
        self.assertEqual(self.egress.requests, [])
        self.assertNotIn("new1", self.ids())
        status, view = self.call(b"GET", f"logins/{login['id']}")
        self.assertEqual((view["login"]["status"], view["login"]["error"]["code"]),
                         ("failed", "state_mismatch"))
        self.assertEqual(self.audit()[0]["action"], "login.failed")

    def test_denied(self):
        """
        A refused sign-in (C{error=access_denied}) is a clear 400; no
        account.
        """
        login = self.begin()
        state = self.loginRecord(login["id"]).data["secret"]["state"]
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {
            "redirect_url": "http://localhost:1455/auth/callback?error=access_denied"
                            f"&error_description=The+user+said+no&state={state}"})
        self.assertEqual((status, body["error"]["code"]), (400, "login_denied"))
        self.assertIn("The user said no", body["error"]["message"])
        self.assertNotIn("new1", self.ids())

    def test_expired(self):
        """
        A login not completed within 10 minutes has expired: completing it
        is a 409 and its view says so.
        """
        login = self.begin()
        self.reactor.advance(LOGIN_TTL_SECONDS + 1)
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {"code": "ac_1"})
        self.assertEqual((status, body["error"]["code"]), (409, "login_expired"))
        self.assertEqual(self.call(b"GET", f"logins/{login['id']}")[1]["login"]["status"],
                         "expired")
        self.assertEqual(self.egress.requests, [])
        self.assertIn("login.expired", [e["action"] for e in self.audit()])

    def test_codeRefused(self):
        """
        A code the server refuses (expired, used) ends the login with its
        reason; no account.
        """
        login = self.begin()
        self.egress.answer("/oauth/token", reply(400, {
            "error": "invalid_grant", "error_description": "The authorization code has expired."}))
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {"code": "ac_1"})
        self.assertEqual((status, body["error"]["code"]), (400, "login_refused"))
        self.assertIn("authorization code has expired", body["error"]["message"])
        self.assertNotIn("new1", self.ids())

    def test_unreachable(self):
        """
        An auth server that cannot be reached through the proxy is a 502.
        """
        login = self.begin()
        self.egress.answer("/oauth/token", ConnectionRefusedError("refused"))
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {"code": "ac_1"})
        self.assertEqual((status, body["error"]["code"]), (502, "login_unreachable"))

    def test_refusedStarts(self):
        """
        A bad flow, a taken id, an API-key account's re-login or a bad new
        account field is refused at the start.
        """
        cases = [({"flow": "qr", "account": {"id": "n"}}, 400),
                 ({"flow": "browser", "account": {"id": "a1"}}, 409),
                 ({"flow": "browser", "account_id": "a1"}, 400),
                 ({"flow": "browser", "account_id": "zz"}, 404),
                 ({"flow": "browser", "account": {"id": "n", "api_key": "x"}}, 400),
                 ({"flow": "browser", "account": {"id": "n", "priority": "x"}}, 400),
                 ({"flow": "browser"}, 400)]
        for body, status in cases:
            self.assertEqual(self.call(b"POST", "logins", body)[0], status, body)

    def test_cancel(self):
        """
        A pending login can be cancelled, once.
        """
        login = self.begin()
        self.assertEqual(self.call(b"DELETE", f"logins/{login['id']}")[0], 200)
        self.assertEqual(self.call(b"DELETE", f"logins/{login['id']}")[0], 409)
        self.assertEqual(self.call(b"GET", "logins")[1]["logins"][0]["status"], "cancelled")


class ReloginTests(LoginFixture, SynchronousTestCase):
    """
    A new login of an account in C{needs_login}.
    """

    def test_reloginClearsNeedsLogin(self):
        """
        A file OAuth account whose token expired without a refresh token is
        in C{needs_login}; a browser login of it stores the new tokens in
        its lineage: it serves again, through the same proxy.
        """
        credentials = self.app.extras["credentials"]
        account = self.app.live.accounts.byId("o1")
        self.assertTrue(credentials.blockReason(account, NOW)[0].startswith("needs_login"))
        status, body = self.call(b"POST", "accounts/o1/login", {"flow": "browser"})
        self.assertEqual(status, 201, body)
        issued = tokens("acct-o1")
        self.egress.answer("/oauth/token", reply(200, issued))
        status, body = self.call(b"POST", f"logins/{body['login']['id']}/complete",
                                 {"code": "ac_2"})
        self.assertEqual(status, 200, body)
        self.assertEqual(self.egress.requests[-1]["proxy"].id, "p1")
        self.assertIsNone(credentials.blockReason(account, NOW))
        self.assertEqual(credentials.current(account).credential, issued["access_token"])
        self.assertEqual(body["account"]["source"], "file")

    def test_otherChatGPTAccountRefused(self):
        """
        Tokens of another ChatGPT account are not put into this account.
        """
        status, body = self.call(b"POST", "logins", {"flow": "browser", "account_id": "o1"})
        self.egress.answer("/oauth/token", reply(200, tokens("acct-someone-else")))
        status, body = self.call(b"POST", f"logins/{body['login']['id']}/complete",
                                 {"code": "ac_3"})
        self.assertEqual((status, body["error"]["code"]), (400, "wrong_account"))
        credentials = self.app.extras["credentials"]
        self.assertIsNotNone(credentials.blockReason(self.app.live.accounts.byId("o1"), NOW))


class DeviceLoginTests(LoginFixture, SynchronousTestCase):
    """
    The device-code flow: relay polls at the announced interval.
    """

    def begin(self):
        self.egress.answer("/api/accounts/deviceauth/usercode", reply(200, {
            "device_auth_id": "dev-secret-1", "user_code": "ABCD-EFGH", "interval": "3"}))
        status, body = self.call(b"POST", "logins", {"flow": "device",
                                                     "account": {"id": "dev1", "proxy_id": "p1"}})
        self.assertEqual(status, 201, body)
        return body["login"]

    def polls(self):
        return self.egress.paths().count("/api/accounts/deviceauth/token")

    def test_deviceFlowCreatesTheAccount(self):
        """
        protocol.md 7.5: the user code request carries the client id (JSON,
        through the proxy); the answer shows the verification address, the
        code and the interval (never the device code); polls come at the
        interval (403 pending), 5 s later after a C{slow_down}; the code a
        poll brings is exchanged with C{/deviceauth/callback} and the
        poll's verifier; the account is then added and the login audited.
        """
        login = self.begin()
        first = self.egress.requests[0]
        self.assertEqual(json.loads(first["body"]), {"client_id": "app_EMoamEEZ73f0CkXaXp7hrann"})
        self.assertEqual(first["proxy"].id, "p1")
        self.assertEqual((login["verification_url"], login["user_code"], login["interval"]),
                         (ISSUER + "/codex/device", "ABCD-EFGH", 3))
        self.assertNotIn("dev-secret-1", self.lastRaw.decode())
        pending = reply(403, {"error": {"code": "deviceauth_authorization_pending"}})
        slow = reply(429, {"error": {"code": "slow_down"}})
        code = reply(200, {"authorization_code": "ac_dev_secret", "code_challenge": "c",
                           "code_verifier": "verifier-from-poll-secret"})
        self.egress.answer("/api/accounts/deviceauth/token", pending, slow, code)
        self.egress.answer("/oauth/token", reply(200, tokens("acct-dev")))
        self.reactor.advance(2.9)
        self.assertEqual(self.polls(), 0)
        self.reactor.advance(0.1)
        self.assertEqual(self.polls(), 1)
        poll = self.egress.requests[-1]
        self.assertEqual(json.loads(poll["body"]), {"device_auth_id": "dev-secret-1",
                                                    "user_code": "ABCD-EFGH"})
        self.reactor.advance(3)
        self.assertEqual(self.polls(), 2)
        self.assertEqual(self.call(b"GET", f"logins/{login['id']}")[1]["login"]["interval"], 8)
        self.reactor.advance(7.9)
        self.assertEqual(self.polls(), 2)
        self.reactor.advance(0.1)
        self.assertEqual(self.polls(), 3)
        exchange = self.egress.requests[-1]
        form = {k: v[0] for k, v in parse_qs(exchange["body"].decode()).items()}
        self.assertEqual((form["code"], form["code_verifier"], form["redirect_uri"]),
                         ("ac_dev_secret", "verifier-from-poll-secret",
                          ISSUER + "/deviceauth/callback"))
        self.assertEqual(self.app.live.accounts.byId("dev1").chatgpt_account_id, "acct-dev")
        status, view = self.call(b"GET", f"logins/{login['id']}")
        self.assertEqual(view["login"]["status"], "completed")
        self.assertEqual(self.audit()[0]["action"], "login.complete")
        self.reactor.advance(60)
        self.assertEqual(self.polls(), 3)
        self.assertNotLogged("dev-secret-1", "ac_dev_secret", "verifier-from-poll-secret")

    def test_denied(self):
        """
        A refused device login ends with a clear reason; no account.
        """
        login = self.begin()
        self.egress.answer("/api/accounts/deviceauth/token", reply(400, {
            "error": {"code": "access_denied", "message": "The user denied the request."}}))
        self.reactor.advance(3)
        status, view = self.call(b"GET", f"logins/{login['id']}")
        self.assertEqual(view["login"]["status"], "failed")
        self.assertIn("refused", view["login"]["error"]["message"])
        self.assertNotIn("dev1", self.ids())
        self.assertEqual(self.audit()[0]["action"], "login.failed")

    def test_expires(self):
        """
        A login nobody approves expires after 10 minutes and polls stop;
        transport errors meanwhile are polled again.
        """
        login = self.begin()
        self.egress.answer("/api/accounts/deviceauth/token", ConnectionRefusedError("x"),
                           reply(404, {}))
        for _ in range(int(LOGIN_TTL_SECONDS / 3) + 2):
            self.reactor.advance(3)
        polls = self.polls()
        self.assertGreater(polls, 150)
        self.assertEqual(self.call(b"GET", f"logins/{login['id']}")[1]["login"]["status"],
                         "expired")
        self.reactor.advance(30)
        self.assertEqual(self.polls(), polls)

    def test_unavailable(self):
        """
        A server without device login (404) is a 502 saying so.
        """
        self.egress.answer("/api/accounts/deviceauth/usercode", reply(404, {}))
        status, body = self.call(b"POST", "logins", {"flow": "device", "account": {"id": "d"}})
        self.assertEqual((status, body["error"]["code"]), (502, "device_login_unavailable"))

    def test_numericInterval(self):
        """
        The interval may be a number too; a missing one is 5 s.
        """
        self.egress.answer("/api/accounts/deviceauth/usercode", reply(200, {
            "device_auth_id": "d1", "usercode": "XY-12", "interval": 7}))
        status, body = self.call(b"POST", "logins", {"flow": "device", "account": {"id": "d"}})
        self.assertEqual((body["login"]["interval"], body["login"]["user_code"]), (7, "XY-12"))


class WireTests(SynchronousTestCase):
    """
    L{relay.control.logins.wire} and the egress client's shape.
    """

    def test_pkce(self):
        """
        RFC 7636's example: the S256 challenge of its verifier.
        """
        self.assertEqual(wire.challengeOf("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
                         "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM")
        self.assertEqual(len(wire.newState()), 43)
        self.assertNotEqual(wire.newVerifier(), wire.newVerifier())

    def test_parseCallback(self):
        """
        A full address, a query, a bare code and an error all read.
        """
        self.assertEqual(wire.parseCallback(
            "http://localhost:1455/auth/callback?code=c1&state=s1"),
            wire.CallbackParams(code="c1", state="s1"))
        self.assertEqual(wire.parseCallback("?code=c2"), wire.CallbackParams(code="c2"))
        self.assertEqual(wire.parseCallback("  c3 "), wire.CallbackParams(code="c3"))
        self.assertEqual(wire.parseCallback("error=access_denied&state=s").error,
                         "access_denied")
        self.assertEqual(wire.parseCallback(""), wire.CallbackParams())

    def test_tokenError(self):
        """
        Codex's reading of a token endpoint's error body.
        """
        self.assertEqual(wire.tokenErrorOf({"error": "invalid_grant", "error_description": "d"}),
                         ("invalid_grant", "d"))
        self.assertEqual(wire.tokenErrorOf({"error": {"code": "x", "message": "m"}}), ("x", "m"))
        self.assertEqual(wire.tokenErrorOf({}), (None, None))

    def test_egressInterface(self):
        """
        The real client and the fake provide L{IEgressClient}.
        """
        self.assertTrue(verifyObject(IEgressClient, EgressClient(reactor=None, settings=None)))
        self.assertTrue(verifyObject(IEgressClient, FakeEgress()))


def emailToken(account, email, sub="id"):
    """
    An ID token naming the signed-in person's e-mail address.
    """
    import jwt

    from tests.test_control import NOW

    claims = {"sub": sub, "exp": int(NOW + 3600), "iat": int(NOW), "email": email,
              "https://api.openai.com/auth": {"chatgpt_account_id": account,
                                              "chatgpt_plan_type": "plus"}}
    return jwt.encode(claims, "test-secret-" * 3, algorithm="HS256")


class PasteRetryTests(LoginFixture, SynchronousTestCase):
    """
    A paste without a code leaves the login pending, to paste again or
    cancel.
    """

    def begin(self):
        status, body = self.call(b"POST", "logins", {"flow": "browser", "account": {
            "id": "new1", "proxy_id": "p1"}})
        self.assertEqual(status, 201, body)
        return body["login"]

    def test_badPasteThenRetry(self):
        login = self.begin()
        status, body = self.call(b"POST", f"logins/{login['id']}/complete",
                                 {"redirect_url": "http://localhost:1455/auth/callback?x=1"})
        self.assertEqual((status, body["error"]["code"]), (400, "no_code"))
        self.assertEqual(body["login"]["status"], "pending")
        self.assertEqual(body["login"]["paste_attempts"], 1)
        self.assertIn("authorize_url", body["login"])
        status, body = self.call(b"GET", f"logins/{login['id']}")
        self.assertEqual(body["login"]["status"], "pending")
        self.assertEqual(body["login"]["last_paste_error"], "no code in what was pasted")
        self.egress.answer("/oauth/token", reply(200, tokens()))
        status, body = self.call(b"POST", f"logins/{login['id']}/complete", {"code": "ac_1"})
        self.assertEqual(status, 200, body)
        self.assertEqual(body["login"]["status"], "completed")

    def test_cancelByPost(self):
        login = self.begin()
        self.call(b"POST", f"logins/{login['id']}/complete",
                  {"redirect_url": "http://localhost:1455/auth/callback"})
        status, body = self.call(b"POST", f"logins/{login['id']}/cancel")
        self.assertEqual((status, body["login"]["status"]), (200, "cancelled"))
        self.assertEqual(self.call(b"POST", f"logins/{login['id']}/cancel")[0], 409)
        self.assertEqual(self.audit()[0]["action"], "login.cancel")


class DuplicateIdentityTests(LoginFixture, SynchronousTestCase):
    """
    A login (or an added account) whose ChatGPT identity is already in the
    pool comes with a C{duplicate_identity} warning; it is added all the
    same.
    """

    def complete(self, issued):
        status, body = self.call(b"POST", "logins", {"flow": "browser", "account": {
            "id": "new1", "proxy_id": "p1"}})
        self.egress.answer("/oauth/token", reply(200, issued))
        return self.call(b"POST", f"logins/{body['login']['id']}/complete", {"code": "ac_1"})

    def test_loginOfAnIdentityInThePool(self):
        issued = dict(tokens("acct-o1"), id_token=emailToken("acct-o1", "ana@example.com"))
        status, body = self.complete(issued)
        self.assertEqual(status, 200, body)
        [warning] = body["warnings"]
        self.assertEqual((warning["code"], warning["accounts"], warning["email"]),
                         ("duplicate_identity", ["o1"], "ana@example.com"))
        self.assertIn("acct-o1", warning["message"])
        self.assertIn("new1", [a.id for a in self.app.live.accounts])
        login = self.call(b"GET", f"logins/{body['login']['id']}")[1]["login"]
        self.assertEqual(login["warnings"], body["warnings"])
        self.assertEqual(login["identity"], {"chatgpt_account_id": "acct-o1",
                                             "email": "ana@example.com"})

    def test_newIdentityNoWarning(self):
        status, body = self.complete(tokens("acct-other"))
        self.assertEqual((status, body["warnings"]), (200, []))

    def test_otherPersonSameWorkspace(self):
        """
        Same workspace, a different e-mail address: another person, no
        warning.
        """
        issued = dict(tokens("acct-new"), id_token=emailToken("acct-new", "ana@example.com"))
        self.assertEqual(self.complete(issued)[0], 200)
        status, body = self.call(b"POST", "accounts", {
            "id": "new2", "type": "oauth", "proxy_id": "p1",
            "access_token": oauthToken("acct-new", sub="b"),
            "id_token": emailToken("acct-new", "bo@example.com")})
        self.assertEqual((status, body["warnings"]), (201, []))
        status, body = self.call(b"POST", "accounts", {
            "id": "new3", "type": "oauth", "proxy_id": "p1",
            "access_token": oauthToken("acct-new", sub="c"),
            "id_token": emailToken("acct-new", "ANA@example.com")})
        self.assertEqual(status, 201, body)
        self.assertEqual(body["warnings"][0]["accounts"], ["new1"])

    def test_accountAddWarns(self):
        status, body = self.call(b"POST", "accounts", {
            "id": "dup", "type": "oauth", "proxy_id": "p1",
            "access_token": oauthToken("acct-o1", sub="x")})
        self.assertEqual(status, 201, body)
        self.assertEqual(body["warnings"][0]["accounts"], ["o1"])
