# -*- test-case-name: tests.test_keypage -*-
"""
C{/me}: a key holder's own page (C{GET /me}, a static page, C{me.html})
and its data, behind the client key itself (C{Authorization: Bearer} or
C{x-api-key}, like every client route: the intake authenticates it, R103;
a disabled or expired key is refused there):

  - C{GET /me/api/summary}: C{{"key": {"name", "expires_at"}, "limits":
    {...}, "windows": [...], "budget": {...}, "usage": {"hours": [...],
    "today": {...}}, "now"}}: the key's policy limits (no account, group or
    account list), its windows as R114 gives them (percent used and left,
    length, reset), its budgets' use and what is left, and its use per
    hour over the last L{HOURS} hours (requests, tokens, cost), from its
    own request records;
  - C{GET /me/api/requests?limit=N&cursor=C}: its own requests, newest
    first, each with only L{REQUEST_FIELDS} (never an account, an
    upstream id, an attempt or a sample).

Every read is filtered by the asking key's name before anything is
answered: nothing of another key, no account detail beyond R114's
windows.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.entry.http import UNAUTHORIZED
from relay.entry.sinks import writeError
from relay.tenants.requestlog import RequestQuery

__all__ = ["HOURS", "KeyPage", "REQUEST_FIELDS", "ownRequest"]

HOURS = 24
"""How many hours of use the summary gives, one bucket each."""

MAX_RECORDS = 2000
"""The most own request records read for the hourly use."""

REQUEST_FIELDS = (
    "time", "request_id", "client_request_id", "endpoint", "entrypoint", "mode", "stream",
    "model", "outcome", "status", "first_output_ms", "duration_ms", "input_tokens",
    "cached_input_tokens", "output_tokens", "reasoning_tokens", "cost_usd", "unpriced",
    "usage_estimated", "error_code", "waited_ms",
)
"""What a key holder sees of each of their requests."""

LIMIT_FIELDS = ("concurrency", "rpm", "tpm", "daily_tokens", "monthly_tokens", "daily_usd",
                "monthly_usd", "models", "deny_models", "max_turn_output_tokens")
"""What a key holder sees of their key's policy."""

_log = Logger()


def ownRequest(record) -> dict:
    """
    @param record: a L{relay.tenants.record.TurnRecord} of the asking key.
    @return: the fields a key holder sees (L{REQUEST_FIELDS}).
    """
    full = record.asDict()
    return {name: full.get(name) for name in REQUEST_FIELDS}


def _json(request, status: int, obj) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    request.setHeader(b"cache-control", b"no-store")
    request.setHeader(b"x-content-type-options", b"nosniff")
    return json.dumps(obj, default=str).encode("utf-8")


class _Page(Resource):
    isLeaf = True

    def __init__(self, page: bytes):
        super().__init__()
        self.page = page

    def render_GET(self, request):
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-frame-options", b"DENY")
        request.setHeader(b"referrer-policy", b"no-referrer")
        request.setHeader(b"content-security-policy",
                          b"default-src 'self'; script-src 'unsafe-inline'; style-src"
                          b" 'unsafe-inline'; frame-ancestors 'none'")
        return self.page


class _Data(Resource):
    """
    C{/me/api/...} (see the module docstring).
    """

    isLeaf = True

    def __init__(self, keys, keyUsage, ledger, requestLog, clock):
        super().__init__()
        self.keys, self.keyUsage, self.ledger = keys, keyUsage, ledger
        self.requestLog, self.clock = requestLog, clock

    def render_GET(self, request):
        key = self.keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        path = [p for p in request.postpath if p]
        if path == [b"summary"]:
            work = self._summary(key)
        elif path == [b"requests"]:
            work = self._requests(key, request)
        else:
            return _json(request, 404, {"error": {
                "message": "Not found", "type": "invalid_request_error", "param": None,
                "code": "not_found"}})
        d = Deferred.fromCoroutine(work)
        gone = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))

        def _cbAnswer(answer):
            if not gone:
                request.write(_json(request, *answer))
                request.finish()

        def _ebFailed(f):
            _log.failure("a key holder's page failed", f, event="relay.keypage_failed")
            return 500, {"error": {"message": "Internal error", "type": "api_error",
                                   "param": None, "code": "internal_error"}}

        d.addErrback(_ebFailed)
        d.addCallback(_cbAnswer)
        return NOT_DONE_YET

    async def _summary(self, key) -> tuple:
        now = self.clock.seconds()
        windows = []
        if self.keyUsage is not None:
            limits = await self.keyUsage.limits(key)
            for w in limits.windows:
                used = round(min(100.0, max(0.0, w.usedPercent)), 1)
                windows.append({"name": w.name, "used_percent": used,
                                "left_percent": round(100.0 - used, 1),
                                "window_seconds": int(w.seconds), "reset_at": int(w.resetAt),
                                "reset_after_seconds": max(0, int(w.resetAt - now))})
        budget = None
        if self.ledger is not None:
            for row in self.ledger.budgetView(now):
                if row.get("key") == key.name:
                    budget = {k: v for k, v in row.items() if k != "key"}
                    for period in ("daily", "monthly"):
                        if budget.get(f"{period}_tokens") is not None:
                            budget[f"{period}_tokens_left"] = max(
                                0, budget[f"{period}_tokens"] - (budget.get(f"{period}_used")
                                                                 or 0))
                        if budget.get(f"{period}_usd") is not None:
                            budget[f"{period}_usd_left"] = round(max(
                                0.0, budget[f"{period}_usd"]
                                - (budget.get(f"{period}_spent_usd") or 0.0)), 6)
        return 200, {
            "key": {"name": key.name, "expires_at": key.expires_at},
            "limits": {name: (list(v) if isinstance(v, tuple) else v)
                       for name in LIMIT_FIELDS for v in (getattr(key, name, None),)},
            "windows": windows, "budget": budget,
            "usage": await self._hours(key, now), "now": now,
        }

    async def _hours(self, key, now: float) -> dict:
        start = (int(now) // 3600 - HOURS + 1) * 3600
        buckets = {start + i * 3600: {"hour": start + i * 3600, "requests": 0, "tokens": 0,
                                      "cost_usd": 0.0} for i in range(HOURS)}
        if self.requestLog is not None:
            records, _ = await self.requestLog.query(
                RequestQuery(key=key.name, since=float(start)), MAX_RECORDS, None)
            for record in records:
                if record.key != key.name:  # never another key's, whatever the store did
                    continue
                bucket = buckets.get(int(record.time) // 3600 * 3600)
                if bucket is None:
                    continue
                bucket["requests"] += 1
                bucket["tokens"] += (record.input_tokens or 0) + (record.output_tokens or 0)
                bucket["cost_usd"] += (record.cost_nanos or 0) / 1e9
        hours = sorted(buckets.values(), key=lambda b: b["hour"])
        for bucket in hours:
            bucket["cost_usd"] = round(bucket["cost_usd"], 6)
        total = {name: sum(b[name] for b in hours) for name in ("requests", "tokens")}
        total["cost_usd"] = round(sum(b["cost_usd"] for b in hours), 6)
        return {"hours": hours, "last_24h": total}

    async def _requests(self, key, request) -> tuple:
        def arg(name):
            values = request.args.get(name.encode("ascii"))
            return values[0].decode("utf-8", "replace") if values else None

        try:
            limit = int(arg("limit") or 50)
        except ValueError:
            limit = 0
        if not 1 <= limit <= 200:
            return 400, {"error": {"message": "limit: expected 1 to 200",
                                   "type": "invalid_request_error", "param": "limit",
                                   "code": "invalid_value"}}
        if self.requestLog is None:
            return 200, {"requests": [], "next": None}
        records, cursor = await self.requestLog.query(RequestQuery(key=key.name), limit,
                                                      arg("cursor"))
        return 200, {"requests": [ownRequest(r) for r in records if r.key == key.name],
                     "next": cursor}


class KeyPage(Resource):
    """
    C{/me} (see the module docstring).
    """

    def __init__(self, keys, keyUsage: Any, ledger: Any, requestLog: Any, clock):
        """
        @param keys: the L{relay.entry.http.KeyRing}.
        @param keyUsage: the L{relay.interfaces.IKeyUsage}, or L{None}.
        @param ledger: the L{relay.interfaces.IUsageLedger}, or L{None}.
        @param requestLog: the L{relay.interfaces.IRequestLog}, or L{None}.
        @param clock: the injected clock.
        """
        super().__init__()
        page = resources.files("relay.keypage").joinpath("me.html").read_bytes()
        self.putChild(b"", _Page(page))
        self.putChild(b"api", _Data(keys, keyUsage, ledger, requestLog, clock))

    def render_GET(self, request):
        """
        C{/me} without the slash: to C{/me/}.
        """
        request.setResponseCode(302)
        request.setHeader(b"location", b"/me/")
        return b""
