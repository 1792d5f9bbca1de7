# -*- test-case-name: tests.test_httpclient -*-
"""
A lean HTTP/1.1 client for direct upstreams (no egress proxy): one
L{httptools} response parser under a Twisted L{Protocol} per keep-alive
connection, and a per-host pool of idle connections.

Why not treq: a relayed request spent about a third of relay's CPU in
treq's and twisted.web's client layers (cookie and content-decoder agents,
URI parsing, the pool's and the protocol's state machines, a line-based
parser, L{twisted.web.http_headers.Headers} both ways). This client keeps
their observable behaviour and nothing else:

  - the same endpoints (L{HostnameEndpoint}, TLS through the same
    L{BrowserLikePolicyForHTTPS} policy), so connect errors and timeouts
    are the same exceptions;
  - the same failure shapes: a connection lost before the response head is
    L{ResponseNeverReceived} wrapping the reason; a body cut before its end
    is L{ResponseFailed} wrapping the reason and L{_DataLoss}; a clean end
    is L{ResponseDone}, a body delimited by the connection's close
    L{PotentialDataLoss} (behaviour.md R1, R23 tell these apart);
  - C{Accept-Encoding: gzip} with transparent decoding (what treq did);
  - no cookies, no redirects, no automatic retry (architecture.md
    invariant 3): a request on a pooled connection that the upstream had
    just closed fails, as it did with C{retryAutomatically} off.

Accounts behind an egress proxy keep the treq path (L{relay.upstream.http}).
"""

from __future__ import annotations

import zlib
from urllib.parse import urlsplit

import httptools
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.web._newclient import ResponseFailed, ResponseNeverReceived
from twisted.web.client import PotentialDataLoss, ResponseDone
from twisted.web.http import _DataLoss
from zope.interface import implementer

from relay.interfaces import IUpstreamResponse
from relay.wire.sendnow import sendNow

IDLE_TIMEOUT_SECONDS = 240.0
"""An idle pooled connection older than this is closed instead of reused
(twisted.web's C{HTTPConnectionPool.cachedConnectionTimeout})."""


_CLOSED = Failure(ConnectionDone())

_DONE = Failure(ResponseDone("Response body fully received"))
"""How every complete body ends (one shared Failure: building one per
response walked its exception's class hierarchy each time)."""


class HeaderTimeout(Exception):
    """
    Upstream accepted the connection but sent no response headers in time
    (behaviour.md R1: a response-header timeout is a transport failure).
    """


def _timeoutFail(t):
    """
    The failure of a request whose head did not come within C{t} seconds.
    """
    return Failure(HeaderTimeout(f"upstream sent no response headers within {t:.0f}s"))


def _headerTimeout(d: Deferred, timeout: float, clock) -> Deferred:
    """
    C{d.addTimeout(timeout, clock)} failing with L{HeaderTimeout}, in one
    callback rather than C{addTimeout}'s two (a request on a new
    connection: its connect counts too).

    @param timeout: seconds until C{d} is cancelled.
    @return: C{d}.
    """
    timedOut = []

    def expire() -> None:
        timedOut.append(True)
        d.cancel()

    call = clock.callLater(timeout, expire)

    def settle(result):
        if timedOut:
            return _timeoutFail(timeout)
        if call.active():
            call.cancel()
        return result

    return d.addBoth(settle)


class Target:
    """
    One upstream URL, parsed once: where to connect and what to send.

    @ivar scheme: C{http} or C{https}.
    @ivar host: the host to connect to (no brackets).
    @ivar port: the TCP port.
    @ivar key: the pool key, C{(scheme, host, port)}.
    @ivar head: the request line and C{Host} header, as bytes, for
        C{POST}.
    """

    __slots__ = ("head", "host", "key", "port", "scheme")

    def __init__(self, url: str):
        """
        @param url: an absolute C{http} or C{https} URL.
        @raise ValueError: for another scheme or no host.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.scheme = parts.scheme
        self.host = parts.hostname
        default = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default
        self.key = (self.scheme, self.host, self.port)
        hostHeader = f"[{self.host}]" if ":" in self.host else self.host
        if self.port != default:
            hostHeader += f":{self.port}"
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        self.head = f"POST {target} HTTP/1.1\r\nHost: {hostHeader}\r\n".encode("idna")


def requestPieces(target: Target, headers: dict, body) -> list:
    """
    The whole request: line, C{Host}, C{headers}, C{Accept-Encoding: gzip},
    C{Content-Length} and the body, as C{[head, body]} (sent together,
    never joined: L{relay.wire.sendnow.sendNow}); a body given as pieces
    (a list of bytes-like) follows the head piece by piece.

    @param headers: lower-cased name -> str value; a value with a CR or LF
        is sent with them replaced by spaces (no header injection).
    @return: a list of C{bytes}.
    """
    lines = [target.head]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            value = value.replace("\r", " ").replace("\n", " ")
        lines.append(name.encode("ascii") + b": " + value.encode("utf-8") + b"\r\n")
    if body.__class__ is list:  # pieces (relay.interfaces.IPiecesDialer)
        size = sum(map(len, body))
        lines.append(b"accept-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % size)
        return [b"".join(lines), *body]
    lines.append(b"accept-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body))
    return [b"".join(lines), body] if body else [b"".join(lines)]


def requestBytes(target: Target, headers: dict, body: bytes) -> bytes:
    """
    L{requestPieces} joined.
    """
    return b"".join(requestPieces(target, headers, body))


class _BodyTransport:
    """
    What a body protocol sees as its transport: an L{IPushProducer} over
    the connection while the response is arriving (pause/resume for
    backpressure; stop drops the connection and so the response). Once the
    response ended it does nothing: the connection may serve another
    request by then.
    """

    __slots__ = ("_response",)

    def __init__(self, response):
        self._response = response

    def pauseProducing(self) -> None:
        c = self._response._connection
        if c is not None:
            c.pause()

    def resumeProducing(self) -> None:
        c = self._response._connection
        if c is not None:
            c.resume()

    def stopProducing(self) -> None:
        c = self._response._connection
        if c is not None:
            c.abort()

    def loseConnection(self) -> None:
        self.stopProducing()


@implementer(IUpstreamResponse)
class Response:
    """
    An upstream response whose body is still arriving (L{IUpstreamResponse}).

    @ivar code: the HTTP status.
    @ivar headers: lower-cased name -> first value (C{content-encoding} and
        C{content-length} are dropped when the body is decoded).
    """

    def __init__(self, connection, code: int, headers: dict, decoder):
        self.code = code
        self.headers = headers
        self._connection = connection
        self._decoder = decoder
        self._protocol = None
        self._buffer = []
        self._end: Failure | None = None
        self._delivered = False

    # -- from the connection ---------------------------------------------------

    def _data(self, data: bytes) -> None:
        if self._decoder is not None:
            try:
                data = self._decoder.decompress(data)
            except zlib.error:
                self._connection.fail(Failure())
                return
            if not data:
                return
        if self._protocol is not None:
            self._protocol.dataReceived(data)
        elif self._end is None:
            self._buffer.append(data)

    def _finished(self, reason: Failure) -> None:
        if self._end is not None:
            return
        if self._decoder is not None and reason.check(ResponseDone, PotentialDataLoss):
            try:
                tail = self._decoder.flush()
            except zlib.error:
                reason = Failure(ResponseFailed([Failure()]))
            else:
                self._decoder = None
                if tail:
                    self._data(tail)
        self._end = reason
        self._connection = None
        if self._protocol is not None:
            protocol, self._protocol = self._protocol, None
            protocol.connectionLost(reason)

    # -- IUpstreamResponse -----------------------------------------------------

    def deliverBody(self, protocol) -> None:
        """
        See L{IUpstreamResponse.deliverBody}; once per response.
        """
        if self._delivered:
            raise RuntimeError("the body was already delivered")
        self._delivered = True
        protocol.makeConnection(_BodyTransport(self))
        buffered, self._buffer = self._buffer, []
        for part in buffered:
            protocol.dataReceived(part)
        if self._end is not None:
            protocol.connectionLost(self._end)
        else:
            self._protocol = protocol

    def takeBody(self, limit: int):
        """
        The whole body at once, when it has all arrived and ended cleanly
        (a JSON answer that came with its head): what a reader given it
        through L{deliverBody} would have collected, without the
        protocol's calls. Takes the body as L{deliverBody} does (once per
        response).

        @param limit: the most bytes returned (the rest is dropped, as a
            bounded reader drops it).
        @return: the body's first C{limit} bytes, or L{None} when the body
            is still arriving, ended otherwise, or was delivered: read it
            with L{deliverBody}.
        """
        if self._end is not _DONE or self._delivered:
            return None
        self._delivered = True
        buffered, self._buffer = self._buffer, []
        body = b"".join(buffered)
        return body[:limit] if len(body) > limit else body

    def readBody(self, limit: int) -> Deferred:
        """
        See L{IUpstreamResponse.readBody}.
        """
        collector = BodyCollector(limit)
        self.deliverBody(collector)
        return collector.done

    def abort(self) -> None:
        """
        See L{IUpstreamResponse.abort}.
        """
        if self._connection is not None:
            self._connection.abort()


class BodyCollector(Protocol):
    """
    Collects a bounded body (C{readBody} of both upstream responses): fires
    C{done} with at most C{limit} bytes, stopping the producer once full.
    """

    def __init__(self, limit: int):
        self._limit = limit
        self._parts = []
        self._size = 0
        self.done = Deferred()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        room = self._limit - self._size
        self._parts.append(data[:room])
        self._size += min(len(data), room)
        if self._size >= self._limit:
            self.done.callback(b"".join(self._parts))
            self.transport.stopProducing()

    def connectionLost(self, reason) -> None:
        if not self.done.called:
            self.done.callback(b"".join(self._parts))


class Connection(Protocol):
    """
    One keep-alive HTTP/1.1 connection to an upstream; one request at a
    time. Parsed by L{httptools.HttpResponseParser}, whose callbacks are
    the C{on_*} methods.

    @ivar response: the L{Response} whose body is arriving, or L{None}.
    """

    def __init__(self, pool: ConnectionPool, key: tuple):
        self._pool = pool
        self._key = key
        self._parser = httptools.HttpResponseParser(self)
        self._waiting: Deferred | None = None
        self._head: tuple | None = None
        self._headers: dict = {}
        self._framed = False
        self._aborted = False
        self._paused = False
        self._timer = None
        self._timeout = 0.0
        self.response: Response | None = None
        self.idleSince = 0.0

    # -- requests ----------------------------------------------------------------

    def request(self, data, timeout: float | None = None) -> Deferred:
        """
        Send a whole request: its bytes, or its pieces (L{requestPieces}).

        @param timeout: seconds the head may take (behaviour.md R1), or
            L{None}: no limit here. One timer per connection serves its
            requests one after another: moved to each request's deadline,
            and left to run out harmlessly once the head came (no new
            timer and no cancel per request).
        @return: a cancellable Deferred firing with the L{Response} once
            its head is in; failing with L{ResponseNeverReceived} when the
            connection ends first, or with L{HeaderTimeout}.
        """
        self._headers = {}
        self._framed = False
        self._waiting = d = Deferred(self._cancel)
        if timeout is not None:
            self._timeout = timeout
            timer = self._timer
            if timer is None or timer.called or timer.cancelled:
                self._timer = self._pool._reactor.callLater(timeout, self._headTimedOut)
            else:
                timer.reset(timeout)
        elif self._timer is not None:
            # no limit for this one: an earlier request's timer must not
            # fail it
            timer, self._timer = self._timer, None
            if timer.active():
                timer.cancel()
        # Sent at once when nothing is queued (relay.wire.sendnow).
        sendNow(self.transport, data)
        return d

    def _headTimedOut(self) -> None:
        """
        The timer ran out: the request waiting for its head (if any; one
        that has it, or ended, leaves nothing to do) fails with
        L{HeaderTimeout} and the connection is dropped.
        """
        self._timer = None
        d, self._waiting = self._waiting, None
        if d is not None:
            self.abort()
            d.errback(_timeoutFail(self._timeout))

    def _cancel(self, d: Deferred) -> None:
        self._waiting = None
        self.abort()
        d.errback(Failure(CancelledError()))

    def pause(self) -> None:
        """
        Stop reading (backpressure from the body's consumer).
        """
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pauseProducing()

    def resume(self) -> None:
        """
        Read again.
        """
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resumeProducing()

    def abort(self) -> None:
        """
        Drop the connection (the response in progress ends as failed).
        """
        if not self._aborted:
            self._aborted = True
            self._pool.forget(self)
            if self.transport is not None:
                self.transport.abortConnection()

    def fail(self, reason: Failure) -> None:
        """
        End the exchange in progress with C{reason} and drop the connection.
        """
        self._end(Failure(ResponseFailed([reason])))
        self.abort()

    # -- httptools callbacks -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key not in self._headers:
            self._headers[key] = value.decode("latin-1")
        if key == "content-length" or key == "transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        code = self._parser.get_status_code()
        if code < 200:
            self._headers = {}  # an interim 1xx: wait for the real head
            self._framed = False
            return
        headers = self._headers
        decoder = None
        if headers.get("content-encoding", "").strip().lower() == "gzip":
            decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
            del headers["content-encoding"]
            headers.pop("content-length", None)
        self.response = Response(self, code, headers, decoder)
        d, self._waiting = self._waiting, None
        if d is not None:
            # Fired once this read is parsed (L{dataReceived}),
            # so a body that came with its head is already buffered (and
            # ended) when the consumer takes it: a JSON turn reads it
            # without waiting again.
            self._head = (d, self.response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None and not self._aborted:
            self.response._data(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        if self._parser.should_keep_alive() and not self._aborted:
            self.resume()
            self._pool.release(self)
        else:
            self._aborted = True
            self._pool.forget(self)
            self.transport.loseConnection()
        response._finished(_DONE)

    # -- the transport ----------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._aborted:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail(Failure())
        except httptools.HttpParserError:
            self.fail(Failure())
        head = self._head
        if head is not None:
            self._head = None
            head[0].callback(head[1])

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._aborted = True
        self._pool.forget(self)
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        self._end(reason)

    def _end(self, reason: Failure) -> None:
        d, self._waiting = self._waiting, None
        if d is not None:
            d.errback(Failure(ResponseNeverReceived([reason])))
            return
        response, self.response = self.response, None
        if response is None:
            return
        if reason.check(ResponseFailed):
            response._finished(reason)
        elif not self._framed and reason.check(ConnectionDone):
            # No length, not chunked: the close ends the body (RFC 9112
            # 6.3 rule 8), which cannot be told from a cut (twisted.web's
            # PotentialDataLoss).
            response._finished(Failure(PotentialDataLoss()))
        else:
            response._finished(Failure(ResponseFailed([reason, Failure(_DataLoss())])))


class _ConnectionFactory(Factory):
    """
    Builds the one L{Connection} of one dial. Quiet (C{noisy = False}):
    Twisted would log "Starting factory" / "Stopping factory" at info
    level for every upstream connection.
    """

    noisy = False

    def __init__(self, pool: ConnectionPool, key: tuple):
        self._pool = pool
        self._key = key

    def buildProtocol(self, addr) -> Connection:
        return Connection(self._pool, self._key)


class ConnectionPool:
    """
    Idle keep-alive connections per C{(scheme, host, port)}, most recently
    used first, and the dialling of new ones.

    @ivar maxPerHost: idle connections kept per key; more are closed.
    """

    def __init__(self, reactor, tlsPolicy, connectTimeout: float, maxPerHost: int = 64):
        """
        @param reactor: connects and the clock.
        @param tlsPolicy: an L{twisted.web.iweb.IPolicyForHTTPS} for https.
        @param connectTimeout: seconds for a TCP (and TLS) connect.
        """
        self._reactor = reactor
        self._tlsPolicy = tlsPolicy
        self._connectTimeout = connectTimeout
        self.maxPerHost = maxPerHost
        self._idle: dict = {}
        self._endpoints: dict = {}
        self._all: set = set()

    def request(self, target: Target, data: bytes, timeout: float | None = None) -> Deferred:
        """
        Send C{data} on an idle connection to C{target}, or on a new one.

        @param timeout: seconds until the response head must be in, the
            connect of a new connection included; L{None}: no limit.
        @return: a cancellable Deferred firing with a L{Response}, or
            failing with L{HeaderTimeout} once C{timeout} ran out.
        """
        idle = self._idle.get(target.key)
        if idle:
            now = self._reactor.seconds()
            while idle:
                connection = idle.pop()
                if now - connection.idleSince < IDLE_TIMEOUT_SECONDS:
                    return connection.request(data, timeout)
                self.forget(connection)
                connection.transport.loseConnection()
        d = self._endpoint(target).connect(_ConnectionFactory(self, target.key))
        d.addCallback(self._connected, data)
        return d if timeout is None else _headerTimeout(d, timeout, self._reactor)

    def _connected(self, connection: Connection, data: bytes) -> Deferred:
        self._all.add(connection)
        return connection.request(data)

    def _endpoint(self, target: Target):
        endpoint = self._endpoints.get(target.key)
        if endpoint is None:
            endpoint = HostnameEndpoint(
                self._reactor, target.host.encode("idna"), target.port,
                timeout=self._connectTimeout,
            )
            if target.scheme == "https":
                creator = self._tlsPolicy.creatorForNetloc(target.host.encode("idna"), target.port)
                endpoint = wrapClientTLS(creator, endpoint)
            self._endpoints[target.key] = endpoint
        return endpoint

    def release(self, connection: Connection) -> None:
        """
        A connection finished its exchange and may be reused.
        """
        idle = self._idle.setdefault(connection._key, [])
        if len(idle) >= self.maxPerHost:
            self.forget(connection)
            connection.transport.loseConnection()
            return
        connection.idleSince = self._reactor.seconds()
        idle.append(connection)

    def forget(self, connection: Connection) -> None:
        """
        Take a connection out of the pool (closed, aborted, not reusable).
        """
        self._all.discard(connection)
        idle = self._idle.get(connection._key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> Deferred:
        """
        Close every connection (service stop).

        @return: a Deferred firing once the closes are under way.
        """
        for connection in list(self._all):
            if connection.transport is not None:
                connection.transport.loseConnection()
        self._idle.clear()
        return succeed(None)
