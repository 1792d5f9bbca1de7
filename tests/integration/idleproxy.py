"""
A TCP proxy that cuts idle connections, like nginx's C{proxy_read_timeout}
or a CDN in front of relay (issue 13 item 4, behaviour.md R85).

Every accepted connection is relayed to one target; when the target has
sent the client nothing for C{idle} seconds the proxy closes both sides.
Only bytes from the target count as activity (a client's own pings or
pongs do not keep the connection alive), so a relay that falls silent is
cut no matter what the client does.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol


class _Upstream(Protocol):
    """
    The proxy's connection to the target: bytes go to the client, and
    count as activity.
    """

    def __init__(self, downstream: _Downstream):
        self.downstream = downstream

    def dataReceived(self, data: bytes) -> None:
        self.downstream.activity()
        self.downstream.transport.write(data)

    def connectionLost(self, reason) -> None:
        self.downstream.transport.loseConnection()


class _Downstream(Protocol):
    """
    One client connection: buffers until the target is connected, then
    relays both ways and arms the idle timer.
    """

    def __init__(self, proxy: IdleCuttingProxy):
        self.proxy = proxy
        self.upstream = None
        self.pending = []
        self.timer = None

    def connectionMade(self) -> None:
        self.proxy.connections += 1
        self.proxy.live.add(self)
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.proxy.targetPort, timeout=5)
        d = endpoint.connect(Factory.forProtocol(lambda: _Upstream(self)))
        d.addCallbacks(self._connected, lambda f: self.transport.loseConnection())
        self.activity()

    def _connected(self, upstream) -> None:
        self.upstream = upstream
        for data in self.pending:
            upstream.transport.write(data)
        self.pending = []

    def activity(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.reset(self.proxy.idle)
        else:
            self.timer = reactor.callLater(self.proxy.idle, self._cut)

    def _cut(self) -> None:
        self.timer = None
        self.proxy.cuts += 1
        self.transport.abortConnection()
        if self.upstream is not None:
            self.upstream.transport.abortConnection()

    def dataReceived(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending.append(data)
        else:
            self.upstream.transport.write(data)

    def connectionLost(self, reason) -> None:
        self.proxy.live.discard(self)
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        if self.upstream is not None:
            self.upstream.transport.loseConnection()


class IdleCuttingProxy:
    """
    Listens on a loopback port and relays to C{targetPort}, cutting a
    connection after C{idle} seconds without bytes from the target.

    @ivar cuts: connections cut for idleness so far.
    @ivar connections: connections accepted so far.
    @ivar live: the client connections open now.
    """

    def __init__(self, targetPort: int, idle: float):
        self.targetPort = targetPort
        self.idle = idle
        self.cuts = 0
        self.connections = 0
        self.live = set()
        self.port = None

    async def listen(self) -> int:
        """
        @return: the proxy's port on 127.0.0.1.
        """
        factory = Factory.forProtocol(lambda: _Downstream(self))
        self.port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
        return self.port.getHost().port

    async def stop(self) -> None:
        """
        Stop listening and drop the connections still open.
        """
        for conn in list(self.live):
            conn.transport.abortConnection()
            if conn.upstream is not None:
                conn.upstream.transport.abortConnection()
        if self.port is not None:
            await self.port.stopListening()
