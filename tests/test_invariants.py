"""
architecture.md's invariants that can be checked on the source itself:
injected time (no wall clock or global reactor below relay/ outside the
tap modules), no failover/cooldown/admission policy in the entrypoints and
upstream dialers, no automatic retries in the HTTP client, and no import
circle between relay's modules outside the emulator.
"""

from __future__ import annotations

import ast
import os

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

import relay
from relay.base.records import Account, UpstreamSettings
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

    def test_testCaseNamesExist(self):
        """
        Every module's C{test-case-name} header (what C{trial --testmodule}
        runs for it) names test modules that exist.
        """
        tests = os.path.join(os.path.dirname(ROOT), "tests")
        missing = []
        for rel, path in _modules():
            with open(path, encoding="utf-8") as f:
                first = f.readline()
            if "test-case-name:" not in first:
                continue
            names = first.split("test-case-name:", 1)[1].split("-*-", 1)[0]
            for name in filter(None, (n.strip() for n in names.split(","))):
                parts = name.split(".")
                if parts[0] != "tests" or not os.path.exists(
                        os.path.join(tests, *parts[1:]) + ".py"):
                    missing.append(f"{rel} names {name}")
        self.assertEqual(missing, [])

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


def _moduleName(rel: str) -> str:
    """
    @param rel: a path below relay/, e.g. C{operations/reload.py}.
    @return: the dotted module name, e.g. C{relay.process.reload}.
    """
    name = "relay." + rel[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def importGraph() -> dict:
    """
    Which relay module imports which, counting every import (at the top
    and inside functions: a lazy import still ties the modules).

    @return: module name -> set of relay module names it imports.
    """
    modules = {_moduleName(rel): (rel, path) for rel, path in _modules()}
    graph = {}
    for name, (rel, path) in modules.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(_tree(path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def importCircles(graph: dict) -> list:
    """
    The strongly connected components of more than one module (Tarjan).

    @return: sorted lists of module names.
    """
    index, low, stack, onStack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        onStack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in onStack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                onStack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


class ImportCircleTests(SynchronousTestCase):
    """
    Issue 21: the house's import graph has no circle outside the emulator
    (whose core, HTTP and WebSocket modules are one unit), so a part that
    needs start-up's checks does not import the twistd plugin's module.
    """

    def test_noCircleOutsideTheEmulator(self):
        """
        No set of relay modules (lazy imports included) imports itself
        round, except within relay.emulator. C{app -> operations.reload ->
        tap -> app} was one: the checks both need live in
        L{relay.configuration.check} now.
        """
        circles = [c for c in importCircles(importGraph())
                   if not all(m.startswith("relay.emulator.") for m in c)]
        self.assertEqual(circles, [])

    def test_findsACircle(self):
        """
        The detector itself finds a circle through a lazy import.
        """
        self.assertEqual(
            importCircles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]]
        )
