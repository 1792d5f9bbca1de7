"""
Metrics wiring on a real relay: WebSocket close codes reach
C{relay_ws_closes_total{code}} and HTTP turns that reach upstream are
observed in C{relay_added_latency_seconds}.
"""

from __future__ import annotations

import json
import re

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater

from tests.integration.harness import startStack
from tests.integration.test_ws_turns import connect, drain, userTurn

ADMIN = "metrics-wiring-admin-k"
ACCOUNTS = [{"id": "a1", "credential": "sk-a1"}]


async def _metrics(stack) -> str:
    r = await treq.get(stack.url + "/metrics", headers={"Authorization": [f"Bearer {ADMIN}"]})
    body = await r.content()
    assert r.code == 200, body
    return body.decode()


def _sample(text: str, name: str) -> float | None:
    match = re.search(r"^" + re.escape(name) + r" ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


async def _eventually(stack, predicate, timeout=5.0) -> str:
    """
    Scrape until C{predicate(text)} holds (the server's C{onClose} runs a
    moment after the client sees the close).
    """
    deadline = reactor.seconds() + timeout
    while True:
        text = await _metrics(stack)
        if predicate(text) or reactor.seconds() > deadline:
            return text
        await deferLater(reactor, 0.02, lambda: None)


@pytest_twisted.ensureDeferred
async def test_ws_close_codes_are_counted():
    """
    A 1008 close (a client mistake) and a normal 1000 close each appear in
    C{relay_ws_closes_total} with their code.
    """
    stack = await startStack(ACCOUNTS, extra=f"admin_key: {ADMIN}\n")
    try:
        bad = await connect(stack)
        bad.sendMessage(b"{not json", False)
        assert await bad.closed.addTimeout(5, reactor) == (1008, "invalid JSON payload")

        good = await connect(stack)
        assert (await good.turn(userTurn("hi")))[-1]["type"] == "response.completed"
        good.bye()
        code, _ = await good.closed.addTimeout(5, reactor)
        assert code == 1000

        text = await _eventually(
            stack,
            lambda t: _sample(t, 'relay_ws_closes_total{code="1008"}') is not None
            and _sample(t, 'relay_ws_closes_total{code="1000"}') is not None,
        )
        assert _sample(text, 'relay_ws_closes_total{code="1008"}') == 1.0, text
        assert _sample(text, 'relay_ws_closes_total{code="1000"}') == 1.0, text
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_http_turn_observes_added_latency():
    """
    An HTTP turn that reached upstream is observed once in
    C{relay_added_latency_seconds}.
    """
    stack = await startStack(ACCOUNTS, extra=f"admin_key: {ADMIN}\n")
    try:
        r, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        assert r.code == 200, data
        assert json.loads(data)["status"] == "completed"
        text = await _metrics(stack)
        count = _sample(text, "relay_added_latency_seconds_count")
        assert count is not None and count >= 1, text
        total = _sample(text, "relay_added_latency_seconds_sum")
        assert total is not None and total >= 0
    finally:
        await stack.stop()
