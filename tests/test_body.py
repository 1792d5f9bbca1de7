"""
Tests for L{relay.entry.body}: the bounded C{Content-Encoding} decoders and
L{LimitedBodyRequest} driven through a real L{HTTPChannel} on a
L{StringTransport} with a L{Clock} (issue 13 items 2 and 3).
"""

from __future__ import annotations

import gzip
import json
import zlib

import zstandard
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from relay.entry import body as B
from relay.base.requestid import requestIdOf

DOC = json.dumps({"model": "gpt-5.5", "input": "hi " * 1000}).encode()
MiB = 2**20


def decode(header, data, limit=64 * MiB, feed=4096):
    """
    Decode C{data} in C{feed}-byte pieces; return the output pieces.
    """
    out = []
    decoder = B.contentDecoder(header, limit, out.append)
    for i in range(0, len(data), feed):
        decoder.write(data[i : i + feed])
    decoder.close()
    return out


def responseBody(value):
    """
    The body of the first HTTP response in C{value}, de-chunked.
    """
    head, _, body = value.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return body
    out = b""
    while True:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, body = out + rest[:n], rest[n + 2 :]


def rawDeflate(data):
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


class DecoderTests(SynchronousTestCase):
    """
    L{B.contentDecoder}: every accepted encoding, chains, bad input, bombs.
    """

    def test_encodings(self):
        """
        gzip, x-gzip, deflate (zlib-wrapped and raw), zstd and identity
        decode to the original bytes.
        """
        cases = {
            b"gzip": gzip.compress(DOC),
            b"X-Gzip": gzip.compress(DOC),
            b"deflate": zlib.compress(DOC),
            b"zstd": zstandard.ZstdCompressor().compress(DOC),
        }
        for header, data in cases.items():
            self.assertEqual(b"".join(decode(header, data)), DOC, header)
        self.assertEqual(b"".join(decode(b"deflate", rawDeflate(DOC), feed=1)), DOC)
        self.assertIsNone(B.contentDecoder(b"identity", 10, print))
        self.assertIsNone(B.contentDecoder(None, 10, print))

    def test_chain(self):
        """
        C{gzip, zstd}: gzipped first, so zstd is undone first, then gzip.
        """
        data = zstandard.ZstdCompressor().compress(gzip.compress(DOC))
        self.assertEqual(b"".join(decode(b"gzip, zstd", data)), DOC)
        data = gzip.compress(zlib.compress(DOC))
        self.assertEqual(b"".join(decode(b"deflate,identity, gzip", data)), DOC)

    def test_gzip_members(self):
        """
        Concatenated gzip members decode one after the other.
        """
        data = gzip.compress(DOC[:100]) + gzip.compress(DOC[100:])
        self.assertEqual(b"".join(decode(b"gzip", data, feed=7)), DOC)

    def test_unknown(self):
        """
        An unknown token is L{B.UnsupportedEncoding}.
        """
        e = self.assertRaises(B.UnsupportedEncoding, B.contentDecoder, b"gzip, br", 10, print)
        self.assertEqual(e.encoding, "br")

    def test_corrupt_and_truncated(self):
        """
        Garbage and truncated streams are L{B.CorruptBody}.
        """
        self.assertRaises(B.CorruptBody, decode, b"gzip", b"not gzip at all")
        self.assertRaises(B.CorruptBody, decode, b"deflate", b"\x78\x9c garbage")
        self.assertRaises(B.CorruptBody, decode, b"zstd", b"not zstd at all")
        self.assertRaises(B.CorruptBody, decode, b"gzip", gzip.compress(DOC)[:-20])
        self.assertRaises(B.CorruptBody, decode, b"deflate", zlib.compress(DOC) + b"junk")

    def test_bombs_stop_at_the_limit(self):
        """
        A 256 MiB zstd bomb, a 256 MiB gzip bomb and a chain of both stop with
        L{B.BodyTooLarge} after producing at most the limit, in pieces of at
        most L{B.CHUNK} bytes.
        """
        zeros = b"\0" * (16 * MiB)
        z = zstandard.ZstdCompressor(level=3).compressobj()
        zbomb = b"".join(z.compress(zeros) for _ in range(16)) + z.flush()
        g = zlib.compressobj(9, zlib.DEFLATED, 31)
        gbomb = b"".join(g.compress(zeros) for _ in range(16)) + g.flush()
        for header, bomb in ((b"zstd", zbomb), (b"gzip", gbomb), (b"gzip, zstd", None)):
            if bomb is None:
                bomb = zstandard.ZstdCompressor().compress(gbomb)
            out = []
            decoder = B.contentDecoder(header, 4 * MiB, out.append)
            with self.assertRaises(B.BodyTooLarge):
                for i in range(0, len(bomb), 65536):
                    decoder.write(bomb[i : i + 65536])
            self.assertLessEqual(sum(map(len, out)), 4 * MiB, header)
            self.assertLessEqual(max(map(len, out)), B.CHUNK, header)


class EchoResource(Resource):
    """
    Answers the body it got, and the Content-Encoding header it saw.
    """

    isLeaf = True

    def render_POST(self, request):
        body = request.content.read()
        seen = request.getHeader(b"content-encoding") or b"-"
        return seen + b"|" + body


class HalfCloseTransport(StringTransport):
    """
    A L{StringTransport} that can half-close and records an abort.
    """

    writeClosed = False
    aborted = False

    def loseWriteConnection(self):
        self.writeClosed = True

    def abortConnection(self):
        self.aborted = True


class RequestTests(SynchronousTestCase):
    """
    L{B.LimitedBodyRequest} behind a real L{Site} and L{HTTPChannel}.
    """

    def channel(self, limit=1 * MiB, transport=None):
        site = Site(EchoResource(), requestFactory=B.LimitedBodyRequest)
        site.maxRequestBodyBytes = limit
        self.clock = Clock()
        channel = site.buildProtocol(None)
        channel.callLater = self.clock.callLater
        transport = transport or HalfCloseTransport()
        channel.makeConnection(transport)
        return channel, transport

    def post(self, body, headers=b"", limit=1 * MiB, transport=None):
        channel, transport = self.channel(limit, transport)
        channel.dataReceived(
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n" + headers + b"\r\n" + body
        )
        return channel, transport

    def test_plain_body(self):
        """
        A body under the limit reaches the resource unchanged.
        """
        _, transport = self.post(DOC)
        self.assertIn(b"200 OK", transport.value())
        self.assertTrue(transport.value().endswith(b"-|" + DOC))

    def test_decoded_before_the_resource(self):
        """
        A zstd body reaches the resource decoded, without the
        C{Content-Encoding} header.
        """
        data = zstandard.ZstdCompressor().compress(DOC)
        _, transport = self.post(data, b"Content-Encoding: zstd\r\n")
        self.assertTrue(transport.value().endswith(b"-|" + DOC), transport.value()[:200])

    def test_declared_length_over_the_limit(self):
        """
        A Content-Length over the limit is answered 413 from the headers
        alone, with C{Connection: close} and the OpenAI envelope; the write
        side is closed, the connection dropped after the linger time, and
        no body is stored.
        """
        channel, transport = self.channel(limit=1000)
        channel.dataReceived(
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 413 "))
        self.assertIn(b"connection: close", head)
        self.assertNotIn(b"100 Continue", transport.value())
        self.assertEqual(json.loads(body)["error"]["type"], "invalid_request_error")
        self.assertTrue(transport.writeClosed)
        request = channel._channel.requests[-1]
        self.assertIsNone(request.content)
        channel.dataReceived(b"x" * 5000)  # discarded
        self.assertIsNone(request.content)
        self.assertFalse(transport.aborted)
        self.clock.advance(B.LINGER_SECONDS)
        self.assertTrue(transport.aborted)

    def test_chunked_body_crossing_the_limit(self):
        """
        A chunked body is refused the moment it crosses the limit; what it
        stored so far is closed and nothing more is stored.
        """
        channel, transport = self.channel(limit=10000)
        channel.dataReceived(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        request = channel._channel.requests[-1]
        content = request.content
        for _ in range(2):
            channel.dataReceived(b"1000\r\n" + b"a" * 4096 + b"\r\n")
        self.assertEqual(transport.value(), b"")
        self.assertEqual(content.tell(), 8192)
        channel.dataReceived(b"1000\r\n" + b"a" * 4096 + b"\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertTrue(content.closed)
        self.assertIsNone(request.content)
        channel.dataReceived(b"1000\r\n" + b"a" * 4096 + b"\r\n0\r\n\r\n")
        self.assertEqual(transport.value().count(b"HTTP/1.1"), 1)

    def test_bomb_is_413(self):
        """
        A gzip body that inflates past the limit is answered 413 at once.
        """
        data = gzip.compress(b"\0" * (4 * MiB))
        _, transport = self.post(data, b"Content-Encoding: gzip\r\n", limit=MiB)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))

    def test_corrupt_is_400(self):
        """
        A body that does not decode is answered 400 in OpenAI's envelope
        once it has arrived; the connection stays usable.
        """
        _, transport = self.post(b"garbage!", b"Content-Encoding: gzip\r\n")
        value = transport.value()
        self.assertIn(b"HTTP/1.1 400 ", value)
        error = json.loads(responseBody(value))["error"]
        self.assertEqual(error["code"], "invalid_content_encoding")
        self.assertFalse(transport.writeClosed)

    def test_unknown_encoding_is_415(self):
        """
        An unknown encoding is answered 415 in OpenAI's envelope.
        """
        _, transport = self.post(b"xx", b"Content-Encoding: br\r\n")
        value = transport.value()
        self.assertIn(b"HTTP/1.1 415 ", value)
        error = json.loads(responseBody(value))["error"]
        self.assertEqual(error["code"], "unsupported_content_encoding")

    def test_413_carries_the_request_id(self):
        """
        Issue 15: every 413 (a declared length, a chunked body, a gzip
        bomb) answers with the request's id as C{X-Request-Id} and
        C{error.request_id}: a new C{req_} id of relay's own whatever the
        client sent (R111), chosen as for every other answer.
        """
        declared = (
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n%s\r\n"
        )
        chunked = (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n%s\r\n"
            + b"1000\r\n" + b"a" * 4096 + b"\r\n"
        )
        bomb = gzip.compress(b"\0" * (4 * MiB))
        compressed = (
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: "
            + str(len(bomb)).encode() + b"\r\n%s\r\n" + bomb
        )
        for raw in (declared, chunked, compressed):
            for header, expected in (
                (b"X-Request-Id: my-id.1\r\n", None),
                (b"X-Client-Request-Id: thread-9\r\n", None),
                (b"X-Request-Id: not ok\r\n", None),
                (b"", None),
            ):
                channel, transport = self.channel(limit=1000)
                channel.dataReceived(raw.replace(b"%s", header))
                value = transport.value()
                self.assertTrue(value.startswith(b"HTTP/1.1 413 "), value[:100])
                head, _, body = value.partition(b"\r\n\r\n")
                ids = [
                    line.split(b":", 1)[1].strip().decode()
                    for line in head.split(b"\r\n")[1:]
                    if line.lower().startswith(b"x-request-id:")
                ]
                self.assertEqual(len(ids), 1, head)
                if expected is None:
                    self.assertTrue(ids[0].startswith("req_"), ids)
                else:
                    self.assertEqual(ids[0], expected)
                error = json.loads(body)["error"]
                self.assertEqual(error["request_id"], ids[0])
                self.assertEqual(error["code"], "request_too_large")
                self.assertEqual(requestIdOf(channel._channel.requests[-1]), ids[0])

    def test_without_half_close(self):
        """
        A transport that cannot half-close is closed after the 413.
        """
        _, transport = self.post(b"x" * 2000, limit=1000, transport=StringTransport())
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertTrue(transport.disconnecting)


class ConfigTests(SynchronousTestCase):
    """
    C{gateway.max_request_body_bytes} (config.md): default, parsing, errors,
    and the site that enforces it.
    """

    def test_default_and_value(self):
        """
        The default is 64 MiB; a value is read; the built site carries it.
        """
        from twisted.internet.testing import MemoryReactorClock

        from relay.process.app import buildApplication
        from relay.configuration.parse import settingsFromString

        base = 'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        self.assertEqual(settingsFromString(base).gateway.max_request_body_bytes, 64 * MiB)
        config = settingsFromString(base + "gateway: {max_request_body_bytes: 2048}\n")
        self.assertEqual(config.gateway.max_request_body_bytes, 2048)
        app = buildApplication(config, MemoryReactorClock())
        self.assertEqual(app.site.maxRequestBodyBytes, 2048)
        self.assertTrue(issubclass(app.site.requestFactory, B.LimitedBodyRequest))

    def test_bad_value_is_one_line(self):
        """
        A value below 1024 or not an integer is a one-line config error
        naming the key.
        """
        from relay.configuration.parse import settingsFromString
        from relay.base.records import ConfigError

        for value in ("10", "lots", "1.5"):
            e = self.assertRaises(ConfigError, settingsFromString,
                                  f"gateway: {{max_request_body_bytes: {value}}}\n")
            self.assertIn("gateway.max_request_body_bytes", str(e))
            self.assertNotIn("\n", str(e))
