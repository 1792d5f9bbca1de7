# -*- test-case-name: tests.test_tenants_logseries -*-
"""
The request log summed over time: turns per time bucket and group, by
outcome and failure kind, for the usage charts
(L{relay.interfaces.IRequestLog.aggregate}).

Each provider reads once for the whole range: SQLite in one C{GROUP BY}
query (the kind and the account read from the stored JSON), the memory log
in one pass over its records, the Redis stream in one forward scan of the
range (batched C{XRANGE}; the stream is capped by
C{request_log.max_records}).

A point is C{{"requests", "completed", "failed", "client_gone",
"failures": {kind: n}}}: C{failed} counts outcomes C{failed} and
C{error}, C{client_gone} counts C{client_gone} and C{relay_cancelled}; a
failure's kind is the turn's C{error_code}, else its last attempt's
reason, else C{unknown}. A turn's account is the one that served it, else
the last one tried, else C{""}.
"""

from __future__ import annotations

import json
from typing import Optional

__all__ = [
    "AGGREGATE_GROUPS", "addTo", "aggregateRecords", "emptyPoint", "redisAggregate",
    "sqliteAggregate",
]

AGGREGATE_GROUPS = ("key", "account", "model", "none")
"""What the log may be grouped by (C{none}: one group, C{""})."""

_FAILED = ("failed", "error")
_GONE = ("client_gone", "relay_cancelled")


def emptyPoint() -> dict:
    """
    @return: a point with nothing counted.
    """
    return {"requests": 0, "completed": 0, "failed": 0, "client_gone": 0, "failures": {}}


def addTo(point: dict, outcome: str, kind: Optional[str], n: int = 1) -> None:
    """
    Count C{n} turns of C{outcome} (failure C{kind}) into C{point}.
    """
    point["requests"] += n
    if outcome == "completed":
        point["completed"] += n
    elif outcome in _FAILED:
        point["failed"] += n
        kind = kind or "unknown"
        point["failures"][kind] = point["failures"].get(kind, 0) + n
    elif outcome in _GONE:
        point["client_gone"] += n


def check(bucket: int, groupBy: str, filters: dict) -> None:
    """
    @raise ValueError: an unknown group or filter, or a bucket that is
        not a positive whole number of seconds.
    """
    if groupBy not in AGGREGATE_GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(AGGREGATE_GROUPS)}")
    if int(bucket) != bucket or bucket <= 0:
        raise ValueError("bucket must be a positive number of seconds")
    for name in filters:
        if name not in ("key", "account", "model"):
            raise ValueError(f"unknown filter {name}")


def _kindOf(error_code, attempts) -> Optional[str]:
    if error_code:
        return str(error_code)
    for attempt in reversed(attempts or ()):
        reason = attempt.reason if hasattr(attempt, "reason") else attempt.get("reason")
        if reason and reason != "ok":
            return str(reason)
    return None


def aggregateRecords(records, since: float, until: float, bucket: int, groupBy: str,
                     filters: dict, out: Optional[dict] = None) -> dict:
    """
    Sum records (L{relay.tenants.record.TurnRecord}s) in one pass.

    @param out: the points to add to (a batch after another), or L{None}.
    @return: C{{(bucket start, group): point}} (C{out} when given).
    """
    check(bucket, groupBy, filters)
    out = {} if out is None else out
    for record in records:
        if not since <= record.time < until:
            continue
        accounts = record.accounts
        if "key" in filters and record.key != filters["key"]:
            continue
        if "model" in filters and (record.model or "") != filters["model"]:
            continue
        if "account" in filters and filters["account"] not in accounts:
            continue
        values = {"key": record.key, "model": record.model or "",
                  "account": record.account or (accounts[-1] if accounts else "")}
        ident = (int(record.time // bucket * bucket),
                 "" if groupBy == "none" else values[groupBy])
        point = out.get(ident)
        if point is None:
            point = out[ident] = emptyPoint()
        addTo(point, record.outcome, _kindOf(record.error_code, record.attempts)
              if record.outcome in _FAILED else None)
    return out


_SQL_GROUP = {
    "key": "key",
    "model": "COALESCE(model, '')",
    "account": "COALESCE(json_extract(data, '$.account'),"
               " json_extract(data, '$.accounts[#-1]'), '')",
    "none": "''",
}

_SQL_KIND = (
    "CASE WHEN outcome IN ('failed', 'error') THEN COALESCE("
    "NULLIF(json_extract(data, '$.error_code'), ''),"
    " NULLIF(NULLIF(json_extract(data, '$.attempts[#-1].reason'), 'ok'), '')) END"
)


def sqliteAggregate(since: float, until: float, bucket: int, groupBy: str,
                    filters: dict) -> tuple:
    """
    The one query of the SQLite log's aggregate.

    @return: C{(sql, args)}; its rows are C{(bucket start, group, outcome,
        kind, count)}.
    """
    check(bucket, groupBy, filters)
    where, args = ["time >= ?", "time < ?"], [since, until]
    if "key" in filters:
        where.append("key = ?")
        args.append(filters["key"])
    if "model" in filters:
        where.append("COALESCE(model, '') = ?")
        args.append(filters["model"])
    if "account" in filters:
        where.append("instr(accounts, ?) > 0")
        args.append("," + filters["account"] + ",")
    b = int(bucket)
    sql = (f"SELECT CAST(time / {b} AS INTEGER) * {b} AS b, {_SQL_GROUP[groupBy]} AS g,"
           f" outcome, {_SQL_KIND} AS kind, COUNT(*) FROM request_log"
           f" WHERE {' AND '.join(where)} GROUP BY b, g, outcome, kind")
    return sql, args


def fromRows(rows) -> dict:
    """
    @param rows: L{sqliteAggregate}'s rows.
    @return: C{{(bucket start, group): point}}.
    """
    out: dict = {}
    for b, g, outcome, kind, n in rows:
        point = out.get((int(b), g))
        if point is None:
            point = out[(int(b), g)] = emptyPoint()
        addTo(point, outcome, kind, int(n))
    return out


def decodeAll(entries) -> list:
    """
    Records from Redis stream entries (what L{aggregateRecords} reads).
    """
    from relay.tenants.record import fromDict

    out = []
    for _streamId, fields in entries:
        fields = list(fields)
        for name, value in zip(fields[0::2], fields[1::2]):
            if _text(name) == "r":
                try:
                    out.append(fromDict(json.loads(_text(value))))
                except ValueError:
                    pass
    return out


async def redisAggregate(log, since: float, until: float, bucket: int, groupBy: str,
                         filters: dict) -> dict:
    """
    The Redis log's aggregate: one forward scan of the range's stream ids
    (batched C{XRANGE}), summed batch by batch.

    @param log: the L{relay.tenants.requestlog.RedisRequestLog}.
    """
    check(bucket, groupBy, filters)
    start, end = str(int(since * 1000)), str(int((until + log.slack) * 1000))
    out: dict = {}
    while True:
        entries = list(await log.redis.execute(
            log.timeout, "execute_command", "XRANGE", log.stream, start, end,
            "COUNT", str(log.batch)) or [])
        aggregateRecords(decodeAll(entries), since, until, bucket, groupBy, filters, out)
        if len(entries) < log.batch:
            return out
        start = "(" + _text(entries[-1][0])


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
