# -*- test-case-name: tests.test_overview -*-
"""
C{GET /admin/overview}: the figures a team lead reads first, in one
answer behind the admin key (R99):

  - C{capacity}: the pool now (accounts, schedulable, failing, degraded,
    paused, blocked; slots, in use, waiting), from the accounts view and
    each account's health (L{relay.policy.outcomes});
  - C{next_resets}: every block end and usage-window reset still ahead,
    soonest first (at most L{MAX_RESETS});
  - C{per_minute}: the pool's attempts and failures per minute over the
    last 15 minutes, and their mean over the last 5
    (C{requests_per_minute}, C{failures_per_minute});
  - C{spend_today_usd}, C{tokens_today}, C{spend_today_by_key}: the UTC day
    so far, from the usage store (L{None} when the store cannot be read:
    the rest still answers).

Attempt counts are this process's (as the health); spend is the shared
store's.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger

from relay.console.admin import Guarded, deliverLater, notFound
from relay.usage.store import dayStart, monthStart

__all__ = ["MAX_RESETS", "OverviewResource", "overviewOf"]

_log = Logger()

MAX_RESETS = 20
"""The most resets listed."""

RATE_MINUTES = 5
"""The per-minute rates are the mean over this many minutes."""


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _resets(rows: list, now: float) -> list:
    found = []
    for row in rows:
        for block in row.get("blocks") or ():
            until = block.get("until")
            if until and until > now:
                found.append({"account": row["id"], "kind": block.get("kind") or "block",
                              "model": block.get("model"), "reason": block.get("reason"),
                              "at": until})
        usage = row.get("usage") or {}
        for name in ("primary", "secondary"):
            window = usage.get(name) or {}
            at = window.get("reset_at")
            if at and at > now:
                found.append({"account": row["id"], "kind": "window_" + name, "model": None,
                              "reason": f"{name} usage window at"
                                        f" {window.get('used_percent') or 0:.0f} %",
                              "at": at})
    found.sort(key=lambda r: (r["at"], r["account"], r["kind"]))
    for reset in found:
        reset.update(at_iso=_iso(reset["at"]), seconds_left=round(reset["at"] - now, 1))
    return found[:MAX_RESETS]


def overviewOf(rows: list, perMinute: list, costs: dict, tokens: dict, now: float) -> dict:
    """
    The answer from its parts.

    @param rows: the accounts view (L{relay.console.view.OperatorView}).
    @param perMinute: L{relay.policy.outcomes.AttemptOutcomes.perMinute}.
    @param costs: key -> nano-dollars today. @param tokens: key -> tokens
        today.
    """
    states = [(row.get("health") or {}).get("state") for row in rows]
    paused = sum(1 for row, s in zip(rows, states) if row.get("paused") or s == "paused")
    capacity = {
        "accounts": len(rows),
        "schedulable": sum(1 for row in rows if row.get("schedulable")),
        "failing": states.count("failing"),
        "degraded": states.count("degraded"),
        "paused": paused,
        "blocked": sum(1 for row in rows if not row.get("schedulable")) - paused,
        "slots": sum(int(row.get("concurrency") or 0) for row in rows),
        "in_use": sum(int(row.get("in_use") or 0) for row in rows),
        "waiting": sum(int(row.get("waiting") or 0) for row in rows),
    }
    recent = perMinute[-RATE_MINUTES:]
    keys = sorted(set(costs) | set(tokens))
    byKey = [{"key": k, "cost_usd": round(costs.get(k, 0) / 1e9, 9),
              "total_tokens": tokens.get(k, 0)} for k in keys]
    byKey.sort(key=lambda r: (-r["cost_usd"], -r["total_tokens"], r["key"]))
    return {
        "now": now,
        "capacity": capacity,
        "next_resets": _resets(rows, now),
        "per_minute": perMinute,
        "requests_per_minute": round(sum(r["requests"] for r in recent) / RATE_MINUTES, 2),
        "failures_per_minute": round(sum(r["failed"] for r in recent) / RATE_MINUTES, 2),
        "spend_today_usd": round(sum(costs.values()) / 1e9, 9),
        "tokens_today": sum(tokens.values()),
        "spend_today_by_key": byKey,
    }


class OverviewResource(Guarded):
    """
    C{GET /admin/overview} (see the module docstring).
    """

    def __init__(self, adminKey, accountsView: Callable[[], Any], outcomes, ledger, clock):
        """
        @param accountsView: returns (a L{Deferred} of) the accounts view.
        @param outcomes: the L{relay.policy.outcomes.AttemptOutcomes}, or
            L{None}.
        @param ledger: the L{relay.usage.ledger.UsageLedger}, or L{None}.
        """
        super().__init__(adminKey)
        self.accountsView = accountsView
        self.outcomes = outcomes
        self.ledger = ledger
        self.clock = clock

    async def _read(self) -> dict:
        now = self.clock.seconds()
        rows = list(await maybeDeferred(self.accountsView))
        perMinute = self.outcomes.perMinute() if self.outcomes is not None else []
        costs: Optional[dict] = {}
        tokens: Optional[dict] = {}
        if self.ledger is not None:
            await self.ledger.flush()
            store = self.ledger.store
            try:
                costs, _ = await store.costTotals(dayStart(now), monthStart(now))
                tokens, _ = await store.budgetTotals(dayStart(now), monthStart(now))
            except Exception as e:  # noqa: BLE001 - the rest of the overview still answers
                _log.warn("reading today's spend failed: {error}", error=repr(e),
                          event="relay.admin_overview_spend_failed")
                costs = tokens = None
        answer = overviewOf(rows, perMinute, costs or {}, tokens or {}, now)
        if costs is None:
            # Unknown, never a made-up zero.
            answer.update(spend_today_usd=None, tokens_today=None, spend_today_by_key=None)
        return answer

    def render_GET(self, request):
        """
        The overview as JSON.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        return deliverLater(request, Deferred.fromCoroutine(self._read()),
                            lambda answer: (200, answer), "reading the overview")
