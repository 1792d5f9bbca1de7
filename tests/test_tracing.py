"""
Optional OpenTelemetry traces (issue 23, L{relay.tracing.otel}), with the
SDK's in-memory exporter on the runner rig of L{tests.test_runner} (a
L{Clock}): one C{relay.turn} span per turn, a C{relay.attempt} child per
attempt with the account, outcome, failover reason, wait and first-output
time, the request id, the client's W3C C{traceparent} as the parent and
each attempt's context sent upstream. Off by default: no observer, no
trace state per turn.
"""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.process.app import _tracing, buildApplication
from relay.configuration.parse import settingsFromString
from relay.interfaces import ITurnObserver, ITurnTrace
from relay.base.records import ClientKey, ConfigError, TracingSettings, Turn
from relay.tracing.otel import TurnTracer, buildTracerProvider
from tests.test_runner import FakeDialer, FakeSink, Rig, T0, account, ok, status

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


class _HeaderDialer(FakeDialer):
    """
    Records the headers of every upstream request.
    """

    def __init__(self, clock):
        super().__init__(clock)
        self.headers = []

    def request(self, account, method, path, body, headers, timeouts):
        self.headers.append(dict(headers))
        return super().request(account, method, path, body, headers, timeouts)


def _traced(rig: Rig) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = buildTracerProvider(TracingSettings(exporter="none"), exporter)
    rig.runner.observer = TurnTracer(provider.get_tracer("test"), rig.clock)
    rig.dialer = rig.runner.dialer = _HeaderDialer(rig.clock)
    return exporter


def _run(rig: Rig, headers=None, model="gpt-5.5"):
    turn = Turn(entrypoint="http", endpoint="responses",
                client=ClientKey(name="team", key="sk-secret", concurrency=0), model=model,
                body={"model": model, "input": "hi", "stream": True}, stream=True,
                headers=dict(headers or {}), requestId="req_trace1")
    sink = FakeSink()
    outcome = []
    rig.runner.run(turn, sink).addCallback(outcome.append)
    return turn, sink, outcome


def _byName(exporter):
    spans = exporter.get_finished_spans()
    return ([s for s in spans if s.name == "relay.turn"],
            [s for s in spans if s.name == "relay.attempt"])


class TracingTests(SynchronousTestCase):
    def test_interfaces(self):
        rig = Rig([account("a")])
        _traced(rig)
        self.assertTrue(verifyObject(ITurnObserver, rig.runner.observer))
        turn, _, _ = _run(rig)
        # the trace object of a turn (built fresh; the finished one is gone)
        self.assertTrue(verifyObject(ITurnTrace, rig.runner.observer.turnStarted(turn)))

    def test_turnAndAttempts(self):
        """
        A failover (a answers 503, b serves): one turn span, two attempt
        children with the account, outcome, status and failover reason;
        the first output time on the attempt that produced it.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)], retry_interval_ms=0)
        exporter = _traced(rig)
        rig.script("a", status(503))
        rig.script("b", ok())
        _, sink, outcome = _run(rig)
        rig.clock.advance(1)
        self.assertEqual(outcome, ["completed"])
        [turn], attempts = _byName(exporter)
        self.assertEqual(turn.kind, SpanKind.SERVER)
        self.assertEqual(turn.attributes["relay.request_id"], "req_trace1")
        self.assertEqual(turn.attributes["relay.client"], "team")
        self.assertEqual(turn.attributes["relay.outcome"], "completed")
        self.assertEqual(turn.attributes["relay.attempts"], 2)
        self.assertEqual(turn.attributes["relay.account_id"], "b")
        self.assertEqual(turn.attributes["http.response.status_code"], 200)
        self.assertNotEqual(turn.status.status_code, StatusCode.ERROR)
        self.assertNotIn("sk-secret", repr(dict(turn.attributes)))
        self.assertEqual([a.attributes["relay.account_id"] for a in attempts], ["a", "b"])
        first, second = attempts
        self.assertEqual(first.kind, SpanKind.CLIENT)
        self.assertEqual(first.parent.span_id, turn.context.span_id)
        self.assertEqual(first.attributes["relay.outcome"], "failed")
        self.assertEqual(first.attributes["http.response.status_code"], 503)
        self.assertEqual(first.attributes["relay.failover_reason"], "status_503")
        self.assertTrue(first.attributes["relay.failover"])
        self.assertEqual(first.status.status_code, StatusCode.ERROR)
        self.assertEqual(second.attributes["relay.outcome"], "ok")
        self.assertIn("relay.first_output_seconds", second.attributes)
        self.assertNotIn("relay.first_output_seconds", first.attributes)
        self.assertEqual(turn.start_time, int(T0 * 1e9))

    def test_traceparentFromClientAndUpstream(self):
        """
        The client's C{traceparent} is the turn's parent (same trace id);
        each attempt sends its own context upstream.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)], retry_interval_ms=0)
        exporter = _traced(rig)
        rig.script("a", status(503))
        _run(rig, headers={"traceparent": CLIENT_PARENT})
        [turn], attempts = _byName(exporter)
        self.assertEqual(format(turn.context.trace_id, "032x"), CLIENT_TRACE)
        self.assertEqual(format(turn.parent.span_id, "016x"), "b7ad6b7169203331")
        sent = [h["traceparent"] for h in rig.dialer.headers]
        expected = [f"00-{CLIENT_TRACE}-{format(a.context.span_id, '016x')}-01" for a in attempts]
        self.assertEqual(sent, expected)

    def test_newTraceWithoutClientContext(self):
        rig = Rig([account("a")])
        exporter = _traced(rig)
        _run(rig)
        [turn], [attempt] = _byName(exporter)
        self.assertIsNone(turn.parent)
        self.assertTrue(rig.dialer.headers[0]["traceparent"].startswith(
            f"00-{format(turn.context.trace_id, '032x')}-"))

    def test_waitTime(self):
        """
        The seconds a turn waited for a slot are on the attempt that
        followed and on the turn.
        """
        rig = Rig([account("a", concurrency=1)])
        exporter = _traced(rig)
        held = []
        rig.admission.tryAcquire("account", "a", 1).addCallback(held.append)
        _, _, outcome = _run(rig)
        rig.clock.advance(2.0)
        held[0].release()
        rig.clock.advance(0.5)
        self.assertEqual(outcome, ["completed"])
        [turn], [attempt] = _byName(exporter)
        self.assertGreaterEqual(attempt.attributes["relay.wait_seconds"], 2.0)
        self.assertGreaterEqual(turn.attributes["relay.wait_seconds"], 2.0)

    def test_failedTurnIsAnError(self):
        rig = Rig([account("a")])
        exporter = _traced(rig)
        rig.script("a", status(400, {"error": {"message": "bad", "type": "invalid_request_error"}}))
        _, _, outcome = _run(rig)
        [turn], [attempt] = _byName(exporter)
        self.assertEqual(turn.attributes["relay.outcome"], "failed")
        self.assertEqual(turn.status.status_code, StatusCode.ERROR)

    def test_clientGoneClosesTheAttempt(self):
        """
        A client that leaves mid-attempt: the attempt span ends with the
        turn (C{abandoned}), no span is left open.
        """
        from tests.test_runner import hang

        rig = Rig([account("a")])
        exporter = _traced(rig)
        rig.script("a", hang())
        turn, _, outcome = _run(rig)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(1)
        [span], [attempt] = _byName(exporter)
        self.assertEqual(attempt.attributes["relay.outcome"], "abandoned")
        self.assertEqual(span.attributes["relay.outcome"], "client_gone")


class WiringTests(SynchronousTestCase):
    def _config(self, tracing=""):
        return settingsFromString(
            "database: \":memory:\"\n"
            "keys: [{name: k, key: sk-k}]\n"
            "accounts: [{id: a1, type: apikey, api_key: x, base_url: 'http://127.0.0.1:1/v1'}]\n"
            + tracing
        )

    def test_offByDefault(self):
        """
        Without C{tracing:} the runner has no observer: nothing is built
        per turn (each turn's trace state stays L{None}).
        """
        app = buildApplication(self._config(), Clock())
        self.assertIsNone(app.runner.observer)
        calls = []

        class _Counting:
            def turnStarted(self, turn):
                calls.append(turn)
                return None

        rig = Rig([account("a")])
        rig.runner.observer = _Counting()
        _run(rig)
        self.assertEqual(len(calls), 1)
        rig.runner.observer = None
        _, _, outcome = _run(rig)
        self.assertEqual((len(calls), outcome), (1, ["completed"]))

    def test_configured(self):
        """
        C{tracing.exporter} builds the observer; C{_tracing} with a test
        exporter too; bad values are one-line config errors.
        """
        config = self._config("tracing: {exporter: otlp, endpoint: 'http://127.0.0.1:4318/v1/traces',"
                              " service_name: relay-test, sample_ratio: 0.5}\n")
        self.assertEqual(config.tracing.sample_ratio, 0.5)
        app = buildApplication(config, Clock())
        self.assertIsInstance(app.runner.observer, TurnTracer)
        app.extras["tracerProvider"].shutdown()
        app = buildApplication(self._config(), Clock())
        _tracing(app, exporter=InMemorySpanExporter())
        self.assertIsInstance(app.runner.observer, TurnTracer)
        for bad, key in (("tracing: {exporter: jaeger}", "tracing.exporter"),
                         ("tracing: {sample_ratio: 2}", "tracing.sample_ratio"),
                         ("tracing: {endpoint: 'grpc://x'}", "tracing.endpoint")):
            e = self.assertRaises(ConfigError, self._config, bad + "\n")
            self.assertIn(key, str(e))
