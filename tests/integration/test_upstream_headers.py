"""
behaviour.md R112 through a real relay: every header of the one table
(L{relay.upstream.headers.UPSTREAM_HEADERS}) that current Codex sends
reaches the upstream -- checked on what the emulator received -- on HTTP
and on the WebSocket handshake, for both account types; identifiers are
scoped per key on OAuth accounts; a mapped model's C{x-codex-routing-hint}
is rebuilt; a non-Codex client on an OAuth account gets relay's
C{version}; the client's credentials never travel.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from relay.engine.payload import scopedId
from relay.upstream.headers import CODEX_VERSION, DEFAULT_ORIGINATOR, UPSTREAM_HEADERS
from tests.integration.harness import startStack
from tests.integration.test_ws_turns import connect, drain, gateway, userTurn

KEY = "test"
"""The harness key's owner id (what scoping hashes with)."""

CLIENT = {h.name: f"v-{h.name}" for h in UPSTREAM_HEADERS if h.listed != "relay"}
CLIENT.update({"originator": "codex_exec", "version": "0.171.0",
               "x-codex-routing-hint": "model=gpt-client;tier=priority",
               "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "tracestate": "vendor=1"})
CREDENTIALS = {"x-api-key": "sk-client-secret", "api-key": "sk-client-secret",
               "cookie": "session=sk-client-secret"}


def _accounts(kind: str, mode: str = "ctx_pool"):
    entry = {"id": "a1", "credential": f"{kind}-cred", "ws_mode": mode,
             "model_mapping": {"gpt-client": "gpt-5.5"}}
    if kind == "oauth":
        entry["type"] = "oauth"
    return [entry]


def _check(received: dict, kind: str, transport: str) -> None:
    """
    Every row meant for C{transport} and C{kind} arrived, scoped where the
    table says so; the credentials did not.
    """
    for row in UPSTREAM_HEADERS:
        if row.listed == "relay" or not getattr(row, transport):
            continue
        got = received.get(row.name)
        if kind not in row.accounts:
            assert got is None, (row.name, got)
        elif row.name == "x-client-request-id":
            expect = CLIENT[row.name]
            assert got == (scopedId(KEY, expect) if kind == "oauth" else expect), received
        elif row.name == "x-codex-routing-hint":
            assert got == "model=gpt-5.5;tier=priority", received
        elif row.name == "user-agent":
            assert CLIENT[row.name] in got, received  # (the test client adds Autobahn's)
        elif row.name == "traceparent":
            assert got, received  # the client's, or relay's own span when tracing
        elif row.scoped and kind == "oauth":
            assert got == scopedId(KEY, CLIENT[row.name]), (row.name, received)
        else:
            assert got == CLIENT[row.name], (row.name, received)
    assert received["authorization"] == f"Bearer {kind}-cred"
    for name in CREDENTIALS:
        assert name not in received, received
    assert "sk-client-secret" not in " ".join(map(str, received.values()))


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest_twisted.ensureDeferred
async def test_http_carries_the_table(kind):
    stack = await startStack(_accounts(kind))
    try:
        headers = {k: [v] for k, v in {**CLIENT, **CREDENTIALS}.items()}
        headers["X-Client-Request-Id"] = [CLIENT["x-client-request-id"]]
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-client", "input": "hi", "stream": True,
                              "service_tier": "priority"}, headers=headers)
        assert response.code == 200, data
        [record] = stack.emulator.requestsFor(f"{kind}-cred", "request")
        _check(record.headers, kind, "http")
        assert record.body["model"] == "gpt-5.5"
    finally:
        await stack.stop()


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough"])
@pytest_twisted.ensureDeferred
async def test_websocket_handshake_carries_the_table(kind, mode):
    stack = await startStack(_accounts(kind, mode), gateway=gateway(mode))
    client = None
    try:
        client = await connect(stack, headers={**CLIENT, **CREDENTIALS})
        events = await client.turn(dict(userTurn("hi", model="gpt-client"),
                                        service_tier="priority"))
        assert events[-1]["type"] == "response.completed", events
        [record] = stack.emulator.requestsFor(f"{kind}-cred", "handshake")
        _check(record.headers, kind, "websocket")
    finally:
        await drain(stack, [client] if client else [])


@pytest_twisted.ensureDeferred
async def test_non_codex_client_gets_relays_version_on_oauth():
    """
    An SDK client (no Codex C{originator}) on an OAuth account: relay sends
    its own C{originator} and current C{version}, on HTTP and the handshake.
    """
    stack = await startStack(_accounts("oauth"))
    client = None
    try:
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True},
            headers={"User-Agent": ["OpenAI/Python 2.3.0"]})
        assert response.code == 200, data
        client = await connect(stack, headers={"User-Agent": "OpenAI/Python 2.3.0"})
        events = await client.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed", events
        records = (stack.emulator.requestsFor("oauth-cred", "request")
                   + stack.emulator.requestsFor("oauth-cred", "handshake"))
        assert len(records) == 2
        for record in records:
            assert record.headers["version"] == CODEX_VERSION, record.headers
            assert record.headers["originator"] == DEFAULT_ORIGINATOR
    finally:
        await drain(stack, [client] if client else [])
