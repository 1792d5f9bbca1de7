"""
Issue 13 item 5: token accounting, on a L{Clock}.

Reading C{usage} (Responses and Chat Completions shapes), the per-attempt
tap, the ledger's hourly rollup, periodic flush and budgets, the memory and
SQLite stores, the C{/admin/usage} parameters and resource, and the turn
runner counting each turn once on every path (SSE, JSON, chat, failover).
"""

from __future__ import annotations

import calendar
import json

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.interfaces import IUsageStore
from relay.console.metrics import RelayMetrics
from relay.base.records import ClientKey, Turn
from relay.state.settingsdb import SQLiteSettingsStore
from relay.wire.sse import Event, eventFromJSON
from relay.usage.ledger import UsageLedger
from relay.usage.query import UsageQueryError, parseGroupBy, parseSince
from relay.usage.service import UsageFlushService
from relay.usage.store import (
    MemoryUsageStore,
    RedisUsageStore,
    SQLiteUsageStore,
    dayStart,
    hourOf,
    monthStart,
    nextMonthStart,
)
from relay.usage.reader import UsageTap
from relay.usage.tokens import TokenCounts, fromBody, fromEvent, fromUsage
from tests.test_admin import jsonBody, makeRequest, render
from tests.test_runner import (
    CREATED,
    DELTA,
    ITEM_ADDED,
    FakeResponse,
    FakeSink,
    Rig,
    account,
)
from tests.test_settings import synchronousPool

#: 2026-01-31 23:30:00 UTC
T0 = float(calendar.timegm((2026, 1, 31, 23, 30, 0)))

RESPONSES_USAGE = {
    "input_tokens": 120, "input_tokens_details": {"cached_tokens": 100},
    "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 12},
    "total_tokens": 150,
}
CHAT_USAGE = {
    "prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 100},
    "completion_tokens": 30, "completion_tokens_details": {"reasoning_tokens": 12},
    "total_tokens": 150,
}
COUNTS = TokenCounts(requests=1, input=120, cached=100, output=30, reasoning=12)


def frame(kind, **fields):
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def terminal(kind="response.completed", usage=RESPONSES_USAGE):
    return frame(kind, response={"id": "resp_1", "status": kind.split(".")[1],
                                 "output": [{"type": "message"}], "usage": usage})


class TokensTests(SynchronousTestCase):
    """
    Reading C{usage} objects (protocol.md 2.7, 3).
    """

    def test_responses_shape(self):
        """
        Input, cached input, output and reasoning tokens of a Responses
        C{usage}; the total is input + output.
        """
        counts = fromUsage(RESPONSES_USAGE)
        self.assertEqual(counts, COUNTS)
        self.assertEqual(counts.total, 150)

    def test_chat_shape(self):
        """
        C{prompt_tokens}/C{completion_tokens} and their details map the same
        way.
        """
        self.assertEqual(fromUsage(CHAT_USAGE), COUNTS)
        self.assertEqual(
            fromUsage({"prompt_tokens": 5, "completion_tokens": 2}),
            TokenCounts(requests=1, input=5, output=2),
        )

    def test_not_usage(self):
        """
        Absent, null or foreign objects are no usage; junk numbers count 0.
        """
        for value in (None, {}, [], "x", {"foo": 1}):
            self.assertIsNone(fromUsage(value))
        self.assertEqual(
            fromUsage({"input_tokens": "7", "output_tokens": -3, "input_tokens_details": 5}),
            TokenCounts(requests=1),
        )

    def test_events_and_bodies(self):
        """
        The terminal event's C{response.usage}, a chat chunk's C{usage}, a
        JSON body's C{usage}; C{[DONE]} and usage-less events carry none.
        """
        self.assertEqual(fromEvent(eventFromJSON(terminal()[terminal().index(b"{"):-2])), COUNTS)
        for kind in ("response.incomplete", "response.failed"):
            data = json.dumps({"type": kind, "response": {"usage": RESPONSES_USAGE}}).encode()
            self.assertEqual(fromEvent(eventFromJSON(data)), COUNTS)
        chunk = json.dumps({"object": "chat.completion.chunk", "choices": [], "usage": CHAT_USAGE})
        self.assertEqual(fromEvent(Event(b"", chunk.encode())), COUNTS)
        self.assertIsNone(fromEvent(Event(b"[DONE]", b"[DONE]")))
        self.assertIsNone(fromEvent(eventFromJSON(b'{"type":"response.completed","response":{}}')))
        self.assertEqual(fromBody({"object": "response", "usage": RESPONSES_USAGE}), COUNTS)
        self.assertIsNone(fromBody(["x"]))

    def test_sum_and_dict(self):
        """
        Counts add field by field; L{TokenCounts.asDict} uses the API names.
        """
        both = COUNTS + TokenCounts(1, 120, 100, 30, 12, cost=1500, unpriced=1, estimated=1)
        self.assertEqual(both.asDict(), {
            "requests": 2, "input_tokens": 240, "cached_input_tokens": 200,
            "output_tokens": 60, "reasoning_tokens": 24, "total_tokens": 300,
            "cost_usd": 0.0000015, "unpriced_requests": 1, "estimated_requests": 1,
        })


class TapTests(SynchronousTestCase):
    """
    L{UsageTap}: once per attempt; the chat usage chunk dropped unless the
    client asked for it.
    """

    def setUp(self):
        self.recorded = []

    def tap(self, **kw):
        return UsageTap(record=self.recorded.append, **kw)

    def test_terminal_counted_once(self):
        """
        The first event with usage is counted; later ones are not.
        """
        tap = self.tap()
        event = eventFromJSON(json.dumps({"type": "response.completed",
                                          "response": {"usage": RESPONSES_USAGE}}).encode())
        tap.terminal(event)
        tap.terminal(event)
        self.assertEqual(self.recorded, [COUNTS])
        self.assertEqual(tap.counted, COUNTS)

    def test_chat_usage_chunk(self):
        """
        A chat usage chunk (C{choices: []}) is counted, and dropped when the
        client did not ask for it; other chunks pass untouched.
        """
        usageChunk = Event(b"", json.dumps({"choices": [], "usage": CHAT_USAGE}).encode())
        plain = Event(b"", b'{"choices":[{"delta":{"content":"hi"}}],"usage":null}')
        dropping = self.tap(chat=True, dropUsageChunk=True)
        self.assertFalse(dropping.chunk(plain))
        self.assertTrue(dropping.chunk(usageChunk))
        keeping = self.tap(chat=True, dropUsageChunk=False)
        self.assertFalse(keeping.chunk(usageChunk))
        self.assertEqual(self.recorded, [COUNTS, COUNTS])

    def test_text_never_matches(self):
        """
        A quoted C{"usage":{} inside content is escaped JSON and is not a
        usage chunk.
        """
        text = json.dumps({"choices": [{"delta": {"content": '"usage":{"x":1}'}}]}).encode()
        self.assertFalse(self.tap(chat=True, dropUsageChunk=True).chunk(Event(b"", text)))
        self.assertEqual(self.recorded, [])

    def test_record_failure_is_logged(self):
        """
        A failing recorder is logged; the stream is never broken by it.
        """
        def record(counts):
            raise RuntimeError("boom")

        tap = UsageTap(record=record, requestId="req_9")
        with capturedLogs() as events:
            tap.terminal(eventFromJSON(json.dumps(
                {"type": "response.completed", "response": {"usage": RESPONSES_USAGE}}).encode()))
        self.assertEqual([e["request_id"] for e in events
                          if e.get("event") == "relay.usage_failed"], ["req_9"])
        self.flushLoggedErrors(RuntimeError)


class PeriodTests(SynchronousTestCase):
    """
    UTC hours, days and months.
    """

    def test_periods(self):
        """
        Hour, day and month starts, and the next month (across a year end).
        """
        self.assertEqual(hourOf(T0), T0 - 1800)
        self.assertEqual(dayStart(T0), calendar.timegm((2026, 1, 31, 0, 0, 0)))
        self.assertEqual(monthStart(T0), calendar.timegm((2026, 1, 1, 0, 0, 0)))
        self.assertEqual(nextMonthStart(T0), calendar.timegm((2026, 2, 1, 0, 0, 0)))
        dec = calendar.timegm((2025, 12, 15, 0, 0, 0))
        self.assertEqual(nextMonthStart(dec), calendar.timegm((2026, 1, 1, 0, 0, 0)))

    def test_month_of_each_day(self):
        """
        The month starts are the UTC day's, whatever was asked before (they
        are kept per day): every second of a month's last and first days,
        in any order, floats and ints alike.
        """
        import time

        def expected(seconds):
            t = time.gmtime(seconds)
            year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
            return (calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)),
                    calendar.timegm((year, month, 1, 0, 0, 0)))

        newYear = calendar.timegm((2027, 1, 1, 0, 0, 0))
        asked = [newYear - 1, newYear, newYear - 0.5, newYear + 0.25, newYear - 86400,
                 newYear - 86401, newYear + 86399.75, newYear + 86400, newYear - 1, newYear,
                 calendar.timegm((2028, 2, 29, 23, 59, 59)), calendar.timegm((2028, 3, 1, 0, 0, 0))]
        for seconds in asked:
            self.assertEqual((monthStart(seconds), nextMonthStart(seconds)), expected(seconds),
                             seconds)


class StoreContract:
    """
    L{IUsageStore} behaviour every provider shares.
    """

    def makeStore(self):
        raise NotImplementedError()

    def test_interface(self):
        """
        The store provides L{IUsageStore}.
        """
        self.assertTrue(verifyObject(IUsageStore, self.makeStore()))

    def test_add_is_an_increment_and_groups(self):
        """
        Adding the same row twice sums it; totals group by key, account,
        model and hour, from C{since} on (rounded down to the hour).
        """
        store = self.makeStore()
        h = hourOf(T0)
        rows = [((h, "alice", "a1", "gpt-5.5"), COUNTS),
                ((h, "bob", "a2", "gpt-5.5"), TokenCounts(1, 10, 0, 5, 0)),
                ((h - 3600, "alice", "a1", "gpt-4.1"), TokenCounts(1, 1, 0, 1, 0))]
        self.successResultOf(store.add(rows))
        self.successResultOf(store.add(rows[:1]))
        byKey = self.successResultOf(store.totals(h - 3600, "key"))
        self.assertEqual(byKey["alice"], COUNTS + COUNTS + TokenCounts(1, 1, 0, 1, 0))
        self.assertEqual(byKey["bob"], TokenCounts(1, 10, 0, 5, 0))
        byModel = self.successResultOf(store.totals(h + 1799, "model"))
        self.assertEqual(set(byModel), {"gpt-5.5"})
        byAccount = self.successResultOf(store.totals(0, "account"))
        self.assertEqual(byAccount["a2"].total, 15)
        byHour = self.successResultOf(store.totals(0, "hour"))
        self.assertEqual(sorted(byHour), [h - 3600, h])

    def test_budget_totals(self):
        """
        Tokens per key since the day's and the month's start.
        """
        store = self.makeStore()
        today = dayStart(T0)
        rows = [((hourOf(T0), "alice", "a1", "m"), COUNTS),
                ((today - 7200, "alice", "a1", "m"), TokenCounts(1, 5, 0, 5, 0))]
        self.successResultOf(store.add(rows))
        day, month = self.successResultOf(store.budgetTotals(today, monthStart(T0)))
        self.assertEqual(day, {"alice": 150})
        self.assertEqual(month, {"alice": 160})


def seriesRows(h):
    """
    Rows over two days: two keys, two models, two accounts.
    """
    return [((h, "alice", "a1", "gpt-5.5"), TokenCounts(1, 100, 10, 20, 5, 1000)),
            ((h, "bob", "a2", "gpt-5.5"), TokenCounts(2, 10, 0, 5, 0, 500)),
            ((h - 3600, "alice", "a1", "gpt-4.1"), TokenCounts(1, 1, 0, 1, 0)),
            ((h - 86400, "alice", "a2", "gpt-5.5"), TokenCounts(3, 7, 1, 3, 1, 70, 1))]


class SeriesContract:
    """
    L{IUsageStore.series}: per bucket and group in one read; the buckets sum
    to the totals.
    """

    def test_series_hour_and_day(self):
        store = self.makeStore()
        h = hourOf(T0)
        self.successResultOf(store.add(seriesRows(h)))
        byHour = self.successResultOf(store.series(h - 86400, h + 3600, 3600, "key", {}))
        self.assertEqual(byHour, {
            (h, "alice"): TokenCounts(1, 100, 10, 20, 5, 1000),
            (h, "bob"): TokenCounts(2, 10, 0, 5, 0, 500),
            (h - 3600, "alice"): TokenCounts(1, 1, 0, 1, 0),
            (h - 86400, "alice"): TokenCounts(3, 7, 1, 3, 1, 70, 1),
        })
        total = TokenCounts()
        for counts in byHour.values():
            total += counts
        self.assertEqual(total, sum(
            self.successResultOf(store.totals(h - 86400, "hour")).values(), TokenCounts()))
        byDay = self.successResultOf(store.series(h - 86400, h + 3600, 86400, "none", {}))
        self.assertEqual(sorted(byDay), sorted({(dayStart(h), ""), (dayStart(h - 86400), "")}))
        self.assertEqual(sum(byDay.values(), TokenCounts()), total)

    def test_series_filters_and_range(self):
        store = self.makeStore()
        h = hourOf(T0)
        self.successResultOf(store.add(seriesRows(h)))
        found = self.successResultOf(store.series(h - 3600, h, 3600, "model",
                                                  {"key": "alice"}))
        self.assertEqual(found, {(h - 3600, "gpt-4.1"): TokenCounts(1, 1, 0, 1, 0)})
        found = self.successResultOf(store.series(h - 86400, h + 3600, 3600, "account",
                                                  {"model": "gpt-5.5", "account": "a2"}))
        self.assertEqual(set(found), {(h, "a2"), (h - 86400, "a2")})


class MemoryStoreTests(StoreContract, SeriesContract, SynchronousTestCase):
    """
    L{MemoryUsageStore} passes the store contract.
    """

    def makeStore(self):
        return MemoryUsageStore()


class SQLiteStoreTests(StoreContract, SeriesContract, SynchronousTestCase):
    """
    L{SQLiteUsageStore} on a real SQLite file, sharing the settings store's
    connection.
    """

    def makeStore(self):
        path = self.mktemp()
        self.database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(self.database.close)
        return SQLiteUsageStore(database=self.database, retentionDays=2)

    def test_retention(self):
        """
        Rows older than C{retentionDays} before the newest added are deleted.
        """
        store = self.makeStore()
        h = hourOf(T0)
        self.successResultOf(store.add([((h - 3 * 86400, "k", "a", "m"), COUNTS)]))
        self.successResultOf(store.add([((h, "k", "a", "m"), COUNTS)]))
        self.assertEqual(self.successResultOf(store.totals(0, "hour")), {h: COUNTS})

    def test_settings_untouched(self):
        """
        The usage table lives beside the settings in the same file.
        """
        store = self.makeStore()
        self.successResultOf(self.database.save({"retry_interval_ms": 5}))
        self.successResultOf(store.add([((hourOf(T0), "k", "a", "m"), COUNTS)]))
        self.assertEqual(self.successResultOf(self.database.load()), {"retry_interval_ms": 5})


class RedisStoreShapeTests(SynchronousTestCase):
    """
    L{RedisUsageStore} without a server: what it sends and how it reads the
    replies (the real server is in tests/integration/test_usage.py).
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.calls = []
        self.replies = []

        class FakeRedis:
            def execute(fake, timeout, method, *args):
                self.calls.append((timeout, method) + args)
                return succeed(self.replies.pop(0) if self.replies else None)

        self.store = RedisUsageStore(redis=FakeRedis(), clock=self.clock, retentionDays=2)

    def test_interface(self):
        """
        The store provides L{IUsageStore}.
        """
        self.assertTrue(verifyObject(IUsageStore, self.store))

    def test_add_one_eval_with_declared_keys(self):
        """
        One C{EVAL} per flush; every key it touches is in C{KEYS}.
        """
        h = hourOf(T0)
        self.successResultOf(self.store.add([((h, "al\tice", "a1", "m"), COUNTS)]))
        (_timeout, method, _script, keys, args), = self.calls
        self.assertEqual(method, "eval")
        self.assertEqual(keys, [f"relay:usage:h:{h}", f"relay:usage:d:{dayStart(h)}",
                                f"relay:usage:m:{monthStart(h)}"])
        self.assertEqual(args[3:], ["al ice\ta1\tm", "al ice", "1", "120", "100", "30", "12", "0",
                                    "0", "0"])

    def test_totals_parse(self):
        """
        The hour hashes' fields sum into the groups asked for; the hours
        read reach back at most C{retentionDays}.
        """
        h = hourOf(T0)
        self.replies.append([f"relay:usage:h:{h}", ["i\tk\ta\tm", "120", "o\tk\ta\tm", "30",
                                                     "r\tk\ta\tm", "1", "junk", "9"]])
        found = self.successResultOf(self.store.totals(0, "key"))
        self.assertEqual(found, {"k": TokenCounts(1, 120, 0, 30, 0)})
        keys = self.calls[0][3]
        self.assertEqual(len(keys), 2 * 24 + 1)

    def test_budget_totals_parse(self):
        """
        The day and month hashes read back as key -> tokens.
        """
        day, month = dayStart(T0), monthStart(T0)
        self.replies.append([f"relay:usage:m:{month}", ["k", "160"]])
        self.assertEqual(self.successResultOf(self.store.budgetTotals(day, month)),
                         ({}, {"k": 160}))


class FailingStore(MemoryUsageStore):
    """
    A memory store whose C{add} fails while C{failing} is set.
    """

    failing = False

    def add(self, rows):
        if self.failing:
            return fail(ConnectionError("store down"))
        return super().add(rows)


class LedgerTests(SynchronousTestCase):
    """
    L{UsageLedger}: counters at once, hourly rows at the next flush, and
    budgets.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.store = FailingStore()
        self.metrics = RelayMetrics(clock=self.clock)
        self.ledger = UsageLedger(clock=self.clock, store=self.store, metrics=self.metrics,
                                  budgets={"alice": (300, 1000)})

    def sample(self, name, labels):
        return self.metrics.registry.get_sample_value(name, labels) or 0

    def test_record_then_flush_rolls_up_by_hour(self):
        """
        Nothing reaches the store per request; a flush writes one row per
        hour, key, account and model.
        """
        self.ledger.record("alice", "a1", "gpt-5.5", COUNTS)
        self.ledger.record("alice", "a1", "gpt-5.5", COUNTS)
        self.assertEqual(self.store.rows, {})
        self.clock.advance(3600)
        self.ledger.record("alice", "a1", "gpt-5.5", COUNTS)
        self.successResultOf(self.ledger.flush())
        h = hourOf(T0)
        self.assertEqual(self.store.rows, {
            (h, "alice", "a1", "gpt-5.5"): COUNTS + COUNTS,
            (h + 3600, "alice", "a1", "gpt-5.5"): COUNTS,
        })

    def test_prometheus_counters(self):
        """
        C{relay_tokens_total} per key, account, model and type, and
        C{relay_usage_turns_total}, at once.
        """
        self.ledger.record("alice", "a1", "gpt-5.5", COUNTS)
        labels = {"key": "alice", "account": "a1", "model": "gpt-5.5"}
        self.assertEqual(self.sample("relay_tokens_total", dict(labels, type="input")), 120)
        self.assertEqual(self.sample("relay_tokens_total", dict(labels, type="cached_input")), 100)
        self.assertEqual(self.sample("relay_tokens_total", dict(labels, type="output")), 30)
        self.assertEqual(self.sample("relay_tokens_total", dict(labels, type="reasoning")), 12)
        self.assertEqual(self.sample("relay_usage_turns_total", labels), 1)

    def test_failed_flush_keeps_rows(self):
        """
        A store failure is logged and the rows wait for the next flush.
        """
        self.ledger.record("bob", "a1", "m", COUNTS)
        self.store.failing = True
        with capturedLogs() as events:
            self.successResultOf(self.ledger.flush())
        self.assertEqual([e["rows"] for e in events
                          if e.get("event") == "relay.usage_flush_failed"], [1])
        self.ledger.record("bob", "a1", "m", COUNTS)
        self.store.failing = False
        self.successResultOf(self.ledger.flush())
        self.assertEqual(list(self.store.rows.values()), [COUNTS + COUNTS])

    def test_daily_budget(self):
        """
        Once a key's day total reaches C{daily_tokens}: 429 naming the budget
        and the UTC reset, C{Retry-After} in seconds; the next UTC day it
        may go on.
        """
        self.assertIsNone(self.ledger.overBudget("alice", self.clock.seconds()))
        self.ledger.record("alice", "a1", "m", COUNTS)
        self.assertIsNone(self.ledger.overBudget("alice", self.clock.seconds()))
        self.ledger.record("alice", "a1", "m", COUNTS)
        error = self.ledger.overBudget("alice", self.clock.seconds())
        self.assertEqual(error.status, 429)
        self.assertEqual(error.type, "insufficient_quota")
        self.assertIn("daily_tokens is 300", error.message)
        self.assertIn("2026-02-01T00:00:00Z", error.message)
        self.assertEqual(dict(error.headers), {"Retry-After": "1800"})
        self.assertEqual(error.wsClose[0], 1013)
        self.assertIsNone(self.ledger.overBudget("bob", self.clock.seconds()))
        self.clock.advance(1800)
        self.assertIsNone(self.ledger.overBudget("alice", self.clock.seconds()))

    def test_budgetEnvelopeIsCodexUsageLimit(self):
        """
        R113: a spent budget's error body is the shape Codex renders with a
        reset time (C{type} C{usage_limit_reached}, C{resets_at},
        C{resets_in_seconds}) and keeps OpenAI's envelope with relay's code.
        """
        self.ledger.record("alice", "a1", "m", COUNTS)
        self.ledger.record("alice", "a1", "m", COUNTS)
        error = self.ledger.overBudget("alice", self.clock.seconds())
        self.assertEqual(error.envelope()["error"], {
            "message": error.message, "type": "usage_limit_reached", "param": None,
            "code": "insufficient_quota", "resets_at": int(self.clock.seconds()) + 1800,
            "resets_in_seconds": 1800})

    def test_monthly_budget(self):
        """
        C{monthly_tokens} counts the UTC month and resets on the 1st.
        """
        ledger = UsageLedger(clock=self.clock, store=self.store, budgets={"alice": (None, 200)})
        ledger.record("alice", "a1", "m", COUNTS)
        ledger.record("alice", "a1", "m", COUNTS)
        error = ledger.overBudget("alice", self.clock.seconds())
        self.assertIn("monthly_tokens is 200", error.message)
        self.assertIn("UTC month", error.message)
        self.clock.advance(1800)
        self.assertIsNone(ledger.overBudget("alice", self.clock.seconds()))

    def test_hold_periods_follow_the_utc_day(self):
        """
        R108: a reservation's and a settlement's periods are the UTC day
        and month of their time (ids C{d:<day start>}, C{m:<month
        start>}), living to the period's end plus an hour: across a month
        end, the new day's and month's.
        """
        seen = []

        class Holds:
            def reserve(self, key, id, tokens, nanos, limits, ttl):
                seen.append([(name, period, known) for name, period, _, _, known in limits])
                return succeed(None)

            def settle(self, key, id, tokens, nanos, periods):
                seen.append(periods)
                return succeed(None)

        ledger = UsageLedger(clock=self.clock, store=self.store, budgets={"alice": (300, 1000)},
                             holds=Holds())
        jan31, jan1, feb1 = (calendar.timegm((2026, 1, 31, 0, 0, 0)),
                             calendar.timegm((2026, 1, 1, 0, 0, 0)),
                             calendar.timegm((2026, 2, 1, 0, 0, 0)))
        for when in (T0, T0 + 1800):
            self.clock.advance(when - self.clock.seconds())
            error, hold = self.successResultOf(Deferred.fromCoroutine(
                ledger.reserve("alice", 10, 0)))
            ledger.settle(hold, COUNTS)
            ledger.record("alice", "a1", "m", COUNTS)
        self.assertEqual(seen, [
            [("daily_tokens", f"d:{jan31}", 0), ("monthly_tokens", f"m:{jan1}", 0)],
            ((f"d:{jan31}", 1800 + 3600), (f"m:{jan1}", 1800 + 3600)),
            [("daily_tokens", f"d:{feb1}", 0), ("monthly_tokens", f"m:{feb1}", 0)],
            ((f"d:{feb1}", 86400 + 3600),
             (f"m:{feb1}", calendar.timegm((2026, 3, 1, 0, 0, 0)) - feb1 + 3600)),
        ])
        self.assertEqual(ledger.used("alice", T0), (150, 150))

    def test_budget_sees_other_processes_after_flush(self):
        """
        What another relay wrote to the shared store counts after this
        one's next flush; what this one counted is not counted twice.
        """
        h = hourOf(T0)
        self.successResultOf(self.store.add([((h, "alice", "a9", "m"), COUNTS)]))
        self.ledger.record("alice", "a1", "m", COUNTS)
        self.assertEqual(self.ledger.used("alice", self.clock.seconds()), (150, 150))
        self.successResultOf(self.ledger.flush())
        self.assertEqual(self.ledger.used("alice", self.clock.seconds()), (300, 300))
        self.assertIsNotNone(self.ledger.overBudget("alice", self.clock.seconds()))
        view = self.ledger.budgetView(self.clock.seconds())
        self.assertEqual(view[0]["daily_used"], 300)
        self.assertEqual(view[0]["daily_resets_at"], dayStart(T0) + 86400)

    def test_counts_during_a_flush_are_kept(self):
        """
        A turn counted while a flush is writing is in the next one and in
        the budget meanwhile.
        """
        gate = Deferred()

        class SlowStore(MemoryUsageStore):
            def add(store, rows):
                return gate.addCallback(lambda _: MemoryUsageStore.add(store, rows))

        ledger = UsageLedger(clock=self.clock, store=SlowStore(), budgets={"alice": (None, None)})
        ledger.record("alice", "a1", "m", COUNTS)
        d = ledger.flush()
        ledger.record("alice", "a1", "m", COUNTS)
        gate.callback(None)
        self.successResultOf(d)
        self.assertEqual(ledger.used("alice", self.clock.seconds()), (300, 300))
        self.successResultOf(ledger.flush())
        self.assertEqual(ledger.used("alice", self.clock.seconds()), (300, 300))

    def test_totals_flushes_first(self):
        """
        The admin query includes turns counted a moment ago, largest first.
        """
        self.ledger.record("bob", "a1", "m", TokenCounts(1, 1, 0, 1, 0))
        self.ledger.record("alice", "a1", "m", COUNTS)
        d = Deferred.fromCoroutine(self.ledger.totals(0, "key"))
        rows = self.successResultOf(d)
        self.assertEqual([r["key"] for r in rows], ["alice", "bob"])
        self.assertEqual(rows[0]["cached_input_tokens"], 100)


class FlushServiceTests(SynchronousTestCase):
    """
    L{UsageFlushService}: periodic flushes on the clock, a last one on stop.
    """

    def test_periodic_and_final(self):
        """
        Rows reach the store within one interval, and at shutdown.
        """
        clock = Clock()
        clock.advance(T0)
        store = MemoryUsageStore()
        ledger = UsageLedger(clock=clock, store=store)
        service = UsageFlushService(ledger, 10, clock)
        service.startService()
        ledger.record("k", "a", "m", COUNTS)
        clock.advance(10)
        self.assertEqual(len(store.rows), 1)
        clock.advance(3600)
        ledger.record("k", "a", "m", COUNTS)
        self.successResultOf(service.stopService())
        self.assertEqual(len(store.rows), 2)


class QueryTests(SynchronousTestCase):
    """
    C{since} and C{group_by} of C{/admin/usage}.
    """

    def test_since(self):
        """
        Unix seconds, ISO 8601 with or without a zone (UTC), or the last 24 h.
        """
        self.assertEqual(parseSince("1767225600", T0), 1767225600)
        self.assertEqual(parseSince("2026-01-01T00:00:00Z", T0), 1767225600)
        self.assertEqual(parseSince("2026-01-01", T0), 1767225600)
        self.assertEqual(parseSince("2026-01-01T02:00:00+02:00", T0), 1767225600)
        self.assertEqual(parseSince(None, T0), T0 - 86400)
        for bad in ("yesterday", "-5", "nan"):
            self.assertRaises(UsageQueryError, parseSince, bad, T0)

    def test_group_by(self):
        """
        C{key} by default; C{account}, C{model}, C{hour}; anything else is an
        error naming the parameter.
        """
        self.assertEqual(parseGroupBy(None), "key")
        self.assertEqual(parseGroupBy("model"), "model")
        e = self.assertRaises(UsageQueryError, parseGroupBy, "user")
        self.assertEqual(e.param, "group_by")


class AdminUsageTests(SynchronousTestCase):
    """
    C{GET /admin/usage} behind the admin key.
    """

    def setUp(self):
        from relay.console.admin import buildAdminResource
        from relay.state.settings import RuntimeSettings

        self.clock = Clock()
        self.clock.advance(T0)
        self.ledger = UsageLedger(clock=self.clock, store=MemoryUsageStore(),
                                  budgets={"alice": (1000, None)})
        self.root = buildAdminResource(
            "admin-secret", RuntimeSettings(), lambda: succeed([]), lambda i: succeed(None),
            clock=self.clock, usage=self.ledger,
        )

    def get(self, query, key="admin-secret"):
        request = makeRequest("usage", key=key)
        for pair in query.split("&") if query else []:
            name, _, value = pair.partition("=")
            request.addArg(name.encode(), value.encode())
        return render(self.root, request)

    def test_rows_totals_budgets(self):
        """
        Rows per group, the sum, and the budgets, since the hour asked for.
        """
        self.ledger.record("alice", "a1", "gpt-5.5", COUNTS)
        self.ledger.record("bob", "a2", "gpt-5.5", COUNTS)
        request = self.get("since=2026-01-31T00:00:00Z&group_by=account")
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        self.assertEqual(body["group_by"], "account")
        self.assertEqual(body["since"], dayStart(T0))
        self.assertEqual([r["account"] for r in body["rows"]], ["a1", "a2"])
        self.assertEqual(body["total"]["total_tokens"], 300)
        self.assertEqual(body["total"]["requests"], 2)
        self.assertEqual(body["budgets"][0]["key"], "alice")
        self.assertEqual(body["budgets"][0]["daily_used"], 150)

    def test_bad_parameters_and_key(self):
        """
        A bad C{since} or C{group_by} is a 400 naming it; no key is a 401.
        """
        for query, param in (("since=soon", "since"), ("group_by=user", "group_by")):
            request = self.get(query)
            self.assertEqual(request.responseCode, 400)
            self.assertEqual(jsonBody(request)["error"]["param"], param)
        self.assertEqual(self.get("", key=None).responseCode, 401)


# -- the runner ---------------------------------------------------------------------


def turnFor(endpoint="responses", stream=True, body=None, key="alice"):
    body = body or {"model": "gpt-5.5", "input": "hi", "stream": stream}
    return Turn(entrypoint="http", endpoint=endpoint,
                client=ClientKey(name=key, key="k", concurrency=0), model="gpt-5.5",
                body=body, stream=stream, requestId="req")


def upstream(*chunks, headers=None, end="done"):
    return lambda clock: succeed(FakeResponse(
        clock, headers=headers or {"content-type": "text/event-stream"},
        steps=[(0, c) for c in chunks], end=end))


class RawSink(FakeSink):
    """
    A recording sink with the pass-through C{writeRaw} of the SSE sink.
    """

    def __init__(self):
        super().__init__()
        self.raw = []

    def writeEvent(self, event):
        super().writeEvent(event)
        self.raw.append(event.raw)

    def writeRaw(self, data):
        self.raw.append(data)


class RunnerUsageTests(SynchronousTestCase):
    """
    The engine counts every turn once, from the terminal event or body, on
    every path (issue 13 item 5).
    """

    def setUp(self):
        self.rig = Rig([account("a", priority=1, model_mapping={"gpt-5.5": "gpt-up"}),
                        account("b", priority=2)])
        self.store = MemoryUsageStore()
        self.ledger = UsageLedger(clock=self.rig.clock, store=self.store,
                                  budgets={"capped": (100, None)})
        self.rig.runner.usage = self.ledger

    def run_(self, turn, sink=None):
        sink = sink or RawSink()
        outcome = []
        self.rig.door.enter(turn, sink).addCallback(outcome.append)
        self.successResultOf(self.ledger.flush())
        return sink, outcome

    def counted(self):
        return {(k, a, m): c for (_, k, a, m), c in self.store.rows.items()}

    def test_sse_terminal_usage(self):
        """
        A streamed turn is counted from its terminal event, under the key,
        the account and the upstream (mapped) model; C{turn.usage} holds it.
        """
        for kind in ("response.completed", "response.incomplete"):
            self.store.rows.clear()
            self.rig.script("a", upstream(CREATED + ITEM_ADDED, DELTA, terminal(kind)))
            turn = turnFor()
            sink, outcome = self.run_(turn)
            self.assertEqual(outcome, ["completed"])
            self.assertEqual(sink.events[-1], kind)
            self.assertEqual(self.counted(), {("alice", "a", "gpt-up"): COUNTS})
            self.assertEqual(turn.usage, COUNTS)

    def test_failed_turn_usage(self):
        """
        A C{response.failed} forwarded to the client (not a failover) is
        counted too.
        """
        failed = frame("response.failed", response={
            "id": "r", "status": "failed", "usage": RESPONSES_USAGE,
            "error": {"code": "invalid_prompt", "message": "violates our usage policy"}})
        self.rig.script("a", upstream(CREATED, failed))
        sink, _ = self.run_(turnFor())
        self.assertEqual(sink.events[-1], "response.failed")
        self.assertEqual(self.counted(), {("alice", "a", "gpt-up"): COUNTS})

    def test_failed_over_attempt_not_counted(self):
        """
        An attempt that failed over before output (here an upstream 5xx
        C{response.failed} carrying usage) is not counted; the turn is
        counted once, on the account that served it.
        """
        failed = frame("response.failed", response={
            "id": "r", "status": "failed", "usage": RESPONSES_USAGE,
            "error": {"code": "server_error", "message": "The server had an error"}})
        self.rig.script("a", upstream(CREATED, failed))
        self.rig.script("b", upstream(CREATED + ITEM_ADDED + DELTA,
                                      terminal(usage={"input_tokens": 7, "output_tokens": 3})))
        _, outcome = self.run_(turnFor())
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(self.rig.dialer.ids(), ["a", "b"])
        self.assertEqual(self.counted(), {("alice", "b", "gpt-5.5"): TokenCounts(1, 7, 0, 3, 0)})

    def test_json_body_usage(self):
        """
        A non-stream JSON answer is counted from its body.
        """
        body = json.dumps({"id": "resp_1", "object": "response", "status": "completed",
                           "output": [{"type": "message"}], "usage": RESPONSES_USAGE}).encode()
        self.rig.script("a", upstream(body, headers={"content-type": "application/json"}))
        _, outcome = self.run_(turnFor(stream=False), FakeSink())
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(self.counted(), {("alice", "a", "gpt-up"): COUNTS})

    def chatStream(self):
        def chunk(delta, finish=None, **extra):
            data = {"id": "c", "object": "chat.completion.chunk", "model": "gpt-5.5",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    "usage": None}
            data.update(extra)
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        usageChunk = chunk({}, choices=[], usage=CHAT_USAGE)
        return [chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hi"}),
                chunk({}, "stop") + usageChunk, b"data: [DONE]\n\n"], usageChunk

    def test_chat_stream_usage_chunk_dropped_unless_asked(self):
        """
        relay asks upstream for the chat usage chunk, counts it, and drops
        it when the client did not ask (the pass-through hands it over
        instead of writing it blindly).
        """
        chunks, usageChunk = self.chatStream()
        self.rig = Rig([account("c")])  # no model mapping: the raw pass-through runs
        self.rig.runner.usage = self.ledger
        for asked in (False, True):
            self.store.rows.clear()
            self.rig.script("c", upstream(*chunks))
            body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}
            if asked:
                body["stream_options"] = {"include_usage": True}
            sink, outcome = self.run_(turnFor("chat", body=body))
            self.assertEqual(outcome, ["completed"])
            self.assertEqual(self.counted(), {("alice", "c", "gpt-5.5"): COUNTS})
            written = b"".join(sink.raw)
            self.assertIn(chunks[0], written)  # written raw, as it came
            written = b"".join(sink.raw)
            self.assertEqual(usageChunk in written, asked)
            self.assertTrue(written.endswith(b"data: [DONE]\n\n"))

    def test_chat_request_asks_for_usage(self):
        """
        The upstream chat body always carries C{stream_options.include_usage}
        (other stream options kept).
        """
        from relay.engine.payload import upstreamBody

        body = {"model": "gpt-5.5", "messages": [], "stream": True,
                "stream_options": {"include_obfuscation": False}}
        sent = json.loads(upstreamBody(turnFor("chat", body=body), account("a")))
        self.assertEqual(sent["stream_options"],
                         {"include_obfuscation": False, "include_usage": True})
        self.assertNotIn("stream_options", json.loads(
            upstreamBody(turnFor("chat", stream=False, body={"model": "m", "messages": []}),
                         account("a"))))

    def test_budget_refused_before_admission(self):
        """
        A key over its budget gets the 429 before any slot or account is
        touched; other keys go on.
        """
        self.ledger.record("capped", "a", "m", COUNTS)
        sink, outcome = self.run_(turnFor(key="capped"))
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(self.rig.dialer.ids(), [])
        self.assertEqual(sink.errors[0].status, 429)
        self.assertIn("daily_tokens", sink.errors[0].message)
        self.assertEqual(sink.keepalives, 0)
        sink, outcome = self.run_(turnFor(key="alice"))
        self.assertEqual(outcome, ["completed"])


class ConfigTests(SynchronousTestCase):
    """
    The configuration of token accounting, budgets and the keepalive
    (config keys added by issue 13).
    """

    def test_keys_budgets_and_usage_section(self):
        """
        C{keys[].daily_tokens}/C{monthly_tokens} (positive integers or null)
        and C{usage:} parse; a bad value is one error naming the key path.
        """
        from relay.configuration.parse import settingsFromString
        from relay.base.records import ConfigError

        config = settingsFromString(
            "keys: [{name: a, key: k, daily_tokens: 1000, monthly_tokens: null}]\n"
            "usage: {flush_interval_seconds: 2, retention_days: 30}\n"
        )
        self.assertEqual((config.keys[0].daily_tokens, config.keys[0].monthly_tokens),
                         (1000, None))
        self.assertEqual(config.usage.flush_interval_seconds, 2)
        for text, path in (("keys: [{name: a, key: k, daily_tokens: 0}]", "keys[0].daily_tokens"),
                           ("usage: {retention: 3}", "usage.retention"),
                           ("usage: {flush_interval_seconds: 0}", "usage.flush_interval_seconds")):
            e = self.assertRaises(ConfigError, settingsFromString, text)
            self.assertIn(path, str(e))

    def test_stream_keepalive_interval(self):
        """
        C{gateway.stream_keepalive_interval}: default 10 (R24), 0..300 in the
        file, clamped as a runtime setting (R74).
        """
        from relay.configuration.parse import settingsFromString
        from relay.base.records import ConfigError
        from relay.state.settings import normalise

        self.assertEqual(settingsFromString("keys: []").gateway.stream_keepalive_interval, 10)
        self.assertEqual(
            settingsFromString("gateway: {stream_keepalive_interval: 2.5}")
            .gateway.stream_keepalive_interval, 2.5)
        e = self.assertRaises(ConfigError, settingsFromString,
                              "gateway: {stream_keepalive_interval: 301}")
        self.assertIn("gateway.stream_keepalive_interval", str(e))
        self.assertEqual(normalise({"stream_keepalive_interval": 900}),
                         {"stream_keepalive_interval": 300})
        self.assertEqual(normalise({"stream_keepalive_interval": -1}),
                         {"stream_keepalive_interval": 0})
