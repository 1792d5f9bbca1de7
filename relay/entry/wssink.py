# -*- test-case-name: tests.test_ws -*-
"""
The WebSocket sink: what the turn engine writes for a C{response.create}
turn becomes JSON text frames on the client socket (protocol.md 4.3, 4.5).
Transport adapter only; no policy (architecture.md invariant 1).

Error rule (behaviour.md R81, protocol.md 4.5): a status-bearing C{error}
event only for C{previous_response_not_found},
C{websocket_connection_limit_reached} and genuine client mistakes;
conditions the client should retry end with the error's close code and
reason (1013 busy, 1011 upstream failure). A key's own limit
(C{ClientError.wsInband}, R113) is a status-bearing event and the socket
stays open: a limit with a reset time in the shape Codex renders with its
time (L{keyLimitEvent}).
"""

from __future__ import annotations

import json

from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import ITurnSink
from relay.base.records import PROMO_HEADER, ClientError, promoText
from relay.translate.assemble import ResponseAssembler

_ITEM_DONE = b"response.output_item.done"

STATUS_EVENT_CODES = frozenset(
    {"previous_response_not_found", "websocket_connection_limit_reached", "frame_too_large"}
)
"""Codes that reach the client as a status-bearing error event (R81; R91's
oversized frame, which then closes 1009)."""

RETRY_STATUSES = frozenset({401, 403, 408, 429})
"""4xx statuses that are not client mistakes: they end with a close."""

DEFAULT_CLOSE = (1011, "upstream websocket proxy failed")


def wsErrorEvent(error: ClientError, withStatus: bool = True) -> dict:
    """
    The WebSocket error wrapper (protocol.md 4.5).
    """
    event = {
        "type": "error",
        "error": {
            "type": error.type,
            "code": error.code,
            "message": error.message,
            "param": error.param,
        },
    }
    if withStatus:
        event["status"] = error.status
    return event


def keyLimitEvent(error: ClientError) -> dict:
    """
    R113: the in-band C{error} event of a key's own limit. A limit with a
    reset time (a spent budget, an C{rpm}/C{tpm} window) takes the shape
    Codex renders with that time, as for a plan's usage limit (protocol.md
    4.5, 7.3; L{ClientError.usageLimitFields}): status 429, C{error.type}
    C{usage_limit_reached} (Codex's one fatal 429: no reconnect),
    C{error.code} relay's own (C{insufficient_quota},
    C{rate_limit_exceeded}), C{resets_at} (Unix seconds) and
    C{resets_in_seconds}, and relay's message in the C{headers} Codex reads
    (L{PROMO_HEADER}, with the HTTP answer's C{Retry-After} and
    C{x-ratelimit-*}). Without a reset time it is the plain status event.

    @param error: a L{ClientError} with C{wsInband} set.
    @return: the event, a JSON-ready dict.
    """
    event = wsErrorEvent(error)
    if error.resetsAt is None:
        return event
    event["error"].update(error.usageLimitFields())
    headers = {name.lower(): value for name, value in error.headers}
    headers[PROMO_HEADER] = promoText(error.message)
    event["headers"] = headers
    return event


def isStatusEvent(error: ClientError) -> bool:
    """
    R81: whether C{error} is told to the client as a status-bearing event.
    """
    if error.code in STATUS_EVENT_CODES:
        return True
    return 400 <= error.status < 500 and error.status not in RETRY_STATUSES and (
        error.wsClose is None or error.wsClose[0] == 1008 and error.status == 400
    )


@implementer(ITurnSink)
class WebSocketSink:
    """
    Writes one turn to a client connection.

    @ivar terminal: the terminal event's parsed C{response}, once written;
        its C{output} rebuilt from the C{response.output_item.done} events
        when the upstream sent C{output: []} (the ChatGPT backend does), so
        the connection's transcript keeps the turn's items.
    @ivar committed: output reached the client.
    """

    _log = Logger()

    def __init__(self, connection):
        """
        @param connection: the client protocol; needs C{sendText(bytes)},
            C{sendPing()}, C{closeWith(code, reason)} and C{isOpen()}.
        """
        self._conn = connection
        self._onWrite = None
        self.committed = False
        self.terminal: dict | None = None
        self.terminalType: bytes | None = None
        self.closed = False
        self.failed: ClientError | None = None
        self._assembler = ResponseAssembler()

    def watchWrites(self, callback) -> None:
        """
        Call C{callback()} after every event frame sent, so a
        L{relay.engine.keepalive.StreamKeepalive} pings only after real
        silence (behaviour.md R85).

        @param callback: a no-argument callable, or L{None} to stop.
        """
        self._onWrite = callback

    def keepalive(self) -> None:
        """
        A ping frame while the turn is quiet: during waits (R31) and while
        the upstream is silent before or after its first output (R85). A
        control frame goes between whole messages, never inside one.
        """
        if self._conn.isOpen():
            self._conn.sendPing()

    def commit(self, headers) -> None:
        self.committed = True

    def writeEvent(self, event) -> None:
        if event.type == b"[DONE]":
            return
        if event.type == _ITEM_DONE:
            self._assembler.add(event.json())
        elif event.terminal:
            self.terminalType = event.type
            response = event.json().get("response")
            self.terminal = self._assembler.complete(response) if isinstance(response, dict) else {}
        if self._conn.isOpen():
            self._conn.sendText(event.data)
            if self._onWrite is not None:
                self._onWrite()

    def writeBody(self, status, headers, body) -> None:
        """
        A non-streaming upstream answer on the WebSocket (rare): wrap it as
        C{response.completed}.
        """
        try:
            response = json.loads(body)
        except ValueError:
            response = {}
        self.committed = True
        self.terminal = response if isinstance(response, dict) else {}
        self.terminalType = b"response.completed"
        if self._conn.isOpen():
            self._conn.sendText(
                json.dumps({"type": "response.completed", "response": self.terminal}).encode()
            )

    def fail(self, error: ClientError) -> None:
        """
        Before output: a status event (R81 cases) and/or the error's close.
        After output: the close tells Codex to retry (protocol.md 4.6). A
        key's own limit before output (R113) is told in-band
        (L{keyLimitEvent}) and the socket stays open.
        """
        self.failed = error
        if not self._conn.isOpen():
            return
        if not self.committed and error.wsInband:
            self._conn.sendText(json.dumps(keyLimitEvent(error)).encode())
            return
        if not self.committed and isStatusEvent(error):
            self._conn.sendText(json.dumps(wsErrorEvent(error)).encode())
            if error.wsClose is not None:
                self.closed = True
                self._conn.closeWith(*error.wsClose)
            return
        code, reason = error.wsClose or DEFAULT_CLOSE
        self.closed = True
        self._conn.closeWith(code, reason)

    def finish(self) -> None:
        """
        A turn ended; the connection reads its next frame.
        """
