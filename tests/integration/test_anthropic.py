"""
The Anthropic Messages API end to end (behaviour.md R115, protocol.md 10):
the official C{anthropic} SDK against a real relay whose accounts are the
bundled emulator's, on API-key and OAuth accounts alike: text (stream and
not), tools (the C{tool_use} id is the upstream C{call_id} both ways),
images, C{count_tokens}, stop sequences, model mapping, failover, and
errors in Anthropic's shape and statuses.

The SDK is synchronous; every call runs in a thread (L{deferToThread}).
"""

from __future__ import annotations

import json

import anthropic
import pytest
import pytest_twisted
import treq
from twisted.internet.threads import deferToThread

from relay.translate.anthropic import messagesToResponses
from tests.integration.harness import RELAY_KEY, sseEvents, startStack

SONNET = "claude-sonnet-4-5-20250929"
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
         "RU5ErkJggg==")


def apikey(id="a1", credential="sk-a1", **extra):
    return {"id": id, "credential": credential, **extra}


def oauth(id="o1", credential="oauth-o1", **extra):
    return {"id": id, "type": "oauth", "credential": credential, **extra}


ACCOUNTS = {"apikey": apikey, "oauth": oauth}


async def start(accounts, **kw):
    known = [{"name": a["credential"], "credential": a["credential"]} for a in accounts]
    return await startStack(accounts, emulatorConfig={"accounts": known}, **kw)


async def sdk(relay, fn, key=RELAY_KEY):
    def call():
        with anthropic.Anthropic(base_url=relay.url, api_key=key, max_retries=0,
                                 timeout=10.0) as c:
            return fn(c)

    return await deferToThread(call)


def upstream(relay, credential):
    [request] = relay.emulator.requestsFor(credential)
    return request


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest_twisted.ensureDeferred
async def test_text_stream_and_not(kind):
    """
    R115: C{messages.create} streaming and not, on either account type: the
    answer carries the client's model name, C{end_turn} and the usage; the
    upstream got a Responses request for the mapped model (C{sonnet} ->
    gpt-5.5) with the system prompt as C{instructions}; on OAuth without
    C{max_output_tokens}, C{temperature} (left out as for chat).
    """
    account = ACCOUNTS[kind]()
    relay = await start([account])
    try:
        message = await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=200, system=[{"type": "text", "text": "be brief",
                                                   "cache_control": {"type": "ephemeral"}}],
            extra_body={"temperature": 0.2}, messages=[{"role": "user", "content": "hi"}]))
        assert message.model == SONNET and message.role == "assistant"
        assert message.stop_reason == "end_turn"
        assert message.content[0].text.startswith("Hello from the relay emulator")
        assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
        body = upstream(relay, account["credential"]).body
        assert body["model"] == "gpt-5.5" and body["instructions"] == "be brief"
        assert body["input"] == [{"type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": "hi"}]}]
        # cache_control: a cache key, scoped per client key upstream (R112)
        unscoped = messagesToResponses({"model": SONNET, "max_tokens": 200, "system": [
            {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "hi"}]}, "gpt-5.5")["prompt_cache_key"]
        assert body["prompt_cache_key"] and body["prompt_cache_key"] != unscoped
        if kind == "oauth":
            assert "max_output_tokens" not in body and "temperature" not in body
        else:
            assert body["max_output_tokens"] == 200 and body["temperature"] == 0.2
        relay.emulator.clearRequests()

        def streamed(c):
            with c.messages.stream(model=SONNET, max_tokens=200,
                                   messages=[{"role": "user", "content": "hi"}]) as s:
                kinds = [e.type for e in s]
                return kinds, s.get_final_message()

        kinds, final = await sdk(relay, streamed)
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_delta" in kinds and "message_delta" in kinds
        assert final.content[0].text == message.content[0].text
        assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    finally:
        await relay.stop()


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest_twisted.ensureDeferred
async def test_tool_use_round_trip(kind):
    """
    R115: a tool call comes back as a C{tool_use} block whose id is the
    upstream C{call_id} unchanged (stream and not), C{stop_reason}
    C{tool_use}; the next turn's C{tool_result} goes up as a
    C{function_call_output} with that same id, and the answer uses it.
    C{disable_parallel_tool_use} and C{tool_choice: any} are translated.
    """
    account = ACCOUNTS[kind]()
    relay = await start([account])
    relay.emulator.setScript(account["credential"], {
        "tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}},
        "text": "It is {output}"})
    try:
        ask = [{"role": "user", "content": "weather in Paris?"}]
        message = await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=100, tools=TOOLS, messages=ask,
            tool_choice={"type": "any", "disable_parallel_tool_use": True}))
        assert message.stop_reason == "tool_use"
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.input == {"city": "Paris"}
        assert use.id.startswith("call_")
        body = upstream(relay, account["credential"]).body
        assert body["tools"][0]["parameters"] == TOOLS[0]["input_schema"]
        assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
        relay.emulator.clearRequests()

        def streamed(c):
            with c.messages.stream(model=SONNET, max_tokens=100, tools=TOOLS,
                                   messages=ask) as s:
                return [e.type for e in s], s.get_final_message()

        kinds, final = await sdk(relay, streamed)
        [use2] = [b for b in final.content if b.type == "tool_use"]
        assert use2.input == {"city": "Paris"} and final.stop_reason == "tool_use"
        assert "input_json" in kinds  # the SDK's event for input_json_delta
        relay.emulator.clearRequests()
        answer = await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=100, tools=TOOLS, messages=ask + [
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"}]}]))
        assert answer.content[0].text == "It is sunny, 21C"
        items = upstream(relay, account["credential"]).body["input"]
        assert items[1] == {"type": "function_call", "call_id": use.id, "name": "get_weather",
                            "arguments": json.dumps({"city": "Paris"})}
        assert items[2] == {"type": "function_call_output", "call_id": use.id,
                            "output": "sunny, 21C"}
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_images_and_error_tool_result():
    """
    R115: a base64 image and a URL image become C{input_image} parts; a
    C{tool_result} with an image and C{is_error} goes up as input parts
    with the error marked.
    """
    relay = await start([apikey()])
    try:
        await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=50, messages=[
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": PIXEL}},
                    {"type": "image", "source": {"type": "url",
                                                 "url": "https://example.com/a.png"}},
                    {"type": "text", "text": "what is this?"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                     "content": [{"type": "text", "text": "blurry"},
                                 {"type": "image", "source": {
                                     "type": "base64", "media_type": "image/png",
                                     "data": PIXEL}}]}]}]))
        items = upstream(relay, "sk-a1").body["input"]
        parts = items[0]["content"]
        assert parts[0] == {"type": "input_image", "detail": "auto",
                            "image_url": "data:image/png;base64," + PIXEL}
        assert parts[1]["image_url"] == "https://example.com/a.png"
        assert items[1]["call_id"] == "toolu_1"  # a client's own id, unchanged
        output = items[2]["output"]
        assert items[2]["call_id"] == "toolu_1"
        assert output[0] == {"type": "input_text", "text": "Error: "}
        assert output[2]["type"] == "input_image"
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_count_tokens_is_never_a_generation():
    """
    R115: C{messages.count_tokens} answers relay's estimate; the upstream
    sees no request.
    """
    relay = await start([apikey()])
    try:
        counted = await sdk(relay, lambda c: c.messages.count_tokens(
            model=SONNET, system="be brief", tools=TOOLS,
            messages=[{"role": "user", "content": "hello there " * 50}]))
        assert counted.input_tokens > 100
        assert relay.emulator.requests == []
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_stop_sequences_applied_on_the_way_back():
    """
    R115: C{stop_sequences} end the text where one appears, stream and
    not, with C{stop_reason: stop_sequence}.
    """
    relay = await start([apikey()])
    try:
        message = await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=100, stop_sequences=["emulator"],
            messages=[{"role": "user", "content": "hi"}]))
        assert message.content[0].text == "Hello from the relay "
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == "emulator"

        def streamed(c):
            with c.messages.stream(model=SONNET, max_tokens=100, stop_sequences=["emulator"],
                                   messages=[{"role": "user", "content": "hi"}]) as s:
                return s.get_final_message()

        final = await sdk(relay, streamed)
        assert final.content[0].text == "Hello from the relay "
        assert final.stop_reason == "stop_sequence"
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_failover_is_invisible():
    """
    R115 with R8/R86: the first account answers 503; the turn fails over
    and the SDK sees only the second account's answer, stream and not.
    """
    relay = await start([apikey("bad", "sk-bad", priority=1), apikey("good", "sk-good",
                                                                     priority=50)])
    relay.emulator.setFault("sk-bad", {"kind": "status", "code": 503, "body": {
        "error": {"message": "down", "type": "server_error"}}})
    try:
        message = await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=50, messages=[{"role": "user", "content": "hi"}]))
        assert "sk-good" in message.content[0].text
        assert relay.emulator.requestsFor("sk-bad")

        def streamed(c):
            with c.messages.stream(model=SONNET, max_tokens=50,
                                   messages=[{"role": "user", "content": "hi"}]) as s:
                return s.get_final_message()

        final = await sdk(relay, streamed)
        assert "sk-good" in final.content[0].text
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_errors_in_anthropic_shape():
    """
    R115: a bad key is 401 C{authentication_error}; a body without
    C{max_tokens} 400 C{invalid_request_error}; relay's own "no capacity"
    (every account failing, R15's 503) 529 C{overloaded_error} with
    C{retry-after}; a key's rpm 429 C{rate_limit_error} with
    C{retry-after}; all as C{{"type": "error", "error": {type, message}}}.
    """
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0},
                       {"name": "slow", "key": "sk-relay-slow", "rpm": 1}])
    relay = await start([apikey()], keys=keys)
    try:
        with pytest.raises(anthropic.AuthenticationError) as bad:
            await sdk(relay, lambda c: c.messages.create(
                model=SONNET, max_tokens=5, messages=[{"role": "user", "content": "x"}]),
                key="sk-wrong")
        assert bad.value.body["type"] == "error"
        assert bad.value.body["error"]["type"] == "authentication_error"
        response = await relay.post("/v1/messages", {"model": SONNET, "messages": []},
                                    headers={"anthropic-version": ["2023-06-01"]})
        body = json.loads(await response.content())
        assert response.code == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]

        await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=5, messages=[{"role": "user", "content": "x"}]),
            key="sk-relay-slow")
        with pytest.raises(anthropic.RateLimitError) as limited:
            await sdk(relay, lambda c: c.messages.create(
                model=SONNET, max_tokens=5, messages=[{"role": "user", "content": "x"}]),
                key="sk-relay-slow")
        assert limited.value.body["error"]["type"] == "rate_limit_error"
        assert limited.value.response.headers.get("retry-after")

        relay.emulator.setFault("sk-a1", {"kind": "stream_error", "code": "server_is_overloaded",
                                          "message": "The server is overloaded."})
        with pytest.raises(anthropic.APIStatusError) as shed:
            await sdk(relay, lambda c: c.messages.create(
                model=SONNET, max_tokens=5, messages=[{"role": "user", "content": "x"}]))
        assert shed.value.status_code == 529, shed.value.body
        assert shed.value.body["error"]["type"] == "overloaded_error"
        assert shed.value.response.headers.get("retry-after")
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_mid_stream_error_is_an_error_event():
    """
    R115 with R17: after the stream started, an upstream failure is an
    C{event: error} in Anthropic's shape.
    """
    relay = await start([apikey()])
    relay.emulator.setFault("sk-a1", {"kind": "cut_after_events", "events": 6})
    try:
        response = await relay.post("/v1/messages", {
            "model": SONNET, "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        events = sseEvents(await response.content())
        assert response.code == 200
        assert events[0][0] == "message_start"
        name, data = events[-1]
        assert name == "error" and data["type"] == "error"
        assert data["error"]["type"] in ("api_error", "overloaded_error")
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_models_mapped_before_key_policy_and_listed():
    """
    R115 with R110: a C{claude-haiku-*} name is mapped first
    (C{anthropic_models}), so a key allowed only gpt-5.4-mini may use
    it and is refused C{claude-sonnet-*} (mapped to gpt-5.5) with
    C{permission_error}; C{GET /v1/models} with C{anthropic-version} lists
    the families in Anthropic's shape.
    """
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0,
                        "models": ["gpt-5.4-mini", "gpt-4.1"]}])
    relay = await start([apikey()], keys=keys, extra="anthropic_models: {haiku: gpt-4.1}\n")
    try:
        message = await sdk(relay, lambda c: c.messages.create(
            model="claude-haiku-4-5", max_tokens=5, messages=[{"role": "user", "content": "x"}]))
        assert message.model == "claude-haiku-4-5"
        assert upstream(relay, "sk-a1").body["model"] == "gpt-4.1"
        with pytest.raises(anthropic.APIStatusError) as refused:
            await sdk(relay, lambda c: c.messages.create(
                model=SONNET, max_tokens=5, messages=[{"role": "user", "content": "x"}]))
        assert refused.value.status_code == 403
        assert refused.value.body["error"]["type"] == "permission_error"
        response = await treq.get(relay.url + "/v1/models", headers={
            "x-api-key": [RELAY_KEY], "anthropic-version": ["2023-06-01"]})
        listing = json.loads(await response.content())
        ids = {m["id"] for m in listing["data"]}
        assert {"claude-opus", "claude-sonnet", "claude-haiku"} <= ids
        assert all(m["type"] == "model" for m in listing["data"])
        assert listing["has_more"] is False
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_admin_api_changes_the_mapping_live():
    """
    R115: C{PUT /admin/anthropic_models} changes the family table at once
    (the next request maps with it); C{GET} shows each family's model and
    source; a bad table is a 400 naming it.
    """
    admin = "anthropic-admin-key-0x7f"
    relay = await start([apikey()], extra=f"admin_key: {admin}\n"
                                          "anthropic_models: {haiku: gpt-4.1-mini}\n")
    auth = {"Authorization": [f"Bearer {admin}"], "Content-Type": ["application/json"]}
    try:
        response = await treq.get(relay.url + "/admin/anthropic_models", headers=auth)
        view = json.loads(await response.content())["anthropic_models"]
        assert view["haiku"] == {"model": "gpt-4.1-mini", "source": "config"}
        assert view["sonnet"] == {"model": "gpt-5.5", "source": "default"}
        response = await treq.put(relay.url + "/admin/anthropic_models", json.dumps(
            {"anthropic_models": {"sonnet": "gpt-4.1"}}).encode(), headers=auth)
        body = json.loads(await response.content())
        assert response.code == 200, body
        assert body["anthropic_models"]["sonnet"] == {"model": "gpt-4.1", "source": "admin"}
        await sdk(relay, lambda c: c.messages.create(
            model=SONNET, max_tokens=5, messages=[{"role": "user", "content": "x"}]))
        assert upstream(relay, "sk-a1").body["model"] == "gpt-4.1"
        response = await treq.put(relay.url + "/admin/anthropic_models", json.dumps(
            {"anthropic_models": {"sonnet": ""}}).encode(), headers=auth)
        assert response.code == 400
        assert "anthropic_models.sonnet" in (await response.content()).decode()
        audit = await treq.get(relay.url + "/admin/audit", headers=auth)
        assert "anthropic_models.update" in (await audit.content()).decode()
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_budgets_request_log_and_cost():
    """
    R115 with R102/R108/R109: a Messages turn is recorded in the request
    log with the mapped model, its endpoint, usage and cost, counts
    against the key's token budget, and a spent budget is a 429
    C{rate_limit_error} in Anthropic's shape.
    """
    admin = "anthropic-admin-key-0x7f"
    keys = json.dumps([{"name": "tight", "key": RELAY_KEY, "daily_tokens": 60}])
    relay = await start([apikey()], keys=keys, extra=f"admin_key: {admin}\n")
    relay.emulator.setScript("sk-a1", {"usage": {"input_tokens": 50, "output_tokens": 20}})
    try:
        response = await relay.post("/v1/messages", {
            "model": SONNET, "max_tokens": 20, "messages": [{"role": "user", "content": "x"}]})
        assert response.code == 200, await response.content()
        rid = response.headers.getRawHeaders("x-request-id")[0]
        page = await treq.get(relay.url + f"/admin/requests?request_id={rid}",
                              headers={"Authorization": [f"Bearer {admin}"]})
        [record] = (await page.json())["requests"]
        assert (record["key"], record["model"], record["endpoint"]) == (
            "tight", "gpt-5.5", "messages")
        assert (record["input_tokens"], record["output_tokens"]) == (50, 20)
        assert record["cost_usd"] > 0
        with pytest.raises(anthropic.RateLimitError) as spent:
            await sdk(relay, lambda c: c.messages.create(
                model=SONNET, max_tokens=20, messages=[{"role": "user", "content": "x"}]))
        assert spent.value.body["type"] == "error"
        assert spent.value.body["error"]["type"] == "rate_limit_error"
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_keepalives_before_the_first_output():
    """
    R85 with R115: a slow first output is kept alive with SSE comments
    (which Anthropic's SSE readers skip) before C{message_start}; the SDK
    reads the stream as usual.
    """
    relay = await start([apikey()], gateway="{stream_keepalive_interval: 0.1}")
    relay.emulator.setFault("sk-a1", {"kind": "delay_first_output", "seconds": 0.5})
    try:
        response = await relay.post("/v1/messages", {
            "model": SONNET, "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        raw = await response.content()
        assert raw.startswith(b":\n\n"), raw[:40]
        assert sseEvents(raw)[0][0] == "message_start"

        def streamed(c):
            with c.messages.stream(model=SONNET, max_tokens=50,
                                   messages=[{"role": "user", "content": "hi"}]) as s:
                return s.get_final_message()

        relay.emulator.setFault("sk-a1", {"kind": "delay_first_output", "seconds": 0.5})
        final = await sdk(relay, streamed)
        assert final.content[0].text.startswith("Hello from the relay emulator")
    finally:
        await relay.stop()
