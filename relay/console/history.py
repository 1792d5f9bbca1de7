# -*- test-case-name: tests.test_history -*-
"""
Per-account history for the status page: per one-minute bucket
of the injected clock, how many attempts each account got, how many
failovers left it, and the median time to first output of the turns it
served, for the last L{MINUTES} minutes.

Memory is bounded: at most L{MINUTES} + 1 buckets per account (older ones
are dropped as the clock moves), and a bucket's latencies are counted in
fixed log-spaced bins (L{LATENCY_RATIO} apart, L{LATENCY_BINS} of them)
rather than kept one by one, so a busy minute costs no more than a quiet
one. The median is read from the bins: within half a bin (about 5 %) of the
true value. Accounts are only those the engine names (the configured
ones).

Nothing here is persisted or shared between processes: with several
relays each page shows its own process.
"""

from __future__ import annotations

import math
from collections import deque

from attrs import define, field
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.interfaces import IAccountHistory

__all__ = ["BUCKET_SECONDS", "MINUTES", "AccountHistory"]

MINUTES = 15
"""How many minutes the status page charts."""

BUCKET_SECONDS = 60
"""The width of one bucket, in seconds."""

LATENCY_RATIO = 1.1
"""Consecutive latency bins differ by this factor (bin edges in ms)."""

LATENCY_BINS = 160
"""Bins from 1 ms up to about 4 hours (1.1 ** 160 ms); slower lands in the last."""

_LOG_RATIO = math.log(LATENCY_RATIO)


def _latencyBin(milliseconds: float) -> int:
    """
    @return: the bin of a latency: 0 below 1 ms, else
        C{1 + floor(log(ms) / log(ratio))}, capped at the last bin.
    """
    if milliseconds < 1:
        return 0
    return min(LATENCY_BINS - 1, 1 + int(math.log(milliseconds) / _LOG_RATIO))


def _binValue(index: int) -> float:
    """
    @return: a bin's representative latency in ms (its geometric middle;
        0.5 ms for bin 0).
    """
    if index == 0:
        return 0.5
    return LATENCY_RATIO ** (index - 1) * math.sqrt(LATENCY_RATIO)


@define(eq=False)
class _Minute:
    """
    One account's counts in one bucket.

    @ivar index: the bucket number (clock seconds // L{BUCKET_SECONDS}).
    @ivar latencies: bin index -> count.
    """

    index: int
    requests: int = 0
    failovers: int = 0
    latencies: dict = field(factory=dict)

    def median(self) -> float | None:
        """
        @return: the median first-output latency in ms (the lower median
            for an even count), or L{None} without samples.
        """
        total = sum(self.latencies.values())
        if not total:
            return None
        rank = (total + 1) // 2
        seen = 0
        for index in sorted(self.latencies):
            seen += self.latencies[index]
            if seen >= rank:
                return round(_binValue(index), 1)
        return None  # pragma: no cover - rank <= total


@implementer(IAccountHistory)
@define(eq=False)
class AccountHistory:
    """
    The in-memory L{IAccountHistory}.

    @ivar minutes: buckets per account (the chart's width).
    """

    _clock: IReactorTime
    minutes: int = MINUTES
    _accounts: dict = field(factory=dict)

    def _bucket(self, accountId: str) -> _Minute:
        """
        The current bucket of C{accountId}, starting a new one (and
        dropping the oldest) when the clock entered a new minute.
        """
        index = int(self._clock.seconds() // BUCKET_SECONDS)
        buckets = self._accounts.get(accountId)
        if buckets is None:
            buckets = self._accounts[accountId] = deque(maxlen=self.minutes)
        if not buckets or buckets[-1].index != index:
            buckets.append(_Minute(index=index))
        return buckets[-1]

    def attempt(self, accountId: str) -> None:
        """
        See L{IAccountHistory.attempt}.
        """
        self._bucket(accountId).requests += 1

    def failover(self, accountId: str) -> None:
        """
        See L{IAccountHistory.failover}.
        """
        self._bucket(accountId).failovers += 1

    def firstOutput(self, accountId: str, seconds: float) -> None:
        """
        See L{IAccountHistory.firstOutput}.
        """
        latencies = self._bucket(accountId).latencies
        index = _latencyBin(max(0.0, seconds) * 1000)
        latencies[index] = latencies.get(index, 0) + 1

    def snapshot(self) -> dict:
        """
        See L{IAccountHistory.snapshot}.
        """
        last = int(self._clock.seconds() // BUCKET_SECONDS)
        first = last - self.minutes + 1
        accounts = {}
        for accountId, buckets in self._accounts.items():
            byIndex = {b.index: b for b in buckets if b.index >= first}
            requests, failovers, medians = [], [], []
            for index in range(first, last + 1):
                bucket = byIndex.get(index)
                requests.append(bucket.requests if bucket else 0)
                failovers.append(bucket.failovers if bucket else 0)
                medians.append(bucket.median() if bucket else None)
            accounts[accountId] = {
                "requests": requests,
                "failovers": failovers,
                "first_output_p50_ms": medians,
            }
        return {
            "minutes": self.minutes,
            "bucket_seconds": BUCKET_SECONDS,
            "start": first * BUCKET_SECONDS,
            "accounts": accounts,
        }
