# -*- test-case-name: tests.test_runner -*-
"""
What the turn engine does with a failed attempt (behaviour.md R19): pass
the error through, retry the same account, switch, or give up; the
one-shot fixes tried on the same account before any decision (R7's body
rewrite, R11's refresh after a 401); the global retry budget; and the
per-turn failover state they read and write (L{TurnState}, R18).

Functions of the L{relay.engine.runner.TurnRunner} they decide for: they
read its C{settings}, C{classifier}, C{credentials}, C{scheduler},
C{metrics}, C{history} and C{budget}, and write nothing to account state
(that is L{relay.policy.bookkeeping.AccountBookkeeping}'s, R86).
"""

from __future__ import annotations

from typing import Optional

from attrs import define, evolve, field

from relay.base import clienterrors as E
from relay.engine.cancel import raceCancel
from relay.engine.keepalive import StreamKeepalive
from relay.engine.payload import withoutEncryptedReasoning, withoutField
from relay.base.records import ClientError, Turn
from relay.policy import failures as F
from relay.policy.classify import sanitise

MAX_FIRST_OUTPUT_SWITCHES = 1
"""behaviour.md R21: the first safe-after-write failure switches, the second ends."""

OAUTH_429_SWITCH_STOP = 3
"""behaviour.md R13 stop rule."""

FIXED_RETRY_DELAY = 0.5
"""Same-account retry delay without a better one (R14), seconds."""


@define(eq=False)
class RetryBudget:
    """
    Envoy-style global retry budget: turns that retry or
    switch at the same time may not exceed C{percent} of active turns, with
    a floor of C{minimum}.

    @ivar active: turns running now.
    @ivar retrying: turns holding a retry token now.
    """

    active: int = 0
    retrying: int = 0
    minimum: int = 3

    def allowed(self, percent: float) -> int:
        """
        @param percent: C{retry_budget_percent}; <= 0 disables the budget.
        @return: how many turns may retry at once.
        """
        if percent <= 0:
            return 2**31
        return max(self.minimum, int(self.active * percent / 100.0))

    def take(self, percent: float) -> bool:
        """
        Take a retry token if the budget allows.
        """
        if self.retrying >= self.allowed(percent):
            return False
        self.retrying += 1
        return True

    def give(self) -> None:
        """
        Return a token.
        """
        self.retrying = max(0, self.retrying - 1)


@define(eq=False)
class TurnState:
    """
    Per-turn failover state (behaviour.md R18): switch count, first-output
    switch count, exclusion set, same-account retries, the last verdict and
    the OAuth-429 state.
    """

    switches: int = 0
    firstOutputSwitches: int = 0
    excluded: set = field(factory=set)
    sameAccountRetries: dict = field(factory=dict)
    lastVerdict: Optional[F.Verdict] = None
    oauth429: bool = False
    attempts: int = 0
    pendingFailover: Optional[dict] = None
    rewrites: set = field(factory=set)
    retryToken: bool = False
    lastAccountId: Optional[str] = None
    startedAt: float = 0.0
    waited: float = 0.0
    """Seconds spent in slot waits and retry sleeps (not relay's own latency)."""
    dispatched: bool = False
    keepalive: StreamKeepalive | None = None
    """The turn's downstream keepalive (R85), for streaming turns."""
    bearers: dict = field(factory=dict)
    """Account id -> the bearer its last attempt was dialled with."""
    refreshed: set = field(factory=set)
    """Accounts that got their one 401 refresh-and-replay in this turn."""
    tried: list = field(factory=list)
    """Every attempt (L{Attempt}) and why it was left, for the
    turn's record."""
    sink: object = None
    """The turn's sink (its C{failed} error goes into the record)."""
    trace: object = None
    """The turn's L{relay.interfaces.ITurnTrace}, or L{None}."""


async def withRetryHint(runner, turn: Turn, error: ClientError, fallback=None) -> ClientError:
    """
    R83, R16: relay's 429 after every account it
    tried answered 429 carries C{Retry-After} -- the upstream's when it
    gave one, else the seconds until the earliest cooldown ends.

    @param fallback: the scheduler's own answer, whose hint is used
        first when it has one.
    """
    if error.status != 429 or any(n.lower() == "retry-after" for n, _ in error.headers):
        return error
    hint = None
    for name, value in (fallback.headers if fallback is not None else ()):
        if name.lower() == "retry-after":
            hint = value
    if hint is None:
        hinter = getattr(runner.scheduler, "retryHint", None)
        seconds = await hinter(turn) if hinter is not None else None
        hint = str(seconds) if seconds else None
    if hint is None:
        return error
    return evolve(error, headers=tuple(error.headers) + (("Retry-After", hint),))


def rewriteOnce(runner, turn: Turn, state: TurnState, account, verdict) -> bool:
    """
    behaviour.md R7: a one-shot same-account retry with a corrected body
    before any failover decision; it counts as neither a switch nor a
    same-account retry. Implemented: 400 C{invalid_encrypted_content}
    -> drop the encrypted reasoning items; a 400 naming an unknown or
    unsupported parameter (C{verdict.rejectedField}, R106, R112) ->
    drop that field, once per turn (a second refusal reaches the
    client).

    @return: L{True} when C{turn.body} was rewritten for a retry.
    """
    if verdict is not None and verdict.rejectedField is not None:
        return _dropRejectedField(runner, turn, state, account, verdict.rejectedField)
    if "encrypted_content" in state.rewrites or verdict is None:
        return False
    error = verdict.clientError
    if verdict.kind != F.STATUS or verdict.status != 400 or error is None:
        return False
    if error.code != "invalid_encrypted_content":
        return False
    body = withoutEncryptedReasoning(turn.body)
    if body is None:
        return False
    turn.body = body
    state.rewrites.add("encrypted_content")
    runner._log.info(
        "retrying {account_id} without encrypted reasoning items",
        event="openai.invalid_encrypted_content_retry",
        account_id=account.id,
        request_id=turn.requestId,
    )
    return True


def _dropRejectedField(runner, turn: Turn, state: TurnState, account, name: str) -> bool:
    """
    behaviour.md R7's rejected field (R106, R112): drop the field the
    upstream refused and retry once on the same account, on every
    entrypoint (the HTTP and WebSocket attempts build their upstream
    body from C{turn.body}).

    @param name: the field as upstream named it.
    @return: L{True} when the field was dropped for a retry.
    """
    if "rejected_field" in state.rewrites:
        return False
    body = withoutField(turn.body, name)
    if body is None:
        return False
    turn.body = body
    state.rewrites.add("rejected_field")
    runner._log.info(
        "retrying {account_id} without the field upstream refused",
        event="openai.rejected_field_retry",
        account_id=account.id,
        field=sanitise(name, 120),
        request_id=turn.requestId,
    )
    return True


async def refreshOnce(runner, turn: Turn, state: TurnState, account, verdict) -> bool:
    """
    behaviour.md R11, protocol.md 7.4: a 401 from an OAuth
    account that can refresh, before anything reached the client,
    triggers one refresh (single flight) and one replay on the same
    account before any failover decision. A second 401 in the turn
    invalidates the cached token and goes on to R11's marking.

    @return: L{True} when a new token is in place and the turn should
        be replayed on C{account}.
    """
    if runner.credentials is None or verdict is None or verdict.status != 401:
        return False
    if verdict.kind not in (F.STATUS, F.STREAM) or account.type != "oauth":
        return False
    if account.id in state.refreshed:
        runner.credentials.invalidate(account)
        return False
    if not runner.credentials.canRefresh(account):
        return False
    state.refreshed.add(account.id)
    ok = await raceCancel(
        runner.credentials.refresh(account, stale=state.bearers.get(account.id)), turn.cancel
    )
    runner._log.info(
        "401 on {account_id}: token refresh {outcome}; {action}",
        event="openai.oauth_401_refresh",
        account_id=account.id,
        outcome="succeeded" if ok else "failed",
        action="replaying on the same account" if ok else "deciding as usual",
        request_id=turn.requestId,
    )
    return bool(ok)


async def decide(
    runner, turn, sink, state: TurnState, account, verdict: F.Verdict, recorded
):
    """
    R19: what to do with one failure. Account state was already written
    by L{AccountBookkeeping.record} (C{recorded} says what it found);
    this only decides.

    @return: C{("pass", ClientError)}, C{("exhausted", ClientError)},
        C{("same", delay)} or C{("switch", delay)}.
    """
    s = runner.settings.current
    if not verdict.failover:
        return ("pass", verdict.clientError)
    state.lastVerdict = verdict
    interval = max(0, s.retry_interval_ms) / 1000.0

    # R72: a transient transport failure may retry the same account.
    if verdict.kind == F.TRANSPORT:
        if not verdict.persistent:
            if s.transport_retry_policy == "sticky" and _canRetrySame(runner, 
                state, account, verdict
            ):
                if not _takeRetryToken(runner, state, s):
                    return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))
                state.sameAccountRetries[account.id] = (
                    state.sameAccountRetries.get(account.id, 0) + 1
                )
                runner._log.info(
                    "sticky transport retry on account {account_id}",
                    event="openai.transport_sticky_retry",
                    account_id=account.id,
                    attempt=state.attempts,
                    cause=verdict.message,
                    request_id=turn.requestId,
                )
                return ("same", interval)
    elif verdict.oauth429:
        # R13: inside the window the same account is retried.
        delay = recorded.oauth429RetryIn
        if delay is not None:
            if not _takeRetryToken(runner, state, s):
                return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))
            _logSameRetry(runner, turn, account, state, delay, "oauth_429_window", None)
            return ("same", max(interval, delay))
        state.oauth429 = True

    if verdict.stop:
        return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))

    # R21: at most one switch for slow first output / staging overflow.
    if verdict.safeAfterWrite:
        state.firstOutputSwitches += 1
        if state.firstOutputSwitches > MAX_FIRST_OUTPUT_SWITCHES:
            return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))

    # R14: same-account retry. An OAuth 429 after its R13 window has
    # just marked the account rate-limited: it switches (retrying would
    # open a fresh window on a rate-limited account).
    if (
        verdict.sameAccount
        and not verdict.safeAfterWrite
        and not verdict.oauth429
        and _canRetrySame(runner, state, account, verdict)
    ):
        count = state.sameAccountRetries.get(account.id, 0) + 1
        state.sameAccountRetries[account.id] = count
        if verdict.retryDelay is not None:
            delay = verdict.retryDelay
        elif verdict.backoff:
            delay = min(8.0, 0.5 * 2 ** (count - 1))
        else:
            delay = FIXED_RETRY_DELAY
        if not _takeRetryToken(runner, state, s):
            return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))
        _logSameRetry(runner, turn, account, state, delay, verdict.reason, count)
        return ("same", max(interval, delay))

    # R19 step 7: switch.
    state.excluded.add(account.id)
    if not turn.historyComplete:
        # R62, R-B7, R76: relay does not hold the whole conversation, so
        # the turn cannot move; the client must resend full input.
        runner._log.info(
            "not moving turn {request_id} off {account_id}: incomplete history",
            event="ingress_ws_account_failover_replay_skip",
            reason="incomplete_history",
            account_id=account.id,
            request_id=turn.requestId,
        )
        return ("exhausted", E.previousResponseNotFound(turn.previousResponseId))
    if state.switches >= s.max_account_switches:
        return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))
    if state.oauth429 and state.switches >= OAUTH_429_SWITCH_STOP:
        return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))
    if not _takeRetryToken(runner, state, s):
        runner._log.warn(
            "retry budget exhausted; not switching from {account_id}",
            event="relay.retry_budget_exhausted",
            account_id=account.id,
            request_id=turn.requestId,
        )
        return ("exhausted", runner.classifier.exhausted(verdict, turn.endpoint))
    state.switches += 1
    if verdict.kind == F.TRANSPORT:
        # R72 rotate (and any persistent failure): release the binding.
        await runner.scheduler.unbind(turn)
    name = (
        "openai.websocket_upstream_failover_switching"
        if turn.entrypoint == "ws"
        else "openai.upstream_failover_switching"
    )
    runner._log.warn(
        "switching from account {account_id} after {reason} (status {upstream_status}),"
        " switch {switch_count}/{max_switches}",
        event=name,
        account_id=account.id,
        upstream_status=verdict.status,
        reason=verdict.reason,
        switch_count=state.switches,
        max_switches=s.max_account_switches,
        proxy_id=_proxyId(account),
        proxy_name=_proxyId(account),
        proxy_host=account.proxy.host if account.proxy is not None else None,
        proxy_port=account.proxy.port if account.proxy is not None else None,
        request_id=turn.requestId,
        upstream_request_id=turn.upstreamRequestId,
        entrypoint=turn.entrypoint,
    )
    if runner.metrics is not None:
        state.pendingFailover = runner.metrics.failover(
            verdict.reason, account.id, None, turn.entrypoint, verdict.status
        )
    if runner.history is not None:
        runner.history.failover(account.id)
    # R71: no extra interval after a first-output timeout.
    return ("switch", 0 if verdict.kind == F.FIRST_OUTPUT_TIMEOUT else interval)


def _canRetrySame(runner, state: TurnState, account, verdict) -> bool:
    """
    R14's count limit: C{pool_mode_retry_count} (default 3) per account
    in this turn; an OAuth-429 window retry is not counted here.
    """
    limit = max(0, min(10, account.pool_mode_retry_count))
    return state.sameAccountRetries.get(account.id, 0) < limit


def _takeRetryToken(runner, state: TurnState, s) -> bool:
    """
    The global retry budget: one token per retrying turn.
    """
    if state.retryToken:
        return True
    if runner.budget.take(s.retry_budget_percent):
        state.retryToken = True
        return True
    return False


def _logSameRetry(runner, turn, account, state, delay, reason, count) -> None:
    runner._log.info(
        "retrying account {account_id} after {retry_delay}s ({reason})",
        event="openai.pool_mode_same_account_retry",
        account_id=account.id,
        retry_limit=account.pool_mode_retry_count,
        retry_count=count,
        retry_delay=delay,
        reason=reason,
        request_id=turn.requestId,
    )
    if runner.metrics is not None:
        runner.metrics.sameAccountRetry(reason)


def _proxyId(account) -> Optional[str]:
    return account.proxy.id if account.proxy is not None else None
