"""
Issue 15: the README's first command works as written on a stock Debian 12
/ Ubuntu 24.04 box.

What it proves: a fresh C{git clone} of this repository, the first C{sh}
block of C{README.md} (read from the clone's README, not copied here) run
by C{bash} in the clone with

  - the stock C{PATH} (C{/usr/local/sbin:...:/bin}), on which there is a
    C{python3} but no C{python} (checked),
  - no virtual environment made beforehand, no C{PYTHONPATH}, no
    C{VIRTUAL_ENV}, a fresh C{HOME},

creates the virtual environment, installs relay and its dependencies into
it with pip, and the demo answers -- the block's C{scripts/demo.sh} is run
as C{scripts/demo.sh --check} (one streaming and one non-streaming request;
the interactive demo would wait for Ctrl-C; C{RELAY_PORT}/C{EMULATOR_PORT}
pick free ports). The README's prerequisite
sentence naming C{python3-venv} (Debian and Ubuntu ship C{venv} apart) is
checked too; this test cannot install system packages, so it needs them
installed (CI's C{.ci/run} installs C{python3}, C{python3-venv}, C{git} and
C{curl}).

pip needs a package index: PyPI in CI; C{PIP_*} and proxy variables are
passed through so it also runs behind a mirror. It tests what is committed
(the clone), and takes about a minute (most of it pip).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue

from tests.integration.harness import closedPort

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

STOCK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""Debian's and Ubuntu's default C{PATH} for a login shell (root's)."""

PASSED = ("PIP_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
          "no_proxy", "LANG", "LC_ALL", "TMPDIR")

DEADLINE = 300
"""Seconds the whole first run may take."""

pytestmark = pytest.mark.skipif(
    not (shutil.which("git") and shutil.which("bash", path=STOCK_PATH)
         and shutil.which("curl", path=STOCK_PATH)
         and os.path.exists(os.path.join(ROOT, ".git"))),
    reason="needs git, bash and curl, and a git checkout to clone",
)


def firstShellBlock(readme: str) -> str:
    """
    The first fenced C{sh} block of a README.

    @raise AssertionError: when there is none.
    """
    found = re.search(r"^```sh\n(.*?)^```", readme, re.DOTALL | re.MULTILINE)
    assert found is not None, "README.md has no ```sh block"
    return found.group(1)


def stockEnvironment(home: str) -> dict:
    """
    A newcomer's environment: the stock C{PATH}, a fresh C{HOME}, and only
    the pip and proxy settings of ours.
    """
    env = {"PATH": STOCK_PATH, "HOME": home, "LANG": "C.UTF-8"}
    for name, value in os.environ.items():
        if name.startswith(PASSED):
            env[name] = value
    return env


@pytest_twisted.ensureDeferred
async def test_readme_first_command_on_a_stock_box():
    """
    Issue 15 "done when": the README's first command block, run as written
    in a fresh clone with C{python3} and no C{python} on the C{PATH} and no
    virtual environment, installs relay into a new venv and the demo's
    check passes.
    """
    python3 = shutil.which("python3", path=STOCK_PATH)
    if python3 is None:
        pytest.skip("no python3 on the stock PATH (apt-get install -y python3 python3-venv)")
    assert shutil.which("python", path=STOCK_PATH) is None, "the stock PATH must lack python"
    work = tempfile.mkdtemp(prefix="relay-first-run-")
    try:
        clone = os.path.join(work, "relay")
        home = os.path.join(work, "home")
        os.mkdir(home)
        out, err, code = await getProcessOutputAndValue(
            shutil.which("git"), ["clone", "--quiet", ROOT, clone], env=dict(os.environ),
            reactor=reactor,
        )
        assert code == 0, err.decode()
        readme = Path(clone, "README.md").read_text(encoding="utf-8")
        assert "python3-venv" in readme.split("```sh", 1)[0]
        block = firstShellBlock(readme)
        assert "python3 -m venv" in block and "scripts/demo.sh" in block, block
        assert not os.path.exists(os.path.join(clone, ".venv"))
        script = block.replace("scripts/demo.sh", "scripts/demo.sh --check")
        relayPort, emulatorPort = closedPort(), closedPort()
        while emulatorPort == relayPort:
            emulatorPort = closedPort()
        # Free ports instead of the demo's 8080/9090, which may be taken here.
        env = dict(stockEnvironment(home), RELAY_PORT=str(relayPort),
                   EMULATOR_PORT=str(emulatorPort))
        d = getProcessOutputAndValue(
            shutil.which("bash", path=STOCK_PATH), ["-euo", "pipefail", "-c", script],
            env=env, path=clone, reactor=reactor, stdinBytes=b"",
        )
        d.addTimeout(DEADLINE, reactor)
        out, err, code = await d
        output = (out + err).decode("utf-8", "replace")
        assert code == 0, output[-6000:]
        assert "demo check passed" in output, output[-6000:]
        assert os.path.exists(os.path.join(clone, ".venv", "bin", "python"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
