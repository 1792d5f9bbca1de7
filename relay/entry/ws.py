# -*- test-case-name: tests.test_ws, tests.test_frontdoor -*-
"""
The Responses WebSocket entrypoint (C{GET /v1/responses} with an upgrade;
protocol.md 4, behaviour.md group F, style.md 9(a)).

A transport adapter: it authenticates before the upgrade, keeps the
connection's own record of its turns (inputs, output items, last response
id) and its dedicated upstream for C{passthrough}, and hands every client
frame to the front door (L{relay.frontdoor.door.FrontDoor.frame}), which
parses it, has the connection make a C{response.create} a L{Turn} with a
L{WebSocketSink} (L{RelayWebSocketProtocol.turnFor}), checks the key and
hands the turn to the engine. Selection, admission, waiting, failover and
cooldowns all happen in the engine.
"""

from __future__ import annotations

import json
import os

from attrs import define, field
from autobahn.twisted.resource import WebSocketResource
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.exception import PayloadExceededError
from autobahn.util import encode_truncate
from autobahn.websocket.compress import (
    PerMessageDeflateOffer,
    PerMessageDeflateOfferAccept,
)
from twisted.logger import Logger
from twisted.web.server import NOT_DONE_YET

from relay.base.clienterrors import previousResponseNotFound
from relay.entry.keylimits import handshakeHeaders
from relay.entry.annotate import annotateTurn
from relay.entry.http import UNAUTHORIZED, filterClientHeaders
from relay.entry.sinks import errorBody, writeError
from relay.entry.wssink import WebSocketSink, wsErrorEvent
from relay.frontdoor.budgets import parsedEstimate, parsedOver
from relay.frontdoor.door import FrontDoor
from relay.frontdoor.parse import FieldRefused, turnFields
from relay.frontdoor.record import Admission
from relay.base.records import ClientError, Turn
from relay.base.clienterrors import RESTART_CLOSE
from relay.base.requestid import adoptClientId
from relay.scheduling.session import SESSION_HEADERS, sessionHash, sessionSeed

MSG_ID_MESSAGE = "previous_response_id must be a response.id (resp_*), not a message id"
APPEND_MESSAGE = (
    "response.append is not supported in ws v2; use response.create with previous_response_id"
)
TOO_MANY_MESSAGE = "too many requests while retrying, please retry later"
CONNECTION_LIMIT_MESSAGE = (
    "Responses websocket connection limit reached (60 minutes)."
    " Create a new websocket connection to continue."
)
CONNECTION_LIMIT_CLOSE = (1001, "websocket connection limit reached; please reconnect")
"""protocol.md 4.5/4.6: after the status-bearing error event the socket
closes 1001 (going away), not 1000: R81 keeps a plain 1000 for the idle
timeout and a normal end, and 1001 is the R70 family of "please reconnect"
closes that both Codex and the SDK answer with a fresh connection."""
CLIENT_IDLE_CLOSE = (1008, "client websocket idle timeout")
PREEMPTED_CLOSE = (1001, "session preempted by a newer connection")
"""R68 (adopted): the pre-empted connection is told before it is dropped."""
THREAD_HEADERS = ("thread-id", "x-codex-window-id")
"""R-B13: parallel Codex threads sharing a session id do not pre-empt each other."""
"""R69: the passthrough client idle close (other modes close 1000)."""
KEY_REVOKED_CLOSE = (1008, "api key is no longer valid")
"""Issue 14: the connection's key was removed or rotated by a reload; the
connection takes no new turn (a reconnect with the new key works)."""


class _FrameHold:
    """
    The parsed-size estimate of one admitted frame, held in the bytes in
    flight until its turn ends; released once.
    """

    def __init__(self, budget, keyName: str, n: int):
        self._budget, self._key, self._n = budget, keyName, n

    def release(self) -> None:
        n, self._n = self._n, 0
        if n and self._budget is not None:
            self._budget.release(self._key, n)


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


def normaliseInput(value) -> list:
    """
    A frame's C{input} as a list of items (a string is one user message).
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    if isinstance(value, list):
        return list(value)
    return [value]


COMPACTION_TRIGGER = "compaction_trigger"
"""protocol.md 2.8: the input item that asks for a compaction turn."""


def lastCompaction(items: list) -> int:
    """
    The index of the last C{compaction} item of a transcript, or 0.
    """
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if isinstance(item, dict) and item.get("type") == "compaction":
            return index
    return 0


@define(eq=False)
class ConnectionState:
    """
    What one client connection knows about its own conversation
    (R61, R62, R76, R77, R80).

    @ivar items: the complete transcript of this connection's turns (inputs
        and output items, in order), or L{None} when relay does not hold
        the whole conversation (a chain begun before this connection).
    @ivar lastResponseId: the id of the last completed response.
    @ivar accountId: the account of the last completed turn.
    @ivar dedicated: the C{passthrough} upstream connection.
    """

    items: list | None = field(factory=list)
    lastResponseId: str | None = None
    accountId: str | None = None
    dedicated: object = None
    unchecked: tuple = ()
    """R104: the stored-item ids named by prewarms relay answered itself
    (C{http_bridge}, never selected) that the transcript now carries; the
    next chained turn is checked for them too."""

    def expandable(self, previous: str | None) -> bool:
        """
        R62: a chain to this connection's previous response whose history
        is complete.
        """
        return bool(previous) and previous == self.lastResponseId and self.items is not None

    def historyComplete(self, previous: str | None) -> bool:
        """
        R62, R80: a turn without C{previous_response_id} is complete; a
        chained one only when relay can expand it.
        """
        return not previous or self.expandable(previous)

    def expandedBody(self, turn) -> dict | None:
        """
        R61/R66: earlier inputs + earlier outputs + the current input, the
        chain id removed; L{None} when the history is not complete.
        """
        previous = turn.previousResponseId
        if not self.expandable(previous):
            return None
        body = dict(turn.body)
        body.pop("previous_response_id", None)
        body["input"] = list(self.items) + normaliseInput(turn.body.get("input"))
        return body

    def record(self, previous, inputItems: list, response: dict, accountId=None) -> None:
        """
        A turn completed: extend (or restart, or lose) the transcript.

        R89: a C{compaction_trigger} is used once it was sent, so the
        transcript never keeps one (a replayed trigger would no longer be
        the last item, and upstream refuses that); once a C{compaction}
        item arrived, the transcript restarts from it (it stands for
        everything before it).
        """
        outputs = [o for o in (response.get("output") or []) if isinstance(o, dict)]
        inputItems = [i for i in inputItems
                      if not (isinstance(i, dict) and i.get("type") == COMPACTION_TRIGGER)]
        if not previous:
            self.items = list(inputItems) + outputs
        elif self.expandable(previous):
            self.items = list(self.items) + list(inputItems) + outputs
        else:
            self.items = None
        if self.items is not None:
            start = lastCompaction(self.items)
            if start:
                self.items = self.items[start:]
        self.lastResponseId = response.get("id") or self.lastResponseId
        if accountId is not None:
            self.accountId = accountId


def _connectionIds(headers) -> tuple[str, str, str | None]:
    """
    A new connection's ids (issue 15, R111): its own C{ws_<random>} id,
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

    def onConnect(self, request):
        try:
            f = self.factory
            headers = {k.lower(): v for k, v in request.headers.items()}
            # Issue 19 item 7: the upgrade was authenticated once, by the
            # HTTP intake and L{RelayWebSocketResource}; its key is handed
            # over, never parsed again from the headers.
            admission = getattr(self, "admission", None)
            self._key = admission.key if admission is not None else None
            if self._key is None:
                from autobahn.websocket.types import ConnectionDeny

                raise ConnectionDeny(401, "Unauthorized")
            self._headers = filterClientHeaders(headers)
            self._state = ConnectionState()
            self._model = None
            self._session = None
            self._turns = 0
            self._running = None
            self._buffered = None
            self._timer = None
            self._closing = None
            self._gone = False
            self._connId, self._requestId, self._clientRequestId = _connectionIds(headers)
            self._openedAt = f.reactor.seconds()
            self._threadId = next((headers[h] for h in THREAD_HEADERS if headers.get(h)), None)
            self._ownerKey = None
            # Issue 22: who is calling, for the request log.
            self._clientAddress = _peerHost(self.transport)
            self._userAgent = (headers.get("user-agent") or "")[:200] or None
            self.admitting = None  # a large frame's slot wait (FrontDoor.frame)
            self._ending = None
        except Exception:
            self._log.failure("accepting a client websocket failed")
            raise
        answer = {"X-Request-Id": self._requestId}
        if self._key is not None and any(headers.get(h) for h in SESSION_HEADERS):
            return handshakeHeaders(f.runner, self._key, self._withTurnState(headers, answer))
        return handshakeHeaders(f.runner, self._key, (None, answer))  # R114

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

        session = sessionHash(sessionSeed(headers, {}, None), self._key.ownerId)
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
        request id as C{X-Request-Id}, like every HTTP answer (issue 15):
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
        (style: bad input gets a clear error; issue 14's fuzzing found
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
            self._openedAt = f.reactor.seconds()
            connections = getattr(f, "openConnections", None)
            if connections is not None:
                connections.add(self)
            if getattr(f, "draining", False):
                # Issue 14: the upgrade raced the start of a graceful stop.
                self.closeWith(*RESTART_CLOSE)
                return
            self._arm(s.client_first_message_timeout_seconds, 1008, "missing first response.create message")
        except Exception:  # noqa: BLE001
            self._log.failure("opening a client websocket failed")
            self.closeWith(1011, "upstream websocket proxy failed")

    def onClose(self, wasClean, code, reason) -> None:
        if getattr(self, "_state", None) is None:
            return
        self._gone = True
        # Issue 19: what the connection still held leaves the bytes in flight.
        held, self._bufferedHold = self._bufferedHold, 0
        self._giveBackBytes(self._releaseAssembled() + held)
        self._disarm()
        connections = getattr(self.factory, "openConnections", None)
        if connections is not None:
            connections.discard(self)
        owners = getattr(self.factory, "sessionOwners", None)
        if owners is not None and self._ownerKey is not None and owners.get(self._ownerKey) is self:
            del owners[self._ownerKey]
        turn = self._running
        if turn is not None:
            turn.cancel.cancel("client_gone")
        admitting = getattr(self, "admitting", None)
        if admitting is not None:
            admitting.cancel("client_gone")
        dedicated = self._state.dedicated
        if dedicated is not None:
            self._state.dedicated = None
            if not dedicated.busy:
                dedicated.broken = True
                dedicated.proto.close()
            # else the running turn's attempt closes it when it ends, after
            # reading its usage (behaviour.md R107).
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
            turns=self._turns,
            account_id=self._state.accountId,
            mode=self._modeName(),
            while_running=turn is not None,
        )
        metrics = getattr(getattr(self.factory, "runner", None), "metrics", None)
        if metrics is not None:
            try:
                metrics.wsClose(closeCode)
            except Exception:  # noqa: BLE001
                self._log.failure("counting a websocket close failed")

    def _modeName(self):
        try:
            return self._modeFor(self._model)
        except Exception:  # noqa: BLE001
            return None

    def drain(self) -> None:
        """
        Issue 14: relay is stopping. An idle connection closes 1001 "server
        restarting" now (Codex reconnects); a busy one when its turn ends
        (L{_turnDone}).
        """
        if self._running is None:
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
                # Issue 19 item 2: a permessage-deflate bomb.
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

    # -- frames in flight (issue 19 item 2) ----------------------------------------

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
        if budget is None or settings is None or getattr(self, "_key", None) is None:
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
        Issue 19 item 2: a compressed message inflates to at most
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
        process's bytes in flight while the message is assembled (issue 19
        item 2), like an HTTP body while it arrives; over a bound the
        connection is refused (L{_refuseFrame}) and nothing more of the
        message is kept.
        """
        if self._closing is not None or getattr(self, "_gone", False):
            return
        budget, limits = self._budgetAndLimits()
        if budget is not None and payload:
            error = budget.reserve(
                self._key.name, len(payload), limits.body_bytes_in_flight_per_key,
                limits.body_bytes_in_flight,
            )
            if error is not None:
                self._refuseFrame(error)
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
            budget.release(self._key.name, n)

    def _refuseFrame(self, error: ClientError) -> None:
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
        running = getattr(self, "_running", None)
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
            if self._running is not None:
                # R63: one early frame is held; a second one is too many.
                if self._buffered is None:
                    self._buffered = payload
                    self._bufferedHold = assembled  # still held (issue 19)
                    return
                self._giveBackBytes(assembled)
                self.closeWith(1013, TOO_MANY_MESSAGE)
                self._running.cancel.cancel("too_many_frames")
                return
            # The frame's own hold is given back; a large one is held again
            # as its parsed-size estimate while it waits (L{holdFrame}).
            self._giveBackBytes(assembled)
            self._disarm()
            self.factory.door.frame(self, payload)  # to the engine (relay.frontdoor)
        except Exception:  # noqa: BLE001
            self._log.failure("handling a client websocket frame failed")
            self.closeWith(1011, "upstream websocket proxy failed")

    # -- for the front door (relay.frontdoor.door.FrontDoor.frame) --------------

    @property
    def key(self):
        """
        The connection's L{relay.base.records.ClientKey} (the one in force since
        its last turn).
        """
        return self._key

    def nextRequestId(self) -> str:
        """
        The request id of the connection's next turn.
        """
        return f"{self._requestId}:{self._turns + 1}"

    def gone(self) -> bool:
        """
        Whether the connection is closing or closed.
        """
        return self._gone or self._closing is not None

    def holdFrame(self, payload: bytes):
        """
        Hold a large frame's parsed-size estimate within the key's and the
        process's bytes in flight while its key's slot is awaited (R103),
        like an HTTP body's; refuse the frame (L{_refuseFrame}) when it
        does not fit.

        @return: the hold (C{release()}), or L{None} when refused.
        """
        f = self.factory
        estimate = parsedEstimate(payload)
        budget, limits = getattr(f, "budget", None), f.settings.current.limits
        if budget is not None:
            error = None
            if parsedOver(estimate, limits) is not None:
                error = ClientError(
                    400, "invalid_request_error",
                    "frame too large once parsed (gateway.limits.body_bytes_in_flight)",
                    code="frame_too_large",
                )
            if error is None:
                error = budget.reserve(
                    self._key.name, estimate, limits.body_bytes_in_flight_per_key,
                    limits.body_bytes_in_flight,
                )
            if error is not None:
                self._refuseFrame(error)
                return None
        return _FrameHold(budget, self._key.name, estimate if budget is not None else 0)

    def slotRefused(self, failure) -> None:
        """
        A large frame's key slot was refused (R32): the engine's close.
        """
        error = getattr(failure.value, "error", None)
        if error is None or error.wsClose is None:
            self._log.failure("admitting a websocket frame failed", failure)
            self.closeWith(1011, "failed to acquire user concurrency slot")
            return
        self.closeWith(*error.wsClose)

    def admissionPing(self) -> None:
        """
        R85 while a frame waits for the key's slot: a ping frame at the
        turn's pace (the engine calls this, L{TurnRunner.keySlot}).
        """
        if not self._gone and self._closing is None and self.isOpen():
            self.sendPing()

    def badJSON(self, nested: bool) -> None:
        """
        A frame that is not JSON (R47): the status-bearing error and close.
        """
        if nested:
            self.reject("invalid JSON payload: nested too deeply", "invalid_json")
            return
        self.reject("invalid JSON payload", "invalid_json")

    def turnFor(self, frame, door):
        """
        The turn a parsed frame asks for, with its sink, or L{None} when
        the frame was answered here (C{response.processed}, a refusal, a
        prewarm answered locally). Its fields are checked as an HTTP
        body's (L{relay.frontdoor.parse.turnFields}).

        @param door: the L{relay.frontdoor.door.FrontDoor} (a prewarm's
            key refusal, R102).
        @return: C{(turn, sink)} or L{None}.
        """
        if not isinstance(frame, dict):
            self.reject("invalid JSON payload", "invalid_json")
            return None
        kind = frame.get("type") or "response.create"
        if kind == "response.processed":
            self._idle()
            return None
        if kind == "response.append":
            self.reject(APPEND_MESSAGE, "unsupported_request_type", "type")
            return None
        if kind != "response.create":
            self.reject(f"unsupported websocket request type: {kind}", "unsupported_request_type", "type")
            return None
        if getattr(self.factory, "draining", False):
            # Issue 14: no new turn while relay stops; reconnect elsewhere.
            self.closeWith(*RESTART_CLOSE)
            return None
        key = self.factory.keys.current(self._key)
        if key is None:
            self._log.info(
                "client websocket {conn_id}: its key was removed or rotated",
                event="ingress_ws_key_revoked",
                conn_id=self._connId,
                client=self._key.name,
            )
            # R81: information without a status, then the close.
            revoked = ClientError(
                401, "invalid_request_error", UNAUTHORIZED.message, code="invalid_api_key"
            )
            self.sendText(json.dumps(wsErrorEvent(revoked, withStatus=False)).encode())
            self.closeWith(*KEY_REVOKED_CLOSE)
            return None
        self._key = key
        if self._overAge():
            return None
        try:
            fields = turnFields(frame, "responses", self._model)
        except FieldRefused as e:
            if e.kind == "missing":
                self.reject(
                    "model is required in first response.create payload",
                    "missing_required_parameter",
                    "model",
                )
            elif e.kind == "empty":
                # Never forwarded as an empty chain id (issue 14's fuzzing).
                self.reject("invalid JSON payload", "invalid_value", e.param,
                            message=e.error.message)
            else:
                # R47's close reason; the event's message is HTTP's 400.
                self.reject("invalid JSON payload", "invalid_type", e.param,
                            message=e.error.message)
            return None
        model, previous = fields.model, fields.previous
        if previous and previous.startswith("msg_"):
            self.reject(MSG_ID_MESSAGE, "invalid_value", "previous_response_id")
            return None
        self._model = model
        return self._newTurn(frame, model, previous or None, door)

    def _modeFor(self, model) -> str:
        """
        The connection's mode for this turn (R48): the current account's
        when it serves the model, else the one mode every serving account
        shares, else the gateway default. The engine's attempt still uses
        each account's own mode.
        """
        f = self.factory
        default = f.settings.current.websocket.mode_default
        accounts = _reachable(f, self._key)
        byId = {a.id: a for a in accounts}
        current = byId.get(self._state.accountId)
        if current is not None and current.servesModel(model):
            return current.ws_mode or default
        modes = {a.ws_mode or default for a in accounts if a.servesModel(model)}
        modes.discard("off")
        if len(modes) == 1:
            return modes.pop()
        return default if default != "off" else "ctx_pool"

    def _newTurn(self, frame: dict, model: str, previous: str | None, door):
        """
        See L{turnFor}: the L{Turn} of a checked C{response.create}.
        """
        state = self._state
        mode = self._modeFor(model)
        inputItems = normaliseInput(frame.get("input"))
        body = dict(frame)
        body.pop("type", None)
        body["model"] = model
        for name in ("stream", "previous_response_id"):
            if body.get(name, False) is None:
                body.pop(name)  # null is absent; never forwarded (issue 14's fuzzing)
        if self._session is None:
            self._session = sessionHash(sessionSeed(self._headers, body, model),
                                        self._key.ownerId)
            self._claimSession(body)
        phase = "first_turn" if self._turns == 0 else "later_turn"
        turn = Turn(
            entrypoint="ws",
            endpoint="responses",
            client=self._key,
            model=model,
            body=body,
            stream=True,
            headers=dict(self._headers),
            sessionHash=self._session,
            previousResponseId=previous,
            historyComplete=state.historyComplete(previous),
            wsMode=mode,
            requestId=f"{self._requestId}:{self._turns + 1}",
            clientRequestId=getattr(self, "_clientRequestId", None),
            phase=phase,
            preferredAccountId=state.accountId,
            wsContext=state,
            clientAddress=getattr(self, "_clientAddress", None),
            userAgent=getattr(self, "_userAgent", None),
        )
        annotateTurn(turn)  # R89, R90 (relay.entry.annotate)
        if previous and state.unchecked:
            turn.itemReferences += state.unchecked  # R104: a local prewarm's items
        body = turn.body
        if mode == "http_bridge":
            if frame.get("generate") is False:
                # Issue 22 (R102): a prewarm answered locally is refused
                # exactly like a turn would be.
                error = door.refusal(turn)
                if error is not None:
                    WebSocketSink(self).fail(error)
                    return None
                self._prewarm(turn, previous, inputItems)
                return None
            if previous:
                expanded = state.expandedBody(turn)
                if expanded is None:
                    # R77: never send a fragment as the whole conversation.
                    error = previousResponseNotFound(previous)
                    self.sendText(json.dumps(wsErrorEvent(error)).encode())
                    self.closeWith(*error.wsClose)
                    return None
                body = expanded
            body.pop("generate", None)
            body.pop("previous_response_id", None)
            body["stream"] = True
            turn.body = body
            turn.previousResponseId = None
            turn.historyComplete = True
        sink = WebSocketSink(self)
        self._running = turn

        def onResponse(responseId, account):
            state.accountId = account.id

        turn.onResponseId = onResponse
        self._ending = (previous, inputItems)
        return turn, sink

    def turnStarted(self, d, turn, sink, frame) -> None:
        """
        The front door handed the frame's turn to the engine: C{d} fires
        when it ends (L{_turnDone}).
        """
        previous, inputItems = self._ending
        self._ending = None
        d.addCallback(self._turnDone, turn, sink, previous, inputItems)
        d.addErrback(lambda fail: self._log.failure("websocket turn failed", fail))

    def _prewarm(self, turn, previous, inputItems) -> None:
        """
        R53 in C{http_bridge}: answer C{generate:false} locally, record its
        input, take no slot.
        """
        rid = "resp_" + os.urandom(12).hex()
        response = {
            "id": rid,
            "object": "response",
            "created_at": int(self.factory.reactor.seconds()),
            "status": "in_progress",
            "model": turn.model,
            "output": [],
        }
        self.sendText(json.dumps({"type": "response.created", "sequence_number": 0, "response": response}).encode())
        done = dict(response, status="completed", usage={"input_tokens": 0, "output_tokens": 0, "total_tokens": 0})
        self.sendText(json.dumps({"type": "response.completed", "sequence_number": 1, "response": done}).encode())
        self._state.record(previous, inputItems, done)
        self._state.unchecked = (self._state.unchecked if previous else ()) + turn.itemReferences
        self._turns += 1
        self._log.info(
            "answered a prewarm locally with {response_id}",
            event="ingress_ws_http_bridge_prewarm",
            response_id=rid,
            conn_id=self._connId,
            request_id=turn.requestId,
        )
        self._next()

    def _turnDone(self, outcome, turn, sink, previous, inputItems) -> None:
        self._running = None
        self._turns += 1
        if sink.terminalType == b"response.completed" and sink.terminal is not None:
            self._state.record(previous, inputItems, sink.terminal)
            self._state.unchecked = ()  # R104: checked by this turn's selection
        if self._gone or self._closing is not None:
            return
        if sink.closed:
            return
        if getattr(self.factory, "draining", False):
            self.closeWith(*RESTART_CLOSE)
            return
        self._next()

    def _next(self) -> None:
        if self._buffered is not None:
            payload, self._buffered = self._buffered, None
            held, self._bufferedHold = self._bufferedHold, 0
            self._giveBackBytes(held)
            self._disarm()
            self.factory.door.frame(self, payload)
            return
        self._idle()

    def _idle(self) -> None:
        s = self.factory.settings.current.websocket
        if self._modeName() == "passthrough":
            self._arm(s.inter_turn_idle_timeout_seconds, *CLIENT_IDLE_CLOSE)
            return
        self._arm(s.inter_turn_idle_timeout_seconds, 1000, "websocket idle timeout")

    def _claimSession(self, body: dict) -> None:
        """
        R68, R-B13: become the owner of (API key, session hash, thread id)
        and pre-empt an older connection holding the same key on an OAuth
        account. Only an explicit session (a session header or
        C{prompt_cache_key}) counts: a content-derived seed would let two
        unrelated clients that open with the same text cancel each other.
        In-process only (one relay); the owner is dropped when it closes.
        """
        explicit = any(self._headers.get(h) for h in SESSION_HEADERS) or body.get("prompt_cache_key")
        if not self._session or not explicit:
            return
        owners = self.factory.__dict__.setdefault("sessionOwners", {})  # unit-test factories
        key = (self._key.ownerId, self._session, self._threadId)
        older = owners.get(key)
        owners[key] = self
        self._ownerKey = key
        if older is None or older is self or not older.isOpen():
            return
        byId = {a.id: a for a in self.factory.accounts}
        account = byId.get(older._state.accountId)
        if account is None or account.type != "oauth":
            return
        older.preempt(self._connId)

    def preempt(self, by: str) -> None:
        """
        R68: a newer connection owns this session. Cancel the running turn
        (a cancelled turn writes nothing to account state, R2), say so
        with close 1001, and drop.
        """
        self._log.info(
            "client websocket {conn_id} pre-empted by {new_conn_id}",
            event="ingress_ws_session_preempted",
            conn_id=self._connId,
            request_id=self._requestId,
            new_conn_id=by,
            account_id=self._state.accountId,
            while_running=self._running is not None,
        )
        if self._running is not None:
            self._running.cancel.cancel("session_preempted")
        self.closeWith(*PREEMPTED_CLOSE)

    def _overAge(self) -> bool:
        """
        protocol.md 4.5/4.6: a connection older than
        C{client_max_age_seconds} (by the injected clock) answers
        C{response.create} with C{websocket_connection_limit_reached}
        (status 400) and closes, so the client reconnects with full input.
        """
        limit = self.factory.settings.current.websocket.client_max_age_seconds
        age = self.factory.reactor.seconds() - self._openedAt
        if not limit or age < limit:
            return False
        event = {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_connection_limit_reached",
                "message": CONNECTION_LIMIT_MESSAGE,
            },
        }
        self._log.info(
            "client websocket {conn_id} reached its age limit ({age:.0f}s)",
            event="ingress_ws_connection_limit_reached",
            conn_id=self._connId,
            request_id=self._requestId,
            age=age,
            limit=limit,
            turns=self._turns,
        )
        self.sendText(json.dumps(event).encode())
        self.closeWith(*CONNECTION_LIMIT_CLOSE)
        return True


def _peerHost(transport):
    """
    @return: the client's IP address, or L{None} when the transport cannot say.
    """
    try:
        return getattr(transport.getPeer(), "host", None)
    except Exception:  # noqa: BLE001 - a test transport, a closed socket
        return None


def _reachable(factory, key) -> list:
    """
    Issue 22: the accounts C{key} may reach (its account group), for the
    connection's mode choice; every account without a key policy.
    """
    policy = getattr(getattr(factory, "runner", None), "keyPolicy", None)
    if policy is None or key is None:
        return list(factory.accounts)
    return policy.reachable(key, factory.accounts)


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
        if all((a.ws_mode or default) == "off" for a in _reachable(self.factory, key)):
            writeError(
                request,
                ClientError(
                    426, "invalid_request_error",
                    "WebSocket mode is disabled; use HTTP POST /v1/responses",
                ),
            )
            return NOT_DONE_YET
        # Issue 19 item 7: the protocol takes this key (authenticated once).
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
    factory.accounts = accounts  # the live registry (issue 14), never a copy
    factory.settings = settings
    factory.sessionOwners = {}  # R68: (key, session hash, thread id) -> connection
    factory.openConnections = set()  # issue 14: what a graceful stop closes
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
