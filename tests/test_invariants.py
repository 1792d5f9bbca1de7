"""
architecture.md's invariants that can be checked on the source itself:
injected time (no wall clock or global reactor below relay/ outside the
tap modules), no failover/cooldown/admission policy in the entrypoints and
upstream dialers, and no automatic retries in the HTTP client.
"""

from __future__ import annotations

import ast
import os

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

import relay
from relay.model import Account, UpstreamSettings
from relay.upstream.http import HTTPDialer

ROOT = os.path.dirname(os.path.abspath(relay.__file__))

# The one module allowed to import the global reactor, lazily, for the
# twistd makeService functions (architecture.md: relay/tap.py only).
TAP_MODULES = {"tap.py"}

# Names that only the engine (and the health / scheduler / admission
# modules it drives) may use: failover, cooldown, admission and retry
# decisions (architecture.md invariant 1).
POLICY_NAMES = {
    "max_account_switches",
    "retry_interval_ms",
    "transport_retry_policy",
    "first_output_timeout_seconds",
    "markAccount",
    "applyVerdict",
    "transientTransportFailure",
    "oauth429Decision",
    "WaitPlan",
    "sticky_session_wait_timeout",
    "fallback_wait_timeout",
}


def _modules(*subdirs):
    for sub in subdirs or ("",):
        base = os.path.join(ROOT, sub)
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, ROOT), path


def _tree(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


class InvariantTests(SynchronousTestCase):
    """
    Source-level checks of architecture.md's invariants.
    """

    def test_noWallClockOrGlobalReactor(self):
        """
        Invariant 2: no C{time.time()}, C{time.monotonic()} or
        C{datetime.now()} anywhere below relay/, and the global reactor is
        imported only by relay/tap.py.
        """
        offenders = []
        for rel, path in _modules():
            for node in ast.walk(_tree(path)):
                if isinstance(node, ast.ImportFrom) and node.module == "twisted.internet":
                    if any(a.name == "reactor" for a in node.names) and rel not in TAP_MODULES:
                        offenders.append(f"{rel}:{node.lineno} imports the reactor")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    target = node.func.value
                    if isinstance(target, ast.Name) and (
                        (target.id == "time" and node.func.attr in ("time", "monotonic"))
                        or (target.id == "datetime" and node.func.attr in ("now", "utcnow"))
                    ):
                        offenders.append(f"{rel}:{node.lineno} reads the wall clock")
        self.assertEqual(offenders, [])

    def test_noPolicyInEntrypointsOrDialers(self):
        """
        Invariant 1: relay/entry/ and relay/upstream/ use none of the
        engine's policy names in code (docstrings do not count).
        """
        offenders = []
        for rel, path in _modules("entry", "upstream"):
            for node in ast.walk(_tree(path)):
                name = None
                if isinstance(node, ast.Name):
                    name = node.id
                elif isinstance(node, ast.Attribute):
                    name = node.attr
                if name in POLICY_NAMES:
                    offenders.append(f"{rel}:{node.lineno} uses {name}")
        self.assertEqual(offenders, [])

    def test_httpClientNeverRetries(self):
        """
        Invariant 3: the upstream HTTP connection pools have
        C{retryAutomatically} off, so every retry is the engine's.
        """
        dialer = HTTPDialer(reactor=Clock())
        account = Account(id="a", type="apikey", base_url="http://127.0.0.1:1/v1", credential="k")
        dialer._clientFor(account, UpstreamSettings())
        self.assertTrue(dialer._pools)
        self.assertEqual([p.retryAutomatically for p in dialer._pools], [False] * len(dialer._pools))
