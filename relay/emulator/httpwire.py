# -*- test-case-name: tests.test_emulator -*-
"""
Request and connection helpers of the emulator's HTTP routes
(L{relay.emulator.http}) and its WebSocket (L{relay.emulator.ws}): the
bearer token, headers, the peer, upgrades, connection breaks, the
C{x-codex-turn-state} token and the stream-break faults; and L{Route},
what the resource's route families (chat, OAuth and login, control) hold.
"""

from __future__ import annotations

import secrets
from typing import Any

from relay.emulator.state import Fault


def bearer(value: str | None) -> str | None:
    """
    Extract the token from an C{Authorization} header value.

    @param value: the header value, or L{None}.
    @type value: L{str} or L{None}
    @return: the token, or L{None}.
    @rtype: L{str} or L{None}
    """
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def lowerHeaders(request: Any) -> dict:
    """
    The request headers as a dict with lower-cased names (repeated headers joined by C{, }).

    @param request: a twisted.web request.
    @return: name to value.
    @rtype: L{dict}
    """
    out = {}
    for name, values in request.requestHeaders.getAllRawHeaders():
        out[name.decode("latin-1").lower()] = ", ".join(v.decode("latin-1") for v in values)
    return out


def peerHost(address: Any) -> str | None:
    """
    The host part of a peer address.

    @param address: an C{IAddress}.
    @return: the host, or a string form for addresses without one.
    @rtype: L{str} or L{None}
    """
    if address is None:
        return None
    host = getattr(address, "host", None)
    return host if host is not None else str(address)


def isUpgrade(request: Any) -> bool:
    """
    Whether a request asks for a WebSocket upgrade.

    @param request: a twisted.web request.
    @rtype: L{bool}
    """
    upgrade = (request.getHeader(b"upgrade") or b"").lower()
    connection = (request.getHeader(b"connection") or b"").lower()
    return upgrade == b"websocket" and b"upgrade" in connection


def abortConnection(request: Any) -> None:
    """
    Abort the TCP (or TLS) connection under a request at once.

    @param request: a twisted.web request.
    """
    transport = request.channel.transport if request.channel is not None else None
    if transport is None:
        return
    abort = getattr(transport, "abortConnection", None)
    if abort is not None:
        abort()
    else:  # pragma: no cover - every stream transport we listen on has it
        transport.loseConnection()


def dropConnection(request: Any) -> None:
    """
    Close the connection under a request after flushing what was written (no terminal
    chunk), so the client sees a truncated body.

    @param request: a twisted.web request.
    """
    transport = request.channel.transport if request.channel is not None else None
    if transport is not None:
        transport.loseConnection()


def turnStateFor(request: Any) -> str:
    """
    The C{x-codex-turn-state} the OAuth route answers with: the client's own (Codex replays it
    within a turn), else a fresh token.

    @param request: a twisted.web request, or autobahn's C{ConnectionRequest}.
    """
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        given = headers.get("x-codex-turn-state")
    else:
        raw = request.getHeader(b"x-codex-turn-state")
        given = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    return given or "ts_" + secrets.token_hex(12)


def breakAfter(fault: Fault | None) -> tuple[int | None, bool]:
    """
    Where a C{cut_after_events} or C{end_after_events} fault breaks a stream off.

    @param fault: the turn's fault, if any.
    @type fault: L{Fault} or L{None}
    @return: C{(events, clean)}: how many events are sent first (L{None}: no break) and
        whether the break is a clean end (C{end_after_events}) rather than a lost
        connection (C{cut_after_events}).
    @rtype: L{tuple}
    """
    if fault is None or fault.kind not in ("cut_after_events", "end_after_events"):
        return None, False
    return fault.get("events"), fault.kind == "end_after_events"


def streamErrorBody(fault: Fault) -> dict:
    """
    The error envelope of a C{stream_error} fault: the body of the HTTP 500 a non-stream
    request gets, and the Chat Completions error chunk.

    @param fault: the C{stream_error} fault.
    @type fault: L{Fault}
    @return: C{{"error": {"message", "type": "server_error", "code", "param"}}}.
    @rtype: L{dict}
    """
    return {"error": {
        "message": fault.get("message", "The emulator injected a stream error."),
        "type": "server_error", "code": fault.get("code", "server_error"), "param": None}}


class Route:
    """
    A family of routes of L{relay.emulator.http.EmulatorResource} (chat,
    OAuth and login, control), held by the resource, which dispatches to it.

    @ivar emulator: the owning emulator.
    """

    def __init__(self, resource) -> None:
        """
        @param resource: the emulator's leaf resource
            (L{relay.emulator.http.EmulatorResource}), whose answer helpers
            (C{_json}, C{_parseBody}, C{_credential}, C{_record}, ...) the
            routes use.
        """
        self._resource = resource
        self.emulator = resource.emulator

    @property
    def _state(self):
        """
        The emulator state.

        @rtype: L{relay.emulator.state.EmulatorState}
        """
        return self.emulator.state
