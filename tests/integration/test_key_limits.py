"""
Behaviour.md R114 end to end against the emulator: where Codex reads an
account's usage (C{GET /backend-api/wham/usage}, C{GET /api/codex/usage},
the C{x-codex-*} rate-limit headers of a turn and of the WebSocket
handshake, C{codex.rate_limits} events) a client key sees its own windows,
never the account's.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint

from relay.oauth.windows import Snapshot, Window
from tests.integration.harness import startStack
from tests.integration.oauthstack import emulatorConfig, oauthAccount
from tests.integration.test_ws_turns import _Client, drain, gateway

ACCOUNT_PERCENT = 70
"""The account's own primary window: never what a client sees."""

BUDGET = 200


class _HeadersClient(_Client):
    """A WebSocket client that keeps the handshake's response headers."""

    def onConnect(self, response):
        self.handshake = {k.lower(): v for k, v in response.headers.items()}


async def connectKeeping(stack, key):
    port = stack.port.getHost().port
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/v1/responses",
                                     headers={"Authorization": f"Bearer {key}"}, reactor=reactor)
    factory.protocol = _HeadersClient
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(5, reactor)
    return proto


async def stack(keys, names=("o1",), usage=None, mode="ctx_pool"):
    usage = usage or {"primary_used_percent": ACCOUNT_PERCENT, "secondary_used_percent": 40}
    return await startStack(
        lambda e: [oauthAccount(e, name, concurrency=0) for name in names],
        gateway=gateway(mode),
        emulatorConfig=emulatorConfig(names, usage=usage,
                                      script={"text": "word " * 10, "delay": 0.01}),
        keys=json.dumps(keys),
    )


def budgetKey(name="budget", **more):
    return dict({"name": name, "key": "sk-" + name, "concurrency": 0,
                 "daily_tokens": BUDGET}, **more)


async def getJSON(s, path, key):
    port = s.port.getHost().port
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await treq.get(f"http://127.0.0.1:{port}{path}", headers=headers)
    return response.code, json.loads(await response.content())


def keyPercent(s, name) -> int:
    used = s.app.runner.usage.used(name, reactor.seconds())[0]
    return int(used * 100 // BUDGET)


@pytest_twisted.ensureDeferred
async def test_usage_route_answers_for_the_key():
    """
    Both usage routes answer a key with a daily budget with its UTC day
    (integer percent of the budget used, C{limit_window_seconds} 86400,
    the reset at the next UTC midnight) and a plan Codex accepts; no key
    gets 401.
    """
    s = await stack([budgetKey()])
    try:
        response, _ = await s.postJSON("/v1/responses",
                                       {"model": "gpt-5.5", "input": "hi", "stream": True},
                                       key="sk-budget")
        assert response.code == 200
        expected = keyPercent(s, "budget")
        assert expected > 0
        for path in ("/backend-api/wham/usage", "/api/codex/usage"):
            code, body = await getJSON(s, path, "sk-budget")
            assert code == 200, body
            assert body["plan_type"] == "team"
            primary = body["rate_limit"]["primary_window"]
            assert primary["used_percent"] == expected, (body, expected)
            assert isinstance(primary["used_percent"], int)
            assert primary["limit_window_seconds"] == 86400
            assert primary["reset_at"] % 86400 == 0
            assert 0 < primary["reset_after_seconds"] <= 86400
            assert body["rate_limit"]["secondary_window"] is None
        code, _ = await getJSON(s, "/backend-api/wham/usage", None)
        assert code == 401
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_identity_routes_answer_for_the_key():
    """
    Codex signed in with the key as a personal access token asks who it is
    (C{/v1/user-auth-credential/whoami}) and for its workspace
    (C{accounts/check} beside both usage routes): the key's, never the
    account's (C{acct-o1}); no key gets 401.
    """
    s = await stack([budgetKey()])
    try:
        code, body = await getJSON(s, "/v1/user-auth-credential/whoami", "sk-budget")
        assert code == 200, body
        assert (body["chatgpt_account_id"], body["chatgpt_plan_type"]) == (
            "relay-key-budget", "team")
        for path in ("/backend-api/wham/accounts/check", "/api/codex/accounts/check"):
            code, body = await getJSON(s, path, "sk-budget")
            assert code == 200, body
            assert [a["id"] for a in body["accounts"]] == ["relay-key-budget"]
            assert "acct-o1" not in json.dumps(body)
        for path in ("/v1/user-auth-credential/whoami", "/backend-api/wham/accounts/check"):
            code, _ = await getJSON(s, path, None)
            assert code == 401
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_codex_models_manifest_beside_codex_responses():
    """
    Codex signed in with the key (its built-in provider, C{openai_base_url}
    ending C{/backend-api/codex}) asks C{GET /backend-api/codex/models
    ?client_version=...} for its models (protocol.md 5, 7): relay answers the
    same manifest as C{/v1/models?client_version=...}; no key gets 401.
    """
    s = await stack([budgetKey()])
    try:
        path = "/models?client_version=0.171.0"
        code, expected = await getJSON(s, "/v1" + path, "sk-budget")
        assert code == 200, expected
        code, body = await getJSON(s, "/backend-api/codex" + path, "sk-budget")
        assert code == 200, body
        assert [m["slug"] for m in body["models"]] == [m["slug"] for m in expected["models"]]
        code, _ = await getJSON(s, "/backend-api/codex" + path, None)
        assert code == 401
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_http_turn_headers_are_the_keys():
    """
    A turn over HTTP carries the key's C{x-codex-primary-*} (its rpm
    minute) and C{x-codex-secondary-*} (its UTC day), not the account's
    70 % of 300 minutes.
    """
    s = await stack([budgetKey(rpm=10)])
    try:
        response, _ = await s.postJSON("/v1/responses",
                                       {"model": "gpt-5.5", "input": "hi", "stream": True},
                                       key="sk-budget")
        assert response.code == 200
        h = {k.decode().lower(): v[0].decode() for k, v in response.headers.getAllRawHeaders()}
        assert h["x-codex-primary-window-minutes"] == "1", h
        assert float(h["x-codex-primary-used-percent"]) == 10.0, h  # 1 of rpm 10
        assert h["x-codex-secondary-window-minutes"] == "1440", h
        assert float(h["x-codex-secondary-used-percent"]) < ACCOUNT_PERCENT
        assert int(h["x-codex-secondary-reset-at"]) % 86400 == 0
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
async def test_websocket_handshake_and_events_are_the_keys():
    """
    Over the WebSocket the 101 carries the key's headers and the turn's
    C{codex.rate_limits} events carry the key's day, never the account's
    5-hour window.
    """
    s = await stack([budgetKey()])
    client = None
    try:
        client = await connectKeeping(s, "sk-budget")
        assert client.handshake.get("x-codex-primary-window-minutes") == "1440", client.handshake
        events = await client.turn({"type": "response.create", "model": "gpt-5.5",
                                    "input": "hi"}, timeout=10)
        assert events[-1]["type"] == "response.completed", events
        limits = [e for e in events if e["type"] == "codex.rate_limits"]
        assert limits, [e["type"] for e in events]
        for event in limits:
            assert event["rate_limits"]["primary"]["window_minutes"] == 1440, event
            assert event["rate_limits"]["primary"]["used_percent"] != ACCOUNT_PERCENT
            assert event["plan_type"] == "team"
    finally:
        await drain(s, [client] if client else [])


@pytest_twisted.ensureDeferred
async def test_key_without_budget_sees_the_pools_headroom():
    """
    A key with no budget sees the pool's headroom: the mean use of the
    accounts it reaches (80 % and 20 % make 50 %), in their window.
    """
    s = await stack([{"name": "free", "key": "sk-free", "concurrency": 0}],
                    names=("o1", "o2"),
                    usage={"o1": {"primary_used_percent": 80},
                           "o2": {"primary_used_percent": 20}})
    try:
        response, _ = await s.postJSON("/v1/responses",
                                       {"model": "gpt-5.5", "input": "hi", "stream": True},
                                       key="sk-free")
        assert response.code == 200
        h = {k.decode().lower(): v[0].decode() for k, v in response.headers.getAllRawHeaders()}
        # Nothing known of the pool before the turn: no window, and never
        # the serving account's.
        assert h.get("x-codex-primary-used-percent") not in ("80", "20"), h
        # Quota-aware selection served the emptier account only; the other
        # one's window as a usage probe would have read it.
        quota, now = s.app.runner.quota, reactor.seconds()
        quota.observe("o1", Snapshot(Window(80.0, 300.0, now + 3600), None, "plus", now, "probe"))
        quota.observe("o2", Snapshot(Window(20.0, 300.0, now + 7200), None, "plus", now, "probe"))
        code, body = await getJSON(s, "/backend-api/wham/usage", "sk-free")
        assert code == 200
        primary = body["rate_limit"]["primary_window"]
        assert primary["used_percent"] == 50, body
        assert primary["limit_window_seconds"] == 300 * 60
        assert primary["reset_at"] == int(now + 3600)
    finally:
        await drain(s)


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
async def test_websocket_turn_on_an_api_key_account_carries_the_keys_event(mode):
    """
    R114: an API-key account sends no C{codex.rate_limits} event; a
    WebSocket turn still carries one, with the key's day, in every mode.
    """
    s = await startStack([{"id": "a1", "credential": "sk-up-a1", "concurrency": 0}],
                         gateway=gateway(mode),
                         emulatorConfig={"accounts": [{"name": "a1", "credential": "sk-up-a1"}]},
                         keys=json.dumps([budgetKey()]))
    client = None
    try:
        client = await connectKeeping(s, "sk-budget")
        frame = {"type": "response.create", "model": "gpt-5.5", "input": "hi"}
        events = await client.turn(frame, timeout=10)
        assert events[-1]["type"] == "response.completed", events
        # the second turn's windows are surely read (the first turn may
        # reach its first output before they are)
        events = await client.turn(frame, timeout=10)
        assert events[-1]["type"] == "response.completed", events
        limits = [e for e in events if e["type"] == "codex.rate_limits"]
        assert len(limits) == 1, [e["type"] for e in events]
        assert limits[0]["rate_limits"]["primary"]["window_minutes"] == 1440, limits
    finally:
        await drain(s, [client] if client else [])
