# -*- test-case-name: tests.test_usage_series -*-
"""
C{GET /admin/usage/series}: usage and cost over time, per key, account or
model, bucketed by hour or day over 24 hours, 7 or 30 days, as JSON or CSV
(the console's charts and exports; the contract is in docs/operating.md).

Two aggregated reads answer it, one per source, never one per bucket:

  - the usage store's hourly rows (L{relay.usage.ledger.UsageLedger.series}):
    tokens, cost, the turns that reported usage (C{usage_requests});
  - the request log (L{relay.interfaces.IRequestLog.aggregate}): every
    turn by outcome, failures by kind (C{requests}, C{completed},
    C{failed}, C{failures}, C{client_gone}); the log is bounded by
    C{request_log.retention_days}, so long ranges may count fewer turns
    than the token fields.

Every series has a point per bucket (zeros where nothing happened); the
points of a series sum to its C{total}, and the series to the answer's.
"""

from __future__ import annotations

from typing import Any, Optional

from twisted.internet.defer import Deferred

from relay.console.admin import deliverLater, errorBody, respond
from relay.console.csvexport import deliverCSV, wantsCSV
from relay.usage.tokens import TokenCounts

__all__ = ["RANGES", "SeriesQuery", "parseSeries", "seriesAnswer", "seriesCSV", "renderSeries"]

HOUR = 3600
DAY = 86400

RANGES = {"24h": DAY, "7d": 7 * DAY, "30d": 30 * DAY}
"""The ranges offered, seconds."""

BUCKETS = {"hour": HOUR, "day": DAY}
"""The bucket widths offered, seconds."""

_GROUPS = ("key", "account", "model", "none")

_TOKEN_FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens",
                 "total_tokens")

_CSV_FIELDS = ("requests", "completed", "failed", "client_gone") + _TOKEN_FIELDS + (
    "cost_usd", "unpriced_requests", "estimated_requests", "usage_requests")


class SeriesQuery:
    """
    A parsed C{/admin/usage/series} request.
    """

    def __init__(self, range: str, bucket: str, groupBy: str, filters: dict, csv: bool):
        self.range, self.bucket, self.groupBy = range, bucket, groupBy
        self.filters, self.csv = filters, csv

    @property
    def bucketSeconds(self) -> int:
        return BUCKETS[self.bucket]

    def bounds(self, now: float) -> tuple:
        """
        @return: C{(since, until, bucket starts)}: the bucket holding
            C{now} is the last; as many buckets as cover the range.
        """
        width = self.bucketSeconds
        until = int(now // width) * width + width
        count = max(1, -(-RANGES[self.range] // width))
        since = until - count * width
        return since, until, list(range(since, until, width))


class SeriesError(ValueError):
    """
    A bad parameter.

    @ivar param: its name.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _arg(request, name: str) -> Optional[str]:
    values = request.args.get(name.encode("ascii"))
    if not values:
        return None
    text = values[0].decode("utf-8", "replace").strip()
    return text or None


def parseSeries(request) -> SeriesQuery:
    """
    Read the query (C{range}, C{bucket}, C{group_by}, C{key}, C{account},
    C{model}, C{format}).

    @raise SeriesError: naming the bad parameter.
    """
    range_ = _arg(request, "range") or "24h"
    if range_ not in RANGES:
        raise SeriesError("range", "range must be one of " + ", ".join(RANGES))
    bucket = _arg(request, "bucket") or ("day" if range_ == "30d" else "hour")
    if bucket not in BUCKETS:
        raise SeriesError("bucket", "bucket must be hour or day")
    groupBy = _arg(request, "group_by") or "none"
    if groupBy not in _GROUPS:
        raise SeriesError("group_by", "group_by must be one of " + ", ".join(_GROUPS))
    filters = {name: _arg(request, name) for name in ("key", "account", "model")
               if _arg(request, name) is not None}
    csv = wantsCSV(request)
    if csv is None:
        raise SeriesError("format", "format must be json or csv")
    return SeriesQuery(range_, bucket, groupBy, filters, csv)


def _emptyLog() -> dict:
    return {"requests": 0, "completed": 0, "failed": 0, "client_gone": 0, "failures": {}}


def _addLog(into: dict, point: dict) -> None:
    for name in ("requests", "completed", "failed", "client_gone"):
        into[name] += point.get(name, 0)
    for kind, n in point.get("failures", {}).items():
        into["failures"][kind] = into["failures"].get(kind, 0) + n


def _point(counts: TokenCounts, log: dict, kinds: list) -> dict:
    tokens = counts.asDict()
    out = {"requests": log["requests"], "completed": log["completed"], "failed": log["failed"],
           "failures": {kind: log["failures"].get(kind, 0) for kind in kinds
                        if log["failures"].get(kind)},
           "client_gone": log["client_gone"]}
    for name in _TOKEN_FIELDS:
        out[name] = tokens[name]
    out.update(cost_usd=tokens["cost_usd"], unpriced_requests=tokens["unpriced_requests"],
               estimated_requests=tokens["estimated_requests"],
               usage_requests=tokens["requests"])
    return out


def seriesAnswer(query: SeriesQuery, now: float, usage: dict, log: dict) -> dict:
    """
    The JSON answer from the two reads.

    @param usage: C{{(bucket, group): TokenCounts}}.
    @param log: C{{(bucket, group): log point}}.
    """
    since, until, buckets = query.bounds(now)
    groups = sorted({g for (_, g) in usage} | {g for (_, g) in log}, key=str)
    if query.groupBy == "none" and not groups:
        groups = [""]
    kinds = sorted({k for p in log.values() for k in p["failures"]})
    series, grand, grandLog = [], TokenCounts(), _emptyLog()
    for group in groups:
        points, total, totalLog = [], TokenCounts(), _emptyLog()
        for b in buckets:
            counts = usage.get((b, group), TokenCounts())
            logPoint = log.get((b, group), _emptyLog())
            total += counts
            _addLog(totalLog, logPoint)
            points.append(dict(time=b, **_point(counts, logPoint, kinds)))
        grand += total
        _addLog(grandLog, totalLog)
        series.append({"group": "all" if query.groupBy == "none" else group, "points": points,
                       "total": _point(total, totalLog, kinds)})
    series.sort(key=lambda s: (-s["total"]["cost_usd"], -s["total"]["total_tokens"],
                               -s["total"]["requests"], str(s["group"])))
    return {
        "range": query.range, "bucket": query.bucket, "bucket_seconds": query.bucketSeconds,
        "group_by": query.groupBy, "filters": query.filters, "since": since, "until": until,
        "now": now, "buckets": buckets, "series": series,
        "total": _point(grand, grandLog, kinds), "failure_kinds": kinds,
    }


def seriesCSV(answer: dict) -> tuple:
    """
    @return: C{(header, rows)}: one row per bucket and group with anything
        counted, oldest first.
    """
    import time

    kinds = answer["failure_kinds"]
    header = ["time_iso", "time", "group"] + list(_CSV_FIELDS) + ["failures_" + k for k in kinds]
    rows = []
    for index, b in enumerate(answer["buckets"]):
        for series in answer["series"]:
            point = series["points"][index]
            if not any(point[name] for name in _CSV_FIELDS):
                continue
            rows.append([time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(b)), b,
                         series["group"]] + [point[name] for name in _CSV_FIELDS]
                        + [point["failures"].get(k, 0) for k in kinds])
    return header, rows


def renderSeries(request, ledger: Any, log: Any, clock: Any):
    """
    Answer C{GET /admin/usage/series} (see the module docstring).

    @param ledger: the L{relay.usage.ledger.UsageLedger}.
    @param log: the L{relay.interfaces.IRequestLog}, or L{None} (then the
        turn counts are zero).
    """
    try:
        query = parseSeries(request)
    except SeriesError as e:
        return respond(request, 400, errorBody(str(e), "invalid_request_error",
                                               "invalid_value", e.param))
    now = clock.seconds()
    since, until, _ = query.bounds(now)

    async def read():
        usage = await ledger.series(since, until, query.bucketSeconds, query.groupBy,
                                    query.filters)
        counted = {}
        if log is not None:
            counted = await log.aggregate(since, until, query.bucketSeconds, query.groupBy,
                                          query.filters)
        return seriesAnswer(query, now, usage, counted)

    d = Deferred.fromCoroutine(read())
    if not query.csv:
        return deliverLater(request, d, lambda answer: (200, answer), "reading the usage series")
    return deliverCSV(request, d.addCallback(seriesCSV),
                      f"usage-{query.range}-{query.bucket}.csv", "reading the usage series")
