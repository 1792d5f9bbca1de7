# -*- test-case-name: tests.test_state -*-
"""
The in-memory L{IStateStore} provider: one relay process, no Redis.

It keeps the same semantics as L{relay.state.redis.RedisStateStore}
(behaviour.md §0 "State backends"); both run one contract test suite.
Expiry is evaluated lazily against the injected clock, and expired entries
are dropped when touched or on L{MemoryStateStore.prune}.
"""

from __future__ import annotations

import math
from typing import Optional

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.state.runtime import AccountRuntime
from relay.interfaces import (
    NOT_NOW,
    IAccountStates,
    IAccountStateView,
    IStateStore,
    ISynchronousState,
)
from relay.state import MARK_KINDS, counter403Key
from relay.state.durable import isDurable


def applyMark(
    runtime: AccountRuntime, kind: str, until: float, reason: str, model: Optional[str]
) -> AccountRuntime:
    """
    Apply one marking to an account runtime, replacing the earlier value of
    that state (R4, R11, R12).

    @param runtime: the current L{AccountRuntime}.
    @param kind: one of L{relay.state.MARK_KINDS}.
    @param until: Unix seconds (ignored for C{disabled}).
    @param reason: sanitised text.
    @param model: the upstream model for C{model_block}.
    @return: the new L{AccountRuntime}.
    @raise ValueError: for an unknown kind or a C{model_block} without model.
    """
    if kind == "temp_unschedulable":
        return evolve(runtime, blockedUntil=float(until), blockReason=reason)
    if kind == "rate_limited":
        return evolve(runtime, rateLimitedUntil=float(until))
    if kind == "overloaded":
        return evolve(runtime, overloadedUntil=float(until))
    if kind == "disabled":
        return evolve(runtime, disabled=True, disabledReason=reason)
    if kind == "model_block":
        if not model:
            raise ValueError("model_block needs a model")
        blocks = dict(runtime.modelBlocks)
        blocks[model] = float(until)
        reasons = dict(runtime.modelReasons)
        reasons[model] = reason
        return evolve(runtime, modelBlocks=blocks, modelReasons=reasons)
    raise ValueError(f"unknown account state kind {kind!r}; expected one of {sorted(MARK_KINDS)}")


def blockEnd(runtime: AccountRuntime) -> float:
    """
    Until when a runtime state may keep its account from being scheduled
    (what L{relay.interfaces.IAccountStates.flagged} reports).

    @return: Unix seconds; C{inf} for a disabled account; 0 when nothing
        blocks it (streaks alone never do).
    """
    if runtime.disabled:
        return math.inf
    end = max(runtime.blockedUntil, runtime.rateLimitedUntil, runtime.overloadedUntil)
    if runtime.modelBlocks:
        end = max(end, max(runtime.modelBlocks.values()))
    return end




@implementer(IAccountStates)
@define(eq=False)
class FlaggedStates:
    """
    An L{IAccountStates} over a dict of runtimes, with the end of each
    account's blocks kept beside it (L{flagged} costs the flagged
    accounts, not the pool).

    @ivar runtimes: account id -> L{AccountRuntime} (only stored ones).
    @ivar ends: account id -> L{blockEnd} of its runtime, for those whose
        end was in the future when it was set.
    """

    runtimes: dict = field(factory=dict)
    ends: dict = field(factory=dict)

    def get(self, accountId, default=None):
        """
        See L{IAccountStates.get}.
        """
        return self.runtimes.get(accountId, default)

    def flagged(self, now):
        """
        See L{IAccountStates.flagged}; blocks that have ended are dropped.
        """
        ends = self.ends
        over = [aid for aid, end in ends.items() if end <= now]
        for aid in over:
            del ends[aid]
        return ends.keys()

    def put(self, accountId: str, runtime: Optional[AccountRuntime]) -> None:
        """
        Set (or with L{None}, forget) an account's runtime.
        """
        if runtime is None:
            self.runtimes.pop(accountId, None)
            self.ends.pop(accountId, None)
            return
        self.runtimes[accountId] = runtime
        end = blockEnd(runtime)
        if end > 0:
            self.ends[accountId] = end
        else:
            self.ends.pop(accountId, None)


@implementer(IStateStore, IAccountStateView, ISynchronousState)
@define(eq=False)
class MemoryStateStore:
    """
    Account runtime states, counters and TTL'd values in dicts.

    Every method returns an already-fired L{Deferred}.

    @ivar _clock: the time source; C{seconds()} are Unix seconds.
    @ivar _accounts: account id -> L{AccountRuntime}.
    @ivar _view: the L{FlaggedStates} over C{_accounts}.
    @ivar _counters: name -> C{[value, expiresAt]} (Unix seconds).
    @ivar _values: key -> C{(value, expiresAt)} (Unix seconds).
    """

    _clock: IReactorTime
    maxValues: int = 1_000_000
    """The most TTL'd values (bindings, owners) kept; over
    it, expired entries are pruned, then the oldest written are dropped.
    Client-chosen session ids can never grow the store without bound."""
    durable: object = None
    """R104: a L{relay.state.durable.SQLiteValues} the owner
    records are also written to and read back from after a restart, or
    L{None} (nothing outlives the process)."""
    _view: FlaggedStates = field(factory=FlaggedStates, init=False)
    _accounts: dict = field(init=False)
    _counters: dict = field(factory=dict, init=False)
    _values: dict = field(factory=dict, init=False)
    _prunedAt: float = field(default=-1.0, init=False)

    _log = Logger()

    @_accounts.default
    def _accountsDefault(self) -> dict:
        return self._view.runtimes

    def accountStateView(self, accountIds) -> Deferred:
        """
        See L{IAccountStateView.accountStateView}: the live view of this
        store's runtimes (one object, already fired).
        """
        return succeed(self._view)

    def getAccountStates(self, accountIds) -> Deferred:
        """
        See L{IStateStore.getAccountStates}.
        """
        default = AccountRuntime()
        return succeed({aid: self._accounts.get(aid, default) for aid in accountIds})

    def markAccount(self, accountId, kind, until, reason, model=None) -> Deferred:
        """
        See L{IStateStore.markAccount}. Fails with L{ValueError} for an
        unknown C{kind}.
        """
        try:
            runtime = applyMark(
                self._accounts.get(accountId, AccountRuntime()), kind, until, reason, model
            )
        except ValueError as e:
            return fail(e)
        self._view.put(accountId, runtime)
        return succeed(None)

    def clearAccount(self, accountId) -> Deferred:
        """
        See L{IStateStore.clearAccount}.
        """
        self._view.put(accountId, None)
        self._counters.pop(counter403Key(accountId), None)
        return succeed(None)

    def bumpStreak(self, accountId, model, ttl) -> Deferred:
        """
        See L{IStateStore.bumpStreak}.
        """
        now = self._clock.seconds()
        runtime = self._accounts.get(accountId, AccountRuntime())
        # Streaks whose TTL has passed count as none: dropped here, so the
        # map holds only the models that failed within the TTL, however
        # many model names clients send.
        streaks = {m: v for m, v in runtime.streaks.items() if now - v[1] <= ttl}
        count = streaks[model][0] + 1 if model in streaks else 1
        streaks[model] = (count, now)
        self._accounts[accountId] = evolve(runtime, streaks=streaks)
        return succeed(count)

    def resetStreak(self, accountId, model) -> Deferred:
        """
        See L{IStateStore.resetStreak}.
        """
        runtime = self._accounts.get(accountId)
        if runtime is not None and model in runtime.streaks:
            streaks = dict(runtime.streaks)
            del streaks[model]
            self._accounts[accountId] = evolve(runtime, streaks=streaks)
        return succeed(None)

    def incrementCounter(self, name, ttl, refresh=True) -> Deferred:
        """
        See L{IStateStore.incrementCounter}.

        @param ttl: seconds.
        """
        now = self._clock.seconds()
        entry = self._counters.get(name)
        if entry is None or entry[1] <= now:
            entry = self._counters[name] = [0, now + ttl]
        elif refresh:
            entry[1] = now + ttl
        entry[0] += 1
        return succeed(entry[0])

    def resetCounter(self, name) -> Deferred:
        """
        See L{IStateStore.resetCounter}.
        """
        self._counters.pop(name, None)
        return succeed(None)

    def getValue(self, key) -> Deferred:
        """
        See L{IStateStore.getValue}.
        """
        entry = self._values.get(key)
        if entry is None:
            if self.durable is not None and isDurable(key):
                return self._loadDurable(key)
            return succeed(None)
        if entry[1] <= self._clock.seconds():
            del self._values[key]
            return succeed(None)
        return succeed(entry[0])

    def _loadDurable(self, key: str) -> Deferred:
        """
        A persisted value this process does not hold (after a restart).
        """
        d = self.durable.load(key, self._clock.seconds())

        def found(row):
            if row is None:
                return None
            self._values[key] = row
            return row[0]

        return d.addCallback(found)

    def setValue(self, key, value, ttl) -> Deferred:
        """
        See L{IStateStore.setValue}.

        @param ttl: seconds.
        """
        self._set(key, value, ttl)
        return succeed(None)

    def _set(self, key, value, ttl) -> None:
        """
        L{setValue} without its Deferred (L{setValues} writes several).
        """
        values = self._values
        values.pop(key, None)
        values[key] = (value, self._clock.seconds() + ttl)
        if self.durable is not None and isDurable(key):
            self.durable.save(key, value, values[key][1]).addErrback(
                lambda f: self._log.failure("persisting {key} failed", f, key=key)
            )
        if len(values) > self.maxValues:
            self._evict()

    def _evict(self) -> None:
        """
        Bring the values back to L{maxValues}: a prune, at most once per
        clock tick, then the oldest go.
        """
        values = self._values
        now = self._clock.seconds()
        if now > self._prunedAt:
            # At most one full pass per clock tick; then the oldest go.
            self._prunedAt = now
            self.prune()
        while len(values) > self.maxValues:
            del values[next(iter(values))]

    def setValues(self, pairs, ttl) -> Deferred:
        """
        L{setValue} of several keys (as the Redis store's). The
        persisted ones (L{isDurable}) go to the durable store in one
        change (L{relay.state.durable.SQLiteValues.saveMany}).

        @param pairs: C{[(key, value), ...]}, or C{(key, value, ttl)}
            triples for a key with a TTL of its own.
        @param ttl: seconds (for the pairs without one).
        """
        values = self._values
        durable = self.durable
        saveMany = None if durable is None else getattr(durable, "saveMany", None)
        if durable is not None and saveMany is None:
            for pair in pairs:
                self._set(pair[0], pair[1], pair[2] if len(pair) > 2 else ttl)
            return succeed(None)
        now = self._clock.seconds()
        saves = []
        for pair in pairs:
            key = pair[0]
            entry = (pair[1], now + (pair[2] if len(pair) > 2 else ttl))
            values.pop(key, None)
            values[key] = entry
            if saveMany is not None and isDurable(key):
                saves.append((key,) + entry)
            if len(values) > self.maxValues:
                if saves:
                    self._persist(saveMany, saves)
                    saves = []
                self._evict()
        if saves:
            self._persist(saveMany, saves)
        return succeed(None)

    def _persist(self, saveMany, rows: list) -> None:
        """
        Hand C{rows} (C{(key, value, expires)}) to the durable store; a
        failure is logged per key, as L{_set}'s.
        """

        def failed(f):
            for row in rows:
                self._log.failure("persisting {key} failed", f, key=row[0])

        saveMany(rows, failed)

    def touchValue(self, key, ttl) -> Deferred:
        """
        See L{IStateStore.touchValue}. A missing or expired key stays absent.

        @param ttl: seconds.
        """
        self.touchValueNow(key, ttl)
        return succeed(None)

    def deleteValue(self, key) -> Deferred:
        """
        See L{IStateStore.deleteValue}.
        """
        self._values.pop(key, None)
        if self.durable is not None and isDurable(key):
            self.durable.delete(key).addErrback(
                lambda f: self._log.failure("forgetting {key} failed", f, key=key)
            )
        return succeed(None)

    # -- ISynchronousState: answers without a Deferred (the scheduler's fast path)

    def valueNow(self, key):
        """
        L{getValue} answered at once (the scheduler's sticky fast path).

        @return: the value, L{None} when absent or expired, or L{NOT_NOW}
            for a key that only the asynchronous durable load could answer.
        """
        entry = self._values.get(key)
        if entry is None:
            if self.durable is not None and isDurable(key):
                return NOT_NOW
            return None
        if entry[1] <= self._clock.seconds():
            del self._values[key]
            return None
        return entry[0]

    def accountStateViewNow(self) -> FlaggedStates:
        """
        L{accountStateView} answered at once: the live view.
        """
        return self._view

    def touchValueNow(self, key, ttl) -> None:
        """
        L{touchValue} without its Deferred.

        @param ttl: seconds.
        """
        now = self._clock.seconds()
        entry = self._values.get(key)
        if entry is not None:
            if entry[1] <= now:
                del self._values[key]
            else:
                self._values[key] = (entry[0], now + ttl)

    def prune(self) -> int:
        """
        Drop expired counters and values (relay runs this every minute,
        L{relay.process.app}; the store also drops them lazily).

        @return: the number of entries dropped.
        """
        now = self._clock.seconds()
        dropped = 0
        if self.durable is not None:
            self.durable.prune(now).addErrback(
                lambda f: self._log.failure("pruning persisted values failed", f)
            )
        for table in (self._counters, self._values):
            for key in [k for k, e in table.items() if e[1] <= now]:
                del table[key]
                dropped += 1
        return dropped
