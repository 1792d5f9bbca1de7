"""
Two relay processes sharing one real Redis (issue 4): many concurrent
clients through both against the emulator, which reports its peak
concurrency per credential. Per-account in-flight never exceeds the
account's C{concurrency}, and afterwards every slot set and wait queue in
Redis is empty (behaviour.md R27, R29, R33, R34).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from tests.integration.redis_server import freePort, redisServer  # noqa: F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-relay-two"


def _config(path, port, emulator, redisURL) -> None:
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-two-a1", "concurrency": 2},
        {"id": "a2", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-two-a2", "concurrency": 1},
    ]
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        f"keys: {json.dumps([{'name': 'two', 'key': KEY, 'concurrency': 0}])}\n"
        f"accounts: {json.dumps(accounts)}\n"
        "gateway: {scheduling: {fallback_wait_timeout: 20, ping_interval: 5}}\n"
        f"state: {{backend: redis, redis_url: '{redisURL}'}}\n"
    )
    with open(path, "w") as f:
        f.write(text)


async def _waitHealthy(port: int, timeout: float = 15.0) -> None:
    deadline = reactor.seconds() + timeout
    while reactor.seconds() < deadline:
        try:
            r = await treq.get(f"http://127.0.0.1:{port}/healthz", persistent=False)
            await r.content()
            if r.code == 200:
                return
        except Exception:
            pass
        await deferLater(reactor, 0.1, lambda: None)
    raise AssertionError(f"relay on {port} did not become healthy")


@pytest_twisted.ensureDeferred
async def test_two_relays_share_slots(redisServer):  # noqa: F811
    """
    R29/R34: two relay processes on one Redis admit at most C{concurrency}
    turns per account between them, make the rest wait, and leave no slot
    or queue entry behind.
    """
    emulator = Emulator(reactor=reactor, config={"default_script": {"text": "slow answer", "delay": 0.05, "deltas": 6}})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-two-")
    ports = [freePort(), freePort()]
    procs = []
    try:
        for i, port in enumerate(ports):
            path = os.path.join(tmp, f"relay{i}.yaml")
            _config(path, port, emulator, redisServer.url)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "twisted", "relay", "--config", path],
                    cwd=ROOT,
                    env=dict(os.environ, PYTHONPATH=ROOT),
                    stdout=open(os.path.join(tmp, f"relay{i}.log"), "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        for port in ports:
            await _waitHealthy(port)

        async def one(i):
            port = ports[i % 2]
            body = json.dumps({"model": "gpt-5.5", "input": f"q{i}", "stream": i % 3 != 0}).encode()
            r = await treq.post(
                f"http://127.0.0.1:{port}/v1/responses",
                body,
                headers={"Authorization": [f"Bearer {KEY}"], "Content-Type": ["application/json"]},
                persistent=False,
            )
            data = await r.content()
            return r.code, data

        results = await gatherResults([Deferred.fromCoroutine(one(i)) for i in range(24)])
        codes = [c for c, _ in results]
        assert codes == [200] * 24, codes
        for _, data in results:
            assert b"response.failed" not in data
        assert emulator.peak("sk-two-a1") <= 2
        assert emulator.peak("sk-two-a2") <= 1
        assert emulator.peak("sk-two-a1") + emulator.peak("sk-two-a2") >= 2
        await deferLater(reactor, 0.2, lambda: None)  # fire-and-forget releases land
        assert slotLeftovers(redisServer) == []
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        await emulator.stop()


def slotLeftovers(server) -> list:
    """
    Non-empty slot sets and wait queues (C{concurrency:*}, C{wait:*}) in
    Redis, as C{[(key, members)]} (R33: nothing may be left behind).
    """
    leftovers = []
    for pattern in ("concurrency:*", "wait:*"):
        for key in _cli(server, "--scan", "--pattern", pattern).split():
            if _cli(server, "type", key).strip() == "zset":
                n = int(_cli(server, "zcard", key).strip() or 0)
                if n:
                    leftovers.append((key, n))
    return leftovers


def _cli(server, *args) -> str:
    """
    Run C{redis-cli} against the test server.
    """
    out = subprocess.run(
        ["redis-cli", "-p", str(server.port), *args], capture_output=True, timeout=10, check=True
    )
    return out.stdout.decode()
