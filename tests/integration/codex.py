"""
Run Codex CLI (protocol.md 8) against a relay from a test, without blocking
the reactor.

Each run gets a fresh C{CODEX_HOME} holding a C{config.toml} whose
C{relay} provider points at the relay; Codex runs as
C{codex exec --skip-git-repo-check --ephemeral
--dangerously-bypass-approvals-and-sandbox --json PROMPT} with stdin closed,
under an overall timeout, and its JSONL stdout is parsed into a
L{CodexResult}.

Use L{codexBinary} to skip when Codex is not installed (CI installs it with
C{npm install -g --prefix "$HOME/.local/codex" @openai/codex@0.171.0}).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

from attrs import define, field
from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue

__all__ = ["FALLBACK_MARKER", "SKIP_REASON", "CodexResult", "codexBinary", "runCodex"]

CODEX_VERSION = "0.171.0"

SKIP_REASON = (
    "Codex CLI not found: install it with "
    f'npm install -g --prefix "$HOME/.local/codex" @openai/codex@{CODEX_VERSION} '
    "(or set CODEX_BINARY)"
)
"""The reason tests give when L{codexBinary} returns L{None}."""

FALLBACK_MARKER = "Falling back from WebSockets"
"""What Codex prints when it gives up on the WebSocket (protocol.md 5)."""


def codexBinary() -> str | None:
    """
    Find the Codex CLI: C{$CODEX_BINARY} when it is set (only it: the
    canary, C{scripts/codex-canary.sh}, must never test the pinned Codex
    in place of the one it names), else C{~/.local/codex/bin/codex}, then
    C{codex} on C{PATH}.

    @return: an executable path, or L{None} when Codex is not installed.
    """
    chosen = os.environ.get("CODEX_BINARY")
    candidates = [chosen] if chosen else [
        os.path.expanduser("~/.local/codex/bin/codex"),
        shutil.which("codex"),
    ]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@define
class CodexResult:
    """
    One C{codex exec --json} run.

    @ivar exitCode: the process exit code (C{124}/C{137} when the timeout
        killed it).
    @ivar stdout: everything printed on stdout (the JSONL).
    @ivar stderr: everything printed on stderr (Codex's own log).
    @ivar events: the parsed JSONL events, in order.
    @ivar invalidLines: stdout lines that were not JSON.
    """

    exitCode: int
    stdout: str
    stderr: str
    events: list = field(factory=list)
    invalidLines: list = field(factory=list)

    @classmethod
    def parse(cls, exitCode: int, stdout: bytes, stderr: bytes) -> CodexResult:
        """
        Build a result from the raw process output.
        """
        out = stdout.decode("utf-8", "replace")
        err = stderr.decode("utf-8", "replace")
        events, invalid = [], []
        for line in out.splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                invalid.append(line)
                continue
            if isinstance(event, dict):
                events.append(event)
            else:
                invalid.append(line)
        return cls(exitCode=exitCode, stdout=out, stderr=err, events=events, invalidLines=invalid)

    def items(self, itemType: str) -> list:
        """
        The completed items of one type (C{agent_message},
        C{command_execution}, C{error}, ...).
        """
        return [
            e["item"]
            for e in self.events
            if e.get("type") == "item.completed"
            and isinstance(e.get("item"), dict)
            and e["item"].get("type") == itemType
        ]

    @property
    def agentMessages(self) -> list:
        """
        The text of every completed C{agent_message} item.
        """
        return [item.get("text", "") for item in self.items("agent_message")]

    @property
    def commandExecutions(self) -> list:
        """
        Every completed C{command_execution} item (C{command},
        C{aggregated_output}, C{exit_code}, C{status}).
        """
        return self.items("command_execution")

    @property
    def errors(self) -> list:
        """
        The messages of top-level C{error} events and C{error} items.
        """
        messages = [e.get("message", "") for e in self.events if e.get("type") == "error"]
        messages += [item.get("message", "") for item in self.items("error")]
        return messages

    @property
    def turnCompleted(self) -> bool:
        """
        Whether the run ended with C{turn.completed}.
        """
        return any(e.get("type") == "turn.completed" for e in self.events)

    @property
    def turnFailed(self) -> list:
        """
        The C{error} of every C{turn.failed} event.
        """
        return [e.get("error") for e in self.events if e.get("type") == "turn.failed"]

    @property
    def fellBack(self) -> bool:
        """
        Whether Codex gave up on the WebSocket and fell back to HTTP
        (a WebSocket test must fail on this: protocol.md 8).
        """
        return FALLBACK_MARKER in self.stdout or FALLBACK_MARKER in self.stderr

    @property
    def usage(self) -> dict | None:
        """
        The C{usage} of the last C{turn.completed}, if any.
        """
        for e in reversed(self.events):
            if e.get("type") == "turn.completed":
                return e.get("usage")
        return None

    def summary(self) -> str:
        """
        A short human-readable account of the run, for test output: the
        event types, commands with their output, agent messages, errors.
        """
        lines = [f"codex exit code {self.exitCode}; events: "
                 + " ".join(e.get("type", "?") for e in self.events)]
        for item in self.commandExecutions:
            lines.append(
                f"  command {item.get('command')!r} exit {item.get('exit_code')}"
                f" output {item.get('aggregated_output')!r}"
            )
        for text in self.agentMessages:
            lines.append(f"  agent message: {text!r}")
        for message in self.errors:
            lines.append(f"  error: {message}")
        for error in self.turnFailed:
            lines.append(f"  turn.failed: {error}")
        if self.usage is not None:
            lines.append(f"  usage: {json.dumps(self.usage, sort_keys=True)}")
        if self.fellBack:
            lines.append("  FELL BACK from WebSockets to HTTP")
        if self.invalidLines:
            lines.append(f"  {len(self.invalidLines)} non-JSON stdout lines")
        return "\n".join(lines)


def configTOML(baseURL: str, websockets: bool, model: str = "gpt-5.5",
               extra: str = "") -> str:
    """
    The C{config.toml} of protocol.md 8 for a C{relay} provider.

    @param baseURL: the relay's C{/v1} URL.
    @param websockets: C{supports_websockets}.
    @param extra: more TOML lines for the provider table.
    """
    return (
        f'model = "{model}"\n'
        'model_provider = "relay"\n'
        "check_for_update_on_startup = false\n"
        "\n[analytics]\nenabled = false\n"
        "\n[features]\nplugins = false\n"
        "\n[model_providers.relay]\n"
        'name = "local relay"\n'
        f"base_url = {json.dumps(baseURL)}\n"
        'env_key = "RELAY_API_KEY"\n'
        'wire_api = "responses"\n'
        f"supports_websockets = {'true' if websockets else 'false'}\n"
        "stream_max_retries = 5\n"
        "request_max_retries = 4\n"
        f"{extra}"
    )


def builtinConfigTOML(baseURL: str, model: str = "gpt-5.5", compactLimit: int | None = None,
                      extra: str = "") -> str:
    """
    The C{config.toml} for Codex's B{built-in} C{openai} provider pointed at
    relay (C{openai_base_url}, protocol.md 8): it sends no C{Authorization}
    unless C{CODEX_API_KEY} is exported (L{runCodex} does), uses the
    WebSocket (HTTP when the upgrade is refused), and compacts remotely
    (protocol.md 2.8) once the context passes C{model_auto_compact_token_limit}.

    @param compactLimit: the token limit, or L{None} for Codex's default.
    """
    limit = "" if compactLimit is None else f"model_auto_compact_token_limit = {compactLimit}\n"
    return (
        f'model = "{model}"\n'
        f"openai_base_url = {json.dumps(baseURL)}\n"
        f"{limit}"
        "check_for_update_on_startup = false\n"
        f"{extra}"
        "\n[analytics]\nenabled = false\n"
        "\n[features]\nplugins = false\n"
    )


def _codexHome() -> str:
    """
    A fresh C{CODEX_HOME} under C{~/.cache/relay-tests/} (outside the temp
    dir, which makes Codex warn), falling back to the temp dir.
    """
    base = os.path.join(os.path.expanduser("~"), ".cache", "relay-tests")
    try:
        os.makedirs(base, exist_ok=True)
        path = os.path.join(base, "codex-" + uuid.uuid4().hex[:12])
        os.makedirs(path)
        return path
    except OSError:
        return tempfile.mkdtemp(prefix="relay-codex-")


async def runCodex(
    baseURL: str,
    apiKey: str,
    prompt: str = "Run echo hi, then say what it printed.",
    websockets: bool = False,
    timeout: float = 60.0,
    extraArgs: tuple = (),
    extraTOML: str = "",
    binary: str | None = None,
    workdir: str | None = None,
    builtin: bool = False,
    compactLimit: int | None = None,
) -> CodexResult:
    """
    Run one C{codex exec --json} turn against a relay.

    @param baseURL: the relay's C{/v1} URL, e.g. C{http://127.0.0.1:PORT/v1}.
    @param apiKey: the relay client key (sent as C{Authorization: Bearer}).
    @param prompt: the user prompt.
    @param websockets: C{supports_websockets} of the provider.
    @param timeout: seconds before Codex is killed (coreutils C{timeout}),
        and (plus a margin) before the returned coroutine gives up.
    @param extraArgs: more C{codex exec} arguments (before the prompt).
    @param extraTOML: more provider keys for C{config.toml}.
    @param binary: the Codex executable; default L{codexBinary}.
    @param workdir: the working directory (C{-C}); default the fresh
        C{CODEX_HOME}.
    @param builtin: use Codex's built-in C{openai} provider
        (L{builtinConfigTOML}; the key goes in C{CODEX_API_KEY}) instead of
        the custom C{relay} provider; C{websockets} and C{extraTOML} do not
        apply then.
    @param compactLimit: with C{builtin}, C{model_auto_compact_token_limit}.
    @return: the parsed L{CodexResult}.
    @raise RuntimeError: Codex is not installed.
    """
    binary = binary or codexBinary()
    if binary is None:
        raise RuntimeError(SKIP_REASON)
    home = _codexHome()
    try:
        with open(os.path.join(home, "config.toml"), "w", encoding="utf-8") as f:  # noqa: ASYNC230
            if builtin:
                f.write(builtinConfigTOML(baseURL, compactLimit=compactLimit))
            else:
                f.write(configTOML(baseURL, websockets, extra=extraTOML))
        cwd = workdir or home
        env = {
            "HOME": os.environ.get("HOME", home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CODEX_HOME": home,
            "RELAY_API_KEY": apiKey,
            **({"CODEX_API_KEY": apiKey} if builtin else {}),
            "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
            "NO_COLOR": "1",
        }
        args = [
            "exec", "--skip-git-repo-check", "--ephemeral",
            "--dangerously-bypass-approvals-and-sandbox", "--json",
            "-C", cwd, *extraArgs, prompt,
        ]
        killer = shutil.which("timeout")
        if killer:
            executable, argv = killer, ["-k", "5", str(int(timeout)), binary, *args]
        else:
            executable, argv = binary, args
        d = getProcessOutputAndValue(
            executable, argv, env=env, path=cwd, reactor=reactor, stdinBytes=b""
        )
        d.addTimeout(timeout + 15, reactor)
        out, err, code = await d
        return CodexResult.parse(code, out, err)
    finally:
        shutil.rmtree(home, ignore_errors=True)
