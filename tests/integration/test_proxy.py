"""
Integration tests for L{relay.upstream.proxy} against real proxies
(C{microsocks} with and without credentials, C{tinyproxy} with BasicAuth),
a real twisted.web server and a real TLS server with a CA made at test
time. Every port and process is closed at teardown.
"""

from __future__ import annotations

import warnings

import pytest
import pytest_twisted
import treq
from cryptography.hazmat.primitives import serialization
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import wrapClientTLS
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import Certificate, PrivateCertificate, optionsForClientTLS
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    ResponseNeverReceived,
)
from twisted.web.resource import Resource
from twisted.web.server import Site

from relay.upstream.proxy import (
    ProxyAgentEndpointFactory,
    ProxyAuthenticationFailed,
    ProxyConnectFailed,
    proxyEndpoint,
    webSocketEndpoint,
)
from tests.integration.proxy_servers import freePort, startMicrosocks, startTinyproxy
from tests.integration.tlsca import _keyPEM, makeCA, makeLeaf

TIMEOUT = 10
"""Seconds any single await in these tests may take."""


def getReactor():
    """
    @return: the running reactor (pytest-twisted's).
    """
    from twisted.internet import reactor

    return reactor


# ---------------------------------------------------------------------------
# Fixtures: proxies, a web server, a test CA
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def socksOpen():
    """
    C{microsocks} without authentication.
    """
    server = startMicrosocks()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def socksAuth():
    """
    C{microsocks -u alice -P wonderland}.
    """
    server = startMicrosocks("alice", "wonderland")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def httpProxy():
    """
    C{tinyproxy} with C{BasicAuth user pass}.
    """
    server = startTinyproxy("user", "pass")
    yield server
    server.stop()


class PeerResource(Resource):
    """
    Answers every GET with C{peer=<address of the TCP peer>}.
    """

    isLeaf = True

    def render_GET(self, request):
        """
        @return: the peer's host, so tests can see the proxy dialled us.
        """
        return b"peer=" + request.getClientAddress().host.encode("ascii")


def makeTestCA():
    """
    A CA and a leaf certificate for C{localhost} (the shared builders in
    L{tests.integration.tlsca}).

    @return: (CA certificate PEM, leaf key+certificate PEM).
    """
    caKey, caCert = makeCA()
    leafKey, leafCert = makeLeaf(caKey, caCert, ("localhost",))
    caPEM = caCert.public_bytes(serialization.Encoding.PEM)
    return caPEM, _keyPEM(leafKey) + leafCert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def testCA():
    """
    (trust root L{Certificate}, server L{PrivateCertificate}) for
    C{localhost}.
    """
    caPEM, leafPEM = makeTestCA()
    return Certificate.loadPEM(caPEM), PrivateCertificate.loadPEM(leafPEM)


def serverOptions(certificate: PrivateCertificate):
    """
    Server TLS options with the OpenSSL context built now.

    Twisted 26.10's L{CertificateOptions} hands pyOpenSSL C{X509} objects to
    C{Context.use_certificate}, which pyOpenSSL deprecates; under our
    C{filterwarnings = error} that would break the first handshake inside the
    reactor. Building the (cached) context here, with that one warning
    ignored, keeps it out of the reactor.

    @param certificate: the server's certificate and key.
    @return: the options, with their context cached.
    """
    options = certificate.options()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Passing pyOpenSSL", DeprecationWarning)
        options.getContext()
    return options


class Servers:
    """
    Tracks listening ports and client pools to close after a test.
    """

    def __init__(self):
        self.ports = []
        self.pools = []

    def listenHTTP(self, resource=None, tls=None) -> int:
        """
        Serve C{resource} (default L{PeerResource}) on 127.0.0.1.

        @param tls: a L{PrivateCertificate} to serve TLS with, or L{None}.
        @return: the port number.
        """
        site = Site(resource or PeerResource())
        return self.listen(site, tls)

    def listen(self, factory, tls=None) -> int:
        """
        Listen with C{factory} on 127.0.0.1, port 0.

        @return: the port number.
        """
        reactor = getReactor()
        if tls is None:
            port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        else:
            port = reactor.listenSSL(0, factory, serverOptions(tls), interface="127.0.0.1")
        self.ports.append(port)
        return port.getHost().port

    def agent(self, proxy, tlsPolicy=None) -> Agent:
        """
        @return: an L{Agent} sending through C{proxy}.
        """
        reactor = getReactor()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.pools.append(pool)
        factory = ProxyAgentEndpointFactory(reactor, proxy, TIMEOUT, tlsPolicy)
        return Agent.usingEndpointFactory(reactor, factory, pool=pool)

    async def close(self):
        """
        Close pools and stop listening.
        """
        for pool in self.pools:
            await pool.closeCachedConnections()
        for port in self.ports:
            await port.stopListening()


@pytest.fixture
def servers():
    """
    A L{Servers} closed at teardown.
    """
    s = Servers()
    yield s
    pytest_twisted.blockon(Deferred.fromCoroutine(s.close()))


async def get(agent, url: str):
    """
    GET C{url}.

    @return: (status, body).
    """
    reactor = getReactor()
    response = await agent.request(b"GET", url.encode("ascii")).addTimeout(TIMEOUT, reactor)
    # treq's collector, not readBody: on Twisted 26.10 readBody warns
    # (DeprecationWarning, an error under our pytest config) because Agent's
    # TransportProxyProducer has no abortConnection.
    body = await treq.content(response).addTimeout(TIMEOUT, reactor)
    return response.code, body


async def failureOf(d: Deferred):
    """
    @return: the exception C{d} fails with (fails the test on success).
    """
    try:
        result = await d.addTimeout(TIMEOUT, getReactor())
    except Exception as e:
        return e
    pytest.fail(f"expected a failure, got {result!r}")


# ---------------------------------------------------------------------------
# SOCKS5 through microsocks
# ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_socks5hGetNoAuth(socksOpen, servers):
    """
    An HTTP GET through an unauthenticated SOCKS5 proxy succeeds, and the
    server's TCP peer is the proxy (on 127.0.0.1).
    """
    port = servers.listenHTTP()
    status, body = await get(servers.agent(socksOpen.spec()), f"http://127.0.0.1:{port}/")
    assert (status, body) == (200, b"peer=127.0.0.1")


@pytest_twisted.ensureDeferred
async def test_socks5hSendsHostName(socksOpen, servers):
    """
    C{socks5h} sends the host name C{localhost}; the proxy resolves it.
    """
    port = servers.listenHTTP()
    status, _ = await get(servers.agent(socksOpen.spec()), f"http://localhost:{port}/")
    assert status == 200


@pytest_twisted.ensureDeferred
async def test_socks5ResolvesLocally(socksOpen, servers):
    """
    C{socks5} resolves C{localhost} with the reactor's resolver first.
    """
    port = servers.listenHTTP()
    agent = servers.agent(socksOpen.spec(scheme="socks5"))
    status, _ = await get(agent, f"http://localhost:{port}/")
    assert status == 200


@pytest_twisted.ensureDeferred
async def test_socks5AuthGet(socksAuth, servers):
    """
    With the right RFC 1929 credentials the GET succeeds.
    """
    port = servers.listenHTTP()
    status, body = await get(servers.agent(socksAuth.spec()), f"http://127.0.0.1:{port}/")
    assert (status, body) == (200, b"peer=127.0.0.1")


@pytest_twisted.ensureDeferred
async def test_socks5WrongPassword(socksAuth, servers):
    """
    A wrong password fails with L{ProxyAuthenticationFailed} carrying the
    R3 marker C{authentication failed}, also through an Agent.
    """
    port = servers.listenHTTP()
    spec = socksAuth.spec(id="bad-pass", password="nope")
    e = await failureOf(
        proxyEndpoint(getReactor(), spec, "127.0.0.1", port, TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ProxyAuthenticationFailed)
    assert "authentication failed" in str(e).lower()
    assert "nope" not in str(e)
    assert e.proxyId == "bad-pass"
    e = await failureOf(servers.agent(spec).request(b"GET", f"http://127.0.0.1:{port}/".encode()))
    assert isinstance(e, ProxyAuthenticationFailed)


@pytest_twisted.ensureDeferred
async def test_socks5MissingCredentials(socksAuth, servers):
    """
    Offering no credentials to a proxy that needs them is an
    authentication failure (method 0xFF).
    """
    spec = socksAuth.spec()
    spec = type(spec)(id=spec.id, scheme=spec.scheme, host=spec.host, port=spec.port)
    e = await failureOf(
        proxyEndpoint(getReactor(), spec, "127.0.0.1", 9, TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ProxyAuthenticationFailed)
    assert "authentication failed" in str(e).lower()


@pytest_twisted.ensureDeferred
async def test_socks5TargetRefused(socksOpen):
    """
    A closed target port behind SOCKS fails with L{ProxyConnectFailed}
    C{connection refused} (reply 0x05).
    """
    closed = freePort()
    e = await failureOf(
        proxyEndpoint(getReactor(), socksOpen.spec(), "127.0.0.1", closed, TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ProxyConnectFailed)
    assert e.code == 5
    assert "connection refused" in str(e).lower()


@pytest_twisted.ensureDeferred
async def test_proxyPortClosed(socksOpen):
    """
    A proxy that is not listening fails with Twisted's
    L{ConnectionRefusedError} (persistent by type, R3).
    """
    spec = socksOpen.spec()
    spec = type(spec)(id="gone", scheme="socks5h", host="127.0.0.1", port=freePort())
    e = await failureOf(
        proxyEndpoint(getReactor(), spec, "127.0.0.1", 80, TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ConnectionRefusedError)


# ---------------------------------------------------------------------------
# HTTP CONNECT through tinyproxy
# ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_httpConnectGet(httpProxy, servers):
    """
    An HTTP GET through tinyproxy's CONNECT with BasicAuth succeeds, and the
    server's peer is the proxy on 127.0.0.1.
    """
    port = servers.listenHTTP()
    status, body = await get(servers.agent(httpProxy.spec()), f"http://127.0.0.1:{port}/")
    assert (status, body) == (200, b"peer=127.0.0.1")


@pytest_twisted.ensureDeferred
async def test_httpConnectWrongPassword(httpProxy, servers):
    """
    A wrong password (tinyproxy answers 401) or none at all (407) fails
    with L{ProxyAuthenticationFailed} carrying C{proxy authentication
    required}.
    """
    port = servers.listenHTTP()
    spec = httpProxy.spec(password="wrong")
    e = await failureOf(
        proxyEndpoint(getReactor(), spec, "127.0.0.1", port, TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ProxyAuthenticationFailed)
    assert "proxy authentication required" in str(e).lower()
    assert "wrong" not in str(e)
    bare = type(spec)(id="nocred", scheme="http", host=spec.host, port=spec.port)
    e = await failureOf(
        proxyEndpoint(getReactor(), bare, "127.0.0.1", port, TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ProxyAuthenticationFailed)
    assert "407" in str(e)


@pytest_twisted.ensureDeferred
async def test_httpConnectTargetRefused(httpProxy):
    """
    A closed target behind tinyproxy fails with L{ProxyConnectFailed}
    status 500. tinyproxy 1.11 says only C{Unable to connect} (no reason in
    the body), so the text carries no R3 persistent marker: transient.
    """
    e = await failureOf(
        proxyEndpoint(getReactor(), httpProxy.spec(), "127.0.0.1", freePort(), TIMEOUT).connect(
            Factory.forProtocol(Protocol)
        )
    )
    assert isinstance(e, ProxyConnectFailed)
    assert e.status == 500
    assert "unable to connect" in str(e).lower()
    markers = ("authentication", "connection refused", "no route", "unreachable", "no such")
    assert not [m for m in markers if m in str(e).lower()]


# ---------------------------------------------------------------------------
# TLS inside the tunnel
# ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("which", ["socksOpen", "socksAuth", "httpProxy"])
async def test_httpsThroughTunnel(which, request, testCA, servers):
    """
    HTTPS through each proxy verifies the upstream certificate for
    C{localhost} against the test CA inside the tunnel.
    """
    proxy = request.getfixturevalue(which)
    ca, leaf = testCA
    port = servers.listenHTTP(tls=leaf)
    agent = servers.agent(proxy.spec(), BrowserLikePolicyForHTTPS(trustRoot=ca))
    status, body = await get(agent, f"https://localhost:{port}/")
    assert (status, body) == (200, b"peer=127.0.0.1")


@pytest_twisted.ensureDeferred
async def test_httpsNameMismatch(socksOpen, testCA, servers):
    """
    The same server reached as C{127.0.0.1} (not in the certificate)
    fails verification: TLS checks the upstream name, not the proxy's.
    """
    ca, leaf = testCA
    port = servers.listenHTTP(tls=leaf)
    agent = servers.agent(socksOpen.spec(), BrowserLikePolicyForHTTPS(trustRoot=ca))
    e = await failureOf(agent.request(b"GET", f"https://127.0.0.1:{port}/".encode()))
    assert isinstance(e, ResponseNeverReceived)


@pytest_twisted.ensureDeferred
async def test_httpsUntrustedCA(httpProxy, testCA, servers):
    """
    Without the test CA as trust root the certificate is rejected.
    """
    _, leaf = testCA
    port = servers.listenHTTP(tls=leaf)
    otherCA = Certificate.loadPEM(makeTestCA()[0])
    agent = servers.agent(httpProxy.spec(), BrowserLikePolicyForHTTPS(trustRoot=otherCA))
    e = await failureOf(agent.request(b"GET", f"https://localhost:{port}/".encode()))
    assert isinstance(e, ResponseNeverReceived)


class LineClient(Protocol):
    """
    Sends one HTTP/1.0 request on C{connectionMade} and collects the
    answer until the server closes.

    @ivar done: fires with the whole answer, or fails with the close reason
        when the connection broke (e.g. a TLS verification error).
    """

    def __init__(self):
        self.done = Deferred()
        self.data = b""

    def connectionMade(self):
        """
        Send the request.
        """
        self.transport.write(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")

    def dataReceived(self, data):
        """
        Collect.
        """
        self.data += data

    def connectionLost(self, reason):
        """
        Fire L{done}.
        """
        from twisted.internet.error import ConnectionDone

        if reason.check(ConnectionDone) and self.data:
            self.done.callback(self.data)
        else:
            self.done.errback(reason)


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("serverName,ok", [("localhost", True), ("wrong.example", False)])
async def test_wrapClientTLSOverProxyEndpoint(serverName, ok, socksAuth, testCA, servers):
    """
    C{wrapClientTLS(optionsForClientTLS(name, trustRoot), proxyEndpoint(...))}
    verifies C{name}, independent of the tunnel's target address: the
    right name succeeds, a wrong one fails.
    """
    ca, leaf = testCA
    port = servers.listenHTTP(tls=leaf)
    endpoint = wrapClientTLS(
        optionsForClientTLS(serverName, trustRoot=ca),
        proxyEndpoint(getReactor(), socksAuth.spec(), "127.0.0.1", port, TIMEOUT),
    )
    client = await endpoint.connect(Factory.forProtocol(LineClient)).addTimeout(
        TIMEOUT, getReactor()
    )
    if ok:
        answer = await client.done.addTimeout(TIMEOUT, getReactor())
        assert answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b"peer=127.0.0.1")
    else:
        e = await failureOf(client.done)
        assert "certificate" in repr(e).lower() or "verif" in repr(e).lower()


# ---------------------------------------------------------------------------
# WebSocket through the proxy
# ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("which,secure", [("socksAuth", False), ("httpProxy", True)])
async def test_webSocketThroughProxy(which, secure, request, testCA, servers):
    """
    An autobahn client connected with L{webSocketEndpoint} talks to an
    autobahn echo server through the proxy (C{ws} over SOCKS5, C{wss} over
    HTTP CONNECT with the test CA).
    """
    from autobahn.twisted.websocket import (
        WebSocketClientFactory,
        WebSocketClientProtocol,
        WebSocketServerFactory,
        WebSocketServerProtocol,
    )

    reactor = getReactor()
    proxy = request.getfixturevalue(which)
    ca, leaf = testCA

    class Echo(WebSocketServerProtocol):
        """
        Echoes every message.
        """

        def onMessage(self, payload, isBinary):
            """
            Send it back.
            """
            self.sendMessage(payload, isBinary)

    serverFactory = WebSocketServerFactory(reactor=reactor)
    serverFactory.protocol = Echo
    port = servers.listen(serverFactory, tls=leaf if secure else None)
    echoed = Deferred()
    closed = Deferred()

    class Client(WebSocketClientProtocol):
        """
        Sends one message and records the echo.
        """

        def onOpen(self):
            """
            Say hello.
            """
            self.sendMessage(b"hello through the proxy")

        def onMessage(self, payload, isBinary):
            """
            Record the echo and close.
            """
            echoed.callback(payload)
            self.sendClose(1000)

        def onClose(self, wasClean, code, reason):
            """
            Note the close.
            """
            if not closed.called:
                closed.callback(wasClean)

    url = f"{'wss' if secure else 'ws'}://localhost:{port}/"
    clientFactory = WebSocketClientFactory(url, reactor=reactor)
    clientFactory.protocol = Client
    endpoint = webSocketEndpoint(
        reactor, proxy.spec(), url, TIMEOUT, BrowserLikePolicyForHTTPS(trustRoot=ca)
    )
    await endpoint.connect(clientFactory).addTimeout(TIMEOUT, reactor)
    assert await echoed.addTimeout(TIMEOUT, reactor) == b"hello through the proxy"
    await closed.addTimeout(TIMEOUT, reactor)
