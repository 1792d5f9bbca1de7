"""
Tests for L{relay.policy}: attempt ends are judged by what they mean, never
by their wire form (behaviour.md R86), and one bookkeeping writes account
state from them; a departed client writes nothing (R2).
"""

from __future__ import annotations

import json

from attrs import evolve
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.policy import failures as F
from relay.policy.classify import DefaultClassifier
from relay.state.runtime import AccountRuntime
from relay.policy.health import AccountHealth
from relay.base.records import Account, ClientKey, GatewaySettings, ProxySpec, Turn
from relay.policy import ends as E
from relay.policy.bookkeeping import AccountBookkeeping
from relay.policy.judgement import eventError, impliedStatus, judge
from relay.policy.proxyhealth import ProxyHealth
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore

T0 = 1_800_000_000.0
MODEL = "gpt-5.5"
APIKEY = Account(id="a", type="apikey", base_url="http://u/v1", credential="k")
OAUTH = Account(id="o", type="oauth", base_url="http://u/codex", credential="t")
PROXIED = Account(
    id="p", type="apikey", base_url="http://u/v1", credential="k",
    proxy=ProxySpec(id="px", scheme="socks5", host="127.0.0.1", port=1080),
)


def turn(entrypoint="http", endpoint="responses", phase="request", previous=None):
    """
    A turn for the judgement (only endpoint, phase and chain id matter).
    """
    return Turn(
        entrypoint=entrypoint, endpoint=endpoint, client=ClientKey(name="t", key="k"),
        model=MODEL, body={}, stream=True, phase=phase, previousResponseId=previous,
    )


def errorJSON(message, type_="server_error", code=None) -> dict:
    return {"message": message, "type": type_, "code": code, "param": None}


def httpStatus(status, error, headers=None) -> E.StatusRefused:
    return E.StatusRefused(
        status, {"content-type": "application/json", **(headers or {})},
        json.dumps({"error": error}).encode(),
    )


def shape(verdict):
    """
    What a verdict means for the account and the turn, without the fields
    that legitimately carry the wire form (messages).
    """
    if verdict is None:
        return None
    return (
        verdict.failover, verdict.status, verdict.sameAccount, verdict.backoff,
        verdict.oauth429, tuple((m.kind, m.seconds) for m in verdict.markings),
        verdict.clientError.status if verdict.clientError else None,
        verdict.clientError.wsClose if verdict.clientError else None,
    )


class JudgementTests(SynchronousTestCase):
    """
    R86.1, R86.2, R86.4, R56: one meaning, one verdict, whatever the wire.
    """

    def setUp(self):
        self.classifier = DefaultClassifier()

    def judged(self, end, account=APIKEY, t=None):
        return judge(self.classifier, end, account, t or turn(), T0)

    def test_5xx_same_on_every_wire(self):
        """
        R86.1: a 503 as an HTTP status, as a first-turn WebSocket handshake
        status, and as an in-band C{error} event with C{status: 503} (WS and
        SSE) is one verdict: fail over, and the R11 streak marking on an
        API-key account.
        """
        err = errorJSON("Service Unavailable")
        forms = [
            httpStatus(503, err),
            evolve(httpStatus(503, err), wire=E.WIRE_WS_HANDSHAKE),
            E.InBandFailure({"type": "error", "status": 503, "error": err}, E.WIRE_WS),
            E.InBandFailure({"type": "error", "status": 503, "error": err}, E.WIRE_SSE),
        ]
        shapes = {shape(self.judged(end, t=turn("ws", phase="first_turn"))) for end in forms}
        self.assertEqual(len(shapes), 1, shapes)
        verdict = self.judged(forms[2])
        self.assertTrue(verdict.failover)
        self.assertEqual([m.kind for m in verdict.markings], [F.MARK_TRANSIENT_STREAK])

    def test_html_403_in_band_is_the_html_row(self):
        """
        R86.1 with R11's 403 rows: an in-band C{error} event whose wrapped
        answer is an HTML page (the event's C{headers} say C{text/html}, or
        the message is a document) is judged like the HTTP 403 with that
        page: fail over, no marking; a JSON 403 in band still counts.
        """
        page = "<!DOCTYPE html><html><head><title>Attention Required!</title></head></html>"
        http = self.judged(E.StatusRefused(
            403, {"content-type": "text/html; charset=UTF-8"}, page.encode()))
        self.assertTrue(http.failover)
        self.assertEqual(http.markings, ())
        for headers in ({"content-type": "text/html; charset=UTF-8", "server": "cloudflare"}, {}):
            event = {"type": "error", "status": 403, "headers": headers,
                     "error": {"type": "invalid_request_error", "message": page}}
            self.assertEqual(shape(self.judged(E.InBandFailure(event, E.WIRE_WS))), shape(http))
        forbidden = errorJSON("Country, region, or territory not supported")
        event = {"type": "error", "status": 403, "error": forbidden}
        markings = self.judged(E.InBandFailure(event, E.WIRE_WS)).markings
        self.assertEqual([m.kind for m in markings], [F.MARK_COUNT_403])

    def test_server_error_failed_stands_for_500(self):
        """
        R86.2: a pre-output C{response.failed} (or C{error} event, or chat
        error chunk) with code C{server_error} is judged like an HTTP 500:
        it fails over and adds to the streak.
        """
        err = errorJSON("The server had an error", code="server_error")
        http = self.judged(httpStatus(500, err))
        for end in (
            E.InBandFailure({"type": "response.failed", "response": {"error": err}}, E.WIRE_SSE),
            E.InBandFailure({"type": "error", "error": err}, E.WIRE_WS),
            E.InBandFailure({"error": err}, E.WIRE_CHAT),
        ):
            self.assertEqual(shape(self.judged(end)), shape(http), end)
        self.assertIn(F.MARK_TRANSIENT_STREAK, [m.kind for m in http.markings])

    def test_overload_marks_nothing_anywhere(self):
        """
        R86.2: a capacity shed marks nothing, however it arrives; it is a
        same-account retry with backoff (R8, R14).
        """
        err = errorJSON("Servers are overloaded", code="server_is_overloaded")
        forms = [
            httpStatus(503, err),
            E.InBandFailure({"type": "error", "status": 503, "error": err}, E.WIRE_WS),
            E.InBandFailure({"type": "response.failed", "response": {"error": err}}, E.WIRE_SSE),
            E.InBandFailure({"error": err}, E.WIRE_CHAT),
        ]
        for end in forms:
            verdict = self.judged(end)
            self.assertTrue(verdict.failover and verdict.sameAccount and verdict.backoff, end)
            self.assertEqual(verdict.markings, (), end)

    def test_rate_limit_in_band_is_a_429(self):
        """
        R86.1, R49 step 5: an in-band rate limit without a status is judged
        like an HTTP 429: the rate-limit marking (API key) and the R13 window
        (OAuth).
        """
        err = {"type": "usage_limit_reached", "message": "The usage limit has been reached",
               "resets_in_seconds": 600}
        event = E.InBandFailure({"type": "error", "error": err}, E.WIRE_WS)
        self.assertEqual(shape(self.judged(event)), shape(self.judged(httpStatus(429, err))))
        self.assertEqual(
            shape(self.judged(event, OAUTH)), shape(self.judged(httpStatus(429, err), OAUTH))
        )
        self.assertTrue(self.judged(event, OAUTH).oauth429)

    def test_policy_refusal_is_forwarded(self):
        """
        R23: an in-band failure R23 does not fail over (a policy refusal) is
        not a failover on any wire.
        """
        err = errorJSON("violates our usage policy", "invalid_request_error", "content_policy")
        for wire in (E.WIRE_SSE, E.WIRE_WS):
            verdict = self.judged(
                E.InBandFailure({"type": "response.failed", "response": {"error": err}}, wire)
            )
            self.assertTrue(verdict is None or not verdict.failover)

    def test_clean_end_is_a_stream_failure(self):
        """
        R86.4: a clean end without a terminal event fails over as R23's
        "stream ended before a terminal event", with no marking.
        """
        verdict = self.judged(E.StreamEnded())
        self.assertEqual(verdict.kind, F.STREAM)
        self.assertEqual(verdict.reason, "stream_no_terminal")
        self.assertTrue(verdict.failover)
        self.assertEqual(verdict.markings, ())

    def test_handshake_outside_guard(self):
        """
        R56: outside the guard a 401/403 handshake closes 1008 "upstream
        websocket authentication failed", another 4xx 1008 "handshake
        rejected"; 429 and 5xx still take the HTTP rules.
        """
        later = turn("ws", phase="later_turn")
        auth = self.judged(
            evolve(httpStatus(403, errorJSON("no")), wire=E.WIRE_WS_HANDSHAKE), t=later
        )
        self.assertFalse(auth.failover)
        self.assertEqual(auth.clientError.wsClose[0], 1008)
        other = self.judged(
            evolve(httpStatus(404, errorJSON("no")), wire=E.WIRE_WS_HANDSHAKE), t=later
        )
        self.assertEqual(other.clientError.wsClose,
                         (1008, "upstream websocket handshake rejected"))
        busy = self.judged(
            evolve(httpStatus(503, errorJSON("down")), wire=E.WIRE_WS_HANDSHAKE), t=later
        )
        self.assertTrue(busy.failover)

    def test_not_failures(self):
        """
        Successes, forwarded failures, departures and refusals have no
        verdict.
        """
        for end in (E.Completed("r"), E.Forwarded("r"), E.Departed(), E.Refused("off")):
            self.assertIsNone(self.judged(end))

    def test_timeouts(self):
        """
        R20: a first-output timeout is the 504 safe-after-write verdict; R24:
        an idle stream before output fails over like a read error.
        """
        first = self.judged(E.RelayTimeout(E.FIRST_OUTPUT, 30))
        self.assertEqual((first.kind, first.status, first.safeAfterWrite),
                         (F.FIRST_OUTPUT_TIMEOUT, 504, True))
        idle = self.judged(E.RelayTimeout(E.IDLE, 180))
        self.assertTrue(idle.failover)

    def test_event_error_and_implied_status(self):
        """
        L{eventError} reads the three in-band shapes; L{impliedStatus} names
        500 for C{server_error}, 429 for rate limits, 0 otherwise.
        """
        self.assertEqual(
            eventError({"type": "error", "status_code": "429", "error": {"code": "x"},
                        "headers": {"Retry-After": "3"}}),
            ({"code": "x"}, 429, {"retry-after": "3"}),
        )
        self.assertEqual(impliedStatus({"code": "server_error"}), 500)
        self.assertEqual(impliedStatus({"type": "rate_limit_exceeded"}), 429)
        self.assertEqual(impliedStatus({"code": "insufficient_quota"}), 429)
        self.assertEqual(impliedStatus({"message": "Please try again"}), 0)


class BookkeepingTests(SynchronousTestCase):
    """
    R2, R86.3, R86.4: what each end writes to account state.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.settings = RuntimeSettings(current=GatewaySettings())
        self.store = MemoryStateStore(clock=self.clock)
        self.health = AccountHealth(store=self.store, clock=self.clock, settings=self.settings)
        self.proxies = ProxyHealth(clock=self.clock)
        self.book = AccountBookkeeping(
            health=self.health, clock=self.clock, proxyHealth=self.proxies
        )
        self.classifier = DefaultClassifier()

    def record(self, end, account=APIKEY, t=None):
        verdict = judge(self.classifier, end, account, t or turn(), self.clock.seconds())
        return self.successResultOf(self.book.record(account, end, verdict, MODEL, "req"))

    def state(self, account=APIKEY):
        return self.successResultOf(self.store.getAccountStates([account.id]))[account.id]

    def breakerFailures(self, account=APIKEY):
        state = self.health.breakerState(account.id)
        return 0 if state is None else state["failures"]

    def test_departed_writes_nothing(self):
        """
        R2: a departure writes nothing, even when handed a verdict with
        markings: there is no path from it to the store, the breaker, the
        proxy quarantine or the operator counters.
        """
        marking = judge(self.classifier, E.TransportFailure(ConnectionRefusedError()), PROXIED,
                        turn(), T0)
        self.assertTrue(marking.markings)
        for _ in range(5):
            self.successResultOf(
                self.book.record(PROXIED, E.Departed("client_gone"), marking, MODEL, "req")
            )
        self.assertEqual(self.state(PROXIED), AccountRuntime())
        self.assertIsNone(self.health.breakerState(PROXIED.id))
        self.assertIsNone(self.health.localBlock(PROXIED.id))
        self.assertEqual(self.proxies.snapshot(), {})
        self.assertEqual(self.book.stats, {})

    def test_read_errors_count_toward_breaker_everywhere(self):
        """
        R86.3: a cut before output, a cut after output and a transient
        transport failure each count toward R-B1; the third opens it.
        """
        self.record(E.StreamCut("ConnectionLost"))
        self.record(E.StreamCut("ConnectionLost", afterOutput=True))
        self.assertEqual(self.breakerFailures(), 2)
        self.record(E.TransportFailure(ConnectionLost()))
        self.assertIsNotNone(self.health.localBlock(APIKEY.id))
        self.assertTrue(self.state().blockReason.startswith("transport circuit open"))

    def test_clean_ends_and_relay_timeouts_never_count(self):
        """
        R86.3, R86.4: clean ends without a terminal event (before or after
        output), relay's own timeouts, staging overflow and a busy pool write
        nothing to the breaker or the store.
        """
        for _ in range(3):
            for end in (E.StreamEnded(), E.StreamEnded(afterOutput=True),
                        E.RelayTimeout(E.IDLE, 1), E.RelayTimeout(E.IDLE, 1, afterOutput=True),
                        E.RelayTimeout(E.FIRST_OUTPUT, 30), E.StagingOverflow(9 * 2**20),
                        E.PoolBusy("timeout")):
                self.record(end)
        self.assertEqual(self.breakerFailures(), 0)
        self.assertEqual(self.state(), AccountRuntime())
        self.assertIsNone(self.health.localBlock(APIKEY.id))

    def test_persistent_transport_cools_without_breaker(self):
        """
        R4: a persistent transport failure cools the account for 10 minutes
        and does not count toward the breaker.
        """
        self.record(E.TransportFailure(ConnectionRefusedError()))
        self.assertEqual(self.state().blockedUntil, T0 + 600)
        self.assertEqual(self.breakerFailures(), 0)

    def test_stream_cut_through_proxy_counts_toward_quarantine(self):
        """
        Issue 8: cuts through a proxy, before or after output, count toward
        its quarantine; a clean end does not.
        """
        self.record(E.StreamEnded(), PROXIED)
        self.assertEqual(self.proxies.snapshot(), {})
        self.record(E.StreamCut("x"), PROXIED)
        self.record(E.StreamCut("x", afterOutput=True), PROXIED)
        self.assertTrue(self.proxies.isQuarantined(PROXIED))

    def test_in_band_5xx_streak_like_http(self):
        """
        R86.2: two in-band 503 events block the account+model for 10 s,
        exactly as two HTTP 503s do.
        """
        err = {"type": "error", "status": 503, "error": errorJSON("down")}
        self.record(E.InBandFailure(err, E.WIRE_WS))
        self.assertEqual(self.state().modelBlocks, {})
        self.record(E.InBandFailure(err, E.WIRE_WS))
        self.assertEqual(self.state().modelBlocks, {MODEL: T0 + 10})

    def test_success_resets(self):
        """
        A completed turn resets the streak and the breaker; a forwarded
        failure neither resets nor marks.
        """
        self.record(httpStatus(503, errorJSON("down")))
        self.record(E.StreamCut("x"))
        self.record(E.Forwarded("r"))
        self.assertEqual(self.breakerFailures(), 1)
        self.assertEqual(self.health.streaks(self.state(), self.clock.seconds()), {MODEL: 1})
        self.record(E.Completed("r"))
        self.assertIsNone(self.health.breakerState(APIKEY.id))
        self.assertEqual(self.health.streaks(self.state(), self.clock.seconds()), {})

    def test_operator_counters(self):
        """
        Failures update the operator counters (last error and when,
        failovers before output only).
        """
        self.clock.advance(5)
        self.record(httpStatus(503, errorJSON("down")))
        self.record(E.StreamCut("x", afterOutput=True))
        stats = self.book.stats[APIKEY.id]
        self.assertEqual(stats["failovers"], 1)
        self.assertEqual(stats["last_error_at"], T0 + 5)
        self.assertIn("stream_read_error", stats["last_error"])

    def test_oauth_429_window(self):
        """
        R13: an OAuth 429 inside its window asks for a same-account retry and
        marks nothing; after the window it marks the account rate-limited.
        """
        end = httpStatus(429, errorJSON("slow down", "rate_limit_error", "rate_limit_exceeded"))
        recorded = self.record(end, OAUTH)
        self.assertEqual(recorded.oauth429RetryIn, 0.5)
        self.assertEqual(self.state(OAUTH), AccountRuntime())
        self.clock.advance(121)
        recorded = self.record(end, OAUTH)
        self.assertTrue(recorded.oauth429Marked)
        self.assertGreater(self.state(OAUTH).rateLimitedUntil, self.clock.seconds())

    def test_clear_lifts_everything(self):
        """
        An operator's clear ends the stored states, the streak, the breaker
        and the proxy quarantine of the account.
        """
        self.record(httpStatus(503, errorJSON("down")), PROXIED)
        self.record(httpStatus(503, errorJSON("down")), PROXIED)
        self.record(E.StreamCut("x"), PROXIED)
        self.record(E.StreamCut("x"), PROXIED)
        self.assertTrue(self.proxies.isQuarantined(PROXIED))
        self.successResultOf(self.book.clear(PROXIED))
        self.assertEqual(self.state(PROXIED), AccountRuntime())
        self.assertIsNone(self.health.breakerState(PROXIED.id))
        self.assertFalse(self.proxies.isQuarantined(PROXIED))
        self.record(httpStatus(503, errorJSON("down")), PROXIED)
        self.assertEqual(self.state(PROXIED).modelBlocks, {})


class OperatorTruthTests(SynchronousTestCase):
    """
    Issue 11 "operator truth": for every marking the engine can write, the
    operator view reports the account unschedulable for that model while the
    scheduler skips it; after an operator's clear both agree it is back.
    """

    def setUp(self):
        from relay.admission.memory import MemorySlotAdmission
        from relay.engine.runner import TurnRunner
        from relay.console.view import OperatorView
        from relay.scheduling.scheduler import AccountScheduler

        self.clock = Clock()
        self.clock.advance(T0)
        self.settings = RuntimeSettings(current=GatewaySettings())
        self.store = MemoryStateStore(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)
        self.health = AccountHealth(store=self.store, clock=self.clock, settings=self.settings)
        self.proxies = ProxyHealth(clock=self.clock)
        self.classifier = DefaultClassifier()
        self.schedulers = {}
        self.views = {}
        for account in (APIKEY, OAUTH, PROXIED):
            scheduler = AccountScheduler(
                accounts=[account], admission=self.admission, store=self.store,
                clock=self.clock, settings=self.settings,
                extraBlock=lambda a, now, model: self.health.localBlock(a.id, model),
                isQuarantined=self.proxies.isQuarantined,
            )
            runner = TurnRunner(
                clock=self.clock, scheduler=scheduler, admission=self.admission, dialer=None,
                classifier=self.classifier, health=self.health, settings=self.settings,
                proxyHealth=self.proxies,
            )
            self.schedulers[account.id] = (scheduler, runner)
            self.views[account.id] = OperatorView(
                accounts=[account], store=self.store, admission=self.admission,
                health=self.health, runner=runner, clock=self.clock, proxyHealth=self.proxies,
            )

    def record(self, account, end, times=1):
        runner = self.schedulers[account.id][1]
        for _ in range(times):
            verdict = judge(self.classifier, end, account, turn(), self.clock.seconds())
            self.successResultOf(runner.bookkeeping.record(account, end, verdict, MODEL, "r"))

    def view(self, account):
        return self.successResultOf(self.views[account.id].accountsView())[0]

    def selectable(self, account) -> bool:
        """
        Whether selection for L{MODEL} picks C{account}. A proxied account
        is selected among itself and a direct one, because quarantine fails
        open when every candidate is quarantined (R41).
        """
        from relay.scheduling.scheduler import AccountScheduler
        from relay.scheduling.selection import NoAccountAvailable

        scheduler = self.schedulers[account.id][0]
        if account.proxy is not None:
            scheduler = AccountScheduler(
                accounts=[account, evolve(APIKEY, id="direct", priority=99)],
                admission=self.admission, store=self.store,
                clock=self.clock, settings=self.settings,
                extraBlock=lambda a, now, model: self.health.localBlock(a.id, model),
                isQuarantined=self.proxies.isQuarantined,
            )
        result = []
        d = scheduler.select(turn(), frozenset())
        d.addCallbacks(result.append, lambda f: result.append(f.trap(NoAccountAvailable)))
        self.assertTrue(result)
        selection = result[0]
        if selection is NoAccountAvailable:
            return False
        if selection.lease is not None:
            selection.lease.release()
        return selection.account.id == account.id

    def check(self, account, kind):
        row = self.view(account)
        self.assertFalse(row["schedulable"], (kind, row))
        self.assertTrue(row["blocks"], (kind, row))
        for block in row["blocks"]:
            self.assertIn(block["scope"], ("account", "model", "proxy"))
            if block["scope"] == "model":
                self.assertEqual(block["model"], MODEL)
            if block["until"] is not None:
                self.assertGreater(block["seconds_left"], 0)
                self.assertTrue(block["until_iso"].endswith("Z"))
        self.assertFalse(self.selectable(account), kind)
        self.successResultOf(self.views[account.id].clearAccount(account.id))
        row = self.view(account)
        self.assertTrue(row["schedulable"], (kind, row))
        self.assertEqual(row["blocks"], [])
        self.assertEqual(row["streaks"], {})
        self.assertTrue(self.selectable(account), kind)

    def test_every_marking(self):
        """
        Each marking kind, written through the engine's bookkeeping from a
        real fault, blocks the account in the view and in selection alike.
        """
        err = errorJSON
        cases = [
            ("transport_error (R4)", APIKEY, E.TransportFailure(ConnectionRefusedError()), 1),
            ("rate_limited (R12)", APIKEY,
             httpStatus(429, err("slow", "rate_limit_error", "rate_limit_exceeded"),
                        {"retry-after": "30"}), 1),
            ("disabled (401)", APIKEY, httpStatus(401, err("bad key", "invalid_request_error")),
             1),
            ("count_403 (R11)", APIKEY, httpStatus(403, err("forbidden", "permission_error")), 1),
            ("transient streak -> model block (R11)", APIKEY, httpStatus(503, err("down")), 2),
            ("in-band streak -> model block (R86.2)", APIKEY,
             E.InBandFailure({"type": "error", "status": 502, "error": err("bad gw")},
                             E.WIRE_WS), 3),
            ("model not found (R11)", APIKEY,
             httpStatus(400, err("model not found", "invalid_request_error",
                                 "model_not_found")), 1),
            ("breaker (R-B1)", APIKEY, E.StreamCut("reset"), 3),
            ("oauth 401 (R11)", OAUTH, httpStatus(401, err("expired", "invalid_request_error")),
             1),
            ("proxy quarantine", PROXIED, E.StreamEnded(), 0),
        ]
        for name, account, end, times in cases:
            if name == "proxy quarantine":
                self.proxies.streamCut(PROXIED)
                self.proxies.streamCut(PROXIED)
            self.record(account, end, times)
            self.check(account, name)

    def test_oauth_429_after_window(self):
        """
        R13: the rate limit written after the OAuth 429 window shows and is
        honoured.
        """
        end = httpStatus(429, errorJSON("slow", "rate_limit_error", "rate_limit_exceeded"))
        self.record(OAUTH, end)
        self.clock.advance(121)
        self.record(OAUTH, end)
        self.check(OAUTH, "oauth 429 after window")
