"""
Codex CLI 0.171 over the Responses WebSocket (protocol.md 8,
C{supports_websockets = true}) through a real relay to the emulator: a tool
call and its chained answer, a refused account, and a briefly full slot.
Each run must finish without Codex falling back to HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol

from tests.integration.codex import SKIP_REASON, codexBinary
from tests.integration.harness import RELAY_KEY, closedPort, startStack
from tests.integration.test_ws_turns import drain

CODEX = codexBinary() or os.path.expanduser("~/.local/codex/bin/codex")
FALLBACK = "Falling back from WebSockets"
SCRIPT = {
    "tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
    "text": "Tool said: {result}",
}

pytestmark = pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON)


def _codexHome(port: int) -> str:
    """
    A fresh CODEX_HOME outside the system temporary directory (protocol.md 8
    housekeeping) with the relay provider of protocol.md 8.
    """
    home = os.path.expanduser(f"~/.cache/relay-tests/codex-{uuid.uuid4().hex[:12]}")
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "config.toml"), "w") as f:
        f.write(
            'model = "gpt-5.5"\n'
            'model_provider = "relay"\n'
            "check_for_update_on_startup = false\n\n"
            "[analytics]\nenabled = false\n\n"
            "[features]\nplugins = false\n\n"
            "[model_providers.relay]\n"
            'name = "local relay"\n'
            f'base_url = "http://127.0.0.1:{port}/v1"\n'
            'env_key = "RELAY_API_KEY"\n'
            'wire_api = "responses"\n'
            "supports_websockets = true\n"
        )
    return home


class _Collect(ProcessProtocol):
    """
    Collect a child's output; stdin is closed at once (protocol.md 8:
    C{codex exec} otherwise waits for EOF).
    """

    def __init__(self):
        self.out, self.err = [], []
        self.done = Deferred()

    def connectionMade(self):
        self.transport.closeStdin()

    def outReceived(self, data):
        self.out.append(data)

    def errReceived(self, data):
        self.err.append(data)

    def processEnded(self, reason):
        code = getattr(reason.value, "exitCode", None)
        self.done.callback((b"".join(self.out), b"".join(self.err), code if code is not None else -1))


async def runCodex(stack, prompt="run echo hi", timeout=45):
    """
    Run C{codex exec --json} against the relay with stdin closed, without
    blocking the reactor, under C{timeout} seconds.

    @return: (exit code, stdout text, stderr text, parsed JSONL events).
    """
    home = _codexHome(stack.port.getHost().port)
    workdir = os.path.join(home, "work")
    os.makedirs(workdir, exist_ok=True)
    env = {
        "HOME": os.environ.get("HOME", "/root"),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CODEX_HOME": home,
        "RELAY_API_KEY": RELAY_KEY,
        "NO_COLOR": "1",
    }
    args = [
        str(timeout), CODEX, "exec", "--skip-git-repo-check", "--ephemeral",
        "--dangerously-bypass-approvals-and-sandbox", "--json", "-C", workdir, prompt,
    ]
    proto = _Collect()
    binary = shutil.which("timeout") or "/usr/bin/timeout"
    try:
        reactor.spawnProcess(proto, binary, [binary] + args, env=env, path=workdir)
        out, err, code = await proto.done
    finally:
        shutil.rmtree(home, ignore_errors=True)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    events = []
    for line in stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return code, stdout, stderr, events


def assertToolTurn(code, stdout, stderr, events):
    items = [e.get("item", {}) for e in events if e.get("type") == "item.completed"]
    assert code == 0, (stdout, stderr[-3000:])
    assert any(i.get("type") == "command_execution" for i in items), stdout
    messages = [i.get("text", "") for i in items if i.get("type") == "agent_message"]
    assert messages and "Tool said" in messages[-1], stdout
    assert any(e.get("type") == "turn.completed" for e in events), stdout
    assert FALLBACK not in stdout and FALLBACK not in stderr
    assert "Reconnecting" not in stdout


def wsFrames(stack):
    return [r for r in stack.emulator.requests if r.kind == "frame"]


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_codex_tool_call_over_websocket(mode):
    """
    protocol.md 8, R49-R53: Codex's prewarm, tool-call turn and chained
    function_call_output turn run over relay's WebSocket in each mode.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-a1"}],
        gateway="{websocket: {mode_default: " + mode + "}}",
        emulatorConfig={"default_script": SCRIPT},
    )
    try:
        assertToolTurn(*(await runCodex(stack)))
        if mode != "http_bridge":
            chained = [r.body for r in wsFrames(stack) if r.body.get("previous_response_id")]
            assert chained, "Codex chained its turns on the WebSocket"
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_codex_with_a_refusing_account():
    """
    R55, R6: one of two accounts refuses connections; Codex's turn completes
    on the other one over the WebSocket, with no reconnect or fallback.
    """
    stack = await startStack(
        [
            {"id": "a", "credential": "sk-a", "priority": 1,
             "base_url": f"http://127.0.0.1:{closedPort()}/v1"},
            {"id": "b", "credential": "sk-b", "priority": 50},
        ],
        emulatorConfig={"default_script": SCRIPT},
    )
    try:
        assertToolTurn(*(await runCodex(stack)))
        states = await stack.app.store.getAccountStates(["a"])
        assert states["a"].blockedUntil > 0
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_codex_waits_for_a_briefly_full_slot():
    """
    R60: with the only slot held for a moment, Codex's turn waits and then
    completes on the same WebSocket: one handshake, no reconnect.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-a1", "concurrency": 1}],
        emulatorConfig={"default_script": SCRIPT},
    )
    lease = await stack.app.admission.tryAcquire("account", "a1", 1)
    reactor.callLater(1.5, lease.release)
    opened = []
    factory = stack.app.site.wsFactory
    original = factory.buildProtocol

    def counting(addr):
        opened.append(addr)
        return original(addr)

    factory.buildProtocol = counting
    try:
        assertToolTurn(*(await runCodex(stack)))
        assert len(opened) == 1
    finally:
        await drain(stack)
