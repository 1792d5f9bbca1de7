"""
Tests for the factories relay dials upstream with (L{relay.upstream.http},
L{relay.upstream.httpclient}, L{relay.upstream.ws}): they are quiet, so an
upstream call does not log Twisted's "Starting factory" / "Stopping
factory" lines at info level.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import _HTTP11ClientFactory

from relay.base.records import Account, ProxySpec, UpstreamSettings
from relay.upstream.http import HTTPDialer, QuietConnectionPool
from relay.upstream.httpclient import _ConnectionFactory
from relay.upstream.ws import upstreamFactory


class _StartingEndpoint:
    """
    An endpoint that starts the factory it is given, as a real connect does,
    and never connects.
    """

    def __init__(self):
        self.factories = []

    def connect(self, factory):
        """
        Start C{factory}; the connection never comes.
        """
        self.factories.append(factory)
        factory.doStart()
        return Deferred()


class QuietFactoryTests(SynchronousTestCase):
    """
    Starting and stopping the factories of upstream dials logs nothing.
    """

    def assertQuiet(self, factory) -> None:
        """
        C{factory.doStart()} and C{doStop()} log nothing.
        """
        with capturedLogs() as logs:
            factory.doStart()
            factory.doStop()
        self.assertEqual([e.get("log_format") for e in logs], [], factory)

    def test_leanClient(self):
        """
        The lean keep-alive client's per-dial factory (direct upstreams).
        """
        self.assertQuiet(_ConnectionFactory(None, ("http", "127.0.0.1", 1)))

    def test_upstreamWebSocket(self):
        """
        The autobahn factory of an upstream WebSocket dial.
        """
        self.assertQuiet(upstreamFactory(Clock(), "ws://127.0.0.1:1/v1/responses", {}, 10))

    def test_proxiedPool(self):
        """
        L{QuietConnectionPool} (treq through egress proxies, the OAuth token
        endpoint) starts quiet factories for its connections; it relies on
        twisted.web's C{HTTPConnectionPool._factory}, pinned here.
        """
        pool = QuietConnectionPool(Clock(), persistent=False)
        self.assertTrue(issubclass(pool._factory, _HTTP11ClientFactory))
        endpoint = _StartingEndpoint()
        with capturedLogs() as logs:
            pool.getConnection(("http", b"127.0.0.1", 1), endpoint)
        self.assertEqual(len(endpoint.factories), 1)
        self.assertEqual([e.get("log_format") for e in logs], [])

    def test_takesPieces(self):
        """
        The HTTP dialer declares L{IPiecesDialer}: a spliced body reaches it
        as pieces; through a proxy (treq) they are joined first.
        """
        from zope.interface.verify import verifyObject

        from relay.interfaces import IPiecesDialer

        dialer = HTTPDialer(reactor=MemoryReactorClock())
        self.assertTrue(verifyObject(IPiecesDialer, dialer))
        proxy = ProxySpec(id="p1", scheme="socks5", host="127.0.0.1", port=1080)
        account = Account(id="a1", type="apikey", base_url="http://u/v1", credential="c",
                          proxy=proxy)
        sent = []

        class Client:
            def request(self, method, url, **kw):
                sent.append(kw["data"])
                from twisted.internet.defer import Deferred
                return Deferred()

        self.patch(HTTPDialer, "_clientFor", lambda self, account, timeouts: Client())
        dialer.request(account, b"POST", "/responses", [b'{"a"', memoryview(b':1}')],
                       {}, UpstreamSettings())
        self.assertEqual(sent, [b'{"a":1}'])

    def test_dialerUsesTheQuietPool(self):
        """
        The HTTP dialer's treq clients (one per proxy) use
        L{QuietConnectionPool}.
        """
        dialer = HTTPDialer(reactor=MemoryReactorClock())
        proxy = ProxySpec(id="p1", scheme="socks5", host="127.0.0.1", port=1080)
        account = Account(id="a1", type="apikey", base_url="http://u/v1", credential="c",
                          proxy=proxy)
        dialer._clientFor(account, UpstreamSettings())
        self.assertTrue(dialer._pools)
        for pool in dialer._pools:
            self.assertIsInstance(pool, QuietConnectionPool)


class HeaderTimeoutTests(SynchronousTestCase):
    """
    The direct path's header timeout (connect + header seconds): the dial
    is cancelled and fails with L{relay.upstream.http.HeaderTimeout}.
    """

    def test_timesOut(self):
        """
        No head in time: cancelled, failing with C{HeaderTimeout}.
        """
        from relay.upstream.http import HeaderTimeout, _headerTimeout

        clock = Clock()
        cancelled = []
        d = _headerTimeout(Deferred(cancelled.append), 5.0, clock)
        clock.advance(4.9)
        self.assertNoResult(d)
        clock.advance(0.1)
        self.assertEqual(len(cancelled), 1)
        failure = self.failureResultOf(d, HeaderTimeout)
        self.assertIn("within 5s", str(failure.value))

    def test_headInTime(self):
        """
        A head in time passes through and the timer is gone; a cancel by
        someone else (the client left) stays a cancellation.
        """
        from twisted.internet.defer import CancelledError

        from relay.upstream.http import _headerTimeout

        clock = Clock()
        d = Deferred()
        result = _headerTimeout(d, 5.0, clock)
        d.callback("head")
        self.assertEqual(self.successResultOf(result), "head")
        self.assertEqual(clock.getDelayedCalls(), [])
        other = _headerTimeout(Deferred(), 5.0, clock)
        other.cancel()
        self.failureResultOf(other, CancelledError)
        self.assertEqual(clock.getDelayedCalls(), [])
