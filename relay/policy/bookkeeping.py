# -*- test-case-name: tests.test_policy -*-
"""
The one place where an attempt's end becomes account state (behaviour.md
R86; DEVELOPERS.md "One turn engine": bookkeeping is decided in one place
from what the end means).

L{AccountBookkeeping.record} takes the fact (L{relay.policy.ends}) and its
verdict (L{relay.policy.judgement.judge}) and writes, through
L{relay.policy.health.AccountHealth} and L{relay.policy.proxyhealth.ProxyHealth}:

  - L{ends.Completed}: success (resets the R-B1 breaker, the R11 streak and
    the R13 window); upstream's own failure forwarded to the client
    (L{ends.Forwarded}) writes nothing;
  - the verdict's markings (R4 cooldown, R11 rows and streak, R12 rate
    limit), for every failure however it arrived (R86.1, R86.2), and the
    R13 OAuth-429 window for an OAuth 429;
  - R-B1: a transient transport failure (no status) and a stream cut by a
    read error count toward the breaker, before or after output, for
    streaming and JSON clients alike (R86.3); a stream cut through a proxy
    also counts toward that proxy's quarantine;
  - nothing for a clean end without a terminal event (R86.4), relay's own
    timeouts, staging overflow, a busy pool (R-B3);
  - nothing at all for L{ends.Departed}: the client left or relay cancelled
    the attempt for it (R2). There is no code path from a departure to a
    write: L{record} returns before looking at the account.

It also keeps the per-account counters the operator view shows (turns,
failovers, the last error and when; a client's own fault,
L{relay.policy.outcomes.isClientFault}, is never the account's last error),
the recent attempt ends its health is judged from
(L{relay.policy.outcomes.AttemptOutcomes}), and logs C{openai.ops_event}.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field, frozen
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relay.base.eager import eagerDeferred
from relay.interfaces import IAccountBookkeeping
from relay.policy import ends as E
from relay.policy import failures as F
from relay.policy.outcomes import AttemptOutcomes, isClientFault


@frozen
class Recorded:
    """
    What recording an end told the engine.

    @ivar oauth429RetryIn: for an OAuth 429 inside its R13 window, the
        same-account retry delay in seconds; else L{None}.
    @ivar oauth429Marked: an OAuth 429 after its window marked the account
        rate-limited (R13); the turn switches and the R13 stop rule applies.
    """

    oauth429RetryIn: Optional[float] = None
    oauth429Marked: bool = False


NOTHING = Recorded()


def proxyId(account) -> Optional[str]:
    """
    @return: the account's proxy id, or L{None} for a direct account.
    """
    return account.proxy.id if account.proxy is not None else None


def opsKind(verdict: F.Verdict) -> str:
    """
    The C{kind} of an C{openai.ops_event} (R5, R8, R20).
    """
    if verdict.kind == F.TRANSPORT:
        return "request_error"
    if verdict.kind == F.FIRST_OUTPUT_TIMEOUT:
        return "first_output_timeout"
    return "failover" if verdict.failover else "upstream_error"


@implementer(IAccountBookkeeping)
@define(eq=False)
class AccountBookkeeping:
    """
    Applies attempt ends to account state. See the module docstring.

    @ivar health: the L{relay.policy.health.AccountHealth}.
    @ivar clock: the L{IReactorTime}, for C{last_error_at}.
    @ivar proxyHealth: the L{relay.policy.proxyhealth.ProxyHealth}, or L{None}.
    @ivar metrics: the L{relay.console.metrics.RelayMetrics}, or L{None}.
    @ivar stats: account id -> C{{"turns", "failovers", "last_error",
        "last_error_at", "last_success_at"}} for the operator view; times are
        Unix seconds or L{None}.
    """

    health: object
    clock: object
    proxyHealth: object = None
    metrics: object = None
    stats: dict = field(factory=dict)
    outcomes: Optional[AttemptOutcomes] = None
    """The recent attempt ends per account (L{relay.policy.outcomes}), for
    the health the operator is shown; built on the clock when not given."""

    def __attrs_post_init__(self) -> None:
        if self.outcomes is None:
            self.outcomes = AttemptOutcomes(clock=self.clock)

    _log = Logger()

    def accountStats(self, accountId: str) -> dict:
        """
        The operator counters of one account, created on first use.

        @param accountId: an account id.
        @return: the live dict (see L{stats}).
        """
        stats = self.stats.get(accountId)
        if stats is None:
            stats = self.stats[accountId] = {
                "turns": 0,
                "failovers": 0,
                "last_error": None,
                "last_error_at": None,
                "last_success_at": None,
            }
        return stats

    def clear(self, account) -> Deferred:
        """
        An operator lifts every block of an account (C{POST
        /admin/accounts/{id}/clear}): its stored states, streaks and 403
        counter, its in-memory blocks, breaker and OAuth-429 window, and the
        quarantine of the proxy it dials through.

        @param account: the L{relay.base.records.Account}.
        @return: a L{Deferred} firing once the store is cleared.
        """
        if self.proxyHealth is not None and account.proxy is not None:
            self.proxyHealth.lift(account.proxy.id)
        self.outcomes.forget(account.id)
        return self.health.clear(account.id)

    def record(
        self,
        account,
        end,
        verdict: Optional[F.Verdict],
        model: Optional[str] = None,
        requestId: str = "",
        upstreamRequestId: Optional[str] = None,
    ) -> Deferred:
        """
        Write what C{end} means to C{account}'s state.

        @param account: the L{relay.base.records.Account} attempted.
        @param end: the attempt end (L{relay.policy.ends}).
        @param verdict: its verdict from L{relay.policy.judgement.judge}, or
            L{None} (successes, departures, forwarded in-band failures).
        @param model: the upstream model of the attempt (R11 streak and
            model blocks), or L{None}.
        @param requestId: the turn's id, for logs.
        @param upstreamRequestId: the upstream's C{x-request-id} of the
            attempt, for logs, or L{None}.
        @return: a L{Deferred} firing with a L{Recorded}; it fails only on
            a bug (store errors are handled by the health object).
        """
        if isinstance(end, E.Departed):
            return Deferred.fromCoroutine(_nothing())
        if isinstance(end, E.Completed):
            # A success (every relayed turn's end) needs no
            # coroutine: the health answers at once (a fired Deferred).
            self.accountStats(account.id)["last_success_at"] = self.clock.seconds()
            self.outcomes.succeeded(account.id)
            done = self.health.success(account, model)
            if done.called and not isinstance(done.result, (Failure, Deferred)):
                return succeed(NOTHING)
            return done.addCallback(lambda _: NOTHING)
        return eagerDeferred(  # no driver for a record that never waits
            self._record(account, end, verdict, model, requestId, upstreamRequestId)
        )

    async def _record(self, account, end, verdict, model, requestId, upstreamId) -> Recorded:
        if isinstance(end, (E.Refused, E.Forwarded)):
            return NOTHING
        if isinstance(end, E.Completed):
            self.accountStats(account.id)["last_success_at"] = self.clock.seconds()
            self.outcomes.succeeded(account.id)
            await self.health.success(account, model)
            return NOTHING
        if verdict is not None:
            self._noteFailure(account, end, verdict, requestId, upstreamId)
        if self._isTransportFailure(end, verdict):
            await self.health.transientTransportFailure(account, proxyId(account))
        if isinstance(end, E.StreamCut):
            self._proxyCut(account)
        if verdict is None:
            return NOTHING
        if verdict.oauth429 and not E.afterOutput(end):
            action, delay = await self.health.oauth429Decision(account, verdict)
            if action == "retry_same":
                return Recorded(oauth429RetryIn=delay)
            return Recorded(oauth429Marked=True)
        if verdict.markings:
            await self.health.applyVerdict(account, verdict, model)
            if self.metrics is not None:
                for marking in verdict.markings:
                    self.metrics.cooldown(marking.kind)
        return NOTHING

    @staticmethod
    def _isTransportFailure(end, verdict) -> bool:
        """
        R-B1 / R86.3: what counts toward the breaker. A persistent
        transport failure has its own R4 cooldown instead.
        """
        if isinstance(end, E.StreamCut):
            return True
        if isinstance(end, E.TransportFailure):
            return verdict is None or not verdict.persistent
        return False

    def _proxyCut(self, account) -> None:
        """
        A stream through a proxy was cut mid-stream.
        """
        if self.proxyHealth is None or account.proxy is None:
            return
        try:
            self.proxyHealth.streamCut(account, "read_error")
        except Exception:
            self._log.failure("recording a proxy stream cut failed")

    def _noteFailure(
        self, account, end, verdict: F.Verdict, requestId: str, upstreamId: Optional[str]
    ) -> None:
        """
        The operator counters and the R5 ops event of one failed attempt.
        """
        stats = self.accountStats(account.id)
        if isClientFault(verdict):
            # The client's own request was refused: not the account's error.
            self.outcomes.clientFault(account.id)
        else:
            stats["last_error"] = f"{verdict.reason} {verdict.status}: {verdict.message}"[:200]
            stats["last_error_at"] = self.clock.seconds()
            self.outcomes.failed(account.id, verdict.reason, None if verdict.kind == F.TRANSPORT
                                 else verdict.status, verdict.message)
        if verdict.failover and not E.afterOutput(end):
            stats["failovers"] += 1
        self._log.info(
            "attempt on {account_id} failed: {reason} {upstream_status}",
            event="openai.ops_event",
            kind=opsKind(verdict),
            account_id=account.id,
            upstream_status=0 if verdict.kind == F.TRANSPORT else verdict.status,
            reason=verdict.reason,
            message=verdict.message,
            after_output=E.afterOutput(end),
            end=type(end).__name__,
            proxy_id=proxyId(account),
            request_id=requestId,
            upstream_request_id=upstreamId,
        )


async def _nothing() -> Recorded:
    """
    R2: a departed client's attempt writes nothing.
    """
    return NOTHING
