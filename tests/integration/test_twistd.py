"""
The real twistd plugin in a subprocess, under both runners
(C{python -m twisted relay ...} and C{twistd -n relay ...}), with
C{PYTHONPATH} at the repository root (style.md 9(f), trap T2): a bad
configuration is one error line and no traceback; a good one serves
C{/healthz}; C{--log-format json} logs JSON lines with no secret in them.

The house rule: a bad configuration file (or a database path that cannot
be written, or a C{listen} port in use) is exactly one line on stderr,
C{relay: config error: ...} naming the key, and exit status 2: no usage
text, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue

from relay.emulator import Emulator
from tests.integration.harness import closedPort

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

RUNNERS = {
    "twist": ["-m", "twisted"],
    "twistd": ["-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile="],
}
"""How to run a plugin: C{python -m twisted PLUGIN} and C{twistd -n PLUGIN}
(global options before the subcommand, trap T29)."""

runners = pytest.mark.parametrize("runner", sorted(RUNNERS))

CLIENT_KEY = "sk-relay-twistd-client-secret-0123456789"
ACCOUNT_KEY = "sk-emu-twistd-account-secret-0123456789"


def environment() -> dict:
    """
    The subprocess environment: ours, with the repository root first on
    C{PYTHONPATH} so the plugin is found with or without an install.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def writeConfig(text: str) -> str:
    """
    Write a configuration into a fresh temporary directory, with the
    settings database in the same directory; remove it with L{removeConfig}.

    @return: the configuration file's path.
    """
    directory = tempfile.mkdtemp(prefix="relay-twistd-")
    path = os.path.join(directory, "relay.yaml")
    database = os.path.join(directory, "settings.sqlite")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + f"database: {json.dumps(database)}\n")
    return path


def writeConfigIn(directory: str, text: str) -> str:
    """
    Write C{text} as C{relay.yaml} in C{directory} (no database line added).

    @return: the configuration file's path.
    """
    path = os.path.join(directory, "relay.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def removeConfig(path: str) -> None:
    """
    Remove a directory made by L{writeConfig}.
    """
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def goodConfig(emulatorPort: int = 9) -> str:
    """
    A valid configuration with one client key and one API-key account
    pointing at C{emulatorPort}.
    """
    return (
        'listen: "tcp:0:interface=127.0.0.1"\n'
        f"keys: [{{name: t, key: {CLIENT_KEY}}}]\n"
        "accounts:\n"
        f"  - {{id: a1, type: apikey, api_key: {ACCOUNT_KEY},"
        f' base_url: "http://127.0.0.1:{emulatorPort}/v1"}}\n'
    )


async def runSeparately(runner: str, *args: str, cwd: str):
    """
    Run C{relay ARGS} with a runner from L{RUNNERS} in C{cwd} to completion.

    @return: C{(stdout, stderr, exit code)}, decoded.
    """
    d = getProcessOutputAndValue(
        sys.executable, [*RUNNERS[runner], "relay", *args],
        env=environment(), path=cwd, reactor=reactor, stdinBytes=b"",
    )
    d.addTimeout(30, reactor)
    out, err, code = await d
    return out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), code


async def runToCompletion(runner: str, *args: str, cwd: str):
    """
    Run C{relay ARGS} with a runner from L{RUNNERS} in C{cwd} to completion.

    @return: C{(output, exit code)} with stdout and stderr together.
    """
    out, err, code = await runSeparately(runner, *args, cwd=cwd)
    return out + err, code


def assertOneErrorLine(out: str, err: str, code: int, expected: str) -> None:
    """
    The run exited with status 2, wrote exactly C{expected} (one line) to
    stderr and no traceback anywhere.
    """
    assert code == 2, (code, out, err)
    assert err.splitlines() == [expected], err
    assert "Traceback" not in out + err


class Collector(ProcessProtocol):
    """
    Collects a long-running child's output; C{ended} fires at exit.
    """

    def __init__(self):
        self.output = b""
        self.ended = Deferred()

    def outReceived(self, data):
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason):
        self.ended.callback(reason.value)

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


async def startRelay(runner: str, config: str, *args: str):
    """
    Start C{relay --config CONFIG ARGS} with a runner from L{RUNNERS} (in
    the config's directory) on a free port and wait until C{GET /healthz}
    answers.

    @return: C{(collector, process transport, base URL)}.
    """
    port = closedPort()
    collector = Collector()
    process = reactor.spawnProcess(
        collector, sys.executable,
        [sys.executable, *RUNNERS[runner], "relay", "--config", config, *args,
         "--listen", f"tcp:{port}:interface=127.0.0.1"],
        env=environment(), path=os.path.dirname(config),
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        if collector.ended.called:
            break
        try:
            response = await treq.get(url + "/healthz", timeout=1, persistent=False)
            await response.content()
            if response.code == 200:
                return collector, process, url
        except Exception:  # noqa: BLE001, S110 - not listening yet
            pass
        await deferLater(reactor, 0.1, lambda: None)
    await stopRelay(collector, process)
    raise AssertionError("relay did not answer /healthz:\n" + collector.text)


async def stopRelay(collector: Collector, process) -> None:
    """
    SIGTERM the relay and wait for it to exit.
    """
    if not collector.ended.called:
        process.signalProcess("TERM")
    reason = await collector.ended.addTimeout(10, reactor)
    assert isinstance(reason, (ProcessDone, ProcessTerminated))


@runners
@pytest_twisted.ensureDeferred
async def test_bad_config_is_one_line(runner):
    """
    An unknown key exits non-zero with exactly one line naming the key
    and no traceback.
    """
    path = writeConfig(goodConfig() + "gateway: {no_such_key: 1}\n")
    try:
        output, code = await runToCompletion(runner, "--config", path, cwd=os.path.dirname(path))
    finally:
        removeConfig(path)
    assert code != 0
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "gateway.no_such_key" in line]
    assert len(errors) == 1, output


@runners
@pytest_twisted.ensureDeferred
async def test_bad_component_is_one_line(runner):
    """
    A C{components:} dotted name that cannot be imported is reported by
    option parsing as one line, not as a traceback from C{makeService}.
    """
    path = writeConfig(goodConfig() + "components: {classifier: nosuchpkg.Classifier}\n")
    try:
        output, code = await runToCompletion(runner, "--config", path, cwd=os.path.dirname(path))
    finally:
        removeConfig(path)
    assert code != 0
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "components.classifier" in line]
    assert len(errors) == 1, output
    assert "nosuchpkg.Classifier" in errors[0]


@runners
@pytest_twisted.ensureDeferred
async def test_missing_config_file(runner):
    """
    A configuration file that does not exist is one line naming it.
    """
    directory = tempfile.mkdtemp(prefix="relay-twistd-")
    path = os.path.join(directory, "no-such-config.yaml")
    try:
        output, code = await runToCompletion(runner, "--config", path, cwd=directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert code != 0
    assert "Traceback" not in output
    assert len([line for line in output.splitlines() if path in line]) == 1, output


@runners
@pytest_twisted.ensureDeferred
async def test_good_config_serves_healthz(runner):
    """
    A good configuration starts, answers C{GET /healthz} with 200 and stops
    on SIGTERM.
    """
    path = writeConfig(goodConfig())
    try:
        collector, process, url = await startRelay(runner, path)
        try:
            response = await treq.get(url + "/healthz", persistent=False)
            assert response.code == 200
            assert json.loads(await response.content()) == {"status": "ok"}
        finally:
            await stopRelay(collector, process)
    finally:
        removeConfig(path)
    assert "Traceback" not in collector.text


@runners
@pytest_twisted.ensureDeferred
async def test_json_logs_have_no_secrets(runner):
    """
    With C{--log-format json} every log line is a JSON object, and neither
    the client key nor the account key appears in the log after a turn
    went through, even when a client put them in a logged URL and Referer.
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    path = writeConfig(goodConfig(emulator.port))
    try:
        collector, process, url = await startRelay(runner, path, "--log-format", "json")
        try:
            response = await treq.post(
                url + "/v1/responses",
                json.dumps({"model": "gpt-5.5", "input": "hi"}).encode(),
                headers={"Authorization": [f"Bearer {CLIENT_KEY}"],
                         "Content-Type": ["application/json"]},
                persistent=False,
            )
            body = json.loads(await response.content())
            assert response.code == 200, body
            assert body["status"] == "completed"
            assert emulator.requestsFor(ACCOUNT_KEY)[-1].headers["authorization"] == (
                f"Bearer {ACCOUNT_KEY}")
            # The access log echoes the path and the Referer: a client that
            # puts a key there must not leak it into the relay's log.
            leak = await treq.get(
                url + f"/healthz?api_key={CLIENT_KEY}",
                headers={"Referer": [f"http://example.invalid/?k={ACCOUNT_KEY}"]},
                persistent=False,
            )
            await leak.content()
            await deferLater(reactor, 0.2, lambda: None)  # let the log lines out
        finally:
            await stopRelay(collector, process)
    finally:
        removeConfig(path)
        await emulator.stop()
    lines = [line for line in collector.text.splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert isinstance(json.loads(line), dict), line
    assert any("/v1/responses" in line for line in lines), collector.text
    assert CLIENT_KEY not in collector.text
    assert ACCOUNT_KEY not in collector.text
    redacted = [line for line in lines if "/healthz?api_key=" in line]
    assert redacted and "***" in redacted[0], collector.text


@runners
@pytest_twisted.ensureDeferred
async def test_bad_config_exact_stderr_line(runner):
    """
    A bad value: stderr is exactly C{relay: config error: KEY: ...}, one
    line, no usage text; stdout is empty; exit status 2.
    """
    path = writeConfig(goodConfig().replace("type: apikey", "type: x"))
    try:
        out, err, code = await runSeparately(
            runner, "--config", path, cwd=os.path.dirname(path))
    finally:
        removeConfig(path)
    assertOneErrorLine(
        out, err, code,
        "relay: config error: accounts[0].type: expected apikey or oauth, got 'x'")
    assert out == ""


@runners
@pytest_twisted.ensureDeferred
async def test_missing_config_file_exact_line(runner):
    """
    A configuration file that does not exist: the one stderr line names it.
    """
    directory = tempfile.mkdtemp(prefix="relay-twistd-")
    path = os.path.join(directory, "no-such-config.yaml")
    try:
        out, err, code = await runSeparately(runner, "--config", path, cwd=directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assertOneErrorLine(
        out, err, code,
        f"relay: config error: {path}: cannot read configuration file: No such file or directory")


@runners
@pytest_twisted.ensureDeferred
async def test_database_directory_missing(runner):
    """
    With the memory backend, a C{database} in a directory that does not
    exist is one line naming C{database}, not a CRITICAL sqlite traceback
    at start-up.
    """
    directory = tempfile.mkdtemp(prefix="relay-twistd-")
    missing = os.path.join(directory, "no-such-dir")
    path = writeConfigIn(
        directory, goodConfig() + f"database: {json.dumps(missing + '/settings.sqlite')}\n")
    try:
        out, err, code = await runSeparately(runner, "--config", path, cwd=directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assertOneErrorLine(
        out, err, code, f"relay: config error: database: directory {missing} does not exist")


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="root may write to any directory",
)
@runners
@pytest_twisted.ensureDeferred
async def test_database_directory_unwritable(runner):
    """
    A C{database} in a directory the relay cannot write is one line naming
    C{database}.
    """
    directory = tempfile.mkdtemp(prefix="relay-twistd-")
    readOnly = os.path.join(directory, "read-only")
    os.mkdir(readOnly, 0o500)
    path = writeConfigIn(
        directory, goodConfig() + f"database: {json.dumps(readOnly + '/settings.sqlite')}\n")
    try:
        out, err, code = await runSeparately(runner, "--config", path, cwd=directory)
    finally:
        os.chmod(readOnly, 0o700)
        shutil.rmtree(directory, ignore_errors=True)
    assertOneErrorLine(
        out, err, code, f"relay: config error: database: directory {readOnly} is not writable")


@runners
@pytest_twisted.ensureDeferred
async def test_port_in_use(runner):
    """
    A C{listen} port that is already in use is one line naming C{listen}
    on stderr and exit status 2, not a CannotListenError traceback.
    """
    path = writeConfig(goodConfig())
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    listen = f"tcp:{holder.getsockname()[1]}:interface=127.0.0.1"
    try:
        out, err, code = await runSeparately(
            runner, "--config", path, "--listen", listen, cwd=os.path.dirname(path))
    finally:
        holder.close()
        removeConfig(path)
    assertOneErrorLine(
        out, err, code,
        f"relay: config error: listen: cannot listen on {listen}: Address already in use")
    assert "cannot listen" not in out, out


@pytest_twisted.ensureDeferred
async def test_port_in_use_leaves_no_pidfile():
    """
    Under C{twistd -n} with its pid file (relay's own default,
    C{relay.pid}), a port in use is still one line, said once (not again
    in the log on stdout), and no stale C{relay.pid} is left behind.
    """
    path = writeConfig(goodConfig())
    directory = os.path.dirname(path)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    listen = f"tcp:{holder.getsockname()[1]}:interface=127.0.0.1"
    argv = [arg for arg in RUNNERS["twistd"] if arg != "--pidfile="]
    try:
        d = getProcessOutputAndValue(
            sys.executable, [*argv, "relay", "--config", path, "--listen", listen],
            env=environment(), path=directory, reactor=reactor, stdinBytes=b"")
        d.addTimeout(30, reactor)
        out, err, code = await d
        leftover = sorted(os.listdir(directory))
    finally:
        holder.close()
        removeConfig(path)
    out, err = out.decode(), err.decode()
    assertOneErrorLine(
        out, err, code,
        f"relay: config error: listen: cannot listen on {listen}: Address already in use")
    assert "cannot listen" not in out, out
    assert "relay.pid" not in leftover, leftover
