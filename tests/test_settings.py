"""
Tests for L{relay.state.settings} (behaviour.md R74, R75 "Normalisation") and the
settings stores of L{relay.state.settingsdb}.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat

from twisted.enterprise import adbapi
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import capturedLogs, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.base.records import GatewaySettings
from relay.state.settings import (
    RUNTIME_KEYS,
    RuntimeSettings,
    SettingsError,
    flatten,
    nest,
    normalise,
    normaliseLenient,
)
from relay.state.settingsdb import (
    REDIS_KEY,
    SCHEMA_VERSION,
    ISettingsStore,
    RedisSettingsStore,
    SQLiteSettingsStore,
)


@implementer(ISettingsStore)
class MemorySettingsStore:
    """
    A fake L{ISettingsStore}: a dict, with optional failures and a hold.

    @ivar values: what is stored.
    @ivar failSave: when true, L{save} fails.
    @ivar holdSaves: when true, L{save} returns an unfired Deferred kept in
        C{held}.
    """

    def __init__(self, values=None):
        self.values = dict(values or {})
        self.failSave = False
        self.failLoad = False
        self.holdSaves = False
        self.held = []
        self.saves = []

    def load(self):
        if self.failLoad:
            return fail(RuntimeError("store down"))
        return succeed(dict(self.values))

    def save(self, values):
        self.saves.append(dict(values))
        if self.failSave:
            return fail(RuntimeError("store down"))
        self.values.update(values)
        if self.holdSaves:
            d = Deferred()
            self.held.append(d)
            return d
        return succeed(None)


class NormaliseTests(SynchronousTestCase):
    """
    L{normalise} clamps values into range instead of refusing them, and
    refuses unknown keys and wrong types.
    """

    def test_table(self):
        """
        R75: -1 -> 0, 40000 -> 30000, "bogus" -> rotate; and the other
        clamps of the runtime settings.
        """
        cases = [
            ({"retry_interval_ms": -1}, "retry_interval_ms", 0),
            ({"retry_interval_ms": 40000}, "retry_interval_ms", 30000),
            ({"retry_interval_ms": 250}, "retry_interval_ms", 250),
            ({"retry_interval_ms": "1500"}, "retry_interval_ms", 1500),
            ({"retry_interval_ms": 12.6}, "retry_interval_ms", 13),
            ({"transport_retry_policy": "bogus"}, "transport_retry_policy", "rotate"),
            ({"transport_retry_policy": "STICKY"}, "transport_retry_policy", "sticky"),
            ({"transport_retry_policy": "rotate"}, "transport_retry_policy", "rotate"),
            ({"first_output_timeout_seconds": 0}, "first_output_timeout_seconds", 0),
            ({"first_output_timeout_seconds": -5}, "first_output_timeout_seconds", 0),
            ({"first_output_timeout_seconds": 10}, "first_output_timeout_seconds", 30),
            ({"first_output_timeout_seconds": 90}, "first_output_timeout_seconds", 90),
            ({"first_output_timeout_seconds": 9000}, "first_output_timeout_seconds", 600),
            ({"max_account_switches": -3}, "max_account_switches", 0),
            ({"retry_budget_percent": 150}, "retry_budget_percent", 100),
            ({"transport_error_cooldown_seconds": -1}, "transport_error_cooldown_seconds", 0),
            ({"scheduling": {"sticky_session_max_waiting": -1}},
             "scheduling.sticky_session_max_waiting", 0),
            ({"scheduling.fallback_wait_timeout": -2}, "scheduling.fallback_wait_timeout", 0),
            ({"scheduling.user_max_waiting": 0}, "scheduling.user_max_waiting", 1),
            ({"scheduling.ping_interval": 1}, "scheduling.ping_interval", 5),
            ({"scheduling.ping_interval": 99}, "scheduling.ping_interval", 30),
            ({"breaker": {"failures": 0}}, "breaker.failures", 1),
            ({"breaker.enabled": "false"}, "breaker.enabled", False),
            ({"breaker.enabled": True}, "breaker.enabled", True),
        ]
        for given, key, expected in cases:
            result = normalise(given)
            self.assertEqual(result, {key: expected}, given)
            self.assertEqual(isinstance(result[key], bool), isinstance(expected, bool), given)

    def test_nestedAndFlatAgree(self):
        """
        Nested and flat dotted spellings give the same flat result.
        """
        self.assertEqual(
            normalise({"breaker": {"failures": 5, "enabled": False}}),
            normalise({"breaker.failures": 5, "breaker.enabled": False}),
        )
        self.assertEqual(
            normalise({"breaker": {"failures": 5}}), {"breaker.failures": 5}
        )

    def test_unknownKeys(self):
        """
        Unknown keys are refused, all of them named, with the valid ones
        not applied.
        """
        e = self.assertRaises(
            SettingsError,
            normalise,
            {"retry_interval_ms": 5, "nope": 1, "breaker": {"colour": "red"}},
        )
        self.assertEqual(e.unknownKeys, ["breaker.colour", "nope"])
        self.assertIn("nope", str(e))
        self.assertIn("breaker.colour", str(e))

    def test_wrongTypes(self):
        """
        A string that is not a number, a boolean for a number, or a number
        for the policy is refused and named.
        """
        for bad in (
            {"retry_interval_ms": "soon"},
            {"max_account_switches": True},
            {"transport_retry_policy": 5},
            {"breaker.enabled": "perhaps"},
            {"retry_interval_ms": None},
            {"retry_interval_ms": float("nan")},
        ):
            e = self.assertRaises(SettingsError, normalise, bad)
            self.assertEqual(e.keys, list(flatten(bad)))

    def test_notAnObject(self):
        """
        A JSON value that is not an object is refused.
        """
        self.assertRaises(SettingsError, normalise, [1, 2])

    def test_lenient(self):
        """
        L{normaliseLenient} (for stored values) drops what it cannot use
        and keeps the rest, normalised.
        """
        values, dropped = normaliseLenient(
            {"retry_interval_ms": 40000, "old_setting": 1, "breaker.failures": "x"}
        )
        self.assertEqual(values, {"retry_interval_ms": 30000})
        self.assertEqual(dropped, ["breaker.failures", "old_setting"])

    def test_nestFlattenRoundTrip(self):
        """
        L{nest} inverts L{flatten}.
        """
        flat = {k: 1 for k in RUNTIME_KEYS}
        self.assertEqual(flatten(nest(flat)), flat)


class RuntimeSettingsTests(SynchronousTestCase):
    """
    L{RuntimeSettings} applies changes at once and persists them after.
    """

    def test_snapshotNested(self):
        """
        L{RuntimeSettings.snapshot} is nested like C{gateway:} and holds
        every runtime setting.
        """
        snap = RuntimeSettings().snapshot()
        self.assertEqual(snap["retry_interval_ms"], 0)
        self.assertEqual(snap["breaker"]["failures"], 3)
        self.assertEqual(snap["scheduling"]["sticky_session_wait_timeout"], 120)
        self.assertEqual(sorted(flatten(snap)), sorted(RUNTIME_KEYS))

    def test_liveChange(self):
        """
        R74: a change is visible through L{RuntimeSettings.current} as soon
        as L{RuntimeSettings.update} returns, and other keys keep their
        values (partial update).
        """
        settings = RuntimeSettings(
            current=GatewaySettings(max_account_switches=4, retry_interval_ms=100)
        )
        before = settings.current
        d = settings.update({"retry_interval_ms": 40000, "breaker": {"failures": 7}})
        self.assertEqual(settings.current.retry_interval_ms, 30000)
        self.assertEqual(settings.current.breaker.failures, 7)
        self.assertEqual(settings.current.max_account_switches, 4)
        self.assertEqual(settings.current.breaker.window_seconds, 60)
        self.assertIsNot(settings.current, before)
        self.assertEqual(before.retry_interval_ms, 100)
        self.assertEqual(
            self.successResultOf(d), {"retry_interval_ms": 30000, "breaker.failures": 7}
        )

    def test_unchangedNotReported(self):
        """
        Keys set to their current value are not in the changed result.
        """
        settings = RuntimeSettings()
        d = settings.update({"retry_interval_ms": 0, "transport_retry_policy": "sticky"})
        self.assertEqual(self.successResultOf(d), {"transport_retry_policy": "sticky"})

    def test_refusedChangeAppliesNothing(self):
        """
        An update with an unknown key raises L{SettingsError} and leaves
        every setting as it was.
        """
        settings = RuntimeSettings()
        before = settings.current
        self.assertRaises(
            SettingsError, settings.update, {"retry_interval_ms": 5, "bogus_key": 1}
        )
        self.assertIs(settings.current, before)

    def test_logsSettingsUpdated(self):
        """
        R74: a change logs C{relay.settings_updated} with the changed keys
        and their new values.
        """
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        settings = RuntimeSettings()
        settings.update({"retry_interval_ms": 2000})
        ours = [e for e in events if e.get("event") == "relay.settings_updated"]
        self.assertEqual(len(ours), 1)
        self.assertEqual(ours[0]["changed_keys"], ["retry_interval_ms"])
        self.assertEqual(ours[0]["values"], {"retry_interval_ms": 2000})

    def test_maxOpenAtLeastOpen(self):
        """
        C{breaker.max_open_seconds} is raised to C{breaker.open_seconds}
        when set below it.
        """
        settings = RuntimeSettings()
        settings.update({"breaker": {"open_seconds": 900}})
        self.assertEqual(settings.current.breaker.max_open_seconds, 900)

    def test_persistsAfterApplying(self):
        """
        R74: memory first, then the store; the Deferred fires only once the
        store has saved the normalised values.
        """
        store = MemorySettingsStore()
        store.holdSaves = True
        settings = RuntimeSettings(store=store)
        d = settings.update({"retry_interval_ms": -1, "transport_retry_policy": "sticky"})
        self.assertEqual(settings.current.transport_retry_policy, "sticky")
        self.assertNoResult(d)
        self.assertEqual(store.saves, [{"retry_interval_ms": 0, "transport_retry_policy": "sticky"}])
        store.held[0].callback(None)
        self.assertEqual(self.successResultOf(d), {"transport_retry_policy": "sticky"})

    def test_persistFailureKeepsMemoryChange(self):
        """
        When saving fails the Deferred fails, and the in-memory change stays
        in force.
        """
        store = MemorySettingsStore()
        store.failSave = True
        settings = RuntimeSettings(store=store)
        d = settings.update({"retry_interval_ms": 10})
        self.failureResultOf(d, RuntimeError)
        self.assertEqual(settings.current.retry_interval_ms, 10)

    def test_startLoadsNormalised(self):
        """
        R74: at start-up the stored values are loaded over the file's
        values and normalised; unusable stored keys are dropped.
        """
        store = MemorySettingsStore(
            {"retry_interval_ms": 99999, "transport_retry_policy": "bogus",
             "breaker.failures": 9, "retired_setting": 1}
        )
        settings = RuntimeSettings(
            current=GatewaySettings(transport_retry_policy="sticky", max_account_switches=3),
            store=store,
        )
        changed = self.successResultOf(settings.start())
        self.assertEqual(settings.current.retry_interval_ms, 30000)
        self.assertEqual(settings.current.transport_retry_policy, "rotate")
        self.assertEqual(settings.current.breaker.failures, 9)
        self.assertEqual(settings.current.max_account_switches, 3)
        self.assertEqual(
            changed,
            {"retry_interval_ms": 30000, "transport_retry_policy": "rotate",
             "breaker.failures": 9},
        )

    def test_startWithoutStore(self):
        """
        Without a store, L{RuntimeSettings.start} changes nothing.
        """
        settings = RuntimeSettings()
        self.assertEqual(self.successResultOf(settings.start()), {})

    def test_refreshAppliesOtherProcessChanges(self):
        """
        L{RuntimeSettings.refresh} applies values another process stored.
        """
        store = MemorySettingsStore()
        settings = RuntimeSettings(store=store)
        store.values["retry_interval_ms"] = 700
        self.assertEqual(self.successResultOf(settings.refresh()), {"retry_interval_ms": 700})
        self.assertEqual(settings.current.retry_interval_ms, 700)
        self.assertEqual(self.successResultOf(settings.refresh()), {})

    def test_refreshSwallowsErrors(self):
        """
        A failing store does not break the periodic refresh: it logs and
        fires with C{{}}.
        """
        store = MemorySettingsStore()
        store.failLoad = True
        settings = RuntimeSettings(store=store)
        self.assertEqual(self.successResultOf(settings.refresh()), {})
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_fakeStoreProvidesInterface(self):
        """
        The fake store used here provides L{ISettingsStore}.
        """
        self.assertTrue(verifyObject(ISettingsStore, MemorySettingsStore()))


class FakeRedis:
    """
    A fake txredisapi connection: C{get}/C{set} returning Deferreds.
    """

    def __init__(self):
        self.data = {}
        self.hang = False

    def get(self, key):
        if self.hang:
            return Deferred()
        return succeed(self.data.get(key))

    def set(self, key, value):
        self.data[key] = value.encode("utf-8") if isinstance(value, str) else value
        return succeed("OK")


class RedisSettingsStoreTests(SynchronousTestCase):
    """
    L{RedisSettingsStore} keeps one JSON object under C{relay:settings}.
    """

    def setUp(self):
        self.redis = FakeRedis()
        self.clock = Clock()
        self.store = RedisSettingsStore(redis=self.redis, clock=self.clock)

    def test_interface(self):
        """
        It provides L{ISettingsStore}.
        """
        self.assertTrue(verifyObject(ISettingsStore, self.store))

    def test_emptyAndMerge(self):
        """
        A missing key reads as empty; saves merge into the JSON object.
        """
        self.assertEqual(self.successResultOf(self.store.load()), {})
        self.successResultOf(self.store.save({"retry_interval_ms": 5}))
        self.successResultOf(self.store.save({"breaker.failures": 4}))
        self.assertEqual(
            json.loads(self.redis.data[REDIS_KEY]),
            {"retry_interval_ms": 5, "breaker.failures": 4},
        )
        self.assertEqual(
            self.successResultOf(self.store.load()),
            {"retry_interval_ms": 5, "breaker.failures": 4},
        )

    def test_garbage(self):
        """
        A value that is not a JSON object reads as empty.
        """
        self.redis.data[REDIS_KEY] = b"[1,2"
        self.assertEqual(self.successResultOf(self.store.load()), {})

    def test_timeout(self):
        """
        Every call is bounded by the store's timeout on its clock.
        """
        self.redis.hang = True
        d = self.store.load()
        self.assertNoResult(d)
        self.clock.advance(self.store.timeout)
        self.failureResultOf(d)

    def test_sharedBetweenProcesses(self):
        """
        Two L{RuntimeSettings} on one Redis: a change in one reaches the
        other on its next refresh.
        """
        first = RuntimeSettings(store=self.store)
        second = RuntimeSettings(store=RedisSettingsStore(redis=self.redis, clock=self.clock))
        self.successResultOf(first.update({"transport_retry_policy": "sticky"}))
        self.successResultOf(second.refresh())
        self.assertEqual(second.current.transport_retry_policy, "sticky")


class _SynchronousReactor:
    """
    Just enough reactor for L{adbapi.ConnectionPool}: it is running, and
    "threads" call back at once.
    """

    def callWhenRunning(self, f, *args, **kwargs):
        f(*args, **kwargs)

    def addSystemEventTrigger(self, *args, **kwargs):
        return object()

    def removeSystemEventTrigger(self, triggerID):
        pass

    def callFromThread(self, f, *args, **kwargs):
        f(*args, **kwargs)


class _NotRunningReactor(_SynchronousReactor):
    """
    A reactor that never starts, so a pool built on it starts no threads.
    """

    def callWhenRunning(self, f, *args, **kwargs):
        return object()


class _SynchronousThreadPool:
    """
    A thread pool that runs each job at once in the calling thread.
    """

    def start(self):
        pass

    def stop(self):
        pass

    def callInThreadWithCallback(self, onResult, f, *args, **kwargs):
        try:
            result = f(*args, **kwargs)
        except BaseException:
            onResult(False, Failure())
        else:
            onResult(True, result)


def synchronousPool(path: str) -> adbapi.ConnectionPool:
    """
    A real L{adbapi.ConnectionPool} for C{sqlite3} with the store's
    arguments, whose jobs run synchronously (so the tests need no running
    reactor and pass under trial and pytest alike).
    """
    pool = adbapi.ConnectionPool(
        "sqlite3", path, cp_min=1, cp_max=1, check_same_thread=False,
        cp_reactor=_NotRunningReactor(),
    )
    pool.threadpool = _SynchronousThreadPool()
    pool.start()
    return pool


class SQLiteSettingsStoreTests(SynchronousTestCase):
    """
    L{SQLiteSettingsStore} on a real SQLite file through adbapi.
    """

    def makeStore(self, path):
        store = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(store.close)
        return store

    def test_interface(self):
        """
        It provides L{ISettingsStore}.
        """
        self.assertTrue(verifyObject(ISettingsStore, self.makeStore(self.mktemp())))

    def test_defaultPool(self):
        """
        Without a pool the store builds an adbapi pool for C{sqlite3} with
        one connection usable from the pool's thread, on the given reactor.
        """
        reactor = _NotRunningReactor()
        store = SQLiteSettingsStore(path="x.sqlite", reactor=reactor)
        pool = store._getPool()
        self.addCleanup(store.close)
        self.assertEqual((pool.dbapiName, pool.min, pool.max), ("sqlite3", 1, 1))
        self.assertEqual(pool.connkw, {"check_same_thread": False})
        self.assertIs(pool._reactor, reactor)

    def test_walWithSynchronousCommits(self):
        """
        The store's own pool opens its connection in WAL mode with
        synchronous (FULL) commits (L{relay.state.settingsdb.openConnection},
        issue 24), and the store works on it.
        """
        from relay.state.settingsdb import openConnection

        path = self.mktemp()
        store = SQLiteSettingsStore(path=path, reactor=_NotRunningReactor())
        pool = store._getPool()
        self.assertIs(pool.openfun, openConnection)
        pool.threadpool = _SynchronousThreadPool()
        pool.start()
        self.addCleanup(store.close)
        self.successResultOf(store.save({"retry_interval_ms": 5}))
        self.assertEqual(self.successResultOf(store.load()), {"retry_interval_ms": 5})

        def pragmas(txn):
            txn.execute("PRAGMA journal_mode")
            mode = txn.fetchone()[0]
            txn.execute("PRAGMA synchronous")
            return mode, txn.fetchone()[0]

        self.assertEqual(self.successResultOf(store.runInteraction(pragmas)), ("wal", 2))
        self.assertTrue(os.path.exists(path + "-wal"))

    def test_walSwitchWhileAnotherConnectionReads(self):
        """
        A file another connection is reading cannot switch to WAL: the
        connection keeps the rollback journal with a warning (and works);
        the next one opened when the reader is done switches.
        """
        import sqlite3

        from relay.state.settingsdb import openConnection

        path = self.mktemp()
        reader = sqlite3.connect(path, isolation_level=None)
        self.addCleanup(reader.close)
        reader.execute("CREATE TABLE t (x)")
        reader.execute("BEGIN")
        reader.execute("SELECT * FROM t").fetchall()
        busy = sqlite3.connect(path, timeout=0.05)
        self.addCleanup(busy.close)
        with capturedLogs() as events:
            openConnection(busy)
        [event] = [e for e in events if e.get("event") == "relay.database_wal_deferred"]
        self.assertIn("locked", event["error"])
        self.assertEqual(busy.execute("PRAGMA journal_mode").fetchone()[0], "delete")
        self.assertEqual(busy.execute("PRAGMA synchronous").fetchone()[0], 2)
        reader.execute("COMMIT")
        later = sqlite3.connect(path, timeout=0.05)
        self.addCleanup(later.close)
        openConnection(later)
        self.assertEqual(later.execute("PRAGMA journal_mode").fetchone()[0], "wal")

    def test_newFileIsPrivate(self):
        """
        The database holds OAuth tokens: a new file is created 0600 under a
        umask of 022, and so are the C{-wal} and C{-shm} files SQLite makes
        beside it in WAL mode.
        """
        path = self.mktemp()
        old = os.umask(0o022)
        try:
            store = self.makeStore(path)
            self.successResultOf(store.runInteraction(
                lambda txn: txn.execute("PRAGMA journal_mode=WAL")))
            self.successResultOf(store.save({"retry_interval_ms": 5}))
            modes = {suffix: stat.S_IMODE(os.stat(path + suffix).st_mode)
                     for suffix in ("", "-wal", "-shm") if os.path.exists(path + suffix)}
        finally:
            os.umask(old)
        self.assertIn("-wal", modes)
        self.assertEqual(set(modes.values()), {0o600}, modes)

    def test_existingFileTightened(self):
        """
        An existing database file readable by group and others (0644) is
        made 0600 before it is used, with a warning naming the file.
        """
        path = self.mktemp()
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE t (x)")
        db.close()
        os.chmod(path, 0o644)
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.assertEqual(self.successResultOf(self.makeStore(path).load()), {})
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual([e["file"] for e in events
                          if e.get("event") == "relay.database_mode_tightened"], [path])

    def test_schema(self):
        """
        The schema is created idempotently with its version recorded once;
        a second store on the same file migrates again without error.
        """
        path = self.mktemp()
        first = self.makeStore(path)
        self.assertEqual(self.successResultOf(first.schemaVersion()), SCHEMA_VERSION)
        first.close()
        second = self.makeStore(path)
        self.assertEqual(self.successResultOf(second.load()), {})
        second.close()
        with sqlite3.connect(path) as db:
            columns = db.execute("PRAGMA table_info(settings)").fetchall()
            versions = db.execute("SELECT version FROM schema_version").fetchall()
        db.close()
        self.assertEqual([(c[1], c[2], c[3], c[5]) for c in columns],
                         [("key", "TEXT", 0, 1), ("value", "TEXT", 1, 0)])
        # One row per migration, each recorded once (2: OAuth tokens, issue 12).
        self.assertEqual(versions, [(v,) for v in range(1, SCHEMA_VERSION + 1)])

    def test_saveLoad(self):
        """
        Saved values load back with their JSON types; saves merge.
        """
        store = self.makeStore(self.mktemp())
        self.successResultOf(store.save({"retry_interval_ms": 5, "breaker.enabled": False}))
        self.successResultOf(
            store.save({"retry_interval_ms": 6, "transport_retry_policy": "sticky"})
        )
        self.assertEqual(
            self.successResultOf(store.load()),
            {"retry_interval_ms": 6, "breaker.enabled": False,
             "transport_retry_policy": "sticky"},
        )

    def test_persistenceAcrossRestart(self):
        """
        R74: a change made through one L{RuntimeSettings} is in force after
        a "restart": a new L{RuntimeSettings} and store on the same file,
        started from the file's values, loads it; untouched keys keep the
        file's values.
        """
        path = self.mktemp()
        fileValues = GatewaySettings(max_account_switches=4)
        first = RuntimeSettings(current=fileValues, store=self.makeStore(path))
        self.successResultOf(first.start())
        changed = self.successResultOf(first.update(
            {"retry_interval_ms": 40000, "breaker": {"failures": 6},
             "transport_retry_policy": "sticky"}
        ))
        self.assertEqual(changed["retry_interval_ms"], 30000)
        first.store.close()

        second = RuntimeSettings(current=fileValues, store=self.makeStore(path))
        self.assertEqual(second.current.retry_interval_ms, 0)
        self.successResultOf(second.start())
        self.assertEqual(second.current.retry_interval_ms, 30000)
        self.assertEqual(second.current.breaker.failures, 6)
        self.assertEqual(second.current.transport_retry_policy, "sticky")
        self.assertEqual(second.current.max_account_switches, 4)

    def test_storedValuesNormalisedOnRead(self):
        """
        R74: values written to the file by other means are normalised when
        read at start-up.
        """
        path = self.mktemp()
        store = self.makeStore(path)
        self.successResultOf(
            store.save({"retry_interval_ms": -50, "transport_retry_policy": "bogus"})
        )
        settings = RuntimeSettings(
            current=GatewaySettings(retry_interval_ms=10, transport_retry_policy="sticky"),
            store=store,
        )
        self.successResultOf(settings.start())
        self.assertEqual(settings.current.retry_interval_ms, 0)
        self.assertEqual(settings.current.transport_retry_policy, "rotate")

    def test_failedTransactionRollsBack(self):
        """
        A failing save leaves the stored values as they were.
        """
        store = self.makeStore(self.mktemp())
        self.successResultOf(store.save({"retry_interval_ms": 5}))
        self.failureResultOf(store.save({"retry_interval_ms": 6, "bad": object()}), TypeError)
        self.assertEqual(self.successResultOf(store.load()), {"retry_interval_ms": 5})
