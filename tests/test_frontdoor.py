"""
The front door (L{relay.frontdoor}): a WebSocket frame goes from
C{onMessage} through the door to C{TurnRunner.run} without coming back to
the WebSocket module; HTTP bodies and WebSocket frames are read and
checked by the same functions; the key's checks (R102, R105, R108) are
the door's, not the engine's.
"""

from __future__ import annotations

import json
import os
import traceback

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.entry.ws import RelayWebSocketProtocol
from relay.frontdoor import door as D
from relay.frontdoor.door import FrontDoor
from relay.frontdoor.parse import FieldRefused, RequestRefused, readJSON, turnFields
from relay.frontdoor.record import Admission
from relay.base.records import ClientError, ClientKey, GatewaySettings, Turn
from relay.state.settings import RuntimeSettings

KEY = ClientKey(name="alice", key="sk-alice", concurrency=0)


class _Runner:
    """
    Records the call stack of every C{run}; each turn stays running.
    """

    keyPolicy = None

    def __init__(self):
        self.stacks, self.turns, self.refused = [], [], []

    def run(self, turn, sink):
        self.stacks.append(traceback.extract_stack())
        self.turns.append(turn)
        return Deferred()

    def refuse(self, turn, sink, error):
        self.refused.append(error)
        return Deferred()

    def keySlot(self, turn, keepalive=None):
        raise AssertionError("an unlimited key takes no slot")


class _Keys:
    def current(self, key):
        return key


class _Factory:
    def __init__(self, runner):
        self.runner = runner
        self.door = FrontDoor(runner)
        self.keys = _Keys()
        from tests.test_runner import account

        self.accounts = [account("a")]
        self.settings = RuntimeSettings(current=GatewaySettings())
        self.reactor = Clock()
        self.draining = False
        self.sessionOwners = {}


class _Request:
    headers = {"user-agent": "test"}


def _protocol(runner):
    proto = RelayWebSocketProtocol()
    proto.factory = _Factory(runner)
    proto.admission = Admission(key=KEY)
    proto.onConnect(_Request())
    proto.sent = []
    proto.state = proto.STATE_OPEN
    proto.sendMessage = lambda data, binary=False: proto.sent.append(data)
    proto.sendCloseFrame = lambda **kw: proto.sent.append(json.dumps({"close": kw["code"]}))
    return proto


def _between(stack, first: str, last: str) -> list:
    """
    The files of the frames after the last C{first} and before C{last}.
    """
    names = [frame.name for frame in stack]
    start = len(names) - 1 - names[::-1].index(first)
    end = len(names) - 1 - names[::-1].index(last)
    return [os.path.relpath(frame.filename) for frame in stack[start + 1:end]]


class WebSocketPathTests(SynchronousTestCase):
    """
    Issue's acceptance: from C{onMessage} through the front door to
    C{TurnRunner.run}, the WebSocket module is not called back on the way.
    """

    def assertThroughTheDoor(self, files):
        ws = [f for f in files if f.endswith(os.path.join("relay", "entry", "ws.py"))]
        self.assertEqual(ws, [], files)
        self.assertTrue(files and all(
            f.endswith(os.path.join("twisted", "internet", "defer.py"))
            or os.path.join("relay", "frontdoor") in f for f in files), files)

    def test_turnFromOnMessageToRun(self):
        runner = _Runner()
        proto = _protocol(runner)
        frame = {"type": "response.create", "model": "gpt-5.5", "input": "hi"}
        proto.onMessage(json.dumps(frame).encode(), False)
        [turn] = runner.turns
        self.assertEqual((turn.entrypoint, turn.model, turn.requestId.endswith(":1")),
                         ("ws", "gpt-5.5", True))
        [stack] = runner.stacks
        self.assertEqual(stack[-2].name, "enter")
        self.assertThroughTheDoor(_between(stack, "onMessage", "run"))

    def test_theDoorAsksTheConnectionOnlyForItsTurn(self):
        """
        From C{onMessage}'s hand-off to the door until C{run}, no function
        of the WebSocket module (C{relay.entry.ws}) is called: the door
        has the connection's conversation make the frame a turn
        (C{turnFor}, in C{relay.entry.conversation}) and hands it the
        running turn (C{turnStarted}) after C{run}.
        """
        import sys

        runner = _Runner()
        proto = _protocol(runner)
        calls, conversation, recording = [], [], []
        ws = os.path.join("relay", "entry", "ws.py")
        door = os.path.join("relay", "frontdoor", "door.py")

        def profile(frame, event, arg):
            if event != "call":
                return
            code = frame.f_code
            if code.co_name == "frame" and code.co_filename.endswith(door):
                recording.append(True)
            elif code.co_name == "run" and isinstance(frame.f_locals.get("self"), _Runner):
                recording.clear()
            elif recording and code.co_filename.endswith(ws):
                calls.append(code.co_name)
            if code.co_name in ("turnFor", "turnStarted"):
                conversation.append((code.co_name, os.path.basename(code.co_filename)))

        frame = {"type": "response.create", "model": "gpt-5.5", "input": "hi"}
        sys.setprofile(profile)
        try:
            proto.onMessage(json.dumps(frame).encode(), False)
        finally:
            sys.setprofile(None)
        self.assertEqual((calls, len(runner.turns)), ([], 1))
        self.assertEqual(conversation, [("turnFor", "conversation.py"),
                                        ("turnStarted", "conversation.py")])

    def test_largeFrameAdmittedThenRun(self):
        """
        A frame over L{D.PARSE_FREELY_BYTES} takes the key's slot first
        (R103); its turn still reaches C{run} from the door.
        """
        runner = _Runner()
        proto = _protocol(runner)
        frame = {"type": "response.create", "model": "gpt-5.5",
                 "input": "x" * (D.PARSE_FREELY_BYTES + 10)}
        proto.onMessage(json.dumps(frame).encode(), False)
        [turn] = runner.turns
        self.assertTrue(turn.keyAdmitted)
        self.assertThroughTheDoor(_between(runner.stacks[0], "onMessage", "run"))

    def test_fieldsCheckedAsHTTPs(self):
        """
        A frame's wrong-typed field is refused with HTTP's 400 message
        (the one check, L{turnFields}), and no turn runs.
        """
        runner = _Runner()
        proto = _protocol(runner)
        proto.onMessage(json.dumps({"type": "response.create", "model": "m",
                                    "stream": "yes"}).encode(), False)
        self.assertEqual(runner.turns, [])
        [event, close] = [json.loads(m) for m in proto.sent]
        self.assertEqual(close, {"close": 1008})
        with self.assertRaises(FieldRefused) as http:
            turnFields({"model": "m", "stream": "yes"})
        self.assertEqual(event["error"]["message"], http.exception.error.message)
        self.assertEqual(event["error"]["param"], "stream")


class ParseTests(SynchronousTestCase):
    """
    L{readJSON} and L{turnFields}: one reader and one check.
    """

    def test_readJSON(self):
        self.assertEqual(readJSON(b'{"a": 1}'), {"a": 1})
        for raw, nested in ((b"{", False), (b"[" * 100000 + b"]" * 100000, True)):
            with self.assertRaises(RequestRefused) as e:
                readJSON(raw)
            self.assertEqual((e.exception.error.status, e.exception.nested), (400, nested))

    def test_turnFields(self):
        fields = turnFields({"model": "m", "stream": True, "previous_response_id": "resp_1"})
        self.assertEqual((fields.model, fields.stream, fields.previous), ("m", True, "resp_1"))
        self.assertEqual(turnFields({}, defaultModel="d").model, "d")
        self.assertIsNone(turnFields({"model": "m", "previous_response_id": 1}, "chat").previous)
        for body, kind, param in (
            ([], "shape", None),
            ({"model": 3}, "type", "model"),
            ({}, "missing", "model"),
            ({"model": "m", "stream": 1}, "type", "stream"),
            ({"model": "m", "background": "no"}, "type", "background"),
            ({"model": "m", "previous_response_id": 1}, "type", "previous_response_id"),
            ({"model": "m", "previous_response_id": ""}, "empty", "previous_response_id"),
        ):
            with self.assertRaises(FieldRefused) as e:
                turnFields(body)
            self.assertEqual((e.exception.kind, e.exception.param, e.exception.error.status),
                             (kind, param, 400))


class KeyChecksTests(SynchronousTestCase):
    """
    The key's policy is checked at the door (R102); the engine runs what
    it is given.
    """

    def _refusing(self):
        refusal = ClientError(403, "invalid_request_error", "not this model",
                              code="model_not_allowed")

        class Policy:
            def allowedAccounts(self, key):
                return frozenset({"a"})

            def refusal(self, key, model, now):
                return refusal

        return refusal, Policy()

    def test_doorRefuses(self):
        refusal, policy = self._refusing()
        runner = _Runner()
        runner.keyPolicy = policy
        runner.clock = Clock()
        turn = Turn(entrypoint="http", endpoint="responses", client=KEY, model="m",
                    body={"model": "m"}, stream=False)
        FrontDoor(runner).enter(turn, object())
        self.assertEqual((runner.turns, runner.refused), ([], [refusal]))

    def test_engineDoesNotCheckKeys(self):
        """
        C{TurnRunner.run} runs an admitted turn: a key policy on the
        runner is the door's business, not the engine's.
        """
        from tests.test_runner import OK_STREAM, FakeSink, Rig, account, sse

        rig = Rig([account("a")])
        rig.script("a", sse(*OK_STREAM))
        _, rig.runner.keyPolicy = self._refusing()
        turn = Turn(entrypoint="http", endpoint="responses", client=KEY, model="gpt-5.5",
                    body={"model": "gpt-5.5", "input": "hi", "stream": True}, stream=True,
                    requestId="req")
        outcome = []
        rig.runner.run(turn, FakeSink()).addCallback(outcome.append)
        self.assertEqual((rig.dialer.ids(), outcome), (["a"], ["completed"]))

    def test_refusedTurnIsRecorded(self):
        """
        A turn the door refuses ends through the engine's record (the
        request log's turn, R102) with the refusal written to its sink.
        """
        from tests.tenantsrig import RecordingSink, TenantsRig, account, key

        client = key("bob", models=("gpt-5.5",))
        rig = TenantsRig([account("a")], keys=[client])
        sink = RecordingSink()
        outcome = []
        rig.door.enter(rig.turn(client, model="o3"), sink).addCallback(outcome.append)
        self.assertEqual((outcome, sink.failed.status, rig.dialer.ids()), (["failed"], 403, []))
        [record] = rig.records()
        self.assertEqual(record.status, 403)


class GateTests(SynchronousTestCase):
    """
    R105 at the door: a turn waits for the stores before its key is
    checked; a streaming one gets keepalives meanwhile (R85).
    """

    def test_streamingTurnKeptAliveAtTheGate(self):
        from relay.process.readiness import StartupGate
        from tests.test_runner import OK_STREAM, Rig, account, sse

        rig = Rig([account("a")], stream_keepalive_interval=1)
        rig.script("a", sse(*OK_STREAM))
        gate = StartupGate()
        rig.runner.startupGate = gate
        _, sink, outcome = rig.run()
        for _ in range(3):
            rig.clock.advance(1)
        self.assertEqual((sink.keepalives, outcome, rig.dialer.ids()), (3, [], []))
        gate.mark(gate.settings)()
        gate.mark(gate.tokens)()
        self.assertEqual((outcome, rig.dialer.ids()), (["completed"], ["a"]))

    def test_durationCountsFromTheDoor(self):
        """
        A turn that waited at the door for the stores is recorded with
        that wait in its duration, as when the engine waited for them.
        """
        from relay.process.readiness import StartupGate
        from tests.tenantsrig import RecordingSink, TenantsRig, account, key
        from tests.test_runner import OK_STREAM, sse

        client = key("bob")
        rig = TenantsRig([account("a")], keys=[client])
        rig.script("a", sse(*OK_STREAM))
        gate = StartupGate()
        rig.runner.startupGate = gate
        outcome = []
        rig.door.enter(rig.turn(client), RecordingSink()).addCallback(outcome.append)
        rig.clock.advance(3)
        gate.mark(gate.settings)()
        gate.mark(gate.tokens)()
        [record] = rig.records()
        self.assertEqual((outcome, record.duration_ms >= 3000), (["completed"], True))
