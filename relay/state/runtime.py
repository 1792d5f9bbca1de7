"""
The runtime state of one account as the state stores keep it (cooldowns,
rate limits, blocks, the disabled mark, model blocks and R11 streaks):
written by L{relay.policy.bookkeeping}, read by the scheduler.
"""

from __future__ import annotations

from typing import Optional

from attrs import field, frozen

__all__ = ["AccountRuntime"]


@frozen
class AccountRuntime:
    """
    The runtime state of one account, as the state store keeps it.

    Times are Unix seconds from the injected clock; 0 means not set.

    @ivar blockedUntil: temp-unschedulable until (R4, R11, R-B1).
    @ivar blockReason: why it is blocked.
    @ivar rateLimitedUntil: rate-limited until (R12).
    @ivar overloadedUntil: overloaded until (529, R11).
    @ivar disabled: a permanent error state until an admin clears it.
    @ivar disabledReason: why it is disabled.
    @ivar modelBlocks: upstream model -> blocked-until (R11 streak, model
        not found).
    @ivar modelReasons: upstream model -> why it is blocked.
    @ivar streaks: upstream model (C{*} when unknown) -> C{(count, last
        failure time)}: the R11 transient streak. It lapses
        L{relay.policy.health.STREAK_TTL_SECONDS} after the last failure.
    """

    blockedUntil: float = 0
    blockReason: str = ""
    rateLimitedUntil: float = 0
    overloadedUntil: float = 0
    disabled: bool = False
    disabledReason: str = ""
    modelBlocks: dict = field(factory=dict, hash=False)
    modelReasons: dict = field(factory=dict, hash=False)
    streaks: dict = field(factory=dict, hash=False)

    def unschedulable(self, now: float, model: Optional[str] = None) -> Optional[tuple]:
        """
        Why the account cannot be scheduled now, if it cannot.

        @param now: the current time, Unix seconds.
        @param model: the upstream model of the request, or L{None}.
        @return: L{None} when schedulable, else C{(reason, until)} where
            C{until} is 0 for a permanent state.
        """
        if self.disabled:
            return ("disabled: " + self.disabledReason, 0)
        if self.blockedUntil > now:
            return (self.blockReason or "temp_unschedulable", self.blockedUntil)
        if self.rateLimitedUntil > now:
            return ("rate_limited", self.rateLimitedUntil)
        if self.overloadedUntil > now:
            return ("overloaded", self.overloadedUntil)
        if model is not None:
            until = self.modelBlocks.get(model, 0)
            if until > now:
                return ("model_blocked", until)
        return None
