"""
The container image, built and run (issue 23; Dockerfile,
docs/deploying.md).

No registry is reachable from CI, so the images are made here
(L{tests.integration.containers}: C{scripts/container-images.sh}, the base
from Debian packages with mmdebstrap, relay's image on it from this
checkout), once per test session and from scratch under CI (C{CI} set);
L{tests.integration.test_compose} reuses them. Podman runs with
L{.ci/containers.conf} (runc; no default ulimits), pip inside the build with
the machine's CA bundle mounted read-only.

The image then runs (host network) against the emulator and a real
C{redis-server} on loopback: it runs as the unprivileged user, its health
check passes, C{/readyz} is ready, the requests of C{scripts/demo.sh
--check} pass through it (a streaming and a non-streaming
C{POST /v1/responses}, with the demo's failover off a 503 account) and a
WebSocket turn; C{SIGTERM} (C{podman stop}) while a slow stream runs: the
stream completes, the container exits 0 well within the stop timeout, and
its log shows the drain. A second run on the memory backend puts its
SQLite database on the image's volume, owned by the relay user.

Skipped (with the reason) only when podman is not installed; C{.ci/run}
installs it and mmdebstrap.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from relay.emulator import Emulator
from tests.integration.containers import RELAY_UID, containerImages, podman  # noqa: F401
from tests.integration.redis_server import RedisServer, freePort, requireRedis
from tests.integration.test_ws_turns import _Client, userTurn

KEY = "sk-relay-container"
ADMIN = "admin-container-0123456789"


@pytest.fixture(scope="module")
def relayImage(containerImages):  # noqa: F811
    """
    relay's image (L{tests.integration.containers.containerImages}: built
    once per session, from scratch under CI) and the build's seconds.
    """
    return containerImages["relay"], containerImages["seconds"]


def _config(path: str, port: int, emulator, redisPort: int | None) -> None:
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-ct-a1", "concurrency": 4, "priority": 20, "models": ["gpt-5.5"]},
        # The demo's faulty account (503): every turn fails over to a1.
        {"id": "a2", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-ct-a2", "concurrency": 4, "priority": 10, "models": ["gpt-5.5"]},
        {"id": "slow", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-ct-slow", "concurrency": 4, "models": ["slow-model"]},
    ]
    state = ({"backend": "redis", "redis_url": f"redis://127.0.0.1:{redisPort}/0"}
             if redisPort else {"backend": "memory"})
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        f"admin_key: {ADMIN}\n"
        "log: {format: json}\n"
        f"keys: {json.dumps([{'name': 'ct', 'key': KEY, 'concurrency': 8}])}\n"
        f"accounts: {json.dumps(accounts)}\n"
        "gateway: {shutdown_grace_seconds: 15}\n"
        f"state: {json.dumps(state)}\n"
        "database: /var/lib/relay/relay.sqlite\n"
    )
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)  # the container's relay user reads it


def _run(image: str, name: str, config: str, port: int, volume: str) -> None:
    podman("run", "-d", "--name", name, "--network", "host",
           "-v", f"{config}:/etc/relay/relay.yaml:ro", "-v", f"{volume}:/var/lib/relay",
           "-e", f"RELAY_HEALTH_URL=http://127.0.0.1:{port}/healthz", image)


def _remove(name: str) -> None:
    podman("rm", "-f", "-t", "0", name, check=False)


async def _until(check, timeout: float, what: str, logs=None):
    deadline = reactor.seconds() + timeout
    while reactor.seconds() < deadline:
        try:
            if await check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await deferLater(reactor, 0.2, lambda: None)
    raise AssertionError(f"{what} within {timeout}s" + (f"\n{logs()}" if logs else ""))


async def _get(url: str, key: str | None = None):
    headers = {"Authorization": [f"Bearer {key}"]} if key else {}
    r = await treq.get(url, headers=headers, persistent=False)
    return r.code, await r.content()


async def _post(base: str, body: dict, timeout: float = 30):
    r = await treq.post(base + "/v1/responses", json.dumps(body).encode(),
                        headers={"Authorization": [f"Bearer {KEY}"],
                                 "Content-Type": ["application/json"]},
                        persistent=False).addTimeout(timeout, reactor)
    return r.code, await r.content()


async def _wsTurn(port: int) -> list:
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/v1/responses",
                                     headers={"Authorization": f"Bearer {KEY}"}, reactor=reactor)
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(10, reactor)
    events = await proto.turn(userTurn("hi from a container test"), timeout=20)
    proto.bye()
    return [e["type"] for e in events]


@pytest_twisted.ensureDeferred
async def test_image_serves_and_drains(relayImage):
    """
    See the module docstring.
    """
    requireRedis()
    image, buildSeconds = relayImage
    started = time.monotonic()
    emulator = Emulator(reactor=reactor, config={
        "accounts": [
            {"name": "a1", "credential": "sk-ct-a1"},
            {"name": "a2", "credential": "sk-ct-a2",
             "fault": {"kind": "status", "preset": "unavailable"}},
            {"name": "slow", "credential": "sk-ct-slow",
             "script": {"text": "a slow answer to drain", "delay": 0.25, "deltas": 12}},
        ],
    })
    await emulator.listen(reactor)
    redis = RedisServer()
    redis.start()
    tmp = tempfile.mkdtemp(prefix="relay-container-")
    name = f"relay-ct-{os.getpid()}"
    volume = f"relay-ct-data-{os.getpid()}"
    port = freePort()
    config = os.path.join(tmp, "relay.yaml")
    _config(config, port, emulator, redis.port)
    base = f"http://127.0.0.1:{port}"

    def logs() -> str:
        result = podman("logs", name, check=False)
        return result.stdout + result.stderr

    try:
        await deferToThread(_run, image, name, config, port, volume)
        await _until(lambda: _ready(base), 60, "the container ready", logs)
        # The unprivileged user, the health check.
        top = await deferToThread(podman, "exec", name, "id", "-u")
        assert top.stdout.strip() == str(RELAY_UID), top.stdout
        health = await deferToThread(podman, "healthcheck", "run", name)
        assert health.returncode == 0
        # scripts/demo.sh --check: streaming, then non-streaming.
        code, body = await _post(base, {"model": "gpt-5.5", "input": "Say hi", "stream": True})
        assert code == 200 and b"event: response.completed" in body, (code, body, logs())
        code, body = await _post(base, {"model": "gpt-5.5", "input": "Say hi"})
        data = json.loads(body)
        assert code == 200 and data["object"] == "response", (code, body)
        assert data["status"] == "completed", data
        assert "response.completed" in await _wsTurn(port)
        # The demo's failover: a2 (preferred) answers 503, a1 serves.
        assert emulator.requestsFor("sk-ct-a2"), "the preferred account was not tried"
        code, metrics = await _get(base + "/metrics", ADMIN)
        assert code == 200 and b"relay_turns_total" in metrics

        # SIGTERM while a slow stream runs: it finishes, the container exits 0.
        stream = treq.post(
            base + "/v1/responses",
            json.dumps({"model": "slow-model", "input": "drain me", "stream": True}).encode(),
            headers={"Authorization": [f"Bearer {KEY}"], "Content-Type": ["application/json"]},
            persistent=False,
        )
        response = await stream
        body = response.content()
        await _until(lambda: _streaming(emulator), 10, "the slow stream to start")
        stopStarted = time.monotonic()
        stop = deferToThread(podman, "stop", "-t", "30", name)
        data = await body
        assert b"event: response.completed" in data, data[-2000:]
        await stop
        stopSeconds = time.monotonic() - stopStarted
        inspect = await deferToThread(podman, "inspect", name, "--format",
                                      "{{.State.ExitCode}}")
        assert inspect.stdout.strip() == "0", logs()
        assert stopSeconds < 25, stopSeconds
        events = [json.loads(line) for line in logs().splitlines() if line.startswith("{")]
        names = [e.get("event") for e in events]
        assert "relay.drain_started" in names and "relay.drain_finished" in names, names
        finished = [e for e in events if e.get("event") == "relay.drain_finished"][-1]
        assert "1 turn(s) finished" in finished["message"] and "0 cancelled" in finished["message"]
        assert not [e for e in events if e.get("level") == "critical"]
        await deferToThread(_remove, name)

        # The memory backend's SQLite database lands on the volume.
        _config(config, port, emulator, None)
        await deferToThread(_run, image, name, config, port, volume)
        await _until(lambda: _ready(base), 60, "the container ready (memory)", logs)
        code, body = await _post(base, {"model": "gpt-5.5", "input": "Say hi"})
        assert code == 200, body
        await deferToThread(podman, "stop", "-t", "30", name)
        listing = await deferToThread(
            podman, "run", "--rm", "-v", f"{volume}:/data", "--entrypoint", "stat", image,
            "-c", "%u %n", "/data/relay.sqlite")
        assert listing.stdout.split() == [str(RELAY_UID), "/data/relay.sqlite"], listing.stdout
        total = time.monotonic() - started + buildSeconds
        built = f"build {buildSeconds:.1f}s" if buildSeconds else "images reused"
        print(f"container test: {built}, "
              f"run {time.monotonic() - started:.1f}s, total {total:.1f}s; "
              f"SIGTERM to exit {stopSeconds:.1f}s with a stream in flight")
    finally:
        await deferToThread(_remove, name)
        await deferToThread(podman, "volume", "rm", "-f", volume, check=False)
        redis.cleanup()
        await emulator.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def _ready(base: str) -> bool:
    code, body = await _get(base + "/readyz")
    return code == 200


async def _streaming(emulator) -> bool:
    return bool(emulator.requestsFor("sk-ct-slow"))
