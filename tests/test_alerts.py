"""
Webhook alerts (relay.alerts, docs/operating.md "Alerts"): each condition,
once per condition, the cool-off, the resolved notice, the bodies, and
delivery with retries and backoff, all on a L{Clock}.
"""

from __future__ import annotations

import json

from attrs import frozen
from twisted.internet.defer import ensureDeferred, succeed
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.alerts.book import FIRING, RESOLVED, AlertBook, Condition, Notice
from relay.alerts.delivery import WebhookSender, backoff, bodyFor, plainBody, slackBody
from relay.alerts.forecast import WindowRates, runsOutIn
from relay.alerts.monitor import AlertMetrics, AlertMonitor
from relay.base.alertsettings import EVENTS, AlertSettings, WebhookTarget
from relay.base.records import Account, ClientError
from relay.interfaces import IWebhookPoster
from relay.oauth.windows import Snapshot, Window
from relay.state.runtime import AccountRuntime

URL = "https://hooks.example/services/T000/SECRET-TOKEN"


@frozen
class _Record:
    model: str = "gpt-5.5"
    outcome: str = "completed"
    cost_nanos: int = 0


@implementer(IWebhookPoster)
class _Poster:
    """
    A fake L{IWebhookPoster}: C{answer(url, body, timeout)} gives each
    try's status (or raises, or returns a Deferred).
    """

    def __init__(self, answer):
        self.answer = answer
        self.closed = False

    def post(self, url, body, timeout):
        return ensureDeferred(self.answer(url, body, timeout))

    def close(self):
        self.closed = True
        return succeed(None)


class _MutableRecord:
    model, outcome, cost_nanos, seq, time = "gpt-5.5", "completed", 0, None, 0.0


class _Sender:
    def __init__(self):
        self.sent = []
        self.onDelivered = self.onFailed = None

    def send(self, target, notice):
        self.sent.append((target, notice))
        return succeed(True)

    def told(self):
        return [(n.state, n.condition.event, n.condition.subject) for _, n in self.sent]


class BookTests(SynchronousTestCase):
    """
    L{AlertBook}: once per condition, the cool-off, resolved.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.book = AlertBook(clock=self.clock, cooloff=600)
        self.c = Condition("login_needed", "o1", "o1 needs sign-in")

    def states(self, notices):
        return [(n.state, n.condition.subject) for n in notices]

    def test_firesOncePerCondition(self):
        """
        A condition is told when it starts and not again while it holds.
        """
        self.assertEqual(self.states(self.book.update(EVENTS, [self.c])), [(FIRING, "o1")])
        for _ in range(5):
            self.clock.advance(60)
            self.assertEqual(self.book.update(EVENTS, [self.c]), [])

    def test_resolved(self):
        """
        A told condition that ends is told once as resolved.
        """
        self.book.update(EVENTS, [self.c])
        self.clock.advance(30)
        notices = self.book.update(EVENTS, [])
        self.assertEqual(self.states(notices), [(RESOLVED, "o1")])
        self.assertEqual(notices[0].since, 1000)
        self.assertEqual(self.book.update(EVENTS, []), [])

    def test_coolOff(self):
        """
        A condition that comes back within the cool-off is told when the
        cool-off ends, if it still holds; one that came and went within it
        is never told.
        """
        self.book.update(EVENTS, [self.c])
        self.clock.advance(10)
        self.book.update(EVENTS, [])
        self.clock.advance(10)
        self.assertEqual(self.book.update(EVENTS, [self.c]), [])
        self.assertEqual(self.book.nextDue(), 1600)
        self.clock.advance(100)
        self.assertEqual(self.book.update(EVENTS, []), [], "never told: no resolved")
        self.assertEqual(self.book.update(EVENTS, [self.c]), [])
        self.clock.advance(480)
        self.assertEqual(self.states(self.book.update(EVENTS, [self.c])), [(FIRING, "o1")])

    def test_otherSubjectsAreTheirOwnConditions(self):
        """
        The same event about another subject is a condition of its own, told on its own.
        """
        other = Condition("login_needed", "o2", "o2 needs sign-in")
        self.book.update(EVENTS, [self.c])
        self.assertEqual(self.states(self.book.update(EVENTS, [self.c, other])), [(FIRING, "o2")])

    def test_unevaluatedEventsKeepTheirState(self):
        """
        An event whose reading failed (not in C{events}) is neither fired
        nor resolved.
        """
        self.book.update(EVENTS, [self.c])
        self.assertEqual(self.book.update(["spend_rate"], []), [])
        self.assertEqual(self.book.active(), [self.c])


class ForecastTests(SynchronousTestCase):
    """
    L{WindowRates} and L{runsOutIn}.
    """

    def test_rateFallsWhenTrafficStops(self):
        """
        A window's rate is its growth over the kept span; without new
        observations it falls, and after the window it is 0.
        """
        rates = WindowRates(window=100)
        rates.observe("o1", 0, 10)
        rates.observe("o1", 50, 20)
        self.assertAlmostEqual(rates.rate("o1", 50), 0.2)
        self.assertAlmostEqual(rates.rate("o1", 60), 0.2)
        self.assertAlmostEqual(rates.rate("o1", 100), 10 / 90)
        self.assertEqual(rates.rate("o1", 200), 0.0)

    def test_aResetStartsAfresh(self):
        """
        A used-percent that drops (the window reset) starts the observations afresh.
        """
        rates = WindowRates(window=100)
        rates.observe("o1", 0, 90)
        rates.observe("o1", 50, 2)
        self.assertEqual(rates.rate("o1", 60), 0.0)

    def test_runsOut(self):
        """
        Two accounts at 50 % and 80 % using 1 point a second together run
        out in 70 s; none in use: never.
        """
        self.assertEqual(runsOutIn([(50, 0.5, None), (80, 0.5, None)], 0), 70)
        self.assertIsNone(runsOutIn([(50, 0.0, None)], 0))

    def test_aWindowThatResetsFirstComesBack(self):
        """
        A window that resets before the pool runs out comes back with 100 more points.
        """
        self.assertEqual(runsOutIn([(50, 1.0, 10.0)], 0), 150)
        self.assertEqual(runsOutIn([(50, 1.0, 1000.0)], 0), 50)


def _oauth(accountId, models=None):
    return Account(id=accountId, type="oauth", base_url="https://up.example",
                   credential="tok", models=models)


class _Credentials:
    def __init__(self):
        self.status = {}

    def view(self, account):
        return {"token_status": self.status.get(account.id, "ok"),
                "token_reason": "refresh token refused"}


class _Store:
    def __init__(self):
        self.runtimes = {}

    def getAccountStates(self, ids):
        return succeed({i: self.runtimes.get(i, AccountRuntime()) for i in ids})


def _settings(**kw):
    kw.setdefault("webhooks", (WebhookTarget(url=URL, label="webhooks[0] (hooks.example)"),))
    kw.setdefault("evaluate_interval_seconds", 10)
    return AlertSettings(**kw)


class MonitorTests(SynchronousTestCase):
    """
    L{AlertMonitor}: every condition from its reading, on a L{Clock}.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.sender = _Sender()
        self.credentials = _Credentials()
        self.store = _Store()
        self.refusals = {}
        self.snapshots = {}
        self.rows = []
        self.accounts = [_oauth("o1"), _oauth("o2"), _oauth("o3", models=("gpt-5.4-mini",))]

    def monitor(self, **kw):
        monitor = AlertMonitor(
            clock=self.clock, settings=_settings(**kw), sender=self.sender,
            accounts=lambda: self.accounts, credentials=self.credentials, store=self.store,
            canServe=lambda model: succeed(self.refusals.get(model)),
            windows=self.snapshots.get, budgets=lambda now: self.rows)
        monitor.startService()
        self.addCleanup(monitor.stopService)
        return monitor

    def tick(self, seconds=10):
        self.clock.advance(seconds)

    def test_loginNeeded(self):
        """
        An OAuth login whose token status is C{needs_login} fires once and
        is resolved when it is signed in again.
        """
        self.monitor()
        self.credentials.status["o2"] = "needs_login"
        self.tick()
        self.tick()
        self.assertEqual(self.sender.told(), [(FIRING, "login_needed", "o2")])
        self.assertIn("refresh token refused", self.sender.sent[0][1].condition.summary)
        self.credentials.status["o2"] = "ok"
        self.tick()
        self.assertEqual(self.sender.told()[1:], [(RESOLVED, "login_needed", "o2")])

    def test_accountDisabled(self):
        """
        An account relay disabled fires once; cleared, it is resolved.
        """
        self.monitor()
        self.store.runtimes["o1"] = AccountRuntime(disabled=True, disabledReason="402: pay")
        self.tick()
        self.tick()
        self.store.runtimes["o1"] = AccountRuntime()
        self.tick()
        self.assertEqual(self.sender.told(), [(FIRING, "account_disabled", "o1"),
                                              (RESOLVED, "account_disabled", "o1")])

    def test_poolExhaustedForAModelAskedFor(self):
        """
        Only models turns asked for are watched; a refused one fires, and
        a turn that failed brings the evaluation forward (within a second).
        """
        monitor = self.monitor()
        self.refusals["gpt-5.4-mini"] = ClientError(503, "server_error", "no account left",
                                                    headers=(("Retry-After", "5"),))
        self.tick()
        self.assertEqual(self.sender.told(), [], "nobody asked for it")
        monitor.turnRecorded(_Record(model="gpt-5.4-mini", outcome="failed"))
        self.clock.advance(0)
        self.assertEqual(self.sender.told(), [(FIRING, "pool_exhausted", "gpt-5.4-mini")])
        self.assertEqual(self.sender.sent[0][1].condition.details["retry_after"], "5")
        del self.refusals["gpt-5.4-mini"]
        self.tick()
        self.assertEqual(self.sender.told()[1:], [(RESOLVED, "pool_exhausted", "gpt-5.4-mini")])

    def test_onlyKnownModelsAreWatched(self):
        """
        A name relay does not know (R110) is not watched, however many
        clients send; a snapshot name is watched as its family.
        """
        from relay.alerts.monitor import MAX_MODELS

        monitor = self.monitor()
        monitor.modelName = {"gpt-5.5-2026-04-23": "gpt-5.5"}.get
        for i in range(3):
            monitor.turnRecorded(_Record(model=f"made-up-{i}", outcome="failed"))
        monitor.turnRecorded(_Record(model="gpt-5.5-2026-04-23"))
        self.assertEqual(list(monitor.demand), ["gpt-5.5"])
        monitor.modelName = None
        for i in range(MAX_MODELS + 10):
            monitor.turnRecorded(_Record(model=f"m{i}"))
        self.assertEqual(len(monitor.demand), MAX_MODELS)

    def test_capacityForecast(self):
        """
        Windows at 40 % growing 1 point a minute each (two accounts serve
        gpt-5.5) run out in ~60 min: fired at a 90-minute horizon, resolved
        once the use stops.
        """
        monitor = self.monitor(capacity_forecast_minutes=90, forecast_window_seconds=600)
        monitor.turnRecorded(_Record())
        start = self.clock.seconds()
        reset = start + 5 * 3600
        for step in range(0, 11):
            now = self.clock.seconds()
            used = 40 + (now - start) / 60
            for name in ("o1", "o2"):
                self.snapshots[name] = Snapshot(Window(used, 300, reset), None,
                                                observed_at=now)
            self.tick(10)
        told = self.sender.told()
        self.assertEqual(told, [(FIRING, "capacity_forecast", "gpt-5.5")])
        condition = self.sender.sent[0][1].condition
        self.assertIn("at the current rate the pool's 5-hour windows for gpt-5.5 run out in ~",
                      condition.summary)
        self.assertTrue(55 <= condition.details["minutes"] <= 62, condition.details)
        self.assertEqual(condition.details["accounts"], ["o1", "o2"])
        self.tick(700)
        self.assertEqual(self.sender.told()[1:], [(RESOLVED, "capacity_forecast", "gpt-5.5")])

    def test_capacityForecastFarAway(self):
        """
        The same use with a 30-minute horizon fires nothing.
        """
        monitor = self.monitor(capacity_forecast_minutes=30)
        monitor.turnRecorded(_Record())
        start = self.clock.seconds()
        for _ in range(10):
            now = self.clock.seconds()
            self.snapshots["o1"] = Snapshot(Window(40 + (now - start) / 60, 300, None), None,
                                            observed_at=now)
            self.tick(10)
        self.assertEqual(self.sender.told(), [])

    def test_keyBudget80And100(self):
        """
        A key at 80 % of its daily budget fires the 80 % condition, at
        100 % the 100 % one; a new day resolves both.
        """
        self.monitor()
        row = {"key": "bob", "daily_tokens": 1000, "daily_used": 500,
               "monthly_tokens": None, "monthly_used": 500, "daily_resets_at": 0}
        self.rows.append(row)
        self.tick()
        self.assertEqual(self.sender.told(), [])
        row["daily_used"] = 850
        self.tick()
        self.assertEqual(self.sender.told(), [(FIRING, "key_budget", "bob daily_tokens 80%")])
        row["daily_used"] = 1000
        self.tick()
        self.assertEqual(self.sender.told()[1:], [(FIRING, "key_budget", "bob daily_tokens 100%")])
        row["daily_used"] = 0
        self.tick()
        self.assertEqual(sorted(self.sender.told()[2:]), [
            (RESOLVED, "key_budget", "bob daily_tokens 100%"),
            (RESOLVED, "key_budget", "bob daily_tokens 80%")])

    def test_moneyBudget(self):
        """
        A money budget (C{daily_usd}) counts like a token budget.
        """
        self.monitor()
        self.rows.append({"key": "bob", "daily_tokens": None, "daily_used": 0,
                          "daily_usd": 2.0, "daily_spent_usd": 1.7})
        self.tick()
        self.assertEqual(self.sender.told(), [(FIRING, "key_budget", "bob daily_usd 80%")])

    def test_spendRate(self):
        """
        $1 spent in a 60 s window is $60 an hour: over a $50 threshold;
        once the window passes, resolved.
        """
        monitor = self.monitor(spend_rate_usd_per_hour=50, spend_window_seconds=60)
        for _ in range(4):
            monitor.turnRecorded(_Record(cost_nanos=250_000_000))
        self.tick()
        self.assertEqual(self.sender.told(), [(FIRING, "spend_rate", "pool")])
        self.assertAlmostEqual(self.sender.sent[0][1].condition.details["usd_per_hour"], 60)
        self.tick(60)
        self.assertEqual(self.sender.told()[1:], [(RESOLVED, "spend_rate", "pool")])

    def test_spendIsKeptInBoundedBuckets(self):
        """
        However many turns a spend window holds, their costs are kept in
        at most 61 buckets, and the rate is their sum per hour.
        """
        monitor = self.monitor(spend_rate_usd_per_hour=1000, spend_window_seconds=60)
        for _ in range(6000):
            monitor.turnRecorded(_Record(cost_nanos=10_000_000))
            self.clock.advance(0.01)
        self.assertLessEqual(len(monitor._costs), 61)
        self.assertAlmostEqual(monitor.spendPerHour(self.clock.seconds()), 3600, delta=60)

    def test_spendRateOffByDefault(self):
        """
        Without C{spend_rate_usd_per_hour} the spend rate never fires.
        """
        monitor = self.monitor()
        monitor.turnRecorded(_Record(cost_nanos=10**12))
        self.tick()
        self.assertEqual(self.sender.told(), [])

    def test_targetsTakeTheirEvents(self):
        """
        A target gets only the events it lists.
        """
        only = WebhookTarget(url=URL, events=("spend_rate",), label="webhooks[1]")
        self.monitor(webhooks=(_settings().webhooks[0], only))
        self.credentials.status["o1"] = "needs_login"
        self.tick()
        self.assertEqual([t.label for t, _ in self.sender.sent], ["webhooks[0] (hooks.example)"])

    def test_aFailedReadingChangesNothing(self):
        """
        A reading that fails is logged; its conditions are neither fired
        nor resolved, and the other events go on.
        """
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)
        self.monitor()
        self.store.runtimes["o1"] = AccountRuntime(disabled=True, disabledReason="x")
        self.tick()
        self.store.getAccountStates = lambda ids: 1 / 0
        self.credentials.status["o1"] = "needs_login"
        self.tick()
        self.assertEqual(self.sender.told(), [(FIRING, "account_disabled", "o1"),
                                              (FIRING, "login_needed", "o1")])
        self.assertEqual([e["alert_event"] for e in self.events
                          if e.get("event") == "relay.alert_read_failed"], ["account_disabled"])

    def test_aReadingThatHangsTimesOut(self):
        """
        A store that does not answer fails its reading after 10 s; the
        other events are told then.
        """
        from twisted.internet.defer import Deferred

        self.monitor()
        self.store.getAccountStates = lambda ids: Deferred()
        self.credentials.status["o1"] = "needs_login"
        self.tick()
        self.assertEqual(self.sender.told(), [])
        self.tick(10)
        self.assertEqual(self.sender.told(), [(FIRING, "login_needed", "o1")])

    def test_metrics(self):
        """
        Notices, deliveries and failed deliveries are counted by event (and target, never its URL).
        """
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        self.sender = WebhookSender(clock=self.clock, poster=_Poster(self._answer(200)),
                                    attempts=1)
        monitor = self.monitor()
        monitor.metrics = AlertMetrics(registry)
        monitor.__attrs_post_init__()
        self.credentials.status["o1"] = "needs_login"
        self.tick()
        self.assertEqual(registry.get_sample_value(
            "relay_alerts_fired_total", {"event": "login_needed", "state": "firing"}), 1)
        self.assertEqual(registry.get_sample_value(
            "relay_alerts_delivered_total", {"event": "login_needed", "target": "webhooks[0]"}), 1)
        self.sender.poster = _Poster(self._answer(400))
        self.credentials.status["o1"] = "ok"
        self.tick()
        self.assertEqual(registry.get_sample_value(
            "relay_alerts_failed_total", {"event": "login_needed", "target": "webhooks[0]"}), 1)

    @staticmethod
    def _answer(status):
        async def post(url, body, timeout):
            return status
        return post


def _notice(state=FIRING):
    return Notice(state, Condition("pool_exhausted", "gpt-5.5", "the pool cannot serve gpt-5.5",
                                   {"model": "gpt-5.5"}), 1_800_000_000, 1_799_999_940)


class BodyTests(SynchronousTestCase):
    """
    Plain JSON and Slack's shape.
    """

    def test_plain(self):
        """
        The plain body: event, status, subject, summary, details and ISO times.
        """
        self.assertEqual(plainBody(_notice()), {
            "source": "relay", "event": "pool_exhausted", "status": "firing",
            "subject": "gpt-5.5", "summary": "the pool cannot serve gpt-5.5",
            "details": {"model": "gpt-5.5"}, "at": "2027-01-15T08:00:00Z",
            "since": "2027-01-15T07:59:00Z"})
        self.assertEqual(plainBody(_notice(RESOLVED))["summary"],
                         "resolved: the pool cannot serve gpt-5.5")

    def test_slack(self):
        """
        With C{slack: true} the body is Slack's C{{"text": ...}} only.
        """
        target = WebhookTarget(url=URL, slack=True)
        self.assertEqual(list(json.loads(bodyFor(target, _notice()))), ["text"])
        self.assertIn("pool_exhausted", slackBody(_notice())["text"])
        self.assertIn("resolved", slackBody(_notice(RESOLVED))["text"])


class DeliveryTests(SynchronousTestCase):
    """
    L{WebhookSender}: retried with backoff, never logging the URL.
    """

    def setUp(self):
        self.clock = Clock()
        self.tries = []
        self.answers = []
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)
        self.target = WebhookTarget(url=URL, label="webhooks[0] (hooks.example)")

    async def post(self, url, body, timeout):
        self.tries.append(self.clock.seconds())
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sender(self, attempts=6):
        self.delivered, self.failed = [], []
        poster = _Poster(self.post)
        self.assertTrue(verifyObject(IWebhookPoster, poster))
        return WebhookSender(clock=self.clock, poster=poster, attempts=attempts,
                             onDelivered=lambda t, n: self.delivered.append(n),
                             onFailed=lambda t, n: self.failed.append(n))

    def test_treqPoster(self):
        """
        The production poster provides L{IWebhookPoster}; closing it closes
        its kept connections.
        """
        from twisted.internet.testing import MemoryReactorClock

        from relay.alerts.delivery import TreqPoster

        poster = TreqPoster(MemoryReactorClock())
        self.assertTrue(verifyObject(IWebhookPoster, poster))
        self.successResultOf(poster.close())

    def test_backoff(self):
        """
        Retries wait 1, 2, 4... seconds, at most 60.
        """
        self.assertEqual([backoff(n) for n in range(1, 9)], [1, 2, 4, 8, 16, 32, 60, 60])

    def test_retriedWithBackoff(self):
        """
        A refused connection and a 503 are tried again after 1 s, then 2 s.
        """
        self.answers = [ConnectionRefusedError(f"refused by {URL}"), 503, 204]
        d = self.sender().send(self.target, _notice())
        self.assertNoResult(d)
        self.clock.advance(1)
        self.assertNoResult(d)
        self.clock.advance(2)
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(self.tries, [0, 1, 3])
        self.assertEqual(len(self.delivered), 1)

    def test_givesUp(self):
        """
        After C{attempts} failed tries the notice is given up and counted as failed.
        """
        self.answers = [500] * 3
        d = self.sender(attempts=3).send(self.target, _notice())
        self.clock.pump([1, 2, 4])
        self.assertFalse(self.successResultOf(d))
        self.assertEqual(self.tries, [0, 1, 3])
        self.assertEqual(len(self.failed), 1)

    def test_clientErrorNotRetried(self):
        """
        A 4xx other than 408, 425 or 429 is not retried.
        """
        self.answers = [404]
        self.assertFalse(self.successResultOf(self.sender().send(self.target, _notice())))
        self.assertEqual(self.tries, [0])

    def test_timeout(self):
        """
        A try that does not answer within the timeout is a failed try.
        """
        from twisted.internet.defer import Deferred

        hanging = []

        def post(url, body, timeout):
            hanging.append(Deferred())
            return hanging[-1]

        sender = WebhookSender(clock=self.clock, poster=_Poster(post), attempts=2, timeout=5)
        d = sender.send(self.target, _notice())
        self.clock.advance(5)
        self.assertEqual(len(hanging), 1)
        self.clock.advance(1)
        self.assertEqual(len(hanging), 2)
        self.clock.advance(5)
        self.assertFalse(self.successResultOf(d))

    def test_urlNeverLogged(self):
        """
        The logs name the target by its label; the URL's token is never in them.
        """
        self.answers = [ConnectionRefusedError(f"refused by {URL}"), 200]
        self.sender().send(self.target, _notice())
        self.clock.advance(1)
        from twisted.logger import formatEvent

        text = " ".join(formatEvent(e) + repr(e) for e in self.events)
        self.assertIn("webhooks[0]", text)
        self.assertNotIn("SECRET-TOKEN", text)


class WiringTests(SynchronousTestCase):
    """
    The request log tells its listeners of each record; a reload's
    settings apply.
    """

    def test_requestLogListeners(self):
        """
        Every request log tells its listeners of each record it is given.
        """
        from relay.tenants.requestlog import MemoryRequestLog, SQLiteRequestLog

        for cls in (MemoryRequestLog, SQLiteRequestLog):
            kwargs = {"database": None} if cls is SQLiteRequestLog else {}
            log = cls(clock=Clock(), **kwargs)
            seen = []
            log.listeners.append(seen.append)
            record = _MutableRecord()
            log.add(record)
            self.assertEqual(seen, [record], cls)

    def test_reconfigure(self):
        """
        A reload's section applies: interval, cool-off, forecast window, tries.
        """
        clock = Clock()
        sender = WebhookSender(clock=clock, poster=_Poster(None))
        monitor = AlertMonitor(clock=clock, settings=_settings(), sender=sender)
        monitor.startService()
        self.addCleanup(monitor.stopService)
        calls = []
        monitor.evaluate = lambda: calls.append(clock.seconds())
        monitor.reconfigure(_settings(evaluate_interval_seconds=2, cooloff_seconds=5,
                                      delivery_attempts=2, forecast_window_seconds=30))
        clock.advance(2)
        self.assertEqual(calls, [2])
        self.assertEqual((monitor.book.cooloff, monitor.rates.window, sender.attempts),
                         (5, 30, 2))

    def test_appBuildsTheMonitor(self):
        """
        A configuration with webhooks gets a monitor among the services,
        listening to the request log; without, none (and the budgets'
        gauge either way).
        """
        from relay.configuration.parse import settingsFromString
        from relay.process.app import buildApplication

        text = ("keys: [{name: t, key: sk-relay-t}]\n"
                "accounts: [{id: a1, type: apikey, api_key: sk-1}]\n"
                "database: ':memory:'\n")
        app = buildApplication(settingsFromString(text, environ={}), Clock())
        self.assertNotIn("alerts", app.extras)
        families = {f.name for f in app.runner.metrics.registry.collect()}
        self.assertIn("relay_key_budget_used_ratio", families)
        self.assertNotIn("relay_alerts_fired", families)
        app = buildApplication(settingsFromString(
            text + f"alerts: {{webhooks: [{{url: '{URL}'}}]}}\n", environ={}), Clock())
        monitor = app.extras["alerts"]
        self.assertIn(monitor, app.services)
        self.assertIn(monitor.turnRecorded, app.runner.requestLog.listeners)
        self.assertTrue(monitor.sending)
