"""
Slot-full waits on Redis across transports (issue 4; behaviour.md R29, R34,
R60): two relay processes on one real Redis compete for ONE account with
C{concurrency: 1} against a slow emulator. Relay 0 serves WebSocket clients
(C{ctx_pool}), relay 1 serves plain HTTP clients. Every WebSocket turn and
every HTTP request completes, the emulator never sees more than one
in-flight turn on the account, and afterwards every C{concurrency:*} and
C{wait:*} sorted set in Redis is empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from tests.integration.redis_server import freePort, redisServer  # noqa: F401 (fixture)
from tests.integration.test_two_relays_redis import ROOT, _waitHealthy, slotLeftovers
from tests.integration.test_ws_turns import _Client, userTurn

KEY = "sk-relay-wshttp"
CRED = "sk-wshttp-a1"
WS_CLIENTS = 2
WS_TURNS = 2
HTTP_REQUESTS = 4


def _config(path, port, emulator, redisURL) -> None:
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": CRED, "concurrency": 1},
    ]
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        f"keys: {json.dumps([{'name': 'wshttp', 'key': KEY, 'concurrency': 0}])}\n"
        f"accounts: {json.dumps(accounts)}\n"
        "gateway: {scheduling: {fallback_wait_timeout: 20, sticky_session_wait_timeout: 20,"
        " sticky_session_max_waiting: 50, ping_interval: 5},"
        " websocket: {mode_default: ctx_pool}}\n"
        f"state: {{backend: redis, redis_url: '{redisURL}'}}\n"
    )
    with open(path, "w") as f:
        f.write(text)


async def _connectWS(port: int) -> _Client:
    factory = WebSocketClientFactory(
        f"ws://127.0.0.1:{port}/v1/responses",
        headers={"Authorization": f"Bearer {KEY}"},
        reactor=reactor,
    )
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(5, reactor)
    return proto


async def _stop(procs, timeout: float = 10.0) -> None:
    """
    Terminate the relays and wait for them without blocking the reactor:
    the in-process emulator must keep answering their upstream WebSocket
    close handshakes while they shut down.
    """
    for p in procs:
        p.terminate()
    deadline = reactor.seconds() + timeout
    while any(p.poll() is None for p in procs) and reactor.seconds() < deadline:
        await deferLater(reactor, 0.05, lambda: None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)


@pytest_twisted.ensureDeferred
async def test_ws_and_http_relays_share_one_slot(redisServer):  # noqa: F811
    """
    Issue 4 / R29 / R34 / R60: WebSocket turns on relay 0 and concurrent
    HTTP requests on relay 1 share one account slot through Redis: all
    complete, peak in-flight is 1, and no slot or queue entry is left.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(
        reactor=reactor,
        config={"default_script": {"text": "slow answer", "delay": 0.05, "deltas": 6}},
    )
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-wshttp-")
    ports = [freePort(), freePort()]
    procs = []
    clients = []
    try:
        for i, port in enumerate(ports):
            path = os.path.join(tmp, f"relay{i}.yaml")
            _config(path, port, emulator, redisServer.url)
            with open(os.path.join(tmp, f"relay{i}.log"), "wb") as log:  # noqa: ASYNC230
                procs.append(
                    subprocess.Popen(  # noqa: ASYNC220 (started, never waited on here)
                        [sys.executable, "-m", "twisted", "relay", "--config", path],
                        cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        for port in ports:
            await _waitHealthy(port)

        async def wsClient(n):
            client = await _connectWS(ports[0])
            clients.append(client)
            previous = None
            out = []
            for t in range(WS_TURNS):
                events = await client.turn(userTurn(f"ws {n}.{t}", previous=previous), timeout=20)
                out.append(events[-1])
                if events[-1]["type"] == "response.completed":
                    previous = events[-1]["response"]["id"]
            return out

        async def httpRequest(i):
            body = json.dumps({"model": "gpt-5.5", "input": f"http {i}", "stream": i % 2 == 0})
            r = await treq.post(
                f"http://127.0.0.1:{ports[1]}/v1/responses",
                body.encode(),
                headers={"Authorization": [f"Bearer {KEY}"], "Content-Type": ["application/json"]},
                persistent=False,
            )
            return r.code, await r.content()

        work = [Deferred.fromCoroutine(wsClient(n)) for n in range(WS_CLIENTS)]
        work += [Deferred.fromCoroutine(httpRequest(i)) for i in range(HTTP_REQUESTS)]
        results = await gatherResults(work, consumeErrors=True)
        wsResults, httpResults = results[:WS_CLIENTS], results[WS_CLIENTS:]
        for terminals in wsResults:
            assert [e["type"] for e in terminals] == ["response.completed"] * WS_TURNS, terminals
        assert [code for code, _ in httpResults] == [200] * HTTP_REQUESTS, httpResults
        for _, data in httpResults:
            assert b"response.failed" not in data
        assert all(c.closeInfo is None for c in clients)
        assert len(emulator.requestsFor(CRED, "frame")) == WS_CLIENTS * WS_TURNS
        assert len(emulator.requestsFor(CRED, "request")) == HTTP_REQUESTS
        assert emulator.peak(CRED) == 1
        for c in clients:
            c.bye()
        await deferLater(reactor, 0.3, lambda: None)  # fire-and-forget releases land
        assert slotLeftovers(redisServer) == []
    finally:
        for c in clients:
            c.bye()
        await _stop(procs)
        await emulator.stop()
