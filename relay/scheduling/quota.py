# -*- test-case-name: tests.test_quota -*-
"""
Usage windows of OAuth accounts and quota-aware ordering
(protocol.md 7.3).

L{UsageWindows} records each account's primary and secondary window
(used-percent, length, reset time, plan) from every upstream response that
carries them: HTTP response headers (C{x-codex-*}), the WebSocket
handshake's headers, and C{codex.rate_limits} events. It is per process
and in memory: every response carries the upstream's current figures, so
each process learns them from its own traffic. A window whose reset time
has passed counts as empty.

L{UsageWindows.rank} is the load-balance layer's quota key
(L{relay.scheduling.scheduler.AccountScheduler}): among accounts of equal priority the
one with the most remaining window comes first (lowest used-percent of its
fuller window, in whole points, then the earliest reset), and an account
whose primary or secondary window is at or above the threshold
(C{gateway.scheduling.quota_threshold_percent}, default 95) sorts after
every account of its priority below it. Accounts without data (API keys,
OAuth accounts not yet seen) count as empty.

L{UsageCollector} exports C{relay_account_usage_percent{account,window}}
and C{relay_account_usage_reset_timestamp_seconds{account,window}}.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from attrs import define, field
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.interfaces import IUsageWindows
from relay.oauth.tokens import STATUS_IN_DOUBT, STATUS_LOADING, STATUS_NEEDS_LOGIN, STATUS_OK
from relay.oauth.windows import (
    WINDOWS,
    Snapshot,
    windowsFromEvent,
    windowsFromHeaders,
)

_HEADER_MARK = "x-codex-primary-used-percent"


@implementer(IUsageWindows)
@define(eq=False)
class UsageWindows:
    """
    The per-process record of every account's windows (see the module
    docstring).

    @ivar _clock: Unix seconds.
    @ivar snapshots: account id -> L{Snapshot}.
    """

    _clock: IReactorTime
    snapshots: dict = field(factory=dict)

    def observeHeaders(self, account, headers: dict, source: str = "headers") -> None:
        """
        Record the windows an upstream response's headers carry (cheap when
        there are none).

        @param account: the L{relay.base.records.Account}.
        @param headers: lower-cased name -> value.
        """
        if _HEADER_MARK not in headers and "x-codex-secondary-used-percent" not in headers:
            return
        snapshot = windowsFromHeaders(headers, self._clock.seconds())
        if snapshot is not None:
            if source != "headers":
                snapshot = Snapshot(snapshot.primary, snapshot.secondary, snapshot.plan,
                                    snapshot.observed_at, source)
            self.snapshots[account.id] = snapshot

    def observeFrame(self, account, payload: bytes) -> None:
        """
        Record a C{codex.rate_limits} WebSocket frame (other frames are
        ignored after a substring check).

        @param payload: the raw frame.
        """
        if b"codex.rate_limits" not in payload:
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if not isinstance(event, dict) or event.get("type") != "codex.rate_limits":
            return
        snapshot = windowsFromEvent(event, self._clock.seconds())
        if snapshot is not None:
            self.snapshots[account.id] = snapshot

    def observe(self, accountId: str, snapshot: Snapshot) -> None:
        """
        Record a snapshot learnt outside traffic (a usage probe),
        unless traffic told something newer meanwhile.
        """
        current = self.snapshots.get(accountId)
        if current is None or current.observed_at <= snapshot.observed_at:
            self.snapshots[accountId] = snapshot

    def get(self, accountId: str) -> Optional[Snapshot]:
        """
        @return: the last L{Snapshot} of an account, or L{None}.
        """
        return self.snapshots.get(accountId)

    def rank(self, accountId: str, threshold: float) -> tuple:
        """
        The quota part of the load-balance sort key (see the module
        docstring): C{(over threshold, used points, earliest reset)}.
        """
        snapshot = self.snapshots.get(accountId)
        if snapshot is None:
            return (False, 0, math.inf)
        now = self._clock.seconds()
        over = any(
            w is not None and w.usedAt(now) >= threshold
            for w in (snapshot.primary, snapshot.secondary)
        )
        return (over, int(snapshot.used(now)), snapshot.resetOfFuller(now))

    def view(self, accountId: str) -> Optional[dict]:
        """
        @return: the admin view's C{usage} object, or L{None}.
        """
        snapshot = self.snapshots.get(accountId)
        return None if snapshot is None else snapshot.toJSON(self._clock.seconds())


TOKEN_STATUSES = (STATUS_OK, STATUS_IN_DOUBT, STATUS_NEEDS_LOGIN, STATUS_LOADING)
"""The C{status} label values of C{relay_oauth_token_status}."""


class UsageCollector(Collector):
    """
    Prometheus gauges of the usage windows and the OAuth token state:
    C{relay_account_usage_percent{account,window}},
    C{relay_account_usage_reset_timestamp_seconds{account,window}},
    C{relay_oauth_token_expiry_timestamp_seconds{account}},
    C{relay_oauth_token_status{account,status}} (1 for the account's
    current status, 0 for the others of L{TOKEN_STATUSES}: alert on
    C{relay_oauth_token_status{status="needs_login"} == 1}). No secrets:
    account ids and statuses only. (The counter
    C{relay_oauth_refresh_failures_total} is a real counter of
    L{relay.console.metrics.RelayMetrics}, so it adds up across workers.)
    """

    def __init__(self, windows: UsageWindows, credentials=None, accounts=()):
        self._windows = windows
        self._credentials = credentials
        self._accounts = accounts

    def describe(self):
        """
        Name the gauges up front.
        """
        return list(self._families())

    def _families(self):
        return (
            GaugeMetricFamily("relay_account_usage_percent",
                              "Used percent of an account's usage window",
                              labels=["account", "window"]),
            GaugeMetricFamily("relay_account_usage_reset_timestamp_seconds",
                              "When an account's usage window resets (Unix seconds)",
                              labels=["account", "window"]),
            GaugeMetricFamily("relay_oauth_token_expiry_timestamp_seconds",
                              "When an OAuth account's access token expires (Unix seconds)",
                              labels=["account"]),
            GaugeMetricFamily("relay_oauth_token_status",
                              "An OAuth account's token status (1 for the current one)",
                              labels=["account", "status"]),
        )

    def collect(self):
        """
        Read the snapshots at scrape time.
        """
        used, reset, expiry, status = self._families()
        now = self._windows._clock.seconds()
        for accountId, snapshot in list(self._windows.snapshots.items()):
            for name in WINDOWS:
                window = getattr(snapshot, name)
                if window is None:
                    continue
                used.add_metric([accountId, name], window.usedAt(now))
                if window.reset_at is not None:
                    reset.add_metric([accountId, name], window.reset_at)
        if self._credentials is not None:
            for account in self._accounts:
                view = self._credentials.view(account)
                if view.get("token_expires_at") is not None:
                    expiry.add_metric([account.id], view["token_expires_at"])
                current = view.get("token_status")
                if current is not None:
                    for name in TOKEN_STATUSES:
                        status.add_metric([account.id, name], 1.0 if name == current else 0.0)
        yield used
        yield reset
        yield expiry
        yield status
