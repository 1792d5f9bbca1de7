"""
Tests for explain (issue 22 item 5): L{AccountScheduler.preview}, the dry
run of the selection code, agrees with the real decision that follows it
(account, layer, slot or wait plan) in every layer, admits nothing and
writes nothing; L{Explainer} says for every other account why not.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from relay.entry.http import KeyRing
from relay.scheduling.scheduler import DRY_LEASE, sessionKey
from relay.scheduling.session import sessionHash
from relay.console.explain import Explainer
from tests.tenantsrig import TenantsRig, account, key
from tests.test_runner import T0


class PreviewAgreesTests(SynchronousTestCase):
    """
    For each situation: preview, then the real selection; they name the
    same account, layer and wait plan, and the preview changed nothing.
    """

    def agree(self, rig, turn):
        store = dict(rig.store._values) if hasattr(rig.store, "_values") else None
        lastUsed = dict(rig.scheduler._balancer._lastUsed)
        preview = self.successResultOf(rig.scheduler.preview(turn))
        self.assertEqual(rig.scheduler._balancer._lastUsed, lastUsed, "the preview touched last-used")
        if store is not None:
            self.assertEqual(rig.store._values, store, "the preview wrote the store")
        ids = [a.id for a in rig.live.accounts]
        loads = rig.load(*ids)
        real = []
        d = rig.scheduler.select(turn, frozenset())
        d.addBoth(real.append)
        [real] = real
        if preview.selection is None:
            self.assertEqual(real.value.error.status, preview.error.status)
            self.assertEqual(real.value.error.message, preview.error.message)
            return preview, None
        self.assertEqual(loads, {i: (0, 0) for i in ids} if not self.busy else loads)
        self.assertEqual(preview.selection.account.id, real.account.id)
        self.assertEqual(preview.selection.record.layer, real.record.layer)
        self.assertEqual(preview.selection.waitPlan, real.waitPlan)
        self.assertEqual(preview.selection.lease is DRY_LEASE, real.lease is not None)
        if real.lease is not None:
            real.lease.release()
        return preview, real

    busy = False

    def test_priority(self):
        rig = TenantsRig([account("a", priority=2), account("b", priority=1)])
        preview, real = self.agree(rig, rig.turn(key()))
        self.assertEqual(real.account.id, "b")

    def test_ties_are_predicted(self):
        """
        Equal accounts: the preview breaks the tie with a copy of the
        shuffle's state, so it names the account the next selection picks,
        every time.
        """
        rig = TenantsRig([account(i, priority=1) for i in "abcdef"])
        chosen = set()
        for n in range(12):
            rig.clock.advance(1)
            _, real = self.agree(rig, rig.turn(key()))
            chosen.add(real.account.id)
        self.assertGreater(len(chosen), 1)

    def test_session_binding(self):
        rig = TenantsRig([account("a", priority=1), account("b", priority=2)])
        client = key()
        turn = rig.turn(client, sessionHash=sessionHash("s1", client.name))
        self.successResultOf(rig.store.setValue(sessionKey(turn.sessionHash), "b", 60))
        preview, real = self.agree(rig, turn)
        self.assertEqual((real.account.id, real.record.layer), ("b", "session_hash"))

    def test_busy_fallback_plan(self):
        """
        Every slot taken: both wait on the same account with the fallback
        plan.
        """
        self.busy = True
        rig = TenantsRig([account("a", concurrency=1), account("b", concurrency=1)])
        held = [self.successResultOf(rig.admission.tryAcquire("account", i, 1)) for i in "ab"]
        preview, real = self.agree(rig, rig.turn(key()))
        self.assertEqual(real.waitPlan.plan, "fallback")
        for lease in held:
            lease.release()

    def test_blocked_and_group(self):
        """
        A rate-limited account and the key's group narrow the choice the
        same way for both; with the whole group blocked both give the
        group's R83 answer.
        """
        rig = TenantsRig([account("pro", priority=0), account("c1", priority=1),
                          account("c2", priority=2)], groups={"g": ("c1", "c2")})
        self.successResultOf(rig.store.markAccount("c1", "rate_limited", T0 + 40,
                                                   "rate_limited"))
        client = key(group="g")
        turn = rig.turn(client, allowedAccounts=rig.policy.allowedAccounts(client))
        _, real = self.agree(rig, turn)
        self.assertEqual(real.account.id, "c2")
        self.successResultOf(rig.store.markAccount("c2", "rate_limited", T0 + 20,
                                                   "rate_limited"))
        preview, _ = self.agree(rig, turn)
        self.assertEqual(preview.error.status, 429)

    def test_previous_response_owner(self):
        rig = TenantsRig([account("a", priority=1), account("b", priority=2)])
        client = key()
        first = rig.turn(client)
        self.successResultOf(rig.scheduler.recordResponse(first, "resp_9", rig.live.accounts[1]))
        _, real = self.agree(rig, rig.turn(client, previousResponseId="resp_9"))
        self.assertEqual((real.account.id, real.record.layer), ("b", "previous_response_id"))


class ExplainerTests(SynchronousTestCase):
    """
    L{Explainer.explain}: the decision, the key policy, and a reason for
    every account; then a real turn lands where it said.
    """

    def setUp(self):
        self.rig = TenantsRig(
            [account("pro", priority=0), account("c1", priority=1, concurrency=1),
             account("c2", priority=2, models=("o3",)), account("c3", priority=3)],
            groups={"g": ("c1", "c2", "c3")})
        self.client = key(group="g", rpm=10)
        self.explainer = Explainer(
            clock=self.rig.clock, scheduler=self.rig.scheduler, keys=KeyRing([self.client]),
            accounts=self.rig.live.accounts, policy=self.rig.policy,
            admission=self.rig.admission, ledger=self.rig.ledger, settings=self.rig.settings)

    def explain(self, **kw):
        return self.successResultOf(Deferred.fromCoroutine(
            self.explainer.explain(self.client, kw.pop("model", "gpt-5.5"), **kw)))

    def test_why_not(self):
        """
        C{c1} would serve; C{pro} is outside the group, C{c2} does not serve
        the model, C{c3} loses on priority; then C{c1} busy and cooling
        change the answer, and the real turn agrees each time.
        """
        answer = self.explain()
        self.assertEqual(answer["decision"]["account"], "c1")
        self.assertEqual(answer["decision"]["slot"], "free")
        self.assertIsNone(answer["refused"])
        self.assertEqual(answer["rate"]["rpm"], 10)
        why = {row["id"]: row["verdict"] for row in answer["accounts"]}
        self.assertEqual(why, {"pro": "not_in_group", "c1": "chosen",
                               "c2": "model_not_served", "c3": "candidate"})
        c3 = next(r for r in answer["accounts"] if r["id"] == "c3")
        self.assertEqual(c3["why"], "lower priority (3 > 1)")
        self.assertEqual(self.rig.load("c1"), {"c1": (0, 0)})
        self.assertEqual(self.successResultOf(self.rig.limiter.peek("bob", 10, None)).requests, 0)

        _, outcome = self.rig.go(self.rig.turn(self.client, requestId="r1"))
        self.assertEqual(self.rig.records()[-1].account, answer["decision"]["account"])

        held = self.successResultOf(self.rig.admission.tryAcquire("account", "c1", 1))
        answer = self.explain()
        rows = {row["id"]: row for row in answer["accounts"]}
        self.assertEqual(answer["decision"]["account"], "c3")
        self.assertIn("slots full (1/1 in use", rows["c1"]["why"])
        held.release()

        self.successResultOf(self.rig.store.markAccount("c1", "rate_limited", T0 + 90,
                                                        "rate_limited"))
        answer = self.explain()
        rows = {row["id"]: row for row in answer["accounts"]}
        self.assertEqual(rows["c1"]["verdict"], "unschedulable: rate_limited")
        self.assertEqual(rows["c1"]["until"], T0 + 90)
        self.rig.go(self.rig.turn(self.client, requestId="r2"))
        self.assertEqual(self.rig.records()[-1].account, answer["decision"]["account"])

    def test_policy_refusal_said(self):
        """
        A model the key may not use: C{refused} says what the turn would
        get.
        """
        self.client = key(group="g", models=("o3",))
        answer = self.explain()
        self.assertEqual((answer["refused"]["status"], answer["refused"]["code"]),
                         (403, "model_not_found"))


class ExplainHealthTests(SynchronousTestCase):
    """
    Explain names recent failures: an account that failed 7 times and whose
    cooldown lapsed is chosen only with a warning saying it is failing.
    """

    def test_chosenFailingSaid(self):
        from relay.policy.outcomes import AttemptOutcomes

        rig = TenantsRig([account("a", priority=1), account("b", priority=2)])
        client = key()
        outcomes = AttemptOutcomes(clock=rig.clock)
        explainer = Explainer(
            clock=rig.clock, scheduler=rig.scheduler, keys=KeyRing([client]),
            accounts=rig.live.accounts, policy=rig.policy, admission=rig.admission,
            ledger=rig.ledger, settings=rig.settings, outcomes=outcomes)
        for _ in range(7):
            outcomes.failed("a", "status_500", 500, "boom")
        outcomes.succeeded("b")
        answer = self.successResultOf(Deferred.fromCoroutine(
            explainer.explain(client, "gpt-5.5")))
        rows = {row["id"]: row for row in answer["accounts"]}
        self.assertEqual(answer["decision"]["account"], "a")
        self.assertEqual(answer["decision"]["health_state"], "failing")
        self.assertEqual(rows["a"]["health"]["state"], "failing")
        self.assertIn("failing", rows["a"]["why"])
        self.assertIn("7 of 7 attempts failed", rows["a"]["why"])
        self.assertEqual(rows["b"]["health"]["state"], "ok")
        [warning] = answer["warnings"]
        self.assertEqual((warning["code"], warning["account"]), ("chosen_failing", "a"))
