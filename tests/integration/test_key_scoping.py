"""
behaviour.md R112: the identifiers of a conversation are scoped per key,
checked on what the emulator (the upstream) received through a real relay.
The body's C{prompt_cache_key} is scoped on both account types (two keys
never share an upstream prompt cache); C{session_id}, C{conversation_id},
C{thread-id} (and the rest of L{relay.engine.payload.SCOPED_HEADERS}) on
OAuth accounts; each as C{xxhash64("k{key}:" + raw)}, the same for every
turn of one key, on HTTP (Responses, chat, compact, input_tokens) and on
the WebSocket (the handshake's headers and every C{response.create}, in
every mode).
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import xxhash

from relay.engine.payload import SCOPED_HEADERS
from tests.integration.harness import startStack
from tests.integration.test_ws_turns import MODES, connect, drain, gateway, userTurn

RAW_CACHE = "019a-thread-shared"
RAW_THREAD = "thread-shared-1"
KEYS = json.dumps([{"name": "alice", "key": "sk-alice", "concurrency": 0},
                   {"name": "bob", "key": "sk-bob", "concurrency": 0}])
HEADERS = {"session_id": "sess-shared", "thread-id": RAW_THREAD,
           "conversation_id": "conv-shared"}


def scoped(key: str, raw: str) -> str:
    """
    @return: what R112 makes of C{raw} for key C{key}.
    """
    return xxhash.xxh64_hexdigest(f"k{key}:{raw}".encode())


def test_scoped_header_table():
    """
    The table names every conversation identifier of R112 (a header
    forwarded later is scoped by being in it).
    """
    names = {n for group in SCOPED_HEADERS for n in group}
    assert {"session_id", "conversation_id", "thread-id", "x-codex-parent-thread-id",
            "x-client-request-id"} <= names


def _accounts(kind: str, mode: str = "ctx_pool"):
    """
    @return: one account of C{kind} (C{apikey} or C{oauth}) in WebSocket
        C{mode}.
    """
    entry = {"id": "a1", "credential": f"{kind}-cred", "ws_mode": mode}
    if kind == "oauth":
        entry["type"] = "oauth"
    return [entry]


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest_twisted.ensureDeferred
async def test_http_prompt_cache_key_and_thread_id_scoped(kind):
    """
    HTTP Responses (SSE and JSON) and chat turns of two keys sending the
    same raw ids: upstream sees each key's own scoped value, the same on
    every turn of one key; never the raw value.
    """
    stack = await startStack(_accounts(kind), keys=KEYS)
    try:
        for name in ("alice", "bob"):
            headers = {k: [v] for k, v in HEADERS.items()}
            for stream in (True, False):
                response, data = await stack.postJSON(
                    "/v1/responses",
                    {"model": "gpt-5.5", "input": "hi", "stream": stream,
                     "prompt_cache_key": RAW_CACHE},
                    key="sk-" + name, headers=headers,
                )
                assert response.code == 200, data
            response, data = await stack.postJSON(
                "/v1/chat/completions",
                {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                 "prompt_cache_key": RAW_CACHE},
                key="sk-" + name, headers=headers,
            )
            assert response.code == 200, data
        records = stack.emulator.requestsFor(f"{kind}-cred", "request")
        assert len(records) == 6
        for i, record in enumerate(records):
            name = "alice" if i < 3 else "bob"
            assert record.body["prompt_cache_key"] == scoped(name, RAW_CACHE), record.body
            if kind == "oauth":
                assert record.headers["thread-id"] == scoped(name, RAW_THREAD)
                assert record.headers["session_id"] == scoped(name, "sess-shared")
                assert record.headers["conversation_id"] == scoped(name, "conv-shared")
                assert record.headers["x-client-request-id"] != "", record.headers
            else:
                assert record.headers["thread-id"] == RAW_THREAD
            assert RAW_CACHE not in json.dumps(record.body)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_input_tokens_prompt_cache_key_scoped():
    """
    The forwarded sub-routes (C{input_tokens}) carry the scoped key too.
    """
    stack = await startStack(_accounts("apikey"), keys=KEYS)
    try:
        response, data = await stack.postJSON(
            "/v1/responses/input_tokens",
            {"model": "gpt-5.5", "input": "hi", "prompt_cache_key": RAW_CACHE}, key="sk-alice",
        )
        assert response.code == 200, data
        [record] = stack.emulator.requestsFor("apikey-cred", "request")
        assert record.body["prompt_cache_key"] == scoped("alice", RAW_CACHE)
    finally:
        await stack.stop()


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_websocket_scoped_in_every_mode(kind, mode):
    """
    Every mode: the upstream handshake's (or, bridged, the HTTP request's)
    C{thread-id} and C{session_id} are scoped on OAuth accounts, and every
    C{response.create} (or bridged body) carries the key's scoped
    C{prompt_cache_key} on both account types.
    """
    stack = await startStack(_accounts(kind, mode), keys=KEYS, gateway=gateway(mode))
    clients = []
    try:
        for name in ("alice", "bob"):
            client = await connect(stack, key="sk-" + name, headers=HEADERS)
            clients.append(client)
            previous = None
            for text in ("one", "two"):
                frame = dict(userTurn(text, previous=previous), prompt_cache_key=RAW_CACHE)
                events = await client.turn(frame)
                assert events[-1]["type"] == "response.completed", events
                previous = events[-1]["response"]["id"]
            client.bye()
        credential = f"{kind}-cred"
        if mode == "http_bridge":
            sent = stack.emulator.requestsFor(credential, "request")
            heads = sent
        else:
            sent = stack.emulator.requestsFor(credential, "frame")
            heads = stack.emulator.requestsFor(credential, "handshake")
        assert len(sent) == 4
        for i, record in enumerate(sent):
            name = "alice" if i < 2 else "bob"
            assert record.body["prompt_cache_key"] == scoped(name, RAW_CACHE), record.body
        assert heads
        for record in heads:
            values = {record.headers.get("thread-id"), record.headers.get("session_id")}
            if kind == "oauth":
                assert values <= {scoped(n, raw) for n in ("alice", "bob")
                                  for raw in (RAW_THREAD, "sess-shared")}, record.headers
            else:
                assert record.headers.get("thread-id") == RAW_THREAD
    finally:
        await drain(stack, clients)
