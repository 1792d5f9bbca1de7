# -*- test-case-name: tests.test_alerts -*-
"""
What is in force now, as L{relay.alerts.book.Condition}s, from readings of
relay's state (docs/operating.md "Alerts"). Pure functions: the readings
are taken by L{relay.alerts.monitor}.
"""

from __future__ import annotations

from typing import Iterable, Optional

from relay.alerts.book import Condition
from relay.alerts.forecast import runsOutIn
from relay.base.alertsettings import (
    ACCOUNT_DISABLED,
    CAPACITY_FORECAST,
    KEY_BUDGET,
    LOGIN_NEEDED,
    POOL_EXHAUSTED,
    SPEND_RATE,
)

BUDGETS = (
    # (budget, limit field, used field, unit)
    ("daily_tokens", "daily_tokens", "daily_used", "tokens"),
    ("monthly_tokens", "monthly_tokens", "monthly_used", "tokens"),
    ("daily_usd", "daily_usd", "daily_spent_usd", "USD"),
    ("monthly_usd", "monthly_usd", "monthly_spent_usd", "USD"),
)


def loginsNeeded(views: Iterable[tuple]) -> list:
    """
    C{login_needed}: an OAuth login whose tokens need a person to sign in
    again (token status C{needs_login}: a refresh token refused, none to
    refresh with, or a refresh in doubt).

    @param views: C{(account id, credentials view)} per OAuth account
        (L{relay.interfaces.ICredentialSource.view}).
    """
    out = []
    for accountId, view in views:
        if view.get("token_status") == "needs_login":
            reason = view.get("token_reason") or "login required"
            out.append(Condition(
                LOGIN_NEEDED, accountId,
                f"OAuth account {accountId} needs sign-in: {reason}",
                {"account": accountId, "reason": reason}))
    return out


def accountsDisabled(runtimes: dict) -> list:
    """
    C{account_disabled}: an account relay disabled after its upstream's
    answers (R11: deactivated workspace, 402, repeated 403, ...); it stays
    disabled until an operator clears it.

    @param runtimes: account id -> L{relay.base.records.AccountRuntime}.
    """
    out = []
    for accountId, runtime in sorted(runtimes.items()):
        if getattr(runtime, "disabled", False):
            reason = runtime.disabledReason or "disabled"
            out.append(Condition(
                ACCOUNT_DISABLED, accountId, f"account {accountId} is disabled: {reason}",
                {"account": accountId, "reason": reason}))
    return out


def poolsExhausted(refusals: dict) -> list:
    """
    C{pool_exhausted}: no account can serve a model clients ask for.

    @param refusals: model -> the L{relay.base.records.ClientError} a turn
        would get now (models the pool can serve are absent).
    """
    out = []
    for model, error in sorted(refusals.items()):
        retry = dict(getattr(error, "headers", None) or ()).get("Retry-After")
        out.append(Condition(
            POOL_EXHAUSTED, model,
            f"the pool cannot serve {model}: {error.message}",
            {"model": model, "status": error.status, "code": error.code,
             "message": error.message, "retry_after": retry}))
    return out


def capacityForecasts(pools: dict, now: float, horizonMinutes: float) -> list:
    """
    C{capacity_forecast}: at the current rate the pool's 5-hour windows
    for a model run out within C{horizonMinutes}
    (L{relay.alerts.forecast.runsOutIn}).

    @param pools: model -> C{[(account id, used percent, rate per second,
        reset time or None)]} of the accounts serving it with a known
        primary window.
    """
    out = []
    for model, windows in sorted(pools.items()):
        if not windows:
            continue
        eta = runsOutIn([(used, rate, reset) for _, used, rate, reset in windows], now)
        if eta is None or eta > horizonMinutes * 60:
            continue
        minutes = max(1, round(eta / 60))
        used = sum(u for _, u, _, _ in windows) / len(windows)
        out.append(Condition(
            CAPACITY_FORECAST, model,
            f"at the current rate the pool's 5-hour windows for {model} run out in"
            f" ~{minutes} min",
            {"model": model, "minutes": minutes, "seconds": round(eta),
             "used_percent": round(used, 1),
             "percent_per_hour": round(sum(r for _, _, r, _ in windows) * 3600, 2),
             "accounts": sorted(a for a, _, _, _ in windows)}))
    return out


def keyBudgets(rows: Iterable[dict], percents: Iterable[float]) -> list:
    """
    C{key_budget}: a key at or over a share of one of its budgets (a
    condition per key, budget and share: 80 % and 100 % by default).

    @param rows: L{relay.usage.ledger.UsageLedger.budgetView} rows.
    @param percents: the shares, percent.
    """
    percents = sorted(percents)
    out = []
    for row in rows:
        key = row["key"]
        for budget, limitField, usedField, unit in BUDGETS:
            limit, used = row.get(limitField), row.get(usedField)
            if not limit or used is None:
                continue
            share = used * 100.0 / limit
            for percent in percents:
                if share >= percent:
                    out.append(Condition(
                        KEY_BUDGET, f"{key} {budget} {percent:g}%",
                        f"key {key} has used {share:.0f}% of its {budget} budget"
                        f" ({_amount(used, unit)} of {_amount(limit, unit)})",
                        {"key": key, "budget": budget, "percent": percent,
                         "used": used, "limit": limit, "resets_at": row.get(
                             budget.split("_")[0] + "_resets_at")}))
    return out


def spendRate(usdPerHour: float, threshold: Optional[float], windowSeconds: float) -> list:
    """
    C{spend_rate}: the pool's spend per hour over the threshold.

    @param usdPerHour: the spend over the last C{windowSeconds}, per hour.
    @param threshold: C{alerts.spend_rate_usd_per_hour}, or L{None} (off).
    """
    if threshold is None or usdPerHour <= threshold:
        return []
    return [Condition(
        SPEND_RATE, "pool",
        f"spending ${usdPerHour:.2f}/hour (over the last {windowSeconds:g} s),"
        f" over the ${threshold:g}/hour threshold",
        {"usd_per_hour": round(usdPerHour, 6), "threshold_usd_per_hour": threshold,
         "window_seconds": windowSeconds})]


def _amount(value, unit: str) -> str:
    """
    @return: C{value} for people: dollars or whole tokens.
    """
    if unit == "USD":
        return f"${value:.2f}"
    return f"{int(value)} tokens"
