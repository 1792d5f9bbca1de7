"""
Console operators over HTTP against a relay (in this process, its intake
in front, R103): sign-in by cookie, CSRF on every change, the roles'
rules, a viewer's masked answers, sessions ended by a password reset,
a removal or sign-out, the audit's actors, and file operators following a
reload.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq

from relay.operators.passwords import hashPassword
from tests.integration.harness import startStack

ADMIN = "zQ8vN3kP0xL2mR7tY5wB-operators-api"
ANA_PASSWORD = "ana-password-123"


class Browser:
    """
    A cookie jar and the session's CSRF token.
    """

    def __init__(self, url):
        self.url, self.cookies, self.csrf = url, {}, None

    async def call(self, method, path, body=None, csrf=True, bearer=None):
        headers = {"Content-Type": ["application/json"]}
        if csrf and self.csrf:
            headers["X-CSRF-Token"] = [self.csrf]
        if bearer:
            headers["Authorization"] = [f"Bearer {bearer}"]
        r = await treq.request(method, self.url + path, headers=headers, cookies=self.cookies,
                               data=json.dumps(body).encode() if body is not None else None,
                               persistent=False, allow_redirects=False)
        for header in r.headers.getRawHeaders(b"set-cookie") or []:
            name, _, rest = header.decode().partition("=")
            self.cookies[name] = rest.split(";")[0]
        raw = await r.content()
        return r.code, json.loads(raw) if raw else None

    async def signIn(self, name, password):
        code, body = await self.call("POST", "/auth/signin", {"name": name, "password": password},
                                     csrf=False)
        if code == 200:
            self.csrf = body["csrf_token"]
        return code, body


@pytest_twisted.ensureDeferred
async def test_operatorsOverHTTP(monkeypatch):
    monkeypatch.setenv("RELAY_OP_ANA", hashPassword(ANA_PASSWORD))
    stack = await startStack(
        [{"id": "acct-1", "credential": "sk-upstream-1"}],
        extra=(f"admin_key: {ADMIN}\n"
               "operators:\n  - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}\n"))
    try:
        ana = Browser(stack.url)
        assert (await ana.signIn("ana", "wrong-password-1"))[0] == 401
        code, body = await ana.signIn("ana", ANA_PASSWORD)
        assert code == 200 and body["operator"]["role"] == "owner"

        # CSRF: a change without the token is refused at the headers.
        code, body = await ana.call("POST", "/admin/operators",
                                    {"name": "vic", "role": "viewer",
                                     "password": "vic-password-123"}, csrf=False)
        assert (code, body["error"]["code"]) == (403, "csrf_failed")
        code, body = await ana.call("POST", "/admin/operators",
                                    {"name": "vic", "role": "viewer",
                                     "password": "vic-password-123"})
        assert code == 201, body
        code, body = await ana.call("POST", "/admin/operators",
                                    {"name": "adam", "role": "admin",
                                     "password": "adam-password-123"})
        assert code == 201
        # An issued key, whose hint a viewer must not see.
        code, issued = await ana.call("POST", "/admin/keys", {"name": "carol"})
        assert code in (200, 201), issued

        vic = Browser(stack.url)
        assert (await vic.signIn("vic", "vic-password-123"))[0] == 200
        code, body = await vic.call("PUT", "/admin/settings", {"retry_interval_ms": 5})
        assert code == 403 and "viewer" in body["error"]["message"]
        code, body = await vic.call("GET", "/admin/keys")
        assert code == 200
        carol = [k for k in body["keys"] if k["name"] == "carol"][0]
        assert carol["hint"] == "***"
        code, owners = await ana.call("GET", "/admin/keys")
        assert [k for k in owners["keys"] if k["name"] == "carol"][0]["hint"] not in (None, "***")

        adam = Browser(stack.url)
        assert (await adam.signIn("adam", "adam-password-123"))[0] == 200
        code, body = await adam.call("POST", "/admin/operators",
                                     {"name": "boss", "role": "owner",
                                      "password": "boss-password-12"})
        assert code == 403 and "only an owner" in body["error"]["message"]
        code, body = await adam.call("PATCH", "/admin/operators/vic",
                                     {"password": "vic-new-password-1"})
        assert code == 200 and body["sessions_ended"] == 1
        code, body = await vic.call("GET", "/admin/keys")
        assert (code, body["error"]["code"]) == (401, "session_invalid")
        assert (await vic.signIn("vic", "vic-new-password-1"))[0] == 200
        code, body = await ana.call("POST", "/admin/operators/vic/signout")
        assert body == {"ended": 1}
        assert (await vic.call("GET", "/admin/keys"))[0] == 401

        # Signed out: the cookie is dead.
        code, _ = await adam.call("POST", "/auth/signout")
        assert code == 200
        assert (await adam.call("GET", "/admin/operators"))[0] == 401

        # The admin key still works (automation) and is "admin-key" in the audit.
        code, _ = await ana.call("DELETE", "/admin/operators/adam", csrf=False, bearer=ADMIN)
        assert code == 200
        code, audit = await ana.call("GET", "/admin/audit?limit=50")
        who = [(e["action"], e["actor"], e.get("target")) for e in reversed(audit["audit"])]
        assert ("operator.create", "ana", "vic") in who
        assert ("key.create", "ana", "carol") in who
        assert ("operator.update", "adam", "vic") in who
        assert ("operator.signout", "ana", "vic") in who
        assert ("operator.delete", "admin-key", "adam") in who
        assert ("operator.signin", "vic", "vic") in who
        assert all(e["actor"] for e in audit["audit"])
    finally:
        await stack.stop()
