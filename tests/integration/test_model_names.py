"""
behaviour.md R110 end to end: one normalised model name. A key's
C{deny_models: [gpt-5.5]} refuses C{gpt-5.5-2026-04-23}, C{GPT-5.5},
C{"gpt-5.5 "} and an operator alias mapped to it, on HTTP (Responses SSE
and JSON), Chat Completions and the WebSocket, before any upstream
request; an allow-list of C{gpt-5.5} lets its snapshot through, sent
upstream exactly as the client wrote it and priced as the family; a name
no account serves is a 404 C{model_not_found} before an account is chosen
(the WebSocket keeps its socket open).
"""

from __future__ import annotations

import json

import pytest_twisted

from relay.tenants.prices import PriceTable
from relay.tenants.requestlog import RequestQuery
from relay.usage.tokens import TokenCounts
from tests.integration.harness import startStack
from tests.integration.test_ws_turns import connect, drain

PINNED = {"input_tokens": 120, "cached_tokens": 100, "output_tokens": 30, "reasoning_tokens": 12}
ACCOUNTS = [
    {"id": "api", "credential": "sk-api", "models": ["gpt-5.5", "gpt-5.4"],
     "model_mapping": {"fast": "gpt-5.5"}},
]
DENIED = ("gpt-5.5-2026-04-23", "GPT-5.5", "gpt-5.5 ", "Fast")


def keyEntry(name: str, **policy) -> dict:
    return dict({"name": name, "key": "sk-" + name, "concurrency": 0}, **policy)


async def stack():
    keys = [keyEntry("deny", deny_models=["gpt-5.5"]), keyEntry("allow", models=["gpt-5.5"])]
    return await startStack(ACCOUNTS, keys=json.dumps(keys),
                            emulatorConfig={"default_script": {"usage": PINNED}},
                            extra="admin_key: names-admin-key-0123456789\n")


async def http(s, entry: str, key: str, model: str):
    if entry == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        return await s.postJSON("/v1/chat/completions", body, key="sk-" + key)
    body = {"model": model, "input": "hi", "stream": entry == "sse"}
    return await s.postJSON("/v1/responses", body, key="sk-" + key)


@pytest_twisted.ensureDeferred
async def test_deny_list_holds_for_every_spelling_and_alias():
    s = await stack()
    clients = []
    try:
        for entry in ("sse", "json", "chat"):
            for model in DENIED:
                response, data = await http(s, entry, "deny", model)
                assert response.code == 403, (entry, model, data)
                assert json.loads(data)["error"]["code"] == "model_not_found"
        for model in DENIED:
            client = await connect(s, key="sk-deny")
            clients.append(client)
            events = await client.turn({"type": "response.create", "model": model,
                                        "input": "hi"}, timeout=10)
            last = events[-1]
            assert last["type"] in ("error", "__closed__"), last
            if last["type"] == "error" and last.get("status") is not None:
                assert last["status"] == 403 and last["error"]["code"] == "model_not_found"
        assert s.emulator.requestsFor("sk-api") == []
        response, _ = await http(s, "json", "deny", "gpt-5.4")
        assert response.code == 200
    finally:
        await drain(s, clients)
        await s.stop()


@pytest_twisted.ensureDeferred
async def test_allow_list_allows_snapshots_sent_unaltered_and_priced_as_family():
    s = await stack()
    client = None
    try:
        response, data = await http(s, "json", "allow", "gpt-5.5-2026-04-23")
        assert response.code == 200, data
        response, data = await http(s, "chat", "allow", "GPT-5.5")
        assert response.code == 200, data
        client = await connect(s, key="sk-allow")
        events = await client.turn({"type": "response.create", "model": "gpt-5.5-2026-04-23",
                                    "input": "hi"}, timeout=10)
        assert events[-1]["type"] == "response.completed", events[-1]
        sent = [r.body.get("model") for r in s.emulator.requestsFor("sk-api")
                if r.kind in ("request", "frame") and isinstance(r.body, dict)]
        assert sent == ["gpt-5.5-2026-04-23", "GPT-5.5", "gpt-5.5-2026-04-23"], sent
        log = s.app.extras["requestLog"]
        records, _ = await log.query(RequestQuery(key="allow"), 10, None)
        family = PriceTable().cost("gpt-5.5", TokenCounts(1, 120, 100, 30, 12))
        assert [r.cost_nanos for r in records] == [family] * 3
        metrics = s.app.runner.metrics
        labels = {sample.labels["model"] for m in metrics.registry.collect()
                  if m.name == "relay_tokens" for sample in m.samples}
        assert labels == {"gpt-5.5"}, labels
    finally:
        await drain(s, [client] if client else [])
        await s.stop()


@pytest_twisted.ensureDeferred
async def test_unknown_model_is_404_before_an_account():
    s = await stack()
    client = None
    try:
        for entry in ("sse", "json", "chat"):
            response, data = await http(s, entry, "deny", "gpt-5.6")
            assert response.code == 404, (entry, data)
            assert json.loads(data)["error"]["code"] == "model_not_found"
        client = await connect(s, key="sk-deny")
        events = await client.turn({"type": "response.create", "model": "gpt-5.6",
                                    "input": "hi"}, timeout=10)
        assert events[-1]["type"] == "error"
        assert events[-1]["error"]["code"] == "model_not_found"
        assert client.closeInfo is None
        assert s.emulator.requestsFor("sk-api", "request") == []
        assert s.emulator.requestsFor("sk-api", "frame") == []
    finally:
        await drain(s, [client] if client else [])
        await s.stop()
