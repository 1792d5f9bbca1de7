"""
A prewarm is never a generation (issue 20; behaviour.md R53, R93): in every
WebSocket mode a C{generate: false} frame produces no upstream generation;
ctx_pool and passthrough pass it through natively, http_bridge answers it
locally -- also when the connection's mode is ctx_pool but the engine lands
the prewarm on an account bridged to HTTP (after a failover).
"""

import pytest
import pytest_twisted

from tests.integration.harness import startStack
from tests.integration.test_ws_turns import PREWARM, connect, drain, gateway, userTurn


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_prewarm_is_never_a_generation(mode):
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway(mode))
    client = await connect(stack)
    try:
        warm = await client.turn(PREWARM)
        assert warm[-1]["type"] == "response.completed"
        assert warm[-1]["response"]["output"] == []
        assert stack.emulator.generationCount() == 0
        turn = await client.turn(userTurn("hi", previous=warm[-1]["response"]["id"]))
        assert turn[-1]["type"] == "response.completed", turn
        assert stack.emulator.generationCount() == 1
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_prewarm_failed_over_to_a_bridged_account_is_answered_locally():
    """
    R93: the connection runs ctx_pool (its accounts' modes differ); the
    preferred account refuses the upgrade and the prewarm fails over to an
    account in http_bridge mode: relay answers it there without sending it
    (HTTP has no C{generate}; it would bill a generation).
    """
    stack = await startStack(
        [{"id": "ws", "credential": "sk-ws", "priority": 1, "ws_mode": "ctx_pool"},
         {"id": "br", "credential": "sk-br", "priority": 50, "ws_mode": "http_bridge"}],
        gateway=gateway("ctx_pool"))
    stack.emulator.setFault("sk-ws", {"kind": "ws_handshake_status", "code": 503})
    client = await connect(stack)
    try:
        warm = await client.turn(PREWARM)
        assert warm[-1]["type"] == "response.completed", warm
        assert warm[-1]["response"]["output"] == []
        assert stack.emulator.requestsFor("sk-br") == []
        assert stack.emulator.generationCount() == 0
        turn = await client.turn(userTurn("hi", previous=warm[-1]["response"]["id"]))
        assert turn[-1]["type"] == "response.completed", turn
        (sent,) = [r.body for r in stack.emulator.requestsFor("sk-br")]
        assert "generate" not in sent and "base" in str(sent["input"])
    finally:
        await drain(stack, [client])
