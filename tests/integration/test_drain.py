"""
The graceful stop on real sockets (issue 14, L{relay.process.drain}):
the relay service's own C{stopService} (what twistd runs on C{SIGTERM})
stops accepting, answers requests on kept-alive connections 503 with
C{Retry-After} and C{Connection: close}, closes idle client WebSockets
1001 "server restarting" and busy ones after their turn, lets running
turns finish within C{gateway.shutdown_grace_seconds}, then cancels the
rest as relay-cancelled (their clients are told; no account state is
written) and gives back every slot, in Redis too. A real C{twistd}
subprocess exits 0 after C{SIGTERM} with nothing left in Redis.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionRefusedError, ProcessDone
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater

from relay.process.app import buildService
from relay.configuration.parse import loadConfig
from relay.emulator import Emulator
from tests.integration.harness import closedPort, sseEvents
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_reload import waitFor
from tests.integration.test_twistd import Collector, environment
from tests.integration.test_two_relays_redis import slotLeftovers
from tests.integration.test_ws_turns import _Client

KEY = "sk-relay-drain-test"
CRED = "sk-emu-drain-a1"
SLOW = {"delay": 0.2, "deltas": 5}
"""About a second of streaming output per turn."""


def writeConfig(directory, emulator, grace, extra="", keyConcurrency=0, accountConcurrency=3):
    """
    Write a relay configuration with one account on C{emulator}.

    @return: its path.
    """
    path = os.path.join(str(directory), "relay.yaml")
    account = {"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
               "api_key": CRED, "concurrency": accountConcurrency}
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            'listen: "tcp:0:interface=127.0.0.1"\n'
            f"database: {json.dumps(os.path.join(str(directory), 's.sqlite'))}\n"
            f"keys: {json.dumps([{'name': 'd', 'key': KEY, 'concurrency': keyConcurrency}])}\n"
            f"accounts: {json.dumps([account])}\n"
            f"gateway: {{shutdown_grace_seconds: {grace},"
            " websocket: {mode_default: ctx_pool}, scheduling: {fallback_wait_timeout: 60}}\n"
            f"{extra}"
        )
    return path


class Running:
    """
    A started relay service (the twistd service, in this process).
    """

    def __init__(self, service, port):
        self.service = service
        self.app = service.relayApplication
        self.port = port

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


async def startService(path) -> Running:
    """
    Build and start the relay service as twistd would, on a free port.
    """
    service = buildService(loadConfig(path), reactor, configPath=path)
    service.startService()
    port = await service.relayListener._waitingForPort
    return Running(service, port.getHost().port)


def post(url, body, key=KEY):
    """
    C{POST /v1/responses} on a fresh connection.
    """
    return treq.post(
        url + "/v1/responses", json.dumps(body).encode(),
        headers={"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]},
        persistent=False,
    )


async def answer(d, timeout=20.0):
    """
    @return: C{(status, headers, body)} of a treq response Deferred, within
        C{timeout} seconds (a test that breaks fails fast, never hangs).
    """
    response = await d.addTimeout(timeout, reactor)
    return response.code, response.headers, await response.content().addTimeout(timeout, reactor)


class RawClient(Protocol):
    """
    A kept-alive HTTP/1.1 connection driven by hand.
    """

    def __init__(self):
        self.data = b""
        self.lost = Deferred()

    def dataReceived(self, data):
        self.data += data

    def connectionLost(self, reason):
        self.lost.callback(None)


async def rawConnect(port) -> RawClient:
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5)
    return await endpoint.connect(Factory.forProtocol(RawClient))


async def connectWS(port) -> _Client:
    """
    A client WebSocket to C{/v1/responses}.
    """
    from autobahn.twisted.websocket import WebSocketClientFactory

    factory = WebSocketClientFactory(
        f"ws://127.0.0.1:{port}/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
        reactor=reactor,
    )
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(5, reactor)
    return proto


CREATE = {"type": "response.create", "model": "gpt-5.5", "input": "hi"}


@pytest_twisted.ensureDeferred
async def test_drain_finishes_running_turns_and_refuses_new(tmp_path):
    """
    During the drain: new connections are refused; a request on a
    kept-alive connection gets 503 + Retry-After + Connection: close; an
    idle WebSocket closes 1001 at once; a busy one gets its answer, then
    1001 instead of running the response.create it sent meanwhile; the
    running SSE turn completes; then the stop finishes.
    """
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    relay = await startService(writeConfig(tmp_path, emulator, grace=20))
    clients = []
    try:
        idle = await connectWS(relay.port)
        clients.append(idle)
        events = await idle.turn(CREATE)
        assert events[-1]["type"] == "response.completed"

        raw = await rawConnect(relay.port)
        raw.transport.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await waitFor(lambda: b"\r\n\r\n" in raw.data and raw.data.endswith(b"}"))
        assert raw.data.startswith(b"HTTP/1.1 200")
        raw.data = b""

        emulator.setScript(CRED, SLOW)
        busy = await connectWS(relay.port)
        clients.append(busy)
        busy.sendJSON(CREATE)
        # R63: a second response.create while the first runs is held; during
        # the drain it is answered by the 1001 close, never run.
        busy.sendJSON(dict(CREATE, input="the next turn"))
        sse = Deferred.fromCoroutine(answer(post(relay.url, {
            "model": "gpt-5.5", "input": "hi", "stream": True})))
        await waitFor(lambda: emulator.inflight(CRED) == 2)

        stopped = relay.service.stopService()
        code, reason = await idle.closed.addTimeout(5, reactor)
        assert (code, reason) == (1001, "server restarting")

        with pytest.raises(ConnectionRefusedError):
            await rawConnect(relay.port)

        # With the key (R103: without it, 401 from the headers first).
        raw.transport.write(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\n\r\n"
        )
        await raw.lost.addTimeout(5, reactor)
        head, _, body = raw.data.partition(b"\r\n\r\n")
        lowered = head.lower()
        assert head.startswith(b"HTTP/1.1 503"), raw.data
        assert b"retry-after: 1" in lowered and b"connection: close" in lowered
        assert b'"server_restarting"' in body

        events = await busy.collect(10)
        assert events[-1]["type"] == "response.completed"
        assert await busy.closed.addTimeout(5, reactor) == (1001, "server restarting")
        upstreamFrames = [json.dumps(r.body) for r in emulator.requestsFor(CRED, "frame")]
        assert len(upstreamFrames) == 2
        assert not any("the next turn" in f for f in upstreamFrames)

        status, _, data = await sse
        assert status == 200
        assert [e for e, _ in sseEvents(data)][-1] == "response.completed"

        await stopped.addTimeout(10, reactor)
        assert relay.app.runner.inflight == {}
    finally:
        for c in clients:
            c.bye()
        if relay.service.running:
            await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_grace_over_cancels_and_tells_clients(tmp_path):
    """
    When the grace runs out: a JSON turn waiting on upstream gets 503 with
    Retry-After; a streaming turn already sending output ends with an
    in-stream response.failed (server_restarting); a WebSocket turn closes
    1001 "server restarting". Upstream calls are dropped and no account
    state is written.
    """
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    relay = await startService(writeConfig(tmp_path, emulator, grace=1))
    clients = []
    try:
        emulator.setFault(CRED, [
            {"kind": "hang_before_headers", "times": 1, "transport": "http"},
            {"kind": "hang_before_headers", "times": 1, "transport": "ws"},
        ])
        blocked = Deferred.fromCoroutine(answer(post(relay.url, {
            "model": "gpt-5.5", "input": "hi", "stream": False})))
        await waitFor(lambda: emulator.inflight(CRED) == 1)
        ws = await connectWS(relay.port)
        clients.append(ws)
        ws.sendJSON(CREATE)
        await waitFor(lambda: emulator.inflight(CRED) == 2)
        emulator.setScript(CRED, {"delay": 0.2, "deltas": 100})
        streaming = Deferred.fromCoroutine(answer(post(relay.url, {
            "model": "gpt-5.5", "input": "hi", "stream": True})))
        await waitFor(lambda: emulator.inflight(CRED) == 3)
        await deferLater(reactor, 0.5, lambda: None)

        report = []
        relay.app.drain.drain().addCallback(report.append)
        stopped = relay.service.stopService()

        status, headers, body = await blocked
        assert status == 503
        assert headers.getRawHeaders(b"retry-after") == [b"1"]
        assert json.loads(body)["error"]["code"] == "server_restarting"

        status, _, data = await streaming
        assert status == 200
        events = sseEvents(data)
        assert any(e == "response.output_text.delta" for e, _ in events)
        last, payload = events[-1]
        assert last == "response.failed"
        assert payload["response"]["error"]["code"] == "server_restarting"

        events = await ws.collect(10)
        assert events[-1] == {"type": "__closed__", "code": 1001, "reason": "server restarting"}

        await stopped.addTimeout(15, reactor)
        assert report[0].cancelled == 3
        await waitFor(lambda: emulator.inflight(CRED) == 0)
        states = await relay.app.store.getAccountStates(["a1"])
        assert states["a1"].blockedUntil == 0
        assert relay.app.health._breakers == {}
    finally:
        for c in clients:
            c.bye()
        if relay.service.running:
            await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_drain_leaves_nothing_in_redis(tmp_path, redisServer):  # noqa: F811
    """
    With Redis: one turn holds the account's only slot upstream, one waits
    for it, one waits for a per-key slot. The stop cancels them at the end
    of the grace and no C{concurrency:*} / C{wait:*} entry is left.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    path = writeConfig(
        tmp_path, emulator, grace=1, keyConcurrency=2, accountConcurrency=1,
        extra=f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n",
    )
    relay = await startService(path)
    try:
        emulator.setFault(CRED, {"kind": "hang_before_headers", "times": 1})
        turns = [
            Deferred.fromCoroutine(answer(post(relay.url, {"model": "gpt-5.5", "input": str(i)})))
            for i in range(3)
        ]
        await waitFor(lambda: emulator.inflight(CRED) == 1)
        await waitFor(lambda: len(relay.app.runner.inflight) == 3)
        await deferLater(reactor, 0.3, lambda: None)
        assert slotLeftovers(redisServer) != []
        await relay.service.stopService().addTimeout(15, reactor)
        for d in turns:
            status, headers, _ = await d
            assert status == 503
            assert headers.getRawHeaders(b"retry-after") == [b"1"]
        assert slotLeftovers(redisServer) == []
    finally:
        if relay.service.running:
            await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_sigterm_twistd_finishes_turn_and_exits_zero(tmp_path, redisServer):  # noqa: F811
    """
    A real twistd relay on Redis: SIGTERM while a turn streams and another
    waits for the account's only slot. Both finish within the grace, the
    process exits with status 0, and Redis holds nothing of it.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    emulator.setScript(CRED, {"delay": 0.1, "deltas": 5})
    path = writeConfig(
        tmp_path, emulator, grace=20, accountConcurrency=1,
        extra=f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n",
    )
    port = closedPort()
    collector = Collector()
    process = reactor.spawnProcess(
        collector, sys.executable,
        [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n",
         "--pidfile=", "relay", "--config", path,
         "--listen", f"tcp:{port}:interface=127.0.0.1"],
        env=environment(), path=str(tmp_path),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        from tests.integration.test_reload import healthy

        await healthy(url, KEY)
        turns = [
            Deferred.fromCoroutine(answer(post(url, {"model": "gpt-5.5", "input": str(i),
                                                     "stream": True})))
            for i in range(2)
        ]
        await waitFor(lambda: emulator.inflight(CRED) == 1)
        process.signalProcess("TERM")
        for d in turns:
            status, _, data = await d
            assert status == 200
            assert [e for e, _ in sseEvents(data)][-1] == "response.completed"
        reason = await collector.ended.addTimeout(20, reactor)
        assert isinstance(reason, ProcessDone), collector.text
        assert "relay.drain_finished" in collector.text or "drained in" in collector.text
        assert slotLeftovers(redisServer) == []
    finally:
        if not collector.ended.called:
            process.signalProcess("KILL")
            await collector.ended
        await emulator.stop()
