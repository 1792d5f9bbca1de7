"""
behaviour.md R113, last sentence: a prewarm (C{generate: false}) is not
counted by a key's C{rpm}, in every WebSocket mode; on HTTP the field is
dropped and the request generates, so there it counts like any request.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from tests.integration.harness import startStack
from tests.integration.test_ws_turns import MODES, PREWARM, connect, drain, gateway, userTurn


def _stack(mode: str):
    """
    @return: (a Deferred of) a stack whose one key has C{rpm: 2}.
    """
    keys = json.dumps([{"name": "warm", "key": "sk-warm", "concurrency": 0, "rpm": 2}])
    return startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway(mode), keys=keys)


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_prewarm_is_not_counted_by_rpm(mode):
    """
    With C{rpm: 2}, Codex's session start (a prewarm, then a turn chained
    to it) leaves room for one more real turn; the turn after that is the
    third request of the minute and is refused.
    """
    stack = await _stack(mode)
    client = await connect(stack, key="sk-warm")
    try:
        warm = await client.turn(PREWARM)
        assert warm[-1]["type"] == "response.completed", warm
        first = await client.turn(userTurn("one", previous=warm[-1]["response"]["id"]))
        assert first[-1]["type"] == "response.completed", first
        second = await client.turn(userTurn("two", previous=first[-1]["response"]["id"]))
        assert second[-1]["type"] == "response.completed", second
        third = await client.turn(userTurn("three", previous=second[-1]["response"]["id"]))
        assert third[-1]["type"] != "response.completed", third
        again = await client.turn(PREWARM) if client.closeInfo is None else None
        if again is not None:
            # a prewarm is not refused by rpm either
            assert again[-1]["type"] == "response.completed", again
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_http_generate_false_is_still_a_request():
    """
    On HTTP C{generate} is dropped (the upstream generates), so a body
    carrying C{generate: false} is counted: the third request is a 429.
    """
    stack = await _stack("ctx_pool")
    try:
        codes = []
        for _ in range(3):
            response, _ = await stack.postJSON(
                "/v1/responses", {"model": "gpt-5.5", "input": "hi", "generate": False},
                key="sk-warm",
            )
            codes.append(response.code)
        assert codes == [200, 200, 429]
    finally:
        await stack.stop()
