"""
A micro of the HTTP request side of a turn (issue 24 item 2): the real
relay site (L{relay.process.app.buildApplication}, memory state, one API-key
account) on a L{MemoryReactorClock}, one keep-alive connection on a
L{StringTransport}, and a scripted upstream answering every turn with a
small JSON body at once, so a turn runs to its answer inside the
C{dataReceived} call that brings its request. What is counted is relay's
request path (header block, intake, twisted.web's C{Request}, the answer's
head and body) plus the engine's turn; no sockets, no reactor I/O.

  python bench/requestside.py --turns 2000           # wall time per turn
  python bench/requestside.py --profile              # cProfile, top functions
  valgrind --tool=callgrind python bench/requestside.py --turns N
                                                     # instructions: run twice
                                                     # (N and 0), subtract
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.address import IPv4Address  # noqa: E402
from twisted.internet.defer import succeed  # noqa: E402
from twisted.internet.testing import MemoryReactorClock, StringTransport  # noqa: E402
from twisted.logger import globalLogPublisher  # noqa: E402
from zope.interface import implementer  # noqa: E402

from relay.interfaces import IUpstreamDialer  # noqa: E402

KEY = "sk-relay-micro"
ANSWER = json.dumps({"id": "resp_1", "object": "response", "status": "completed",
                     "output": [], "usage": {"input_tokens": 1, "output_tokens": 1,
                                             "total_tokens": 2}}).encode()
BODY = json.dumps({"model": "gpt-5.5", "input": "hi"}).encode()
REQUEST = (b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: identity\r\n"
           b"Content-Length: %d\r\nAuthorization: Bearer " % len(BODY) + KEY.encode()
           + b"\r\nContent-Type: application/json\r\n\r\n" + BODY)


@implementer(IUpstreamDialer)
class _Dialer:
    def __init__(self, clock):
        self.clock = clock

    def request(self, account, method, path, body, headers, timeouts):
        from tests.test_runner import FakeResponse

        return succeed(FakeResponse(self.clock, code=200,
                                    headers={"content-type": "application/json"},
                                    steps=[(0, ANSWER)]))


def build():
    from relay.process.app import buildApplication
    from relay.configuration.parse import settingsFromString

    config = settingsFromString(
        'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        f"keys: [{{name: team, key: {KEY}, concurrency: 0}}]\n"
        "accounts: [{id: a1, type: apikey, api_key: sk-up, "
        'base_url: "http://127.0.0.1:1/v1"}]\n'
    )
    reactor = MemoryReactorClock()
    app = buildApplication(config, reactor, dialer=_Dialer(reactor))
    site = app.site
    protocol = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = StringTransport(hostAddress=IPv4Address("TCP", "127.0.0.1", 8080),
                                peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    protocol.makeConnection(transport)
    return protocol, transport, reactor


def turns(protocol, transport, n: int) -> None:
    for _ in range(n):
        protocol.dataReceived(REQUEST)
        out = transport.value()
        if b"resp_1" not in out:
            raise SystemExit("no answer: %r" % out[:400])
        transport.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--show", action="store_true", help="print one answer")
    args = parser.parse_args()
    for observer in list(globalLogPublisher._observers):
        globalLogPublisher.removeObserver(observer)
    globalLogPublisher.addObserver(lambda event: None)
    protocol, transport, reactor = build()
    if args.show:
        protocol.dataReceived(REQUEST)
        sys.stdout.write(transport.value().decode("latin-1") + "\n")
        return
    turns(protocol, transport, args.warm)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        turns(protocol, transport, args.turns)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(45)
        return
    start = time.perf_counter()
    turns(protocol, transport, args.turns)
    took = time.perf_counter() - start
    if args.turns:
        print(f"{took / args.turns * 1e6:.1f} us per turn")


if __name__ == "__main__":
    main()
