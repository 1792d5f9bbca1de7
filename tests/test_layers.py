"""
The import graph of C{relay/} (architecture.md "imports only point down"):
every folder of the package has a floor in L{LAYERS}, and every import,
at module level or inside a function, names a module on its own floor or
below; no two modules import each other, directly or in a ring.

Run C{python -m twisted.trial tests.test_layers} to see the floors (the
test of the floors prints them on failure).
"""

from __future__ import annotations

import ast
import pathlib

from twisted.trial.unittest import SynchronousTestCase

ROOT = pathlib.Path(__file__).resolve().parent.parent

LAYERS = (
    ("relay.interfaces", "every seam, as zope interfaces"),
    ("relay.base", "records, model names, request ids, logs, client errors"),
    ("relay.wire", "JSON, SSE, the Redis client, send-now"),
    ("relay.state", "account state, runtime settings: memory and Redis"),
    ("relay.policy", "what an attempt's end is, means and does (R86)"),
    ("relay.admission", "slots, wait plans, FIFO tickets"),
    ("relay.usage", "tokens, the usage ledger, budget holds"),
    ("relay.tracing", "OpenTelemetry spans"),
    ("relay.translate", "chat <-> Responses"),
    ("relay.upstream", "dialers, proxies"),
    ("relay.oauth", "tokens, logins, usage windows"),
    ("relay.tenants", "key policy, prices, rate limits, the request log"),
    ("relay.alerts", "webhook alerts from account, pool, window and spend readings"),
    ("relay.configuration", "the YAML file, start-up checks, components"),
    ("relay.scheduling", "account selection, sticky sessions, owners"),
    ("relay.engine", "the one turn engine"),
    ("relay.frontdoor", "everything before a turn: key, slot, body, policy, budget"),
    ("relay.entry", "HTTP and WebSocket entrypoints"),
    ("relay.console", "what operators read: the page, metrics, reports"),
    ("relay.control", "what operators change live"),
    ("relay.operators", "console operators: roles, sessions, sign-in"),
    ("relay.keypage", "a key holder's own page"),
    ("relay.process", "the application, workers, reload, drain"),
    ("relay.tap", "the twistd plugin's service maker"),
    ("relay.emulator", "the bundled upstream emulator"),
)
"""Floors from the bottom up: a module may import its own floor and any
floor below it, never one above."""


def modules() -> dict:
    """
    @return: dotted module name -> path, for every module of C{relay/}.
    """
    found = {}
    for path in (ROOT / "relay").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def floorOf(module: str) -> int:
    """
    @return: the index in L{LAYERS} of C{module}'s floor.
    @raise KeyError: for a module whose folder has no floor.
    """
    for index, (name, _) in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return index
    raise KeyError(module)


def imports(known: dict) -> dict:
    """
    @return: module -> set of relay modules it imports (anywhere in it).
    """
    graph = {}
    for module, path in known.items():
        targets = set()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [base] + [base + "." + alias.name for alias in node.names]
            for name in names:
                while name and name not in known and "." in name:
                    name = name.rpartition(".")[0]
                if name in known and name != module and name != "relay":
                    targets.add(name)
        graph[module] = targets
    return graph


def rings(graph: dict) -> list:
    """
    @return: every strongly connected set of more than one module.
    """
    index, low, stack, onStack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        onStack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in onStack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            ring = []
            while True:
                other = stack.pop()
                onStack.discard(other)
                ring.append(other)
                if other == node:
                    break
            if len(ring) > 1:
                found.append(sorted(ring))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


class LayerTests(SynchronousTestCase):
    """
    The import graph of C{relay/} runs only downward.
    """

    def setUp(self):
        self.known = modules()
        self.graph = imports(self.known)

    def floors(self) -> str:
        return "\n".join(f"  {i:2d} {name:22s} {what}" for i, (name, what) in enumerate(LAYERS))

    def test_everyFolderHasAFloor(self):
        """
        Every module of C{relay/} is on a floor of L{LAYERS}: a new folder
        must be placed before it lands.
        """
        homeless = []
        for module in sorted(self.known):
            if module == "relay":
                continue
            try:
                floorOf(module)
            except KeyError:
                homeless.append(module)
        self.assertEqual(homeless, [], "modules on no floor; the floors are:\n" + self.floors())

    def test_noUpwardImport(self):
        """
        No module imports a module on a higher floor.
        """
        upward = [
            f"{module} (floor {floorOf(module)}) -> {target} (floor {floorOf(target)})"
            for module, targets in sorted(self.graph.items()) if module != "relay"
            for target in sorted(targets)
            if floorOf(target) > floorOf(module)
        ]
        self.assertEqual(upward, [], "imports that run up:\n" + "\n".join(upward)
                         + "\nthe floors are:\n" + self.floors())

    def test_noRing(self):
        """
        No two modules import each other, directly or through others.
        """
        self.assertEqual(rings(self.graph), [])

    def test_aRingIsFound(self):
        """
        L{rings} finds a ring of three and ignores a chain.
        """
        self.assertEqual(rings({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]])
        self.assertEqual(rings({"a": {"b"}, "b": {"c"}}), [])

    def test_anUpwardImportIsFound(self):
        """
        An import from a lower floor to a higher one is reported: the check
        can fail.
        """
        graph = dict(self.graph)
        graph["relay.base.records"] = set(graph["relay.base.records"]) | {"relay.engine.runner"}
        upward = [(m, t) for m, ts in graph.items() if m != "relay"
                  for t in ts if floorOf(t) > floorOf(m)]
        self.assertIn(("relay.base.records", "relay.engine.runner"), upward)


class PackageDataTests(SynchronousTestCase):
    """
    Every file of C{relay/} that is not Python is named by C{setup.cfg}'s
    C{package_data}, so an installed relay (a container, C{pip install .})
    has it after any move.
    """

    def test_everyDataFileIsInstalled(self):
        import configparser
        import fnmatch

        config = configparser.ConfigParser()
        config.read(ROOT / "setup.cfg")
        value = config["options.package_data"]["relay"]
        # As setuptools reads it: a value of several lines is one pattern a
        # line (commas are then part of a pattern and match nothing), a
        # value of one line is split at its commas.
        patterns = [p.strip() for p in (value.splitlines() if "\n" in value
                                        else value.split(","))]
        patterns = [p for p in patterns if p]
        for pattern in patterns:
            self.assertNotRegex(pattern, r"[,\s]", "one glob per pattern")
        missing = []
        for path in sorted((ROOT / "relay").rglob("*")):
            if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            name = path.relative_to(ROOT / "relay").as_posix()
            if not any(fnmatch.fnmatch(name, p) and name.count("/") == p.count("/")
                       for p in patterns):
                missing.append(name)
        self.assertEqual(missing, [])
