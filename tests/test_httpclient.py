"""
Tests for L{relay.upstream.httpclient}, the lean keep-alive upstream client
(issue 16): wire format, the failure shapes relay's classification relies
on (behaviour.md R1, R23), gzip, backpressure and the pool.
"""

from __future__ import annotations

import gzip

from twisted.internet.defer import CancelledError
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import ResponseFailed, ResponseNeverReceived
from twisted.web.client import PotentialDataLoss, ResponseDone
from twisted.web.http import _DataLoss
from zope.interface.verify import verifyObject

from relay.interfaces import IUpstreamResponse
from relay.upstream.httpclient import (
    IDLE_TIMEOUT_SECONDS,
    Connection,
    ConnectionPool,
    HeaderTimeout,
    Target,
    requestBytes,
)


class Body(Protocol):
    """
    Records what a response body delivers.
    """

    def __init__(self):
        self.data = []
        self.reason = None

    def dataReceived(self, data: bytes) -> None:
        """
        Record C{data}.
        """
        self.data.append(data)

    def connectionLost(self, reason) -> None:
        """
        Record how the body ended.
        """
        self.reason = reason


class RequestBytesTests(SynchronousTestCase):
    """
    L{Target} and L{requestBytes}: what goes on the wire.
    """

    def test_request(self):
        """
        The request line, C{Host} (with a non-default port), the headers,
        C{accept-encoding: gzip}, the length and the body.
        """
        target = Target("http://up.example:8081/v1/responses?x=1")
        data = requestBytes(target, {"authorization": "Bearer k", "accept": "text/event-stream"}, b"{}")
        self.assertEqual(
            data,
            b"POST /v1/responses?x=1 HTTP/1.1\r\nHost: up.example:8081\r\n"
            b"authorization: Bearer k\r\naccept: text/event-stream\r\n"
            b"accept-encoding: gzip\r\ncontent-length: 2\r\n\r\n{}",
        )
        self.assertEqual(target.key, ("http", "up.example", 8081))

    def test_requestPieces(self):
        """
        A body given as pieces follows the head piece by piece, its length
        their sum; a body in one piece is one piece after the head.
        """
        from relay.upstream.httpclient import requestPieces

        target = Target("http://up.example/v1/responses")
        data = b'{"a":1}'
        pieces = requestPieces(target, {}, [b'{"a"', memoryview(data)[4:]])
        self.assertEqual(len(pieces), 3)
        self.assertTrue(pieces[0].endswith(b"content-length: 7\r\n\r\n"))
        self.assertEqual(b"".join(pieces[1:]), data)
        self.assertEqual(requestPieces(target, {}, data)[1], data)

    def test_defaultPortsAndIPv6(self):
        """
        The default port is left out of C{Host}; an IPv6 literal is
        bracketed.
        """
        self.assertIn(b"Host: api.example\r\n", Target("https://api.example/v1/x").head)
        self.assertEqual(Target("https://api.example/v1/x").port, 443)
        self.assertIn(b"Host: [::1]:9000\r\n", Target("http://[::1]:9000/v1").head)

    def test_noHeaderInjection(self):
        """
        CR and LF in a header value are sent as spaces.
        """
        data = requestBytes(Target("http://h/x"), {"user-agent": "a\r\nx-evil: 1"}, b"")
        self.assertIn(b"user-agent: a  x-evil: 1\r\n", data)

    def test_notHTTP(self):
        """
        Other schemes are refused.
        """
        self.assertRaises(ValueError, Target, "ftp://h/x")


class ConnectionTests(SynchronousTestCase):
    """
    One L{Connection} over a L{StringTransport}.
    """

    def setUp(self):
        self.clock = Clock()
        self.pool = ConnectionPool(self.clock, None, 5)
        self.target = Target("http://up/v1/responses")
        self.connection = Connection(self.pool, self.target.key)
        self.transport = StringTransport()
        self.connection.makeConnection(self.transport)
        self.pool._all.add(self.connection)

    def _request(self):
        return self.connection.request(requestBytes(self.target, {}, b"{}"))

    def test_contentLengthResponse(self):
        """
        The head fires the Deferred with the status and lower-cased first
        header values; the body arrives and ends with L{ResponseDone}; the
        connection goes back to the pool.
        """
        d = self._request()
        self.assertTrue(self.transport.value().startswith(b"POST /v1/responses HTTP/1.1\r\n"))
        self.connection.dataReceived(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r1\r\n"
            b"X-Request-Id: r2\r\nContent-Length: 5\r\n\r\nhel"
        )
        response = self.successResultOf(d)
        self.assertTrue(verifyObject(IUpstreamResponse, response))
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers["x-request-id"], "r1")
        self.assertEqual(response.headers["content-type"], "application/json")
        body = Body()
        response.deliverBody(body)
        self.assertEqual(body.data, [b"hel"])
        self.connection.dataReceived(b"lo")
        self.assertEqual(b"".join(body.data), b"hello")
        self.assertTrue(body.reason.check(ResponseDone))
        self.assertEqual(self.pool._idle[self.target.key], [self.connection])

    def test_chunkedAndReuse(self):
        """
        A chunked body arrives piece by piece; the same connection then
        serves the next request.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.connection.dataReceived(b"2\r\nde\r\n0\r\n\r\n")
        self.assertEqual(b"".join(body.data), b"abcde")
        self.assertTrue(body.reason.check(ResponseDone))
        self.transport.clear()
        d2 = self.pool.request(self.target, b"next")
        self.assertEqual(self.transport.value(), b"next")
        self.connection.dataReceived(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d2).code, 404)

    def test_bufferedUntilDelivered(self):
        """
        A body that ends before C{deliverBody} is replayed in full, then
        its end.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.assertEqual(body.data, [b"ok"])
        self.assertTrue(body.reason.check(ResponseDone))

    def test_headFiresOnceTheReadIsParsed(self):
        """
        Issue 24: the head's Deferred fires after the whole read it came in
        is parsed, so the consumer of a body that came with its head finds
        it ended (a JSON turn reads it without waiting again); the
        connection is back in the pool by then.
        """
        d = self._request()
        seen = []

        def head(response):
            body = Body()
            response.deliverBody(body)
            seen.append((b"".join(body.data), body.reason, list(self.pool._idle[self.target.key])))

        d.addCallback(head)
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n{}{}")
        [(data, reason, idle)] = seen
        self.assertEqual(data, b"{}{}")
        self.assertTrue(reason.check(ResponseDone))
        self.assertEqual(idle, [self.connection])

    def test_headThenBrokenRead(self):
        """
        A read whose body breaks after the head still gives the head; the
        body then ends as failed (L{ResponseFailed}).
        """
        d = self._request()
        self.connection.dataReceived(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n"
        )
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.assertEqual(body.data, [b"ok"])
        self.assertTrue(body.reason.check(ResponseFailed))

    def test_interimResponseSkipped(self):
        """
        A C{100 Continue} before the real head is not the response.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 100 Continue\r\nX-A: 1\r\n\r\n")
        self.assertNoResult(d)
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        self.assertNotIn("x-a", response.headers)
        self.assertEqual(self.successResultOf(response.readBody(10)), b"ok")

    def test_readBody(self):
        """
        L{IUpstreamResponse.readBody} collects the body.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nfail")
        self.assertEqual(self.successResultOf(self.successResultOf(d).readBody(100)), b"fail")

    def test_lostBeforeHead(self):
        """
        A connection that ends before the head fails the request with
        L{ResponseNeverReceived} wrapping the reason (as twisted.web's
        client did).
        """
        d = self._request()
        self.connection.connectionLost(Failure(ConnectionLost()))
        f = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(f.value.reasons[0].check(ConnectionLost))
        self.assertNotIn(self.connection, self.pool._all)

    def test_cutBody(self):
        """
        A body cut before its length ends with L{ResponseFailed} wrapping
        the reason and L{_DataLoss}.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.connection.connectionLost(Failure(ConnectionDone()))
        self.assertTrue(body.reason.check(ResponseFailed))
        reasons = body.reason.value.reasons
        self.assertTrue(reasons[0].check(ConnectionDone))
        self.assertTrue(reasons[1].check(_DataLoss))

    def test_closeDelimitedBody(self):
        """
        A body with neither length nor chunking ends with the close, as
        L{PotentialDataLoss}.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\n\r\nabc")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.connection.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(body.data, [b"abc"])
        self.assertTrue(body.reason.check(PotentialDataLoss))

    def test_gzip(self):
        """
        A gzip body is decoded; C{content-encoding} and C{content-length}
        are dropped from the headers.
        """
        payload = gzip.compress(b'{"ok": true}')
        d = self._request()
        self.connection.dataReceived(
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(payload)
            + payload
        )
        response = self.successResultOf(d)
        self.assertNotIn("content-encoding", response.headers)
        self.assertNotIn("content-length", response.headers)
        self.assertEqual(self.successResultOf(response.readBody(100)), b'{"ok": true}')

    def test_stopProducingAborts(self):
        """
        The body's transport C{stopProducing} drops the connection; after
        the body ended it does nothing (the connection may serve another
        request by then).
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        body.transport.stopProducing()
        self.assertTrue(self.transport.disconnecting)
        self.assertNotIn(self.connection, self.pool._all)

        other = Connection(self.pool, self.target.key)
        otherTransport = StringTransport()
        other.makeConnection(otherTransport)
        d = other.request(b"x")
        other.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nz")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        body.transport.stopProducing()
        self.assertFalse(otherTransport.disconnecting)

    def test_pauseResume(self):
        """
        Backpressure pauses the socket; a connection released paused is
        resumed first.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        body.transport.pauseProducing()
        self.assertEqual(self.transport.producerState, "paused")
        self.connection.dataReceived(b"cd")
        self.assertEqual(self.transport.producerState, "producing")

    def test_cancelBeforeHead(self):
        """
        Cancelling the request drops the connection and fails with
        L{CancelledError}.
        """
        d = self._request()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(self.transport.disconnecting)

    def test_connectionClose(self):
        """
        A response with C{Connection: close} is not pooled.
        """
        d = self._request()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(d)
        self.assertFalse(self.pool._idle.get(self.target.key))
        self.assertTrue(self.transport.disconnecting)

    def test_garbage(self):
        """
        A response that is not HTTP fails the request.
        """
        d = self._request()
        self.connection.dataReceived(b"SSH-2.0-OpenSSH\r\n\r\n")
        self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(self.transport.disconnecting)

    def test_staleIdleNotReused(self):
        """
        A pooled connection idle longer than L{IDLE_TIMEOUT_SECONDS} is
        closed instead of reused.
        """
        self.pool.release(self.connection)
        self.clock.advance(IDLE_TIMEOUT_SECONDS + 1)

        class Endpoint:
            def connect(self, factory):
                from twisted.internet.defer import Deferred

                self.factory = factory
                return Deferred()

        endpoint = Endpoint()
        self.pool._endpoints[self.target.key] = endpoint
        self.pool.request(self.target, b"x")
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.transport.value(), b"")
        self.assertIsNotNone(endpoint.factory)


class HeadTimeoutTests(SynchronousTestCase):
    """
    The pool's header timeout (behaviour.md R1): a request whose head does
    not come within its seconds (the connect of a new connection
    included) fails with L{HeaderTimeout} and drops its connection.
    """

    def setUp(self):
        self.clock = Clock()
        self.pool = ConnectionPool(self.clock, None, 5)
        self.target = Target("http://up/v1/responses")
        self.connection = Connection(self.pool, self.target.key)
        self.transport = StringTransport()
        self.connection.makeConnection(self.transport)
        self.pool._all.add(self.connection)
        self.pool.release(self.connection)

    def test_pooledConnectionTimesOut(self):
        """
        On a pooled connection: no head within the seconds, the request
        fails with L{HeaderTimeout} naming them, and the connection goes.
        """
        d = self.pool.request(self.target, b"x", 5.0)
        self.clock.advance(4.9)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        failure = self.failureResultOf(d, HeaderTimeout)
        self.assertIn("within 5s", str(failure.value))
        self.assertTrue(self.transport.disconnecting)
        self.assertNotIn(self.connection, self.pool._all)

    def test_oneTimerForTheConnectionsRequests(self):
        """
        Requests one after another on a connection share one timer, moved
        to each request's deadline; a head in time leaves it to run out
        doing nothing, and the next request's deadline is its own.
        """
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        first = self.pool.request(self.target, b"x", 5.0)
        [timer] = self.clock.getDelayedCalls()
        self.clock.advance(3)
        self.connection.dataReceived(ok)
        self.successResultOf(first)
        second = self.pool.request(self.target, b"y", 5.0)
        self.assertEqual(self.clock.getDelayedCalls(), [timer])
        self.clock.advance(3)
        self.connection.dataReceived(ok)
        self.successResultOf(second)
        self.clock.advance(10)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertFalse(self.transport.disconnecting)
        third = self.pool.request(self.target, b"z", 2.0)
        self.clock.advance(1.9)
        self.assertNoResult(third)
        self.clock.advance(0.1)
        self.failureResultOf(third, HeaderTimeout)

    def test_requestWithoutLimitAfterOneWithIt(self):
        """
        A request without a timeout after one with it on the same
        connection is never failed by the earlier one's timer.
        """
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        first = self.pool.request(self.target, b"x", 5.0)
        self.connection.dataReceived(ok)
        self.successResultOf(first)
        second = self.pool.request(self.target, b"y", None)
        self.clock.advance(10)
        self.assertNoResult(second)
        self.assertFalse(self.transport.disconnecting)
        self.connection.dataReceived(ok)
        self.successResultOf(second)

    def test_newConnectionConnectCounts(self):
        """
        A request on a new connection: the connect is within the seconds.
        """
        from twisted.internet.defer import Deferred

        cancelled = []

        class Endpoint:
            def connect(self, factory):
                return Deferred(cancelled.append)

        self.pool._idle.clear()
        self.pool._endpoints[self.target.key] = Endpoint()
        d = self.pool.request(self.target, b"x", 5.0)
        self.clock.advance(5.0)
        self.assertEqual(len(cancelled), 1)
        self.failureResultOf(d, HeaderTimeout)

    def test_lostConnectionStopsItsTimer(self):
        """
        A connection that closes takes its timer with it.
        """
        d = self.pool.request(self.target, b"x", 5.0)
        self.connection.connectionLost(Failure(ConnectionLost()))
        self.failureResultOf(d, ResponseNeverReceived)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class EngineBodyReadTests(SynchronousTestCase):
    """
    L{relay.engine.upstreambody.readBody} over a L{Connection}'s response:
    R24's idle timer runs only while the body is still arriving.
    """

    def setUp(self):
        self.clock = Clock()
        self.pool = ConnectionPool(self.clock, None, 5)
        self.target = Target("http://up/v1/responses")
        self.connection = Connection(self.pool, self.target.key)
        self.connection.makeConnection(StringTransport())

    def _response(self, data: bytes):
        d = self.connection.request(requestBytes(self.target, {}, b"{}"))
        self.connection.dataReceived(data)
        return self.successResultOf(d)

    def test_bodyAlreadyInNeedsNoTimer(self):
        """
        A body that came with its head is read at once; no idle timer is
        left behind (issue 24).
        """
        from relay.engine.upstreambody import readBody

        response = self._response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        timers = []
        self.clock.callLater = lambda *a, **kw: timers.append(a) or Clock.callLater(
            self.clock, *a, **kw
        )
        self.assertEqual(self.successResultOf(readBody(response, 100, 30.0, self.clock)), b"ok")
        self.assertEqual(timers, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_bodyAlreadyInTakenWhole(self):
        """
        A body that came whole with its head is taken at once
        (L{Response.takeBody}): the same bytes a bounded reader collects,
        cut to the limit, and the body counts as delivered; one still
        arriving, or one ended otherwise, is not taken.
        """
        from relay.engine.upstreambody import readBody

        response = self._response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        self.assertEqual(response.takeBody(3), b"hel")
        self.assertIsNone(response.takeBody(100))
        self.assertRaises(RuntimeError, response.deliverBody, Body())
        whole = self._response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        self.assertEqual(self.successResultOf(readBody(whole, 100, 30.0, self.clock)), b"hello")
        arriving = self._response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
        self.assertIsNone(arriving.takeBody(100))
        body = Body()
        arriving.deliverBody(body)
        self.assertEqual(body.data, [b"hel"])

    def test_closeDelimitedBodyNotTaken(self):
        """
        A body ended by the connection's close (L{PotentialDataLoss}) is
        read through its protocol, as before.
        """
        from relay.engine.upstreambody import readBody

        response = self._response(b"HTTP/1.1 200 OK\r\n\r\nabc")
        self.connection.connectionLost(Failure(ConnectionDone()))
        self.assertIsNone(response.takeBody(100))
        self.assertEqual(self.successResultOf(readBody(response, 100, 30.0, self.clock)), b"abc")

    def test_idleBodyTimesOut(self):
        """
        A body still arriving is watched: each read restarts the idle
        period, and a silent one fails with L{BodyBroken} (C{idle}).
        """
        from relay.engine.upstreambody import BodyBroken, readBody

        response = self._response(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok")
        d = readBody(response, 100, 30.0, self.clock)
        self.clock.advance(20)
        self.connection.dataReceived(b"o")
        self.clock.advance(20)
        self.assertNoResult(d)
        self.clock.advance(10)
        failure = self.failureResultOf(d, BodyBroken)
        self.assertTrue(failure.value.idle)
        self.assertEqual(failure.value.partial, b"oko")
        self.assertEqual(self.clock.getDelayedCalls(), [])
