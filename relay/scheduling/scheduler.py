# -*- test-case-name: tests.test_scheduler -*-
"""
Account selection (behaviour.md group E, R37-R46, R-B6, R76-R79).

L{AccountScheduler} is the built-in L{IAccountScheduler}: a façade over
the rooms of selection, each a module of its own:

  - L{relay.scheduling.layers}: the layers of R43 in order (the
    C{previous_response_id} owner, R41; affinity records; the turn's
    preferred account; the sticky session binding, R38 revised by R-B6;
    load balance; the fallback wait plan) and the one truthful
    L{DecisionRecord} (R45) each selection logs as
    C{openai.account_schedule_decision};
  - L{relay.scheduling.bindings}: what selection remembers in the state
    store (session bindings, response owners, affinity records, R38-R40,
    R104) and their store keys;
  - L{relay.scheduling.eligibility}: the compatibility check of every
    layer and the answer when nothing qualifies (R41, R42, R44, R83);
  - L{relay.scheduling.balance}: the accounts in force, slot tries and the
    load-balance and fallback layers (R28, R43 steps 3-4);
  - L{relay.scheduling.preview}: the dry run C{/admin/explain} shows;
  - L{relay.scheduling.quick}: the sticky fast path, taken only with
    providers that declare L{ISynchronousState} and
    L{ISynchronousAdmission}.
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.base.eager import eagerDeferred
from relay.base.logs import ClassLogger
from relay.base.records import Account, Turn
from relay.interfaces import (
    IAccountScheduler,
    ISlotAdmission,
    IStateStore,
    ISynchronousAdmission,
    ISynchronousState,
)
from relay.scheduling import preview as _preview
from relay.scheduling.balance import Balancer, loadRate
from relay.scheduling.bindings import (
    Bindings,
    affinityKey,
    ownerRecord,
    responseKey,
    responseKeys,
    responseOwnerKey,
    sessionKey,
    turnStateSessionKey,
)
from relay.scheduling.eligibility import Eligibility, Pass, never
from relay.scheduling.layers import NO_SLOT, Layers
from relay.scheduling.preview import DRY_LEASE, Preview
from relay.scheduling.quick import QuickSticky
from relay.state.settings import RuntimeSettings

__all__ = [
    "AccountScheduler", "DRY_LEASE", "NO_SLOT", "Preview", "affinityKey", "loadRate",
    "ownerRecord", "responseKey", "responseKeys", "responseOwnerKey", "sessionKey",
    "turnStateSessionKey",
]


@implementer(IAccountScheduler)
@define(eq=False)
class AccountScheduler:
    """
    The built-in L{IAccountScheduler} (behaviour.md R37-R46, R-B6): builds
    its rooms once and hands each call to the one that holds it.

    @ivar _accounts: the configured accounts, read on every call (a list
        may be changed in place by the admin API).
    @ivar _admission: the L{ISlotAdmission} for account slots.
    @ivar _store: the L{IStateStore} holding account states, sticky
        bindings and response owners.
    @ivar _clock: the L{IReactorTime} for Unix seconds and latency.
    @ivar _settings: the L{RuntimeSettings}; C{.current.scheduling} is read
        on every call (R74).
    @ivar _random: shuffles ties in load-balance order (R43 step 3.5).
    @ivar _isQuarantined: C{(account) -> bool}, the proxy quarantine hook;
        with C{_extraBlock}, C{_quarantineEnd} and C{_flagged}, the hooks of
        L{Eligibility} (see there).
    @ivar _quota: optional L{relay.scheduling.quota.UsageWindows}: with
        C{scheduling.quota_aware} the load-balance layer orders accounts of
        equal priority by remaining usage window.
    @ivar _bindings: the L{Bindings} room.
    @ivar _checks: the L{Eligibility} room.
    @ivar _balancer: the L{Balancer} room (it holds the pool index and the
        last-used order).
    @ivar _layers: the L{Layers} room.
    @ivar _quick: the L{QuickSticky} fast path, or L{None} when the store or
        the admission does not declare the synchronous capability.
    """

    _accounts: Sequence[Account]
    _admission: ISlotAdmission
    _store: IStateStore
    _clock: IReactorTime
    _settings: RuntimeSettings
    _random: random.Random = field(factory=random.Random)
    _isQuarantined: Callable[[Account], bool] = never
    _extraBlock: Optional[Callable] = None
    _quarantineEnd: Optional[Callable[[str], Optional[float]]] = None
    _quota: Optional[object] = None
    _flagged: Optional[Callable] = None
    _bindings: Bindings = field(init=False)
    _checks: Eligibility = field(init=False)
    _balancer: Balancer = field(init=False)
    _layers: Layers = field(init=False)
    _quick: Optional[QuickSticky] = field(init=False)

    _log = ClassLogger()

    def __attrs_post_init__(self) -> None:
        # Every room logs as the scheduler (one namespace, as before the split).
        log = self._log
        store, admission, clock, settings = (self._store, self._admission, self._clock,
                                             self._settings)
        self._bindings = Bindings(store, clock, settings, log)
        self._checks = Eligibility(self._isQuarantined, self._extraBlock,
                                   self._quarantineEnd, self._flagged, log)
        self._balancer = Balancer(self._accounts, admission, clock, self._random,
                                  self._quota, self._checks, log)
        self._layers = Layers(store, admission, clock, settings, self._random,
                              self._bindings, self._checks, self._balancer, log)
        self._quick = None
        if ISynchronousState.providedBy(store) and ISynchronousAdmission.providedBy(admission):
            self._quick = QuickSticky(store, admission, clock, settings, self._bindings,
                                      self._checks, self._balancer, log)

    # ------------------------------------------------------------------
    # IAccountScheduler
    # ------------------------------------------------------------------

    def select(self, turn: Turn, excluded=frozenset()) -> Deferred:
        """
        See L{IAccountScheduler.select} and
        L{relay.scheduling.layers.Layers.select}.

        A request bound to the account owning its response id (R87: a
        retrieve, delete, cancel or input-items listing) is given that
        account only, never another (L{Layers.selectOwner}).

        @param turn: the L{Turn}.
        @param excluded: account ids excluded in this turn.
        @return: Deferred firing with a L{relay.scheduling.selection.Selection},
            or failing with L{relay.scheduling.selection.NoAccountAvailable}.
        """
        request = turn.request
        if request is not None:
            if request.ownerAccountId is not None:
                return eagerDeferred(self._layers.selectOwner(
                    turn, request, frozenset(excluded or ())))
        elif turn.sessionHash and self._quick is not None:
            # A sticky turn on providers that answer at once.
            selection = self._quick.select(turn, frozenset(excluded or ()))
            if selection is not None:
                return succeed(selection)
        return eagerDeferred(self._layers.select(turn, frozenset(excluded or ())))

    def bind(self, turn: Turn, account: Account) -> Deferred:
        """
        See L{IAccountScheduler.bind} and L{Bindings.bind}.
        """
        return self._bindings.bind(turn, account)

    def unbind(self, turn: Turn) -> Deferred:
        """
        See L{IAccountScheduler.unbind} and L{Bindings.unbind}.
        """
        return self._bindings.unbind(turn)

    def recordResponse(self, turn: Turn, responseId: str, account: Account) -> Deferred:
        """
        See L{IAccountScheduler.recordResponse} and L{Bindings.recordResponse}.
        """
        return self._bindings.recordResponse(turn, responseId, account)

    # ------------------------------------------------------------------
    # The rest of the scheduler's API
    # ------------------------------------------------------------------

    def preview(self, turn: Turn) -> Deferred:
        """
        The selection C{turn} would get now, without taking a slot,
        writing the store, touching the last-used order or logging (see
        L{relay.scheduling.preview}).

        @return: a Deferred firing with a L{Preview}.
        """
        return _preview.preview(self._layers.select, turn)

    def why(self, ctx: Pass, account: Account) -> Optional[tuple]:
        """
        Why C{account} is not a candidate in a previewed pass
        (L{relay.scheduling.preview.why}).

        @return: C{(reason, until)}, or L{None} when it is a candidate.
        """
        return _preview.why(self._checks, ctx, account)

    def usedPercent(self, account: Account) -> Optional[float]:
        """
        The account's fuller usage window in percent, or L{None}.
        """
        return self._balancer.usedPercent(account)

    def accountById(self, accountId: str) -> Optional[Account]:
        """
        The configured account with this id (the live registry), or L{None}.
        """
        return self._balancer.pool().byId.get(accountId)

    def retryHint(self, turn: Turn) -> Deferred:
        """
        Whole seconds until the earliest account serving C{turn}'s model
        becomes schedulable again (R83's hint; also for the 429 relay
        answers when every account it tried answered 429).

        @return: a Deferred firing with seconds (at least 1), or L{None}
            when no account is blocked with a known end.
        """
        return eagerDeferred(self._layers.retryHint(turn))

    def lookupResponse(self, responseId: str) -> Deferred:
        """
        Who owns a response id (R39, R40, R104); see
        L{Bindings.lookupResponse}.

        @return: a Deferred firing with L{None} or C{(accountId, keyName)}.
        """
        return self._bindings.lookupResponse(responseId)

    def recordAffinity(self, key: str, account: Account) -> Deferred:
        """
        See L{Bindings.recordAffinity} (R89, R90).
        """
        return self._bindings.recordAffinity(key, account)

    def recordValue(self, key: str, value: str) -> Deferred:
        """
        See L{Bindings.recordValue} (R39's lifetime, R90).
        """
        return self._bindings.recordValue(key, value)

    def recallValue(self, key: str) -> Deferred:
        """
        See L{Bindings.recallValue}.
        """
        return self._bindings.recallValue(key)

    def affinityOwner(self, key: str) -> Deferred:
        """
        See L{Bindings.affinityOwner} (R89, R90).
        """
        return self._bindings.affinityOwner(key)

    def claimOnce(self, key: str, ttl: float) -> Deferred:
        """
        See L{Bindings.claimOnce} (R88).
        """
        return self._bindings.claimOnce(key, ttl)
