# -*- test-case-name: tests.test_proxy -*-
"""
Client endpoints that reach an upstream host through a per-account egress
proxy: SOCKS5 (RFC 1928, with RFC 1929 username/password) and
HTTP C{CONNECT} (RFC 9110 section 9.3.6).

Why our own code: the one Twisted SOCKS library on PyPI, C{txsocksx}
(last release 1.15.0.2, August 2015), is Python 2 era -- its sdist no
longer even builds metadata with current setuptools (C{vcversioner}
setup option, an C{int} in C{install_requires}), it builds protocol bytes
from C{str} with C{chr()}, depends on Parsley, and has no HTTP C{CONNECT}.
C{txtorcon} has a maintained SOCKS client but it is Tor specific and has no
HTTP C{CONNECT} either. Both handshakes are a few dozen lines, so they live
here as small sans-IO state machines (L{Socks5Negotiation},
L{HTTPConnectNegotiation}) driven by one protocol wrapper, all unit tested
byte by byte.

How it fits together::

    wrapClientTLS(optionsForClientTLS(upstreamHost, trustRoot),   # TLS inside
                  proxyEndpoint(reactor, proxy, upstreamHost, 443, timeout))

L{proxyEndpoint} dials the proxy with a L{HostnameEndpoint}, runs the
handshake, and only then builds the caller's protocol and calls its
C{makeConnection}, so the caller (or the TLS layer wrapped around it) sees
C{connectionMade} once the tunnel is up. TLS therefore runs end to end with
the upstream host name for SNI and certificate verification; the proxy only
sees ciphertext.

Failures feed behaviour.md R3 (persistent versus transient):

    - the proxy port refuses or is unreachable: Twisted's own
      L{ConnectionRefusedError} / L{NoRouteError} from the TCP dial
      (persistent by type);
    - SOCKS5 credentials rejected, or no acceptable method:
      L{ProxyAuthenticationFailed}, text contains C{"authentication failed"}
      (persistent);
    - HTTP 407 (or 401): L{ProxyAuthenticationFailed}, text contains
      C{"proxy authentication required"} (persistent);
    - SOCKS reply 0x05/0x03/0x04: L{ProxyConnectFailed} with the text
      C{"connection refused"}, C{"network is unreachable"} or
      C{"no route to host"} (persistent);
    - SOCKS general failure and other replies, HTTP C{CONNECT} 5xx whose
      status line and body do not name one of those reasons:
      L{ProxyConnectFailed} without a marker (transient);
    - the whole dial plus handshake exceeding C{timeout} seconds:
      L{ProxyTimeout} (transient).

Logs name the proxy by id, host and port only; credentials never appear in
logs or exception text.
"""

from __future__ import annotations

import ipaddress
import re
from base64 import b64encode
from typing import Callable, Optional

from attrs import define, field
from autobahn.websocket.util import parse_url
from twisted.internet.address import HostnameAddress
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectingCancelledError
from twisted.internet.interfaces import (
    IProtocol,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import URI, BrowserLikePolicyForHTTPS
from twisted.web.iweb import IAgentEndpointFactory, IPolicyForHTTPS
from zope.interface import implementer

from relay.base.records import ProxySpec, RelayError

SCHEMES = ("socks5", "socks5h", "http")
"""The proxy schemes L{proxyEndpoint} understands (config.md C{proxies:})."""

MAX_HTTP_RESPONSE_HEAD = 16 * 1024
"""Bytes, the largest C{CONNECT} response head (status line plus headers)."""

MAX_HTTP_ERROR_BODY = 8 * 1024
"""Bytes of a failed C{CONNECT} response body read to look for a reason."""

# R3 text markers a proxy's own error text may carry; only these (never the
# raw text) are copied into our exception messages.
_REASON_MARKERS = (
    "connection refused",
    "no route to host",
    "network is unreachable",
    "no such host",
)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ProxyError(RelayError):
    """
    A failure inside the proxy handshake. The message never contains
    credentials.

    @ivar proxyId: the L{ProxySpec.id} of the proxy, or L{None} when the
        error was raised outside an endpoint (unit tests of the machines).
    """

    def __init__(self, message: str, proxyId: Optional[str] = None):
        super().__init__(message)
        self.proxyId = proxyId


class ProxyAuthenticationFailed(ProxyError):
    """
    The proxy rejected our credentials (or offered no method we can use).
    The message contains C{"authentication failed"} (SOCKS5) or
    C{"proxy authentication required"} (HTTP 407), both persistent under
    behaviour.md R3.
    """


class ProxyConnectFailed(ProxyError):
    """
    The proxy could not open the tunnel to the target.

    @ivar code: the SOCKS5 reply code (RFC 1928 section 6), or L{None}.
    @ivar status: the HTTP C{CONNECT} response status, or L{None}.
    """

    def __init__(
        self,
        message: str,
        proxyId: Optional[str] = None,
        code: Optional[int] = None,
        status: Optional[int] = None,
    ):
        super().__init__(message, proxyId)
        self.code = code
        self.status = status


class ProxyTimeout(ProxyError):
    """
    The TCP dial plus handshake took longer than the endpoint's timeout
    (transient under behaviour.md R3).

    @ivar timeout: the limit that was exceeded, in seconds.
    """

    def __init__(self, message: str, proxyId: Optional[str] = None, timeout: float = 0):
        super().__init__(message, proxyId)
        self.timeout = timeout


SOCKS5_REPLIES = {
    0x01: "general SOCKS server failure",
    0x02: "connection not allowed by ruleset",
    0x03: "network is unreachable",
    0x04: "no route to host (host unreachable)",
    0x05: "connection refused",
    0x06: "TTL expired",
    0x07: "command not supported",
    0x08: "address type not supported",
}
"""RFC 1928 section 6 reply codes -> the text of L{ProxyConnectFailed}."""


# ---------------------------------------------------------------------------
# Sans-IO handshakes
# ---------------------------------------------------------------------------


def _isIPAddress(host: str) -> bool:
    """
    @param host: a host name or address literal.
    @return: whether C{host} is an IPv4 or IPv6 literal.
    """
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Socks5Negotiation:
    """
    The client side of a SOCKS5 C{CONNECT} (RFC 1928), with no
    authentication or username/password (RFC 1929).

    Feed it every byte from the proxy with L{dataReceived}; it returns the
    bytes to send and, once the tunnel is up, the bytes that followed the
    reply (which belong to the tunnelled protocol). Errors are raised as
    L{ProxyError} subclasses.

    @ivar phase: C{method}, C{auth}, C{reply} or C{done}, for logs.
    """

    def __init__(
        self,
        host: str,
        port: int,
        username: Optional[str] = None,
        password: Optional[str] = None,
        proxyId: Optional[str] = None,
    ):
        """
        @param host: the target as it goes into the request: an IPv4/IPv6
            literal (ATYP 1/4) or a domain name (ATYP 3, resolved by the
            proxy).
        @param port: the target TCP port.
        @param username: RFC 1929 user name, or L{None} for no
            authentication.
        @param password: RFC 1929 password (empty when L{None}).
        @param proxyId: for the errors' C{proxyId}.
        @raise ProxyError: a credential or host name longer than 255 bytes.
        """
        self._proxyId = proxyId
        self._credentials = None
        if username is not None:
            user = username.encode("utf-8")
            secret = (password or "").encode("utf-8")
            if len(user) > 255 or len(secret) > 255:
                raise ProxyError("SOCKS5 user name or password longer than 255 bytes", proxyId)
            self._credentials = (user, secret)
        self._request = b"\x05\x01\x00" + self._address(host) + port.to_bytes(2, "big")
        self._buffer = b""
        self.phase = "method"

    def _address(self, host: str) -> bytes:
        """
        @return: ATYP plus DST.ADDR for C{host}.
        """
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            name = host.encode("idna")
            if not 0 < len(name) <= 255:
                raise ProxyError("SOCKS5 target host name is empty or too long", self._proxyId)
            return b"\x03" + bytes([len(name)]) + name
        return (b"\x01" if ip.version == 4 else b"\x04") + ip.packed

    def start(self) -> bytes:
        """
        @return: the greeting: version 5 and the offered methods (0x00, plus
            0x02 when we hold credentials).
        """
        if self._credentials is None:
            return b"\x05\x01\x00"
        return b"\x05\x02\x00\x02"

    def dataReceived(self, data: bytes) -> tuple[bytes, Optional[bytes]]:
        """
        @param data: bytes from the proxy, in any fragmentation.
        @return: (bytes to send to the proxy, leftover) where leftover is
            L{None} until the tunnel is up, then the bytes after the reply.
        @raise ProxyError: the proxy refused or broke the protocol.
        """
        self._buffer += data
        out = b""
        while True:
            if self.phase == "method":
                if len(self._buffer) < 2:
                    return out, None
                version, method = self._buffer[0], self._buffer[1]
                self._buffer = self._buffer[2:]
                if version != 5:
                    raise ProxyError(f"not a SOCKS5 proxy (version byte {version})", self._proxyId)
                if method == 0xFF:
                    raise ProxyAuthenticationFailed(
                        "SOCKS5 authentication failed: the proxy accepted none of the "
                        "offered methods (credentials required?)",
                        self._proxyId,
                    )
                if method == 0x00:
                    self.phase = "reply"
                    out += self._request
                elif method == 0x02 and self._credentials is not None:
                    user, secret = self._credentials
                    self.phase = "auth"
                    out += b"\x01" + bytes([len(user)]) + user + bytes([len(secret)]) + secret
                else:
                    raise ProxyError(
                        f"SOCKS5 proxy chose a method we did not offer (0x{method:02x})",
                        self._proxyId,
                    )
            elif self.phase == "auth":
                if len(self._buffer) < 2:
                    return out, None
                status = self._buffer[1]
                self._buffer = self._buffer[2:]
                if status != 0:
                    raise ProxyAuthenticationFailed(
                        "SOCKS5 authentication failed: user name or password rejected",
                        self._proxyId,
                    )
                self.phase = "reply"
                out += self._request
            elif self.phase == "reply":
                if len(self._buffer) < 2:
                    return out, None
                if self._buffer[0] != 5:
                    raise ProxyError(
                        f"not a SOCKS5 reply (version byte {self._buffer[0]})", self._proxyId
                    )
                code = self._buffer[1]
                if code != 0:
                    text = SOCKS5_REPLIES.get(code, f"unknown SOCKS5 reply 0x{code:02x}")
                    raise ProxyConnectFailed(
                        f"SOCKS5 CONNECT failed: {text}", self._proxyId, code=code
                    )
                length = self._replyLength()
                if length is None or len(self._buffer) < length:
                    return out, None
                leftover = self._buffer[length:]
                self._buffer = b""
                self.phase = "done"
                return out, leftover
            else:
                raise ProxyError("SOCKS5 negotiation already finished", self._proxyId)

    def _replyLength(self) -> Optional[int]:
        """
        @return: the length in bytes of the whole reply at the head of the
            buffer, or L{None} when not enough of it is there to tell.
        @raise ProxyError: an unknown address type.
        """
        if len(self._buffer) < 4:
            return None
        atyp = self._buffer[3]
        if atyp == 1:
            return 4 + 4 + 2
        if atyp == 4:
            return 4 + 16 + 2
        if atyp == 3:
            if len(self._buffer) < 5:
                return None
            return 5 + self._buffer[4] + 2
        raise ProxyError(f"SOCKS5 reply with unknown address type {atyp}", self._proxyId)

    def connectionLost(self) -> ProxyError:
        """
        @return: the error for a proxy that closed before the tunnel was up
            (transient: no R3 marker).
        """
        return ProxyError(
            f"SOCKS5 proxy closed the connection during the handshake ({self.phase})",
            self._proxyId,
        )


_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] (\d{3})(?: (.*))?$")


class HTTPConnectNegotiation:
    """
    The client side of an HTTP C{CONNECT} tunnel through an HTTP proxy,
    with optional C{Proxy-Authorization: Basic}.

    Same contract as L{Socks5Negotiation}. A 2xx opens the tunnel; 407 (and
    401, which tinyproxy sends for a wrong password) raises
    L{ProxyAuthenticationFailed}; any other status reads up to
    L{MAX_HTTP_ERROR_BODY} bytes of the body (until C{Content-Length} or
    close) and raises L{ProxyConnectFailed}, naming an R3 reason when the
    status line or body names one. Proxies that give no reason stay
    transient: tinyproxy 1.11 answers a refused target with
    C{500 Unable to connect} and a body that does not say why.

    @ivar phase: C{head}, C{body} or C{done}.
    """

    def __init__(
        self,
        host: str,
        port: int,
        username: Optional[str] = None,
        password: Optional[str] = None,
        proxyId: Optional[str] = None,
    ):
        """
        @param host: the target host name or address literal.
        @param port: the target TCP port.
        @param username: Basic credentials user, or L{None} for none.
        @param password: Basic credentials password (empty when L{None}).
        @param proxyId: for the errors' C{proxyId}.
        """
        self._proxyId = proxyId
        if not _isIPAddress(host):
            host = host.encode("idna").decode("ascii")
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if username is not None:
            token = b64encode(f"{username}:{password or ''}".encode("utf-8")).decode("ascii")
            lines.append(f"Proxy-Authorization: Basic {token}")
        self._request = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
        self._buffer = b""
        self._status = 0
        self._reason = ""
        self._bodyLength: Optional[int] = None
        self.phase = "head"

    def start(self) -> bytes:
        """
        @return: the C{CONNECT} request.
        """
        return self._request

    def dataReceived(self, data: bytes) -> tuple[bytes, Optional[bytes]]:
        """
        @param data: bytes from the proxy, in any fragmentation.
        @return: (bytes to send, leftover), as L{Socks5Negotiation}.
        @raise ProxyError: the proxy refused or broke the protocol.
        """
        self._buffer += data
        if self.phase == "head":
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HTTP_RESPONSE_HEAD:
                    raise ProxyError("HTTP proxy response head too large", self._proxyId)
                return b"", None
            head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
            lines = head.split(b"\r\n")
            match = _STATUS_LINE.match(lines[0])
            if match is None:
                raise ProxyError("HTTP proxy sent a malformed status line", self._proxyId)
            self._status = int(match.group(1))
            self._reason = _printable(match.group(2) or b"")
            if 200 <= self._status < 300:
                self.phase = "done"
                leftover, self._buffer = self._buffer, b""
                return b"", leftover
            if self._status in (401, 407):
                # 401 to a CONNECT can only come from the proxy itself (no
                # tunnel exists yet); tinyproxy 1.11 sends it for a wrong
                # password (407 only when the header is missing).
                raise ProxyAuthenticationFailed(
                    "HTTP proxy CONNECT failed: proxy authentication required "
                    f"({self._status}, credentials missing or rejected)",
                    self._proxyId,
                )
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    try:
                        self._bodyLength = int(value.strip())
                    except ValueError:
                        pass
            self.phase = "body"
        if self.phase == "body":
            limit = MAX_HTTP_ERROR_BODY
            if self._bodyLength is not None:
                limit = min(limit, self._bodyLength)
            if len(self._buffer) >= limit:
                raise self._statusError()
            return b"", None
        raise ProxyError("HTTP CONNECT negotiation already finished", self._proxyId)

    def _statusError(self) -> ProxyConnectFailed:
        """
        @return: the error for a non-2xx, non-407 C{CONNECT} response.
        """
        text = f"HTTP proxy CONNECT failed: {self._status} {self._reason}".rstrip()
        seen = f"{self._reason}\n{self._buffer[:MAX_HTTP_ERROR_BODY].decode('latin-1')}".lower()
        found = [marker for marker in _REASON_MARKERS if marker in seen]
        if found and not any(marker in text.lower() for marker in found):
            text += " (" + ", ".join(found) + ")"
        return ProxyConnectFailed(text, self._proxyId, status=self._status)

    def connectionLost(self) -> ProxyError:
        """
        @return: the error for a proxy that closed before the tunnel was up:
            the status error when a non-2xx head was already read.
        """
        if self.phase == "body":
            return self._statusError()
        return ProxyError(
            "HTTP proxy closed the connection before answering CONNECT", self._proxyId
        )


def _printable(raw: bytes, limit: int = 80) -> str:
    """
    @param raw: untrusted bytes from the proxy.
    @param limit: characters to keep at most.
    @return: printable ASCII only, truncated to C{limit} characters.
    """
    return "".join(c for c in raw.decode("latin-1") if " " <= c <= "~")[:limit]


def negotiationFor(proxy: ProxySpec, host: str, port: int):
    """
    The handshake machine for C{proxy}'s scheme.

    @param proxy: the proxy.
    @param host: the target as it must appear in the request (already
        resolved for C{socks5}).
    @param port: the target TCP port.
    @return: a L{Socks5Negotiation} or L{HTTPConnectNegotiation}.
    @raise ValueError: an unknown scheme.
    """
    if proxy.scheme in ("socks5", "socks5h"):
        cls = Socks5Negotiation
    elif proxy.scheme == "http":
        cls = HTTPConnectNegotiation
    else:
        raise ValueError(f"unknown proxy scheme {proxy.scheme!r} for proxy {proxy.id}")
    return cls(host, port, proxy.username, proxy.password, proxyId=proxy.id)


# ---------------------------------------------------------------------------
# Protocol wrapper
# ---------------------------------------------------------------------------


class _TunnelProtocol(Protocol):
    """
    Runs a negotiation on the proxy connection, then builds the wrapped
    protocol, gives it the real transport (so C{connectionMade} happens
    once the tunnel is up) and forwards every later event to it.

    @ivar whenTunnelled: fires with the wrapped protocol once it is
        connected, or fails with the handshake's L{ProxyError}. Cancelling
        it aborts the connection.
    """

    def __init__(self, negotiation, wrappedFactory: IProtocolFactory, address):
        """
        @param negotiation: a L{Socks5Negotiation} or
            L{HTTPConnectNegotiation}.
        @param wrappedFactory: the caller's factory.
        @param address: the target's address, given to C{buildProtocol}.
        """
        self._negotiation = negotiation
        self._wrappedFactory = wrappedFactory
        self._address = address
        self.wrappedProtocol: Optional[IProtocol] = None
        self.whenTunnelled: Deferred = Deferred(self._cancel)

    def _cancel(self, d: Deferred) -> None:
        """
        Abort the proxy connection when the handshake is cancelled.
        """
        if self.transport is not None:
            self.transport.abortConnection()

    def connectionMade(self) -> None:
        """
        Send the greeting (SOCKS5) or the request (HTTP C{CONNECT}).
        """
        self.transport.write(self._negotiation.start())

    def dataReceived(self, data: bytes) -> None:
        """
        Drive the handshake, or forward tunnelled bytes.
        """
        if self.wrappedProtocol is not None:
            self.wrappedProtocol.dataReceived(data)
            return
        if self.whenTunnelled.called:
            return
        try:
            out, leftover = self._negotiation.dataReceived(data)
        except ProxyError as e:
            self.whenTunnelled.errback(Failure(e))
            self.transport.abortConnection()
            return
        if out:
            self.transport.write(out)
        if leftover is not None:
            self._tunnelUp(leftover)

    def _tunnelUp(self, leftover: bytes) -> None:
        """
        Hand the transport to the wrapped protocol.

        @param leftover: bytes that followed the handshake reply.
        """
        try:
            inner = self._wrappedFactory.buildProtocol(self._address)
        except Exception:
            self.whenTunnelled.errback()
            self.transport.abortConnection()
            return
        if inner is None:
            self.whenTunnelled.errback(Failure(ProxyError("the protocol factory refused")))
            self.transport.loseConnection()
            return
        self.wrappedProtocol = inner
        inner.makeConnection(self.transport)
        self.whenTunnelled.callback(inner)
        if leftover and self.transport is not None:
            inner.dataReceived(leftover)

    def connectionLost(self, reason: Failure) -> None:
        """
        Forward to the wrapped protocol, or fail the handshake.
        """
        if self.wrappedProtocol is not None:
            self.wrappedProtocol.connectionLost(reason)
        elif not self.whenTunnelled.called:
            self.whenTunnelled.errback(Failure(self._negotiation.connectionLost()))


class _TunnelFactory(Factory):
    """
    Builds one L{_TunnelProtocol} for one proxy connection and forwards the
    factory lifecycle to the wrapped factory. Quiet, like every factory
    relay dials with (no "Starting factory" line per connection).
    """

    noisy = False

    def __init__(self, negotiation, wrappedFactory: IProtocolFactory, address):
        """
        @param negotiation: the handshake machine.
        @param wrappedFactory: the caller's factory.
        @param address: the target's address.
        """
        self._negotiation = negotiation
        self._wrappedFactory = wrappedFactory
        self._address = address

    def doStart(self) -> None:
        """
        Start the wrapped factory.
        """
        self._wrappedFactory.doStart()

    def doStop(self) -> None:
        """
        Stop the wrapped factory.
        """
        self._wrappedFactory.doStop()

    def buildProtocol(self, addr) -> _TunnelProtocol:
        """
        @return: the handshake protocol.
        """
        return _TunnelProtocol(self._negotiation, self._wrappedFactory, self._address)


# ---------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------


@implementer(IStreamClientEndpoint)
@define(eq=False)
class ProxyTunnelEndpoint:
    """
    An endpoint whose connections reach C{host}:C{port} through a proxy.

    The whole attempt -- local name resolution (C{socks5}), the TCP dial to
    the proxy and the handshake -- is bounded by C{timeout} seconds on
    C{clock}; exceeding it fails with L{ProxyTimeout}. Cancelling the
    Deferred from L{connect} abandons the attempt and closes the
    connection.

    @ivar _clock: the reactor's L{IReactorTime}, for the timeout.
    @ivar _proxyEndpoint: the endpoint that dials the proxy itself.
    @ivar _proxy: the proxy.
    @ivar _host: the target host name or address.
    @ivar _port: the target TCP port.
    @ivar _timeout: seconds for the whole attempt.
    @ivar _resolve: for C{socks5}: a callable taking a host name and
        returning a Deferred of an IPv4 address string (e.g.
        C{reactor.resolve}); L{None} when not needed.
    """

    _clock: IReactorTime
    _proxyEndpoint: IStreamClientEndpoint
    _proxy: ProxySpec
    _host: str
    _port: int
    _timeout: float
    _resolve: Optional[Callable[[str], Deferred]] = None
    _log = Logger()

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred:
        """
        Dial the proxy, open the tunnel, then connect C{protocolFactory}'s
        protocol over it.

        @param protocolFactory: the caller's factory.
        @return: a L{Deferred} of the caller's protocol, or a failure with
            L{ProxyError}, L{ProxyTimeout}, or the dial's own error
            (e.g. L{ConnectionRefusedError}).
        """
        d = Deferred.fromCoroutine(self._connect(protocolFactory))
        d.addTimeout(self._timeout, self._clock, onTimeoutCancel=self._timedOut)
        d.addCallbacks(self._cbTunnelled, self._ebFailed)
        return d

    async def _connect(self, protocolFactory: IProtocolFactory) -> IProtocol:
        """
        The attempt, as a coroutine.
        """
        target = self._host
        if self._proxy.scheme == "socks5" and not _isIPAddress(target):
            if self._resolve is None:
                raise ProxyError("socks5 needs a resolver for host names", self._proxy.id)
            target = await self._resolve(target)
        negotiation = negotiationFor(self._proxy, target, self._port)
        address = HostnameAddress(self._host.encode("idna"), self._port)
        factory = _TunnelFactory(negotiation, protocolFactory, address)
        tunnel = await self._proxyEndpoint.connect(factory)
        return await tunnel.whenTunnelled

    def _timedOut(self, result, timeout: float):
        """
        Turn the cancellation from C{addTimeout} into L{ProxyTimeout}. The
        cancelled step may fail with L{CancelledError} or its own variant
        (a pending TCP dial gives C{ConnectingCancelledError}); either way
        the cause is the timeout.
        """
        if isinstance(result, Failure):
            return Failure(
                ProxyTimeout(
                    f"proxy dial and handshake timed out after {timeout:g} seconds",
                    self._proxy.id,
                    timeout=timeout,
                )
            )
        return result

    def _cbTunnelled(self, protocol: IProtocol) -> IProtocol:
        """
        Log the open tunnel.
        """
        self._log.debug(
            "tunnel to {target_host}:{target_port} open through proxy {proxy_id}",
            event="relay.proxy_tunnel_open",
            proxy_id=self._proxy.id,
            proxy_host=self._proxy.host,
            proxy_port=self._proxy.port,
            target_host=self._host,
            target_port=self._port,
        )
        return protocol

    def _ebFailed(self, failure: Failure) -> Failure:
        """
        Log the failed attempt (an expected upstream condition) and pass it on.
        """
        if not failure.check(CancelledError, ConnectingCancelledError):
            self._log.info(
                "tunnel to {target_host}:{target_port} through proxy {proxy_id} "
                "({proxy_host}:{proxy_port}) failed: {reason}",
                event="relay.proxy_tunnel_failed",
                proxy_id=self._proxy.id,
                proxy_host=self._proxy.host,
                proxy_port=self._proxy.port,
                target_host=self._host,
                target_port=self._port,
                reason=f"{failure.type.__name__}: {failure.getErrorMessage()}",
            )
        return failure


def proxyEndpoint(
    reactor, proxy: ProxySpec, host: str, port: int, timeout: float
) -> IStreamClientEndpoint:
    """
    An endpoint for C{host}:C{port} through C{proxy}.

    @param reactor: the reactor (L{IReactorTime}, L{IReactorTCP},
        L{IReactorPluggableNameResolver}; C{resolve} for C{socks5}).
    @param proxy: the proxy; scheme C{socks5} resolves C{host} locally,
        C{socks5h} sends the name to the proxy, C{http} uses C{CONNECT}.
    @param host: the upstream host name or address.
    @param port: the upstream TCP port.
    @param timeout: seconds for the TCP dial plus the handshake.
    @return: a L{ProxyTunnelEndpoint}. Wrap it with L{wrapClientTLS} for
        TLS to the upstream host.
    @raise ValueError: an unknown proxy scheme.
    """
    if proxy.scheme not in SCHEMES:
        raise ValueError(f"unknown proxy scheme {proxy.scheme!r} for proxy {proxy.id}")
    return ProxyTunnelEndpoint(
        clock=reactor,
        proxyEndpoint=HostnameEndpoint(reactor, proxy.host, proxy.port, timeout=timeout),
        proxy=proxy,
        host=host,
        port=port,
        timeout=timeout,
        resolve=getattr(reactor, "resolve", None),
    )


def _upstreamEndpoint(
    reactor,
    proxy: Optional[ProxySpec],
    host: str,
    port: int,
    secure: bool,
    timeout: float,
    tlsPolicy: IPolicyForHTTPS,
) -> IStreamClientEndpoint:
    """
    The plain or TLS endpoint for one upstream host, through C{proxy} or
    direct when it is L{None}.
    """
    if proxy is None:
        endpoint = HostnameEndpoint(reactor, host, port, timeout=timeout)
    else:
        endpoint = proxyEndpoint(reactor, proxy, host, port, timeout)
    if secure:
        creator = tlsPolicy.creatorForNetloc(host.encode("idna"), port)
        endpoint = wrapClientTLS(creator, endpoint)
    return endpoint


@implementer(IAgentEndpointFactory)
@define(eq=False)
class ProxyAgentEndpointFactory:
    """
    Endpoints for L{twisted.web.client.Agent.usingEndpointFactory} that
    send every request through one proxy. Give each proxy its own Agent
    and connection pool: the pool keys connections by scheme, host and
    port only.

    @ivar _reactor: the reactor.
    @ivar _proxy: the proxy, or L{None} to connect directly.
    @ivar _timeout: seconds for the dial plus proxy handshake.
    @ivar _tlsPolicy: the L{IPolicyForHTTPS} for C{https} URIs, verifying
        the upstream host name inside the tunnel; L{None} means
        L{BrowserLikePolicyForHTTPS} with the platform trust store. Pass
        C{BrowserLikePolicyForHTTPS(trustRoot=Certificate.loadPEM(...))}
        for a private CA.
    """

    _reactor: object
    _proxy: Optional[ProxySpec]
    _timeout: float
    _tlsPolicy: Optional[IPolicyForHTTPS] = field(default=None)

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        """
        @param uri: the request URI (C{http} or C{https}).
        @return: the tunnel endpoint, wrapped in TLS for C{https}.
        @raise ValueError: another scheme.
        """
        scheme = uri.scheme.decode("ascii").lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"unsupported URI scheme {scheme!r}")
        return _upstreamEndpoint(
            self._reactor,
            self._proxy,
            uri.host.decode("idna"),
            uri.port,
            scheme == "https",
            self._timeout,
            self._tlsPolicy or BrowserLikePolicyForHTTPS(),
        )


def webSocketEndpoint(
    reactor,
    proxy: Optional[ProxySpec],
    url: str,
    timeout: float,
    tlsPolicy: Optional[IPolicyForHTTPS] = None,
) -> IStreamClientEndpoint:
    """
    The endpoint to C{connect} an autobahn C{WebSocketClientFactory(url)}
    with, through C{proxy}.

    @param reactor: the reactor.
    @param proxy: the proxy, or L{None} to connect directly.
    @param url: a C{ws://} or C{wss://} URL.
    @param timeout: seconds for the dial plus proxy handshake (the
        WebSocket opening handshake needs its own timeout).
    @param tlsPolicy: as for L{ProxyAgentEndpointFactory}; L{None} means
        the platform trust store.
    @return: the endpoint, wrapped in verifying TLS for C{wss}.
    @raise ValueError: a URL autobahn cannot parse.
    """
    isSecure, host, port, _resource, _path, _params = parse_url(url)
    return _upstreamEndpoint(
        reactor,
        proxy,
        host,
        port,
        isSecure,
        timeout,
        tlsPolicy or BrowserLikePolicyForHTTPS(),
    )
