"""
Tests for selection through the pool index (issue 24 item 5,
L{relay.scheduling.index}): with a state store that gives a view and a
C{flagged} hook beside C{extraBlock}, a selection checks only the flagged
accounts, and decides exactly what the full check of every candidate
decides.
"""

from __future__ import annotations

import random

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.memory import MemorySlotAdmission
from relay.base.records import GatewaySettings, SchedulingSettings
from relay.process.live import AccountRegistry
from relay.scheduling.index import PoolIndex, sameSnapshot
from relay.oauth.windows import Snapshot, Window
from relay.scheduling.quota import UsageWindows
from relay.scheduling.scheduler import AccountScheduler, sessionKey
from relay.scheduling.selection import NoAccountAvailable
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore
from tests.test_scheduler import HASH, account, turn


class CountingStore(MemoryStateStore):
    """
    A memory store that counts per-account state reads.
    """

    __slots__ = ("reads",)

    def getAccountStates(self, accountIds):
        ids = list(accountIds)
        self.reads = getattr(self, "reads", 0) + len(ids)
        return super().getAccountStates(ids)


class Blocks:
    """
    An C{extraBlock} hook with its C{flagged} answer (like the app's:
    pauses, in-memory blocks, token state), counting the accounts it is
    asked about.
    """

    def __init__(self):
        self.blocked = {}
        self.quarantined = set()
        self.asked = 0
        self.unknown = False

    def extraBlock(self, account, now, model):
        self.asked += 1
        return self.blocked.get(account.id)

    def isQuarantined(self, account):
        return account.id in self.quarantined

    def flagged(self, now, pool):
        if self.unknown:
            return None
        return set(self.blocked) | self.quarantined


class Rig:
    """
    One scheduler over a registry of accounts, memory providers, a seeded
    random; C{indexed=False} makes its hook's C{flagged} answer "unknown",
    so every candidate is checked (the path without an index).
    """

    def __init__(self, accounts, seed=1, indexed=True, clock=None, quota=False):
        self.clock = clock or Clock()
        if clock is None:
            self.clock.advance(1_000_000)
        self.store = CountingStore(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)
        self.registry = AccountRegistry(accounts)
        self.blocks = Blocks()
        self.blocks.unknown = not indexed
        self.scheduler = AccountScheduler(
            accounts=self.registry, admission=self.admission, store=self.store,
            clock=self.clock,
            settings=RuntimeSettings(GatewaySettings(scheduling=SchedulingSettings())),
            random=random.Random(seed), extraBlock=self.blocks.extraBlock,
            isQuarantined=self.blocks.isQuarantined, flagged=self.blocks.flagged,
            quota=UsageWindows(clock=self.clock) if quota else None,
        )

    def select(self, t, excluded=frozenset()):
        d = self.scheduler.select(t, excluded)
        result = []
        d.addBoth(result.append)
        (outcome,) = result
        if isinstance(getattr(outcome, "value", None), NoAccountAvailable):
            return ("error", outcome.value.error.status, outcome.value.error.message)
        sel = outcome
        if sel.lease is not None:
            sel.lease.release()
        r = sel.record
        return (sel.account.id, r.layer, r.candidate_count, r.sticky_session_hit,
                sel.waitPlan.plan if sel.waitPlan else None)


class IndexTests(SynchronousTestCase):
    """
    Selection through the index.
    """

    def test_stickyTurnChecksOnlyFlagged(self):
        """
        With 2,000 accounts, a sticky turn reads no account state and asks
        the hooks about the flagged accounts only, while the decision
        record still counts every eligible account (R45).
        """
        rig = Rig([account(f"a{i}") for i in range(2000)])
        rig.blocks.blocked = {"a5": "paused: by admin", "a9": ("breaker_open", 2e6)}
        self.successResultOf(rig.store.markAccount("a7", "rate_limited", 2e6, "429"))
        self.successResultOf(rig.store.setValue(sessionKey(HASH), "a42", 3600))
        rig.blocks.asked = 0
        result = rig.select(turn(sessionHash=HASH))
        self.assertEqual(result[:4], ("a42", "session_hash", 1997, True))
        self.assertEqual(getattr(rig.store, "reads", 0), 0)
        self.assertLessEqual(rig.blocks.asked, 4)

    def test_sameDecisionsAsFullCheck(self):
        """
        Over random pools, blocks, quarantines, exclusions, bindings and
        model mappings, the indexed selection decides what the full check
        of every candidate decides (account, layer, candidate count,
        sticky hit, wait plan; or the same error), turn after turn.
        """
        rng = random.Random(24)
        for case in range(60):
            n = rng.randint(1, 12)
            accounts = [
                account(f"a{i}", type=rng.choice(["apikey", "apikey", "oauth"]),
                        priority=rng.choice([1, 50, 50]), concurrency=rng.choice([0, 1, 2]),
                        models=rng.choice([None, None, ["gpt-5"], ["o3"]]))
                for i in range(n)
            ]
            rigs = [Rig(accounts, seed=case, indexed=True), Rig(accounts, seed=case, indexed=False)]
            for rig in rigs:
                for a in accounts:
                    roll = random.Random(hash((case, a.id)) & 0xFFFF).random()
                    if roll < 0.15:
                        self.successResultOf(rig.store.markAccount(
                            a.id, "rate_limited", rig.clock.seconds() + 30, "429"))
                    elif roll < 0.25:
                        self.successResultOf(rig.store.markAccount(
                            a.id, "model_block", rig.clock.seconds() + 30, "x", model="gpt-5"))
                    elif roll < 0.3:
                        rig.blocks.blocked[a.id] = ("paused: by admin", 0)
                    elif roll < 0.35:
                        rig.blocks.quarantined.add(a.id)
                    elif roll < 0.4:
                        self.successResultOf(rig.admission.tryAcquire("account", a.id, 0))
            turns = []
            for step in range(6):
                kw = {}
                if step % 2:
                    kw["sessionHash"] = HASH
                if step == 3:
                    kw["previousResponseId"] = "resp_x"
                if step == 4:
                    kw["entrypoint"] = "ws"
                turns.append(kw)
            excluded = frozenset(a.id for a in accounts[: case % 3])
            outcomes = []
            for rig in rigs:
                out = []
                self.successResultOf(rig.store.setValue(
                    sessionKey(HASH), accounts[case % n].id, 3600))
                for kw in turns:
                    out.append(rig.select(turn(**kw), excluded))
                    rig.clock.advance(1.5)
                outcomes.append(out)
            self.assertEqual(outcomes[0], outcomes[1], f"case {case}")

    def test_loadBalanceSameAsFullSort(self):
        """
        The load-balance layer read from the index (busy accounts, usage
        windows and flagged ones ranked one by one, the idle rest by the
        index's priority and last-used order) picks what sorting every
        candidate picks, draw for draw, turn after turn while slots fill
        and time passes; the record's load skew, top_k and quota verdict
        agree too.
        """
        rng = random.Random(12)
        for case in range(50):
            n = rng.randint(2, 10)
            accounts = [account(f"a{i}", priority=rng.choice([1, 50, 50, 50]),
                                concurrency=rng.choice([0, 1, 2, 3]))
                        for i in range(n)]
            rigs = [Rig(accounts, seed=case, indexed=flag, quota=True) for flag in (True, False)]
            held = [rng.randrange(n) for _ in range(rng.randint(0, n))]
            windows = {f"a{i}": rng.choice([5.0, 40.0, 97.0]) for i in range(n)
                       if rng.random() < 0.3}
            steps = [rng.choice([0.2, 1.0]) for _ in range(8)]
            outcomes = []
            for rig in rigs:
                for i in held:
                    self.successResultOf(rig.admission.tryAcquire("account", f"a{i}", 0))
                for aid, used in windows.items():
                    rig.scheduler._quota.observe(aid, Snapshot(
                        Window(used, 300, rig.clock.seconds() + 3600), None))
                if case % 4 == 0:
                    rig.blocks.blocked = {"a1": ("paused: by admin", 0)}
                out = []
                for step in steps:
                    d = rig.scheduler.select(turn())
                    result = []
                    d.addBoth(result.append)
                    sel = result[0]
                    if isinstance(getattr(sel, "value", None), NoAccountAvailable):
                        out.append(("error", sel.value.error.status))
                        rig.clock.advance(step)
                        continue
                    r = sel.record
                    out.append((sel.account.id, r.candidate_count, round(r.load_skew, 9),
                                r.top_k, r.quota_decided, sel.waitPlan is None))
                    rig.clock.advance(step)
                outcomes.append(out)
            self.assertEqual(outcomes[0], outcomes[1], f"case {case}")

    def test_freshPoolDrawsInPlace(self):
        """
        A new session in a pool of 2,000 never-used accounts costs a draw or
        two, not a shuffle of the pool: the selection asks the hooks about
        the flagged accounts only, never picks a blocked, excluded or busy
        one, and spreads its picks over the pool.
        """
        rig = Rig([account(f"a{i}", concurrency=1) for i in range(2000)])
        draws = []
        real = rig.scheduler._random.randrange
        rig.scheduler._random.randrange = lambda *a: draws.append(a) or real(*a)
        blocked = {f"a{i}" for i in range(0, 2000, 2)}
        rig.blocks.blocked = {i: ("paused: by admin", 0) for i in blocked}
        picks = set()
        for n in range(30):
            del draws[:]
            rig.blocks.asked = 0
            result = rig.select(turn(), excluded=frozenset({"a1"}))
            self.assertNotIn(result[0], blocked | {"a1"})
            self.assertEqual(result[2], 999)
            self.assertLessEqual(len(draws), 40)
            self.assertLessEqual(rig.blocks.asked, 1100)
            picks.add(result[0])
        self.assertGreater(len(picks), 20)

    def test_reloadGivesNewIndex(self):
        """
        A new account set (a reload, an admin change) is selected from at
        once; an unchanged one keeps its index, also when it comes as a new
        tuple of the same accounts (then compared by identity again).
        """
        rig = Rig([account("a")])
        self.assertEqual(rig.select(turn())[0], "a")
        index = rig.scheduler._index
        rig.select(turn())
        self.assertIs(rig.scheduler._index, index)
        a = rig.registry.snapshot()[0]
        rig.registry.replace([a])
        rig.select(turn())
        self.assertIs(rig.scheduler._index, index)
        self.assertIs(index.accounts, rig.registry.snapshot())
        rig.registry.replace([account("b")])
        self.assertEqual(rig.select(turn())[0], "b")
        self.assertIsNot(rig.scheduler._index, index)

    def test_groupNarrowing(self):
        """
        Issue 22: a key's group narrows the index's candidates, and the
        count is of the group's eligible accounts only.
        """
        rig = Rig([account(f"a{i}") for i in range(10)])
        rig.blocks.blocked = {"a2": "paused: by admin"}
        result = rig.select(turn(allowedAccounts=frozenset({"a1", "a2", "a3"})))
        self.assertIn(result[0], {"a1", "a3"})
        self.assertEqual(result[2], 2)

    def test_quarantineFailOpenThroughIndex(self):
        """
        R41: every open account quarantined -> allowed anyway; one not
        quarantined (not flagged) -> the others stay out.
        """
        rig = Rig([account("a"), account("b")])
        rig.blocks.quarantined = {"a", "b"}
        self.assertEqual(rig.select(turn())[2], 2)
        rig.blocks.quarantined = {"a"}
        self.assertEqual(rig.select(turn())[:3], ("b", "load_balance", 1))

    def test_sameSnapshot(self):
        """
        L{sameSnapshot} is identity of the accounts, in order.
        """
        a, b = account("a"), account("b")
        index = PoolIndex((a, b))
        self.assertTrue(sameSnapshot(index, (a, b)))
        self.assertTrue(sameSnapshot(index, [a, b]))
        self.assertFalse(sameSnapshot(index, (b, a)))
        self.assertFalse(sameSnapshot(index, (a, account("b"))))
        self.assertFalse(sameSnapshot(None, (a,)))
