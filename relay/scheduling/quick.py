# -*- test-case-name: tests.test_scheduler_quick -*-
"""
The sticky fast path of selection (behaviour.md R38, R43 step 2, R45): the
common sticky turn decided at once on providers that answer without a
Deferred, L{relay.interfaces.ISynchronousState} and
L{relay.interfaces.ISynchronousAdmission} (the built-in memory ones).
"""

from __future__ import annotations

from typing import Optional

from attrs import define
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.base.records import Turn
from relay.interfaces import NOT_NOW, ISynchronousAdmission, ISynchronousState
from relay.scheduling.balance import Balancer
from relay.scheduling.bindings import Bindings, sessionKey
from relay.scheduling.eligibility import Eligibility, QuickPass
from relay.scheduling.layers import LAYER_SESSION
from relay.scheduling.selection import Selection
from relay.state.settings import RuntimeSettings


@define(eq=False)
class QuickSticky:
    """
    The selection of L{relay.scheduling.layers.Layers.select} for a sticky
    turn whose bound account is usable and free, without a coroutine.

    @ivar _store: the L{ISynchronousState} (also the L{IStateStore}).
    @ivar _admission: the L{ISynchronousAdmission}.
    @ivar _clock: the L{IReactorTime} for Unix seconds and latency.
    @ivar _settings: the L{RuntimeSettings} (R74).
    @ivar _bindings: the L{Bindings}.
    @ivar _checks: the L{Eligibility}.
    @ivar _balancer: the L{Balancer} (pool, last-used order).
    @ivar _log: the scheduler's logger.
    """

    _store: ISynchronousState
    _admission: ISynchronousAdmission
    _clock: IReactorTime
    _settings: RuntimeSettings
    _bindings: Bindings
    _checks: Eligibility
    _balancer: Balancer
    _log: Logger

    def select(self, turn: Turn, excluded: frozenset) -> Optional[Selection]:
        """
        The selection of L{relay.scheduling.layers.Layers.select} for the
        common sticky turn on a store and admission whose answers it takes at once
        (C{valueNow}, C{accountStateViewNow}, C{tryAcquireNow},
        C{touchValueNow}): the session binding names an account that is
        compatible and has a free slot. It reads, checks and decides as the
        layers' C{select}, C{_decide}, C{_sessionLayer} and C{_finish} do, in the
        same order, without their coroutines and intermediate objects; it
        builds the same L{DecisionRecord} and logs the same line.

        Whatever it cannot decide at once (no usable binding, a busy slot,
        a proxy-quarantine fail open) it leaves to the
        general path, having changed nothing but what a repeated read
        changes (expired values and ended blocks dropped): a busy slot's
        immediate try takes nothing.

        Conditions checked by the scheduler's C{select}: no owner request, a
        session hash, the synchronous providers. Here: no C{previous_response_id}, affinity,
        preferred account, background, stored item references or
        conversation (each has its own layer or check).

        @return: the L{Selection}, or L{None} for the general path.
        """
        if (turn.previousResponseId or turn.affinity or turn.preferredAccountId
                or turn.background or turn.itemReferences):
            return None
        if turn.endpoint == "responses" and turn.body.get("conversation") is not None:
            return None
        clock = self._clock
        started = clock.seconds()
        store = self._store
        key = sessionKey(turn.sessionHash)
        boundId = store.valueNow(key)
        if not boundId or boundId is NOT_NOW:
            return None  # (a new session: the read is repeated, as idempotent)
        pool = self._balancer.pool()
        allowed = turn.allowedAccounts
        model, endpoint = turn.model, turn.endpoint
        serving, servingIds, endpointServed = pool.serving(allowed, model, endpoint)
        if not serving or not endpointServed:
            return None
        account = pool.candidates(allowed)[1].get(boundId)
        if account is None:
            return None
        states = store.accountStateViewNow()
        ctx = QuickPass(turn, excluded, clock.seconds(), states)
        # _decide: the fail-open check and the eligible count.
        openAccounts = [a for a in serving if a.id not in excluded] if excluded else serving
        suspects = self._checks.suspectsAt(states, ctx.now, pool)
        incompatible = self._checks.incompatible
        staticIds = None
        if suspects is None:
            if openAccounts and all(self._checks.isQuarantined(a) for a in openAccounts):
                return None
            candidateCount = sum(1 for a in openAccounts if incompatible(ctx, a) is None)
        else:
            if suspects:
                flaggedOpen = sum(1 for i in suspects if i in servingIds and i not in excluded)
                if (openAccounts and flaggedOpen == len(openAccounts)
                        and all(self._checks.isQuarantined(a) for a in openAccounts)):
                    return None
            elif not openAccounts:
                return None
            static = pool.static(allowed, model, endpoint, False, False)
            staticIds = static.ids
            bad = 0
            if suspects:
                for accountId in suspects:
                    if (accountId in staticIds and accountId not in excluded
                            and incompatible(ctx, pool.byId[accountId]) is not None):
                        bad += 1
            gone = sum(1 for i in excluded if i in staticIds) if excluded else 0
            candidateCount = len(static.accounts) - gone - bad
        # _sessionLayer: the bound account, compatible, with a free slot. A
        # static candidate no source flags (a superset of what the hooks
        # and the stored states may refuse at ctx.now, read just above with
        # nothing in between) is compatible unless excluded: the full
        # check is for the others.
        if (staticIds is None or boundId not in staticIds or boundId in suspects
                or boundId in excluded):
            if incompatible(ctx, account) is not None:
                return None
        lease = self._admission.tryAcquireNow("account", account.id, account.concurrency)
        if lease is None:
            return None
        # _finish, for a session hit holding its slot (bindingOp "touch").
        self._bindings.selected(turn, False)
        self._balancer.noteUsed(account)
        scheduling = self._settings.current.scheduling
        store.touchValueNow(key, scheduling.sticky_session_ttl_seconds)
        self._bindings.written(turn, account.id)
        fields = {
            "layer": LAYER_SESSION,
            "sticky_previous_hit": False,
            "sticky_session_hit": True,
            "selected_account_id": account.id,
            "selected_account_type": account.type,
            "candidate_count": candidateCount,
            "excluded_count": len(excluded),
            "wait_plan": None,
            "latency_ms": (clock.seconds() - started) * 1000.0,
            "load_skew": 0.0,
            "top_k": 1,
            "sticky_busy_bypass": False,
            "preferred_account_hit": False,
            "quota_decided": False,
            "quota_used_percent": self._balancer.usedPercent(account),
        }
        self._log.info(
            "account schedule decision: {layer} -> {selected_account_id}",
            event="openai.account_schedule_decision", request_id=turn.requestId,
            entrypoint=turn.entrypoint, **fields,
        )
        # The record is built only if read (the log line above carries it).
        return Selection(account, lease, None, fields=fields)

