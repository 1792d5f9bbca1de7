"""
Traces for those who run a tracing stack: optional OpenTelemetry.

Off unless C{tracing.exporter} is set (config: L{relay.base.records.TracingSettings});
then L{relay.tracing.otel.TurnTracer} is the engine's
L{relay.interfaces.ITurnObserver}: one C{relay.turn} span per turn (the
client's W3C C{traceparent} its parent) with one C{relay.attempt} child per
attempt, whose context goes upstream as C{traceparent}. Needs the C{otel}
extra (C{opentelemetry-sdk}, C{opentelemetry-exporter-otlp-proto-http}).
"""
