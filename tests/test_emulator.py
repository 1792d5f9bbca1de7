"""
Unit tests for L{relay.emulator}: scripts, faults, event shapes, pacing, the HTTP resources
(through L{treq.testing.StubTreq}) and the twistd plugin.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile

from treq.testing import StubTreq
from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IServiceMaker, MultiService
from twisted.internet.error import CannotListenError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.plugin import getPlugins
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.emulator import Emulator, EmulatorConfigError
from relay.emulator.state import (
    EmulatorState,
    ReplyScript,
    ToolCall,
    buildTurn,
    chatChunks,
    chooseReply,
    parseFault,
    parseScript,
    splitText,
    sseFrame,
)
from relay.emulator.stream import EventPump
from relay.emulator.tap import LISTEN_ERROR_EXIT, Options, configFromString, makeService

_HERE = os.path.dirname(os.path.abspath(__file__))
_EXAMPLE = os.path.join(os.path.dirname(_HERE), "etc", "emulator.yaml")

TOOL = {"tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
        "text": "Tool said: {output}"}


class ScriptTests(SynchronousTestCase):
    """
    Tests for script parsing and reply selection.
    """

    def test_toolCallForFreshTurn(self) -> None:
        """
        A script with a tool call answers a fresh user turn with that call.
        """
        script = parseScript(TOOL)
        reply = chooseReply(script, [{"role": "user", "content": "hi"}], "a1", "gpt-5.5")
        self.assertEqual(reply.toolCall, ToolCall("exec_command", '{"cmd":"echo hi"}'))
        self.assertIsNone(reply.text)

    def test_textAfterToolOutput(self) -> None:
        """
        When the last input item is a C{function_call_output}, the answer is text with the
        tool output filled in.
        """
        script = parseScript(TOOL)
        items = [{"type": "function_call_output", "call_id": "call_1", "output": "hi\n"}]
        reply = chooseReply(script, items, "a1", "gpt-5.5")
        self.assertEqual(reply.text, "Tool said: hi")

    def test_resultField(self) -> None:
        """
        C{{result}} is the part of a Codex tool output after its C{Output:} line.
        """
        script = parseScript({"text": "[{result}]", "tool_call": TOOL["tool_call"]})
        output = "Chunk ID: 1\nProcess exited with code 0\nOutput:\nhi\n"
        items = [{"type": "function_call_output", "call_id": "c", "output": output}]
        self.assertEqual(chooseReply(script, items, "a1", "m").text, "[hi]")

    def test_chatToolMessage(self) -> None:
        """
        A chat request whose last message has role C{tool} also gets the text answer.
        """
        script = parseScript(TOOL)
        reply = chooseReply(script, [{"role": "tool", "content": "3"}], "a1", "m")
        self.assertEqual(reply.text, "Tool said: 3")

    def test_defaultTextNamesAccountNotCredential(self) -> None:
        """
        The default text names the account and never contains the credential.
        """
        state = EmulatorState(clock=Clock())
        state.addAccount("a1", "sk-secret")
        reply = chooseReply(state.scriptFor("sk-secret"), [], state.nameOf("sk-secret"), "m")
        self.assertIn("a1", reply.text)
        self.assertNotIn("sk-secret", reply.text)

    def test_unknownPlaceholderKept(self) -> None:
        """
        Unknown template fields are left as they are instead of raising.
        """
        reply = chooseReply(ReplyScript(text="{nope} {name}"), [], "a1", "m")
        self.assertEqual(reply.text, "{nope} a1")

    def test_badScript(self) -> None:
        """
        Unknown keys and malformed tool calls are rejected.
        """
        self.assertRaises(ValueError, parseScript, {"txt": "x"})
        self.assertRaises(ValueError, parseScript, {"tool_call": {"arguments": {}}})

    def test_splitText(self) -> None:
        """
        Text splits into consecutive, non-empty pieces that join back to the text.
        """
        pieces = splitText("Hello world", 3)
        self.assertEqual(len(pieces), 3)
        self.assertEqual("".join(pieces), "Hello world")
        self.assertEqual(splitText("", 3), [""])


class FaultTests(SynchronousTestCase):
    """
    Tests for fault parsing and consumption.
    """

    def test_timesCountdown(self) -> None:
        """
        A fault with C{times: 2} applies to the next two requests and then heals.
        """
        state = EmulatorState(clock=Clock())
        state.setFault("sk-1", {"kind": "status", "code": 500, "times": 2})
        self.assertEqual(state.takeFault("sk-1", "http").kind, "status")
        self.assertEqual(state.takeFault("sk-1", "http").kind, "status")
        self.assertIsNone(state.takeFault("sk-1", "http"))
        self.assertEqual(state.faults(), {})

    def test_foreverByDefault(self) -> None:
        """
        Without C{times}, a fault applies forever.
        """
        state = EmulatorState(clock=Clock())
        state.setFault("sk-1", {"kind": "reset_before_headers"})
        for _ in range(5):
            self.assertEqual(state.takeFault("sk-1", "ws").kind, "reset_before_headers")

    def test_transportFilter(self) -> None:
        """
        A fault limited to C{ws} does not apply to HTTP requests, and handshake faults only
        apply to upgrades.
        """
        state = EmulatorState(clock=Clock())
        state.setFault("sk-1", [{"kind": "status", "code": 503, "transport": "ws"},
                                {"kind": "ws_handshake_status", "code": 500}])
        self.assertIsNone(state.takeFault("sk-1", "http"))
        self.assertEqual(state.takeFault("sk-1", "ws").kind, "status")
        self.assertEqual(state.takeFault("sk-1", "ws", handshake=True).kind,
                         "ws_handshake_status")

    def test_byNameAndDefault(self) -> None:
        """
        Faults may be addressed by account name, and C{*} applies to accounts without their
        own faults.
        """
        state = EmulatorState(clock=Clock())
        state.addAccount("a2", "sk-a2")
        state.setFault("a2", {"kind": "status", "code": 503})
        state.setFault("*", {"kind": "status", "code": 500})
        self.assertEqual(state.takeFault("sk-a2", "http").get("code"), 503)
        self.assertEqual(state.takeFault("sk-other", "http").get("code"), 500)
        state.setFault("a2", None)
        self.assertEqual(state.takeFault("sk-a2", "http").get("code"), 500)

    def test_modelFilter(self) -> None:
        """
        A fault naming a C{model} applies only to a body for that model (and
        never to a request whose body is unknown); a malformed one is refused.
        """
        state = EmulatorState(clock=Clock())
        state.setFault("*", {"kind": "status", "code": 500, "model": "o1-pro"})
        self.assertIsNone(state.takeFault("sk-1", "http", body={"model": "gpt-5.5"}))
        self.assertIsNone(state.takeFault("sk-1", "http"))
        self.assertEqual(state.takeFault("sk-1", "http", body={"model": "o1-pro"}).get("code"),
                         500)
        self.assertRaises(ValueError, state.setFault, "*", {"kind": "status", "code": 500,
                                                            "model": 5})

    def test_refusalsActTogether(self) -> None:
        """
        A list of C{refuse} faults acts as upstream's validations do: each body
        gets the first refusal that fits it, a body none fits gets none, and a
        refusal that does not fit is not counted down.
        """
        state = EmulatorState(clock=Clock())
        state.setFault("*", [
            {"kind": "refuse", "template": "model_not_found", "code": 403, "model": "o1-pro"},
            {"kind": "refuse", "template": "unknown_parameter", "times": 1},
            {"kind": "refuse", "template": "invalid_value", "param": "tool_choice"},
        ])
        plain = {"model": "gpt-5.5", "input": "hi", "prompt_cache_key": "k"}
        self.assertIsNone(state.takeFault("sk-1", "http", body=plain))
        fault = state.takeFault("sk-1", "http", body=dict(plain, tool_choice="x"))
        self.assertEqual(fault.get("template"), "invalid_value")
        fault = state.takeFault("sk-1", "ws", body=dict(plain, model="o1-pro"))
        self.assertEqual(fault.get("template"), "model_not_found")
        fault = state.takeFault("sk-1", "http", body=dict(plain, odd=1), endpoint="chat")
        self.assertEqual(fault.get("template"), "unknown_parameter")
        self.assertIsNone(state.takeFault("sk-1", "http", body=dict(plain, odd=1)))

    def test_presets(self) -> None:
        """
        Presets fill code, body and headers; explicit fields override them.
        """
        cf = parseFault({"kind": "status", "preset": "cloudflare"})
        self.assertEqual(cf.get("code"), 403)
        self.assertEqual(cf.get("headers")["server"], "cloudflare")
        self.assertIn("cf-ray", cf.get("headers"))
        limit = parseFault({"preset": "usage_limit"}, now=1000.0)
        self.assertEqual(limit.get("code"), 429)
        self.assertEqual(limit.get("body")["error"]["type"], "usage_limit_reached")
        self.assertEqual(limit.get("body")["error"]["resets_in_seconds"], 7200)
        self.assertIn("x-codex-primary-used-percent", limit.get("headers"))
        over = parseFault({"kind": "status", "preset": "overloaded", "code": 503})
        self.assertEqual(over.get("code"), 503)
        self.assertEqual(over.get("body")["error"]["code"], "server_is_overloaded")

    def test_invalid(self) -> None:
        """
        Malformed faults raise L{ValueError}.
        """
        for spec in ({"kind": "nope"}, {"kind": "status"}, {"kind": "status", "code": 99},
                     {"kind": "cut_after_events"}, {"kind": "end_after_events", "events": "2"},
                     {"kind": "reset_before_headers", "times": 0},
                     {"kind": "reset_before_headers", "transport": "udp"},
                     {"kind": "status", "preset": "nope"}):
            self.assertRaises(ValueError, parseFault, spec)


class TurnShapeTests(SynchronousTestCase):
    """
    Tests for the planned event sequences (protocol.md §2.3, §2.4).
    """

    def test_textTurn(self) -> None:
        """
        A text turn has the §2.3 events in order, numbered from 0, and ends with
        C{response.completed} carrying the full output and usage.
        """
        turn = buildTurn({"model": "gpt-5.5", "input": "hi"}, chooseReply(
            ReplyScript(text="Hello there"), [], "a1", "gpt-5.5"), 100.0)
        types = [e["type"] for e in turn.events]
        self.assertEqual(types, [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.delta", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"])
        self.assertEqual([e["sequence_number"] for e in turn.events],
                         list(range(len(turn.events))))
        self.assertTrue(turn.responseId.startswith("resp_"))
        self.assertEqual(turn.events[0]["response"]["status"], "in_progress")
        self.assertEqual(turn.events[0]["response"]["output"], [])
        final = turn.events[-1]["response"]
        self.assertEqual(final, turn.final)
        self.assertEqual(final["status"], "completed")
        self.assertEqual(final["output"][0]["content"][0]["text"], "Hello there")
        self.assertTrue(final["output"][0]["id"].startswith("msg_"))
        usage = final["usage"]
        self.assertEqual(usage["total_tokens"], usage["input_tokens"] + usage["output_tokens"])
        self.assertEqual(turn.firstOutput, 2)

    def test_functionCallTurn(self) -> None:
        """
        A function-call turn has the §2.4 events and the call in the final output.
        """
        turn = buildTurn({"input": []}, chooseReply(parseScript(TOOL), [], "a1", "m"), 0.0)
        types = [e["type"] for e in turn.events]
        self.assertEqual(types[2], "response.output_item.added")
        self.assertIn("response.function_call_arguments.delta", types)
        self.assertEqual(types[-3:], ["response.function_call_arguments.done",
                                      "response.output_item.done", "response.completed"])
        item = turn.final["output"][0]
        self.assertEqual(item["type"], "function_call")
        self.assertTrue(item["id"].startswith("fc_"))
        self.assertTrue(item["call_id"].startswith("call_"))
        self.assertEqual(json.loads(item["arguments"]), {"cmd": "echo hi"})
        deltas = "".join(e["delta"] for e in turn.events
                         if e["type"] == "response.function_call_arguments.delta")
        self.assertEqual(deltas, item["arguments"])

    def test_prewarm(self) -> None:
        """
        A prewarm (no reply) is C{response.created} then an empty C{response.completed}.
        """
        turn = buildTurn({"input": []}, None, 0.0)
        self.assertEqual([e["type"] for e in turn.events],
                         ["response.created", "response.completed"])
        self.assertEqual(turn.final["output"], [])

    def test_streamErrorAndEmptyCompleted(self) -> None:
        """
        C{stream_error} ends with C{response.failed} carrying the code; C{empty_completed}
        ends with an empty C{response.completed} without usage.
        """
        reply = chooseReply(ReplyScript(), [], "a1", "m")
        failed = buildTurn({}, reply, 0.0, parseFault(
            {"kind": "stream_error", "code": "server_error", "message": "boom"}))
        self.assertEqual([e["type"] for e in failed.events],
                         ["response.created", "response.failed"])
        self.assertEqual(failed.final["error"], {"code": "server_error", "message": "boom"})
        empty = buildTurn({}, reply, 0.0, parseFault({"kind": "empty_completed"}))
        self.assertEqual(empty.final["output"], [])
        self.assertIsNone(empty.final["usage"])

    def test_sseFrame(self) -> None:
        """
        An SSE frame is an C{event:} line, a C{data:} line and a blank line.
        """
        frame = sseFrame({"type": "response.created", "sequence_number": 0})
        self.assertEqual(frame, b'event: response.created\n'
                                b'data: {"type":"response.created","sequence_number":0}\n\n')


class AwkwardShapeTests(SynchronousTestCase):
    """
    The script options that rehearse the ChatGPT backend's awkward shapes
    (issue 13): parallel calls, arguments only in C{.done}, C{output: []}
    on the terminal event, C{response.incomplete} endings.
    """

    PARALLEL = {"tool_calls": [{"name": "a", "arguments": {"x": 1}},
                               {"name": "b", "arguments": "{}"}],
                "argument_deltas": 0}

    def test_parse(self) -> None:
        """
        The new keys parse; bad values are refused.
        """
        script = parseScript({**self.PARALLEL, "completed_output": "empty",
                              "ending": "content_filter"})
        self.assertEqual(script.calls(), (ToolCall("a", '{"x":1}'), ToolCall("b", "{}")))
        self.assertEqual((script.argumentDeltas, script.completedOutput, script.ending),
                         (0, "empty", "content_filter"))
        for bad in ({"tool_calls": {}}, {"argument_deltas": -1}, {"completed_output": "x"},
                    {"ending": "stop"}, {"tool_calls": [{"arguments": {}}]}):
            self.assertRaises(ValueError, parseScript, bad)

    def test_parallel_calls_without_argument_deltas(self) -> None:
        """
        Two calls at output indexes 0 and 1; with C{argument_deltas: 0}
        no delta events, the arguments only in C{.done}.
        """
        reply = chooseReply(parseScript(self.PARALLEL), [], "a1", "m")
        turn = buildTurn({}, reply, 0.0, argumentDeltas=0)
        types = [e["type"] for e in turn.events]
        self.assertNotIn("response.function_call_arguments.delta", types)
        done = [e for e in turn.events if e["type"] == "response.function_call_arguments.done"]
        self.assertEqual([(e["output_index"], e["arguments"]) for e in done],
                         [(0, '{"x":1}'), (1, "{}")])
        self.assertEqual([i["name"] for i in turn.final["output"]], ["a", "b"])

    def test_empty_output(self) -> None:
        """
        C{emptyOutput}: the terminal event has C{output: []}, the items are
        in the C{output_item.done} events; the non-stream answer is full.
        """
        turn = buildTurn({}, chooseReply(ReplyScript(), [], "a1", "m"), 0.0, emptyOutput=True)
        self.assertEqual(turn.events[-1]["response"]["output"], [])
        self.assertIsNotNone(turn.events[-1]["response"]["usage"])
        self.assertEqual(len(turn.final["output"]), 1)

    def test_incomplete_endings(self) -> None:
        """
        C{ending}: half the text, then C{response.incomplete} with the reason.
        """
        for ending in ("max_output_tokens", "content_filter"):
            script = parseScript({"text": "abcdefgh", "ending": ending})
            turn = buildTurn({}, chooseReply(script, [], "a1", "m"), 0.0)
            last = turn.events[-1]
            self.assertEqual(last["type"], "response.incomplete")
            self.assertEqual(last["response"]["incomplete_details"], {"reason": ending})
            self.assertEqual(last["response"]["output"][0]["content"][0]["text"], "abcd")

    def test_chat_chunks(self) -> None:
        """
        The chat route answers parallel calls with two indexes and the
        endings with C{length} / C{content_filter}.
        """
        reply = chooseReply(parseScript(self.PARALLEL), [], "a1", "m")
        chunks, completion = chatChunks({}, reply, 0.0, False, 0)
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        self.assertEqual([(c["index"], c["function"]["arguments"]) for c in calls],
                         [(0, '{"x":1}'), (1, "{}")])
        self.assertEqual(len(completion["choices"][0]["message"]["tool_calls"]), 2)
        for ending, finish in (("max_output_tokens", "length"),
                               ("content_filter", "content_filter")):
            reply = chooseReply(parseScript({"ending": ending}), [], "a1", "m")
            _, completion = chatChunks({}, reply, 0.0, False)
            self.assertEqual(completion["choices"][0]["finish_reason"], finish)


class EventPumpTests(SynchronousTestCase):
    """
    Tests for L{EventPump} on a L{Clock}.
    """

    def _pump(self, **kw):
        """
        Build a pump over five events that records what it does.

        @param kw: extra pump fields.
        @return: the pump and the log list.
        """
        log: list = []
        pump = EventPump(clock=self.clock, events=list(range(5)), send=log.append,
                         finish=lambda: log.append("finish"), cut=lambda: log.append("cut"),
                         beforeTerminal=lambda: log.append("terminal"), **kw)
        return pump, log

    def setUp(self) -> None:
        """
        Make a clock.
        """
        self.clock = Clock()

    def test_synchronousWithoutDelay(self) -> None:
        """
        Without delays every event is sent at once, the terminal hook runs before the last.
        """
        pump, log = self._pump()
        pump.start()
        self.assertEqual(log, [0, 1, 2, 3, "terminal", 4, "finish"])

    def test_delayFirstOutput(self) -> None:
        """
        C{firstDelay} holds back the event at C{firstOutput} on the clock.
        """
        pump, log = self._pump(firstOutput=2, firstDelay=3.0)
        pump.start()
        self.assertEqual(log, [0, 1])
        self.clock.advance(2.9)
        self.assertEqual(log, [0, 1])
        self.clock.advance(0.1)
        self.assertEqual(log[-1], "finish")

    def test_perEventDelay(self) -> None:
        """
        A per-event delay spaces the events out.
        """
        pump, log = self._pump(delay=1.0)
        pump.start()
        self.assertEqual(log, [0])
        self.clock.advance(1.0)
        self.assertEqual(log, [0, 1])
        self.clock.pump([1.0] * 4)
        self.assertEqual(log[-1], "finish")

    def test_cutAfter(self) -> None:
        """
        C{cutAfter} sends that many events and then cuts instead of finishing.
        """
        pump, log = self._pump(cutAfter=2)
        pump.start()
        self.assertEqual(log, [0, 1, "cut"])

    def test_stop(self) -> None:
        """
        A stopped pump sends nothing more and cancels its pending call.
        """
        pump, log = self._pump(delay=1.0)
        pump.start()
        pump.stop()
        self.clock.advance(10)
        self.assertEqual(log, [0])
        self.assertEqual(self.clock.getDelayedCalls(), [])


class ResourceTests(SynchronousTestCase):
    """
    Tests for the HTTP resources, through L{StubTreq} and a L{Clock}.
    """

    def setUp(self) -> None:
        """
        Build an emulator with two accounts and a stub client.
        """
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.emulator = Emulator(reactor=self.clock, config={
            "accept_any": False,
            "accounts": [{"name": "a1", "credential": "sk-a1"},
                         {"name": "a3", "credential": "oauth-a3", "script": TOOL}]})
        self.treq = StubTreq(self.emulator.site.resource)

    def _post(self, path: str, body: dict, credential: str = "sk-a1"):
        """
        POST JSON and return the response.

        @param path: the path.
        @param body: the JSON body.
        @param credential: the bearer token.
        @return: the response.
        """
        d = self.treq.post("http://emulator" + path, json.dumps(body).encode(), headers={
            "Authorization": "Bearer " + credential, "Content-Type": "application/json"})
        self.treq.flush()
        return self.successResultOf(d)

    def _content(self, response) -> bytes:
        """
        Read a body.

        @param response: the response.
        @rtype: L{bytes}
        """
        d = response.content()
        self.treq.flush()
        return self.successResultOf(d)

    def test_nonStream(self) -> None:
        """
        A non-stream request gets one JSON response object (§2.7).
        """
        response = self._post("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        self.assertEqual(response.code, 200)
        body = json.loads(self._content(response))
        self.assertEqual(body["object"], "response")
        self.assertEqual(body["status"], "completed")
        self.assertEqual(body["created_at"], 1_800_000_000)
        self.assertIn("a1", body["output"][0]["content"][0]["text"])
        self.assertEqual(self.emulator.peak("a1"), 1)
        self.assertEqual(self.emulator.inflight("a1"), 0)

    def test_unknownKey(self) -> None:
        """
        With C{accept_any: false}, an unknown credential gets OpenAI's 401 body.
        """
        response = self._post("/v1/responses", {"input": "hi"}, credential="sk-nope")
        self.assertEqual(response.code, 401)
        body = json.loads(self._content(response))
        self.assertEqual(body["error"]["code"], "invalid_api_key")

    def test_oauthNonStream(self) -> None:
        """
        The OAuth route rejects non-stream requests with C{Stream must be set to true}.
        """
        response = self._post("/backend-api/codex/responses", {"input": "hi"}, "oauth-a3")
        self.assertEqual(response.code, 400)
        self.assertEqual(json.loads(self._content(response)),
                         {"detail": "Stream must be set to true"})

    def test_oauthUnsupportedParameters(self) -> None:
        """
        The OAuth route refuses C{max_output_tokens}, C{temperature} and
        C{top_p} as the ChatGPT backend does.
        """
        for name in ("max_output_tokens", "temperature", "top_p"):
            response = self._post("/backend-api/codex/responses",
                                  {"input": "hi", "stream": True, name: 1}, "oauth-a3")
            self.assertEqual(response.code, 400)
            self.assertEqual(json.loads(self._content(response)),
                             {"detail": f"Unsupported parameter: {name}"})

    def test_oauthTerminalOutputIsEmpty(self) -> None:
        """
        On the OAuth route the terminal event carries C{output: []} (the call
        is only in C{output_item.done}); C{completed_output: full} restores it.
        """
        body = {"input": "hi", "stream": True}
        data = self._content(self._post("/backend-api/codex/responses", body, "oauth-a3"))
        events = [json.loads(line[6:]) for line in data.decode().split("\n")
                  if line.startswith("data: ")]
        self.assertEqual(events[-1]["type"], "response.completed")
        self.assertEqual(events[-1]["response"]["output"], [])
        self.assertEqual(events[-2]["item"]["type"], "function_call")
        self.emulator.setScript("oauth-a3", {**TOOL, "completed_output": "full"})
        data = self._content(self._post("/backend-api/codex/responses", body, "oauth-a3"))
        last = json.loads(data.decode().strip().split("\n")[-1][6:])
        self.assertEqual(len(last["response"]["output"]), 1)

    def test_storeChaining(self) -> None:
        """
        A stored response chains for its own credential only; other ids get
        C{previous_response_not_found}.
        """
        self.emulator.state.addAccount("a2", "sk-a2")
        first = json.loads(self._content(self._post("/v1/responses", {"input": "hi"})))
        ok = self._post("/v1/responses", {"input": "x", "previous_response_id": first["id"]})
        self.assertEqual(ok.code, 200)
        other = self._post("/v1/responses", {"input": "x", "previous_response_id": first["id"]},
                           "sk-a2")
        self.assertEqual(other.code, 400)
        error = json.loads(self._content(other))["error"]
        self.assertEqual(error["code"], "previous_response_not_found")
        self.assertEqual(error["param"], "previous_response_id")

    def test_statusFaultThenHeal(self) -> None:
        """
        A status fault with C{times: 1} answers once with its status and body, then heals.
        """
        self.emulator.setFault("a1", {"kind": "status", "preset": "cloudflare", "times": 1})
        response = self._post("/v1/responses", {"input": "hi"})
        self.assertEqual(response.code, 403)
        self.assertEqual(response.headers.getRawHeaders("server"), ["cloudflare"])
        self.assertIsNone(response.headers.getRawHeaders("x-request-id"))
        self.assertIn(b"Cloudflare", self._content(response))
        self.assertEqual(self._post("/v1/responses", {"input": "hi"}).code, 200)

    def test_delayFirstOutputNonStream(self) -> None:
        """
        C{delay_first_output} holds a non-stream answer until the clock advances, counting
        the turn as in flight meanwhile.
        """
        self.emulator.setFault("a1", {"kind": "delay_first_output", "seconds": 5})
        d = self.treq.post("http://emulator/v1/responses", b'{"input":"hi"}',
                           headers={"Authorization": "Bearer sk-a1"})
        self.treq.flush()
        self.assertNoResult(d)
        self.assertEqual(self.emulator.inflight("a1"), 1)
        self.clock.advance(5)
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(self.emulator.inflight("a1"), 0)

    def test_nonStreamTakesGenerationTime(self) -> None:
        """
        With a per-event C{delay} in the script, a non-stream answer comes after the time
        the stream would have taken (here 10 events after the first, 0.5 s apart), and a
        non-stream C{stream_error} is an HTTP 500 with the code in the error envelope.
        """
        self.emulator.setScript("a1", {"delay": 0.5})
        d = self.treq.post("http://emulator/v1/responses", b'{"input":"hi"}',
                           headers={"Authorization": "Bearer sk-a1"})
        self.treq.flush()
        self.clock.advance(4.9)
        self.treq.flush()
        self.assertNoResult(d)
        self.assertEqual(self.emulator.inflight("a1"), 1)
        self.clock.advance(0.1)
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        self.emulator.setFault("a1", {"kind": "stream_error", "code": "server_error"})
        response = self._post("/v1/responses", {"input": "hi"})
        self.assertEqual(response.code, 500)
        error = json.loads(self._content(response))["error"]
        self.assertEqual((error["type"], error["code"]), ("server_error", "server_error"))

    def test_hangBeforeHeaders(self) -> None:
        """
        C{hang_before_headers} never answers and counts the request as in flight.
        """
        self.emulator.setFault("a1", {"kind": "hang_before_headers", "times": 1})
        d = self.treq.post("http://emulator/v1/responses", b'{"input":"hi"}',
                           headers={"Authorization": "Bearer sk-a1"})
        self.treq.flush()
        self.clock.advance(3600)
        self.treq.flush()
        self.assertNoResult(d)
        self.assertEqual(self.emulator.inflight("a1"), 1)

    def test_recording(self) -> None:
        """
        Requests are recorded with lower-cased headers and parsed bodies; the control API
        redacts the credential.
        """
        self._post("/v1/responses", {"input": "hi"})
        record = self.emulator.requests[-1]
        self.assertEqual((record.credential, record.name, record.transport, record.kind,
                          record.method, record.path), ("sk-a1", "a1", "http", "request",
                                                        "POST", "/v1/responses"))
        self.assertEqual(record["body"], {"input": "hi"})
        self.assertEqual(record.headers["authorization"], "Bearer sk-a1")
        listing = self.successResultOf(self.treq.get("http://emulator/_emulator/requests"))
        raw = self._content(listing)
        self.assertNotIn(b"sk-a1", raw)
        self.assertEqual(json.loads(raw)[0]["headers"]["authorization"], "Bearer ***")
        self.emulator.clearRequests()
        self.assertEqual(self.emulator.requests, [])

    def test_controlFaultsAndScripts(self) -> None:
        """
        Faults and scripts can be set by account name through the control API.
        """
        d = self.treq.put("http://emulator/_emulator/faults/a1",
                          b'{"kind":"status","code":500,"times":1}')
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        d = self.treq.put("http://emulator/_emulator/scripts/a1", b'{"text":"scripted"}')
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(self._post("/v1/responses", {"input": "hi"}).code, 500)
        body = json.loads(self._content(self._post("/v1/responses", {"input": "hi"})))
        self.assertEqual(body["output"][0]["content"][0]["text"], "scripted")
        d = self.treq.put("http://emulator/_emulator/faults/a1", b'{"kind":"bogus"}')
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 400)
        stats = json.loads(self._content(self.successResultOf(
            self.treq.get("http://emulator/_emulator/stats"))))
        self.assertEqual(stats["a1"], {"inflight": 0, "peak": 1})

    def test_getWithoutUpgrade(self) -> None:
        """
        A GET on the Responses path without an upgrade gets 426.
        """
        d = self.treq.get("http://emulator/v1/responses", headers={
            "Authorization": "Bearer sk-a1"})
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 426)


class ConfigTests(SynchronousTestCase):
    """
    Tests for configuration loading and the twistd plugin.
    """

    def test_exampleConfig(self) -> None:
        """
        C{etc/emulator.yaml} parses and defines the three demo accounts, a2 faulty,
        and the ChatGPT login C{demo-login} the demo signs in with (issue 21).
        """
        options = Options()
        options.parseOptions(["--config", _EXAMPLE])
        self.assertEqual(options.listen, "tcp:9090:interface=127.0.0.1")
        creds = {a["name"]: a.get("credential") for a in options.config["accounts"]}
        self.assertEqual(creds, {"a1": "sk-emu-a1", "a2": "sk-emu-a2", "a3": "oauth-emu-a3",
                                 "demo-login": None})
        emulator = Emulator(reactor=Clock(), config=options.config)
        self.assertEqual(emulator.state.takeFault("sk-emu-a2", "http").get("code"), 503)

    def test_portOption(self) -> None:
        """
        C{--port} overrides the configured listen endpoint with a loopback TCP port.
        """
        options = Options()
        options.parseOptions(["--config", _EXAMPLE, "--port", "9191"])
        self.assertEqual(options.listen, "tcp:9191:interface=127.0.0.1")
        self.assertRaises(usage.UsageError, Options().parseOptions, ["--port", "x"])
        self.assertRaises(usage.UsageError, Options().parseOptions, ["--port", "70000"])

    def test_helpIsPlainText(self) -> None:
        """
        C{relay-emulator --help} describes C{--port} in one plain line, never
        with a docstring's epytext fields (C{@param}, C{L{...}}).
        """
        # the options' block only: usage.Options appends the running
        # program's own docstring after it (a trial worker's has an @since)
        text = Options().getUsage().split("\n\n")[0]
        self.assertIn("TCP port on 127.0.0.1 (shortcut for --listen).", text)
        self.assertNotIn("@", text)
        self.assertNotIn("L{", text)

    def test_badConfig(self) -> None:
        """
        Unknown keys, missing account entries and unreadable files are usage errors.
        """
        self.assertRaises(EmulatorConfigError, configFromString, "bogus: 1\n")
        self.assertRaises(EmulatorConfigError, configFromString,
                          "accounts:\n  - {name: a1}\n")
        self.assertRaises(EmulatorConfigError, configFromString,
                          "accounts:\n  - {name: a1, credential: x, fault: {kind: nope}}\n")
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        path = os.path.join(directory, "bad.yaml")
        with open(path, "w") as f:
            f.write("listen: [unclosed\n")
        self.assertRaises(usage.UsageError, Options().parseOptions, ["--config", path])
        self.assertRaises(usage.UsageError, Options().parseOptions,
                          ["--config", os.path.join(directory, "missing.yaml")])

    def test_makeService(self) -> None:
        """
        C{makeService} returns a L{MultiService} listening with the emulator's site.
        """
        options = Options()
        options.parseOptions(["--port", "0"])
        service = makeService(options, reactor=MemoryReactorClock())
        self.assertIsInstance(service, MultiService)
        [child] = list(service)
        self.assertIsInstance(child, StreamServerEndpointService)
        self.assertIs(child.factory, service.emulator.site)

    def test_portInUseIsOneLine(self) -> None:
        """
        A port already taken (another demo or emulator still running) ends the
        emulator with one line naming the endpoint and exit status 2, not a
        C{CannotListenError} traceback and a process serving nothing.
        """

        class BusyReactor(MemoryReactorClock):
            def listenTCP(self, port, factory, backlog=50, interface=""):
                raise CannotListenError(interface, port, OSError(98, "Address already in use"))

        options = Options()
        options.parseOptions(["--port", "9191"])
        service = makeService(options, reactor=BusyReactor())
        [listener] = list(service)
        listener.stderr = io.StringIO()
        with self.assertRaises(SystemExit) as caught:
            service.privilegedStartService()
        self.assertEqual(caught.exception.code, LISTEN_ERROR_EXIT)
        self.assertEqual(
            listener.stderr.getvalue(),
            "relay-emulator: cannot listen on tcp:9191:interface=127.0.0.1:"
            " Address already in use\n",
        )

    def test_plugin(self) -> None:
        """
        The C{relay-emulator} plugin is discoverable and provides L{IServiceMaker}.
        """
        import twisted.plugins

        makers = [p for p in getPlugins(IServiceMaker, twisted.plugins)
                  if p.tapname == "relay-emulator"]
        self.assertEqual(len(makers), 1)
        self.assertTrue(verifyObject(IServiceMaker, makers[0]))
        self.assertIs(makers[0].options, Options)
