"""
Tests for L{relay.scheduling.scheduler.AccountScheduler} (behaviour.md group E,
R37-R46, R-B6, seed 003), against the real memory providers.
"""

from __future__ import annotations

import json

import random

from twisted.internet.defer import fail
from twisted.internet.task import Clock
from twisted.internet.testing import EventLoggingObserver
from twisted.logger import capturedLogs, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer_only
from zope.interface.verify import verifyObject

from relay.admission.memory import MemorySlotAdmission
from relay.interfaces import IAccountScheduler, IAccountStateView, IStateStore
from relay.base.records import Account, ClientKey, GatewaySettings, SchedulingSettings, Turn
from relay.scheduling.scheduler import (
    AccountScheduler,
    responseKey,
    responseOwnerKey,
    sessionKey,
)
from relay.scheduling.selection import NoAccountAvailable
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore

ALICE = ClientKey(name="alice", key="sk-alice")
BOB = ClientKey(name="bob", key="sk-bob")
HASH = "0123456789abcdef"


def account(id, type="apikey", **kw):
    """
    Build an L{Account} with test defaults.
    """
    return Account(id=id, type=type, base_url="https://api.example/v1", credential="c", **kw)


def turn(**kw):
    """
    Build an HTTP L{Turn} for model C{gpt-5} with test defaults.
    """
    values = dict(entrypoint="http", endpoint="responses", client=ALICE, model="gpt-5",
                  body={}, stream=True, requestId="req-1")
    values.update(kw)
    return Turn(**values)


@implementer_only(IStateStore, IAccountStateView)
class UnreadableStore(MemoryStateStore):
    """
    A memory store whose C{getValue} fails, like Redis when it is down (so
    it answers nothing at once: not an L{relay.interfaces.ISynchronousState}).
    """

    __slots__ = ()

    def getValue(self, key):
        """
        Fail every read (R35).
        """
        return fail(RuntimeError("redis down"))


class SchedulerMixin:
    """
    Builds a scheduler over the memory state store and slot admission.
    """

    def build(self, accounts, quarantined=(), extraBlock=None, seed=1, **scheduling):
        """
        Create C{self.clock}, C{self.store}, C{self.admission} and
        C{self.scheduler}.

        @param quarantined: account ids whose proxy is quarantined.
        """
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.store = MemoryStateStore(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)
        self.accounts = list(accounts)
        self.settings = RuntimeSettings(
            GatewaySettings(scheduling=SchedulingSettings(**scheduling))
        )
        self.scheduler = AccountScheduler(
            accounts=self.accounts, admission=self.admission, store=self.store,
            clock=self.clock, settings=self.settings, random=random.Random(seed),
            isQuarantined=lambda a: a.id in quarantined, extraBlock=extraBlock,
        )
        return self.scheduler

    def select(self, t, excluded=frozenset()):
        """
        Run a selection that must succeed.
        """
        return self.successResultOf(self.scheduler.select(t, excluded))

    def selectFails(self, t, excluded=frozenset()):
        """
        Run a selection that must fail; return its L{ClientError}.
        """
        failure = self.failureResultOf(self.scheduler.select(t, excluded), NoAccountAvailable)
        return failure.value.error

    def fill(self, accountId, count):
        """
        Hold C{count} slots of an account (limit ignored).
        """
        return [
            self.successResultOf(self.admission.tryAcquire("account", accountId, 0))
            for _ in range(count)
        ]

    def value(self, key):
        """
        Read a store value synchronously.
        """
        return self.successResultOf(self.store.getValue(key))

    def inUse(self, accountId):
        """
        Slots held on an account.
        """
        return self.successResultOf(self.admission.load("account", [accountId]))[accountId][0]

    def bindSession(self, accountId, hash=HASH):
        """
        Write a session binding.
        """
        self.successResultOf(self.store.setValue(sessionKey(hash), accountId, 3600))

    def ownResponse(self, responseId, accountId, client=ALICE):
        """
        Record a response owner through the scheduler (R39, R40).
        """
        self.successResultOf(self.scheduler.recordResponse(
            turn(client=client), responseId, next(a for a in self.accounts if a.id == accountId)
        ))


class InterfaceTests(SchedulerMixin, SynchronousTestCase):
    """
    The scheduler provides its interface.
    """

    def test_verifyObject(self):
        """
        L{AccountScheduler} provides L{IAccountScheduler}.
        """
        self.assertTrue(verifyObject(IAccountScheduler, self.build([account("a")])))


class SessionLayerTests(SchedulerMixin, SynchronousTestCase):
    """
    The session-hash layer (R38, R43 step 2, R45, seed 003).
    """

    def test_stickyHitLabelled(self):
        """
        R45 / seed 003: a session binding hit is recorded as
        C{session_hash} with C{sticky_session_hit} and the account filled in.
        """
        self.build([account("a"), account("b")])
        self.bindSession("b")
        sel = self.select(turn(sessionHash=HASH))
        self.assertEqual(sel.account.id, "b")
        self.assertIsNotNone(sel.lease)
        self.assertEqual(sel.record.layer, "session_hash")
        self.assertTrue(sel.record.sticky_session_hit)
        self.assertFalse(sel.record.sticky_previous_hit)
        self.assertEqual(sel.record.selected_account_id, "b")
        self.assertEqual(sel.record.selected_account_type, "apikey")

    def test_stickyHitWithBusyOthers(self):
        """
        R45 / seed 003: with load on the other accounts (the batch-load
        path) the hit is still C{session_hash}.
        """
        self.build([account("a"), account("b")])
        self.fill("a", 1)
        self.fill("b", 2)
        self.bindSession("b")
        sel = self.select(turn(sessionHash=HASH))
        self.assertEqual((sel.account.id, sel.record.layer), ("b", "session_hash"))
        self.assertTrue(sel.record.sticky_session_hit)

    def test_missIsLoadBalanceAndBinds(self):
        """
        R43 step 3.6: without a binding the load-balance choice is
        recorded as C{load_balance}, with the account filled in, and its
        binding is written.
        """
        self.build([account("a")])
        sel = self.select(turn(sessionHash=HASH))
        self.assertEqual(sel.record.layer, "load_balance")
        self.assertFalse(sel.record.sticky_session_hit)
        self.assertEqual(sel.record.selected_account_id, "a")
        self.assertEqual(self.value(sessionKey(HASH)), "a")

    def test_hitRefreshesTtl(self):
        """
        R38: a hit refreshes the binding's TTL.
        """
        self.build([account("a")], sticky_session_ttl_seconds=100)
        self.successResultOf(self.store.setValue(sessionKey(HASH), "a", 100))
        self.clock.advance(90)
        sel = self.select(turn(sessionHash=HASH))
        sel.lease.release()
        self.clock.advance(90)
        self.assertEqual(self.value(sessionKey(HASH)), "a")

    def test_unschedulableBindingDeleted(self):
        """
        R38: a binding whose account is unschedulable is deleted and load
        balance picks another account.
        """
        self.build([account("a"), account("b")])
        self.bindSession("a")
        self.successResultOf(self.store.markAccount(
            "a", "temp_unschedulable", self.clock.seconds() + 60, "x"))
        sel = self.select(turn(sessionHash=HASH))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(sel.record.layer, "load_balance")
        self.assertEqual(self.value(sessionKey(HASH)), "b")

    def test_quarantinedBindingKept(self):
        """
        R38, issue 8: a bound account whose proxy is quarantined is skipped
        for this request but the binding is neither deleted nor rewritten.
        """
        self.build([account("a"), account("b")], quarantined={"a"})
        self.bindSession("a")
        t = turn(sessionHash=HASH)
        sel = self.select(t)
        self.assertEqual(sel.account.id, "b")
        self.successResultOf(self.scheduler.bind(t, sel.account))
        self.assertEqual(self.value(sessionKey(HASH)), "a")

    def test_excludedBindingKept(self):
        """
        R43 step 2: an excluded bound account is skipped for this turn.
        """
        self.build([account("a"), account("b")])
        self.bindSession("a")
        sel = self.select(turn(sessionHash=HASH), frozenset(["a"]))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(sel.record.excluded_count, 1)

    def test_storeErrorFailsOpen(self):
        """
        R35: a sticky read error counts as no binding.
        """
        self.build([account("a")])
        self.store.__class__ = UnreadableStore
        sel = self.select(turn(sessionHash=HASH))
        self.assertEqual(sel.record.layer, "load_balance")
        self.flushLoggedErrors()

    def test_bindAndUnbind(self):
        """
        R38, R72: L{bind} writes the binding with the configured TTL and
        L{unbind} deletes it.
        """
        self.build([account("a")], sticky_session_ttl_seconds=50)
        t = turn(sessionHash=HASH)
        self.successResultOf(self.scheduler.bind(t, self.accounts[0]))
        self.assertEqual(self.value(sessionKey(HASH)), "a")
        self.clock.advance(51)
        self.assertIsNone(self.value(sessionKey(HASH)))
        self.successResultOf(self.scheduler.bind(t, self.accounts[0]))
        self.successResultOf(self.scheduler.unbind(t))
        self.assertIsNone(self.value(sessionKey(HASH)))


class StickyBusyTests(SchedulerMixin, SynchronousTestCase):
    """
    A busy bound account (R43 step 2, R-B6, sub2api #6992).
    """

    def setUp(self):
        self.build([account(i, concurrency=2) for i in "abcd"])
        self.bindSession("a")
        self.held = self.fill("a", 2)

    def test_spreadToIdleAccounts(self):
        """
        R-B6 / #6992: concurrent HTTP turns of one session whose bound
        account A is busy go to the idle B, C and D, not into A's queue,
        and the binding still names A afterwards.
        """
        turns = [turn(sessionHash=HASH, requestId=f"r{i}") for i in range(6)]
        selections = [self.select(t) for t in turns]
        chosen = [s.account.id for s in selections]
        self.assertNotIn("a", chosen)
        self.assertEqual(set(chosen), {"b", "c", "d"})
        for s in selections:
            self.assertIsNotNone(s.lease)
            self.assertEqual(s.record.layer, "load_balance")
            self.assertFalse(s.record.sticky_session_hit)
            self.assertTrue(s.record.sticky_busy_bypass)
        for s, t in zip(selections, turns):
            self.successResultOf(self.scheduler.bind(t, s.account))
        self.assertEqual(self.value(sessionKey(HASH)), "a")

    def test_bindSkippedAfterBypass(self):
        """
        R-B6: L{bind} after a bypass selection leaves the binding on A.
        """
        t = turn(sessionHash=HASH)
        sel = self.select(t)
        self.successResultOf(self.scheduler.bind(t, sel.account))
        self.assertEqual(self.value(sessionKey(HASH)), "a")

    def test_noIdleThenStickyWait(self):
        """
        R43 step 2 / R-B6: with no idle account, a movable turn gets the
        sticky wait plan on A, still as a session hit.
        """
        for other in "bcd":
            self.fill(other, 2)
        sel = self.select(turn(sessionHash=HASH))
        self.assertIsNone(sel.lease)
        self.assertEqual(sel.account.id, "a")
        self.assertEqual(sel.waitPlan.plan, "sticky")
        self.assertEqual(sel.waitPlan.timeout, 120)
        self.assertEqual(sel.waitPlan.max_waiting, 3)
        self.assertEqual(sel.waitPlan.max_concurrency, 2)
        self.assertEqual(sel.record.layer, "session_hash")
        self.assertTrue(sel.record.sticky_session_hit)
        self.assertEqual(sel.record.wait_plan, "sticky")

    def test_stickyQueueFullFallsThrough(self):
        """
        R43 step 2: when A's queue holds C{sticky_session_max_waiting}
        waiters the turn falls to load balance (here the fallback plan),
        keeping the binding on A.
        """
        for other in "bcd":
            self.fill(other, 2)
        plan = self.select(turn(sessionHash=HASH)).waitPlan
        for _ in range(3):
            self.admission.acquire(plan, turn().cancel)
        t = turn(sessionHash=HASH)
        sel = self.select(t)
        self.assertEqual(sel.record.layer, "load_balance")
        self.assertFalse(sel.record.sticky_session_hit)
        self.assertEqual(sel.waitPlan.plan, "fallback")
        self.assertNotEqual(sel.account.id, "a")
        self.successResultOf(self.scheduler.bind(t, sel.account))
        self.assertEqual(self.value(sessionKey(HASH)), "a")

    def test_wsLaterTurnNotMovable(self):
        """
        R-B6: a WebSocket later turn keeps its bounded wait on A.
        """
        sel = self.select(turn(entrypoint="ws", phase="later_turn", sessionHash=HASH))
        self.assertEqual(sel.account.id, "a")
        self.assertEqual(sel.waitPlan.plan, "sticky")
        self.assertEqual(sel.record.layer, "session_hash")
        self.assertTrue(sel.record.sticky_session_hit)

    def test_wsFirstTurnMovable(self):
        """
        R-B6: a WebSocket first turn without a chain id may move.
        """
        sel = self.select(turn(entrypoint="ws", phase="first_turn", sessionHash=HASH))
        self.assertNotEqual(sel.account.id, "a")
        self.assertTrue(sel.record.sticky_busy_bypass)

    def test_incompleteHistoryNotMovable(self):
        """
        R-B6 / R46: a turn whose history is incomplete waits on A.
        """
        sel = self.select(turn(sessionHash=HASH, historyComplete=False))
        self.assertEqual((sel.account.id, sel.waitPlan.plan), ("a", "sticky"))


class PreviousResponseTests(SchedulerMixin, SynchronousTestCase):
    """
    The C{previous_response_id} layer (R39-R42, seed 003).
    """

    def test_routesToOwner(self):
        """
        R41 / seed 003: a continuation goes to the owning account, labelled
        C{previous_response_id} with C{sticky_previous_hit}, and the
        session binding is written too.
        """
        self.build([account("a"), account("b"), account("c")])
        self.ownResponse("resp_1", "c")
        self.bindSession("a")
        sel = self.select(turn(previousResponseId="resp_1", sessionHash=HASH))
        self.assertEqual(sel.account.id, "c")
        self.assertIsNotNone(sel.lease)
        self.assertEqual(sel.record.layer, "previous_response_id")
        self.assertTrue(sel.record.sticky_previous_hit)
        self.assertFalse(sel.record.sticky_session_hit)
        self.assertEqual(self.value(sessionKey(HASH)), "c")

    def test_recordResponseKeys(self):
        """
        R39, R40: L{recordResponse} writes the owner account and owner key
        under sha256 keys with the configured TTL.
        """
        self.build([account("a")], previous_response_ttl_seconds=10)
        self.ownResponse("resp_1", "a")
        self.assertEqual(self.value(responseKey("resp_1")), "a")
        self.assertEqual(json.loads(self.value(responseOwnerKey("resp_1"))),
                         {"key": "alice", "account": "a"})
        self.assertIn(":response:", responseKey("resp_1"))
        self.clock.advance(11)
        self.assertIsNone(self.value(responseKey("resp_1")))

    def test_ownerNotConfiguredHere(self):
        """
        Issue 14 (the chaos soak): an owner this process does not have (an
        account only another relay has, or one a reload removed) falls
        through to normal selection and says so, like any skipped owner.
        """
        self.build([account("a"), account("b")])
        self.successResultOf(self.store.setValue(responseKey("resp_1"), "gone", 3600))
        self.successResultOf(self.store.setValue(responseOwnerKey("resp_1"), "alice", 3600))
        with capturedLogs() as logs:
            sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.record.layer, "load_balance")
        skipped = [e for e in logs if e.get("event") == "openai.previous_response_owner_skipped"]
        self.assertEqual([(e["account_id"], e["reason"]) for e in skipped],
                         [("gone", "not_configured")])

    def test_ownerBusyStickyWait(self):
        """
        R41: a busy owner gives the sticky wait plan, still a previous hit.
        """
        self.build([account("a", concurrency=1), account("b")])
        self.ownResponse("resp_1", "a")
        self.fill("a", 1)
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual((sel.account.id, sel.waitPlan.plan), ("a", "sticky"))
        self.assertEqual(sel.record.layer, "previous_response_id")
        self.assertTrue(sel.record.sticky_previous_hit)

    def test_ownerExcluded(self):
        """
        R41 step 1 / seed 003: an excluded owner is dropped and normal
        selection runs.
        """
        self.build([account("a"), account("b")])
        self.ownResponse("resp_1", "a")
        sel = self.select(turn(previousResponseId="resp_1"), frozenset(["a"]))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(sel.record.layer, "load_balance")
        self.assertFalse(sel.record.sticky_previous_hit)

    def test_ownerModelNotServed(self):
        """
        R41 / seed 003: an owner that does not serve the model after
        mapping is incompatible: no slot stays taken and selection falls
        back.
        """
        self.build([
            account("a", models=("gpt-4",)),
            account("b", models=("gpt-5",)),
        ])
        self.ownResponse("resp_1", "a")
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "b")
        self.assertFalse(sel.record.sticky_previous_hit)
        self.assertEqual(self.inUse("a"), 0)

    def test_ownerMappedModelServed(self):
        """
        R41: compatibility is judged after model mapping.
        """
        self.build([
            account("a", models=("gpt-5-upstream",), model_mapping={"gpt-5": "gpt-5-upstream"}),
            account("b"),
        ])
        self.ownResponse("resp_1", "a")
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "a")

    def test_ownerQuarantined(self):
        """
        R41 / seed 003: an owner whose proxy is quarantined is skipped,
        its slot load stays 0, and another account is chosen.
        """
        self.build([account("a"), account("b")], quarantined={"a"})
        self.ownResponse("resp_1", "a")
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(self.inUse("a"), 0)

    def test_ownerBlockedAfterAcquireReleased(self):
        """
        R41 / seed 003: an owner that becomes blocked while its slot is
        being taken is released and selection falls back.
        """
        calls = []

        def extraBlock(acct, now, model):
            if acct.id == "a":
                calls.append(1)
                return "breaker_open" if len(calls) > 1 else None
            return None

        self.build([account("a"), account("b")], extraBlock=extraBlock)
        self.ownResponse("resp_1", "a")
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(self.inUse("a"), 0)

    def test_everyProxyQuarantinedFailsOpen(self):
        """
        R41 / seed 003: when every candidate's proxy is quarantined the
        owner is used anyway.
        """
        self.build([account("a"), account("b")], quarantined={"a", "b"})
        self.ownResponse("resp_1", "a")
        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "a")
        self.assertTrue(sel.record.sticky_previous_hit)
        events = [e.get("event") for e in logged]
        self.assertIn("openai.proxy_quarantine_fail_open", events)
        self.assertIn("openai.previous_response_owner_fail_open", events)

    def test_ownerUnschedulableDeletesBinding(self):
        """
        R41 step 2: an unschedulable owner's response binding is deleted.
        """
        self.build([account("a"), account("b")])
        self.ownResponse("resp_1", "a")
        self.successResultOf(self.store.markAccount("a", "disabled", 0, "x"))
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "b")
        self.assertIsNone(self.value(responseKey("resp_1")))

    def test_oauthHttpContinuation(self):
        """
        R42: an HTTP continuation never lands on an OAuth account, even its
        owner; an API-key account is chosen instead.
        """
        self.build([account("o", type="oauth", priority=1), account("k", priority=99)])
        self.ownResponse("resp_1", "o")
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "k")

    def test_oauthHttpContinuationNothingLeft(self):
        """
        R42: with only OAuth accounts an HTTP continuation fails 400.
        """
        self.build([account("o", type="oauth")])
        self.ownResponse("resp_1", "o")
        error = self.selectFails(turn(previousResponseId="resp_1"))
        self.assertEqual(error.status, 400)
        self.assertEqual(
            error.message,
            "previous_response_id requires an OpenAI API-key account for HTTP requests",
        )

    def test_oauthWebSocketContinuation(self):
        """
        R41: a WebSocket continuation may use its OAuth owner.
        """
        self.build([account("o", type="oauth"), account("k")])
        self.ownResponse("resp_1", "o")
        sel = self.select(turn(entrypoint="ws", phase="first_turn", previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "o")
        self.assertEqual(sel.record.selected_account_type, "oauth")

    def test_messageId(self):
        """
        R40: a C{msg_*} id is refused with 400, and closes 1008 on the
        WebSocket.
        """
        self.build([account("a")])
        message = "previous_response_id must be a response.id (resp_*), not a message id"
        error = self.selectFails(turn(previousResponseId="msg_1"))
        self.assertEqual((error.status, error.message, error.wsClose), (400, message, None))
        error = self.selectFails(turn(entrypoint="ws", previousResponseId="msg_1"))
        self.assertEqual(error.wsClose, (1008, message))

    def test_foreignOwner(self):
        """
        R40: an HTTP continuation of another key's response is refused.
        """
        self.build([account("a")])
        self.ownResponse("resp_1", "a", client=BOB)
        error = self.selectFails(turn(previousResponseId="resp_1"))
        self.assertEqual(error.status, 400)
        self.assertEqual(error.message, "previous_response_id is not available for this user")

    def test_ownerKnownLocallyWhenStoreFails(self):
        """
        R39, R35: the local owner map answers when the store read fails.
        """
        self.build([account("a"), account("b")])
        self.ownResponse("resp_1", "b")
        self.store.__class__ = UnreadableStore
        sel = self.select(turn(previousResponseId="resp_1"))
        self.assertEqual(sel.account.id, "b")
        self.flushLoggedErrors()


class ModelAndErrorTests(SchedulerMixin, SynchronousTestCase):
    """
    Errors when nothing qualifies (R44, R79, seed 003).
    """

    def test_modelNotServedBeforeRouting(self):
        """
        R44 / seed 003: a model no account serves fails 404
        C{model_not_found} before any routing (no slot taken, even on the
        response owner).
        """
        self.build([account("a", models=("gpt-4",))])
        self.ownResponse("resp_1", "a")
        error = self.selectFails(turn(previousResponseId="resp_1"))
        self.assertEqual(error.status, 404)
        self.assertEqual(error.code, "model_not_found")
        self.assertEqual(error.type, "invalid_request_error")
        self.assertEqual(
            error.message, "The model `gpt-5` does not exist or you do not have access to it."
        )
        self.assertEqual(self.inUse("a"), 0)

    def test_modelNotServedWebSocket(self):
        """
        R79: on the WebSocket an unknown model is a status-400 error event
        and the connection stays open.
        """
        self.build([account("a", models=("gpt-4",))])
        error = self.selectFails(turn(entrypoint="ws"))
        self.assertEqual((error.status, error.code, error.wsClose), (400, "model_not_found", None))

    def test_allExcluded(self):
        """
        R44: nothing left → 503; WebSocket closes 1013.
        """
        self.build([account("a")])
        error = self.selectFails(turn(), frozenset(["a"]))
        self.assertEqual((error.status, error.type), (503, "api_error"))
        self.assertEqual(error.message, "Service temporarily unavailable")
        error = self.selectFails(turn(entrypoint="ws"), frozenset(["a"]))
        self.assertEqual(error.wsClose, (1013, "no available account"))

    def test_allRateLimited(self):
        """
        R44 + R83: every candidate rate-limited → 429 with C{Retry-After} =
        whole seconds until the earliest reset, and a message naming the
        class, the count, the model and that time.
        """
        self.build([account("a"), account("b")])
        now = self.clock.seconds()
        self.successResultOf(self.store.markAccount("a", "rate_limited", now + 60, "x"))
        self.successResultOf(self.store.markAccount("b", "rate_limited", now + 41.5, "x"))
        error = self.selectFails(turn())
        self.assertEqual((error.status, error.type), (429, "rate_limit_error"))
        self.assertEqual(error.headers, (("Retry-After", "42"),))
        self.assertEqual(
            error.message,
            "All 2 accounts for gpt-5 are rate-limited; the earliest is available in 42 s",
        )

    def test_allCoolingR83(self):
        """
        R83: every candidate blocked for mixed reasons (a model block, an
        in-memory breaker, a cooldown) → 503 with the earliest end as
        C{Retry-After} and the classes counted; the WebSocket closes 1013 with
        the same text; the log line lists each account's reason.
        """
        now = 1_000_000 + 0.0
        self.build(
            [account("a"), account("b"), account("c")],
            extraBlock=lambda a, t, m: (
                ("transport circuit open", t + 120) if a.id == "b" else None
            ),
        )
        self.successResultOf(self.store.markAccount("a", "model_block", now + 45, "streak",
                                                    model="gpt-5"))
        self.successResultOf(self.store.markAccount("c", "rate_limited", now + 300, "x"))
        logs = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        error = self.selectFails(turn())
        self.assertEqual((error.status, error.type), (503, "api_error"))
        self.assertEqual(error.headers, (("Retry-After", "45"),))
        self.assertEqual(
            error.message,
            "None of the 3 accounts for gpt-5 is available (2 cooling down, 1 rate-limited);"
            " the earliest is available in 45 s",
        )
        lines = [e for e in logs if e.get("event") == "openai.account_select_no_available"]
        self.assertEqual(len(lines), 1)
        for aid in "abc":
            self.assertIn(aid + ": ", lines[0]["accounts"])
        # Times inside the text are ISO-8601 UTC, like every message's.
        self.assertIn("a: model_blocked until 1970-01-12T13:47:25.000Z", lines[0]["accounts"])
        self.assertIn("c: rate_limited until 1970-01-12T13:51:40.000Z", lines[0]["accounts"])
        ws = self.selectFails(turn(entrypoint="ws"))
        self.assertEqual(ws.wsClose, (1013, error.message))

    def test_disabledOnlyHasNoRetryAfter(self):
        """
        R83: when no end time is known (disabled accounts) C{Retry-After} is
        omitted.
        """
        self.build([account("a")])
        self.successResultOf(self.store.markAccount("a", "disabled", 0, "401"))
        error = self.selectFails(turn())
        self.assertEqual(error.status, 503)
        self.assertEqual(error.headers, ())
        self.assertEqual(error.message, "The only account for gpt-5 is disabled")

    def test_pausedNamedPausedR83(self):
        """
        R83: an account an operator paused is named as paused in the answer
        (and so in the C{pool_exhausted} alert), not as cooling down; no end
        time is known, so no C{Retry-After}.
        """
        self.build([account("a"), account("b")],
                   extraBlock=lambda a, now, model: ("paused: upstream 503s", 0))
        error = self.selectFails(turn())
        self.assertEqual((error.status, error.headers), (503, ()))
        self.assertEqual(error.message, "All 2 accounts for gpt-5 are paused")

    def test_modelBlock(self):
        """
        R11 via R43 step 3.1: a model block applies to the mapped model.
        """
        self.build([account("a"), account("b")])
        self.successResultOf(self.store.markAccount(
            "a", "model_block", self.clock.seconds() + 60, "x", model="gpt-5"))
        self.assertEqual(self.select(turn()).account.id, "b")

    def test_extraBlock(self):
        """
        The C{extraBlock} hook removes an account (e.g. an open breaker).
        """
        self.build([account("a", priority=1), account("b")],
                   extraBlock=lambda a, now, model: ("breaker", now + 5) if a.id == "a" else None)
        self.assertEqual(self.select(turn()).account.id, "b")

    def test_quarantinedSkippedUnlessAll(self):
        """
        Issue 8 / R41: quarantined proxies are skipped while another
        candidate exists, and allowed when all are quarantined.
        """
        self.build([account("a", priority=1), account("b")], quarantined={"a"})
        self.assertEqual(self.select(turn()).account.id, "b")
        self.build([account("a")], quarantined={"a"})
        self.assertEqual(self.select(turn()).account.id, "a")


class LoadBalanceTests(SchedulerMixin, SynchronousTestCase):
    """
    The load-balance and fallback layers (R28, R43 steps 3-4).
    """

    def test_priorityFirst(self):
        """
        R43 step 3.4: lower priority number wins.
        """
        self.build([account("a", priority=50), account("b", priority=10)])
        self.assertEqual(self.select(turn()).account.id, "b")

    def test_loadRateThenPriority(self):
        """
        R43 step 3.4: equal priority → lower load rate wins; an account at
        100 % is skipped even with a better priority.
        """
        self.build([account("a", concurrency=4), account("b", concurrency=4),
                    account("c", concurrency=1, priority=1)])
        self.fill("a", 2)
        self.fill("b", 1)
        self.fill("c", 1)
        sel = self.select(turn())
        self.assertEqual(sel.account.id, "b")
        self.assertGreater(sel.record.load_skew, 0)
        self.assertEqual(sel.record.candidate_count, 3)

    def test_unlimitedConcurrencyZeroLoad(self):
        """
        R27, R28: concurrency <= 0 is unlimited and has load rate 0.
        """
        self.build([account("a", concurrency=0), account("b", concurrency=2)])
        self.fill("a", 50)
        self.fill("b", 1)
        self.assertEqual(self.select(turn()).account.id, "a")

    def test_leastRecentlyUsed(self):
        """
        R43 step 3.4: with equal priority and load, the least recently
        used (never used first) wins.
        """
        self.build([account("a"), account("b"), account("c")])
        order = []
        for _ in range(3):
            sel = self.select(turn())
            order.append(sel.account.id)
            sel.lease.release()
            self.clock.advance(1)
        self.assertEqual(sorted(order), ["a", "b", "c"])
        sel = self.select(turn())
        self.assertEqual(sel.account.id, order[0])

    def test_randomTies(self):
        """
        R43 step 3.5: ties are shuffled with the injected random, so
        different seeds spread first picks.
        """
        firsts = set()
        for seed in range(20):
            self.build([account(i) for i in "abcd"], seed=seed)
            firsts.add(self.select(turn()).account.id)
        self.assertGreater(len(firsts), 1)
        self.build([account(i) for i in "abcd"], seed=7)
        first = self.select(turn()).account.id
        self.build([account(i) for i in "abcd"], seed=7)
        self.assertEqual(self.select(turn()).account.id, first)

    def test_fallbackWaitPlan(self):
        """
        R43 step 4, R28: every account busy → the fallback plan (30 s /
        100) on the best account by priority, labelled C{load_balance}.
        """
        self.build([account("a", concurrency=1), account("b", concurrency=1, priority=1)])
        self.fill("a", 1)
        self.fill("b", 1)
        sel = self.select(turn())
        self.assertIsNone(sel.lease)
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(sel.waitPlan.plan, "fallback")
        self.assertEqual((sel.waitPlan.timeout, sel.waitPlan.max_waiting), (30, 100))
        self.assertEqual(sel.record.layer, "load_balance")
        self.assertEqual(sel.record.wait_plan, "fallback")
        self.assertEqual(sel.record.top_k, 1)

    def test_fallbackSkipsFullQueue(self):
        """
        R28: the fallback prefers an account whose queue has room.
        """
        self.build([account("a", concurrency=1, priority=1), account("b", concurrency=1)],
                   fallback_max_waiting=1)
        self.fill("a", 1)
        self.fill("b", 1)
        plan = self.select(turn()).waitPlan
        self.assertEqual(plan.id, "a")
        self.admission.acquire(plan, turn().cancel)
        self.assertEqual(self.select(turn()).waitPlan.id, "b")

    def test_settingsReadEachCall(self):
        """
        R74: a live settings change applies to the next selection.
        """
        self.build([account("a", concurrency=1)])
        self.fill("a", 1)
        self.assertEqual(self.select(turn()).waitPlan.timeout, 30)
        self.settings.current = GatewaySettings(
            scheduling=SchedulingSettings(fallback_wait_timeout=5))
        self.assertEqual(self.select(turn()).waitPlan.timeout, 5)


class PreferredAccountTests(SchedulerMixin, SynchronousTestCase):
    """
    A WebSocket later turn's preferred account.
    """

    def test_preferredBound(self):
        """
        R45: the connection's account, when it is the bound one, is a
        C{session_hash} hit.
        """
        self.build([account("a"), account("b")])
        self.bindSession("b")
        sel = self.select(turn(entrypoint="ws", phase="later_turn", sessionHash=HASH,
                               preferredAccountId="b"))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(sel.record.layer, "session_hash")
        self.assertTrue(sel.record.sticky_session_hit)
        self.assertTrue(sel.record.preferred_account_hit)

    def test_preferredNotBound(self):
        """
        R45: a preferred account that is not the bound one is not reported
        as a session hit.
        """
        self.build([account("a"), account("b")])
        sel = self.select(turn(entrypoint="ws", phase="later_turn", preferredAccountId="b"))
        self.assertEqual(sel.account.id, "b")
        self.assertEqual(sel.record.layer, "load_balance")
        self.assertFalse(sel.record.sticky_session_hit)
        self.assertTrue(sel.record.preferred_account_hit)

    def test_preferredNotServingModel(self):
        """
        R79: a preferred account that does not serve the model is
        reselected away from.
        """
        self.build([account("a", models=("gpt-4",)), account("b")])
        sel = self.select(turn(entrypoint="ws", phase="later_turn", preferredAccountId="a"))
        self.assertEqual(sel.account.id, "b")


class DecisionLogTests(SchedulerMixin, SynchronousTestCase):
    """
    The C{openai.account_schedule_decision} event (R45).
    """

    def test_oneEventWithAllFields(self):
        """
        R45: every selection logs exactly one
        C{openai.account_schedule_decision} event (at info, so the report and
        the seed-003 tables can read it) with every record field, the request
        id and the entrypoint.
        """
        self.build([account("a"), account("b")])
        self.bindSession("a")
        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.select(turn(sessionHash=HASH, requestId="req-9"))
        events = [e for e in logged if e.get("event") == "openai.account_schedule_decision"]
        self.assertEqual(len(events), 1)
        event = events[0]
        self.assertEqual(event["log_level"].name, "info")
        for name in ("layer", "sticky_session_hit", "sticky_previous_hit",
                     "selected_account_id", "selected_account_type", "candidate_count",
                     "excluded_count", "wait_plan", "latency_ms", "load_skew", "top_k"):
            self.assertIn(name, event)
        self.assertEqual(event["layer"], "session_hash")
        self.assertTrue(event["sticky_session_hit"])
        self.assertEqual(event["selected_account_id"], "a")
        self.assertEqual(event["request_id"], "req-9")
        self.assertEqual(event["entrypoint"], "http")
        self.assertEqual(event["latency_ms"], 0.0)

    def test_eventFieldsAreTheRecords(self):
        """
        Issue 24: the event's record fields are the returned record's, with
        the same values, in L{DecisionRecord}'s field order, after the
        request id and the entrypoint.
        """
        from attrs import asdict

        self.build([account("a"), account("b")])
        logged = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        sel = self.select(turn(requestId="req-10"))
        [event] = [e for e in logged if e.get("event") == "openai.account_schedule_decision"]
        record = asdict(sel.record)
        own = [k for k in event if not k.startswith("log_")]
        expected = ["event", "request_id", "entrypoint"] + list(record)
        # (Twisted's legacy bridge adds its keys after them.)
        self.assertEqual(own[:len(expected)], expected)
        self.assertEqual({k: event[k] for k in record}, record)
