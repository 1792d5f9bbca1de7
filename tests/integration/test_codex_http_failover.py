"""
Codex CLI 0.171 over HTTP (C{supports_websockets = false}, protocol.md 8)
through a real relay to the emulator, with the preferred account answering
503 and a healthy second account (behaviour.md R8 row 6, R19 step 7): the
tool turn completes on the healthy account.

Skipped when Codex is not installed (see L{tests.integration.codex}).
"""

import pytest
import pytest_twisted

from tests.integration.codex import SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import RELAY_KEY, startStack

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)

SCRIPT = {
    "tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "text": "All done.",
}
"""Answer a fresh turn with C{exec_command echo hi}, then the tool output with text."""


@pytest_twisted.ensureDeferred
async def test_codex_http_one_account_503():
    """
    R8/R15/R19: the preferred account answers 503 to every request; relay
    switches to the healthy account, so Codex exits 0 with
    C{turn.completed}, one C{command_execution} printing C{hi} and the
    final agent message. The emulator saw the 503 account (tried first)
    and the healthy one serving both requests of the turn.
    """
    stack = await startStack(
        [
            {"id": "sick", "credential": "sk-emu-sick", "priority": 1},
            {"id": "good", "credential": "sk-emu-good", "priority": 50},
        ],
        emulatorConfig={"default_script": SCRIPT},
    )
    try:
        stack.emulator.setFault(
            "sk-emu-sick",
            {"kind": "status", "code": 503,
             "body": {"error": {"message": "Service Unavailable", "type": "server_error",
                                "code": None, "param": None}}},
        )
        result = await runCodex(
            stack.url + "/v1", RELAY_KEY, prompt="run echo hi", websockets=False, timeout=90
        )
        summary = result.summary() + "\n" + result.stderr[-2000:]
        assert result.exitCode == 0, summary
        assert result.turnCompleted, summary
        assert not result.turnFailed, summary
        commands = result.commandExecutions
        assert len(commands) == 1, summary
        assert "echo hi" in commands[0]["command"]
        assert commands[0]["aggregated_output"].strip() == "hi"
        assert result.agentMessages and result.agentMessages[-1] == "All done.", summary
        sick = stack.emulator.requestsFor("sk-emu-sick", kind="request")
        good = stack.emulator.requestsFor("sk-emu-good", kind="request")
        assert len(sick) >= 1
        assert len(good) >= 2
        assert all(r.transport == "http" for r in sick + good)
        # 5xx marks nothing beyond the API-key streak's first step (R11).
        state = (await stack.app.store.getAccountStates(["sick"]))["sick"]
        assert not state.disabled
    finally:
        await stack.stop()
