"""
Health that tells the truth (relay.policy.outcomes): an account's recent
attempt ends as the policy recorded them (R86), the state shown from them,
a client's own fault kept out of the account's last error, and what the
breaker really counts.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import GatewaySettings
from relay.policy import ends as E
from relay.policy.bookkeeping import AccountBookkeeping
from relay.policy.classify import DefaultClassifier
from relay.policy.health import AccountHealth
from relay.policy.judgement import judge
from relay.policy.outcomes import AttemptOutcomes, healthState, isClientFault
from relay.state.memory import MemoryStateStore
from relay.state.settings import RuntimeSettings
from tests.test_policy import APIKEY, MODEL, T0, errorJSON, httpStatus, turn


class OutcomeWindowTests(SynchronousTestCase):
    """
    L{AttemptOutcomes}: 15 minutes of counts per account.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.outcomes = AttemptOutcomes(clock=self.clock)

    def test_countsAndRates(self):
        """
        Successes, failures by reason and client faults are counted apart;
        rates are over the account's own attempts.
        """
        for _ in range(3):
            self.outcomes.succeeded("a")
        self.outcomes.failed("a", "status_500", 500, "boom")
        self.outcomes.clientFault("a")
        counts = self.outcomes.counts("a")
        self.assertEqual((counts["attempts"], counts["succeeded"], counts["failed"],
                          counts["client_faults"]), (4, 3, 1, 1))
        self.assertEqual(counts["failure_rate"], 0.25)
        self.assertEqual(counts["failures"], {"status_500": 1})
        self.assertEqual(counts["last_failure"]["status"], 500)

    def test_windowSlides(self):
        """
        Ends older than 15 minutes no longer count.
        """
        self.outcomes.failed("a", "status_500", 500)
        self.clock.advance(16 * 60)
        counts = self.outcomes.counts("a")
        self.assertEqual(counts["attempts"], 0)
        self.assertIsNone(counts["last_failure"])
        self.assertEqual(healthState(counts)["state"], "idle")

    def test_perMinute(self):
        """
        The pool's attempts per minute: 15 rows, the current minute last.
        """
        self.outcomes.succeeded("a")
        self.outcomes.failed("b", "transport", None)
        self.clock.advance(60)
        self.outcomes.succeeded("a")
        rows = self.outcomes.perMinute()
        self.assertEqual(len(rows), 15)
        self.assertEqual([(r["requests"], r["failed"]) for r in rows[-2:]], [(2, 1), (1, 0)])
        self.assertEqual(sum(r["requests"] for r in rows), 3)


class HealthStateTests(SynchronousTestCase):
    """
    L{healthState}: never plain C{ok} when the account failed recently.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.outcomes = AttemptOutcomes(clock=self.clock)

    def test_failedSevenTimesCooldownLapsed(self):
        """
        An account whose 7 attempts all failed is C{failing} once its
        cooldown has lapsed (no block in force): not C{ok}.
        """
        for _ in range(7):
            self.outcomes.failed("a", "status_500", 500)
        state = healthState(self.outcomes.counts("a"), None)
        self.assertEqual(state["state"], "failing")
        self.assertIn("7 of 7 attempts failed", state["why"])

    def test_lastThreeFailed(self):
        """
        Many successes, then the last 3 attempts all failed: C{failing}.
        """
        for _ in range(20):
            self.outcomes.succeeded("a")
        for _ in range(3):
            self.outcomes.failed("a", "transport", None)
        self.assertEqual(healthState(self.outcomes.counts("a"))["state"], "failing")

    def test_oneFailureIsDegraded(self):
        """
        One failure among successes: C{degraded}, not C{ok}.
        """
        for _ in range(9):
            self.outcomes.succeeded("a")
        self.outcomes.failed("a", "status_502", 502)
        self.outcomes.succeeded("a")
        self.assertEqual(healthState(self.outcomes.counts("a"))["state"], "degraded")

    def test_okAndBlocks(self):
        """
        Only successes: C{ok}; a block in force wins (C{paused},
        C{needs_login}, C{blocked}).
        """
        self.outcomes.succeeded("a")
        counts = self.outcomes.counts("a")
        self.assertEqual(healthState(counts)["state"], "ok")
        self.assertEqual(healthState(counts, {"kind": "paused", "reason": "x"})["state"],
                         "paused")
        self.assertEqual(healthState(counts, {"kind": "token", "reason": "needs_login: y"})
                         ["state"], "needs_login")
        self.assertEqual(healthState(counts, {"kind": "cooldown", "reason": "z"})["state"],
                         "blocked")

    def test_clientFaultsKeepOk(self):
        """
        Client faults alone leave the account C{ok}/C{idle}.
        """
        for _ in range(5):
            self.outcomes.clientFault("a")
        self.assertEqual(healthState(self.outcomes.counts("a"))["state"], "idle")


class ClientFaultBookkeepingTests(SynchronousTestCase):
    """
    A client's own fault is never recorded as the account's last error.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.settings = RuntimeSettings(current=GatewaySettings())
        self.store = MemoryStateStore(clock=self.clock)
        self.health = AccountHealth(store=self.store, clock=self.clock, settings=self.settings)
        self.book = AccountBookkeeping(health=self.health, clock=self.clock)
        self.classifier = DefaultClassifier()

    def record(self, end):
        verdict = judge(self.classifier, end, APIKEY, turn(), self.clock.seconds())
        self.successResultOf(self.book.record(APIKEY, end, verdict, MODEL, "req"))
        return verdict

    def test_client400NotLastError(self):
        """
        An upstream 400 about the client's request (a bad value, with a
        C{param}) passes to the client and is counted as a client fault:
        C{last_error} stays empty and the account is not failing.
        """
        verdict = self.record(httpStatus(400, errorJSON(
            "Invalid value for 'temperature': must be <= 2.", "invalid_request_error",
            "invalid_value") | {"param": "temperature"}))
        self.assertTrue(isClientFault(verdict))
        stats = self.book.accountStats(APIKEY.id)
        self.assertIsNone(stats["last_error"])
        counts = self.book.outcomes.counts(APIKEY.id)
        self.assertEqual((counts["failed"], counts["client_faults"]), (0, 1))

    def test_modelRefusalNotLastError(self):
        """
        R106: a project's model refusal blocks the model on the account but
        is never the account's last error nor its failure.
        """
        verdict = self.record(httpStatus(403, errorJSON(
            "Project `proj_abc` does not have access to model `o1-pro`",
            "invalid_request_error", "model_not_found")))
        self.assertTrue(isClientFault(verdict))
        self.assertIsNone(self.book.accountStats(APIKEY.id)["last_error"])
        counts = self.book.outcomes.counts(APIKEY.id)
        self.assertEqual((counts["failed"], counts["client_faults"]), (0, 1))

    def test_serverErrorIsLastError(self):
        """
        A 500 is the account's failure: its last error and counted.
        """
        verdict = self.record(httpStatus(500, errorJSON("boom")))
        self.assertFalse(isClientFault(verdict))
        self.assertIn("500", self.book.accountStats(APIKEY.id)["last_error"])
        self.assertEqual(self.book.outcomes.counts(APIKEY.id)["failed"], 1)

    def test_successCounted(self):
        """
        A completed attempt counts as a success; a departure writes nothing
        (R2).
        """
        self.successResultOf(self.book.record(APIKEY, E.Completed(), None, MODEL))
        self.successResultOf(self.book.record(APIKEY, E.Departed("client_gone"), None, MODEL))
        counts = self.book.outcomes.counts(APIKEY.id)
        self.assertEqual((counts["attempts"], counts["succeeded"]), (1, 1))

    def test_clearForgets(self):
        """
        An operator's clear forgives the recent failures.
        """
        self.record(httpStatus(500, errorJSON("boom")))
        self.successResultOf(self.book.clear(APIKEY))
        self.assertEqual(self.book.outcomes.counts(APIKEY.id)["failed"], 0)


class BreakerViewTests(SynchronousTestCase):
    """
    The breaker view says what the breaker counts now and when it resets.
    """

    def test_countLapsesWithWindow(self):
        """
        One transient failure: C{failures} 1 with C{window_resets_at};
        once the window has passed, 0 and C{closed} (not "1 fail" for
        minutes).
        """
        clock = Clock()
        clock.advance(T0)
        settings = RuntimeSettings(current=GatewaySettings())
        health = AccountHealth(store=MemoryStateStore(clock=clock), clock=clock,
                               settings=settings)
        self.successResultOf(health.transientTransportFailure(APIKEY))
        window = settings.current.breaker.window_seconds
        view = health.breakerState(APIKEY.id)
        self.assertEqual((view["failures"], view["state"]), (1, "counting"))
        self.assertEqual(view["window_resets_at"], T0 + window)
        self.assertEqual(view["threshold"], settings.current.breaker.failures)
        clock.advance(window + 1)
        view = health.breakerState(APIKEY.id)
        self.assertEqual((view["failures"], view["state"], view["window_resets_at"]),
                         (0, "closed", None))
