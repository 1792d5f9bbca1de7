"""
Wire details protocol.md fixes, checked on what the emulator (the upstream)
and the client actually received through a real relay.
"""

import json

import pytest_twisted
import xxhash

from tests.integration.harness import RELAY_KEY, startStack
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint

from tests.integration.test_ws_turns import (
    PREWARM,
    _Client,
    connect,
    drain,
    frames,
    gateway,
    userTurn,
)

CODEX_UA = "codex_exec/0.171.0 (Linux; x86_64) xterm (codex_exec; 0.171.0)"


@pytest_twisted.ensureDeferred
async def test_oauth_session_ids_are_hashed_per_key():
    """
    protocol.md 7.2: for OAuth accounts C{session_id} / C{conversation_id}
    become xxhash64("k{key}:" + raw) (16 hex digits), falling back to
    C{prompt_cache_key}; API-key accounts get the client's value. Client
    C{OpenAI-Beta} never goes to an HTTP upstream (2.1).
    """
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-fid"}])
    try:
        response, _ = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True},
            headers={"session_id": ["sess-raw-1"], "conversation-id": ["conv-raw"],
                     "OpenAI-Beta": ["responses=experimental"]},
        )
        assert response.code == 200
        response, _ = await stack.postJSON(
            "/v1/responses",
            {"model": "gpt-5.5", "input": "hi", "stream": True, "prompt_cache_key": "thread-9"},
        )
        assert response.code == 200
        first, second = stack.emulator.requestsFor("oauth-fid")
        expect = lambda raw: xxhash.xxh64_hexdigest(("ktest:" + raw).encode())  # noqa: E731
        assert first.headers["session_id"] == expect("sess-raw-1")
        assert first.headers["conversation_id"] == expect("conv-raw")
        assert "conversation-id" not in first.headers
        assert "openai-beta" not in first.headers
        assert second.headers["session_id"] == expect("thread-9")
    finally:
        await stack.stop()
    stack = await startStack([{"id": "k1", "credential": "sk-fid"}])
    try:
        await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True},
                             headers={"session_id": ["sess-raw-1"]})
        [record] = stack.emulator.requestsFor("sk-fid")
        assert record.headers["session_id"] == "sess-raw-1"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_mapped_model_is_rewritten_in_non_stream_json():
    """
    protocol.md 4.3: when relay mapped the model, the client sees the name it
    asked for, also in a non-streaming JSON body written as C{"model": "x"}.
    """
    stack = await startStack([{"id": "k1", "credential": "sk-map", "model_mapping": {"gpt-api": "gpt-5.5"}}])
    try:
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-api", "input": "hi"})
        assert response.code == 200
        assert json.loads(data)["model"] == "gpt-api"
        assert stack.emulator.requestsFor("sk-map")[0].body["model"] == "gpt-5.5"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_stream_has_no_event_lines():
    """
    protocol.md 3: a chat completions stream is data-only, also for tool-call
    chunks whose JSON carries a C{"type"} key.
    """
    stack = await startStack(
        [{"id": "k1", "credential": "sk-chat", "model_mapping": {"gpt-alias": "gpt-5.5"}}],
        emulatorConfig={"default_script": {"tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}}}},
    )
    try:
        for model in ("gpt-5.5", "gpt-alias"):
            response, data = await stack.postJSON(
                "/v1/chat/completions",
                {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"type": "function", "function": {"name": "exec_command"}}]},
            )
            assert response.code == 200
            assert b"tool_calls" in data
            assert b"event:" not in data, data[:400]
            assert data.rstrip().endswith(b"data: [DONE]")
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_upstream_user_agent_and_oauth_store():
    """
    protocol.md 7.2: the upstream handshake carries the client's Codex-shaped
    C{User-Agent} only (not autobahn's), and R66: OAuth frames go upstream
    with C{store:false}.
    """
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-ws"}],
                             gateway=gateway("ctx_pool"))
    client = None
    try:
        port = stack.port.getHost().port
        factory = WebSocketClientFactory(
            f"ws://127.0.0.1:{port}/v1/responses", reactor=reactor, useragent=CODEX_UA,
            headers={"Authorization": f"Bearer {RELAY_KEY}"},
        )
        factory.protocol = _Client
        client = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
        await client.opened.addTimeout(5, reactor)
        events = await client.turn({**userTurn("hi"), "store": True})
        assert events[-1]["type"] == "response.completed"
        [handshake] = stack.emulator.requestsFor("oauth-ws", "handshake")
        assert handshake.headers["user-agent"] == CODEX_UA
        assert frames(stack, "oauth-ws")[0]["store"] is False
    finally:
        await drain(stack, [client] if client else [])


@pytest_twisted.ensureDeferred
async def test_prewarm_with_empty_output_is_not_a_silent_refusal():
    """
    R53/R23: a C{generate:false} prewarm legitimately completes with no
    output; even without usage it is passed through, not failed over as an
    empty C{response.completed}.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-pw-a1", "priority": 1},
         {"id": "a2", "credential": "sk-pw-a2", "priority": 50}],
        gateway=gateway("ctx_pool"),
    )
    client = None
    try:
        stack.emulator.setFault("sk-pw-a1", {"kind": "empty_completed", "times": 1})
        client = await connect(stack)
        events = await client.turn(PREWARM)
        assert events[-1]["type"] == "response.completed"
        assert stack.emulator.requestsFor("sk-pw-a2", "frame") == []
    finally:
        await drain(stack, [client] if client else [])


__all__ = ["RELAY_KEY"]
