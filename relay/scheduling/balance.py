# -*- test-case-name: tests.test_scheduler -*-
"""
The accounts in force and the load-balance and fallback layers of
selection (behaviour.md R28, R34, R43 steps 3-4, R45's C{load_skew} and
C{top_k}): one slot try at a time by priority, load rate and last use,
ties in random order, with OAuth usage windows when quota-aware.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from typing import Callable, Optional, Sequence

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.base.records import Account
from relay.interfaces import ISlotAdmission
from relay.scheduling.eligibility import Eligibility, Pass, refusal
from relay.scheduling.index import PoolIndex, sameSnapshot
from relay.scheduling.preview import DRY_LEASE
from relay.scheduling.selection import NoAccountAvailable

SLOT_ERROR_MESSAGE = "Service temporarily unavailable, please retry later"


BIG_TIE = 64
"""An index bucket of more accounts than this is drawn from in
place (L{_Run}) rather than copied and filtered first."""


class _Run:
    """
    A large run of tying accounts in the pool index (one bucket), drawn
    in random order without copying it: a sparse Fisher-Yates over the
    bucket, skipping the accounts that are not candidates of this turn, so
    each candidate comes in uniformly random order (R43 step 3.5) at the
    cost of the draws made.
    """

    def __init__(self, members: list, byId: dict, candidates: frozenset, skipped):
        self.members, self.byId = members, byId
        self.candidates, self.skipped = candidates, skipped

    def drawn(self, rng):
        members = self.members
        count = len(members)
        swapped: dict = {}
        for i in range(count):
            if count > len(members):
                return  # the bucket changed meanwhile; the caller reads again
            j = rng.randrange(i, count) if i < count - 1 else i
            picked = swapped.get(j, members[j])
            swapped[j] = swapped.get(i, members[i])
            if picked in self.candidates and picked not in self.skipped:
                yield self.byId[picked]


def _skew(rates: list, count: int) -> float:
    """
    The population standard deviation of C{count} load rates of which all
    but C{rates} are 0 (R45's C{load_skew}; the idle accounts of
    a pool are not listed one by one).
    """
    if count <= 1 or not any(rates):
        return 0.0
    if len(rates) == count:
        return statistics.pstdev(rates)
    mean = math.fsum(rates) / count
    variance = (math.fsum((r - mean) ** 2 for r in rates) + (count - len(rates)) * mean * mean)
    return math.sqrt(variance / count)


def _tieRun(specials: list, start: int) -> tuple:
    """
    The run of C{specials} (sorted C{(key, position, account)}) from
    C{start} whose keys tie.

    @return: C{(accounts, the index after the run)}.
    """
    key = specials[start][0]
    end = start + 1
    while end < len(specials) and specials[end][0] == key:
        end += 1
    return [t[2] for t in specials[start:end]], end


def loadRate(inUse: int, waiting: int, concurrency: int) -> float:
    """
    The load rate of an account (R28): C{(inUse + waiting) * 100 /
    concurrency}; 0 for unlimited accounts (concurrency <= 0).

    @param inUse: slots held.
    @param waiting: queued waiters.
    @param concurrency: the account's slot limit.
    @return: a percentage (may exceed 100).
    """
    if concurrency <= 0:
        return 0.0
    return (inUse + waiting) * 100.0 / concurrency


@define(eq=False)
class Balancer:
    """
    The pool of accounts in force, their slots and last-used order, and the
    layers that choose by load (R43 steps 3 and 4).

    @ivar _accounts: the configured accounts, read on every call (a list
        may be changed in place by the admin API).
    @ivar _admission: the L{ISlotAdmission} for account slots.
    @ivar _clock: the L{IReactorTime} for Unix seconds.
    @ivar _random: shuffles ties in load-balance order (R43 step 3.5).
    @ivar _quota: optional L{relay.scheduling.quota.UsageWindows}: with
        C{scheduling.quota_aware} the load-balance layer orders accounts of
        equal priority by remaining usage window.
    @ivar _checks: the L{Eligibility} a slot is re-checked with (R43 step
        3.6).
    @ivar _log: the scheduler's logger.
    @ivar _index: the L{PoolIndex} of the current account snapshot.
    @ivar _lastUsed: account id -> Unix seconds of its last selection.
    """

    _accounts: Sequence[Account]
    _admission: ISlotAdmission
    _clock: IReactorTime
    _random: random.Random
    _quota: Optional[object]
    _checks: Eligibility
    _log: Logger
    _lastUsed: dict = field(factory=dict, init=False)
    _index: Optional[PoolIndex] = field(default=None, init=False)

    def noteUsed(self, account: Account) -> None:
        """
        C{account} was selected now: its place in the last-used order.
        """
        lastUsed = self._lastUsed
        last = lastUsed.get(account.id)
        old = -1 if last is None else int(last)
        now = lastUsed[account.id] = self._clock.seconds()
        if self._index is not None and old != int(now):
            self._index.moved(account, old, int(now))

    async def loads(self, accounts: Sequence[Account]) -> dict:
        """
        Read account loads in one batch (R28); an error counts as idle.

        @return: account id -> C{(inUse, waiting)}.
        """
        if not accounts:
            return {}
        try:
            loads = await self._admission.load("account", [a.id for a in accounts])
        except Exception as e:
            self._log.error(
                "account load read failed: {error}",
                event="openai.account_load_read_failed", error=repr(e),
            )
            loads = {}
        return {a.id: tuple(loads.get(a.id, (0, 0))) for a in accounts}


    def pool(self) -> PoolIndex:
        """
        The L{PoolIndex} of the accounts in force now (a new one when the
        live set changed: a reload, an admin change; a list changed in
        place).
        """
        accounts = self._accounts
        snapshot = getattr(accounts, "snapshot", None)
        accounts = snapshot() if snapshot is not None else tuple(accounts)
        index = self._index
        if index is None or index.accounts is not accounts:
            if sameSnapshot(index, accounts):
                # The same accounts in a new tuple (a reload or a control
                # plane refresh that changed nothing): keep the index, and
                # compare by identity from now on.
                index.accounts = accounts
            else:
                index = self._index = PoolIndex(accounts)
        return index


    async def trySlot(self, ctx: Pass, account: Account):
        """
        One immediate slot attempt. An admission error ends the selection
        with 503 / WebSocket 1011 (R32, R35).

        @return: an L{relay.interfaces.ISlotLease} or L{None}.
        """
        if ctx.dryRun:
            # A preview: read the load instead of taking the slot.
            inUse, waiting = (await self.loads([account]))[account.id]
            limit = account.concurrency
            return DRY_LEASE if limit <= 0 or inUse + waiting < limit else None
        spec = ctx.spec
        if spec is not None and spec[0] is account:
            # The try sent with the state reads
            # (L{relay.scheduling.layers.Layers._speculate}).
            ctx.spec = None
            try:
                lease, ctx.refreshed = await spec[1]
                return lease
            except Exception as e:
                raise self._acquireFailed(ctx, account, e)
        try:
            return await self._admission.tryAcquire("account", account.id, account.concurrency)
        except Exception as e:
            raise self._acquireFailed(ctx, account, e)

    def _acquireFailed(self, ctx: Pass, account: Account, e: Exception) -> NoAccountAvailable:
        """
        Log an account slot acquire error; the 503 / WebSocket 1011 that
        ends the selection (R32, R35).
        """
        self._log.error(
            "account slot acquire failed for {account_id}: {error}",
            event="openai.account_slot_acquire_error", account_id=account.id,
            error=repr(e), request_id=ctx.turn.requestId,
        )
        return refusal(
            ctx.turn, 503, "api_error", SLOT_ERROR_MESSAGE,
            wsClose=(1011, "failed to acquire account concurrency slot"),
        )


    def _ordered(self, accounts: list, key: Callable, rng=None) -> list:
        """
        Sort by C{key}, shuffling accounts that tie (R43 step 3.5): shuffle
        with the injected random (or C{rng}), then sort stably.
        """
        accounts = list(accounts)
        (rng or self._random).shuffle(accounts)
        accounts.sort(key=key)
        return accounts

    def lastUsedSecond(self, account: Account) -> int:
        """
        The last-used sort key: -1 for never used, else whole seconds.
        """
        last = self._lastUsed.get(account.id)
        return -1 if last is None else int(last)

    async def loadBalance(self, ctx: Pass, skip: frozenset = frozenset()):
        """
        The load-balance layer (R43 step 3): read loads in one batch, keep
        C{loadRate < 100}, order by priority, load rate, last used (ties
        in random order), try each slot after re-checking its state; on a
        full miss re-read the load and repeat once.

        With the pool index and an admission that reports its
        busy slots (L{relay.admission.memory.MemorySlotAdmission.busy}) the
        order is read from the index (L{_loadBalanceIndexed}) instead of sorting
        every candidate; ties are put in random order lazily, one draw per
        account tried, the same way on both paths (L{_inRandomOrder}).

        @param skip: account ids not to try (the busy bound account, R-B6).
        @return: C{(account, lease)} or L{None}.
        """
        scheduling = ctx.scheduling
        quota = self._quota if scheduling.quota_aware else None
        threshold = scheduling.quota_threshold_percent
        busy = getattr(self._admission, "busy", None)
        if ctx._lazy is not None and busy is not None:
            return await self._loadBalanceIndexed(ctx, skip, busy, quota, threshold)
        candidates = [a for a in ctx.eligible if a.id not in skip]
        if not candidates:
            return None
        for _ in range(2):
            ctx.loads.update(await self.loads(candidates))
            rates = {a.id: loadRate(*ctx.loads[a.id], a.concurrency) for a in candidates}
            ctx.skew = statistics.pstdev(rates.values()) if len(rates) > 1 else 0.0
            available = [a for a in candidates if rates[a.id] < 100]
            plain, key = self._orderKeys(rates, quota, threshold)
            ranked = sorted(available, key=key)
            groups = [list(g) for _, g in itertools.groupby(ranked, key=key)]
            def peersOf(priority, chosen, available=available, plain=plain):
                return [plain(a) for a in available if a.priority == priority
                        and (a is chosen or not self._checks.incompatible(ctx, a))]

            found = await self._tryInOrder(ctx, self._inRandomOrder(groups, ctx.rng),
                                           quota, peersOf, plain)
            if found is not None:
                return found
        return None

    def _orderKeys(self, rates: dict, quota, threshold) -> tuple:
        """
        The sort keys of the load-balance order (R43 step 3): C{plain(a)},
        its load rate (0 when not in C{rates}: idle) and last-used second,
        and C{key(a)}, its priority first.

        @return: C{(plain, key)}.
        """
        lastUsedSecond = self.lastUsedSecond

        def plain(a):
            return (rates.get(a.id, 0.0), lastUsedSecond(a))

        if quota is None:
            def key(a):
                return (a.priority,) + plain(a)
        else:
            # Within a priority, the most remaining usage
            # window first; at/above the threshold only after the rest.
            def key(a):
                return (a.priority,) + quota.rank(a.id, threshold) + plain(a)
        return plain, key

    def _inRandomOrder(self, groups, rng=None):
        """
        R43 step 3.5: the accounts of C{groups} (runs of accounts that tie,
        in order, each in configured order), each run in a random order
        drawn lazily (Fisher-Yates, one draw per account taken), so a
        selection whose first try succeeds draws once, however many tie.
        """
        rng = rng or self._random
        for group in groups:
            if isinstance(group, _Run):
                yield from group.drawn(rng)
                continue
            count = len(group)
            if count == 1:
                yield group[0]
                continue
            group = list(group)
            for i in range(count - 1):
                j = rng.randrange(i, count)
                group[i], group[j] = group[j], group[i]
                yield group[i]
            yield group[count - 1]

    async def _tryInOrder(self, ctx: Pass, order, quota, peersOf, plain):
        """
        Try each account of C{order} after re-checking it (R43 step 3.6).

        @param peersOf: C{(priority) -> plain keys} of the available
            accounts of that priority (for the decision's C{quota_decided}).
        @return: C{(account, lease)} or L{None}.
        """
        for account in order:
            if self._checks.incompatible(ctx, account):
                continue
            ctx.tried += 1
            lease = await self.trySlot(ctx, account)
            if lease is not None:
                if quota is not None:
                    # The chosen account is always its own peer: its state
                    # may have changed while the acquire was in flight
                    # (found by the chaos soak).
                    peers = peersOf(account.priority, account)
                    ctx.quotaDecided = plain(account) > min(peers + [plain(account)])
                return account, lease
        return None

    async def _loadBalanceIndexed(self, ctx: Pass, skip: frozenset, busy, quota, threshold):
        """
        L{loadBalance} from the pool index: only the busy
        candidates (a slot held or a waiter), those with a usage window
        (when quota-aware) and the flagged ones are looked at one
        by one; every other candidate is idle with the default quota rank,
        so its place is its priority and last-used second, which the index
        keeps in order (L{PoolIndex.buckets}).
        """
        pool = self.pool()
        if pool.buckets is None:
            pool.placeAll(self.lastUsedSecond)
        static, excluded, bad = ctx._lazy
        staticIds = pool.static(ctx.turn.allowedAccounts, ctx.turn.model, ctx.turn.endpoint,
                                ctx.oauthBarred, ctx.onlyOAuth).ids
        out = excluded | bad | skip if (excluded or skip) else bad
        count = ctx.candidateCount - sum(1 for i in skip if i in staticIds and i not in excluded
                                         and i not in bad)
        if count <= 0:
            return None
        byId = pool.byId
        for again in (False, True):
            # R34: the second pass (every try of the first failed) reads
            # the loads uncached.
            loads = await self._busy(busy, staticIds, again)
            loads = {i: load for i, load in loads.items() if i in staticIds and i not in out}
            ctx.loads.update(loads)
            special = dict.fromkeys(loads)
            if quota is not None:
                for i in quota.snapshots:
                    if i in staticIds and i not in out:
                        special[i] = None
            rates = {i: loadRate(*loads.get(i, (0, 0)), byId[i].concurrency) for i in special}
            ctx.skew = _skew([rates[i] for i in loads], count)
            plain, key = self._orderKeys(rates, quota, threshold)
            specials = sorted(
                (key(byId[i]), pool.position[i], byId[i]) for i in special if rates[i] < 100)
            skipped = out.union(special) if special else out
            groups = self._indexedGroups(pool, staticIds, skipped, specials, quota is not None)

            def peersOf(priority, chosen, specials=specials, skipped=skipped):
                peers = [plain(t[2]) for t in specials if t[2].priority == priority
                         and (t[2] is chosen or not self._checks.incompatible(ctx, t[2]))]
                for p, lus in pool.bucketKeys:
                    if p == priority and any(i in staticIds and i not in skipped
                                             for i in pool.buckets[(p, lus)]):
                        peers.append((0.0, lus))
                        break
                return peers

            found = await self._tryInOrder(ctx, self._inRandomOrder(groups, ctx.rng), quota,
                                           peersOf, plain)
            if found is not None:
                return found
        return None

    async def _busy(self, busy, ids: frozenset, fresh: bool = False) -> dict:
        """
        The admission's busy loads among the static candidates (at once in
        memory, one load read on Redis, reused for 200 ms unless C{fresh},
        R34); an error counts as idle (R35), as L{loads}.
        """
        try:
            loads = busy("account", ids, fresh=True) if fresh else busy("account", ids)
            if isinstance(loads, Deferred):
                loads = await loads
            return loads
        except Exception as e:
            self._log.error(
                "account load read failed: {error}",
                event="openai.account_load_read_failed", error=repr(e),
            )
            return {}

    @staticmethod
    def _indexedGroups(pool: PoolIndex, staticIds: frozenset, skipped, specials: list,
                       quotaAware: bool):
        """
        The tie runs of L{_loadBalanceIndexed}'s order, lazily: the index's
        buckets (idle candidates by priority and last-used second) merged
        with the explicitly ranked C{specials} (C{(key, position, account)},
        sorted), each run in configured order.
        """
        byId = pool.byId
        position = pool.position
        si = 0
        quotaKey = (False, 0, math.inf) if quotaAware else ()
        for bucket in list(pool.bucketKeys):
            priority, lus = bucket
            members = pool.buckets.get(bucket)
            if not members:
                continue
            plainKey = (priority,) + quotaKey + (0.0, lus)
            while si < len(specials) and specials[si][0] < plainKey:
                run, si = _tieRun(specials, si)
                yield run
            if len(members) > BIG_TIE and not (si < len(specials)
                                                and specials[si][0] == plainKey):
                # A large run (a fresh pool: every account never
                # used) is drawn from in place, not copied.
                yield _Run(members, byId, staticIds, skipped)
                continue
            group = [byId[i] for i in members if i in staticIds and i not in skipped]
            joined = False
            while si < len(specials) and specials[si][0] == plainKey:
                group.append(specials[si][2])
                si += 1
                joined = True
            if group:
                if joined:
                    # (The bucket's members are in configured order already.)
                    group.sort(key=lambda a: position[a.id])
                yield group
        while si < len(specials):
            run, si = _tieRun(specials, si)
            yield run

    async def fallback(self, ctx: Pass):
        """
        The fallback layer (R43 step 4): by priority then least recently
        used (ties shuffled), the first account whose queue has room gets
        the fallback wait plan (the first one overall when every queue is
        full, so admission reports C{queue_full}).

        @return: the chosen L{Account}, or L{None}.
        """
        if not ctx.eligible:
            return None
        missing = [a for a in ctx.eligible if a.id not in ctx.loads]
        ctx.loads.update(await self.loads(missing))
        order = self._ordered(
            ctx.eligible, key=lambda a: (a.priority, self.lastUsedSecond(a)), rng=ctx.rng,
        )
        limit = ctx.scheduling.fallback_max_waiting
        for account in order:
            if ctx.loads.get(account.id, (0, 0))[1] < limit:
                return account
        return order[0]

    def usedPercent(self, account: Account) -> Optional[float]:
        """
        The account's fuller usage window now, in percent, or L{None}.
        """
        if self._quota is None:
            return None
        snapshot = self._quota.get(account.id)
        return None if snapshot is None else snapshot.used(self._clock.seconds())

