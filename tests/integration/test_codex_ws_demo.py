"""
Codex CLI 0.171 against the offline demo's accounts (etc/demo.yaml: C{a2}
preferred and answering 503, C{a1} healthy), over the Responses WebSocket
(C{supports_websockets = true}, relay's default C{ctx_pool}) and over HTTP
(C{supports_websockets = false}) (issue 11 item 2, behaviour.md R11, R86.1,
R86.2): two Codex turns leave C{a2} in the same state on both transports,
every turn completes, and Codex neither falls back from the WebSocket nor
reconnects.

Skipped when Codex is not installed (see L{tests.integration.codex}).
"""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.integration import parity as P
from tests.integration.codex import SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import RELAY_KEY
from tests.integration.test_attempt_ends import (
    A2,
    DEMO_503,
    demoAccounts,
    storeModelBlock,
)

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)

RECONNECTING = "Reconnecting"
"""What Codex prints when it retries a broken stream (protocol.md 5)."""


async def twoCodexTurns(websockets: bool):
    """
    Run two C{codex exec} turns (two threads, as a user would) against a
    fresh demo-shaped relay.

    @return: C{(normalised state of a2, seconds left on its stored model
        block, a2's admin row, the Codex summaries)}.
    """
    stack = await P.startParityStack("ws_ctx_pool" if websockets else "http_sse", demoAccounts())
    summaries = []
    try:
        stack.emulator.setFault(A2, DEMO_503)
        for n in (1, 2):
            result = await runCodex(stack.url + "/v1", RELAY_KEY, prompt=f"Say hello ({n})",
                                    websockets=websockets, timeout=60)
            summary = result.summary() + "\n" + result.stderr[-1500:]
            summaries.append(summary)
            assert result.exitCode == 0, summary
            assert result.turnCompleted and not result.turnFailed, summary
            assert "account a1" in " ".join(result.agentMessages), summary
            assert not result.fellBack, summary
            assert RECONNECTING not in result.stdout + result.stderr, summary
        await P.settle(stack, P.turnsFinished(stack))
        row = (await P.adminAccounts(stack))["a2"]
        return P.accountState(row), await storeModelBlock(stack, "a2"), row, summaries
    finally:
        await P.drain(stack)


@pytest_twisted.ensureDeferred
async def test_codex_websocket_marks_a2_like_http():
    """
    Two Codex turns over the WebSocket block C{a2} exactly as two Codex
    turns over HTTP do: the R11 streak reaches 2, the store holds a 10 s
    model block for gpt-5.5, and C{/admin/accounts} reports the same
    normalised state (unschedulable, streak class, no breaker failures,
    streak 2) on both transports.
    """
    httpState, httpBlock, httpRow, _ = await twoCodexTurns(websockets=False)
    wsState, wsBlock, wsRow, _ = await twoCodexTurns(websockets=True)
    note = (f"\nhttp: {httpState} block {httpBlock:.1f}s {httpRow}"
            f"\nws:   {wsState} block {wsBlock:.1f}s {wsRow}")
    assert 8 <= httpBlock <= 10, note
    assert 8 <= wsBlock <= 10, note
    assert wsState == httpState, note
    assert httpState == (False, "streak", 0, 2), note
