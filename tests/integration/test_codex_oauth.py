"""
Issue 12 with the real Codex CLI 0.171: a session through an OAuth account
whose access token expires in the middle of it (6 s token, the turn and its
tool output take longer), over HTTP and over the Responses WebSocket
(C{ctx_pool} and C{passthrough}), and a WebSocket session whose first
handshake is rejected with 401 (refresh, replay). Every turn completes,
Codex never falls back from the WebSocket, and the emulator saw no reuse.

Skipped when Codex is not installed.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor

from relay.emulator import Emulator
from tests.integration.codex import FALLBACK_MARKER, SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import RELAY_KEY, startStack
from tests.integration.oauthstack import (
    bearers,
    emulatorConfig,
    expOf,
    forgedToken,
    oauthAccount,
    oauthStats,
)
from tests.integration.test_ws_turns import drain

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)

SCRIPT = {
    "tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "text": "Tool said: {result}",
    "delay": 0.4,
    "deltas": 4,
}


def assertToolTurn(result) -> None:
    summary = result.summary() + "\n" + result.stderr[-3000:]
    assert result.exitCode == 0, summary
    assert result.turnCompleted and not result.turnFailed, summary
    commands = result.commandExecutions
    assert len(commands) == 1 and commands[0]["aggregated_output"].strip() == "hi", summary
    assert result.agentMessages and result.agentMessages[-1] == "Tool said: hi", summary
    everything = result.stdout + result.stderr
    assert FALLBACK_MARKER not in everything, summary
    assert "Reconnecting" not in everything, summary


@pytest.mark.parametrize("transport", ["http", "ctx_pool", "passthrough"])
@pytest_twisted.ensureDeferred
async def test_codex_session_outlives_its_token(transport):
    """
    The account's access token expires 6 s into a Codex session that lasts
    longer: relay refreshes it (proactively at expiry, or before a dial
    within 5 s of it) and every turn completes; over HTTP the later request
    carries the new token.
    """
    emulator = Emulator(reactor=reactor, config=emulatorConfig(("o1",), script=SCRIPT))
    await emulator.listen(reactor)
    mode = "ctx_pool" if transport == "http" else transport
    stack = await startStack(
        lambda e: [oauthAccount(e, "o1", accessTtl=6)], emulator=emulator,
        gateway="{oauth: {refresh_margin_seconds: 0}, websocket: {mode_default: " + mode + "}}",
    )
    try:
        if transport == "http":
            # The first request (the user turn) outlives the 6 s token, so the
            # second (the tool result) is dialled after its expiry whatever
            # the machine's speed.
            stack.emulator.setFault("o1", {"kind": "delay_first_output", "seconds": 7,
                                           "times": 1, "transport": "http"})
        result = await runCodex(
            stack.url + "/v1", RELAY_KEY, prompt="run echo hi",
            websockets=transport != "http", timeout=60,
        )
        print(f"Codex ({transport}, expiring token):\n" + result.summary())
        assertToolTurn(result)
        stats = oauthStats(emulator, "o1")
        assert stats["refreshes"] >= 1 and stats["reuse_attempts"] == 0, stats
        if transport == "http":
            # The session outlives the 6 s token (the first request is held
            # for 7 s), and every request was dialled with a token still
            # valid when it arrived: relay refreshed in between.
            requests = emulator.requestsFor("o1", "request")
            assert len(requests) >= 2, requests
            assert requests[-1].time - requests[0].time > 6, [r.time for r in requests]
            for record in requests:
                token = record.headers["authorization"].partition(" ")[2]
                assert expOf(token) > record.time, (record.time, expOf(token))
    finally:
        await drain(stack)


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough"])
@pytest_twisted.ensureDeferred
async def test_codex_ws_handshake_401_refreshes_and_replays(mode):
    """
    The first upstream WebSocket handshake is rejected with 401 (a token
    upstream no longer accepts): relay refreshes once and replays on the
    same account; Codex's turn completes over the WebSocket.
    """
    # The stream's pace is not the point here (SCRIPT's delay makes a session outlive a
    # 6 s token above): the turns stream at once.
    emulator = Emulator(reactor=reactor,
                        config=emulatorConfig(("o1",), script=dict(SCRIPT, delay=0.0)))
    await emulator.listen(reactor)
    stack = await startStack(
        lambda e: [oauthAccount(e, "o1", credential=forgedToken("o1"))], emulator=emulator,
        gateway="{websocket: {mode_default: " + mode + "}}",
    )
    try:
        result = await runCodex(
            stack.url + "/v1", RELAY_KEY, prompt="run echo hi", websockets=True, timeout=60,
        )
        print(f"Codex ({mode}, handshake 401):\n" + result.summary())
        assertToolTurn(result)
        stats = oauthStats(emulator, "o1")
        assert stats["refreshes"] == 1 and stats["reuse_attempts"] == 0, stats
        handshakes = bearers(emulator, "o1", "handshake")
        assert handshakes[0] != handshakes[-1]
    finally:
        await drain(stack)
