"""
Every generated token is counted, whoever hangs up (behaviour.md R107), on a
L{Clock}: the turn engine reads a left client's upstream to its terminal
event for the usage (bounded by C{gateway.usage_drain_seconds} and
C{usage_drain_bytes}), records relay's estimate, marked, where it cannot,
still cancels at once before any output (R2), and writes no account state.
"""

from __future__ import annotations

import json

from twisted.internet.defer import succeed
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import ClientKey, Turn
from relay.usage.estimate import estimatedCounts, inputTokens
from relay.usage.tokens import TokenCounts
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
    frame,
)

USAGE = {"input_tokens": 6000, "input_tokens_details": {"cached_tokens": 0},
         "output_tokens": 40, "total_tokens": 6040}
DONE = frame("response.output_text.done", item_id="msg_1", output_index=0, text="Hi")
COMPLETED_6K = frame(
    "response.completed",
    response={"id": "resp_1", "status": "completed", "output": [], "usage": USAGE},
)


def stream(*steps, end="done", code=200):
    """
    An upstream SSE answer of C{steps} (C{(delay seconds, bytes)}).
    """
    return lambda clock: succeed(FakeResponse(
        clock, code=code, headers={"content-type": "text/event-stream"}, steps=list(steps),
        end=end))


def tick(rig, seconds: int) -> None:
    """
    Advance the rig's clock a second at a time (the fake upstream schedules
    each step when the one before it was delivered).
    """
    for _ in range(seconds):
        rig.clock.advance(1)


def chatChunk(**fields) -> bytes:
    return b"data: " + json.dumps({"object": "chat.completion.chunk", **fields}).encode() + b"\n\n"


class RawSink(FakeSink):
    """
    A sink that takes raw bytes too (the pass-through path, issue 16).
    """

    def __init__(self):
        super().__init__()
        self.raw = b""

    def writeRaw(self, data):
        self.raw += data


class Log:
    """
    The request log: keeps each turn's record.
    """

    sampleMaxBytes = 0

    def __init__(self):
        self.records = []

    def sampled(self):
        return False

    def add(self, record):
        self.records.append(record)


class DrainTests(SynchronousTestCase):
    """
    R107 on HTTP SSE (Responses and chat), JSON, and through a sink that
    stops producing.
    """

    def rig(self, **settings):
        rig = Rig([account("a", priority=1), account("b", priority=2)], **settings)
        rig.runner.requestLog = self.log = Log()
        return rig

    def start(self, rig, sink=None, endpoint="responses", body=None, stream=True):
        body = body or {"model": "gpt-5.5", "input": "x" * 400, "stream": stream}
        turn = Turn(entrypoint="http", endpoint=endpoint,
                    client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                    body=body, stream=stream, requestId="req")
        sink = sink if sink is not None else FakeSink()
        outcome = []
        rig.runner.run(turn, sink).addCallback(outcome.append)
        return turn, sink, outcome

    def assertNothingMarked(self, rig):
        """
        R2: the left client's turn wrote no account state, freed its slot and
        tried no other account.
        """
        for id in ("a", "b"):
            state = rig.state(id)
            self.assertEqual((state.blockedUntil, state.disabled, state.rateLimitedUntil),
                             (0, False, 0))
            self.assertIsNone(rig.health.localBlock(id))
        self.assertEqual(rig.health._breakers, {})
        self.assertEqual(rig.load("a", "b"), {"a": (0, 0), "b": (0, 0)})
        self.assertEqual(rig.dialer.ids(), ["a"])

    def test_left_after_output_text_done_counts_real_usage(self):
        """
        The client leaves after C{response.output_text.done}, before
        C{response.completed}: relay reads on, the turn is C{client_gone}
        499 with the upstream's usage, not estimated; nothing more reaches
        the client and nothing is marked.
        """
        rig = self.rig()
        response = []

        def answer(clock):
            r = FakeResponse(clock, headers={"content-type": "text/event-stream"},
                             steps=[(0, CREATED), (0, ITEM_ADDED), (0, DELTA), (0, DONE),
                                    (5, COMPLETED_6K)])
            response.append(r)
            return succeed(r)

        rig.script("a", answer)
        turn, sink, outcome = self.start(rig)
        self.assertIn("response.output_text.done", sink.events)
        turn.cancel.cancel("client_gone")
        self.assertEqual(outcome, [], "the turn waits for the drain")
        self.assertFalse(response[0].lost or response[0].protocol.transport.stopped)
        rig.clock.advance(5)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage, TokenCounts(1, 6000, 0, 40, 0))
        self.assertNotIn("response.completed", sink.events)
        self.assertEqual(sink.errors, [])
        record, = self.log.records
        self.assertEqual((record.outcome, record.status), ("client_gone", 499))
        self.assertEqual((record.input_tokens, record.output_tokens), (6000, 40))
        self.assertFalse(record.usage_estimated)
        self.assertNothingMarked(rig)

    def test_left_at_first_delta_raw_path(self):
        """
        "Hanging up at the first delta is free too" no more: on the raw
        pass-through path as well.
        """
        rig = self.rig()
        rig.script("a", stream((0, CREATED), (0, DELTA), (3, DELTA + DONE), (3, COMPLETED_6K)))
        turn, sink, outcome = self.start(rig, RawSink())
        self.assertIn(b"output_text.delta", sink.raw)
        turn.cancel.cancel("client_gone")
        written = sink.raw
        tick(rig, 10)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(sink.raw, written, "nothing reaches the left client")
        self.assertEqual(turn.usage.input, 6000)
        self.assertEqual(turn.usage.estimated, 0)
        self.assertNothingMarked(rig)

    def test_left_before_output_cancels_at_once(self):
        """
        R2 unchanged: before the first output the upstream is dropped at
        once and nothing is counted.
        """
        rig = self.rig()
        response = []

        def answer(clock):
            r = FakeResponse(clock, headers={"content-type": "text/event-stream"},
                             steps=[(0, CREATED), (0, IN_PROGRESS), (5, DELTA), (1, COMPLETED)])
            response.append(r)
            return succeed(r)

        rig.script("a", answer)
        turn, sink, outcome = self.start(rig)
        turn.cancel.cancel("client_gone")
        self.assertEqual(outcome, ["client_gone"])
        self.assertTrue(response[0].lost)
        self.assertIsNone(turn.usage)
        self.assertIsNone(self.log.records[0].input_tokens)
        self.assertNothingMarked(rig)

    def test_cut_after_departure_is_estimated(self):
        """
        The upstream breaks after the client left: relay's estimate is
        counted (input from the request, output from the deltas relayed),
        marked in the record and the counts; the cut marks nothing.
        """
        rig = self.rig()
        rig.script("a", stream((0, CREATED), (0, DELTA), (0, DELTA), (2, DELTA), end="cut"))
        turn, sink, outcome = self.start(rig)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(2)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage.estimated, 1)
        self.assertEqual(turn.usage.input, inputTokens(turn.body))
        self.assertEqual(turn.usage.output, 3)
        record = self.log.records[0]
        self.assertTrue(record.usage_estimated)
        self.assertTrue(record.asDict()["usage_estimated"])
        self.assertEqual(record.input_tokens, inputTokens(turn.body))
        self.assertNothingMarked(rig)

    def test_drain_time_bound(self):
        """
        An upstream that goes on past C{usage_drain_seconds} is dropped
        then, and the turn estimated.
        """
        rig = self.rig(usage_drain_seconds=30)
        response = []

        def answer(clock):
            r = FakeResponse(clock, headers={"content-type": "text/event-stream"},
                             steps=[(0, CREATED), (0, DELTA), (29, DELTA), (29, DELTA)],
                             end="hang")
            response.append(r)
            return succeed(r)

        rig.script("a", answer)
        turn, _sink, outcome = self.start(rig)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(29)
        self.assertEqual(outcome, [])
        rig.clock.advance(1)
        self.assertEqual(outcome, ["client_gone"])
        self.assertTrue(response[0].lost)
        self.assertEqual(turn.usage.estimated, 1)
        self.assertEqual(turn.usage.output, 2)
        self.assertNothingMarked(rig)

    def test_drain_byte_bound(self):
        """
        More than C{usage_drain_bytes} after the client left: dropped and
        estimated.
        """
        rig = self.rig(usage_drain_bytes=len(DELTA) * 2)
        big = DELTA * 3
        rig.script("a", stream((0, CREATED), (0, DELTA), (1, DELTA), (1, big), (1, COMPLETED_6K)))
        turn, _sink, outcome = self.start(rig)
        turn.cancel.cancel("client_gone")
        tick(rig, 10)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage.estimated, 1)
        self.assertNothingMarked(rig)

    def test_drain_off_estimates_at_once(self):
        """
        C{usage_drain_seconds: 0}: no drain; the departure after output is
        estimated at once and the upstream dropped.
        """
        rig = self.rig(usage_drain_seconds=0)
        rig.script("a", stream((0, CREATED), (0, DELTA), (5, COMPLETED_6K)))
        turn, _sink, outcome = self.start(rig)
        turn.cancel.cancel("client_gone")
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage.estimated, 1)

    def test_sink_stops_producing(self):
        """
        The client's connection drops under the pump (twisted.web stops
        the registered producer) before the turn is told: the drain runs
        all the same and the turn still ends as the client's departure.
        """
        rig = self.rig()
        producers = []

        class ProducerSink(FakeSink):
            def attachProducer(self, producer):
                producers.append(producer)

            def detachProducer(self):
                pass

        rig.script("a", stream((0, CREATED), (0, DELTA), (2, COMPLETED_6K)))
        turn, sink, outcome = self.start(rig, ProducerSink())
        producers[0].stopProducing()
        rig.clock.advance(2)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage.input, 6000)
        self.assertFalse(sink.finished)
        self.assertNothingMarked(rig)

    def test_chat_stream_left_after_finish_reason(self):
        """
        A chat stream: the client leaves after the C{finish_reason} chunk;
        relay reads on to the usage chunk (which it asked upstream for).
        """
        rig = self.rig()
        role = chatChunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        text = chatChunk(choices=[{"index": 0, "delta": {"content": "Hi"}}])
        finish = chatChunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])
        usage = chatChunk(choices=[], usage={"prompt_tokens": 6000, "completion_tokens": 9,
                                             "total_tokens": 6009})
        rig.script("a", stream((0, role), (0, text), (0, finish), (3, usage),
                               (0, b"data: [DONE]\n\n")))
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                "stream": True}
        turn, _sink, outcome = self.start(rig, endpoint="chat", body=body)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(3)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual((turn.usage.input, turn.usage.output, turn.usage.estimated), (6000, 9, 0))
        self.assertNothingMarked(rig)

    def test_json_left_while_body_arrives(self):
        """
        A non-streaming turn whose client leaves while the answer's body
        arrives: the body is read on for its usage.
        """
        rig = self.rig()
        answer = json.dumps({"id": "resp_1", "object": "response", "status": "completed",
                             "output": [{"type": "message", "content": [
                                 {"type": "output_text", "text": "Hi"}]}],
                             "usage": USAGE}).encode()
        rig.script("a", lambda clock: succeed(FakeResponse(
            clock, headers={"content-type": "application/json"},
            steps=[(0, answer[:20]), (2, answer[20:])])))
        turn, sink, outcome = self.start(rig, stream=False)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(2)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage.input, 6000)
        self.assertEqual(sink.bodies, [])
        self.assertNothingMarked(rig)

    def test_json_cut_is_estimated(self):
        """
        The JSON body breaks after the client left: estimated, marked.
        """
        rig = self.rig()
        rig.script("a", lambda clock: succeed(FakeResponse(
            clock, headers={"content-type": "application/json"},
            steps=[(0, b'{"id": "resp_1", '), (2, b'"output"')], end="cut")))
        turn, _sink, outcome = self.start(rig, stream=False)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(2)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(turn.usage.estimated, 1)
        self.assertNothingMarked(rig)

    def test_relay_cancel_estimates(self):
        """
        A turn relay cancels itself (a graceful stop's grace ran out) is not
        drained: its usage after output is estimated at once.
        """
        from relay.base.clienterrors import internalError

        rig = self.rig()
        rig.script("a", stream((0, CREATED), (0, DELTA), (5, COMPLETED_6K)))
        turn, _sink, outcome = self.start(rig)
        turn.cancel.cancel("relay_shutdown", tell=internalError())
        self.assertEqual(outcome, ["relay_cancelled"])
        self.assertEqual(turn.usage.estimated, 1)


class EstimateTests(SynchronousTestCase):
    """
    L{relay.usage.estimate}: input from the request, output from what was
    relayed.
    """

    def test_input(self):
        self.assertEqual(inputTokens({"instructions": "a" * 400}), 100)
        self.assertEqual(inputTokens({"messages": [{"role": "user", "content": "hi"}]}), 8)
        self.assertEqual(inputTokens({}), 1)
        self.assertEqual(inputTokens(None), 1)

    def test_output(self):
        self.assertEqual(estimatedCounts({}, 7, 10_000).output, 7)
        self.assertEqual(estimatedCounts({}, 0, 400).output, 100)
        self.assertEqual(estimatedCounts({}, 0, 0), TokenCounts(1, 1, 0, 1, 0, estimated=1))


class ConfigTests(SynchronousTestCase):
    """
    C{gateway.usage_drain_seconds} and C{gateway.usage_drain_bytes}
    (config.md, R107): defaults, values, one-line errors naming the key.
    """

    def test_defaults_and_values(self):
        from relay.configuration.parse import settingsFromString

        base = 'listen: "tcp:0:interface=127.0.0.1"\n'
        gateway = settingsFromString(base).gateway
        self.assertEqual((gateway.usage_drain_seconds, gateway.usage_drain_bytes), (60, 8388608))
        gateway = settingsFromString(
            base + "gateway: {usage_drain_seconds: 5.5, usage_drain_bytes: 0}\n").gateway
        self.assertEqual((gateway.usage_drain_seconds, gateway.usage_drain_bytes), (5.5, 0))

    def test_bad_values_are_one_line(self):
        from relay.configuration.parse import settingsFromString
        from relay.base.records import ConfigError

        for key, value in (("usage_drain_seconds", "-1"), ("usage_drain_seconds", "soon"),
                           ("usage_drain_seconds", "7200"), ("usage_drain_bytes", "1.5"),
                           ("usage_drain_bytes", "-3"), ("usage_drain_bytes", "lots")):
            e = self.assertRaises(ConfigError, settingsFromString, f"gateway: {{{key}: {value}}}\n")
            self.assertIn(f"gateway.{key}", str(e))
            self.assertNotIn("\n", str(e))

    def test_sample_config_names_them(self):
        import os

        path = os.path.join(os.path.dirname(__file__), "..", "etc", "relay.example.yaml")
        with open(path) as f:
            text = f.read()
        self.assertIn("usage_drain_seconds: 60", text)
        self.assertIn("usage_drain_bytes: 8388608", text)


class _Proto:
    listener = None


class _Conn:
    """
    An upstream WebSocket connection as the pump sees it.
    """

    def __init__(self):
        self.proto = _Proto()
        self.broken = False
        self.lastResponseId = None


class WebSocketDrainTests(SynchronousTestCase):
    """
    R107 on upstream WebSocket frames (ctx_pool, passthrough): the same pump
    reads on after the client left.
    """

    def pump(self, **settings):
        from relay.engine.wsattempt import WebSocketPump

        rig = Rig([account("a")], **settings)
        turn = Turn(entrypoint="ws", endpoint="responses",
                    client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                    body={"model": "gpt-5.5", "input": "x" * 40}, stream=True, requestId="req")
        released = []
        conn = _Conn()
        pump = WebSocketPump(rig.runner, turn, FakeSink(), account("a"),
                             lambda: released.append(True), None, 0, conn)
        pump.start()
        return rig, turn, pump, conn, released

    @staticmethod
    def frame(kind, **fields) -> bytes:
        return json.dumps({"type": kind, **fields}).encode()

    def test_frames_after_departure_are_counted(self):
        rig, turn, pump, conn, released = self.pump()
        ended = []
        pump.done.addCallback(ended.append)
        pump.frameReceived(self.frame("response.created", response={"id": "resp_1"}))
        pump.frameReceived(self.frame("response.output_text.delta", delta="Hi"))
        turn.cancel.cancel("client_gone")
        pump.depart("client_gone")
        self.assertEqual(ended, [])
        self.assertTrue(pump.draining)
        pump.frameReceived(self.frame("response.completed", response={
            "id": "resp_1", "status": "completed", "output": [], "usage": USAGE}))
        result, = ended
        self.assertEqual(type(result.end).__name__, "Departed")
        self.assertEqual(result.status, 499)
        self.assertEqual((turn.usage.input, turn.usage.output, turn.usage.estimated),
                         (6000, 40, 0))
        self.assertFalse(conn.broken, "read to its end: the connection may serve again")
        self.assertEqual(released, [True])

    def test_upstream_close_after_departure_is_estimated(self):
        rig, turn, pump, conn, _ = self.pump()
        pump.frameReceived(self.frame("response.created", response={"id": "resp_1"}))
        pump.frameReceived(self.frame("response.output_text.delta", delta="Hi"))
        turn.cancel.cancel("client_gone")
        pump.depart("client_gone")
        pump.upstreamLost(None, "")
        self.assertTrue(pump.finished)
        self.assertEqual(turn.usage.estimated, 1)
        self.assertEqual(turn.usage.output, 1)

    def test_byte_bound(self):
        rig, turn, pump, conn, _ = self.pump(usage_drain_bytes=100)
        pump.frameReceived(self.frame("response.created", response={"id": "resp_1"}))
        pump.frameReceived(self.frame("response.output_text.delta", delta="Hi"))
        turn.cancel.cancel("client_gone")
        pump.depart("client_gone")
        pump.frameReceived(self.frame("response.output_text.delta", delta="x" * 200))
        self.assertTrue(pump.finished)
        self.assertTrue(conn.broken)
        self.assertEqual(turn.usage.estimated, 1)

    def test_before_output_ends_at_once(self):
        rig, turn, pump, conn, _ = self.pump()
        pump.frameReceived(self.frame("response.created", response={"id": "resp_1"}))
        turn.cancel.cancel("client_gone")
        pump.depart("client_gone")
        self.assertTrue(pump.finished)
        self.assertTrue(conn.broken)
        self.assertIsNone(turn.usage)


class RequestKindDrainTests(SynchronousTestCase):
    """
    R107 for requests of their own kind (R87): a compaction's JSON answer
    is read on for its usage when the client leaves while it arrives; a
    poll's answer for a background response counts once, whoever sees it.
    """

    def test_compact_json_left_while_body_arrives(self):
        from relay.engine import requests as R
        from tests.test_requests import COMPACTED, PathDialerRig

        rig = PathDialerRig([account("a")])
        raw = json.dumps(COMPACTED).encode()
        rig.script("a", lambda clock: succeed(FakeResponse(
            clock, headers={"content-type": "application/json"},
            steps=[(0, raw[:10]), (2, raw[10:])])))
        turn, sink, outcome = rig.request(R.compactRequest(), {"model": "gpt-5.5", "input": "x"})
        turn.cancel.cancel("client_gone")
        rig.clock.advance(2)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual((turn.usage.input, turn.usage.output, turn.usage.estimated), (40, 4, 0))
        self.assertEqual(sink.bodies, [])

    def test_poll_of_unfinished_background_left_counts_nothing(self):
        """
        A poll whose client leaves while the answer arrives: a background
        response not finished yet is not counted, nor estimated (it is
        counted once when it finishes, R88).
        """
        from relay.engine import requests as R
        from tests.test_requests import PathDialerRig

        rig = PathDialerRig([account("a")])
        raw = json.dumps({"id": "resp_1", "status": "in_progress", "background": True}).encode()
        rig.script("a", lambda clock: succeed(FakeResponse(
            clock, headers={"content-type": "application/json"},
            steps=[(0, raw[:10]), (2, raw[10:])])))
        kind = R.ownedRequest("retrieve", b"GET", "resp_1", "a")
        turn, _sink, outcome = rig.request(kind, model=None)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(2)
        self.assertEqual(outcome, ["client_gone"])
        self.assertIsNone(turn.usage)


class GracefulStopTests(SynchronousTestCase):
    """
    R107 and a graceful stop: a turn still draining when the grace runs
    out ends with an estimate, so its usage is not lost with the process.
    """

    def test_drain_ended_at_grace(self):
        from relay.process.drain import GracefulDrain

        rig = Rig([account("a")], shutdown_grace_seconds=10)
        rig.runner.requestLog = log = Log()
        stop = GracefulDrain(clock=rig.clock, runner=rig.runner, settings=rig.settings,
                             admission=rig.admission)
        rig.script("a", stream((0, CREATED), (0, DELTA), (0, DELTA), end="hang"))
        turn, _sink, outcome = rig.run()
        turn.cancel.cancel("client_gone")
        self.assertEqual(len(rig.runner.drains), 1)
        d = stop.drain()
        rig.clock.advance(10)
        self.successResultOf(d)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(rig.runner.drains, set())
        self.assertEqual((turn.usage.estimated, turn.usage.output), (1, 2))
        self.assertTrue(log.records[0].usage_estimated)


class BackgroundWatchTests(SynchronousTestCase):
    """
    R107, R88: a background response is counted once when it finishes,
    whoever polls it -- twice, or nobody.
    """

    DONE = {"id": "resp_bg", "object": "response", "status": "completed", "background": True,
            "output": [], "usage": {"input_tokens": 900, "output_tokens": 9,
                                    "total_tokens": 909}}

    def create(self, *later):
        from tests.test_requests import PathDialerRig, jsonAnswer

        rig = PathDialerRig([account("a")])
        queued = dict(self.DONE, status="queued", usage=None)
        rig.script("a", jsonAnswer(queued), *[jsonAnswer(answer) for answer in later])
        turn = Turn(entrypoint="http", endpoint="responses",
                    client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                    body={"model": "gpt-5.5", "input": "hi", "background": True}, stream=False,
                    requestId="req", background=True)
        outcome = []
        rig.runner.run(turn, FakeSink()).addCallback(outcome.append)
        self.assertEqual(outcome, ["completed"])
        self.assertIsNone(turn.usage)
        return rig, turn

    def test_never_polled_counted_once(self):
        rig, turn = self.create(dict(self.DONE, status="in_progress", usage=None), self.DONE)
        tick(rig, 5)
        self.assertEqual([s[2] for s in rig.sent], ["/responses", "/responses/resp_bg"])
        self.assertIsNone(turn.usage)
        tick(rig, 10)
        self.assertEqual([s[2] for s in rig.sent][-1], "/responses/resp_bg")
        self.assertEqual((turn.usage.input, turn.usage.output), (900, 9))
        sent = len(rig.sent)
        tick(rig, 600)
        self.assertEqual(len(rig.sent), sent, "the watch ended with the count")

    def test_polled_twice_counted_once(self):
        from relay.engine import requests as R

        rig, turn = self.create(self.DONE)
        polls = []
        for _ in range(2):
            poll, _sink, outcome = rig.request(
                R.ownedRequest("retrieve", b"GET", "resp_bg", "a"), model=None)
            self.assertEqual(outcome, ["completed"])
            polls.append(poll.usage)
        self.assertEqual((polls[0].input, polls[1]), (900, None))
        tick(rig, 5)
        self.assertIsNone(turn.usage, "the watch saw it counted already")

    def test_gone_response_ends_the_watch(self):
        from tests.test_runner import status

        rig, turn = self.create()
        rig.script("a", status(404, {"error": {"message": "not found"}}))
        tick(rig, 5)
        sent = len(rig.sent)
        tick(rig, 600)
        self.assertEqual(len(rig.sent), sent)
        self.assertIsNone(turn.usage)
