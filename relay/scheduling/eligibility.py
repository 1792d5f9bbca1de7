# -*- test-case-name: tests.test_scheduler -*-
"""
Which accounts may take a turn (behaviour.md R41, R42, R44, R83, R87,
R88): the compatibility check every selection layer uses, the runtime
blocks and proxy quarantine behind it, and the answer when nothing
qualifies.

A selection's knowledge travels in one L{Pass}: the turn, the time, the
account states and the eligible accounts derived from them.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

from attrs import define
from twisted.logger import Logger

from relay.base.logs import isoTime
from relay.base.records import Account, ClientError, SchedulingSettings, Turn
from relay.scheduling.index import PoolIndex
from relay.scheduling.preview import logFor
from relay.scheduling.selection import NoAccountAvailable, noAccountError

OAUTH_CONTINUATION_MESSAGE = (
    "previous_response_id requires an OpenAI API-key account for HTTP requests"
)
NO_ACCOUNT_MESSAGE = "Service temporarily unavailable"


def never(account: Account) -> bool:
    """
    The default quarantine check: no proxy is ever quarantined.

    @param account: an L{Account}.
    @return: L{False}.
    """
    return False


def refusal(turn: Turn, status: int, type: str, message: str, code=None,
            param=None, wsClose=None) -> NoAccountAvailable:
    """
    Build L{NoAccountAvailable}; C{wsClose} applies only to WebSocket
    turns.
    """
    return NoAccountAvailable(ClientError(
        status=status, type=type, message=message, code=code, param=param,
        wsClose=wsClose if turn.entrypoint == "ws" else None,
    ))


class Pass:
    """
    What one L{relay.scheduling.layers.Layers.select} call knows: the turn, the time, the
    account states and the derived eligibility.

    A plain class: the constructor sets what every pass is given and the
    C{loads} map; every other attribute reads its class default until a
    layer sets it (one pass per general selection: no per-field default
    work).

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

    oauthBarred: bool = False
    barMessage: str = OAUTH_CONTINUATION_MESSAGE
    barParam: Optional[str] = "previous_response_id"
    onlyOAuth: bool = False
    quarantineFailOpen: bool = False
    _eligible: Optional[list] = None
    _lazy: Optional[tuple] = None
    """C{(static candidates, excluded, ineligible ids)} when the
    eligible list is built only if a layer needs it (see L{eligible})."""
    candidateCount: int = 0
    """How many accounts are eligible (R45's C{candidate_count})."""
    spec: Optional[list] = None
    """C{[account, Deferred]} of a slot try sent with the state
    reads on the account this process last bound the session to (see
    L{relay.scheduling.layers.Layers}), until the session layer takes it."""
    refreshed: bool = False
    """The speculative try also refreshed the session binding (R38)."""
    binding: Optional[str] = None
    skew: float = 0.0
    tried: int = 0
    quotaDecided: bool = False
    dryRun: bool = False
    """A preview (L{relay.scheduling.preview}): no slot is taken,
    nothing is written, nothing is logged."""
    rng: Optional[random.Random] = None
    """The tie shuffler: the scheduler's own, or (dry run) a copy of its
    state, so a preview predicts the next real selection's ties."""

    def __init__(self, turn: Turn, excluded: frozenset, now: float,
                 scheduling: SchedulingSettings, byId: dict, states,
                 oauthBarred: bool = False, spec: Optional[list] = None) -> None:
        self.turn, self.excluded, self.now, self.scheduling = turn, excluded, now, scheduling
        self.byId, self.states = byId, states
        if oauthBarred:
            self.oauthBarred = oauthBarred
        if spec is not None:
            self.spec = spec
        self.loads: dict = {}

    @property
    def eligible(self) -> list:
        """
        The eligible accounts in configured order; with the pool index,
        built on first use from the static candidates less the
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


class QuickPass:
    """
    What L{Eligibility.incompatible} reads of a L{Pass}, for
    L{relay.scheduling.quick.QuickSticky}'s turns (no R42 bar, no OAuth-only
    request, no quarantine fail open, not a dry run).
    """

    __slots__ = ("turn", "excluded", "now", "states")

    oauthBarred = False
    onlyOAuth = False
    quarantineFailOpen = False
    dryRun = False

    def __init__(self, turn: Turn, excluded: frozenset, now: float, states) -> None:
        self.turn, self.excluded, self.now, self.states = turn, excluded, now, states


@define(eq=False)
class Eligibility:
    """
    The compatibility check of every layer (R41) with its sources: the
    state store's runtime states (in the pass), and the hooks below.

    @ivar isQuarantined: C{(account) -> bool}: the account's proxy is
        quarantined.
    @ivar extraBlock: optional C{(account, now, upstreamModel) -> reason}
        returning L{None} when schedulable, or a reason (a string or a
        C{(reason, until)} tuple) for in-memory blocks the state store does
        not hold (e.g. the breaker, R-B1).
    @ivar quarantineEnd: optional C{(proxy id) -> Unix seconds or None}: when
        a proxy's quarantine ends (R83's retry hint).
    @ivar flagged: optional C{(now, pool) -> iterable of account ids, or
        None}: a superset of the accounts C{extraBlock} and
        C{isQuarantined} may refuse at C{now} (see L{suspectsAt}).
    @ivar _log: the scheduler's logger.
    """

    isQuarantined: Callable[[Account], bool]
    extraBlock: Optional[Callable]
    quarantineEnd: Optional[Callable[[str], Optional[float]]]
    flagged: Optional[Callable]
    _log: Logger

    def suspects(self, ctx: Pass, pool: PoolIndex) -> Optional[set]:
        """
        The accounts whose eligibility must be checked in this
        selection (every other static candidate is eligible), or L{None}
        when the sources cannot tell (then every candidate is checked).
        """
        return self.suspectsAt(ctx.states, ctx.now, pool)

    def suspectsAt(self, states, now: float, pool: PoolIndex) -> Optional[set]:
        """
        L{suspects} of the account states C{states} at C{now}.
        """
        flagged = getattr(states, "flagged", None)
        if flagged is None:
            return None
        first = flagged(now)
        if self.extraBlock is not None or self.isQuarantined is not never:
            if self.flagged is None:
                return None
            more = self.flagged(now, pool)
            if more is None:
                return None
            if not first and type(more) is set:
                return more  # (the hook's own new set: no copy)
            out = set(first)
            out.update(more)
            return out
        return set(first)


    def nothingQualifies(self, ctx: Pass, openAccounts: list) -> NoAccountAvailable:
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
            return refusal(
                turn, 400, "invalid_request_error", ctx.barMessage, param=ctx.barParam,
            )
        if ctx.onlyOAuth and not any(a.type == "oauth" for a in openAccounts):
            return refusal(turn, 400, "invalid_request_error", ctx.barMessage)
        allowed = [a for a in openAccounts if not (ctx.oauthBarred and a.type == "oauth")
                   and not (ctx.onlyOAuth and a.type != "oauth")]
        blocked = []
        for account in allowed:
            why = self.blockWhy(ctx, account)
            if why is None and self.quarantined(ctx, account):
                why = ("proxy_quarantined", self.quarantineUntil(account))
            if why is None:
                blocked = None
                break
            blocked.append((account.id, why[0], why[1]))
        logFor(self._log, ctx).info(
            "no account available for model {model}: {accounts}",
            event="openai.account_select_no_available", request_id=turn.requestId,
            entrypoint=turn.entrypoint, model=turn.model, excluded_count=len(ctx.excluded),
            accounts="; ".join(
                f"{a.id}: {self.describe(ctx, a)}" for a in openAccounts
            ) or "none",
        )
        if blocked:
            # R83: every account is blocked: say why and when it ends.
            return NoAccountAvailable(
                noAccountError(turn.model, blocked, ctx.now, turn.entrypoint == "ws")
            )
        return refusal(
            turn, 503, "api_error", NO_ACCOUNT_MESSAGE,
            wsClose=(1013, "no available account"),
        )

    def describe(self, ctx: Pass, account: Account) -> str:
        """
        One account's state for the R83 log line: its block reason and end
        (ISO-8601 UTC, as the log renders times in every message), or why
        else it was not chosen.
        """
        why = self.blockWhy(ctx, account)
        if why is not None:
            until = why[1]
            return f"{why[0]} until {isoTime(until)}" if until else why[0]
        if self.quarantined(ctx, account):
            return "proxy_quarantined"
        return self.incompatible(ctx, account) or "busy or over load"

    def blockReason(self, ctx: Pass, account: Account) -> Optional[str]:
        """
        Why the account is runtime-blocked for this turn's model (see
        L{blockWhy}).

        @return: a reason string, or L{None} when schedulable.
        """
        why = self.blockWhy(ctx, account)
        return None if why is None else why[0]

    def blockWhy(self, ctx: Pass, account: Account) -> Optional[tuple]:
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
        extra = self.extraBlock(account, ctx.now, upstream) if self.extraBlock else None
        if extra and not isinstance(extra, tuple):
            extra = (str(extra), None)
        if stored is None:
            return (str(extra[0]), extra[1]) if extra else None
        if extra and stored[1] and (extra[1] or 0) > stored[1]:
            return (str(extra[0]), extra[1])
        return (str(stored[0]), stored[1])

    def quarantineUntil(self, account: Account) -> Optional[float]:
        """
        When the account's proxy quarantine ends, if the hook knows.
        """
        if self.quarantineEnd is None or account.proxy is None:
            return None
        return self.quarantineEnd(account.proxy.id)

    def quarantined(self, ctx: Pass, account: Account) -> bool:
        """
        Whether the account's proxy quarantine applies (not when every
        candidate is quarantined: fail open, R41).
        """
        return not ctx.quarantineFailOpen and bool(self.isQuarantined(account))

    def incompatible(self, ctx: Pass, account: Account) -> Optional[str]:
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
        blocked = self.blockReason(ctx, account)
        if blocked:
            return "unschedulable: " + blocked
        if self.quarantined(ctx, account):
            return "proxy_quarantined"
        return None


    def eligibleFromIndex(self, ctx: Pass, pool: PoolIndex, suspects: set) -> None:
        """
        The eligible count (and, lazily, list) from the static
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
                if self.incompatible(ctx, byId[accountId]) is not None:
                    bad.add(accountId)
        gone = sum(1 for i in excluded if i in static.ids) if excluded else 0
        ctx._lazy = (static.accounts, excluded, bad)
        ctx._eligible = None
        ctx.candidateCount = len(static.accounts) - gone - len(bad)

