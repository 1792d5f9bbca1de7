# -*- test-case-name: tests.test_alerts -*-
"""
The alert monitor (docs/operating.md "Alerts"): every
C{alerts.evaluate_interval_seconds}, and soon after a turn that did not
complete, it reads relay's state, off the turn path, turns the readings
into conditions (L{relay.alerts.conditions}), asks the book
(L{relay.alerts.book.AlertBook}) what to tell, and hands each notice to
the webhook sender (L{relay.alerts.delivery.WebhookSender}) for every
target that takes its event.

What it reads (each reading is injected, so tests run on a
L{twisted.internet.task.Clock}):

  - the OAuth accounts' token status (C{login_needed});
  - the accounts' stored state (C{account_disabled});
  - a dry-run selection for every model clients asked for in the last
    hour (C{pool_exhausted});
  - the usage windows relay observed (C{capacity_forecast});
  - the usage ledger's budget view (C{key_budget});
  - the cost of the turns it was told of (L{turnRecorded}) over the last
    C{alerts.spend_window_seconds} (C{spend_rate}).

A reading that fails is logged and its event's conditions are left as
they were (neither fired nor resolved).

Metrics: C{relay_alerts_fired_total{event,state}} (notices, C{state}
C{firing} or C{resolved}), C{relay_alerts_delivered_total{event,target}}
and C{relay_alerts_failed_total{event,target}} (given up after every
try); C{target} is C{webhooks[i]}, never a URL.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from relay.alerts import conditions
from relay.alerts.book import AlertBook
from relay.alerts.forecast import WindowRates
from relay.base.alertsettings import (
    ACCOUNT_DISABLED,
    CAPACITY_FORECAST,
    KEY_BUDGET,
    LOGIN_NEEDED,
    POOL_EXHAUSTED,
    SPEND_RATE,
    AlertSettings,
)

DEMAND_SECONDS = 3600.0
"""A model is watched for C{pool_exhausted} and C{capacity_forecast} until
no turn asked for it for this long."""

READ_TIMEOUT_SECONDS = 10.0
"""A reading (a store, a dry-run selection) that takes longer fails."""

MAX_MODELS = 256
"""At most this many models are watched (the most recently asked for)."""

SOON_SECONDS = 1.0
"""After a turn that did not complete, the conditions are evaluated again
within this many seconds (at most once per such span)."""


class AlertMetrics:
    """
    The monitor's counters, in the registry given (relay's metrics
    registry: C{/metrics} serves them).
    """

    def __init__(self, registry) -> None:
        """
        @param registry: the L{prometheus_client.CollectorRegistry} to count in.
        """
        from prometheus_client import Counter

        self.fired = Counter("relay_alerts_fired", "Alert notices (firing or resolved)",
                             ["event", "state"], registry=registry)
        self.delivered = Counter("relay_alerts_delivered", "Alert notices a webhook took",
                                 ["event", "target"], registry=registry)
        self.failed = Counter("relay_alerts_failed",
                              "Alert notices not delivered after every try",
                              ["event", "target"], registry=registry)


def _target(target) -> str:
    """
    @return: the C{target} label of a webhook: C{webhooks[i]}, never its URL.
    """
    return target.label.split(" ", 1)[0]


@define(eq=False, slots=False)
class AlertMonitor(Service):
    """
    See the module docstring.

    @ivar clock: the injected L{IReactorTime}.
    @ivar settings: the L{AlertSettings}.
    @ivar sender: the L{relay.alerts.delivery.WebhookSender}.
    @ivar accounts: C{() -> iterable of Account}: the accounts in force.
    @ivar credentials: the L{relay.interfaces.ICredentialSource}, or L{None}.
    @ivar store: the account state store (C{getAccountStates}), or L{None}.
    @ivar canServe: C{async (model) -> ClientError or None}: what a turn
        for the model would be refused with now, or L{None}.
    @ivar windows: C{(account id) -> Snapshot or None}: the usage windows.
    @ivar budgets: C{(now) -> rows} (L{relay.usage.ledger.UsageLedger.budgetView}).
    @ivar metrics: an L{AlertMetrics}, or L{None}.
    @ivar sending: whether notices go out (only one process of a group
        sends).
    """

    clock: IReactorTime
    settings: AlertSettings
    sender: Any
    accounts: Callable[[], Any] = tuple
    credentials: Any = None
    store: Any = None
    canServe: Optional[Callable] = None
    windows: Optional[Callable] = None
    budgets: Optional[Callable] = None
    metrics: Optional[AlertMetrics] = None
    sending: bool = True
    modelName: Optional[Callable] = None
    """C{(name) -> known normalised name or None} (R110,
    L{relay.base.modelname.ModelCatalogue.canonical}): only known models
    are watched, whatever names clients send; L{None}: names as given."""
    book: AlertBook = field(init=False)
    rates: WindowRates = field(init=False)
    demand: dict = field(factory=dict)
    _costs: deque = field(factory=deque)
    _loop: Optional[LoopingCall] = None
    _running: Optional[Deferred] = None
    _again: bool = False
    _soon: Any = None
    _lastSoon: float = -1e18
    _log = Logger()

    def __attrs_post_init__(self) -> None:
        """
        Build the book and the window rates; count deliveries when there are metrics.
        """
        self.book = AlertBook(clock=self.clock, cooloff=self.settings.cooloff_seconds)
        self.rates = WindowRates(window=self.settings.forecast_window_seconds)
        if self.metrics is not None:
            self.sender.onDelivered = self._delivered
            self.sender.onFailed = self._failed

    # -- the service -------------------------------------------------------------

    def startService(self) -> None:
        """
        Evaluate every C{evaluate_interval_seconds}.
        """
        Service.startService(self)
        self._loop = LoopingCall(self.evaluate)
        self._loop.clock = self.clock
        self._loop.start(self.settings.evaluate_interval_seconds, now=False)

    def stopService(self):
        """
        Stop the timer and close the sender's connections (a delivery in
        flight is abandoned).
        """
        Service.stopService(self)
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._soon is not None and self._soon.active():
            self._soon.cancel()
        self._soon = None
        for pending in list(getattr(self.sender, "pending", ())):
            pending.cancel()
        close = getattr(getattr(self.sender, "poster", None), "close", None)
        return close() if close is not None else None

    def reconfigure(self, settings: AlertSettings) -> None:
        """
        Take a reloaded C{alerts:} section: webhooks and thresholds apply
        from the next evaluation; the book's conditions are kept.
        """
        interval = self.settings.evaluate_interval_seconds
        if settings.spend_window_seconds != self.settings.spend_window_seconds:
            self._costs.clear()  # its buckets were of the old window
        self.settings = settings
        self.book.cooloff = settings.cooloff_seconds
        self.rates.window = settings.forecast_window_seconds
        if hasattr(self.sender, "attempts"):
            self.sender.attempts = settings.delivery_attempts
            self.sender.timeout = settings.delivery_timeout_seconds
        if self._loop is not None and self._loop.running and (
                settings.evaluate_interval_seconds != interval):
            self._loop.stop()
            self._loop = LoopingCall(self.evaluate)
            self._loop.clock = self.clock
            self._loop.start(settings.evaluate_interval_seconds, now=False)

    # -- what the turns tell -------------------------------------------------------

    def turnRecorded(self, record) -> None:
        """
        A turn ended (a L{relay.tenants.record.TurnRecord}): note its model
        as asked for, its cost, and after one that did not complete,
        evaluate again soon. Cheap: it runs where the record is made.
        """
        now = self.clock.seconds()
        model = record.model
        if model and self.modelName is not None:
            model = self.modelName(model)
        if model:
            demand = self.demand
            demand.pop(model, None)
            demand[model] = now
            if len(demand) > MAX_MODELS:
                del demand[next(iter(demand))]
        if record.cost_nanos:
            # Costs in buckets of a 60th of the spend window: bounded,
            # however many turns a window holds.
            bucket = int(now * 60 // self.settings.spend_window_seconds)
            costs = self._costs
            if costs and costs[-1][0] == bucket:
                costs[-1][1] += record.cost_nanos
            else:
                costs.append([bucket, record.cost_nanos])
        if record.outcome != "completed" and self.running and self._soon is None:
            delay = max(0.0, self._lastSoon + SOON_SECONDS - now)
            self._soon = self.clock.callLater(delay, self._evaluateSoon)

    def _evaluateSoon(self) -> None:
        """
        The evaluation a turn that did not complete brought forward.
        """
        self._soon = None
        self._lastSoon = self.clock.seconds()
        self.evaluate()

    def spendPerHour(self, now: float) -> float:
        """
        @return: US dollars spent over the last C{spend_window_seconds}
            (turns this process saw, counted in 60ths of the window), per
            hour.
        """
        window = self.settings.spend_window_seconds
        costs = self._costs
        # A bucket counts while any of it is within the window.
        oldest = int((now - window) * 60 // window)
        while costs and costs[0][0] < oldest:
            costs.popleft()
        return sum(n for _, n in costs) / 1e9 * 3600.0 / window

    # -- evaluation ----------------------------------------------------------------

    def evaluate(self) -> Deferred:
        """
        Read, decide and send (one evaluation at a time: a call during one
        runs another after it).

        @return: a Deferred firing when this evaluation's notices were
            handed to the sender; it never fails.
        """
        if self._running is not None:
            self._again = True
            return self._running
        self._running = ensureDeferred(self._evaluate())
        self._running.addErrback(
            lambda f: self._log.failure("alert evaluation failed", f,
                                        event="relay.alert_read_failed"))

        def _done(result):
            """
            One evaluation at a time: run the one asked for meanwhile.
            """
            self._running = None
            if self._again:
                self._again = False
                return self.evaluate()
            return result

        return self._running.addBoth(_done)

    async def _evaluate(self) -> None:
        """
        Read each event's conditions, update the book, send its notices.
        """
        now = self.clock.seconds()
        for model in [m for m, t in self.demand.items() if t < now - DEMAND_SECONDS]:
            del self.demand[model]
        accounts = list(self.accounts())
        evaluated, found = [], []
        for event, reading in (
            (LOGIN_NEEDED, self._logins),
            (ACCOUNT_DISABLED, self._disabled),
            (POOL_EXHAUSTED, self._exhausted),
            (CAPACITY_FORECAST, self._forecasts),
            (KEY_BUDGET, self._keyBudgets),
            (SPEND_RATE, self._spend),
        ):
            try:
                found.extend(await ensureDeferred(reading(accounts, now)).addTimeout(
                    READ_TIMEOUT_SECONDS, self.clock))
            except Exception as e:  # noqa: BLE001 - one reading never stops the others
                # A store that does not answer, most likely: its conditions
                # stay as they were.
                self._log.error("reading {alert_event} failed ({error})",
                                event="relay.alert_read_failed", alert_event=event,
                                error=repr(e)[:300])
                continue
            evaluated.append(event)
        try:
            notices = self.book.update(evaluated, found)
        except Exception:  # noqa: BLE001 - a periodic job never fails (style.md T26)
            self._log.failure("alert evaluation failed", event="relay.alert_read_failed")
            return
        for notice in notices:
            self._dispatch(notice)

    def _dispatch(self, notice) -> None:
        """
        Log and count a notice; hand it to every target that takes its event.
        """
        c = notice.condition
        self._log.info("alert {alert_event} {state}: {summary}", event="relay.alert",
                       alert_event=c.event, state=notice.state, subject=c.subject,
                       summary=c.summary)
        if self.metrics is not None:
            self.metrics.fired.labels(event=c.event, state=notice.state).inc()
        if not self.sending:
            return
        for target in self.settings.webhooks:
            if c.event in target.events:
                self.sender.send(target, notice)

    def _delivered(self, target, notice) -> None:
        """
        Count a delivered notice.
        """
        self.metrics.delivered.labels(event=notice.condition.event, target=_target(target)).inc()

    def _failed(self, target, notice) -> None:
        """
        Count a notice given up.
        """
        self.metrics.failed.labels(event=notice.condition.event, target=_target(target)).inc()

    # -- the readings ----------------------------------------------------------------

    async def _logins(self, accounts, now) -> list:
        """
        C{login_needed}: the OAuth accounts' token status.
        """
        if self.credentials is None:
            return []
        views = [(a.id, self.credentials.view(a)) for a in accounts if a.type == "oauth"]
        return conditions.loginsNeeded(views)

    async def _disabled(self, accounts, now) -> list:
        """
        C{account_disabled}: the accounts' stored state.
        """
        if self.store is None or not accounts:
            return []
        runtimes = await self.store.getAccountStates([a.id for a in accounts])
        return conditions.accountsDisabled(runtimes)

    async def _exhausted(self, accounts, now) -> list:
        """
        C{pool_exhausted}: a dry-run selection per model asked for.
        """
        if self.canServe is None:
            return []
        refusals = {}
        for model in sorted(self.demand):
            if not any(a.servesModel(model) for a in accounts):
                # A name no account lists (a typo): not the pool's to serve.
                continue
            error = await ensureDeferred(self.canServe(model))
            if error is not None:
                refusals[model] = error
        return conditions.poolsExhausted(refusals)

    async def _forecasts(self, accounts, now) -> list:
        """
        C{capacity_forecast}: the usage windows' observations and rates.
        """
        if self.windows is None:
            return []
        known = {}
        for account in accounts:
            snapshot = self.windows(account.id) if account.type == "oauth" else None
            if snapshot is None or snapshot.primary is None:
                continue
            window = snapshot.primary
            self.rates.observe(account.id, snapshot.observed_at,
                               window.usedAt(snapshot.observed_at))
            known[account.id] = (account, window.usedAt(now),
                                 self.rates.rate(account.id, now), window.reset_at)
        self.rates.forget(known)
        pools = {}
        for model in sorted(self.demand):
            pools[model] = [(accountId, used, rate, reset)
                            for accountId, (account, used, rate, reset) in sorted(known.items())
                            if account.servesModel(model)]
        return conditions.capacityForecasts(pools, now, self.settings.capacity_forecast_minutes)

    async def _keyBudgets(self, accounts, now) -> list:
        """
        C{key_budget}: the ledger's budget view.
        """
        if self.budgets is None:
            return []
        return conditions.keyBudgets(self.budgets(now), self.settings.key_budget_percents)

    async def _spend(self, accounts, now) -> list:
        """
        C{spend_rate}: the turns' cost over the spend window.
        """
        return conditions.spendRate(self.spendPerHour(now), self.settings.spend_rate_usd_per_hour,
                                    self.settings.spend_window_seconds)
