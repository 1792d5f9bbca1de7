# -*- test-case-name: tests.test_scheduler -*-
"""
The layers of account selection (behaviour.md R40-R46, R-B6, R76-R79,
R87-R90, R104), in the order of R43: the id and model checks, the
C{previous_response_id} owner (R41), affinity records (R89, R90), the
turn's preferred account, the session binding (R38, revised by R-B6), load
balance and the fallback wait plan; and the one truthful L{DecisionRecord}
(R45) every selection logs as C{openai.account_schedule_decision}.
"""

from __future__ import annotations

import math
import random
from typing import Iterable, Optional, Sequence

from attrs import define, evolve
from attrs import fields as attrs_fields
from twisted.internet.defer import fail
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.base.eager import eagerDeferred
from relay.base.records import Account, ClientError, Turn, WaitPlan
from relay.interfaces import IAccountStateView, ISlotAdmission, IStateStore
from relay.scheduling.balance import Balancer
from relay.scheduling.bindings import (
    Bindings,
    parseOwner,
    responseKey,
    sessionKey,
)
from relay.scheduling.eligibility import NO_ACCOUNT_MESSAGE, Eligibility, Pass, refusal
from relay.scheduling.index import PoolIndex
from relay.scheduling.itemowners import conversationRefused, itemNotFound, itemOwnerKey
from relay.scheduling.preview import Preview, logFor
from relay.scheduling.selection import DecisionRecord, NoAccountAvailable, Selection
from relay.state.settings import RuntimeSettings

LAYER_PREVIOUS = "previous_response_id"
LAYER_SESSION = "session_hash"
LAYER_LOAD = "load_balance"
LAYER_OWNER = "response_owner"
"""A request bound to the account that owns its response id (R87)."""

MSG_ID_MESSAGE = "previous_response_id must be a response.id (resp_*), not a message id"
FOREIGN_OWNER_MESSAGE = "previous_response_id is not available for this user"
EMBEDDINGS_MESSAGE = (
    "Embeddings require an OpenAI API-key account; none of the accounts this key may use"
    " for this model is one (ChatGPT/Codex OAuth accounts do not serve /v1/embeddings)."
)
"""R115: the answer to an embeddings request when only OAuth accounts
serve its model for the key (L{relay.base.records.Account.servesEndpoint})."""

BACKGROUND_MESSAGE = "background responses require an OpenAI API-key account"
"""R88: the ChatGPT backend keeps nothing (store is forced false), so a
background response can live only on an API-key account."""


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


@define(eq=False)
class Layers:
    """
    The walk of one selection through the layers of R43.

    @ivar _store: the L{IStateStore} holding account states.
    @ivar _admission: the L{ISlotAdmission} (for its optional
        C{tryAcquireBinding}, L{_speculate}).
    @ivar _clock: the L{IReactorTime} for Unix seconds and latency.
    @ivar _settings: the L{RuntimeSettings}; C{.current.scheduling} is read
        on every call (R74).
    @ivar _random: the tie shuffler, copied for a dry run.
    @ivar _bindings: the L{Bindings} (session bindings, owners, affinity).
    @ivar _checks: the L{Eligibility} check of every layer (R41).
    @ivar _balancer: the L{Balancer} (pool, slots, load balance).
    @ivar _log: the scheduler's logger.
    """

    _store: IStateStore
    _admission: ISlotAdmission
    _clock: IReactorTime
    _settings: RuntimeSettings
    _random: random.Random
    _bindings: Bindings
    _checks: Eligibility
    _balancer: Balancer
    _log: Logger

    async def retryHint(self, turn: Turn) -> Optional[int]:
        """
        Whole seconds until the earliest account serving C{turn}'s model
        becomes schedulable again (R83's hint), at least 1; L{None} when no
        account is blocked with a known end.
        """
        accounts = [a for a in self._balancer.pool().accounts if a.servesModel(turn.model)]
        states = await self._states(accounts)
        now = self._clock.seconds()
        ctx = Pass(
            turn=turn, excluded=frozenset(), now=now,
            scheduling=self._settings.current.scheduling,
            byId={a.id: a for a in accounts}, states=states,
        )
        ends = []
        for account in accounts:
            why = self._checks.blockWhy(ctx, account)
            if why is not None and why[1] and why[1] > now:
                ends.append(why[1])
        if not ends:
            return None
        return max(1, int(math.ceil(min(ends) - now)))


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


    async def _view(self, pool: PoolIndex, accounts: Sequence[Account]):
        """
        The account states for one selection: the store's view (no
        per-account read) or, for a store without one, a read of every
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


    def _stickyPlan(self, ctx: Pass, account: Account) -> WaitPlan:
        """
        The sticky wait plan (R28): C{sticky_session_wait_timeout} /
        C{sticky_session_max_waiting}, the account's real concurrency.
        """
        return WaitPlan(
            kind="account", id=account.id, max_concurrency=account.concurrency,
            timeout=ctx.scheduling.sticky_session_wait_timeout,
            max_waiting=ctx.scheduling.sticky_session_max_waiting, plan="sticky",
        )

    def _fallbackPlan(self, ctx: Pass, account: Account) -> WaitPlan:
        """
        The fallback wait plan (R28): C{fallback_wait_timeout} /
        C{fallback_max_waiting}.
        """
        return WaitPlan(
            kind="account", id=account.id, max_concurrency=account.concurrency,
            timeout=ctx.scheduling.fallback_wait_timeout,
            max_waiting=ctx.scheduling.fallback_max_waiting, plan="fallback",
        )


    def _speculate(self, turn: Turn, byId: dict, excluded: frozenset) -> Optional[list]:
        """
        With an admission that can refresh a binding with a slot
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
        guess = self._bindings.guess(turn.sessionHash)
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


    def movable(self, turn: Turn) -> bool:
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

    async def select(self, turn: Turn, excluded: frozenset,
                     preview: Optional[Preview] = None) -> Selection:
        """
        One selection (see L{relay.interfaces.IAccountScheduler.select});
        with C{preview}, its dry run (L{relay.scheduling.preview}).

        Order: R40 id checks, the model check (R44 404 before routing,
        seed 003), then the C{previous_response_id} owner (R41), the
        preferred account, the session binding (R43 step 2 with R-B6),
        load balance (step 3) and the fallback wait plan (step 4).

        @param excluded: account ids excluded in this turn.
        @raise NoAccountAvailable: nothing qualifies (R44).
        """
        started = self._clock.seconds()
        pool = self._balancer.pool()
        allowed = turn.allowedAccounts
        accounts, byId = pool.candidates(allowed)
        previous = turn.previousResponseId or None

        # R40: a message id is never a chain id.
        if previous and previous.startswith("msg_"):
            raise refusal(
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
            if turn.endpoint == "embeddings":
                # R115: a capability, not a fault: no account the key
                # reaches for the model is an API-key account.
                raise NoAccountAvailable(ClientError(
                    status=400, type="invalid_request_error", message=EMBEDDINGS_MESSAGE,
                    code="endpoint_not_served", param="model",
                ))
            raise NoAccountAvailable(ClientError(
                status=503, type="api_error",
                message="No available accounts: only API-key accounts serve chat completions",
                code="no_available_accounts",
            ))

        # R40, R104: a continuation must belong to the caller's key, on
        # every entrypoint and mode; an id relay holds no owner record for
        # is refused (fail closed), never tried on another key's context.
        if previous:
            ownerKey = await self._bindings.responseKeyName(previous)
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
                raise refusal(
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

        # The binding read leaves with the states read (one round
        # trip on Redis, relay.state.redisbatch); memory answers both at once.
        binding = None
        if turn.sessionHash:
            binding = self._bindings.read(sessionKey(turn.sessionHash))
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
        ctx = Pass(
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

    async def _decide(self, ctx: Pass, turn: Turn, started: float, pool: PoolIndex,
                      serving: list, servingIds: frozenset, excluded: frozenset,
                      previous: Optional[str], binding) -> Selection:
        """
        The layers of L{select}, once the states are read.
        """
        if turn.background or turn.request is not None:
            self._barOAuth(ctx)
        openAccounts = [a for a in serving if a.id not in excluded] if excluded else serving
        suspects = self._checks.suspects(ctx, pool)
        isQuarantined = self._checks.isQuarantined
        if suspects is None:
            failOpen = bool(openAccounts) and all(isQuarantined(a) for a in openAccounts)
        else:
            # An open account no source flags is not quarantined.
            flaggedOpen = sum(1 for i in suspects if i in servingIds and i not in excluded)
            failOpen = (bool(openAccounts) and flaggedOpen == len(openAccounts)
                        and all(isQuarantined(a) for a in openAccounts))
        if failOpen:
            ctx.quarantineFailOpen = True
            logFor(self._log, ctx).warn(
                "every candidate proxy is quarantined; allowing them anyway",
                event="openai.proxy_quarantine_fail_open", request_id=turn.requestId,
                candidate_count=len(openAccounts),
            )
        if suspects is None:
            ctx.eligible = [a for a in openAccounts if self._checks.incompatible(ctx, a) is None]
        else:
            self._checks.eligibleFromIndex(ctx, pool, suspects)
        if binding is not None:
            ctx.binding = await self._bindings.got(binding, sessionKey(turn.sessionHash))

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
            picked = await self._balancer.loadBalance(ctx)
            if picked is not None:
                account, lease = picked
                choice = _Choice(
                    account, lease, None, LAYER_LOAD, keepBinding=keepBinding,
                    bindingOp="none" if keepBinding else "write",
                )
        if choice is None:
            account = await self._balancer.fallback(ctx)
            if account is not None:
                choice = _Choice(
                    account, None, self._fallbackPlan(ctx, account), LAYER_LOAD,
                    keepBinding=keepBinding,
                )
        if choice is None:
            raise self._checks.nothingQualifies(ctx, openAccounts)
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
        reads = [self._bindings.read(itemOwnerKey(ref)) for ref in refs]
        owners = [await self._bindings.got(d, itemOwnerKey(ref)) for ref, d in zip(refs, reads)]
        for ref, raw in zip(refs, owners):
            keyName = parseOwner(raw)[0] if raw else None
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

    async def _previousLayer(self, ctx: Pass, previous: str) -> Optional[_Choice]:
        """
        The C{previous_response_id} layer (R41, R42, R76): route to the
        account that owns the response when it is usable. An incompatible
        owner releases any slot taken and falls through.

        @return: a L{_Choice}, or L{None} to fall through.
        """
        ownerId = await self._bindings.responseOwner(previous)
        owner = ctx.byId.get(ownerId) if ownerId else None
        if owner is None:
            if ownerId:
                # An owner this process does not have (removed by
                # a reload, or configured on another relay only) is said,
                # not silently dropped.
                logFor(self._log, ctx).info(
                    "previous_response_id owner {account_id} not usable ({reason});"
                    " falling back",
                    event="openai.previous_response_owner_skipped", account_id=ownerId,
                    reason="not_configured", request_id=ctx.turn.requestId,
                )
            return None
        reason = self._checks.incompatible(ctx, owner)
        if reason is not None and reason.startswith("unschedulable") and not ctx.dryRun:
            # R41 step 2: the owner is no longer schedulable.
            await self._bindings.write("deleteValue", responseKey(previous))
        lease, reason = await self._tryOwner(ctx, owner, reason)
        if reason is not None:
            logFor(self._log, ctx).info(
                "previous_response_id owner {account_id} not usable ({reason}); falling back",
                event="openai.previous_response_owner_skipped", account_id=owner.id,
                reason=reason, request_id=ctx.turn.requestId,
            )
            return None
        if ctx.quarantineFailOpen and self._checks.isQuarantined(owner):
            logFor(self._log, ctx).warn(
                "routing to previous_response_id owner {account_id} despite proxy quarantine",
                event="openai.previous_response_owner_fail_open", account_id=owner.id,
                request_id=ctx.turn.requestId,
            )
        plan = None if lease is not None else self._stickyPlan(ctx, owner)
        return _Choice(
            owner, lease, plan, LAYER_PREVIOUS, previousHit=True, bindingOp="write",
        )

    async def _tryOwner(self, ctx: Pass, owner: Account, reason: Optional[str]) -> tuple:
        """
        Try the slot of an owner found compatible (C{reason} L{None}), and
        re-check it just before use: a block may have appeared meanwhile
        (R41).

        @return: C{(lease or None, reason or None)}; no slot is held when a
            reason is given.
        """
        lease = None
        if reason is None:
            lease = await self._balancer.trySlot(ctx, owner)
            reason = self._checks.incompatible(ctx, owner)
            if reason is not None and lease is not None:
                lease.release()
                lease = None
        return lease, reason

    def _barOAuth(self, ctx: Pass) -> None:
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

    async def _affinityLayer(self, ctx: Pass) -> Optional[_Choice]:
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
            ownerId = await self._bindings.recalled(key)
            owner = ctx.byId.get(ownerId) if ownerId else None
            if owner is None:
                continue
            lease, reason = await self._tryOwner(
                ctx, owner, self._checks.incompatible(ctx, owner))
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

    async def selectOwner(self, turn: Turn, request, excluded: frozenset) -> Selection:
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
        account = self._balancer.pool().byId.get(request.ownerAccountId)
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
            ctx = Pass(turn=turn, excluded=excluded, now=started, scheduling=scheduling,
                        byId={account.id: account}, states={})
            lease = await self._balancer.trySlot(ctx, account)
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

    async def _preferredLayer(self, ctx: Pass) -> Optional[_Choice]:
        """
        The turn's preferred account (a WebSocket later turn stays on its
        account while it serves the model, R59, R79). A hit is labelled
        C{session_hash} only when it is also the session's bound account;
        otherwise C{load_balance} with C{preferred_account_hit} (R45).

        @return: a L{_Choice}, or L{None} to fall through.
        """
        account = ctx.byId.get(ctx.turn.preferredAccountId)
        if account is None or self._checks.incompatible(ctx, account) is not None:
            return None
        lease = await self._balancer.trySlot(ctx, account)
        plan = None if lease is not None else self._stickyPlan(ctx, account)
        bound = ctx.binding == account.id
        return _Choice(
            account, lease, plan, LAYER_SESSION if bound else LAYER_LOAD,
            sessionHit=bound, preferred=True, bindingOp="touch" if bound else "write",
        )

    async def _sessionLayer(self, ctx: Pass):
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
        reason = "unknown_account" if account is None else self._checks.incompatible(ctx, account)
        if reason is not None:
            if reason in ("unknown_account", "model_not_served") or reason.startswith(
                "unschedulable"
            ):
                # R38: delete a binding whose account can no longer serve.
                if not ctx.dryRun:
                    self._bindings.noteBinding(turn.sessionHash, None)
                    await self._bindings.write("deleteValue", sessionKey(turn.sessionHash))
                ctx.binding = None
                return False
            # Excluded in this turn (failover): the new account takes the
            # binding. A quarantined proxy or R42 only bars this request:
            # keep the lasting binding.
            return reason != "excluded"
        lease = await self._balancer.trySlot(ctx, account)
        if lease is not None:
            return _Choice(account, lease, None, LAYER_SESSION, sessionHit=True, bindingOp="touch")
        if not self.movable(turn):
            return _Choice(account, None, self._stickyPlan(ctx, account), LAYER_SESSION,
                           sessionHit=True)
        # R-B6: re-select among idle accounts, keeping the lasting binding.
        picked = await self._balancer.loadBalance(ctx, skip=frozenset([account.id]))
        if picked is not None:
            other, lease = picked
            return _Choice(other, lease, None, LAYER_LOAD, bypass=True, keepBinding=True)
        loads = await self._balancer.loads([account])
        if loads[account.id][1] < ctx.scheduling.sticky_session_max_waiting:
            return _Choice(account, None, self._stickyPlan(ctx, account), LAYER_SESSION,
                           sessionHit=True)
        return True

    async def _finish(self, ctx: Pass, started: float, choice: _Choice) -> Selection:
        """
        Note the last use, apply the session binding for a held slot (a
        plan's binding is written by L{Bindings.bind} after admission, R27 step 5),
        build the truthful L{DecisionRecord} and log it once (R45).
        """
        turn = ctx.turn
        account = choice.account
        if not ctx.dryRun:
            self._bindings.selected(turn, choice.keepBinding)
            self._balancer.noteUsed(account)
        ttl = ctx.scheduling.sticky_session_ttl_seconds
        writeBinding = choice.lease is not None and turn.sessionHash and not choice.keepBinding
        if writeBinding and not ctx.dryRun and choice.bindingOp in ("touch", "write"):
            if choice.bindingOp == "touch":
                if not (choice.sessionHit and ctx.refreshed):
                    # Not awaited (errors are logged by write). On Redis a
                    # speculative try refreshed it already.
                    self._bindings.send("touchValue", sessionKey(turn.sessionHash), ttl)
            else:
                await self._bindings.write("setValue", sessionKey(turn.sessionHash), account.id,
                                           ttl)
            # Written with the slot held; bind() need not again.
            self._bindings.written(turn, account.id)
        # The record's fields are built once, in DecisionRecord's
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
            "quota_used_percent": self._balancer.usedPercent(account),
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

