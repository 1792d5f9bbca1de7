# -*- test-case-name: tests.test_control_store -*-
"""
L{SQLiteControlStore}: the control store in the embedded SQLite
C{database} (L{relay.interfaces.IControlStore}), on the settings store's
single connection (writes are serialised; a commit is durable before the
write's Deferred fires). The file is private (mode 0600,
L{relay.state.settingsdb.secureDatabaseFile}): it also holds OAuth tokens.

Tables, created on first use (C{CREATE TABLE IF NOT EXISTS}, so no settings
schema version is needed)::

    control_records (kind TEXT, id TEXT, version INTEGER, data TEXT,
                     updated_at REAL, PRIMARY KEY (kind, id))
    control_counters (name TEXT PRIMARY KEY, value INTEGER)
        -- "revision" (the store's version counter) and "seq:<kind>"

One process serves from a database file (several processes need
C{state.backend: redis}), so changes are announced to this process's
listeners only.
"""

from __future__ import annotations

import os
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.control.store import (
    ANY,
    STORE_TIMEOUT_SECONDS,
    ControlChange,
    ControlRecord,
    ControlStoreUnavailable,
    Listeners,
    VersionConflict,
    checkKey,
    decodeData,
    encodeData,
    sequenceId,
)
from relay.interfaces import IControlStore

__all__ = ["SQLiteControlStore"]

_CREATE = (
    "CREATE TABLE IF NOT EXISTS control_records ("
    " kind TEXT NOT NULL, id TEXT NOT NULL, version INTEGER NOT NULL, data TEXT NOT NULL,"
    " updated_at REAL NOT NULL, PRIMARY KEY (kind, id))",
    "CREATE TABLE IF NOT EXISTS control_counters ("
    " name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


def _next(txn, name: str) -> int:
    """
    Increment a counter inside the transaction.

    @return: its new value.
    """
    txn.execute("INSERT OR IGNORE INTO control_counters (name, value) VALUES (?, 0)", (name,))
    txn.execute("UPDATE control_counters SET value = value + 1 WHERE name = ?", (name,))
    txn.execute("SELECT value FROM control_counters WHERE name = ?", (name,))
    return int(txn.fetchone()[0])


def _version(txn, kind: str, id: str):
    txn.execute("SELECT version FROM control_records WHERE kind = ? AND id = ?", (kind, id))
    row = txn.fetchone()
    return int(row[0]) if row else None


@implementer(IControlStore)
@define(eq=False)
class SQLiteControlStore:
    """
    See the module docstring.

    @ivar database: the L{relay.state.settingsdb.SQLiteSettingsStore} whose
        connection (and file) this store shares.
    @ivar _clock: stamps records and bounds every call.
    @ivar timeout: seconds per call.
    """

    database: Any
    _clock: IReactorTime
    timeout: float = STORE_TIMEOUT_SECONDS
    _ready: bool = field(default=False, init=False)
    _listeners: Listeners = field(factory=Listeners, init=False)

    def _run(self, interaction, *args) -> Deferred:
        """
        Run C{interaction(txn, *args)} in one transaction, the tables
        created first; a failure of the database is
        L{ControlStoreUnavailable}, a L{VersionConflict} passes through.
        """

        def _withTables(txn, *a):
            if not self._ready:
                for statement in _CREATE:
                    txn.execute(statement)
            return interaction(txn, *a)

        def _cbReady(result):
            self._ready = True
            return result

        def _ebMap(failure):
            if failure.check(VersionConflict, ValueError):
                return failure
            raise ControlStoreUnavailable(
                f"control store (SQLite): {type(failure.value).__name__}: {failure.value}"
            )

        d = self.database.runInteraction(_withTables, *args)
        d.addTimeout(self.timeout, self._clock)
        return d.addCallbacks(_cbReady, _ebMap)

    def get(self, kind: str, id: str) -> Deferred:
        """
        See L{IControlStore.get}.
        """
        checkKey(kind, id)

        def _get(txn):
            txn.execute(
                "SELECT version, data, updated_at FROM control_records WHERE kind = ? AND id = ?",
                (kind, id),
            )
            row = txn.fetchone()
            if row is None:
                return None
            return ControlRecord(kind=kind, id=id, version=int(row[0]), data=decodeData(row[1]),
                                 updated_at=float(row[2]))

        return self._run(_get)

    def list(self, kind: str) -> Deferred:
        """
        See L{IControlStore.list}.
        """
        checkKey(kind, "-")

        def _list(txn):
            txn.execute(
                "SELECT id, version, data, updated_at FROM control_records WHERE kind = ?"
                " ORDER BY id",
                (kind,),
            )
            return [
                ControlRecord(kind=kind, id=row[0], version=int(row[1]), data=decodeData(row[2]),
                              updated_at=float(row[3]))
                for row in txn.fetchall()
            ]

        return self._run(_list)

    def put(self, kind: str, id: str, data: dict, expected) -> Deferred:
        """
        See L{IControlStore.put}: check and write in one transaction.
        """
        checkKey(kind, id)
        raw = encodeData(data)
        now = self._clock.seconds()

        def _put(txn):
            current = _version(txn, kind, id)
            if expected is not ANY and expected != current:
                raise VersionConflict(kind, id, current)
            version = _next(txn, "revision")
            txn.execute(
                "INSERT OR REPLACE INTO control_records (kind, id, version, data, updated_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (kind, id, version, raw, now),
            )
            return ControlRecord(kind=kind, id=id, version=version, data=decodeData(raw),
                                 updated_at=now)

        return self._run(_put).addCallback(self._announce)

    def delete(self, kind: str, id: str, expected=ANY) -> Deferred:
        """
        See L{IControlStore.delete}.
        """
        checkKey(kind, id)

        def _delete(txn):
            current = _version(txn, kind, id)
            if expected is not ANY and expected != current:
                raise VersionConflict(kind, id, current)
            if current is None:
                return False
            txn.execute("DELETE FROM control_records WHERE kind = ? AND id = ?", (kind, id))
            _next(txn, "revision")
            return True

        def _cbDeleted(deleted):
            if deleted:
                self._listeners.notify(ControlChange(kind, id, None))
            return deleted

        return self._run(_delete).addCallback(_cbDeleted)

    def append(self, kind: str, data: dict, keep: int) -> Deferred:
        """
        See L{IControlStore.append}: the id, the write and the trim in one
        transaction.
        """
        checkKey(kind, "-")
        raw = encodeData(data)
        now = self._clock.seconds()
        keep = max(1, int(keep))

        def _append(txn):
            id = sequenceId(_next(txn, "seq:" + kind))
            version = _next(txn, "revision")
            txn.execute(
                "INSERT INTO control_records (kind, id, version, data, updated_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (kind, id, version, raw, now),
            )
            txn.execute(
                "DELETE FROM control_records WHERE kind = ? AND id NOT IN"
                " (SELECT id FROM control_records WHERE kind = ? ORDER BY id DESC LIMIT ?)",
                (kind, kind, keep),
            )
            return ControlRecord(kind=kind, id=id, version=version, data=decodeData(raw),
                                 updated_at=now)

        return self._run(_append).addCallback(self._announce)

    def _announce(self, record: ControlRecord) -> ControlRecord:
        self._listeners.notify(ControlChange(record.kind, record.id, record.version))
        return record

    def readNow(self, kinds) -> dict:
        """
        Read every record of C{kinds} now, synchronously, with a short-lived
        connection of its own (start-up only: the control plane knows the
        admin accounts and pauses before relay listens; the file is local).
        Not part of L{IControlStore}.

        @return: kind -> list of L{ControlRecord} sorted by id (empty when
            the tables do not exist yet).
        @raise sqlite3.Error: the file cannot be read.
        """
        import sqlite3

        out = {kind: [] for kind in kinds}
        path = self.database.path
        if not path or path == ":memory:" or not os.path.exists(path):
            return out
        connection = sqlite3.connect(path, timeout=self.timeout)
        try:
            for kind in kinds:
                try:
                    rows = connection.execute(
                        "SELECT id, version, data, updated_at FROM control_records"
                        " WHERE kind = ? ORDER BY id", (kind,)).fetchall()
                except sqlite3.OperationalError as e:
                    if "no such table" in str(e):
                        return out
                    raise
                out[kind] = [ControlRecord(kind=kind, id=r[0], version=int(r[1]),
                                           data=decodeData(r[2]), updated_at=float(r[3]))
                             for r in rows]
        finally:
            connection.close()
        return out

    def subscribe(self, listener):
        """
        See L{IControlStore.subscribe}.
        """
        return self._listeners.subscribe(listener)

    def start(self) -> Deferred:
        """
        See L{IControlStore.start}: one process, nothing to open.
        """
        return succeed(None)

    def stop(self) -> Deferred:
        """
        See L{IControlStore.stop}.
        """
        return succeed(None)
