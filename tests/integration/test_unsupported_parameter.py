"""
behaviour.md R7, R49 step 5, R112 through a real relay and the emulator: an
upstream 400 naming an unsupported parameter -- the ChatGPT backend's
C{{"detail": "Unsupported parameter: X"}}, on HTTP as the status and body,
on the WebSocket as the status-bearing C{error} event -- is R7's rejected
field on every entrypoint and mode, on both account types: the field is
dropped and the turn retried once on the same account; when the retry is
refused too, the upstream's own message reaches the client (never
"Upstream request failed").
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from tests.integration.harness import sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain, gateway, userTurn

CASES = [(e, k) for e in ("http_sse", "http_json", "chat_stream", "ctx_pool", "passthrough",
                          "http_bridge")
         for k in ("apikey", "oauth")
         if not (e == "chat_stream" and k == "oauth")]
"""(entrypoint, account type). A chat turn on an OAuth account keeps only
the fields Codex sends (relay.engine.payload.OAUTH_CHAT_FIELDS): an unknown
one never reaches the backend there."""

WS = ("ctx_pool", "passthrough", "http_bridge")


async def _start(entrypoint: str, kind: str):
    accounts = [{"id": f"a{i}", "credential": f"{kind}-a{i}", "priority": i,
                 **({"type": "oauth"} if kind == "oauth" else {})} for i in (1, 2)]
    mode = entrypoint if entrypoint in WS else "ctx_pool"
    return await startStack(accounts, gateway=gateway(mode))


async def _turn(stack, entrypoint: str, extra: dict):
    """
    @return: C{(completed, message)}: whether the turn completed, and the
        error message the client got otherwise.
    """
    if entrypoint in WS:
        client = await connect(stack, headers={"session-id": "s-1"})
        try:
            client.sendJSON({**userTurn("hi"), **extra})
            while True:
                event = await client.next(8)
                kind = event["type"]
                if kind == "response.completed":
                    return True, None
                if kind == "__closed__":
                    return False, event.get("reason")
                if kind == "response.failed":
                    return False, event["response"]["error"]["message"]
                if kind == "error" and (event.get("status") or event.get("status_code")):
                    return False, event["error"]["message"]
        finally:
            client.bye()
    if entrypoint == "chat_stream":
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                "stream": True, **extra}
        response, data = await stack.postJSON("/v1/chat/completions", body)
    else:
        body = {"model": "gpt-5.5", "input": "hi", "stream": entrypoint == "http_sse", **extra}
        response, data = await stack.postJSON("/v1/responses", body)
    if response.code != 200:
        return False, json.loads(data)["error"]["message"]
    if entrypoint == "http_json":
        return json.loads(data).get("status") == "completed", None
    if entrypoint == "chat_stream":
        return b"[DONE]" in data, None
    for kind, event in sseEvents(data):
        if kind == "response.completed":
            return True, None
        if kind == "response.failed":
            return False, event["response"]["error"]["message"]
        if kind == "error":
            return False, (event.get("error") or event).get("message")
    return False, None


def _sent(stack, credential: str) -> list:
    return [r.body for r in stack.emulator.requestsFor(credential)
            if r.kind in ("request", "frame") and isinstance(r.body, dict)]


@pytest.mark.parametrize("entrypoint,kind", CASES)
@pytest_twisted.ensureDeferred
async def test_unsupported_parameter_dropped_and_retried(entrypoint, kind):
    """
    The backend's C{{"detail": "Unsupported parameter: zz_field"}}: relay
    drops C{zz_field} and the same account serves the retry.
    """
    stack = await _start(entrypoint, kind)
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "unsupported_parameter"})
        completed, message = await _turn(stack, entrypoint, {"zz_field": 1})
        assert completed, message
        bodies = _sent(stack, f"{kind}-a1")
        assert len(bodies) == 2, bodies
        assert "zz_field" in bodies[0] and "zz_field" not in bodies[1]
        assert _sent(stack, f"{kind}-a2") == []
    finally:
        await drain(stack)


@pytest.mark.parametrize("entrypoint,kind", CASES)
@pytest_twisted.ensureDeferred
async def test_second_unsupported_parameter_reaches_the_client(entrypoint, kind):
    """
    Two unsupported fields: one is dropped, the retry's refusal is answered
    with the backend's own C{detail} as the client's message.
    """
    stack = await _start(entrypoint, kind)
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "unsupported_parameter"})
        completed, message = await _turn(stack, entrypoint, {"zz_one": 1, "zz_two": 2})
        assert not completed
        assert message == "Unsupported parameter: zz_two", message
        assert len(_sent(stack, f"{kind}-a1")) == 2
        assert _sent(stack, f"{kind}-a2") == []
    finally:
        await drain(stack)


@pytest.mark.parametrize("mode", ("ctx_pool", "passthrough"))
@pytest_twisted.ensureDeferred
async def test_prompt_cache_retention_on_the_oauth_websocket(mode):
    """
    The issue's case: the ChatGPT backend refuses C{prompt_cache_retention}
    on the WebSocket; relay drops it and the same account serves the turn.
    """
    stack = await _start(mode, "oauth")
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "unsupported_parameter",
                                      "param": "prompt_cache_retention"})
        completed, message = await _turn(stack, mode, {"prompt_cache_retention": "24h"})
        assert completed, message
        frames = _sent(stack, "oauth-a1")
        assert [("prompt_cache_retention" in f) for f in frames] == [True, False], frames
    finally:
        await drain(stack)


@pytest.mark.parametrize("kind", ("apikey", "oauth"))
@pytest.mark.parametrize("mode", ("ctx_pool", "passthrough"))
@pytest_twisted.ensureDeferred
async def test_handshake_unsupported_parameter(mode, kind):
    """
    The backend answering the upstream WebSocket handshake with 400
    C{{"detail": "Unsupported parameter: zz_field"}}: once, relay drops the
    field and the same account serves the turn; every time, the detail is
    the client's message.
    """
    stack = await _start(mode, kind)
    try:
        detail = {"detail": "Unsupported parameter: zz_field"}
        stack.emulator.setFault("*", {"kind": "ws_handshake_status", "code": 400,
                                      "body": detail, "times": 1})
        completed, message = await _turn(stack, mode, {"zz_field": 1})
        assert completed, message
        frames = _sent(stack, f"{kind}-a1")
        assert frames and "zz_field" not in frames[-1], frames
        assert _sent(stack, f"{kind}-a2") == []
        stack.emulator.clearFaults()
        stack.emulator.setFault("*", {"kind": "ws_handshake_status", "code": 400,
                                      "body": detail})
        completed, message = await _turn(stack, mode, {"zz_field": 1})
        assert not completed
        assert message == "Unsupported parameter: zz_field", message
    finally:
        await drain(stack)
