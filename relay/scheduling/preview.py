# -*- test-case-name: tests.test_tenants_explain -*-
"""
The dry run of a selection (behaviour.md R43-R45 as C{/admin/explain}
shows them): the selection a turn would get now, from the same layers as a
real one, without taking a slot, writing the store, touching the last-used
order or logging a decision.

A pass with C{dryRun} set (L{relay.scheduling.eligibility.Pass}) reads a
slot's load instead of trying it (L{DRY_LEASE} when it is free), logs to
L{SILENT}, and breaks ties with a copy of the shuffler's state.
"""

from __future__ import annotations

from typing import Callable, Optional

from attrs import define
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from relay.base.records import Account, ClientError, Turn
from relay.scheduling.selection import NoAccountAvailable, Selection


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

SILENT = Logger(observer=lambda event: None)
"""What a dry run logs to: nothing."""


@define(eq=False)
class Preview:
    """
    A dry run of one selection (L{preview}).

    @ivar selection: the L{Selection} the turn would get (its C{lease} is
        L{DRY_LEASE} when a slot is free now, else C{waitPlan} is set), or
        L{None}.
    @ivar error: the L{ClientError} the turn would get instead, or L{None}.
    @ivar ctx: what the selection knew (account states, loads), a
        L{relay.scheduling.eligibility.Pass}, or L{None} when it ended
        before reading them.
    """

    selection: Optional[Selection] = None
    error: Optional[ClientError] = None
    ctx: Optional[object] = None


def logFor(log: Logger, ctx) -> Logger:
    """
    C{log}, or for a dry run's pass (C{ctx.dryRun}) L{SILENT}.
    """
    return SILENT if ctx.dryRun else log


def preview(select: Callable, turn: Turn) -> Deferred:
    """
    The selection C{turn} would get now (see the module docstring).

    @param select: C{(turn, excluded, preview) -> coroutine of Selection},
        the layers' walk (L{relay.scheduling.layers.Layers.select}).
    @return: a Deferred firing with a L{Preview}.
    """
    result = Preview()

    async def _run():
        try:
            result.selection = await select(turn, frozenset(), result)
        except NoAccountAvailable as e:
            result.error = e.error
        return result

    return Deferred.fromCoroutine(_run())


def why(checks, ctx, account: Account) -> Optional[tuple]:
    """
    Why C{account} is not a candidate in a previewed pass, from the
    compatibility check every layer uses (R41).

    @param checks: the L{relay.scheduling.eligibility.Eligibility}.
    @param ctx: the preview's pass (L{Preview.ctx}).
    @return: C{(reason, until)} (C{until} Unix seconds or L{None}), or
        L{None} when it is a candidate.
    """
    reason = checks.incompatible(ctx, account)
    if reason is None:
        return None
    until = None
    if reason.startswith("unschedulable"):
        blocked = checks.blockWhy(ctx, account)
        until = blocked[1] if blocked else None
    elif reason == "proxy_quarantined":
        until = checks.quarantineUntil(account)
    return reason, until
