"""
Tests for the sticky fast path of L{relay.scheduling.scheduler.AccountScheduler}
(issue 24: C{_quickSticky}, taken by C{select} on the memory providers): on
the same inputs it gives what the general path (C{_select}) gives -- the
same selection, decision record, log lines, store values, slots and
scheduler bookkeeping -- or leaves the turn to the general path having
changed nothing.
"""

from __future__ import annotations

import random

from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.admission.memory import MemorySlotAdmission
from relay.base.eager import eagerDeferred
from relay.interfaces import (
    IAccountStateView,
    IStateStore,
    ISynchronousAdmission,
    ISynchronousState,
)
from relay.base.records import GatewaySettings, SchedulingSettings
from relay.scheduling.scheduler import AccountScheduler, sessionKey
from relay.scheduling.selection import NoAccountAvailable
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore

from tests.test_scheduler import HASH, account, turn

OTHER = "fedcba9876543210"
_VOLATILE = frozenset(["log_logger", "log_time", "time", "message", "log_legacy"])
"""Event keys that differ between two equal lines (the clock, wrappers)."""


class World:
    """
    A scheduler over the memory providers, built from a description so that
    two equal worlds can be compared.

    @param accounts: the accounts.
    @param blocked: account ids the C{extraBlock} hook refuses.
    @param quarantined: account ids whose proxy is quarantined.
    @param hooked: give the scheduler a C{flagged} hook (as the app does);
        else every candidate is checked one by one.
    """

    def __init__(self, accounts, blocked=(), quarantined=(), hooked=True, marks=(),
                 bindings=(), held=(), lastUsed=None):
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.store = MemoryStateStore(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)
        self.settings = RuntimeSettings(GatewaySettings(scheduling=SchedulingSettings(
            sticky_session_max_waiting=1)))
        blocked, quarantined = frozenset(blocked), frozenset(quarantined)

        def extraBlock(a, now, model):
            return "paused" if a.id in blocked else None

        def flagged(now, pool):
            return blocked | quarantined

        self.scheduler = AccountScheduler(
            accounts=list(accounts), admission=self.admission, store=self.store,
            clock=self.clock, settings=self.settings, random=random.Random(7),
            isQuarantined=lambda a: a.id in quarantined, extraBlock=extraBlock,
            flagged=flagged if hooked else None,
        )
        for accountId, kind in marks:
            self.store.markAccount(accountId, kind, self.clock.seconds() + 60, "test")
        for sessionHash, accountId in bindings:
            self.store.setValue(sessionKey(sessionHash), accountId, 3600)
        self.leases = []
        for accountId in held:
            self.leases.append(self.admission._tryNow("account", accountId, 0))
        if lastUsed:
            self.scheduler._balancer._lastUsed.update(lastUsed)
        self.clock.advance(1.5)

    def facts(self):
        """
        Everything a selection may change.
        """
        scheduler = self.scheduler
        return {
            "values": dict(self.store._values),
            "held": {k: len(v) for k, v in self.admission._held.items()},
            "lastUsed": dict(scheduler._balancer._lastUsed),
            "boundTurns": sorted(scheduler._bindings._boundTurns.values()),
            "keptBindings": len(scheduler._bindings._keptBindings),
            "localBindings": dict(scheduler._bindings._localBindings),
            "buckets": None if scheduler._balancer._index is None
            or scheduler._balancer._index.buckets is None
            else {k: list(v) for k, v in scheduler._balancer._index.buckets.items()},
        }


def outcome(testCase, d):
    """
    What a selection gave: the selection's account, lease kind, wait plan
    and record, or the client error.
    """
    results = []
    d.addBoth(results.append)
    testCase.assertEqual(len(results), 1, "the selection did not fire at once")
    result = results[0]
    if isinstance(result, Exception) or hasattr(result, "value"):
        error = getattr(result, "value", result)
        testCase.assertIsInstance(error, NoAccountAvailable)
        return ("error", error.error)
    return ("selected", result.account.id, result.lease is not None, result.waitPlan,
            result.record)


class FastPathParityTests(SynchronousTestCase):
    maxDiff = None
    """
    C{select} (which takes the fast path when it applies) against
    C{_select} (the general path) in two equal worlds.
    """

    def compare(self, expectFast=None, turns=(), excluded=frozenset(), **world):
        """
        Select for each turn of C{turns} (keyword dicts for L{turn}) in two
        equal worlds, then bind; assert the same outcome, log lines and
        facts after each step.

        @param expectFast: whether the first turn must take the fast path
            (L{None}: not checked).
        """
        fast, general = World(**world), World(**world)
        for i, kw in enumerate(turns or [{}]):
            kw = dict(dict(sessionHash=HASH), **kw)
            fastTurn, generalTurn = turn(**kw), turn(**kw)
            if i == 0 and expectFast is not None:
                quick = fast.scheduler._quick.select(turn(**kw), frozenset(excluded))
                self.assertEqual(quick is not None, expectFast)
                fast = World(**world)  # the probe took a slot: start again
            with capturedLogs() as fastLog:
                fastOut = outcome(self, fast.scheduler.select(fastTurn, excluded))
                if fastOut[0] == "selected":
                    self.successResultOf(fast.scheduler.bind(
                        fastTurn, fast.scheduler.accountById(fastOut[1])))
            with capturedLogs() as generalLog:
                generalOut = outcome(self, eagerDeferred(
                    general.scheduler._layers.select(generalTurn, frozenset(excluded))))
                if generalOut[0] == "selected":
                    self.successResultOf(general.scheduler.bind(
                        generalTurn, general.scheduler.accountById(generalOut[1])))
            self.assertEqual(fastOut, generalOut)
            self.assertEqual(
                [sorted((k, v) for k, v in e.items() if k not in _VOLATILE)
                 for e in fastLog],
                [sorted((k, v) for k, v in e.items() if k not in _VOLATILE)
                 for e in generalLog])
            self.assertEqual(fast.facts(), general.facts())
            fast.clock.advance(0.25)
            general.clock.advance(0.25)
        return fast, general

    def test_sticky_hit(self):
        """
        A bound, healthy, idle account: the fast path decides, as the
        general path does (the session hit, the touched binding, last use).
        """
        self.compare(expectFast=True, accounts=[account("a1"), account("a2")],
                     bindings=[(HASH, "a2")])

    def test_sticky_hit_unhooked(self):
        """
        Without a C{flagged} hook every candidate is checked (the candidate
        count counts the blocked ones out).
        """
        self.compare(expectFast=True, hooked=False,
                     accounts=[account("a1"), account("a2"), account("a3")],
                     bindings=[(HASH, "a2")], blocked=["a3"], marks=[("a1", "rate_limited")])

    def test_candidate_count_with_flagged(self):
        """
        Flagged and blocked accounts, quarantined proxies and excluded
        accounts are counted out of C{candidate_count} the same way.
        """
        accounts = [account(f"a{i}") for i in range(1, 7)]
        self.compare(expectFast=True, accounts=accounts, bindings=[(HASH, "a2")],
                     blocked=["a3"], quarantined=["a4"], marks=[("a5", "temp_unschedulable")],
                     excluded=frozenset(["a6"]))

    def test_repeated_turns(self):
        """
        Turns of one session in a row (the last-used index moves; bind is a
        no-op after a fast selection) and of a new session.
        """
        self.compare(accounts=[account("a1"), account("a2")], bindings=[(HASH, "a1")],
                     lastUsed={"a1": 999_990.0},
                     turns=[{}, {}, {"sessionHash": OTHER}, {"sessionHash": OTHER}, {}])

    def test_unflagged_bound_account_not_asked(self):
        """
        With a C{flagged} hook, a bound static candidate that no source
        flags is compatible without asking the C{extraBlock} and quarantine
        hooks (their answers are a subset of the flagged ones); a flagged
        one is still checked in full.
        """
        world = World(accounts=[account("a1"), account("a2")], bindings=[(HASH, "a2")],
                      blocked=["a1"])
        asked = []
        checks = world.scheduler._checks
        extraBlock, isQuarantined = checks.extraBlock, checks.isQuarantined
        checks.extraBlock = lambda a, now, model: asked.append(a.id) or extraBlock(a, now, model)
        checks.isQuarantined = lambda a: asked.append(a.id) or isQuarantined(a)
        quick = world.scheduler._quick.select(turn(sessionHash=HASH), frozenset())
        self.assertEqual(quick.account.id, "a2")
        self.assertNotIn("a2", asked)
        self.assertIn("a1", asked)

    def test_left_to_the_general_path(self):
        """
        Every case the fast path does not decide gives the general path's
        answer: no binding, an unknown, blocked, excluded, quarantined,
        model-barred or busy bound account, everyone quarantined, a model
        nobody serves, a continuation, a conversation, a preferred account.
        """
        two = [account("a1", concurrency=1), account("a2", concurrency=1)]
        cases = [
            dict(accounts=two),
            dict(accounts=two, bindings=[(HASH, "gone")]),
            dict(accounts=two, bindings=[(HASH, "a1")], blocked=["a1"]),
            dict(accounts=two, bindings=[(HASH, "a1")], marks=[("a1", "rate_limited")]),
            dict(accounts=two, bindings=[(HASH, "a1")], excluded=frozenset(["a1"])),
            dict(accounts=two, bindings=[(HASH, "a1")], quarantined=["a1"]),
            dict(accounts=two, bindings=[(HASH, "a1")], quarantined=["a1", "a2"]),
            dict(accounts=two, bindings=[(HASH, "a1")], held=["a1"]),
            dict(accounts=two, bindings=[(HASH, "a1")], held=["a1", "a2"]),
            dict(accounts=two, bindings=[(HASH, "a1")], held=["a1", "a2"], hooked=False),
            dict(accounts=[account("a1", models=("other",)), account("a2")],
                 bindings=[(HASH, "a1")]),
            dict(accounts=[account("a1", models=("other",))], bindings=[(HASH, "a1")]),
            dict(accounts=two, bindings=[(HASH, "a1")], turns=[{"body": {"conversation": "c"}}]),
            dict(accounts=two, bindings=[(HASH, "a1")], turns=[{"preferredAccountId": "a2"}]),
            dict(accounts=two, bindings=[(HASH, "a1")], turns=[{"background": True}]),
            dict(accounts=two, bindings=[(HASH, "a1")],
                 turns=[{"previousResponseId": "resp_1"}]),
            dict(accounts=two, bindings=[(HASH, "a1")], turns=[{"sessionHash": None}]),
        ]
        for case in cases:
            try:
                self.compare(expectFast=False if "turns" not in case else None, **case)
            except self.failureException as e:
                raise self.failureException(f"{case}: {e}") from None


class _Delegating:
    """
    An in-process store of another type than L{MemoryStateStore} (an
    operator's, say) that forwards to one and counts its at-once reads.
    """

    def __init__(self, inner):
        self.inner = inner
        self.atOnce = 0

    def valueNow(self, key):
        self.atOnce += 1
        return self.inner.valueNow(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@implementer(IStateStore, IAccountStateView, ISynchronousState)
class DeclaringStore(_Delegating):
    """
    Declares the synchronous capability.
    """


@implementer(IStateStore, IAccountStateView)
class PlainStore(_Delegating):
    """
    Does not declare it.
    """


class CapabilityTests(SynchronousTestCase):
    """
    The fast path is taken for a provider that declares the capability
    (L{ISynchronousState}, L{ISynchronousAdmission}), whatever its type,
    and never for one that does not.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.inner = MemoryStateStore(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)

    def test_memoryProvidersDeclareIt(self):
        """
        The built-in memory store and admission provide the capability.
        """
        self.assertTrue(verifyObject(ISynchronousState, self.inner))
        self.assertTrue(verifyObject(ISynchronousAdmission, self.admission))

    def select(self, store):
        scheduler = AccountScheduler(
            accounts=[account("a1")], admission=self.admission, store=store,
            clock=self.clock, settings=RuntimeSettings(GatewaySettings()),
            random=random.Random(7))
        self.inner.setValue(sessionKey(HASH), "a1", 3600)
        return self.successResultOf(scheduler.select(turn(sessionHash=HASH)))

    def test_declared(self):
        """
        A store of another type that declares L{ISynchronousState} is read
        at once, with the same selection.
        """
        store = DeclaringStore(self.inner)
        selection = self.select(store)
        self.assertEqual(store.atOnce, 1)
        self.assertEqual((selection.account.id, selection.record.layer), ("a1", "session_hash"))

    def test_undeclared(self):
        """
        A store that does not declare it is never read at once, even with
        C{valueNow} at hand.
        """
        store = PlainStore(self.inner)
        selection = self.select(store)
        self.assertEqual(store.atOnce, 0)
        self.assertEqual((selection.account.id, selection.record.layer), ("a1", "session_hash"))


class AtOnceAnswerTests(SynchronousTestCase):
    """
    The memory providers' answers without a Deferred (issue 24, used by the
    fast path) are their Deferreds' answers.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.store = MemoryStateStore(clock=self.clock)
        self.twin = MemoryStateStore(clock=self.clock)
        for store in (self.store, self.twin):
            store.setValue("k", "v", 10)
            store.setValue("old", "v", 1)

    def test_valueNow(self):
        """
        C{valueNow} gives C{getValue}'s value, L{None} for absent and
        expired keys (dropping them as C{getValue} does).
        """
        self.clock.advance(2)
        for key in ("k", "old", "absent"):
            self.assertEqual(self.store.valueNow(key),
                             self.successResultOf(self.twin.getValue(key)))
        self.assertEqual(self.store._values, self.twin._values)

    def test_valueNow_durable(self):
        """
        A durable key the process does not hold is left to C{getValue}'s
        asynchronous load.
        """
        from relay.state.durable import DURABLE_PREFIXES
        from relay.state.memory import NOT_NOW

        self.store.durable = object()
        self.assertIs(self.store.valueNow(DURABLE_PREFIXES[0] + "x"), NOT_NOW)

    def test_touchValueNow(self):
        """
        C{touchValueNow} extends a live key and drops an expired one, as
        C{touchValue} does.
        """
        self.clock.advance(2)
        for key in ("k", "old", "absent"):
            self.store.touchValueNow(key, 100)
            self.successResultOf(self.twin.touchValue(key, 100))
        self.assertEqual(self.store._values, self.twin._values)

    def test_views(self):
        """
        C{accountStateViewNow} is the view C{accountStateView} fires with;
        C{tryAcquireNow} grants and refuses as C{tryAcquire} does.
        """
        self.assertIs(self.store.accountStateViewNow(),
                      self.successResultOf(self.store.accountStateView(["a"])))
        admission = MemorySlotAdmission(clock=self.clock)
        first = admission.tryAcquireNow("account", "a", 2)
        second = self.successResultOf(admission.tryAcquire("account", "a", 2))
        self.assertIsNotNone(first)
        self.assertIsNotNone(second)
        self.assertIsNone(admission.tryAcquireNow("account", "a", 2))
        self.assertIsNone(self.successResultOf(admission.tryAcquire("account", "a", 2)))
        first.release()
        self.assertIsNotNone(admission.tryAcquireNow("account", "a", 2))


class LazyRecordTests(SynchronousTestCase):
    """
    A L{Selection} built from the decision line's fields (issue 24) gives
    the record that line carries, built once, and stays immutable.
    """

    def test_record_from_fields(self):
        """
        The record's fields are the logged line's; two reads give one
        object; no attribute may be set.
        """
        from attrs import asdict
        from attrs.exceptions import FrozenInstanceError

        world = World(accounts=[account("a1"), account("a2")], bindings=[(HASH, "a2")])
        for kw in ({}, {"sessionHash": OTHER}):  # the fast path, then load balance
            with capturedLogs() as events:
                selection = outcome_selection(self, world.scheduler.select(turn(**kw)))
            [line] = [e for e in events if e.get("event") == "openai.account_schedule_decision"]
            record = selection.record
            self.assertIs(selection.record, record)
            self.assertEqual(asdict(record), {k: line[k] for k in asdict(record)})
            self.assertRaises(FrozenInstanceError, setattr, selection, "account", None)
            self.assertRaises(FrozenInstanceError, setattr, selection, "_record", None)


def outcome_selection(testCase, d):
    """
    The L{Selection} a fired selection gave.
    """
    return testCase.successResultOf(d)
