"""
Issue 24 item 2: L{relay.entry.headblock} reads a plain header block in
one pass, and L{relay.entry.site.RelayHTTPChannel} files it as twisted.web
would; every other input goes to twisted.web's line parser. A table of
edge inputs is fed to the relay's site classes both ways (the one-pass
read on and off), whole and split, and the answers must be the same bytes.
"""

from __future__ import annotations

import itertools
import json
import re

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from relay.base import requestid
from relay.entry.headblock import readHead


class _Echo(Resource):
    """
    A leaf answering every method with what the request carried.
    """

    isLeaf = True

    def render(self, request):
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({
            "method": request.method.decode("latin-1"),
            "uri": request.uri.decode("latin-1"),
            "version": request.clientproto.decode("latin-1"),
            "headers": [[n.decode("latin-1"), [v.decode("latin-1") for v in vs]]
                        for n, vs in request.requestHeaders.getAllRawHeaders()],
            "body": request.content.read().decode("latin-1") if request.content else None,
            "cookies": sorted([k.decode("latin-1"), v.decode("latin-1")]
                              for k, v in request.received_cookies.items()),
        }).encode()


class _Transport(StringTransport):
    """
    A L{StringTransport} that, like a TCP transport, delivers nothing more
    once it is closing, and lets go of its producer more than once.
    """

    def unregisterProducer(self):
        self.producer = None


_ID = re.compile(rb"(?i)(x-request-id: )[^\r]+|(\"request_id\": \")[^\"]+")
_DATE = re.compile(rb"(?i)date: [^\r]+\r\n")


def _answer(raw: bytes, readHead: bool, pieces: int = 1):
    """
    L{_feed} with request ids of one width, so an answer's length does not
    depend on how many ids the process made before (hex C{fff} -> C{1000}).
    """
    ids = requestid._ids
    requestid._ids = itertools.count(0x10000000)
    try:
        return _feed(raw, readHead, pieces)
    finally:
        requestid._ids = ids


def _feed(raw: bytes, readHead: bool, pieces: int = 1):
    """
    Feed C{raw} (in C{pieces} parts) to one connection of the relay's site
    classes.

    @return: C{(bytes written, ids and dates masked; whether the connection
        is closing; requests read)}.
    """
    from relay.process.app import _Request
    from relay.entry.site import RelaySite

    site = RelaySite(_Echo(), requestFactory=_Request, reactor=Clock())
    protocol = site.buildProtocol(None)
    channel = protocol._channel
    channel.relayReadHead = readHead
    transport = _Transport()
    protocol.makeConnection(transport)
    step = max(1, -(-len(raw) // pieces))
    for i in range(0, len(raw), step):
        if transport.disconnecting:
            break
        protocol.dataReceived(raw[i:i + step])
    written = _DATE.sub(b"", _ID.sub(lambda m: (m.group(1) or m.group(2)) + b"ID",
                                     transport.value()))
    return written, transport.disconnecting


def _post(body: bytes = b'{"a":1}', extra: bytes = b"") -> bytes:
    return (b"POST /v1/responses HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def _big(size: int) -> bytes:
    """
    A GET whose one header line is C{size} bytes long (without its CRLF).
    """
    return (b"GET /x HTTP/1.1\r\nX-Request-Id: req-big\r\nX-Big: "
            + b"a" * (size - len(b"X-Big: ")) + b"\r\n\r\n")


EDGES = {
    "plain POST": _post(),
    "pipelined POSTs": _post(b'{"a":1}') + _post(b'{"b":2}'),
    "pipelined, the second incomplete": _post() + b"POST /v1/responses HTTP/1.1\r\nHost: r",
    "POST then GET": _post() + b"GET /v1/models HTTP/1.1\r\nHost: relay\r\n\r\n",
    "upgrade after a POST": _post() + (
        b"GET /v1/responses HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"),
    "chunked with extensions": (
        b"POST /v1/responses HTTP/1.1\r\nHost: relay\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;name=value\r\nabc\r\n2;x\r\nde\r\n0\r\n\r\n"),
    "chunked, bad size": (
        b"POST /v1/responses HTTP/1.1\r\nHost: relay\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n"),
    "chunked, size with a sign": (
        b"POST /v1/responses HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n+3\r\nabc\r\n0\r\n\r\n"),
    "transfer-encoding identity": (
        b"POST /v1/responses HTTP/1.1\r\nTransfer-Encoding: identity\r\nContent-Length: 2"
        b"\r\n\r\nab"),
    "transfer-encoding gzip": b"POST /v1/responses HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    "length and chunked": (
        b"POST /v1/responses HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n"),
    "obs-fold": _post(extra=b"X-Folded: one\r\n  two\r\n"),
    "obs-fold with a tab": _post(extra=b"X-Folded: one\r\n\ttwo\r\n"),
    "duplicate Content-Length": _post(extra=b"Content-Length: 7\r\n"),
    "Content-Length with a sign": b"POST /x HTTP/1.1\r\nContent-Length: +2\r\n\r\nab",
    "Content-Length with spaces": b"POST /x HTTP/1.1\r\nContent-Length:  2 \r\n\r\nab",
    "Content-Length lower case": b"POST /x HTTP/1.1\r\ncontent-length: 2\r\n\r\nab",
    "Content-Length 0": b"POST /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    "HTTP/1.0": b"POST /x HTTP/1.0\r\nContent-Length: 2\r\n\r\nab",
    "HTTP/1.0 then more": b"GET /x HTTP/1.0\r\n\r\nGET /y HTTP/1.0\r\n\r\n",
    "HTTP/0.9": b"GET /x\r\n\r\n",
    "HTTP/2.0": b"GET /x HTTP/2.0\r\n\r\n",
    "Connection: close then more": (
        b"GET /x HTTP/1.1\r\nConnection: close\r\n\r\nGET /y HTTP/1.1\r\n\r\n"),
    "Connection: keep-alive, close": b"GET /x HTTP/1.1\r\nConnection: keep-alive close\r\n\r\n",
    "Expect: 100-continue": _post(extra=b"Expect: 100-continue\r\n"),
    "Expect on HTTP/1.0": b"POST /x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\na",
    "leading blank line": b"\r\n" + _post(),
    "two leading blank lines": b"\r\n\r\n" + _post(),
    "blank line after a POST": _post() + b"\r\n" + _post(),
    "unknown method": b"FOO /x HTTP/1.1\r\n\r\n",
    "method not a token": b"G(T /x HTTP/1.1\r\n\r\n",
    "lower-case method": b"get /x HTTP/1.1\r\n\r\n",
    "two spaces in the request line": b"GET  /x HTTP/1.1\r\n\r\n",
    "target with a control byte": b"GET /\x7f HTTP/1.1\r\n\r\n",
    "target with high bytes": b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n",
    "header without a colon": b"GET /x HTTP/1.1\r\nNoColon\r\n\r\n",
    "space before the colon": b"GET /x HTTP/1.1\r\nHost : relay\r\n\r\n",
    "empty header name": b"GET /x HTTP/1.1\r\n: value\r\n\r\n",
    "empty header value": b"GET /x HTTP/1.1\r\nX-Empty:\r\n\r\n",
    "header name not a token": b"GET /x HTTP/1.1\r\nX;Y: 1\r\n\r\n",
    "NUL in a value": b"GET /x HTTP/1.1\r\nX-A: a\0b\r\n\r\n",
    "CR in a value": b"GET /x HTTP/1.1\r\nX-A: a\rb\r\n\r\n",
    "bare LF endings": b"GET /x HTTP/1.1\nHost: relay\n\n",
    "LF inside a header block": b"GET /x HTTP/1.1\r\nX-A: a\nX-B: b\r\n\r\n",
    "repeated header": b"GET /x HTTP/1.1\r\nX-A: 1\r\nx-a: 2\r\nX-A:3\r\n\r\n",
    "value with inner spaces and tabs": b"GET /x HTTP/1.1\r\nX-A: \t a  b \t\r\n\r\n",
    "odd header case": b"GET /x HTTP/1.1\r\nwww-authenticate: x\r\nCONTENT-md5: y\r\n\r\n",
    "request id and bad header": b"GET /x HTTP/1.1\r\nX-Request-Id: req-abc\r\nBad\r\n\r\n",
    "header line of 16 KiB - 1": _big(16383),
    "header line of 16 KiB": _big(16384),
    "header line of 16 KiB + 1": _big(16385),
    "header block over 16 KiB": (b"GET /x HTTP/1.1\r\n"
                                 + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 2000) for i in range(9))
                                 + b"\r\n"),
    "request line of 16 KiB + 1": b"GET /" + b"a" * 16377 + b" HTTP/1.1\r\n\r\n",
    "block just under the one-pass size": b"GET /x HTTP/1.1\r\nX-A: " + b"v" * 8160 + b"\r\n\r\n",
    "many headers": b"GET /x HTTP/1.1\r\n" + b"X-A: 1\r\n" * 120 + b"\r\n",
    "body longer than declared": b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\nabGET /y HTTP/1.1\r\n\r\n",
    "incomplete headers": b"GET /x HTTP/1.1\r\nHost: relay\r\n",
    "cookies": _post(extra=b"Cookie: a=1; b=2\r\nCookie: c=3\r\n"),
    "POST with Connection: close, then more": _post(extra=b"Connection: close\r\n") + _post(),
    "POST with Connection: keep-alive": _post(extra=b"Connection: keep-alive\r\n") + _post(),
    "Expect with no body": b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
    "Expect, not 100-continue": _post(extra=b"Expect: something\r\n"),
    "GET without a length, then a POST": b"GET /x HTTP/1.1\r\nHost: relay\r\n\r\n" + _post(),
    "body in a later read": _post(b'{"a":"' + b"x" * 3000 + b'"}'),
}


class EdgeTableTests(SynchronousTestCase):
    """
    The one-pass read answers every edge input as twisted.web's line
    parser does.
    """

    def test_same_answers(self):
        for name, raw in EDGES.items():
            for pieces in (1, 2, 3, 7):
                with self.subTest(edge=name, pieces=pieces):
                    self.assertEqual(_answer(raw, True, pieces), _answer(raw, False, pieces))

    def test_byte_by_byte(self):
        for name, raw in EDGES.items():
            if len(raw) > 2000:
                continue
            with self.subTest(edge=name):
                self.assertEqual(_answer(raw, True, len(raw)), _answer(raw, False, 1))

    def test_the_table_answers(self):
        """
        The table is not all one answer: it has 200s, twisted.web's and
        relay's refusals.
        """
        firsts = {_answer(raw, True)[0].split(b"\r\n", 1)[0] for raw in EDGES.values()}
        for line in (b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request",
                     b"HTTP/1.1 431 Request Header Fields Too Large",
                     b"HTTP/1.1 414 Request-URI Too Long", b"HTTP/1.1 100 Continue"):
            self.assertIn(line, firsts)


class ReadHeadTests(SynchronousTestCase):
    """
    What L{readHead} takes and what it leaves to twisted.web.
    """

    def test_plain(self):
        raw = _post(b"ab", b"X-A:  1 \r\nx-a: 2\r\n")
        command, path, version, fields, length, size, blank = readHead(raw)
        self.assertEqual((command, path, version), (b"POST", b"/v1/responses", b"HTTP/1.1"))
        self.assertEqual(fields, [(b"Host", b"relay"), (b"Content-Type", b"application/json"),
                                  (b"X-A", b"1"), (b"X-A", b"2"), (b"Content-Length", b"2")])
        self.assertEqual(length, 2)
        self.assertEqual(raw[blank:], b"\r\nab")
        self.assertEqual(size, sum(len(line) for line in raw[:blank - 2].split(b"\r\n")))

    def test_left_to_twisted(self):
        for raw in (b"GET /x HTTP/1.1\r\nHost: r\r\n", b"\r\nGET /x HTTP/1.1\r\n\r\n",
                    EDGES["obs-fold"], EDGES["duplicate Content-Length"],
                    EDGES["chunked with extensions"], EDGES["HTTP/2.0"], EDGES["bare LF endings"],
                    EDGES["Content-Length with a sign"], EDGES["header line of 16 KiB - 1"],
                    EDGES["many headers"], EDGES["header name not a token"]):
            with self.subTest(raw=raw[:40]):
                self.assertIsNone(readHead(raw))

    def test_taken_on_the_connection(self):
        """
        A plain block is read by L{readHead} on the relay's channel (else
        the table above compares twisted.web with itself).
        """
        from relay.entry import site

        seen = []
        real = site.readHead

        def spy(data):
            seen.append(real(data))
            return seen[-1]

        self.patch(site, "readHead", spy)
        written, _ = _answer(EDGES["pipelined POSTs"], True)
        self.assertEqual(written.count(b"HTTP/1.1 200 OK"), 2)
        self.assertTrue(seen and all(s is not None for s in seen))
