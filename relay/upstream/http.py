# -*- test-case-name: tests.test_upstream_http -*-
"""
The built-in upstream HTTP dialer: the lean keep-alive client of
L{relay.upstream.httpclient} for direct upstreams, treq over a persistent
L{HTTPConnectionPool} through egress proxies; real TLS (C{optionsForClientTLS} through Agent's
default policy), per-account auth headers, connect and response-header
timeouts, and per-account egress proxies.

It never retries by itself: C{retryAutomatically} is off
(architecture.md invariant 3).
"""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING, Optional

from attrs import define, field
from hyperlink import EncodedURL
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.web.client import Agent, HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

if TYPE_CHECKING:
    from treq.client import HTTPClient

from relay.interfaces import IPiecesDialer, IUpstreamResponse
from relay.upstream.httpclient import (
    BodyCollector,
    ConnectionPool,
    Target,
    _timeoutFail,
    requestPieces,
)
from relay.upstream.httpclient import HeaderTimeout, _headerTimeout  # noqa: F401 - named here too
from relay.base.records import Account, UpstreamSettings
from relay.upstream.headers import (
    BOTH,
    CODEX_VERSION,
    DEFAULT_ORIGINATOR,
    forwardedFor,
    isCodex,
)

FORWARDED_HEADERS = tuple(
    {n: None for t in ("http", "websocket") for a in BOTH for n in forwardedFor(t, a)}
)
"""Every client spelling that may travel upstream, on either transport and
account type: the names of L{relay.upstream.headers.UPSTREAM_HEADERS}
(behaviour.md R112, protocol.md 7.2). Everything else -- Authorization,
x-api-key, cookies, hop-by-hop headers -- stays behind (architecture.md
invariant 7)."""


class _QuietClientFactory(_HTTP11ClientFactory):
    """
    twisted.web's per-connection client factory without its "Starting
    factory" / "Stopping factory" info lines.
    """

    noisy = False


class QuietConnectionPool(HTTPConnectionPool):
    """
    An L{HTTPConnectionPool} whose connections' factories are quiet: Twisted
    logs every new connection's factory start and stop at info level, two
    lines per upstream call through a proxy or to the token endpoint. Relies
    on the pool's C{_factory} class attribute (Twisted 26;
    C{tests.test_upstream_http} pins it).
    """

    _factory = _QuietClientFactory


class UpstreamBodyTooLarge(Exception):
    """
    A body read hit its limit.
    """


def upstreamHeaders(account: Account, clientHeaders: dict, transport: str = "http") -> dict:
    """
    Build the upstream request headers for C{account}.

    @param account: the L{Account}; its credential goes into
        C{Authorization}, OAuth accounts add C{chatgpt-account-id}.
    @param clientHeaders: lower-cased headers from the engine: only the
        spellings L{relay.upstream.headers.UPSTREAM_HEADERS} lets through
        on C{transport} for the account's type are copied, plus C{accept},
        which the engine sets from the body's C{stream} flag (protocol.md
        2.1).
    @param transport: C{http}, or C{websocket} for a handshake.
    @return: a dict of str -> str. On an OAuth account a client that is
        not Codex gets relay's C{originator} and C{version} (R112).
    """
    headers = {}
    allowed = forwardedFor(transport, account.type)
    # The client's few forwarded names, in FORWARDED_HEADERS'
    # order (what a look-up of every name in that order gives).
    names = [name for name in clientHeaders if name in allowed]
    if len(names) > 1:
        names.sort(key=allowed.__getitem__)
    for name in names:
        value = clientHeaders[name]
        if value is not None:
            headers[name] = value
    headers["authorization"] = "Bearer " + account.credential
    # the engine's own (a multipart edit, R115), never the client's
    headers["content-type"] = clientHeaders.get("content-type") or "application/json"
    headers["accept"] = clientHeaders.get("accept", "text/event-stream")
    if account.type == "oauth":
        if account.chatgpt_account_id:
            headers["chatgpt-account-id"] = account.chatgpt_account_id
        if not isCodex(headers.get("originator")):
            headers["originator"] = DEFAULT_ORIGINATOR
            headers["version"] = CODEX_VERSION
    return headers


@implementer(IUpstreamResponse)
@define(eq=False)
class UpstreamResponse:
    """
    A treq response whose body is still unread.

    @ivar code: the HTTP status.
    @ivar headers: lower-cased name -> first value.
    """

    _response: object
    _clock: object
    code: int = 0
    headers: dict = field(factory=dict)
    _delivered: bool = False
    _transport: object = None

    @classmethod
    def wrap(cls, response, clock) -> "UpstreamResponse":
        """
        @param response: a treq or twisted.web response.
        @param clock: an L{IReactorTime} for body-read timeouts.
        """
        headers = {}
        for name, values in response.headers.getAllRawHeaders():
            headers[name.decode("latin-1").lower()] = values[0].decode("latin-1")
        return cls(response=response, clock=clock, code=response.code, headers=headers)

    def deliverBody(self, protocol) -> None:
        """
        See L{IUpstreamResponse.deliverBody}.
        """
        self._delivered = True
        original = protocol.makeConnection

        def makeConnection(transport):
            self._transport = transport
            original(transport)

        protocol.makeConnection = makeConnection
        self._response.deliverBody(protocol)

    def readBody(self, limit: int) -> Deferred:
        """
        See L{IUpstreamResponse.readBody}. Stops reading (and drops the
        connection) once C{limit} bytes are in.
        """
        collector = BodyCollector(limit)
        self.deliverBody(collector)
        return collector.done

    def abort(self) -> None:
        """
        See L{IUpstreamResponse.abort}.
        """
        if self._transport is not None:
            self._transport.stopProducing()
        elif not self._delivered:
            self.deliverBody(_Abort())


class _Abort(Protocol):
    """
    Drops the body at once.
    """

    def connectionMade(self) -> None:
        self.transport.stopProducing()

    def connectionLost(self, reason) -> None:
        reason.trap(Exception)


class _PreparedURL(EncodedURL):
    """
    An upstream URL already in the URI form treq sends, parsed once per
    account and path: treq calls C{to_uri().to_text()} on every request,
    which re-runs IDNA over the host each time. The URI form of a URI is
    itself, so this returns itself and its remembered text.
    """

    _uriText = ""

    def to_uri(self):
        return self

    def to_text(self, with_password=False):
        if with_password:
            return super().to_text(with_password)
        return self._uriText


def _prepareURL(url: str):
    """
    @return: a L{_PreparedURL} that treq turns into exactly the bytes it
        would send for C{url}, or C{url} itself should the two ever differ.
    """
    text = EncodedURL.from_text(url).to_uri().to_text()
    prepared = _PreparedURL.from_text(text)
    prepared._uriText = text
    if EncodedURL.to_text(prepared) != text:
        return url
    return prepared


@implementer(IAgentEndpointFactory)
class _EndpointCache:
    """
    Remembers Agent's endpoint (and, for https, its TLS connection creator)
    per scheme, host and port. Agent builds both for every request even when
    the pool hands back an idle connection; they are reusable, and only
    used to open a new connection.
    """

    def __init__(self, factory) -> None:
        self._factory = factory
        self._endpoints: dict = {}

    def endpointForURI(self, uri):
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            endpoint = self._endpoints[key] = self._factory.endpointForURI(uri)
        return endpoint


@implementer(IPiecesDialer)
@define(eq=False)
class HTTPDialer:
    """
    The built-in L{IUpstreamDialer} for HTTP upstreams.

    @ivar _reactor: the reactor (connects, timers).
    @ivar _trustRoot: optional TLS trust root (tests with a local CA);
        L{None} uses the platform trust store.
    @ivar _maxPersistentPerHost: idle connections kept per upstream host.
    """

    _reactor: object
    _trustRoot: Optional[object] = None
    _maxPersistentPerHost: int = 64
    _clients: dict = field(factory=dict)
    _pools: list = field(factory=list)
    _urls: dict = field(factory=dict)
    _direct: dict = field(factory=dict)
    _targets: dict = field(factory=dict)

    def _directPool(self, timeouts: UpstreamSettings) -> ConnectionPool:
        """
        The lean client's pool (L{relay.upstream.httpclient}) for accounts
        without an egress proxy, one per connect timeout.
        """
        pool = self._direct.get(timeouts.connect_timeout_seconds)
        if pool is None:
            from twisted.web.client import BrowserLikePolicyForHTTPS

            policy = self._tlsPolicy() or BrowserLikePolicyForHTTPS()
            pool = self._direct[timeouts.connect_timeout_seconds] = ConnectionPool(
                self._reactor, policy, timeouts.connect_timeout_seconds,
                maxPerHost=self._maxPersistentPerHost,
            )
        return pool

    def _target(self, url: str) -> Optional[Target]:
        """
        The parsed L{Target} of C{url} (cached), or L{None} when the lean
        client cannot send to it.
        """
        target = self._targets.get(url, False)
        if target is False:
            if len(self._targets) >= 1024:
                self._targets.clear()
            try:
                target = Target(url)
            except ValueError:
                target = None
            self._targets[url] = target
        return target

    def _clientFor(self, account: Account, timeouts: UpstreamSettings) -> HTTPClient:
        """
        One treq client (and connection pool) per (proxy, connect timeout):
        connections through different proxies must never be shared. Keyed
        by the whole L{relay.base.records.ProxySpec}, not its id: a reload that points a
        proxy id at another address or credentials gets a new client.
        """
        proxy = account.proxy
        key = (proxy, timeouts.connect_timeout_seconds)
        client = self._clients.get(key)
        if client is None:
            pool = QuietConnectionPool(self._reactor, persistent=True)
            pool.retryAutomatically = False
            pool.maxPersistentPerHost = self._maxPersistentPerHost
            self._pools.append(pool)
            policy = self._tlsPolicy()
            if proxy is not None:
                from relay.upstream.proxy import ProxyAgentEndpointFactory

                factory = ProxyAgentEndpointFactory(
                    self._reactor, proxy, timeouts.connect_timeout_seconds, policy
                )
                agent = Agent.usingEndpointFactory(self._reactor, factory, pool=pool)
            else:
                kwargs = {"pool": pool, "connectTimeout": timeouts.connect_timeout_seconds}
                if policy is not None:
                    kwargs["contextFactory"] = policy
                agent = Agent(self._reactor, **kwargs)
                agent._endpointFactory = _EndpointCache(agent._endpointFactory)
            # For RSS, treq only for accounts behind a proxy; imported
            # at start when the config names one (relay.process.app.checkImports).
            from treq.client import HTTPClient

            # Upstream cookies (e.g. Cloudflare's) must never be stored and
            # replayed: the pool is shared by every account and client.
            client = HTTPClient(agent, cookiejar=CookieJar(DefaultCookiePolicy(allowed_domains=[])))
            self._clients[key] = client
        return client

    def _tlsPolicy(self):
        """
        @return: a TLS policy verifying upstream hostnames against
            C{_trustRoot}, or L{None} for Agent's default (also verifying).
        """
        if self._trustRoot is None:
            return None
        from twisted.web.client import BrowserLikePolicyForHTTPS

        return BrowserLikePolicyForHTTPS(trustRoot=self._trustRoot)

    def request(self, account, method, path, body, headers, timeouts) -> Deferred:
        """
        See L{IUpstreamDialer.request}. The returned Deferred is cancellable
        (client gone, first-output timeout).
        """
        url = account.base_url + path
        direct = account.proxy is None and method in (b"POST", "POST") and (
            isinstance(body, bytes) or body.__class__ is list)
        target = self._target(url) if direct else None
        if target is not None:
            # Direct upstreams go through the lean client, a body's pieces unjoined.
            # The header timeout is the pool's (HeaderTimeout).
            data = requestPieces(target, upstreamHeaders(account, headers), body)
            timeout = timeouts.connect_timeout_seconds + timeouts.header_timeout_seconds
            return self._directPool(timeouts).request(target, data, timeout)
        if body.__class__ is list:
            body = b"".join(body)  # pieces (IPiecesDialer) go to treq as bytes
        client = self._clientFor(account, timeouts)
        prepared = self._urls.get(url)
        if prepared is None:
            if len(self._urls) >= 1024:
                self._urls.clear()
            prepared = self._urls[url] = _prepareURL(url)
        hdrs = Headers()
        for name, value in upstreamHeaders(account, headers).items():
            hdrs.setRawHeaders(name, [value])
        d = client.request(
            method.decode("ascii") if isinstance(method, bytes) else method,
            prepared,
            headers=hdrs,
            data=body,
            unbuffered=True,
            allow_redirects=False,
        )
        timeout = timeouts.connect_timeout_seconds + timeouts.header_timeout_seconds
        d.addTimeout(timeout, self._reactor, onTimeoutCancel=lambda r, t: _timeoutFail(t))
        d.addCallback(UpstreamResponse.wrap, self._reactor)
        return d

    def close(self) -> Deferred:
        """
        Close every cached connection (service stop).
        """
        from twisted.internet.defer import gatherResults

        closing = [p.closeCachedConnections() for p in self._pools]
        closing.extend(p.close() for p in self._direct.values())
        return gatherResults(closing)
