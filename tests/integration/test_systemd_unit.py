"""
C{etc/relay.service} (issue 23, README "Deploying"): C{systemd-analyze
verify} finds nothing to say about it (it exits 0 even for an unknown key,
so its output must be empty too), it is C{Type=exec}, restarts on failure,
and gives the drain time to finish: C{TimeoutStopSec} above the default
C{gateway.shutdown_grace_seconds} plus the supervisor's margin, and it has
the hardening options. The unit names C{/opt/relay/bin/twistd}; verify
checks that the command exists, so the copy verified here names this
environment's C{twistd}.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from relay.model import GatewaySettings
from relay.tap import SUPERVISOR_GRACE_MARGIN_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT = os.path.join(ROOT, "etc", "relay.service")


def _settings() -> dict:
    out = {}
    with open(UNIT) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", "[")) and "=" in line:
                key, _, value = line.partition("=")
                out.setdefault(key, []).append(value)
    return out


def _twistd() -> str:
    found = shutil.which("twistd") or os.path.join(os.path.dirname(sys.executable), "twistd")
    if not os.path.exists(found):
        pytest.skip("no twistd executable in this environment")
    return found


def test_systemd_analyze_verify():
    """
    C{systemd-analyze verify} on the unit: exit 0 and no message.
    """
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs systemd)")
    directory = tempfile.mkdtemp(prefix="relay-unit-")
    try:
        path = os.path.join(directory, "relay.service")
        with open(UNIT) as f:
            text = f.read()
        assert "/opt/relay/bin/twistd" in text
        with open(path, "w") as f:
            f.write(text.replace("/opt/relay/bin/twistd", _twistd()))
        result = subprocess.run(["systemd-analyze", "verify", path], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_unit_settings():
    """
    The service's lifecycle settings and hardening.
    """
    s = _settings()
    assert s["Type"] == ["exec"]
    assert s["Restart"] == ["on-failure"]
    assert s["KillSignal"] == ["SIGTERM"]
    grace = GatewaySettings().shutdown_grace_seconds + SUPERVISOR_GRACE_MARGIN_SECONDS
    timeout = float(re.match(r"(\d+)", s["TimeoutStopSec"][0]).group(1))
    assert timeout > grace, (timeout, grace)
    assert "--nodaemon" in s["ExecStart"][0] and "--pidfile=" in s["ExecStart"][0]
    assert s["User"] == ["relay"]
    # The example configuration's secrets come from *_env keys: the README's
    # walk-through puts them in this (optional) file.
    assert s["EnvironmentFile"] == ["-/etc/relay/relay.env"]
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
                "RestrictAddressFamilies", "SystemCallFilter", "CapabilityBoundingSet"):
        assert key in s, key
    assert s["ProtectSystem"] == ["strict"] and s["StateDirectory"] == ["relay"]
