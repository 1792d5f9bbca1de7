"""
The slot gauges' periodic read (L{relay.console.view.OperatorView.
refreshSlots}): every account's load, read through the admission's busy
read when it has one (issue 24: on Redis one argument for the pool).
"""

from __future__ import annotations

from types import SimpleNamespace

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.memory import MemorySlotAdmission
from relay.console.view import OperatorView

ACCOUNTS = [SimpleNamespace(id=f"a{i}") for i in range(1, 4)]


def view(admission):
    return OperatorView(accounts=ACCOUNTS, store=None, admission=admission, health=None,
                        runner=None, clock=Clock())


class RefreshSlotsTests(SynchronousTestCase):

    def test_busyRead(self):
        """
        With a busy read, every account gets its load, the idle ones
        C{(0, 0)}.
        """
        admission = MemorySlotAdmission(clock=Clock())
        lease = self.successResultOf(admission.tryAcquire("account", "a2", 4))
        v = view(admission)
        self.successResultOf(v.refreshSlots())
        self.assertEqual(v.slots, {"a1": (0, 0), "a2": (1, 0), "a3": (0, 0)})
        lease.release()
        self.successResultOf(v.refreshSlots())
        self.assertEqual(v.slots, {"a1": (0, 0), "a2": (0, 0), "a3": (0, 0)})

    def test_loadRead(self):
        """
        An admission without one is read with C{load}, as before.
        """
        calls = []

        class Admission:
            def load(self, kind, ids):
                calls.append((kind, list(ids)))
                return succeed({i: (1, 0) for i in ids})

        v = view(Admission())
        self.successResultOf(v.refreshSlots())
        self.assertEqual(calls, [("account", ["a1", "a2", "a3"])])
        self.assertEqual(v.slots, {"a1": (1, 0), "a2": (1, 0), "a3": (1, 0)})
