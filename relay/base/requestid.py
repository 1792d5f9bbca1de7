# -*- test-case-name: tests.test_requestid -*-
"""
One request id per turn, everywhere; relay's own, always
(behaviour.md R111).

Each HTTP request gets its id as soon as twisted.web has parsed it
(L{requestIdOf}, called from C{relay.process.app}'s request class), so every
answer -- a relayed turn, relay's own errors, 401, 404, 405, 426, the
admission 429/503s, SSE and JSON -- carries it as C{X-Request-Id}, and
error bodies repeat it as C{error.request_id}. Answers written before
that, below the resources, call L{requestIdOf} themselves: the 413 for an
oversize body (C{relay.entry.body}) and the 400 for unparseable HTTP
(C{relay.entry.site}). The turn engine logs it as C{request_id} on every
line of the turn; the upstream's own C{x-request-id} is logged as
C{upstream_request_id} and returned as C{X-Upstream-Request-Id}.

The id is always relay's own (L{newRequestId}, C{req_<process
prefix><sequence>}), unique per HTTP request, whatever the client sends
(R111): clients choose their ids freely (Codex sends its thread id on
every request of a thread), so a client's id never identifies one
request. The client's id (L{clientRequestIdOf}: C{X-Request-Id}, else
C{X-Client-Request-Id}; at most 128 characters of C{[A-Za-z0-9._:-]}) is
kept beside it as C{client_request_id}: logged on the turn's lines, stored
in the request log (searchable as C{/admin/requests?client_request_id=}),
shown on the status page, and sent upstream as C{X-Client-Request-Id}
(relay's id when the client sent none).

WebSocket connections: the C{101} carries the connection's id
(C{ws_<random>}, relay's own) and turn C{n} on the connection is
C{<connection id>:<n>}, so a search for the connection's id finds every
turn of the connection while each turn still has an id of its own, and a
reconnect gets new ids whatever the client sends; the client's id from
the upgrade is each turn's C{client_request_id}.

Inside a turn the id is also the value of L{currentRequestId}, a context
variable set by L{bindRequestId} at the start of the turn's coroutine
(Twisted runs each coroutine started with C{Deferred.fromCoroutine} in a
copy of the context it was started from), so the log observers of
L{relay.base.logs} can stamp C{request_id} on lines written by code that does
not know the turn (health, the scheduler, admission waits). Code that
logs from a reactor callback outside the coroutine passes C{request_id}
explicitly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextvars import ContextVar, Token, copy_context
from itertools import count

from relay.base.requestnotes import notesOf

__all__ = [
    "CLIENT_REQUEST_ID_HEADER",
    "MAX_LENGTH",
    "REQUEST_ID_HEADER",
    "UPSTREAM_REQUEST_ID_HEADER",
    "adoptClientId",
    "bindRequestId",
    "clientRequestIdOf",
    "currentRequestId",
    "newRequestId",
    "requestIdOf",
    "wellFormed",
    "withRequestId",
]

REQUEST_ID_HEADER = "x-request-id"
"""The header a client may send its id in, and relay answers with."""

CLIENT_REQUEST_ID_HEADER = "x-client-request-id"
"""The other header a client may send its id in (OpenAI's name; Codex sends
its thread id in it); relay sends the client's id upstream in it (relay's
when the client sent none)."""

UPSTREAM_REQUEST_ID_HEADER = "x-upstream-request-id"
"""The header carrying the upstream's own C{x-request-id} to the client."""

MAX_LENGTH = 128
"""The longest client id relay adopts."""

_WELL_FORMED = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_LENGTH}}}\Z")

currentRequestId: ContextVar[str | None] = ContextVar("relay_request_id", default=None)
"""The id of the turn whose coroutine is running, or L{None} outside one."""

_ids = count(1)
_prefix = os.urandom(3).hex()


def wellFormed(value) -> str | None:
    """
    @param value: a header value (C{str} or C{bytes}) or L{None}.
    @return: C{value} as text when it is 1 to L{MAX_LENGTH} characters of
        C{[A-Za-z0-9._:-]}, else L{None} (so it is safe in a log line, a
        header and a grep pattern).
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip()
    return value if _WELL_FORMED.match(value) else None


def adoptClientId(getHeader: Callable[[str], object]) -> str | None:
    """
    The client's own request id, if it sent a well-formed one.

    @param getHeader: returns a header's value (C{str}, C{bytes} or
        L{None}) by lower-case name.
    @return: C{X-Request-Id} if well-formed, else C{X-Client-Request-Id}
        if well-formed, else L{None}.
    """
    for name in (REQUEST_ID_HEADER, CLIENT_REQUEST_ID_HEADER):
        adopted = wellFormed(getHeader(name))
        if adopted is not None:
            return adopted
    return None


def newRequestId(prefix: str = "req_") -> str:
    """
    A relay request id: C{<prefix><process prefix><sequence in hex>},
    unique within the process and unlikely to repeat across processes.

    @param prefix: e.g. C{req_} (HTTP) or C{ws_} (a WebSocket connection).
    """
    return f"{prefix}{_prefix}{next(_ids):x}"


def requestIdOf(request) -> str:
    """
    The id of a twisted.web request: relay's own (L{newRequestId}, R111),
    chosen once. The first call also sets the C{X-Request-Id} response
    header, so whatever answers the request carries it.

    @param request: an L{twisted.web.iweb.IRequest}.
    @return: the id.
    """
    notes = getattr(request, "notes", None)  # notesOf's, without its call for relay's own
    if notes is None:
        notes = notesOf(request)
    requestId = notes.requestId
    if requestId is None:
        requestId = notes.requestId = f"req_{_prefix}{next(_ids):x}"  # newRequestId()
        request.setHeader(b"x-request-id", requestId.encode("ascii"))
    return requestId


def clientRequestIdOf(request) -> str | None:
    """
    The id the client sent with a twisted.web request (R111's
    C{client_request_id}), read once: L{adoptClientId} of its headers.

    @param request: an L{twisted.web.iweb.IRequest}.
    @return: the client's well-formed id, or L{None}.
    """
    notes = getattr(request, "notes", None)
    if notes is None:
        notes = notesOf(request)
    if notes.clientRequestIdRead:
        return notes.clientRequestId
    raw = _rawHeadersOf(request)
    if raw is not None and _RAW_REQUEST_ID not in raw and _RAW_CLIENT_REQUEST_ID not in raw:
        # Neither header was sent (what adoptClientId would read as None
        # twice), told by two lookups.
        found = None
    else:
        found = adoptClientId(_textHeader(request))
    notes.clientRequestId, notes.clientRequestIdRead = found, True
    return found


_RAW_REQUEST_ID = b"X-Request-Id"
_RAW_CLIENT_REQUEST_ID = b"X-Client-Request-Id"
"""The two id headers' names as twisted.web's L{Headers} keeps them
(canonical capitalisation)."""


def _rawHeadersOf(request):
    """
    The raw header map (canonical name -> values) of a request whose class
    says C{getHeader} reads it (C{relayRawHeaders}: twisted.web's own
    C{getHeader} over its L{twisted.web.http_headers.Headers},
    L{relay.entry.body.LimitedBodyRequest}), else L{None} (the request is
    read through C{getHeader}).
    """
    if getattr(type(request), "relayRawHeaders", False):
        return request.requestHeaders._rawHeaders
    return None


def _textHeader(request) -> Callable[[str], object]:
    """
    A request's header values as text, as C{request.getHeader(str)} gives
    them (UTF-8), except that a value that is no UTF-8 reads as L{None}
    (twisted.web's C{getHeader(str)} raises, which dropped the connection
    with no answer) so the request has no client id.
    """

    def getHeader(name: str):
        value = request.getHeader(name.encode("ascii"))
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                return None
        return value

    return getHeader


def bindRequestId(requestId: str | None) -> Token:
    """
    Make C{requestId} the current turn's id in this context (call it at
    the start of the turn's coroutine; the copy of the context that Twisted
    runs the coroutine in keeps it to that coroutine).

    @return: the L{Token} to reset it with.
    """
    return currentRequestId.set(requestId or None)


def withRequestId(requestId: str | None, f: Callable, *args, **kwargs):
    """
    Call C{f(*args, **kwargs)} with C{requestId} as the current turn's id,
    in a copy of the current context: for the turn's work done from a
    reactor callback outside its coroutine (a stream ending), so what it
    logs (e.g. health's account state) still carries the id.

    @return: what C{f} returns.
    """

    def call():
        currentRequestId.set(requestId or None)
        return f(*args, **kwargs)

    return copy_context().run(call)
