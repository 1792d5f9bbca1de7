"""
The Responses API routes that are not turns (issue 20; behaviour.md R87,
R88, R92; protocol.md 1) through a real relay to the emulator on loopback:
compact on API-key and OAuth accounts, retrieve / delete / input items /
cancel routed to the owning account for the owning key, input token counts,
unknown sub-paths, the models manifest with its ETag. For every sub-route
the emulator's generation count is unchanged, and usage is counted where
upstream reports one.
"""

import json

import pytest_twisted
import treq

from tests.integration.harness import RELAY_KEY, startStack

MODEL = "gpt-5.5"
OTHER_KEY = "sk-relay-other"
KEYS = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0},
                   {"name": "other", "key": OTHER_KEY, "concurrency": 0}])


def user(text):
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def call(stack, method, path, body=None, key=RELAY_KEY, headers=None):
    hdrs = {"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]}
    hdrs.update(headers or {})
    data = json.dumps(body).encode() if body is not None else None
    response = await treq.request(method, stack.url + path, data=data, headers=hdrs,
                                  persistent=False)
    content = await response.content()
    return response, content


def parsed(content):
    return json.loads(content) if content else None


def tokensCounted(stack) -> float:
    """
    The input tokens relay counted (relay_tokens_total{type="input"}).
    """
    total = 0.0
    for metric in stack.app.extras["metrics"].registry.collect():
        for sample in metric.samples:
            if sample.name == "relay_tokens_total" and sample.labels.get("type") == "input":
                total += sample.value
    return total


@pytest_twisted.ensureDeferred
async def test_compact_on_apikey_account():
    """
    R87: C{POST /v1/responses/compact} goes to the account's
    C{/responses/compact} (not C{/responses}); the answer is the compact
    shape; no generation; its usage is counted.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        before = tokensCounted(stack)
        response, content = await call(stack, "POST", "/v1/responses/compact",
                                       {"model": MODEL, "input": [user("one"), user("two")]})
        assert response.code == 200, content
        body = parsed(content)
        assert body["object"] == "response.compaction"
        assert [i["type"] for i in body["output"]] == ["message", "message", "compaction"]
        seen = stack.emulator.requestsFor("sk-emu-a1", "request")
        assert [r.path for r in seen] == ["/v1/responses/compact"]
        assert stack.emulator.generationCount() == 0
        assert tokensCounted(stack) - before == body["usage"]["input_tokens"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_compact_on_oauth_account_is_a_compaction_turn():
    """
    R87: an OAuth account's backend retired C{/responses/compact}: relay
    runs the compaction turn (input + trailing C{compaction_trigger},
    C{store: false}, streamed) on its C{/responses} and answers the compact
    shape from the C{compaction} item; its usage is counted.
    """
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-1"}])
    try:
        before = tokensCounted(stack)
        response, content = await call(stack, "POST", "/v1/responses/compact",
                                       {"model": MODEL, "input": [user("keep this")]})
        assert response.code == 200, content
        body = parsed(content)
        assert body["object"] == "response.compaction"
        assert [i["type"] for i in body["output"]] == ["message", "compaction"]
        (sent,) = stack.emulator.requestsFor("oauth-1", "request")
        assert sent.path == "/backend-api/codex/responses"
        assert sent.body["input"][-1] == {"type": "compaction_trigger"}
        assert (sent.body["stream"], sent.body["store"]) == (True, False)
        assert tokensCounted(stack) - before == body["usage"]["input_tokens"] > 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_compact_fails_over_and_4xx_passes_after_one_attempt():
    """
    R87, R8: a compact 503 fails over to the next account like any request;
    a deterministic 400 is answered after one attempt, with upstream's own
    body, and marks nothing.
    """
    stack = await startStack([{"id": "bad", "credential": "sk-emu-bad", "priority": 1},
                              {"id": "good", "credential": "sk-emu-good", "priority": 50}])
    try:
        stack.emulator.setFault("sk-emu-bad", {"kind": "status", "code": 503, "times": 1})
        response, content = await call(stack, "POST", "/v1/responses/compact",
                                       {"model": MODEL, "input": "x"})
        assert response.code == 200, content
        assert len(stack.emulator.requestsFor("sk-emu-good", "request")) == 1
        stack.emulator.clearRequests()
        refusal = {"error": {"message": "Invalid 'input': bad item.",
                             "type": "invalid_request_error", "code": "invalid_value",
                             "param": "input"}}
        stack.emulator.setFault("sk-emu-bad", {"kind": "status", "code": 400, "body": refusal,
                                               "times": 1})
        response, content = await call(stack, "POST", "/v1/responses/compact",
                                       {"model": MODEL, "input": "another conversation"})
        assert response.code == 400
        assert parsed(content)["error"]["message"] == "Invalid 'input': bad item."
        assert len(stack.emulator.requestsFor("sk-emu-bad", "request")) == 1
        assert stack.emulator.requestsFor("sk-emu-good", "request") == []
        state = (await stack.app.store.getAccountStates(["bad"]))["bad"]
        assert state.blockedUntil == 0 and state.rateLimitedUntil == 0
        assert stack.emulator.generationCount() == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_retrieve_delete_input_items_go_to_the_owner_for_its_key():
    """
    R87, R104: retrieve, input items and delete of a stored response go to
    the account that served it, never another; another key, or an id relay
    holds no owner record for, gets 404 and nothing goes upstream.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1", "priority": 1},
                              {"id": "a2", "credential": "sk-emu-a2", "priority": 2}], keys=KEYS)
    try:
        response, content = await call(stack, "POST", "/v1/responses",
                                       {"model": MODEL, "input": [user("a"), user("b")]})
        created = parsed(content)
        rid = created["id"]
        generations = stack.emulator.generationCount()
        stack.emulator.clearRequests()
        response, content = await call(stack, "GET", f"/v1/responses/{rid}")
        assert response.code == 200, content
        assert parsed(content)["output"] == created["output"]
        response, content = await call(stack, "GET", f"/v1/responses/{rid}/input_items?order=asc")
        assert response.code == 200, content
        assert [i["content"][0]["text"] for i in parsed(content)["data"]] == ["a", "b"]
        for key in (OTHER_KEY,):
            for method, path in (("GET", f"/v1/responses/{rid}"),
                                 ("DELETE", f"/v1/responses/{rid}"),
                                 ("GET", f"/v1/responses/{rid}/input_items"),
                                 ("POST", f"/v1/responses/{rid}/cancel")):
                response, content = await call(stack, method, path, key=key)
                assert response.code == 404, (method, path, content)
                assert parsed(content)["error"]["type"] == "invalid_request_error"
        response, content = await call(stack, "GET", "/v1/responses/resp_nobodyknows")
        assert response.code == 404
        response, content = await call(stack, "DELETE", f"/v1/responses/{rid}")
        assert response.code == 200, content
        assert parsed(content)["deleted"] is True
        response, content = await call(stack, "GET", f"/v1/responses/{rid}")
        assert response.code == 404
        seen = stack.emulator.requestsFor("sk-emu-a1", "request")
        assert [(r.method, r.path) for r in seen] == [
            ("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
            ("DELETE", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}")]
        assert stack.emulator.requestsFor("sk-emu-a2") == []
        assert stack.emulator.generationCount() == generations
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chains_are_the_owners_on_every_route():
    """
    R40, R104: C{previous_response_id} on C{/v1/responses/input_tokens} and
    C{/v1/responses/compact} is checked like on a turn: another key's
    response id is refused (400, nothing upstream) and an id relay never
    issued is not found (input_tokens forwarded any id to any account);
    the owner key's count goes to the account that holds the chain.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1", "priority": 1},
                              {"id": "a2", "credential": "sk-emu-a2", "priority": 2}], keys=KEYS)
    try:
        _, content = await call(stack, "POST", "/v1/responses", {"model": MODEL, "input": "x"})
        rid = parsed(content)["id"]
        stack.emulator.clearRequests()
        for path in ("/v1/responses/input_tokens", "/v1/responses/compact"):
            body = {"model": MODEL, "previous_response_id": rid, "input": "y"}
            response, content = await call(stack, "POST", path, body, key=OTHER_KEY)
            assert response.code == 400, (path, content)
            assert parsed(content)["error"]["param"] == "previous_response_id", content
            assert "not available" in parsed(content)["error"]["message"], content
            response, content = await call(
                stack, "POST", path, dict(body, previous_response_id="resp_nobodyknows"))
            assert response.code == 400, (path, content)
            assert parsed(content)["error"]["code"] == "previous_response_not_found", content
        assert stack.emulator.requests == []
        # The owner key's count goes to a1, where the chain is.
        response, content = await call(stack, "POST", "/v1/responses/input_tokens",
                                       {"model": MODEL, "previous_response_id": rid,
                                        "input": "y"})
        assert response.code == 200, content
        assert [r.path for r in stack.emulator.requestsFor("sk-emu-a1")] == [
            "/v1/responses/input_tokens"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_owner_bound_request_never_moves():
    """
    R87: a 5xx on the owning account is not failed over to another account
    (only the owner can answer for its response): the client gets relay's
    exhausted error after the owner's attempts.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1", "priority": 1},
                              {"id": "a2", "credential": "sk-emu-a2", "priority": 2}])
    try:
        _, content = await call(stack, "POST", "/v1/responses", {"model": MODEL, "input": "x"})
        rid = parsed(content)["id"]
        stack.emulator.setFault("sk-emu-a1", {"kind": "status", "code": 503, "times": 5})
        response, content = await call(stack, "GET", f"/v1/responses/{rid}")
        assert response.code == 502, content
        assert stack.emulator.requestsFor("sk-emu-a2") == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_oauth_owned_ids_and_input_tokens():
    """
    R87: a response an OAuth account served is not stored upstream (relay
    sends C{store: false}), so relay answers 404 without asking; input token
    counts go to an API-key account, and with none there is a 400.
    """
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-1"}])
    try:
        _, content = await call(stack, "POST", "/v1/responses", {"model": MODEL, "input": "x"})
        rid = parsed(content)["id"]
        stack.emulator.clearRequests()
        response, _ = await call(stack, "GET", f"/v1/responses/{rid}")
        assert response.code == 404
        response, content = await call(stack, "POST", "/v1/responses/input_tokens",
                                       {"model": MODEL, "input": "count"})
        assert response.code == 400, content
        assert "API-key" in parsed(content)["error"]["message"]
        assert stack.emulator.requests == []
    finally:
        await stack.stop()
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-1",
                               "priority": 1},
                              {"id": "a1", "credential": "sk-emu-a1", "priority": 50}])
    try:
        response, content = await call(stack, "POST", "/v1/responses/input_tokens",
                                       {"model": MODEL, "input": "count me"})
        assert response.code == 200, content
        assert parsed(content)["object"] == "response.input_tokens"
        assert [r.path for r in stack.emulator.requestsFor("sk-emu-a1")] == [
            "/v1/responses/input_tokens"]
        assert stack.emulator.generationCount() == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_unknown_sub_paths_are_json_404_never_a_generation():
    """
    R87: an unknown sub-path is a JSON 404; a wrong method a JSON 405;
    nothing reaches upstream, nothing is generated; a 401 comes first.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        for method, path, status in (
            ("POST", "/v1/responses/nope", 404),
            ("POST", "/v1/responses/resp_1/nope", 404),
            ("GET", "/v1/responses/resp_1/input_items/x", 404),
            ("GET", "/v1/responses/compact", 405),
            ("PUT", "/v1/responses/resp_1", 405),
            ("POST", "/responses/resp_1/x", 404),
            ("POST", "/backend-api/codex/responses/nope", 404),
        ):
            response, content = await call(stack, method, path, {"model": MODEL, "input": "x"})
            assert response.code == status, (method, path, content)
            assert parsed(content)["error"]["type"] == "invalid_request_error"
        response, _ = await call(stack, "POST", "/v1/responses/compact", {"model": MODEL},
                                 key="sk-wrong")
        assert response.code == 401
        assert stack.emulator.requests == []
        assert stack.emulator.generationCount() == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_models_both_shapes_manifest_cached_with_etag():
    """
    R92: C{?client_version=} answers the OAuth upstream's manifest with an
    ETag (If-None-Match -> 304), fetched once and served from the cache;
    without it the plain list, from the upstream where no account declares
    models; both need a key.
    """
    stack = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-1"},
                              {"id": "a1", "credential": "sk-emu-a1"}])
    try:
        path = "/v1/models?client_version=0.171.0"
        response, content = await call(stack, "GET", path)
        assert response.code == 200, content
        manifest = parsed(content)
        assert [m["slug"] for m in manifest["models"]][:1] == ["gpt-5.5"]
        etag = response.headers.getRawHeaders(b"etag")[0]
        response, content = await call(stack, "GET", path,
                                       headers={"If-None-Match": [etag.decode()]})
        assert (response.code, content) == (304, b"")
        fetched = [r for r in stack.emulator.requestsFor("oauth-1") if "models" in r.path]
        assert len(fetched) == 1
        response, content = await call(stack, "GET", "/v1/models")
        listing = parsed(content)
        assert listing["object"] == "list"
        assert "gpt-5.5" in [m["id"] for m in listing["data"]]
        response, _ = await call(stack, "GET", path, key="sk-wrong")
        assert response.code == 401
        assert stack.emulator.generationCount() == 0
    finally:
        await stack.stop()
