# -*- test-case-name: tests.test_usage -*-
"""
Parsing the parameters of C{GET /admin/usage}.
"""

from __future__ import annotations

import datetime
import math

from relay.usage.store import GROUPS

__all__ = ["DEFAULT_WINDOW", "UsageQueryError", "parseGroupBy", "parseSince"]

DEFAULT_WINDOW = 24 * 3600
"""Seconds looked back when C{since} is absent."""


class UsageQueryError(ValueError):
    """
    A C{/admin/usage} parameter is malformed.

    @ivar param: the parameter's name.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def parseSince(text: str | None, now: float) -> float:
    """
    Read C{since}: Unix seconds (C{1767225600}, fractions allowed) or an
    ISO 8601 time (C{2026-01-01}, C{2026-01-01T10:00:00Z},
    C{2026-01-01T12:00:00+02:00}; without a zone it is UTC).

    @param text: the parameter, or L{None} for the last
        L{DEFAULT_WINDOW} seconds.
    @param now: Unix seconds.
    @return: Unix seconds.
    @raise UsageQueryError: for anything else.
    """
    if text is None or not text.strip():
        return now - DEFAULT_WINDOW
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value) or value < 0:
            raise UsageQueryError("since", "since must be a non-negative Unix time")
        return value
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise UsageQueryError(
            "since", "since must be Unix seconds or an ISO 8601 time, e.g. 2026-01-01T00:00:00Z"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


def parseGroupBy(text: str | None) -> str:
    """
    Read C{group_by}: C{key} (the default), C{account}, C{model} or C{hour}.

    @raise UsageQueryError: for anything else.
    """
    if text is None or not text.strip():
        return "key"
    text = text.strip()
    if text not in GROUPS:
        raise UsageQueryError("group_by", "group_by must be one of " + ", ".join(GROUPS))
    return text
