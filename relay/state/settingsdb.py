# -*- test-case-name: tests.test_settings -*-
"""
Where runtime settings changes are persisted (behaviour.md R74).

Two providers of L{ISettingsStore}:

  - L{SQLiteSettingsStore}: the embedded default, one SQLite file
    (config.md C{database:}), through L{twisted.enterprise.adbapi} with one
    connection (C{cp_max=1}), so writes are serialised;
  - L{RedisSettingsStore}: one JSON object under the Redis key
    C{relay:settings}, for several relay processes sharing settings; each
    process calls L{relay.state.settings.RuntimeSettings.refresh} periodically.

The SQLite file also holds live OAuth access and refresh tokens
(L{relay.oauth.store.SQLiteTokenStore}), so it is created with mode 0600
whatever the umask, and an existing file (and its C{-wal}, C{-shm} and
C{-journal} companions, which SQLite otherwise creates with the main file's
mode) readable by group or others is tightened to 0600 (L{secureDatabaseFile}).

Both store flat dotted names (C{breaker.failures}) with JSON values, and
C{save} merges: keys not given keep their stored values.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Optional

from attrs import define, field
from twisted.enterprise import adbapi
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import Interface, implementer

__all__ = [
    "ISettingsStore", "SQLiteSettingsStore", "RedisSettingsStore", "SCHEMA_VERSION",
    "secureDatabaseFile",
]

#: The schema version L{SQLiteSettingsStore} migrates to.
SCHEMA_VERSION = 2

_MIGRATIONS = {
    1: (
        "CREATE TABLE IF NOT EXISTS settings ("
        " key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    # OAuth token records and refresh locks
    # (L{relay.oauth.store.SQLiteTokenStore}).
    2: (
        "CREATE TABLE IF NOT EXISTS oauth_tokens ("
        " account_id TEXT PRIMARY KEY, version INTEGER NOT NULL, record TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS oauth_locks ("
        " account_id TEXT PRIMARY KEY, owner TEXT NOT NULL, until REAL NOT NULL)",
    ),
}


class ISettingsStore(Interface):
    """
    Persists runtime settings changes (R74). Values are flat dotted names
    (as in L{relay.state.settings.RUNTIME_KEYS}) mapped to JSON-able values; the
    store does not validate them (the reader normalises).
    """

    def load():
        """
        Read every stored setting.

        @return: a L{Deferred} firing with a C{dict} of dotted name -> value
            (empty when nothing was stored).
        """

    def save(values):
        """
        Store some settings, keeping the others as they are (a merge).

        @param values: dotted name -> JSON-able value.
        @return: a L{Deferred} firing with L{None} once durable.
        """


@implementer(ISettingsStore)
@define(eq=False)
class SQLiteSettingsStore:
    """
    Settings in a SQLite file: table C{settings(key TEXT PRIMARY KEY, value
    TEXT NOT NULL)} with JSON values, and C{schema_version(version)}.
    Migrations are idempotent (C{CREATE TABLE IF NOT EXISTS}) and run before
    the first query.

    @ivar path: the database file (C{:memory:} is not useful: every
        connection would get its own database).
    @ivar reactor: the reactor the connection pool runs on; L{None} for the
        global one (only C{makeService} should rely on that).
    @ivar pool: an L{adbapi.ConnectionPool} to use instead of creating one
        (tests pass one running on a synchronous thread pool).
    """

    path: str
    _reactor: Any = None
    _pool: Optional[adbapi.ConnectionPool] = None
    _migrated: bool = field(default=False, init=False)

    def _getPool(self) -> adbapi.ConnectionPool:
        if self._pool is None:
            kwargs = {}
            if self._reactor is not None:
                kwargs["cp_reactor"] = self._reactor
            self._pool = adbapi.ConnectionPool(
                "sqlite3",
                self.path,
                cp_min=1,
                cp_max=1,
                check_same_thread=False,
                cp_noisy=False,
                cp_openfun=openConnection,
                **kwargs,
            )
        return self._pool

    def _migrate(self) -> Deferred:
        """
        Create or upgrade the schema before the first query. Concurrent
        first calls may both run it; it is idempotent, and the single
        connection serialises them.

        @return: a L{Deferred} firing when the schema is current.
        """
        if self._migrated:
            return succeed(None)
        secureDatabaseFile(self.path)

        def _cbMigrated(_):
            self._migrated = True

        return self._getPool().runInteraction(_migrateSchema).addCallback(_cbMigrated)

    def load(self) -> Deferred:
        """
        See L{ISettingsStore.load}. Rows whose value is not JSON are skipped.
        """
        d = self._migrate()
        d.addCallback(lambda _: self._getPool().runQuery("SELECT key, value FROM settings"))

        def _cbRows(rows):
            result = {}
            for key, value in rows:
                try:
                    result[key] = json.loads(value)
                except ValueError:
                    continue
            return result

        return d.addCallback(_cbRows)

    def save(self, values: dict) -> Deferred:
        """
        See L{ISettingsStore.save}: one transaction of upserts.
        """
        values = dict(values)

        def _write(txn):
            # Encoded lazily inside the transaction: a value that cannot be
            # encoded rolls back the rows written before it.
            rows = ((str(k), json.dumps(v)) for k, v in values.items())
            txn.executemany("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", rows)

        d = self._migrate()
        d.addCallback(lambda _: self._getPool().runInteraction(_write))
        return d.addCallback(lambda _: None)

    def runInteraction(self, interaction, *args) -> Deferred:
        """
        Run C{interaction(txn, *args)} in one transaction on this store's
        connection, after the migrations; other tables in the same file
        (e.g. L{relay.usage.store.SQLiteUsageStore}'s) share the single,
        serialised connection.

        @return: a L{Deferred} firing with the interaction's result.
        """
        d = self._migrate()
        d.addCallback(lambda _: self._getPool().runInteraction(interaction, *args))
        return d

    def schemaVersion(self) -> Deferred:
        """
        @return: a L{Deferred} firing with the stored schema version (int).
        """
        d = self._migrate()
        d.addCallback(
            lambda _: self._getPool().runQuery("SELECT MAX(version) FROM schema_version")
        )
        return d.addCallback(lambda rows: rows[0][0])

    def close(self) -> None:
        """
        Close the connection pool (from C{stopService}). Idempotent.
        """
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self._migrated = False
            pool.close()


def openConnection(connection) -> None:
    """
    Set up each connection the store opens (adbapi's C{cp_openfun}): the
    database in write-ahead-log mode, every commit still synchronous.

    In the default rollback-journal mode every commit created,
    synced and deleted a C{-journal} file and synced the database -- about
    0.5 s of system CPU in 8 s at c=32 JSON, taken from the turns on the
    core relay shares with the connection's thread (the durable response
    owners are written every 0.25 s, the request log every second). In WAL
    mode a commit appends to C{-wal} and syncs it once; with
    C{synchronous=FULL} a commit is on disk when it returns, as before
    (the file holds rotated OAuth refresh tokens, which must survive a
    power loss). The mode is kept in the file. Copy a live database with
    C{sqlite3 relay.sqlite ".backup copy.sqlite"}, or the file together
    with its C{-wal}; it must sit on a local file system (WAL's C{-shm} is
    shared memory).

    The first switch of a file needs it to itself: while another
    connection reads it (an operator's C{sqlite3} shell, a C{.backup},
    another relay starting on the same file) the switch fails after the
    busy timeout; this connection then keeps the rollback journal, with a
    warning, and the next one tries again.

    @param connection: a C{sqlite3} connection.
    """
    import sqlite3

    try:
        connection.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError as e:
        _log.warn(
            "the database could not switch to WAL mode now ({error}); this connection keeps"
            " the rollback journal",
            event="relay.database_wal_deferred", error=str(e),
        )
    connection.execute("PRAGMA synchronous=FULL")


#: The files SQLite keeps beside a database, by suffix.
_COMPANIONS = ("-wal", "-shm", "-journal")

_log = Logger()


def secureDatabaseFile(path: str) -> None:
    """
    Make the SQLite file at C{path} private to relay's user before SQLite
    opens it: create it empty with mode 0600 when it does not exist, and
    take the group and other bits off an existing file and its companions
    (C{-wal}, C{-shm}, C{-journal}; SQLite gives the ones it creates later
    the main file's mode). In-memory and URI names are left alone.

    @param path: the configured C{database}.
    @raise OSError: the file cannot be created (SQLite would fail too).
    """
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        os.close(descriptor)
    for name in (path,) + tuple(path + suffix for suffix in _COMPANIONS):
        try:
            mode = stat.S_IMODE(os.stat(name).st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            os.chmod(name, mode & 0o700)
            _log.warn(
                "{file} was readable by other users (mode {old:o}); now {new:o}: it holds"
                " OAuth tokens",
                event="relay.database_mode_tightened", file=name, old=mode, new=mode & 0o700,
            )


def _migrateSchema(txn) -> None:
    """
    Run the missing migrations in one transaction.
    """
    txn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    txn.execute("SELECT MAX(version) FROM schema_version")
    row = txn.fetchone()
    current = (row[0] if row else None) or 0
    for version in sorted(_MIGRATIONS):
        if version <= current:
            continue
        for statement in _MIGRATIONS[version]:
            txn.execute(statement)
        txn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))


#: The Redis key holding the settings JSON.
REDIS_KEY = "relay:settings"


@implementer(ISettingsStore)
@define(eq=False)
class RedisSettingsStore:
    """
    Settings as one JSON object under C{relay:settings}.

    @ivar redis: any object with C{get(key)} and C{set(key, value)} returning
        Deferreds, such as a txredisapi connection or pool.
    @ivar clock: bounds every call with C{timeout}.
    @ivar timeout: seconds per Redis call.
    @ivar key: the Redis key.
    """

    _redis: Any
    _clock: IReactorTime
    timeout: float = 2.0
    key: str = REDIS_KEY

    def load(self) -> Deferred:
        """
        See L{ISettingsStore.load}. A missing key or a value that is not a
        JSON object reads as C{{}}.
        """
        d = self._redis.get(self.key)
        d.addTimeout(self.timeout, self._clock)

        def _cbParse(raw):
            if raw is None:
                return {}
            if isinstance(raw, bytes):
                raw = raw.decode("utf-8")
            try:
                value = json.loads(raw)
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}

        return d.addCallback(_cbParse)

    def save(self, values: dict) -> Deferred:
        """
        See L{ISettingsStore.save}: read, merge, write. (Two processes saving
        at the same instant may lose one of the merges; admin changes are
        rare and the last one wins.)
        """
        d = self.load()

        def _cbMerge(stored):
            stored.update(values)
            w = self._redis.set(self.key, json.dumps(stored, sort_keys=True))
            w.addTimeout(self.timeout, self._clock)
            return w

        d.addCallback(_cbMerge)
        return d.addCallback(lambda _: None)
