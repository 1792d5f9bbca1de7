# -*- test-case-name: tests.test_emulator -*-
"""
The emulator's twisted.web resources: the Responses and Chat Completions endpoints, the model
list, the WebSocket upgrade dispatch and the C{/_emulator/} control API (the Chat Completions,
embeddings and images, OAuth/login and control routes are served by L{relay.emulator.chat},
L{relay.emulator.media}, L{relay.emulator.authroutes} and L{relay.emulator.control}).

One leaf resource (L{EmulatorResource}) serves every path, so that C{/v1/responses} can carry
both the POST and the WebSocket upgrade GET (style.md §9(a)).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.emulator.authroutes import (
    AUTHORIZE,
    AUTHORIZE_DECISION,
    DEVICE_PAGE,
    DEVICE_TOKEN,
    DEVICE_USERCODE,
    TOKEN,
    WHAM_CONSUME,
    WHAM_RESETS,
    WHAM_USAGE,
    AuthRoutes,
)
from relay.emulator.chaos import CLIENT_REQUEST_ID, TurnDraw
from relay.emulator.chat import ChatCompletions
from relay.emulator.control import ControlAPI
from relay.emulator.media import EMBEDDINGS, IMAGE_EDITS, IMAGES, MediaRoutes
from relay.emulator.httpwire import (
    abortConnection,
    bearer,
    breakAfter,
    dropConnection,
    isUpgrade,
    lowerHeaders,
    peerHost,
    streamErrorBody,
    turnStateFor,
)
from relay.emulator.refusals import refusalOf
from relay.emulator.responsesapi import ResponsesAPIMixin, manifestETag, modelsManifest
from relay.emulator.state import (
    HTTP,
    WS,
    Fault,
    buildTurn,
    chooseReply,
    inputError,
    invalidKeyBody,
    normaliseInput,
    previousNotFoundError,
    sseFrame,
)
from relay.emulator.stored import resolveItems
from relay.emulator.stream import EventPump, TurnTracker, stallOf

APIKEY_RESPONSES = ("/v1/responses", "/responses")
"""Paths of the API-key style Responses endpoint."""

OAUTH_RESPONSES = ("/backend-api/codex/responses",)
"""Paths of the ChatGPT (OAuth) style Responses endpoint."""

OAUTH_UNSUPPORTED = ("max_output_tokens", "temperature", "top_p")
"""Request fields the ChatGPT backend refuses on its HTTP path with 400
C{{"detail": "Unsupported parameter: <name>"}} (chat clients send them by default)."""

CHAT = ("/v1/chat/completions", "/chat/completions")
"""Paths of the Chat Completions endpoint."""

MODELS = ("/v1/models", "/models", "/backend-api/codex/models")
"""Paths of the model list."""


class EmulatorResource(ResponsesAPIMixin, Resource):
    """
    The single leaf resource of the emulator site.

    @ivar emulator: the owning emulator.
    @ivar _chatCompletions: the L{ChatCompletions} route.
    @ivar _auth: the L{AuthRoutes} (token, usage, login).
    @ivar _controlAPI: the L{ControlAPI} (C{/_emulator/*}).
    """

    isLeaf = True
    _log = Logger()

    def __init__(self, emulator) -> None:
        """
        @param emulator: the owning emulator (state, clock, WebSocket resource).
        @type emulator: L{relay.emulator.core.Emulator}
        """
        super().__init__()
        self.emulator = emulator
        self._chatCompletions = ChatCompletions(self)
        self._media = MediaRoutes(self)
        self._auth = AuthRoutes(self)
        self._controlAPI = ControlAPI(self)

    # -- helpers ----------------------------------------------------------------------------

    @property
    def _state(self):
        """
        The emulator state.

        @rtype: L{relay.emulator.state.EmulatorState}
        """
        return self.emulator.state

    def _json(self, request: Any, code: int, body: Any, headers: dict | None = None) -> bytes:
        """
        Answer with a JSON body.

        @param request: the request.
        @param code: the status code.
        @type code: L{int}
        @param body: the JSON value.
        @param headers: extra headers.
        @type headers: L{dict} or L{None}
        @return: the encoded body.
        @rtype: L{bytes}
        """
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"x-request-id", ("req_" + secrets.token_hex(12)).encode())
        for name, value in (headers or {}).items():
            request.setHeader(name.encode(), str(value).encode())
        return json.dumps(body).encode()

    def _faultStatus(self, request: Any, fault: Fault) -> bytes:
        """
        Answer a C{status} or C{ws_handshake_status} fault.

        @param request: the request.
        @param fault: the fault.
        @type fault: L{Fault}
        @return: the body.
        @rtype: L{bytes}
        """
        request.setResponseCode(fault.get("code"))
        body = fault.get("body")
        headers = {k.lower(): str(v) for k, v in (fault.get("headers") or {}).items()}
        if body is None:
            body = {"error": {"message": f"Emulated status {fault.get('code')}",
                              "type": "server_error", "code": None, "param": None}}
        if isinstance(body, str):
            data = body.encode()
            headers.setdefault("content-type", "text/plain; charset=utf-8")
        else:
            data = json.dumps(body).encode()
            headers.setdefault("content-type", "application/json")
        if headers.get("server") != "cloudflare":
            headers.setdefault("x-request-id", "req_" + secrets.token_hex(12))
        for name, value in headers.items():
            request.setHeader(name.encode(), value.encode())
        return data

    def _parseBody(self, request: Any) -> tuple[bool, Any]:
        """
        Parse the request body as JSON.

        @param request: the request.
        @return: C{(ok, value)}; an empty body parses as L{None}.
        @rtype: L{tuple}
        """
        raw = request.content.read() if request.content is not None else b""
        if not raw.strip():
            return True, None
        try:
            return True, json.loads(raw)
        except ValueError:
            return False, None

    def _record(self, request: Any, transport: str, kind: str, credential: str | None,
                body: Any) -> None:
        """
        Record a request.

        @param request: the request.
        @param transport: C{"http"} or C{"ws"}.
        @type transport: L{str}
        @param kind: C{"request"} or C{"handshake"}.
        @type kind: L{str}
        @param credential: the bearer token.
        @param body: the parsed body.
        """
        self._state.record(
            credential, transport, kind, request.path.decode("latin-1"),
            request.method.decode("latin-1"), lowerHeaders(request), body,
            peerHost(request.getClientAddress()),
        )

    def _credential(self, request: Any) -> tuple:
        """
        The request's credential key and, for one of the emulator's own
        access tokens that is expired or invalid, the 401 body.

        @param request: the request.
        @return: C{(key, None)} or C{(key, body)}.
        @rtype: L{tuple}
        """
        return self.emulator.authenticate(bearer(request.getHeader("authorization")))

    def _hold(self, request: Any) -> None:
        """
        Keep a request open (a hang) until the client goes or the emulator stops.

        @param request: the request.
        """
        self.emulator._held.add(request)
        request.notifyFinish().addBoth(lambda _: self.emulator._held.discard(request))

    # -- dispatch ---------------------------------------------------------------------------

    def render(self, request: Any) -> Any:
        """
        Dispatch on path and method.

        @param request: the request.
        @return: the body or C{NOT_DONE_YET}.
        """
        path = request.path.decode("latin-1").rstrip("/") or "/"
        method = request.method
        if path.startswith("/_emulator"):
            return self._controlAPI.render(request, path)
        if path in APIKEY_RESPONSES or path in OAUTH_RESPONSES:
            route = "oauth" if path in OAUTH_RESPONSES else "apikey"
            if method == b"POST":
                return self._responses(request, route)
            if method == b"GET":
                if isUpgrade(request):
                    return self._upgrade(request)
                return self._json(request, 426, {"error": {
                    "type": "invalid_request_error",
                    "message": "WebSocket upgrade required (Upgrade: websocket)"}})
            return self._json(request, 405, {"error": {"type": "invalid_request_error",
                                                       "message": "Method not allowed"}})
        for prefix in APIKEY_RESPONSES + OAUTH_RESPONSES:
            if path.startswith(prefix + "/"):
                route = "oauth" if prefix in OAUTH_RESPONSES else "apikey"
                return self._subRoute(request, route, path[len(prefix) + 1:].split("/"))
        if path == TOKEN:
            if method != b"POST":
                return self._json(request, 405, {"error": "invalid_request",
                                                 "error_description": "use POST"})
            return self._auth.token(request)
        if path == WHAM_USAGE and method == b"GET":
            return self._auth.wham(request)
        if (path, method) in ((WHAM_RESETS, b"GET"), (WHAM_CONSUME, b"POST")):
            return self._auth.resets(request, path == WHAM_CONSUME)
        if path in (AUTHORIZE, AUTHORIZE_DECISION, DEVICE_USERCODE, DEVICE_TOKEN, DEVICE_PAGE):
            return self._auth.login(request, path)
        if path in CHAT and method == b"POST":
            return self._chatCompletions.post(request)
        if path in EMBEDDINGS + IMAGES + IMAGE_EDITS and method == b"POST":
            return self._media.post(request, path)
        if path in MODELS and method == b"GET":
            return self._models(request)
        return self._json(request, 404, {"error": {
            "message": f"Invalid URL ({method.decode()} {path})",
            "type": "invalid_request_error", "code": None, "param": None}})

    # -- the model list ---------------------------------------------------------------------

    def _models(self, request: Any) -> bytes:
        """
        Answer C{GET /v1/models}.

        @param request: the request.
        @rtype: L{bytes}
        """
        credential, denied = self._credential(request)
        self._record(request, HTTP, "request", credential, None)
        if denied is not None:
            return self._json(request, 401, denied)
        if not self._state.known(credential):
            return self._json(request, 401, invalidKeyBody())
        created = int(self.emulator.clock.seconds())
        if request.path.startswith(b"/backend-api"):
            # The Codex models manifest (protocol.md 7.2) with its ETag; a matching
            # If-None-Match is answered 304 without a body (behaviour.md R92).
            manifest = modelsManifest(self.emulator.models)
            etag = manifestETag(manifest)
            if request.getHeader(b"if-none-match") == etag.encode():
                request.setResponseCode(304)
                request.setHeader(b"etag", etag.encode())
                return b""
            return self._json(request, 200, manifest, {"etag": etag})
        return self._json(request, 200, {"object": "list", "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "openai"}
            for m in self.emulator.models]})

    # -- shared fault handling --------------------------------------------------------------

    def _admit(self, request: Any, credential: str | None, draw: TurnDraw,
               body: Any = None, endpoint: str = "responses") -> tuple[Any, Fault | None]:
        """
        Authenticate and apply the faults that act before the response starts.

        @param request: the request.
        @param credential: the bearer token.
        @param draw: the request's L{TurnDraw} (scripted faults first, then chaos).
        @param body: the parsed body (which faults fit it: L{EmulatorState.takeFault}).
        @param endpoint: C{responses} or C{chat}.
        @return: C{(answer, fault)}: when C{answer} is not L{None} the request is already
            answered with it; otherwise C{fault} is the fault (if any) that shapes the stream.
        @rtype: L{tuple}
        """
        if not self._state.known(credential):
            return self._json(request, 401, invalidKeyBody()), None
        fault = self.emulator.takeFault(credential, HTTP, draw, body=body, endpoint=endpoint)
        if fault is None:
            return None, None
        self._log.info("applying fault {kind} for {name}", event="emulator.fault",
                       kind=fault.kind, name=self._state.nameOf(credential))
        if fault.kind == "reset_before_headers":
            abortConnection(request)
            return NOT_DONE_YET, None
        if fault.kind == "hang_before_headers":
            tracker = TurnTracker(self._state, credential)
            request.notifyFinish().addBoth(tracker.end)
            self._hold(request)
            return NOT_DONE_YET, None
        if fault.kind == "status":
            return self._faultStatus(request, fault), None
        return None, fault

    def _hangAfterHeaders(self, request: Any, credential: str | None, stream: bool) -> Any:
        """
        Send 200 and the headers, then nothing.

        @param request: the request.
        @param credential: the bearer token.
        @param stream: whether SSE headers are sent.
        @type stream: L{bool}
        @return: C{NOT_DONE_YET}.
        """
        tracker = TurnTracker(self._state, credential)
        request.notifyFinish().addBoth(tracker.end)
        request.setResponseCode(200)
        if stream:
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
        else:
            request.setHeader(b"content-type", b"application/json")
        request.write(b"")
        self._hold(request)
        return NOT_DONE_YET

    def _finisher(self, request: Any, tracker: TurnTracker, onComplete: Any = None):
        """
        Build a callback that ends the turn and finishes the request (if the client is still
        there).

        @param request: the request.
        @param tracker: the turn's tracker.
        @type tracker: L{TurnTracker}
        @param onComplete: called before finishing when the client is still there (the
            answer was delivered whole: a generation, L{relay.emulator.chaos}), or L{None}.
        @return: a no-argument callable.
        """

        def finish() -> None:
            tracker.end()
            if not request.finished and not getattr(request, "_emulatorGone", False):
                if onComplete is not None:
                    onComplete()
                request.finish()

        return finish

    def _watch(self, request: Any, tracker: TurnTracker, pump: EventPump | None = None) -> None:
        """
        Stop the pump and end the turn when the client goes away.

        @param request: the request.
        @param tracker: the turn's tracker.
        @type tracker: L{TurnTracker}
        @param pump: the event pump, if any.
        @type pump: L{EventPump} or L{None}
        """

        def gone(reason: Failure | None) -> None:
            if isinstance(reason, Failure):
                request._emulatorGone = True
                if pump is not None:
                    pump.stop()
            tracker.end()

        request.notifyFinish().addBoth(gone)

    # -- POST /v1/responses -----------------------------------------------------------------

    def _responses(self, request: Any, route: str) -> Any:
        """
        Answer a Responses POST.

        @param request: the request.
        @param route: C{"apikey"} or C{"oauth"}.
        @type route: L{str}
        @return: the body or C{NOT_DONE_YET}.
        """
        ok, body = self._parseBody(request)
        credential, denied = self._credential(request)
        self._record(request, HTTP, "request", credential, body)
        if denied is not None:
            return self._json(request, 401, denied)
        if not ok or not isinstance(body, dict):
            return self._json(request, 400, {"error": {
                "message": "We could not parse the JSON body of your request.",
                "type": "invalid_request_error", "code": None, "param": None}})
        draw = self.emulator.arrive(credential, HTTP, body, lowerHeaders(request))
        stream = body.get("stream") is True
        if route == "oauth" and self._state.known(credential) and not stream:
            return self._json(request, 400, {"detail": "Stream must be set to true"})
        unsupported = [name for name in OAUTH_UNSUPPORTED if name in body]
        if route == "oauth" and self._state.known(credential) and unsupported:
            return self._json(request, 400, {"detail": f"Unsupported parameter: {unsupported[0]}"})
        answer, fault = self._admit(request, credential, draw, body)
        if answer is not None:
            return answer
        if fault is not None and fault.kind == "refuse":
            refusal = refusalOf(fault, body, "responses", credential)
            if refusal is not None and (not stream or fault.get("wire", "error") == "error"):
                return self._json(request, refusal.status, refusal.body)
            fault = None if refusal is None else Fault(
                "stream_error", params={"error": refusal.error()})
        if fault is not None and fault.kind == "hang_after_headers":
            return self._hangAfterHeaders(request, credential, stream)
        previous = body.get("previous_response_id")
        if previous and not (route == "apikey"
                             and self.emulator.responses.get(credential, previous) is not None):
            return self._json(request, 400, {"error": previousNotFoundError(previous)})
        background = body.get("background") is True
        if background and route == "oauth":
            return self._json(request, 400, {"detail": "Unsupported parameter: background"})
        items = normaliseInput(body.get("input"))
        resolved, missing = resolveItems(self.emulator.responses, route, credential, items,
                                         body.get("store"))
        if missing is not None:
            return self._json(request, 404, {"error": missing})
        if resolved is not items:
            body, items = dict(body, input=resolved), resolved
        refused = inputError(items, self._state.nameOf(credential))
        if refused is not None:
            return self._json(request, 400, {"error": refused})
        script = self._state.scriptFor(credential)
        reply = None
        if body.get("generate") is not False:
            reply = chooseReply(script, items, self._state.nameOf(credential),
                                body.get("model") or "", body.get("include"))
        if not stream and fault is not None and fault.kind == "stream_error":
            return self._json(request, 500, streamErrorBody(fault))
        shaping = fault if fault is not None and fault.kind in (
            "stream_error", "empty_completed") else None
        emptyOutput = (script.completedOutput or ("empty" if route == "oauth" else "full")) \
            == "empty"
        turn = buildTurn(body, reply, self.emulator.clock.seconds(), shaping, script.deltas,
                         script.argumentDeltas, emptyOutput, script.usage)
        if route == "apikey" and body.get("store") is not False and not background:
            self._keep(credential, turn, body)
        if route == "oauth":
            for name, value in self.emulator.oauth.usageHeaders(credential).items():
                request.setHeader(name.encode(), value.encode())
            # The sticky-routing token (protocol.md 4.1, behaviour.md R90): the client's own
            # within a turn, else a fresh one.
            request.setHeader(b"x-codex-turn-state", turnStateFor(request).encode())
        self.emulator.oauth.served(credential, (turn.final.get("usage") or {}).get(
            "total_tokens", 0))
        tracker = TurnTracker(self._state, credential)
        firstDelay = float(fault.get("seconds", 0)) if fault is not None and \
            fault.kind == "delay_first_output" else 0.0
        cutAfter, cleanEnd = breakAfter(fault)
        complete = None
        if reply is not None and (shaping is None or shaping.kind != "stream_error"):
            # A generation: an answer (not a prewarm, not a response.failed) delivered whole.
            def complete() -> None:
                self.emulator.generated(draw, credential, turn.final)

        if background:
            tracker.end()
            return self._background(request, credential, body, turn, script, stream, complete)
        if not stream:
            # A non-stream answer takes as long as the stream would have.
            generation = script.delay * max(0, len(turn.events) - 1)
            return self._nonStream(request, tracker, turn.final, firstDelay + generation,
                                   cutAfter, cleanEnd, complete)
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-request-id", ("req_" + secrets.token_hex(12)).encode())
        request.write(b"")

        finish = self._finisher(request, tracker)

        def cut() -> None:
            tracker.end()
            dropConnection(request)

        pump = EventPump(
            clock=self.emulator.clock, events=turn.events,
            send=lambda event: request.write(sseFrame(event)),
            finish=self._finisher(request, tracker, complete),
            cut=finish if cleanEnd else cut, beforeTerminal=tracker.end,
            delay=script.delay, firstOutput=turn.firstOutput, firstDelay=firstDelay,
            cutAfter=cutAfter, **stallOf(fault),
        )
        self._watch(request, tracker, pump)
        pump.start()
        return NOT_DONE_YET

    def _nonStream(self, request: Any, tracker: TurnTracker, final: dict, firstDelay: float,
                   cutAfter: int | None, cleanEnd: bool = False, complete: Any = None) -> Any:
        """
        Answer a non-stream request with the final response (or completion) object.

        @param request: the request.
        @param tracker: the turn's tracker.
        @type tracker: L{TurnTracker}
        @param final: the response object.
        @type final: L{dict}
        @param firstDelay: seconds to wait before answering.
        @type firstDelay: L{float}
        @param cutAfter: when not L{None}, send the status line, the headers and the first
            half of the body, then break off (the event count does not matter: the body is
            one piece).
        @type cutAfter: L{int} or L{None}
        @param cleanEnd: with C{cutAfter}, end the truncated body cleanly
            (C{end_after_events}) instead of dropping the connection mid-body
            (C{cut_after_events}).
        @type cleanEnd: L{bool}
        @param complete: called when the whole body was delivered (a generation), or L{None}.
        @return: C{NOT_DONE_YET}.
        """
        finish = self._finisher(request, tracker)

        def truncated() -> None:
            encoded = self._json(request, 200, final)
            request.write(encoded[: max(1, len(encoded) // 2)])
            if cleanEnd:
                finish()
            else:
                tracker.end()
                dropConnection(request)

        pump = EventPump(
            clock=self.emulator.clock, events=[final],
            send=lambda obj: request.write(self._json(request, 200, obj)),
            finish=self._finisher(request, tracker, complete), cut=truncated,
            beforeTerminal=tracker.end, firstOutput=0, firstDelay=firstDelay,
            cutAfter=0 if cutAfter is not None else None,
        )
        self._watch(request, tracker, pump)
        pump.start()
        return NOT_DONE_YET

    # -- WebSocket upgrade ------------------------------------------------------------------

    def _upgrade(self, request: Any) -> Any:
        """
        Check and hand a WebSocket upgrade to autobahn, or reject it.

        @param request: the request.
        @return: whatever the C{WebSocketResource} returns, or a rejection body.
        """
        credential, denied = self._credential(request)
        self._record(request, WS, "handshake", credential, None)
        if denied is not None:
            return self._json(request, 401, denied)
        if not self._state.known(credential):
            return self._json(request, 401, invalidKeyBody())
        draw = self.emulator.ledger.handshake(
            lowerHeaders(request).get(CLIENT_REQUEST_ID) or None)
        fault = self.emulator.takeFault(credential, WS, draw, handshake=True)
        if fault is not None:
            self._log.info("applying handshake fault {kind} for {name}",
                           event="emulator.fault", kind=fault.kind,
                           name=self._state.nameOf(credential))
            if fault.kind == "ws_handshake_reset":
                abortConnection(request)
                return NOT_DONE_YET
            if fault.kind == "ws_handshake_hang":
                self._hold(request)
                return NOT_DONE_YET
            return self._faultStatus(request, fault)
        return self.emulator.wsResource.render(request)


__all__ = ["EmulatorResource", "bearer", "isUpgrade", "WS"]
