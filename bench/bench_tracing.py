"""
Tracing benchmark (issue 23): the engine's per-turn cost with OpenTelemetry
off (no observer: nothing built) and on (L{relay.tracing.otel.TurnTracer},
one turn span and one attempt span per turn, exported to the SDK's
in-memory exporter through a simple processor, or dropped by a batch
processor's queue when C{--batch} is given).

Usage::

    python bench/bench_tracing.py [--turns 20000] [--batch]

Each turn runs the real L{relay.engine.runner.TurnRunner} on a
L{twisted.internet.task.Clock} with the fake dialer of the unit tests (a
five-event SSE stream), so the figure is relay's own CPU per turn, upstream
excluded. Prints microseconds per turn for both and the difference.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_runner import Rig, account  # noqa: E402
from tests.test_tracing import _run  # noqa: E402


def _measure(rig: Rig, turns: int) -> float:
    """
    @return: seconds of process CPU per turn.
    """
    for _ in range(200):  # warm up
        _run(rig)
    gc.collect()
    started = time.process_time()
    for _ in range(turns):
        _run(rig)
    return (time.process_time() - started) / turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--batch", action="store_true",
                        help="a BatchSpanProcessor (what relay uses) instead of a simple one")
    args = parser.parse_args()

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from relay.tracing.otel import TurnTracer

    off = Rig([account("a")])
    offCost = _measure(off, args.turns)

    on = Rig([account("a")])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    processor = BatchSpanProcessor(exporter, max_queue_size=4096) if args.batch \
        else SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    on.runner.observer = TurnTracer(provider.get_tracer("bench"), on.clock)
    onCost = _measure(on, args.turns)
    provider.shutdown()
    spans = len(exporter.get_finished_spans())

    print(f"turns: {args.turns} per side, processor: {'batch' if args.batch else 'simple'}")
    print(f"tracing off: {offCost * 1e6:8.1f} us/turn")
    print(f"tracing on:  {onCost * 1e6:8.1f} us/turn  ({spans} spans exported)")
    print(f"added:       {(onCost - offCost) * 1e6:8.1f} us/turn "
          f"({(onCost / offCost - 1) * 100:.0f}% of the engine's own cost)")


if __name__ == "__main__":
    main()
