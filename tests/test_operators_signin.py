"""
Tests for L{relay.operators.signin} (C{/auth/...}): a session cookie for
the right password, one 401 for a wrong name or password, the throttle in
front of the password check, sign-out with the CSRF token.
"""

from __future__ import annotations

import io
import json

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.control.audit.service import AuditTrail
from relay.control.store.memory import MemoryControlStore
from relay.operators.directory import OperatorDirectory
from relay.operators.roles import ADMIN_KEY
from relay.operators.sessions import OperatorSessions
from relay.operators.signin import SignInResource
from relay.operators.throttle import SignInThrottle
from tests.test_operators import CookieRequest

PASSWORD = "ana-password-123"


class SignInTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        store = MemoryControlStore(clock=self.clock)
        self.directory = OperatorDirectory(store=store, clock=self.clock)
        self.successResultOf(self.directory.start())
        self.successResultOf(Deferred.fromCoroutine(
            self.directory.add("ana", "owner", PASSWORD, None, ADMIN_KEY)))
        self.sessions = OperatorSessions(store=store, clock=self.clock)
        self.throttle = SignInThrottle(clock=self.clock)
        self.audit = AuditTrail(store=store, clock=self.clock)
        self.resource = SignInResource(self.sessions, self.directory, self.throttle,
                                       audit=self.audit)

    def call(self, path, method=b"POST", body=None, cookie=None, csrf=None, secure=False):
        request = CookieRequest(path, method, cookie=cookie, csrf=csrf, secure=secure)
        request.postpath = list(path)
        request.content = io.BytesIO(json.dumps(body).encode() if body is not None else b"")
        result = self.resource.render(request)
        if isinstance(result, bytes):
            request.write(result)
            request.finish()
        self.assertTrue(request.finished)
        return request, json.loads(b"".join(request.written) or b"null")

    def signIn(self, password=PASSWORD, name="ana", secure=False):
        return self.call([b"signin"], body={"name": name, "password": password}, secure=secure)

    def test_signInSetsTheCookie(self):
        request, answer = self.signIn(secure=True)
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(answer["operator"], {"name": "ana", "role": "owner", "via": "password"})
        header = request.responseHeaders.getRawHeaders(b"set-cookie")[0].decode()
        cookie = header.split(";")[0].split("=", 1)[1]
        for part in ("HttpOnly", "SameSite=Strict", "Secure", "Max-Age="):
            self.assertIn(part, header)
        session = self.sessions.lookup(cookie)
        self.assertEqual((session.operator, session.csrf), ("ana", answer["csrf_token"]))
        _, who = self.call([b"session"], b"GET", cookie=cookie.encode())
        self.assertEqual((who["operator"]["name"], who["csrf_token"]), ("ana", session.csrf))
        audit = self.successResultOf(Deferred.fromCoroutine(self.audit.recent(5)))
        self.assertEqual((audit[0]["action"], audit[0]["actor"]), ("operator.signin", "ana"))

    def test_wrongPasswordOrName(self):
        for name, password in (("ana", "wrong-password-1"), ("nobody", PASSWORD)):
            request, answer = self.signIn(password, name)
            self.assertEqual((request.responseCode, answer["error"]["code"]),
                             (401, "sign_in_failed"))
            self.assertIsNone(request.responseHeaders.getRawHeaders(b"set-cookie"))

    def test_throttled(self):
        """
        After five failures the address waits: even the right password is
        answered 429 with Retry-After, unchecked; after the wait it works.
        """
        for _ in range(5):
            self.signIn("wrong-password-1")
        request, answer = self.signIn()
        self.assertEqual((request.responseCode, answer["error"]["code"]),
                         (429, "sign_in_throttled"))
        self.assertEqual(request.responseHeaders.getRawHeaders(b"retry-after"), [b"2"])
        self.assertEqual(self.sessions.byOperator("ana"), [])
        self.clock.advance(2)
        request, _ = self.signIn()
        self.assertEqual(request.responseCode, 200)

    def test_signOut(self):
        request, answer = self.signIn()
        cookie = request.responseHeaders.getRawHeaders(b"set-cookie")[0].decode().split(
            ";")[0].split("=", 1)[1].encode()
        request, refused = self.call([b"signout"], cookie=cookie, csrf=b"nope")
        self.assertEqual(request.responseCode, 403)
        self.assertIsNotNone(self.sessions.lookup(cookie))
        request, done = self.call([b"signout"], cookie=cookie,
                                  csrf=answer["csrf_token"].encode())
        self.assertEqual(done, {"signed_out": True})
        self.assertIsNone(self.sessions.lookup(cookie))
        request, _ = self.call([b"session"], b"GET", cookie=cookie)
        self.assertEqual(request.responseCode, 401)
