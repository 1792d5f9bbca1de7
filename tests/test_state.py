"""
Tests for L{relay.state}: the L{IStateStore} contract, run against the
memory provider here and against the Redis provider in
L{tests.integration.test_redis_state} (architecture invariant 8).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.state.runtime import AccountRuntime
from relay.interfaces import IAccountStates, IAccountStateView, IStateStore
from relay.state import accountKey, counter403Key
from relay.state.memory import MemoryStateStore

#: a fixed start time, Unix seconds
T0 = 1_700_000_000.0


class StateStoreContractMixin:
    """
    The L{IStateStore} contract as coroutine scenarios named C{contract_*}.

    Subclasses provide L{makeStore} (a fresh, empty store), L{advance}
    (let C{seconds} pass on the store's clock) and L{now} (the store's
    clock, Unix seconds). TTLs here are short (< 1 s) so the Redis run,
    which waits in real time, stays fast.
    """

    def makeStore(self):
        """
        @return: a fresh, empty L{IStateStore} provider.
        """
        raise NotImplementedError()

    async def advance(self, seconds: float) -> None:
        """
        Let C{seconds} pass on the store's clock.
        """
        raise NotImplementedError()

    def now(self) -> float:
        """
        @return: the store's clock, Unix seconds.
        """
        raise NotImplementedError()

    async def contract_interface(self):
        """
        The provider implements L{IStateStore}.
        """
        assert verifyObject(IStateStore, self.makeStore())

    async def contract_defaultRuntime(self):
        """
        An account never marked has the default L{AccountRuntime}.
        """
        store = self.makeStore()
        states = await store.getAccountStates(["a", "b"])
        assert states == {"a": AccountRuntime(), "b": AccountRuntime()}

    async def contract_stateView(self):
        """
        Issue 24: the store's L{IAccountStateView} gives what
        C{getAccountStates} gives, and flags exactly the accounts whose
        stored state may block them now: a block or model block not yet
        over, or disabled; not an account with a streak only, a cleared
        one, or one whose block has ended.
        """
        store = self.makeStore()
        assert verifyObject(IAccountStateView, store)
        now = self.now()
        ids = ("a", "b", "c", "d", "e")
        await store.markAccount("a", "rate_limited", now + 60, "429")
        await store.markAccount("b", "disabled", 0, "401")
        await store.markAccount("c", "model_block", now + 60, "streak", model="gpt-5")
        await store.markAccount("d", "overloaded", now + 0.2, "529")
        await store.bumpStreak("e", "gpt-5", 60)
        view = await store.accountStateView(ids)
        assert verifyObject(IAccountStates, view)
        states = await store.getAccountStates(ids)
        for i in ids[:4]:
            assert view.get(i) == states[i], i
        assert set(view.flagged(now)) == {"a", "b", "c", "d"}
        await store.clearAccount("b")
        await store.markAccount("a", "temp_unschedulable", now + 90, "transport")
        await self.advance(0.4)
        view = await store.accountStateView(ids)
        assert set(view.flagged(self.now())) == {"a", "c"}
        assert view.get("a").blockReason == "transport"
        assert view.get("b", AccountRuntime()) == AccountRuntime()

    async def contract_setValues(self):
        """
        Issue 24: C{setValues} sets every key with the one TTL, as
        C{setValue} does each.
        """
        store = self.makeStore()
        await store.setValues([("k1", "v1"), ("k2", "0012")], 0.3)
        assert (await store.getValue("k1"), await store.getValue("k2")) == ("v1", "0012")
        await self.advance(0.5)
        assert (await store.getValue("k1"), await store.getValue("k2")) == (None, None)

    async def contract_markEachKind(self):
        """
        Every marking kind is stored and read back (R4, R11, R12).
        """
        store = self.makeStore()
        now = self.now()
        await store.markAccount("a", "temp_unschedulable", now + 600, "transport")
        await store.markAccount("a", "rate_limited", now + 60, "429")
        await store.markAccount("a", "overloaded", now + 30, "529")
        await store.markAccount("a", "model_block", now + 90, "streak", model="gpt-5")
        await store.markAccount("b", "disabled", 0, "401 invalid key")
        states = await store.getAccountStates(["a", "b", "c"])
        a = states["a"]
        assert a.blockedUntil == now + 600
        assert a.blockReason == "transport"
        assert a.rateLimitedUntil == now + 60
        assert a.overloadedUntil == now + 30
        assert a.modelBlocks == {"gpt-5": now + 90}
        assert not a.disabled
        assert a.unschedulable(now) == ("transport", now + 600)
        assert states["b"].disabled
        assert states["b"].disabledReason == "401 invalid key"
        assert states["b"].unschedulable(now) == ("disabled: 401 invalid key", 0)
        assert states["c"] == AccountRuntime()

    async def contract_markReplaces(self):
        """
        A second marking of the same kind replaces the first.
        """
        store = self.makeStore()
        now = self.now()
        await store.markAccount("a", "temp_unschedulable", now + 600, "one")
        await store.markAccount("a", "temp_unschedulable", now + 60, "two")
        a = (await store.getAccountStates(["a"]))["a"]
        assert (a.blockedUntil, a.blockReason) == (now + 60, "two")

    async def contract_markUnknownKind(self):
        """
        An unknown kind fails with L{ValueError} and stores nothing.
        """
        store = self.makeStore()
        try:
            await store.markAccount("a", "sleepy", self.now() + 5, "x")
        except ValueError:
            pass
        else:
            raise AssertionError("no ValueError")
        assert (await store.getAccountStates(["a"]))["a"] == AccountRuntime()

    async def contract_clearAccount(self):
        """
        C{clearAccount} lifts every state of that account only.
        """
        store = self.makeStore()
        now = self.now()
        await store.markAccount("a", "disabled", 0, "x")
        await store.markAccount("a", "rate_limited", now + 60, "429")
        await store.markAccount("b", "rate_limited", now + 60, "429")
        await store.clearAccount("a")
        await store.clearAccount("never")
        states = await store.getAccountStates(["a", "b"])
        assert states["a"] == AccountRuntime()
        assert states["b"].rateLimitedUntil == now + 60

    async def contract_clearAccountEndsCountersAndStreaks(self):
        """
        C{clearAccount} also ends the account's R11 transient streaks and its
        403 counter (admin "clear" resets everything, issue 11), and keeps
        other accounts' streaks.
        """
        store = self.makeStore()
        await store.incrementCounter(counter403Key("a"), 60, False)
        await store.incrementCounter(counter403Key("a"), 60, False)
        assert await store.bumpStreak("a", "m", 60) == 1
        assert await store.bumpStreak("b", "m", 60) == 1
        await store.markAccount("a", "model_block", self.now() + 60, "streak", "m")
        await store.clearAccount("a")
        assert await store.incrementCounter(counter403Key("a"), 60, False) == 1
        assert await store.bumpStreak("a", "m", 60) == 1
        assert await store.bumpStreak("b", "m", 60) == 2
        state = (await store.getAccountStates(["a"]))["a"]
        assert state.modelBlocks == {} and state.modelReasons == {}

    async def contract_streaks(self):
        """
        R11: a streak counts per (account, model), is visible in the account
        runtime as C{(count, last failure)}, starts again after its TTL from
        the last failure, and C{resetStreak} ends it.
        """
        store = self.makeStore()
        assert await store.bumpStreak("a", "m", 0.6) == 1
        await self.advance(0.35)
        assert await store.bumpStreak("a", "m", 0.6) == 2
        assert await store.bumpStreak("a", "*", 0.6) == 1
        state = (await store.getAccountStates(["a"]))["a"]
        assert state.streaks["m"][0] == 2
        assert abs(state.streaks["m"][1] - self.now()) < 1
        await self.advance(0.35)
        assert await store.bumpStreak("a", "m", 0.6) == 3
        await self.advance(0.8)
        assert await store.bumpStreak("a", "m", 0.6) == 1
        await store.resetStreak("a", "m")
        await store.resetStreak("a", "never")
        assert "m" not in (await store.getAccountStates(["a"]))["a"].streaks
        assert await store.bumpStreak("a", "m", 0.6) == 1

    async def contract_expiredStreaksAreDropped(self):
        """
        A bump drops the account's streaks whose TTL has passed, of any
        model: the account holds only the models that failed within the
        TTL, however many model names clients send (a client's 150 model
        names against a failing account were kept for good).
        """
        store = self.makeStore()
        for i in range(20):
            assert await store.bumpStreak("a", f"junk-{i}", 0.3) == 1
        assert await store.bumpStreak("b", "junk-0", 5) == 1
        await self.advance(0.4)
        assert await store.bumpStreak("a", "m", 0.3) == 1
        states = await store.getAccountStates(["a", "b"])
        assert set(states["a"].streaks) == {"m"}
        assert set(states["b"].streaks) == {"junk-0"}

    async def contract_modelBlockReason(self):
        """
        A model block keeps its reason (the operator view shows it).
        """
        store = self.makeStore()
        until = self.now() + 45
        await store.markAccount("a", "model_block", until, "3 in a row", "gpt-5.5")
        state = (await store.getAccountStates(["a"]))["a"]
        assert state.modelBlocks == {"gpt-5.5": until}
        assert state.modelReasons == {"gpt-5.5": "3 in a row"}

    async def contract_counterIncrements(self):
        """
        A counter counts from 1 and C{resetCounter} deletes it.
        """
        store = self.makeStore()
        name = counter403Key("a")
        assert await store.incrementCounter(name, 60) == 1
        assert await store.incrementCounter(name, 60) == 2
        assert await store.incrementCounter("other", 60) == 1
        await store.resetCounter(name)
        await store.resetCounter("never")
        assert await store.incrementCounter(name, 60) == 1

    async def contract_counterRefreshTtl(self):
        """
        With C{refresh=True} the TTL runs from the last increment.
        """
        store = self.makeStore()
        assert await store.incrementCounter("c", 0.6) == 1
        await self.advance(0.35)
        assert await store.incrementCounter("c", 0.6) == 2
        await self.advance(0.35)
        assert await store.incrementCounter("c", 0.6) == 3
        await self.advance(0.8)
        assert await store.incrementCounter("c", 0.6) == 1

    async def contract_counterFixedWindow(self):
        """
        With C{refresh=False} the TTL is set only on creation (a fixed
        window).
        """
        store = self.makeStore()
        assert await store.incrementCounter("c", 0.6, refresh=False) == 1
        await self.advance(0.35)
        assert await store.incrementCounter("c", 0.6, refresh=False) == 2
        await self.advance(0.4)
        assert await store.incrementCounter("c", 0.6, refresh=False) == 1

    async def contract_values(self):
        """
        Values are stored, read back, deleted; a missing key reads L{None}.
        """
        store = self.makeStore()
        assert await store.getValue("sticky_session:0:openai:h") is None
        await store.setValue("sticky_session:0:openai:h", "acct-1", 60)
        assert await store.getValue("sticky_session:0:openai:h") == "acct-1"
        await store.setValue("sticky_session:0:openai:h", "acct-2", 60)
        assert await store.getValue("sticky_session:0:openai:h") == "acct-2"
        await store.deleteValue("sticky_session:0:openai:h")
        await store.deleteValue("never")
        assert await store.getValue("sticky_session:0:openai:h") is None

    async def contract_valueExpires(self):
        """
        A value disappears after its TTL.
        """
        store = self.makeStore()
        await store.setValue("k", "v", 0.3)
        await self.advance(0.5)
        assert await store.getValue("k") is None

    async def contract_touchValue(self):
        """
        C{touchValue} extends a live key (R38) and does not create a missing
        one.
        """
        store = self.makeStore()
        await store.setValue("k", "v", 0.5)
        await self.advance(0.3)
        await store.touchValue("k", 0.5)
        await self.advance(0.3)
        assert await store.getValue("k") == "v"
        await store.touchValue("missing", 5)
        assert await store.getValue("missing") is None
        await self.advance(0.4)
        assert await store.getValue("k") is None

    async def contract_unicodeValues(self):
        """
        Non-ASCII reasons and values round-trip.
        """
        store = self.makeStore()
        await store.setValue("k", "账号-é", 60)
        assert await store.getValue("k") == "账号-é"
        await store.markAccount("a", "temp_unschedulable", self.now() + 5, "超时 {x}")
        assert (await store.getAccountStates(["a"]))["a"].blockReason == "超时 {x}"


def contractNames() -> list:
    """
    @return: the names of the C{contract_*} scenarios, sorted.
    """
    return sorted(n for n in dir(StateStoreContractMixin) if n.startswith("contract_"))


class MemoryStateStoreTests(StateStoreContractMixin, SynchronousTestCase):
    """
    The L{IStateStore} contract on L{MemoryStateStore} with a L{Clock}.
    """

    def setUp(self):
        """
        A clock at L{T0}.
        """
        self.clock = Clock()
        self.clock.advance(T0)

    def makeStore(self):
        """
        @return: a L{MemoryStateStore} on the test clock.
        """
        return MemoryStateStore(clock=self.clock)

    async def advance(self, seconds):
        """
        Advance the L{Clock}.
        """
        self.clock.advance(seconds)

    def now(self):
        """
        @return: the L{Clock}'s time.
        """
        return self.clock.seconds()

    def test_accountKeyNames(self):
        """
        Key names follow R34 and the documented account-state key.
        """
        self.assertEqual(accountKey("x"), "relay:account:x")
        self.assertEqual(counter403Key("x"), "openai_403_count:account:x")

    def test_prune(self):
        """
        L{MemoryStateStore.prune} drops expired counters and values only.
        """
        store = self.makeStore()
        store.setValue("a", "1", 1)
        store.setValue("b", "1", 10)
        store.incrementCounter("c", 1)
        self.clock.advance(2)
        self.assertEqual(store.prune(), 2)
        self.assertEqual(self.successResultOf(store.getValue("b")), "1")


def _contractTest(name):
    def test(self):
        self.successResultOf(Deferred.fromCoroutine(getattr(self, name)()))

    test.__name__ = "test_" + name[len("contract_") :]
    test.__doc__ = getattr(StateStoreContractMixin, name).__doc__
    return test


for _name in contractNames():
    setattr(MemoryStateStoreTests, "test_" + _name[len("contract_") :], _contractTest(_name))
del _name
