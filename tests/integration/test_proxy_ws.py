"""
The Responses WebSocket through real egress proxies (issue 8, R6, R-B12):
real C{microsocks} and C{tinyproxy} processes on loopback, the real relay
and its upstream WebSocket dialer (C{ctx_pool}), the bundled emulator.

- a prewarm and a chained turn go through each proxy (the emulator's peer
  socket belongs to the proxy process, checked via C{/proc});
- a killed proxy on one of two accounts: the WebSocket turn switches to the
  other account and the proxied account gets the 10-minute cooldown (R4);
- WebSocket streams cut before output through one proxy count towards the
  proxy quarantine (2 within 60 s), so the next turn avoids that proxy.
"""

from __future__ import annotations

import os

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.logger import globalLogPublisher

from tests.integration.harness import closedPort
from tests.integration.proxy_servers import startMicrosocks
from tests.integration.test_proxy_relay import (
    PROXIES,
    assertNoSecrets,
    blockedUntil,
    named,
    proxyURL,
    recordPeers,
    startProxiedStack,
)
from tests.integration.test_ws_turns import PREWARM, connect, drain, frames, userTurn

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/usr/bin/microsocks") and os.path.exists("/usr/bin/tinyproxy")),
    reason="microsocks and tinyproxy are not installed",
)

CTX_POOL = "{websocket: {mode_default: ctx_pool}}"


@pytest.fixture
def logs():
    """
    Every log event emitted during the test.
    """
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


@pytest.mark.parametrize("kind", sorted(PROXIES))
@pytest_twisted.ensureDeferred
async def test_websocket_prewarm_and_chain_through_proxy(kind, logs):
    """
    Issue 8 / R49: a prewarm and a chained turn on one relay WebSocket
    complete through each proxy (SOCKS5 without and with user/password,
    HTTP CONNECT with basic auth), and every connection the emulator
    accepted is owned by the proxy process. The proxy password never
    reaches the logs.
    """
    proxy = PROXIES[kind]()
    stack = client = None
    try:
        stack = await startProxiedStack(
            [{"id": "p1", "credential": "sk-p1", "proxy": proxyURL(proxy)}], gateway=CTX_POOL
        )
        peers = recordPeers(stack.emulator, stack.emulator.listeningPort)
        client = await connect(stack)
        warm = await client.turn(PREWARM)
        assert warm[-1]["type"] == "response.completed", warm
        rid = warm[-1]["response"]["id"]
        chained = await client.turn(userTurn("hello", previous=rid))
        assert chained[-1]["type"] == "response.completed", chained
        assert any(e["type"] == "response.output_text.delta" for e in chained)
        sent = frames(stack, "sk-p1")
        assert len(sent) == 2 and sent[1]["previous_response_id"] == rid
        assert len(stack.emulator.requestsFor("sk-p1", "handshake")) == 1
        assert peers and all(owners == {proxy.process.pid} for owners in peers), peers
        if proxy.password:
            assertNoSecrets(logs, proxy.password)
    finally:
        if stack is not None:
            await drain(stack, [client] if client is not None else [])
        proxy.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_killed_proxy_switches_and_cools(logs):
    """
    R6/R4/R-B12: the preferred account's proxy works for a turn, then is
    killed; on a new connection the WebSocket dial is refused (persistent),
    so the turn switches to the direct account, completes, and the proxied
    account is cooled for 10 minutes. The failover log names the proxy port.
    """
    proxy = startMicrosocks("relayuser", "relaypass")
    stack = None
    clients = []
    try:
        stack = await startProxiedStack(
            [
                {"id": "p1", "credential": "sk-p1", "priority": 1, "proxy": proxyURL(proxy)},
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ],
            gateway=CTX_POOL,
        )
        client = await connect(stack)
        clients.append(client)
        events = await client.turn(userTurn("through the proxy"))
        assert events[-1]["type"] == "response.completed", events
        assert len(frames(stack, "sk-p1")) == 1
        client.bye()
        await client.closed.addTimeout(5, reactor)
        await stack.app.extras["wsPool"].close()  # no pooled tunnel survives the proxy
        proxy.stop()
        now = reactor.seconds()
        client = await connect(stack)
        clients.append(client)
        events = await client.turn(userTurn("proxy is gone"))
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        assert len(frames(stack, "sk-p1")) == 1
        assert len(frames(stack, "sk-d1")) == 1
        until = await blockedUntil(stack, "p1")
        assert until is not None and until >= now + 590
        [switch] = named(logs, "openai.websocket_upstream_failover_switching")
        assert switch["account_id"] == "p1"
        assert switch["proxy_port"] == proxy.port
        assertNoSecrets(logs, proxy.password)
    finally:
        if stack is not None:
            await drain(stack, clients)
        proxy.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_never_started_proxy_switches():
    """
    R6: an account whose proxy URL points at a closed port (refused) never
    serves a WebSocket turn; the turn completes on the other account.
    """
    stack = None
    client = None
    try:
        stack = await startProxiedStack(
            [
                {"id": "p1", "credential": "sk-p1", "priority": 1,
                 "proxy": f"socks5h://127.0.0.1:{closedPort()}"},
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ],
            gateway=CTX_POOL,
        )
        client = await connect(stack)
        events = await client.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed", events
        assert stack.emulator.requestsFor("sk-p1") == []
        assert len(frames(stack, "sk-d1")) == 1
        assert (await blockedUntil(stack, "p1")) is not None
    finally:
        if stack is not None:
            await drain(stack, [client] if client is not None else [])


@pytest_twisted.ensureDeferred
async def test_websocket_cuts_before_output_quarantine_proxy(logs):
    """
    Issue 8 quarantine for WebSocket turns: two accounts share one proxy;
    each one's upstream WebSocket is cut before output (the turn fails over
    twice and completes on the direct account). Those 2 cuts within 60 s
    quarantine the proxy, so the next turn, on a fresh connection, goes
    straight to the direct account although the proxied ones are preferred.
    """
    proxy = startMicrosocks()
    stack = None
    clients = []
    try:
        stack = await startProxiedStack(
            [
                {"id": "p1", "credential": "sk-p1", "priority": 1, "proxy_id": "shared"},
                {"id": "p2", "credential": "sk-p2", "priority": 2, "proxy_id": "shared"},
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ],
            gateway=CTX_POOL,
            extra=f'proxies: [{{"id": "shared", "url": "{proxyURL(proxy)}"}}]\n',
        )
        cut = {"kind": "cut_after_events", "events": 1, "times": 1, "transport": "ws"}
        stack.emulator.setFault("sk-p1", cut)
        stack.emulator.setFault("sk-p2", cut)
        client = await connect(stack)
        clients.append(client)
        events = await client.turn(userTurn("cut twice"))
        assert events[-1]["type"] == "response.completed", events
        assert len(frames(stack, "sk-p1")) == 1
        assert len(frames(stack, "sk-p2")) == 1
        assert len(frames(stack, "sk-d1")) == 1
        cuts = named(logs, "relay.proxy_stream_cut")
        assert [(e["account_id"], e["proxy_id"]) for e in cuts] == [
            ("p1", "shared"), ("p2", "shared")
        ]
        [quarantined] = named(logs, "relay.proxy_quarantined")
        assert quarantined["proxy_id"] == "shared"
        assert quarantined["proxy_port"] == proxy.port
        health = stack.app.extras["proxyHealth"]
        assert health.quarantinedUntil("shared") is not None
        client = await connect(stack)
        clients.append(client)
        events = await client.turn(userTurn("after the quarantine"))
        assert events[-1]["type"] == "response.completed", events
        assert len(frames(stack, "sk-p1")) == 1
        assert len(frames(stack, "sk-p2")) == 1
        assert len(frames(stack, "sk-d1")) == 2
        assert health.snapshot()["shared"]["state"] == "quarantined"
    finally:
        if stack is not None:
            await drain(stack, clients)
        proxy.stop()
