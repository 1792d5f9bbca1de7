"""
behaviour.md R114 with the real Codex CLI 0.171: Codex's own TUI shows a
client key's own limits in C{/status}.

Codex 0.171 fills C{/status}'s limit rows only from the usage route, and
calls it only when signed in to the Codex backend (openai/codex
C{tui/src/app/rate_limit_refresh.rs}; with an API key the card says
"Limits: data not available yet" though the turns carry the key's
C{x-codex-*} headers). relay signs Codex in with the key itself: a key
starting C{at-} given as C{CODEX_ACCESS_TOKEN} is a personal access token to
Codex (C{login/src/auth/personal_access_token.rs}), which asks relay's
C{/v1/user-auth-credential/whoami} who it is, then
C{/backend-api/wham/accounts/check} for its workspace (an HTTPS base only:
C{app-server/src/request_processors/account_processor/workspace_routing.rs}
C{parse_backend_url}), then reads C{/backend-api/wham/usage} -- all
answered for the key. relay listens with TLS here (an C{ssl:} endpoint, a
self-signed certificate made for the test), and Codex trusts it through
C{CODEX_CA_CERTIFICATE}.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import shlex
import signal
import subprocess
import tempfile
import time
import uuid

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.endpoints import serverFromString
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.internet.utils import getProcessOutputAndValue

from relay.usage.tokens import TokenCounts
from tests.integration.codex import SKIP_REASON, CodexResult, codexBinary
from tests.integration.harness import startStack
from tests.integration.oauthstack import emulatorConfig, oauthAccount
from tests.integration.test_ws_turns import drain, gateway

pytestmark = [
    pytest.mark.skipif(codexBinary() is None, reason=SKIP_REASON),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    # Twisted's TLS server hands pyOpenSSL its own certificate objects
    pytest.mark.filterwarnings("ignore:Passing pyOpenSSL .* is deprecated:DeprecationWarning"),
]

KEY = "at-relay-status"
"""The key: C{at-} makes it a personal access token to Codex."""

BUDGET = 100_000
SPENT = 40_000
"""The key has used 40% of its daily budget: C{/status} says 60% left."""

ACCOUNT_PERCENT = 70
"""The account's own primary window, which Codex must never show."""


def makeCertificates(directory: str) -> tuple[str, str]:
    """
    A self-signed server certificate for C{127.0.0.1} (not a CA, the
    address in its subjectAltName: what rustls, which Codex uses, takes).

    @return: C{(certificate path, key + certificate path)}: what Codex
        trusts, what relay's C{ssl:} endpoint serves.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    certPath, serverPath = os.path.join(directory, "cert.pem"), os.path.join(directory, "server.pem")
    with open(certPath, "wb") as f:
        f.write(pem)
    with open(serverPath, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.TraditionalOpenSSL,
                                  serialization.NoEncryption()))
        f.write(pem)
    return certPath, serverPath


class CodexSetup:
    """
    A relay + emulator stack listening with TLS, and a C{CODEX_HOME} for
    Codex signed in with the relay key (docs/clients.md, "The key's limits
    in /status").
    """

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="relay-codex-status-")
        self.home = os.path.join(self.dir, "codex-home")
        os.makedirs(self.home)
        self.ca, self.server = makeCertificates(self.dir)
        self.stack = None
        self.base = None

    async def start(self, keys) -> None:
        names = ("o1",)
        self.stack = await startStack(
            lambda e: [oauthAccount(e, name, concurrency=0) for name in names],
            gateway=gateway("ctx_pool"),
            emulatorConfig=emulatorConfig(
                names, usage={"primary_used_percent": ACCOUNT_PERCENT,
                              "secondary_used_percent": 40},
                script={"text": "All good."}),
            keys=json.dumps(keys),
        )
        endpoint = serverFromString(reactor,
                                    f"ssl:0:interface=127.0.0.1:privateKey={self.server}")
        port = await endpoint.listen(self.stack.app.site)
        self.stack.extraPorts.append(port)
        self.base = f"https://127.0.0.1:{port.getHost().port}"
        with open(os.path.join(self.home, "config.toml"), "w", encoding="utf-8") as f:
            f.write(
                'model = "gpt-5.5"\n'
                f'openai_base_url = "{self.base}/backend-api/codex"\n'
                f'chatgpt_base_url = "{self.base}/backend-api/"\n'
                "check_for_update_on_startup = false\n"
                "\n[analytics]\nenabled = false\n"
                "\n[features]\nplugins = false\n"
                # the offer of Codex's newer model, as already answered
                '\n[notice.model_migrations]\n"gpt-5.5" = "gpt-6-sol"\n'
            )

    def env(self) -> dict:
        """
        What Codex needs besides its C{config.toml}: the key as its access
        token, relay as its auth API, the test CA.
        """
        return {
            "HOME": os.environ.get("HOME", self.home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CODEX_HOME": self.home,
            "CODEX_ACCESS_TOKEN": KEY,
            "CODEX_AUTHAPI_BASE_URL": self.base + "/",
            "CODEX_CA_CERTIFICATE": self.ca,
            "TZ": "UTC",
            "LANG": "C.UTF-8",
            "RUST_LOG": "warn",
        }

    async def stop(self) -> None:
        killCodexServers(self.home)
        if self.stack is not None:
            await drain(self.stack)
        shutil.rmtree(self.dir, ignore_errors=True)


def killCodexServers(home: str) -> None:
    """
    End the C{codex app-server} processes the TUI left running for
    C{home} (its managed daemon runs from C{<home>/packages/}), by pid.
    """
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].startswith(home.encode()) and b"app-server" in argv:
            try:
                os.kill(int(pid), signal.SIGTERM)
            except OSError:
                pass


async def tmux(*args: str) -> str:
    """
    Run one C{tmux} command off the reactor thread (relay serves Codex on
    this reactor meanwhile).
    """
    done = await deferToThread(subprocess.run, ["tmux", *args], capture_output=True, text=True,
                               timeout=20)
    return done.stdout


async def screenUntil(session: str, wanted, timeout: float = 40.0) -> str:
    """
    Poll the TUI's screen (and scrollback) until C{wanted(screen)}.

    @return: the last screen.
    """
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = await tmux("capture-pane", "-p", "-J", "-t", session, "-S", "-200")
        if wanted(screen):
            return screen
        await deferLater(reactor, 0.5, lambda: None)
    raise AssertionError(f"timed out; the TUI shows:\n{screen}")


async def press(session: str, keys: list, wanted, timeout: float = 40.0) -> str:
    """
    Send C{keys} to the TUI until the screen shows what they do (a key
    sent before the TUI reads its input is lost; sent again after 5 s).

    @return: the screen.
    """
    deadline = time.monotonic() + timeout
    while True:
        await deferLater(reactor, 1, lambda: None)
        await tmux("send-keys", "-t", session, *keys)
        try:
            return await screenUntil(session, wanted, timeout=5)
        except AssertionError:
            if time.monotonic() > deadline:
                raise


def statusCard(screen: str) -> str:
    """
    The last C{/status} card on the screen.
    """
    return screen[screen.rindex("/status"):]


@pytest_twisted.ensureDeferred
async def test_status_shows_the_keys_own_daily_limit():
    """
    The TUI's C{/status} shows the key's daily budget as Codex shows a
    plan's window: "Daily limit", 60% left (40,000 of 100,000 tokens used
    this UTC day, plus what Codex's prewarm used when it was counted
    first), resetting at the next UTC midnight -- not the account's
    70%-used window; the workspace named is the key's.
    """
    setup = CodexSetup()
    session = "relay-status-" + uuid.uuid4().hex[:8]
    try:
        await setup.start([{"name": "status", "key": KEY, "concurrency": 0,
                            "daily_tokens": BUDGET}])
        setup.stack.app.runner.usage.record("status", "o1", "gpt-5.5",
                                            TokenCounts(requests=1, input=SPENT))
        env = setup.env()
        command = ["env", *(f"{k}={v}" for k, v in env.items()), codexBinary(),
                   "--dangerously-bypass-approvals-and-sandbox", "-C", setup.dir]
        await tmux("new-session", "-d", "-s", session, "-x", "150", "-y", "50",
                   shlex.join(command))
        await screenUntil(session, lambda s: "Ask Codex to do anything" in s)
        await press(session, ["/status"], lambda s: "› /status" in s)
        screen = await press(session, ["Enter"],
                             lambda s: "/status" in s and "limit:" in statusCard(s))
        card = statusCard(screen)
        midnight = (datetime.datetime.fromtimestamp(reactor.seconds(), datetime.timezone.utc)
                    .date() + datetime.timedelta(days=1))
        [row] = [line for line in card.splitlines() if "limit:" in line]
        assert "Daily limit:" in row, card
        # Codex's prewarm (its first WebSocket frame) is a turn of the key
        # too; whether its usage was recorded before Codex read the usage
        # route is a race: the card shows the key's window with or without it.
        usedNow = setup.stack.app.runner.usage.used("status", reactor.seconds())[0]
        shown = {f"{100 - used * 100 // BUDGET}% left" for used in (SPENT, usedNow)}
        assert any(left in row for left in shown), (shown, card)
        assert f"(resets 00:00 on {midnight.day} {midnight:%b})" in row, card
        assert "30% left" not in card and "data not available" not in card, card
        assert "relay-key-status" in card, card
    finally:
        await tmux("kill-session", "-t", session)
        await setup.stop()


@pytest_twisted.ensureDeferred
async def test_signed_in_codex_runs_on_the_websocket_over_tls():
    """
    Codex signed in the same way runs its turn on relay's WebSocket over
    TLS (the built-in provider's transport): the upgrade works on an
    C{ssl:} listener, no reconnects, no fallback to HTTP.
    """
    setup = CodexSetup()
    try:
        await setup.start([{"name": "status", "key": KEY, "concurrency": 0}])
        args = ["exec", "--skip-git-repo-check", "--ephemeral",
                "--dangerously-bypass-approvals-and-sandbox", "--json", "-C", setup.dir,
                "say hi"]
        d = getProcessOutputAndValue(shutil.which("timeout"), ["-k", "5", "60", codexBinary(),
                                                               *args],
                                     env=setup.env(), path=setup.dir, reactor=reactor,
                                     stdinBytes=b"")
        d.addTimeout(80, reactor)
        out, err, code = await d
        result = CodexResult.parse(code, out, err)
        assert result.turnCompleted and result.agentMessages == ["All good."], (
            result.summary() + "\n" + result.stderr[-3000:])
        assert not result.fellBack, result.summary()
        assert not any("Reconnecting" in m for m in result.errors), result.summary()
    finally:
        await setup.stop()
