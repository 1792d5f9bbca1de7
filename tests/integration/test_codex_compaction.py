"""
Codex CLI 0.171 end to end with its B{built-in} provider pointed at relay
(C{openai_base_url}, protocol.md 8) and a tiny
C{model_auto_compact_token_limit}, so it compacts remotely mid-turn
(protocol.md 2.8): over the WebSocket (ctx_pool on an API-key account,
http_bridge on an OAuth account) and over HTTP (every account refuses the
upgrade, so Codex uses HTTP from the start), the compaction turn completes
and so does the turn after it (issue 20; behaviour.md R89).

Skipped when Codex is not installed (see L{tests.integration.codex}).
"""

import pytest
import pytest_twisted

from tests.integration.codex import SKIP_REASON, codexBinary, runCodex
from tests.integration.harness import RELAY_KEY, startStack
from tests.integration.test_ws_turns import drain

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)

SCRIPT = {
    "tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "text": "All done.",
}
"""A fresh turn asks for C{echo hi}; the context then passes the limit, Codex
compacts, and the turn resumes from the compacted window with text."""

CASES = {
    "ws_ctx_pool_apikey": ([{"id": "a1", "credential": "sk-emu-a1"}], "ctx_pool"),
    "ws_http_bridge_oauth": ([{"id": "o1", "type": "oauth", "credential": "oauth-emu-o1"}],
                             "http_bridge"),
    "http_apikey": ([{"id": "a1", "credential": "sk-emu-a1", "ws_mode": "off"}], "ctx_pool"),
}


def types(body) -> list:
    return [i.get("type") for i in (body or {}).get("input") or [] if isinstance(i, dict)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest_twisted.ensureDeferred
async def test_codex_remote_compaction_through_relay(case):
    accounts, mode = CASES[case]
    credential = accounts[0]["credential"]
    stack = await startStack(accounts, gateway="{websocket: {mode_default: %s}}" % mode,
                             emulatorConfig={"default_script": SCRIPT})
    try:
        result = await runCodex(stack.url + "/v1", RELAY_KEY, prompt="Run echo hi",
                                builtin=True, compactLimit=200, timeout=90)
        print(f"Codex ({case}):\n" + result.summary())
        assert result.exitCode == 0, result.summary() + "\n" + result.stderr[-2000:]
        assert result.turnCompleted and not result.turnFailed, result.summary()
        assert not any("compaction" in m for m in result.errors), result.summary()
        assert not result.fellBack, result.summary()
        assert result.agentMessages and result.agentMessages[-1] == "All done.", result.summary()
        sent = [r for r in stack.emulator.requestsFor(credential) if r.kind in ("request", "frame")]
        compacting = [i for i, r in enumerate(sent) if types(r.body)[-1:] == ["compaction_trigger"]]
        assert compacting, [types(r.body) for r in sent]
        after = sent[compacting[0] + 1:]
        assert any("compaction" in types(r.body) for r in after), [types(r.body) for r in sent]
        for r in sent:
            kinds = types(r.body)
            assert "compaction_trigger" not in kinds[:-1], kinds  # R89: only ever last
        transport = "http" if case.startswith("http") or mode == "http_bridge" else "ws"
        assert {r.transport for r in sent} == {transport}
    finally:
        await drain(stack)
