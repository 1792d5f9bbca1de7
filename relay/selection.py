# -*- test-case-name: tests.test_scheduler -*-
"""
What account selection returns (behaviour.md R43-R45).
"""

from __future__ import annotations

from typing import Optional

from attrs import frozen

from relay.model import Account, ClientError, RelayError, WaitPlan


@frozen
class DecisionRecord:
    """
    The truthful record of one selection (behaviour.md R45), logged as
    C{openai.account_schedule_decision}.

    @ivar layer: C{previous_response_id}, C{session_hash} or C{load_balance}.
    @ivar sticky_previous_hit: the previous_response_id layer decided.
    @ivar sticky_session_hit: the session-hash layer decided.
    @ivar selected_account_id: the chosen account id.
    @ivar selected_account_type: C{apikey} or C{oauth}.
    @ivar candidate_count: accounts considered.
    @ivar excluded_count: accounts excluded in this turn.
    @ivar wait_plan: C{sticky}, C{fallback} or L{None}.
    @ivar latency_ms: time the decision took, milliseconds.
    @ivar load_skew: standard deviation of load rate across candidates.
    @ivar top_k: how many candidates were tried.
    @ivar sticky_busy_bypass: the session's bound account was busy and this
        movable turn went to an idle account instead, leaving the binding
        unchanged (R-B6); C{layer} is then C{load_balance} and
        C{sticky_session_hit} is L{False}.
    @ivar preferred_account_hit: the turn's C{preferredAccountId} (a
        WebSocket connection's account) was chosen.
    @ivar quota_decided: the load-balance layer chose this account over
        one that the plain order (load rate, last used) would have tried
        first, because its usage window has more room (issue 12).
    @ivar quota_used_percent: the chosen account's fuller usage window, in
        percent, when relay knows it.
    """

    layer: str
    sticky_previous_hit: bool
    sticky_session_hit: bool
    selected_account_id: str
    selected_account_type: str
    candidate_count: int
    excluded_count: int
    wait_plan: Optional[str] = None
    latency_ms: float = 0.0
    load_skew: float = 0.0
    top_k: int = 0
    sticky_busy_bypass: bool = False
    preferred_account_hit: bool = False
    quota_decided: bool = False
    quota_used_percent: Optional[float] = None


@frozen
class Selection:
    """
    The outcome of L{relay.interfaces.IAccountScheduler.select}.

    Exactly one of C{lease} and C{waitPlan} is set.

    @ivar account: the chosen L{Account}.
    @ivar lease: the held L{relay.interfaces.ISlotLease}, or L{None}.
    @ivar waitPlan: the L{WaitPlan} to wait on, or L{None}.
    @ivar record: the L{DecisionRecord}.
    """

    account: Account
    lease: object
    waitPlan: Optional[WaitPlan]
    record: DecisionRecord


class NoAccountAvailable(RelayError):
    """
    Nothing qualifies for this turn (behaviour.md R44).

    @ivar error: the L{ClientError} to give the client.
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error
