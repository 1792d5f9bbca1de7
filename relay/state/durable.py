# -*- test-case-name: tests.test_tenancy,tests.test_durable -*-
"""
Durable TTL'd values for the embedded (memory) state store (behaviour.md
R104): response owner records outlive a restart.

With C{state.backend: memory}, L{relay.state.memory.MemoryStateStore}
keeps every value in the process; the values whose key starts with one of
L{DURABLE_PREFIXES} (the owner records of
L{relay.scheduling.scheduler.responseOwnerKey}) are also written through
to the SQLite C{database} (table C{state_values}, created on first use, in
the file L{relay.state.settingsdb.SQLiteSettingsStore} manages), and read from
it when the process does not have them (after a restart). Redis keeps its
keys itself.

Writes are coalesced: with a clock, a change waits until L{WRITE_DELAY}
seconds after the oldest change not yet written, and at least until the
write in flight is committed; everything that waited is then written in
one transaction (the last value of a key wins). A turn thus never queues a
transaction of its own on the single, serialised connection: one per turn
kept a backlog of queued transactions at load (memory growing with every
turn, half of the throughput in the thread hand-offs) and, sequentially, a
synchronous commit's fsyncs per turn (~0.7 ms of CPU); and at load the
writes do not follow each other back to back either (a transaction, and
its fsync, as soon as the last one committed: ~70 a second at 2,000 turns
a second), but come at most about every L{WRITE_DELAY} seconds. A value
waiting is read back from the buffer; a clean stop writes what waits
(L{DurableFlushService}); a crash loses what waits and the write in flight:
the records of the last L{WRITE_DELAY} seconds (longer while a slow write
holds them back) and that write's (a continuation of those is refused as
unknown, R104's fail closed).
"""

from __future__ import annotations

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

WRITE_DELAY = 0.25
"""Seconds a change waits for others before it is written."""

DURABLE_PREFIXES = ("openai:http-response-owner:",)
"""Keys persisted by L{SQLiteValues}."""

_CREATE = (
    "CREATE TABLE IF NOT EXISTS state_values ("
    " key TEXT PRIMARY KEY, value TEXT NOT NULL, expires REAL NOT NULL)"
)


def isDurable(key: str) -> bool:
    """
    @return: whether C{key} is one the embedded store persists.
    """
    return key.startswith(DURABLE_PREFIXES)


class _OnFailure:
    """
    A waiter of L{SQLiteValues} that is no L{Deferred}: the write's success
    is nobody's business, its failure goes to C{f} (L{SQLiteValues.saveMany}).
    """

    __slots__ = ("_f",)

    def __init__(self, f):
        self._f = f

    def callback(self, result) -> None:
        pass

    def errback(self, failure) -> None:
        self._f(failure)


@define(eq=False)
class SQLiteValues:
    """
    TTL'd values in the settings database.

    @ivar database: the L{relay.state.settingsdb.SQLiteSettingsStore}.
    """

    database: object
    clock: object = None
    """An C{IReactorTime}: changes wait L{WRITE_DELAY} for each other;
    L{None}: a change is written at once when no write is in flight."""
    _ready: bool = field(default=False, init=False)
    _pending: dict = field(factory=dict, init=False)
    """key -> C{(value, expires)}, or L{None} for a delete: what the next
    write carries."""
    _waiters: list = field(factory=list, init=False)
    """The Deferreds of the calls whose changes are in L{_pending}."""
    _writing: bool = field(default=False, init=False)
    _timer: object = field(default=None, init=False)
    _since: object = field(default=None, init=False)
    """When the oldest change in L{_pending} came (the clock's seconds), or
    L{None}."""
    _urgent: bool = field(default=False, init=False)
    """L{flushNow} came while a write was in flight: what waits is written
    as soon as that write is committed."""
    _log = Logger()

    def _run(self, interaction, *args) -> Deferred:
        def withTable(txn, *a):
            if not self._ready:
                txn.execute(_CREATE)
            return interaction(txn, *a)

        d = self.database.runInteraction(withTable, *args)

        def ok(result):
            self._ready = True
            return result

        return d.addCallback(ok)

    def load(self, key: str, now: float) -> Deferred:
        """
        @return: a Deferred firing with C{(value, expires)} or L{None}.
        """
        if key in self._pending:
            change = self._pending[key]
            return succeed(change if change is not None and change[1] > now else None)

        def read(txn):
            txn.execute("SELECT value, expires FROM state_values WHERE key = ?", (key,))
            row = txn.fetchone()
            return (row[0], row[1]) if row and row[1] > now else None

        return self._run(read)

    def save(self, key: str, value: str, expires: float) -> Deferred:
        """
        Write (or replace) one value (coalesced, see the module docstring).

        @param expires: Unix seconds.
        @return: a Deferred firing once the value is committed.
        """
        return self._change(key, (value, expires))

    def delete(self, key: str) -> Deferred:
        """
        Forget one value (coalesced, see the module docstring).

        @return: a Deferred firing once the delete is committed.
        """
        return self._change(key, None)

    def saveMany(self, rows, onFailure=None) -> Deferred | None:
        """
        L{save} of several values in one change (a response's
        owner record and its items' ones).

        @param rows: C{(key, value, expires)} triples, C{expires} in Unix
            seconds.
        @param onFailure: L{None}, or a callable given the L{Failure} when
            their write fails (nothing is called when it succeeds): then no
            Deferred is made (a turn's records need none).
        @return: a Deferred firing once they are all committed, or L{None}
            with C{onFailure}.
        """
        pending = self._pending
        for key, value, expires in rows:
            pending.pop(key, None)
            pending[key] = (value, expires)
        if onFailure is None:
            return self._waitForWrite()
        self._waitForWrite(_OnFailure(onFailure))
        return None

    def _change(self, key: str, change) -> Deferred:
        self._pending.pop(key, None)
        self._pending[key] = change
        return self._waitForWrite()

    def _waitForWrite(self, d=None) -> Deferred:
        """
        A Deferred for the changes now in L{_pending}: the next write's.

        @param d: L{None} (a new Deferred), or what to tell instead
            (C{callback(None)} or C{errback(failure)}, as a Deferred).
        """
        if d is None:
            d = Deferred()
        self._waiters.append(d)
        if self._since is None and self.clock is not None:
            self._since = self.clock.seconds()
        if not self._writing and self._timer is None:
            if self.clock is None:
                self._flush()
            else:
                self._timer = self.clock.callLater(WRITE_DELAY, self._flush)
        return d

    def flushNow(self) -> Deferred:
        """
        Write what waits now (a clean stop).

        @return: a Deferred firing once everything that waited is written
            (errors are the callers' and logged there; this never fails).
        """
        if not self._pending:
            return succeed(None)
        d = Deferred()
        self._waiters.append(d)
        if not self._writing:
            self._flush()
        else:
            self._urgent = True
        return d.addErrback(lambda f: None)

    def _flush(self) -> None:
        """
        Write everything pending in one transaction; when it is committed,
        write what arrived meanwhile: at once without a clock (or after
        L{flushNow}), else once its oldest change has waited L{WRITE_DELAY}.
        """
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        self._since, self._urgent = None, False
        changes, self._pending = self._pending, {}
        waiters, self._waiters = self._waiters, []
        self._writing = True
        saves = [(k, c[0], c[1]) for k, c in changes.items() if c is not None]
        deletes = [(k,) for k, c in changes.items() if c is None]

        def write(txn):
            if deletes:
                txn.executemany("DELETE FROM state_values WHERE key = ?", deletes)
            if saves:
                txn.executemany(
                    "INSERT OR REPLACE INTO state_values (key, value, expires) VALUES (?, ?, ?)",
                    saves,
                )

        def done(result):
            self._writing = False
            if self._pending:
                self._next()  # before the callers hear: what they save waits its turn
            for w in waiters:
                w.callback(None) if result is None else w.errback(result)

        self._run(write).addCallbacks(lambda _: done(None), done)

    def _next(self) -> None:
        """
        A write was committed and changes wait: write them at once (no
        clock, or L{flushNow} asked while the write was in flight, or the
        oldest has waited L{WRITE_DELAY} already), else when it will have.
        """
        clock = self.clock
        if self._urgent or clock is None or self._since is None:
            self._flush()
            return
        if self._timer is not None:
            return
        wait = self._since + WRITE_DELAY - clock.seconds()
        if wait > 0:
            self._timer = clock.callLater(wait, self._flush)
        else:
            self._flush()

    def prune(self, now: float) -> Deferred:
        """
        Drop expired values.
        """
        return self._run(
            lambda txn: txn.execute("DELETE FROM state_values WHERE expires <= ?", (now,))
        )


class DurableFlushService(Service):
    """
    Writes an L{SQLiteValues}' waiting records when relay stops (before the
    settings database closes).
    """

    def __init__(self, values: SQLiteValues):
        self.values = values

    def stopService(self):
        Service.stopService(self)
        return self.values.flushNow()
