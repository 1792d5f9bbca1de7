"""
The embedded store's durable owner records (R104) are written behind,
coalesced (issue 24): one transaction in flight at a time, whatever waited
meanwhile in the next one.
"""

from __future__ import annotations

import sqlite3

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from relay.state.durable import SQLiteValues


class _Database:
    """
    A settings store whose transactions run on an in-memory SQLite
    connection when the test says so (L{finish}).
    """

    def __init__(self):
        self.connection = sqlite3.connect(":memory:")
        self.queued = []

    def runInteraction(self, interaction, *args):
        d = Deferred()
        self.queued.append((interaction, args, d))
        return d

    def finish(self):
        interaction, args, d = self.queued.pop(0)
        cursor = self.connection.cursor()
        result = interaction(cursor, *args)
        self.connection.commit()
        d.callback(result)

    def rows(self):
        return sorted(self.connection.execute("SELECT key, value FROM state_values"))


class CoalescedWritesTests(SynchronousTestCase):

    def test_oneTransactionInFlight(self):
        """
        Saves made while a write is in flight wait, and go in one
        transaction together; each Deferred fires once its value is
        committed. On the old code every save queued a transaction.
        """
        db = _Database()
        values = SQLiteValues(db)
        first = values.save("k1", "v1", 100.0)
        later = [values.save("k2", "v2", 100.0), values.save("k3", "v3", 100.0),
                 values.save("k2", "v2b", 100.0)]
        self.assertEqual(len(db.queued), 1)
        self.assertNoResult(first)
        db.finish()
        self.successResultOf(first)
        self.assertEqual(len(db.queued), 1)
        for d in later:
            self.assertNoResult(d)
        db.finish()
        for d in later:
            self.successResultOf(d)
        self.assertEqual(db.queued, [])
        self.assertEqual(db.rows(), [("k1", "v1"), ("k2", "v2b"), ("k3", "v3")])

    def test_loadSeesWhatWaits(self):
        """
        A value waiting to be written is read back from the buffer (and a
        waiting delete hides the committed row).
        """
        db = _Database()
        values = SQLiteValues(db)
        values.save("k1", "v1", 100.0)
        db.finish()
        values.save("k0", "v0", 100.0)
        values.save("k2", "v2", 100.0)
        values.delete("k1")
        self.assertEqual(self.successResultOf(values.load("k2", 50.0)), ("v2", 100.0))
        self.assertIsNone(self.successResultOf(values.load("k2", 150.0)))
        self.assertIsNone(self.successResultOf(values.load("k1", 50.0)))
        db.finish()
        db.finish()
        self.assertEqual(db.rows(), [("k0", "v0"), ("k2", "v2")])

    def test_failedWriteFailsItsCallers(self):
        """
        A transaction that fails fails the calls it carried; the next
        write still happens.
        """
        db = _Database()
        values = SQLiteValues(db)
        first = values.save("k1", "v1", 100.0)
        second = values.save("k2", "v2", 100.0)
        _, _, d = db.queued.pop(0)
        d.errback(RuntimeError("disk full"))
        self.failureResultOf(first, RuntimeError)
        db.finish()
        self.successResultOf(second)
        self.assertEqual(db.rows(), [("k2", "v2")])


class DelayedWritesTests(SynchronousTestCase):
    """
    With a clock, changes wait L{relay.state.durable.WRITE_DELAY} for each
    other (issue 24: a synchronous commit per sequential turn cost its
    fsyncs), and a stop writes what waits.
    """

    def test_oneTransactionPerDelay(self):
        from twisted.internet.task import Clock

        from relay.state.durable import WRITE_DELAY

        clock, db = Clock(), _Database()
        values = SQLiteValues(db, clock=clock)
        saves = [values.save(f"k{i}", "v", 100.0) for i in range(5)]
        self.assertEqual(db.queued, [])
        self.assertEqual(self.successResultOf(values.load("k3", 50.0)), ("v", 100.0))
        clock.advance(WRITE_DELAY)
        self.assertEqual(len(db.queued), 1)
        db.finish()
        for d in saves:
            self.successResultOf(d)
        self.assertEqual(len(db.rows()), 5)

    def test_writesDoNotFollowBackToBack(self):
        """
        At load, what arrives while a write is in flight waits until
        L{WRITE_DELAY} after its oldest change (a transaction and its fsync
        at most about every L{WRITE_DELAY} seconds, not one as soon as the
        last committed); a change that already waited that long behind a
        slow write is written as soon as it commits, and so is what waits
        when a stop asks for it (L{SQLiteValues.flushNow}).
        """
        from twisted.internet.task import Clock

        from relay.state.durable import WRITE_DELAY

        clock, db = Clock(), _Database()
        values = SQLiteValues(db, clock=clock)
        values.save("k1", "v", 100.0)
        clock.advance(WRITE_DELAY)
        self.assertEqual(len(db.queued), 1)
        clock.advance(0.05)
        second = values.save("k2", "v", 100.0)  # while k1's write is in flight
        clock.advance(0.02)
        db.finish()
        self.assertEqual(db.queued, [])  # not back to back
        clock.advance(WRITE_DELAY - 0.02 - 0.01)  # k2 has waited WRITE_DELAY - 0.01
        self.assertEqual(db.queued, [])
        self.assertNoResult(second)
        clock.advance(0.02)
        self.assertEqual(len(db.queued), 1)  # k2 waited WRITE_DELAY
        values.save("k3", "v", 100.0)
        clock.advance(WRITE_DELAY * 4)  # a slow write: k3 waited long enough
        db.finish()
        self.successResultOf(second)
        self.assertEqual(len(db.queued), 1)
        values.save("k4", "v", 100.0)
        flushed = values.flushNow()
        db.finish()
        self.assertEqual(len(db.queued), 1)  # the stop's: at once
        db.finish()
        self.successResultOf(flushed)
        self.assertEqual([k for k, _ in db.rows()], ["k1", "k2", "k3", "k4"])
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_callerSavingOnCommit(self):
        """
        A caller that saves again when its write is committed does not
        hold back what waited: a stop's L{SQLiteValues.flushNow} made
        during the write still writes at once, and the caller's new value
        goes in the write after.
        """
        from twisted.internet.task import Clock

        from relay.state.durable import WRITE_DELAY

        clock, db = Clock(), _Database()
        values = SQLiteValues(db, clock=clock)
        first = values.save("k1", "v", 100.0)
        first.addCallback(lambda _: values.save("k3", "v", 100.0))
        clock.advance(WRITE_DELAY)
        values.save("k2", "v", 100.0)
        flushed = values.flushNow()  # a stop, while k1's write is in flight
        db.finish()
        self.assertEqual(len(db.queued), 1)  # k2, at once
        db.finish()
        self.successResultOf(flushed)
        clock.advance(WRITE_DELAY)
        db.finish()  # k3
        self.assertEqual([k for k, _ in db.rows()], ["k1", "k2", "k3"])
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_stopWritesWhatWaits(self):
        from twisted.internet.task import Clock

        from relay.state.durable import DurableFlushService

        clock, db = Clock(), _Database()
        values = SQLiteValues(db, clock=clock)
        saved = values.save("k1", "v1", 100.0)
        service = DurableFlushService(values)
        service.startService()
        stopped = service.stopService()
        self.assertEqual(len(db.queued), 1)
        db.finish()
        self.successResultOf(saved)
        self.successResultOf(stopped)
        self.assertEqual(db.rows(), [("k1", "v1")])
        self.assertEqual(clock.getDelayedCalls(), [])
        self.successResultOf(values.flushNow())
