"""
C{etc/relay.service} (issue 23, docs/deploying.md): C{systemd-analyze
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

from relay.base.records import GatewaySettings
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
    # The example configuration's secrets come from *_env keys: docs/deploying.md's
    # walk-through puts them in this (optional) file.
    assert s["EnvironmentFile"] == ["-/etc/relay/relay.env"]
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
                "RestrictAddressFamilies", "SystemCallFilter", "CapabilityBoundingSet"):
        assert key in s, key
    assert s["ProtectSystem"] == ["strict"] and s["StateDirectory"] == ["relay"]


_TLS_CHILD = r"""
import ctypes, sys
if sys.argv[1] == "mdwe":
    # PR_SET_MDWE (65) with PR_MDWE_REFUSE_EXEC_GAIN (1): the kernel policy
    # systemd applies for MemoryDenyWriteExecute=yes.
    if ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0:
        sys.exit(77)
from twisted.web.client import BrowserLikePolicyForHTTPS
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.protocols.tls import TLSMemoryBIOFactory
# A dial's TLS start: the OpenSSL context, the hostname verify callback (a
# cffi callback) and the ClientHello written to the transport.
creator = BrowserLikePolicyForHTTPS().creatorForNetloc(b"api.openai.com", 443)
tls = TLSMemoryBIOFactory(creator, True, Factory.forProtocol(Protocol)).buildProtocol(None)
transport = StringTransport()
tls.makeConnection(transport)
assert transport.value()[:1] == b"\x16", transport.value()[:8]
print("tls ok")
"""


def _tlsUnder(policy: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _TLS_CHILD, policy], capture_output=True,
                          text=True, timeout=60)


def test_tls_under_the_units_memory_policy():
    """
    Every memory policy the unit sets leaves relay able to build the TLS
    client connection of its upstream dials (relay/upstream/http.py's
    C{BrowserLikePolicyForHTTPS}): C{MemoryDenyWriteExecute=yes} is applied
    to a child with C{prctl(PR_SET_MDWE)} when the unit sets it (the unit
    had it, and pyOpenSSL's cffi callbacks then raise C{MemoryError}: every
    HTTPS/WSS dial, OAuth refresh and C{rediss://} connection failed while
    C{/readyz} said ready).
    """
    plain = _tlsUnder("plain")
    assert plain.returncode == 0 and "tls ok" in plain.stdout, plain.stderr
    if _settings().get("MemoryDenyWriteExecute", ["no"])[-1] in ("yes", "true", "1", "on"):
        guarded = _tlsUnder("mdwe")
        if guarded.returncode == 77:
            pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
        assert guarded.returncode == 0 and "tls ok" in guarded.stdout, guarded.stderr[-400:]
