# -*- test-case-name: tests.test_tracing -*-
"""
OpenTelemetry spans for turns and attempts.

L{TurnTracer} is an L{relay.interfaces.ITurnObserver}: the runner calls it
through its one observer seam (L{relay.engine.runner.TurnRunner.observer}),
never from inside the attempt loop's policy. Spans:

  - C{relay.turn} (kind SERVER), parent: the client's C{traceparent}
    (W3C trace context) when it sent a valid one. Attributes:
    C{relay.request_id}, C{relay.entrypoint} (http, ws), C{relay.endpoint},
    C{relay.client} (the key's name, never the key), C{relay.base.records},
    C{relay.outcome}, C{http.response.status_code}, C{relay.account_id}
    (the last account), C{relay.attempts}, C{relay.switches},
    C{relay.wait_seconds} (slot waits and retry sleeps), and
    C{relay.first_output_seconds} (from the turn's start). Status ERROR
    unless the turn completed.
  - C{relay.attempt} (kind CLIENT), one per attempt, child of the turn:
    C{relay.account_id}, C{relay.attempt} (1-based), C{relay.outcome}
    (C{ok}, C{committed}, C{failed}, C{abandoned}), C{http.response.status_code},
    C{relay.failover_reason} (the verdict's reason, e.g. C{status_503}),
    C{relay.failover} (whether the verdict moves the turn on),
    C{relay.wait_seconds} (waited before this attempt) and
    C{relay.first_output_seconds} (from the attempt's start, when this
    attempt produced the first output). Its context is put in the turn's
    C{traceparent} header, which the dialers send upstream (HTTP per
    attempt; a new upstream WebSocket with its handshake).

Timestamps come from the injected clock (nanoseconds of
C{clock.seconds()}), like every time in relay. Nothing here runs when
tracing is off: the runner's observer is L{None} and builds no object.
"""

from __future__ import annotations

from typing import Any, Optional

from zope.interface import implementer

from relay.interfaces import ITurnObserver, ITurnTrace

__all__ = ["TurnTracer", "buildTracerProvider"]


def _ns(clock) -> int:
    return int(clock.seconds() * 1_000_000_000)


@implementer(ITurnObserver)
class TurnTracer:
    """
    The engine's observer when tracing is on.

    @ivar tracer: an OpenTelemetry C{Tracer}.
    @ivar clock: the injected L{IReactorTime}.
    """

    def __init__(self, tracer, clock) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.clock = clock
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = (SpanKind.SERVER, SpanKind.CLIENT)
        self._status = (Status, StatusCode)
        self._inContext = set_span_in_context

    def turnStarted(self, turn) -> "_TurnTrace":
        """
        See L{ITurnObserver.turnStarted}: start the turn's span.
        """
        headers = turn.headers or {}
        parent = None
        if "traceparent" in headers:
            parent = self._propagator.extract(carrier=headers)
        span = self.tracer.start_span(
            "relay.turn",
            context=parent,
            kind=self._kinds[0],
            start_time=_ns(self.clock),
            attributes={
                "relay.request_id": turn.requestId,
                "relay.entrypoint": turn.entrypoint,
                "relay.endpoint": turn.endpoint,
                "relay.client": turn.client.name,
                "relay.base.records": turn.model or "",
                "relay.stream": bool(turn.stream),
            },
        )
        return _TurnTrace(self, turn, span)


@implementer(ITurnTrace)
class _TurnTrace:
    """
    One turn's spans (see the module docstring).
    """

    def __init__(self, tracer: TurnTracer, turn, span) -> None:
        self._tracer = tracer
        self._turn = turn
        self._span = span
        self._attempt: Optional[Any] = None
        self._attemptStarted = 0.0
        self._waitedBefore = 0.0
        self._firstSeen = turn.firstOutputAt

    def attemptStarted(self, account, state) -> None:
        t = self._tracer
        self._closeAttempt("abandoned")
        now = t.clock.seconds()
        waited = state.waited - self._waitedBefore
        self._waitedBefore = state.waited
        self._attemptStarted = now
        self._attempt = t.tracer.start_span(
            "relay.attempt",
            context=t._inContext(self._span),
            kind=t._kinds[1],
            start_time=_ns(t.clock),
            attributes={
                "relay.account_id": account.id,
                "relay.account_type": account.type,
                "relay.attempt": state.attempts,
                "relay.wait_seconds": waited,
            },
        )
        carrier: dict = {}
        t._propagator.inject(carrier, context=t._inContext(self._attempt))
        headers = self._turn.headers
        if isinstance(headers, dict) and "traceparent" in carrier:
            headers["traceparent"] = carrier["traceparent"]
            if "tracestate" in carrier:
                headers["tracestate"] = carrier["tracestate"]

    def attemptEnded(self, result, verdict, state) -> None:
        span = self._attempt
        if span is None:
            return
        if result.ok:
            outcome = "ok"
        elif result.committed:
            outcome = "committed"
        else:
            outcome = "failed"
        if result.status is not None:
            span.set_attribute("http.response.status_code", int(result.status))
        if verdict is not None:
            span.set_attribute("relay.failover_reason", str(verdict.reason))
            span.set_attribute("relay.failover", bool(verdict.failover))
        first = self._turn.firstOutputAt
        if first is not None and self._firstSeen is None:
            self._firstSeen = first
            span.set_attribute("relay.first_output_seconds", first - self._attemptStarted)
        self._closeAttempt(outcome)

    def turnEnded(self, outcome, status, accountId, state) -> None:
        t = self._tracer
        self._closeAttempt("abandoned")
        span = self._span
        span.set_attribute("relay.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", int(status))
        if accountId is not None:
            span.set_attribute("relay.account_id", accountId)
        span.set_attribute("relay.attempts", state.attempts)
        span.set_attribute("relay.switches", state.switches)
        span.set_attribute("relay.wait_seconds", state.waited)
        first = self._turn.firstOutputAt
        if first is not None:
            span.set_attribute("relay.first_output_seconds", first - state.startedAt)
        Status, StatusCode = t._status
        if outcome != "completed":
            span.set_status(Status(StatusCode.ERROR, f"{outcome} ({status})"))
        span.end(end_time=_ns(t.clock))

    def _closeAttempt(self, outcome: str) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        span.set_attribute("relay.outcome", outcome)
        if outcome not in ("ok",):
            Status, StatusCode = self._tracer._status
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=_ns(self._tracer.clock))


def buildTracerProvider(settings, exporter=None):
    """
    The SDK's tracer provider for C{tracing:} (L{relay.base.records.TracingSettings}).

    @param settings: the L{relay.base.records.TracingSettings}.
    @param exporter: a span exporter to use instead of the configured one
        (tests: the SDK's C{InMemorySpanExporter}); it gets a simple
        (synchronous) processor, the configured exporters a batch one (its
        own thread exports).
    @return: a C{TracerProvider}.
    @raise relay.base.records.ConfigError: when the C{otel} extra is not installed.
    """
    from relay.base.records import ConfigError

    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise ConfigError(
            f"tracing.exporter: {settings.exporter} needs the otel extra"
            f" (pip install 'relay[otel]'): {e}"
        )
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider
    if settings.exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif settings.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ConfigError(
                "tracing.exporter: otlp needs the otel extra (pip install 'relay[otel]'): "
                f"{e}"
            )
        kwargs = {"endpoint": settings.endpoint} if settings.endpoint else {}
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(**kwargs)))
    return provider
