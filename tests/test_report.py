"""
Tests for L{relay.console.report}: the seed-style tables from a synthetic JSON log
whose counts are known.
"""

from __future__ import annotations

import io
import json

from twisted.logger import Logger, jsonFileLogObserver
from twisted.trial.unittest import SynchronousTestCase

from relay.console.report import buildReport, formatReport, main, percentile


def writeLog(path: str, separator: str = "\x1e") -> None:
    """
    Write a synthetic relay log through twisted.logger's JSON observer.

    Waits (ws): later_turn 5 acquired (100..500 ms), 1 queue_full;
    first_turn 2 acquired (1000, 3000 ms), 1 timeout, 1 client_gone.
    Waits (http): request 1 acquired (50 ms).
    Failovers: 3 (2 http status_503 a1->a2 named directly and via the
    following decision, 1 ws transport a2->a3 via the following decision).
    Decisions: 6 (session_hash 3 with sticky_session_hit, load_balance 2,
    previous_response_id 1 with sticky_previous_hit).
    Closes: 1013 "account is busy, please retry later" x1, 1000 x2.
    Turns: http ok 3 (200), ws ok 2, ws exhausted 1 (502).
    """
    with open(path, "w", encoding="utf-8") as f:
        log = Logger(observer=jsonFileLogObserver(f, recordSeparator=separator))

        def wait(name, entrypoint, phase, outcome, ms):
            log.info("wait finished", event=name, entrypoint=entrypoint, mode="ctx_pool",
                     phase=phase, outcome=outcome, wait_ms=ms, account_id="a1")

        for ms in (100, 200, 300, 400, 500):
            wait("openai.websocket_account_wait_finished", "ws", "later_turn", "acquired", ms)
        wait("openai.websocket_account_wait_finished", "ws", "later_turn", "queue_full", 0)
        wait("openai.websocket_account_wait_finished", "ws", "first_turn", "acquired", 1000)
        wait("openai.websocket_account_wait_finished", "ws", "first_turn", "acquired", 3000)
        wait("openai.websocket_account_wait_finished", "ws", "first_turn", "timeout", 30000)
        wait("openai.websocket_account_wait_finished", "ws", "first_turn", "client_gone", 700)
        log.info("wait finished", event="openai.account_wait_finished", phase="request",
                 outcome="acquired", wait_ms=50)

        def decision(request, layer, account, session=False, previous=False):
            log.debug("decision", event="openai.account_schedule_decision", request_id=request,
                      layer=layer, sticky_session_hit=session, sticky_previous_hit=previous,
                      selected_account_id=account)

        decision("r1", "session_hash", "a1", session=True)
        log.warn("switching", event="openai.upstream_failover_switching", request_id="r1",
                 account_id="a1", next_account_id="a2", reason="status_503",
                 upstream_status=503)
        decision("r1", "load_balance", "a2")
        decision("r2", "session_hash", "a1", session=True)
        log.warn("switching", event="openai.upstream_failover_switching", request_id="r2",
                 account_id="a1", upstream_status=503)
        decision("r2", "load_balance", "a2")
        decision("r3", "previous_response_id", "a2", previous=True)
        log.warn("switching", event="openai.websocket_upstream_failover_switching",
                 request_id="r3", account_id="a2", reason="transport_transient",
                 upstream_status=502)
        decision("r3", "session_hash", "a3", session=True)

        log.info("closed", event="relay.ws_closed", code=1013,
                 reason="account is busy, please retry later")
        log.info("closed", event="relay.ws_closed", code=1000, reason="websocket idle timeout")
        log.info("closed", event="relay.ws_closed", code=1000, reason="websocket idle timeout")

        def turn(entrypoint, status, outcome, attempts, ms):
            log.info("turn", event="relay.turn_finished", entrypoint=entrypoint, status=status,
                     outcome=outcome, account_id="a1", attempts=attempts, duration_ms=ms)

        turn("http", 200, "ok", 1, 100)
        turn("http", 200, "ok", 2, 300)
        turn("http", 200, "ok", 1, 200)
        turn("ws", 200, "ok", 1, 1000)
        turn("ws", 200, "ok", 3, 2000)
        turn("ws", 502, "exhausted", 11, 9000)
        log.info("unrelated", event="relay.something_else")
        log.info("no event field at all")


class PercentileTests(SynchronousTestCase):
    """
    L{percentile} is the nearest-rank percentile.
    """

    def test_values(self):
        """
        Known values.
        """
        self.assertIsNone(percentile([], 50))
        self.assertEqual(percentile([5], 95), 5)
        self.assertEqual(percentile([1, 2, 3, 4, 5], 50), 3)
        self.assertEqual(percentile(list(range(1, 101)), 95), 95)
        self.assertEqual(percentile([4, 1, 3, 2], 50), 2)


class ReportTests(SynchronousTestCase):
    """
    The report's numbers match the synthetic log.
    """

    def setUp(self):
        self.path = self.mktemp()
        writeLog(self.path)

    def runMain(self, *args):
        out = io.StringIO()
        status = main([self.path, *args], out=out)
        self.assertEqual(status, 0)
        return out.getvalue()

    def report(self):
        return json.loads(self.runMain("--json"))

    def test_waits(self):
        """
        Waits by entrypoint and phase, with p50/p95 of acquired waits.
        """
        waits = {(w["entrypoint"], w["phase"]): w for w in self.report()["waits"]}
        self.assertEqual(sorted(waits), [("http", "request"), ("ws", "first_turn"),
                                         ("ws", "later_turn")])
        later = waits[("ws", "later_turn")]
        self.assertEqual(
            (later["total"], later["acquired"], later["queue_full"], later["timeout"],
             later["client_gone"]),
            (6, 5, 1, 0, 0),
        )
        self.assertEqual((later["p50_ms"], later["p95_ms"]), (300, 500))
        first = waits[("ws", "first_turn")]
        self.assertEqual(
            (first["total"], first["acquired"], first["queue_full"], first["timeout"],
             first["client_gone"]),
            (4, 2, 0, 1, 1),
        )
        self.assertEqual((first["p50_ms"], first["p95_ms"]), (1000, 3000))
        self.assertEqual(waits[("http", "request")]["acquired"], 1)

    def test_failovers(self):
        """
        Failovers by reason and by from -> to, pairing a missing next
        account with the following decision of the same request.
        """
        f = self.report()["failovers"]
        self.assertEqual(f["total"], 3)
        self.assertEqual(
            f["by_reason"],
            [{"entrypoint": "http", "reason": "status_503", "count": 2},
             {"entrypoint": "ws", "reason": "transport_transient", "count": 1}],
        )
        self.assertEqual(
            f["by_account"],
            [{"from": "a1", "to": "a2", "count": 2}, {"from": "a2", "to": "a3", "count": 1}],
        )

    def test_decisions(self):
        """
        Decisions by layer, with the sticky-hit share (seed 003).
        """
        d = self.report()["decisions"]
        self.assertEqual(d["total"], 6)
        self.assertEqual(
            [(r["layer"], r["count"], r["share_percent"]) for r in d["by_layer"]],
            [("previous_response_id", 1, 16.7), ("session_hash", 3, 50.0),
             ("load_balance", 2, 33.3)],
        )
        self.assertEqual((d["sticky_session_hits"], d["sticky_previous_hits"], d["sticky_hits"]),
                         (3, 1, 4))
        self.assertEqual(d["sticky_hit_percent"], 66.7)

    def test_closesAndTurns(self):
        """
        WebSocket closes by code and reason; turns by outcome.
        """
        r = self.report()
        self.assertEqual(
            r["ws_closes"],
            [{"code": 1000, "reason": "websocket idle timeout", "count": 2},
             {"code": 1013, "reason": "account is busy, please retry later", "count": 1}],
        )
        turns = {(t["entrypoint"], t["outcome"]): t for t in r["turns"]}
        self.assertEqual(turns[("http", "ok")]["count"], 3)
        self.assertEqual(turns[("http", "ok")]["statuses"], {"200": 3})
        self.assertEqual(turns[("http", "ok")]["mean_attempts"], 1.33)
        self.assertEqual(turns[("http", "ok")]["p50_ms"], 200)
        self.assertEqual(turns[("ws", "exhausted")]["statuses"], {"502": 1})
        self.assertEqual(turns[("ws", "ok")]["count"], 2)
        self.assertEqual(r["events"]["relay.turn_finished"], 6)

    def test_text(self):
        """
        The text output has every section and the key numbers.
        """
        text = self.runMain()
        for heading in ("Requests that had to wait", "Failover switches (3)",
                        "Schedule decisions (6)", "WebSocket closes", "Turns"):
            self.assertIn(heading, text)
        self.assertIn("later_turn", text)
        self.assertIn("300 ms / 500 ms", text)
        self.assertIn("sticky hits: 4 of 6 (66.7%)", text)

    def test_newlineSeparated(self):
        """
        A log without record separators (one JSON object per line) reads
        the same.
        """
        path = self.mktemp()
        writeLog(path, separator="")
        with open(path, "rb") as f:
            self.assertEqual(f.read(1), b"{")
        out = io.StringIO()
        main([path, "--json"], out=out)
        self.assertEqual(json.loads(out.getvalue()), self.report())

    def test_empty(self):
        """
        An empty log gives empty tables, and the text says so.
        """
        report = buildReport([])
        self.assertEqual(report["failovers"]["total"], 0)
        self.assertIn("(no wait events)", formatReport(report))

    def test_textLog(self):
        """
        A log with lines but no JSON record (relay's text format) prints no
        tables, a one-line hint naming C{--log-format json} on standard
        error, and exits 1; from standard input too.
        """
        text = (
            b"2026-05-02T10:11:12.345Z [relay.turn_finished#info req=r1] turn r1 completed\n"
            b"2026-05-02T10:11:13.000Z [relay.ws_closed#info req=-] closed 1000\n"
        )
        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(text)
        for argv, stdin in (([path], None), (["-"], io.BytesIO(text))):
            out, err = io.StringIO(), io.StringIO()
            self.assertEqual(main(argv, out=out, stdin=stdin, err=err), 1)
            self.assertEqual(out.getvalue(), "")
            lines = err.getvalue().splitlines()
            self.assertEqual(len(lines), 1, lines)
            self.assertIn("no JSON records", lines[0])
            self.assertIn("--log-format json", lines[0])

    def test_emptyFileIsNotAnError(self):
        """
        An empty file is an empty log: empty tables, exit 0, nothing on
        standard error.
        """
        path = self.mktemp()
        open(path, "wb").close()
        out, err = io.StringIO(), io.StringIO()
        self.assertEqual(main([path], out=out, err=err), 0)
        self.assertIn("(no wait events)", out.getvalue())
        self.assertEqual(err.getvalue(), "")

    def test_missingFile(self):
        """
        A missing file exits 2.
        """
        err = io.StringIO()
        self.assertEqual(main([self.mktemp()], out=io.StringIO(), err=err), 2)
        self.assertIn("relay-report:", err.getvalue())
