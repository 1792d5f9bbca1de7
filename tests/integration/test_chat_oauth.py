"""
Issue 13 item 1 end to end: the official C{openai} SDK (3.57) speaks Chat
Completions to a real relay whose accounts are OAuth (ChatGPT) accounts in
the emulator, which answer on C{/backend-api/codex/responses} with the
backend's awkward shapes (C{response.completed} with C{output: []},
arguments only in C{function_call_arguments.done}, parallel calls,
C{response.incomplete}); plus failover of chat turns (R84) and the
C{output} assembly for C{/v1/responses} JSON clients and WebSocket
transcripts on OAuth accounts.

The SDK is synchronous; every call runs in a thread (L{deferToThread}).
"""

from __future__ import annotations

import json

import openai
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from tests.integration.harness import RELAY_KEY, sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain, frames, gateway, http, userTurn

MODEL = "gpt-5.5"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
PARALLEL = {
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {"tz": "CET"}},
    ],
    "argument_deltas": 0,
    "text": "Done: {output}",
}


def client(stack) -> openai.OpenAI:
    """
    A sync SDK client for the relay, without SDK retries.
    """
    return openai.OpenAI(
        base_url=stack.url + "/v1", api_key=RELAY_KEY, max_retries=0, timeout=10.0
    )


def oauth(id="o1", credential="oauth-o1", **extra):
    return {"id": id, "type": "oauth", "credential": credential, **extra}


async def start(accounts, **kw):
    """
    A stack whose emulator knows every account by its credential, so the
    OAuth route behaves as the ChatGPT backend for them (protocol.md 7.2).
    """
    known = [{"name": a["credential"], "credential": a["credential"]} for a in accounts]
    return await startStack(accounts, emulatorConfig={"accounts": known}, **kw)


async def sdk(stack, fn):
    """
    Run C{fn(client)} in a thread.
    """

    def call():
        with client(stack) as c:
            return fn(c)

    return await deferToThread(call)


@pytest_twisted.ensureDeferred
async def test_chat_stream_text_with_usage():
    """
    A streaming chat answer from an OAuth account: the role chunk first,
    the text, C{finish_reason} C{stop}, a usage chunk (include_usage); the
    upstream got a translated, streaming C{/responses} request without the
    fields the backend refuses (here C{max_tokens} and C{temperature}).
    """
    stack = await start([oauth()])
    try:
        chunks = await sdk(stack, lambda c: list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}],
            stream=True, stream_options={"include_usage": True}, max_tokens=50,
            temperature=0.3)))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "Hello from the relay emulator (account oauth-o1)"
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes[-1] == "stop" and finishes.count("stop") == 1
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
        assert len({ch.id for ch in chunks}) == 1
        [request] = stack.emulator.requestsFor("oauth-o1")
        assert request.path == "/backend-api/codex/responses"
        body = request.body
        assert body["stream"] is True and body["store"] is False
        assert body["input"][0]["role"] == "developer"
        assert "max_output_tokens" not in body and "temperature" not in body
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_parallel_tool_calls_stream_and_json():
    """
    Parallel tool calls whose arguments come only in
    C{function_call_arguments.done}, over an upstream whose
    C{response.completed} has C{output: []}: streaming, every call's id,
    name and arguments arrive exactly once with stable indexes; not
    streaming, the completion lists both calls; the follow-up turn with the
    tool results answers text.
    """
    stack = await start([oauth()])
    stack.emulator.setScript("oauth-o1", PARALLEL)
    try:
        messages = [{"role": "user", "content": "weather and time?"}]
        chunks = await sdk(stack, lambda c: list(c.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stream=True)))
        calls = {}
        for ch in chunks:
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
                if tc.id:
                    assert entry["id"] is None
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                entry["args"] += (tc.function.arguments or "") if tc.function else ""
        assert sorted(calls) == [0, 1]
        assert calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["args"]) == {"city": "Paris"}
        assert calls[1]["name"] == "get_time" and json.loads(calls[1]["args"]) == {"tz": "CET"}
        assert all(c["id"].startswith("call_") for c in calls.values())
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

        completion = await sdk(stack, lambda c: c.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS))
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [t.function.name for t in choice.message.tool_calls] == ["get_weather", "get_time"]
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        assert completion.usage.prompt_tokens > 0

        follow = messages + [choice.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": t.id, "content": f"result {i}"}
            for i, t in enumerate(choice.message.tool_calls)
        ]
        answer = await sdk(stack, lambda c: c.chat.completions.create(
            model=MODEL, messages=follow, tools=TOOLS))
        assert answer.choices[0].message.content == "Done: result 1"
        sent = stack.emulator.requestsFor("oauth-o1")[-1].body["input"]
        assert [i["type"] for i in sent] == [
            "message", "function_call", "function_call", "function_call_output",
            "function_call_output"]
        assert sent[1]["call_id"] == sent[3]["call_id"] == choice.message.tool_calls[0].id
    finally:
        await stack.stop()


@pytest.mark.parametrize("ending,finish", [("max_output_tokens", "length"),
                                           ("content_filter", "content_filter")])
@pytest_twisted.ensureDeferred
async def test_chat_incomplete_endings(ending, finish):
    """
    C{response.incomplete} (max_output_tokens / content_filter) ends a chat
    answer with C{finish_reason} C{length} / C{content_filter}, streaming
    and not.
    """
    stack = await start([oauth()])
    stack.emulator.setScript("oauth-o1", {"text": "a rather long answer", "ending": ending})
    try:
        messages = [{"role": "user", "content": "hi"}]
        completion = await sdk(stack, lambda c: c.chat.completions.create(
            model=MODEL, messages=messages))
        assert completion.choices[0].finish_reason == finish
        assert completion.choices[0].message.content == "a rather l"
        chunks = await sdk(stack, lambda c: list(c.chat.completions.create(
            model=MODEL, messages=messages, stream=True)))
        assert [ch.choices[0].finish_reason for ch in chunks][-1] == finish
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_on_oauth_matches_chat_on_apikey():
    """
    The same script answers the same chat completion through an OAuth
    account (translated) and an API-key account (forwarded): content, tool
    calls and finish reasons agree.
    """
    results = {}
    for kind in ("apikey", "oauth"):
        stack = await start([{"id": "x", "type": kind, "credential": "cred-x"}])
        stack.emulator.setScript("cred-x", PARALLEL)
        try:
            first = await sdk(stack, lambda c: c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "q"}], tools=TOOLS))
            message = first.choices[0].message
            results[kind] = (
                first.choices[0].finish_reason,
                [(t.function.name, t.function.arguments) for t in message.tool_calls],
                message.content,
            )
        finally:
            await stack.stop()
    assert results["oauth"] == results["apikey"]


@pytest.mark.parametrize("fault", [
    {"kind": "status", "code": 503, "times": 1},
    {"kind": "cut_after_events", "events": 1, "times": 1},
    {"kind": "stream_error", "code": "server_error",
     "message": "The server had an error processing your request.", "times": 1},
], ids=["5xx", "cut_before_output", "in_band_server_error"])
@pytest_twisted.ensureDeferred
async def test_chat_fails_over_to_the_good_oauth_account(fault):
    """
    R84: a bad OAuth account first (a 503, a stream cut before output, an
    in-band C{response.failed} C{server_error}) -> the chat turn is served by the good one and the
    SDK reads one clean stream: one role chunk, the good account's text,
    no error.
    """
    stack = await start([oauth("bad", "oauth-bad", priority=1),
                              oauth("good", "oauth-good", priority=50)])
    stack.emulator.setFault("oauth-bad", fault)
    try:
        chunks = await sdk(stack, lambda c: list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)))
        roles = [ch for ch in chunks if ch.choices and ch.choices[0].delta.role]
        assert len(roles) == 1
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "Hello from the relay emulator (account oauth-good)"
        assert len(stack.emulator.requestsFor("oauth-bad")) >= 1
        assert len(stack.emulator.requestsFor("oauth-good")) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_raw_stream_is_data_only_with_done():
    """
    protocol.md 3: the chat stream is C{data:} lines only, ending with
    C{data: [DONE]}.
    """
    stack = await start([oauth()])
    try:
        response, data = await stack.postJSON("/v1/chat/completions", {
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert response.code == 200
        assert b"event:" not in data
        assert data.endswith(b"data: [DONE]\n\n")
        assert sseEvents(data)[-1] == ("[DONE]", "[DONE]")
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_context_window_error_is_a_400():
    """
    R10/R23: an upstream context window failure is the request's own: no
    failover, and the SDK raises a 400 C{BadRequestError}.
    """
    stack = await start([oauth("a", "oauth-a", priority=1),
                              oauth("b", "oauth-b", priority=50)])
    stack.emulator.setFault("oauth-a", {"kind": "stream_error", "code": "context_length_exceeded",
                                        "message": "Your input exceeds the context window"})
    try:
        with pytest.raises(openai.BadRequestError) as info:
            await sdk(stack, lambda c: c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))
        assert info.value.status_code == 400
        assert stack.emulator.requestsFor("oauth-b") == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_responses_json_on_oauth_has_output():
    """
    Issue 13: a non-streaming C{/v1/responses} client on an OAuth account
    gets C{output} built from the C{output_item.done} events although the
    backend's C{response.completed} carries C{output: []}.
    """
    stack = await start([oauth()])
    stack.emulator.setScript("oauth-o1", PARALLEL)
    try:
        response = await sdk(stack, lambda c: c.responses.create(model=MODEL, input="go"))
        assert [item.name for item in response.output] == ["get_weather", "get_time"]
        stack.emulator.setScript("oauth-o1", None)
        response = await sdk(stack, lambda c: c.responses.create(model=MODEL, input="hi"))
        assert response.output_text == "Hello from the relay emulator (account oauth-o1)"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_bridge_transcript_keeps_items_of_empty_completed():
    """
    Issue 13: on C{http_bridge} to an OAuth account, the connection's
    transcript keeps turn 1's function call although the backend's
    C{response.completed} has C{output: []}, so the chained turn 2 is
    expanded with the call its tool output answers.
    """
    stack = await start([oauth()], gateway=gateway("http_bridge"))
    stack.emulator.setScript("oauth-o1", {"tool_call": {"name": "exec_command",
                                                        "arguments": {"cmd": "ls"}}})
    ws = await connect(stack)
    try:
        t1 = await ws.turn(userTurn("list files"))
        assert t1[-1]["type"] == "response.completed" and t1[-1]["response"]["output"] == []
        [call] = [e["item"] for e in t1 if e["type"] == "response.output_item.done"]
        frame = userTurn("unused", previous=t1[-1]["response"]["id"])
        frame["input"] = [{"type": "function_call_output", "call_id": call["call_id"],
                           "output": "a.txt"}]
        t2 = await ws.turn(frame)
        assert t2[-1]["type"] == "response.completed", t2
        sent = http(stack, "oauth-o1")[-1]["input"]
        assert [i.get("type") for i in sent][-2:] == ["function_call", "function_call_output"]
        assert sent[-2]["call_id"] == call["call_id"]
    finally:
        await drain(stack, [ws])


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_sampling_fields_left_out_on_oauth(mode):
    """
    The ChatGPT backend refuses C{max_output_tokens}, C{temperature} and
    C{top_p} (400 "Unsupported parameter"); SDK clients send them on
    C{/v1/responses} too. Over HTTP (stream and JSON) and the WebSocket in
    every mode, a turn on an OAuth account completes and the backend never
    sees them, while an API-key account still gets them: the outcome does
    not depend on which kind of account served the turn.
    """
    stack = await start([oauth()], gateway=gateway(mode))
    sampling = {"max_output_tokens": 300, "temperature": 0.2, "top_p": 0.9}
    try:
        response = await sdk(stack, lambda c: c.responses.create(
            model=MODEL, input="hi", **sampling))
        assert response.status == "completed", response
        with_stream = await sdk(stack, lambda c: list(c.responses.create(
            model=MODEL, input="hi", stream=True, **sampling)))
        assert with_stream[-1].type == "response.completed", with_stream[-1]
        ws = await connect(stack)
        events = await ws.turn({**userTurn("hi"), **sampling})
        assert events[-1]["type"] == "response.completed", events[-1]
        bodies = http(stack, "oauth-o1") + frames(stack, "oauth-o1")
        assert len(bodies) == 3, bodies
        for body in bodies:
            assert not set(sampling) & set(body), body
        await drain(stack, [ws])
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_sampling_fields_kept_on_apikey():
    """
    The counterpart of L{test_sampling_fields_left_out_on_oauth}: an
    API-key account gets the sampling fields as the client sent them.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}])
    try:
        response = await sdk(stack, lambda c: c.responses.create(
            model=MODEL, input="hi", max_output_tokens=300, temperature=0.2, top_p=0.9))
        assert response.status == "completed", response
        [body] = http(stack, "sk-a1")
        assert (body["max_output_tokens"], body["temperature"], body["top_p"]) == (300, 0.2, 0.9)
    finally:
        await stack.stop()
