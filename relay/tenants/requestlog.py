# -*- test-case-name: tests.test_tenants_requestlog -*-
"""
Where the per-turn records live: three providers of
L{relay.interfaces.IRequestLog}, bounded by count (C{request_log.max_records})
and by age (C{request_log.retention_days}).

  - L{SQLiteRequestLog}: the embedded default, a C{request_log} table in the
    settings database (config.md C{database:}), on the settings store's
    single connection; indexed by request id, time, key, model and outcome;
  - L{RedisRequestLog}: with C{state.backend: redis}, a capped Redis stream
    (C{XADD ... MAXLEN}, C{XTRIM MINID} for the age) that every relay
    process appends to, plus a per-request-id index key (expiring with the
    age bound), so any process answers a query for any turn;
  - L{MemoryRequestLog}: a bounded deque in the process (no database).

The engine calls L{IRequestLog.add} once per turn (an append to a list); a
timer (L{RequestLogService}) writes the buffer every
C{request_log.flush_interval_seconds} and a query flushes first, so a query
sees every finished turn. A store that cannot be written keeps at most
L{MAX_BUFFER} records for the next flush (the oldest are dropped, logged).

Queries (L{RequestQuery}) filter by key, account (any account the turn
tried), model, outcome, a time range, a request id and the client's
request id (R111: C{client_request_id}, which many turns may share, of
several keys); a WebSocket connection's id (C{ws_...}) also finds its
turns (C{ws_...:1}, C{:2}, ...). Answers are newest first, paged by an
opaque cursor.

Records are keyed by relay's request id (R111), unique per turn. A
C{request_log} table written before R111 gains its C{client_request_id}
column (and index) when the log first opens it (L{_SQL_MIGRATE}); the Redis
stream's entries carry the field in their JSON and the id in an index list
per client id (C{<stream>:cid:<id>}, expiring with the age bound).
"""

from __future__ import annotations

import json
import random
from collections import deque
from typing import Any, Optional

from attrs import define, field, frozen
from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IRequestLog
from relay.tenants import logseries
from relay.tenants.record import TurnRecord, fromDict

__all__ = [
    "MAX_BUFFER",
    "MemoryRequestLog",
    "RedisRequestLog",
    "RequestLogService",
    "RequestQuery",
    "SQLiteRequestLog",
]

MAX_BUFFER = 50_000
"""Records kept for the next flush at most while the store is unwritable."""

DAY = 86400


@frozen
class RequestQuery:
    """
    What C{GET /admin/requests} filters by; L{None} means any.

    @ivar key: a client key name.
    @ivar account: an account id the turn tried (any attempt).
    @ivar model: the client model name.
    @ivar outcome: C{completed}, C{failed}, C{client_gone}, C{error} or
        C{relay_cancelled}.
    @ivar since: Unix seconds, inclusive.
    @ivar until: Unix seconds, exclusive.
    @ivar request_id: a turn's id, or a WebSocket connection's (its turns).
    @ivar client_request_id: the id the client sent (R111), exactly.
    """

    key: Optional[str] = None
    account: Optional[str] = None
    model: Optional[str] = None
    outcome: Optional[str] = None
    since: Optional[float] = None
    until: Optional[float] = None
    request_id: Optional[str] = None
    client_request_id: Optional[str] = None

    def matches(self, record: TurnRecord) -> bool:
        """
        @return: whether C{record} passes every filter.
        """
        if self.request_id is not None and not (
            record.request_id == self.request_id
            or record.request_id.startswith(self.request_id + ":")
        ):
            return False
        if (self.client_request_id is not None
                and record.client_request_id != self.client_request_id):
            return False
        if self.key is not None and record.key != self.key:
            return False
        if self.model is not None and record.model != self.model:
            return False
        if self.outcome is not None and record.outcome != self.outcome:
            return False
        if self.account is not None and self.account not in record.accounts:
            return False
        if self.since is not None and record.time < self.since:
            return False
        if self.until is not None and record.time >= self.until:
            return False
        return True


@define(eq=False)
class _Buffered:
    """
    The buffering shared by the stores: L{add} appends; L{flush} writes.

    @ivar clock: the injected L{IReactorTime}.
    @ivar maxRecords: the count bound.
    @ivar retentionDays: the age bound.
    @ivar sampleRate: the fraction of turns sampled for debugging.
    @ivar random: the L{random.Random} that draws samples.
    """

    clock: Any
    maxRecords: int = 100_000
    retentionDays: float = 7
    sampleRate: float = 0.0
    sampleMaxBytes: int = 16384
    random: random.Random = field(factory=random.Random)
    _buffer: list = field(factory=list)
    _flushing: Optional[Deferred] = None
    dropped: int = 0
    _log = Logger()

    def sampled(self) -> bool:
        """
        Whether the turn starting now keeps its body and output (debug
        sampling, C{request_log.sample_rate}; never when it is 0).
        """
        return self.sampleRate > 0 and self.random.random() < self.sampleRate

    def add(self, record: TurnRecord) -> None:
        """
        See L{IRequestLog.add}.
        """
        self._buffer.append(record)
        if len(self._buffer) > MAX_BUFFER:
            extra = len(self._buffer) - MAX_BUFFER
            del self._buffer[:extra]
            self.dropped += extra
            self._log.error(
                "request log buffer full; {count} oldest record(s) dropped",
                event="relay.request_log_dropped", count=extra,
            )

    def flush(self) -> Deferred:
        """
        See L{IRequestLog.flush}. Concurrent calls share one write.
        """
        if self._flushing is not None:
            d = Deferred()
            self._flushing.addBoth(lambda r: (d.callback(None), r)[1])
            return d
        if not self._buffer:
            return succeed(None)
        records, self._buffer = self._buffer, []
        self._flushing = Deferred.fromCoroutine(self._write(records))

        def _done(result):
            self._flushing = None

        return self._flushing.addBoth(_done)

    async def _write(self, records: list) -> None:
        try:
            await self._store(records)
        except Exception as e:  # noqa: BLE001 - logged; records kept
            self._buffer[:0] = records
            if len(self._buffer) > MAX_BUFFER:
                extra = len(self._buffer) - MAX_BUFFER
                del self._buffer[:extra]
                self.dropped += extra
            self._log.error(
                "writing {count} request record(s) failed ({error}); kept for the next flush",
                event="relay.request_log_flush_failed", count=len(records), error=repr(e),
            )

    async def _store(self, records: list) -> None:
        raise NotImplementedError

    def _cutoff(self) -> float:
        return self.clock.seconds() - self.retentionDays * DAY

    def query(self, filters: RequestQuery, limit: int, cursor: Optional[str]) -> Deferred:
        """
        See L{IRequestLog.query}: flush, then read.
        """
        async def _query():
            await self.flush()
            return await self._read(filters, max(1, limit), cursor)

        return Deferred.fromCoroutine(_query())

    def aggregate(self, since: float, until: float, bucket: int, groupBy: str,
                  filters: dict) -> Deferred:
        """
        See L{IRequestLog.aggregate}: flush, then one read
        (L{relay.tenants.logseries}).
        """
        async def _aggregate():
            await self.flush()
            return await self._aggregate(since, until, bucket, groupBy, dict(filters))

        return Deferred.fromCoroutine(_aggregate())


@implementer(IRequestLog)
@define(eq=False)
class MemoryRequestLog(_Buffered):
    """
    Records in a bounded deque of this process (see the module docstring).
    """

    _records: deque = field(factory=deque)
    _seq: int = 0

    def add(self, record: TurnRecord) -> None:
        """
        See L{IRequestLog.add}: kept at once (nothing to write).
        """
        self._seq += 1
        record.seq = str(self._seq)
        self._records.append(record)
        while len(self._records) > self.maxRecords:
            self._records.popleft()

    def flush(self) -> Deferred:
        """
        See L{IRequestLog.flush}: applies the age bound.
        """
        cutoff = self._cutoff()
        while self._records and self._records[0].time < cutoff:
            self._records.popleft()
        return succeed(None)

    async def _aggregate(self, since, until, bucket, groupBy, filters) -> dict:
        return logseries.aggregateRecords(self._records, since, until, bucket, groupBy, filters)

    async def _read(self, filters, limit, cursor):
        before = int(cursor) if cursor else None
        found = []
        for record in reversed(self._records):
            if before is not None and int(record.seq) >= before:
                continue
            if filters.matches(record):
                found.append(record)
                if len(found) > limit:
                    break
        more = len(found) > limit
        found = found[:limit]
        return found, (found[-1].seq if more and found else None)


_SQL_CREATE = (
    "CREATE TABLE IF NOT EXISTS request_log ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, request_id TEXT NOT NULL,"
    " key TEXT NOT NULL, accounts TEXT NOT NULL, model TEXT, outcome TEXT NOT NULL,"
    " status INTEGER NOT NULL, data TEXT NOT NULL, client_request_id TEXT)",
    "CREATE INDEX IF NOT EXISTS request_log_request_id ON request_log (request_id)",
    "CREATE INDEX IF NOT EXISTS request_log_time ON request_log (time)",
    "CREATE INDEX IF NOT EXISTS request_log_key ON request_log (key, seq)",
    "CREATE INDEX IF NOT EXISTS request_log_model ON request_log (model, seq)",
    "CREATE INDEX IF NOT EXISTS request_log_outcome ON request_log (outcome, seq)",
)

_SQL_MIGRATE = (
    "ALTER TABLE request_log ADD COLUMN client_request_id TEXT",
)
"""R111: what a table written before the C{client_request_id} column needs
(run when the column is missing)."""

_SQL_INDEX_CLIENT = (
    "CREATE INDEX IF NOT EXISTS request_log_client_request_id"
    " ON request_log (client_request_id, seq)"
)

_SQL_INSERT = (
    "INSERT INTO request_log (time, request_id, key, accounts, model, outcome, status, data,"
    " client_request_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


@implementer(IRequestLog)
@define(eq=False)
class SQLiteRequestLog(_Buffered):
    """
    Records in the C{request_log} table of the settings database (see the
    module docstring); created on first use.

    @ivar database: the L{relay.state.settingsdb.SQLiteSettingsStore} whose
        single connection (and file) this log shares.
    """

    database: Any = None
    _ready: bool = False

    def _run(self, interaction, *args) -> Deferred:
        def _withTable(txn, *a):
            if not self._ready:
                for statement in _SQL_CREATE:
                    txn.execute(statement)
                txn.execute("PRAGMA table_info(request_log)")
                if "client_request_id" not in {row[1] for row in txn.fetchall()}:
                    for statement in _SQL_MIGRATE:
                        txn.execute(statement)
                txn.execute(_SQL_INDEX_CLIENT)
            return interaction(txn, *a)

        def _cbReady(result):
            self._ready = True
            return result

        return self.database.runInteraction(_withTable, *args).addCallback(_cbReady)

    async def _store(self, records: list) -> None:
        rows = [
            (r.time, r.request_id, r.key, "," + ",".join(r.accounts) + ",", r.model, r.outcome,
             r.status, r.toJSON(), r.client_request_id)
            for r in records
        ]
        cutoff, keep = self._cutoff(), self.maxRecords

        def _insert(txn):
            txn.executemany(_SQL_INSERT, rows)
            txn.execute("DELETE FROM request_log WHERE time < ?", (cutoff,))
            txn.execute(
                "DELETE FROM request_log WHERE seq <= (SELECT MAX(seq) FROM request_log) - ?",
                (keep,),
            )

        await self._run(_insert)

    async def _aggregate(self, since, until, bucket, groupBy, filters) -> dict:
        sql, args = logseries.sqliteAggregate(since, until, bucket, groupBy, filters)

        def _select(txn):
            txn.execute(sql, args)
            return txn.fetchall()

        return logseries.fromRows(await self._run(_select))

    async def _read(self, filters: RequestQuery, limit: int, cursor):
        where, args = [], []
        if filters.request_id is not None:
            rid = filters.request_id
            where.append("(request_id = ? OR (request_id >= ? AND request_id < ?))")
            args += [rid, rid + ":", rid + ";"]
        for column in ("client_request_id", "key", "model", "outcome"):
            value = getattr(filters, column)
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if filters.account is not None:
            where.append("instr(accounts, ?) > 0")
            args.append("," + filters.account + ",")
        if filters.since is not None:
            where.append("time >= ?")
            args.append(filters.since)
        if filters.until is not None:
            where.append("time < ?")
            args.append(filters.until)
        if cursor:
            where.append("seq < ?")
            args.append(int(cursor))
        sql = "SELECT seq, data FROM request_log"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        args.append(limit + 1)

        def _select(txn):
            txn.execute(sql, args)
            return txn.fetchall()

        rows = await self._run(_select)
        records = [fromDict(json.loads(data), str(seq)) for seq, data in rows[:limit]]
        more = len(rows) > limit
        return records, (records[-1].seq if more and records else None)


# Appends records. KEYS[1] the stream. ARGV: max records, index TTL seconds,
# the age bound's MINID, then per record: its request id, its connection
# prefix ('' for none), its JSON and its client request id ('' for none,
# R111: indexed in a list per client id, as a connection's turns are).
_REDIS_ADD = """
local stream = KEYS[1]
for i = 4, #ARGV, 4 do
  local id = redis.call('XADD', stream, 'MAXLEN', ARGV[1], '*', 'r', ARGV[i + 2])
  redis.call('SET', stream .. ':id:' .. ARGV[i], id, 'EX', ARGV[2])
  if ARGV[i + 1] ~= '' then
    local conn = stream .. ':conn:' .. ARGV[i + 1]
    redis.call('RPUSH', conn, id)
    redis.call('LTRIM', conn, -1000, -1)
    redis.call('EXPIRE', conn, ARGV[2])
  end
  if ARGV[i + 3] ~= '' then
    local cid = stream .. ':cid:' .. ARGV[i + 3]
    redis.call('RPUSH', cid, id)
    redis.call('LTRIM', cid, -1000, -1)
    redis.call('EXPIRE', cid, ARGV[2])
  end
end
redis.call('XTRIM', stream, 'MINID', ARGV[3])
return (#ARGV - 3) / 4
"""

# Finds a request id's records. KEYS[1] the stream. ARGV[1] the id, ARGV[2]
# 'cid' to find a client request id's records instead (R111).
# Returns {stream id, fields, ...}.
_REDIS_BY_ID = """
local stream = KEYS[1]
local ids = {}
if ARGV[2] == 'cid' then
  for _, id in ipairs(redis.call('LRANGE', stream .. ':cid:' .. ARGV[1], 0, -1)) do
    ids[#ids + 1] = id
  end
else
  local one = redis.call('GET', stream .. ':id:' .. ARGV[1])
  if one then ids[#ids + 1] = one end
  for _, id in ipairs(redis.call('LRANGE', stream .. ':conn:' .. ARGV[1], 0, -1)) do
    ids[#ids + 1] = id
  end
end
local out = {}
for _, id in ipairs(ids) do
  local found = redis.call('XRANGE', stream, id, id)
  if #found > 0 then
    out[#out + 1] = found[1][1]
    out[#out + 1] = found[1][2]
  end
end
return out
"""


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _streamOrder(streamId: str) -> tuple:
    """
    A stream id (C{<ms>-<seq>}) as a sortable tuple.
    """
    ms, _, seq = streamId.partition("-")
    return int(ms), int(seq or 0)


@implementer(IRequestLog)
@define(eq=False)
class RedisRequestLog(_Buffered):
    """
    Records in a capped Redis stream (see the module docstring).

    @ivar redis: a L{relay.wire.redisclient.RedisService}.
    @ivar stream: the stream's key.
    @ivar timeout: seconds per Redis call.
    @ivar batch: entries read per C{XREVRANGE} while filtering.
    @ivar scanLimit: entries a query reads at most before it answers with
        what it found and a cursor to go on from.
    @ivar slack: seconds between a turn's end and its append (the flush
        interval) allowed for when a time range is turned into stream ids.
    """

    redis: Any = None
    stream: str = "relay:requests"
    timeout: float = 5.0
    batch: int = 500
    scanLimit: int = 20_000
    slack: float = 120.0

    async def _store(self, records: list) -> None:
        ttl = max(1, int(self.retentionDays * DAY))
        minid = f"{int(self._cutoff() * 1000)}-0"
        args = [str(self.maxRecords), str(ttl), minid]
        for r in records:
            prefix = r.request_id.rsplit(":", 1)[0] if ":" in r.request_id else ""
            args += [r.request_id, prefix, r.toJSON(), r.client_request_id or ""]
        await self.redis.execute(self.timeout, "eval", _REDIS_ADD, [self.stream], args)

    def _decode(self, entries) -> list:
        out = []
        for streamId, fields in entries:
            fields = list(fields)
            data = None
            for name, value in zip(fields[0::2], fields[1::2]):
                if _text(name) == "r":
                    data = _text(value)
            if data is None:
                continue
            try:
                out.append(fromDict(json.loads(data), _text(streamId)))
            except ValueError:
                continue
        return out

    async def _aggregate(self, since, until, bucket, groupBy, filters) -> dict:
        return await logseries.redisAggregate(self, since, until, bucket, groupBy, filters)

    async def _read(self, filters: RequestQuery, limit: int, cursor):
        if filters.request_id is not None or filters.client_request_id is not None:
            which = ([filters.request_id, "id"] if filters.request_id is not None
                     else [filters.client_request_id, "cid"])
            reply = await self.redis.execute(
                self.timeout, "eval", _REDIS_BY_ID, [self.stream], which
            )
            reply = list(reply or [])
            records = self._decode(zip(reply[0::2], reply[1::2]))
            records = [r for r in records if filters.matches(r)]
            records.sort(key=lambda r: _streamOrder(r.seq), reverse=True)
            return records[:limit], None
        end = "+"
        if filters.until is not None:
            end = str(int((filters.until + self.slack) * 1000))
        if cursor:
            end = "(" + cursor
        start = "-" if filters.since is None else str(int(filters.since * 1000))
        found, scanned, exhausted = [], 0, False
        while True:
            entries = await self.redis.execute(
                self.timeout, "execute_command", "XREVRANGE", self.stream, end, start,
                "COUNT", str(self.batch),
            )
            entries = list(entries or [])
            if not entries:
                exhausted = True
                break
            scanned += len(entries)
            end = "(" + _text(entries[-1][0])
            for record in self._decode(entries):
                if filters.matches(record):
                    found.append(record)
                    if len(found) > limit:
                        break
            if len(found) > limit:
                return found[:limit], found[limit - 1].seq
            if len(entries) < self.batch:
                exhausted = True
                break
            if scanned >= self.scanLimit:
                break
        # The scan bound was reached: go on below the last entry read.
        return found, None if exhausted else end[1:]


class RequestLogService(TimerService):
    """
    Flushes a request log every C{interval} seconds on the injected clock,
    and once more on stop; never stops on an error (style.md trap T26).
    """

    _log = Logger()

    def __init__(self, log, interval: float, clock):
        """
        @param log: the L{IRequestLog}.
        @param interval: seconds between flushes.
        @param clock: the L{IReactorTime}.
        """
        super().__init__(interval, self._flush)
        self.requestLog = log
        self.clock = clock

    def _flush(self):
        try:
            d = self.requestLog.flush()
        except Exception:  # noqa: BLE001 - a periodic job never stops (T26)
            self._log.failure("flushing the request log failed",
                              event="relay.request_log_flush_failed")
            return None
        return d.addErrback(lambda f: self._log.failure(
            "flushing the request log failed", f, event="relay.request_log_flush_failed"))

    def stopService(self):
        """
        Stop the timer, then write what is left.
        """
        d = super().stopService()
        return d.addCallback(lambda _: self._flush())
