"""
Run Claude Code (protocol.md 10) against a relay from a test, without
blocking the reactor.

Each run gets a fresh C{HOME} (no login, no settings of the machine's user)
and runs C{claude -p PROMPT --output-format json} in a given directory with
C{ANTHROPIC_BASE_URL} at the relay, C{ANTHROPIC_AUTH_TOKEN} a relay client
key (sent as C{Authorization: Bearer}), C{ANTHROPIC_MODEL} /
C{ANTHROPIC_SMALL_FAST_MODEL} and C{CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1}
(no telemetry, no update check, no connectivity probe: with it, Claude
Code 2.1.332 sends only C{POST /v1/messages?beta=true}; without it, also
C{HEAD /api/hello}, and it tries Anthropic's own hosts).

Use L{claudeBinary} to skip when Claude Code is not installed (CI installs
it with C{npm install -g --prefix "$HOME/.local/claude"
@anthropic-ai/claude-code@2.1.332}).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from attrs import define
from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue

__all__ = ["CLAUDE_VERSION", "SKIP_REASON", "ClaudeResult", "claudeBinary", "runClaude"]

CLAUDE_VERSION = "2.1.332"

SKIP_REASON = (
    "Claude Code not found: install it with npm install -g --prefix \"$HOME/.local/claude\" "
    f"@anthropic-ai/claude-code@{CLAUDE_VERSION} (or set CLAUDE_BINARY)"
)


def claudeBinary() -> str | None:
    """
    @return: C{$CLAUDE_BINARY}, else C{~/.local/claude/bin/claude}, else
        C{claude} on C{PATH}; L{None} when none is installed.
    """
    chosen = os.environ.get("CLAUDE_BINARY")
    candidates = [chosen] if chosen else [
        os.path.expanduser("~/.local/claude/bin/claude"), shutil.which("claude")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@define
class ClaudeResult:
    """
    @ivar code: the exit status.
    @ivar result: the parsed C{--output-format json} object, or L{None}.
    @ivar stdout: the raw output.
    @ivar stderr: the raw error output.
    """

    code: int
    result: dict | None
    stdout: str
    stderr: str


async def runClaude(baseURL: str, key: str, prompt: str, cwd: str,
                    model: str = "claude-sonnet-4-5", tools: str = "Read",
                    timeout: float = 120.0) -> ClaudeResult:
    """
    Run C{claude -p PROMPT} against the relay at C{baseURL}.

    @param tools: C{--allowedTools} (the tools it may use unasked).
    """
    home = tempfile.mkdtemp(prefix="relay-claude-home-")
    env = {
        "HOME": home, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "ANTHROPIC_BASE_URL": baseURL, "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": "claude-haiku-4-5",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
    }
    args = ["timeout", str(int(timeout)), claudeBinary(), "-p", prompt, "--output-format",
            "json", "--allowedTools", tools]
    try:
        out, err, code = await getProcessOutputAndValue(
            "/usr/bin/env", args, env=env, path=cwd, reactor=reactor)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    text = out.decode("utf-8", "replace")
    try:
        result = json.loads(text.strip().splitlines()[-1]) if text.strip() else None
    except ValueError:
        result = None
    return ClaudeResult(code, result, text, err.decode("utf-8", "replace"))
