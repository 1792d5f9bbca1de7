"""
Tests for the cheaper request side of a turn (issue 24 item 2): relay's
request class (L{relay.entry.body.LimitedBodyRequest}) and site
(L{relay.entry.site.RelaySite}) re-do or shorten parts of twisted.web's
C{Request}; each is compared here with twisted.web's own on the same input.
"""

from __future__ import annotations

import itertools
import re
import time

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import datetimeToString
from twisted.web.http import Request as HTTPRequest
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from relay.entry import body as B
from relay.entry.site import RelaySite
from tests.test_intake import AUTH, Conn, head, relaySite

NAMES = [b"content-type", b"Content-Type", b"CONTENT-TYPE", "content-type", b"x-request-id",
         b"X-Request-Id", b"www-authenticate", b"x-relay-never-seen-before", "X-Str-Name"]
VALUES = [b"v", b"", b"a\r\nb", b"a\nb", b"a\rb", b"trailing\n", "text", "caf\u00e9", b" sp "]


class HeadersTests(SynchronousTestCase):
    """
    L{B._Headers} stores and answers exactly what twisted.web's L{Headers}
    does.
    """

    def test_sameAsTwisted(self):
        for name, first, second in itertools.product(NAMES, VALUES, VALUES):
            for values in ([first], [first, second]):
                ours, theirs = B._Headers(), Headers()
                ours.setRawHeaders(name, list(values))
                theirs.setRawHeaders(name, list(values))
                self.assertEqual(ours._rawHeaders, theirs._rawHeaders, (name, values))
                for asked in NAMES:
                    self.assertEqual(ours.getRawHeaders(asked), theirs.getRawHeaders(asked))
                    self.assertEqual(ours.getRawHeaders(asked, b"d"),
                                     theirs.getRawHeaders(asked, b"d"))

    def test_orderKept(self):
        """
        Setting a header again keeps its place (the answer's header order).
        """
        ours, theirs = B._Headers(), Headers()
        for h in (ours, theirs):
            for name in (b"a-one", b"b-two", b"A-One", b"c-three"):
                h.setRawHeaders(name, [name])
        self.assertEqual(list(ours.getAllRawHeaders()), list(theirs.getAllRawHeaders()))
        self.assertEqual(list(ours.getAllRawHeaders())[0], (b"A-One", [b"A-One"]))

    def test_requestHeadersAreOurs(self):
        request = B.LimitedBodyRequest(_Channel())
        self.assertIs(type(request.requestHeaders), B._Headers)
        self.assertIs(type(request.responseHeaders), B._Headers)


class _NoForms:
    _parsePOSTFormSubmission = False


class _Channel:
    site = _NoForms()
    transport = None

    def getPeer(self):
        return None

    def getHost(self):
        return None

    def requestDone(self, request):
        pass


class OnGoneTests(SynchronousTestCase):
    """
    L{B.LimitedBodyRequest.relayOnGone} is C{notifyFinish().addErrback(f)}
    without the L{Deferred}.
    """

    def test_orderAmongNotifications(self):
        calls = []
        request = B.LimitedBodyRequest(_Channel())
        request.notifyFinish().addErrback(lambda f: calls.append("deferred 1"))
        request.relayOnGone(lambda f: calls.append(("gone", f.type)))
        request.notifyFinish().addErrback(lambda f: calls.append("deferred 2"))
        request.connectionLost(Failure(ConnectionError("lost")))
        self.assertEqual(calls, ["deferred 1", ("gone", ConnectionError), "deferred 2"])

    def test_notAfterFinish(self):
        calls = []
        request = B.LimitedBodyRequest(_Channel())
        request.relayOnGone(calls.append)
        finished = request.notifyFinish()
        request._cleanup()
        self.assertEqual(calls, [])
        self.assertTrue(finished.called)

    def test_aFailingCallbackDoesNotStopTheOthers(self):
        calls = []
        request = B.LimitedBodyRequest(_Channel())
        request.relayOnGone(lambda f: 1 / 0)
        d = request.notifyFinish()
        d.addErrback(lambda f: calls.append("after"))
        with capturedLogs() as events:
            request.connectionLost(Failure(ConnectionError("lost")))
        self.assertEqual(calls, ["after"])
        self.assertTrue(any(e.get("log_failure") is not None
                            and e["log_failure"].check(ZeroDivisionError) for e in events))
        self.flushLoggedErrors(ZeroDivisionError)


class _Seen(Resource):
    """
    Records what twisted.web hands a resource, answers with a body.
    """

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.seen = []

    def render(self, request):
        self.seen.append((request.method, request.uri, request.path, request.args,
                          request.prepath, request.postpath, request.clientproto,
                          request.content.tell()))
        return b'{"ok":1}'


class _TwistedWay(B.LimitedBodyRequest):
    """
    The request with twisted.web's own C{requestReceived} and C{process}.
    """

    def _requestReceived(self, command, path, version):
        return HTTPRequest.requestReceived(self, command, path, version)

    def _render(self):
        return Request.process(self)


DATE = re.compile(rb"\r\nDate: [^\r]*\r\n")


class RequestPathTests(SynchronousTestCase):
    """
    L{B.LimitedBodyRequest._requestReceived} and C{_render} against
    twisted.web's C{requestReceived} and C{process}.
    """

    def answer(self, requestFactory, data: bytes):
        from twisted.internet.testing import StringTransport

        resource = _Seen()
        site = RelaySite(resource, requestFactory=requestFactory)
        clock = Clock()
        clock.advance(time.time())
        site.clock = clock
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(data)
        return transport.value(), resource.seen, clock

    def test_sameAsTwisted(self):
        cases = [
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /v1/models?a=1&b=2&a=3&empty=&x HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /v1/p%20q/%2Fx//y/ HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /v1/p%zz?q=%41 HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET / HTTP/1.0\r\n\r\n",
            b"POST /v1/form HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded"
            b"\r\nContent-Length: 7\r\n\r\na=1&b=2",
            b"POST /v1/responses?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
            b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
            b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        ]
        for data in cases:
            ours, oursSeen, clock = self.answer(B.LimitedBodyRequest, data)
            theirs, theirsSeen, _ = self.answer(_TwistedWay, data)
            self.assertEqual(oursSeen, theirsSeen, data)
            self.assertEqual(DATE.sub(b"\r\n", ours), DATE.sub(b"\r\n", theirs), data)
            if b"\r\nDate: " in theirs:
                self.assertIn(b"\r\nDate: " + datetimeToString(int(clock.seconds())) + b"\r\n",
                              ours)


class DateTests(SynchronousTestCase):
    """
    L{RelaySite.httpDate}: twisted.web's format, on the site's clock, once
    per second.
    """

    def test_perSecondOfTheClock(self):
        site = RelaySite(Resource())
        site.clock = clock = Clock()
        clock.advance(1_764_000_000.25)
        first = site.httpDate()
        self.assertEqual(first, datetimeToString(1_764_000_000))
        clock.advance(0.7)
        self.assertIs(site.httpDate(), first)
        clock.advance(0.1)
        self.assertEqual(site.httpDate(), datetimeToString(1_764_000_001))

    def test_noClock(self):
        """
        Without a clock the Date is twisted.web's, of the wall clock: a
        second between the readings taken before and after it (a VM's
        clock may step back between them).
        """
        site = RelaySite(Resource())
        before = time.time()
        value = site.httpDate()
        after = time.time()
        seconds = range(int(min(before, after)), int(max(before, after)) + 1)
        self.assertIn(value, {datetimeToString(second) for second in seconds})


class _Held(Resource):
    isLeaf = True

    def render_POST(self, request):
        request.content.read()
        return NOT_DONE_YET


class RateTimerTests(SynchronousTestCase):
    """
    The minimum body rate's timer is not armed (and cancelled) for a body
    that came whole with its headers; it is armed as before otherwise.
    """

    def conn(self):
        app, probe = relaySite("{min_body_bytes_per_second: 100}")
        conn = Conn(app.site)
        armed = []
        callLater = conn.inner.callLater

        def recording(delay, f, *a, **kw):
            armed.append(getattr(f, "__name__", ""))
            return callLater(delay, f, *a, **kw)

        conn.inner.callLater = recording
        return conn, armed

    def test_wholeBodyInTheFirstRead(self):
        conn, armed = self.conn()
        conn.send(head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual(conn.status(), 200)
        self.assertNotIn("_checkRate", armed)

    def test_pipelined(self):
        """
        Only the request whose head was read in one pass is spared the
        timer; the one behind it (read by twisted.web after the first is
        answered) arms and cancels it as before.
        """
        conn, armed = self.conn()
        one = head(b"/v1/probe", headers=AUTH, length=2) + b"{}"
        conn.send(one + one)
        self.assertEqual(conn.value.count(b"HTTP/1.1 200 "), 2)
        self.assertEqual(armed.count("_checkRate"), 1)

    def test_partOfTheBody(self):
        conn, armed = self.conn()
        conn.send(head(b"/v1/probe", headers=AUTH, length=1000) + b"{" * 10)
        self.assertEqual(armed.count("_checkRate"), 1)
        conn.clock.advance(10)
        self.assertEqual(conn.status(), 408)

    def test_bodyInButHeldBack(self):
        """
        A body whose read is in but not handed to the request in that call
        (here: the request's content chunks are dropped by a stub) still
        gets its timer, at the end of the call.
        """
        conn, armed = self.conn()
        original = B.LimitedBodyRequest.handleContentChunk
        self.patch(B.LimitedBodyRequest, "handleContentChunk", lambda self, data: None)
        self.patch(conn.inner._channel, "_finishRequestBody", lambda data: None)
        conn.send(head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual(armed.count("_checkRate"), 1)
        self.assertIsNot(original, B.LimitedBodyRequest.handleContentChunk)


del Deferred


class _Chunks(Resource):
    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        for piece in (b"data: one\n\n", b"", b"x" * 300, memoryview(b"mv")):
            request.write(piece)
        self.sent = request.sentLength
        request.finish()
        return NOT_DONE_YET


class ChunkTests(SynchronousTestCase):
    """
    The chunks after an answer's head (L{relay.process.app._Request.write}) are
    framed as twisted.web frames them.
    """

    def answer(self, site):
        from twisted.internet.testing import StringTransport

        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        return transport.value().partition(b"\r\n\r\n")[2]

    def test_sameAsTwisted(self):
        from twisted.web.server import Site

        from relay.process.app import _Request

        ours, theirs = _Chunks(), _Chunks()
        self.assertEqual(self.answer(RelaySite(ours, requestFactory=_Request)),
                         self.answer(Site(theirs)))
        self.assertEqual(ours.sent, theirs.sent)
        self.assertEqual(ours.sent, 313)


class _FirstWrite(Resource):
    """
    Answers as a case says: a status, headers, cookies, an ETag or
    C{Last-Modified}, then the writes.
    """

    isLeaf = True

    def __init__(self, case):
        super().__init__()
        self.case = case

    def render(self, request):
        code, headers, extra, writes = self.case
        if code is not None:
            request.setResponseCode(code)
        for name, value in headers:
            request.setHeader(name, value)
        if "cookie" in extra:
            request.addCookie(b"k", b"v")
        if "etag" in extra:
            request.setETag(b"tag")
        if "modified" in extra:
            request.setLastModified(1_000_000)
        if "default type" in extra:
            request.defaultContentType = None
        for piece in writes:
            request.write(piece)
        self.sent = request.sentLength
        request.finish()
        return NOT_DONE_YET


class FirstWriteTests(SynchronousTestCase):
    """
    An answer's first write (L{relay.entry.site.writeFirst}) writes what
    twisted.web's C{Request.write} and the channel's held head write.
    """

    CASES = [
        (None, [(b"content-type", b"application/json"), (b"content-length", b"2")], (), [b"{}"]),
        (200, [(b"content-type", b"text/event-stream")], (), [b"data: 1\n\n", b"x", b""]),
        (200, [(b"content-type", b"text/event-stream")], (), [b"", b"data: 1\n\n"]),
        (429, [(b"content-length", b"0")], (), [b""]),
        (200, [], (), [b"no type"]),
        (200, [], ("default type",), [b"no default type"]),
        (200, [(b"content-length", b"0")], (), []),
        (204, [], (), [b""]),
        (304, [(b"content-type", b"text/plain")], (), [b"x"]),
        (200, [(b"x-a", b"1"), (b"X-B", b"2")], ("cookie",), [b"c"]),
        (200, [], ("etag",), [b"e"]),
        (200, [], ("modified",), [b"m"]),
        (200, [(b"content-type", b"text/plain")], (), [memoryview(b"mv"), b"after"]),
        (200, [(b"content-type", b"text/plain"), (b"content-length", b"2")], (),
         [memoryview(b"mv")]),
    ]
    REQUESTS = [b"GET /w HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /w HTTP/1.0\r\n\r\n",
                b"HEAD /w HTTP/1.1\r\nHost: x\r\n\r\n"]

    def answer(self, case, request, first):
        from twisted.internet.testing import StringTransport

        import relay.process.app as A

        if not first:
            self.patch(A, "writeFirst", lambda request, data: False)
        resource = _FirstWrite(case)
        site = RelaySite(resource, requestFactory=A._Request)
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(request)
        ids = re.compile(rb"(X-Request-Id: )[^\r]+|Date: [^\r]+")
        return ids.sub(b"", transport.value()), getattr(resource, "sent", None)

    def test_sameAsTwisted(self):
        for case in self.CASES:
            for request in self.REQUESTS:
                with self.subTest(case=case, request=request):
                    ours = self.answer(case, request, True)
                    theirs = self.answer(case, request, False)
                    self.assertEqual(ours, theirs)
                    self.assertTrue(ours[0].startswith(b"HTTP/1."))

    def test_taken(self):
        """
        The plain case is written by L{relay.entry.site.writeFirst}.
        """
        from relay.entry import site as S
        import relay.process.app as A

        taken = []
        real = S.writeFirst
        self.patch(A, "writeFirst", lambda request, data: taken.append(real(request, data))
                   or taken[-1])
        self.answer(self.CASES[0], self.REQUESTS[0], True)
        self.assertEqual(taken, [True])


class AddressTests(SynchronousTestCase):
    """
    A connection's addresses are asked of its transport once.
    """

    def test_oncePerTransport(self):
        from twisted.internet.address import IPv4Address
        from twisted.internet.testing import StringTransport

        asked = []

        class Counting(StringTransport):
            def getPeer(self):
                asked.append("peer")
                return IPv4Address("TCP", "10.1.1.1", 5)

            def getHost(self):
                asked.append("host")
                return IPv4Address("TCP", "10.0.0.1", 80)

        channel = RelaySite(Resource()).buildProtocol(None)
        channel.makeConnection(Counting())
        inner = channel._channel
        for _ in range(3):
            self.assertEqual(inner.getPeer(), IPv4Address("TCP", "10.1.1.1", 5))
            self.assertEqual(inner.getHost(), IPv4Address("TCP", "10.0.0.1", 80))
        self.assertEqual(sorted(asked), ["host", "peer"])
        inner.transport = Counting()
        inner.getPeer()
        self.assertEqual(len(asked), 4)


class BadRequestIdTests(SynchronousTestCase):
    """
    A client's C{X-Request-Id} (or C{X-Client-Request-Id}) that is no UTF-8
    is not adopted: the request is answered with an id of relay's own
    (twisted.web's C{getHeader(str)} raised, and the connection dropped
    with no answer).
    """

    def test_answeredWithANewId(self):
        for name in (b"X-Request-Id", b"X-Client-Request-Id"):
            app, _ = relaySite()
            conn = Conn(app.site).send(head(b"/healthz", b"GET",
                                            headers=name + b": \xff\xfe\r\n"))
            self.assertEqual(conn.status(), 200)
            self.assertRegex(conn.value, rb"\r\nX-Request-Id: req_[0-9a-f]+\r\n")

    def test_utf8StillReadAsText(self):
        """
        A UTF-8 value is read as text as before (here one whose NBSP is
        stripped, leaving a well-formed id), kept as the client's id
        (R111: relay's own answers as C{X-Request-Id}).
        """
        from twisted.logger import capturedLogs

        app, _ = relaySite()
        with capturedLogs() as events:
            conn = Conn(app.site).send(head(b"/healthz", b"GET",
                                            headers=b"X-Request-Id: abc-1\xc2\xa0\r\n"))
        self.assertRegex(conn.value, rb"\r\nX-Request-Id: req_[0-9a-f]+\r\n")
        [line] = [e for e in events if e.get("event") == "relay.http_access"]
        self.assertEqual(line["client_request_id"], "abc-1")
