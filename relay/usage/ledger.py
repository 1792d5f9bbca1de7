# -*- test-case-name: tests.test_usage -*-
"""
The usage ledger: counts every turn's tokens per client key, account and
model, rolls them up per UTC hour, flushes them to an
L{relay.interfaces.IUsageStore} periodically (never per request), answers
C{GET /admin/usage}, and enforces the optional per-key token budgets
(C{keys[].daily_tokens}, C{keys[].monthly_tokens}) before a turn starts.

Budgets count input + output tokens per UTC day and UTC month. What other
relay processes used reaches this one at its next flush (the store's totals
are read back then).

Reservations (behaviour.md R108): with an L{relay.interfaces.IBudgetHolds}
(L{holds}), a turn of a key with a budget L{reserve}s its estimate before
it is dialled and L{settle}s to its real tokens and cost at its end (or
L{release}s it, refused or failed before output). The check counts the
holds of the key's other turns and what turns settled in the holds' store
(every process, at once), so N parallel turns end at most one turn's
settled cost above the budget, to the accuracy of the estimates. A turn
whose cost is unknown (unpriced) settles at its estimate: never free. A
store error admits the turn without a hold (C{fail_open}, logged) or
refuses it with a 503 (C{fail_closed}, R35).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IUsageLedger
from relay.base.records import ClientError
from relay.usage.store import DAY, dayStart, hourOf, monthStart, nextMonthStart
from relay.usage.tokens import TokenCounts

__all__ = ["Hold", "UsageLedger", "budgetError"]


def _iso(seconds: float) -> str:
    """
    @return: C{seconds} as an ISO 8601 UTC time, e.g.
        C{2026-01-02T00:00:00Z}.
    """
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def budgetError(keyName: str, budget: str, limit, used, resetsAt: float,
                now: float) -> ClientError:
    """
    The 429 a key gets once its token budget is spent: the message names the
    budget and when it resets; C{Retry-After} is the seconds until then. On
    an open WebSocket it is answered in-band with its reset time
    (C{wsInband}, C{resetsAt}; behaviour.md R113); on every entrypoint it
    is in the shape Codex renders with that time (C{usageLimit}: the body's
    C{error.type} is C{usage_limit_reached} with C{resets_at} and
    C{resets_in_seconds}, C{code} stays C{insufficient_quota}; the message
    also in the C{x-codex-promo-message} header Codex prints it from).

    @param keyName: the client key's name (never its secret).
    @param budget: C{daily_tokens}, C{monthly_tokens}, C{daily_usd} or
        C{monthly_usd}.
    @param limit: the budget in tokens (or dollars).
    @param used: tokens (or dollars) counted so far in the period.
    @param resetsAt: Unix seconds of the next UTC day or month.
    @param now: Unix seconds.
    @rtype: L{ClientError}
    """
    period = "UTC day" if budget.startswith("daily") else "UTC month"
    if budget.endswith("_usd"):
        what = "Money budget"
        message = (
            f"Money budget exhausted for key {keyName!r}: {budget} is ${limit:.2f} and"
            f" ${used:.4f} was spent this {period}; it resets at {_iso(resetsAt)}."
        )
    else:
        what = "Token budget"
        message = (
            f"Token budget exhausted for key {keyName!r}: {budget} is {limit} and {used} were"
            f" used this {period}; it resets at {_iso(resetsAt)}."
        )
    wait = max(1, int(resetsAt - now + 0.999))
    reason = f"{what.lower()} {budget} exhausted; resets at {_iso(resetsAt)}"
    return ClientError(
        429,
        "insufficient_quota",
        message,
        code="insufficient_quota",
        headers=(("Retry-After", str(wait)),),
        wsClose=(1013, reason),
        wsInband=True,
        resetsAt=resetsAt,
        usageLimit=True,
    )


@define(eq=False)
class Hold:
    """
    One turn's budget reservation (R108), kept on the turn
    (C{Turn.budgetHold}).

    @ivar key: the client key's name.
    @ivar id: the hold's unique id in the store.
    @ivar tokens: the estimated tokens held.
    @ivar nanos: the estimated cost held, nano-dollars.
    @ivar held: whether the store holds it (L{False}: admitted without a
        hold, the store was down and C{fail_open}).
    @ivar settled: its turn's usage was counted (once).
    @ivar released: given back without a count (once; a later usage still
        settles, e.g. a background response's or a drained one's, R107).
    @ivar responseId: the turn's response id, once known: its tokens are
        kept for a turn chained on it.
    """

    key: str
    id: str
    tokens: int
    nanos: int
    held: bool = True
    settled: bool = False
    released: bool = False
    responseId: Optional[str] = None
    chainKept: bool = False


@implementer(IUsageLedger)
@define(eq=False)
class UsageLedger:
    """
    Token accounting for one relay process.

    @ivar clock: the injected L{IReactorTime}.
    @ivar store: the L{relay.interfaces.IUsageStore}.
    @ivar metrics: optional L{relay.console.metrics.RelayMetrics} (token counters).
    @ivar budgets: key name -> C{(daily_tokens, monthly_tokens)}, each an
        C{int} or L{None}; keys without a budget are absent.
    @ivar moneyBudgets: key name -> C{(daily_usd, monthly_usd)}, each a
        C{float} or L{None}; keys without one are absent.
    @ivar flushTimeout: seconds a flush may take before it is abandoned (the
        rows are kept for the next one).
    """

    clock: IReactorTime
    store: Any
    metrics: Any = None
    budgets: dict = field(factory=dict)
    flushTimeout: float = 30.0
    moneyBudgets: dict = field(factory=dict)
    holds: Any = None
    """R108: the L{relay.interfaces.IBudgetHolds}, or L{None} (budgets
    checked against spend only, as before)."""
    holdTtl: float = 1800.0
    """R108: seconds a hold lives at most (C{state.concurrency_slot_ttl_minutes})."""
    onHoldError: str = "fail_open"
    """R35: C{fail_open} (admit without a hold) or C{fail_closed} (503)."""
    _pending: dict = field(factory=dict)
    _stored: dict = field(factory=dict)
    _local: dict = field(factory=dict)
    _storedCost: dict = field(factory=dict)
    _localCost: dict = field(factory=dict)
    _flushing: Deferred | None = None
    _day: tuple = field(default=(None,), init=False)
    """L{_periodsAt}'s last day."""
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
        pending = self._pending.get(ident)
        # An hour's first turn is its row (TokenCounts is frozen):
        # no zero row built and added per turn.
        self._pending[ident] = counts if pending is None else pending + counts
        if key in self.budgets:
            day, month = self._periodsAt(now)[:2]
            total, local = counts.total, self._local
            for slot in ((key, "d", day), (key, "m", month)):
                local[slot] = local.get(slot, 0) + total
        if key in self.moneyBudgets and counts.cost:
            day, month = self._periodsAt(now)[:2]
            cost, local = counts.cost, self._localCost
            for slot in ((key, "d", day), (key, "m", month)):
                local[slot] = local.get(slot, 0) + cost
        if self.metrics is not None:
            self.metrics.tokens(key, account, model, counts)

    def setBudgets(self, keys) -> None:
        """
        Take the token and money budgets of C{keys} (at start-up and after
        a reload): a key added with a budget is enforced from its
        next turn, a budget removed stops being enforced.

        @param keys: an iterable of L{relay.base.records.ClientKey}.
        """
        budgets, money = {}, {}
        for key in keys:
            if key.daily_tokens is not None or key.monthly_tokens is not None:
                budgets[key.name] = (key.daily_tokens, key.monthly_tokens)
            if key.daily_usd is not None or key.monthly_usd is not None:
                money[key.name] = (key.daily_usd, key.monthly_usd)
        self.budgets = budgets
        self.moneyBudgets = money

    # -- budgets -----------------------------------------------------------------

    def _periodsAt(self, now: float) -> tuple:
        """
        The UTC day and month of C{now}, as budgets count them (kept for
        the day: a function of the day alone).

        @return: C{(day start, month start, next month start, day period
            id, month period id)}, Unix seconds and the holds' period ids
            (C{d:<day start>}, C{m:<month start>}).
        """
        day = dayStart(now)
        held = self._day
        if held[0] != day:
            month = monthStart(now)
            held = self._day = (day, month, nextMonthStart(now), f"d:{day}", f"m:{month}")
        return held

    def used(self, key: str, now: float) -> tuple:
        """
        Tokens a key used this UTC day and this UTC month, as far as this
        process knows (the store's totals at the last flush plus what was
        counted here since).

        @return: C{(day, month)}.
        """
        day, month = self._periodsAt(now)[:2]
        day, month = (key, "d", day), (key, "m", month)
        stored, local = self._stored, self._local
        return (stored.get(day, 0) + local.get(day, 0), stored.get(month, 0) + local.get(month, 0))

    def spent(self, key: str, now: float) -> tuple:
        """
        Nano-dollars a key spent this UTC day and month on priced turns, as
        far as this process knows (like L{used}).

        @return: C{(day, month)}.
        """
        day, month = self._periodsAt(now)[:2]
        day, month = (key, "d", day), (key, "m", month)
        stored, local = self._storedCost, self._localCost
        return (stored.get(day, 0) + local.get(day, 0), stored.get(month, 0) + local.get(month, 0))

    def overBudget(self, key: str, now: float) -> ClientError | None:
        """
        Check C{key}'s token budgets, then its money budgets,
        before a turn starts.

        @param key: the client key's name.
        @param now: Unix seconds.
        @return: the 429 to answer with (L{budgetError}), or L{None} when
            the key may go on.
        """
        limits = self.budgets.get(key)
        if limits is not None:
            daily, monthly = limits
            usedDay, usedMonth = self.used(key, now)
            if daily is not None and usedDay >= daily:
                return budgetError(key, "daily_tokens", daily, usedDay, dayStart(now) + DAY, now)
            if monthly is not None and usedMonth >= monthly:
                return budgetError(key, "monthly_tokens", monthly, usedMonth,
                                   nextMonthStart(now), now)
        money = self.moneyBudgets.get(key)
        if money is not None:
            daily, monthly = money
            spentDay, spentMonth = self.spent(key, now)
            if daily is not None and spentDay >= daily * 1e9:
                return budgetError(key, "daily_usd", daily, spentDay / 1e9,
                                   dayStart(now) + DAY, now)
            if monthly is not None and spentMonth >= monthly * 1e9:
                return budgetError(key, "monthly_usd", monthly, spentMonth / 1e9,
                                   nextMonthStart(now), now)
        return None

    # -- reservations (R108) ------------------------------------------------

    def hasBudget(self, key: str) -> bool:
        """
        Whether C{key} has a token or money budget.
        """
        return key in self.budgets or key in self.moneyBudgets

    def _limits(self, key: str, now: float) -> list:
        """
        C{(name, period, unit, limit, known)} of C{key}'s budgets
        (L{relay.interfaces.IBudgetHolds.reserve}).
        """
        day, month = self._periodsAt(now)[3:]
        limits = []
        tokens = self.budgets.get(key)
        if tokens is not None:
            usedDay, usedMonth = self.used(key, now)
            for name, period, limit, known in (("daily_tokens", day, tokens[0], usedDay),
                                               ("monthly_tokens", month, tokens[1], usedMonth)):
                if limit is not None:
                    limits.append((name, period, "t", int(limit), known))
        money = self.moneyBudgets.get(key)
        if money is not None:
            spentDay, spentMonth = self.spent(key, now)
            for name, period, limit, known in (("daily_usd", day, money[0], spentDay),
                                               ("monthly_usd", month, money[1], spentMonth)):
                if limit is not None:
                    limits.append((name, period, "n", int(round(limit * 1e9)), known))
        return limits

    def _periods(self, now: float) -> tuple:
        """
        The current day's and month's period ids with the seconds their
        settled amounts must live (to the period's end, plus an hour).
        """
        day, _, nextMonth, dayId, monthId = self._periodsAt(now)
        return ((dayId, int(day + DAY - now) + 3600), (monthId, int(nextMonth - now) + 3600))

    async def reserve(self, key: str, tokens: int, nanos: int):
        """
        R108: check C{key}'s budgets counting its other turns' holds and,
        when every one has room, hold this turn's estimate.

        @param key: the client key's name (with a budget: L{hasBudget}).
        @param tokens: the turn's estimated input + output tokens.
        @param nanos: its estimated cost, nano-dollars.
        @return: C{(error, hold)}: the 429 (L{budgetError}; or a 503 when
            the store is down and C{fail_closed}) and L{None}, or L{None}
            and the L{Hold} to settle or release.
        """
        now = self.clock.seconds()
        hold = Hold(key=key, id=os.urandom(9).hex(), tokens=int(tokens), nanos=int(nanos))
        if self.holds is None:
            error = self.overBudget(key, now)
            hold.held = False
            return (error, None) if error is not None else (None, hold)
        limits = self._limits(key, now)
        try:
            refused = await self.holds.reserve(key, hold.id, hold.tokens, hold.nanos, limits,
                                               self.holdTtl)
        except Exception as e:  # noqa: BLE001 - R35: the policy decides
            self._log.error(
                "reserving the budget of key {key_name} failed ({error})",
                event="relay.budget_hold_failed", key_name=key, error=repr(e),
            )
            if self.onHoldError == "fail_closed":
                return ClientError(503, "api_error",
                                   "Service temporarily unavailable, please retry later",
                                   wsClose=(1011, "budget store unavailable")), None
            error = self.overBudget(key, now)
            hold.held = False
            return (error, None) if error is not None else (None, hold)
        if refused is None:
            return None, hold
        name, used = refused
        limit = next(limit for n, _, _, limit, _ in limits if n == name)
        resets = dayStart(now) + DAY if name.startswith("daily") else nextMonthStart(now)
        if name.endswith("_usd"):
            return budgetError(key, name, limit / 1e9, used / 1e9, resets, now), None
        return budgetError(key, name, limit, used, resets, now), None

    def settle(self, hold: Hold, counts: TokenCounts) -> None:
        """
        R108: the turn of C{hold} ended with C{counts} (priced): count its
        real tokens and cost in the holds' store and drop the hold. An
        unpriced turn of a key with a money budget settles at its
        estimate (never free). Not awaited; errors are logged.
        """
        if hold.settled:
            return
        hold.settled = True
        if self.holds is None:
            return
        nanos = counts.cost
        if counts.unpriced and hold.key in self.moneyBudgets:
            nanos = max(nanos, hold.nanos)
        d = self.holds.settle(hold.key, hold.id, counts.total, nanos,
                              self._periods(self.clock.seconds()))
        d.addErrback(self._holdFailed, "settling", hold)

    def release(self, hold: Hold) -> None:
        """
        R108: drop C{hold} without counting anything (refused, or failed
        before output); nothing when it was settled. A usage learnt later
        still settles (L{settle}: the real figure counts at once). Not
        awaited.
        """
        if hold.settled or hold.released:
            return
        hold.released = True
        if hold.held and self.holds is not None:
            try:
                d = self.holds.release(hold.key, hold.id)
            except Exception:  # noqa: BLE001 - logged; the hold expires by itself
                self._log.failure("releasing a budget hold failed",
                                  event="relay.budget_hold_failed")
                return
            d.addErrback(self._holdFailed, "releasing", hold)

    def _holdFailed(self, failure, doing: str, hold: Hold) -> None:
        self._log.error(
            "{doing} the budget hold of key {key_name} failed ({error}); it expires by itself",
            event="relay.budget_hold_failed", doing=doing, key_name=hold.key,
            error=repr(failure.value),
        )

    async def chainTokens(self, responseId: Optional[str]) -> int:
        """
        R108: the last known input + output of the chain a turn continues
        by C{previous_response_id}, or 0 (unknown, or the store failed).
        """
        if not responseId or self.holds is None:
            return 0
        try:
            return int(await self.holds.chainTokens(responseId))
        except Exception:  # noqa: BLE001 - an estimate: 0 is a smaller one
            return 0

    def rememberChain(self, responseId: str, tokens: int, ttl: float) -> None:
        """
        R108: keep a response's input + output for a turn chained on it
        (C{previous_response_ttl_seconds}). Not awaited; errors ignored.
        """
        if self.holds is not None and responseId and tokens:
            try:
                self.holds.rememberChain(responseId, tokens, ttl).addErrback(lambda _: None)
            except Exception:  # noqa: BLE001 - an estimate's input: never a turn's failure
                self._log.failure("keeping a chain's tokens failed",
                                  event="relay.budget_hold_failed")

    def budgetView(self, now: float) -> list:
        """
        Each budgeted key's use, for C{/admin/usage} and the status page.

        @return: dicts with C{key}, C{daily_tokens}, C{daily_used},
            C{daily_resets_at}, C{monthly_tokens}, C{monthly_used},
            C{monthly_resets_at} (times in Unix seconds).
        """
        rows = []
        for key in sorted(set(self.budgets) | set(self.moneyBudgets)):
            daily, monthly = self.budgets.get(key, (None, None))
            usedDay, usedMonth = self.used(key, now)
            row = {
                "key": key,
                "daily_tokens": daily,
                "daily_used": usedDay,
                "daily_resets_at": dayStart(now) + DAY,
                "monthly_tokens": monthly,
                "monthly_used": usedMonth,
                "monthly_resets_at": nextMonthStart(now),
            }
            if key in self.moneyBudgets:
                # Money budgets, in dollars.
                dailyUsd, monthlyUsd = self.moneyBudgets[key]
                spentDay, spentMonth = self.spent(key, now)
                row.update(daily_usd=dailyUsd, daily_spent_usd=round(spentDay / 1e9, 9),
                           monthly_usd=monthlyUsd, monthly_spent_usd=round(spentMonth / 1e9, 9))
            rows.append(row)
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
        localCost = dict(self._localCost)
        now = self.clock.seconds()
        day, month = dayStart(now), monthStart(now)
        for budgets, read, stored, counted, before in (
            (self.budgets, self.store.budgetTotals, "_stored", self._local, local),
            (self.moneyBudgets, self.store.costTotals, "_storedCost", self._localCost, localCost),
        ):
            if not budgets:
                continue
            try:
                totals = await read(day, month).addTimeout(self.flushTimeout, self.clock)
            except Exception as e:  # noqa: BLE001 - logged; next flush retries
                self._log.error(
                    "reading usage totals for budgets failed ({error})",
                    event="relay.usage_flush_failed", error=repr(e),
                )
                return
            fresh = {}
            for period, start, perKey in (("d", day, totals[0]), ("m", month, totals[1])):
                for key, amount in perKey.items():
                    fresh[(key, period, start)] = amount
            setattr(self, stored, fresh)
            # What was counted before this flush is in the store's totals
            # now; keep only what was counted while it ran (and no stale
            # periods).
            for slot in list(counted):
                left = counted[slot] - before.get(slot, 0)
                current = slot[2] == (day if slot[1] == "d" else month)
                if left > 0 and current:
                    counted[slot] = left
                else:
                    del counted[slot]

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

    async def series(self, since: float, until: float, bucket: int, groupBy: str,
                     filters: dict) -> dict:
        """
        The totals per time bucket and group (L{IUsageStore.series}) for
        C{GET /admin/usage/series}; flushes first so the answer includes
        the turns just counted.

        @return: C{{(bucket start, group): TokenCounts}}.
        @raise ValueError: for a bad bucket, group or filter.
        """
        await self.flush()
        return await self.store.series(since, until, bucket, groupBy, filters).addTimeout(
            self.flushTimeout, self.clock)
