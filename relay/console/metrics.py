# -*- test-case-name: tests.test_metrics -*-
"""
Prometheus metrics for relay, served at C{/metrics} and C{/admin/metrics},
both behind the admin key (L{relay.console.admin._GuardedMetrics}).

Every metric lives in the registry given to L{RelayMetrics}, never in
prometheus_client's global registry, so tests and several relays in one
process do not collide. The engine and entrypoints call the small record
methods of L{RelayMetrics}; they never touch the metric objects.

Names (all prefixed C{relay_}):

  - C{relay_turns_total{entrypoint,outcome}}
  - C{relay_failovers_total{from_account,to_account,reason}} (C{to_account}
    is C{none} when no account took the turn over)
  - C{relay_same_account_retries_total{reason}}
  - C{relay_cooldowns_total{reason}}
  - C{relay_waits_total{entrypoint,outcome}}, C{relay_wait_seconds{entrypoint}}
  - C{relay_slots_in_use{account}}, C{relay_slots_waiting{account}}
  - C{relay_first_output_seconds}
  - C{relay_upstream_status_total{status}} (HTTP statuses, and WebSocket
    handshake statuses: C{101} for each new upstream connection, the
    refusal's status otherwise)
  - C{relay_added_latency_seconds}
  - C{relay_ws_closes_total{code}}
  - C{relay_tokens_total{key,account,model,type}} (C{type}: C{input},
    C{cached_input}, C{output}, C{reasoning}) and
    C{relay_usage_turns_total{key,account,model}}: tokens counted from
    every turn's terminal usage; C{model} is the known
    normalised name or C{other} (R110, L{relay.base.modelname.ModelCatalogue}),
    and C{relay_usage_estimated_turns_total{key,account,model}}: turns among
    them counted from relay's estimate (behaviour.md R107)
  - from L{relay.scheduling.quota.UsageCollector}: the usage windows,
    C{relay_oauth_token_expiry_timestamp_seconds{account}},
    C{relay_oauth_token_status{account,status}} (1 for the current status of
    C{ok}, C{in_doubt}, C{needs_login}, C{loading}; 0 for the others)
  - C{relay_oauth_refresh_failures_total{account}}: failed OAuth token
    requests (transient, permanent or in doubt), counted by
    L{relay.oauth.credentials.OAuthCredentials} through
    L{RelayMetrics.oauthRefreshFailed}

Across workers: with C{workers: N} the supervisor gives its
workers a private directory in C{PROMETHEUS_MULTIPROC_DIR}
(L{relay.process.workers.MetricsDirectory}), and prometheus_client's multiprocess
mode keeps every worker's counters and histograms in files there; whichever
worker answers a scrape serves the sum of all of them (a
C{MultiProcessCollector}), so one scrape reports the whole group's
C{relay_turns_total}, failovers, waits, latencies, tokens... including
those of a worker that has since been restarted. The gauges relay reports
are read at scrape time from shared state, so the answering worker's
reading is the group's: C{relay_slots_in_use} / C{relay_slots_waiting} come
from Redis (the same numbers in every worker), the usage windows and token
status from the token store every worker follows (within its 15 s sync).
C{relay_oauth_refresh_failures_total} is a counter like the others: the sum
of every worker's failed token requests.

No C{_created} series: prometheus_client only has a process-wide switch
(C{disable_created_metrics()}), so the exposition reads the registry
through L{withoutCreated} instead, which drops them for relay's registry
only.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections import deque
from typing import Any, Callable, Optional

from attrs import define, field
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IEngineMetrics

__all__ = ["NO_ACCOUNT", "RelayMetrics", "SlotsCollector", "newRegistry", "withoutCreated"]

NO_ACCOUNT = "none"
"""The C{to_account} label of a failover no account took over."""

_WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_FIRST_OUTPUT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_ADDED_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess directory variable (read at import time
by prometheus_client itself, so it must be in the environment the process
starts with; L{relay.process.workers} sets it for its workers)."""


def multiprocessDirectory(environ=os.environ) -> Optional[str]:
    """
    @return: the multiprocess metrics directory of this process, or L{None}
        when it reports its own metrics only.
    """
    return environ.get(MULTIPROCESS_ENV) or None


def _adder(child) -> Callable[[float], None]:
    """
    What C{child.inc(amount)} does for a positive amount, in one call: the
    C{inc} of the value a labelled counter's child (or an unlabelled
    counter) holds -- prometheus_client's C{Counter.inc} first checks that
    the metric has its labels (a child always has) and that the amount is
    not negative (L{RelayMetrics.tokens} lets only positive amounts
    through; a negative one still goes to C{child.inc}, which refuses it).
    The value is the process's own or, across workers, its multiprocess
    file's (the same C{inc}). Relies on prometheus_client's C{_value}
    (C{tests.test_metrics} pins it).

    Another prometheus_client, without C{_value}, gets C{child.inc}.

    @param child: a L{Counter} with its labels.
    """
    value = getattr(child, "_value", None)
    return child.inc if value is None else value.inc


def _observer(histogram) -> Callable[[float], None]:
    """
    What C{histogram.observe(amount)} does, in one call: the sum grows by
    C{amount} and the first bucket whose upper bound is at least
    C{amount} by one (C{Histogram.observe}'s scan, as a bisection; the last
    bound is C{+Inf}). For amounts that are not NaN (the record methods
    pass C{max(0.0, seconds)}). Relies on prometheus_client's C{_sum},
    C{_buckets} and C{_upper_bounds} (C{tests.test_metrics} pins them).

    Another prometheus_client, without these, gets C{histogram.observe}.

    @param histogram: an unlabelled L{Histogram}, or a labelled one's child.
    """
    if not all(hasattr(histogram, name) for name in ("_sum", "_buckets", "_upper_bounds")):
        return histogram.observe
    add = histogram._sum.inc
    bounds = list(histogram._upper_bounds)
    buckets = [bucket.inc for bucket in histogram._buckets]

    def observe(amount: float) -> None:
        add(amount)
        buckets[bisect_left(bounds, amount)](1)

    return observe


def newRegistry() -> CollectorRegistry:
    """
    @return: a fresh registry, without the process/platform collectors.
    @rtype: L{CollectorRegistry}
    """
    return CollectorRegistry(auto_describe=True)


_CREATED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class _WithoutCreated:
    """
    A read-only view of a registry whose families have no C{<name>_created}
    samples; what L{withoutCreated} returns.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        """
        @param registry: the registry to read.
        """
        self._registry = registry

    def collect(self):
        """
        Yield the registry's metric families, each without its C{_created}
        samples (counters, histograms and summaries only).
        """
        for family in self._registry.collect():
            if family.type in _CREATED_TYPES:
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
            yield family


def withoutCreated(registry: CollectorRegistry):
    """
    What to hand prometheus_client's encoders instead of C{registry}: the
    same metrics without C{_created} series (a per-registry alternative to
    the process-wide C{prometheus_client.disable_created_metrics()}).

    @param registry: a L{CollectorRegistry}.
    @return: an object with C{collect()}, as the encoders expect.
    """
    return _WithoutCreated(registry)


class SlotsCollector(Collector):
    """
    Reports C{relay_slots_in_use} and C{relay_slots_waiting} per account from
    a callable, read at scrape time.

    The callable must be synchronous and cheap: it returns
    C{{account_id: (in_use, waiting)}}, typically a snapshot the admission
    layer keeps up to date. An exception in it is logged and the scrape
    reports no samples for these two gauges.
    """

    _log = Logger()

    def __init__(self) -> None:
        self.source: Optional[Callable[[], dict]] = None

    def describe(self):
        """
        Describe both gauges (so the registry knows their names up front).
        """
        return [
            GaugeMetricFamily("relay_slots_in_use", "Account slots held", labels=["account"]),
            GaugeMetricFamily(
                "relay_slots_waiting", "Requests waiting for an account slot", labels=["account"]
            ),
        ]

    def collect(self):
        """
        Read the source and yield both gauges.
        """
        inUse = GaugeMetricFamily("relay_slots_in_use", "Account slots held", labels=["account"])
        waiting = GaugeMetricFamily(
            "relay_slots_waiting", "Requests waiting for an account slot", labels=["account"]
        )
        if self.source is not None:
            try:
                loads = self.source() or {}
                for account, (used, queued) in sorted(loads.items()):
                    inUse.add_metric([str(account)], float(used))
                    waiting.add_metric([str(account)], float(queued))
            except Exception:
                self._log.failure("slot source failed", event="relay.metrics_slots_failed")
        yield inUse
        yield waiting


@implementer(IEngineMetrics)
@define(eq=False, slots=False)
class RelayMetrics:
    """
    relay's metrics in one registry, with the record methods the engine and
    entrypoints call. Also keeps the most recent failovers for the status
    page (L{recentFailovers}).

    @ivar registry: the L{CollectorRegistry} holding every metric.
    @ivar clock: timestamps for L{recentFailovers}; L{None} leaves them out.
    @ivar recentLimit: how many failovers L{recentFailovers} keeps.
    """

    registry: CollectorRegistry = field(factory=newRegistry)
    _clock: Optional[IReactorTime] = None
    recentLimit: int = 50
    multiprocessDir: Optional[str] = field(factory=multiprocessDirectory)
    models: Any = None
    """The L{relay.base.modelname.ModelCatalogue} whose L{label
    <relay.base.modelname.ModelCatalogue.label>} names the C{model} label
    (R110: the known normalised name or C{other}, a bounded set whatever
    clients send), or L{None}: the name as given."""
    exposed: CollectorRegistry = field(init=False)
    """The registry C{/metrics} serves: L{registry} itself, or with
    L{multiprocessDir} a registry with the whole process group's counters
    and histograms and this process's scrape-time collectors (see the
    module docstring)."""
    _recent: deque = field(init=False)
    _slots: SlotsCollector = field(init=False)
    _tokenChildren: dict = field(init=False, factory=dict)
    _turnChildren: dict = field(init=False, factory=dict)
    _statusChildren: dict = field(init=False, factory=dict)
    _costChildren: dict = field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        r = self.registry
        self._recent = deque(maxlen=self.recentLimit)
        self.turns = Counter(
            "relay_turns", "Finished turns", ["entrypoint", "outcome"], registry=r
        )
        self.failovers = Counter(
            "relay_failovers",
            "Switches to another account",
            ["from_account", "to_account", "reason"],
            registry=r,
        )
        self.sameAccountRetries = Counter(
            "relay_same_account_retries", "Retries on the same account", ["reason"], registry=r
        )
        self.cooldowns = Counter(
            "relay_cooldowns", "Account cooldowns written, by kind", ["reason"], registry=r
        )
        self.waits = Counter(
            "relay_waits", "Slot waits by outcome", ["entrypoint", "outcome"], registry=r
        )
        self.waitSeconds = Histogram(
            "relay_wait_seconds",
            "Time spent waiting for a slot",
            ["entrypoint"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.firstOutputSeconds = Histogram(
            "relay_first_output_seconds",
            "Time from the turn's start to the first semantic output",
            buckets=_FIRST_OUTPUT_BUCKETS,
            registry=r,
        )
        self.upstreamStatuses = Counter(
            "relay_upstream_status", "Upstream HTTP statuses", ["status"], registry=r
        )
        self.addedLatencyHistogram = Histogram(
            "relay_added_latency_seconds",
            "Latency relay adds on top of upstream (selection, admission, dial setup)",
            buckets=_ADDED_LATENCY_BUCKETS,
            registry=r,
        )
        self.wsCloses = Counter(
            "relay_ws_closes", "WebSocket close codes sent to clients", ["code"], registry=r
        )
        self.tokenCounter = Counter(
            "relay_tokens",
            "Tokens counted from upstream usage (cached within input, reasoning within output)",
            ["key", "account", "model", "type"],
            registry=r,
        )
        self.usageTurns = Counter(
            "relay_usage_turns",
            "Turns whose usage was counted",
            ["key", "account", "model"],
            registry=r,
        )
        # Cost in money, and the turns relay could not price.
        self.costCounter = Counter(
            "relay_cost_usd",
            "Cost of priced turns in US dollars (relay.tenants.prices)",
            ["key", "account", "model"],
            registry=r,
        )
        self.unpricedTurns = Counter(
            "relay_unpriced_turns",
            "Turns on a model without a price (their cost is unknown, not zero)",
            ["key", "account", "model"],
            registry=r,
        )
        self.estimatedTurns = Counter(
            "relay_usage_estimated_turns",
            "Turns whose usage relay estimated: the client left and the upstream's usage"
            " could not be read (R107)",
            ["key", "account", "model"],
            registry=r,
        )
        self.requests = Counter(
            "relay_requests",
            "Finished requests that are not turns (compact, retrieve, cancel, ...), R87",
            ["kind", "outcome"],
            registry=r,
        )
        self.oauthRefreshFailures = Counter(
            "relay_oauth_refresh_failures",
            "OAuth token requests that failed (transient, permanent or in doubt)",
            ["account"],
            registry=r,
        )
        # The per-turn updates, bound once (L{_observer}).
        self._observeFirstOutput = _observer(self.firstOutputSeconds)
        self._observeAddedLatency = _observer(self.addedLatencyHistogram)
        self._slots = SlotsCollector()
        r.register(self._slots)
        self.exposed = r
        if self.multiprocessDir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, path=self.multiprocessDir)
            self.exposed.register(self._slots)

    def addCollector(self, collector: Collector) -> None:
        """
        Register a scrape-time collector (e.g. the usage windows) in
        L{registry} and, across workers, in L{exposed} too.
        """
        self.registry.register(collector)
        if self.exposed is not self.registry:
            self.exposed.register(collector)

    def oauthAccounts(self, accountIds) -> None:
        """
        Report C{relay_oauth_refresh_failures_total} of these OAuth
        accounts from the start (0 until a token request fails), so an
        alert rule sees the series before the first failure.

        @param accountIds: account ids.
        """
        for accountId in accountIds:
            self.oauthRefreshFailures.labels(account=str(accountId))

    def oauthRefreshFailed(self, accountId: str) -> None:
        """
        Count one failed OAuth token request of C{accountId} (transient,
        permanent or in doubt; L{relay.oauth.credentials}).
        """
        self.oauthRefreshFailures.labels(account=str(accountId)).inc()

    def turnFinished(self, entrypoint: str, outcome: str) -> None:
        """
        Count a finished turn.

        @param entrypoint: C{http} or C{ws}.
        @param outcome: e.g. C{ok}, C{error}, C{client_gone}, C{exhausted}.
        """
        key = (entrypoint, outcome)
        add = self._turnChildren.get(key)
        if add is None:
            add = self._turnChildren[key] = _adder(
                self.turns.labels(entrypoint=entrypoint, outcome=outcome))
        add(1)

    def requestFinished(self, kind: str, outcome: str) -> None:
        """
        Count a finished request of its own kind (behaviour.md R87).

        @param kind: C{compact}, C{retrieve}, C{stream}, C{delete},
            C{input_items}, C{cancel}, C{input_tokens}, C{models} or C{manifest}.
        @param outcome: as for L{turnFinished}.
        """
        self.requests.labels(kind=kind, outcome=outcome).inc()

    def failover(
        self,
        reason: str,
        accountId: Optional[str] = None,
        nextAccountId: Optional[str] = None,
        entrypoint: Optional[str] = None,
        status: Optional[int] = None,
    ) -> None:
        """
        Record a switch away from an account, and remember it for the status
        page. It is counted in C{relay_failovers_total} once the account
        that takes the turn over is known: now when C{nextAccountId} is
        given, else when the caller passes the returned entry to
        L{failoverTo}.

        @param reason: the verdict's machine reason (e.g. C{status_503}).
        @param accountId: the account switched away from.
        @param nextAccountId: the account switched to, when known.
        @param entrypoint: C{http} or C{ws}.
        @param status: the upstream (or synthetic) status.
        @return: the remembered entry (a dict), for L{failoverTo}.
        """
        entry = {
            "at": self._clock.seconds() if self._clock is not None else None,
            "reason": reason,
            "account_id": accountId,
            "next_account_id": nextAccountId,
            "entrypoint": entrypoint,
            "upstream_status": status,
        }
        self._recent.appendleft(entry)
        if nextAccountId is not None:
            self.failoverTo(entry, nextAccountId)
        return entry

    def failoverTo(self, entry: dict, nextAccountId: Optional[str]) -> None:
        """
        Count a switch recorded by L{failover} now that its next account is
        known, and show it on the status page.

        @param entry: what L{failover} returned.
        @param nextAccountId: the account that took the turn over, or
            L{None} when none did (no account left, the switch budget ran
            out, or the client left): counted as C{to_account="none"}.
        """
        entry["next_account_id"] = nextAccountId
        self.failovers.labels(
            from_account=str(entry.get("account_id") or NO_ACCOUNT),
            to_account=str(nextAccountId or NO_ACCOUNT),
            reason=str(entry.get("reason") or "unknown"),
        ).inc()

    def recentFailovers(self) -> list:
        """
        @return: the most recent failovers, newest first, as dicts with
            C{at}, C{reason}, C{account_id}, C{next_account_id},
            C{entrypoint}, C{upstream_status}.
        @rtype: L{list}
        """
        return [dict(entry) for entry in self._recent]

    def sameAccountRetry(self, reason: str) -> None:
        """
        Count a same-account retry (R13, R14, R72).
        """
        self.sameAccountRetries.labels(reason=reason).inc()

    def cooldown(self, reason: str) -> None:
        """
        Count an account state written (the marking kind, e.g.
        C{temp_unschedulable}, C{rate_limited}, C{breaker_open}).
        """
        self.cooldowns.labels(reason=reason).inc()

    def waitFinished(self, entrypoint: str, outcome: str, seconds: float) -> None:
        """
        Count a finished slot wait and observe its duration.

        @param outcome: C{acquired}, C{queue_full}, C{timeout},
            C{client_gone} or C{error}.
        @param seconds: time spent waiting.
        """
        self.waits.labels(entrypoint=entrypoint, outcome=outcome).inc()
        self.waitSeconds.labels(entrypoint=entrypoint).observe(max(0.0, seconds))

    def firstOutput(self, seconds: float) -> None:
        """
        Observe the time to first semantic output.
        """
        self._observeFirstOutput(max(0.0, seconds))

    def upstreamStatus(self, status) -> None:
        """
        Count an upstream HTTP status (or a synthetic one, e.g. 502 for a
        transport failure), or an upstream WebSocket handshake's status
        (101, or the status that refused it).
        """
        add = self._statusChildren.get(status)
        if add is None:
            add = _adder(self.upstreamStatuses.labels(status=str(status)))
            if len(self._statusChildren) < 1024:
                self._statusChildren[status] = add
        add(1)

    def addedLatency(self, seconds: float) -> None:
        """
        Observe the latency relay added before the upstream request.
        """
        self._observeAddedLatency(max(0.0, seconds))

    def tokens(self, key: str, account: str, model: str, counts) -> None:
        """
        Count one turn's tokens.

        @param key: the client key's name.
        @param account: the account id.
        @param model: the upstream model (labelled by L{models}, R110).
        @param counts: a L{relay.usage.tokens.TokenCounts}.
        """
        if self.models is not None:
            model = self.models.label(model)
        children = self._tokenChildren.get((key, account, model))
        if children is None:
            # labels() costs about a microsecond each; cache the five per
            # (key, account, model) - a bounded set (configured names).
            labels = {"key": key, "account": account, "model": model}
            children = (self.usageTurns.labels(**labels),) + tuple(
                self.tokenCounter.labels(type=kind, **labels)
                for kind in ("input", "cached_input", "output", "reasoning")
            )
            children = (children, tuple(_adder(child) for child in children))
            self._tokenChildren[(key, account, model)] = children
        # A zero is not added (each inc takes the child's lock); a
        # negative one goes to the child's inc, which refuses it.
        amounts = (counts.requests, counts.input, counts.cached, counts.output,
                   counts.reasoning)
        for child, add, n in zip(children[0], children[1], amounts):
            if n > 0:
                add(n)
            elif n:
                child.inc(n)
        if counts.cost:
            # The cost series appears with the first priced turn, as before.
            child = self._costChildren.get((key, account, model))
            if child is None:
                child = self._costChildren[(key, account, model)] = self.costCounter.labels(
                    key=key, account=account, model=model)
            child.inc(counts.cost / 1e9)
        if counts.unpriced:
            self.unpricedTurns.labels(key=key, account=account, model=model).inc(counts.unpriced)
        if counts.estimated:
            self.estimatedTurns.labels(key=key, account=account, model=model).inc(
                counts.estimated)

    def wsClose(self, code: int) -> None:
        """
        Count a WebSocket close code sent to a client.
        """
        self.wsCloses.labels(code=str(code)).inc()

    def setSlotsSource(self, source: Optional[Callable[[], dict]]) -> None:
        """
        Set where C{relay_slots_in_use}/C{relay_slots_waiting} come from.

        @param source: a synchronous callable returning
            C{{account_id: (in_use, waiting)}}, or L{None} to report none.
        """
        self._slots.source = source
