"""
behaviour.md R24, R31, R85 (issue 13 item 4): the turn's downstream
keepalive, on a L{Clock}.

L{StreamKeepalive} on its own; then the turn runner with a scripted
upstream that falls silent before and after its first output, writing to a
recording sink, the real L{SSESink} (over a L{DummyRequest}) and the real
L{WebSocketSink}.
"""

from __future__ import annotations

import json

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest
from zope.interface.verify import verifyObject

from relay.engine.keepalive import StreamKeepalive
from relay.entry.sinks import SSESink
from relay.entry.wssink import WebSocketSink
from relay.interfaces import ITurnSink
from relay.base.records import ClientKey, Turn
from relay.wire.sse import eventFromJSON
from tests.test_runner import (
    COMPLETED,
    CREATED,
    DELTA,
    IN_PROGRESS,
    ITEM_ADDED,
    FakeResponse,
    FakeSink,
    Rig,
    account,
    ok,
)


class KeepaliveTests(SynchronousTestCase):
    """
    L{StreamKeepalive}: a keepalive after every C{interval} seconds of
    silence, the wait pace, stop.
    """

    def setUp(self):
        self.clock = Clock()
        self.sent = []
        self.keepalive = StreamKeepalive(
            clock=self.clock, send=lambda: self.sent.append(self.clock.seconds()), interval=10
        )

    def test_silence_sends_every_interval(self):
        """
        R24/R85: with nothing written, one keepalive every interval, the
        first one interval after the start.
        """
        self.keepalive.start()
        self.clock.advance(9.9)
        self.assertEqual(self.sent, [])
        self.clock.pump([0.1, 10, 10])
        self.assertEqual(self.sent, [10, 20, 30])

    def test_silence_since_an_earlier_write(self):
        """
        Issue 19: a turn whose request had keepalives while it waited for
        its key's slot counts the silence from the last of them.
        """
        self.clock.advance(25)
        self.keepalive.start(since=22)
        self.clock.advance(6.9)
        self.assertEqual(self.sent, [])
        self.clock.advance(0.1)
        self.assertEqual(self.sent, [32])

    def test_writes_restart_the_silence(self):
        """
        A keepalive comes only after a whole interval without writes.
        """
        self.keepalive.start()
        self.clock.advance(6)
        self.keepalive.touch()
        self.clock.advance(6)
        self.assertEqual(self.sent, [])
        self.clock.advance(4)
        self.assertEqual(self.sent, [16])

    def test_stop(self):
        """
        Nothing is sent after L{StreamKeepalive.stop}; stopping twice is
        harmless.
        """
        self.keepalive.start()
        self.clock.advance(10)
        self.keepalive.stop()
        self.keepalive.stop()
        self.clock.advance(100)
        self.assertEqual(self.sent, [10])
        self.assertFalse(self.keepalive.running)

    def test_wait_pace_when_shorter(self):
        """
        R31: during a wait the shorter C{ping_interval} applies; after it,
        the stream interval again.
        """
        self.keepalive.start()
        self.keepalive.beginWait(5)
        self.clock.pump([5, 5])
        self.assertEqual(self.sent, [5, 10])
        self.clock.advance(2)
        self.keepalive.endWait()
        self.clock.pump([5, 3])
        self.assertEqual(self.sent, [5, 10, 20])

    def test_off_outside_waits(self):
        """
        An interval of 0 turns the stream keepalive off; waits still ping
        (R31).
        """
        self.keepalive.interval = 0
        self.keepalive.start()
        self.clock.advance(100)
        self.assertEqual(self.sent, [])
        self.keepalive.touch()
        self.keepalive.beginWait(5)
        self.clock.advance(5)
        self.assertEqual(self.sent, [105])
        self.keepalive.endWait()
        self.clock.advance(100)
        self.assertEqual(self.sent, [105])

    def test_send_failure_is_logged_and_keeps_going(self):
        """
        A keepalive that raises is logged (C{relay.keepalive_failed}); the
        next one is still sent.
        """
        calls = []

        def send():
            calls.append(self.clock.seconds())
            if len(calls) == 1:
                raise RuntimeError("boom")

        keepalive = StreamKeepalive(clock=self.clock, send=send, interval=10, requestId="req_1")
        with capturedLogs() as events:
            keepalive.start()
            self.clock.pump([10, 10])
        self.assertEqual(calls, [10, 20])
        failed = [e for e in events if e.get("event") == "relay.keepalive_failed"]
        self.assertEqual(len(failed), 1)
        self.assertEqual(failed[0]["request_id"], "req_1")
        self.flushLoggedErrors(RuntimeError)


# -- the runner -------------------------------------------------------------------


def timed(*steps, end="done"):
    """
    An upstream SSE answer whose C{(delay, bytes)} steps arrive on the clock.
    """
    return lambda clock: succeed(
        FakeResponse(clock, headers={"content-type": "text/event-stream"}, steps=list(steps),
                     end=end)
    )


class WatchingSink(FakeSink):
    """
    A L{FakeSink} that reports its writes (as the real sinks do) and keeps
    a timeline of keepalives and events.
    """

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.timeline = []
        self._onWrite = None

    def watchWrites(self, callback):
        self._onWrite = callback

    def keepalive(self):
        super().keepalive()
        self.timeline.append((":", self.clock.seconds()))

    def writeEvent(self, event):
        super().writeEvent(event)
        self.timeline.append((event.type.decode(), self.clock.seconds()))
        if self._onWrite is not None:
            self._onWrite()


def streamingTurn(stream=True):
    return Turn(entrypoint="http", endpoint="responses",
                client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                body={"model": "gpt-5.5", "input": "hi", "stream": stream}, stream=stream,
                requestId="req")


class RunnerKeepaliveTests(SynchronousTestCase):
    """
    R85: the runner keeps every streaming turn alive from its start to its
    terminal event.
    """

    def run_(self, rig, sink, stream=True):
        outcome = []
        rig.runner.run(streamingTurn(stream), sink).addCallback(outcome.append)
        return outcome

    def test_interface(self):
        """
        The recording sink still provides L{ITurnSink}.
        """
        self.assertTrue(verifyObject(ITurnSink, WatchingSink(Clock())))

    def test_silent_before_first_output(self):
        """
        R85: an upstream that sends C{response.created} and then nothing for
        25 s gets the client two keepalives (10 s, 20 s), none counting as
        output; then the turn completes.
        """
        rig = Rig([account("a")])
        rig.script("a", timed((0, CREATED + IN_PROGRESS), (25, ITEM_ADDED + DELTA), (0, COMPLETED)))
        sink = WatchingSink(rig.clock)
        outcome = self.run_(rig, sink)
        rig.clock.pump([5] * 6)
        self.assertEqual(outcome, ["completed"])
        t0 = sink.timeline[0][1]
        self.assertEqual(
            [(kind, at - t0) for kind, at in sink.timeline],
            [(":", 0), (":", 10), ("response.created", 15), ("response.in_progress", 15),
             ("response.output_item.added", 15), ("response.output_text.delta", 15),
             ("response.completed", 15)],
        )

    def test_silent_after_first_output(self):
        """
        R85: after the first output, a silent upstream still gets the client
        a keepalive every interval, between whole events.
        """
        rig = Rig([account("a")])
        rig.script("a", timed((0, CREATED + ITEM_ADDED + DELTA), (25, COMPLETED)))
        sink = WatchingSink(rig.clock)
        outcome = self.run_(rig, sink)
        rig.clock.pump([5] * 6)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(
            [kind for kind, _ in sink.timeline],
            ["response.created", "response.output_item.added", "response.output_text.delta",
             ":", ":", "response.completed"],
        )

    def test_flowing_stream_gets_no_keepalive(self):
        """
        A keepalive is written only when nothing was written for an interval.
        """
        rig = Rig([account("a")])
        steps = [(0, CREATED + ITEM_ADDED)] + [(6, DELTA)] * 5 + [(6, COMPLETED)]
        rig.script("a", timed(*steps))
        sink = WatchingSink(rig.clock)
        outcome = self.run_(rig, sink)
        rig.clock.pump([1] * 40)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sink.keepalives, 0)

    def test_stops_at_the_terminal_event(self):
        """
        Nothing is written after the terminal event.
        """
        rig = Rig([account("a")])
        rig.script("a", ok())
        sink = WatchingSink(rig.clock)
        self.assertEqual(self.run_(rig, sink), ["completed"])
        rig.clock.pump([10] * 10)
        self.assertEqual(sink.keepalives, 0)

    def test_non_streaming_turns_get_none(self):
        """
        R31: a non-streaming client gets no keepalives, however long it waits.
        """
        rig = Rig([account("a")])
        body = json.dumps({"id": "resp_1", "status": "completed", "output": [{"type": "x"}]})
        rig.script("a", lambda clock: succeed(
            FakeResponse(clock, headers={"content-type": "application/json"},
                         steps=[(30, body.encode())])))
        sink = WatchingSink(rig.clock)
        outcome = self.run_(rig, sink, stream=False)
        rig.clock.pump([5] * 8)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sink.keepalives, 0)

    def test_keepalive_never_blocks_failover(self):
        """
        R85/R19: a keepalive is not output; an attempt that breaks after it
        (before output) fails over, and the client sees one stream from the
        account that served it.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", timed((0, CREATED), (15, b""), end="cut"))
        rig.script("b", ok())
        sink = WatchingSink(rig.clock)
        outcome = self.run_(rig, sink)
        rig.clock.pump([5] * 4)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.ids(), ["a", "b"])
        self.assertEqual(sink.errors, [])
        self.assertEqual(sink.keepalives, 1)
        self.assertEqual(sink.events.count("response.created"), 1)


class _Request(DummyRequest):
    """
    A L{DummyRequest} that records a streaming producer instead of looping
    on it.
    """

    def registerProducer(self, producer, streaming):
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None


class SSEKeepaliveTests(SynchronousTestCase):
    """
    The real L{SSESink}: comments between whole events, before and after
    the first output; after a keepalive committed the headers, a failure is
    in-stream (R17, R19.2).
    """

    def test_comments_between_whole_events(self):
        """
        R85: every chunk written is a whole event or a whole comment.
        """
        rig = Rig([account("a")])
        rig.script("a", timed((0, CREATED), (12, ITEM_ADDED + DELTA), (12, COMPLETED)))
        request = _Request([b""])
        sink = SSESink(request, "responses", "gpt-5.5")
        rig.runner.run(streamingTurn(), sink)
        rig.clock.pump([1] * 30)
        self.assertTrue(request.finished)
        self.assertEqual(request.responseCode, 200)
        chunks = request.written
        self.assertEqual(chunks[0], b":\n\n")
        for chunk in chunks:
            self.assertTrue(chunk.endswith(b"\n\n"), chunk)
            self.assertTrue(chunk == b":\n\n" or chunk.startswith(b"event: "), chunk)
        self.assertEqual(chunks.count(b":\n\n"), 2)
        body = b"".join(chunks)
        self.assertLess(body.index(b"output_text.delta"), body.rindex(b":\n\n"))

    def test_finished_sink_leaves_no_cycle(self):
        """
        A finished streaming sink no longer watches its writes: the
        keepalive that watched them (L{relay.engine.waiting}) refers back
        to the sink, and that cycle kept the request (a 1 MiB Codex body
        and its parse) alive until a full collection.
        """
        import gc
        import weakref

        clock = Clock()
        request = _Request([b""])
        sink = SSESink(request, "responses", "gpt-5.5")
        keepalive = StreamKeepalive(clock=clock, send=sink.keepalive, interval=10)
        sink.watchWrites(keepalive.touch)
        keepalive.start()
        gone = weakref.ref(sink)
        gc.disable()
        try:
            sink.writeEvent(eventFromJSON(CREATED))
            keepalive.stop()
            sink.finish()
            self.assertTrue(request.finished)
            del sink, keepalive, request
            self.assertIsNone(gone())
        finally:
            gc.enable()

    def test_failure_after_keepalive_is_in_stream(self):
        """
        R85/R17: once a keepalive committed 200 and the SSE headers, the
        exhausted turn ends with an in-stream C{response.failed}.
        """
        rig = Rig([account("a")])
        rig.script("a", timed((0, CREATED), (15, b""), end="cut"))
        request = _Request([b""])
        sink = SSESink(request, "responses", "gpt-5.5")
        rig.runner.run(streamingTurn(), sink)
        rig.clock.pump([5] * 6)
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(request.written[0], b":\n\n")
        self.assertTrue(request.written[-1].startswith(b"event: response.failed\n"))
        self.assertNotIn(b"response.created", b"".join(request.written))
        self.assertTrue(request.finished)


class _Conn:
    """
    A client WebSocket connection double.
    """

    def __init__(self):
        self.sent, self.pings, self.closes = [], 0, []

    def isOpen(self):
        return not self.closes

    def sendText(self, data):
        self.sent.append(json.loads(data))

    def sendPing(self):
        self.pings += 1

    def closeWith(self, code, reason):
        self.closes.append((code, reason))


class WebSocketKeepaliveTests(SynchronousTestCase):
    """
    R85: WebSocket clients get ping frames at the keepalive pace.
    """

    def test_keepalive_is_a_ping(self):
        """
        L{WebSocketSink.keepalive} sends a ping on an open connection and
        nothing on a closed one; event frames are reported as writes.
        """
        conn = _Conn()
        sink = WebSocketSink(conn)
        writes = []
        sink.watchWrites(lambda: writes.append(True))
        sink.keepalive()
        sink.writeEvent(eventFromJSON(b'{"type":"response.created","response":{}}'))
        conn.closes.append((1000, ""))
        sink.keepalive()
        self.assertEqual(conn.pings, 1)
        self.assertEqual(writes, [True])

    def test_silent_upstream_pings_the_client(self):
        """
        A WebSocket turn (here through the HTTP attempt, as C{http_bridge}
        does) whose upstream is silent for 25 s pings the client twice.
        """
        rig = Rig([account("a")])
        rig.script("a", timed((0, CREATED), (25, ITEM_ADDED + DELTA + COMPLETED)))
        conn = _Conn()
        sink = WebSocketSink(conn)
        turn = streamingTurn()
        turn.entrypoint, turn.wsMode = "ws", "http_bridge"
        outcome = []
        rig.runner.run(turn, sink).addCallback(outcome.append)
        rig.clock.pump([5] * 6)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(conn.pings, 2)
        self.assertEqual(conn.sent[-1]["type"], "response.completed")

    def test_no_ping_after_the_terminal_event(self):
        """
        R85: the keepalive ends with the terminal event, even while the
        turn's bookkeeping after it is slow.
        """
        from twisted.internet.defer import Deferred

        rig = Rig([account("a")])
        rig.script("a", timed((0, CREATED + ITEM_ADDED + DELTA + COMPLETED)))
        slow = Deferred()

        class SlowHealth:
            def __getattr__(self, name):
                return getattr(rig.health, name)

            def success(self, account, model):
                return slow

        rig.runner.bookkeeping.health = SlowHealth()
        conn = _Conn()
        sink = WebSocketSink(conn)
        turn = streamingTurn()
        turn.entrypoint, turn.wsMode = "ws", "http_bridge"
        outcome = []
        rig.runner.run(turn, sink).addCallback(outcome.append)
        self.assertEqual(conn.sent[-1]["type"], "response.completed")
        rig.clock.pump([5] * 6)
        self.assertEqual(outcome, [])
        slow.callback(None)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(conn.pings, 0)
