# -*- test-case-name: tests.test_tenancy -*-
"""
Durable TTL'd values for the embedded (memory) state store (behaviour.md
R104, issue 19 item 5): response owner records outlive a restart.

With C{state.backend: memory}, L{relay.state.memory.MemoryStateStore}
keeps every value in the process; the values whose key starts with one of
L{DURABLE_PREFIXES} (the owner records of
L{relay.scheduling.scheduler.responseOwnerKey}) are also written through
to the SQLite C{database} (table C{state_values}, created on first use, in
the file L{relay.settingsdb.SQLiteSettingsStore} manages), and read from
it when the process does not have them (after a restart). Redis keeps its
keys itself.
"""

from __future__ import annotations

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.logger import Logger

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


@define(eq=False)
class SQLiteValues:
    """
    TTL'd values in the settings database.

    @ivar database: the L{relay.settingsdb.SQLiteSettingsStore}.
    """

    database: object
    _ready: bool = field(default=False, init=False)
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

        def read(txn):
            txn.execute("SELECT value, expires FROM state_values WHERE key = ?", (key,))
            row = txn.fetchone()
            return (row[0], row[1]) if row and row[1] > now else None

        return self._run(read)

    def save(self, key: str, value: str, expires: float) -> Deferred:
        """
        Write (or replace) one value.
        """

        def write(txn):
            txn.execute(
                "INSERT OR REPLACE INTO state_values (key, value, expires) VALUES (?, ?, ?)",
                (key, value, expires),
            )

        return self._run(write)

    def delete(self, key: str) -> Deferred:
        """
        Forget one value.
        """
        return self._run(lambda txn: txn.execute("DELETE FROM state_values WHERE key = ?", (key,)))

    def prune(self, now: float) -> Deferred:
        """
        Drop expired values.
        """
        return self._run(
            lambda txn: txn.execute("DELETE FROM state_values WHERE expires <= ?", (now,))
        )
