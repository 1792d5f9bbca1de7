"""
Issue 12: the emulator's OAuth side over real sockets: C{POST /oauth/token}
(JSON and form), rotation and reuse counting, token faults (5xx, slow,
hold, reset, permanent codes), the control API, 401 for expired tokens on
the backend, usage headers on HTTP and the WebSocket handshake,
C{codex.rate_limits} events, and C{GET /backend-api/wham/usage}.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint

from relay.emulator import Emulator
from tests.integration.oauthstack import emulatorConfig, sleep
from tests.integration.test_ws_turns import _Client


async def post(url, body, form=False):
    if form:
        data = "&".join(f"{k}={v}" for k, v in body.items()).encode()
        ctype = "application/x-www-form-urlencoded"
    else:
        data, ctype = json.dumps(body).encode(), "application/json"
    r = await treq.post(url, data, headers={"Content-Type": [ctype]}, persistent=False)
    return r.code, json.loads(await r.content())


def grant(rt):
    return {"grant_type": "refresh_token", "refresh_token": rt,
            "client_id": "app_EMoamEEZ73f0CkXaXp7hrann", "scope": "openid profile email"}


@pytest_twisted.ensureDeferred
async def test_token_endpoint_and_faults():
    """
    Rotation over JSON then form bodies; reuse is 401 and counted; faults
    answer 503 without rotating, answer late, hold until released (and
    rotate then), drop the connection, or give permanent codes; the control
    API reports counts without tokens.
    """
    emulator = Emulator(reactor=reactor, config=emulatorConfig(("o1",), ttl=60))
    await emulator.listen(reactor)
    url = emulator.baseURL("root") + "/oauth/token"
    try:
        code, body = await post(url, grant("rt-o1-0"))
        assert code == 200 and body["token_type"] == "Bearer"
        code, body2 = await post(url, grant(body["refresh_token"]), form=True)
        assert code == 200 and body2["refresh_token"] != body["refresh_token"]
        code, reused = await post(url, grant("rt-o1-0"))
        assert (code, reused["error"]["code"]) == (401, "refresh_token_reused")
        current = body2["refresh_token"]

        emulator.oauth.setFault("o1", {"kind": "status", "code": 503, "times": 1})
        assert (await post(url, grant(current)))[0] == 503
        emulator.oauth.setFault("o1", {"kind": "slow", "seconds": 0.3, "times": 1})
        started = reactor.seconds()
        code, slow = await post(url, grant(current))
        assert code == 200 and reactor.seconds() - started >= 0.25
        current = slow["refresh_token"]

        emulator.oauth.setFault("o1", {"kind": "hold", "times": 1})
        d = Deferred.fromCoroutine(post(url, grant(current)))
        await sleep(0.2)
        assert not d.called and emulator.oauth.stats()["held"] == 1
        r = await treq.post(emulator.baseURL("root") + "/_emulator/oauth/release", b"",
                            persistent=False)
        assert json.loads(await r.content()) == {"released": 1}
        code, held = await d
        assert code == 200
        current = held["refresh_token"]

        emulator.oauth.setFault("o1", {"kind": "reset", "times": 1})
        try:
            await post(url, grant(current))
            raise AssertionError("expected a dropped connection")
        except Exception as e:
            assert not isinstance(e, AssertionError)
        r = await treq.put(emulator.baseURL("root") + "/_emulator/oauth/faults/o1",
                           json.dumps({"kind": "invalid_grant"}).encode(), persistent=False)
        await r.content()
        code, bad = await post(url, grant(current))
        assert (code, bad["error"]) == (400, "invalid_grant")

        r = await treq.get(emulator.baseURL("root") + "/_emulator/oauth", persistent=False)
        text = await r.content()
        stats = json.loads(text)["accounts"]["o1"]
        assert stats["reuse_attempts"] == 1 and stats["refreshes"] == 4, stats
        assert b"rt-" not in text and b"eyJ" not in text
    finally:
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_backend_tokens_and_usage():
    """
    The backend answers an expired access token with 401 and a valid one
    with usage headers; C{wham/usage} reports the same windows; the
    WebSocket handshake carries the headers and each turn starts with a
    C{codex.rate_limits} event.
    """
    usage = {"primary_used_percent": 12, "primary_capacity_tokens": 100000}
    emulator = Emulator(reactor=reactor, config=emulatorConfig(("o1",), usage=usage))
    await emulator.listen(reactor)
    url = emulator.baseURL("oauth") + "/responses"
    body = json.dumps({"model": "gpt-5.5", "input": "hi", "stream": True}).encode()
    try:
        expired = emulator.mintAccessToken("o1", -1)
        r = await treq.post(url, body, headers={"Authorization": [f"Bearer {expired}"]},
                            persistent=False)
        error = json.loads(await r.content())
        assert (r.code, error["error"]["code"]) == (401, "token_expired")
        good = emulator.mintAccessToken("o1")
        r = await treq.post(url, body, headers={"Authorization": [f"Bearer {good}"]},
                            persistent=False)
        await r.content()
        assert r.code == 200
        assert r.headers.getRawHeaders(b"x-codex-primary-used-percent") == [b"12"]
        r = await treq.get(emulator.baseURL("root") + "/backend-api/wham/usage",
                           headers={"Authorization": [f"Bearer {good}"]}, persistent=False)
        wham = json.loads(await r.content())
        assert wham["rate_limit"]["primary_window"]["used_percent"] == 12

        port = emulator.port
        factory = WebSocketClientFactory(
            f"ws://127.0.0.1:{port}/backend-api/codex/responses",
            headers={"Authorization": f"Bearer {good}"}, reactor=reactor)
        factory.protocol = _Client
        handshake = {}
        original = _Client.onConnect

        def onConnect(self, response):
            handshake.update(response.headers)
            return original(self, response) if original else None

        factory.protocol = type("_C", (_Client,), {"onConnect": onConnect})
        client = await TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(factory)
        await client.opened
        assert "x-codex-primary-used-percent" in handshake
        events = await client.turn({"type": "response.create", "model": "gpt-5.5",
                                    "input": "hi"})
        assert events[0]["type"] == "codex.rate_limits"
        assert events[0]["rate_limits"]["primary"]["used_percent"] >= 12
        client.bye()
        await client.closed
    finally:
        await emulator.stop()
