# -*- test-case-name: tests.test_emulator_oauth -*-
"""
The emulator's ChatGPT account routes: the OAuth token endpoint
(L{relay.emulator.oauth}, protocol.md 7.4), the usage snapshot
(C{GET /backend-api/wham/usage}) and the login pages and device-code
endpoints (protocol.md 7.5, L{relay.emulator.login}).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.server import NOT_DONE_YET

from relay.emulator.httpwire import Route, abortConnection, lowerHeaders, peerHost
from relay.emulator.state import HTTP, invalidKeyBody

TOKEN = "/oauth/token"
"""The OAuth token endpoint (L{relay.emulator.oauth})."""

WHAM_USAGE = "/backend-api/wham/usage"
"""The usage snapshot endpoint (protocol.md 7.4)."""

WHAM_RESETS = "/backend-api/wham/rate-limit-reset-credits"
"""The banked resets (protocol.md 7.3a)."""

WHAM_CONSUME = WHAM_RESETS + "/consume"
"""Redeem one banked reset (protocol.md 7.3a)."""

AUTHORIZE = "/oauth/authorize"
AUTHORIZE_DECISION = "/oauth/authorize/decision"
DEVICE_USERCODE = "/api/accounts/deviceauth/usercode"
DEVICE_TOKEN = "/api/accounts/deviceauth/token"
DEVICE_PAGE = "/codex/device"
"""The login endpoints (protocol.md 7.5, L{relay.emulator.login})."""

_LOGIN_SECRET_FIELDS = ("code", "code_verifier", "device_auth_id", "user_code", "state",
                        "code_challenge", "refresh_token")


class AuthRoutes(Route):
    """
    C{POST /oauth/token}, C{GET /backend-api/wham/usage} and the login
    endpoints of L{relay.emulator.http.EmulatorResource}.

    @ivar emulator: the owning emulator.
    """

    @property
    def _log(self):
        return self._resource._log

    # -- POST /oauth/token, GET wham/usage --------------------------------------------------
    def token(self, request: Any) -> Any:
        """
        Answer a token request (L{relay.emulator.oauth}): apply the token
        fault of the refresh token's account, then rotate.

        @param request: the request.
        @return: the body or C{NOT_DONE_YET}.
        """
        raw = request.content.read() if request.content is not None else b""
        ctype = (request.getHeader(b"content-type") or b"").decode("latin-1")
        authority = self.emulator.oauth
        params = authority.parseRequest(raw, ctype)
        name = authority.accountFor(params)
        shown = {k: ("***" if "token" in k or k in _LOGIN_SECRET_FIELDS else v)
                 for k, v in params.items()}
        self._state.record(
            f"oauth:{name}" if name else None, HTTP, "token", request.path.decode("latin-1"),
            "POST", lowerHeaders(request), shown, peerHost(request.getClientAddress()),
        )
        authority.countRequest(name)
        fault = authority.takeFault(name)
        if fault is not None:
            self._log.info("applying token fault {kind} for {name}", event="emulator.fault",
                           kind=fault.kind, name=name)
        gone: list = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))

        def answer() -> None:
            status, body = authority.exchange(params)
            if gone or request.finished:
                return
            request.write(self._resource._json(request, status, body))
            request.finish()

        if fault is None:
            status, body = authority.exchange(params)
            return self._resource._json(request, status, body)
        if fault.kind == "status":
            body = fault.params.get("body") or {"error": {"message": "Emulated token error",
                                                          "type": "server_error"}}
            return self._resource._json(request, fault.params["code"], body,
                                        fault.params.get("headers"))
        if fault.kind == "reset":
            abortConnection(request)
            return NOT_DONE_YET
        if fault.kind == "slow":
            self.emulator.clock.callLater(float(fault.params["seconds"]), answer)
            return NOT_DONE_YET
        if fault.kind == "hold":
            authority.held.append(answer)
            self._resource._hold(request)
            return NOT_DONE_YET
        from relay.emulator.oauth import permanentError

        return self._resource._json(request, 401 if fault.kind != "invalid_grant" else 400,
                                    permanentError(fault.kind))

    def wham(self, request: Any) -> bytes:
        """
        Answer C{GET /backend-api/wham/usage} (protocol.md 7.4).

        @param request: the request.
        @rtype: L{bytes}
        """
        credential, denied = self._resource._credential(request)
        self._resource._record(request, HTTP, "request", credential, None)
        if denied is not None:
            return self._resource._json(request, 401, denied)
        if not self._state.known(credential):
            return self._resource._json(request, 401, invalidKeyBody())
        return self._resource._json(request, 200, self.emulator.oauth.wham(credential))

    def resets(self, request: Any, consume: bool) -> bytes:
        """
        Answer C{GET /backend-api/wham/rate-limit-reset-credits} or C{POST
        .../consume} (protocol.md 7.3a; L{relay.emulator.oauth.UsageModel}).

        @param consume: the C{POST .../consume}.
        @rtype: L{bytes}
        """
        credential, denied = self._resource._credential(request)
        raw = request.content.read() if consume and request.content is not None else b""
        self._resource._record(request, HTTP, "request", credential, None)
        if denied is not None:
            return self._resource._json(request, 401, denied)
        if not self._state.known(credential):
            return self._resource._json(request, 401, invalidKeyBody())
        if not consume:
            return self._resource._json(request, 200, self.emulator.oauth.resetCredits(credential))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        answer = self.emulator.oauth.consumeReset(credential, body)
        if answer is None:
            return self._resource._json(request, 400, {"detail": "redeem_request_id is required"})
        return self._resource._json(request, 200, answer)

    # -- the login flows (protocol.md 7.5) ----------------------------------------------------
    def _html(self, request: Any, code: int, body: bytes) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        return body

    def login(self, request: Any, path: str) -> bytes:
        """
        Serve the login endpoints (L{relay.emulator.login}): the authorize
        page and its decision, the device code, its polls and its page.

        @param request: the request.
        @param path: the normalised path.
        @rtype: L{bytes}
        """
        from relay.emulator.login import parseForm, parseJSONObject

        flows = self.emulator.oauth.login
        method = request.method
        raw = request.content.read() if request.content is not None else b""
        if path == AUTHORIZE and method == b"GET":
            params = {k.decode("utf-8", "replace"): v[0].decode("utf-8", "replace")
                      for k, v in request.args.items() if v}
            self._recordLogin(request, path, params)
            problem = flows.checkAuthorize(params)
            return self._html(request, 400 if problem else 200, flows.authorizePage(params))
        if path == AUTHORIZE_DECISION and method == b"POST":
            params = parseForm(raw)
            self._recordLogin(request, path, params)
            code, result = flows.decide(params)
            if code == 302:
                request.setResponseCode(302)
                request.setHeader(b"location", result.encode("utf-8"))
                request.setHeader(b"cache-control", b"no-store")
                return b""
            return self._html(request, code, result)
        if path == DEVICE_PAGE and method == b"GET":
            return self._html(request, 200, flows.devicePage())
        if path == DEVICE_PAGE and method == b"POST":
            form = parseForm(raw)
            ok, message = flows.approve(form.get("user_code", ""), form.get("account"),
                                        form.get("decision", "allow"))
            return self._html(request, 200 if ok else 400, flows.devicePage(message))
        if method != b"POST":
            return self._resource._json(request, 405, {"error": {"code": "method_not_allowed",
                                                                 "message": "use POST"}})
        params = parseJSONObject(raw)
        self._recordLogin(request, path, params)
        if path == DEVICE_USERCODE:
            scheme = "https" if self.emulator._secure else "http"
            host = (request.getHeader(b"host") or b"127.0.0.1").decode("latin-1")
            status, body = flows.userCode(params, f"{scheme}://{host}")
        else:
            status, body = flows.poll(params)
        return self._resource._json(request, status, body)

    def _recordLogin(self, request: Any, path: str, params: dict) -> None:
        shown = {k: ("***" if k in _LOGIN_SECRET_FIELDS else v) for k, v in params.items()}
        self._state.record(None, HTTP, "login", path, request.method.decode("latin-1"),
                           lowerHeaders(request), shown, peerHost(request.getClientAddress()))
