"""
HTTP turns through a real relay to the real emulator on loopback: streaming
and non-streaming Responses, chat completions, auth, and basic failover
(issue 2).
"""

import json

import pytest_twisted

import treq

from tests.integration.harness import RELAY_KEY, closedPort, sseEvents, startStack


@pytest_twisted.ensureDeferred
async def test_streaming_responses_turn():
    """
    A streaming C{/v1/responses} request is relayed event by event and ends
    with C{response.completed}.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True}
        )
        assert response.code == 200
        assert response.headers.getRawHeaders(b"content-type") == [b"text/event-stream"]
        events = sseEvents(data)
        assert events[0][0] == "response.created"
        assert events[-1][0] == "response.completed"
        assert [e for e in events if e[0] == "response.output_text.delta"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_non_streaming_oauth_collects_json():
    """
    protocol.md 2.7: a non-streaming request on an OAuth account streams
    upstream and answers one JSON response object.
    """
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-1"}])
    try:
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        assert response.code == 200, data
        body = json.loads(data)
        assert body["object"] == "response"
        assert body["status"] == "completed"
        seen = stack.emulator.requestsFor("oauth-1")
        assert seen[-1].body["stream"] is True
        assert seen[-1].body["store"] is False
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_no_key_is_401():
    """
    A request without a relay key gets 401 in OpenAI's error format and
    never reaches upstream.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5"}, key="nope")
        assert response.code == 401
        assert json.loads(data)["error"]["type"] == "invalid_request_error"
        assert stack.emulator.requests == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_refused_account_fails_over():
    """
    R1/R3/R4/R5: a refused account is switched away from, cooled down, and
    the turn completes on the healthy account.
    """
    port = closedPort()
    stack = await startStack(
        [
            {"id": "dead", "credential": "sk-dead", "base_url": f"http://127.0.0.1:{port}/v1", "priority": 1},
            {"id": "good", "credential": "sk-good", "priority": 50},
        ]
    )
    try:
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True}
        )
        assert response.code == 200
        assert sseEvents(data)[-1][0] == "response.completed"
        assert len(stack.emulator.requestsFor("sk-good")) == 1
        states = await stack.app.store.getAccountStates(["dead"])
        assert states["dead"].blockedUntil > stack.app.reactor.seconds() + 500
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_completions_stream():
    """
    Chat completions stream through relay as data-only chunks ending in
    C{[DONE]}.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        response, data = await stack.postJSON(
            "/v1/chat/completions",
            {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert response.code == 200
        assert data.rstrip().endswith(b"data: [DONE]")
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_upstream_cookies_are_never_replayed():
    """
    architecture.md invariant 7: a cookie one upstream account sets (e.g.
    Cloudflare's C{__cf_bm}) is never stored and sent with another account's
    (or another client's) request.
    """
    stack = await startStack(
        [
            {"id": "a1", "credential": "sk-cookie-a1", "priority": 1},
            {"id": "a2", "credential": "sk-cookie-a2", "priority": 50},
        ]
    )
    try:
        stack.emulator.setFault(
            "sk-cookie-a1",
            {"kind": "status", "code": 503, "times": 1,
             "headers": {"set-cookie": "__cf_bm=tracking; Path=/"}},
        )
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "one", "stream": True}
        )
        assert response.code == 200
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "two", "stream": True}
        )
        assert response.code == 200
        seen = stack.emulator.requestsFor("sk-cookie-a2") + stack.emulator.requestsFor("sk-cookie-a1")
        assert len(seen) >= 3
        assert all("cookie" not in r.headers for r in seen), [r.headers for r in seen]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_fails_over_to_oauth_accounts():
    """
    Issue 13: OAuth accounts serve chat completions through their
    C{/responses} route, so a chat request whose API-key account fails is
    served by the OAuth account (translated), and with only OAuth accounts
    it is served too.
    """
    stack = await startStack(
        [
            {"id": "k1", "credential": "sk-chat-k1", "priority": 1},
            {"id": "o1", "type": "oauth", "credential": "oauth-chat-o1", "priority": 50},
        ]
    )
    try:
        stack.emulator.setFault("sk-chat-k1", {"kind": "status", "code": 500, "times": 1})
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}]}
        response, data = await stack.postJSON("/v1/chat/completions", body)
        assert response.code == 200, data
        assert json.loads(data)["object"] == "chat.completion"
        [seen] = stack.emulator.requestsFor("oauth-chat-o1")
        assert seen.path == "/backend-api/codex/responses"
    finally:
        await stack.stop()
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-chat-o1"}])
    try:
        response, data = await stack.postJSON(
            "/v1/chat/completions", {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.code == 200, data
        assert json.loads(data)["choices"][0]["message"]["content"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_bad_methods_paths_and_fields_get_openai_errors():
    """
    Bad input gets a clear error in OpenAI's format, never twisted.web's
    HTML: unknown paths 404, wrong methods 405, a plain GET on
    /v1/responses 426, a non-boolean C{stream} or a chat request without
    C{messages} 400; nothing reaches upstream.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        auth = {"Authorization": [f"Bearer {RELAY_KEY}"]}
        cases = [
            ("GET", "/v1/nope", 404, "unknown_url"),
            ("GET", "/", 404, "unknown_url"),
            ("DELETE", "/v1/responses", 405, "method_not_allowed"),
            ("PUT", "/v1/chat/completions", 405, "method_not_allowed"),
            ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
            ("GET", "/v1/responses", 426, None),
        ]
        for method, path, status, code in cases:
            r = await treq.request(method, stack.url + path, headers=auth)
            body = json.loads(await r.content())
            assert (r.code, body["error"]["code"]) == (status, code), (method, path, body)
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "x", "stream": "yes"}
        )
        assert response.code == 400 and json.loads(data)["error"]["param"] == "stream"
        response, data = await stack.postJSON("/v1/chat/completions", {"model": "gpt-5.5"})
        assert response.code == 400 and json.loads(data)["error"]["param"] == "messages"
        assert stack.emulator.requests == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_invalid_encrypted_content_retries_once_without_reasoning():
    """
    R7: a 400 C{invalid_encrypted_content} (reasoning encrypted by another
    account, e.g. after a failover) is retried once on the same account
    with the encrypted reasoning items dropped; it is neither a switch nor
    a cooldown. Without such items the 400 passes through.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-enc-a1"}])
    rejected = {"error": {"type": "invalid_request_error", "code": "invalid_encrypted_content",
                          "message": "The encrypted content could not be verified.", "param": None}}
    try:
        stack.emulator.setFault("sk-enc-a1", {"kind": "status", "code": 400, "body": rejected, "times": 1})
        body = {
            "model": "gpt-5.5", "stream": True,
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA-from-other"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]},
            ],
        }
        response, data = await stack.postJSON("/v1/responses", body)
        assert response.code == 200
        assert sseEvents(data)[-1][0] == "response.completed"
        first, second = stack.emulator.requestsFor("sk-enc-a1")
        assert [i["type"] for i in first.body["input"]] == ["message", "reasoning", "message"]
        assert [i["type"] for i in second.body["input"]] == ["message", "message"]
        stack.emulator.setFault("sk-enc-a1", {"kind": "status", "code": 400, "body": rejected, "times": 1})
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "plain", "stream": True}
        )
        assert response.code == 400
        assert json.loads(data)["error"]["code"] == "invalid_encrypted_content"
    finally:
        await stack.stop()
