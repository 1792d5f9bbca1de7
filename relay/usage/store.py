# -*- test-case-name: tests.test_usage -*-
"""
Where hourly token totals live: three providers of
L{relay.interfaces.IUsageStore}.

  - L{SQLiteUsageStore}: the embedded default, a C{usage_hourly} table in
    the settings database (config.md C{database:}), on the settings
    store's single connection;
  - L{RedisUsageStore}: hashes in Redis (C{state.backend: redis}), so every
    relay process adds to the same totals and sees the same budgets;
  - L{MemoryUsageStore}: in the process only (no database configured;
    tests).

Rows are C{((hour, key, account, model), TokenCounts)}; hours are Unix
seconds at the start of a UTC hour.
"""

from __future__ import annotations

import calendar
import time
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.interfaces import IUsageStore
from relay.usage.tokens import TokenCounts

__all__ = [
    "GROUPS",
    "SERIES_GROUPS",
    "MemoryUsageStore",
    "RedisUsageStore",
    "SQLiteUsageStore",
    "dayStart",
    "hourOf",
    "monthStart",
    "nextMonthStart",
]

HOUR = 3600
DAY = 86400

GROUPS = ("key", "account", "model", "hour")
"""What totals may be grouped by."""


def hourOf(seconds: float) -> int:
    """
    @return: the start of the UTC hour holding C{seconds} (Unix seconds).
    """
    return int(seconds // HOUR) * HOUR


def dayStart(seconds: float) -> int:
    """
    @return: 00:00 UTC of the day holding C{seconds} (Unix seconds).
    """
    return int(seconds // DAY) * DAY


_months = (None, 0, 0)
"""The last day's C{(day index, monthStart, nextMonthStart)}: both are
functions of the UTC day alone, so a turn's reads of them cost a
comparison, not two C{gmtime}/C{timegm} pairs (one entry; replaced whole)."""


def _monthsOf(seconds: float) -> tuple:
    """
    @return: C{(day index, month start, next month start)} of the UTC day
        holding C{seconds} (L{monthStart}, L{nextMonthStart}).
    """
    global _months
    held = _months
    if held[0] == seconds // DAY:
        return held
    t = time.gmtime(seconds)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    held = _months = (seconds // DAY, calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)),
                      calendar.timegm((year, month, 1, 0, 0, 0)))
    return held


def monthStart(seconds: float) -> int:
    """
    @return: 00:00 UTC on the 1st of the month holding C{seconds}.
    """
    return _monthsOf(seconds)[1]


def nextMonthStart(seconds: float) -> int:
    """
    @return: 00:00 UTC on the 1st of the month after the one holding
        C{seconds}.
    """
    return _monthsOf(seconds)[2]


def _groupValue(groupBy: str, hour: int, key: str, account: str, model: str):
    return {"key": key, "account": account, "model": model, "hour": hour}[groupBy]


def _checkGroup(groupBy: str) -> None:
    if groupBy not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}")


SERIES_GROUPS = ("key", "account", "model", "none")
"""What a series may be grouped by (C{none}: one group, C{""})."""


def _checkSeries(bucket: int, groupBy: str, filters: dict) -> None:
    if groupBy not in SERIES_GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(SERIES_GROUPS)}")
    if bucket <= 0 or bucket % HOUR:
        raise ValueError("bucket must be a whole number of hours")
    for name in filters:
        if name not in ("key", "account", "model"):
            raise ValueError(f"unknown filter {name}")


def _seriesIdent(hour: int, key: str, account: str, model: str, bucket: int, groupBy: str,
                 filters: dict):
    """
    @return: the C{(bucket start, group)} a row adds to, or L{None} when
        the filters leave it out.
    """
    values = {"key": key, "account": account, "model": model}
    for name, wanted in filters.items():
        if values[name] != wanted:
            return None
    return hour // bucket * bucket, "" if groupBy == "none" else values[groupBy]


@implementer(IUsageStore)
@define(eq=False)
class MemoryUsageStore:
    """
    Totals in a dict, for one process (see L{IUsageStore}).

    @ivar rows: C{(hour, key, account, model)} -> L{TokenCounts}.
    """

    rows: dict = field(factory=dict)

    def add(self, rows) -> Deferred:
        """
        See L{IUsageStore.add}.
        """
        for ident, counts in rows:
            self.rows[ident] = self.rows.get(ident, TokenCounts()) + counts
        return succeed(None)

    def totals(self, since, groupBy) -> Deferred:
        """
        See L{IUsageStore.totals}.
        """
        _checkGroup(groupBy)
        since = hourOf(since)
        result: dict = {}
        for (hour, key, account, model), counts in self.rows.items():
            if hour >= since:
                group = _groupValue(groupBy, hour, key, account, model)
                result[group] = result.get(group, TokenCounts()) + counts
        return succeed(result)

    def series(self, since, until, bucket, groupBy, filters) -> Deferred:
        """
        See L{IUsageStore.series}: one pass over the rows.
        """
        _checkSeries(bucket, groupBy, filters)
        since = hourOf(since)
        result: dict = {}
        for (hour, key, account, model), counts in self.rows.items():
            if since <= hour < until:
                ident = _seriesIdent(hour, key, account, model, bucket, groupBy, filters)
                if ident is not None:
                    result[ident] = result.get(ident, TokenCounts()) + counts
        return succeed(result)

    def budgetTotals(self, dayStart, monthStart) -> Deferred:
        """
        See L{IUsageStore.budgetTotals}.
        """
        return succeed(self._sums(dayStart, monthStart, lambda c: c.total))

    def costTotals(self, dayStart, monthStart) -> Deferred:
        """
        See L{IUsageStore.costTotals}.
        """
        return succeed(self._sums(dayStart, monthStart, lambda c: c.cost))

    def _sums(self, dayStart, monthStart, value) -> tuple:
        day: dict = {}
        month: dict = {}
        for (hour, key, _account, _model), counts in self.rows.items():
            if hour >= monthStart:
                month[key] = month.get(key, 0) + value(counts)
            if hour >= dayStart:
                day[key] = day.get(key, 0) + value(counts)
        return day, month


_SQL_CREATE = (
    "CREATE TABLE IF NOT EXISTS usage_hourly ("
    " hour INTEGER NOT NULL, key TEXT NOT NULL, account TEXT NOT NULL,"
    " model TEXT NOT NULL, requests INTEGER NOT NULL, input INTEGER NOT NULL,"
    " cached INTEGER NOT NULL, output INTEGER NOT NULL, reasoning INTEGER NOT NULL,"
    " cost INTEGER NOT NULL DEFAULT 0, unpriced INTEGER NOT NULL DEFAULT 0,"
    " estimated INTEGER NOT NULL DEFAULT 0,"
    " PRIMARY KEY (hour, key, account, model))"
)

_SQL_MONEY_COLUMNS = (
    ("cost", "ALTER TABLE usage_hourly ADD COLUMN cost INTEGER NOT NULL DEFAULT 0"),
    ("unpriced", "ALTER TABLE usage_hourly ADD COLUMN unpriced INTEGER NOT NULL DEFAULT 0"),
    ("estimated", "ALTER TABLE usage_hourly ADD COLUMN estimated INTEGER NOT NULL DEFAULT 0"),
)
"""The money columns (and R107's estimated turns), added to a table
an older relay created."""

_SQL_ADD = (
    "INSERT INTO usage_hourly"
    " (hour, key, account, model, requests, input, cached, output, reasoning, cost, unpriced,"
    " estimated)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (hour, key, account, model) DO UPDATE SET"
    " requests = requests + excluded.requests, input = input + excluded.input,"
    " cached = cached + excluded.cached, output = output + excluded.output,"
    " reasoning = reasoning + excluded.reasoning, cost = cost + excluded.cost,"
    " unpriced = unpriced + excluded.unpriced, estimated = estimated + excluded.estimated"
)

_SQL_SUMS = (
    "SUM(requests), SUM(input), SUM(cached), SUM(output), SUM(reasoning), SUM(cost),"
    " SUM(unpriced), SUM(estimated)"
)


@implementer(IUsageStore)
@define(eq=False)
class SQLiteUsageStore:
    """
    Totals in the C{usage_hourly} table of the settings database (see
    L{IUsageStore}); created on first use (C{CREATE TABLE IF NOT EXISTS}),
    so it needs no settings schema version.

    @ivar database: the L{relay.state.settingsdb.SQLiteSettingsStore} whose
        connection (and file) this store shares.
    @ivar retentionDays: rows older than this (before the newest hour
        added) are deleted when rows are added.
    """

    database: Any
    retentionDays: int = 400
    _ready: bool = field(default=False, init=False)

    def _run(self, interaction, *args) -> Deferred:
        def _withTable(txn, *a):
            if not self._ready:
                txn.execute(_SQL_CREATE)
                txn.execute("PRAGMA table_info(usage_hourly)")
                present = {row[1] for row in txn.fetchall()}
                for column, alter in _SQL_MONEY_COLUMNS:
                    if column not in present:
                        txn.execute(alter)
            return interaction(txn, *a)

        def _cbReady(result):
            self._ready = True
            return result

        return self.database.runInteraction(_withTable, *args).addCallback(_cbReady)

    def add(self, rows) -> Deferred:
        """
        See L{IUsageStore.add}: one transaction of upserts (and the
        retention cut).
        """
        values = [
            (hour, key, account, model, c.requests, c.input, c.cached, c.output, c.reasoning,
             c.cost, c.unpriced, c.estimated)
            for (hour, key, account, model), c in rows
        ]

        cutoff = max((v[0] for v in values), default=0) - self.retentionDays * DAY

        def _add(txn):
            txn.executemany(_SQL_ADD, values)
            txn.execute("DELETE FROM usage_hourly WHERE hour < ?", (cutoff,))

        return self._run(_add).addCallback(lambda _: None)

    def totals(self, since, groupBy) -> Deferred:
        """
        See L{IUsageStore.totals}.
        """
        _checkGroup(groupBy)
        column = groupBy  # whitelisted above: key, account, model or hour

        def _totals(txn):
            txn.execute(
                f"SELECT {column}, {_SQL_SUMS} FROM usage_hourly WHERE hour >= ?"
                f" GROUP BY {column}",
                (hourOf(since),),
            )
            return {row[0]: TokenCounts(*(int(v or 0) for v in row[1:])) for row in txn.fetchall()}

        return self._run(_totals)

    def series(self, since, until, bucket, groupBy, filters) -> Deferred:
        """
        See L{IUsageStore.series}: one C{GROUP BY} query.
        """
        _checkSeries(bucket, groupBy, filters)
        column = "''" if groupBy == "none" else groupBy  # whitelisted above
        where, args = ["hour >= ?", "hour < ?"], [hourOf(since), until]
        for name in ("key", "account", "model"):
            if name in filters:
                where.append(f"{name} = ?")
                args.append(filters[name])

        def _series(txn):
            txn.execute(
                f"SELECT (hour / {int(bucket)}) * {int(bucket)} AS b, {column} AS g,"
                f" {_SQL_SUMS} FROM usage_hourly WHERE {' AND '.join(where)}"
                f" GROUP BY b, g",
                args,
            )
            return {(int(row[0]), row[1]): TokenCounts(*(int(v or 0) for v in row[2:]))
                    for row in txn.fetchall()}

        return self._run(_series)

    def budgetTotals(self, dayStart, monthStart) -> Deferred:
        """
        See L{IUsageStore.budgetTotals}.
        """

        return self._run(self._sums, "SUM(input) + SUM(output)", dayStart, monthStart)

    def costTotals(self, dayStart, monthStart) -> Deferred:
        """
        See L{IUsageStore.costTotals}.
        """
        return self._run(self._sums, "SUM(cost)", dayStart, monthStart)

    @staticmethod
    def _sums(txn, expression, dayStart, monthStart):
        out = []
        for since in (dayStart, monthStart):
            txn.execute(
                f"SELECT key, {expression} FROM usage_hourly WHERE hour >= ? GROUP BY key",
                (since,),
            )
            out.append({key: int(total or 0) for key, total in txn.fetchall()})
        return tuple(out)


# Adds rows. KEYS: per row its hour hash, day hash and month hash. ARGV: the
# hour, day and month TTLs, then per row: the "key\taccount\tmodel" field,
# the key name, requests, input, cached, output, reasoning, cost (nano-USD)
# unpriced requests and estimated requests (R107). The day and month hashes hold tokens per key name
# and, under "$\t<key>", the cost.
_REDIS_ADD = """
local rows = (#ARGV - 3) / 10
for i = 0, rows - 1 do
  local h, d, m = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local a = 3 + 10 * i
  local f = ARGV[a + 1]
  redis.call('HINCRBY', h, 'r\\t' .. f, ARGV[a + 3])
  redis.call('HINCRBY', h, 'i\\t' .. f, ARGV[a + 4])
  redis.call('HINCRBY', h, 'c\\t' .. f, ARGV[a + 5])
  redis.call('HINCRBY', h, 'o\\t' .. f, ARGV[a + 6])
  redis.call('HINCRBY', h, 'x\\t' .. f, ARGV[a + 7])
  if ARGV[a + 8] ~= '0' then redis.call('HINCRBY', h, 'u\\t' .. f, ARGV[a + 8]) end
  if ARGV[a + 9] ~= '0' then redis.call('HINCRBY', h, 'n\\t' .. f, ARGV[a + 9]) end
  if ARGV[a + 10] ~= '0' then redis.call('HINCRBY', h, 'e\\t' .. f, ARGV[a + 10]) end
  local total = tonumber(ARGV[a + 4]) + tonumber(ARGV[a + 6])
  redis.call('HINCRBY', d, ARGV[a + 2], total)
  redis.call('HINCRBY', m, ARGV[a + 2], total)
  if ARGV[a + 8] ~= '0' then
    redis.call('HINCRBY', d, '$\\t' .. ARGV[a + 2], ARGV[a + 8])
    redis.call('HINCRBY', m, '$\\t' .. ARGV[a + 2], ARGV[a + 8])
  end
  redis.call('EXPIRE', h, ARGV[1])
  redis.call('EXPIRE', d, ARGV[2])
  redis.call('EXPIRE', m, ARGV[3])
end
return rows
"""

# Reads hour hashes. KEYS: the hour hashes; returns {key, {field, value, ...}}
# pairs for those that exist.
_REDIS_READ = """
local out = {}
for _, k in ipairs(KEYS) do
  local v = redis.call('HGETALL', k)
  if #v > 0 then
    out[#out + 1] = k
    out[#out + 1] = v
  end
end
return out
"""

_METRICS = {"r": "requests", "i": "input", "c": "cached", "o": "output", "x": "reasoning",
            "u": "cost", "n": "unpriced", "e": "estimated"}

_COST_FIELD = "$\t"
"""Prefix of the cost fields in the day and month hashes."""


def _clean(text: str) -> str:
    """
    A name safe inside a tab-separated Redis field.
    """
    return str(text).replace("\t", " ")


def _number(value) -> int:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@implementer(IUsageStore)
@define(eq=False)
class RedisUsageStore:
    """
    Totals in Redis (see L{IUsageStore}), shared by every relay process:

      - C{<prefix>:h:<hour>}: a hash per hour, field
        C{<metric>\\t<key>\\t<account>\\t<model>} (metric C{r} requests,
        C{i} input, C{c} cached, C{o} output, C{x} reasoning), kept for
        C{retentionDays};
      - C{<prefix>:d:<day start>} and C{<prefix>:m:<month start>}: tokens
        per key name, for budgets.

    Every call is one C{EVAL} or C{HGETALL} bounded by C{timeout} on the
    injected clock (style.md pattern d).

    @ivar redis: a L{relay.wire.redisclient.RedisService} (or anything with its
        C{execute(timeout, method, *args)}).
    @ivar clock: the L{IReactorTime} (for C{totals}' last hour).
    @ivar prefix: the key prefix.
    @ivar retentionDays: how long hourly totals are kept.
    @ivar timeout: seconds per Redis call.
    """

    redis: Any
    clock: IReactorTime
    prefix: str = "relay:usage"
    retentionDays: int = 400
    timeout: float = 5.0

    def _hourKey(self, hour: int) -> str:
        return f"{self.prefix}:h:{hour}"

    def add(self, rows) -> Deferred:
        """
        See L{IUsageStore.add}: one C{EVAL}.
        """
        rows = list(rows)
        if not rows:
            return succeed(None)
        keys: list = []
        args: list = [
            str(self.retentionDays * DAY),
            str(2 * DAY + HOUR),
            str(32 * DAY + HOUR),
        ]
        for (hour, key, account, model), c in rows:
            keys += [
                self._hourKey(hour),
                f"{self.prefix}:d:{dayStart(hour)}",
                f"{self.prefix}:m:{monthStart(hour)}",
            ]
            args += [
                f"{_clean(key)}\t{_clean(account)}\t{_clean(model)}",
                _clean(key),
                str(c.requests), str(c.input), str(c.cached), str(c.output), str(c.reasoning),
                str(c.cost), str(c.unpriced), str(c.estimated),
            ]
        d = self.redis.execute(self.timeout, "eval", _REDIS_ADD, keys, args)
        return d.addCallback(lambda _: None)

    def totals(self, since, groupBy) -> Deferred:
        """
        See L{IUsageStore.totals}: one C{EVAL} over the hour hashes from
        C{since} (at most C{retentionDays} back) to now.
        """
        _checkGroup(groupBy)
        return self._sumHours(
            since, self.clock.seconds() + HOUR,
            lambda hour, key, account, model: _groupValue(groupBy, hour, key, account, model))

    def series(self, since, until, bucket, groupBy, filters) -> Deferred:
        """
        See L{IUsageStore.series}: one C{EVAL} over the hour hashes of the
        range (at most C{retentionDays} back), summed here.
        """
        _checkSeries(bucket, groupBy, filters)
        return self._sumHours(
            since, until,
            lambda hour, key, account, model: _seriesIdent(hour, key, account, model, bucket,
                                                           groupBy, filters))

    def _sumHours(self, since, until, identOf) -> Deferred:
        """
        Read the hour hashes of C{[since, until)} (not past now) in one
        C{EVAL} and sum their fields per C{identOf(hour, key, account,
        model)} (L{None} leaves a field out).
        """
        last = min(hourOf(self.clock.seconds()), hourOf(until - 1))
        first = max(hourOf(since), last - self.retentionDays * DAY)
        keys = [self._hourKey(h) for h in range(first, last + HOUR, HOUR)]
        if not keys:
            return succeed({})
        d = self.redis.execute(self.timeout, "eval", _REDIS_READ, keys, [])

        def _cbSum(reply):
            result: dict = {}
            reply = list(reply or [])
            for name, flat in zip(reply[0::2], reply[1::2]):
                hour = _number(_text(name).rsplit(":", 1)[-1])
                flat = list(flat)
                for fieldName, value in zip(flat[0::2], flat[1::2]):
                    parts = _text(fieldName).split("\t")
                    if len(parts) != 4 or parts[0] not in _METRICS:
                        continue
                    metric, key, account, model = parts
                    group = identOf(hour, key, account, model)
                    if group is None:
                        continue
                    counts = result.get(group, TokenCounts())
                    result[group] = counts + TokenCounts(**{_METRICS[metric]: _number(value)})
            return result

        return d.addCallback(_cbSum)

    def budgetTotals(self, dayStart, monthStart) -> Deferred:
        """
        See L{IUsageStore.budgetTotals}: one C{EVAL} reading both hashes.
        """
        return self._periodTotals(dayStart, monthStart, cost=False)

    def costTotals(self, dayStart, monthStart) -> Deferred:
        """
        See L{IUsageStore.costTotals}: one C{EVAL} reading both hashes'
        cost fields.
        """
        return self._periodTotals(dayStart, monthStart, cost=True)

    def _periodTotals(self, dayStart, monthStart, cost: bool) -> Deferred:
        keys = [f"{self.prefix}:d:{dayStart}", f"{self.prefix}:m:{monthStart}"]
        d = self.redis.execute(self.timeout, "eval", _REDIS_READ, keys, [])

        def _cbTotals(reply):
            found = {}
            reply = list(reply or [])
            for name, flat in zip(reply[0::2], reply[1::2]):
                flat = list(flat)
                values = {}
                for k, v in zip(flat[0::2], flat[1::2]):
                    k = _text(k)
                    if k.startswith(_COST_FIELD) == cost:
                        values[k[len(_COST_FIELD):] if cost else k] = _number(v)
                found[_text(name)] = values
            return found.get(keys[0], {}), found.get(keys[1], {})

        return d.addCallback(_cbTotals)
