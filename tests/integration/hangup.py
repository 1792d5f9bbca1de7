"""
A raw HTTP client that hangs up once a marker came (behaviour.md R107's
client that leaves after the first output).
"""

from __future__ import annotations

import json

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol


class HangUp(Protocol):
    """
    A raw HTTP client that drops its connection as soon as C{marker} came.

    @ivar left: fires with what was received when the connection ended.
    """

    def __init__(self, request: bytes, marker: bytes | None):
        self.request = request
        self.marker = marker
        self.received = b""
        self.left = Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.received += data
        if self.marker is not None and self.marker in self.received and not self.left.called:
            self.transport.abortConnection()
            self.left.callback(self.received)

    def connectionLost(self, reason):
        if not self.left.called:
            self.left.callback(self.received)


async def hangUpAt(port: int, key: str, path: str, body: dict, marker: bytes | None,
                   timeout: float = 10):
    """
    POST C{body} to relay on C{port} with C{key} and hang up once C{marker}
    was received.

    @param marker: bytes, or L{None}: the caller hangs up itself.
    @return: what the client received (the L{HangUp} client for no marker).
    """
    raw = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw
    client = HangUp(request, marker)
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    await endpoint.connect(Factory.forProtocol(lambda: client))
    if marker is None:
        return client
    return await client.left.addTimeout(timeout, reactor)
