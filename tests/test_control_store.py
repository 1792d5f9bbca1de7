"""
Tests for L{relay.control.store}: the L{IControlStore} contract (one
suite, issue 21), run here against the memory and SQLite providers and in
L{tests.integration.test_control_store_redis} against Redis on a real
redis-server (architecture invariant 8).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.control.store import (
    ANY,
    ControlChange,
    ControlStoreUnavailable,
    VersionConflict,
    sequenceId,
)
from relay.control.assemble import controlStoreFor
from relay.control.store.memory import MemoryControlStore
from relay.control.store.sqlite import SQLiteControlStore
from relay.interfaces import IControlStore
from relay.base.records import RelayConfig, StateSettings
from relay.state.settingsdb import SQLiteSettingsStore
from tests.test_settings import synchronousPool

T0 = 1_700_000_000.0


async def conflict(d) -> VersionConflict:
    """
    @return: the L{VersionConflict} C{d} fails with.
    @raise AssertionError: when it does not.
    """
    try:
        await d
    except VersionConflict as e:
        return e
    raise AssertionError("expected a VersionConflict")


class ControlStoreContractMixin:
    """
    The L{IControlStore} contract as coroutine scenarios named
    C{contract_*}. Subclasses provide L{makeStore} (a fresh, empty store)
    and L{now} (the store's clock, Unix seconds).
    """

    def makeStore(self):
        """
        @return: a fresh, empty L{IControlStore} provider.
        """
        raise NotImplementedError()

    def now(self) -> float:
        """
        @return: the store's clock, Unix seconds.
        """
        raise NotImplementedError()

    def flushErrors(self, *types) -> None:
        """
        Forget the errors of C{types} that were logged on purpose (trial
        fails a test that leaves any).
        """
        flush = getattr(self, "flushLoggedErrors", None)
        if flush is not None:
            flush(*types)

    async def contract_interface(self):
        """
        The provider implements L{IControlStore}.
        """
        assert verifyObject(IControlStore, self.makeStore())

    async def contract_putGetList(self):
        """
        A new record (expected L{None}) is read back with its data, a
        positive version and the store's time; C{list} gives a kind's
        records sorted by id, kinds apart.
        """
        store = self.makeStore()
        assert await store.get("account", "a1") is None
        b = await store.put("account", "b2", {"priority": 5}, None)
        a = await store.put("account", "a1", {"type": "apikey", "models": ["x"]}, None)
        await store.put("pause", "a1", {"paused": True}, None)
        got = await store.get("account", "a1")
        assert got == a
        assert got.data == {"type": "apikey", "models": ["x"]}
        assert got.version > 0 and got.kind == "account" and got.id == "a1"
        assert abs(got.updated_at - self.now()) < 5
        listed = await store.list("account")
        assert [r.id for r in listed] == ["a1", "b2"]
        assert listed[1] == b
        assert [r.id for r in await store.list("pause")] == ["a1"]
        assert await store.list("audit") == []

    async def contract_compareAndSet(self):
        """
        A write with the version read succeeds and gives a newer version;
        one with a stale version, or C{None} over an existing record, is a
        L{VersionConflict} naming the current version, and writes nothing.
        """
        store = self.makeStore()
        first = await store.put("account", "a", {"n": 1}, None)
        e = await conflict(store.put("account", "a", {"n": 9}, None))
        assert e.current == first.version
        second = await store.put("account", "a", {"n": 2}, first.version)
        assert second.version > first.version
        e = await conflict(store.put("account", "a", {"n": 9}, first.version))
        assert e.current == second.version
        e = await conflict(store.put("account", "missing", {"n": 9}, first.version))
        assert e.current is None
        assert (await store.get("account", "a")).data == {"n": 2}
        assert await store.get("account", "missing") is None
        third = await store.put("account", "a", {"n": 3}, ANY)
        assert third.version > second.version
        assert (await store.put("account", "new", {}, ANY)).data == {}

    async def contract_versionsGrowAcrossKinds(self):
        """
        Versions are one store-wide revision: every write, of any kind or
        record (a delete too), gets a higher one.
        """
        store = self.makeStore()
        a = await store.put("account", "a", {}, None)
        p = await store.put("pause", "a", {}, None)
        await store.delete("pause", "a", ANY)
        log = await store.append("audit", {"action": "x"}, 10)
        b = await store.put("account", "b", {}, None)
        assert a.version < p.version < log.version < b.version
        assert b.version - a.version >= 4

    async def contract_delete(self):
        """
        A delete removes the record (L{True}); deleting nothing is L{False};
        a delete with a stale version is a L{VersionConflict} and removes
        nothing.
        """
        store = self.makeStore()
        a = await store.put("account", "a", {"x": 1}, None)
        b = await store.put("account", "a", {"x": 2}, a.version)
        e = await conflict(store.delete("account", "a", a.version))
        assert e.current == b.version
        assert await store.get("account", "a") is not None
        assert await store.delete("account", "a", b.version) is True
        assert await store.get("account", "a") is None
        assert await store.delete("account", "a", ANY) is False
        again = await store.put("account", "a", {"x": 3}, None)
        assert again.version > b.version

    async def contract_appendKeepsTheNewest(self):
        """
        C{append} gives ids of an ever-growing sequence that sort in the
        order of appending, and keeps only the newest C{keep} records.
        """
        store = self.makeStore()
        ids = []
        for n in range(5):
            ids.append((await store.append("audit", {"n": n}, 3)).id)
        assert ids == sorted(ids) and len(set(ids)) == 5
        assert ids[0] == sequenceId(1)
        kept = await store.list("audit")
        assert [r.data["n"] for r in kept] == [2, 3, 4]
        assert [r.id for r in kept] == ids[2:]
        other = await store.append("otherlog", {"n": 0}, 3)
        assert other.id == sequenceId(1)

    async def contract_dataRoundTrips(self):
        """
        JSON data comes back equal: nesting, empty containers, unicode,
        big integers, floats, booleans and nulls; ids with odd characters.
        """
        store = self.makeStore()
        data = {"nested": {"a": [1, 2, {"b": None}]}, "empty": [], "map": {},
                "text": "账号 é \t tab", "big": 2**53 + 1, "float": 0.1, "yes": True}
        await store.put("account", "odd id/é:1", data, None)
        assert (await store.get("account", "odd id/é:1")).data == data
        assert [r.id for r in await store.list("account")] == ["odd id/é:1"]

    async def contract_badInput(self):
        """
        A malformed kind, an empty id or data that is not a JSON object is
        a L{ValueError} before anything is written.
        """
        store = self.makeStore()
        for call in (lambda: store.get("Bad-Kind", "a"), lambda: store.get("account", ""),
                     lambda: store.put("account", "a", ["not", "a", "dict"], None),
                     lambda: store.put("account", "a", {"x": float("nan")}, None),
                     lambda: store.append("audit", "text", 3)):
            try:
                await call()
            except ValueError:
                continue
            raise AssertionError("expected ValueError")
        assert await store.list("account") == []

    async def contract_ownChangesAreAnnounced(self):
        """
        Every write of this process reaches its listeners once, after it is
        readable, with the kind, the id and the new version (L{None} for a
        delete); an unsubscribed listener hears nothing more.
        """
        store = self.makeStore()
        heard = []
        seenData = []

        def listener(change):
            heard.append(change)

        def reader(change):
            seenData.append(change)

        unsubscribe = store.subscribe(listener)
        store.subscribe(reader)
        a = await store.put("account", "a", {"v": 1}, None)
        await store.delete("account", "missing", ANY)
        log = await store.append("audit", {"x": 1}, 5)
        await store.delete("account", "a", ANY)
        assert heard == [ControlChange("account", "a", a.version),
                         ControlChange("audit", log.id, log.version),
                         ControlChange("account", "a", None)]
        assert heard[-1].deleted and not heard[0].deleted
        unsubscribe()
        await store.put("account", "b", {}, None)
        assert len(heard) == 3
        assert len(seenData) == 4

    async def contract_listenerErrorsAreContained(self):
        """
        A listener that raises does not stop the others or the write.
        """
        store = self.makeStore()
        heard = []

        def broken(change):
            raise RuntimeError("listener bug")

        store.subscribe(broken)
        store.subscribe(heard.append)
        record = await store.put("account", "a", {}, None)
        self.flushErrors(RuntimeError)
        assert heard == [ControlChange("account", "a", record.version)]
        assert await store.get("account", "a") == record

    async def contract_startStop(self):
        """
        C{start} and C{stop} succeed and may be called twice.
        """
        store = self.makeStore()
        await store.start()
        await store.start()
        await store.stop()
        await store.stop()


def contractNames() -> list:
    """
    @return: the names of the C{contract_*} scenarios, sorted.
    """
    return sorted(n for n in dir(ControlStoreContractMixin) if n.startswith("contract_"))


def _contractTest(name):
    def test(self):
        self.successResultOf(Deferred.fromCoroutine(getattr(self, name)()))

    test.__name__ = "test_" + name[len("contract_"):]
    test.__doc__ = getattr(ControlStoreContractMixin, name).__doc__
    return test


class MemoryControlStoreTests(ControlStoreContractMixin, SynchronousTestCase):
    """
    The L{IControlStore} contract on L{MemoryControlStore} with a L{Clock}.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)

    def makeStore(self):
        return MemoryControlStore(clock=self.clock)

    def now(self):
        return self.clock.seconds()

    def test_failing(self):
        """
        A failing store fails every call with L{ControlStoreUnavailable}.
        """
        store = self.makeStore()
        store.failing = True
        self.failureResultOf(store.get("account", "a"), ControlStoreUnavailable)
        self.failureResultOf(store.put("account", "a", {}, None), ControlStoreUnavailable)

    def test_storedDataIsACopy(self):
        """
        Changing a dict after writing it, or a record's data after reading
        it, changes nothing stored.
        """
        store = self.makeStore()
        data = {"models": ["a"]}
        self.successResultOf(store.put("account", "a", data, None))
        data["models"].append("b")
        got = self.successResultOf(store.get("account", "a"))
        got.data["models"].append("c")
        self.assertEqual(self.successResultOf(store.get("account", "a")).data, {"models": ["a"]})


class SQLiteControlStoreTests(ControlStoreContractMixin, SynchronousTestCase):
    """
    The L{IControlStore} contract on L{SQLiteControlStore} on a real SQLite
    file, sharing the settings store's connection.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.path = self.mktemp()

    def makeStore(self):
        self.database = SQLiteSettingsStore(path=self.path, pool=synchronousPool(self.path))
        self.addCleanup(self.database.close)
        return SQLiteControlStore(database=self.database, clock=self.clock)

    def now(self):
        return self.clock.seconds()

    def test_survivesAReopen(self):
        """
        Records (and the version counter) are in the file: a store opened
        again on it reads them and keeps counting up.
        """
        store = self.makeStore()
        first = self.successResultOf(store.put("pause", "a1", {"paused": True}, None))
        self.database.close()
        again = self.makeStore()
        self.assertEqual(self.successResultOf(again.get("pause", "a1")), first)
        later = self.successResultOf(again.put("pause", "a2", {}, None))
        self.assertGreater(later.version, first.version)

    def test_readNow(self):
        """
        The start-up read: every record of the kinds asked, at once, with a
        connection of its own; nothing (not an error) before the file or
        its tables exist.
        """
        store = self.makeStore()
        self.assertEqual(store.readNow(("pause",)), {"pause": []})
        self.successResultOf(self.database.save({"x": 1}))
        self.assertEqual(store.readNow(("pause",)), {"pause": []})
        record = self.successResultOf(store.put("pause", "a1", {"paused": True}, None))
        self.successResultOf(store.put("account", "b", {}, None))
        found = store.readNow(("pause", "account", "login"))
        self.assertEqual(found["pause"], [record])
        self.assertEqual([r.id for r in found["account"]], ["b"])
        self.assertEqual(found["login"], [])

    def test_settingsUntouched(self):
        """
        The control tables live beside the settings in the same file.
        """
        store = self.makeStore()
        self.successResultOf(self.database.save({"retry_interval_ms": 5}))
        self.successResultOf(store.put("account", "a", {"x": 1}, None))
        self.assertEqual(self.successResultOf(self.database.load()), {"retry_interval_ms": 5})

    def test_databaseFailure(self):
        """
        A database that fails is L{ControlStoreUnavailable}.
        """
        store = self.makeStore()

        class Broken:
            def runInteraction(self, *args):
                from twisted.internet.defer import fail

                return fail(OSError("disk gone"))

        store.database = Broken()
        f = self.failureResultOf(store.get("account", "a"), ControlStoreUnavailable)
        self.assertIn("disk gone", str(f.value))


for _name in contractNames():
    for _cls in (MemoryControlStoreTests, SQLiteControlStoreTests):
        setattr(_cls, "test_" + _name[len("contract_"):], _contractTest(_name))
del _name, _cls


class ProviderChoiceTests(SynchronousTestCase):
    """
    L{controlStoreFor} picks the store by C{state.backend} and C{database}.
    """

    def test_choice(self):
        """
        Redis with the Redis backend, SQLite with a settings database, else
        memory.
        """
        clock = Clock()
        path = self.mktemp()
        database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(database.close)
        memory = RelayConfig()
        self.assertIsInstance(controlStoreFor(memory, clock), MemoryControlStore)
        self.assertIsInstance(
            controlStoreFor(memory, clock, settingsStore=database), SQLiteControlStore
        )
        from relay.control.store.redis import RedisControlStore

        redis = RelayConfig(state=StateSettings(backend="redis"))
        self.assertIsInstance(
            controlStoreFor(redis, clock, redis=object(), settingsStore=database),
            RedisControlStore,
        )
