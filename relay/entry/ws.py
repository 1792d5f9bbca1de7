# -*- test-case-name: tests.test_ws, tests.test_frontdoor -*-
"""
The Responses WebSocket entrypoint (C{GET /v1/responses} with an upgrade;
protocol.md 4, behaviour.md group F, style.md 9(a)).

A transport adapter: it authenticates before the upgrade, reads and
writes frames (what a message holds counts in the bytes in flight, R103;
one early frame is held while a turn runs, R63), keeps the timers and
close codes, and hands every client frame with the
connection's L{relay.entry.conversation.WebSocketConversation} (its record
of its turns and its dedicated upstream for C{passthrough}) to the front
door (L{relay.frontdoor.door.FrontDoor.frame}), which parses it, has the
conversation make a C{response.create} a L{Turn} with a L{WebSocketSink},
checks the key and hands the turn to the engine. Selection, admission,
waiting, failover and cooldowns all happen in the engine.
"""

from __future__ import annotations

import json
import os

from autobahn.twisted.resource import WebSocketResource
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.exception import PayloadExceededError
from autobahn.util import encode_truncate
from autobahn.websocket.compress import (
    PerMessageDeflateOffer,
    PerMessageDeflateOfferAccept,
)
from twisted.internet.interfaces import ISSLTransport
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.web.server import NOT_DONE_YET
from zope.interface import directlyProvidedBy, directlyProvides

from relay.entry.conversation import THREAD_HEADERS, WebSocketConversation, reachable
from relay.entry.keylimits import handshakeHeaders
from relay.entry.http import UNAUTHORIZED, filterClientHeaders
from relay.entry.sinks import errorBody, writeError
from relay.entry.wssink import wsErrorEvent
from relay.frontdoor.door import FrontDoor
from relay.frontdoor.record import Admission
from relay.base.records import ClientError
from relay.base.logs import cutRedacted
from relay.base.clienterrors import RESTART_CLOSE
from relay.base.requestid import adoptClientId
from relay.scheduling.session import SESSION_HEADERS, sessionHash, sessionSeed

TOO_MANY_MESSAGE = "too many requests while retrying, please retry later"
CLIENT_IDLE_CLOSE = (1008, "client websocket idle timeout")
"""R69: the passthrough client idle close (other modes close 1000)."""


def closeWith(proto, code: int, reason: str) -> None:
    """
    Close with any code (style.md 9(a), trap T21): C{sendClose} accepts only
    1000 and 3000-4999. The reason is cut to 120 bytes on a character
    boundary (R65). Does nothing unless the connection is open.
    """
    if proto.state == proto.STATE_OPEN:
        proto.sendCloseFrame(code=code, reasonUtf8=encode_truncate(reason, 120), isReply=False)


def acceptDeflate(offers):
    """
    Accept the client's first permessage-deflate offer (R47; Codex offers it).
    """
    for offer in offers:
        if isinstance(offer, PerMessageDeflateOffer):
            return PerMessageDeflateOfferAccept(offer)
    return None


def _connectionIds(headers) -> tuple[str, str, str | None]:
    """
    A new connection's ids (R111): its own C{ws_<random>} id,
    which is also its request id (relay's own, new on every connection, so
    a reconnect never reuses a turn's id), and the client's id
    (L{adoptClientId} as for HTTP; Codex: its thread id), kept as each
    turn's C{client_request_id}. Turn C{n} on the connection is
    C{<request id>:<n>}.

    @param headers: the upgrade request's headers by lower-case name.
    @return: C{(connection id, request id, client request id or None)}.
    """
    connId = "ws_" + os.urandom(6).hex()
    return connId, connId, adoptClientId(headers.get)


class RelayWebSocketProtocol(WebSocketServerProtocol):
    """
    One client WebSocket. Strictly one turn at a time (protocol.md 4.6);
    while a turn runs the socket is still read, holding at most one early
    frame (R63).
    """

    _log = Logger()
    conversation = None
    """The connection's L{WebSocketConversation}, from L{onConnect}."""

    def onConnect(self, request):
        try:
            f = self.factory
            headers = {k.lower(): v for k, v in request.headers.items()}
            # The upgrade was authenticated once, by the
            # HTTP intake and L{RelayWebSocketResource}; its key is handed
            # over, never parsed again from the headers.
            admission = getattr(self, "admission", None)
            key = admission.key if admission is not None else None
            if key is None:
                from autobahn.websocket.types import ConnectionDeny

                raise ConnectionDeny(401, "Unauthorized")
            self._buffered = None
            self._timer = None
            self._closing = None
            self._gone = False
            ids = _connectionIds(headers)
            self._connId, self._requestId, self._clientRequestId = ids
            self.conversation = WebSocketConversation(
                self, f, key, filterClientHeaders(headers), ids,
                threadId=next((headers[h] for h in THREAD_HEADERS if headers.get(h)), None),
                # Who is calling, for the request log.
                clientAddress=_peerHost(self.transport),
                userAgent=cutRedacted(headers.get("user-agent") or "", 200, always=True) or None,
                openedAt=f.reactor.seconds(),
            )
        except Exception:
            self._log.failure("accepting a client websocket failed")
            raise
        answer = {"X-Request-Id": self._requestId}
        if any(headers.get(h) for h in SESSION_HEADERS):
            return handshakeHeaders(f.runner, key, self._withTurnState(headers, answer))
        return handshakeHeaders(f.runner, key, (None, answer))  # R114

    def _withTurnState(self, headers: dict, answer: dict):
        """
        R90: the 101 of a session's new connection carries the
        C{x-codex-turn-state} the upstream gave the session before (its
        first 101 went out before an account was chosen, R47).

        @return: a Deferred firing with autobahn's C{(protocol, headers)}.
        """
        recall = getattr(getattr(self.factory.runner, "scheduler", None), "recallValue", None)
        if recall is None:
            return (None, answer)
        from relay.scheduling.scheduler import turnStateSessionKey

        session = sessionHash(sessionSeed(headers, {}, None), self.conversation.key.ownerId)
        d = recall(turnStateSessionKey(session))

        def carry(token):
            if token:
                return (None, {**answer, "x-codex-turn-state": token})
            return (None, answer)

        d.addCallback(carry)
        d.addErrback(lambda f: (self._log.failure("recalling a turn state failed", f),
                                (None, answer))[1])
        return d

    def failHandshake(self, reason: str, code: int = 400, responseHeaders=None) -> None:
        """
        Refuse the opening handshake (autobahn's answer to a malformed
        upgrade: no C{Sec-WebSocket-Key}, an unknown version, ...) with the
        request id as C{X-Request-Id}, like every HTTP answer:
        the connection's once L{onConnect} chose it, else chosen the same
        way (L{_connectionIds}) from the headers autobahn parsed.

        @param reason: the status line's reason.
        @param code: the HTTP status.
        @param responseHeaders: C{(name, value)} pairs to send, or L{None}.
        """
        requestId = getattr(self, "_requestId", None)
        if requestId is None:
            _, requestId, _ = _connectionIds(getattr(self, "http_headers", None) or {})
        headers = [*(responseHeaders or ()), ("X-Request-Id", requestId)]
        super().failHandshake(reason, code, headers)

    def sendHttpErrorResponse(self, code: int, reason: str, responseHeaders=None) -> None:
        """
        Write a refused handshake's answer in OpenAI's error format
        (style: bad input gets a clear error; fuzzing found
        autobahn's bare status line with no body): the status line as
        autobahn writes it, the headers given, and a JSON envelope
        (C{websocket_handshake_failed}, the reason as its message and the
        request id) with its length and C{Connection: close}.

        @param code: the HTTP status (400, 426, ...).
        @param reason: autobahn's reason (e.g. a missing C{Sec-WebSocket-Key}).
        @param responseHeaders: C{(name, value)} pairs, or L{None}.
        """
        headers = list(responseHeaders or ())
        requestId = next((v for n, v in headers if n.lower() == "x-request-id"), None)
        body = errorBody(
            ClientError(code, "invalid_request_error", reason, code="websocket_handshake_failed"),
            requestId,
        )
        lines = [f"HTTP/1.1 {code} {reason}"]
        lines.extend(f"{name}: {value}" for name, value in headers)
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}",
                  "Connection: close", "", ""]
        self.sendData("\r\n".join(lines).encode("utf-8") + body)

    # -- lifecycle -------------------------------------------------------------

    def onOpen(self) -> None:
        try:
            f = self.factory
            s = f.settings.current.websocket
            self.conversation.openedAt = f.reactor.seconds()
            connections = getattr(f, "openConnections", None)
            if connections is not None:
                connections.add(self)
            if getattr(f, "draining", False):
                # The upgrade raced the start of a graceful stop.
                self.closeWith(*RESTART_CLOSE)
                return
            self._arm(s.client_first_message_timeout_seconds, 1008, "missing first response.create message")
        except Exception:  # noqa: BLE001
            self._log.failure("opening a client websocket failed")
            self.closeWith(1011, "upstream websocket proxy failed")

    def onClose(self, wasClean, code, reason) -> None:
        conv = self.conversation
        if conv is None:
            return
        self._gone = True
        # What the connection still held leaves the bytes in flight.
        held, self._bufferedHold = self._bufferedHold, 0
        self._giveBackBytes(self._releaseAssembled() + held)
        self._disarm()
        connections = getattr(self.factory, "openConnections", None)
        if connections is not None:
            connections.discard(self)
        running = conv.leave()
        sent = self._closing
        if sent is None and getattr(self, "closedByMe", False) and self.localCloseCode:
            # autobahn failed the connection itself (a protocol violation
            # 1002, a close reason that is not UTF-8 1007): that close is
            # what the client got, not the client's own code it refused.
            local = self.localCloseReason
            sent = (self.localCloseCode,
                    local.decode("utf-8", "replace") if isinstance(local, bytes) else local or "")
        closeCode = sent[0] if sent else (code or 1006)
        self._log.info(
            "client websocket {conn_id} closed {code} {reason} after {turns} turn(s)",
            event="relay.ws_closed",
            conn_id=self._connId,
            request_id=self._requestId,
            client_request_id=getattr(self, "_clientRequestId", None),
            code=closeCode,
            reason=sent[1] if sent else (reason or ""),
            turns=conv.turns,
            account_id=conv.state.accountId,
            mode=conv.modeName(),
            while_running=running,
        )
        metrics = getattr(getattr(self.factory, "runner", None), "metrics", None)
        if metrics is not None:
            try:
                metrics.wsClose(closeCode)
            except Exception:  # noqa: BLE001
                self._log.failure("counting a websocket close failed")

    def drain(self) -> None:
        """
        relay is stopping. An idle connection closes 1001 "server
        restarting" now (Codex reconnects); a busy one when its turn ends
        (L{relay.entry.conversation.WebSocketConversation}).
        """
        if self.conversation.running is None:
            self.closeWith(*RESTART_CLOSE)

    def isOpen(self) -> bool:
        return not self._gone and self.state == self.STATE_OPEN and self._closing is None

    def sendText(self, data: bytes) -> None:
        if self.isOpen():
            self.sendMessage(data, False)

    def closeWith(self, code: int, reason: str) -> None:
        """
        Close once, remembering what was sent for the C{relay.ws_closed} log.
        """
        if self._closing is not None or self._gone:
            return
        self._closing = (code, reason)
        self._disarm()
        closeWith(self, code, reason)

    def reject(self, reason: str, code=None, param=None, close: int = 1008,
               message: str | None = None) -> None:
        """
        A genuine client mistake (R81): a status-bearing C{error} event
        (400, C{invalid_request_error}), then the R70 close with C{reason}.

        @param message: the event's message, when it says more than the
            close reason (a field's type, worded as HTTP's 400); else the
            reason.
        """
        if self._closing is not None or self._gone:
            return
        reason = encode_truncate(reason, 120).decode("utf-8", "ignore")  # R65
        error = ClientError(400, "invalid_request_error", message or reason, code=code,
                            param=param)
        self.sendText(json.dumps(wsErrorEvent(error)).encode())
        self.closeWith(close, reason)

    def _max_message_size_exceeded(self, msg_size, max_msg_size, reason) -> None:
        """
        R47 step 4, R70, R81: a frame above the read limit. autobahn's hook
        closes 1009 itself; tell the client first while it can still read.
        """
        if self._closing is None and not self._gone and self.state == self.STATE_OPEN:
            code = "frame_too_large"
            if self._ratioExceeded:
                # A permessage-deflate bomb.
                ratio = self.factory.settings.current.limits.max_decompression_ratio
                reason = (f"frame decompresses to more than {ratio:g} times its size"
                          " (gateway.limits.max_decompression_ratio)")
                code = "decompression_ratio_exceeded"
            self._giveBackBytes(self._releaseAssembled())
            reason = encode_truncate(reason, 120).decode("utf-8", "ignore")
            error = ClientError(400, "invalid_request_error", reason, code=code)
            self.sendText(json.dumps(wsErrorEvent(error)).encode())
            self._closing = (1009, reason)
            self._disarm()
        super()._max_message_size_exceeded(msg_size, max_msg_size, reason)

    # -- frames in flight ------------------------------------------------------

    _assembling = 0
    """Bytes of the message being assembled now (after permessage-deflate),
    held in the key's and the process's bytes in flight."""
    _bufferedHold = 0
    """The same for the one early frame held while a turn runs (R63)."""
    _compressedIn = 0
    _inflatedOut = 0
    _ratioExceeded = False

    def _budgetAndLimits(self):
        f = self.factory
        budget = getattr(f, "budget", None)
        settings = getattr(f, "settings", None)
        if budget is None or settings is None or self.conversation is None:
            return None, None
        return budget, settings.current.limits

    def onMessageBegin(self, isBinary: bool) -> None:
        """
        A client message starts: bound its permessage-deflate inflation by
        C{gateway.limits.max_decompression_ratio} (L{_boundInflation}).
        """
        self._compressedIn = self._inflatedOut = 0
        self._ratioExceeded = False
        self._boundInflation()
        super().onMessageBegin(isBinary)

    def _boundInflation(self) -> None:
        """
        A compressed message inflates to at most
        C{max_decompression_ratio} times the compressed bytes received so
        far (or L{relay.entry.body.RATIO_FLOOR_BYTES}, whichever is more),
        besides autobahn's own C{maxMessagePayloadSize} bound: the
        decompressor is asked for no more (it stops inflating, in C), and a
        message that needs more is refused like an oversized one
        (L{_max_message_size_exceeded}: C{error} event, close 1009).
        Needs autobahn's bounded C{decompress_message_data(data,
        max_output_len)} (26.11; setup.cfg).
        """
        pmc = getattr(self, "_perMessageCompress", None)
        if pmc is None or getattr(pmc, "_relayBounded", False):
            return
        from relay.entry.body import RATIO_FLOOR_BYTES

        original = pmc.decompress_message_data

        def bounded(data, max_output_len=None):
            _, limits = self._budgetAndLimits()
            ratio = limits.max_decompression_ratio if limits is not None else None
            if not ratio:
                return original(data, max_output_len=max_output_len)
            self._compressedIn += len(data)
            allowed = max(int(ratio * self._compressedIn), RATIO_FLOOR_BYTES) - self._inflatedOut
            allowed = max(allowed, 0)
            cap = allowed if max_output_len is None else min(max_output_len, allowed)
            try:
                out = original(data, max_output_len=cap)
            except PayloadExceededError:
                if max_output_len is None or allowed < max_output_len:
                    self._ratioExceeded = True
                raise
            self._inflatedOut += len(out)
            return out

        pmc.decompress_message_data = bounded
        pmc._relayBounded = True

    def onMessageFrameData(self, payload: bytes) -> None:
        """
        A piece of a client message (inflated): held in the key's and the
        process's bytes in flight while the message is assembled
        (R103), like an HTTP body while it arrives; over a bound the
        connection is refused (L{refuseFrame}) and nothing more of the
        message is kept.
        """
        if self._closing is not None or getattr(self, "_gone", False):
            return
        budget, limits = self._budgetAndLimits()
        if budget is not None and payload:
            error = budget.reserve(
                self.conversation.key.name, len(payload), limits.body_bytes_in_flight_per_key,
                limits.body_bytes_in_flight,
            )
            if error is not None:
                self.refuseFrame(error)
                return
            self._assembling += len(payload)
        super().onMessageFrameData(payload)

    def _releaseAssembled(self) -> int:
        """
        Stop counting the assembled message; return its byte count.
        """
        n, self._assembling = self._assembling, 0
        return n

    def _giveBackBytes(self, n: int) -> None:
        budget, _ = self._budgetAndLimits()
        if budget is not None and n:
            budget.release(self.conversation.key.name, n)

    def refuseFrame(self, error: ClientError) -> None:
        """
        A message over the bytes in flight: busy, not the client's mistake
        (R81): an C{error} event without status, then close 1013; a single
        message that can never fit is a frame too large (400, 1009).
        """
        self._log.info(
            "client websocket {conn_id}: frame refused ({message})",
            event="relay.ws_frame_refused", conn_id=getattr(self, "_connId", "-"),
            message=error.message,
        )
        self._giveBackBytes(self._releaseAssembled())
        busy = error.status == 429
        self.sendText(json.dumps(wsErrorEvent(error, withStatus=not busy)).encode())
        self.closeWith(1013 if busy else 1009, encode_truncate(error.message, 120).decode(
            "utf-8", "ignore"))
        running = self.conversation.running if self.conversation is not None else None
        if running is not None:
            running.cancel.cancel("frame_refused")

    def _arm(self, seconds: float, code: int, reason: str) -> None:
        self._disarm()
        if seconds and seconds > 0:
            self._timer = self.factory.reactor.callLater(seconds, self.closeWith, code, reason)

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    # -- frames ----------------------------------------------------------------

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        assembled = self._releaseAssembled()
        try:
            if self._closing is not None or self._gone:
                self._giveBackBytes(assembled)
                return
            running = self.conversation.running
            if running is not None:
                # R63: one early frame is held; a second one is too many.
                if self._buffered is None:
                    self._buffered = payload
                    self._bufferedHold = assembled  # still held
                    return
                self._giveBackBytes(assembled)
                self.closeWith(1013, TOO_MANY_MESSAGE)
                running.cancel.cancel("too_many_frames")
                return
            # The frame's own hold is given back; a large one is held again
            # as its parsed-size estimate while it waits (L{holdFrame}).
            self._giveBackBytes(assembled)
            self._disarm()
            self.factory.door.frame(self.conversation, payload)  # to the engine (relay.frontdoor)
        except Exception:  # noqa: BLE001
            self._log.failure("handling a client websocket frame failed")
            self.closeWith(1011, "upstream websocket proxy failed")

    def readNext(self) -> None:
        """
        A turn ended (or was answered locally): hand the early frame held
        meanwhile (R63) to the front door, else wait for the next one.
        """
        if self._buffered is not None:
            payload, self._buffered = self._buffered, None
            held, self._bufferedHold = self._bufferedHold, 0
            self._giveBackBytes(held)
            self._disarm()
            self.factory.door.frame(self.conversation, payload)
            return
        self.idle()

    def idle(self) -> None:
        """
        Between turns: the idle close (R69: C{passthrough} closes 1008,
        other modes 1000).
        """
        s = self.factory.settings.current.websocket
        if self.conversation.modeName() == "passthrough":
            self._arm(s.inter_turn_idle_timeout_seconds, *CLIENT_IDLE_CLOSE)
            return
        self._arm(s.inter_turn_idle_timeout_seconds, 1000, "websocket idle timeout")


def _peerHost(transport):
    """
    @return: the client's IP address, or L{None} when the transport cannot say.
    """
    try:
        return getattr(transport.getPeer(), "host", None)
    except Exception:  # noqa: BLE001 - a test transport, a closed socket
        return None


def _plainForAutobahn(transport) -> None:
    """
    An upgrade on a TLS listener (C{listen: "ssl:..."}): the connection's
    counting wrapper (L{relay.entry.site.RelaySite}) declares the TLS
    transport's L{ISSLTransport} without being the
    L{TLSMemoryBIOProtocol} autobahn reads the TLS channel id from (it
    declares C{INegotiated}, which extends it), and autobahn's
    C{connectionMade} raises on that; relay binds nothing to the channel,
    so the wrapper stops declaring it (the socket is no longer HTTP,
    nothing asks C{isSecure} again).

    @param transport: the request's channel transport, about to be taken.
    """
    if (transport is None or isinstance(transport, TLSMemoryBIOProtocol)
            or not ISSLTransport.providedBy(transport)):
        return
    kept = [i for i in directlyProvidedBy(transport) if not i.isOrExtends(ISSLTransport)]
    directlyProvides(transport, *kept)


class RelayWebSocketResource:
    """
    The upgrade handler: authenticate (401 JSON, not upgraded), refuse when
    every account has WebSockets off (426, so clients use HTTP), then let
    autobahn take the transport.
    """

    def __init__(self, factory, keys, accounts, settings):
        self.factory = factory
        self._keys = keys
        self._accounts = accounts
        self._settings = settings
        self._ws = WebSocketResource(factory)

    def render(self, request):
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        # R102: a disabled or expired key is refused before the upgrade (an
        # open socket's next turn is refused at the front door).
        error = self.factory.door.checks.keyRefusal(key)
        if error is not None:
            writeError(request, error)
            return NOT_DONE_YET
        default = self._settings.current.websocket.mode_default
        if all((a.ws_mode or default) == "off" for a in reachable(self.factory, key)):
            writeError(
                request,
                ClientError(
                    426, "invalid_request_error",
                    "WebSocket mode is disabled; use HTTP POST /v1/responses",
                ),
            )
            return NOT_DONE_YET
        _plainForAutobahn(request.channel.transport)
        # The protocol takes this key (authenticated once).
        self.factory.handover = Admission(key=key)
        try:
            return self._ws.render(request)
        finally:
            self.factory.handover = None


class _RelayWebSocketFactory(WebSocketServerFactory):
    """
    The client WebSocket factory: a protocol built for an upgrade takes
    the admission of the key L{RelayWebSocketResource} authenticated
    (C{handover}, a L{relay.frontdoor.record.Admission}).
    """

    handover = None
    budget = None

    def buildProtocol(self, addr):
        proto = super().buildProtocol(addr)
        proto.admission = self.handover
        return proto


def buildWebSocketResource(runner, keys, accounts, settings, reactor) -> RelayWebSocketResource:
    """
    The autobahn factory with explicit options (style.md 9(a)) wrapped in
    the upgrade handler. Keep C{resource.factory} as C{site.wsFactory}.
    """
    factory = _RelayWebSocketFactory(None, reactor=reactor)
    factory.protocol = RelayWebSocketProtocol
    factory.runner = runner
    factory.door = FrontDoor(runner)  # every frame's way to the engine
    factory.keys = keys
    factory.accounts = accounts  # the live registry, never a copy
    factory.settings = settings
    factory.sessionOwners = {}  # R68: (key, session hash, thread id) -> connection
    factory.openConnections = set()  # what a graceful stop closes
    factory.draining = False
    factory.setProtocolOptions(
        openHandshakeTimeout=10,
        closeHandshakeTimeout=5,
        autoPingInterval=30,
        autoPingTimeout=60,
        maxMessagePayloadSize=settings.current.websocket.max_frame_bytes,
        failByDrop=False,
        perMessageCompressionAccept=acceptDeflate,
    )
    return RelayWebSocketResource(factory, keys, accounts, settings)
