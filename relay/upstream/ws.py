# -*- test-case-name: tests.test_ws -*-
"""
The upstream Responses WebSocket client (protocol.md 4, 7; style.md 9(b)).

L{dialUpstream} opens one upstream connection for an account: TCP (or the
account's egress proxy) with a connect timeout, verifying TLS for C{wss},
and the opening handshake bounded by its own timeout. A handshake the
upstream rejects with an HTTP status fails with L{HandshakeRejected}; a
dial without any status fails with the transport exception (R6).

L{UpstreamPool} keeps the C{ctx_pool} connections of each account
(behaviour.md R50): capacity C{ceil(concurrency x factor)} capped at 128,
a connection is lent to one turn at a time, idle connections answer
upstream pings (autobahn does) and send their own every 30 s, and a
connection is retired after 50 minutes. An acquire that cannot get a
connection in time, or finds the wait queue full, fails with L{PoolBusy}
(R-B3: the engine switches accounts without a cooldown).

This module holds no failover policy; the attempt function in
L{relay.engine.wsattempt} maps these outcomes to verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from attrs import define, field
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from autobahn.websocket.compress import (
    PerMessageDeflateOffer,
    PerMessageDeflateResponse,
    PerMessageDeflateResponseAccept,
)
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.logger import Logger

from relay.upstream.http import upstreamHeaders
from relay.upstream.proxy import webSocketEndpoint

BETA_HEADER = "responses_websockets=2026-02-06"
"""The v2 WebSocket beta value sent upstream (behaviour.md R48, protocol.md 7)."""

MAX_CONNS_PER_ACCOUNT = 128
"""R50 hard cap per account."""

MAX_AGE_SECONDS = 50 * 60
"""R50 (adopted): retire pooled connections after 50 minutes."""

QUEUE_LIMIT = 64
"""R50: waiters per account pool before C{conn_queue_full}."""

ACQUIRE_EXTRA_SECONDS = 2.0
"""R69: the pool acquire deadline is the dial timeout + 2 s."""


class HandshakeRejected(Exception):
    """
    The upstream answered the WebSocket upgrade with an HTTP status
    (behaviour.md R56).

    @ivar status: the HTTP status.
    @ivar headers: lower-cased response headers.
    @ivar body: whatever body bytes arrived with the status.
    """

    def __init__(self, status: int, headers: dict, body: bytes):
        super().__init__(f"websocket handshake rejected with {status}")
        self.status = status
        self.headers = headers
        self.body = body


class UpstreamClosed(Exception):
    """
    The upstream connection closed before or during use.
    """


class PoolBusy(Exception):
    """
    A C{ctx_pool} acquire timed out or found the queue full (R-B3).

    @ivar reason: C{acquire_timeout} or C{conn_queue_full}.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def upstreamWebSocketURL(baseURL: str) -> str:
    """
    The upstream C{…/responses} WebSocket URL of an account's base URL:
    C{http} becomes C{ws} and C{https} becomes C{wss}.
    """
    url = baseURL.rstrip("/") + "/responses"
    if url.startswith("https://"):
        return "wss://" + url[len("https://") :]
    if url.startswith("http://"):
        return "ws://" + url[len("http://") :]
    return url


def handshakeHeaders(account, clientHeaders: dict) -> dict:
    """
    The upgrade headers for C{account}: its credential (and
    C{chatgpt-account-id} for OAuth), the forwarded client headers
    (protocol.md 7.2), and the v2 beta value.
    """
    headers = upstreamHeaders(account, clientHeaders, "websocket")
    headers.pop("content-type", None)
    headers.pop("accept", None)
    headers["openai-beta"] = BETA_HEADER
    return headers


class UpstreamProtocol(WebSocketClientProtocol):
    """
    One upstream WebSocket. Frames go to the current C{listener} (a turn's
    pump); without one (idle) they are ignored. autobahn answers pings.

    @ivar listener: an object with C{frameReceived(bytes)} and
        C{upstreamLost(code, reason)} (the close code, L{None} for a drop
        without a close frame), or L{None}.
    @ivar opened: fires with this protocol when the handshake completes,
        or fails with L{HandshakeRejected} / L{UpstreamClosed}.
    """

    _log = Logger()

    def __init__(self):
        super().__init__()
        self.listener = None
        self.opened = Deferred()
        self.closed = False
        self.responseHeaders = {}

    def onConnect(self, response) -> None:
        try:
            self.responseHeaders = {k.lower(): v for k, v in (response.headers or {}).items()}
        except Exception:  # noqa: BLE001
            self._log.failure("reading upstream handshake headers failed")

    def onOpen(self) -> None:
        if not self.opened.called:
            self.opened.callback(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        listener = self.listener
        if listener is not None:
            listener.frameReceived(payload)

    def onClose(self, wasClean: bool, code, reason) -> None:
        self.closed = True
        if not self.opened.called:
            self.opened.errback(self._handshakeFailure(code, reason))
            return
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.upstreamLost(code, reason or "")
        onGone = getattr(self, "onGone", None)
        if onGone is not None:
            onGone(self)

    def _handshakeFailure(self, code, reason) -> Exception:
        line = getattr(self, "http_status_line", None)
        if line:
            parts = line.split()
            try:
                status = int(parts[1])
            except (IndexError, ValueError):
                status = 0
            if status and status != 101:
                headers = {k.lower(): v for k, v in (getattr(self, "http_headers", None) or {}).items()}
                data = getattr(self, "data", b"") or b""
                end = data.find(b"\r\n\r\n")
                body = data[end + 4 :] if end >= 0 else b""
                return HandshakeRejected(status, headers, body)
        return UpstreamClosed(f"upstream websocket closed during the handshake ({code} {reason})")

    def send(self, payload: bytes) -> None:
        """
        Send one text frame.
        """
        self.sendMessage(payload, False)

    def close(self) -> None:
        """
        Close (or drop, when not open) this connection.
        """
        self.listener = None
        if self.state == self.STATE_OPEN:
            self.sendClose(1000)
        elif self.state != self.STATE_CLOSED:
            self.dropConnection(abort=True)


def _offerDeflate():
    return [PerMessageDeflateOffer()]


def _acceptDeflate(response):
    if isinstance(response, PerMessageDeflateResponse):
        return PerMessageDeflateResponseAccept(response)
    return None


def upstreamFactory(reactor, url: str, headers: dict, timeout: float) -> WebSocketClientFactory:
    """
    The autobahn factory of one upstream WebSocket dial, with explicit
    options (style.md 9(b)). Quiet (C{noisy = False}): Twisted would log
    "Starting factory" / "Stopping factory" at info level for every dial.

    @param url: the C{ws://} or C{wss://} URL.
    @param headers: the handshake headers.
    @param timeout: seconds for the opening handshake.
    """
    # useragent=None: only the forwarded (Codex-shaped) User-Agent goes out,
    # not autobahn's (protocol.md 7.2: a non-Codex UA draws CDN 403s).
    factory = WebSocketClientFactory(url, headers=headers, reactor=reactor, useragent=None)
    factory.noisy = False
    factory.protocol = UpstreamProtocol
    factory.setProtocolOptions(
        openHandshakeTimeout=timeout,
        closeHandshakeTimeout=5,
        autoPingInterval=30,
        autoPingTimeout=30,
        maxMessagePayloadSize=0,
        maxFramePayloadSize=0,
        failByDrop=False,
        perMessageCompressionOffers=_offerDeflate(),
        perMessageCompressionAccept=_acceptDeflate,
    )
    return factory


async def dialUpstream(reactor, account, clientHeaders: dict, timeout: float, tlsPolicy=None):
    """
    Open one upstream WebSocket for C{account}.

    @param timeout: seconds for the dial (TCP, proxy, TLS) and again for
        the opening handshake (R69: 10 s).
    @return: the open L{UpstreamProtocol}.
    @raise HandshakeRejected: the upgrade was answered with a status.
    @raise Exception: a transport failure without a status (R6).
    """
    url = upstreamWebSocketURL(account.base_url)
    factory = upstreamFactory(reactor, url, handshakeHeaders(account, clientHeaders), timeout)
    endpoint = webSocketEndpoint(reactor, account.proxy, url, timeout, tlsPolicy)
    proto = await endpoint.connect(factory)
    try:
        await proto.opened.addTimeout(timeout, reactor)
    except (DeferredTimeout, CancelledError):
        proto.dropConnection(abort=True)
        raise DeferredTimeout("upstream websocket handshake timed out")
    return proto


@define(eq=False)
class PooledConnection:
    """
    One C{ctx_pool} connection and its bookkeeping.

    @ivar lastResponseId: the latest response produced on it (the chain
        head the upstream caches, protocol.md 4.4).
    @ivar handshakeCounted: whether its handshake's 101 was counted in
        C{relay_upstream_status_total} (once per connection).
    @ivar retiring: its account changed or went away in a reload:
        closed when its turn gives it back, never lent again.
    @ivar turns: how many turns were sent on it; a connection with turns
        behind it may have gone stale while idle (behaviour.md R67).
    """

    proto: UpstreamProtocol
    accountId: str
    openedAt: float
    busy: bool = False
    broken: bool = False
    lastResponseId: str | None = None
    handshakeCounted: bool = False
    retiring: bool = False
    turns: int = 0
    ownerKey: str | None = None
    """R104: the client key whose turn dialled it (with that
    turn's session headers); it is lent to that key's turns only."""

    @property
    def alive(self) -> bool:
        return not self.broken and not self.proto.closed


@define(eq=False)
class _AccountPool:
    conns: list = field(factory=list)
    dialing: int = 0
    waiters: list = field(factory=list)


@define(eq=False)
class UpstreamPool:
    """
    The C{ctx_pool} connections of every account (behaviour.md R50).

    @ivar dial: C{async (account, headers) -> UpstreamProtocol}; defaults
        to L{dialUpstream} with C{timeout}.
    """

    reactor: object
    settings: object
    tlsPolicy: object = None
    dial: Callable | None = None
    _pools: dict = field(factory=dict)
    _log = Logger()

    def capacity(self, account) -> int:
        """
        R50: C{min(128, max(1, ceil(concurrency x factor)))}; unlimited
        accounts get the cap.
        """
        if account.concurrency <= 0:
            return MAX_CONNS_PER_ACCOUNT
        factor = self.settings.current.websocket.pool_capacity_factor
        return min(MAX_CONNS_PER_ACCOUNT, max(1, math.ceil(account.concurrency * factor)))

    def _timeout(self) -> float:
        return self.settings.current.upstream.connect_timeout_seconds

    def _pool(self, accountId: str) -> _AccountPool:
        pool = self._pools.get(accountId)
        if pool is None:
            pool = self._pools[accountId] = _AccountPool()
        return pool

    def findByResponse(
        self, accountId: str, responseId: str, ownerKey: str | None = None
    ) -> PooledConnection | None:
        """
        The live connection of C{accountId} whose chain head is
        C{responseId}, if any, among those of C{ownerKey} (R104).
        """
        for conn in self._pool(accountId).conns:
            if conn.alive and conn.lastResponseId == responseId and conn.ownerKey == ownerKey:
                return conn
        return None

    def counts(self, accountId: str) -> tuple:
        """
        @return: (open connections, busy connections, waiters), for tests.
        """
        pool = self._pool(accountId)
        live = [c for c in pool.conns if c.alive]
        return len(live), len([c for c in live if c.busy]), len(pool.waiters)

    async def acquire(
        self, account, clientHeaders: dict, preferred=None, fresh: bool = False,
        ownerKey: str | None = None,
    ) -> PooledConnection:
        """
        Lend one connection of C{account} to a turn of client key
        C{ownerKey}: C{preferred} when it is idle and alive, else an idle
        one (never one holding another turn), else a new dial under
        capacity, else wait up to dial + 2 s. Only connections dialled for
        C{ownerKey}'s turns are lent (R104: a connection carries
        the session headers and the context of the key that dialled it);
        at capacity, an idle connection of another key is closed to make
        room.

        @param fresh: dial a new connection when capacity allows instead of
            lending an idle one (the R67 turn retry); at capacity the rules
            above apply.
        @param ownerKey: the turn's client key name.

        @raise PoolBusy: the deadline passed or the queue is full (R-B3).
        @raise HandshakeRejected: a new dial was rejected with a status.
        @raise Exception: a new dial failed without a status.
        """
        pool = self._pool(account.id)
        self._prune(pool)
        mine = [c for c in pool.conns if c.ownerKey == ownerKey]

        def room() -> bool:
            return len([c for c in pool.conns if c.alive]) + pool.dialing < self.capacity(account)

        if fresh and room():
            return await self._dialInto(pool, account, clientHeaders, ownerKey)
        if (
            preferred is not None and preferred.alive and not preferred.busy
            and preferred.ownerKey == ownerKey
        ):
            preferred.busy = True
            return preferred
        for conn in mine:
            if conn.alive and not conn.busy and conn.lastResponseId is None:
                conn.busy = True
                return conn
        # R-B11: a connection holding a live chain head is lent to another
        # turn only when no new connection can be dialled.
        if room():
            return await self._dialInto(pool, account, clientHeaders, ownerKey)
        idle = [c for c in mine if c.alive and not c.busy]
        if idle:
            conn = min(idle, key=lambda c: c.openedAt)
            conn.busy = True
            return conn
        others = [c for c in pool.conns if c.alive and not c.busy and c.ownerKey != ownerKey]
        if others:
            self._close(pool, min(others, key=lambda c: c.openedAt))
            return await self._dialInto(pool, account, clientHeaders, ownerKey)
        if len(pool.waiters) >= QUEUE_LIMIT:
            raise PoolBusy("conn_queue_full")
        d = Deferred()
        d.relayOwnerKey = ownerKey
        pool.waiters.append(d)
        try:
            conn = await d.addTimeout(self._timeout() + ACQUIRE_EXTRA_SECONDS, self.reactor)
        except (DeferredTimeout, CancelledError):
            if d in pool.waiters:
                pool.waiters.remove(d)
            raise PoolBusy("acquire_timeout")
        if conn is None:
            # Another key's connection was closed to make room for this one.
            return await self._dialInto(pool, account, clientHeaders, ownerKey)
        return conn

    def _close(self, pool, conn: PooledConnection) -> None:
        """
        Close and forget an idle connection.
        """
        conn.broken = True
        if conn in pool.conns:
            pool.conns.remove(conn)
        conn.proto.close()

    async def _dialInto(self, pool, account, clientHeaders, ownerKey=None) -> PooledConnection:
        pool.dialing += 1
        try:
            if self.dial is not None:
                proto = await self.dial(account, clientHeaders)
            else:
                proto = await dialUpstream(
                    self.reactor, account, clientHeaders, self._timeout(), self.tlsPolicy
                )
        finally:
            pool.dialing -= 1
        conn = PooledConnection(
            proto=proto, accountId=account.id, openedAt=self.reactor.seconds(), busy=True,
            ownerKey=ownerKey,
        )
        proto.onGone = lambda p: self._gone(pool, conn)
        pool.conns.append(conn)
        self._log.info(
            "opened upstream websocket for {account_id} ({count} open)",
            event="relay.ws_upstream_opened",
            account_id=account.id,
            count=len(pool.conns),
        )
        return conn

    def release(self, conn: PooledConnection, broken: bool = False) -> None:
        """
        Give C{conn} back. A broken, closed or over-age connection is closed
        and forgotten; otherwise the first waiter gets it, or it idles.
        """
        if not conn.busy:
            return
        conn.busy = False
        conn.proto.listener = None
        pool = self._pool(conn.accountId)
        tooOld = self.reactor.seconds() - conn.openedAt >= MAX_AGE_SECONDS
        if broken or not conn.alive or tooOld or conn.retiring:
            conn.broken = True
            if conn in pool.conns:
                pool.conns.remove(conn)
            conn.proto.close()
            self._wakeForCapacity(pool)
            return
        pool.waiters = [d for d in pool.waiters if not d.called]
        for d in pool.waiters:
            if getattr(d, "relayOwnerKey", None) == conn.ownerKey:
                pool.waiters.remove(d)
                conn.busy = True
                d.callback(conn)
                return
        if pool.waiters:
            # R104: only another key waits; this connection is never lent
            # to it: close it, and let that waiter dial its own.
            d = pool.waiters.pop(0)
            self._close(pool, conn)
            d.callback(None)

    def retire(self, accountId: str) -> int:
        """
        An account's credentials or settings changed, or it was removed,
        in a live reload: close its idle connections now and
        each busy one when its turn gives it back, so new turns dial with
        the account in force. Other accounts' connections are untouched.

        @param accountId: the account id.
        @return: how many connections were retired.
        """
        pool = self._pools.get(accountId)
        if pool is None:
            return 0
        retired = 0
        for conn in list(pool.conns):
            retired += 1
            conn.retiring = True
            if not conn.busy:
                pool.conns.remove(conn)
                conn.broken = True
                conn.proto.close()
        if retired:
            self._log.info(
                "retiring {count} upstream websocket(s) of {account_id} after a reload",
                event="relay.ws_upstream_retired",
                account_id=accountId,
                count=retired,
            )
        return retired

    def _wakeForCapacity(self, pool) -> None:
        """
        A connection went away: a waiter may now dial. Waiters are woken by
        failing them over to a fresh dial through L{acquire}'s caller; the
        simplest correct behaviour is to let them time out unless a
        connection frees up, so nothing is done here beyond pruning.
        """
        self._prune(pool)

    def _gone(self, pool, conn) -> None:
        conn.broken = True
        if conn in pool.conns and not conn.busy:
            pool.conns.remove(conn)

    def _prune(self, pool) -> None:
        now = self.reactor.seconds()
        for conn in list(pool.conns):
            if conn.busy:
                continue
            if not conn.alive or now - conn.openedAt >= MAX_AGE_SECONDS:
                pool.conns.remove(conn)
                conn.broken = True
                conn.proto.close()

    def close(self) -> Deferred:
        """
        Close every pooled connection (service shutdown, tests).

        @return: a Deferred that fires once they are closed (bounded).
        """
        from twisted.internet.defer import DeferredList

        waits = []
        for pool in self._pools.values():
            for d in pool.waiters:
                if not d.called:
                    d.cancel()
            pool.waiters = []
            for conn in pool.conns:
                conn.broken = True
                if not conn.proto.closed:
                    done = Deferred()
                    previous = getattr(conn.proto, "onGone", None)

                    def _gone(p, done=done, previous=previous):
                        if previous is not None:
                            previous(p)
                        if not done.called:
                            done.callback(None)

                    conn.proto.onGone = _gone
                    waits.append(done.addTimeout(6, self.reactor).addErrback(lambda f: None))
                    conn.proto.close()
            pool.conns = []
        return DeferredList(waits)


class PoolService:
    """
    Closes the pooled upstream connections when relay stops.
    """

    def __init__(self, pool: UpstreamPool):
        from twisted.application.service import Service

        self.pool = pool
        self._service = Service()
        self._service.stopService = self.stopService

    def asService(self):
        return self._service

    def stopService(self):
        from twisted.application.service import Service

        Service.stopService(self._service)
        return self.pool.close()
