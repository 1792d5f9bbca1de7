"""
Tests for L{relay.translate}: chat requests become Responses requests,
Responses events become chat chunks and completions, terminal responses
get their C{output} back from C{output_item.done} events (issue 13 item 1,
protocol.md 2.7 and 3).
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.engine.payload import OAUTH_CHAT_FIELDS, upstreamBody, upstreamPath, upstreamStreams
from relay.entry.sinks import JSONSink
from relay.interfaces import ITurnSink
from relay.base.records import Account, ClientKey, Turn
from relay.wire.sse import Event
from relay.translate import (
    ChatChunkTranslator,
    ChatCompletionsSink,
    ResponseAssembler,
    chatCompletion,
    chatToResponses,
)
from relay.translate.chatrequest import ChatRequestError, checkMessages
from relay.translate.sink import chatError

OAUTH = Account(id="o", type="oauth", base_url="https://chatgpt.com/backend-api/codex",
                credential="t")
APIKEY = Account(id="k", type="apikey", base_url="https://api.openai.com/v1", credential="k")


def chatTurn(body, stream=None):
    body = {"model": "gpt-5.5", **body}
    return Turn(entrypoint="http", endpoint="chat", client=ClientKey(name="t", key="k"),
                model="gpt-5.5", body=body,
                stream=body.get("stream") is True if stream is None else stream)


def ev(kind, **fields):
    return {"type": kind, **fields}


def fc(index, callId, name, arguments="", fid=None):
    return {"type": "function_call", "id": fid or f"fc_{index}", "call_id": callId,
            "name": name, "arguments": arguments}


CREATED = ev("response.created", response={"id": "resp_abc", "created_at": 1234, "output": []})


def toolStream(argDeltas=True, emptyOutput=True):
    """
    Two parallel calls; arguments as deltas or only in the .done events.
    """
    out = [CREATED]
    calls = [(0, "call_a", "get_weather", '{"city":"Paris"}'),
             (1, "call_b", "get_time", '{"tz":"CET"}')]
    items = []
    for index, callId, name, args in calls:
        out.append(ev("response.output_item.added", output_index=index,
                      item=fc(index, callId, name)))
        if argDeltas:
            out.append(ev("response.function_call_arguments.delta", output_index=index,
                          item_id=f"fc_{index}", delta=args[:5]))
            out.append(ev("response.function_call_arguments.delta", output_index=index,
                          item_id=f"fc_{index}", delta=args[5:]))
        out.append(ev("response.function_call_arguments.done", output_index=index,
                      item_id=f"fc_{index}", arguments=args))
        item = fc(index, callId, name, args)
        items.append(item)
        out.append(ev("response.output_item.done", output_index=index, item=item))
    usage = {"input_tokens": 10, "output_tokens": 4, "total_tokens": 14,
             "input_tokens_details": {"cached_tokens": 2},
             "output_tokens_details": {"reasoning_tokens": 1}}
    out.append(ev("response.completed", response={
        "id": "resp_abc", "status": "completed", "output": [] if emptyOutput else items,
        "usage": usage}))
    return out


def textStream(text="Hello there", terminal="response.completed", details=None):
    msg = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}
    out = [CREATED, ev("response.output_item.added", output_index=0, item=msg)]
    for piece in (text[:5], text[5:]):
        out.append(ev("response.output_text.delta", output_index=0, item_id="msg_1",
                      content_index=0, delta=piece))
    out.append(ev("response.output_text.done", output_index=0, item_id="msg_1", text=text))
    done = dict(msg, content=[{"type": "output_text", "text": text}])
    out.append(ev("response.output_item.done", output_index=0, item=done))
    response = {"id": "resp_abc", "status": "completed", "output": [],
                "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}
    if details:
        response["incomplete_details"] = details
    out.append(ev(terminal, response=response))
    return out


def translate(events, includeUsage=False):
    t = ChatChunkTranslator("gpt-5.5", includeUsage, 99)
    chunks = []
    for e in events:
        chunks.extend(t.feed(e))
    return t, chunks


def toolDeltas(chunks):
    return [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]


class ChatRequestTests(SynchronousTestCase):
    """
    L{chatToResponses}: the request mapping of protocol.md 3 "Upstream".
    """

    def test_messages(self):
        """
        System and developer messages become developer messages, user text
        and images become input parts, assistant tool calls become
        function_call items and tool messages function_call_output items,
        in order.
        """
        body = {"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url",
                 "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
            ]},
            {"role": "assistant", "content": "calling", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "look", "arguments": '{"a":1}'}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "see", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "result one"},
            {"role": "tool", "tool_call_id": "call_2",
             "content": [{"type": "text", "text": "res"}, {"type": "text", "text": "ult"}]},
        ]}
        items = chatToResponses(body)["input"]
        self.assertEqual(items[0], {"type": "message", "role": "developer",
                                    "content": [{"type": "input_text", "text": "be brief"}]})
        self.assertEqual(items[1]["role"], "developer")
        self.assertEqual(items[2]["content"], [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"},
            {"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"},
        ])
        self.assertEqual(items[3], {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "calling", "annotations": []}]})
        self.assertEqual(items[4], {"type": "function_call", "call_id": "call_1",
                                    "name": "look", "arguments": '{"a":1}'})
        self.assertEqual(items[5]["call_id"], "call_2")
        self.assertEqual(items[6], {"type": "function_call_output", "call_id": "call_1",
                                    "output": "result one"})
        self.assertEqual(items[7]["output"], "result")
        self.assertEqual(len(items), 8)

    def test_assistant_without_content_is_only_calls(self):
        """
        An assistant message with C{content: null} and tool calls gives no
        empty message item.
        """
        items = chatToResponses({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]}]})["input"]
        self.assertEqual([i["type"] for i in items], ["function_call"])

    def test_custom_tools_and_calls(self):
        """
        Custom tools, custom tool calls and their outputs keep their kind.
        """
        out = chatToResponses({
            "messages": [
                {"role": "assistant", "tool_calls": [
                    {"id": "c1", "type": "custom", "custom": {"name": "patch", "input": "x"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "tools": [{"type": "custom", "custom": {"name": "patch", "description": "d"}}],
            "tool_choice": {"type": "custom", "custom": {"name": "patch"}},
        })
        self.assertEqual(out["input"][0], {"type": "custom_tool_call", "call_id": "c1",
                                           "name": "patch", "input": "x"})
        self.assertEqual(out["input"][1]["type"], "custom_tool_call_output")
        self.assertEqual(out["tools"], [{"type": "custom", "name": "patch", "description": "d"}])
        self.assertEqual(out["tool_choice"], {"type": "custom", "name": "patch"})

    def test_tools_and_choice(self):
        """
        Function tools are flattened and non-strict unless the chat tool said
        otherwise; a named tool choice is flattened; legacy C{functions} and
        C{function_call} work too.
        """
        out = chatToResponses({"messages": [], "tools": [
            {"type": "function", "function": {"name": "f", "description": "d",
                                              "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "g", "strict": True}},
        ], "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False})
        self.assertEqual(out["tools"], [
            {"type": "function", "name": "f", "description": "d",
             "parameters": {"type": "object"}, "strict": False},
            {"type": "function", "name": "g", "parameters": {"type": "object", "properties": {}},
             "strict": True},
        ])
        self.assertEqual(out["tool_choice"], {"type": "function", "name": "f"})
        self.assertIs(out["parallel_tool_calls"], False)
        legacy = chatToResponses({"messages": [], "functions": [{"name": "h"}],
                                  "function_call": {"name": "h"}})
        self.assertEqual(legacy["tools"][0]["name"], "h")
        self.assertEqual(legacy["tool_choice"], {"type": "function", "name": "h"})
        required = chatToResponses({"messages": [], "tool_choice": "required"})
        self.assertEqual(required["tool_choice"], "required")

    def test_limits_formats_reasoning(self):
        """
        C{max_completion_tokens} (else C{max_tokens}) -> C{max_output_tokens},
        C{response_format} -> C{text.format}, C{reasoning_effort} ->
        C{reasoning.effort}; chat-only fields are left out.
        """
        out = chatToResponses({
            "messages": [], "max_tokens": 50, "max_completion_tokens": 70,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "r", "schema": {"type": "object"}, "strict": True}},
            "reasoning_effort": "low", "verbosity": "low", "n": 1, "stop": ["x"], "seed": 3,
            "stream_options": {"include_usage": True}, "temperature": 0.2,
        })
        self.assertEqual(out["max_output_tokens"], 70)
        self.assertEqual(out["text"], {"format": {"type": "json_schema", "name": "r",
                                                  "schema": {"type": "object"}, "strict": True},
                                       "verbosity": "low"})
        self.assertEqual(out["reasoning"], {"effort": "low"})
        self.assertEqual(out["temperature"], 0.2)
        for name in ("n", "stop", "seed", "stream_options", "messages", "max_tokens"):
            self.assertNotIn(name, out)
        self.assertEqual(chatToResponses({"messages": [], "max_tokens": 5})["max_output_tokens"], 5)
        self.assertEqual(
            chatToResponses({"messages": [], "response_format": {"type": "json_object"}})["text"],
            {"format": {"type": "json_object"}},
        )

    def test_check_messages(self):
        """
        Every chat request needs a non-empty array of objects with a known
        role; the error names the parameter.
        """
        checkMessages([{"role": "user", "content": "x"}])
        for bad, param in [(None, "messages"), ([], "messages"), (["x"], "messages[0]"),
                           ([{"role": "user"}, {"role": "robot"}], "messages[1].role")]:
            e = self.assertRaises(ChatRequestError, checkMessages, bad)
            self.assertEqual(e.param, param)


class OAuthPayloadTests(SynchronousTestCase):
    """
    L{relay.engine.payload} for chat turns: OAuth accounts get a translated,
    streaming C{/responses} request; API-key accounts the chat request.
    """

    def test_oauth_gets_a_codex_shaped_responses_request(self):
        """
        A chat turn on an OAuth account goes to C{/responses}, streams,
        C{store:false}, has C{instructions}, and keeps only the fields
        Codex sends (the backend refuses C{max_output_tokens},
        C{temperature}, C{top_p}).
        """
        turn = chatTurn({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                         "temperature": 0.5, "top_p": 0.9, "user": "u", "stream": False})
        self.assertEqual(upstreamPath(turn, OAUTH), "/responses")
        self.assertTrue(upstreamStreams(turn, OAUTH))
        body = json.loads(upstreamBody(turn, OAUTH))
        self.assertEqual(body["stream"], True)
        self.assertEqual(body["store"], False)
        self.assertEqual(body["instructions"], "")
        self.assertEqual(body["input"][0]["content"][0]["text"], "hi")
        self.assertLessEqual(set(body), OAUTH_CHAT_FIELDS)
        for name in ("max_output_tokens", "temperature", "top_p", "messages", "user"):
            self.assertNotIn(name, body)

    def test_apikey_gets_the_chat_request(self):
        """
        On an API-key account the chat request goes to C{/chat/completions}
        unchanged.
        """
        turn = chatTurn({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
        self.assertEqual(upstreamPath(turn, APIKEY), "/chat/completions")
        self.assertFalse(upstreamStreams(turn, APIKEY))
        body = json.loads(upstreamBody(turn, APIKEY))
        self.assertEqual(body["max_tokens"], 9)
        self.assertIn("messages", body)


class ChunkTranslatorTests(SynchronousTestCase):
    """
    L{ChatChunkTranslator}: protocol.md 3 "Stream".
    """

    def test_text(self):
        """
        A role chunk, the deltas once (not again from C{.done} or the item),
        a C{stop} finish chunk; the id comes from the response id and
        C{created} from C{created_at}.
        """
        t, chunks = translate(textStream())
        deltas = [c["choices"][0]["delta"] for c in chunks]
        self.assertEqual(deltas, [{"role": "assistant", "content": ""}, {"content": "Hello"},
                                  {"content": " there"}, {}])
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")
        self.assertEqual({c["id"] for c in chunks}, {"chatcmpl-abc"})
        self.assertEqual({c["created"] for c in chunks}, {1234})
        self.assertEqual({c["model"] for c in chunks}, {"gpt-5.5"})
        self.assertNotIn("usage", chunks[0])

    def test_text_only_in_done(self):
        """
        Text that arrives only in the finished item (no deltas) is sent once.
        """
        events = [e for e in textStream() if e["type"] not in (
            "response.output_text.delta", "response.output_text.done")]
        _, chunks = translate(events)
        self.assertEqual([c["choices"][0]["delta"].get("content") for c in chunks],
                         ["", "Hello there", None])

    def test_text_only_in_terminal_output(self):
        """
        A terminal response whose items no event announced still reaches
        the client.
        """
        _, chunks = translate([CREATED, ev("response.completed", response={
            "output": [{"type": "message",
                        "content": [{"type": "output_text", "text": "late"}]}]})])
        self.assertEqual(chunks[1]["choices"][0]["delta"], {"content": "late"})

    def test_parallel_tool_calls_with_deltas(self):
        """
        Two calls: stable index, id and name on each call's first delta,
        the argument fragments once, C{finish_reason} C{tool_calls}.
        """
        t, chunks = translate(toolStream(argDeltas=True))
        deltas = toolDeltas(chunks)
        self.assertEqual(deltas[0], {"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}})
        byIndex = {}
        for d in deltas:
            byIndex.setdefault(d["index"], []).append(d["function"].get("arguments", ""))
        self.assertEqual("".join(byIndex[0]), '{"city":"Paris"}')
        self.assertEqual("".join(byIndex[1]), '{"tz":"CET"}')
        self.assertEqual([d.get("id") for d in deltas if "id" in d], ["call_a", "call_b"])
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "tool_calls")
        self.assertEqual(t.finishReason, "tool_calls")

    def test_arguments_only_in_done(self):
        """
        Arguments sent only in C{function_call_arguments.done} reach the
        client exactly once per call.
        """
        _, chunks = translate(toolStream(argDeltas=False))
        args = [d["function"]["arguments"] for d in toolDeltas(chunks)
                if d["function"].get("arguments")]
        self.assertEqual(args, ['{"city":"Paris"}', '{"tz":"CET"}'])

    def test_arguments_only_in_item_done(self):
        """
        Arguments that come only in the finished item (no argument events)
        are sent once too.
        """
        events = [e for e in toolStream(argDeltas=False)
                  if e["type"] != "response.function_call_arguments.done"]
        _, chunks = translate(events)
        args = [d["function"]["arguments"] for d in toolDeltas(chunks)
                if d["function"].get("arguments")]
        self.assertEqual(args, ['{"city":"Paris"}', '{"tz":"CET"}'])

    def test_incomplete_endings(self):
        """
        C{response.incomplete} for C{max_output_tokens} finishes with
        C{length}, for C{content_filter} with C{content_filter}.
        """
        for reason, finish in [("max_output_tokens", "length"),
                               ("content_filter", "content_filter")]:
            _, chunks = translate(textStream(terminal="response.incomplete",
                                             details={"reason": reason}))
            self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], finish)

    def test_usage_chunk(self):
        """
        With C{include_usage}: every chunk has C{usage: null} except a last
        one with C{choices: []} and the mapped usage.
        """
        t, chunks = translate(toolStream(), includeUsage=True)
        self.assertTrue(all(c["usage"] is None for c in chunks[:-1]))
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"], {
            "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 2},
            "completion_tokens_details": {"reasoning_tokens": 1}})

    def test_failure(self):
        """
        A C{response.failed} or an C{error} event produces no chunk and
        leaves the error.
        """
        t, chunks = translate([CREATED, ev("response.failed", response={
            "error": {"code": "context_length_exceeded", "message": "too long"}})])
        self.assertEqual(chunks, [])
        self.assertEqual(t.error["code"], "context_length_exceeded")
        t, chunks = translate([CREATED, ev("error", code="server_error", message="boom")])
        self.assertEqual(t.error, {"code": "server_error", "message": "boom"})


class AssemblyTests(SynchronousTestCase):
    """
    L{ResponseAssembler} and L{chatCompletion}.
    """

    def test_output_from_item_done_events(self):
        """
        An empty terminal C{output} is rebuilt in C{output_index} order; a
        full one is kept.
        """
        a = ResponseAssembler()
        a.add(ev("response.output_item.done", output_index=1, item={"id": "b"}))
        a.add(ev("response.output_item.done", output_index=0, item={"id": "a"}))
        a.add(ev("response.output_text.delta", delta="x"))
        self.assertEqual(a.complete({"output": []})["output"], [{"id": "a"}, {"id": "b"}])
        self.assertEqual(a.complete({"output": [{"id": "z"}]})["output"], [{"id": "z"}])
        self.assertEqual(ResponseAssembler().complete({"output": []}), {"output": []})

    def test_completion_folds_chunks(self):
        """
        The non-stream completion of a tool turn: content null, the calls
        with full arguments, C{tool_calls}, the usage.
        """
        t, chunks = translate(toolStream(), includeUsage=True)
        completion = chatCompletion(chunks, t.usage)
        self.assertEqual(completion["object"], "chat.completion")
        self.assertEqual(completion["id"], "chatcmpl-abc")
        choice = completion["choices"][0]
        self.assertEqual(choice["finish_reason"], "tool_calls")
        self.assertIsNone(choice["message"]["content"])
        self.assertEqual(choice["message"]["tool_calls"], [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz":"CET"}'}},
        ])
        self.assertEqual(completion["usage"]["total_tokens"], 14)
        text = chatCompletion(translate(textStream())[1])
        self.assertEqual(text["choices"][0]["message"]["content"], "Hello there")
        self.assertEqual(text["choices"][0]["finish_reason"], "stop")


class FakeRequest:
    """
    Just enough of a twisted.web request for the entry sinks.
    """

    def __init__(self):
        self.code = None
        self.headers = {}
        self.written = []
        self.finished = False

    def notifyFinish(self):
        from twisted.internet.defer import Deferred

        return Deferred()

    def setResponseCode(self, code):
        self.code = code

    def setHeader(self, name, value):
        self.headers[name] = value

    def getHeader(self, name):
        return None

    def write(self, data):
        self.written.append(data)

    def finish(self):
        self.finished = True

    def registerProducer(self, producer, streaming):
        pass

    def unregisterProducer(self):
        pass

    @property
    def body(self):
        return b"".join(self.written)


def feed(sink, events):
    for e in events:
        sink.writeEvent(Event(e["type"].encode(), json.dumps(e).encode()))


class SinkTests(SynchronousTestCase):
    """
    L{ChatCompletionsSink} around the real SSE and JSON sinks, and the
    JSON sink's output assembly for C{/v1/responses}.
    """

    def test_interface(self):
        """
        L{ChatCompletionsSink} provides L{ITurnSink}.
        """
        from relay.entry.sinks import SSESink

        sink = ChatCompletionsSink(SSESink(FakeRequest(), "chat", "m"), chatTurn({}), 0)
        self.assertTrue(verifyObject(ITurnSink, sink))

    def test_stream(self):
        """
        A streaming client gets data-only chunks, then C{data: [DONE]};
        nothing before the engine's first chunk.
        """
        from relay.entry.sinks import SSESink

        request = FakeRequest()
        sink = ChatCompletionsSink(SSESink(request, "chat", "gpt-5.5"),
                                   chatTurn({"stream": True}), 0)
        feed(sink, [CREATED])
        sink.commit({})
        self.assertEqual(request.body, b"")
        feed(sink, toolStream()[1:])
        sink.finish()
        lines = [line for line in request.body.split(b"\n\n") if line]
        self.assertTrue(all(line.startswith(b"data: ") for line in lines))
        self.assertEqual(lines[-1], b"data: [DONE]")
        self.assertEqual(request.code, 200)
        self.assertTrue(request.finished)

    def test_json(self):
        """
        A non-streaming client gets one C{chat.completion} with the usage.
        """
        request = FakeRequest()
        sink = ChatCompletionsSink(JSONSink(request, "chat", "gpt-5.5"),
                                   chatTurn({"stream": False}), 0)
        self.assertTrue(sink.holdsOutput)
        sink.commit({})
        feed(sink, textStream())
        sink.finish()
        body = json.loads(request.body)
        self.assertEqual(body["choices"][0]["message"]["content"], "Hello there")
        self.assertEqual(body["usage"]["prompt_tokens"], 3)
        self.assertEqual(request.code, 200)

    def test_failed_before_any_chunk_is_an_http_error(self):
        """
        R10: a C{response.failed} before any chunk is an HTTP status with
        the chat error envelope (400 for a context window error).
        """
        from relay.entry.sinks import SSESink

        request = FakeRequest()
        sink = ChatCompletionsSink(SSESink(request, "chat", "m"), chatTurn({"stream": True}), 0)
        sink.commit({})
        feed(sink, [CREATED, ev("response.failed", response={
            "error": {"code": "context_length_exceeded", "message": "too long"}})])
        sink.fail(chatError({"code": "x"}))
        self.assertEqual(request.code, 400)
        self.assertEqual(json.loads(request.body)["error"]["code"], "context_length_exceeded")

    def test_failed_after_chunks_is_an_error_event(self):
        """
        After chunks, a failure is one in-stream C{event: error}.
        """
        from relay.entry.sinks import SSESink

        request = FakeRequest()
        sink = ChatCompletionsSink(SSESink(request, "chat", "m"), chatTurn({"stream": True}), 0)
        sink.commit({})
        feed(sink, textStream()[:3])
        feed(sink, [ev("response.failed", response={"error": {"message": "gone"}})])
        sink.fail(chatError({"code": "x"}))
        self.assertEqual(request.code, 200)
        self.assertEqual(request.body.count(b"event: error\n"), 1)
        self.assertIn(b'"gone"', request.body)

    def test_chat_error_statuses(self):
        """
        R10's types: 429 rate_limit_error, 500 api_error, 400
        invalid_request_error.
        """
        self.assertEqual(chatError({"code": "rate_limit_exceeded"}).status, 429)
        self.assertEqual(chatError({"code": "server_error"}).type, "api_error")
        self.assertEqual(chatError({}).status, 500)
        self.assertEqual(chatError({"code": "cyber_policy"}).type, "invalid_request_error")

    def test_responses_json_output_is_assembled(self):
        """
        Issue 13: a C{/v1/responses} JSON client gets C{output} rebuilt from
        the C{output_item.done} events when the terminal one is empty.
        """
        request = FakeRequest()
        sink = JSONSink(request, "responses", "gpt-5.5")
        sink.commit({})
        feed(sink, toolStream(emptyOutput=True))
        body = json.loads(request.body)
        self.assertEqual([i["call_id"] for i in body["output"]], ["call_a", "call_b"])
        self.assertEqual(body["status"], "completed")
