"""
R75 (WebSocket end to end) for R72's C{transport_retry_policy}: the first
upstream connect of a WebSocket turn fails with "connection reset" and the
second succeeds. Under C{sticky} both attempts use the same account (the
emulator saw two handshakes, or two bridged requests, on A and none on B);
under C{rotate} (the default) the second attempt uses the other account.
Either way the transient reset writes no cooldown (R3, R72).
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.logger import globalLogPublisher

from tests.integration.harness import startStack
from tests.integration.test_ws_turns import connect, drain, userTurn

ACCOUNTS = [
    {"id": "a", "credential": "sk-a", "priority": 1},
    {"id": "b", "credential": "sk-b", "priority": 50},
]

# The "connection reset" fault for each mode, and what the emulator records
# for one upstream attempt.
FAULTS = {
    "ctx_pool": ({"kind": "ws_handshake_reset", "times": 1}, "handshake"),
    "passthrough": ({"kind": "ws_handshake_reset", "times": 1}, "handshake"),
    "http_bridge": ({"kind": "reset_before_headers", "times": 1, "transport": "http"}, "request"),
}


@pytest.fixture
def logs():
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def named(events, name) -> list:
    return [e for e in events if e.get("event") == name]


@pytest.mark.parametrize("policy", ["sticky", "rotate"])
@pytest.mark.parametrize("mode", sorted(FAULTS))
@pytest_twisted.ensureDeferred
async def test_connection_reset_then_success(mode, policy, logs):
    """
    R75/R72: a reset first upstream connect on account A, then success.
    C{sticky}: A is retried (two attempts on A, none on B), logged as
    C{openai.transport_sticky_retry}. C{rotate}: one attempt on A, the turn
    completes on B after a C{openai.websocket_upstream_failover_switching}.
    """
    fault, kind = FAULTS[mode]
    stack = await startStack(
        ACCOUNTS,
        gateway="{websocket: {mode_default: " + mode + "}, transport_retry_policy: "
        + policy + "}",
    )
    stack.emulator.setFault("sk-a", fault)
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        onA = stack.emulator.requestsFor("sk-a", kind)
        onB = stack.emulator.requestsFor("sk-b", kind)
        if policy == "sticky":
            assert (len(onA), len(onB)) == (2, 0)
            [retry] = named(logs, "openai.transport_sticky_retry")
            assert retry["account_id"] == "a"
            assert named(logs, "openai.websocket_upstream_failover_switching") == []
        else:
            assert (len(onA), len(onB)) == (1, 1)
            assert named(logs, "openai.transport_sticky_retry") == []
            [switch] = named(logs, "openai.websocket_upstream_failover_switching")
            assert switch["account_id"] == "a"
        states = await stack.app.store.getAccountStates(["a"])
        assert not states["a"].blockedUntil  # transient: no cooldown
    finally:
        await drain(stack, [client])
