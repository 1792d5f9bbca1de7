"""
behaviour.md R104 for stored items, on real sockets against the emulator,
on both state backends: key A makes a stored response; key B naming one
of its output items by C{item_reference} is refused over HTTP and over the
WebSocket (404, as upstream answers an unknown item; nothing reaches
upstream), key A itself is served. A C{conversation} is refused (relay
serves no Conversations API). With the memory backend the item owner
records outlive a restart (the SQLite C{database}); with Redis they live
as long as the response's owner record.
"""

from __future__ import annotations

import json
import os

import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint

from relay.emulator import Emulator
from relay.scheduling.itemowners import itemOwnerKey
from relay.scheduling.scheduler import responseOwnerKey
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_drain import startService
from tests.integration.test_ownership import redisTTL
from tests.integration.test_ws_turns import _Client

ALICE, BOB = "sk-items-alice-key", "sk-items-bob-key"
CRED = "sk-emu-items-a1"


def writeConfig(directory, emulator, mode="ctx_pool", redisURL=None) -> str:
    path = os.path.join(str(directory), "relay.yaml")
    keys = [{"name": "alice", "key": ALICE, "concurrency": 0},
            {"name": "bob", "key": BOB, "concurrency": 0}]
    accounts = [{"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                 "api_key": CRED}]
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            'listen: "tcp:0:interface=127.0.0.1"\n'
            f"database: {json.dumps(os.path.join(str(directory), 's.sqlite'))}\n"
            f"keys: {json.dumps(keys)}\naccounts: {json.dumps(accounts)}\n"
            f"gateway: {json.dumps({'websocket': {'mode_default': mode}})}\n"
            + (f"state: {{backend: redis, redis_url: '{redisURL}'}}\n" if redisURL else "")
        )
    return path


def ref(itemId: str) -> dict:
    return {"type": "item_reference", "id": itemId}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def post(relay, key, items, **fields):
    """
    One JSON turn; @return: C{(status, body)}.
    """
    body = {"model": "gpt-5.5", "input": items, **fields}
    response = await treq.post(
        relay.url + "/v1/responses", json.dumps(body).encode(), persistent=False,
        headers={"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]},
    ).addTimeout(20, reactor)
    return response.code, json.loads(await response.content())


async def connect(relay, key) -> _Client:
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{relay.port}/v1/responses",
                                     headers={"Authorization": f"Bearer {key}"}, reactor=reactor)
    factory.protocol = _Client
    client = await TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port, timeout=5).connect(
        factory)
    await client.opened.addTimeout(5, reactor)
    return client


def create(items, **fields) -> dict:
    return {"type": "response.create", "model": "gpt-5.5", "stream": True, "input": items,
            **fields}


async def storedItem(relay) -> str:
    """
    Key A makes a stored response; @return: its output message's id.
    """
    status, body = await post(relay, ALICE, [user("remember this")])
    assert status == 200, body
    return body["output"][-1]["id"]


def upstreamTurns(emulator) -> int:
    return len(emulator.requestsFor(CRED, "request")) + len(emulator.requestsFor(CRED, "frame"))


async def assertRefusedAndServed(relay, emulator, itemId) -> None:
    """
    Key B is refused on HTTP and on the WebSocket (the connection stays
    open and serves B's next turn), nothing reaching upstream; key A is
    served on both.
    """
    before = upstreamTurns(emulator)
    status, body = await post(relay, BOB, [ref(itemId), user("what did A say?")])
    assert status == 404, body
    error = {k: body["error"].get(k) for k in ("message", "type", "param", "code")}
    assert error == {"message": f"Item with id '{itemId}' not found.",
                     "type": "invalid_request_error", "param": "input", "code": None}, body
    client = await connect(relay, BOB)
    try:
        events = await client.turn(create([ref(itemId)]), timeout=10)
        assert [e["type"] for e in events] == ["error"], events
        assert events[0]["status"] == 404 and events[0]["error"]["param"] == "input", events
        assert upstreamTurns(emulator) == before
        events = await client.turn(create([user("something else")]), timeout=10)
        assert events[-1]["type"] == "response.completed", events
    finally:
        client.bye()
        await client.closed.addTimeout(5, reactor)
    status, body = await post(relay, ALICE, [ref(itemId), user("and then?")])
    assert status == 200, body
    sent = emulator.requestsFor(CRED, "request")[-1].body
    assert sent["input"][0] == ref(itemId)
    client = await connect(relay, ALICE)
    try:
        events = await client.turn(create([ref(itemId), user("go on")]), timeout=10)
        assert events[-1]["type"] == "response.completed", events
    finally:
        client.bye()
        await client.closed.addTimeout(5, reactor)


@pytest_twisted.ensureDeferred
async def test_memory_backend_items_and_conversations(tmp_path):
    """
    Memory backend: B refused, A served, on both entrypoints; the records
    outlive a restart; C{conversation} is a 400 on HTTP and an error event
    on the WebSocket.
    """
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    path = writeConfig(tmp_path, emulator)
    relay = await startService(path)
    try:
        itemId = await storedItem(relay)
        await assertRefusedAndServed(relay, emulator, itemId)

        status, body = await post(relay, ALICE, "hi", conversation="conv_1")
        assert (status, body["error"]["param"]) == (400, "conversation"), body
        client = await connect(relay, ALICE)
        try:
            events = await client.turn(create("hi", conversation={"id": "conv_1"}))
            assert [e["type"] for e in events] == ["error"], events
            assert events[0]["status"] == 400 and events[0]["error"]["param"] == "conversation"
        finally:
            client.bye()
            await client.closed.addTimeout(5, reactor)

        await relay.service.stopService()
        relay = await startService(path)
        status, body = await post(relay, BOB, [ref(itemId)])
        assert status == 404, body
        status, body = await post(relay, ALICE, [ref(itemId), user("after the restart?")])
        assert status == 200, body
    finally:
        if relay.service.running:
            await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_http_bridge_prewarm_items_are_checked(tmp_path):
    """
    C{http_bridge}: a prewarm relay answers itself (never selected) may not
    smuggle another key's item into the transcript the next turn sends
    upstream: that turn is refused; A's own prewarm chain is served.
    """
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    relay = await startService(writeConfig(tmp_path, emulator, mode="http_bridge"))
    try:
        itemId = await storedItem(relay)
        for key, expected in ((BOB, "error"), (ALICE, "response.completed")):
            client = await connect(relay, key)
            try:
                events = await client.turn(create([ref(itemId)], generate=False))
                assert events[-1]["type"] == "response.completed", events
                prewarm = events[-1]["response"]["id"]
                events = await client.turn(create([user("go")], previous_response_id=prewarm),
                                           timeout=10)
                assert events[-1]["type"] == expected, (key, events)
            finally:
                client.bye()
                await client.closed.addTimeout(5, reactor)
    finally:
        await relay.service.stopService()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_redis_backend_items(tmp_path, redisServer):  # noqa: F811
    """
    Redis: the same refusals and service; each item's owner record lives
    as long as its response's.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    relay = await startService(writeConfig(tmp_path, emulator, redisURL=redisServer.url))
    try:
        status, body = await post(relay, ALICE, [user("remember this")])
        assert status == 200, body
        itemId = body["output"][-1]["id"]
        owner = redisTTL(redisServer, responseOwnerKey(body["id"]))
        assert owner > 86400
        assert abs(redisTTL(redisServer, itemOwnerKey(itemId)) - owner) <= 2
        await assertRefusedAndServed(relay, emulator, itemId)
    finally:
        await relay.service.stopService()
        await emulator.stop()
