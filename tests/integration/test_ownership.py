"""
Issue 19 item 5 (behaviour.md R104) on both state backends, on real
sockets: key B never continues key A's conversation -- over HTTP and
over the WebSocket -- for as long as the owner record lives
(C{gateway.scheduling.response_owner_ttl_seconds}, default 30 days, not
the routing binding's 3,600 s), and after a relay restart; with
C{state.backend: redis} against a real C{redis-server}, with the memory
backend through the SQLite C{database}.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from relay.scheduling.scheduler import responseKey, responseOwnerKey
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_drain import startService
from tests.integration.test_ws_turns import _Client, userTurn

ALICE, BOB = "sk-owner-alice-key", "sk-owner-bob-key"
CRED = "sk-emu-owner-a1"
FOREIGN = "previous_response_id is not available for this user"


def writeConfig(directory, emulator, scheduling=None, redisURL=None) -> str:
    path = os.path.join(str(directory), "relay.yaml")
    keys = [{"name": "alice", "key": ALICE, "concurrency": 0},
            {"name": "bob", "key": BOB, "concurrency": 0}]
    accounts = [{"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                 "api_key": CRED}]
    gateway = {"websocket": {"mode_default": "ctx_pool"}}
    if scheduling:
        gateway["scheduling"] = scheduling
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            'listen: "tcp:0:interface=127.0.0.1"\n'
            f"database: {json.dumps(os.path.join(str(directory), 's.sqlite'))}\n"
            f"keys: {json.dumps(keys)}\naccounts: {json.dumps(accounts)}\n"
            f"gateway: {json.dumps(gateway)}\n"
            + (f"state: {{backend: redis, redis_url: '{redisURL}'}}\n" if redisURL else "")
        )
    return path


async def post(relay, key, previous=None, text="hi"):
    """
    One JSON turn; @return: C{(status, body)}.
    """
    body = {"model": "gpt-5.5", "input": text}
    if previous:
        body["previous_response_id"] = previous
    response = await treq.post(
        relay.url + "/v1/responses", json.dumps(body).encode(), persistent=False,
        headers={"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]},
    ).addTimeout(20, reactor)
    return response.code, json.loads(await response.content())


async def wsTurn(relay, key, previous=None):
    """
    One WebSocket turn on a new connection; @return: its events (and the
    close, when relay closed).
    """
    from autobahn.twisted.websocket import WebSocketClientFactory
    from twisted.internet.endpoints import TCP4ClientEndpoint

    factory = WebSocketClientFactory(f"ws://127.0.0.1:{relay.port}/v1/responses",
                                     headers={"Authorization": f"Bearer {key}"}, reactor=reactor)
    factory.protocol = _Client
    client = await TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port, timeout=5).connect(
        factory)
    await client.opened.addTimeout(5, reactor)
    events = await client.turn(userTurn("go on", previous=previous), timeout=10)
    if events[-1]["type"] == "error":
        code, reason = await client.closed.addTimeout(5, reactor)
        events.append({"type": "__closed__", "code": code, "reason": reason})
    elif events[-1]["type"] != "__closed__":
        client.bye()
        await client.closed.addTimeout(5, reactor)
    return events


async def assertBobRefused(relay, responseId) -> None:
    """
    Key B naming C{responseId}: 400 over HTTP, the error event and close
    1008 over the WebSocket; nothing reaches upstream.
    """
    status, body = await post(relay, BOB, responseId)
    assert (status, body["error"]["message"]) == (400, FOREIGN), body
    assert body["error"]["param"] == "previous_response_id"
    events = await wsTurn(relay, BOB, responseId)
    assert events[0]["type"] == "error" and events[0]["status"] == 400, events
    assert events[0]["error"]["message"] == FOREIGN
    assert events[-1]["code"] == 1008, events[-1]


def redisTTL(server, key) -> int:
    """
    @return: the seconds C{key} still lives in Redis (-2: gone).
    """
    out = subprocess.run(["redis-cli", "-p", str(server.port), "TTL", key],
                         capture_output=True, timeout=10, check=True)
    return int(out.stdout.strip())


@pytest_twisted.ensureDeferred
async def test_redis_owner_records_outlive_the_binding_and_a_restart(tmp_path, redisServer):  # noqa: F811
    """
    Redis: A's responses (one over HTTP, one over the WebSocket) belong to
    A. The owner record lives the configured C{response_owner_ttl_seconds}
    (here 60 s) while the routing binding lives
    C{previous_response_ttl_seconds} (here 1 s): once the binding is gone,
    B is still refused on both entrypoints and A still chains (routed by
    the owner record). A restarted relay on the same Redis says the same.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    path = writeConfig(tmp_path, emulator, redisURL=redisServer.url, scheduling={
        "previous_response_ttl_seconds": 1, "response_owner_ttl_seconds": 60})
    relay = await startService(path)
    try:
        status, body = await post(relay, ALICE)
        assert status == 200, body
        httpId = body["id"]
        events = await wsTurn(relay, ALICE)
        assert events[-1]["type"] == "response.completed", events
        wsId = events[-1]["response"]["id"]
        for rid in (httpId, wsId):
            assert 55 <= redisTTL(redisServer, responseOwnerKey(rid)) <= 60
            assert redisTTL(redisServer, responseKey(rid)) <= 1
        await deferLater(reactor, 1.5, lambda: None)
        for rid in (httpId, wsId):
            assert redisTTL(redisServer, responseKey(rid)) == -2
            await assertBobRefused(relay, rid)
        upstream = len(emulator.requestsFor(CRED, "request"))
        status, body = await post(relay, ALICE, httpId, "and then?")
        assert status == 200, body
        assert len(emulator.requestsFor(CRED, "request")) == upstream + 1

        await relay.service.stopService()
        relay = await startService(path)
        await assertBobRefused(relay, httpId)
        await assertBobRefused(relay, wsId)
        status, body = await post(relay, ALICE, httpId, "after the restart?")
        assert status == 200, body
        status, body = await post(relay, BOB, "resp_relay_never_saw_it")
        assert status == 400 and body["error"]["code"] == "previous_response_not_found", body
    finally:
        if relay.service.running:
            await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_redis_owner_record_default_lifetime_is_long(tmp_path, redisServer):  # noqa: F811
    """
    Without C{response_owner_ttl_seconds}, an owner record in Redis lives
    30 days (as long as upstream keeps a stored response), the routing
    binding 3,600 s (before issue 19 the owner record lived 3,600 s too).
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    relay = await startService(writeConfig(tmp_path, emulator, redisURL=redisServer.url))
    try:
        status, body = await post(relay, ALICE)
        assert status == 200, body
        assert redisTTL(redisServer, responseOwnerKey(body["id"])) > 30 * 86400 - 60
        assert 3500 < redisTTL(redisServer, responseKey(body["id"])) <= 3600
    finally:
        await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_memory_backend_owner_records_survive_a_restart(tmp_path):
    """
    The memory backend keeps owner records in the SQLite C{database}: after
    a restart (a new process's memory is empty) B is still refused on both
    entrypoints and A still chains over HTTP.
    """
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    path = writeConfig(tmp_path, emulator)
    relay = await startService(path)
    try:
        status, body = await post(relay, ALICE)
        assert status == 200, body
        rid = body["id"]
        await relay.service.stopService()
        relay = await startService(path)
        await assertBobRefused(relay, rid)
        status, body = await post(relay, ALICE, rid, "still there?")
        assert status == 200, body
    finally:
        if relay.service.running:
            await relay.service.stopService()
        await emulator.stop()
