"""
behaviour.md R113 with the real Codex CLI 0.171 over relay's WebSocket: a
key's own limits never push Codex off the WebSocket. For each refusal -- a
model the key may not use, a spent budget, an C{rpm} window that frees
within C{fallback_wait_timeout}, one that does not -- Codex prints relay's
message (with the reset time where there is one) or just completes, and
never reconnects or prints "Falling back from WebSockets".
"""

from __future__ import annotations

import collections
import json
import time

import pytest
import pytest_twisted
from twisted.internet import reactor

from tests.integration.codex import SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import startStack
from tests.integration.test_ws_turns import drain

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)

TEXT = {"default_script": {"text": "All good."}}


def keyEntry(name: str, **policy) -> dict:
    return dict({"name": name, "key": "sk-" + name, "concurrency": 0}, **policy)


async def stack(keys, mode="ctx_pool"):
    return await startStack([{"id": "a1", "credential": "sk-a1"}], keys=json.dumps(keys),
                            gateway="{websocket: {mode_default: " + mode + "}}",
                            emulatorConfig=TEXT)


async def codex(s, name: str):
    """
    One Codex run over the WebSocket with key C{name}.
    """
    return await runCodex(f"{s.url}/v1", "sk-" + name, prompt="say hi", websockets=True,
                          timeout=60)


def assertStayedOnTheWebSocket(result):
    assert not result.fellBack, result.summary()
    assert not any("Reconnecting" in m for m in result.errors), result.summary()


def fullWindow(s, name: str, age: float):
    """
    The key's one request of this minute was made C{age} seconds ago.
    """
    s.app.extras["rateLimiter"]._requests[name] = collections.deque([reactor.seconds() - age])


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_model_not_allowed(mode):
    """
    A model outside the key's C{models}: Codex prints relay's message
    naming the model and the allow-list; no fallback.
    """
    s = await stack([keyEntry("narrow", models=["gpt-4.1"])], mode)
    try:
        result = await codex(s, "narrow")
        assertStayedOnTheWebSocket(result)
        assert result.exitCode != 0
        assert any("does not have access to model `gpt-5.5`" in m and "gpt-4.1" in m
                   for m in result.errors), result.summary()
        assert s.emulator.requestsFor("sk-a1") == []
    finally:
        await drain(s)


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_budget_exhausted(mode):
    """
    A spent C{daily_tokens}: Codex prints its usage-limit line with relay's
    message (the budget, what was used, the UTC reset) and the reset time
    ("or try again at <time>"), not "Quota exceeded"; no fallback.
    """
    s = await stack([keyEntry("capped", daily_tokens=1)], mode)
    try:
        response, _ = await s.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"},
                                       key="sk-capped")
        assert response.code == 200
        served = len(s.emulator.requestsFor("sk-a1"))
        result = await codex(s, "capped")
        assertStayedOnTheWebSocket(result)
        [line] = set(m for m in result.errors if "budget" in m) or [result.summary()]
        assert "Token budget exhausted for key 'capped': daily_tokens is 1" in line, line
        assert "resets at " in line and "or try again at " in line, line
        assert "Quota exceeded" not in result.stdout
        assert len(s.emulator.requestsFor("sk-a1")) == served
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_rpm_wait_that_fits():
    """
    C{rpm: 1} with the window freeing in 4 s (under the 30 s
    C{fallback_wait_timeout}): relay waits, the turn completes on the
    same WebSocket; Codex prints no error.
    """
    s = await stack([keyEntry("paced", rpm=1)])
    try:
        fullWindow(s, "paced", 56)
        started = time.monotonic()
        result = await codex(s, "paced")
        assertStayedOnTheWebSocket(result)
        assert result.turnCompleted and result.agentMessages == ["All good."], result.summary()
        assert result.errors == [], result.summary()
        assert time.monotonic() - started >= 3.5
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_rpm_wait_that_does_not_fit():
    """
    C{rpm: 1} with the window freeing in 55 s: Codex prints relay's rate
    limit message naming RPM and the wait, with the time to try again; no
    fallback, and it took no 55 s.
    """
    s = await stack([keyEntry("busy", rpm=1)])
    try:
        fullWindow(s, "busy", 5)
        started = time.monotonic()
        result = await codex(s, "busy")
        assertStayedOnTheWebSocket(result)
        assert any("Rate limit reached for key 'busy' on requests per min (RPM): Limit 1" in m
                   and "or try again at " in m for m in result.errors), result.summary()
        assert time.monotonic() - started < 30
        # only Codex's prewarm (not counted by rpm, R113) reached the account
        frames = [r.body for r in s.emulator.requestsFor("sk-a1") if r.kind == "frame"]
        assert all(f.get("generate") is False for f in frames), frames
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_budget_exhausted_over_http():
    """
    A spent C{daily_tokens} with Codex on HTTP (its provider's
    C{supports_websockets} off): relay's 429 is the body Codex renders as a
    usage limit, so Codex prints relay's message and the reset time ("or
    try again at <time>") at once -- not "Quota exceeded", no retries --
    the same as on the WebSocket (R113).
    """
    s = await stack([keyEntry("capped", daily_tokens=1)])
    try:
        response, _ = await s.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"},
                                       key="sk-capped")
        assert response.code == 200
        served = len(s.emulator.requestsFor("sk-a1"))
        started = time.monotonic()
        result = await runCodex(f"{s.url}/v1", "sk-capped", prompt="say hi", websockets=False,
                                timeout=60)
        assert result.exitCode != 0
        [line] = set(m for m in result.errors if "budget" in m) or [result.summary()]
        assert "Token budget exhausted for key 'capped': daily_tokens is 1" in line, line
        assert "resets at " in line and "or try again at " in line, line
        assert "Quota exceeded" not in result.stdout
        assert not any("Reconnecting" in m for m in result.errors), result.summary()
        assert time.monotonic() - started < 20
        assert len(s.emulator.requestsFor("sk-a1")) == served
    finally:
        await drain(s)
