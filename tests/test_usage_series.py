"""
Usage over time (L{relay.console.usageseries}) and the CSV exports
(L{relay.console.csvexport}): the buckets sum to the totals, every bucket
is there, bad parameters name themselves, the CSV parses.
"""

from __future__ import annotations

import csv
import io

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.console.admin import buildAdminResource
from relay.console.csvexport import csvBody
from relay.console.tenants import RequestsResource
from relay.console.usageseries import renderSeries
from relay.state.settings import RuntimeSettings
from relay.tenants.requestlog import MemoryRequestLog
from relay.usage.ledger import UsageLedger
from relay.usage.store import MemoryUsageStore, hourOf
from relay.usage.tokens import TokenCounts
from tests.test_admin import jsonBody, makeRequest, render
from tests.test_tenants_requestlog import failedRecord, record

T0 = 1_769_860_000.0
KEY = "admin-secret"


class SeriesTests(SynchronousTestCase):
    """
    C{GET /admin/usage/series} over a memory store and log.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.store = MemoryUsageStore()
        self.ledger = UsageLedger(clock=self.clock, store=self.store)
        self.log = MemoryRequestLog(clock=self.clock)
        self.root = buildAdminResource(KEY, RuntimeSettings(), lambda: succeed([]),
                                       lambda i: succeed(None), clock=self.clock,
                                       usage=self.ledger)
        self.root.route(b"usage").series = lambda request: renderSeries(
            request, self.ledger, self.log, self.clock)
        h = hourOf(T0)
        self.successResultOf(self.store.add([
            ((h, "alice", "a1", "gpt-5.5"), TokenCounts(2, 100, 10, 20, 5, 3_000_000)),
            ((h - 3600, "bob", "a2", "gpt-5.5"), TokenCounts(1, 50, 0, 10, 0, 1_000_000)),
            ((h - 5 * 3600, "alice", "a2", "o3"), TokenCounts(1, 7, 0, 3, 0, 0, 1)),
            ((h - 3 * 86400, "alice", "a1", "o3"), TokenCounts(9, 900, 0, 90, 0, 9)),
        ]))
        for n, r in enumerate([record(1, key="alice", t=h + 5), record(2, key="alice", t=h + 6),
                               failedRecord(3, code="rate_limited", t=h - 3000),
                               record(4, key="bob", t=h - 3000),
                               failedRecord(5, t=h - 100)]):
            self.log.add(r)

    def get(self, query="", path="usage/series"):
        request = makeRequest(path, key=KEY)
        for pair in query.split("&") if query else []:
            name, _, value = pair.partition("=")
            request.addArg(name.encode(), value.encode())
        return render(self.root, request)

    def assertSums(self, body):
        """
        Each series' points sum to its total; the series to the answer's.
        """
        fields = [n for n in body["total"] if n not in ("failures", "cost_usd")]
        for series in body["series"]:
            self.assertEqual(len(series["points"]), len(body["buckets"]))
            self.assertEqual([p["time"] for p in series["points"]], body["buckets"])
            for name in fields:
                self.assertEqual(sum(p[name] for p in series["points"]),
                                 series["total"][name], name)
            self.assertAlmostEqual(sum(p["cost_usd"] for p in series["points"]),
                                   series["total"]["cost_usd"], places=9)
            for kind, n in series["total"]["failures"].items():
                self.assertEqual(sum(p["failures"].get(kind, 0) for p in series["points"]), n)
        for name in fields:
            self.assertEqual(sum(s["total"][name] for s in body["series"]), body["total"][name])

    def test_defaults_24h_hourly(self):
        """
        24 hourly buckets, the current hour last; one series C{all}; the
        tokens from the store, the turns and failures from the log.
        """
        request = self.get()
        self.assertEqual(request.responseCode, 200)
        body = jsonBody(request)
        h = hourOf(T0)
        self.assertEqual((body["range"], body["bucket"], body["group_by"]),
                         ("24h", "hour", "none"))
        self.assertEqual(len(body["buckets"]), 24)
        self.assertEqual(body["buckets"][-1], h)
        [series] = body["series"]
        self.assertEqual(series["group"], "all")
        self.assertEqual(body["total"]["input_tokens"], 157)
        self.assertEqual(body["total"]["cost_usd"], 0.004)
        self.assertEqual(body["total"]["unpriced_requests"], 1)
        self.assertEqual((body["total"]["requests"], body["total"]["failed"]), (5, 2))
        self.assertEqual(body["total"]["failures"], {"rate_limited": 1, "server_error": 1})
        self.assertEqual(body["failure_kinds"], ["rate_limited", "server_error"])
        self.assertEqual(series["points"][-1]["requests"], 2)
        self.assertSums(body)

    def test_grouped_7d_and_30d(self):
        """
        Per key over 7 days hourly (168 buckets), per model over 30 days
        daily; the buckets sum to the totals either way.
        """
        body = jsonBody(self.get("range=7d&group_by=key"))
        self.assertEqual(len(body["buckets"]), 168)
        self.assertEqual({s["group"] for s in body["series"]}, {"alice", "bob"})
        self.assertEqual(body["total"]["input_tokens"], 1057)
        self.assertSums(body)
        body = jsonBody(self.get("range=30d&group_by=model"))
        self.assertEqual((body["bucket"], len(body["buckets"])), ("day", 30))
        self.assertEqual({s["group"] for s in body["series"]}, {"gpt-5.5", "o3"})
        self.assertSums(body)
        body = jsonBody(self.get("range=7d&bucket=day&group_by=account&model=o3"))
        self.assertEqual({s["group"]: s["total"]["input_tokens"] for s in body["series"]},
                         {"a1": 900, "a2": 7})
        self.assertSums(body)

    def test_bad_parameters(self):
        for query, param in (("range=1y", "range"), ("bucket=minute", "bucket"),
                             ("group_by=user", "group_by"), ("format=xml", "format")):
            request = self.get(query)
            self.assertEqual(request.responseCode, 400, query)
            self.assertEqual(jsonBody(request)["error"]["param"], param)
        self.assertEqual(render(self.root, makeRequest("usage/series", key=None)).responseCode,
                         401)

    def test_csv_parses(self):
        """
        C{format=csv}: an attachment whose rows parse and sum to the JSON
        totals; a failure kind is a column.
        """
        request = self.get("range=7d&group_by=key&format=csv")
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-type"),
                         [b"text/csv; charset=utf-8"])
        self.assertIn(b"attachment", request.responseHeaders.getRawHeaders(
            b"content-disposition")[0])
        rows = list(csv.DictReader(io.StringIO(b"".join(request.written).decode())))
        body = jsonBody(self.get("range=7d&group_by=key"))
        self.assertEqual(sum(int(r["input_tokens"]) for r in rows), body["total"]["input_tokens"])
        self.assertEqual(sum(int(r["requests"]) for r in rows), body["total"]["requests"])
        self.assertEqual(sum(int(r["failures_rate_limited"]) for r in rows), 1)
        self.assertTrue(all(r["time_iso"].endswith("Z") for r in rows))

    def test_usage_totals_csv(self):
        """
        C{GET /admin/usage?format=csv}: the grouped rows as CSV.
        """
        request = self.get("group_by=model&since=0&format=csv", path="usage")
        rows = list(csv.DictReader(io.StringIO(b"".join(request.written).decode())))
        self.assertEqual({r["model"]: int(r["input_tokens"]) for r in rows},
                         {"gpt-5.5": 150, "o3": 907})


class RequestsCSVTests(SynchronousTestCase):
    """
    C{GET /admin/requests?format=csv}.
    """

    def test_page_as_csv(self):
        from tests.test_runner import T0 as RECORDS_T0

        clock = Clock()
        clock.advance(RECORDS_T0 + 10)
        log = MemoryRequestLog(clock=clock)
        for n in range(3):
            log.add(record(n, key="=cmd()" if n == 1 else "bob", tried=["a0"]))
        resource = RequestsResource(KEY, log, clock)
        request = makeRequest("requests", key=KEY)
        request.postpath = []
        request.addArg(b"format", b"csv")
        request.addArg(b"limit", b"2")
        render(resource, request)
        self.assertEqual(request.responseCode, 200)
        rows = list(csv.DictReader(io.StringIO(b"".join(request.written).decode())))
        self.assertEqual([r["request_id"] for r in rows], ["req-2", "req-1"])
        self.assertEqual(rows[0]["accounts"], "a0;a1")
        self.assertEqual(rows[1]["key"], "'=cmd()")
        self.assertEqual(request.responseHeaders.getRawHeaders(b"x-next-cursor"), [b"2"])
        request = makeRequest("requests", key=KEY)
        request.postpath = []
        request.addArg(b"format", b"csv")
        request.addArg(b"limit", b"5000")
        render(resource, request)
        self.assertEqual(request.responseCode, 200)

    def test_cells(self):
        """
        L{csvBody}: commas, quotes and newlines quoted; L{None} empty.
        """
        text = csvBody(["a", "b"], [['x,"y"\nz', None]]).decode()
        self.assertEqual(list(csv.reader(io.StringIO(text))), [["a", "b"], ['x,"y"\nz', ""]])
