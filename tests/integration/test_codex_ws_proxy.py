"""
Codex CLI 0.171 over the Responses WebSocket (C{supports_websockets =
true}, protocol.md 8) through a real relay with two accounts, the preferred
one behind a dead egress proxy (a real C{microsocks} that was killed):
R6/R4 (issue 8, R-B12). The dial through the dead proxy is refused, relay
switches to the other account on the same client WebSocket, and the turn
(tool call C{echo hi} and the chained answer) completes without Codex
falling back to HTTP or reconnecting.

Skipped when Codex or microsocks is not installed.
"""

from __future__ import annotations

import os

import pytest
import pytest_twisted
from twisted.internet import reactor

from tests.integration.codex import FALLBACK_MARKER, SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import RELAY_KEY
from tests.integration.proxy_servers import startMicrosocks
from tests.integration.test_proxy_relay import blockedUntil, proxyURL, startProxiedStack
from tests.integration.test_ws_turns import drain

pytestmark = [
    pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON),
    pytest.mark.skipif(not os.path.exists("/usr/bin/microsocks"), reason="microsocks not installed"),
]

SCRIPT = {
    "tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "text": "Tool said: {result}",
}


@pytest_twisted.ensureDeferred
async def test_codex_ws_dead_proxy_account_fails_over():
    """
    R6/R4/R-B12 with Codex: account C{p1} (preferred) egresses through a
    killed SOCKS5 proxy; Codex's WebSocket turn runs C{echo hi} and gets
    the chained answer from account C{d1}. Codex exits 0 with no
    "Falling back from WebSockets" and no "Reconnecting"; the emulator saw
    no traffic for C{p1}, WebSocket frames only for C{d1}, and C{p1} is
    cooled for 10 minutes.
    """
    proxy = startMicrosocks("relayuser", "relaypass")
    url = proxyURL(proxy)
    proxy.stop()  # dead: the port now refuses
    stack = await startProxiedStack(
        [
            {"id": "p1", "credential": "sk-emu-p1", "priority": 1, "proxy": url},
            {"id": "d1", "credential": "sk-emu-d1", "priority": 50},
        ],
        gateway="{websocket: {mode_default: ctx_pool}}",
    )
    stack.emulator.setScript("sk-emu-p1", SCRIPT)
    stack.emulator.setScript("sk-emu-d1", SCRIPT)
    try:
        now = reactor.seconds()
        result = await runCodex(
            stack.url + "/v1", RELAY_KEY, prompt="run echo hi", websockets=True, timeout=50
        )
        summary = result.summary() + "\n" + result.stderr[-3000:]
        assert result.exitCode == 0, summary
        assert result.turnCompleted and not result.turnFailed, summary
        commands = result.commandExecutions
        assert len(commands) == 1, summary
        assert "echo hi" in commands[0]["command"]
        assert commands[0]["aggregated_output"].strip() == "hi"
        assert result.agentMessages and result.agentMessages[-1] == "Tool said: hi", summary
        everything = result.stdout + result.stderr
        assert FALLBACK_MARKER not in everything, summary
        assert "Reconnecting" not in everything, summary
        assert stack.emulator.requestsFor("sk-emu-p1") == []
        frames = stack.emulator.requestsFor("sk-emu-d1", "frame")
        assert len(frames) >= 2, summary  # the tool call, then the chained answer
        assert stack.emulator.requestsFor("sk-emu-d1", "request") == []
        until = await blockedUntil(stack, "p1")
        assert until is not None and until >= now + 590
    finally:
        await drain(stack)
        proxy.stop()
