# -*- test-case-name: tests.test_site, tests.test_requestside -*-
"""
The HTTP transport under every route: relay answers in OpenAI's error
format even where twisted.web would answer on its own (fuzzed
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
fails loudly. The one-pass header read
(L{RelayHTTPChannel._relayHead}) sets twisted.web's private parser state
(C{__first_line}, C{_command}, the request's raw headers, the
C{Content-Length} decoder); C{tests.test_headblock} compares its answers
with twisted.web's own on a table of edge inputs.
"""

from __future__ import annotations

from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.protocols.basic import LineReceiver
from twisted.protocols.policies import ProtocolWrapper
from twisted.web.http import (
    HTTPChannel,
    _GenericHTTPChannelProtocol,
    _IdentityTransferDecoder,
    datetimeToString,
)
from twisted.web.iweb import INonQueuedRequestFactory
from twisted.web.resource import UnsupportedMethod
from twisted.web.server import NOT_DONE_YET, Site

from relay.entry.body import _Headers, reasonPhrase
from relay.entry.headblock import readHead
from relay.entry.intake import TOO_MANY_CONNECTIONS
from relay.entry.logthrottle import LogThrottle, suppressedNote, throttleOf
from relay.entry.sinks import errorBody, writeError
from relay.base.records import ClientError
from relay.base.requestid import newRequestId, requestIdOf  # noqa: F401
from relay.wire.sendnow import sendNow

BAD_REQUEST = ClientError(
    400, "invalid_request_error", "The HTTP request could not be parsed.",
    code="malformed_http_request",
)
"""The answer to HTTP twisted.web cannot parse."""


HEADER_TIMEOUT = ClientError(
    408, "invalid_request_error", "The request headers did not arrive in time.",
    code="request_timeout",
)


HEADER_TOO_LARGE = ClientError(
    431, "invalid_request_error",
    "A request header line or the header block is too large (the limit is 16384 bytes).",
    code="request_header_fields_too_large",
)
"""A header line over twisted.web's line limit, or a header block over its
total (both 16 KiB)."""

TOO_MANY_HEADERS = ClientError(
    431, "invalid_request_error",
    "The request has too many header lines (the limit is 500).",
    code="request_header_fields_too_large",
)
"""More header lines than twisted.web's C{maxHeaders} (500)."""

URI_TOO_LONG = ClientError(
    414, "invalid_request_error",
    "The request line is too long (the limit is 16384 bytes).", code="request_uri_too_long",
)
"""A request line over twisted.web's line limit."""

OVER_CAP_ALLOWANCE = 8
"""How many connections over C{gateway.limits.max_connections} /
C{max_connections_per_address} are still accepted, counted on their own,
to answer C{/healthz} and C{/readyz} (a liveness probe sharing an address
with a flood must not fail): any other request on one is the JSON 503
C{too_many_connections}. When all are taken, the oldest one whose headers
are not in yet is closed with that 503 to make room."""


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
    request's id like every other answer.

    The whole header block of each request must arrive
    within C{gateway.limits.header_timeout_seconds} of its first byte (of
    the connection opening, for the first request); a client that drips
    header bytes (each byte resets twisted.web's idle timeout) gets a 408
    and the connection closes, logged as C{relay.intake_header_timeout}.
    """

    _headerCall = None
    _awaitingHeaders = True
    _relayClosed = False
    _relayHeaderBlocks = 0
    relayBodyIn = None
    """The request whose whole body is in the read being handled (see
    L{relay.entry.body.LimitedBodyRequest._armRate}), else L{None}."""
    relayOverCap = None
    """The C{(limit name, value)} this connection is over when it is one of
    the L{OVER_CAP_ALLOWANCE} (health routes only), else L{None}."""
    _relayLog = Logger()
    relayPlainRequests = True
    """A request of this channel may set twisted.web's request attributes
    itself (L{relay.entry.body.LimitedBodyRequest.__init__}): the channel
    has its site (L{Site.buildProtocol}) and the addresses of L{getPeer}
    and L{getHost}."""
    relayReadHead = True
    """Whether a plain header block is read in one pass (L{_relayHead});
    L{False}: twisted.web reads every line (C{tests.test_headblock} compares
    the two)."""

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
        if self.transport is None or self._relayClosed:
            return
        self._relayClosed = True
        peer = self.transport.getPeer()
        suppressed = self._throttled("relay.intake_header_timeout")
        if suppressed is not None:
            self._relayLog.warn(
                "request headers from {client} not complete within {seconds} s: closing"
                + suppressedNote(suppressed, "more closed"),
                event="relay.intake_header_timeout", client=getattr(peer, "host", "-"),
                seconds=self._headerTimeout(), suppressed=suppressed,
            )
        _rawAnswer(self.transport, HEADER_TIMEOUT, newRequestId())
        self.loseConnection()

    def _throttled(self, key):
        """
        The site's L{LogThrottle} verdict for a line of C{key}: L{None} to
        drop it, else the count of dropped ones it stands for (C{0} with no
        throttle).
        """
        throttle = throttleOf(getattr(self, "site", None))
        return throttle.admit(key) if throttle is not None else 0

    def lineReceived(self, line):
        """
        A header block over twisted.web's C{totalHeadersSize}: 431 (see
        L{lineLengthExceeded}) instead of twisted.web's bare 400.
        """
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._tooLarge(len(line))
            return None
        return super().lineReceived(line)

    def headerReceived(self, line):
        """
        One header line more than twisted.web's C{maxHeaders}: 431 in
        OpenAI's format, as for a header block over its total size, instead
        of twisted.web's 400 (RFC 6585: too many fields is a 431 too).
        """
        if self._receivedHeaderCount >= self.maxHeaders:
            self._tooLarge(len(line), TOO_MANY_HEADERS)
            return False
        return super().headerReceived(line)

    def lineLengthExceeded(self, line) -> None:
        """
        A request line or a header line over twisted.web's C{MAX_LENGTH}
        (16 KiB): twisted's L{LineReceiver} only drops the connection (the
        client reads an empty reply); relay answers 414 (the request line)
        or 431 (a header) in OpenAI's format with C{X-Request-Id}, and
        closes, logged as C{relay.intake_header_too_large} (throttled).
        """
        self._tooLarge(len(line))

    def _tooLarge(self, size: int, error: ClientError | None = None) -> None:
        if self._relayClosed or self.transport is None:
            return
        self._relayClosed = True
        self._disarmHeaders()
        requestLine = bool(self._HTTPChannel__first_line)
        if error is None:
            error = URI_TOO_LONG if requestLine else HEADER_TOO_LARGE
        request = self.requests[-1] if self.requests and not requestLine else None
        pending = self._HTTPChannel__header
        name, _, value = pending.partition(b":")
        if request is not None and name.strip().lower() == b"x-request-id":
            # twisted.web holds the last header line until the next one (a
            # continuation may follow): it counts for the request's id. Only
            # that header is taken from it (any other name may be no valid
            # header name at all: the fuzz's ";").
            self._HTTPChannel__header = b""
            request.requestHeaders.addRawHeader(b"x-request-id", value.strip())
        requestId = requestIdOf(request) if request is not None else newRequestId()
        peer = self.transport.getPeer()
        suppressed = self._throttled("relay.intake_header_too_large")
        if suppressed is not None:
            self._relayLog.warn(
                "{what} from {client} over {limit} {unit}: {status}, closing"
                + suppressedNote(suppressed, "more refused"),
                event="relay.intake_header_too_large", client=getattr(peer, "host", "-"),
                what="request line" if requestLine else (
                    "request headers" if error is TOO_MANY_HEADERS else "request header"),
                limit=self.maxHeaders if error is TOO_MANY_HEADERS else self.MAX_LENGTH,
                unit="lines" if error is TOO_MANY_HEADERS else "bytes",
                status=error.status, size=size,
                suppressed=suppressed, request_id=requestId,
            )
        _rawAnswer(self.transport, error, requestId)
        self.loseConnection()

    def checkPersistence(self, request, version):
        """
        A connection of the over-cap allowance answers one request and
        closes (it must not be held open to keep the probe out).
        """
        if self.relayOverCap is not None:
            request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
            return False
        return super().checkPersistence(request, version)

    def relayIdle(self) -> bool:
        """
        Whether the connection is open and no request's headers have come
        in on it yet.
        """
        transport = self.transport
        return not (
            self._relayClosed or transport is None or getattr(transport, "disconnecting", False)
            or self._relayHeaderBlocks
        )

    def relayEvict(self) -> None:
        """
        Close an over-cap connection whose headers are not in, with the
        JSON 503 C{too_many_connections} (to make room in the allowance).
        """
        if self._relayClosed or self.transport is None:
            return
        self._relayClosed = True
        self._disarmHeaders()
        _rawAnswer(self.transport, TOO_MANY_CONNECTIONS, newRequestId())
        self.loseConnection()

    _relayAddresses = None
    _relayFactoryKind = None

    def _addresses(self) -> tuple:
        """
        The connection's C{(transport, peer, host)} addresses, asked of the
        transport once per transport (twisted.web's C{Request}
        asks for both on every request, and a TCP transport builds a new
        address object each time, the host one with a C{getsockname}).
        """
        transport = self.transport
        addresses = self._relayAddresses
        if addresses is None or addresses[0] is not transport:
            addresses = self._relayAddresses = (
                transport, transport.getPeer(), transport.getHost()
            )
        return addresses

    def getPeer(self):
        return self._addresses()[1]

    def getHost(self):
        return self._addresses()[2]

    def connectionMade(self) -> None:
        super().connectionMade()
        self._awaitingHeaders = True
        self._armHeaders()

    def dataReceived(self, data: bytes) -> None:
        if self._relayClosed:
            return
        if (
            self.relayReadHead and self._buffer == b"" and self.line_mode
            and not self._busyReceiving
            and self._HTTPChannel__first_line == 1 and self.persistent
            and not self._handlingRequest and not self.paused
            and self._relayHead(data)
        ):
            return
        if self._awaitingHeaders and self._headerCall is None:
            self._armHeaders()
        super().dataReceived(data)

    def _relayHead(self, data: bytes) -> bool:
        """
        Read a request's whole header block at once when it is
        in C{data} and plain (see L{relay.entry.headblock}), doing what
        twisted.web's line-by-line parser would do with it; then hand the
        blank line and the rest to twisted.web (body, pipelining and every
        later check as before).

        @return: whether C{data} was taken; L{False} leaves nothing changed
            (twisted.web reads it).
        """
        head = readHead(data)
        if head is None:
            return False
        command, path, version, fields, length, size, blank = head
        self.resetTimeout()
        factory = self.requestFactory
        kind = self._relayFactoryKind
        if kind is None or kind[0] is not factory:
            # asked once per connection (and factory), not per request
            kind = self._relayFactoryKind = (factory, INonQueuedRequestFactory.providedBy(factory))
        if kind[1]:
            request = factory(self)
        else:
            request = factory(self, len(self.requests))
        self.requests.append(request)
        self._HTTPChannel__first_line = 0
        self._command, self._path, self._version = command, path, version
        raw = request.requestHeaders._rawHeaders
        for name, value in fields:
            values = raw.get(name)
            if values is None:
                raw[name] = [value]
            else:
                values.append(value)
        self._receivedHeaderCount = len(fields)
        self._receivedHeaderSize = size
        if length is not None:
            self.length = length
            self._transferDecoder = _IdentityTransferDecoder(
                length, request.handleContentChunk, self._finishRequestBody
            )
        if length and len(data) - blank - 2 >= length:
            self.relayBodyIn = request  # LimitedBodyRequest._armRate
        # What LineReceiver.dataReceived(data[blank:]) does, without its
        # line split: the blank line (twisted.web's lineReceived at the end
        # of a block), then the rest to the body's decoder (its
        # rawDataReceived), then LineReceiver's loop for anything left.
        self._busyReceiving = True
        self._buffer = data[blank + 2:]
        more = False
        try:
            if self._HTTPChannel__header or self._receivedHeaderSize > self.totalHeadersSize:
                self.lineReceived(b"")  # twisted.web's own (and relay's 431)
            else:
                self.allHeadersReceived()
                if self.length == 0:
                    self.allContentReceived()
                else:
                    self.line_mode = 0  # setRawMode
            transport = self.transport
            if not (transport and transport.disconnecting):
                more = True
                rest = self._buffer
                if (
                    rest and not self.paused and not self.line_mode
                    and not self._handlingRequest and self._transferDecoder is not None
                ):
                    self._buffer = b""
                    self._transferDecoder.dataReceived(rest)
        finally:
            self._busyReceiving = False
            self.relayBodyIn = None
        if more and self._buffer and not self.paused:
            LineReceiver.dataReceived(self, b"")
        late = getattr(request, "relayArmLate", None)
        if late is not None:
            late()
        return True

    def allHeadersReceived(self) -> None:
        """
        The header block is in: twisted.web's
        C{HTTPChannel.allHeadersReceived} (Twisted 26), the headers it reads
        looked up in the request's raw header map (canonical names, as
        L{Headers} keeps them): cookies parsed only when a C{Cookie} came,
        L{checkPersistence} asked only when the connection is in the
        over-cap allowance, the request is not HTTP/1.1 or it sent
        C{Connection} (else it is persistent), C{Expect} read once.
        C{tests.test_headblock} compares the answers with twisted.web's.
        """
        self._awaitingHeaders = False
        self._relayHeaderBlocks += 1
        if self._headerCall is not None:
            self._disarmHeaders()
        request = self.requests[-1]
        raw = request.requestHeaders._rawHeaders
        if b"Cookie" in raw:
            request.parseCookies()
        version = self._version
        if self.relayOverCap is None and version == b"HTTP/1.1" and b"Connection" not in raw:
            self.persistent = True
        else:
            self.persistent = self.checkPersistence(request, version)
        request.gotLength(self.length)
        expect = raw.get(b"Expect")
        if expect and expect[0].lower() == b"100-continue" and self._version == b"HTTP/1.1":
            self._send100Continue()

    # -- the idle timeout while a request is handled ----------------------------
    #
    # twisted.web stops its idle timeout (TimeoutMixin) when a request's body
    # is in and starts a new one when the answer is done: a reactor call
    # cancelled and another scheduled per request. Here the call is parked
    # instead: the timeout reads as off (timeOut None, so data does not
    # reset it) and the call, if it comes meanwhile, does nothing; at the
    # end of the request twisted.web's setTimeout resets it to the full
    # timeout from then, as a new call would be. A request that upgrades
    # (WebSocket: the transport is taken over and the channel never learns
    # of its end) has its call cancelled as twisted.web does.

    _relayParkIdle = False
    _relayIdleParked = False

    def allContentReceived(self) -> None:
        if self.timeOut and b"Upgrade" not in self.requests[-1].requestHeaders._rawHeaders:
            self._relayParkIdle = True
        try:
            super().allContentReceived()
        finally:
            self._relayParkIdle = False  # only ever its own setTimeout(None)

    def setTimeout(self, period):
        """
        TimeoutMixin's, but the stop at a request's start parks the call
        (see above).
        """
        if self._relayParkIdle:
            self._relayParkIdle = False
            if period is None and self._TimeoutMixin__timeoutCall is not None:
                self._relayIdleParked = True
                previous, self.timeOut = self.timeOut, None
                return previous
        self._relayIdleParked = False
        return super().setTimeout(period)

    def timeoutConnection(self) -> None:
        if self._relayIdleParked:
            return  # a parked idle timeout: twisted.web's would be stopped
        super().timeoutConnection()

    def requestDone(self, request) -> None:
        self._awaitingHeaders = True
        super().requestDone(request)

    def connectionLost(self, reason) -> None:
        self._disarmHeaders()
        super().connectionLost(reason)

    # -- an answer's head and body in one write ----------------------------------
    #
    # With a remote store (Redis state, admission or control store, or an
    # operator's component) the answer is queued as twisted.web queues it
    # (sent at the next poll), never sent at once: a response's owner record
    # (R39/R40/R104), the slot releases and the other store writes issued
    # before the answer leave at the end of the reactor iteration, and must
    # reach the store before the client can read the body and chain from it
    # (TurnRunner.ownResponse). With every store in this process
    # (RelaySite.answerAtOnce) those writes are done before the answer is
    # written, so its first write (the head and what came with it: a whole
    # JSON answer, a stream's first event) is sent at once
    # (relay.wire.sendnow.sendNow): no wait for the next poll, no epoll
    # registration. A stream's later events are queued, so the events of one
    # reactor iteration share one send.

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
        Answer data, after any held head (one C{write}). The write that
        carries the head is sent at once when L{_atOnce}; the later ones (a
        stream's events) are queued as twisted.web queues them, so the
        events written in one reactor iteration leave in one C{send}
        instead of one system call each.
        """
        head = self._head
        if head is None:
            self.transport.write(data)
            return
        self._head = None
        data = head + data
        if self._atOnce:
            sendNow(self.transport, data)
        else:
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
        if self._head is not None:
            self.write(b"")

    @property
    def _atOnce(self) -> bool:
        """
        Whether this connection's answers may be sent at once: the site's
        L{RelaySite.answerAtOnce}.
        """
        return getattr(getattr(self, "site", None), "answerAtOnce", False)

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


_NO_BODY_CODES = (204, 304)
"""twisted.web's C{NO_BODY_CODES} (and C{server.Request.write}'s codes
without a default C{Content-Type})."""


def writeFirst(request, data: bytes) -> bool:
    """
    An answer's first write on a L{RelayHTTPChannel}, in one call: what
    twisted.web's C{server.Request.write} and C{http.Request.write}
    (Twisted 26) do for it (a default C{Content-Type}, C{Transfer-Encoding:
    chunked} without a C{Content-Length}, the head from the response
    headers in their order, C{data} as the first chunk when chunked) and
    L{RelayHTTPChannel.holdHead}/C{writeHeaders}/C{sendHead} (the head and
    C{data} in one write), with the header reads done on the raw header
    map. Only for the plain case: a request whose response headers are
    relay's (L{relay.entry.body._Headers}), not finished or disconnected,
    no C{HEAD}, no 204/304, no encoder, fake C{HEAD}, C{Last-Modified},
    C{ETag} or cookies; anything else returns L{False} with nothing done
    (the caller writes as twisted.web does). C{tests.test_requestside}
    compares the bytes of both.

    @param request: a L{relay.entry.body.LimitedBodyRequest} that has not
        started writing.
    @return: whether the write was done.
    """
    headers = request.responseHeaders
    channel = request.channel
    if (
        headers.__class__ is not _Headers or channel._head is not None
        or request.finished or request._disconnected
        or request._inFakeHead or request._encoder or request.method == b"HEAD"
        or request.code in _NO_BODY_CODES or request.lastModified is not None
        or request.etag is not None or request.cookies
    ):
        return False
    raw = headers._rawHeaders
    length = raw.get(b"Content-Length")
    if (
        not raw.get(b"Content-Type") and request.defaultContentType is not None
        and not (length and length[0] == b"0")
    ):
        headers.setRawHeaders(b"Content-Type", [request.defaultContentType])
    request.startedWriting = 1
    version = request.clientproto
    if version == b"HTTP/1.1" and not length:
        headers.setRawHeaders("Transfer-Encoding", [b"chunked"])
        request.chunked = 1
    head = [version, b" ", b"%d" % (request.code,), b" ", request.code_message, b"\r\n"]
    for name, values in raw.items():
        for value in values:
            head.extend((name, b": ", value, b"\r\n"))
    head.append(b"\r\n")
    request.sentLength = request.sentLength + len(data)
    if data and request.chunked:
        data = b"%x\r\n%b\r\n" % (len(data), data)
    data = b"".join(head) + data
    # RelayHTTPChannel.write of a held head
    if getattr(getattr(channel, "site", None), "answerAtOnce", False):
        sendNow(channel.transport, data)
    else:
        channel.transport.write(data)
    return True


class _Counted(ProtocolWrapper):
    """
    One open client connection, counted by L{RelaySite} until it closes
    (also after a WebSocket upgrade took the transport: autobahn replaces
    the protocol this wrapper wraps, not the wrapper).
    """

    relayOverCap = None
    """The cap this connection is over (the site's over-cap allowance), or
    L{None}."""

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
    C{max_connections_per_address}. A connection over
    either cap is still accepted into a separate allowance of
    L{OVER_CAP_ALLOWANCE} connections (counted on their own, under the
    header deadline, one request each) that answers only C{/healthz} and
    C{/readyz}, so a flood from a probe's address does not fail the probe;
    any other request on it, and a connection when the allowance is full of
    connections already past their headers, gets a JSON 503
    (C{too_many_connections}, C{Retry-After: 1}) and is closed, logged as
    C{relay.intake_connection_refused}.

    @ivar openConnections: open client connections now (the allowance's
        not included).
    @ivar openByAddress: client IP -> open connections (likewise).
    @ivar overCap: the open connections of the allowance (an ordered dict
        of their L{_Counted} wrappers, oldest first).
    @ivar logThrottle: the L{LogThrottle} of every intake refusal line
        (connections refused, header deadline, slow bodies, headers too
        large): one line per kind per second.
    @ivar answerAtOnce: send answers at once (L{relay.wire.sendnow.sendNow})
        instead of at the next poll: only when every store a turn writes
        before its answer is in this process
        (L{relay.process.app.answersAtOnce}), so nothing the client may read next can
        still be on its way to a remote store (R39/R40/R104).
    """

    limits = None
    answerAtOnce = False
    _relayLog = Logger()
    clock = None
    _dateSecond = None
    _date = b""

    def httpDate(self) -> bytes:
        """
        The C{Date} header of an answer now: twisted.web's
        C{datetimeToString} of the second the site's C{clock} is in,
        formatted once per second; twisted.web's own (of the wall clock)
        when the site has no clock.
        """
        clock = self.clock
        if clock is None:
            return datetimeToString()
        second = int(clock.seconds())
        if second != self._dateSecond:
            self._date = datetimeToString(second)
            self._dateSecond = second
        return self._date

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.openConnections = 0
        self.openByAddress = {}
        self.overCap = {}
        self.logThrottle = LogThrottle(self.reactor)

    def buildProtocol(self, addr):
        """
        Build a connection's protocol: counted, in the over-cap allowance,
        or a refusal.
        """
        host = getattr(addr, "host", None)
        limits = self.limits() if self.limits is not None else None
        cap = None
        if limits is not None and host is not None:
            total, mine = self.openConnections, self.openByAddress.get(host, 0)
            if limits.max_connections and total >= limits.max_connections:
                cap = ("max_connections", limits.max_connections)
            elif limits.max_connections_per_address and mine >= limits.max_connections_per_address:
                cap = ("max_connections_per_address", limits.max_connections_per_address)
            if cap is not None and not self._roomOverCap():
                self._noteRefusal(host, cap)
                return _Refusal(TOO_MANY_CONNECTIONS)
        inner = super().buildProtocol(addr)
        if host is None:
            return inner
        wrapper = _Counted(self, inner, host)
        if cap is not None:
            wrapper.relayOverCap = cap
            getattr(inner, "_channel", inner).relayOverCap = cap
        return wrapper

    def _roomOverCap(self) -> bool:
        """
        Whether the over-cap allowance takes one more connection, making
        room when it is full by closing its oldest connection whose headers
        are not in yet (L{RelayHTTPChannel.relayEvict}): a probe sends its
        request at once, a connection held open to fill the allowance does
        not.
        """
        if len(self.overCap) < OVER_CAP_ALLOWANCE:
            return True
        for wrapper in self.overCap:
            channel = getattr(wrapper.wrappedProtocol, "_channel", None)
            if channel is not None and channel.relayIdle():
                del self.overCap[wrapper]
                self._noteRefusal(wrapper.relayHost, wrapper.relayOverCap)
                channel.relayEvict()
                return True
        return False

    def refuseOverCap(self, host: str, cap: tuple) -> None:
        """
        A request other than C{/healthz} / C{/readyz} on a connection of the
        over-cap allowance (L{relay.entry.body}: answered 503): log it as a
        refused connection.
        """
        self._noteRefusal(host, cap)

    def _noteRefusal(self, host: str, cap: tuple) -> None:
        """
        Log a refused connection: at most one C{relay.intake_connection_refused}
        line per cap per second of the site's reactor (L{logThrottle}), so a
        flood of connections is not a flood of log lines; a line counts the
        refusals of that cap left unlogged since the one before
        (C{suppressed}).

        @param host: the client's IP.
        @param cap: C{(limit name, its value)}.
        """
        suppressed = self.logThrottle.admit(("relay.intake_connection_refused", cap[0]))
        if suppressed is None:
            return
        self._relayLog.warn(
            "connection from {client} refused: gateway.limits.{cap} ({limit}) reached"
            + suppressedNote(suppressed, "more refused"),
            event="relay.intake_connection_refused", client=host, cap=cap[0],
            limit=cap[1], suppressed=suppressed,
        )

    def registerProtocol(self, proto) -> None:
        """
        L{ProtocolWrapper} hook: a counted connection opened.
        """
        if proto.relayOverCap is not None:
            self.overCap[proto] = None
            return
        self.openConnections += 1
        self.openByAddress[proto.relayHost] = self.openByAddress.get(proto.relayHost, 0) + 1

    def unregisterProtocol(self, proto) -> None:
        """
        L{ProtocolWrapper} hook: a counted connection closed.
        """
        if proto.relayOverCap is not None:
            self.overCap.pop(proto, None)
            return
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
