"""
The turn-state token round trip (issue 20; behaviour.md R90; protocol.md
4.1, 7.2) through a real relay to the emulator's OAuth route on loopback.
"""

import uuid

import pytest_twisted

from tests.integration.harness import sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain, userTurn

MODEL = "gpt-5.5"


def oauth(name, priority):
    return {"id": name, "type": "oauth", "credential": f"oauth-{name}", "priority": priority}


def named(*names):
    return {"accounts": [{"name": n, "credential": f"oauth-{n}"} for n in names]}


@pytest_twisted.ensureDeferred
async def test_http_turn_state_reaches_the_client_and_routes_back():
    """
    R90 on HTTP: the upstream's C{x-codex-turn-state} reaches the client
    (SSE and JSON); the client's token goes upstream unchanged and routes
    the turn to the account that issued it.
    """
    stack = await startStack([oauth("o1", 1), oauth("o2", 2)], emulatorConfig=named("o1", "o2"))
    try:
        await stack.app.store.markAccount("o1", "temp_unschedulable",
                                          stack.app.reactor.seconds() + 1, "test")
        response, data = await stack.postJSON(
            "/v1/responses", {"model": MODEL, "input": "hi", "stream": True},
            headers={"session-id": [uuid.uuid4().hex]})
        assert response.code == 200
        token = response.headers.getRawHeaders(b"x-codex-turn-state")[0].decode()
        assert token.startswith("ts_")
        assert len(stack.emulator.requestsFor("oauth-o2")) == 1
        await stack.app.store.clearAccount("o1")
        stack.emulator.clearRequests()
        for stream in (True, False):
            response, data = await stack.postJSON(
                "/v1/responses", {"model": MODEL, "input": "again", "stream": stream},
                headers={"session-id": [uuid.uuid4().hex], "x-codex-turn-state": [token]})
            assert response.code == 200, data
            assert response.headers.getRawHeaders(b"x-codex-turn-state") == [token.encode()]
        sent = stack.emulator.requestsFor("oauth-o2")
        assert len(sent) == 2 and stack.emulator.requestsFor("oauth-o1") == []
        assert all(r.headers.get("x-codex-turn-state") == token for r in sent)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_http_turn_state_survives_an_early_keepalive():
    """
    R90 with R85: when the upstream is slow after its headers, the
    keepalive that commits the SSE headers carries the turn state too.
    """
    stack = await startStack([oauth("o1", 1)], gateway="{stream_keepalive_interval: 0.2}")
    try:
        stack.emulator.setFault("oauth-o1", {"kind": "delay_first_output", "seconds": 0.8,
                                             "times": 1})
        response = await stack.post("/v1/responses",
                                    {"model": MODEL, "input": "slow", "stream": True})
        data = await response.content()
        assert data.startswith(b":"), data[:40]  # a keepalive came first
        assert response.headers.getRawHeaders(b"x-codex-turn-state")
        assert sseEvents(data)[-1][0] == "response.completed"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_turn_state_on_the_next_connection():
    """
    R90 on the WebSocket: the first 101 goes out before an account is
    chosen; the token the upstream handshake gave the session is carried on
    the 101 of the session's next connection.
    """
    stack = await startStack([oauth("o1", 1)], gateway="{websocket: {mode_default: passthrough}}")
    session = uuid.uuid4().hex
    clients = []
    try:
        first = await connect(stack, headers={"session-id": session})
        clients.append(first)
        assert "x-codex-turn-state" not in (first.http_headers or {})
        events = await first.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed"
        (handshake,) = stack.emulator.requestsFor("oauth-o1", "handshake")
        second = await connect(stack, headers={"session-id": session})
        clients.append(second)
        token = second.http_headers.get("x-codex-turn-state")
        assert token and token.startswith("ts_")
        other = await connect(stack, headers={"session-id": uuid.uuid4().hex})
        clients.append(other)
        assert "x-codex-turn-state" not in (other.http_headers or {})
        assert handshake.headers.get("x-codex-turn-state") is None
    finally:
        await drain(stack, clients)
