"""
behaviour.md R113 on a L{Clock}: a key's own limits never push a client off
the WebSocket. A model the key may not use is a status-bearing C{error}
event; a spent budget and an C{rpm}/C{tpm} window that cannot be waited
for are the 429 event Codex renders with its reset time; a window that
frees within C{scheduling.fallback_wait_timeout} is waited for (keepalives
as in a slot wait), on every entrypoint; the socket stays open; only a
disabled, expired or revoked key closes it (1008).
"""

from __future__ import annotations

import json

from attrs import evolve
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from relay.base.records import ClientError
from relay.entry.sinks import writeError
from relay.entry.wssink import PROMO_HEADER, WebSocketSink, keyLimitEvent
from relay.usage.store import DAY, dayStart
from tests.tenantsrig import TenantsRig, account, key
from tests.test_runner import T0

MODES = ("ctx_pool", "passthrough", "http_bridge")


class Conn:
    """
    A client WebSocket: what was sent, pings, the close.
    """

    def __init__(self):
        self.sent, self.pings, self.closed = [], 0, None

    def isOpen(self):
        return self.closed is None

    def sendText(self, data):
        self.sent.append(json.loads(data))

    def sendPing(self):
        self.pings += 1

    def closeWith(self, code, reason):
        self.closed = (code, reason)


def rig(*keys, wait=30.0, ping=10.0, keepalive=10.0):
    """
    @return: a L{TenantsRig} with one account whose rate waits fit C{wait}
        seconds.
    """
    made = TenantsRig([account("a")], keys=keys)
    current = made.settings.current
    made.settings.current = evolve(
        current, stream_keepalive_interval=keepalive,
        scheduling=evolve(current.scheduling, fallback_wait_timeout=wait, ping_interval=ping))
    return made


def wsTurn(r, client, mode="ctx_pool", model="gpt-5.5"):
    """
    One WebSocket C{response.create} turn on a fresh connection.

    @return: C{(conn, outcome)}.
    """
    conn = Conn()
    _, outcome = r.go(r.turn(client, model, entrypoint="ws", wsMode=mode), WebSocketSink(conn))
    return conn, outcome


class ModelTests(SynchronousTestCase):
    """
    A model the key may not use.
    """

    def test_statusEventSocketOpen(self):
        """
        Every mode: one C{error} event with status 403, C{model_not_found},
        C{param: model}, relay's message naming the model; no close. The
        same key's allowed model then completes.
        """
        client = key(models=("gpt-5.4",))
        r = rig(client)
        for mode in MODES:
            conn, outcome = wsTurn(r, client, mode)
            self.assertEqual(outcome, ["failed"])
            self.assertIsNone(conn.closed, mode)
            [event] = conn.sent
            self.assertEqual(
                (event["type"], event["status"], event["error"]["type"], event["error"]["code"],
                 event["error"]["param"]),
                ("error", 403, "invalid_request_error", "model_not_found", "model"))
            self.assertIn("does not have access to model `gpt-5.5`", event["error"]["message"])
            conn, outcome = wsTurn(r, client, mode, model="gpt-5.4")
            self.assertEqual(outcome, ["completed"], mode)
        self.assertEqual(len(r.dialer.calls), 3)

    def test_unpricedModelStatusEvent(self):
        """
        A key with a money budget and a model without a price (403
        C{model_not_priced}) is told the same way.
        """
        client = key(daily_usd=5.0)
        conn, outcome = wsTurn(rig(client), client, model="my-model")
        self.assertIsNone(conn.closed)
        [event] = conn.sent
        self.assertEqual((event["status"], event["error"]["code"]), (403, "model_not_priced"))

    def test_expiredAndDisabledStillClose(self):
        """
        A disabled or expired key closes 1008, as before.
        """
        for client, reason in ((key(expires_at=T0 - 1), "api key expired"),
                               (key(disabled=True), "api key is disabled")):
            conn, outcome = wsTurn(rig(client), client)
            self.assertEqual(conn.closed, (1008, reason))


class BudgetTests(SynchronousTestCase):
    """
    An exhausted token or money budget.
    """

    def test_tokenBudgetUsageLimitEvent(self):
        """
        Every mode: the 429 event Codex renders with a time
        (C{error.type} C{usage_limit_reached}), relay's code
        C{insufficient_quota}, C{resets_at} the next UTC day,
        C{resets_in_seconds} HTTP's C{Retry-After}, relay's message in
        C{x-codex-promo-message} (no full stop: Codex goes on with ", or
        try again at <time>."); no close.
        """
        client = key(daily_tokens=2)
        r = rig(client)
        self.assertEqual(wsTurn(r, client)[1], ["completed"])
        midnight = dayStart(r.clock.seconds()) + DAY
        for mode in MODES:
            conn, outcome = wsTurn(r, client, mode)
            self.assertEqual(outcome, ["failed"])
            self.assertIsNone(conn.closed, mode)
            [event] = conn.sent
            error = event["error"]
            self.assertEqual((event["type"], event["status"], error["type"], error["code"]),
                             ("error", 429, "usage_limit_reached", "insufficient_quota"))
            self.assertEqual(error["resets_at"], int(midnight))
            self.assertEqual(error["resets_in_seconds"], int(midnight - r.clock.seconds()))
            self.assertEqual(event["headers"]["retry-after"], str(error["resets_in_seconds"]))
            self.assertIn("Token budget exhausted for key 'bob'", error["message"])
            promo = event["headers"][PROMO_HEADER]
            self.assertEqual(promo, error["message"].rstrip("."))
            self.assertIn("it resets at 2023-11-15T00:00:00Z", promo)
        self.assertEqual(len(r.dialer.calls), 1)

    def test_moneyBudget(self):
        """
        A money budget the same way, naming C{daily_usd}.
        """
        client = key(daily_usd=0.00007)
        r = rig(client)
        outcomes = [wsTurn(r, client)[1] for _ in range(2)]
        self.assertEqual(outcomes, [["completed"]] * 2)
        conn, _ = wsTurn(r, client, "passthrough")
        [event] = conn.sent
        self.assertIsNone(conn.closed)
        self.assertEqual((event["status"], event["error"]["type"], event["error"]["code"]),
                         (429, "usage_limit_reached", "insufficient_quota"))
        self.assertIn("daily_usd", event["headers"][PROMO_HEADER])

    def test_httpUnchanged(self):
        """
        On HTTP the budget is OpenAI's 429 C{insufficient_quota} with
        C{Retry-After}, as before.
        """
        client = key(daily_tokens=2)
        r = rig(client)
        r.go(r.turn(client))
        sink, outcome = r.go(r.turn(client))
        [error] = sink.errors
        self.assertEqual((error.status, error.type, error.code),
                         (429, "insufficient_quota", "insufficient_quota"))
        self.assertIn("Retry-After", dict(error.headers))


class HTTPBudgetShapeTests(SynchronousTestCase):
    """
    R113 on HTTP: a spent budget's 429 is the body Codex renders as a
    usage limit with its reset time, the same time as the WebSocket event.
    """

    def written(self, error):
        """
        @return: C{(request, parsed body)} of L{writeError} for C{error}.
        """
        request = DummyRequest([b"v1", b"responses"])
        writeError(request, error)
        return request, json.loads(b"".join(request.written))

    def test_budgetBody(self):
        """
        C{error.type} C{usage_limit_reached} (what Codex reads), C{code}
        relay's C{insufficient_quota}, C{resets_at} the next UTC day and
        C{resets_in_seconds} the C{Retry-After}, relay's message in the
        body and (no full stop) in C{x-codex-promo-message}.
        """
        client = key(daily_tokens=2)
        r = rig(client)
        r.go(r.turn(client))
        sink, _ = r.go(r.turn(client))
        [error] = sink.errors
        midnight = dayStart(r.clock.seconds()) + DAY
        request, body = self.written(error)
        self.assertEqual(request.responseCode, 429)
        body = body["error"]
        self.assertEqual((body["type"], body["code"], body["param"]),
                         ("usage_limit_reached", "insufficient_quota", None))
        self.assertEqual(body["resets_at"], int(midnight))
        retry = request.responseHeaders.getRawHeaders(b"retry-after")[0]
        self.assertEqual(body["resets_in_seconds"], int(retry))
        self.assertIn("Token budget exhausted for key 'bob'", body["message"])
        [promo] = request.responseHeaders.getRawHeaders(PROMO_HEADER)
        self.assertEqual(promo, body["message"].rstrip("."))
        conn, _ = wsTurn(r, client)
        [event] = conn.sent
        self.assertEqual(event["error"]["resets_at"], body["resets_at"])

    def test_rateLimitUnchanged(self):
        """
        An C{rpm} window that cannot be waited for stays OpenAI's
        C{rate_limit_error} on HTTP, with C{Retry-After}, no usage-limit
        fields.
        """
        client = key(rpm=1)
        r = rig(client, wait=0.0)
        r.go(r.turn(client))
        sink, _ = r.go(r.turn(client))
        [error] = sink.errors
        request, body = self.written(error)
        self.assertEqual(body["error"]["type"], "rate_limit_error")
        self.assertNotIn("resets_at", body["error"])
        self.assertIsNone(request.responseHeaders.getRawHeaders(PROMO_HEADER))


class RateWaitTests(SynchronousTestCase):
    """
    C{rpm}/C{tpm}: wait for the window when the wait fits
    C{fallback_wait_timeout}, else the 429 with its time.
    """

    def test_wsWaitsWithPings(self):
        """
        Every mode: C{rpm: 1}, the second turn 45 s after the first waits
        the 15 s until the window frees, with a ping at least every
        C{ping_interval} (5 s here; the keepalive interval is 10 s), then
        runs: no error event, no close.
        """
        for mode in MODES:
            client = key(rpm=1)
            r = rig(client, ping=5.0)
            self.assertEqual(wsTurn(r, client, mode)[1], ["completed"])
            r.clock.advance(45)
            conn, outcome = wsTurn(r, client, mode)
            self.assertEqual(outcome, [])
            r.clock.pump([1] * 14)
            self.assertEqual((outcome, len(r.dialer.calls)), ([], 1))
            self.assertGreaterEqual(conn.pings, 2, mode)
            r.clock.advance(1)
            self.assertEqual(outcome, ["completed"], mode)
            self.assertEqual([e for e in conn.sent if e.get("type") == "error"], [])
            self.assertIsNone(conn.closed)
            self.assertEqual(len(r.dialer.calls), 2)

    def test_httpStreamingWaitsWithKeepalives(self):
        """
        HTTP SSE: the same wait, with SSE keepalives; the turn completes.
        """
        client = key(rpm=1)
        r = rig(client, ping=5.0)
        r.go(r.turn(client))
        r.clock.advance(40)
        sink, outcome = r.go(r.turn(client))
        r.clock.pump([1] * 19)
        self.assertEqual(outcome, [])
        self.assertGreaterEqual(sink.keepalives, 3)
        r.clock.advance(1)
        self.assertEqual((outcome, sink.errors), (["completed"], []))

    def test_httpJSONWaitsSilently(self):
        """
        HTTP without streaming waits too, with no keepalive (R31), and is
        dialled once the window frees (the fake upstream's answer is SSE,
        so what it then makes of it is not this test's business).
        """
        client = key(rpm=1)
        r = rig(client)
        r.go(r.turn(client, stream=False))
        r.clock.advance(50)
        sink, outcome = r.go(r.turn(client, stream=False))
        r.clock.advance(9)
        self.assertEqual((outcome, sink.keepalives, len(r.dialer.calls)), ([], 0, 1))
        r.clock.advance(1)
        self.assertEqual(len(r.dialer.calls), 2)
        self.assertNotIn(429, [e.status for e in sink.errors])

    def test_tpmWaits(self):
        """
        A C{tpm} window waits the same way: C{tpm: 2}, a turn of 2 tokens,
        the next turn 50 s later runs 10 s after that.
        """
        client = key(tpm=2)
        r = rig(client)
        r.go(r.turn(client))
        r.clock.advance(50)
        _, outcome = r.go(r.turn(client))
        r.clock.advance(9)
        self.assertEqual(outcome, [])
        r.clock.advance(1)
        self.assertEqual(outcome, ["completed"])

    def test_wsRefusedInBandWhenTheWaitDoesNotFit(self):
        """
        Every mode: with the window 55 s away and 30 s allowed, the turn is
        refused at once with the 429 event Codex renders with a time
        (C{usage_limit_reached}, relay's C{rate_limit_exceeded},
        C{resets_at} when the window frees, relay's message naming RPM and
        the wait); no close, and a later turn on the socket runs.
        """
        for mode in MODES:
            client = key(rpm=1)
            r = rig(client)
            first = r.clock.seconds()
            wsTurn(r, client, mode)
            r.clock.advance(5)
            conn, outcome = wsTurn(r, client, mode)
            self.assertEqual(outcome, ["failed"])
            self.assertIsNone(conn.closed)
            [event] = conn.sent
            error = event["error"]
            self.assertEqual((event["status"], error["type"], error["code"]),
                             (429, "usage_limit_reached", "rate_limit_exceeded"))
            self.assertEqual((error["resets_at"], error["resets_in_seconds"]),
                             (int(first + 60), 55))
            promo = event["headers"][PROMO_HEADER]
            self.assertIn("requests per min (RPM): Limit 1, Used 1", promo)
            self.assertIn("try again in 55s", promo)
            self.assertEqual(event["headers"]["x-ratelimit-limit-requests"], "1")
            r.clock.advance(55)
            self.assertEqual(wsTurn(r, client, mode)[1], ["completed"])

    def test_httpRefusedWithRetryAfterWhenTheWaitDoesNotFit(self):
        """
        HTTP: the 429 with C{Retry-After} at once, no wait.
        """
        client = key(rpm=1)
        r = rig(client, wait=10.0)
        r.go(r.turn(client))
        r.clock.advance(30)
        sink, outcome = r.go(r.turn(client))
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertEqual((error.status, error.code, dict(error.headers)["Retry-After"]),
                         (429, "rate_limit_exceeded", "30"))

    def test_windowTakenAgainWhileWaiting(self):
        """
        Two turns wait for one freed request: the first runs, the second
        waits again for the next one while that fits the total wait
        (counted from its first refusal), else it is refused.
        """
        client = key(rpm=1)
        r = rig(client, wait=30.0)
        r.go(r.turn(client))
        r.clock.advance(55)
        _, first = r.go(r.turn(client))
        r.clock.advance(1)
        sink, second = r.go(r.turn(client))
        r.clock.advance(3.9)
        self.assertEqual((first, second), ([], []))
        r.clock.advance(0.1)
        # the first takes the freed request; the window is then full until
        # T0 + 120, 64 s after the second's first refusal: more than 30 s
        self.assertEqual((first, second), (["completed"], ["failed"]))
        self.assertEqual(sink.errors[0].code, "rate_limit_exceeded")
        self.assertEqual(len(r.dialer.calls), 2)

    def test_clientLeavesWhileWaiting(self):
        """
        A client that leaves during the wait ends the turn: nothing dialled,
        nothing counted in the window.
        """
        client = key(rpm=1)
        r = rig(client)
        r.go(r.turn(client))
        r.clock.advance(50)
        turn = r.turn(client)
        _, outcome = r.go(turn)
        turn.cancel.cancel("client_gone")
        r.clock.advance(20)
        self.assertEqual(len(r.dialer.calls), 1)
        self.assertNotEqual(outcome, ["completed"])
        decision = self.successResultOf(r.limiter.peek("bob", 1, None))
        self.assertEqual(decision.requests, 0)
        self.assertEqual(r.clock.getDelayedCalls(), [])


class EventShapeTests(SynchronousTestCase):
    """
    L{keyLimitEvent} on its own.
    """

    def test_asciiPromo(self):
        """
        A header value Codex accepts is visible ASCII: a key name outside
        it is replaced, the event's message keeps it.
        """
        error = ClientError(429, "insufficient_quota", "Token budget exhausted for key 'é'.",
                            code="insufficient_quota", headers=(("Retry-After", "7"),),
                            wsInband=True, resetsAt=T0 + 6.5)
        event = keyLimitEvent(error)
        self.assertEqual(event["headers"][PROMO_HEADER], "Token budget exhausted for key '?'")
        self.assertEqual(event["error"]["message"], "Token budget exhausted for key 'é'.")
        self.assertEqual((event["error"]["resets_at"], event["error"]["resets_in_seconds"]),
                         (int(T0) + 7, 7))

    def test_afterOutputCloses(self):
        """
        After output (never for a key's check, which comes first) the
        sink closes as for any failure.
        """
        conn = Conn()
        sink = WebSocketSink(conn)
        sink.committed = True
        sink.fail(ClientError(403, "invalid_request_error", "no", code="model_not_found",
                              wsInband=True))
        self.assertEqual(conn.sent, [])
        self.assertIsNotNone(conn.closed)

