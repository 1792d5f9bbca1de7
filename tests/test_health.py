"""
Tests for L{relay.policy.health.AccountHealth}: R4, R11, R12, R13, R-B1 on a
L{Clock} with the memory state store.
"""

from __future__ import annotations

from twisted.internet import error as terror
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.policy import failures as F
from relay.policy.classify import DefaultClassifier
from relay.policy.health import AccountHealth
from relay.interfaces import IStateStore
from relay.base.records import Account, BreakerSettings, GatewaySettings, ProxySpec
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore

#: a fixed start time, Unix seconds
T0 = 1_700_000_000.0

APIKEY = Account(
    id="k1", type="apikey", base_url="https://api.openai.com/v1", credential="sk-secret"
)
OAUTH = Account(
    id="o1", type="oauth", base_url="https://chatgpt.com/backend-api/codex", credential="tok"
)
PROXIED = Account(
    id="x1",
    type="apikey",
    base_url="u",
    credential="c",
    proxy=ProxySpec(id="px", scheme="socks5", host="h", port=1),
)


class FailingStore(MemoryStateStore):
    """
    A memory store whose C{markAccount} fails (or hangs when C{hang}).
    """

    hang = False

    def markAccount(self, accountId, kind, until, reason, model=None):
        """
        Fail, or never fire.
        """
        if self.hang:
            return Deferred()
        return fail(ConnectionError("redis down"))


def result(testCase, d):
    """
    @return: the result of an already-fired Deferred.
    """
    return testCase.successResultOf(d)


class HealthTestCase(SynchronousTestCase):
    """
    Shared setup: a clock at L{T0}, a memory store, runtime settings.
    """

    storeClass = MemoryStateStore

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.store = self.storeClass(clock=self.clock)
        self.settings = RuntimeSettings()
        self.health = AccountHealth(store=self.store, clock=self.clock, settings=self.settings)
        self.classifier = DefaultClassifier()

    def runtime(self, account):
        """
        @return: the stored L{relay.state.runtime.AccountRuntime}.
        """
        return result(self, self.store.getAccountStates([account.id]))[account.id]

    def blocked(self, account, model=None):
        """
        @return: L{AccountHealth.unschedulable} now.
        """
        return self.health.unschedulable(
            self.runtime(account), account, model, self.clock.seconds()
        )

    def apply(self, account, verdict, model=None):
        """
        Apply a verdict and return what was applied.
        """
        return result(self, self.health.applyVerdict(account, verdict, model))

    def status(self, account, status, body=b"", headers=None):
        """
        Classify a status at the clock's time.
        """
        return self.classifier.classifyStatus(
            account, "responses", status, headers or {}, body, self.clock.seconds()
        )


class TransportCooldownTests(HealthTestCase):
    """
    R4: the persistent transport cooldown.
    """

    def test_storeProvidesInterface(self):
        """
        The store used here provides L{IStateStore}.
        """
        self.assertTrue(verifyObject(IStateStore, self.store))

    def test_persistentCooldown(self):
        """
        R4: a persistent failure blocks in memory and persists
        temp-unschedulable until now + 10 min, logging
        C{openai.account_temp_unscheduled_transport}.
        """
        v = self.classifier.classifyTransport(APIKEY, terror.ConnectionRefusedError(), "responses")
        with capturedLogs() as events:
            applied = self.apply(APIKEY, v)
        self.assertEqual(applied, ((F.MARK_TEMP_UNSCHEDULABLE, T0 + 600),))
        rt = self.runtime(APIKEY)
        self.assertEqual(rt.blockedUntil, T0 + 600)
        self.assertTrue(rt.blockReason.startswith("upstream transport error (proxy/network): "))
        names = [e.get("event") for e in events]
        self.assertIn("openai.account_temp_unscheduled_transport", names)
        ev = next(
            e for e in events if e.get("event") == "openai.account_temp_unscheduled_transport"
        )
        self.assertEqual((ev["account_id"], ev["until"]), ("k1", T0 + 600))
        self.assertEqual(self.health.localBlock("k1"), ("transport_error", T0 + 600))
        self.clock.advance(600)
        self.assertIsNone(self.blocked(APIKEY))

    def test_transientNoCooldown(self):
        """
        R4: a transient failure writes no cooldown at all.
        """
        v = self.classifier.classifyTransport(APIKEY, terror.ConnectionLost(), "responses")
        self.assertEqual(self.apply(APIKEY, v), ())
        self.assertIsNone(self.blocked(APIKEY))


class FailingStoreTests(HealthTestCase):
    """
    R4 step 1: the in-memory block survives a failed write.
    """

    storeClass = FailingStore

    def test_writeFails(self):
        """
        R4: a failed write logs C{openai.account_temp_unscheduled_transport_failed}
        and the account stays blocked in memory.
        """
        v = self.classifier.classifyTransport(APIKEY, terror.ConnectionRefusedError(), "responses")
        with capturedLogs() as events:
            self.apply(APIKEY, v)
        self.assertIn(
            "openai.account_temp_unscheduled_transport_failed", [e.get("event") for e in events]
        )
        self.assertEqual(self.runtime(APIKEY).blockedUntil, 0)
        reason, until = self.blocked(APIKEY)
        self.assertEqual(until, T0 + 600)

    def test_writeTimesOut(self):
        """
        R4: the write has 5 s; a hung store counts as failed.
        """
        self.store.hang = True
        v = self.classifier.classifyTransport(APIKEY, terror.ConnectionRefusedError(), "responses")
        with capturedLogs() as events:
            d = self.health.applyVerdict(APIKEY, v, None)
            self.assertNoResult(d)
            self.clock.advance(5)
        self.successResultOf(d)
        self.assertIn(
            "openai.account_temp_unscheduled_transport_failed", [e.get("event") for e in events]
        )
        self.assertIsNotNone(self.blocked(APIKEY))

    def test_disabledWriteFailsLogSaysUntilCleared(self):
        """
        The failed write of a disabled marking says "until cleared" too.
        """
        with capturedLogs() as events:
            self.apply(APIKEY, self.status(APIKEY, 401))
        (ev,) = [e for e in events if e.get("event") == "relay.account_state_write_failed"]
        self.assertEqual((ev["kind"], ev["until"]), ("disabled", 0))
        self.assertIn("writing disabled until cleared failed", formatEvent(ev))

    def test_otherMarkKeptInMemory(self):
        """
        A failed write of any other mark also leaves an in-memory block.
        """
        self.apply(APIKEY, self.status(APIKEY, 403))
        self.assertEqual(self.blocked(APIKEY)[1], T0 + 600)


class MarkingTests(HealthTestCase):
    """
    R11 and R12 markings applied to the store.
    """

    def test_cooldownSetEvent(self):
        """
        R11: a JSON 403 cools the account for 10 min and logs
        C{relay.account_cooldown_set}.
        """
        with capturedLogs() as events:
            self.apply(APIKEY, self.status(APIKEY, 403))
        self.assertEqual(self.runtime(APIKEY).blockedUntil, T0 + 600)
        ev = [e for e in events if e.get("event") == "relay.account_cooldown_set"]
        self.assertEqual(
            [(e["account_id"], e["kind"], e["until"]) for e in ev],
            [("k1", "temp_unschedulable", T0 + 600)],
        )

    def test_rateLimited(self):
        """
        R12: a 429 marks rate-limited until the chosen reset (R82: a spent
        window's).
        """
        spent = {"x-codex-primary-used-percent": "100",
                 "x-codex-primary-reset-after-seconds": "90"}
        self.apply(APIKEY, self.status(APIKEY, 429, headers=spent))
        self.assertEqual(self.runtime(APIKEY).rateLimitedUntil, T0 + 90)
        self.assertEqual(self.blocked(APIKEY)[1], T0 + 90)

    def test_streamRelativeSeconds(self):
        """
        R23 / R49: a stream rate-limit marking in C{seconds} is added to the
        clock.
        """
        v = self.classifier.classifyStreamFailure(
            OAUTH,
            "responses",
            "event",
            {"type": "error", "error": {"code": "rate_limit_exceeded"}},
            "",
        )
        self.apply(OAUTH, v)
        self.assertEqual(self.runtime(OAUTH).rateLimitedUntil, T0 + 5)

    def test_disabledWithBridgeBlock(self):
        """
        R11: a permanent error disables the account and blocks it in memory
        for 2 min.
        """
        self.apply(APIKEY, self.status(APIKEY, 401))
        rt = self.runtime(APIKEY)
        self.assertTrue(rt.disabled)
        self.assertEqual(self.health.localBlock("k1")[1], T0 + 120)
        self.assertEqual(self.blocked(APIKEY)[1], 0)

    def test_disabledLogSaysUntilCleared(self):
        """
        A disabled marking has no end (C{until} 0): its line says "until
        cleared", not "until 0"; the structured fields stay.
        """
        with capturedLogs() as events:
            self.apply(APIKEY, self.status(APIKEY, 401))
        (ev,) = [e for e in events if e.get("event") == "relay.account_cooldown_set"]
        self.assertEqual((ev["account_id"], ev["kind"], ev["until"]), ("k1", "disabled", 0))
        text = formatEvent(ev)
        self.assertIn("k1 marked disabled until cleared: ", text)
        self.assertNotIn("until 0", text)
        with capturedLogs() as events:
            self.apply(APIKEY, self.status(APIKEY, 403))
        (ev,) = [e for e in events if e.get("event") == "relay.account_cooldown_set"]
        self.assertIn(f"until {T0 + 600}: ", formatEvent(ev))

    def test_modelBlock(self):
        """
        R11 check 4: model not found blocks the request's model.
        """
        self.apply(
            APIKEY, self.status(APIKEY, 400, b'{"error":{"code":"model_not_found"}}'), "gpt-x"
        )
        rt = self.runtime(APIKEY)
        self.assertEqual(rt.modelBlocks, {"gpt-x": T0 + 600})
        self.assertIsNone(self.blocked(APIKEY, "gpt-y"))
        self.assertIsNotNone(self.blocked(APIKEY, "gpt-x"))


class Count403Tests(HealthTestCase):
    """
    R11 403 row: the 180-minute counter.
    """

    def test_threeDisables(self):
        """
        R11: counts 1 and 2 cool for 10 min with "(n/3)"; the 3rd in 180 min
        disables.
        """
        v = self.status(APIKEY, 403, b'{"error":{"message":"forbidden"}}')
        self.assertEqual(self.apply(APIKEY, v), ((F.MARK_TEMP_UNSCHEDULABLE, T0 + 600),))
        self.assertIn(
            "OpenAI 403 temporary cooldown (1/3): forbidden", self.runtime(APIKEY).blockReason
        )
        self.clock.advance(3600)
        self.apply(APIKEY, v)
        self.assertIn("(2/3)", self.runtime(APIKEY).blockReason)
        self.assertFalse(self.runtime(APIKEY).disabled)
        self.clock.advance(3600)
        self.assertEqual(self.apply(APIKEY, v), ((F.MARK_DISABLED, 0),))
        self.assertTrue(self.runtime(APIKEY).disabled)

    def test_fixedWindow(self):
        """
        R11: the window is fixed from the first 403: after 180 min the count
        starts again.
        """
        v = self.status(APIKEY, 403, b'{"error":{"message":"forbidden"}}')
        self.apply(APIKEY, v)
        self.clock.advance(100 * 60)
        self.apply(APIKEY, v)
        self.clock.advance(81 * 60)
        self.apply(APIKEY, v)
        self.assertFalse(self.runtime(APIKEY).disabled)
        self.assertIn("(1/3)", self.runtime(APIKEY).blockReason)

    def test_htmlExempt(self):
        """
        R11: a 403 HTML block page neither counts nor cools.
        """
        v = self.status(APIKEY, 403, b"<html>blocked</html>", {"content-type": "text/html"})
        for _ in range(3):
            self.assertEqual(self.apply(APIKEY, v), ())
        self.assertIsNone(self.blocked(APIKEY))


class StreakTests(HealthTestCase):
    """
    R11: the API-key transient streak per (account, model).
    """

    def test_streak(self):
        """
        R11: 1st failure nothing, 2nd 10 s, 3rd and later 45 s, per model;
        success clears it.
        """
        v = self.status(APIKEY, 502)
        self.assertEqual(self.apply(APIKEY, v, "m"), ())
        self.assertEqual(self.apply(APIKEY, v, "m"), ((F.MARK_MODEL_BLOCK, T0 + 10),))
        self.assertEqual(self.apply(APIKEY, v, "m"), ((F.MARK_MODEL_BLOCK, T0 + 45),))
        self.assertEqual(self.apply(APIKEY, v, "m"), ((F.MARK_MODEL_BLOCK, T0 + 45),))
        self.assertEqual(self.runtime(APIKEY).modelBlocks["m"], T0 + 45)
        self.assertEqual(self.apply(APIKEY, v, "other"), ())
        self.successResultOf(self.health.success(APIKEY, "m"))
        self.assertEqual(self.apply(APIKEY, v, "m"), ())

    def test_livesThirtyMinutesFromLast(self):
        """
        R11: the streak lives 30 min from the last failure.
        """
        v = self.status(APIKEY, 503)
        self.apply(APIKEY, v, "m")
        self.clock.advance(20 * 60)
        self.apply(APIKEY, v, "m")
        self.clock.advance(20 * 60)
        self.assertEqual(
            self.apply(APIKEY, v, "m"), ((F.MARK_MODEL_BLOCK, self.clock.seconds() + 45),)
        )
        self.clock.advance(31 * 60)
        self.assertEqual(self.apply(APIKEY, v, "m"), ())

    def test_per_model(self):
        """
        The streak is per account and model: another model's streak starts
        at one.
        """
        v = self.status(APIKEY, 503)
        self.apply(APIKEY, v, "m1")
        self.assertEqual(self.apply(APIKEY, v, "m2"), ())
        self.assertEqual(
            self.apply(APIKEY, v, "m1"), ((F.MARK_MODEL_BLOCK, self.clock.seconds() + 10),)
        )

    def test_streak_visible_and_cleared(self):
        """
        R11 streaks live in the account's runtime state (the operator view
        reads them) and an admin clear ends them: the next failure counts
        from one again.
        """
        v = self.status(APIKEY, 503)
        self.apply(APIKEY, v, "m")
        self.apply(APIKEY, v, "m")
        runtime = self.successResultOf(self.store.getAccountStates([APIKEY.id]))[APIKEY.id]
        self.assertEqual(runtime.streaks["m"][0], 2)
        self.successResultOf(self.health.clear(APIKEY.id))
        self.assertEqual(self.apply(APIKEY, v, "m"), ())


class BreakerTests(HealthTestCase):
    """
    R-B1: the transient transport breaker.
    """

    def failOnce(self, account=APIKEY, proxyId=None):
        """
        Record one transient failure; return the open-until or None.
        """
        return self.successResultOf(self.health.transientTransportFailure(account, proxyId))

    def test_opensAtThree(self):
        """
        R-B1: the 3rd consecutive failure within 60 s opens the breaker for
        2 min and logs C{openai.account_transport_circuit_open}.
        """
        self.assertIsNone(self.failOnce())
        self.clock.advance(20)
        self.assertIsNone(self.failOnce())
        self.clock.advance(20)
        with capturedLogs() as events:
            until = self.failOnce()
        self.assertEqual(until, T0 + 40 + 120)
        self.assertEqual(self.runtime(APIKEY).blockedUntil, until)
        ev = [e for e in events if e.get("event") == "openai.account_transport_circuit_open"]
        self.assertEqual(
            [(e["account_id"], e["proxy_id"], e["failures"], e["until"]) for e in ev],
            [("k1", "direct", 3, until)],
        )

    def test_window(self):
        """
        R-B1: failures more than 60 s apart do not open it.
        """
        for _ in range(5):
            self.assertIsNone(self.failOnce())
            self.clock.advance(31)

    def test_doublesAndCaps(self):
        """
        R-B1: each repeat doubles the period (120, 240, 480) up to 600 s.
        """
        periods = []
        for _ in range(5):
            for _ in range(3):
                until = self.failOnce()
            periods.append(until - self.clock.seconds())
        self.assertEqual(periods, [120, 240, 480, 600, 600])

    def test_successResets(self):
        """
        R-B1: a success resets the count and the doubling, and logs
        C{openai.account_transport_circuit_closed}.
        """
        for _ in range(3):
            self.failOnce()
        self.failOnce()
        self.failOnce()
        with capturedLogs() as events:
            self.successResultOf(self.health.success(APIKEY, None))
        self.assertIn("openai.account_transport_circuit_closed", [e.get("event") for e in events])
        self.assertIsNone(self.failOnce())
        self.assertIsNone(self.failOnce())
        until = self.failOnce()
        self.assertEqual(until - self.clock.seconds(), 120)

    def test_perProxy(self):
        """
        R-B1: the count is per (account, proxy); the account's own proxy is
        the default.
        """
        self.failOnce(PROXIED)
        self.failOnce(PROXIED, "other")
        self.assertIsNone(self.failOnce(PROXIED))
        until = self.failOnce(PROXIED, "px")
        self.assertIsNotNone(until)

    def test_settingsLive(self):
        """
        R-B1 / R74: the settings are read on every call; C{failures} and
        C{enabled: false} apply at once.
        """
        self.settings.current = GatewaySettings(breaker=BreakerSettings(failures=2))
        self.failOnce()
        self.assertIsNotNone(self.failOnce())
        self.settings.current = GatewaySettings(breaker=BreakerSettings(enabled=False))
        for _ in range(10):
            self.assertIsNone(self.failOnce(OAUTH))
        self.assertIsNone(self.blocked(OAUTH))


class OAuth429Tests(HealthTestCase):
    """
    R13: the OAuth 429 window.
    """

    def decide(self, verdict):
        """
        @return: the decision tuple.
        """
        return self.successResultOf(self.health.oauth429Decision(OAUTH, verdict))

    def test_window(self):
        """
        R13: inside 2 min from the first 429 retry the same account (0.5 s
        default, Retry-After capped at 8 s, never past the window end) and
        mark nothing; after it mark rate-limited until the R12 reset and
        clear the window.
        """
        v = self.status(OAUTH, 429)
        self.assertEqual(self.decide(v), ("retry_same", 0.5))
        self.clock.advance(60)
        v30 = self.status(OAUTH, 429, headers={"retry-after": "30"})
        self.assertEqual(self.decide(v30), ("retry_same", 8.0))
        self.clock.advance(58)
        self.assertEqual(self.decide(v30), ("retry_same", 2.0))
        self.assertIsNone(self.blocked(OAUTH))
        self.clock.advance(2)
        late = self.status(OAUTH, 429, headers={"x-codex-primary-used-percent": "100",
                                                "x-codex-primary-reset-after-seconds": "3600"})
        self.assertEqual(self.decide(late), ("mark", None))
        self.assertEqual(self.runtime(OAUTH).rateLimitedUntil, T0 + 120 + 3600)
        self.assertEqual(self.health.localBlock("o1")[1], T0 + 120 + 3600)
        # the window was cleared: the next 429 starts a new one
        self.assertEqual(self.decide(v)[0], "retry_same")

    def test_successClears(self):
        """
        R13: a success on the account clears the window.
        """
        v = self.status(OAUTH, 429)
        self.decide(v)
        self.clock.advance(119)
        self.successResultOf(self.health.success(OAUTH, None))
        self.clock.advance(5)
        self.assertEqual(self.decide(v), ("retry_same", 0.5))

    def test_fallback(self):
        """
        R13: a verdict without a reset gets the 5 s fallback.
        """
        v = F.Verdict(kind=F.STATUS, failover=True, status=429, oauth429=True)
        self.decide(v)
        self.clock.advance(120)
        self.assertEqual(self.decide(v), ("mark", None))
        self.assertEqual(self.runtime(OAUTH).rateLimitedUntil, T0 + 125)
