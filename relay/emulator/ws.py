# -*- test-case-name: tests.test_emulator -*-
"""
The emulator's Responses WebSocket (protocol.md §4): one C{response.create} per text frame,
answered with the same events as the SSE stream, one JSON event per frame.

Chaining is connection-local: a C{previous_response_id} produced on this connection is known;
anything else gets the C{previous_response_not_found} error event.  A connection older than the
configured age limit answers C{response.create} with C{websocket_connection_limit_reached}.
"""

from __future__ import annotations

import json
from typing import Any

from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.compress import PerMessageDeflateOffer, PerMessageDeflateOfferAccept
from twisted.logger import Logger

from relay.emulator.httpwire import bearer, breakAfter, turnStateFor
from relay.emulator.refusals import refusalOf
from relay.emulator.state import (
    WS,
    Fault,
    buildTurn,
    chooseReply,
    inputError,
    normaliseInput,
    previousNotFoundError,
)
from relay.emulator.stored import resolveItems
from relay.emulator.stream import EventPump, TurnTracker, stallOf


def acceptDeflate(offers: list) -> Any:
    """
    Accept the first C{permessage-deflate} offer (Codex offers one).

    @param offers: the client's offers.
    @type offers: L{list}
    @return: the acceptance, or L{None}.
    """
    for offer in offers:
        if isinstance(offer, PerMessageDeflateOffer):
            return PerMessageDeflateOfferAccept(offer)
    return None


def wsError(status: int, error: dict, headers: dict | None = None) -> dict:
    """
    Build the WebSocket error wrapper event (protocol.md §4.5).

    @param status: the HTTP-like status.
    @type status: L{int}
    @param error: the inner error object.
    @type error: L{dict}
    @param headers: headers to carry, if any.
    @type headers: L{dict} or L{None}
    @rtype: L{dict}
    """
    return {"type": "error", "status": status, "error": error, "headers": headers or {}}


def faultError(fault: Fault) -> dict:
    """
    Turn a C{status} fault into the WebSocket error event.

    @param fault: the fault.
    @type fault: L{Fault}
    @rtype: L{dict}
    """
    body = fault.get("body")
    code = fault.get("code")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = dict(body["error"])
    elif isinstance(body, dict) and "detail" in body:
        error = {"type": "invalid_request_error", "message": str(body["detail"])}
    elif isinstance(body, str):
        error = {"type": "server_error", "message": body[:500]}
    else:
        error = {"type": "server_error", "message": f"Emulated status {code}"}
    headers = {k.lower(): str(v) for k, v in (fault.get("headers") or {}).items()}
    return wsError(code, error, headers)


class EmulatorWebSocketProtocol(WebSocketServerProtocol):
    """
    One emulated upstream Responses WebSocket connection.

    Frames are processed strictly one turn at a time; frames arriving during a turn queue.
    """

    _log = Logger()

    def onConnect(self, request: Any) -> None:
        """
        Remember the credential, headers and peer of the upgrade (already vetted by
        L{relay.emulator.http.EmulatorResource}).

        @param request: autobahn's C{ConnectionRequest}.
        @return: L{None} (accept, no subprotocol).
        """
        try:
            self._emulator = self.factory.emulator
            self._credential, _ = self._emulator.authenticate(
                bearer(request.headers.get("authorization"))
            )
            self._headers = {k.lower(): v for k, v in request.headers.items()}
            self._path = request.path
            self._peerHost = getattr(self.transport.getPeer(), "host", None)
            self._openedAt = self._emulator.clock.seconds()
            self._known: set[str] = set()
            self._queue: list[dict] = []
            self._busy = False
            self._pump: EventPump | None = None
            self._tracker: TurnTracker | None = None
            self._model: str | None = None
            self._closed = False
            self._oauthRoute = (self._path or "").startswith("/backend-api")
            usage = self._emulator.oauth.usageHeaders(self._credential)
        except Exception:
            self._log.failure("while accepting an emulated WebSocket")
            raise
        if self._oauthRoute:
            # protocol.md 7.3: the usage windows ride on the handshake too; so does the
            # sticky-routing token (protocol.md 4.1, behaviour.md R90).
            return (None, {**usage, "x-codex-turn-state": turnStateFor(request)})
        return None

    def onOpen(self) -> None:
        """
        Register the connection with the emulator.
        """
        try:
            self._emulator._connections.add(self)
        except Exception:
            self._log.failure("while opening an emulated WebSocket")
            self.dropConnection(abort=True)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        """
        Stop any running turn and forget the connection.

        @param wasClean: whether the close handshake completed.
        @param code: the close code.
        @param reason: the close reason.
        """
        emulator = getattr(self, "_emulator", None)
        if emulator is None:
            return
        self._closed = True
        emulator._connections.discard(self)
        if self._pump is not None:
            self._pump.stop()
        if self._tracker is not None:
            self._tracker.end()

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        """
        Queue one client frame and process it when the connection is idle.

        @param payload: the frame payload.
        @param isBinary: whether it was a binary frame (JSON is accepted either way).
        """
        try:
            frame = json.loads(payload)
        except ValueError:
            self._sendEvent(wsError(400, {"type": "invalid_request_error",
                                          "message": "Invalid JSON frame.", "code": None,
                                          "param": None}))
            return
        if not isinstance(frame, dict):
            self._sendEvent(wsError(400, {"type": "invalid_request_error",
                                          "message": "Frames must be JSON objects.",
                                          "code": None, "param": None}))
            return
        self._queue.append(frame)
        self._drain()

    def _sendEvent(self, event: dict) -> None:
        """
        Send one event as a text frame, if the connection is still open.

        @param event: the event.
        @type event: L{dict}
        """
        if not self._closed and self.state == self.STATE_OPEN:
            self.sendMessage(json.dumps(event, separators=(",", ":")).encode(), False)

    def _drain(self) -> None:
        """
        Process queued frames while no turn is running.
        """
        while not self._busy and self._queue and not self._closed:
            self._process(self._queue.pop(0))

    def _turnDone(self) -> None:
        """
        The current turn ended; process the next frame.
        """
        self._busy = False
        self._pump = None
        self._tracker = None
        self._drain()

    def _process(self, frame: dict) -> None:
        """
        Answer one client frame.

        @param frame: the decoded frame.
        @type frame: L{dict}
        """
        kind = frame.get("type", "response.create")
        if kind == "response.processed":
            return
        state = self._emulator.state
        state.record(self._credential, WS, "frame", self._path, "GET", self._headers, frame,
                     self._peerHost)
        if kind != "response.create":
            self._sendEvent(wsError(400, {
                "type": "invalid_request_error", "code": "unsupported_type",
                "message": f"Unsupported event type: {kind}", "param": "type"}))
            return
        now = self._emulator.clock.seconds()
        if now - self._openedAt >= self._emulator.wsMaxAge:
            minutes = int(self._emulator.wsMaxAge // 60)
            self._sendEvent(wsError(400, {
                "type": "invalid_request_error", "code": "websocket_connection_limit_reached",
                "message": f"Responses websocket connection limit reached ({minutes} minutes)."
                " Create a new websocket connection to continue.", "param": None}))
            return
        draw = self._emulator.arrive(self._credential, WS, frame, None)
        fault = self._emulator.takeFault(self._credential, WS, draw, body=frame)
        tracker = TurnTracker(state, self._credential)
        if fault is not None and fault.kind == "refuse":
            refusal = refusalOf(fault, frame, "responses", self._credential)
            if refusal is not None and fault.get("wire", "error") == "error":
                tracker.end()
                self._sendEvent(wsError(refusal.status, refusal.wsError()))
                return
            fault = None if refusal is None else Fault(
                "stream_error", params={"error": refusal.error()})
        if fault is not None:
            self._log.info("applying fault {kind} for {name}", event="emulator.fault",
                           kind=fault.kind, name=state.nameOf(self._credential))
            if fault.kind == "reset_before_headers":
                tracker.end()
                self.dropConnection(abort=True)
                return
            if fault.kind in ("hang_before_headers", "hang_after_headers"):
                self._busy = True
                self._tracker = tracker
                return
            if fault.kind == "status":
                tracker.end()
                self._sendEvent(faultError(fault))
                return
        previous = frame.get("previous_response_id")
        if previous and previous not in self._known:
            tracker.end()
            self._sendEvent(wsError(400, previousNotFoundError(previous)))
            return
        if frame.get("model"):
            self._model = frame["model"]
        body = dict(frame)
        body.pop("type", None)
        body["model"] = self._model or "gpt-5.5"
        items = normaliseInput(frame.get("input"))
        resolved, missing = resolveItems(self._emulator.responses,
                                         "oauth" if self._oauthRoute else "apikey",
                                         self._credential, items, frame.get("store"))
        if missing is not None:
            tracker.end()
            self._sendEvent(wsError(404, missing))
            return
        if resolved is not items:
            body["input"] = items = resolved
        refused = inputError(items, state.nameOf(self._credential))
        if refused is not None:
            tracker.end()
            self._sendEvent(wsError(400, refused))
            return
        script = state.scriptFor(self._credential)
        reply = None
        if frame.get("generate") is not False:
            reply = chooseReply(script, items, state.nameOf(self._credential), body["model"],
                                frame.get("include"))
        shaping = fault if fault is not None and fault.kind in (
            "stream_error", "empty_completed") else None
        turn = buildTurn(body, reply, now, shaping, script.deltas, script.argumentDeltas,
                         script.completedOutput == "empty", script.usage)
        self._known.add(turn.responseId)
        limits = self._emulator.oauth.usageEvent(self._credential) if self._oauthRoute else None
        if limits is not None:
            self._sendEvent(limits)
        self._emulator.oauth.served(
            self._credential, (turn.final.get("usage") or {}).get("total_tokens", 0)
        )
        self._busy = True
        self._tracker = tracker

        cutAfter, cleanEnd = breakAfter(fault)

        def cut() -> None:
            # cut_after_events: TCP closed without a close frame (the relay sees 1006);
            # end_after_events: a clean close 1000 in the middle of the turn.
            tracker.end()
            if cleanEnd:
                self.sendClose(code=1000)
            else:
                self.dropConnection(abort=False)

        generative = reply is not None and (shaping is None or shaping.kind != "stream_error")

        def finish() -> None:
            if generative and not self._closed and self.state == self.STATE_OPEN:
                # The terminal event went out on an open connection: a generation.
                self._emulator.generated(draw, self._credential, turn.final)
            self._turnDone()

        self._pump = EventPump(
            clock=self._emulator.clock, events=turn.events, send=self._sendEvent,
            finish=finish, cut=cut, beforeTerminal=tracker.end, delay=script.delay,
            firstOutput=turn.firstOutput,
            firstDelay=float(fault.get("seconds", 0))
            if fault is not None and fault.kind == "delay_first_output" else 0.0,
            cutAfter=cutAfter,
            **stallOf(fault),
        )
        self._pump.start()


def buildFactory(emulator) -> WebSocketServerFactory:
    """
    Build the emulator's WebSocket factory with explicit protocol options (style.md §9(a)).

    @param emulator: the owning emulator; protocols find it as C{factory.emulator}.
    @type emulator: L{relay.emulator.core.Emulator}
    @rtype: L{WebSocketServerFactory}
    """
    factory = WebSocketServerFactory(None, reactor=emulator.reactor)
    factory.protocol = EmulatorWebSocketProtocol
    factory.emulator = emulator
    factory.setProtocolOptions(
        openHandshakeTimeout=10, closeHandshakeTimeout=5, autoPingInterval=30,
        autoPingTimeout=60, maxMessagePayloadSize=emulator.wsMaxFrameBytes, failByDrop=False,
        perMessageCompressionAccept=acceptDeflate,
    )
    return factory
