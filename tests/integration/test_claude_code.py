"""
Claude Code through relay (behaviour.md R115, protocol.md 10): the pinned
C{claude} CLI, pointed at a relay whose accounts are the bundled emulator's,
runs a tool turn (it reads a file with its C{Read} tool and answers with
what it read) and a turn where the first account fails and relay fails
over without Claude Code seeing it.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import pytest_twisted

from tests.integration.claudecode import SKIP_REASON, claudeBinary, runClaude
from tests.integration.harness import RELAY_KEY, startStack

pytestmark = pytest.mark.skipif(claudeBinary() is None, reason=SKIP_REASON)

SECRET = "the secret word is pelican"


def workspace() -> str:
    where = tempfile.mkdtemp(prefix="relay-claude-work-")
    with open(os.path.join(where, "notes.txt"), "w", encoding="utf-8") as f:
        f.write(SECRET + "\n")
    return where


def readScript(where: str) -> dict:
    """
    The emulator's script: a fresh turn calls C{Read} on the notes (after an
    encrypted reasoning item, as Claude Code turns thinking on); the turn
    with its result answers with it.
    """
    return {"tool_call": {"name": "Read",
                          "arguments": {"file_path": os.path.join(where, "notes.txt")}},
            "text": "The notes say: {output}", "reasoning": True}


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest_twisted.ensureDeferred
async def test_claude_code_reads_a_file_with_a_tool(kind):
    """
    R115: Claude Code's request is a Messages turn on either account type;
    the upstream's function call reaches it as a C{tool_use} it runs
    (C{Read}), the C{tool_result} goes back up as the call's output with
    the same id, and Claude Code prints the answer built from it. Its
    thinking block goes back up as the account's own encrypted reasoning.
    """
    where = workspace()
    relay = await startStack([{"id": "a1", "credential": "sk-a1", "type": kind}],
                             emulatorConfig={"default_script": readScript(where), "accounts": [
                                 {"name": "a1", "credential": "sk-a1"}]})
    try:
        run = await runClaude(relay.url, RELAY_KEY, "What does notes.txt say?", where)
        assert run.code == 0, (run.stdout, run.stderr)
        assert run.result["is_error"] is False and run.result["num_turns"] == 2
        assert SECRET in run.result["result"]
        first, second = relay.emulator.requestsFor("sk-a1")
        assert first.body["model"] == "gpt-5.5"  # claude-sonnet-4-5, mapped
        [call] = [i for i in second.body["input"] if i["type"] == "function_call"]
        [output] = [i for i in second.body["input"] if i["type"] == "function_call_output"]
        assert call["name"] == "Read" and output["call_id"] == call["call_id"]
        assert SECRET in str(output["output"])
        [reasoning] = [i for i in second.body["input"] if i["type"] == "reasoning"]
        assert reasoning["encrypted_content"].startswith("emu1.")  # the emulator's sealing
        assert first.body["reasoning"]["summary"] == "auto"
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_claude_code_never_sees_a_failover():
    """
    R115 with R8/R86: the preferred account answers 503 to every request;
    relay fails over to the other on each turn and Claude Code finishes
    the tool turn without an error or a retry of its own.
    """
    where = workspace()
    relay = await startStack(
        [{"id": "bad", "credential": "sk-bad", "priority": 1},
         {"id": "good", "credential": "sk-good", "priority": 50}],
        emulatorConfig={"default_script": readScript(where)})
    relay.emulator.setFault("sk-bad", {"kind": "status", "code": 500, "body": {
        "error": {"message": "boom", "type": "server_error"}}})
    try:
        run = await runClaude(relay.url, RELAY_KEY, "What does notes.txt say?", where)
        assert run.code == 0, (run.stdout, run.stderr)
        assert run.result["is_error"] is False and SECRET in run.result["result"]
        assert relay.emulator.requestsFor("sk-bad")
        assert len(relay.emulator.requestsFor("sk-good")) == 2
    finally:
        await relay.stop()
