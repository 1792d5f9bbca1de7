# -*- test-case-name: tests.test_usage -*-
"""
The usage ledger: counts every turn's tokens per client key, account and
model, rolls them up per UTC hour, flushes them to an
L{relay.interfaces.IUsageStore} periodically (never per request), answers
C{GET /admin/usage}, and enforces the optional per-key token budgets
(C{keys[].daily_tokens}, C{keys[].monthly_tokens}) before a turn starts
(issue 13 item 5).

Budgets count input + output tokens per UTC day and UTC month. What other
relay processes used reaches this one at its next flush (the store's totals
are read back then); a turn is refused once the key's total has reached its
budget, so one turn may take a key past it.
"""

from __future__ import annotations

import time
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.model import ClientError
from relay.usage.store import DAY, dayStart, hourOf, monthStart, nextMonthStart
from relay.usage.tokens import TokenCounts

__all__ = ["UsageLedger", "budgetError"]


def _iso(seconds: float) -> str:
    """
    @return: C{seconds} as an ISO 8601 UTC time, e.g.
        C{2026-01-02T00:00:00Z}.
    """
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def budgetError(keyName: str, budget: str, limit: int, used: int, resetsAt: float,
                now: float) -> ClientError:
    """
    The 429 a key gets once its token budget is spent: the message names the
    budget and when it resets; C{Retry-After} is the seconds until then.

    @param keyName: the client key's name (never its secret).
    @param budget: C{daily_tokens} or C{monthly_tokens}.
    @param limit: the budget in tokens.
    @param used: tokens counted so far in the period.
    @param resetsAt: Unix seconds of the next UTC day or month.
    @param now: Unix seconds.
    @rtype: L{ClientError}
    """
    period = "UTC day" if budget == "daily_tokens" else "UTC month"
    message = (
        f"Token budget exhausted for key {keyName!r}: {budget} is {limit} and {used} were used"
        f" this {period}; it resets at {_iso(resetsAt)}."
    )
    wait = max(1, int(resetsAt - now + 0.999))
    reason = f"token budget {budget} exhausted; resets at {_iso(resetsAt)}"
    return ClientError(
        429,
        "insufficient_quota",
        message,
        code="insufficient_quota",
        headers=(("Retry-After", str(wait)),),
        wsClose=(1013, reason),
    )


@define(eq=False)
class UsageLedger:
    """
    Token accounting for one relay process.

    @ivar clock: the injected L{IReactorTime}.
    @ivar store: the L{relay.interfaces.IUsageStore}.
    @ivar metrics: optional L{relay.operator.metrics.RelayMetrics} (token counters).
    @ivar budgets: key name -> C{(daily_tokens, monthly_tokens)}, each an
        C{int} or L{None}; keys without a budget are absent.
    @ivar flushTimeout: seconds a flush may take before it is abandoned (the
        rows are kept for the next one).
    """

    clock: IReactorTime
    store: Any
    metrics: Any = None
    budgets: dict = field(factory=dict)
    flushTimeout: float = 30.0
    _pending: dict = field(factory=dict)
    _stored: dict = field(factory=dict)
    _local: dict = field(factory=dict)
    _flushing: Deferred | None = None
    _log = Logger()

    # -- recording (the hot path: no I/O) ------------------------------------

    def record(self, key: str, account: str, model: str, counts: TokenCounts) -> None:
        """
        Count one turn's tokens: Prometheus counters at once, the hourly
        row in memory until the next L{flush}.

        @param key: the client key's name.
        @param account: the account id that served the turn.
        @param model: the upstream model relay asked for.
        @param counts: the turn's L{TokenCounts}.
        """
        now = self.clock.seconds()
        ident = (hourOf(now), key, account, model)
        self._pending[ident] = self._pending.get(ident, TokenCounts()) + counts
        if key in self.budgets:
            for period in (("d", dayStart(now)), ("m", monthStart(now))):
                slot = (key,) + period
                self._local[slot] = self._local.get(slot, 0) + counts.total
        if self.metrics is not None:
            self.metrics.tokens(key, account, model, counts)

    # -- budgets -----------------------------------------------------------------

    def used(self, key: str, now: float) -> tuple:
        """
        Tokens a key used this UTC day and this UTC month, as far as this
        process knows (the store's totals at the last flush plus what was
        counted here since).

        @return: C{(day, month)}.
        """
        day, month = ("d", dayStart(now)), ("m", monthStart(now))
        return tuple(
            self._stored.get((key,) + period, 0) + self._local.get((key,) + period, 0)
            for period in (day, month)
        )

    def overBudget(self, key: str, now: float) -> ClientError | None:
        """
        Check C{key}'s token budgets before a turn starts.

        @param key: the client key's name.
        @param now: Unix seconds.
        @return: the 429 to answer with (L{budgetError}), or L{None} when
            the key may go on.
        """
        limits = self.budgets.get(key)
        if limits is None:
            return None
        daily, monthly = limits
        usedDay, usedMonth = self.used(key, now)
        if daily is not None and usedDay >= daily:
            return budgetError(key, "daily_tokens", daily, usedDay, dayStart(now) + DAY, now)
        if monthly is not None and usedMonth >= monthly:
            return budgetError(key, "monthly_tokens", monthly, usedMonth, nextMonthStart(now), now)
        return None

    def budgetView(self, now: float) -> list:
        """
        Each budgeted key's use, for C{/admin/usage} and the status page.

        @return: dicts with C{key}, C{daily_tokens}, C{daily_used},
            C{daily_resets_at}, C{monthly_tokens}, C{monthly_used},
            C{monthly_resets_at} (times in Unix seconds).
        """
        rows = []
        for key, (daily, monthly) in sorted(self.budgets.items()):
            usedDay, usedMonth = self.used(key, now)
            rows.append({
                "key": key,
                "daily_tokens": daily,
                "daily_used": usedDay,
                "daily_resets_at": dayStart(now) + DAY,
                "monthly_tokens": monthly,
                "monthly_used": usedMonth,
                "monthly_resets_at": nextMonthStart(now),
            })
        return rows

    # -- flushing and reading -------------------------------------------------

    def flush(self) -> Deferred:
        """
        Write the pending hourly rows to the store, then (with budgets) read
        the keys' day and month totals back. A failed write keeps the rows
        for the next flush. Never fails; errors are logged (a periodic job,
        style.md trap T26). Concurrent calls share one flush.

        @return: a L{Deferred} firing with L{None}.
        """
        if self._flushing is not None:
            d = Deferred()
            self._flushing.addBoth(lambda r: (d.callback(None), r)[1])
            return d
        self._flushing = Deferred.fromCoroutine(self._flush())

        def _done(result):
            self._flushing = None

        return self._flushing.addBoth(_done)

    async def _flush(self) -> None:
        rows, self._pending = self._pending, {}
        local = dict(self._local)
        if rows:
            try:
                await self.store.add(list(rows.items())).addTimeout(
                    self.flushTimeout, self.clock
                )
            except Exception as e:  # noqa: BLE001 - logged; rows kept
                for ident, counts in rows.items():
                    self._pending[ident] = counts + self._pending.get(ident, TokenCounts())
                self._log.error(
                    "storing usage failed ({error}); {rows} row(s) kept for the next flush",
                    event="relay.usage_flush_failed", error=repr(e), rows=len(rows),
                )
                return
            self._log.debug("stored {rows} usage row(s)", event="relay.usage_flushed",
                            rows=len(rows))
        if not self.budgets:
            return
        now = self.clock.seconds()
        day, month = dayStart(now), monthStart(now)
        try:
            totals = await self.store.budgetTotals(day, month).addTimeout(
                self.flushTimeout, self.clock
            )
        except Exception as e:  # noqa: BLE001 - logged; next flush retries
            self._log.error(
                "reading usage totals for budgets failed ({error})",
                event="relay.usage_flush_failed", error=repr(e),
            )
            return
        self._stored = {}
        for period, start, perKey in (("d", day, totals[0]), ("m", month, totals[1])):
            for key, tokens in perKey.items():
                self._stored[(key, period, start)] = tokens
        # What was counted before this flush is in the store's totals now;
        # keep only what was counted while it ran (and no stale periods).
        for slot in list(self._local):
            left = self._local[slot] - local.get(slot, 0)
            current = slot[2] == (day if slot[1] == "d" else month)
            if left > 0 and current:
                self._local[slot] = left
            else:
                del self._local[slot]

    async def totals(self, since: float, groupBy: str) -> list:
        """
        The totals since C{since}, grouped, for C{GET /admin/usage}; flushes
        first so the answer includes the turns just counted.

        @param since: Unix seconds (rounded down to the hour).
        @param groupBy: C{key}, C{account}, C{model} or C{hour}.
        @return: a list of dicts (C{<groupBy>} and the
            L{TokenCounts.asDict} fields), largest total first.
        @raise ValueError: for an unknown C{groupBy}.
        """
        await self.flush()
        found = await self.store.totals(since, groupBy).addTimeout(self.flushTimeout, self.clock)
        rows = [dict({groupBy: group}, **counts.asDict()) for group, counts in found.items()]
        rows.sort(key=lambda row: (-row["total_tokens"], str(row[groupBy])))
        return rows
