"""
The stream pump writes the events of one upstream read in one write
(issue 16), in order, releasing the slot before the terminal event reaches
the client (architecture.md invariant 4).
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.memory import MemorySlotAdmission
from relay.engine.pump import StreamPump
from relay.engine.runner import TurnRunner
from relay.base.records import Account, ClientKey, Turn
from relay.policy.classify import DefaultClassifier
from relay.scheduling.scheduler import AccountScheduler
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore


def _event(kind: str, data: str) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + data.encode() + b"\n\n"


CREATED = _event("response.created", '{"type":"response.created","response":{"id":"resp_1"}}')
DELTA = _event("response.output_text.delta", '{"type":"response.output_text.delta","delta":"hi"}')
COMPLETED = _event(
    "response.completed",
    '{"type":"response.completed","response":{"id":"resp_1","status":"completed",'
    '"output":[{"type":"message"}],"usage":{"input_tokens":1,"output_tokens":1,"total_tokens":2}}}',
)


class Sink:
    """
    Records what reaches the client, in order, in a shared journal.
    """

    committed = False

    def __init__(self, journal):
        self.journal = journal

    def commit(self, headers):
        self.committed = True

    def writeEvent(self, event):
        self.journal.append(("event", event.raw))

    def writeRaw(self, data):
        self.journal.append(("raw", data))

    def fail(self, error):
        self.journal.append(("fail", error))


class Transport:
    def stopProducing(self):
        pass


class BatchTests(SynchronousTestCase):
    """
    L{StreamPump.dataReceived} with several whole events in one read.
    """

    def _pump(self, journal):
        clock = Clock()
        settings = RuntimeSettings()
        account = Account(id="a", type="apikey", base_url="http://x", credential="k")
        store = MemoryStateStore(clock=clock)
        admission = MemorySlotAdmission(clock=clock)
        scheduler = AccountScheduler(
            accounts=[account], admission=admission, store=store, clock=clock,
            settings=settings,
        )
        runner = TurnRunner(
            clock=clock, scheduler=scheduler, admission=admission, dialer=None,
            classifier=DefaultClassifier(), health=None, settings=settings,
        )
        turn = Turn(entrypoint="http", endpoint="responses", client=ClientKey("c", "k"),
                    model="m", body={}, stream=True)
        pump = StreamPump(runner, turn, Sink(journal), account,
                          lambda: journal.append(("release", None)), None, 0)
        pump.makeConnection(Transport())
        return pump

    def test_oneWriteThenReleaseThenTerminal(self):
        """
        Everything before the terminal event goes out in one write, then
        the slot is released, then the terminal event is written.
        """
        journal = []
        pump = self._pump(journal)
        pump.dataReceived(CREATED + DELTA + DELTA + DELTA + COMPLETED)
        self.assertEqual(
            journal,
            [("raw", CREATED + DELTA * 3), ("release", None), ("raw", COMPLETED)],
        )
        self.assertTrue(pump.finished)
        self.assertEqual(self.successResultOf(pump.done).status, 200)

    def test_batchFlushedAtTheEndOfTheRead(self):
        """
        A read without a terminal event is written at its end, whole.
        """
        journal = []
        pump = self._pump(journal)
        pump.dataReceived(CREATED + DELTA + DELTA)
        self.assertEqual(journal, [("raw", CREATED + DELTA * 2)])
        self.assertFalse(pump.finished)

    def test_textThatLooksTerminal(self):
        """
        A delta whose text names a terminal event passes too; only the real
        terminal event comes after the release.
        """
        journal = []
        pump = self._pump(journal)
        tricky = _event("response.output_text.delta",
                        '{"type":"response.output_text.delta","delta":"response.completed"}')
        pump.dataReceived(CREATED + DELTA + tricky + DELTA + COMPLETED)
        written = [data for kind, data in journal if kind == "raw"]
        self.assertEqual(b"".join(written), CREATED + DELTA + tricky + DELTA + COMPLETED)
        self.assertEqual(journal[-2:], [("release", None), ("raw", COMPLETED)])

    def test_eventsSplitAcrossReads(self):
        """
        An event cut between two reads is written whole, once, in order.
        """
        journal = []
        pump = self._pump(journal)
        first = CREATED + DELTA[:10]
        pump.dataReceived(first)
        self.assertEqual(journal, [])
        pump.dataReceived(DELTA[10:] + DELTA[:5])
        pump.dataReceived(DELTA[5:] + COMPLETED)
        written = b"".join(data for kind, data in journal if kind == "raw")
        self.assertEqual(written, CREATED + DELTA + DELTA + COMPLETED)
        self.assertEqual(journal[-2:], [("release", None), ("raw", COMPLETED)])


class MarksTests(SynchronousTestCase):
    """
    The pass-through's mark search finds what the alternation found.
    """

    def test_sameAsAlternation(self):
        """
        For assorted chunks the first mark is where L{_USAGE_MARK} and
        L{_TERMINAL_MARK} match first.
        """
        from relay.engine.pump import _TERMINAL_MARK, _TERMINAL_MARKS, _USAGE_MARK, _USAGE_MARKS

        chunks = [
            DELTA * 3,
            DELTA + COMPLETED,
            DELTA + b'data: {"usage": {"total_tokens": 1}}\n\n' + b"data: [DONE]\n\n",
            b"data: [DONE]\n\n" + DELTA + b'"usage": {',
            DELTA + b"event: response.failed\ndata: {}\n\n" + b"data: [DONE]\n\n",
            b"response.cancelled response.canceled response.incomplete",
        ]
        for chunk in chunks:
            for marks, pattern in ((_TERMINAL_MARKS, _TERMINAL_MARK), (_USAGE_MARKS, _USAGE_MARK)):
                m = pattern.search(chunk)
                self.assertEqual(marks.first(chunk), -1 if m is None else m.start(), chunk)
