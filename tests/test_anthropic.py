"""
The Anthropic Messages translation both ways (behaviour.md R115,
protocol.md 10): L{relay.translate.anthropic}.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.base.records import ClientError
from relay.configuration.parse import settingsFromString
from relay.base.records import ConfigError
from relay.interfaces import ITurnSink
from relay.translate.anthropic import (
    AnthropicModels,
    MessagesContext,
    MessagesRequestError,
    MessagesSink,
    MessagesTranslator,
    anthropicBody,
    anthropicStatus,
    checkMessagesRequest,
    contextOf,
    familyOf,
    foldMessage,
    messagesToResponses,
)
from relay.translate.anthropic.request import effortOf


def request(**extra):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    return body


class RequestTests(SynchronousTestCase):
    """
    L{messagesToResponses}: the request side.
    """

    def test_systemAndText(self):
        """
        C{system} blocks join into C{instructions}; string content is one
        C{input_text}; C{max_tokens} is C{max_output_tokens};
        C{temperature}/C{top_p} pass, C{top_k} does not.
        """
        out = messagesToResponses(request(
            system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            temperature=0.5, top_p=0.9, top_k=5), "gpt-5.5")
        self.assertEqual(out["model"], "gpt-5.5")
        self.assertEqual(out["instructions"], "a\n\nb")
        self.assertEqual(out["input"], [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "hi"}]}])
        self.assertEqual(out["max_output_tokens"], 100)
        self.assertEqual((out["temperature"], out["top_p"]), (0.5, 0.9))
        self.assertNotIn("top_k", out)
        self.assertIs(out["stream"], False)
        self.assertEqual(messagesToResponses(request(system="s"), "m")["instructions"], "s")

    def test_smallMaxTokens(self):
        """
        A C{max_tokens} below the Responses minimum is raised to it.
        """
        self.assertEqual(messagesToResponses(request(max_tokens=1), "m")["max_output_tokens"], 16)

    def test_toolUseAndResultKeepTheId(self):
        """
        R115: C{tool_use} -> C{function_call} with C{call_id} the tool_use
        id unchanged; C{tool_result} -> C{function_call_output} with the
        same id; C{is_error} marks the text; an assistant's text is
        C{output_text}; order is kept.
        """
        out = messagesToResponses(request(messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_01A", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "done",
                 "is_error": True},
                {"type": "text", "text": "next"}]}]), "m")
        items = out["input"]
        self.assertEqual(items[1], {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "calling", "annotations": []}]})
        self.assertEqual(items[2], {"type": "function_call", "call_id": "toolu_01A",
                                    "name": "f", "arguments": '{"x": 1}'})
        self.assertEqual(items[3], {"type": "function_call_output", "call_id": "toolu_01A",
                                    "output": "Error: done"})
        self.assertEqual(items[4]["content"], [{"type": "input_text", "text": "next"}])

    def test_images(self):
        """
        Base64 and URL images become C{input_image}; a tool result with an
        image keeps it as an input part.
        """
        out = messagesToResponses(request(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": "QUJD"}},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "shot"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "Rg=="}}]}]}]), "m")
        first, result = out["input"]
        self.assertEqual(first["content"][0]["image_url"], "data:image/jpeg;base64,QUJD")
        self.assertEqual(first["content"][1]["image_url"], "https://x/y.png")
        self.assertEqual(result["output"][1]["image_url"], "data:image/png;base64,Rg==")

    def test_toolsAndChoice(self):
        """
        C{input_schema} -> C{parameters} (not strict); C{any} ->
        C{required}, C{tool} -> the named function, C{none};
        C{disable_parallel_tool_use} -> C{parallel_tool_calls: false}.
        """
        tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
        out = messagesToResponses(request(tools=tools), "m")
        self.assertEqual(out["tools"], [{"type": "function", "name": "f", "description": "d",
                                         "parameters": {"type": "object"}, "strict": False}])
        self.assertIs(out["parallel_tool_calls"], True)
        for choice, expected in [({"type": "any"}, "required"), ({"type": "auto"}, "auto"),
                                 ({"type": "none"}, "none"),
                                 ({"type": "tool", "name": "f"},
                                  {"type": "function", "name": "f"})]:
            self.assertEqual(
                messagesToResponses(request(tools=tools, tool_choice=choice), "m")["tool_choice"],
                expected)
        out = messagesToResponses(request(tools=tools, tool_choice={
            "type": "auto", "disable_parallel_tool_use": True}), "m")
        self.assertIs(out["parallel_tool_calls"], False)

    def test_thinking(self):
        """
        C{thinking.budget_tokens} -> an effort band, summaries and the
        encrypted reasoning asked for; relay's own thinking blocks go back
        as reasoning items, another provider's are left out.
        """
        self.assertEqual([effortOf(n) for n in (1024, 8000, 32000)], ["low", "medium", "high"])
        out = messagesToResponses(request(
            thinking={"type": "enabled", "budget_tokens": 10000},
            messages=[{"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "relay.ENC"},
                {"type": "thinking", "thinking": "theirs", "signature": "EqQBCk"},
                {"type": "redacted_thinking", "data": "relay.ENC2"}]}]), "m")
        self.assertEqual(out["reasoning"], {"effort": "medium", "summary": "auto"})
        adaptive = messagesToResponses(request(thinking={"type": "adaptive"},
                                               output_config={"effort": "low"}), "m")
        self.assertEqual(adaptive["reasoning"]["effort"], "low")
        self.assertNotIn("reasoning", messagesToResponses(
            request(thinking={"type": "disabled"}), "m"))
        self.assertEqual(out["include"], ["reasoning.encrypted_content"])
        self.assertEqual(out["input"], [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}],
             "encrypted_content": "ENC"},
            {"type": "reasoning", "summary": [], "encrypted_content": "ENC2"}])

    def test_cacheKeyAndUser(self):
        """
        C{cache_control} or C{metadata.user_id} give a C{prompt_cache_key}
        (relay scopes it per key later, R112); the user id goes up in
        C{metadata}; neither: no key.
        """
        self.assertNotIn("prompt_cache_key", messagesToResponses(request(), "m"))
        cached = request(system=[{"type": "text", "text": "s",
                                  "cache_control": {"type": "ephemeral"}}])
        key = messagesToResponses(cached, "m")["prompt_cache_key"]
        self.assertEqual(key, messagesToResponses(cached, "m")["prompt_cache_key"])
        out = messagesToResponses(request(metadata={"user_id": "u1"}), "m")
        self.assertEqual(out["metadata"], {"user_id": "u1"})
        self.assertNotEqual(out["prompt_cache_key"], key)

    def test_badInput(self):
        """
        Bad input is a L{MessagesRequestError} naming the field.
        """
        cases = [
            ({"model": "m", "messages": []}, "max_tokens"),
            (request(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
            (request(messages=[{"role": "user", "content": 3}]), "messages.0.content"),
            (request(tools=[{"name": "b", "type": "bash_20250124"}]), "tools.0.type"),
            (request(tool_choice={"type": "tool"}), "tool_choice.name"),
            (request(stop_sequences=[""]), "stop_sequences"),
            (request(system=[{"type": "text", "text": 5}]), "system.0"),  # a 500 before
            (request(system=["x"]), "system.0"),
            (request(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
             "messages.0.content.0.text"),
            ({"max_tokens": 1, "messages": []}, "model"),
        ]
        for body, param in cases:
            e = self.assertRaises(MessagesRequestError, checkMessagesRequest, body)
            self.assertEqual(e.param, param)
        checkMessagesRequest({"model": "m", "messages": []}, counting=True)


class HostileRequestTests(SynchronousTestCase):
    """
    A hostile key's Messages bodies: refused with a 400 or translated,
    never an exception that is not the client's error, never work that
    grows without bound on the process's one thread.
    """

    def test_deepNestingIsTranslated(self):
        """
        A block nested deeper than half the interpreter's recursion limit
        (the JSON reader accepts such a body) is translated: the
        C{cache_control} search walks it with a stack (a RecursionError,
        answered 500, before).
        """
        deep: list = []
        for _ in range(800):
            deep = [deep]
        body = request(messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "x": deep}]}], tools=[
            {"name": "f", "input_schema": {"type": "object", "x": deep}}])
        checkMessagesRequest(body)
        out = messagesToResponses(body, "m")
        self.assertNotIn("prompt_cache_key", out)
        deep.append({"cache_control": {"type": "ephemeral"}})
        self.assertIn("prompt_cache_key", messagesToResponses(body, "m"))

    def test_stopSequencesBounded(self):
        """
        Every stop sequence is looked for in every text delta of the
        answer: more than L{MAX_STOP_SEQUENCES} of them, or one longer than
        L{MAX_STOP_SEQUENCE_CHARS}, is a 400 naming C{stop_sequences}
        (200,000 of them made each delta cost 0.2 s of the one thread,
        stalling every other key's turns).
        """
        from relay.translate.anthropic.request import (
            MAX_STOP_SEQUENCE_CHARS, MAX_STOP_SEQUENCES)

        checkMessagesRequest(request(stop_sequences=["x%d" % i
                                                     for i in range(MAX_STOP_SEQUENCES)]))
        checkMessagesRequest(request(stop_sequences=["y" * MAX_STOP_SEQUENCE_CHARS]))
        for stops in (["x%d" % i for i in range(MAX_STOP_SEQUENCES + 1)],
                      ["y" * (MAX_STOP_SEQUENCE_CHARS + 1)]):
            e = self.assertRaises(MessagesRequestError, checkMessagesRequest,
                                  request(stop_sequences=stops))
            self.assertEqual(e.param, "stop_sequences")

    def test_heldBackIsCheap(self):
        """
        The worst answer for the longest allowed stop sequences (every
        character of the text could begin one, none does) is translated
        in bounded time per delta.
        """
        import time

        from relay.translate.anthropic.request import (
            MAX_STOP_SEQUENCE_CHARS, MAX_STOP_SEQUENCES)

        stops = tuple("a" * (MAX_STOP_SEQUENCE_CHARS - 1 - i) + "b"
                      for i in range(MAX_STOP_SEQUENCES))
        _, out = translate(responsesEvents(text="a" * 300 + "c" * 300),
                           stopSequences=stops)
        text = "".join(e[1]["delta"]["text"] for e in out
                       if e[0] == "content_block_delta")
        self.assertEqual(text, "a" * 300 + "c" * 300)
        t = MessagesTranslator(MessagesContext(model="claude-x", stopSequences=stops))
        t.feed({"type": "response.created", "response": {"id": "r"}})
        t.feed({"type": "response.output_item.added", "output_index": 0,
                "item": {"type": "message", "id": "m1"}})
        started = time.perf_counter()
        for _ in range(1000):  # ~0.25 ms a delta here; 175 ms with 100,000 stops
            t.feed({"type": "response.output_text.delta", "output_index": 0,
                    "item_id": "m1", "delta": "aaaaac" + "a" * 200})
        self.assertLess(time.perf_counter() - started, 5.0)


def responsesEvents(text="Hello world", calls=(), usage=None, kind="response.completed",
                    reasoning=None, incomplete=None):
    """
    A Responses event stream as the ChatGPT backend sends it.
    """
    events = [{"type": "response.created", "response": {"id": "resp_abc"}}]
    index = 0
    if reasoning is not None:
        events.append({"type": "response.output_item.added", "output_index": 0,
                       "item": {"type": "reasoning", "id": "rs_1"}})
        events.append({"type": "response.reasoning_summary_text.delta", "output_index": 0,
                       "item_id": "rs_1", "delta": reasoning[0]})
        events.append({"type": "response.output_item.done", "output_index": 0, "item": {
            "type": "reasoning", "id": "rs_1", "encrypted_content": reasoning[1],
            "summary": [{"type": "summary_text", "text": reasoning[0]}]}})
        index = 1
    if text:
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": {"type": "message", "id": "m1"}})
        for piece in (text[:4], text[4:]):
            events.append({"type": "response.output_text.delta", "output_index": index,
                           "item_id": "m1", "delta": piece})
        events.append({"type": "response.output_item.done", "output_index": index, "item": {
            "type": "message", "id": "m1",
            "content": [{"type": "output_text", "text": text}]}})
        index += 1
    for name, args in calls:
        item = {"type": "function_call", "id": f"fc_{index}", "call_id": f"call_{index}",
                "name": name}
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": dict(item, arguments="")})
        events.append({"type": "response.function_call_arguments.delta", "output_index": index,
                       "item_id": item["id"], "delta": args[:3]})
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": dict(item, arguments=args)})
        index += 1
    response = {"id": "resp_abc", "output": [], "usage": usage or {
        "input_tokens": 50, "output_tokens": 7,
        "input_tokens_details": {"cached_tokens": 40}}}
    if incomplete:
        response["incomplete_details"] = {"reason": incomplete}
    events.append({"type": kind, "response": response})
    return events


def translate(events, **context):
    t = MessagesTranslator(MessagesContext(model="claude-x", **context))
    out = []
    for event in events:
        out.extend(t.feed(event))
    return t, out


class StreamTests(SynchronousTestCase):
    """
    L{MessagesTranslator} and L{foldMessage}: the answer side.
    """

    def test_textStream(self):
        """
        message_start (the client's model, zero usage), ping, one text
        block, message_delta with C{end_turn} and the usage (cached tokens
        as C{cache_read_input_tokens}, the rest as C{input_tokens}),
        message_stop.
        """
        t, out = translate(responsesEvents())
        names = [n for n, _ in out]
        self.assertEqual(names, ["message_start", "ping", "content_block_start",
                                 "content_block_delta", "content_block_delta",
                                 "content_block_stop", "message_delta", "message_stop"])
        start = out[0][1]["message"]
        self.assertEqual((start["model"], start["id"]), ("claude-x", "msg_abc"))
        delta = out[-2][1]
        self.assertEqual(delta["delta"], {"stop_reason": "end_turn", "stop_sequence": None})
        self.assertEqual(delta["usage"], {"input_tokens": 10, "output_tokens": 7,
                                          "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 40})
        message = foldMessage(out)
        self.assertEqual(message["content"], [{"type": "text", "text": "Hello world"}])
        self.assertEqual(message["stop_reason"], "end_turn")

    def test_toolUse(self):
        """
        A function call is a C{tool_use} block whose id is the C{call_id}
        (R115), its arguments as C{input_json_delta}s sent once;
        C{stop_reason: tool_use}.
        """
        t, out = translate(responsesEvents(text="", calls=[("f", '{"a": 1}')]))
        starts = [d for n, d in out if n == "content_block_start"]
        self.assertEqual(starts[0]["content_block"],
                         {"type": "tool_use", "id": "call_0", "name": "f", "input": {}})
        fragments = [d["delta"]["partial_json"] for n, d in out
                     if n == "content_block_delta"]
        self.assertEqual("".join(fragments), '{"a": 1}')
        message = foldMessage(out)
        self.assertEqual(message["content"][0]["input"], {"a": 1})
        self.assertEqual(message["stop_reason"], "tool_use")

    def test_stopSequence(self):
        """
        A stop sequence split over deltas ends the text before it; the rest
        is not shown; C{stop_reason: stop_sequence}.
        """
        t, out = translate(responsesEvents(text="Hello world, more"),
                           stopSequences=("o wor",))
        message = foldMessage(out)
        self.assertEqual(message["content"], [{"type": "text", "text": "Hell"}])
        self.assertEqual((message["stop_reason"], message["stop_sequence"]),
                         ("stop_sequence", "o wor"))
        t, out = translate(responsesEvents(text="Hello world"), stopSequences=("xyz", "Hel!"))
        self.assertEqual(foldMessage(out)["content"][0]["text"], "Hello world")

    def test_maxTokensAndRefusal(self):
        """
        C{response.incomplete} for C{max_output_tokens} -> C{max_tokens};
        for C{content_filter} -> C{refusal}.
        """
        for reason, expected in [("max_output_tokens", "max_tokens"),
                                 ("content_filter", "refusal")]:
            t, out = translate(responsesEvents(kind="response.incomplete", incomplete=reason))
            self.assertEqual(foldMessage(out)["stop_reason"], expected)

    def test_thinking(self):
        """
        With thinking enabled, a reasoning item is a C{thinking} block:
        C{thinking_delta}s, then one C{signature_delta} carrying relay's
        prefix and the encrypted reasoning; without it, no block.
        """
        events = responsesEvents(reasoning=("let me see", "ENC"))
        t, out = translate(events, thinking=True)
        message = foldMessage(out)
        self.assertEqual(message["content"][0], {"type": "thinking", "thinking": "let me see",
                                                 "signature": "relay.ENC"})
        deltas = [d["delta"]["type"] for n, d in out if n == "content_block_delta"]
        self.assertEqual(deltas[:2], ["thinking_delta", "signature_delta"])
        t, out = translate(events)
        self.assertEqual([b["type"] for b in foldMessage(out)["content"]], ["text"])

    def test_redactedThinking(self):
        """
        A reasoning item with only encrypted content is a
        C{redacted_thinking} block.
        """
        events = responsesEvents(reasoning=("", "ENC"))
        events = [e for e in events if e["type"] != "response.reasoning_summary_text.delta"]
        for e in events:
            if e.get("item", {}).get("type") == "reasoning":
                e["item"]["summary"] = []
        t, out = translate(events, thinking=True)
        self.assertEqual(foldMessage(out)["content"][0],
                         {"type": "redacted_thinking", "data": "relay.ENC"})

    def test_itemsOnlyInTerminal(self):
        """
        Items that only the terminal response carries are still sent.
        """
        events = [{"type": "response.created", "response": {"id": "resp_1"}},
                  {"type": "response.completed", "response": {"id": "resp_1", "output": [
                      {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "call_9", "name": "g",
                       "arguments": "{}"}]}}]
        t, out = translate(events)
        message = foldMessage(out)
        self.assertEqual(message["content"][0], {"type": "text", "text": "hi"})
        self.assertEqual(message["content"][1]["id"], "call_9")

    def test_failure(self):
        """
        A failed turn produces no event; the error is held.
        """
        t, out = translate([{"type": "response.failed", "response": {
            "error": {"code": "server_error", "message": "boom"}}}])
        self.assertEqual(out, [])
        self.assertEqual(t.error["code"], "server_error")


class ErrorTests(SynchronousTestCase):
    """
    L{anthropicStatus} and L{anthropicBody}.
    """

    def test_statuses(self):
        """
        R115: 503 (relay's no capacity, R15) -> 529 C{overloaded_error}
        with C{retry-after}; 429 keeps its C{retry-after}; 502 is an
        C{api_error}; 401/403/404/413 by status.
        """
        status, kind, headers = anthropicStatus(ClientError(503, "server_error", "x"))
        self.assertEqual((status, kind), (529, "overloaded_error"))
        self.assertIn((b"retry-after", b"5"), headers)
        status, kind, headers = anthropicStatus(
            ClientError(429, "rate_limit_error", "x", headers=((b"Retry-After", b"30"),)))
        self.assertEqual((status, kind, headers), (429, "rate_limit_error",
                                                   [(b"Retry-After", b"30")]))
        for code, expected in [(502, "api_error"), (401, "authentication_error"),
                               (403, "permission_error"), (404, "not_found_error"),
                               (413, "request_too_large"), (400, "invalid_request_error")]:
            self.assertEqual(anthropicStatus(ClientError(code, "t", "m"))[1], expected)

    def test_body(self):
        body = json.loads(anthropicBody(ClientError(400, "invalid_request_error", "bad"), "r1"))
        self.assertEqual(body, {"type": "error", "request_id": "r1", "error": {
            "type": "invalid_request_error", "message": "bad"}})


class ModelTests(SynchronousTestCase):
    """
    C{anthropic_models}: families, layers, the file.
    """

    def test_family(self):
        self.assertEqual(familyOf("claude-sonnet-4-5-20250929"), "sonnet")
        self.assertEqual(familyOf("claude-3-5-haiku-latest"), "haiku")
        self.assertEqual(familyOf("Claude-Opus-4"), "opus")
        self.assertIsNone(familyOf("gpt-5.5"))

    def test_layers(self):
        """
        Defaults, under the file, under the admin API; other names pass.
        """
        models = AnthropicModels({"haiku": "gpt-4.1"})
        self.assertEqual(models.resolve("claude-haiku-4-5"), "gpt-4.1")
        self.assertEqual(models.resolve("claude-opus-4-1"), "gpt-5.5")
        self.assertEqual(models.resolve("gpt-5.4"), "gpt-5.4")
        self.assertEqual(models.resolve("claude-unknown-1"), "claude-unknown-1")
        models.setAdmin({"opus": "o3"})
        self.assertEqual(models.view()["opus"], {"model": "o3", "source": "admin"})
        self.assertEqual(models.view()["haiku"]["source"], "config")
        self.assertEqual(models.view()["sonnet"]["source"], "default")

    def test_config(self):
        """
        The file's C{anthropic_models} is checked: a family is one word, a
        model a non-empty string.
        """
        base = 'keys: [{name: k, key: sk-client-key-1}]\naccounts: []\n'
        config = settingsFromString(base + "anthropic_models: {Opus: gpt-5.5-pro}\n")
        self.assertEqual(config.anthropic_models, {"opus": "gpt-5.5-pro"})
        e = self.assertRaises(ConfigError, settingsFromString,
                              base + "anthropic_models: {opus: ''}\n")
        self.assertIn("anthropic_models.opus", str(e))
        self.assertRaises(ConfigError, settingsFromString,
                          base + "anthropic_models: [gpt]\n")


class _Inner:
    holdsOutput = False

    def __init__(self):
        self.written, self.failed, self.body, self.committed = [], None, None, False

    def keepalive(self):
        pass

    def commit(self, headers):
        self.committed = True

    def writeEvent(self, event):
        self.written.append(event)

    def writeBody(self, status, headers, body):
        self.body = (status, body)

    def fail(self, error):
        self.failed = error

    def finish(self):
        pass


class SinkTests(SynchronousTestCase):
    """
    L{MessagesSink}: the per-attempt adapter.
    """

    def turn(self, stream):
        from relay.base.records import ClientKey, Turn

        body = request(stream=stream, stop_sequences=["world"])
        return Turn(entrypoint="http", endpoint="messages", client=ClientKey(name="k", key="s"),
                    model="gpt-5.5", body=messagesToResponses(body, "gpt-5.5"), stream=stream,
                    messages=contextOf(body))

    def feed(self, sink, events):
        from relay.wire.sse import Event

        for e in events:
            sink.writeEvent(Event(e["type"].encode(), json.dumps(e).encode()))

    def test_interface(self):
        verifyObject(ITurnSink, MessagesSink(_Inner(), self.turn(True)))

    def test_stream(self):
        inner = _Inner()
        sink = MessagesSink(inner, self.turn(True))
        self.feed(sink, responsesEvents())
        self.assertTrue(inner.committed)
        self.assertTrue(inner.written[0].raw.startswith(b"event: message_start\ndata: "))
        self.assertEqual(inner.written[-1].type, b"message_stop")

    def test_json(self):
        inner = _Inner()
        sink = MessagesSink(inner, self.turn(False))
        self.feed(sink, responsesEvents())
        status, body = inner.body
        message = json.loads(body)
        self.assertEqual((status, message["model"]), (200, "claude-sonnet-4-5"))
        self.assertEqual(message["content"], [{"type": "text", "text": "Hello "}])
        self.assertEqual(message["stop_reason"], "stop_sequence")

    def test_failed(self):
        """
        A failed upstream turn goes to the client's sink as the chat route's
        error (R10), which writes it in Anthropic's shape.
        """
        inner = _Inner()
        sink = MessagesSink(inner, self.turn(True))
        self.feed(sink, [{"type": "response.failed", "response": {
            "error": {"code": "rate_limit_exceeded", "message": "slow down"}}}])
        self.assertEqual((inner.failed.status, inner.failed.type), (429, "rate_limit_error"))


class EntryTests(SynchronousTestCase):
    """
    L{relay.entry.messages}: the Messages surface's routes onto the
    engine (R115), with a recording runner, through L{treq.testing.StubTreq}.
    """

    def setUp(self):
        from treq.testing import StubTreq

        from relay.entry.http import KeyRing
        from relay.entry.root import buildRoot
        from relay.base.records import ClientKey
        from tests.test_responsesapi import FakeScheduler, RecordingRunner

        self.runner = RecordingRunner(FakeScheduler({}, []))
        self.models = AnthropicModels({"haiku": "gpt-4.1"})
        root = buildRoot(self.runner, KeyRing([ClientKey(name="k", key="sk-k", concurrency=0)]),
                         [], anthropicModels=self.models)
        self.treq = StubTreq(root)

    def call(self, method, path, body=None, headers=None):
        hdrs = {"Content-Type": "application/json", "x-api-key": "sk-k"}
        hdrs.update(headers or {})
        d = self.treq.request(method, "http://relay" + path, headers=hdrs,
                              data=json.dumps(body).encode() if body is not None else None)
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.treq.flush()
        return response, json.loads(self.successResultOf(content))

    def test_turn(self):
        """
        A Messages request is one turn: endpoint C{messages}, the mapped
        model (R115, mapped first), the Responses translation as its body,
        the client's model in its context; the key came from C{x-api-key}.
        """
        response, _ = self.call("POST", "/v1/messages", request(model="claude-haiku-4-5"),
                                headers={"anthropic-version": "2023-06-01"})
        [turn] = self.runner.turns
        self.assertEqual((turn.endpoint, turn.model, turn.body["model"]),
                         ("messages", "gpt-4.1", "gpt-4.1"))
        self.assertEqual(turn.messages.model, "claude-haiku-4-5")
        self.assertEqual(turn.client.name, "k")
        self.assertEqual(turn.body["input"][0]["content"][0]["text"], "hi")

    def test_countTokensIsNoTurn(self):
        """
        C{count_tokens} answers relay's estimate and runs no turn.
        """
        response, body = self.call("POST", "/v1/messages/count_tokens",
                                   {"model": "claude-sonnet-4", "messages": [
                                       {"role": "user", "content": "hello " * 40}]})
        self.assertEqual(response.code, 200)
        self.assertGreater(body["input_tokens"], 40)
        self.assertEqual(self.runner.turns, [])

    def test_errorsInAnthropicShape(self):
        """
        Bad input, a bad key, an unknown sub-path and a GET are answered in
        Anthropic's shape and reach no engine.
        """
        cases = [
            ("POST", "/v1/messages", {"model": "m", "messages": []}, {}, 400,
             "invalid_request_error"),
            ("POST", "/v1/messages", request(), {"x-api-key": "sk-bad"}, 401,
             "authentication_error"),
            ("POST", "/v1/messages/nope", request(), {}, 404, "not_found_error"),
            ("GET", "/v1/messages", None, {}, 405, "invalid_request_error"),
        ]
        for method, path, body, headers, status, kind in cases:
            response, answer = self.call(method, path, body, headers)
            self.assertEqual((response.code, answer["type"], answer["error"]["type"]),
                             (status, "error", kind), path)
        self.assertEqual(self.runner.turns, [])

    def test_modelsInAnthropicShape(self):
        """
        C{GET /v1/models} with C{anthropic-version}: Anthropic's list of the
        families.
        """
        response, body = self.call("GET", "/v1/models",
                                   headers={"anthropic-version": "2023-06-01"})
        self.assertEqual([m["id"] for m in body["data"]],
                         ["claude-haiku", "claude-opus", "claude-sonnet"])
        self.assertEqual(body["first_id"], "claude-haiku")


class FuzzTests(SynchronousTestCase):
    """
    Whatever a client or an upstream sends, the translation answers a 400
    (L{MessagesRequestError}) or translates; it never raises anything else
    (which would be a 500 or a broken stream).
    """

    def test_anyRequest(self):
        from hypothesis import HealthCheck, given, settings, strategies as st

        block = st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image", "document", "tool_use", "tool_result",
                                      "thinking", "redacted_thinking", "x"])},
            optional={k: _JSON for k in ("text", "source", "id", "input", "content",
                                         "tool_use_id", "is_error", "signature", "data")})
        message = st.fixed_dictionaries({
            "role": st.sampled_from(["user", "assistant"]),
            "content": st.one_of(st.text(max_size=5), st.lists(block, max_size=4), _JSON)})
        body = st.fixed_dictionaries(
            {"model": st.just("claude-x"), "max_tokens": st.just(10),
             "messages": st.lists(message, max_size=4)},
            optional={k: _JSON for k in ("system", "tools", "tool_choice", "stop_sequences",
                                         "thinking", "metadata", "output_config", "stream")})

        @settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
        @given(body)
        def check(b):
            try:
                checkMessagesRequest(b)
            except MessagesRequestError:
                return
            messagesToResponses(b, "m")
            contextOf(b)

        check()

    def test_anyEvents(self):
        from hypothesis import HealthCheck, given, settings, strategies as st

        event = st.fixed_dictionaries(
            {"type": st.sampled_from([
                "response.created", "response.output_text.delta", "response.output_item.added",
                "response.output_item.done", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_text.done",
                "response.reasoning_summary_text.delta", "response.refusal.delta",
                "response.completed", "response.incomplete", "response.failed", "error"])},
            optional={k: _JSON for k in ("delta", "item", "output_index", "item_id",
                                         "response", "text", "arguments")})

        @settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
        @given(st.lists(event, max_size=8), st.booleans())
        def check(events, thinking):
            t = MessagesTranslator(MessagesContext(model="c", stopSequences=("ab",),
                                                   thinking=thinking))
            out = []
            for e in events:
                out.extend(t.feed(e))
            foldMessage(out)

        check()


def _json():
    from hypothesis import strategies as st

    keys = st.sampled_from(["type", "text", "source", "id", "input", "content", "name", "data",
                            "role", "media_type", "url", "output", "summary", "usage",
                            "arguments", "call_id"])
    return st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
        max_leaves=20)


_JSON = _json()
