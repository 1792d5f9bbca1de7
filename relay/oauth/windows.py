# -*- test-case-name: tests.test_quota -*-
"""
An OAuth account's plan usage windows as the backend reports them
(protocol.md 7.3): L{Window} and L{Snapshot}, read from response headers
(C{x-codex-primary-*}/C{x-codex-secondary-*}), C{codex.rate_limits} events
and the usage route's body (L{windowsFromWham}). What the scheduler makes
of them is L{relay.scheduling.quota}'s.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from attrs import frozen

WINDOWS = ("primary", "secondary")



@frozen
class Window:
    """
    One usage window.

    @ivar used_percent: percent used (0-100, may be fractional).
    @ivar window_minutes: the window's length, or L{None}.
    @ivar reset_at: when it resets, Unix seconds, or L{None}.
    """

    used_percent: float
    window_minutes: Optional[float] = None
    reset_at: Optional[float] = None

    def usedAt(self, now: float) -> float:
        """
        @return: the used-percent now (0 once the reset time has passed).
        """
        if self.reset_at is not None and self.reset_at <= now:
            return 0.0
        return self.used_percent


@frozen
class Snapshot:
    """
    What relay last heard about one account's windows.

    @ivar primary: the primary (usually 5-hour) L{Window}, or L{None}.
    @ivar secondary: the secondary (usually weekly) L{Window}, or L{None}.
    @ivar plan: the plan type, or L{None}.
    @ivar observed_at: Unix seconds of the observation.
    @ivar source: C{headers}, C{handshake}, C{event}, or C{probe} (a usage
        probe of an idle account).
    """

    primary: Optional[Window]
    secondary: Optional[Window]
    plan: Optional[str] = None
    observed_at: float = 0.0
    source: str = "headers"

    def used(self, now: float) -> float:
        """
        @return: the fuller window's used-percent now.
        """
        return max((w.usedAt(now) for w in (self.primary, self.secondary) if w), default=0.0)

    def resetOfFuller(self, now: float) -> float:
        """
        @return: the reset time of the fuller window (infinity if unknown).
        """
        windows = [w for w in (self.primary, self.secondary) if w is not None]
        if not windows:
            return math.inf
        fuller = max(windows, key=lambda w: w.usedAt(now))
        return fuller.reset_at if fuller.reset_at is not None else math.inf

    def toJSON(self, now: float) -> dict:
        """
        @return: the admin view's C{usage} object.
        """
        out: dict = {"plan": self.plan, "observed_at": self.observed_at, "source": self.source}
        for name in WINDOWS:
            window = getattr(self, name)
            out[name] = None if window is None else {
                "used_percent": window.usedAt(now), "window_minutes": window.window_minutes,
                "reset_at": window.reset_at,
            }
        return out


def _float(value: Any) -> Optional[float]:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, bool):
        return None
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) else None


def windowsFromHeaders(headers: dict, now: float) -> Optional[Snapshot]:
    """
    Read C{x-codex-*} headers (protocol.md 7.3).

    @param headers: lower-cased name -> value.
    @param now: Unix seconds (for C{reset-after-seconds}).
    @return: a L{Snapshot}, or L{None} when no window is given.
    """
    found = {}
    for name in WINDOWS:
        used = _float(headers.get(f"x-codex-{name}-used-percent"))
        if used is None:
            continue
        at = _float(headers.get(f"x-codex-{name}-reset-at"))
        if at is None:
            after = _float(headers.get(f"x-codex-{name}-reset-after-seconds"))
            at = now + after if after is not None else None
        found[name] = Window(
            used, _float(headers.get(f"x-codex-{name}-window-minutes")), at
        )
    if not found:
        return None
    plan = headers.get("x-codex-plan-type")
    return Snapshot(found.get("primary"), found.get("secondary"),
                    str(plan) if plan else None, now)


def windowsFromEvent(event: dict, now: float) -> Optional[Snapshot]:
    """
    Read a C{codex.rate_limits} event (protocol.md 7.3).

    @return: a L{Snapshot}, or L{None} when it holds no window.
    """
    limits = event.get("rate_limits")
    if not isinstance(limits, dict):
        return None
    found = {}
    for name in WINDOWS:
        raw = limits.get(name)
        if not isinstance(raw, dict):
            continue
        used = _float(raw.get("used_percent"))
        if used is None:
            continue
        at = _float(raw.get("reset_at", raw.get("resets_at")))
        if at is None:
            after = _float(raw.get("reset_after_seconds", raw.get("resets_in_seconds")))
            at = now + after if after is not None else None
        minutes = _float(raw.get("window_minutes"))
        found[name] = Window(used, minutes, at)
    if not found:
        return None
    plan = event.get("plan_type")
    return Snapshot(found.get("primary"), found.get("secondary"),
                    str(plan) if plan else None, now, "event")


def windowsFromWham(body: dict, now: float) -> Optional[Snapshot]:
    """
    Read a C{GET /backend-api/wham/usage} answer (protocol.md 7.4; the
    usage probe of idle accounts): C{{"plan_type", "rate_limit":
    {"primary_window": {"used_percent", "limit_window_seconds",
    "reset_after_seconds", "reset_at"}, "secondary_window": {...}}}}.

    @return: a L{Snapshot} with source C{probe}, or L{None} when it holds
        no window.
    """
    limits = body.get("rate_limit") if isinstance(body, dict) else None
    if not isinstance(limits, dict):
        return None
    found = {}
    for name in WINDOWS:
        raw = limits.get(name + "_window")
        if not isinstance(raw, dict):
            continue
        used = _float(raw.get("used_percent"))
        if used is None:
            continue
        at = _float(raw.get("reset_at"))
        if at is None:
            after = _float(raw.get("reset_after_seconds"))
            at = now + after if after is not None else None
        seconds = _float(raw.get("limit_window_seconds"))
        found[name] = Window(used, seconds / 60 if seconds is not None else None, at)
    if not found:
        return None
    plan = body.get("plan_type")
    return Snapshot(found.get("primary"), found.get("secondary"),
                    str(plan) if plan else None, now, "probe")
