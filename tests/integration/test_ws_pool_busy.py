"""
R-B3 (and R49 step 4, R81): when the C{ctx_pool} upstream pool cannot lend a
connection in time and the switch budget is spent, the WebSocket closes
1013 "upstream websocket is busy, please retry later", the pool-specific
reason, not the generic 1013 "upstream service temporarily unavailable".
No cooldown is written for a busy pool.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.integration.harness import startStack
from tests.integration.test_ws_turns import connect, drain, frames, userTurn

BUSY_CLOSE = (1013, "upstream websocket is busy, please retry later")

CASES = {
    # the only account is busy: no account left to select
    "no_account_left": (
        [{"id": "a", "credential": "sk-a", "concurrency": 2}],
        "",
    ),
    # another account exists but the switch budget is 0
    "switch_budget_zero": (
        [
            {"id": "a", "credential": "sk-a", "priority": 1, "concurrency": 2},
            {"id": "b", "credential": "sk-b", "priority": 50},
        ],
        ", max_account_switches: 0",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest_twisted.ensureDeferred
async def test_pool_busy_exhausted_closes_1013_busy(case):
    """
    R-B3: the pool of account C{a} (capacity 1) is held; the turn's acquire
    times out (dial 1 s + 2 s), failover has nowhere to go, and the client
    gets close 1013 "upstream websocket is busy, please retry later".
    """
    accounts, extra = CASES[case]
    stack = await startStack(
        accounts,
        gateway="{websocket: {mode_default: ctx_pool, pool_capacity_factor: 0.5},"
        " upstream: {connect_timeout_seconds: 1.0}" + extra + "}",
    )
    pool = stack.app.extras["wsPool"]
    account = next(a for a in stack.app.config.accounts if a.id == "a")
    held = await pool.acquire(account, {})
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("hi"), timeout=8.0)
        assert events[-1]["type"] == "__closed__", events
        assert client.closeInfo == BUSY_CLOSE
        assert frames(stack, "sk-a") == []
        assert frames(stack, "sk-b") == []
        states = await stack.app.store.getAccountStates(["a"])
        assert not states["a"].blockedUntil
    finally:
        pool.release(held)
        await drain(stack, [client])
