"""
Runtime settings persistence (behaviour.md R74, issue 7) end to end:

  - the Redis settings store through the real L{RedisService}: a change
    made by one process is loaded, normalised, by a "restarted" process and
    picked up by a running one on C{refresh()};
  - the SQLite file through the real service wiring (L{buildService}): a
    C{PUT /admin/settings} survives stopping the service and building a new
    one from the same config;
  - two relay processes on one Redis: a change on one applies on the other
    within the 5 s refresh period.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.error import ConnectError
from twisted.internet.task import deferLater

from relay.process.app import buildService
from relay.configuration.parse import settingsFromString
from relay.console.view import RedisGetSet
from relay.wire.redisclient import RedisService
from relay.state.settings import RuntimeSettings
from relay.state.settingsdb import REDIS_KEY, RedisSettingsStore, SQLiteSettingsStore
from tests.integration.harness import closedPort
from tests.integration.redis_server import freePort, redisServer  # noqa: F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN = "adm-settings-key-0000"


async def sleep(seconds: float) -> None:
    """
    Wait on the real reactor.
    """
    await deferLater(reactor, seconds, lambda: None)


@pytest.fixture
def tmpdir_():
    """
    A scratch directory, removed afterwards.
    """
    path = tempfile.mkdtemp(prefix="relay-settings-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _admin(port: int, method: str, body=None):
    """
    One admin request on C{/admin/settings} (no persistent connection, so
    nothing is left open).

    @return: C{(status, decoded JSON or raw bytes)}.
    """
    data = json.dumps(body).encode() if body is not None else None
    r = await treq.request(
        method,
        f"http://127.0.0.1:{port}/admin/settings",
        data=data,
        headers={"Authorization": [f"Bearer {ADMIN}"], "Content-Type": ["application/json"]},
        persistent=False,
    )
    raw = await r.content()
    try:
        return r.code, json.loads(raw)
    except ValueError:
        return r.code, raw


async def _waitFor(check, timeout: float, what: str):
    """
    Poll the async C{check} until it returns a true value.

    @return: that value.
    """
    deadline = reactor.seconds() + timeout
    last = None
    while reactor.seconds() < deadline:
        try:
            last = await check()
        except ConnectError as e:  # not listening yet
            last = e
        else:
            if last:
                return last
        await sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout} s (last: {last!r})")


# ---------------------------------------------------------------------------
# 1. Redis store through the real RedisService
# ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_redis_store_persists_across_restart_and_refreshes(redisServer):  # noqa: F811
    """
    R74 with C{state.backend: redis}: C{update()} on one process writes
    C{relay:settings}; a new process (new L{RedisService}) loads the values
    at C{start()}, normalised; a running second process sees a later change
    from the first on C{refresh()}, and a value another writer stored out
    of range is clamped on read.
    """
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    services = []

    def process():
        service = RedisService(url=redisServer.url, clock=reactor)
        service.startService()
        services.append(service)
        store = RedisSettingsStore(redis=RedisGetSet(service), clock=reactor)
        return RuntimeSettings(store=store)

    try:
        first = process()
        assert await first.start() == {}
        changed = await first.update(
            {"retry_interval_ms": 1234, "transport_retry_policy": " Sticky "}
        )
        assert changed == {"retry_interval_ms": 1234, "transport_retry_policy": "sticky"}
        stored = json.loads(await services[0].execute(2, "get", REDIS_KEY))
        assert stored == {"retry_interval_ms": 1234, "transport_retry_policy": "sticky"}

        # The first process "stops"; a restarted one loads what it stored.
        await services[0].stopService()
        second = process()
        assert second.current.retry_interval_ms != 1234
        loaded = await second.start()
        assert loaded == {"retry_interval_ms": 1234, "transport_retry_policy": "sticky"}
        assert second.current.retry_interval_ms == 1234
        assert second.current.transport_retry_policy == "sticky"

        # Every process sees a change: a third, running, picks it up.
        third = process()
        await third.start()
        await third.update({"breaker": {"failures": 7}, "max_account_switches": 2})
        assert second.current.breaker.failures != 7
        refreshed = await second.refresh()
        assert refreshed == {"breaker.failures": 7, "max_account_switches": 2}
        assert second.current.breaker.failures == 7
        assert second.current.max_account_switches == 2
        assert second.current.retry_interval_ms == 1234

        # Values written by another writer are normalised on read.
        raw = {"retry_interval_ms": 40000, "transport_retry_policy": "bogus", "nope": 1}
        await services[1].execute(2, "set", REDIS_KEY, json.dumps(raw))
        await second.refresh()
        assert second.current.retry_interval_ms == 30000
        assert second.current.transport_retry_policy == "rotate"
    finally:
        for service in services:
            if service.running:
                await service.stopService()


# ---------------------------------------------------------------------------
# 2. SQLite through the real service wiring
# ---------------------------------------------------------------------------


def _sqliteConfig(path: str, port: int):
    """
    @return: a L{RelayConfig} listening on C{port} with the SQLite settings
        database at C{path}.
    """
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": f"http://127.0.0.1:{closedPort()}/v1",
         "api_key": "sk-persist-a1"}
    ]
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        f"keys: {json.dumps([{'name': 'k', 'key': 'sk-relay-persist', 'concurrency': 0}])}\n"
        f"accounts: {json.dumps(accounts)}\n"
        f"admin_key: {ADMIN}\n"
        f"database: {json.dumps(path)}\n"
    )
    return settingsFromString(text)


def _portClosed(port: int) -> bool:
    """
    @return: whether nothing accepts connections on C{port}.
    """
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest_twisted.ensureDeferred
async def test_sqlite_settings_survive_service_restart(tmpdir_):
    """
    R74 with the memory backend: C{PUT /admin/settings} on a running
    service (L{buildService}) is stored in the C{database:} SQLite file; a
    new service built from the same config, after the first was stopped,
    serves the change on C{GET /admin/settings}. Stopping a service closes
    its listening port and the SQLite connection pool.
    """
    path = os.path.join(tmpdir_, "relay.sqlite")
    port = freePort()
    config = _sqliteConfig(path, port)
    running = []

    async def start():
        service = buildService(config, reactor)
        service.startService()
        running.append(service)
        await _waitFor(lambda: _admin(port, "GET"), 5, "service listening")
        return service

    async def stop(service):
        await service.stopService()
        running.remove(service)
        store = service.relayApplication.settings.store
        assert isinstance(store, SQLiteSettingsStore)
        assert store._pool is None, "the SQLite pool was not closed"
        assert _portClosed(port)

    try:
        first = await start()
        code, body = await _admin(port, "GET")
        assert code == 200 and body["max_account_switches"] == 10, body
        code, body = await _admin(
            port, "PUT", {"max_account_switches": 3, "breaker": {"failures": 40000}}
        )
        assert code == 200, body
        assert body["changed"] == {"max_account_switches": 3, "breaker.failures": 1000}
        await stop(first)

        second = await start()

        async def persisted():
            code, body = await _admin(port, "GET")
            return code == 200 and body["max_account_switches"] == 3 and body

        body = await _waitFor(persisted, 5, "persisted settings loaded")
        assert body["breaker"]["failures"] == 1000
        assert second.relayApplication.settings.current.max_account_switches == 3
        await stop(second)
    finally:
        for service in running:
            await service.stopService()


# ---------------------------------------------------------------------------
# 3. Two relay processes on one Redis
# ---------------------------------------------------------------------------


def _redisConfig(path: str, port: int, redisURL: str) -> None:
    """
    Write a relay config using the Redis backend and an admin key.
    """
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": f"http://127.0.0.1:{closedPort()}/v1",
         "api_key": "sk-two-settings"}
    ]
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        f"keys: {json.dumps([{'name': 'k', 'key': 'sk-relay-two-settings', 'concurrency': 0}])}\n"
        f"accounts: {json.dumps(accounts)}\n"
        f"admin_key: {ADMIN}\n"
        f"state: {{backend: redis, redis_url: '{redisURL}'}}\n"
    )
    with open(path, "w") as f:
        f.write(text)


@pytest_twisted.ensureDeferred
async def test_two_relays_share_a_settings_change(redisServer, tmpdir_):  # noqa: F811
    """
    R74 / issue 7 "every process sees a change": with C{state.backend:
    redis}, C{PUT /admin/settings {"max_account_switches": 0}} on relay
    process 1 is applied by process 2 within its 5 s refresh period
    (C{GET /admin/settings} on process 2 shows 0 within ~6 s).
    """
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    ports = [freePort(), freePort()]
    procs = []
    try:
        for i, port in enumerate(ports):
            path = os.path.join(tmpdir_, f"relay{i}.yaml")
            _redisConfig(path, port, redisServer.url)
            with open(os.path.join(tmpdir_, f"relay{i}.log"), "wb") as log:  # noqa: ASYNC230
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
            body = await _waitFor(lambda port=port: _admin(port, "GET"), 15, f"relay on {port}")
            assert body[0] == 200 and body[1]["max_account_switches"] == 10, body

        code, body = await _admin(ports[0], "PUT", {"max_account_switches": 0})
        assert code == 200, body
        assert body["changed"] == {"max_account_switches": 0}
        changedAt = reactor.seconds()

        async def applied():
            code, body = await _admin(ports[1], "GET")
            return code == 200 and body["max_account_switches"] == 0

        await _waitFor(applied, 6.5, "process 2 applying the change")
        assert reactor.seconds() - changedAt <= 6.5
        code, body = await _admin(ports[0], "GET")
        assert body["max_account_switches"] == 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
