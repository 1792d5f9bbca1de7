"""
The offline demo, C{scripts/demo.sh --check}: it starts the emulator and a
relay with the real twistd plugins on free ports, runs one streaming and one
non-streaming request with curl, and stops both.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue

from tests.integration.harness import closedPort

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
SCRIPT = os.path.join(ROOT, "scripts", "demo.sh")

pytestmark = pytest.mark.skipif(
    not (shutil.which("bash") and shutil.which("curl")), reason="demo.sh needs bash and curl"
)


def listening(port: int) -> bool:
    """
    Whether something accepts connections on a loopback port.
    """
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def runDemo(**extraEnv: str):
    """
    Run C{scripts/demo.sh --check} on two free ports.

    @return: C{(output, exit code)}, stdout and stderr together.
    """
    relayPort, emulatorPort = closedPort(), closedPort()
    while emulatorPort == relayPort:
        emulatorPort = closedPort()
    env = dict(os.environ)
    env.update(RELAY_PORT=str(relayPort), EMULATOR_PORT=str(emulatorPort), PYTHON=sys.executable)
    env.update(extraEnv)
    d = getProcessOutputAndValue(
        shutil.which("bash"), [SCRIPT, "--check"], env=env, path=ROOT, reactor=reactor,
        stdinBytes=b"",
    )
    d.addTimeout(60, reactor)
    out, err, code = await d
    return (out + err).decode("utf-8", "replace"), code, relayPort, emulatorPort


@pytest_twisted.ensureDeferred
async def test_demo_check_passes():
    """
    C{demo.sh --check} exits 0 after a streaming request that ended with
    C{response.completed} and a non-streaming one that completed, both
    served through the relay on the overridden ports; it printed the status
    page's address with the demo admin key (issue 15).
    """
    output, code, relayPort, emulatorPort = await runDemo()
    print(output)
    assert code == 0, output
    assert f"relay:    http://127.0.0.1:{relayPort}" in output
    assert f"emulator: http://127.0.0.1:{emulatorPort}" in output
    assert f"status:   http://127.0.0.1:{relayPort}/admin/#key=admin-demo-change-me" in output
    assert "ending with response.completed" in output
    assert "status completed" in output
    assert "demo check passed" in output
    assert not listening(relayPort) and not listening(emulatorPort)


@pytest_twisted.ensureDeferred
async def test_demo_check_fails_loudly():
    """
    When a check fails (here: a client key the relay does not know) the
    script exits non-zero, says so, and still stops both servers.
    """
    output, code, relayPort, emulatorPort = await runDemo(RELAY_KEY="sk-not-a-relay-key")
    assert code != 0, output
    assert "demo check FAILED" in output
    assert "invalid_api_key" in output
    assert not listening(relayPort) and not listening(emulatorPort)


@pytest_twisted.ensureDeferred
async def test_demo_refuses_a_port_in_use():
    """
    With the relay's port already taken (most often a demo still running in
    another shell) C{demo.sh} exits 2 at once, naming the port and the
    variable, and starts nothing: its checks would otherwise have talked to
    the process already there.
    """
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(8)
        port = busy.getsockname()[1]
        output, code, _, emulatorPort = await runDemo(RELAY_PORT=str(port))
    assert code == 2, output
    assert f"port {port} (RELAY_PORT) is in use" in output
    assert "emulator:" not in output and "demo check" not in output
    assert not listening(emulatorPort)
