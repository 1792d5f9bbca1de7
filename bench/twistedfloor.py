"""
The Twisted floor row of C{bench/compare.py} (issue 24): the least any
gateway written on Twisted in CPython does per request, measured beside the
Go row in the same run.

It does what the Go row (C{bench/goproxy/main.go}) does and nothing more:
checks the client key, swaps in the upstream credential and proxies over
keep-alive connections, passing the upstream's bytes through as they come
(SSE included). It uses the parts relay's hot path uses -- the Twisted
reactor and C{httptools} for both the request and the response -- and none
of relay's: no policy, no logging, no metrics, no state, no body parsing,
no header normalisation, no timeouts. It is not a product and is not safe to
expose (no limits of any kind); it exists so that a ratio against Go can be
split into what CPython and the reactor cost and what relay adds.

  python bench/twistedfloor.py LISTEN_PORT UPSTREAM_PORT CLIENT_KEY UPSTREAM_KEY
"""

from __future__ import annotations

import sys

import httptools
from twisted.internet import reactor
from twisted.internet.protocol import Factory, Protocol

_DENIED = (b'{"error":{"message":"invalid key","type":"invalid_request_error",'
           b'"code":"invalid_api_key"}}')
UNAUTHORIZED = (b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(_DENIED)) + _DENIED


class Upstream(Protocol):
    """
    One keep-alive connection to the upstream; relays one response at a
    time back to C{client}, byte for byte.
    """

    def __init__(self, pool: list):
        self.pool = pool
        self.client = None
        self.parser = httptools.HttpResponseParser(self)

    def send(self, client, data: bytes) -> None:
        self.client = client
        self.transport.write(data)

    def dataReceived(self, data: bytes) -> None:
        client = self.client
        client.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self.pool.append(self)
        client.responded()

    def connectionLost(self, reason=None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:
            self.client.transport.loseConnection()


class Client(Protocol):
    """
    One client connection: parse a request, check the key, send it upstream
    with the upstream credential.
    """

    def __init__(self, factory: "Floor"):
        self.factory = factory
        self.parser = httptools.HttpRequestParser(self)
        self.headers: list = []
        self.body: list = []
        self.url = b""

    def dataReceived(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        factory = self.factory
        head = [self.parser.get_method() + b" " + self.url + b" HTTP/1.1"]
        authorized = False
        for name, value in self.headers:
            if name.lower() == b"authorization":
                authorized = value == factory.want
                value = factory.upstream
            head.append(name + b": " + value)
        data = b"\r\n".join(head) + b"\r\n\r\n" + b"".join(self.body)
        self.headers, self.body, self.url = [], [], b""
        if not authorized:
            self.transport.write(UNAUTHORIZED)
            return
        pool = factory.pool
        if pool:
            pool.pop().send(self, data)
            return
        factory.connect().addCallback(lambda up: up.send(self, data))

    def responded(self) -> None:
        pass


class Floor(Factory):
    def __init__(self, upstreamPort: int, want: bytes, upstream: bytes):
        self.upstreamPort = upstreamPort
        self.want, self.upstream = want, upstream
        self.pool: list = []

    def buildProtocol(self, addr):
        return Client(self)

    def connect(self):
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        return connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.upstreamPort),
                               Upstream(self.pool))


def main() -> None:
    port, upstreamPort, key, upstreamKey = sys.argv[1:5]
    floor = Floor(int(upstreamPort), b"Bearer " + key.encode(), b"Bearer " + upstreamKey.encode())
    reactor.listenTCP(int(port), floor, backlog=1024, interface="127.0.0.1")
    reactor.run()


if __name__ == "__main__":
    main()
