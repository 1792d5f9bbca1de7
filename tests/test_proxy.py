"""
Unit tests for L{relay.upstream.proxy}: the SOCKS5 and HTTP C{CONNECT}
machines byte by byte, and the tunnel endpoint on a L{MemoryReactorClock}
with L{StringTransport}s.
"""

from __future__ import annotations

from base64 import b64encode

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import EventLoggingObserver, MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import URI
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface.verify import verifyObject

from relay.base.records import ProxySpec
from relay.upstream import proxy as proxymod
from relay.upstream.proxy import (
    HTTPConnectNegotiation,
    ProxyAgentEndpointFactory,
    ProxyAuthenticationFailed,
    ProxyConnectFailed,
    ProxyError,
    ProxyTimeout,
    ProxyTunnelEndpoint,
    Socks5Negotiation,
    proxyEndpoint,
    webSocketEndpoint,
)

SOCKS_OK_IPV4 = b"\x05\x00\x00\x01\x7f\x00\x00\x01\x1f\x90"
"""A successful SOCKS5 reply bound to 127.0.0.1:8080."""


def feedBytewise(negotiation, data: bytes):
    """
    Feed C{data} one byte at a time.

    @return: (all bytes to send, the first non-L{None} leftover or L{None}).
    """
    out = b""
    for i in range(len(data)):
        sent, leftover = negotiation.dataReceived(data[i : i + 1])
        out += sent
        if leftover is not None:
            return out, leftover + data[i + 1 :]
    return out, None


class Socks5NegotiationTests(SynchronousTestCase):
    """
    Tests for L{Socks5Negotiation}.
    """

    def test_greetingNoAuth(self):
        """
        Without credentials the greeting offers only method 0x00.
        """
        self.assertEqual(Socks5Negotiation("example.com", 443).start(), b"\x05\x01\x00")

    def test_greetingWithCredentials(self):
        """
        With credentials the greeting offers 0x00 and 0x02 (RFC 1929).
        """
        n = Socks5Negotiation("example.com", 443, "user", "pass")
        self.assertEqual(n.start(), b"\x05\x02\x00\x02")

    def test_connectRequestDomain(self):
        """
        A host name goes out as ATYP 3 with its length (C{socks5h}).
        """
        n = Socks5Negotiation("api.openai.com", 443)
        n.start()
        out, leftover = n.dataReceived(b"\x05\x00")
        self.assertEqual(out, b"\x05\x01\x00\x03\x0eapi.openai.com\x01\xbb")
        self.assertIsNone(leftover)

    def test_connectRequestIPv4(self):
        """
        An IPv4 literal goes out as ATYP 1.
        """
        n = Socks5Negotiation("10.1.2.3", 80)
        out, _ = n.dataReceived(b"\x05\x00")
        self.assertEqual(out, b"\x05\x01\x00\x01\x0a\x01\x02\x03\x00\x50")

    def test_connectRequestIPv6(self):
        """
        An IPv6 literal goes out as ATYP 4 with 16 address bytes.
        """
        n = Socks5Negotiation("::1", 443)
        out, _ = n.dataReceived(b"\x05\x00")
        self.assertEqual(out, b"\x05\x01\x00\x04" + b"\x00" * 15 + b"\x01\x01\xbb")

    def test_usernamePasswordBytes(self):
        """
        When the proxy picks 0x02 the RFC 1929 request carries version 1 and
        the length-prefixed user name and password; success then sends the
        CONNECT request.
        """
        n = Socks5Negotiation("h", 1, "alice", "s3cret")
        out, _ = n.dataReceived(b"\x05\x02")
        self.assertEqual(out, b"\x01\x05alice\x06s3cret")
        self.assertEqual(n.phase, "auth")
        out, _ = n.dataReceived(b"\x01\x00")
        self.assertEqual(out, b"\x05\x01\x00\x03\x01h\x00\x01")

    def test_authRejected(self):
        """
        A non-zero RFC 1929 status is L{ProxyAuthenticationFailed} with the
        R3 marker C{authentication failed}; the password is not in the text.
        """
        n = Socks5Negotiation("h", 1, "alice", "s3cret", proxyId="p1")
        n.dataReceived(b"\x05\x02")
        e = self.assertRaises(ProxyAuthenticationFailed, n.dataReceived, b"\x01\x01")
        self.assertIn("authentication failed", str(e).lower())
        self.assertNotIn("s3cret", str(e))
        self.assertEqual(e.proxyId, "p1")

    def test_noAcceptableMethod(self):
        """
        Method 0xFF (no acceptable method, e.g. the proxy needs credentials
        we do not have) is an authentication failure.
        """
        n = Socks5Negotiation("h", 1)
        e = self.assertRaises(ProxyAuthenticationFailed, n.dataReceived, b"\x05\xff")
        self.assertIn("authentication failed", str(e).lower())

    def test_methodNotOffered(self):
        """
        A method we did not offer is a protocol error.
        """
        n = Socks5Negotiation("h", 1)
        self.assertRaises(ProxyError, n.dataReceived, b"\x05\x02")

    def test_notSocks5(self):
        """
        A first byte other than 5 is a protocol error.
        """
        n = Socks5Negotiation("h", 1)
        self.assertRaises(ProxyError, n.dataReceived, b"HTTP/1.1 400")

    def test_replyCodes(self):
        """
        Each RFC 1928 reply code maps to L{ProxyConnectFailed} with the
        code and the text R3 needs: 0x05 C{connection refused}, 0x03
        C{network is unreachable}, 0x04 C{no route to host}; 0x01 has no
        persistent marker.
        """
        markers = ("connection refused", "network is unreachable", "no route to host")
        expected = {
            0x01: "general socks server failure",
            0x02: "not allowed",
            0x03: "network is unreachable",
            0x04: "no route to host",
            0x05: "connection refused",
            0x06: "ttl expired",
            0x07: "command not supported",
            0x08: "address type not supported",
            0x42: "unknown socks5 reply 0x42",
        }
        for code, text in expected.items():
            n = Socks5Negotiation("h", 1, proxyId="p")
            n.dataReceived(b"\x05\x00")
            e = self.assertRaises(
                ProxyConnectFailed, n.dataReceived, b"\x05" + bytes([code]) + b"\x00\x01"
            )
            self.assertEqual(e.code, code)
            self.assertIn(text, str(e).lower())
            if code in (0x01, 0x02, 0x06, 0x07, 0x08, 0x42):
                self.assertFalse([m for m in markers if m in str(e).lower()], str(e))

    def test_failedReplyNeedsOnlyTwoBytes(self):
        """
        A failure reply is reported as soon as its code arrives, even when
        the proxy closes before sending the bound address.
        """
        n = Socks5Negotiation("h", 1)
        n.dataReceived(b"\x05\x00")
        self.assertRaises(ProxyConnectFailed, n.dataReceived, b"\x05\x05")

    def test_partialReadsAllPhases(self):
        """
        Greeting reply, auth reply and a domain-type CONNECT reply arriving
        one byte at a time complete the handshake, and the bytes after the
        reply come back as leftover.
        """
        n = Socks5Negotiation("example.com", 443, "u", "p")
        out, leftover = feedBytewise(n, b"\x05\x02")
        self.assertEqual(out, b"\x01\x01u\x01p")
        self.assertIsNone(leftover)
        out, leftover = feedBytewise(n, b"\x01\x00")
        self.assertTrue(out.startswith(b"\x05\x01\x00\x03"))
        reply = b"\x05\x00\x00\x03\x09localhost\x01\xbb"
        out, leftover = feedBytewise(n, reply + b"HTTP/1.1")
        self.assertEqual(out, b"")
        self.assertEqual(leftover, b"HTTP/1.1")
        self.assertEqual(n.phase, "done")

    def test_ipv6ReplyAndLeftoverInOneChunk(self):
        """
        Everything in one chunk: method, IPv6 reply and tunnelled bytes.
        """
        n = Socks5Negotiation("h", 1)
        reply = b"\x05\x00\x00\x04" + b"\x00" * 16 + b"\x00\x50"
        out, leftover = n.dataReceived(b"\x05\x00" + reply + b"abc")
        self.assertEqual(leftover, b"abc")

    def test_unknownReplyAddressType(self):
        """
        A success reply with an unknown address type is a protocol error.
        """
        n = Socks5Negotiation("h", 1)
        n.dataReceived(b"\x05\x00")
        self.assertRaises(ProxyError, n.dataReceived, b"\x05\x00\x00\x09")

    def test_credentialsTooLong(self):
        """
        RFC 1929 fields are at most 255 bytes.
        """
        self.assertRaises(ProxyError, Socks5Negotiation, "h", 1, "u" * 256, "p")

    def test_connectionLostIsTransient(self):
        """
        A close during the handshake is a L{ProxyError} without R3 markers.
        """
        n = Socks5Negotiation("h", 1)
        e = n.connectionLost()
        self.assertIsInstance(e, ProxyError)
        self.assertIn("closed", str(e))


class HTTPConnectNegotiationTests(SynchronousTestCase):
    """
    Tests for L{HTTPConnectNegotiation}.
    """

    def test_requestNoAuth(self):
        """
        The request is C{CONNECT host:port HTTP/1.1} with a C{Host} header.
        """
        n = HTTPConnectNegotiation("api.openai.com", 443)
        self.assertEqual(
            n.start(),
            b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n",
        )

    def test_requestBasicAuth(self):
        """
        With credentials it carries C{Proxy-Authorization: Basic}.
        """
        n = HTTPConnectNegotiation("h", 8443, "user", "pa:ss")
        token = b64encode(b"user:pa:ss")
        self.assertIn(b"\r\nProxy-Authorization: Basic " + token + b"\r\n", n.start())

    def test_requestIPv6(self):
        """
        An IPv6 target is bracketed.
        """
        n = HTTPConnectNegotiation("::1", 443)
        self.assertTrue(n.start().startswith(b"CONNECT [::1]:443 HTTP/1.1\r\n"))

    def test_tunnelWithLeftover(self):
        """
        A 200 opens the tunnel; bytes after the head are leftover.
        """
        n = HTTPConnectNegotiation("h", 1)
        out, leftover = n.dataReceived(
            b"HTTP/1.1 200 Connection established\r\nX: y\r\n\r\n\x16\x03"
        )
        self.assertEqual((out, leftover), (b"", b"\x16\x03"))

    def test_tunnelBytewise(self):
        """
        A head arriving one byte at a time completes the handshake.
        """
        n = HTTPConnectNegotiation("h", 1)
        _, leftover = feedBytewise(n, b"HTTP/1.0 200 OK\r\n\r\nzz")
        self.assertEqual(leftover, b"zz")

    def test_407(self):
        """
        407 is L{ProxyAuthenticationFailed} with C{proxy authentication
        required}.
        """
        n = HTTPConnectNegotiation("h", 1, "u", "secret", proxyId="hp")
        e = self.assertRaises(
            ProxyAuthenticationFailed,
            n.dataReceived,
            b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n",
        )
        self.assertIn("proxy authentication required", str(e).lower())
        self.assertNotIn("secret", str(e))
        self.assertEqual(e.proxyId, "hp")

    def test_401FromProxy(self):
        """
        401 to a CONNECT (tinyproxy's answer to a wrong password) is also
        L{ProxyAuthenticationFailed} with the R3 marker.
        """
        n = HTTPConnectNegotiation("h", 1, "u", "bad")
        e = self.assertRaises(
            ProxyAuthenticationFailed, n.dataReceived, b"HTTP/1.0 401 Unauthorized\r\n\r\n"
        )
        self.assertIn("proxy authentication required", str(e).lower())

    def test_502WithoutReasonIsTransient(self):
        """
        502 with a body naming no R3 reason fails with the status and no
        marker once C{Content-Length} bytes are read.
        """
        n = HTTPConnectNegotiation("h", 1)
        _, leftover = n.dataReceived(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 5\r\n\r\nab")
        self.assertIsNone(leftover)
        e = self.assertRaises(ProxyConnectFailed, n.dataReceived, b"cde")
        self.assertEqual(e.status, 502)
        self.assertIn("502 Bad Gateway", str(e))
        self.assertNotIn("refused", str(e).lower())

    def test_refusedInBody(self):
        """
        A body that says C{Connection refused} puts the R3 marker into the
        message; without C{Content-Length} the body is read until close.
        """
        n = HTTPConnectNegotiation("h", 1)
        n.dataReceived(b"HTTP/1.1 500 Unable to connect\r\nConnection: close\r\n\r\n")
        n.dataReceived(b"<p>Connection refused</p>")
        e = n.connectionLost()
        self.assertIsInstance(e, ProxyConnectFailed)
        self.assertEqual(e.status, 500)
        self.assertIn("connection refused", str(e).lower())

    def test_refusedInReason(self):
        """
        A reason phrase naming the reason is kept in the message.
        """
        n = HTTPConnectNegotiation("h", 1)
        e = self.assertRaises(
            ProxyConnectFailed,
            n.dataReceived,
            b"HTTP/1.1 503 Connection refused\r\nContent-Length: 0\r\n\r\n",
        )
        self.assertIn("connection refused", str(e).lower())

    def test_bodyIsNotCopied(self):
        """
        Only known reason markers are copied from the body, never its text.
        """
        n = HTTPConnectNegotiation("h", 1)
        e = self.assertRaises(
            ProxyConnectFailed,
            n.dataReceived,
            b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 6\r\n\r\nsecret",
        )
        self.assertNotIn("secret", str(e))

    def test_malformedStatusLine(self):
        """
        A non-HTTP answer is a protocol error.
        """
        n = HTTPConnectNegotiation("h", 1)
        self.assertRaises(ProxyError, n.dataReceived, b"\x05\x00garbage\r\n\r\n")

    def test_headTooLarge(self):
        """
        An endless head is cut off at L{proxymod.MAX_HTTP_RESPONSE_HEAD}.
        """
        n = HTTPConnectNegotiation("h", 1)
        data = b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (proxymod.MAX_HTTP_RESPONSE_HEAD // 6 + 1)
        self.assertRaises(ProxyError, n.dataReceived, data)

    def test_closedBeforeAnswer(self):
        """
        A close before any answer is a transient L{ProxyError}.
        """
        e = HTTPConnectNegotiation("h", 1).connectionLost()
        self.assertNotIsInstance(e, ProxyConnectFailed)
        self.assertIsInstance(e, ProxyError)


class RecordingProtocol(Protocol):
    """
    A protocol recording what happens to it.

    @ivar made: how many times C{connectionMade} ran.
    @ivar data: everything received.
    @ivar lost: the C{connectionLost} reason, or L{None}.
    """

    def __init__(self):
        self.made = 0
        self.data = b""
        self.lost = None

    def connectionMade(self):
        """
        Count the call.
        """
        self.made += 1

    def dataReceived(self, data):
        """
        Record C{data}.
        """
        self.data += data

    def connectionLost(self, reason):
        """
        Record C{reason}.
        """
        self.lost = reason


class FakePolicy:
    """
    A stand-in L{IPolicyForHTTPS} recording the netlocs asked for.
    """

    def __init__(self):
        self.asked = []

    def creatorForNetloc(self, hostname, port):
        """
        Record the call; return a real creator so C{wrapClientTLS} accepts it.
        """
        from twisted.internet.ssl import optionsForClientTLS

        self.asked.append((hostname, port))
        return optionsForClientTLS(hostname.decode("ascii"))


SOCKS = ProxySpec(id="px", scheme="socks5h", host="10.9.9.9", port=1080)
SOCKS_AUTH = ProxySpec(
    id="px", scheme="socks5h", host="10.9.9.9", port=1080, username="bob", password="hunter2"
)
HTTP = ProxySpec(id="hp", scheme="http", host="10.9.9.9", port=3128)


class ProxyTunnelEndpointTests(SynchronousTestCase):
    """
    Tests for L{ProxyTunnelEndpoint} on a memory reactor.
    """

    def setUp(self):
        """
        A memory reactor with a clock, and a recording factory.
        """
        self.reactor = MemoryReactorClock()
        self.protocols = []

        def build():
            p = RecordingProtocol()
            self.protocols.append(p)
            return p

        self.factory = Factory.forProtocol(build)

    def endpoint(self, proxy=SOCKS, host="api.example", port=443, timeout=10, resolve=None):
        """
        @return: a L{ProxyTunnelEndpoint} dialling the proxy over the memory
            reactor.
        """
        return ProxyTunnelEndpoint(
            clock=self.reactor,
            proxyEndpoint=TCP4ClientEndpoint(self.reactor, proxy.host, proxy.port),
            proxy=proxy,
            host=host,
            port=port,
            timeout=timeout,
            resolve=resolve,
        )

    def accept(self):
        """
        Complete the pending TCP dial with a L{StringTransport}.

        @return: (the handshake protocol, its transport).
        """
        host, port, factory, _timeout, _bind = self.reactor.tcpClients[-1]
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def test_interfaces(self):
        """
        The endpoint and the Agent endpoint factory provide their interfaces.
        """
        self.assertTrue(verifyObject(IStreamClientEndpoint, self.endpoint()))
        self.assertTrue(
            verifyObject(IAgentEndpointFactory, ProxyAgentEndpointFactory(self.reactor, SOCKS, 10))
        )

    def test_dialsTheProxy(self):
        """
        The TCP dial goes to the proxy's host and port.
        """
        self.endpoint().connect(self.factory)
        self.assertEqual(self.reactor.tcpClients[0][:2], ("10.9.9.9", 1080))

    def test_connectionMadeOnlyAfterTunnel(self):
        """
        The wrapped protocol is built and sees C{connectionMade} only after
        the CONNECT reply; the Deferred then fires with it, and data that
        followed the reply reaches it.
        """
        d = self.endpoint().connect(self.factory)
        protocol, transport = self.accept()
        self.assertEqual(transport.value(), b"\x05\x01\x00")
        transport.clear()
        protocol.dataReceived(b"\x05\x00")
        self.assertEqual(transport.value(), b"\x05\x01\x00\x03\x0bapi.example\x01\xbb")
        self.assertEqual(self.protocols, [])
        self.assertNoResult(d)
        protocol.dataReceived(SOCKS_OK_IPV4 + b"early")
        inner = self.successResultOf(d)
        self.assertEqual(self.protocols, [inner])
        self.assertEqual(inner.made, 1)
        self.assertEqual(inner.data, b"early")
        self.assertIs(inner.transport, transport)

    def test_laterEventsForwarded(self):
        """
        After the tunnel is up, bytes, writes and the close pass through.
        """
        d = self.endpoint().connect(self.factory)
        protocol, transport = self.accept()
        protocol.dataReceived(b"\x05\x00" + SOCKS_OK_IPV4)
        inner = self.successResultOf(d)
        transport.clear()
        inner.transport.write(b"GET / HTTP/1.1\r\n")
        self.assertEqual(transport.value(), b"GET / HTTP/1.1\r\n")
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")
        self.assertEqual(inner.data, b"HTTP/1.1 200 OK\r\n")
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertTrue(inner.lost.check(ConnectionDone))

    def test_authenticationBytesOverTheWire(self):
        """
        With credentials the endpoint sends the RFC 1929 request.
        """
        d = self.endpoint(proxy=SOCKS_AUTH).connect(self.factory)
        protocol, transport = self.accept()
        self.assertEqual(transport.value(), b"\x05\x02\x00\x02")
        transport.clear()
        protocol.dataReceived(b"\x05\x02")
        self.assertEqual(transport.value(), b"\x01\x03bob\x07hunter2")
        protocol.dataReceived(b"\x01\x00" + SOCKS_OK_IPV4)
        self.successResultOf(d)

    def test_authenticationFailure(self):
        """
        A rejected password fails the Deferred with
        L{ProxyAuthenticationFailed}, aborts the connection, builds no
        protocol, and logs the proxy id without the password.
        """
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        d = self.endpoint(proxy=SOCKS_AUTH).connect(self.factory)
        protocol, transport = self.accept()
        protocol.dataReceived(b"\x05\x02")
        protocol.dataReceived(b"\x01\x01")
        f = self.failureResultOf(d, ProxyAuthenticationFailed)
        self.assertEqual(f.value.proxyId, "px")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.protocols, [])
        events = [e for e in events if e.get("event") == "relay.proxy_tunnel_failed"]
        self.assertEqual(len(events), 1)
        self.assertEqual(events[0]["proxy_id"], "px")
        self.assertNotIn("hunter2", repr(dict(events[0])))

    def test_socksReplyFailure(self):
        """
        SOCKS reply 0x05 fails with L{ProxyConnectFailed}
        C{connection refused}.
        """
        d = self.endpoint().connect(self.factory)
        protocol, transport = self.accept()
        protocol.dataReceived(b"\x05\x00\x05\x05")
        f = self.failureResultOf(d, ProxyConnectFailed)
        self.assertIn("connection refused", f.getErrorMessage())
        self.assertTrue(transport.disconnecting)

    def test_httpConnect(self):
        """
        Through an HTTP proxy the endpoint sends CONNECT and opens the
        tunnel on 200, passing along bytes after the head.
        """
        d = self.endpoint(proxy=HTTP, host="api.example", port=8443).connect(self.factory)
        protocol, transport = self.accept()
        self.assertTrue(transport.value().startswith(b"CONNECT api.example:8443 HTTP/1.1\r\n"))
        protocol.dataReceived(b"HTTP/1.1 200 Connection established\r\n\r\nhi")
        self.assertEqual(self.successResultOf(d).data, b"hi")

    def test_http407(self):
        """
        HTTP 407 fails with L{ProxyAuthenticationFailed}.
        """
        d = self.endpoint(proxy=HTTP).connect(self.factory)
        protocol, _ = self.accept()
        protocol.dataReceived(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
        f = self.failureResultOf(d, ProxyAuthenticationFailed)
        self.assertIn("proxy authentication required", f.getErrorMessage())

    def test_httpErrorBodyUntilClose(self):
        """
        A 5xx without C{Content-Length} is reported when the proxy closes,
        with the reason found in its body.
        """
        d = self.endpoint(proxy=HTTP).connect(self.factory)
        protocol, _ = self.accept()
        protocol.dataReceived(b"HTTP/1.1 500 Unable to connect\r\n\r\nConnection refused")
        self.assertNoResult(d)
        protocol.connectionLost(Failure(ConnectionDone()))
        f = self.failureResultOf(d, ProxyConnectFailed)
        self.assertIn("connection refused", f.getErrorMessage().lower())

    def test_timeoutDuringHandshake(self):
        """
        A proxy that never answers fails with L{ProxyTimeout} after the
        timeout on the clock, and the connection is aborted.
        """
        d = self.endpoint(timeout=5).connect(self.factory)
        _, transport = self.accept()
        self.reactor.advance(4.9)
        self.assertNoResult(d)
        self.reactor.advance(0.2)
        f = self.failureResultOf(d, ProxyTimeout)
        self.assertEqual(f.value.timeout, 5)
        self.assertEqual(f.value.proxyId, "px")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.protocols, [])

    def test_timeoutDuringDial(self):
        """
        The timeout also covers the TCP dial to the proxy: the pending
        connect is stopped.
        """
        d = self.endpoint(timeout=3).connect(self.factory)
        self.reactor.advance(3)
        self.failureResultOf(d, ProxyTimeout)
        self.assertTrue(self.reactor.connectors[0].stoppedConnecting)

    def test_timeoutCancelledOnSuccess(self):
        """
        A tunnel that opens in time leaves no pending timer.
        """
        d = self.endpoint(timeout=3).connect(self.factory)
        protocol, _ = self.accept()
        protocol.dataReceived(b"\x05\x00" + SOCKS_OK_IPV4)
        self.successResultOf(d)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_dialErrorPassesThrough(self):
        """
        A refused dial to the proxy fails with Twisted's own
        L{ConnectionRefusedError} (persistent by type, R3).
        """
        d = self.endpoint().connect(self.factory)
        factory = self.reactor.tcpClients[0][2]
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        self.failureResultOf(d, ConnectionRefusedError)

    def test_closedDuringHandshake(self):
        """
        A proxy that closes mid-handshake fails with a L{ProxyError}.
        """
        d = self.endpoint().connect(self.factory)
        protocol, _ = self.accept()
        protocol.connectionLost(Failure(ConnectionDone()))
        f = self.failureResultOf(d, ProxyError)
        self.assertIn("closed", f.getErrorMessage())

    def test_factoryRefuses(self):
        """
        A wrapped factory returning L{None} fails the connect and closes the
        tunnel.
        """
        factory = Factory.forProtocol(RecordingProtocol)
        factory.buildProtocol = lambda addr: None
        d = self.endpoint().connect(factory)
        protocol, transport = self.accept()
        protocol.dataReceived(b"\x05\x00" + SOCKS_OK_IPV4)
        self.failureResultOf(d, ProxyError)
        self.assertTrue(transport.disconnecting)

    def test_factoryRaises(self):
        """
        A wrapped factory raising fails the connect with its exception.
        """
        factory = Factory.forProtocol(RecordingProtocol)

        def boom(addr):
            raise ZeroDivisionError()

        factory.buildProtocol = boom
        d = self.endpoint().connect(factory)
        protocol, transport = self.accept()
        protocol.dataReceived(b"\x05\x00" + SOCKS_OK_IPV4)
        self.failureResultOf(d, ZeroDivisionError)
        self.assertTrue(transport.disconnecting)

    def test_cancel(self):
        """
        Cancelling the Deferred during the handshake aborts the connection.
        """
        d = self.endpoint().connect(self.factory)
        protocol, transport = self.accept()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(transport.disconnecting)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.protocols, [])

    def test_socks5ResolvesLocally(self):
        """
        Scheme C{socks5} resolves the host with the injected resolver and
        sends an IPv4 address (ATYP 1).
        """
        asked = []

        def resolve(name):
            asked.append(name)
            return succeed("192.0.2.7")

        proxy = ProxySpec(id="l", scheme="socks5", host="10.9.9.9", port=1080)
        self.endpoint(proxy=proxy, host="api.example", resolve=resolve).connect(self.factory)
        protocol, transport = self.accept()
        transport.clear()
        protocol.dataReceived(b"\x05\x00")
        self.assertEqual(asked, ["api.example"])
        self.assertEqual(transport.value(), b"\x05\x01\x00\x01\xc0\x00\x02\x07\x01\xbb")

    def test_socks5ResolveTimeout(self):
        """
        A resolution that hangs is bounded by the same timeout.
        """
        proxy = ProxySpec(id="l", scheme="socks5", host="10.9.9.9", port=1080)
        d = self.endpoint(proxy=proxy, timeout=2, resolve=lambda name: Deferred()).connect(
            self.factory
        )
        self.reactor.advance(2)
        self.failureResultOf(d, ProxyTimeout)
        self.assertEqual(self.reactor.tcpClients, [])

    def test_socks5LiteralNeedsNoResolver(self):
        """
        Scheme C{socks5} with an address literal dials without resolving.
        """
        proxy = ProxySpec(id="l", scheme="socks5", host="10.9.9.9", port=1080)
        self.endpoint(proxy=proxy, host="127.0.0.1").connect(self.factory)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_proxyEndpointFactoryFunction(self):
        """
        L{proxyEndpoint} builds a L{ProxyTunnelEndpoint} and rejects unknown
        schemes.
        """
        self.assertIsInstance(proxyEndpoint(self.reactor, SOCKS, "h", 443, 10), ProxyTunnelEndpoint)
        bad = ProxySpec(id="b", scheme="socks4", host="h", port=1)
        self.assertRaises(ValueError, proxyEndpoint, self.reactor, bad, "h", 443, 10)


class AgentAndWebSocketEndpointTests(SynchronousTestCase):
    """
    Tests for L{ProxyAgentEndpointFactory} and L{webSocketEndpoint}.
    """

    def setUp(self):
        """
        A memory reactor and a recording TLS policy.
        """
        self.reactor = MemoryReactorClock()
        self.policy = FakePolicy()

    def test_httpsUsesPolicyForUpstreamHost(self):
        """
        An C{https} URI gets a TLS endpoint whose creator comes from the
        policy for the upstream host (not the proxy).
        """
        factory = ProxyAgentEndpointFactory(self.reactor, SOCKS, 10, self.policy)
        endpoint = factory.endpointForURI(URI.fromBytes(b"https://api.example/v1/responses"))
        self.assertNotIsInstance(endpoint, ProxyTunnelEndpoint)
        self.assertEqual(self.policy.asked, [(b"api.example", 443)])

    def test_httpIsPlainTunnel(self):
        """
        An C{http} URI gets the plain tunnel endpoint.
        """
        factory = ProxyAgentEndpointFactory(self.reactor, HTTP, 10, self.policy)
        endpoint = factory.endpointForURI(URI.fromBytes(b"http://api.example:8080/x"))
        self.assertIsInstance(endpoint, ProxyTunnelEndpoint)
        self.assertEqual(self.policy.asked, [])

    def test_unsupportedScheme(self):
        """
        Other URI schemes are rejected.
        """
        factory = ProxyAgentEndpointFactory(self.reactor, HTTP, 10)
        self.assertRaises(ValueError, factory.endpointForURI, URI.fromBytes(b"ftp://h/x"))

    def test_webSocketSecure(self):
        """
        A C{wss} URL gets TLS for its host and default port 443.
        """
        webSocketEndpoint(self.reactor, SOCKS, "wss://chatgpt.example/backend", 10, self.policy)
        self.assertEqual(self.policy.asked, [(b"chatgpt.example", 443)])

    def test_webSocketPlain(self):
        """
        A C{ws} URL gets the plain tunnel to port 80.
        """
        endpoint = webSocketEndpoint(self.reactor, SOCKS, "ws://h.example/x", 10, self.policy)
        self.assertIsInstance(endpoint, ProxyTunnelEndpoint)
        self.assertEqual(self.policy.asked, [])

    def test_noProxyIsDirect(self):
        """
        Without a proxy the endpoints connect directly (still TLS for
        C{wss}).
        """
        endpoint = webSocketEndpoint(self.reactor, None, "ws://h.example:81/x", 10)
        self.assertNotIsInstance(endpoint, ProxyTunnelEndpoint)


class ClassificationTests(SynchronousTestCase):
    """
    The errors of this module land in the right R3 class of
    L{relay.policy.classify.isPersistentTransport}.
    """

    def classify(self, data: bytes, negotiation=None) -> bool:
        """
        @return: the R3 verdict for the error C{data} provokes.
        """
        from relay.policy.classify import isPersistentTransport

        if negotiation is None:
            negotiation = Socks5Negotiation("h", 1, "u", "p")
        try:
            negotiation.dataReceived(data)
        except ProxyError as e:
            return isPersistentTransport(Failure(e))
        self.fail("no error")

    def test_persistent(self):
        """
        R3: SOCKS5 auth rejected, no acceptable method, HTTP 407/401 and
        SOCKS replies 0x03/0x04/0x05 are persistent.
        """
        self.assertTrue(self.classify(b"\x05\x02\x01\x01"))
        self.assertTrue(self.classify(b"\x05\xff"))
        for code in (3, 4, 5):
            self.assertTrue(self.classify(b"\x05\x00\x05" + bytes([code])), code)
        for status in (b"407", b"401"):
            self.assertTrue(
                self.classify(b"HTTP/1.1 " + status + b" X\r\n\r\n", HTTPConnectNegotiation("h", 1))
            )

    def test_transient(self):
        """
        R3: SOCKS general failure, HTTP 502 without a reason, a timeout and a
        close mid-handshake are transient.
        """
        from relay.policy.classify import isPersistentTransport

        self.assertFalse(self.classify(b"\x05\x00\x05\x01"))
        self.assertFalse(
            self.classify(
                b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n",
                HTTPConnectNegotiation("h", 1),
            )
        )
        self.assertFalse(isPersistentTransport(Failure(ProxyTimeout("timed out", "p", 10))))
        self.assertFalse(isPersistentTransport(Failure(Socks5Negotiation("h", 1).connectionLost())))

    def test_dialRefusedIsPersistent(self):
        """
        R3: the proxy port refusing is persistent by type.
        """
        from relay.policy.classify import isPersistentTransport

        self.assertTrue(isPersistentTransport(Failure(ConnectionRefusedError())))
