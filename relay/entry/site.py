# -*- test-case-name: tests.test_site -*-
"""
The HTTP transport under every route: relay answers in OpenAI's error
format even where twisted.web would answer on its own (issue 14's fuzzed
inputs found both):

  - a request line or header block twisted.web cannot parse (an unknown
    HTTP version, a malformed header, a bad C{Content-Length} or chunk,
    headers above twisted's limits): twisted.web writes a bare
    C{400 Bad Request} with no body and drops the connection;
    L{RelayHTTPChannel} writes a JSON 400 envelope first;
  - a method a resource has no C{render_*} for: twisted.web answers an
    HTML 405 page, or an HTML C{501 Huh?} for a method it does not know;
    L{JSONMethodErrors} answers a JSON 405 with C{Allow}.

Both hook twisted.web where it offers no public seam:
C{HTTPChannel._respondToBadRequestAndDisconnect} and the
C{_GenericHTTPChannelProtocol} wrapper L{RelaySite.protocol} builds
(Twisted 26); C{tests.test_site} pins them so an upgrade that moves them
fails loudly.
"""

from __future__ import annotations

from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol
from twisted.web.resource import UnsupportedMethod
from twisted.web.server import NOT_DONE_YET, Site

from relay.entry.body import reasonPhrase
from relay.entry.sinks import errorBody, writeError
from relay.model import ClientError
from relay.requestid import newRequestId, requestIdOf  # noqa: F401

BAD_REQUEST = ClientError(
    400, "invalid_request_error", "The HTTP request could not be parsed.",
    code="malformed_http_request",
)
"""The answer to HTTP twisted.web cannot parse."""


HEADER_TIMEOUT = ClientError(
    408, "invalid_request_error", "The request headers did not arrive in time.",
    code="request_timeout",
)

TOO_MANY_CONNECTIONS = ClientError(
    503, "api_error", "Too many open connections, please retry later.",
    code="too_many_connections", headers=(("Retry-After", "1"),),
)


def _rawAnswer(transport, error: ClientError, requestId: str) -> None:
    """
    Write a complete JSON answer with C{Connection: close} straight to a
    transport (no request object exists yet).
    """
    body = errorBody(error, requestId)
    extra = b"".join(
        name.encode("latin-1") + b": " + str(value).encode("latin-1") + b"\r\n"
        for name, value in (error.headers or ())
    )
    transport.write(
        b"HTTP/1.1 %d " % error.status + reasonPhrase(error.status)
        + b"\r\nContent-Type: application/json\r\nX-Request-Id: " + requestId.encode("ascii")
        + b"\r\n" + extra + b"Content-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + body
    )


class RelayHTTPChannel(HTTPChannel):
    """
    An L{HTTPChannel} whose answer to unparseable HTTP is OpenAI's error
    envelope (still a 400 and still the end of the connection), with the
    request's id like every other answer (issue 15).

    Issue 19 item 4: the whole header block of each request must arrive
    within C{gateway.limits.header_timeout_seconds} of its first byte (of
    the connection opening, for the first request); a client that drips
    header bytes (each byte resets twisted.web's idle timeout) gets a 408
    and the connection closes, logged as C{relay.intake_header_timeout}.
    """

    _headerCall = None
    _awaitingHeaders = True
    _relayLog = Logger()

    def _headerTimeout(self) -> float:
        limits = getattr(self.site, "limits", None)
        return limits().header_timeout_seconds if limits is not None else 0

    def _armHeaders(self) -> None:
        seconds = self._headerTimeout()
        if seconds and self._headerCall is None:
            self._headerCall = self.callLater(seconds, self._headersLate)

    def _disarmHeaders(self) -> None:
        if self._headerCall is not None and self._headerCall.active():
            self._headerCall.cancel()
        self._headerCall = None

    def _headersLate(self) -> None:
        self._headerCall = None
        if self.transport is None:
            return
        peer = self.transport.getPeer()
        self._relayLog.warn(
            "request headers from {client} not complete within {seconds} s: closing",
            event="relay.intake_header_timeout", client=getattr(peer, "host", "-"),
            seconds=self._headerTimeout(),
        )
        _rawAnswer(self.transport, HEADER_TIMEOUT, newRequestId())
        self.loseConnection()

    def connectionMade(self) -> None:
        super().connectionMade()
        self._awaitingHeaders = True
        self._armHeaders()

    def dataReceived(self, data: bytes) -> None:
        if self._awaitingHeaders and self._headerCall is None:
            self._armHeaders()
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        self._awaitingHeaders = False
        self._disarmHeaders()
        super().allHeadersReceived()

    def requestDone(self, request) -> None:
        self._awaitingHeaders = True
        super().requestDone(request)

    def connectionLost(self, reason) -> None:
        self._disarmHeaders()
        super().connectionLost(reason)

    # -- issue 24: an answer's head and body in one write -----------------------
    #
    # Queued as twisted.web queues them (sent at the next poll), never sent
    # at once: a response's owner record (R39/R40) and other store writes
    # issued before the answer leave at the end of the reactor iteration,
    # and must reach the store before the client can read the body and
    # chain from it (TurnRunner.ownResponse).

    _holdHead = False
    _head = None

    def writeHeaders(self, version, code, reason, headers) -> None:
        """
        While the answer's first C{Request.write} runs (L{holdHead}), keep
        the head to send with the body that follows; else as twisted.web.
        """
        if not self._holdHead:
            return super().writeHeaders(version, code, reason, headers)
        head = [version, b" ", code, b" ", reason, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                head.extend((name, b": ", value, b"\r\n"))
        head.append(b"\r\n")
        self._head = b"".join(head)

    def write(self, data: bytes) -> None:
        """
        Answer data, after any held head (one C{write}).
        """
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        self.transport.write(data)

    def writeSequence(self, iovec) -> None:
        self.write(b"".join(iovec))

    def holdHead(self) -> None:
        """
        The first write of an answer starts: hold its head (see
        L{writeHeaders}) until L{sendHead}.
        """
        self._holdHead = True

    def sendHead(self) -> None:
        """
        The first write of an answer is done: send a head no body took.
        """
        self._holdHead = False
        head = self._head
        if head is not None:
            self._head = None
            self.transport.write(head)

    def _respondToBadRequestAndDisconnect(self) -> None:
        """
        Write a JSON 400 with a length, C{X-Request-Id} and C{Connection:
        close}, then drop the connection (twisted.web's own writes only the
        status line). The id is the one of the request being read
        (L{requestIdOf}: the client's if the headers parsed so far carry a
        well-formed one), or a new one when the request line itself is what
        failed.
        """
        request = self.requests[-1] if self.requests else None
        requestId = requestIdOf(request) if request is not None else newRequestId()
        body = errorBody(BAD_REQUEST, requestId)
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\n"
            b"Content-Type: application/json\r\n"
            b"X-Request-Id: " + requestId.encode("ascii") + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n"
            b"Connection: close\r\n\r\n" + body
        )
        self.loseConnection()


class _Counted(ProtocolWrapper):
    """
    One open client connection, counted by L{RelaySite} until it closes
    (also after a WebSocket upgrade took the transport: autobahn replaces
    the protocol this wrapper wraps, not the wrapper).
    """

    def __init__(self, counter, wrapped, host: str):
        super().__init__(counter, wrapped)
        self.relayHost = host


class _Refusal(Protocol):
    """
    The protocol of a connection over a cap: a JSON 503 and close.
    """

    def __init__(self, error):
        self._error = error

    def connectionMade(self):
        _rawAnswer(self.transport, self._error, newRequestId())
        self.transport.loseConnection()


class RelaySite(Site):
    """
    The relay's L{Site}: its connections are L{RelayHTTPChannel}s, counted
    against C{gateway.limits.max_connections} and
    C{max_connections_per_address} (issue 19 item 4): a connection over
    either cap gets a JSON 503 (C{too_many_connections}, C{Retry-After: 1})
    and is closed at once, logged as C{relay.intake_connection_refused}.

    @ivar openConnections: open client connections now.
    @ivar openByAddress: client IP -> open connections.
    """

    limits = None
    _relayLog = Logger()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.openConnections = 0
        self.openByAddress = {}

    def buildProtocol(self, addr):
        """
        Build a connection's protocol, or a refusal over a cap.
        """
        host = getattr(addr, "host", None)
        limits = self.limits() if self.limits is not None else None
        if limits is not None and host is not None:
            total, mine = self.openConnections, self.openByAddress.get(host, 0)
            cap = None
            if limits.max_connections and total >= limits.max_connections:
                cap = ("max_connections", limits.max_connections)
            elif limits.max_connections_per_address and mine >= limits.max_connections_per_address:
                cap = ("max_connections_per_address", limits.max_connections_per_address)
            if cap is not None:
                self._relayLog.warn(
                    "connection from {client} refused: gateway.limits.{cap} ({limit}) reached",
                    event="relay.intake_connection_refused", client=host, cap=cap[0],
                    limit=cap[1],
                )
                return _Refusal(TOO_MANY_CONNECTIONS)
        inner = super().buildProtocol(addr)
        if host is None:
            return inner
        return _Counted(self, inner, host)

    def registerProtocol(self, proto) -> None:
        """
        L{ProtocolWrapper} hook: a counted connection opened.
        """
        self.openConnections += 1
        self.openByAddress[proto.relayHost] = self.openByAddress.get(proto.relayHost, 0) + 1

    def unregisterProtocol(self, proto) -> None:
        """
        L{ProtocolWrapper} hook: a counted connection closed.
        """
        self.openConnections = max(0, self.openConnections - 1)
        left = self.openByAddress.get(proto.relayHost, 0) - 1
        if left > 0:
            self.openByAddress[proto.relayHost] = left
        else:
            self.openByAddress.pop(proto.relayHost, None)

    def protocol(self):
        """
        Build one connection's protocol (L{Site.buildProtocol} calls this
        with no arguments, as twisted.web's own factory function is).
        """
        return _GenericHTTPChannelProtocol(RelayHTTPChannel())


class JSONMethodErrors:
    """
    Wraps the resource a request renders: a method the resource does not
    handle is a JSON 405 with C{Allow} (OpenAI's envelope, code
    C{method_not_allowed}) instead of twisted.web's HTML 405 or 501. A
    C{HEAD} on a C{GET} resource still goes to twisted.web, which fakes it.
    """

    def __init__(self, resource):
        """
        @param resource: the L{IResource} found for the request.
        """
        self._resource = resource

    def render(self, request):
        """
        Render the wrapped resource, answering an unsupported method.
        """
        try:
            return self._resource.render(request)
        except UnsupportedMethod as e:
            allowed = list(e.allowedMethods or ())
            if request.method == b"HEAD" and b"GET" in allowed:
                raise
            if allowed:
                request.setHeader(b"allow", b", ".join(allowed))
            method = request.method.decode("latin-1")
            path = request.path.decode("latin-1")
            writeError(request, ClientError(
                405, "invalid_request_error", f"Method {method} is not allowed on {path}",
                code="method_not_allowed",
            ))
            return NOT_DONE_YET
