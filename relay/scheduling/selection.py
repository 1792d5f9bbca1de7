# -*- test-case-name: tests.test_scheduler -*-
"""
What account selection returns (behaviour.md R43-R45).
"""

from __future__ import annotations

import math
from typing import Optional

from attrs import frozen
from attrs.exceptions import FrozenInstanceError

from relay.base.records import Account, ClientError, RelayError, WaitPlan


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
        first, because its usage window has more room.
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


class Selection:
    """
    The outcome of L{relay.interfaces.IAccountScheduler.select} (immutable).

    Exactly one of C{lease} and C{waitPlan} is set.

    @ivar account: the chosen L{Account}.
    @ivar lease: the held L{relay.interfaces.ISlotLease}, or L{None}.
    @ivar waitPlan: the L{WaitPlan} to wait on, or L{None}.
    @ivar record: the L{DecisionRecord}; given, or built
        (a turn that never reads it builds none) on first read from C{fields},
        the record's fields by name (the decision line's).
    """

    __slots__ = ("account", "lease", "waitPlan", "_record", "_fields")

    def __init__(self, account: Account, lease: object, waitPlan: Optional[WaitPlan],
                 record: Optional[DecisionRecord] = None, fields: Optional[dict] = None):
        if record is None and fields is None:
            raise TypeError("Selection needs a record or its fields")
        _set = object.__setattr__
        _set(self, "account", account)
        _set(self, "lease", lease)
        _set(self, "waitPlan", waitPlan)
        _set(self, "_record", record)
        _set(self, "_fields", fields)

    @property
    def record(self) -> DecisionRecord:
        record = self._record
        if record is None:
            record = DecisionRecord(**self._fields)
            object.__setattr__(self, "_record", record)
        return record

    def __setattr__(self, name: str, value) -> None:
        raise FrozenInstanceError()

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError()

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.account, self.lease, self.waitPlan, self.record) == (
            other.account, other.lease, other.waitPlan, other.record)

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None

    def __repr__(self) -> str:
        return (f"Selection(account={self.account!r}, lease={self.lease!r}, "
                f"waitPlan={self.waitPlan!r}, record={self.record!r})")


#: R83 reason classes, from the reasons selection skips an account for.
CLASS_RATE_LIMITED = "rate-limited"
CLASS_COOLING = "cooling down"
CLASS_DISABLED = "disabled"
CLASS_PAUSED = "paused"
CLASS_QUARANTINED = "behind a quarantined proxy"
CLASS_UNAVAILABLE = "unavailable"


def reasonClass(reason: str) -> str:
    """
    The R83 reason class of one account's block reason.

    @param reason: the reason selection gave (e.g. C{rate_limited},
        C{model_blocked}, C{transport_error}, C{disabled: ...},
        C{paused: <the operator's reason>}, C{proxy_quarantined}).
    """
    if reason == "rate_limited":
        return CLASS_RATE_LIMITED
    if reason.startswith("disabled"):
        return CLASS_DISABLED
    if reason.startswith("paused"):
        return CLASS_PAUSED
    if reason == "proxy_quarantined":
        return CLASS_QUARANTINED
    if reason.startswith("needs_login"):
        return "waiting for a new login"
    return CLASS_COOLING


def noAccountError(model: Optional[str], blocked: list, now: float, ws: bool) -> ClientError:
    """
    behaviour.md R44 + R83: the answer when no account can serve the model
    because every one is blocked: 429 when every one is rate-limited, else
    503; C{Retry-After} is whole seconds until the earliest becomes
    schedulable (omitted when no end time is known); the message names the
    reason class and that time; the WebSocket closes 1013 with the same
    text.

    @param model: the requested model, or L{None}.
    @param blocked: C{(account id, reason, until or None)} per account that
        serves the model; C{until} in Unix seconds, 0 or L{None} when
        permanent or unknown.
    @param now: Unix seconds.
    @param ws: the turn is a WebSocket turn (adds the 1013 close).
    """
    classes = [reasonClass(reason) for _, reason, _ in blocked]
    ends = [until for _, _, until in blocked if until]
    wait = None
    if ends:
        wait = max(1, int(math.ceil(min(ends) - now)))
    n = len(blocked)
    what = f"for {model}" if model else "for this request"
    distinct = sorted(set(classes), key=classes.index)
    if len(distinct) == 1:
        subject = (
            f"the only account {what} is {distinct[0]}"
            if n == 1
            else f"all {n} accounts {what} are {distinct[0]}"
        )
    else:
        counts = ", ".join(f"{classes.count(c)} {c}" for c in distinct)
        subject = f"none of the {n} accounts {what} is available ({counts})"
    message = subject + (f"; the earliest is available in {wait} s" if wait is not None else "")
    message = message[0].upper() + message[1:]
    rateLimited = bool(classes) and all(c == CLASS_RATE_LIMITED for c in classes)
    headers = (("Retry-After", str(wait)),) if wait is not None else ()
    return ClientError(
        status=429 if rateLimited else 503,
        type="rate_limit_error" if rateLimited else "api_error",
        message=message,
        code="no_available_account",
        headers=headers,
        wsClose=(1013, message) if ws else None,
    )


class NoAccountAvailable(RelayError):
    """
    Nothing qualifies for this turn (behaviour.md R44).

    @ivar error: the L{ClientError} to give the client.
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error
