"""
Issue 12 against the emulator: OAuth token refresh through a real relay
(protocol.md 7.4, behaviour.md R11). Proactive refresh before expiry with no
failed request; 401 -> one refresh -> replay (HTTP streaming and JSON, every
WebSocket mode) with one clean answer; a second 401 cools the account and
invalidates the token; 20 concurrent turns on an expired token cause one
refresh; C{refresh_token_reused} -> C{needs_login} and traffic moves, new
tokens through the admin API bring the account back; a 5xx from the token
endpoint keeps a still-valid token in use; the refresh goes through the
account's SOCKS5 proxy (a real microsocks).
"""

from __future__ import annotations

import json
import os

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import globalLogPublisher

from relay.emulator import Emulator
from tests.integration.harness import sseEvents, startStack
from tests.integration.oauthstack import (
    RESPONSES,
    bearers,
    emulatorConfig,
    expOf,
    forgedToken,
    oauthAccount,
    oauthStats,
    sleep,
    turnBody,
)
from tests.integration.test_ws_turns import connect, drain, userTurn

ADMIN = "admin-secret-oauth-0000"


@pytest.fixture
def logs():
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def named(events, name):
    return [e for e in events if e.get("event") == name]


async def oauthStack(accounts, gateway="{}", config=None, extra="", names=("o1",), ttl=600):
    emulator = Emulator(reactor=reactor, config=config or emulatorConfig(names, ttl=ttl))
    await emulator.listen(reactor)
    return await startStack(
        accounts, gateway=gateway, emulator=emulator,
        extra=f"admin_key: {ADMIN}\n" + extra,
    )


async def streamTurn(stack, text="hi"):
    response, data = await stack.postJSON(RESPONSES, turnBody(text))
    return response.code, sseEvents(data)


def assertCleanStream(code, events):
    types = [t for t, _ in events]
    assert code == 200, events
    assert types.count("response.created") == 1, types
    assert types[-1] == "response.completed", types
    assert "response.failed" not in types and "error" not in types, types


async def accountsView(stack) -> dict:
    r = await treq.get(stack.url + "/admin/accounts",
                       headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
    body = json.loads(await r.content())
    return {a["id"]: a for a in body["accounts"]}


@pytest_twisted.ensureDeferred
async def test_proactive_refresh_before_expiry():
    """
    Issue 12: an access token that expires in 6 s with a 3 s margin is
    refreshed about 3 s in, before it expires: every request of a steady
    stream succeeds, none carries an expired token, and the emulator
    rotated exactly once.

    The 6 s token is handed to relay once it is up (C{PUT
    /admin/accounts/o1/tokens}, the same refresh token), so its lifetime
    counts from then: minted into the configuration before the relay
    started, the token lost the start-up time (and up to 1 s to the JWT's
    whole-second C{iat}/C{exp}) from its 3 s before the refresh, and on a
    loaded box the refresh came before the first turn (one distinct token
    in the turns: the flake).
    """
    stack = await oauthStack(
        lambda e: [oauthAccount(e, "o1")],
        gateway="{oauth: {refresh_margin_seconds: 3}}",
    )
    try:
        r = await treq.put(
            stack.url + "/admin/accounts/o1/tokens",
            json.dumps({"access_token": stack.emulator.mintAccessToken("o1", 6),
                        "refresh_token": "rt-o1-0"}).encode(),
            headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False,
        )
        assert r.code == 200, await r.content()
        first = bearers(stack.emulator, "o1")
        for i in range(16):
            code, events = await streamTurn(stack, f"q{i}")
            assertCleanStream(code, events)
            await sleep(0.5)
        assert oauthStats(stack.emulator, "o1")["refreshes"] == 1
        records = stack.emulator.requestsFor("o1", "request")
        assert len(records) == 16 and first == []
        for record in records:
            token = record.headers["authorization"].partition(" ")[2]
            assert expOf(token) > record.time, "a request carried an expired token"
        assert len(set(bearers(stack.emulator, "o1", "request"))) == 2
    finally:
        await stack.stop()


ENTRIES = [("http", None, True), ("http", None, False), ("ws", "ctx_pool", True),
           ("ws", "passthrough", True), ("ws", "http_bridge", True)]


@pytest.mark.parametrize("entry,mode,stream", ENTRIES)
@pytest_twisted.ensureDeferred
async def test_401_refreshes_once_and_replays(entry, mode, stream, logs):
    """
    Issue 12 / R11: an upstream 401 on an OAuth account with a refresh
    token, before any output, triggers one refresh and one replay on the
    same account before any failover: the client sees one clean answer,
    the emulator saw the rejected request, one rotation and the replay with
    the new token.
    """
    gateway = "{websocket: {mode_default: " + (mode or "ctx_pool") + "}}"
    stack = await oauthStack(
        lambda e: [oauthAccount(e, "o1", credential=forgedToken("o1"))], gateway=gateway
    )
    client = None
    try:
        if entry == "http" and stream:
            assertCleanStream(*await streamTurn(stack))
        elif entry == "http":
            response, data = await stack.postJSON(RESPONSES, turnBody(stream=False))
            assert response.code == 200, data
            body = json.loads(data)
            assert body["status"] == "completed" and body["output"], body
        else:
            client = await connect(stack)
            events = await client.turn(userTurn("hello"), timeout=10)
            types = [e["type"] for e in events]
            assert types[-1] == "response.completed", events
            assert "error" not in types and types.count("response.created") == 1, types
        assert oauthStats(stack.emulator, "o1")["refreshes"] == 1
        kind = "handshake" if entry == "ws" and mode != "http_bridge" else "request"
        tokens = bearers(stack.emulator, "o1", kind)
        assert len(tokens) == 2, tokens
        assert stack.emulator.authenticate(tokens[0])[1] is not None  # rejected
        assert stack.emulator.authenticate(tokens[1]) == ("oauth:o1", None)
        [refresh] = named(logs, "openai.oauth_401_refresh")
        assert refresh["outcome"] == "succeeded" and refresh["account_id"] == "o1"
        assert named(logs, "openai.upstream_failover_switching") == []
        assert named(logs, "openai.websocket_upstream_failover_switching") == []
    finally:
        if client is not None:
            await drain(stack, [client])
        else:
            await stack.stop()


@pytest_twisted.ensureDeferred
async def test_second_401_cools_and_invalidates(logs):
    """
    R11 (OAuth with a refresh token): when the replay after the refresh is
    rejected too, the account is temp-unschedulable for 10 minutes and its
    cached token invalidated; there is exactly one refresh.
    """
    stack = await oauthStack(lambda e: [oauthAccount(e, "o1")])
    stack.emulator.setFault("o1", {"kind": "status", "preset": "unauthorized", "times": 2})
    try:
        now = reactor.seconds()
        response, data = await stack.postJSON(RESPONSES, turnBody())
        assert response.code == 502, data
        assert b"Upstream authentication failed" in data
        assert oauthStats(stack.emulator, "o1")["refreshes"] == 1
        states = await stack.app.store.getAccountStates(["o1"])
        assert now + 595 <= states["o1"].blockedUntil <= reactor.seconds() + 601
        assert not states["o1"].disabled
        assert named(logs, "relay.oauth_token_invalidated")
    finally:
        await stack.stop()


@pytest.mark.parametrize("how", ["expired", "rejected"])
@pytest_twisted.ensureDeferred
async def test_concurrent_turns_single_refresh(how):
    """
    Issue 12 single flight: 20 concurrent turns on an account whose token
    just expired (relay sees C{exp} in the past, or upstream rejects it
    with 401) cause exactly one call to the token endpoint; every turn
    completes.
    """
    if how == "expired":
        extra = {"accessTtl": -5}
    else:
        # Unlimited slots: all 20 reach upstream with the rejected token at
        # once (with 3 slots the replays would queue behind the waiters).
        extra = {"credential": forgedToken("o1"), "concurrency": 0}
    stack = await oauthStack(lambda e: [oauthAccount(e, "o1", **extra)])
    stack.emulator.setScript("o1", {"text": "slowish", "delay": 0.02})
    try:
        async def one(i):
            code, events = await streamTurn(stack, f"c{i}")
            return code, [t for t, _ in events]

        results = await gatherResults([Deferred.fromCoroutine(one(i)) for i in range(20)])
        for code, types in results:
            assert code == 200 and types[-1] == "response.completed", (code, types)
        stats = oauthStats(stack.emulator, "o1")
        assert stats["token_requests"] == 1, stats
        assert stats["refreshes"] == 1 and stats["reuse_attempts"] == 0, stats
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_reused_refresh_token_needs_login_and_traffic_moves(logs):
    """
    Issue 12: C{refresh_token_reused} puts the account in C{needs_login}
    (shown with its reason, never scheduled) and its traffic moves to the
    other account; new tokens through C{PUT /admin/accounts/o1/tokens}
    bring it back without a restart, and C{POST /admin/accounts/o1/refresh}
    forces a refresh. relay never sent a used refresh token.
    """
    config = emulatorConfig(("o1",), apikeys=("sk-a1",))
    stack = await oauthStack(
        lambda e: [oauthAccount(e, "o1", accessTtl=-5, priority=1),
                   {"id": "a1", "credential": "sk-a1", "priority": 50}],
        config=config,
    )
    stack.emulator.oauth.setFault("o1", {"kind": "refresh_token_reused", "times": 1})
    try:
        for i in range(3):
            assertCleanStream(*await streamTurn(stack, f"m{i}"))
        assert len(stack.emulator.requestsFor("sk-a1", "request")) == 3
        assert oauthStats(stack.emulator, "o1")["token_requests"] == 1
        view = (await accountsView(stack))["o1"]
        assert view["token_status"] == "needs_login", view
        assert view["token_reason"] == "refresh_token_reused", view
        assert view["schedulable"] is False
        [event] = named(logs, "relay.oauth_needs_login")
        assert event["code"] == "refresh_token_reused"

        fresh = stack.emulator.oauth.newRefreshToken("o1")
        r = await treq.put(
            stack.url + "/admin/accounts/o1/tokens", json.dumps({"refresh_token": fresh}).encode(),
            headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False,
        )
        body = json.loads(await r.content())
        assert r.code == 200 and body["token"]["token_status"] == "ok", body
        before = len(stack.emulator.requestsFor("sk-a1", "request"))
        assertCleanStream(*await streamTurn(stack, "back"))
        assert len(stack.emulator.requestsFor("sk-a1", "request")) == before  # o1 served it
        assert oauthStats(stack.emulator, "o1")["refreshes"] == 1
        view = (await accountsView(stack))["o1"]
        assert view["token_status"] == "ok" and view["schedulable"] is True, view

        async def forceRefresh(accountId):
            r = await treq.post(stack.url + f"/admin/accounts/{accountId}/refresh", b"",
                                headers={"Authorization": [f"Bearer {ADMIN}"]},
                                persistent=False)
            return r.code, json.loads(await r.content())

        code, forced = await forceRefresh("o1")
        assert code == 200 and forced["refreshed"] is True, forced
        assert forced["token"]["refreshes"] == 2
        assert (await forceRefresh("a1"))[0] == 400
        assert (await forceRefresh("nope"))[0] == 404
        assert oauthStats(stack.emulator, "o1")["reuse_attempts"] == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_token_endpoint_5xx_keeps_valid_token(logs):
    """
    Issue 12: a 5xx from the token endpoint is transient: the current
    access token (still valid) stays in use, the refresh is retried with
    backoff and then succeeds; no request fails or carries an expired
    token.
    """
    stack = await oauthStack(
        lambda e: [oauthAccount(e, "o1", accessTtl=16)],
        gateway="{oauth: {refresh_margin_seconds: 8}}",
    )
    stack.emulator.oauth.setFault("o1", {"kind": "status", "code": 503, "times": 1})
    try:
        original = None
        failedAt = None
        for i in range(30):
            assertCleanStream(*await streamTurn(stack, f"t{i}"))
            token = bearers(stack.emulator, "o1", "request")[-1]
            original = original or token
            if failedAt is None and named(logs, "relay.oauth_refresh_failed"):
                failedAt = i
            if failedAt is not None and i == failedAt + 1:
                assert token == original  # the failure kept the valid token
            if oauthStats(stack.emulator, "o1")["refreshes"] == 1 and token != original:
                break
            await sleep(0.5)
        assert failedAt is not None
        stats = oauthStats(stack.emulator, "o1")
        assert stats["token_requests"] == 2 and stats["refreshes"] == 1, stats
        for record in stack.emulator.requestsFor("o1", "request"):
            assert expOf(record.headers["authorization"].partition(" ")[2]) > record.time
        [failure] = named(logs, "relay.oauth_refresh_failed")
        assert failure["error"].startswith("503")
    finally:
        await stack.stop()


@pytest.mark.skipif(not os.path.exists("/usr/bin/microsocks"), reason="microsocks not installed")
@pytest_twisted.ensureDeferred
async def test_refresh_through_socks5_proxy():
    """
    Issue 12: the token request goes through the account's egress proxy
    (a real microsocks with a password): every connection the emulator
    accepted, the token request included, belongs to the proxy process.
    With the proxy gone, the refresh is a transient failure that never
    reached the server: the refresh token is not in doubt.
    """
    from tests.integration.proxy_servers import startMicrosocks
    from tests.integration.test_proxy_relay import proxyURL, recordPeers

    proxy = startMicrosocks("relayuser", "relaypass")
    stack = await oauthStack(
        lambda e: [oauthAccount(e, "o1", accessTtl=-5, proxy=proxyURL(proxy))]
    )
    peers = recordPeers(stack.emulator, stack.emulator.listeningPort)
    try:
        assertCleanStream(*await streamTurn(stack))
        assert oauthStats(stack.emulator, "o1")["refreshes"] == 1
        assert len(stack.emulator.requestsFor("o1", "token")) == 1
        assert peers and all(owners == {proxy.process.pid} for owners in peers), peers
        proxy.stop()
        credentials = stack.app.extras["credentials"]
        account = stack.app.config.accounts[0]
        ok = await credentials.refresh(account, reason="admin", force=True)
        assert ok is False
        view = credentials.view(account)
        assert view["token_status"] == "ok" and view["refresh_failures"] == 1, view
        assert oauthStats(stack.emulator, "o1")["token_requests"] == 1
    finally:
        proxy.stop()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_usage_windows_recorded_and_shown():
    """
    Issue 12: relay records an OAuth account's windows from HTTP response
    headers, the WebSocket handshake and C{codex.rate_limits} events, and
    shows them in C{/admin/accounts} (with the token's expiry and last
    refresh) and as Prometheus gauges.
    """
    usage = {"primary_used_percent": 30, "primary_capacity_tokens": 100000,
             "secondary_used_percent": 7, "secondary_capacity_tokens": 1000000}
    config = emulatorConfig(("o1", "o2"), usage=usage)
    stack = await oauthStack(lambda e: [oauthAccount(e, "o1"), oauthAccount(e, "o2")],
                             config=config, gateway="{websocket: {mode_default: ctx_pool}}")
    quota = stack.app.extras["quota"]
    client = None
    try:
        await streamTurn(stack)
        served = [a for a in ("o1", "o2") if stack.emulator.requestsFor(a, "request")]
        [httpAccount] = served
        assert quota.get(httpAccount).source == "headers"
        assert quota.get(httpAccount).primary.used_percent == 30
        client = await connect(stack)
        seen = []
        for i in range(2):
            events = await client.turn(userTurn(f"w{i}"), timeout=10)
            assert events[-1]["type"] == "response.completed", events
            seen.append(events)
        wsAccounts = {a for a in ("o1", "o2") if stack.emulator.requestsFor(a, "handshake")}
        assert wsAccounts
        for accountId in wsAccounts:
            assert quota.get(accountId).source in ("handshake", "event")
        assert any(quota.get(a).source == "event" for a in wsAccounts)
        view = await accountsView(stack)
        row = view[httpAccount]
        assert row["usage"]["primary"]["used_percent"] >= 30
        assert row["usage"]["secondary"]["used_percent"] >= 7
        assert row["token_expires_at"] > reactor.seconds() and row["token_status"] == "ok"
        r = await treq.get(stack.url + "/metrics", persistent=False,
                           headers={"Authorization": [f"Bearer {ADMIN}"]})
        text = (await r.content()).decode()
        assert f'relay_account_usage_percent{{account="{httpAccount}",window="primary"}}' in text
        assert f'relay_oauth_token_expiry_timestamp_seconds{{account="{httpAccount}"}}' in text
    finally:
        if client is not None:
            await drain(stack, [client])
        else:
            await stack.stop()
