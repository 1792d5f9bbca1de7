# -*- test-case-name: tests.test_classify -*-
"""
What a failure classifier says about one failed upstream attempt, and the
account runtime state that selection reads.

The classifier (L{relay.interfaces.IFailureClassifier}) is pure: it turns a
failure into a L{Verdict}. The turn engine acts on the verdict (switch, retry
the same account, pass the error through) and applies its L{Marking}s to the
state store. Rules: behaviour.md groups A-C.
"""

from __future__ import annotations

from typing import Optional

from attrs import frozen

from relay.base.records import ClientError

# Verdict kinds
TRANSPORT = "transport"
STATUS = "status"
STREAM = "stream"
FIRST_OUTPUT_TIMEOUT = "first_output_timeout"
STAGING_OVERFLOW = "staging_overflow"

# Marking kinds (what the engine writes to the state store)
MARK_TEMP_UNSCHEDULABLE = "temp_unschedulable"
MARK_RATE_LIMITED = "rate_limited"
MARK_OVERLOADED = "overloaded"
MARK_DISABLED = "disabled"
MARK_MODEL_BLOCK = "model_block"
MARK_COUNT_403 = "count_403"
MARK_TRANSIENT_STREAK = "transient_streak"


@frozen
class Marking:
    """
    One change to an account's runtime state (behaviour.md R4, R11, R12).

    @ivar kind: one of the C{MARK_*} constants.
    @ivar seconds: a duration from now, in seconds, or L{None}.
    @ivar until: an absolute time (Unix seconds), or L{None}; wins over
        C{seconds} when both are set.
    @ivar reason: human text stored with the state (sanitised, no secrets).
    @ivar model: the upstream model for model-scoped marks, else L{None}.
    """

    kind: str
    seconds: Optional[float] = None
    until: Optional[float] = None
    reason: str = ""
    model: Optional[str] = None


@frozen
class Verdict:
    """
    The classification of one failed attempt.

    @ivar kind: C{transport}, C{status}, C{stream}, C{first_output_timeout}
        or C{staging_overflow}.
    @ivar failover: L{True} when the engine may retry or switch; L{False}
        when the error goes to the client as it is (C{clientError}).
    @ivar status: the upstream status, or the synthetic one (502 for
        transport, 504 for first-output timeout; R5, R20).
    @ivar persistent: for transport failures, R3's persistent class.
    @ivar sameAccount: retryable on the same account (R13, R14, R72).
    @ivar retryDelay: the error's own same-account delay in seconds (R13).
    @ivar backoff: request-scoped exponential backoff 0.5 -> 8 s (R14).
    @ivar safeAfterWrite: counts toward the first-output cap (R21).
    @ivar stop: end the turn as exhausted now (R19 step 4).
    @ivar reason: a short machine reason for logs and metrics, e.g.
        C{transport_persistent}, C{status_503}, C{cyber_policy}.
    @ivar markings: account state changes to apply (R4, R11).
    @ivar clientError: what the client sees: for C{failover=False}, the
        pass-through error (R9, R10); for failovers, the mapping used when
        failover is exhausted (R15).
    @ivar retryAfter: a safe C{Retry-After} value to copy (R16), or L{None}.
    @ivar message: the sanitised upstream or transport message, for logs.
    @ivar oauth429: an OAuth 429 that may retry within its window (R13).
    @ivar rateLimitUntil: for a 429, the reset chosen by R12 (Unix
        seconds), or L{None}. An OAuth 429 carries no marking; the engine
        marks the account rate-limited until this time once the R13 window
        has ended.
    @ivar rejectedField: for an upstream 400 that names an unknown or
        unsupported request field (R7's rejected field, R106, R112), the
        field as upstream named it (a top-level name, or a path such as
        C{text.verbosity} or C{input[0].foo}); the engine drops it and
        retries once on the same account. L{None} otherwise.
    """

    kind: str
    failover: bool
    status: int
    persistent: bool = False
    sameAccount: bool = False
    retryDelay: Optional[float] = None
    backoff: bool = False
    safeAfterWrite: bool = False
    stop: bool = False
    reason: str = ""
    markings: tuple = ()
    clientError: Optional[ClientError] = None
    retryAfter: Optional[str] = None
    message: str = ""
    oauth429: bool = False
    rateLimitUntil: Optional[float] = None
    rejectedField: Optional[str] = None
