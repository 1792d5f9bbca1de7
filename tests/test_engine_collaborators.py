"""
The turn engine's collaborators (L{relay.engine.runner.TurnRunner}) are
interfaces given at construction: relay's application passes a provider of
each, every provider passes C{verifyObject}, and nothing in relay/ sets an
attribute of a runner after it is built.
"""

from __future__ import annotations

import ast
import typing

import attrs
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.interface import InterfaceClass
from zope.interface.verify import verifyObject

from relay.engine.runner import TurnRunner
from tests.test_invariants import _modules, _tree

STATE = {"budget", "inflight", "backgroundOwners", "drains"}
"""The runner's own per-process state: not collaborators."""


def _interfaces(hint) -> tuple:
    """
    The zope interfaces a field's type names (C{IFoo} or C{Optional[IFoo]}).
    """
    if isinstance(hint, InterfaceClass):
        return (hint,)
    return tuple(a for a in typing.get_args(hint) if isinstance(a, InterfaceClass))


def _runnerAssignments() -> list:
    """
    Every statement below relay/ that sets an attribute of a runner:
    C{runner.x = ...}, C{app.runner.x = ...}, C{self._runner.x += ...},
    C{setattr(runner, ...)}.

    @return: C{"path:line"} strings.
    """

    def isRunner(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("runner", "_runner")) or (
            isinstance(node, ast.Attribute) and node.attr in ("runner", "_runner"))

    def targets(node):
        if isinstance(node, ast.Assign):
            found = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = [node.target]
        else:
            return []
        out = []
        while found:
            target = found.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                found.extend(target.elts)
            else:
                out.append(target)
        return out

    offenders = []
    for rel, path in _modules():
        for node in ast.walk(_tree(path)):
            for target in targets(node):
                if isinstance(target, ast.Attribute) and isRunner(target.value):
                    offenders.append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr" and node.args and isRunner(node.args[0])):
                offenders.append(f"{rel}:{node.lineno}")
    return offenders


class CollaboratorTests(SynchronousTestCase):
    """
    TurnRunner's collaborators: interfaces, given at construction.
    """

    def test_everyCollaboratorIsAnInterface(self):
        """
        Every field of L{TurnRunner} but its own state is typed with a
        zope interface.
        """
        hints = typing.get_type_hints(TurnRunner)
        untyped = [f.name for f in attrs.fields(TurnRunner)
                   if f.name not in STATE and not _interfaces(hints[f.name])]
        self.assertEqual(untyped, [])

    def test_theApplicationsProvidersVerify(self):
        """
        The application gives the runner a provider of each collaborator's
        interface (tracing on, so the observer is built too), and each
        passes C{verifyObject}.
        """
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        from relay.process.app import buildApplication
        from relay.configuration.parse import settingsFromString

        config = settingsFromString(
            'listen: "tcp:0:interface=127.0.0.1"\n'
            "keys: [{name: t, key: sk-t}]\naccounts: [{id: a1, type: apikey, api_key: k}]\n")
        app = buildApplication(config, Clock(), spanExporter=InMemorySpanExporter())
        self.addCleanup(app.extras["tracerProvider"].shutdown)
        hints = typing.get_type_hints(TurnRunner)
        checked = []
        for f in attrs.fields(TurnRunner):
            if f.name in STATE:
                continue
            value = getattr(app.runner, f.name)
            self.assertIsNotNone(value, f.name)
            for interface in _interfaces(hints[f.name]):
                self.assertTrue(verifyObject(interface, value), f.name)
                checked.append(f.name)
        self.assertIn("wsAttempt", checked)
        self.assertIn("startupGate", checked)
        self.assertEqual(len(checked), len(attrs.fields(TurnRunner)) - len(STATE))

    def test_noAttributeSetOnARunner(self):
        """
        Nothing below relay/ sets an attribute of a runner after it is
        built (the application passes everything to the constructor).
        """
        self.assertEqual(_runnerAssignments(), [])

    def test_findsAnAssignment(self):
        """
        The check above sees C{app.runner.x = ...}, tuple targets and
        C{setattr}.
        """
        import tests.test_engine_collaborators as me

        source = ("app.runner.metrics = m\nrunner.a, runner.b = 1, 2\n"
                  "setattr(self._runner, 'c', 3)\nother.runner = runner\n")
        self.patch(me, "_modules", lambda *a: [("x.py", "x.py")])
        self.patch(me, "_tree", lambda path: ast.parse(source))
        self.assertEqual(_runnerAssignments(), ["x.py:1", "x.py:2", "x.py:2", "x.py:3"])
