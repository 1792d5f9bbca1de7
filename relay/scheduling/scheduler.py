# -*- test-case-name: tests.test_scheduler -*-
"""
Account selection (behaviour.md group E, R37-R46, R-B6, R76-R79).

L{AccountScheduler} walks the layers of R43 in order: the
C{previous_response_id} owner (R41), the turn's preferred account (a
WebSocket connection's account), the sticky session binding (R38, revised by
R-B6), load balance, and the fallback wait plan. Every selection produces
one truthful L{DecisionRecord} (R45) and logs it as
C{openai.account_schedule_decision}.

Store keys (R38, R39, R40):

  - C{sticky_session:0:openai:{hash}} -> account id (the session binding);
  - C{sticky_session:0:openai:response:{sha256(id)}} -> account id (the
    response owner);
  - C{openai:http-response-owner:key:{sha256(id)}} -> the owner record
    C{{"key": name, "account": id}} (R40, R104; TTL
    C{response_owner_ttl_seconds}; see L{AccountScheduler.lookupResponse}).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import statistics
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence
from weakref import WeakKeyDictionary

from attrs import define, evolve, field
from attrs import fields as attrs_fields
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.admission.memory import MemorySlotAdmission
from relay.base.eager import eagerDeferred
from relay.interfaces import IAccountScheduler, IAccountStateView, ISlotAdmission, IStateStore
from relay.base.logs import ClassLogger, isoTime
from relay.base.records import Account, ClientError, SchedulingSettings, Turn, WaitPlan
from relay.scheduling.index import PoolIndex, sameSnapshot
from relay.scheduling.itemowners import conversationRefused, itemNotFound, itemOwnerKey
from relay.scheduling.selection import DecisionRecord, NoAccountAvailable, Selection, noAccountError
from relay.state.settings import RuntimeSettings
from relay.state.memory import NOT_NOW, MemoryStateStore

LAYER_PREVIOUS = "previous_response_id"
LAYER_SESSION = "session_hash"
LAYER_LOAD = "load_balance"
LAYER_OWNER = "response_owner"
"""A request bound to the account that owns its response id (R87)."""

#: At most this many response owners are kept in the local map (R39).
LOCAL_OWNER_CAPACITY = 65536

MSG_ID_MESSAGE = "previous_response_id must be a response.id (resp_*), not a message id"
FOREIGN_OWNER_MESSAGE = "previous_response_id is not available for this user"
OAUTH_CONTINUATION_MESSAGE = (
    "previous_response_id requires an OpenAI API-key account for HTTP requests"
)
BACKGROUND_MESSAGE = "background responses require an OpenAI API-key account"
"""R88: the ChatGPT backend keeps nothing (store is forced false), so a
background response can live only on an API-key account."""
NO_ACCOUNT_MESSAGE = "Service temporarily unavailable"
SLOT_ERROR_MESSAGE = "Service temporarily unavailable, please retry later"


def sessionKey(sessionHash: str) -> str:
    """
    The store key of a sticky session binding (R38).

    @param sessionHash: the 16-hex-digit hash from L{relay.scheduling.session.sessionHash}.
    @return: C{sticky_session:0:openai:{hash}}.
    """
    return f"sticky_session:0:openai:{sessionHash}"


def _digest(responseId: str) -> str:
    """
    @param responseId: a response id.
    @return: its sha256 as hex.
    """
    return hashlib.sha256(responseId.encode("utf-8")).hexdigest()


def responseKey(responseId: str) -> str:
    """
    The store key of a response's owner account (R39).

    @param responseId: the upstream response id (C{resp_...}).
    @return: C{sticky_session:0:openai:response:{sha256(responseId)}}.
    """
    return f"sticky_session:0:openai:response:{_digest(responseId)}"


def responseOwnerKey(responseId: str) -> str:
    """
    The store key of the client key that owns a response (R40).

    @param responseId: the upstream response id.
    @return: C{openai:http-response-owner:key:{sha256(responseId)}}.
    """
    return f"openai:http-response-owner:key:{_digest(responseId)}"


def responseKeys(responseId: str) -> tuple:
    """
    Issue 24: L{responseKey} and L{responseOwnerKey} of one response, from
    one sha256 of its id (a turn writes both).

    @return: C{(responseKey(responseId), responseOwnerKey(responseId))}.
    """
    digest = _digest(responseId)
    return (f"sticky_session:0:openai:response:{digest}",
            f"openai:http-response-owner:key:{digest}")


_OWNER_RECORDS: dict = {}
"""Issue 24: C{(key owner id, account id)} -> its L{ownerRecord} (a
bounded set: configured keys and accounts; cleared when full)."""
_OWNER_RECORDS_MAX = 4096


def ownerRecord(keyOwner: str, accountId: str) -> str:
    """
    The value of a response's (and its items') owner record (R104): the
    key's owner identity and the account, as compact JSON (read by
    L{_parseOwner}); built once per C{(key, account)}.

    @param keyOwner: the key's L{relay.base.records.ClientKey.ownerId}.
    @param accountId: the account that served the response.
    @return: C{{"key":keyOwner,"account":accountId}}.
    """
    ident = (keyOwner, accountId)
    record = _OWNER_RECORDS.get(ident)
    if record is None:
        record = json.dumps({"key": keyOwner, "account": accountId}, separators=(",", ":"))
        if len(_OWNER_RECORDS) >= _OWNER_RECORDS_MAX:
            _OWNER_RECORDS.clear()
        _OWNER_RECORDS[ident] = record
    return record


def affinityKey(kind: str, value: str) -> str:
    """
    The store key of an affinity record: which account issued a turn-state
    token (R90) or produced a C{compaction} item (R89).

    @param kind: C{compaction} or C{turn_state}.
    @param value: the token, or the item's C{encrypted_content}.
    @return: C{openai:affinity:{kind}:{sha256(value)}}.
    """
    return f"openai:affinity:{kind}:{_digest(value)}"


def turnStateSessionKey(sessionHash: str) -> str:
    """
    The store key of the C{x-codex-turn-state} the upstream gave a
    WebSocket session (R90), carried on the 101 of its next connection.

    @param sessionHash: the session hash (R37) of the client key and the
        session header.
    """
    return f"openai:ws-turn-state:{sessionHash}"


class _NoSlot:
    """
    The lease of a request that takes no account slot (an owner-bound
    retrieve, delete, cancel or input-items listing, R87/R88: the slot is
    held only while relay streams, not while the client polls).
    """

    kind = "account"
    id = None
    waitedSeconds = 0.0
    queuePosition = 0

    def release(self) -> None:
        """
        Nothing to give back.
        """

    def renew(self):
        """
        Nothing to renew.
        """
        from twisted.internet.defer import succeed

        return succeed(None)


NO_SLOT = _NoSlot()
"""The one L{_NoSlot}."""


def _none(result) -> None:
    """
    Drop C{result}: a store write's result is not the caller's (the
    Deferred fires with L{None}).
    """


def _parseOwner(raw: str) -> tuple:
    """
    An owner record: C{{"key": name, "account": id}} (R104), or the bare
    key name of records written before issue 19.

    @return: C{(keyName, accountId or None)}.
    """
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
            return value.get("key"), value.get("account")
        except (ValueError, AttributeError):
            return None, None
    return raw, None


def _previousNotFound(previous: str, turn: Turn) -> ClientError:
    """
    R104's fail-closed answer: C{previous_response_not_found}, as upstream
    words it; on the WebSocket the event is followed by the close every
    C{previous_response_not_found} gets, so Codex reconnects with its full
    input (L{relay.base.clienterrors.previousResponseNotFound}).
    """
    from relay.base.clienterrors import previousResponseNotFound

    error = previousResponseNotFound(previous)
    return error if turn.entrypoint == "ws" else evolve(error, wsClose=None)


def _never(account: Account) -> bool:
    """
    The default quarantine check: no proxy is ever quarantined.

    @param account: an L{Account}.
    @return: L{False}.
    """
    return False


BIG_TIE = 64
"""Issue 24: an index bucket of more accounts than this is drawn from in
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
    but C{rates} are 0 (R45's C{load_skew}; issue 24: the idle accounts of
    a pool are not listed one by one).
    """
    if count <= 1 or not any(rates):
        return 0.0
    if len(rates) == count:
        return statistics.pstdev(rates)
    mean = math.fsum(rates) / count
    variance = (math.fsum((r - mean) ** 2 for r in rates) + (count - len(rates)) * mean * mean)
    return math.sqrt(variance / count)


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
class _Pass:
    """
    What one L{AccountScheduler.select} call knows: the turn, the time, the
    account states and the derived eligibility.

    @ivar turn: the L{Turn}.
    @ivar excluded: account ids excluded in this turn.
    @ivar now: Unix seconds when the states were read.
    @ivar scheduling: the L{SchedulingSettings} in force.
    @ivar byId: account id -> L{Account}.
    @ivar states: account id -> L{relay.state.runtime.AccountRuntime}.
    @ivar oauthBarred: R42 applies (HTTP turn with C{previous_response_id}).
    @ivar quarantineFailOpen: every open candidate's proxy is quarantined,
        so quarantine is ignored (R41).
    @ivar eligible: accounts that serve the model, are not excluded, not
        blocked, not quarantined and allowed by R42, in configured order.
    @ivar binding: the session's bound account id, or L{None}.
    @ivar skew: the load skew of the last load read.
    @ivar tried: slots tried by the load-balance layer.
    @ivar loads: account id -> (inUse, waiting) of the last load read.
    """

    turn: Turn
    excluded: frozenset
    now: float
    scheduling: SchedulingSettings
    byId: dict
    states: dict
    oauthBarred: bool = False
    barMessage: str = OAUTH_CONTINUATION_MESSAGE
    barParam: Optional[str] = "previous_response_id"
    onlyOAuth: bool = False
    quarantineFailOpen: bool = False
    _eligible: Optional[list] = None
    _lazy: Optional[tuple] = None
    """Issue 24: C{(static candidates, excluded, ineligible ids)} when the
    eligible list is built only if a layer needs it (see L{eligible})."""
    candidateCount: int = 0
    """How many accounts are eligible (R45's C{candidate_count})."""
    spec: Optional[list] = None
    """Issue 24: C{[account, Deferred]} of a slot try sent with the state
    reads on the account this process last bound the session to (see
    L{AccountScheduler._speculate}), until the session layer takes it."""
    refreshed: bool = False
    """The speculative try also refreshed the session binding (R38)."""
    binding: Optional[str] = None
    skew: float = 0.0
    tried: int = 0
    loads: dict = field(factory=dict)
    quotaDecided: bool = False
    dryRun: bool = False
    """Issue 22: a preview (L{AccountScheduler.preview}): no slot is taken,
    nothing is written, nothing is logged."""
    rng: Optional[random.Random] = None
    """The tie shuffler: the scheduler's own, or (dry run) a copy of its
    state, so a preview predicts the next real selection's ties."""

    @property
    def eligible(self) -> list:
        """
        The eligible accounts in configured order; with the pool index
        (issue 24), built on first use from the static candidates less the
        excluded and the flagged accounts found ineligible.
        """
        if self._eligible is None:
            if self._lazy is None:
                self._eligible = []
            else:
                static, excluded, bad = self._lazy
                skip = excluded | bad if excluded else bad
                self._eligible = ([a for a in static if a.id not in skip] if skip
                                  else list(static))
        return self._eligible

    @eligible.setter
    def eligible(self, value: list) -> None:
        self._eligible = value
        self._lazy = None
        self.candidateCount = len(value)


class _DryLease:
    """
    What a dry run's slot "try" returns when the slot is free: holds
    nothing, releases nothing.
    """

    wouldAcquire = True

    def release(self) -> None:
        """
        Nothing was taken.
        """


DRY_LEASE = _DryLease()

_SILENT = Logger(observer=lambda event: None)
"""What a dry run logs to: nothing."""


@define(eq=False)
class Preview:
    """
    A dry run of one selection (issue 22, L{AccountScheduler.preview}).

    @ivar selection: the L{Selection} the turn would get (its C{lease} is
        L{DRY_LEASE} when a slot is free now, else C{waitPlan} is set), or
        L{None}.
    @ivar error: the L{ClientError} the turn would get instead, or L{None}.
    @ivar ctx: what the selection knew (account states, loads), or L{None}
        when it ended before reading them.
    """

    selection: Optional[Selection] = None
    error: Optional[ClientError] = None
    ctx: Optional[_Pass] = None


@define
class _Choice:
    """
    What a layer decided.

    @ivar account: the chosen L{Account}.
    @ivar lease: the held slot, or L{None}.
    @ivar plan: the L{WaitPlan} when the slot is busy, or L{None}.
    @ivar layer: the R45 layer name.
    @ivar previousHit: the C{previous_response_id} layer decided.
    @ivar sessionHit: the session binding decided.
    @ivar bypass: R-B6 moved the turn off its busy bound account.
    @ivar preferred: the turn's preferred account was chosen.
    @ivar keepBinding: the session binding must not be rewritten.
    @ivar bindingOp: what to do with the session binding now that the slot
        is held: C{write}, C{touch} or C{none}.
    """

    account: Account
    lease: object
    plan: Optional[WaitPlan]
    layer: str
    previousHit: bool = False
    sessionHit: bool = False
    bypass: bool = False
    preferred: bool = False
    keepBinding: bool = False
    bindingOp: str = "none"


_RECORD_FIELDS = tuple(a.name for a in attrs_fields(DecisionRecord))


def _recordFields(record: DecisionRecord) -> dict:
    """
    C{attrs.asdict(record)} without its per-call recursion machinery: every
    L{DecisionRecord} field is a scalar, so this is the same dict, in the
    same order, at a fraction of the cost (one per relayed request).
    """
    return {name: getattr(record, name) for name in _RECORD_FIELDS}


@implementer(IAccountScheduler)
@define(eq=False)
class AccountScheduler:
    """
    The built-in L{IAccountScheduler} (behaviour.md R37-R46, R-B6).

    @ivar _accounts: the configured accounts, read on every call (a list
        may be changed in place by the admin API).
    @ivar _admission: the L{ISlotAdmission} for account slots.
    @ivar _store: the L{IStateStore} holding account states, sticky
        bindings and response owners.
    @ivar _clock: the L{IReactorTime} for Unix seconds and latency.
    @ivar _settings: the L{RuntimeSettings}; C{.current.scheduling} is read
        on every call (R74).
    @ivar _random: shuffles ties in load-balance order (R43 step 3.5).
    @ivar _isQuarantined: C{(account) -> bool}: the account's proxy is
        quarantined (issue 8).
    @ivar _extraBlock: optional C{(account, now, upstreamModel) -> reason}
        returning L{None} when schedulable, or a reason (a string or a
        C{(reason, until)} tuple) for in-memory blocks the state store does
        not hold (e.g. the breaker, R-B1).
    @ivar _quarantineEnd: optional C{(proxy id) -> Unix seconds or None}: when
        a proxy's quarantine ends (R83's retry hint).
    @ivar _quota: optional L{relay.scheduling.quota.UsageWindows}: with
        C{scheduling.quota_aware} the load-balance layer orders accounts of
        equal priority by remaining usage window (issue 12).
    @ivar _flagged: optional C{(now, pool) -> iterable of account ids, or
        None} (C{pool}: the L{PoolIndex}, e.g. for the accounts behind a
        quarantined proxy): a superset of the accounts C{extraBlock} and C{isQuarantined} may
        refuse at C{now} (issue 24). With it (and a state store providing
        L{IAccountStateView}) a selection checks only those accounts and
        the few the store flags, so its cost does not grow with the pool;
        without it (L{None} from it, or hooks given without it) every
        candidate is checked, as before.
    @ivar _index: the L{PoolIndex} of the current account snapshot.
    @ivar _lastUsed: account id -> Unix seconds of its last selection.
    @ivar _keptBindings: turns whose selection must not rewrite the session
        binding (R-B6), consulted by L{bind}.
    @ivar _localOwners: a bounded local map response id -> (account id,
        client key name, expiry), used when the store misses or fails (R39).
    """

    _accounts: Sequence[Account]
    _admission: ISlotAdmission
    _store: IStateStore
    _clock: IReactorTime
    _settings: RuntimeSettings
    _random: random.Random = field(factory=random.Random)
    _isQuarantined: Callable[[Account], bool] = _never
    _extraBlock: Optional[Callable] = None
    _quarantineEnd: Optional[Callable[[str], Optional[float]]] = None
    _quota: Optional[object] = None
    _flagged: Optional[Callable] = None
    _lastUsed: dict = field(factory=dict, init=False)
    _keptBindings: WeakKeyDictionary = field(factory=WeakKeyDictionary, init=False)
    _localOwners: OrderedDict = field(factory=OrderedDict, init=False)
    _localAffinity: OrderedDict = field(factory=OrderedDict, init=False)
    _index: Optional[PoolIndex] = field(default=None, init=False)
    _localBindings: OrderedDict = field(factory=OrderedDict, init=False)
    """Issue 24: session hash -> the account this process last bound it to
    (bounded): the guess of L{_speculate}."""
    _boundTurns: WeakKeyDictionary = field(factory=WeakKeyDictionary, init=False)
    """Turns whose selection already wrote (or refreshed) their binding to
    the chosen account with the slot held, so L{bind} need not again."""

    _log = ClassLogger()

    # ------------------------------------------------------------------
    # IAccountScheduler
    # ------------------------------------------------------------------

    def select(self, turn: Turn, excluded=frozenset()) -> Deferred:
        """
        See L{IAccountScheduler.select}.

        Order: R40 id checks, the model check (R44 404 before routing,
        seed 003), then the C{previous_response_id} owner (R41), the
        preferred account, the session binding (R43 step 2 with R-B6),
        load balance (step 3) and the fallback wait plan (step 4).

        A request bound to the account owning its response id (R87: a
        retrieve, delete, cancel or input-items listing) is given that
        account only, never another (L{_selectOwner}).

        @param turn: the L{Turn}.
        @param excluded: account ids excluded in this turn.
        @return: Deferred firing with a L{Selection}, or failing with
            L{NoAccountAvailable}.
        """
        request = turn.request
        if request is not None:
            if request.ownerAccountId is not None:
                return eagerDeferred(self._selectOwner(turn, request, frozenset(excluded or ())))
        elif (turn.sessionHash and type(self._store) is MemoryStateStore
              and type(self._admission) is MemorySlotAdmission):
            # Issue 24: a sticky turn on the built-in in-process providers.
            selection = self._quickSticky(turn, frozenset(excluded or ()))
            if selection is not None:
                return succeed(selection)
        return eagerDeferred(self._select(turn, frozenset(excluded or ())))

    def preview(self, turn: Turn) -> Deferred:
        """
        Issue 22: the selection C{turn} would get now, from the same code
        as L{select}, without taking a slot, writing the store, touching the
        last-used order or logging a decision. A slot "try" becomes a load
        read (free when C{in use + waiting < concurrency}); ties are broken
        with a copy of the shuffler's state, so the preview names the
        account the next real selection picks when nothing changes between
        them.

        @return: a Deferred firing with a L{Preview}.
        """
        preview = Preview()

        async def _run():
            try:
                preview.selection = await self._select(turn, frozenset(), preview)
            except NoAccountAvailable as e:
                preview.error = e.error
            return preview

        return Deferred.fromCoroutine(_run())

    def why(self, ctx: _Pass, account: Account) -> Optional[tuple]:
        """
        Issue 22: why C{account} is not a candidate in a previewed pass,
        from the compatibility check every layer uses.

        @return: C{(reason, until)} (C{until} Unix seconds or L{None}), or
            L{None} when it is a candidate.
        """
        reason = self._incompatible(ctx, account)
        if reason is None:
            return None
        until = None
        if reason.startswith("unschedulable"):
            why = self._blockWhy(ctx, account)
            until = why[1] if why else None
        elif reason == "proxy_quarantined":
            until = self._quarantineUntil(account)
        return reason, until

    def usedPercent(self, account: Account) -> Optional[float]:
        """
        Issue 22: the account's fuller usage window in percent, or L{None}.
        """
        return self._usedPercent(account)

    def accountById(self, accountId: str) -> Optional[Account]:
        """
        The configured account with this id (the live registry), or L{None}.
        """
        return self._pool().byId.get(accountId)

    def recordAffinity(self, key: str, account: Account) -> Deferred:
        """
        Remember that C{account} issued a turn-state token (R90) or produced
        a C{compaction} item (R89), with TTL C{previous_response_ttl_seconds},
        in the store and a bounded local map (fail open, R35).

        @param key: an L{affinityKey}.
        @return: Deferred firing with L{None}; store errors are logged.
        """
        return self.recordValue(key, account.id)

    def recordValue(self, key: str, value: str) -> Deferred:
        """
        Keep a short string under C{key} for C{previous_response_ttl_seconds}
        (R39's lifetime), in the store and a bounded local map (fail open,
        R35): an affinity record, or the turn-state token the upstream gave
        a WebSocket session (R90, L{turnStateSessionKey}).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        ttl = self._settings.current.scheduling.previous_response_ttl_seconds
        owners = self._localAffinity
        owners.pop(key, None)
        owners[key] = (value, self._clock.seconds() + ttl)
        while len(owners) > LOCAL_OWNER_CAPACITY:
            owners.popitem(last=False)
        return eagerDeferred(self._write("setValue", key, value, ttl))

    def recallValue(self, key: str) -> Deferred:
        """
        What L{recordValue} kept under C{key}: the store, then the local map.

        @return: Deferred firing with the string, or L{None}.
        """
        return eagerDeferred(self._affinityOwner(key))

    def claimOnce(self, key: str, ttl: float) -> Deferred:
        """
        Whether this is the first claim of C{key} within C{ttl} seconds, in
        every process sharing the store (an atomic counter): a background
        response's usage is counted once, whoever sees it finished first
        (R88). A store error falls back to this process's own memory.

        @return: Deferred firing with L{True} for the first claim.
        """
        return eagerDeferred(self._claimOnce(key, ttl))

    async def _claimOnce(self, key: str, ttl: float) -> bool:
        try:
            return (await self._store.incrementCounter(key, ttl, refresh=False)) == 1
        except Exception as e:  # noqa: BLE001 - R35: fail open, locally
            self._log.error(
                "state store claim failed for {key}: {error}",
                event="openai.sticky_write_failed", op="incrementCounter", key=key,
                error=repr(e),
            )
            first = key not in self._localAffinity
            self._localAffinity[key] = ("", self._clock.seconds() + ttl)
            return first

    def affinityOwner(self, key: str) -> Deferred:
        """
        The account recorded by L{recordAffinity} for C{key}.

        @return: Deferred firing with an account id, or L{None}.
        """
        return eagerDeferred(self._affinityOwner(key))

    def bind(self, turn: Turn, account: Account) -> Deferred:
        """
        Write the session binding after admission (R38), with TTL
        C{sticky_session_ttl_seconds}; a no-op for turns without a session
        hash and for turns whose selection kept the existing binding
        (R-B6).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        if not turn.sessionHash:
            return succeed(None)
        if self._keptBindings.data and self._keptBindings.get(turn):
            return succeed(None)
        if self._boundTurns.data and self._boundTurns.pop(turn, None) == account.id:
            # The selection wrote it with the slot held (issue 24).
            return succeed(None)
        ttl = self._settings.current.scheduling.sticky_session_ttl_seconds
        self._noteBinding(turn.sessionHash, account.id)
        return eagerDeferred(self._write("setValue", sessionKey(turn.sessionHash), account.id, ttl))

    def unbind(self, turn: Turn) -> Deferred:
        """
        Delete the session binding (rotate transport policy, R72).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        return Deferred.fromCoroutine(self._unbind(turn))

    def recordResponse(self, turn: Turn, responseId: str, account: Account) -> Deferred:
        """
        Remember that C{account} owns C{responseId} (R39) and that the
        turn's client key owns it (R40), both with TTL
        C{previous_response_ttl_seconds}, in the store and the local map;
        and (R104) that the key owns the output items in
        C{turn.outputItemIds}, in the same store operation
        (L{relay.scheduling.itemowners.itemOwnerKey}, the owner record's
        value and TTL).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        if not responseId:
            return succeed(None)
        setValues = getattr(self._store, "setValues", None)
        if setValues is None:
            return eagerDeferred(self._recordResponse(turn, responseId, account))
        # Issue 24: a store with setValues (both built-in ones) gets its one
        # operation straight from here: no coroutine and no await per turn.
        try:
            records, ttl = self._responseRecords(turn, responseId, account)
        except BaseException:  # noqa: BLE001 - delivered as the Deferred's failure
            return fail()
        try:
            d = setValues(records, ttl)
        except Exception as e:  # noqa: BLE001 - logged, never raised (as _write)
            self._writeFailed("setValues", (records, ttl), e)
            return succeed(None)
        if d.called and d.result is None:
            return d

        def failed(f):
            if not isinstance(f.value, Exception):
                return f
            self._writeFailed("setValues", (records, ttl), f.value)
            return None

        return d.addCallbacks(_none, failed)

    def retryHint(self, turn: Turn) -> Deferred:
        """
        Whole seconds until the earliest account serving C{turn}'s model
        becomes schedulable again (R83's hint, issue 19 item 7: also for
        the 429 relay answers when every account it tried answered 429).

        @return: a Deferred firing with seconds (at least 1), or L{None}
            when no account is blocked with a known end.
        """
        return eagerDeferred(self._retryHint(turn))

    async def _retryHint(self, turn: Turn) -> Optional[int]:
        import math

        accounts = [a for a in self._accounts if a.servesModel(turn.model)]
        states = await self._states(accounts)
        now = self._clock.seconds()
        ctx = _Pass(
            turn=turn, excluded=frozenset(), now=now,
            scheduling=self._settings.current.scheduling,
            byId={a.id: a for a in accounts}, states=states,
        )
        ends = []
        for account in accounts:
            why = self._blockWhy(ctx, account)
            if why is not None and why[1] and why[1] > now:
                ends.append(why[1])
        if not ends:
            return None
        return max(1, int(math.ceil(min(ends) - now)))

    # ------------------------------------------------------------------
    # Store helpers (R35: fail open)
    # ------------------------------------------------------------------

    async def _get(self, key: str) -> Optional[str]:
        """
        Read a key; a store error counts as "no value" (R35).
        """
        try:
            return await self._store.getValue(key)
        except Exception as e:
            self._log.error(
                "state store read failed for {key}: {error}",
                event="openai.sticky_read_failed", key=key, error=repr(e),
            )
            return None

    def _read(self, key: str) -> Deferred:
        """
        Start reading a key (see L{_got}); a store that raises at once gives
        a failed Deferred.
        """
        try:
            return self._store.getValue(key)
        except Exception:  # noqa: BLE001 - delivered through the Deferred, logged by _got
            return fail()

    async def _got(self, d: Deferred, key: str) -> Optional[str]:
        """
        The value a L{_read} of C{key} gives; a store error counts as "no
        value" (R35), logged as L{_get} does.
        """
        try:
            return await d
        except Exception as e:
            self._log.error(
                "state store read failed for {key}: {error}",
                event="openai.sticky_read_failed", key=key, error=repr(e),
            )
            return None

    def _send(self, op: str, *args) -> None:
        """
        Call a store write method without waiting for it; errors are logged
        as L{_write} logs them.
        """
        try:
            d = getattr(self._store, op)(*args)
        except Exception:  # noqa: BLE001 - logged by the errback below
            d = fail()

        def _eb(f):
            self._log.error(
                "state store {op} failed for {key}: {error}",
                event="openai.sticky_write_failed", op=op, key=args[0], error=repr(f.value),
            )

        d.addErrback(_eb)

    async def _write(self, op: str, *args) -> None:
        """
        Call a store write method; errors are logged, never raised.

        @param op: C{setValue}, C{touchValue} or C{deleteValue}.
        """
        try:
            await getattr(self._store, op)(*args)
        except Exception as e:
            self._writeFailed(op, args, e)

    def _writeFailed(self, op: str, args: tuple, e: Exception) -> None:
        """
        Log a store write that failed (L{_write}).
        """
        key = ", ".join(p[0] for p in args[0]) if op == "setValues" else args[0]
        self._log.error(
            "state store {op} failed for {key}: {error}",
            event="openai.sticky_write_failed", op=op, key=key, error=repr(e),
        )

    def _noteBinding(self, sessionHash: str, accountId: Optional[str]) -> None:
        """
        Keep (or with L{None}, forget) the local guess of a session's
        binding (issue 24, L{_speculate}).
        """
        bindings = self._localBindings
        bindings.pop(sessionHash, None)
        if accountId is not None:
            bindings[sessionHash] = accountId
            while len(bindings) > LOCAL_OWNER_CAPACITY:
                bindings.popitem(last=False)

    async def _unbind(self, turn: Turn) -> None:
        """
        See L{unbind}.
        """
        if turn.sessionHash:
            self._noteBinding(turn.sessionHash, None)
            await self._write("deleteValue", sessionKey(turn.sessionHash))

    async def _recordResponse(self, turn: Turn, responseId: str, account: Account) -> None:
        """
        See L{recordResponse}. Two records: the routing binding (R39, TTL
        C{previous_response_ttl_seconds}) and the owner record (R104: the
        key and the account, JSON, TTL C{response_owner_ttl_seconds}, as
        long as upstream keeps a stored response).
        """
        if not responseId:
            return
        records, ttl = self._responseRecords(turn, responseId, account)
        # Both writes leave at once (issue 14): a reader in another process
        # must not find the owner without the key (R40) a round trip later.
        if getattr(self._store, "setValues", None) is not None:
            # Issue 24: one operation for both (each with its own TTL).
            await self._write("setValues", records, ttl)
            return
        writes = [
            Deferred.fromCoroutine(self._write("setValue", key, value, t))
            for key, value, t in records
        ]
        for d in writes:
            await d

    def _responseRecords(self, turn: Turn, responseId: str, account: Account) -> tuple:
        """
        Remember the owner locally and build the store records of
        L{_recordResponse}.

        @return: C{(records, ttl)}: C{(key, value, ttl)} triples (the
            routing binding, the owner record, the items' owner records)
            and the routing binding's TTL.
        """
        s = self._settings.current.scheduling
        ttl = s.previous_response_ttl_seconds
        ownerTtl = max(ttl, s.response_owner_ttl_seconds)
        # R104: owned by the key's owner identity (ClientKey.ownerId): a
        # file key's name, an admin key's name with its issuance.
        keyOwner = turn.client.ownerId
        accountId = account.id
        self._remember(responseId, accountId, keyOwner, ownerTtl)
        owner = ownerRecord(keyOwner, accountId)
        bindingKey, ownerKey = responseKeys(responseId)
        records = ((bindingKey, accountId, ttl), (ownerKey, owner, ownerTtl))
        if turn.outputItemIds:
            # R104: its output items belong to the key too (the same record
            # and lifetime, in the same operation: no extra round trip).
            records += tuple((itemOwnerKey(i), owner, ownerTtl) for i in turn.outputItemIds)
        return records, ttl

    def _remember(self, responseId: str, accountId: str, keyName: str, ttl: float) -> None:
        """
        Put a response owner into the bounded local map (R39).
        """
        owners = self._localOwners
        owners.pop(responseId, None)
        owners[responseId] = (accountId, keyName, self._clock.seconds() + ttl)
        while len(owners) > LOCAL_OWNER_CAPACITY:
            owners.popitem(last=False)

    def _local(self, responseId: str) -> Optional[tuple]:
        """
        @return: the live local C{(accountId, keyName)} of a response, or
            L{None}.
        """
        entry = self._localOwners.get(responseId)
        if entry is None:
            return None
        if entry[2] <= self._clock.seconds():
            del self._localOwners[responseId]
            return None
        return entry[:2]

    def lookupResponse(self, responseId: str) -> Deferred:
        """
        Who owns a response id (behaviour.md R39, R40, R104): the key that
        created it and the account that served it, from the store's owner
        record (persisted with the store: Redis, or the embedded store),
        else this process's local map.

        The contract with every route that names a response (retrieve,
        delete, cancel, input items, continuations): L{None} means relay
        holds no owner record, and the caller must fail closed (an unknown
        id, C{previous_response_not_found} / 404), never serve it on
        another key's context.

        @param responseId: the response id (C{resp_...}).
        @return: a Deferred firing with L{None} or C{(accountId, keyName)}
            (C{accountId} may be L{None} for a record written before the
            account was kept with it and whose routing binding expired).
            Store errors count as "no record" (fail closed, logged).
        """
        return eagerDeferred(self._lookupResponse(responseId))

    async def _lookupResponse(self, responseId: str) -> Optional[tuple]:
        if not responseId:
            return None
        raw = await self._get(responseOwnerKey(responseId))
        if raw:
            keyName, accountId = _parseOwner(raw)
            if accountId is None:
                accountId = await self._get(responseKey(responseId))
            if keyName:
                return (accountId, keyName)
        return self._local(responseId)

    async def _responseOwner(self, responseId: str) -> Optional[str]:
        """
        The account id that owns a response (R39): the routing binding,
        then the owner record (R104), then the local map.
        """
        owner = await self._get(responseKey(responseId))
        if owner:
            return owner
        found = await self._lookupResponse(responseId)
        return found[0] if found else None

    async def _affinityOwner(self, key: str) -> Optional[str]:
        """
        See L{affinityOwner}: the store, then the local map.
        """
        owner = await self._get(key)
        if owner and owner.startswith("{"):
            # R104: an item owner record (relay.scheduling.itemowners)
            # names the account that stored the item.
            owner = _parseOwner(owner)[1]
        if owner:
            return owner
        entry = self._localAffinity.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock.seconds():
            del self._localAffinity[key]
            return None
        return entry[0]

    async def _responseKeyName(self, responseId: str) -> Optional[str]:
        """
        The client key name that owns a response (R40), or L{None}.
        """
        found = await self._lookupResponse(responseId)
        return found[1] if found else None

    async def _states(self, accounts: Iterable[Account]) -> dict:
        """
        Account runtime states; a store error counts as "all healthy" (R35).
        """
        try:
            return await self._store.getAccountStates([a.id for a in accounts])
        except Exception as e:
            self._log.error(
                "account state read failed: {error}",
                event="openai.account_state_read_failed", error=repr(e),
            )
            return {}

    async def _loads(self, accounts: Sequence[Account]) -> dict:
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

    def _logFor(self, ctx: _Pass) -> Logger:
        """
        The scheduler's logger, or (issue 22's dry run) one that writes
        nothing.
        """
        return _SILENT if ctx.dryRun else self._log

    def _candidates(self, turn: Turn) -> list:
        """
        Issue 22: the accounts selection considers for C{turn}: the
        configured ones, narrowed to those its key may reach
        (C{Turn.allowedAccounts}, its account group). Every layer, failover
        and wait plan below works on this list only, so a key bound to a
        group never reaches another account.
        """
        return list(self._pool().candidates(turn.allowedAccounts)[0])

    def _pool(self) -> PoolIndex:
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

    async def _view(self, pool: PoolIndex, accounts: Sequence[Account]):
        """
        The account states for one selection: the store's view (issue 24,
        no per-account read) or, for a store without one, a read of every
        candidate's state; a store error counts as "all healthy" (R35).
        """
        store = self._store
        if IAccountStateView.providedBy(store):
            try:
                return await store.accountStateView(pool.ids)
            except Exception as e:
                self._log.error(
                    "account state read failed: {error}",
                    event="openai.account_state_read_failed", error=repr(e),
                )
                return {}
        return await self._states(accounts)

    def _suspects(self, ctx: _Pass, pool: PoolIndex) -> Optional[set]:
        """
        Issue 24: the accounts whose eligibility must be checked in this
        selection (every other static candidate is eligible), or L{None}
        when the sources cannot tell (then every candidate is checked).
        """
        return self._suspectsAt(ctx.states, ctx.now, pool)

    def _suspectsAt(self, states, now: float, pool: PoolIndex) -> Optional[set]:
        """
        L{_suspects} of the account states C{states} at C{now}.
        """
        flagged = getattr(states, "flagged", None)
        if flagged is None:
            return None
        first = flagged(now)
        if self._extraBlock is not None or self._isQuarantined is not _never:
            if self._flagged is None:
                return None
            more = self._flagged(now, pool)
            if more is None:
                return None
            if not first and type(more) is set:
                return more  # (the hook's own new set: no copy)
            out = set(first)
            out.update(more)
            return out
        return set(first)

    # ------------------------------------------------------------------
    # Errors
    # ------------------------------------------------------------------

    @staticmethod
    def _error(turn: Turn, status: int, type: str, message: str, code=None,
               param=None, wsClose=None) -> NoAccountAvailable:
        """
        Build L{NoAccountAvailable}; C{wsClose} applies only to WebSocket
        turns.
        """
        return NoAccountAvailable(ClientError(
            status=status, type=type, message=message, code=code, param=param,
            wsClose=wsClose if turn.entrypoint == "ws" else None,
        ))

    def _nothingQualifies(self, ctx: _Pass, openAccounts: list) -> NoAccountAvailable:
        """
        The R44 error when no account qualifies: R42's 400 when only OAuth
        accounts remain for an HTTP continuation; when every candidate is
        blocked, R83's answer (429 when all are rate-limited, else 503, with
        C{Retry-After} and the reason class, L{noAccountError}); else 503.
        WebSocket turns close 1013. The log line lists each account's
        reason.

        @param openAccounts: accounts that serve the model and are not
            excluded.
        """
        turn = ctx.turn
        if ctx.oauthBarred and openAccounts and all(a.type == "oauth" for a in openAccounts):
            return self._error(
                turn, 400, "invalid_request_error", ctx.barMessage, param=ctx.barParam,
            )
        if ctx.onlyOAuth and not any(a.type == "oauth" for a in openAccounts):
            return self._error(turn, 400, "invalid_request_error", ctx.barMessage)
        allowed = [a for a in openAccounts if not (ctx.oauthBarred and a.type == "oauth")
                   and not (ctx.onlyOAuth and a.type != "oauth")]
        blocked = []
        for account in allowed:
            why = self._blockWhy(ctx, account)
            if why is None and self._quarantined(ctx, account):
                why = ("proxy_quarantined", self._quarantineUntil(account))
            if why is None:
                blocked = None
                break
            blocked.append((account.id, why[0], why[1]))
        self._logFor(ctx).info(
            "no account available for model {model}: {accounts}",
            event="openai.account_select_no_available", request_id=turn.requestId,
            entrypoint=turn.entrypoint, model=turn.model, excluded_count=len(ctx.excluded),
            accounts="; ".join(
                f"{a.id}: {self._describe(ctx, a)}" for a in openAccounts
            ) or "none",
        )
        if blocked:
            # R83: every account is blocked: say why and when it ends.
            return NoAccountAvailable(
                noAccountError(turn.model, blocked, ctx.now, turn.entrypoint == "ws")
            )
        return self._error(
            turn, 503, "api_error", NO_ACCOUNT_MESSAGE,
            wsClose=(1013, "no available account"),
        )

    def _describe(self, ctx: _Pass, account: Account) -> str:
        """
        One account's state for the R83 log line: its block reason and end
        (ISO-8601 UTC, as the log renders times in every message), or why
        else it was not chosen.
        """
        why = self._blockWhy(ctx, account)
        if why is not None:
            until = why[1]
            return f"{why[0]} until {isoTime(until)}" if until else why[0]
        if self._quarantined(ctx, account):
            return "proxy_quarantined"
        return self._incompatible(ctx, account) or "busy or over load"

    # ------------------------------------------------------------------
    # Eligibility
    # ------------------------------------------------------------------

    def _blockReason(self, ctx: _Pass, account: Account) -> Optional[str]:
        """
        Why the account is runtime-blocked for this turn's model (see
        L{_blockWhy}).

        @return: a reason string, or L{None} when schedulable.
        """
        why = self._blockWhy(ctx, account)
        return None if why is None else why[0]

    def _blockWhy(self, ctx: _Pass, account: Account) -> Optional[tuple]:
        """
        Why the account is runtime-blocked for this turn's model and until
        when: the state store's L{relay.state.runtime.AccountRuntime.unschedulable},
        then the C{extraBlock} hook; the later end wins when both block.

        @return: C{(reason, until)} (C{until} Unix seconds, 0 or L{None}
            when permanent or unknown), or L{None} when schedulable.
        """
        upstream = account.upstreamModel(ctx.turn.model) if ctx.turn.model else None
        state = ctx.states.get(account.id)
        stored = state.unschedulable(ctx.now, upstream) if state is not None else None
        extra = self._extraBlock(account, ctx.now, upstream) if self._extraBlock else None
        if extra and not isinstance(extra, tuple):
            extra = (str(extra), None)
        if stored is None:
            return (str(extra[0]), extra[1]) if extra else None
        if extra and stored[1] and (extra[1] or 0) > stored[1]:
            return (str(extra[0]), extra[1])
        return (str(stored[0]), stored[1])

    def _quarantineUntil(self, account: Account) -> Optional[float]:
        """
        When the account's proxy quarantine ends, if the hook knows.
        """
        if self._quarantineEnd is None or account.proxy is None:
            return None
        return self._quarantineEnd(account.proxy.id)

    def _quarantined(self, ctx: _Pass, account: Account) -> bool:
        """
        Whether the account's proxy quarantine applies (not when every
        candidate is quarantined: fail open, R41).
        """
        return not ctx.quarantineFailOpen and bool(self._isQuarantined(account))

    def _incompatible(self, ctx: _Pass, account: Account) -> Optional[str]:
        """
        The compatibility check shared by every layer (R41): excluded,
        model served after mapping, runtime block, proxy quarantine, R42.

        @return: the reason the account cannot take the turn, or L{None}.
        """
        if account.id in ctx.excluded:
            return "excluded"
        if not account.servesModel(ctx.turn.model):
            return "model_not_served"
        if not account.servesEndpoint(ctx.turn.endpoint):
            return "endpoint_not_served"
        if ctx.oauthBarred and account.type == "oauth":
            return "oauth_http_continuation"
        if ctx.onlyOAuth and account.type != "oauth":
            return "not_an_oauth_account"
        blocked = self._blockReason(ctx, account)
        if blocked:
            return "unschedulable: " + blocked
        if self._quarantined(ctx, account):
            return "proxy_quarantined"
        return None

    # ------------------------------------------------------------------
    # Selection
    # ------------------------------------------------------------------

    def _stickyPlan(self, ctx: _Pass, account: Account) -> WaitPlan:
        """
        The sticky wait plan (R28): C{sticky_session_wait_timeout} /
        C{sticky_session_max_waiting}, the account's real concurrency.
        """
        return WaitPlan(
            kind="account", id=account.id, max_concurrency=account.concurrency,
            timeout=ctx.scheduling.sticky_session_wait_timeout,
            max_waiting=ctx.scheduling.sticky_session_max_waiting, plan="sticky",
        )

    def _fallbackPlan(self, ctx: _Pass, account: Account) -> WaitPlan:
        """
        The fallback wait plan (R28): C{fallback_wait_timeout} /
        C{fallback_max_waiting}.
        """
        return WaitPlan(
            kind="account", id=account.id, max_concurrency=account.concurrency,
            timeout=ctx.scheduling.fallback_wait_timeout,
            max_waiting=ctx.scheduling.fallback_max_waiting, plan="fallback",
        )

    async def _try(self, ctx: _Pass, account: Account):
        """
        One immediate slot attempt. An admission error ends the selection
        with 503 / WebSocket 1011 (R32, R35).

        @return: an L{relay.interfaces.ISlotLease} or L{None}.
        """
        if ctx.dryRun:
            # Issue 22's preview: read the load instead of taking the slot.
            inUse, waiting = (await self._loads([account]))[account.id]
            limit = account.concurrency
            return DRY_LEASE if limit <= 0 or inUse + waiting < limit else None
        spec = ctx.spec
        if spec is not None and spec[0] is account:
            # Issue 24: the try sent with the state reads (L{_speculate}).
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

    def _acquireFailed(self, ctx: _Pass, account: Account, e: Exception) -> NoAccountAvailable:
        """
        Log an account slot acquire error; the 503 / WebSocket 1011 that
        ends the selection (R32, R35).
        """
        self._log.error(
            "account slot acquire failed for {account_id}: {error}",
            event="openai.account_slot_acquire_error", account_id=account.id,
            error=repr(e), request_id=ctx.turn.requestId,
        )
        return self._error(
            ctx.turn, 503, "api_error", SLOT_ERROR_MESSAGE,
            wsClose=(1011, "failed to acquire account concurrency slot"),
        )

    def _speculate(self, turn: Turn, byId: dict, excluded: frozenset) -> Optional[list]:
        """
        Issue 24: with an admission that can refresh a binding with a slot
        try (L{relay.admission.redis.RedisSlotAdmission.tryAcquireBinding}),
        try the slot of the account this process last bound the session to
        now, so it travels with the binding and state reads (one round trip
        instead of three for a sticky turn on Redis). The session layer
        takes the try when the binding still names that account and it is
        eligible, exactly where it would try it; otherwise the slot, if
        taken, is released when the selection ends.

        @return: C{[account, Deferred of (lease or None, refreshed)]}, or
            L{None}.
        """
        tryBinding = getattr(self._admission, "tryAcquireBinding", None)
        if tryBinding is None:
            return None
        guess = self._localBindings.get(turn.sessionHash)
        account = byId.get(guess) if guess is not None else None
        if account is None or account.id in excluded:
            return None
        ttl = self._settings.current.scheduling.sticky_session_ttl_seconds
        try:
            d = tryBinding("account", account.id, account.concurrency,
                           sessionKey(turn.sessionHash), ttl)
        except Exception:  # noqa: BLE001 - delivered to the session layer, or dropped
            d = fail()
        return [account, d]

    @staticmethod
    def _dropSpeculation(spec: list) -> None:
        """
        Give back a speculative slot the selection did not use.
        """

        def _cb(result):
            lease = result[0]
            if lease is not None:
                lease.release()

        spec[1].addCallbacks(_cb, lambda f: None)

    def _ordered(self, accounts: list, key: Callable, rng=None) -> list:
        """
        Sort by C{key}, shuffling accounts that tie (R43 step 3.5): shuffle
        with the injected random (or C{rng}), then sort stably.
        """
        accounts = list(accounts)
        (rng or self._random).shuffle(accounts)
        accounts.sort(key=key)
        return accounts

    def _lastUsedSecond(self, account: Account) -> int:
        """
        The last-used sort key: -1 for never used, else whole seconds.
        """
        last = self._lastUsed.get(account.id)
        return -1 if last is None else int(last)

    async def _loadBalance(self, ctx: _Pass, skip: frozenset = frozenset()):
        """
        The load-balance layer (R43 step 3): read loads in one batch, keep
        C{loadRate < 100}, order by priority, load rate, last used (ties
        in random order), try each slot after re-checking its state; on a
        full miss re-read the load and repeat once.

        Issue 24: with the pool index and an admission that reports its
        busy slots (L{relay.admission.memory.MemorySlotAdmission.busy}) the
        order is read from the index (L{_indexedOrder}) instead of sorting
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
            ctx.loads.update(await self._loads(candidates))
            rates = {a.id: loadRate(*ctx.loads[a.id], a.concurrency) for a in candidates}
            ctx.skew = statistics.pstdev(rates.values()) if len(rates) > 1 else 0.0
            available = [a for a in candidates if rates[a.id] < 100]

            def plain(a, rates=rates):
                return (rates[a.id], self._lastUsedSecond(a))

            if quota is None:
                def key(a):
                    return (a.priority,) + plain(a)
            else:
                # Issue 12: within a priority, the most remaining usage
                # window first; at/above the threshold only after the rest.
                def key(a):
                    return (a.priority,) + quota.rank(a.id, threshold) + plain(a)
            ranked = sorted(available, key=key)
            groups = [list(g) for _, g in itertools.groupby(ranked, key=key)]
            def peersOf(priority, chosen, available=available, plain=plain):
                return [plain(a) for a in available if a.priority == priority
                        and (a is chosen or not self._incompatible(ctx, a))]

            found = await self._tryInOrder(ctx, self._inRandomOrder(groups, ctx.rng),
                                           quota, peersOf, plain)
            if found is not None:
                return found
        return None

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

    async def _tryInOrder(self, ctx: _Pass, order, quota, peersOf, plain):
        """
        Try each account of C{order} after re-checking it (R43 step 3.6).

        @param peersOf: C{(priority) -> plain keys} of the available
            accounts of that priority (issue 12's C{quota_decided}).
        @return: C{(account, lease)} or L{None}.
        """
        for account in order:
            if self._incompatible(ctx, account):
                continue
            ctx.tried += 1
            lease = await self._try(ctx, account)
            if lease is not None:
                if quota is not None:
                    # The chosen account is always its own peer: its state
                    # may have changed while the acquire was in flight
                    # (found by the chaos soak, issue 14).
                    peers = peersOf(account.priority, account)
                    ctx.quotaDecided = plain(account) > min(peers + [plain(account)])
                return account, lease
        return None

    async def _loadBalanceIndexed(self, ctx: _Pass, skip: frozenset, busy, quota, threshold):
        """
        L{_loadBalance} from the pool index (issue 24): only the busy
        candidates (a slot held or a waiter), those with a usage window
        (issue 12, when quota-aware) and the flagged ones are looked at one
        by one; every other candidate is idle with the default quota rank,
        so its place is its priority and last-used second, which the index
        keeps in order (L{PoolIndex.buckets}).
        """
        pool = self._pool()
        if pool.buckets is None:
            pool.placeAll(self._lastUsedSecond)
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

            def plain(a, rates=rates):
                return (rates.get(a.id, 0.0), self._lastUsedSecond(a))

            if quota is None:
                def key(a):
                    return (a.priority,) + plain(a)
            else:
                def key(a):
                    return (a.priority,) + quota.rank(a.id, threshold) + plain(a)
            specials = sorted(
                (key(byId[i]), pool.position[i], byId[i]) for i in special if rates[i] < 100)
            skipped = out.union(special) if special else out
            groups = self._indexedGroups(pool, staticIds, skipped, specials, quota is not None)

            def peersOf(priority, chosen, specials=specials, skipped=skipped):
                peers = [plain(t[2]) for t in specials if t[2].priority == priority
                         and (t[2] is chosen or not self._incompatible(ctx, t[2]))]
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
        R34); an error counts as idle (R35), as L{_loads}.
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
                run = [specials[si]]
                si += 1
                while si < len(specials) and specials[si][0] == run[0][0]:
                    run.append(specials[si])
                    si += 1
                yield [t[2] for t in run]
            if len(members) > BIG_TIE and not (si < len(specials)
                                                and specials[si][0] == plainKey):
                # Issue 24: a large run (a fresh pool: every account never
                # used) is drawn from in place, not copied.
                yield _Run(members, byId, staticIds, skipped)
                continue
            group = [byId[i] for i in members if i in staticIds and i not in skipped]
            while si < len(specials) and specials[si][0] == plainKey:
                group.append(specials[si][2])
                si += 1
            if group:
                group.sort(key=lambda a: position[a.id])
                yield group
        while si < len(specials):
            run = [specials[si]]
            si += 1
            while si < len(specials) and specials[si][0] == run[0][0]:
                run.append(specials[si])
                si += 1
            yield [t[2] for t in run]

    async def _fallback(self, ctx: _Pass):
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
        ctx.loads.update(await self._loads(missing))
        order = self._ordered(
            ctx.eligible, key=lambda a: (a.priority, self._lastUsedSecond(a)), rng=ctx.rng,
        )
        limit = ctx.scheduling.fallback_max_waiting
        for account in order:
            if ctx.loads.get(account.id, (0, 0))[1] < limit:
                return account
        return order[0]

    def _usedPercent(self, account: Account) -> Optional[float]:
        """
        The account's fuller usage window now, in percent, or L{None}.
        """
        if self._quota is None:
            return None
        snapshot = self._quota.get(account.id)
        return None if snapshot is None else snapshot.used(self._clock.seconds())

    def _eligibleFromIndex(self, ctx: _Pass, pool: PoolIndex, suspects: set) -> None:
        """
        Issue 24: the eligible count (and, lazily, list) from the static
        candidates of this kind of turn, checking only the C{suspects}
        (flagged by a source) that are static candidates and not excluded.
        """
        turn = ctx.turn
        static = pool.static(turn.allowedAccounts, turn.model, turn.endpoint,
                             ctx.oauthBarred, ctx.onlyOAuth)
        excluded = ctx.excluded
        bad = set()
        byId = pool.byId
        for accountId in suspects:
            if accountId in static.ids and accountId not in excluded:
                if self._incompatible(ctx, byId[accountId]) is not None:
                    bad.add(accountId)
        gone = sum(1 for i in excluded if i in static.ids) if excluded else 0
        ctx._lazy = (static.accounts, excluded, bad)
        ctx._eligible = None
        ctx.candidateCount = len(static.accounts) - gone - len(bad)

    def _movable(self, turn: Turn) -> bool:
        """
        Whether a busy sticky slot may send the turn elsewhere (R-B6): not
        a WebSocket later turn, not a continuation (its chain lives on the
        bound account), and the turn's history is complete (R46, R80).
        """
        if turn.entrypoint == "ws" and turn.phase == "later_turn":
            return False
        if turn.previousResponseId:
            return False
        return bool(turn.historyComplete)

    async def _select(self, turn: Turn, excluded: frozenset,
                      preview: Optional[Preview] = None) -> Selection:
        """
        See L{select}; with C{preview}, the dry run of L{preview}.
        """
        started = self._clock.seconds()
        pool = self._pool()
        allowed = turn.allowedAccounts
        accounts, byId = pool.candidates(allowed)
        previous = turn.previousResponseId or None

        # R40: a message id is never a chain id.
        if previous and previous.startswith("msg_"):
            raise self._error(
                turn, 400, "invalid_request_error", MSG_ID_MESSAGE,
                param="previous_response_id", wsClose=(1008, MSG_ID_MESSAGE),
            )

        # Seed 003 / R44: the requested model must be served, before routing.
        # R110: served as its normalised name (Account.servesModel); an
        # account without a models list serves any name, so a name is
        # refused here only when every account the key reaches has a list.
        serving, servingIds, endpointServed = pool.serving(allowed, turn.model, turn.endpoint)
        if not serving:
            message = f"The model `{turn.model}` does not exist or you do not have access to it."
            # R79: on the WebSocket an unknown model is an error event with
            # status 400 and the connection stays open (no wsClose).
            raise NoAccountAvailable(ClientError(
                status=400 if turn.entrypoint == "ws" else 404,
                type="invalid_request_error", message=message, code="model_not_found",
                param="model",
            ))

        if not endpointServed:
            raise NoAccountAvailable(ClientError(
                status=503, type="api_error",
                message="No available accounts: only API-key accounts serve chat completions",
                code="no_available_accounts",
            ))

        # R40, R104: a continuation must belong to the caller's key, on
        # every entrypoint and mode; an id relay holds no owner record for
        # is refused (fail closed), never tried on another key's context.
        if previous:
            ownerKey = await self._responseKeyName(previous)
            if ownerKey is None:
                self._log.info(
                    "previous_response_id {previous} has no owner record; refused",
                    event="relay.previous_response_unowned", previous=previous,
                    request_id=turn.requestId, client=turn.client.name,
                )
                raise NoAccountAvailable(_previousNotFound(previous, turn))
            if ownerKey != turn.client.ownerId:
                self._log.warn(
                    "key {client} named a response of another key; refused",
                    event="relay.previous_response_foreign", request_id=turn.requestId,
                    client=turn.client.name,
                )
                raise self._error(
                    turn, 400, "invalid_request_error", FOREIGN_OWNER_MESSAGE,
                    param="previous_response_id", wsClose=(1008, FOREIGN_OWNER_MESSAGE),
                )

        # R104: nor a stored item, nor a conversation (relay.scheduling.itemowners).
        if turn.itemReferences:
            await self._checkItemOwners(turn)
        if turn.endpoint == "responses" and turn.body.get("conversation") is not None:
            self._log.info(
                "key {client} named a conversation; refused",
                event="relay.conversation_refused", request_id=turn.requestId,
                client=turn.client.name,
            )
            raise NoAccountAvailable(conversationRefused())

        # Issue 24: the binding read leaves with the states read (one round
        # trip on Redis, relay.state.redisbatch); memory answers both at once.
        binding = None
        if turn.sessionHash:
            binding = self._read(sessionKey(turn.sessionHash))
        viewing = eagerDeferred(self._view(pool, accounts))
        spec = None
        if (binding is not None and preview is None and not previous and not turn.affinity
                and not turn.preferredAccountId):
            spec = self._speculate(turn, byId, excluded)
        try:
            states = await viewing
        except BaseException:
            if spec is not None:
                self._dropSpeculation(spec)
            raise
        ctx = _Pass(
            turn=turn, excluded=excluded, now=self._clock.seconds(),
            scheduling=self._settings.current.scheduling,
            byId=byId, states=states,
            oauthBarred=bool(previous) and turn.entrypoint == "http", spec=spec,
        )
        if preview is not None:
            ctx.dryRun, preview.ctx = True, ctx
            ctx.rng = random.Random()
            ctx.rng.setstate(self._random.getstate())
        try:
            return await self._decide(ctx, turn, started, pool, serving, servingIds,
                                      excluded, previous, binding)
        finally:
            if ctx.spec is not None:
                self._dropSpeculation(ctx.spec)
                ctx.spec = None

    async def _decide(self, ctx: _Pass, turn: Turn, started: float, pool: PoolIndex,
                      serving: list, servingIds: frozenset, excluded: frozenset,
                      previous: Optional[str], binding) -> Selection:
        """
        The layers of L{_select}, once the states are read.
        """
        if turn.background or turn.request is not None:
            self._barOAuth(ctx)
        openAccounts = [a for a in serving if a.id not in excluded] if excluded else serving
        suspects = self._suspects(ctx, pool)
        if suspects is None:
            failOpen = bool(openAccounts) and all(self._isQuarantined(a) for a in openAccounts)
        else:
            # Issue 24: an open account no source flags is not quarantined.
            flaggedOpen = sum(1 for i in suspects if i in servingIds and i not in excluded)
            failOpen = (bool(openAccounts) and flaggedOpen == len(openAccounts)
                        and all(self._isQuarantined(a) for a in openAccounts))
        if failOpen:
            ctx.quarantineFailOpen = True
            self._logFor(ctx).warn(
                "every candidate proxy is quarantined; allowing them anyway",
                event="openai.proxy_quarantine_fail_open", request_id=turn.requestId,
                candidate_count=len(openAccounts),
            )
        if suspects is None:
            ctx.eligible = [a for a in openAccounts if self._incompatible(ctx, a) is None]
        else:
            self._eligibleFromIndex(ctx, pool, suspects)
        if binding is not None:
            ctx.binding = await self._got(binding, sessionKey(turn.sessionHash))

        choice = None
        if previous:
            choice = await self._previousLayer(ctx, previous)
        if choice is None and turn.affinity:
            choice = await self._affinityLayer(ctx)
        if choice is None and turn.preferredAccountId:
            choice = await self._preferredLayer(ctx)
        keepBinding = False
        if choice is None and ctx.binding:
            outcome = await self._sessionLayer(ctx)
            if isinstance(outcome, _Choice):
                choice = outcome
            else:
                keepBinding = outcome
        if choice is None:
            picked = await self._loadBalance(ctx)
            if picked is not None:
                account, lease = picked
                choice = _Choice(
                    account, lease, None, LAYER_LOAD, keepBinding=keepBinding,
                    bindingOp="none" if keepBinding else "write",
                )
        if choice is None:
            account = await self._fallback(ctx)
            if account is not None:
                choice = _Choice(
                    account, None, self._fallbackPlan(ctx, account), LAYER_LOAD,
                    keepBinding=keepBinding,
                )
        if choice is None:
            raise self._nothingQualifies(ctx, openAccounts)
        return await self._finish(ctx, started, choice)

    async def _checkItemOwners(self, turn: Turn) -> None:
        """
        R104: every stored item the turn's input names by id
        (C{turn.itemReferences}) must be owned by the turn's key: its owner
        record (L{itemOwnerKey}, written with the response that produced
        it) names the key. The reads leave together (one round trip on
        Redis); a missing record, another key's, or a store error refuses
        the turn (fail closed) with upstream's 404 for an unknown item.

        @raise NoAccountAvailable: carrying L{itemNotFound}.
        """
        refs = tuple(dict.fromkeys(turn.itemReferences))
        reads = [self._read(itemOwnerKey(ref)) for ref in refs]
        owners = [await self._got(d, itemOwnerKey(ref)) for ref, d in zip(refs, reads)]
        for ref, raw in zip(refs, owners):
            keyName = _parseOwner(raw)[0] if raw else None
            if keyName == turn.client.ownerId:
                continue
            self._log.info(
                "key {client} named item {item_id} it does not own; refused",
                event="relay.item_reference_refused", item_id=ref,
                reason="unowned" if keyName is None else "foreign",
                request_id=turn.requestId, client=turn.client.name,
            )
            raise NoAccountAvailable(itemNotFound(ref))
        # Upstream resolves an item on the account that stored it: the turn
        # prefers that account (the affinity layer, like R89's compaction).
        layer = ("item_reference", itemOwnerKey(refs[0]))
        if layer not in turn.affinity:
            turn.affinity += (layer,)

    async def _previousLayer(self, ctx: _Pass, previous: str) -> Optional[_Choice]:
        """
        The C{previous_response_id} layer (R41, R42, R76): route to the
        account that owns the response when it is usable. An incompatible
        owner releases any slot taken and falls through.

        @return: a L{_Choice}, or L{None} to fall through.
        """
        ownerId = await self._responseOwner(previous)
        owner = ctx.byId.get(ownerId) if ownerId else None
        if owner is None:
            if ownerId:
                # Issue 14: an owner this process does not have (removed by
                # a reload, or configured on another relay only) is said,
                # not silently dropped.
                self._logFor(ctx).info(
                    "previous_response_id owner {account_id} not usable ({reason});"
                    " falling back",
                    event="openai.previous_response_owner_skipped", account_id=ownerId,
                    reason="not_configured", request_id=ctx.turn.requestId,
                )
            return None
        reason = self._incompatible(ctx, owner)
        if reason is not None and reason.startswith("unschedulable") and not ctx.dryRun:
            # R41 step 2: the owner is no longer schedulable.
            await self._write("deleteValue", responseKey(previous))
        lease = None
        if reason is None:
            lease = await self._try(ctx, owner)
            # Re-check just before use: a block may have appeared meanwhile.
            reason = self._incompatible(ctx, owner)
            if reason is not None and lease is not None:
                lease.release()
                lease = None
        if reason is not None:
            self._logFor(ctx).info(
                "previous_response_id owner {account_id} not usable ({reason}); falling back",
                event="openai.previous_response_owner_skipped", account_id=owner.id,
                reason=reason, request_id=ctx.turn.requestId,
            )
            return None
        if ctx.quarantineFailOpen and self._isQuarantined(owner):
            self._logFor(ctx).warn(
                "routing to previous_response_id owner {account_id} despite proxy quarantine",
                event="openai.previous_response_owner_fail_open", account_id=owner.id,
                request_id=ctx.turn.requestId,
            )
        plan = None if lease is not None else self._stickyPlan(ctx, owner)
        return _Choice(
            owner, lease, plan, LAYER_PREVIOUS, previousHit=True, bindingOp="write",
        )

    def _barOAuth(self, ctx: _Pass) -> None:
        """
        R88 and R87: a background create, and a request only API-key
        accounts serve (input token counts), are barred from OAuth accounts
        like an HTTP continuation (R42), with their own message; a request
        only OAuth accounts serve (the Codex models manifest, R92) is barred
        from API-key accounts.
        """
        request = ctx.turn.request
        if request is not None and request.accountType == "apikey":
            ctx.oauthBarred = True
            ctx.barMessage, ctx.barParam = request.accountTypeMessage, None
        elif request is not None and request.accountType == "oauth":
            ctx.onlyOAuth = True
            ctx.barMessage, ctx.barParam = request.accountTypeMessage, None
        elif ctx.turn.background:
            ctx.oauthBarred = True
            ctx.barMessage, ctx.barParam = BACKGROUND_MESSAGE, "background"

    async def _affinityLayer(self, ctx: _Pass) -> Optional[_Choice]:
        """
        R89, R90: a turn carrying a C{compaction} item (or an
        C{x-codex-turn-state} token) prefers the account that produced
        (issued) it, like R39's owner: the first recorded, usable account of
        C{turn.affinity} is tried (its sticky wait plan when busy); an
        unusable one falls through to the other layers. The layer is named
        after the kind of record (C{compaction}, C{turn_state}).

        @return: a L{_Choice}, or L{None} to fall through.
        """
        for layer, key in ctx.turn.affinity:
            ownerId = await self._affinityOwner(key)
            owner = ctx.byId.get(ownerId) if ownerId else None
            if owner is None:
                continue
            reason = self._incompatible(ctx, owner)
            lease = None
            if reason is None:
                lease = await self._try(ctx, owner)
                reason = self._incompatible(ctx, owner)
                if reason is not None and lease is not None:
                    lease.release()
                    lease = None
            if reason is not None:
                self._log.info(
                    "{layer} owner {account_id} not usable ({reason}); falling back",
                    event="openai.affinity_owner_skipped", layer=layer, account_id=owner.id,
                    reason=reason, request_id=ctx.turn.requestId,
                )
                continue
            plan = None if lease is not None else self._stickyPlan(ctx, owner)
            return _Choice(owner, lease, plan, layer, bindingOp="write")
        return None

    async def _selectOwner(self, turn: Turn, request, excluded: frozenset) -> Selection:
        """
        R87: a request bound to the account that owns its response id gets
        that account and no other: it is never moved (once the owner is
        excluded by a failure, nothing is left and the engine answers with
        the last failure). It takes the account's slot only when the
        request uses one (a stream resume, R88), waiting on the sticky plan
        when busy; otherwise L{NO_SLOT}. The owner's blocks are not
        consulted: only it can answer for its responses.
        """
        started = self._clock.seconds()
        account = self.accountById(request.ownerAccountId)
        if account is None or account.id in excluded:
            raise NoAccountAvailable(ClientError(
                404, "invalid_request_error",
                f"No response found with id '{request.responseId}'.",
            ) if account is None else ClientError(
                503, "api_error", NO_ACCOUNT_MESSAGE, code="no_available_accounts",
            ))
        scheduling = self._settings.current.scheduling
        plan = None
        lease = NO_SLOT
        if request.usesSlot:
            ctx = _Pass(turn=turn, excluded=excluded, now=started, scheduling=scheduling,
                        byId={account.id: account}, states={})
            lease = await self._try(ctx, account)
            if lease is None:
                plan = self._stickyPlan(ctx, account)
        record = DecisionRecord(
            layer=LAYER_OWNER, sticky_previous_hit=False, sticky_session_hit=False,
            selected_account_id=account.id, selected_account_type=account.type,
            candidate_count=1, excluded_count=len(excluded),
            wait_plan=plan.plan if plan is not None else None,
            latency_ms=(self._clock.seconds() - started) * 1000.0, top_k=1,
        )
        self._log.info(
            "account schedule decision: {layer} -> {selected_account_id}",
            event="openai.account_schedule_decision", request_id=turn.requestId,
            entrypoint=turn.entrypoint, request_kind=request.name, **_recordFields(record),
        )
        return Selection(account=account, lease=lease, waitPlan=plan, record=record)

    async def _preferredLayer(self, ctx: _Pass) -> Optional[_Choice]:
        """
        The turn's preferred account (a WebSocket later turn stays on its
        account while it serves the model, R59, R79). A hit is labelled
        C{session_hash} only when it is also the session's bound account;
        otherwise C{load_balance} with C{preferred_account_hit} (R45).

        @return: a L{_Choice}, or L{None} to fall through.
        """
        account = ctx.byId.get(ctx.turn.preferredAccountId)
        if account is None or self._incompatible(ctx, account) is not None:
            return None
        lease = await self._try(ctx, account)
        plan = None if lease is not None else self._stickyPlan(ctx, account)
        bound = ctx.binding == account.id
        return _Choice(
            account, lease, plan, LAYER_SESSION if bound else LAYER_LOAD,
            sessionHit=bound, preferred=True, bindingOp="touch" if bound else "write",
        )

    async def _sessionLayer(self, ctx: _Pass):
        """
        The session-hash layer (R43 step 2, R38) with R-B6.

        A busy bound account keeps a turn that cannot move (WebSocket later
        turns, continuations, incomplete history) with the sticky wait plan.
        A movable turn tries idle accounts by load-balance order without
        rewriting the binding; with none idle it waits on the bound account
        while its queue has fewer than C{sticky_session_max_waiting}
        waiters, else falls through to load balance keeping the binding.

        @return: a L{_Choice} on a decision; L{True} to fall through keeping
            the binding; L{False} to fall through normally (no usable
            binding, or the bound account is excluded in this turn).
        """
        turn = ctx.turn
        account = ctx.byId.get(ctx.binding)
        reason = "unknown_account" if account is None else self._incompatible(ctx, account)
        if reason is not None:
            if reason in ("unknown_account", "model_not_served") or reason.startswith(
                "unschedulable"
            ):
                # R38: delete a binding whose account can no longer serve.
                if not ctx.dryRun:
                    self._noteBinding(turn.sessionHash, None)
                    await self._write("deleteValue", sessionKey(turn.sessionHash))
                ctx.binding = None
                return False
            # Excluded in this turn (failover): the new account takes the
            # binding. A quarantined proxy or R42 only bars this request:
            # keep the lasting binding.
            return reason != "excluded"
        lease = await self._try(ctx, account)
        if lease is not None:
            return _Choice(account, lease, None, LAYER_SESSION, sessionHit=True, bindingOp="touch")
        if not self._movable(turn):
            return _Choice(account, None, self._stickyPlan(ctx, account), LAYER_SESSION,
                           sessionHit=True)
        # R-B6: re-select among idle accounts, keeping the lasting binding.
        picked = await self._loadBalance(ctx, skip=frozenset([account.id]))
        if picked is not None:
            other, lease = picked
            return _Choice(other, lease, None, LAYER_LOAD, bypass=True, keepBinding=True)
        loads = await self._loads([account])
        if loads[account.id][1] < ctx.scheduling.sticky_session_max_waiting:
            return _Choice(account, None, self._stickyPlan(ctx, account), LAYER_SESSION,
                           sessionHit=True)
        return True

    async def _finish(self, ctx: _Pass, started: float, choice: _Choice) -> Selection:
        """
        Note the last use, apply the session binding for a held slot (a
        plan's binding is written by L{bind} after admission, R27 step 5),
        build the truthful L{DecisionRecord} and log it once (R45).
        """
        turn = ctx.turn
        account = choice.account
        if not ctx.dryRun:
            if choice.keepBinding:
                self._keptBindings[turn] = True
            elif self._keptBindings.data:
                self._keptBindings.pop(turn, None)
            if self._boundTurns.data:
                # (A weak dictionary's pop builds a weak reference.)
                self._boundTurns.pop(turn, None)
            old = self._lastUsedSecond(account)
            self._lastUsed[account.id] = self._clock.seconds()
            if self._index is not None:
                self._index.moved(account, old, self._lastUsedSecond(account))
        ttl = ctx.scheduling.sticky_session_ttl_seconds
        writeBinding = choice.lease is not None and turn.sessionHash and not choice.keepBinding
        if writeBinding and not ctx.dryRun and choice.bindingOp in ("touch", "write"):
            if choice.bindingOp == "touch":
                if not (choice.sessionHit and ctx.refreshed):
                    # Not awaited (errors are logged by _write). On Redis a
                    # speculative try refreshed it already (issue 24).
                    self._send("touchValue", sessionKey(turn.sessionHash), ttl)
            else:
                await self._write("setValue", sessionKey(turn.sessionHash), account.id, ttl)
            # Issue 24: written with the slot held; bind() need not again.
            self._boundTurns[turn] = account.id
            self._noteBinding(turn.sessionHash, account.id)
        # Issue 24: the record's fields are built once, in DecisionRecord's
        # order (_RECORD_FIELDS), for the record and for its log line.
        fields = {
            "layer": choice.layer,
            "sticky_previous_hit": choice.previousHit,
            "sticky_session_hit": choice.sessionHit,
            "selected_account_id": account.id,
            "selected_account_type": account.type,
            "candidate_count": ctx.candidateCount,
            "excluded_count": len(ctx.excluded),
            "wait_plan": choice.plan.plan if choice.plan is not None else None,
            "latency_ms": (self._clock.seconds() - started) * 1000.0,
            "load_skew": ctx.skew,
            "top_k": max(ctx.tried, 1),
            "sticky_busy_bypass": choice.bypass,
            "preferred_account_hit": choice.preferred,
            "quota_decided": (ctx.quotaDecided and choice.layer == LAYER_LOAD
                              and not choice.preferred),
            "quota_used_percent": self._usedPercent(account),
        }
        if ctx.dryRun:
            return Selection(account, choice.lease, choice.plan, fields=fields)
        # Info, not R45's debug: seed 003's tables (and relay.console.report) are
        # computed from these lines, and the default runners drop debug.
        self._log.info(
            "account schedule decision: {layer} -> {selected_account_id}",
            event="openai.account_schedule_decision", request_id=turn.requestId,
            entrypoint=turn.entrypoint, **fields,
        )
        # The record is built only if read (the log line above carries it).
        return Selection(account, choice.lease, choice.plan, fields=fields)

    # ------------------------------------------------------------------
    # Issue 24: the sticky fast path of the in-process providers
    # ------------------------------------------------------------------

    def _quickSticky(self, turn: Turn, excluded: frozenset) -> Optional[Selection]:
        """
        The selection of L{_select} for the common sticky turn on the
        built-in memory store and admission, whose answers it takes at once
        (C{valueNow}, C{accountStateViewNow}, C{tryAcquireNow},
        C{touchValueNow}): the session binding names an account that is
        compatible and has a free slot. It reads, checks and decides as
        L{_select}, L{_decide}, L{_sessionLayer} and L{_finish} do, in the
        same order, without their coroutines and intermediate objects; it
        builds the same L{DecisionRecord} and logs the same line.

        Whatever it cannot decide at once (no usable binding, a busy slot,
        a proxy-quarantine fail open) it leaves to the
        general path, having changed nothing but what a repeated read
        changes (expired values and ended blocks dropped): a busy slot's
        immediate try takes nothing.

        Conditions checked by L{select}: no owner request, a session hash,
        the memory providers. Here: no C{previous_response_id}, affinity,
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
        pool = self._pool()
        allowed = turn.allowedAccounts
        model, endpoint = turn.model, turn.endpoint
        serving, servingIds, endpointServed = pool.serving(allowed, model, endpoint)
        if not serving or not endpointServed:
            return None
        account = pool.candidates(allowed)[1].get(boundId)
        if account is None:
            return None
        states = store.accountStateViewNow()
        ctx = _QuickPass(turn, excluded, clock.seconds(), states)
        # _decide: the fail-open check and the eligible count.
        openAccounts = [a for a in serving if a.id not in excluded] if excluded else serving
        suspects = self._suspectsAt(states, ctx.now, pool)
        incompatible = self._incompatible
        if suspects is None:
            if openAccounts and all(self._isQuarantined(a) for a in openAccounts):
                return None
            candidateCount = sum(1 for a in openAccounts if incompatible(ctx, a) is None)
        else:
            if suspects:
                flaggedOpen = sum(1 for i in suspects if i in servingIds and i not in excluded)
                if (openAccounts and flaggedOpen == len(openAccounts)
                        and all(self._isQuarantined(a) for a in openAccounts)):
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
        # _sessionLayer: the bound account, compatible, with a free slot.
        if incompatible(ctx, account) is not None:
            return None
        lease = self._admission.tryAcquireNow("account", account.id, account.concurrency)
        if lease is None:
            return None
        # _finish, for a session hit holding its slot (bindingOp "touch").
        if self._keptBindings.data:
            self._keptBindings.pop(turn, None)
        if self._boundTurns.data:
            self._boundTurns.pop(turn, None)
        lastUsed = self._lastUsed
        last = lastUsed.get(account.id)
        old = -1 if last is None else int(last)
        now = lastUsed[account.id] = clock.seconds()
        if self._index is not None and old != int(now):
            self._index.moved(account, old, int(now))
        scheduling = self._settings.current.scheduling
        store.touchValueNow(key, scheduling.sticky_session_ttl_seconds)
        self._boundTurns[turn] = account.id
        self._noteBinding(turn.sessionHash, account.id)
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
            "quota_used_percent": self._usedPercent(account),
        }
        self._log.info(
            "account schedule decision: {layer} -> {selected_account_id}",
            event="openai.account_schedule_decision", request_id=turn.requestId,
            entrypoint=turn.entrypoint, **fields,
        )
        # The record is built only if read (the log line above carries it).
        return Selection(account, lease, None, fields=fields)


class _QuickPass:
    """
    What L{AccountScheduler._incompatible} reads of a L{_Pass}, for
    L{AccountScheduler._quickSticky}'s turns (no R42 bar, no OAuth-only
    request, no quarantine fail open, not a dry run).
    """

    __slots__ = ("turn", "excluded", "now", "states")

    oauthBarred = False
    onlyOAuth = False
    quarantineFailOpen = False
    dryRun = False

    def __init__(self, turn: Turn, excluded: frozenset, now: float, states) -> None:
        self.turn, self.excluded, self.now, self.states = turn, excluded, now, states
