"""
Codex CLI 0.171 over HTTP (C{supports_websockets = false}) through a real
relay to the emulator: a turn with one tool call (C{echo hi}) completes, also
when one of two accounts refuses connections (protocol.md 8).

Skipped when Codex is not installed (see L{tests.integration.codex}).
"""

import pytest
import pytest_twisted
from twisted.logger import globalLogPublisher

from tests.integration.codex import SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import RELAY_KEY, closedPort, startStack

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)

SCRIPT = {
    "tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "text": "All done.",
}
"""
Every account answers a fresh turn with C{exec_command echo hi}, then the
tool output with text.
"""


def assertToolTurn(result) -> None:
    """
    The run exited 0, ran C{echo hi} once with output C{hi}, printed the
    final message and never fell back or failed.
    """
    assert result.exitCode == 0, result.summary() + "\n" + result.stderr[-2000:]
    assert result.turnCompleted, result.summary()
    assert not result.turnFailed, result.summary()
    assert not result.fellBack, result.summary()
    commands = result.commandExecutions
    assert len(commands) == 1, result.summary()
    assert "echo hi" in commands[0]["command"]
    assert commands[0]["exit_code"] == 0
    assert commands[0]["aggregated_output"].strip() == "hi"
    assert result.agentMessages and result.agentMessages[-1] == "All done.", result.summary()


@pytest_twisted.ensureDeferred
async def test_codex_http_tool_turn():
    """
    Codex over HTTP runs the tool call and prints the final message; the
    emulator saw two HTTP requests (the turn and the tool output), both on
    the one account.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-emu-a1"}], emulatorConfig={"default_script": SCRIPT}
    )
    try:
        result = await runCodex(stack.url + "/v1", RELAY_KEY, websockets=False, timeout=60)
        print("Codex (HTTP, one account):\n" + result.summary())
        assertToolTurn(result)
        served = stack.emulator.requestsFor("sk-emu-a1", kind="request")
        assert len(served) >= 2
        assert all(r.transport == "http" for r in served)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_codex_http_one_account_refusing():
    """
    With the preferred account refusing connections (a closed loopback
    port), Codex's turn still completes and the emulator's record shows the
    good account served every request.
    """
    dead = closedPort()
    stack = await startStack(
        [
            {"id": "dead", "credential": "sk-emu-dead",
             "base_url": f"http://127.0.0.1:{dead}/v1", "priority": 1},
            {"id": "good", "credential": "sk-emu-good", "priority": 50},
        ],
        emulatorConfig={"default_script": SCRIPT},
    )
    decisions = []

    def observe(event):
        if event.get("event") == "openai.account_schedule_decision":
            decisions.append(event["selected_account_id"])

    globalLogPublisher.addObserver(observe)
    try:
        result = await runCodex(stack.url + "/v1", RELAY_KEY, websockets=False, timeout=60)
        print("Codex (HTTP, one account refusing):\n" + result.summary())
        print("accounts selected, in order:", decisions)
        assertToolTurn(result)
        assert decisions[0] == "dead", decisions  # the refused account was tried first
        assert "good" in decisions
        served = stack.emulator.requestsFor("sk-emu-good", kind="request")
        assert len(served) >= 2
        assert {r.credential for r in stack.emulator.requests} == {"sk-emu-good"}
    finally:
        globalLogPublisher.removeObserver(observe)
        await stack.stop()
