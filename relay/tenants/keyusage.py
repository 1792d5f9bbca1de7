# -*- test-case-name: tests.test_keyusage -*-
"""
A client key's own limits in the shapes Codex reads for an account's
(behaviour.md R114; protocol.md 7.3, 7.3a): the C{wham/usage} answer, the
C{x-codex-primary-*}/C{x-codex-secondary-*} response headers and the
C{codex.rate_limits} event. Through relay these describe the key, never an
account.

A key's windows, each as percent used, length and reset time:

  - C{rpm} and C{tpm}: the minute (the key's sliding window,
    L{relay.tenants.ratelimit});
  - C{daily_tokens}, C{daily_usd}: the UTC day;
  - C{monthly_tokens}, C{monthly_usd}: the UTC month;
  - a key with no budget: the pool's headroom for the key (the mean use of
    the accounts it may reach, each account's window as the upstream gave
    it; an account that reports none counts as unused), from a callable
    the application gives.

Windows of the same length are one window at the higher percent. The
shortest is Codex's C{primary}, the next its C{secondary}; any further one
goes to C{additional_rate_limits} of the usage answer.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from attrs import frozen
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IKeyUsage

from relay.usage.store import DAY, dayStart, monthStart, nextMonthStart

__all__ = ["KeyLimits", "KeyUsage", "KeyWindow", "PLAN_TYPE", "limitHeaders", "limitsEvent",
           "accountsCheckBody", "usageBody", "whoamiBody"]

PLAN_TYPE = "team"
"""The plan relay reports for a key: one Codex accepts (R114)."""

MINUTE = 60


@frozen
class KeyWindow:
    """
    One window of a key's limits.

    @ivar name: what it measures (C{rpm}, C{daily_tokens}, C{pool}, ...;
        several names joined by C{+} when merged).
    @ivar usedPercent: 0..100, a float.
    @ivar seconds: the window's length, seconds.
    @ivar resetAt: when it resets, Unix seconds.
    """

    name: str
    usedPercent: float
    seconds: int
    resetAt: float


@frozen
class KeyLimits:
    """
    A key's windows, shortest first, at most one per length.

    @ivar windows: a tuple of L{KeyWindow}.
    @ivar at: when they were read, Unix seconds.
    """

    windows: tuple
    at: float

    @property
    def primary(self) -> Optional[KeyWindow]:
        return self.windows[0] if self.windows else None

    @property
    def secondary(self) -> Optional[KeyWindow]:
        return self.windows[1] if len(self.windows) > 1 else None


def _percent(used: float, limit: float) -> float:
    if not limit or limit <= 0:
        return 0.0
    return max(0.0, min(100.0, used * 100.0 / limit))


def merge(windows: list, at: float) -> KeyLimits:
    """
    @param windows: L{KeyWindow}s in any order.
    @return: one window per length (the higher percent, names joined),
        shortest first.
    """
    if not windows:
        return KeyLimits((), at)
    byLength = {}
    for window in windows:
        held = byLength.get(window.seconds)
        if held is None:
            byLength[window.seconds] = window
        else:
            top = window if window.usedPercent > held.usedPercent else held
            byLength[window.seconds] = KeyWindow(held.name + "+" + window.name,
                                                 top.usedPercent, window.seconds, top.resetAt)
    return KeyLimits(tuple(byLength[s] for s in sorted(byLength)), at)


@implementer(IKeyUsage)
class KeyUsage:
    """
    Reads a key's windows (R114; see the module docstring).
    """

    _log = Logger()

    def __init__(self, clock: IReactorTime, ledger=None, policy=None,
                 pool: Optional[Callable] = None):
        """
        @param ledger: the L{relay.usage.ledger.UsageLedger} (budgets), or
            L{None}.
        @param policy: the L{relay.tenants.keypolicy.KeyPolicy} (rpm/tpm
            windows, L{KeyPolicy.peekRate}), or L{None}.
        @param pool: C{pool(key)} -> a list of L{KeyWindow} of the pool's
            headroom for the key, or L{None}.
        """
        self.clock = clock
        self.ledger = ledger
        self.policy = policy
        self.pool = pool

    def budgetWindows(self, key, now: float) -> list:
        """
        @return: the L{KeyWindow}s of C{key}'s token and money budgets.
        """
        if self.ledger is None or (key.daily_tokens is None and key.monthly_tokens is None
                                   and key.daily_usd is None and key.monthly_usd is None):
            return []
        usedDay = usedMonth = spentDay = spentMonth = 0  # read only for a budget
        if key.daily_tokens is not None or key.monthly_tokens is not None:
            usedDay, usedMonth = self.ledger.used(key.name, now)
        if key.daily_usd is not None or key.monthly_usd is not None:
            spentDay, spentMonth = self.ledger.spent(key.name, now)
        dayEnd, monthEnd = dayStart(now) + DAY, nextMonthStart(now)
        monthLength = int(monthEnd - monthStart(now))
        out = []
        for name, limit, used, seconds, end in (
            ("daily_tokens", key.daily_tokens, usedDay, DAY, dayEnd),
            ("monthly_tokens", key.monthly_tokens, usedMonth, monthLength, monthEnd),
            ("daily_usd", key.daily_usd, spentDay / 1e9, DAY, dayEnd),
            ("monthly_usd", key.monthly_usd, spentMonth / 1e9, monthLength, monthEnd),
        ):
            if limit is not None:
                out.append(KeyWindow(name, _percent(used, limit), int(seconds), end))
        return out

    def limitsNow(self, key) -> Optional[KeyLimits]:
        """
        L{limits} when they need no wait (a key without C{rpm}/C{tpm}
        windows to read): the same answer, without a coroutine.

        @param key: the L{relay.base.records.ClientKey}.
        @return: its L{KeyLimits}, or L{None} when L{limits} must be
            awaited.
        """
        if self.policy is not None and (key.rpm or key.tpm):
            return None
        return self._windows(key, self.clock.seconds(), None)

    async def limits(self, key) -> KeyLimits:
        """
        @param key: the L{relay.base.records.ClientKey}.
        @return: its L{KeyLimits}; a rate window that cannot be read is
            left out (logged).
        """
        now = self.clock.seconds()
        decision = None
        if self.policy is not None and (key.rpm or key.tpm):
            try:
                decision = await self.policy.peekRate(key)
            except Exception as e:  # RateLimitUnavailable and kin: leave it out
                self._log.warn("key {key_name}'s rate windows unreadable: {error}",
                               key_name=key.name, error=str(e))
        return self._windows(key, now, decision)

    def _windows(self, key, now: float, decision) -> KeyLimits:
        """
        @param now: when the windows are read, Unix seconds.
        @param decision: L{KeyPolicy.peekRate}'s answer for the key's
            C{rpm}/C{tpm} windows, or L{None} (none read).
        @return: the key's L{KeyLimits} at C{now}.
        """
        windows = []
        if decision is not None:
            if key.rpm:
                windows.append(KeyWindow("rpm", _percent(decision.requests, key.rpm), MINUTE,
                                         now + (decision.resetRequests or MINUTE)))
            if key.tpm:
                windows.append(KeyWindow("tpm", _percent(decision.tokens, key.tpm), MINUTE,
                                         now + (decision.resetTokens or MINUTE)))
        budgets = self.budgetWindows(key, now)
        windows.extend(budgets)
        if not budgets and self.pool is not None:
            windows.extend(self.pool(key))
        return merge(windows, now)


def _int(value: float) -> int:
    return int(math.floor(value))


def usageBody(limits: KeyLimits) -> dict:
    """
    The C{GET /backend-api/wham/usage} answer for a key (protocol.md 7.3a,
    R114): C{plan_type}, C{rate_limit.primary_window} and
    C{secondary_window} (integer C{used_percent}, C{limit_window_seconds},
    C{reset_after_seconds}, C{reset_at}), further windows under
    C{additional_rate_limits}, no credits and no banked resets.
    """

    def window(w: Optional[KeyWindow]):
        if w is None:
            return None
        return {"used_percent": min(100, _int(w.usedPercent)),
                "limit_window_seconds": int(w.seconds),
                "reset_after_seconds": max(0, _int(w.resetAt - limits.at)),
                "reset_at": _int(w.resetAt)}

    reached = any(w.usedPercent >= 100 for w in limits.windows)
    extra = [
        {"limit_name": w.name, "metered_feature": "relay_key",
         "rate_limit": {"allowed": w.usedPercent < 100, "limit_reached": w.usedPercent >= 100,
                        "primary_window": window(w), "secondary_window": None}}
        for w in limits.windows[2:]
    ]
    return {
        "plan_type": PLAN_TYPE,
        "rate_limit": {"allowed": not reached, "limit_reached": reached,
                       "primary_window": window(limits.primary),
                       "secondary_window": window(limits.secondary)},
        "credits": {"has_credits": False, "unlimited": False, "balance": None},
        "additional_rate_limits": extra or None,
        "rate_limit_reset_credits": {"available_count": 0},
    }


def whoamiBody(key) -> dict:
    """
    The C{GET /v1/user-auth-credential/whoami} answer for a key (R114):
    what Codex 0.171 reads when its C{CODEX_ACCESS_TOKEN} is a personal
    access token (a token starting C{at-}; openai/codex
    C{login/src/auth/personal_access_token.rs} C{hydrate_personal_access_token}),
    after which it is signed in to the Codex backend and reads its usage
    from the usage route (the key's own, L{usageBody}). The ids name the
    key, never an account; the plan is L{PLAN_TYPE}.

    @param key: the authenticated L{relay.base.records.ClientKey}.
    @return: C{{"email", "chatgpt_user_id", "chatgpt_account_id",
        "chatgpt_plan_type", "chatgpt_account_is_fedramp"}}.
    """
    ident = "relay-key-" + key.name
    return {"email": None, "chatgpt_user_id": ident, "chatgpt_account_id": ident,
            "chatgpt_plan_type": PLAN_TYPE, "chatgpt_account_is_fedramp": False}


def accountsCheckBody(key) -> dict:
    """
    The C{GET /backend-api/wham/accounts/check} (or C{/api/codex/accounts/check})
    answer for a key (R114): the one workspace of L{whoamiBody}'s account
    id, with no routing constraint, so Codex keeps its configured
    C{chatgpt_base_url} (which must be HTTPS: openai/codex
    C{app-server/src/request_processors/account_processor/workspace_routing.rs}
    C{resolve_routing}, C{parse_backend_url}). Without it Codex 0.171
    signed in with a personal access token stops at "workspace routing
    discovery failed".

    @param key: the authenticated L{relay.base.records.ClientKey}.
    @return: C{{"accounts": [{"id", "plan_type", "workspace_backend_origin":
        "NO_CONSTRAINT", "account_routing_override": "NO_CONSTRAINT", "name"}]}}.
    """
    ident = whoamiBody(key)["chatgpt_account_id"]
    return {"accounts": [{"id": ident, "plan_type": PLAN_TYPE,
                          "workspace_backend_origin": "NO_CONSTRAINT",
                          "account_routing_override": "NO_CONSTRAINT", "name": key.name}],
            "account_ordering": [ident], "default_account_id": ident}


def limitHeaders(limits: Optional[KeyLimits]) -> dict:
    """
    The C{x-codex-*} rate-limit headers for a key (protocol.md 7.3, R114):
    C{x-codex-{primary,secondary}-{used-percent,window-minutes,reset-at,
    reset-after-seconds}} and C{x-codex-plan-type}; C{{}} for L{None}.
    """
    if limits is None:
        return {}
    out = {}
    for name, w in (("primary", limits.primary), ("secondary", limits.secondary)):
        if w is None:
            continue
        out[f"x-codex-{name}-used-percent"] = f"{round(w.usedPercent, 1):g}"
        out[f"x-codex-{name}-window-minutes"] = str(max(1, int(w.seconds) // 60))
        out[f"x-codex-{name}-reset-at"] = str(_int(w.resetAt))
        out[f"x-codex-{name}-reset-after-seconds"] = str(max(0, _int(w.resetAt - limits.at)))
    if out:
        out["x-codex-plan-type"] = PLAN_TYPE
    return out


def limitsEvent(limits: Optional[KeyLimits]) -> Optional[dict]:
    """
    The C{codex.rate_limits} event for a key (protocol.md 7.3, R114), or
    L{None} for L{None}.
    """
    if limits is None:
        return None
    rates = {}
    for name, w in (("primary", limits.primary), ("secondary", limits.secondary)):
        if w is not None:
            rates[name] = {"used_percent": round(w.usedPercent, 1),
                           "window_minutes": max(1, int(w.seconds) // 60),
                           "reset_at": _int(w.resetAt)}
    return {"type": "codex.rate_limits", "plan_type": PLAN_TYPE, "rate_limits": rates,
            "credits": None}


def poolWindows(clock: IReactorTime, windows, policy, accounts) -> Callable:
    """
    The pool's headroom for a key with no budget (R114): per account window
    (C{primary}, C{secondary}), the mean used-percent of the accounts the
    key may reach (one reporting no window counts as unused), the
    longest length reported and the earliest reset.

    @param windows: the L{relay.interfaces.IUsageWindows} (C{get(id)} ->
        a L{relay.oauth.windows.Snapshot} or L{None}).
    @param policy: the L{relay.tenants.keypolicy.KeyPolicy} (C{reachable}).
    @param accounts: the live accounts (iterable, read per call).
    @return: C{pool(key)} -> a list of L{KeyWindow}.
    """

    # UsageWindows' own map (never replaced; its get reads it): read
    # directly, and known empty at no cost (API-key accounts report none)
    held = getattr(windows, "snapshots", None)
    get = held.get if held is not None else windows.get

    def pool(key) -> list:
        if held is not None and not held:
            return []
        now = clock.seconds()
        reach = policy.reachable(key, accounts) if policy is not None else list(accounts)
        if not reach:
            return []
        primaries, secondaries = [], []
        for account in reach:
            snapshot = get(account.id)
            if snapshot is not None:
                if snapshot.primary is not None:
                    primaries.append(snapshot.primary)
                if snapshot.secondary is not None:
                    secondaries.append(snapshot.secondary)
        out = []
        for name, found in (("primary", primaries), ("secondary", secondaries)):
            if not found:
                continue
            # one pass: each window's use now (Window.usedAt), the longest
            # length and the earliest reset to come (max/min: the first of
            # equals)
            used, minutes, reset = [], None, None
            for w in found:
                at = w.reset_at
                used.append(0.0 if at is not None and at <= now else w.used_percent)
                length = w.window_minutes or 0
                if minutes is None or length > minutes:
                    minutes = length
                if at is not None and at > now and (reset is None or at < reset):
                    reset = at
            minutes = minutes or 300
            out.append(KeyWindow("pool_" + name, sum(used) / len(reach), int(minutes * 60),
                                 reset if reset is not None else now + minutes * 60))
        return out

    return pool
