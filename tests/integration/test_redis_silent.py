"""
behaviour.md R101 (issue 23): a Redis that stops answering bounds every
turn and is never blamed on upstream.

A relay process on C{state.backend: redis} whose Redis (1) is a listener
that accepts connections and never replies, or (2) is a real
C{redis-server} stopped with C{SIGSTOP}: every JSON, SSE and WebSocket turn,
with and without a per-key slot, ends within 15 s with 503 and R32's service
message (WebSocket: HTTP 503 before the upgrade per R36, or close 1011
"failed to acquire ... concurrency slot" / 1013), never 502
C{upstream_error}; nothing in the log is critical or a traceback;
C{/healthz} answers 200 and C{/readyz} 503 naming C{redis}. When Redis
answers again (the real server started on the silent port; C{SIGCONT})
turns complete and C{/readyz} is 200 again, with no restart.

On the old code JSON and SSE got 502 "Upstream request failed" after 2 s
and the log had a critical traceback (the per-key slot's admission error
escaped the runner).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile

import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from tests.integration.redis_server import RedisServer, freePort, requireRedis
from tests.integration.relayproc import ROOT, RelayProcess
from tests.integration.test_two_relays_redis import slotLeftovers
from tests.integration.test_ws_turns import _Client, userTurn

SLOT_KEY = "sk-silent-slot"
FREE_KEY = "sk-silent-free"
BOUND = 15.0
SERVICE_MESSAGE = "Service temporarily unavailable, please retry later"


class _Silent(Protocol):
    """
    Accepts and never writes a byte: a Redis that does not answer.
    """

    def connectionMade(self):
        self.factory.connections.append(self)


def _config(path: str, port: int, emulator, redisPort: int, onError: str) -> None:
    keys = [
        {"name": "slot", "key": SLOT_KEY, "concurrency": 4},
        {"name": "free", "key": FREE_KEY, "concurrency": 0},
    ]
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-silent-a1", "concurrency": 4},
    ]
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        "admin_key: admin-silent-0123456789\n"
        f"keys: {json.dumps(keys)}\n"
        f"accounts: {json.dumps(accounts)}\n"
        "gateway: {websocket: {mode_default: ctx_pool}}\n"
        f"state: {{backend: redis, redis_url: 'redis://127.0.0.1:{redisPort}/0',"
        f" on_redis_error: {onError}}}\n"
    )
    with open(path, "w") as f:
        f.write(text)


async def _get(url: str):
    r = await treq.get(url, persistent=False)
    return r.code, await r.content()


async def _post(relay: RelayProcess, key: str, stream: bool):
    body = {"model": "gpt-5.5", "input": "hi", "stream": stream}
    r = await treq.post(
        relay.url + "/v1/responses", json.dumps(body).encode(),
        headers={"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]},
        persistent=False,
    )
    return r.code, await r.content()


async def _wsTurn(relay: RelayProcess, key: str):
    """
    One WebSocket turn. @return: C{("refused", status)} when the upgrade
    was refused, C{("events", [event types], close)} otherwise.
    """
    factory = WebSocketClientFactory(
        relay.url.replace("http", "ws") + "/v1/responses",
        headers={"Authorization": f"Bearer {key}"}, reactor=reactor,
    )
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port, timeout=5).connect(factory)
    try:
        await proto.opened.addTimeout(BOUND, reactor)
    except Exception:
        return ("refused", getattr(proto, "http_status_code", None))
    events = await proto.turn(userTurn("hi"), timeout=BOUND)
    proto.bye()
    return ("events", [e["type"] for e in events], proto.closeInfo)


async def _allTurns(relay: RelayProcess):
    """
    JSON, SSE and WebSocket turns on both keys at once, each timed.

    @return: C{[(name, seconds, result)]}.
    """

    async def timed(name, coro):
        start = reactor.seconds()
        result = await coro
        return (name, reactor.seconds() - start, result)

    jobs = []
    for key, label in ((SLOT_KEY, "slot"), (FREE_KEY, "free")):
        jobs.append(timed(f"json/{label}", _post(relay, key, False)))
        jobs.append(timed(f"sse/{label}", _post(relay, key, True)))
        jobs.append(timed(f"ws/{label}", _wsTurn(relay, key)))
    return await gatherResults([Deferred.fromCoroutine(j) for j in jobs])


def _assertRefused(results) -> None:
    """
    R101: every turn ended within the bound with the service error.
    """
    for name, seconds, result in results:
        assert seconds < BOUND, (name, seconds, result)
        if name.startswith("ws/"):
            if result[0] == "refused":
                # R36: the ingress lease is checked before the upgrade.
                assert result[1] == 503, (name, result)
            else:
                types, close = result[1], result[2]
                assert close is not None and close[0] in (1011, 1013), (name, result)
                if close[0] == 1011:
                    assert "concurrency slot" in close[1], (name, result)
                assert "response.completed" not in types, (name, result)
            continue
        status, body = result
        assert status == 503, (name, status, body)
        assert b"upstream_error" not in body and b"Upstream request failed" not in body, body
        assert SERVICE_MESSAGE.encode() in body, (name, body)


def _assertServed(results) -> None:
    for name, seconds, result in results:
        if name.startswith("ws/"):
            assert result[0] == "events" and "response.completed" in result[1], (name, result)
        else:
            assert result[0] == 200, (name, result)
            if name.startswith("sse/"):
                assert b"response.completed" in result[1], (name, result)


async def _until(check, timeout: float, what: str):
    deadline = reactor.seconds() + timeout
    last = None
    while reactor.seconds() < deadline:
        last = await check()
        if last:
            return last
        await deferLater(reactor, 0.2, lambda: None)
    raise AssertionError(f"{what} within {timeout}s (last: {last!r})")


async def _readyIs(relay: RelayProcess, ready: bool):
    code, body = await _get(relay.url + "/readyz")
    if ready:
        return code == 200 and json.loads(body) == {"status": "ready"}
    return code == 503 and "redis" in json.loads(body)["waiting"]


async def _served(relay: RelayProcess):
    results = await _allTurns(relay)
    try:
        _assertServed(results)
    except AssertionError:
        return False
    return results


def _assertCleanLog(relay: RelayProcess) -> None:
    log = relay.tail(10**7)
    assert "Traceback" not in log, log[-4000:]
    assert "#critical" not in log, log[-4000:]
    assert "upstream_error" not in log


async def _noLeftovers(server) -> None:
    async def check():
        return slotLeftovers(server) == []

    await _until(check, 10, "no slot or queue entry left in Redis")


async def _startRelay(tmp: str, emulator, redisPort: int, onError: str) -> RelayProcess:
    relay = RelayProcess(config=os.path.join(tmp, "relay.yaml"), log=os.path.join(tmp, "relay.log"))
    _config(relay.config, relay.port, emulator, redisPort, onError)
    relay.start()
    await relay.waitHealthy()
    return relay


@pytest_twisted.ensureDeferred
async def test_silent_listener_then_real_redis():
    """
    R101 with a listener that accepts and never replies (fail_open): every
    turn is a bounded 503, /healthz 200, /readyz 503 [redis]; a real
    redis-server on that port brings relay back by itself.
    """
    requireRedis()
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    factory = Factory.forProtocol(_Silent)
    factory.connections = []
    redisPort = freePort()
    port = await TCP4ServerEndpoint(reactor, redisPort, interface="127.0.0.1").listen(factory)
    tmp = tempfile.mkdtemp(prefix="relay-silent-")
    relay = server = None
    try:
        relay = await _startRelay(tmp, emulator, redisPort, "fail_open")
        assert await _readyIs(relay, False)
        for _ in range(2):  # the first turns meet the silence, the next the fail-fast
            _assertRefused(await _allTurns(relay))
        assert (await _get(relay.url + "/healthz"))[0] == 200
        assert await _readyIs(relay, False)
        # Nothing reached upstream: the turns were refused at admission.
        assert emulator.requestsFor("sk-silent-a1") == []
        # Redis comes back on the same port.
        await port.stopListening()
        for c in factory.connections:
            c.transport.abortConnection()
        server = RedisServer(port=redisPort)
        server.start()
        await _until(lambda: _readyIs(relay, True), 20, "relay ready again")
        await _until(lambda: _served(relay), 20, "turns served again")
        await _noLeftovers(server)
        _assertCleanLog(relay)
    finally:
        if relay is not None:
            await relay.shutdown()
        if server is not None:
            server.cleanup()
        else:
            await port.stopListening()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_sigstopped_redis_fail_closed():
    """
    R101 with a real redis-server under SIGSTOP (fail_closed): bounded
    503s, no traceback, /readyz 503 [redis]; SIGCONT resumes service.
    """
    requireRedis()
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    server = RedisServer()
    server.start()
    tmp = tempfile.mkdtemp(prefix="relay-sigstop-")
    relay = None
    stopped = False
    try:
        relay = await _startRelay(tmp, emulator, server.port, "fail_closed")
        await _until(lambda: _readyIs(relay, True), 10, "relay ready")
        _assertServed(await _allTurns(relay))
        os.kill(server.process.pid, signal.SIGSTOP)
        stopped = True
        for _ in range(2):
            _assertRefused(await _allTurns(relay))
        assert (await _get(relay.url + "/healthz"))[0] == 200
        await _until(lambda: _readyIs(relay, False), 10, "relay not ready")
        os.kill(server.process.pid, signal.SIGCONT)
        stopped = False
        await _until(lambda: _readyIs(relay, True), 20, "relay ready again")
        await _until(lambda: _served(relay), 20, "turns served again")
        # Acquires that timed out while Redis was stopped ran when it went
        # on: relay released them again (no slot leaked, issue 23).
        await _noLeftovers(server)
        _assertCleanLog(relay)
    finally:
        if stopped:
            os.kill(server.process.pid, signal.SIGCONT)
        if relay is not None:
            await relay.shutdown()
        server.cleanup()
        await emulator.stop()


__all__ = ["ROOT"]
