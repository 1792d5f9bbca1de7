# -*- test-case-name: tests.test_outcomes -*-
"""
What each account's recent attempts ended in, and the health state the
operator is shown from it (behaviour.md R86: the attempt's end as the
policy judged it).

L{AttemptOutcomes} keeps, per account, one-minute buckets of the last
L{WINDOW_SECONDS} of attempt ends as L{relay.policy.bookkeeping} recorded
them: successes, failures of the account by reason, and the client's own
faults (L{isClientFault}), which are counted apart and are never an
account's failure or its last error. L{healthState} turns those counts
and the account's blocks into one state that is never plain C{ok} when
the account failed recently.

Memory is bounded: at most C{WINDOW_SECONDS / 60 + 1} buckets per account,
each a few counters. Nothing is persisted or shared between processes.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from attrs import define, field

from relay.policy import failures as F

__all__ = [
    "AttemptOutcomes", "FAILING_MIN_ATTEMPTS", "WINDOW_SECONDS", "healthState", "isClientFault",
]

WINDOW_SECONDS = 900
"""The window the health counts cover: the last 15 minutes."""

BUCKET_SECONDS = 60
"""One bucket's width."""

FAILING_MIN_ATTEMPTS = 3
"""At least this many attempts, half of them failed (or the last this many
all failed), make an account C{failing}."""

MODEL_REFUSAL = "model_not_found"
"""The verdict reason of R8 row 5 / R106's model refusal."""

_ACCOUNT_STATUSES = (401, 402, 429)
"""4xx statuses that are about the account, never the client's request."""


def isClientFault(verdict: Optional[F.Verdict]) -> bool:
    """
    Whether a failed attempt was the client's own fault, not the account's:
    an upstream 4xx about the client's request that marks nothing (R7's
    rejected field, R106's client text, R9/R10's pass-through of a request
    error), or a model refusal for the project (R106, R8 row 5: it blocks
    that model on the account, never the account).

    @param verdict: the attempt's L{relay.policy.failures.Verdict}.
    @return: L{True} for a client fault; such an attempt is never an
        account's failure nor its C{last_error}.
    """
    if verdict is None or verdict.kind != F.STATUS:
        return False
    if verdict.rejectedField is not None or verdict.reason == MODEL_REFUSAL:
        # R7's rejected field; R106's model refusal (for the project): its
        # model block stays in the account's blocks, never its error.
        return True
    return (not verdict.failover and not verdict.markings
            and 400 <= verdict.status < 500 and verdict.status not in _ACCOUNT_STATUSES)


@define
class _Bucket:
    minute: int
    succeeded: int = 0
    failed: int = 0
    clientFaults: int = 0
    reasons: dict = field(factory=dict)


@define(eq=False)
class AttemptOutcomes:
    """
    Per account, the attempt ends of the last L{WINDOW_SECONDS} (see the
    module docstring).

    @ivar clock: the L{IReactorTime}.
    @ivar buckets: account id -> deque of L{_Bucket}, oldest first.
    @ivar lastFailure: account id -> C{{"reason", "status", "message", "at"}}.
    @ivar lastSuccess: account id -> Unix seconds.
    @ivar recent: account id -> deque of the last L{FAILING_MIN_ATTEMPTS}
        ends (L{True} for a success), within the window.
    """

    clock: object
    buckets: dict = field(factory=dict)
    lastFailure: dict = field(factory=dict)
    lastSuccess: dict = field(factory=dict)
    recent: dict = field(factory=dict)

    def _bucket(self, accountId: str, now: float) -> _Bucket:
        minute = int(now // BUCKET_SECONDS)
        buckets = self.buckets.get(accountId)
        if buckets is None:
            buckets = self.buckets[accountId] = deque()
        if not buckets or buckets[-1].minute != minute:
            buckets.append(_Bucket(minute))
        oldest = minute - WINDOW_SECONDS // BUCKET_SECONDS
        while buckets and buckets[0].minute <= oldest:
            buckets.popleft()
        return buckets[-1]

    def _ended(self, accountId: str, ok: bool, now: float) -> None:
        recent = self.recent.get(accountId)
        if recent is None:
            recent = self.recent[accountId] = deque(maxlen=FAILING_MIN_ATTEMPTS)
        recent.append((now, ok))

    def succeeded(self, accountId: str) -> None:
        """
        An attempt on C{accountId} completed.
        """
        now = self.clock.seconds()
        buckets = self.buckets.get(accountId)
        if buckets and buckets[-1].minute == int(now // BUCKET_SECONDS):
            # This minute's bucket: it was pruned when it was added, at this
            # minute, so nothing is older than the window (L{_bucket}).
            buckets[-1].succeeded += 1
        else:
            self._bucket(accountId, now).succeeded += 1
        self.lastSuccess[accountId] = now
        recent = self.recent.get(accountId)
        if recent is None:
            self._ended(accountId, True, now)
        else:
            recent.append((now, True))

    def failed(self, accountId: str, reason: str, status: Optional[int],
               message: str = "") -> None:
        """
        An attempt on C{accountId} failed through the account's fault (or
        the upstream's, or the path's): counted as its failure.

        @param reason: the verdict's machine reason (e.g. C{status_500}).
        @param status: the upstream status, or L{None} for a transport one.
        @param message: the sanitised message (never a secret).
        """
        now = self.clock.seconds()
        bucket = self._bucket(accountId, now)
        bucket.failed += 1
        reason = reason or "unknown"
        bucket.reasons[reason] = bucket.reasons.get(reason, 0) + 1
        self.lastFailure[accountId] = {"reason": reason, "status": status,
                                       "message": (message or "")[:200], "at": now}
        self._ended(accountId, False, now)

    def clientFault(self, accountId: str) -> None:
        """
        An attempt on C{accountId} ended in the client's own fault
        (L{isClientFault}): counted apart, not a failure of the account.
        """
        self._bucket(accountId, self.clock.seconds()).clientFaults += 1

    def forget(self, accountId: str) -> None:
        """
        An operator cleared the account: its recent failures are forgiven.
        """
        for table in (self.buckets, self.lastFailure, self.recent):
            table.pop(accountId, None)

    def counts(self, accountId: str) -> dict:
        """
        The account's last L{WINDOW_SECONDS}.

        @return: C{{"window_seconds", "attempts", "succeeded", "failed",
            "client_faults", "success_rate", "failure_rate", "failures"
            (reason -> count), "last_failure" (or L{None}),
            "last_success_at", "recent_all_failed"}}; rates are 0..1 or
            L{None} without attempts.
        """
        now = self.clock.seconds()
        oldest = int(now // BUCKET_SECONDS) - WINDOW_SECONDS // BUCKET_SECONDS
        succeeded = failed = clientFaults = 0
        reasons: dict = {}
        for bucket in self.buckets.get(accountId, ()):
            if bucket.minute <= oldest:
                continue
            succeeded += bucket.succeeded
            failed += bucket.failed
            clientFaults += bucket.clientFaults
            for reason, n in bucket.reasons.items():
                reasons[reason] = reasons.get(reason, 0) + n
        attempts = succeeded + failed
        last = self.lastFailure.get(accountId)
        if last is not None and now - last["at"] > WINDOW_SECONDS:
            last = None
        recent = [ok for at, ok in self.recent.get(accountId, ())
                  if now - at <= WINDOW_SECONDS]
        return {
            "window_seconds": WINDOW_SECONDS,
            "attempts": attempts, "succeeded": succeeded, "failed": failed,
            "client_faults": clientFaults,
            "success_rate": round(succeeded / attempts, 4) if attempts else None,
            "failure_rate": round(failed / attempts, 4) if attempts else None,
            "failures": reasons,
            "last_failure": dict(last) if last is not None else None,
            "last_success_at": self.lastSuccess.get(accountId),
            "recent_all_failed": len(recent) >= FAILING_MIN_ATTEMPTS and not any(recent),
        }

    def perMinute(self, minutes: int = WINDOW_SECONDS // BUCKET_SECONDS) -> list:
        """
        The pool's attempts per minute, oldest first.

        @return: C{minutes} dicts C{{"time" (minute start), "requests",
            "failed"}}, the current minute last.
        """
        current = int(self.clock.seconds() // BUCKET_SECONDS)
        rows = {m: [0, 0] for m in range(current - minutes + 1, current + 1)}
        for buckets in self.buckets.values():
            for bucket in buckets:
                row = rows.get(bucket.minute)
                if row is not None:
                    row[0] += bucket.succeeded + bucket.failed
                    row[1] += bucket.failed
        return [{"time": m * BUCKET_SECONDS, "requests": r, "failed": f}
                for m, (r, f) in sorted(rows.items())]


def healthState(counts: dict, block: Optional[dict] = None) -> dict:
    """
    The state an account is shown in (never plain C{ok} when it failed
    recently), from L{AttemptOutcomes.counts} and its first block.

    The first that applies: C{paused}; C{needs_login}; C{blocked} (a
    cooldown, a rate limit, an open breaker...); C{failing} (at least
    L{FAILING_MIN_ATTEMPTS} attempts and half or more failed, or the last
    L{FAILING_MIN_ATTEMPTS} all failed -- also once a cooldown lapsed);
    C{degraded} (any other failure in the window); C{idle} (no attempt in
    the window); C{ok} (attempts, none failed).

    @param counts: L{AttemptOutcomes.counts} of the account.
    @param block: its first block in force (C{{"kind", "reason", ...}},
        L{relay.console.view}) or L{None}.
    @return: C{counts} (without C{recent_all_failed}) with C{state} and
        C{why} (one line for a person).
    """
    out = {k: v for k, v in counts.items() if k != "recent_all_failed"}
    attempts, failed = counts["attempts"], counts["failed"]
    recentText = f"{failed} of {attempts} attempts failed in the last" \
                 f" {counts['window_seconds'] // 60} minutes"
    kind = (block or {}).get("kind")
    if block is not None:
        if kind == "paused":
            state = "paused"
        elif kind == "token" and "login" in str(block.get("reason") or ""):
            state = "needs_login"
        else:
            state = "blocked"
        why = str(block.get("reason") or kind or state)
        if failed:
            why += "; " + recentText
    elif attempts >= FAILING_MIN_ATTEMPTS and failed * 2 >= attempts or \
            counts.get("recent_all_failed"):
        state, why = "failing", recentText
    elif failed:
        state, why = "degraded", recentText
    elif not attempts:
        state, why = "idle", f"no attempt in the last {counts['window_seconds'] // 60} minutes"
    else:
        state, why = "ok", recentText
    out.update(state=state, why=why)
    return out
