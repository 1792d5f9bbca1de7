# -*- test-case-name: tests.test_operators -*-
"""
The console's sign-in routes, C{/auth/...} (the intake's sign-in route
class: no credential yet, a small body, L{relay.entry.intake}):

  - C{GET /auth/session}: who is signed in (C{{"operator": {"name",
    "role", "via"}, "csrf_token", "expires_at", "methods"}}), else 401
    with C{methods} (C{password}, C{oidc}) so the page knows what to offer;
  - C{POST /auth/signin} C{{"name", "password"}}: checks the password
    (Argon2, off the reactor thread), opens a session and sets its cookie
    (L{relay.operators.sessions.cookieHeader}); a wrong name or password is
    the same 401 C{sign_in_failed}; an address that failed too often waits
    (429 C{sign_in_throttled} with C{Retry-After},
    L{relay.operators.throttle});
  - C{POST /auth/signout}: ends the session (its CSRF token required) and
    clears the cookie;
  - C{GET /auth/oidc/start}, C{GET /auth/oidc/callback}: the OIDC sign-in
    (L{relay.operators.oidc}); the callback sets the cookie and sends the
    browser to C{/admin/} (a refusal is a small page saying why).

Sign-ins and sign-outs are audited with their actor
(L{relay.control.audit}); failed ones are logged (throttled by the
throttle's wait), never with the password.
"""

from __future__ import annotations

import html
from typing import Optional

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.console.admin import errorBody, respond
from relay.console.fields import STRING
from relay.control.web import ControlError, checkedTypes, clientAddress, deliver, readJSONBody
from relay.base.requestid import requestIdOf
from relay.operators.gate import sessionCookie
from relay.operators.oidc import OIDCError
from relay.operators.passwords import verifyPassword
from relay.operators.sessions import CSRF_HEADER, cookieHeader, csrfMatches

__all__ = ["SignInResource", "deferToThreads"]

SIGNIN_BODY = {"name": STRING, "password": STRING}

_log = Logger()


def _origin(request) -> str:
    host = (request.getHeader(b"host") or b"localhost").decode("latin-1")
    return ("https://" if request.isSecure() else "http://") + host


class SignInResource(Resource):
    """
    See the module docstring.

    @ivar sessions: the L{relay.interfaces.IOperatorSessions}.
    @ivar directory: the L{relay.interfaces.IOperatorDirectory}.
    @ivar throttle: the L{relay.operators.throttle.SignInThrottle}.
    @ivar audit: the L{relay.control.audit.service.AuditTrail}, or L{None}.
    @ivar oidc: the L{relay.operators.oidc.OIDCSignIn}, or L{None}.
    @ivar hashing: C{(f, *args) -> Deferred}: runs a password check off the
        reactor thread (L{twisted.internet.threads.deferToThreadPool}), or
        L{None}: in the caller's thread (tests).
    """

    isLeaf = True

    def __init__(self, sessions, directory, throttle, audit=None, oidc=None, hashing=None):
        super().__init__()
        self.sessions = sessions
        self.directory = directory
        self.throttle = throttle
        self.audit = audit
        self.oidc = oidc
        self.hashing = hashing

    def _methods(self) -> list:
        return ["password"] + (["oidc"] if self.oidc is not None else [])

    def _audit(self, request, action: str, actor: str, detail: Optional[dict] = None) -> None:
        if self.audit is not None:
            self.audit.record(action, address=clientAddress(request), status=200,
                              requestId=requestIdOf(request), target=actor, actor=actor,
                              detail=detail)

    def render(self, request):
        path = [p for p in request.postpath if p]
        method = request.method
        if path == [b"session"] and method in (b"GET", b"HEAD"):
            return self._session(request)
        if path == [b"signin"] and method == b"POST":
            return deliver(request, lambda: self._signIn(request), "signing in")
        if path == [b"signout"] and method == b"POST":
            return deliver(request, lambda: self._signOut(request), "signing out")
        if path == [b"oidc", b"start"] and method == b"GET":
            return self._oidcStart(request)
        if path == [b"oidc", b"callback"] and method == b"GET":
            return self._oidcCallback(request)
        return respond(request, 404, errorBody("Not found", "invalid_request_error",
                                               "not_found"))

    # -- password ---------------------------------------------------------

    def _session(self, request):
        session = self.sessions.lookup(sessionCookie(request))
        operator = None if session is None else self.directory.find(session.operator)
        if operator is None:
            return respond(request, 401, dict(errorBody(
                "Not signed in", "authentication_error", "not_signed_in"),
                methods=self._methods()))
        return respond(request, 200, {
            "operator": {"name": operator["name"], "role": operator["role"],
                         "via": session.via},
            "csrf_token": session.csrf, "expires_at": session.expires_at,
            "methods": self._methods()})

    async def _signIn(self, request):
        address = clientAddress(request)
        wait = self.throttle.retryAfter(address)
        if wait is not None:
            request.setHeader(b"retry-after", str(wait).encode("ascii"))
            raise ControlError(429, "sign_in_throttled",
                               f"Too many failed sign-ins from this address; try again in"
                               f" {wait} s")
        body = checkedTypes(readJSONBody(request), SIGNIN_BODY, "invalid_request")
        name, password = body.get("name"), body.get("password")
        encoded = self.directory.passwordHash(name) if isinstance(name, str) else None
        if self.hashing is not None:
            ok = await self.hashing(verifyPassword, encoded, password)
        else:
            ok = verifyPassword(encoded, password)
        operator = self.directory.find(name) if ok else None
        if operator is None:
            self.throttle.failed(address)
            _log.info("console sign-in refused from {address}", address=address or "-",
                      event="relay.signin_refused")
            raise ControlError(401, "sign_in_failed", "Wrong name or password")
        self.throttle.succeeded(address)
        return self._opened(request, await self.sessions.open(
            operator["name"], operator["role"], "password"), operator)

    def _opened(self, request, opened, operator) -> tuple:
        cookie, session = opened
        request.setHeader(b"set-cookie", cookieHeader(cookie, request.isSecure()))
        self._audit(request, "operator.signin", operator["name"], {"via": session.via})
        return 200, {"operator": {"name": operator["name"], "role": operator["role"],
                                  "via": session.via},
                     "csrf_token": session.csrf, "expires_at": session.expires_at}

    async def _signOut(self, request):
        session = self.sessions.lookup(sessionCookie(request))
        request.setHeader(b"set-cookie", cookieHeader("", request.isSecure()))
        if session is None:
            return 200, {"signed_out": False}
        if not csrfMatches(session, request.getHeader(CSRF_HEADER)):
            raise ControlError(403, "csrf_failed",
                               "Missing or wrong X-CSRF-Token for this session")
        await self.sessions.revoke(session.id)
        self._audit(request, "operator.signout", session.operator)
        return 200, {"signed_out": True}

    # -- OIDC -------------------------------------------------------------

    def _oidcStart(self, request):
        if self.oidc is None:
            return respond(request, 404, errorBody(
                "OIDC sign-in is not configured (config.md oidc:)", "invalid_request_error",
                "not_found"))
        d = Deferred.fromCoroutine(self.oidc.start(_origin(request)))

        def _cbRedirect(url):
            request.setResponseCode(302)
            request.setHeader(b"location", url.encode("utf-8"))
            request.setHeader(b"cache-control", b"no-store")
            request.finish()

        d.addCallbacks(_cbRedirect, lambda f: self._oidcRefused(request, f))
        return NOT_DONE_YET

    def _oidcCallback(self, request):
        if self.oidc is None:
            return respond(request, 404, errorBody("Not found", "invalid_request_error",
                                                   "not_found"))
        address = clientAddress(request)
        wait = self.throttle.retryAfter(address)
        if wait is not None:
            request.setHeader(b"retry-after", str(wait).encode("ascii"))
            return self._page(request, 429, f"Too many failed sign-ins; try again in {wait} s")

        def arg(name):
            values = request.args.get(name.encode("ascii"))
            return values[0].decode("utf-8", "replace") if values else ""

        async def finish():
            if arg("error"):
                raise OIDCError(f"the provider refused the sign-in: {arg('error')[:100]}")
            name = await self.oidc.finish(arg("code"), arg("state"))
            operator = self.directory.find(name)
            opened = await self.sessions.open(name, operator["role"], "oidc")
            return operator, opened

        def _cbSignedIn(result):
            operator, opened = result
            self.throttle.succeeded(address)
            self._opened(request, opened, operator)
            request.setResponseCode(302)
            request.setHeader(b"location", b"/admin/")
            request.finish()

        def _ebRefused(f):
            if f.check(OIDCError):
                self.throttle.failed(address)
            return self._oidcRefused(request, f)

        d = Deferred.fromCoroutine(finish())
        d.addCallbacks(_cbSignedIn, _ebRefused)
        return NOT_DONE_YET

    def _oidcRefused(self, request, f) -> None:
        if f.check(OIDCError):
            message = str(f.value)
            _log.info("console OIDC sign-in refused: {why}", why=message,
                      event="relay.signin_refused")
        else:
            _log.failure("console OIDC sign-in failed", f, event="relay.signin_failed")
            message = "the sign-in failed (see relay's log)"
        request.write(self._page(request, 403, message))
        request.finish()

    def _page(self, request, status: int, message: str) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        return (f"<!doctype html><meta charset=utf-8><title>relay sign-in</title>"
                f"<p id=refused>Sign-in refused: {html.escape(message)}</p>"
                f"<p><a href=/admin/>Back to the console</a></p>").encode("utf-8")


def deferToThreads(reactor):
    """
    @return: a C{hashing} callable for L{SignInResource} running on
        C{reactor}'s thread pool.
    """
    from twisted.internet.threads import deferToThreadPool

    def run(f, *args):
        return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)

    return run


