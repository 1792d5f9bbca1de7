# -*- test-case-name: tests.test_alerts -*-
"""
The capacity forecast (docs/operating.md "Alerts", C{capacity_forecast}):
when the pool's 5-hour (primary) usage windows for a model run out at the
current rate.

L{WindowRates} keeps, per account, the primary window's used-percent as
relay observed it (protocol.md 7.3: C{x-codex-*} headers,
C{codex.rate_limits} events, usage probes; L{relay.scheduling.quota}) over
the last C{window} seconds. An account's rate is its growth since the
oldest kept observation divided by the time between them (or, when the
last is older than a tenth of the window, by the time since the oldest
less that tenth), so it falls back to zero when traffic stops; a drop
(the window reset, a banked reset redeemed) starts afresh.

L{runsOutIn} adds the accounts' remaining points and their rates: the pool
runs out after C{remaining / rate} seconds, except that a window that
resets before then comes back with 100 more points.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

from attrs import define, field


@define(eq=False)
class WindowRates:
    """
    See the module docstring.

    @ivar window: seconds of observations kept.
    """

    window: float = 900.0
    _samples: dict = field(factory=dict)

    def observe(self, accountId: str, at: float, usedPercent: float) -> None:
        """
        Keep one observation (a repeat of the last one's time is ignored).

        @param at: when relay observed it, Unix seconds.
        @param usedPercent: the primary window's used-percent then.
        """
        samples = self._samples.setdefault(accountId, deque())
        if samples and samples[-1][0] >= at:
            return
        if samples and usedPercent < samples[-1][1]:
            samples.clear()
        samples.append((at, usedPercent))

    def rate(self, accountId: str, now: float) -> float:
        """
        @return: percent points per second the account's window grew by
            over the kept span, 0 without two observations that far apart.
        """
        samples = self._samples.get(accountId)
        if not samples:
            return 0.0
        while len(samples) > 1 and samples[0][0] < now - self.window:
            samples.popleft()
        if samples[0][0] < now - self.window:
            samples.clear()
            return 0.0
        first, last = samples[0], samples[-1]
        grace = self.window / 10
        if now - first[0] < grace or last[1] <= first[1]:
            return 0.0
        # Observations come with traffic: up to a tenth of the window
        # without one still reads as the rate seen; longer lowers it.
        return (last[1] - first[1]) / max(last[0] - first[0], now - first[0] - grace)

    def forget(self, keep: Iterable[str]) -> None:
        """
        Drop the observations of accounts not in C{keep} (removed ones).
        """
        keep = set(keep)
        for accountId in [a for a in self._samples if a not in keep]:
            del self._samples[accountId]


def runsOutIn(windows: list, now: float) -> Optional[float]:
    """
    When a pool's windows run out at the current rate.

    @param windows: C{(used percent now, rate in points per second, reset
        time in Unix seconds or None)} per account.
    @param now: Unix seconds.
    @return: seconds, or L{None} when they do not run out (no use).
    """
    rate = sum(r for _, r, _ in windows)
    if rate <= 0:
        return None
    remaining = sum(max(0.0, 100.0 - used) for used, _, _ in windows)
    eta = remaining / rate
    counted = set()
    for _ in range(len(windows)):
        fresh = [i for i, (_, _, reset) in enumerate(windows)
                 if i not in counted and reset is not None and now < reset < now + eta]
        if not fresh:
            break
        counted.update(fresh)
        remaining += 100.0 * len(fresh)
        eta = remaining / rate
    return eta
