"""
An upstream "frame too big" is the request's fault (issue 20; behaviour.md
R91): an upstream WebSocket that closes 1009 (the emulator's frame limit,
C{ws_max_frame_bytes}) marks nothing and is not failed over to another
account; relay retries the turn once over HTTP on the same account, else
the client gets an C{error} event with status 400, code
C{frame_too_large}, and close 1009.
"""

import pytest
import pytest_twisted

from tests.integration import parity as P
from tests.integration.harness import startStack
from tests.integration.test_ws_turns import connect, drain, gateway, userTurn

LIMIT = 4096


def accounts():
    return [{"id": "a1", "credential": "sk-a1", "priority": 1},
            {"id": "a2", "credential": "sk-a2", "priority": 50}]


async def bigTurn(stack):
    client = await connect(stack)
    events = await client.turn(userTurn("x" * (LIMIT * 2)))
    return client, events


async def stateOf(stack, accountId):
    runtime = (await stack.app.store.getAccountStates([accountId]))[accountId]
    now = stack.app.reactor.seconds()
    breaker = stack.app.health.breakerState(accountId) or {}
    return (runtime.disabled, runtime.blockedUntil > now, runtime.rateLimitedUntil > now,
            breaker.get("failures", 0))


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough"])
@pytest_twisted.ensureDeferred
async def test_frame_too_big_retries_once_over_http_on_the_same_account(mode):
    stack = await startStack(accounts(), gateway=gateway(mode),
                             emulatorConfig={"ws_max_frame_bytes": LIMIT})
    clients = []
    try:
        client, events = await bigTurn(stack)
        clients.append(client)
        assert events[-1]["type"] == "response.completed", events
        a1 = stack.emulator.requestsFor("sk-a1")
        # The oversized frame never reaches the emulator's turn handling (its
        # WebSocket closed 1009 on it); the HTTP retry is the one request.
        assert [(r.transport, r.kind) for r in a1] == [("ws", "handshake"), ("http", "request")]
        assert stack.emulator.requestsFor("sk-a2") == []
        assert P.decisionCounters(stack)["failovers"] == {}
        assert P.decisionCounters(stack)["cooldowns"] == {}
        assert await stateOf(stack, "a1") == (False, False, False, 0)
    finally:
        await drain(stack, clients)


@pytest_twisted.ensureDeferred
async def test_frame_too_big_everywhere_is_a_400_and_close_1009():
    """
    When HTTP refuses the size too (413), the client is told: an error event
    with status 400 and code frame_too_large, then close 1009; still no
    failover and no marking.
    """
    stack = await startStack(accounts(), gateway=gateway("ctx_pool"),
                             emulatorConfig={"ws_max_frame_bytes": LIMIT})
    clients = []
    try:
        stack.emulator.setFault("sk-a1", {"kind": "status", "code": 413, "transport": "http",
                                          "times": 1})
        client, events = await bigTurn(stack)
        clients.append(client)
        error = next(e for e in events if e["type"] == "error")
        assert (error["status"], error["error"]["code"]) == (400, "frame_too_large")
        closed = events[-1] if events[-1]["type"] == "__closed__" else await client.next()
        assert closed["code"] == 1009, events
        assert stack.emulator.requestsFor("sk-a2") == []
        assert P.decisionCounters(stack)["failovers"] == {}
        assert await stateOf(stack, "a1") == (False, False, False, 0)
    finally:
        await drain(stack, clients)
