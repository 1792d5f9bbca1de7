"""
compose.yaml's stack, brought up docs/deploying.md's way (issue 23):
C{podman-compose up -d} with the images of
L{tests.integration.containers} (built once per session, from scratch under
CI, by whichever of this test and L{tests.integration.test_container} runs
first; the other reuses them) -- relay's image,
and for Redis Debian's redis-server on the same Debian base
(C{RELAY_REDIS_IMAGE}; no registry is reachable), Redis's port private to
the stack, relay published on a free loopback port (C{RELAY_PORT}).

podman-compose is Debian's (1.0.3, what C{apt-get install podman-compose}
gives on Debian 12 and what C{.ci/run} installs). It has no profiles: it
ignores the key and starts every service, so the C{emulator} service runs as
it does under C{docker compose} with C{.env}'s C{COMPOSE_PROFILES=emulator}.
Its containers find each other by service name through the CNI C{dnsname}
plugin (C{.ci/run} installs it), as Docker's embedded DNS does.

The test waits for C{/readyz}, passes the requests of C{scripts/demo.sh
--check} through relay (a streaming and a non-streaming C{POST
/v1/responses}; the preferred demo account a2 answers 503, so relay fails
over) and a WebSocket turn, and checks: relay runs its two workers (none
exited: a supervisor that is a container's pid 1 used to make its workers
end themselves), one scrape counts every turn, relay's state is in Redis
and Redis has AOF on (C{appendonly yes}, C{aof_enabled:1}), and every service's health check
passes. Then C{stop -t
45} (compose's C{stop_grace_period}, which podman-compose 1.0 ignores):
every worker drains and relay exits 0; then C{down -v} leaves no container
and no volume of the project.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from tests.integration.containers import ROOT, containerEnv, containerImages, podman  # noqa: F401
from tests.integration.redis_server import freePort
from tests.integration.test_metrics_workers import _sample
from tests.integration.test_ws_turns import _Client, userTurn

KEY = "sk-relay-demo"      # etc/compose.yaml's demo key
ADMIN = "admin-demo-change-me"


def _compose(project: str, env: dict, *args, check=True, timeout=300):
    result = subprocess.run(["podman-compose", "-p", project, *args], cwd=ROOT, env=env,
                            check=False, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman-compose {' '.join(args)}: {result.returncode}\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _container(project: str, service: str) -> str:
    """
    The name of C{service}'s container in C{project} (by compose's labels,
    whatever the naming of the podman-compose version).
    """
    result = podman("ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
                    "--filter", f"label=com.docker.compose.service={service}",
                    "--format", "{{.Names}}")
    names = result.stdout.split()
    assert len(names) == 1, (service, result.stdout)
    return names[0]


def _anonymousVolumes(project: str) -> list:
    """
    The unnamed volumes the project's containers mount (an image's
    C{VOLUME} without a mount in compose.yaml).
    """
    ids = podman("ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={project}")
    names = []
    for container in ids.stdout.split():
        mounts = podman("inspect", container, "--format",
                        "{{range .Mounts}}{{.Type}}={{.Name}} {{end}}", check=False)
        for mount in mounts.stdout.split():
            kind, _, name = mount.partition("=")
            if kind == "volume" and name and not name.startswith(f"{project}_"):
                names.append(name)
    return names


async def _until(check, timeout: float, what: str, logs=None):
    deadline = reactor.seconds() + timeout
    while reactor.seconds() < deadline:
        try:
            if await check():
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        await deferLater(reactor, 0.3, lambda: None)
    raise AssertionError(f"{what} within {timeout}s" + (f"\n{logs()}" if logs else ""))


async def _post(base: str, body: dict):
    r = await treq.post(base + "/v1/responses", json.dumps(body).encode(),
                        headers={"Authorization": [f"Bearer {KEY}"],
                                 "Content-Type": ["application/json"]},
                        persistent=False).addTimeout(30, reactor)
    return r.code, await r.content()


async def _wsTurn(port: int) -> list:
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/v1/responses",
                                     headers={"Authorization": f"Bearer {KEY}"}, reactor=reactor)
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(10, reactor)
    events = await proto.turn(userTurn("hi from the compose test"), timeout=20)
    proto.bye()
    return [e["type"] for e in events]


@pytest_twisted.ensureDeferred
async def test_compose_up_serves_the_demo(containerImages):  # noqa: F811
    """
    See the module docstring.
    """
    if shutil.which("podman-compose") is None:
        pytest.fail("podman-compose is not installed (.ci/run installs it)")
    project = f"relayct{os.getpid()}"
    port = freePort()
    env = containerEnv()
    env.update(RELAY_IMAGE=containerImages["relay"], RELAY_REDIS_IMAGE=containerImages["redis"],
               RELAY_BASE=containerImages["base"], RELAY_PORT=str(port))
    base = f"http://127.0.0.1:{port}"
    relayName = None

    def logs(tail: int = 6000) -> str:
        if relayName is None:
            return ""
        result = podman("logs", relayName, check=False)
        return (result.stdout + result.stderr)[-tail:]

    upAt = time.monotonic()
    try:
        up = await deferToThread(_compose, project, env, "up", "-d", "--no-build")
        relayName = await deferToThread(_container, project, "relay")
        redisName = await deferToThread(_container, project, "redis")
        # podman-compose 1.0 has no profiles: the emulator runs (checked below).

        async def ready():
            r = await treq.get(base + "/readyz", persistent=False).addTimeout(5, reactor)
            return r.code == 200
        await _until(ready, 90, "the stack ready (GET /readyz 200)",
                     lambda: up.stdout[-2000:] + logs())
        readySeconds = time.monotonic() - upAt

        # Every service's health check passes as podman-compose wrote it (1.0
        # re-quotes a CMD list; relay's comes from the image, asking /readyz).
        emulatorName = await deferToThread(_container, project, "emulator")
        for name in (relayName, redisName, emulatorName):
            health = await deferToThread(podman, "healthcheck", "run", name, check=False)
            assert health.returncode == 0, (name, health.stdout, health.stderr)

        # scripts/demo.sh --check: streaming, then non-streaming; and the WebSocket.
        code, body = await _post(base, {"model": "gpt-5.5", "input": "Say hi", "stream": True})
        assert code == 200 and b"event: response.completed" in body, (code, body, logs())
        code, body = await _post(base, {"model": "gpt-5.5", "input": "Say hi"})
        data = json.loads(body)
        assert code == 200 and data["object"] == "response", (code, body)
        assert data["status"] == "completed", data
        assert "response.completed" in await _wsTurn(port)

        scraped = []

        async def counted():
            # A turn is counted as it ends, just after its last event went out.
            r = await treq.get(base + "/metrics",
                               headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
            scraped[:] = [r.code, (await r.content()).decode()]
            return r.code == 200 and _sample(scraped[1], "relay_turns_total") >= 3
        await _until(counted, 10, "the three turns counted", lambda: str(scraped))
        metrics = scraped[1]
        assert _sample(metrics, "relay_turns_total") == 3, metrics
        assert _sample(metrics, "relay_turns_total", outcome="completed") == 3, metrics
        # The demo's failover: a2 (preferred) answers 503, another account serves.
        assert _sample(metrics, "relay_failovers_total", from_account="a2") >= 1, metrics

        # Two workers, both alive.
        log = logs(10**7)
        started = set(re.findall(r'"message":"worker (\d) started', log))
        assert started == {"0", "1"}, log[-6000:]
        assert "relay.worker_exited" not in log, log[-6000:]

        # Redis: AOF on, and relay's state is there.
        result = await deferToThread(podman, "exec", redisName, "redis-cli", "CONFIG", "GET",
                                     "appendonly")
        assert result.stdout.split() == ["appendonly", "yes"], result.stdout
        result = await deferToThread(podman, "exec", redisName, "redis-cli", "INFO",
                                     "persistence")
        assert "aof_enabled:1" in result.stdout, result.stdout
        result = await deferToThread(podman, "exec", redisName, "redis-cli", "DBSIZE")
        assert int(result.stdout.strip()) > 0, result.stdout

        # Stop: every worker drains, relay exits 0 (compose's stop_grace_period is 45 s).
        await deferToThread(_compose, project, env, "stop", "-t", "45", "relay")
        exit = await deferToThread(podman, "inspect", relayName, "--format",
                                   "{{.State.ExitCode}}")
        log = logs(10**7)
        assert exit.stdout.strip() == "0", log[-6000:]
        assert log.count('"relay.worker_stopped"') == 2, log[-6000:]
        assert log.count('"relay.drain_finished"') == 2, log[-6000:]
        assert '"level":"critical"' not in log, log[-6000:]

        # Anonymous volumes (the emulator's, of the image's VOLUME): podman-compose
        # 1.0's down -v removes only the named ones.
        anonymous = await deferToThread(_anonymousVolumes, project)
        await deferToThread(_compose, project, env, "down", "-v", "-t", "45")
        for volume in anonymous:
            await deferToThread(podman, "volume", "rm", volume)
        left = await deferToThread(podman, "ps", "-a", "--filter",
                                   f"label=com.docker.compose.project={project}", "-q")
        assert left.stdout.strip() == "", left.stdout
        volumes = await deferToThread(podman, "volume", "ls", "-q", "--filter",
                                      f"label=com.docker.compose.project={project}")
        assert volumes.stdout.strip() == "", volumes.stdout
        print(f"\ncompose stack ({project}): ready {readySeconds:.1f}s after up, "
              f"up to down {time.monotonic() - upAt:.1f}s")
    finally:
        anonymous = await deferToThread(_anonymousVolumes, project)
        await deferToThread(_compose, project, env, "down", "-v", "-t", "5", check=False)
        for volume in anonymous:
            await deferToThread(podman, "volume", "rm", "-f", volume, check=False)
        # podman-compose 1.0 leaves the project's network behind.
        await deferToThread(podman, "network", "rm", "-f", f"{project}_default", check=False)
