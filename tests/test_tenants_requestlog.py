"""
Tests for the per-turn record (L{relay.tenants.record}) the engine builds
at a turn's end, and the request log stores (L{relay.tenants.requestlog}):
one contract for memory and SQLite, the Redis provider's calls without a
server (the real one is in tests/integration/test_tenants.py), bounds by
count and age, queries and paging, debug sampling.
"""

from __future__ import annotations

import json

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.interfaces import IRequestLog
from relay.state.settingsdb import SQLiteSettingsStore
from relay.tenants.record import Attempt, TurnRecord, fromDict
from relay.tenants.requestlog import (
    MemoryRequestLog,
    RedisRequestLog,
    RequestLogService,
    RequestQuery,
    SQLiteRequestLog,
)
from tests.tenantsrig import TenantsRig, account, key
from tests.test_runner import T0, status
from tests.test_usage import synchronousPool


def record(n, key="bob", account="a1", model="gpt-5.5", outcome="completed", t=None, rid=None,
           tried=None, cid=None):
    attempts = [Attempt(a, 503, "server_error", "switch") for a in (tried or [])]
    attempts.append(Attempt(account, 200, "ok", "served"))
    return TurnRecord(
        time=T0 + n if t is None else t, request_id=rid or f"req-{n}", key=key,
        entrypoint="http", endpoint="responses", mode=None, stream=True, model=model,
        account=account, attempts=attempts, outcome=outcome,
        status=200 if outcome == "completed" else 502, first_output_ms=12, duration_ms=34,
        input_tokens=10, cached_tokens=0, output_tokens=5, reasoning_tokens=0,
        cost_nanos=175_000, client_ip="127.0.0.1", user_agent="sdk/1", client_request_id=cid,
    )


class RecordTests(SynchronousTestCase):
    """
    The engine builds one L{TurnRecord} per turn from what it holds.
    """

    def test_completed_after_failover(self):
        """
        A turn that failed over a1 -> a2: both attempts with their status,
        reason and decision; outcome, status, timings, tokens, cost, the
        client's address and agent; no prompt or output.
        """
        rig = TenantsRig([account("a1", priority=1), account("a2", priority=2)])
        rig.script("a1", status(503))
        turn = rig.turn(key(), requestId="req-42", clientAddress="10.0.0.7",
                        userAgent="codex/0.171")
        _, outcome = rig.go(turn)
        self.assertEqual(outcome, ["completed"])
        [rec] = rig.records()
        self.assertEqual([a.asList() for a in rec.attempts],
                         [["a1", 503, rec.attempts[0].reason, "switch"],
                          ["a2", 200, "ok", "served"]])
        self.assertEqual((rec.request_id, rec.key, rec.entrypoint, rec.model, rec.account,
                          rec.outcome, rec.status, rec.switches),
                         ("req-42", "bob", "http", "gpt-5.5", "a2", "completed", 200, 1))
        self.assertEqual((rec.input_tokens, rec.output_tokens, rec.cost_nanos), (1, 1, 35_000))
        self.assertEqual((rec.client_ip, rec.user_agent), ("10.0.0.7", "codex/0.171"))
        self.assertEqual(rec.time, T0)
        self.assertIsNone(rec.sample)
        self.assertNotIn("hi", json.dumps(rec.asDict()))

    def test_refused_turn(self):
        """
        A turn the key policy refused is recorded with the status, code and
        message it got, and no attempt.
        """
        rig = TenantsRig([account("a1")])
        rig.go(rig.turn(key(models=("o3",))))
        [rec] = rig.records()
        self.assertEqual((rec.outcome, rec.status, rec.error_code, rec.attempts),
                         ("failed", 403, "model_not_found", []))

    def test_unpriced(self):
        """
        A turn on a model without a price: tokens counted, cost unknown.
        """
        rig = TenantsRig([account("a1")])
        rig.go(rig.turn(key(), model="my-model"))
        [rec] = rig.records()
        self.assertEqual((rec.input_tokens, rec.cost_nanos, rec.unpriced), (1, None, True))
        self.assertIsNone(rec.asDict()["cost_usd"])

    def test_sampling(self):
        """
        With C{sample_rate: 1} a record keeps the request body and the
        output the client got, cut to C{sample_max_bytes}; the client still
        gets everything.
        """
        rig = TenantsRig([account("a1")])
        rig.log.sampleRate, rig.log.sampleMaxBytes = 1.0, 300
        sink, _ = rig.go(rig.turn(key()))
        [rec] = rig.records()
        self.assertEqual(json.loads(rec.sample["request"])["input"], "hi")
        self.assertIn("response.created", rec.sample["output"])
        self.assertLessEqual(len(rec.sample["output"].encode()), 300)
        self.assertEqual(sink.events[-1], "response.completed")

    def test_round_trip(self):
        """
        L{fromDict} reads back L{TurnRecord.asDict}.
        """
        rec = record(1, tried=["a0"])
        again = fromDict(json.loads(rec.toJSON()), "7")
        self.assertEqual(again.asDict(), rec.asDict())
        self.assertEqual((again.seq, again.accounts), ("7", ["a0", "a1"]))


class LogContract:
    """
    What every L{IRequestLog} does.
    """

    def makeLog(self, **kw):
        raise NotImplementedError

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0 + 1000)

    def query(self, log, limit=50, cursor=None, **filters):
        return self.successResultOf(log.query(RequestQuery(**filters), limit, cursor))

    def test_interface(self):
        self.assertTrue(verifyObject(IRequestLog, self.makeLog()))

    def test_filters(self):
        """
        Each filter narrows; C{account} matches any account a turn tried;
        C{request_id} finds a turn, and a WebSocket connection's id its
        turns.
        """
        log = self.makeLog()
        log.add(record(1, key="alice"))
        log.add(record(2, account="a2", tried=["a1"]))
        log.add(record(3, model="o3", outcome="failed"))
        log.add(record(4, rid="ws_abc:1"))
        log.add(record(5, rid="ws_abc:2"))
        log.add(record(6, rid="ws_abcd:1"))

        def ids(**filters):
            return [r.request_id for r in self.query(log, **filters)[0]]

        self.assertEqual(ids(), ["ws_abcd:1", "ws_abc:2", "ws_abc:1", "req-3", "req-2", "req-1"])
        self.assertEqual(ids(key="alice"), ["req-1"])
        self.assertEqual(ids(account="a2"), ["req-2"])
        self.assertEqual(ids(account="a1", model="gpt-5.5", key="bob"),
                         ["ws_abcd:1", "ws_abc:2", "ws_abc:1", "req-2"])
        self.assertEqual(ids(outcome="failed"), ["req-3"])
        self.assertEqual(ids(since=T0 + 2, until=T0 + 4), ["req-3", "req-2"])
        self.assertEqual(ids(request_id="req-2"), ["req-2"])
        self.assertEqual(ids(request_id="ws_abc"), ["ws_abc:2", "ws_abc:1"])
        self.assertEqual(ids(request_id="nope"), [])
        [found] = self.query(log, request_id="req-2")[0]
        self.assertEqual(found.asDict()["attempts"][0],
                         {"account": "a1", "status": 503, "reason": "server_error",
                          "decision": "switch"})

    def test_client_request_id(self):
        """
        R111: C{client_request_id} finds every record the client's id was
        sent with (of any key), exactly; C{request_id} stays relay's and
        never matches a client's id.
        """
        log = self.makeLog()
        log.add(record(1, key="alice", cid="thread-1"))
        log.add(record(2, key="bob", cid="thread-1"))
        log.add(record(3, key="bob", cid="thread-10"))
        log.add(record(4, rid="ws_abc:1", cid="thread-1"))
        log.add(record(5))

        def ids(**filters):
            return [(r.request_id, r.key, r.client_request_id)
                    for r in self.query(log, **filters)[0]]

        self.assertEqual(ids(client_request_id="thread-1"),
                         [("ws_abc:1", "bob", "thread-1"), ("req-2", "bob", "thread-1"),
                          ("req-1", "alice", "thread-1")])
        self.assertEqual(ids(client_request_id="thread-1", key="alice"),
                         [("req-1", "alice", "thread-1")])
        self.assertEqual(ids(request_id="thread-1"), [])
        self.assertEqual(ids(client_request_id="nope"), [])

    def test_paging(self):
        """
        C{limit} and the C{next} cursor walk the records newest first,
        each once.
        """
        log = self.makeLog()
        for n in range(7):
            log.add(record(n))
        seen, cursor = [], None
        while True:
            page, cursor = self.query(log, limit=3, cursor=cursor)
            seen += [r.request_id for r in page]
            if cursor is None:
                break
        self.assertEqual(seen, [f"req-{n}" for n in range(6, -1, -1)])

    def test_count_bound(self):
        """
        At most C{maxRecords} are kept; the oldest go first.
        """
        log = self.makeLog(maxRecords=3)
        for n in range(5):
            log.add(record(n))
        self.successResultOf(log.flush())
        for n in range(5, 8):
            log.add(record(n))
        self.assertEqual([r.request_id for r in self.query(log)[0]],
                         ["req-7", "req-6", "req-5"])

    def test_age_bound(self):
        """
        Records older than C{retentionDays} are dropped.
        """
        log = self.makeLog(retentionDays=1)
        log.add(record(0, t=T0 + 1000 - 2 * 86400))
        log.add(record(1))
        self.assertEqual([r.request_id for r in self.query(log)[0]], ["req-1"])

    def test_service_flushes(self):
        """
        L{RequestLogService} writes the buffer on its period and at stop.
        """
        log = self.makeLog()
        service = RequestLogService(log, 1.0, self.clock)
        service.clock = self.clock
        service.startService()
        log.add(record(1))
        self.clock.advance(1)
        log.add(record(2))
        self.successResultOf(service.stopService())
        self.assertEqual(len(self.query(log)[0]), 2)


def failedRecord(n, code=None, reason="server_error", account="a2", t=None):
    """
    A failed turn: one failed attempt on C{account}, served by none.
    """
    return TurnRecord(
        time=T0 + n if t is None else t, request_id=f"req-{n}", key="bob",
        entrypoint="http", endpoint="responses", mode=None, stream=True, model="gpt-5.5",
        account=None, attempts=[Attempt(account, 500, reason, "exhausted")], outcome="failed",
        status=502, first_output_ms=None, duration_ms=34, error_code=code,
    )


def aggregateLog(log):
    """
    Turns over two hours: completed, failed (by code and by attempt
    reason), a client that left.
    """
    h = int(T0 // 3600 * 3600)
    log.add(record(1, key="alice", t=h + 10))
    log.add(record(2, t=h + 20))
    log.add(record(3, model="o3", t=h - 100))
    log.add(failedRecord(4, code="rate_limited", t=h + 30))
    log.add(failedRecord(5, t=h + 40))
    log.add(record(6, outcome="client_gone", t=h + 50))
    return h


class AggregateContract:
    """
    L{IRequestLog.aggregate}: turns per bucket and group by outcome and
    failure kind; the buckets sum to the totals.
    """

    def aggregate(self, log, since, until, bucket=3600, groupBy="none", **filters):
        return self.successResultOf(log.aggregate(since, until, bucket, groupBy, filters))

    def test_buckets_and_kinds(self):
        log = self.makeLog()
        h = aggregateLog(log)
        found = self.aggregate(log, h - 3600, h + 3600)
        self.assertEqual(found, {
            (h - 3600, ""): {"requests": 1, "completed": 1, "failed": 0, "client_gone": 0,
                             "failures": {}},
            (h, ""): {"requests": 5, "completed": 2, "failed": 2, "client_gone": 1,
                      "failures": {"rate_limited": 1, "server_error": 1}},
        })
        byDay = self.aggregate(log, h - 3600, h + 3600, 86400)
        self.assertEqual(sum(p["requests"] for p in byDay.values()), 6)

    def test_groups_and_filters(self):
        log = self.makeLog()
        h = aggregateLog(log)
        byAccount = self.aggregate(log, h, h + 3600, groupBy="account")
        self.assertEqual({g: p["requests"] for (_, g), p in byAccount.items()},
                         {"a1": 3, "a2": 2})
        byKey = self.aggregate(log, h - 3600, h + 3600, groupBy="key")
        self.assertEqual({(b, g): p["requests"] for (b, g), p in byKey.items()},
                         {(h, "alice"): 1, (h, "bob"): 4, (h - 3600, "bob"): 1})
        self.assertEqual(
            {g for (_, g) in self.aggregate(log, h - 3600, h + 3600, groupBy="model")},
            {"gpt-5.5", "o3"})
        onlyA2 = self.aggregate(log, h - 3600, h + 3600, account="a2")
        self.assertEqual(onlyA2[(h, "")]["failed"], 2)
        self.assertEqual(self.aggregate(log, h - 3600, h + 3600, model="o3", key="bob"),
                         {(h - 3600, ""): {"requests": 1, "completed": 1, "failed": 0,
                                           "client_gone": 0, "failures": {}}})
        self.assertEqual(self.aggregate(log, h + 3600, h + 7200), {})


class MemoryLogTests(LogContract, AggregateContract, SynchronousTestCase):
    def makeLog(self, **kw):
        return MemoryRequestLog(clock=self.clock, **kw)


class SQLiteLogTests(LogContract, AggregateContract, SynchronousTestCase):
    def makeLog(self, **kw):
        path = self.mktemp()
        self.database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(self.database.close)
        return SQLiteRequestLog(clock=self.clock, database=self.database, **kw)

    def test_buffered_until_flush(self):
        """
        L{SQLiteRequestLog.add} writes nothing; the flush writes every
        buffered record in one transaction; a query flushes first.
        """
        log = self.makeLog()
        log.add(record(1))

        def count(txn):
            txn.execute("SELECT COUNT(*) FROM request_log")
            return txn.fetchall()[0][0]

        self.successResultOf(log.flush())
        self.assertEqual(self.successResultOf(log._run(count)), 1)
        log.add(record(2))
        self.assertEqual(len(self.query(log)[0]), 2)

    def test_migrates_a_table_without_client_request_id(self):
        """
        R111: a C{request_log} table written before the
        C{client_request_id} column gains it (and its index) on first use;
        its rows still read, and new rows are found by the client's id.
        """
        log = self.makeLog()
        old = record(1)
        data = old.asDict()
        del data["client_request_id"]

        def oldTable(txn):
            txn.execute(
                "CREATE TABLE request_log (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                " time REAL NOT NULL, request_id TEXT NOT NULL, key TEXT NOT NULL,"
                " accounts TEXT NOT NULL, model TEXT, outcome TEXT NOT NULL,"
                " status INTEGER NOT NULL, data TEXT NOT NULL)")
            txn.execute(
                "INSERT INTO request_log (time, request_id, key, accounts, model, outcome,"
                " status, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (old.time, old.request_id, old.key, ",a1,", old.model, old.outcome, old.status,
                 json.dumps(data)))

        self.successResultOf(self.database.runInteraction(oldTable))
        log.add(record(2, cid="thread-2"))
        self.assertEqual([(r.request_id, r.client_request_id) for r in self.query(log)[0]],
                         [("req-2", "thread-2"), ("req-1", None)])
        self.assertEqual([r.request_id for r in self.query(log, client_request_id="thread-2")[0]],
                         ["req-2"])

        def indexes(txn):
            txn.execute("PRAGMA index_list(request_log)")
            return {row[1] for row in txn.fetchall()}

        self.assertIn("request_log_client_request_id",
                      self.successResultOf(log._run(indexes)))

    def test_store_down_keeps_records(self):
        """
        A failed write keeps the records for the next flush.
        """
        log = self.makeLog()
        log.add(record(1))
        broken = log.database
        log.database = None
        self.successResultOf(log.flush())
        self.assertEqual(len(log._buffer), 1)
        log.database = broken
        self.assertEqual(len(self.query(log)[0]), 1)


class RedisLogShapeTests(SynchronousTestCase):
    """
    L{RedisRequestLog} without a server: what it sends.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.calls, self.replies = [], []

        class FakeRedis:
            def execute(fake, timeout, method, *args):
                self.calls.append((method,) + args)
                return succeed(self.replies.pop(0) if self.replies else None)

        self.log = RedisRequestLog(clock=self.clock, redis=FakeRedis(), maxRecords=1000,
                                   retentionDays=2)

    def test_flush_one_eval(self):
        """
        One C{EVAL} appends every buffered record (capped with MAXLEN,
        trimmed by age with MINID) and indexes its request id and, for a
        WebSocket turn, its connection.
        """
        self.log.add(record(1))
        self.log.add(record(2, rid="ws_x:3"))
        self.successResultOf(self.log.flush())
        [(method, script, keys, args)] = self.calls
        self.assertEqual((method, keys), ("eval", ["relay:requests"]))
        self.assertIn("MAXLEN", script)
        self.assertEqual(args[:3], ["1000", str(2 * 86400), f"{int((T0 - 2 * 86400) * 1000)}-0"])
        self.assertEqual((args[3], args[4], args[6], args[7], args[8]),
                         ("req-1", "", "", "ws_x:3", "ws_x"))
        self.assertEqual(json.loads(args[5])["request_id"], "req-1")

    def test_client_request_id_indexed(self):
        """
        R111: a record's client id is indexed with it (the fourth value of
        each), and a query by client id reads that index (one C{EVAL}).
        """
        self.log.add(record(1, cid="thread-1"))
        self.successResultOf(self.log.flush())
        [(_, script, _, args)] = self.calls
        self.assertIn(":cid:", script)
        self.assertEqual(args[3:7][0::3], ["req-1", "thread-1"])
        self.calls.clear()
        self.replies.append([b"1-0", [b"r", record(1, cid="thread-1").toJSON().encode()]])
        found, _ = self.successResultOf(
            self.log.query(RequestQuery(client_request_id="thread-1"), 10, None))
        self.assertEqual([r.client_request_id for r in found], ["thread-1"])
        [(method, _, _, args)] = self.calls
        self.assertEqual((method, args), ("eval", ["thread-1", "cid"]))

    def test_query_by_id(self):
        """
        A request id is looked up through its index (one C{EVAL}).
        """
        self.replies.append([b"1-0", [b"r", record(1).toJSON().encode()]])
        found, cursor = self.successResultOf(self.log.query(RequestQuery(request_id="req-1"),
                                                            10, None))
        self.assertEqual(([r.request_id for r in found], found[0].seq, cursor),
                         (["req-1"], "1-0", None))


class RedisAggregateShapeTests(RedisLogShapeTests):
    """
    The Redis log's aggregate: one forward scan of the range, in batches.
    """

    def test_aggregate_scans_range_once(self):
        self.log.batch = 2
        h = int(T0 // 3600 * 3600)
        entries = [[f"{i}-0".encode(), [b"r", r.toJSON().encode()]] for i, r in enumerate(
            [record(1, t=h + 1), failedRecord(2, t=h + 2), record(3, t=h + 3)])]
        self.replies += [entries[:2], entries[2:]]
        found = self.successResultOf(self.log.aggregate(h, h + 3600, 3600, "none", {}))
        self.assertEqual(found[(h, "")]["requests"], 3)
        self.assertEqual(found[(h, "")]["failures"], {"server_error": 1})
        [first, second] = self.calls
        self.assertEqual(first[:4], ("execute_command", "XRANGE", "relay:requests",
                                     str(h * 1000)))
        self.assertEqual(second[4], first[4])
        self.assertEqual(second[3], "(1-0")
