"""
Engine rules on the Responses WebSocket, through a real relay, the real
emulator and a real autobahn client on loopback: the shared first-output
cap (R57/R21), the per-turn budget reset (R58), same-account retry and
later-turn 5xx failover on C{http_bridge} (R-B4, R-B5), the connection age
limit (protocol.md 4.5/4.6), the passthrough client idle close (R69) and
session pre-emption (R68).
"""

from __future__ import annotations

import json

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from tests.integration.test_ws_turns import connect, drain, frames, http, userTurn

WS_MODES = ["ctx_pool", "http_bridge"]


def threeAccounts(**extra):
    out = [
        {"id": "a", "credential": "sk-a", "priority": 1},
        {"id": "b", "credential": "sk-b", "priority": 50},
        {"id": "c", "credential": "sk-c", "priority": 100},
    ]
    for account in out:
        account.update(extra.get(account["id"], {}))
    return out


def sent(stack, credential):
    """
    What one account received: WebSocket frames and bridged HTTP bodies.
    """
    return frames(stack, credential) + http(stack, credential)


def transportFor(mode):
    return "http" if mode == "http_bridge" else "ws"


def setFirstOutputTimeout(stack, seconds):
    stack.app.settings.current = attrs.evolve(
        stack.app.settings.current, first_output_timeout_seconds=seconds
    )


def texts(body):
    return json.dumps(body.get("input"))


async def sleep(seconds):
    await deferLater(reactor, seconds, lambda: None)


# -- R57 / R21 -----------------------------------------------------------------


@pytest.mark.parametrize("mode", WS_MODES)
@pytest_twisted.ensureDeferred
async def test_first_output_timeout_switches_once(mode):
    """
    R57, R21: a WebSocket turn whose account produces no output before the
    first-output deadline switches once and completes on the next account.
    """
    stack = await startStack3(mode)
    setFirstOutputTimeout(stack, 0.4)
    stack.emulator.setFault(
        "sk-a", {"kind": "delay_first_output", "seconds": 2, "transport": transportFor(mode)}
    )
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("slow-then-fast"))
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        assert len(sent(stack, "sk-a")) == 1
        assert len(sent(stack, "sk-b")) == 1
        assert sent(stack, "sk-c") == []
    finally:
        await drain(stack, [client])


@pytest.mark.parametrize("mode", WS_MODES)
@pytest_twisted.ensureDeferred
async def test_second_first_output_timeout_ends_the_turn(mode):
    """
    R57, R21, R65: the second first-output timeout of one WebSocket turn
    ends it (the same cap as HTTP): close 1013 "upstream service
    temporarily unavailable" (the synthetic 504), and the healthy third
    account is never tried.
    """
    stack = await startStack3(mode)
    setFirstOutputTimeout(stack, 0.4)
    for credential in ("sk-a", "sk-b"):
        stack.emulator.setFault(
            credential,
            {"kind": "delay_first_output", "seconds": 2, "transport": transportFor(mode)},
        )
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("both-slow"))
        assert events[-1]["type"] == "__closed__", events
        assert not any(e["type"] == "response.completed" for e in events)
        assert client.closeInfo == (1013, "upstream service temporarily unavailable")
        assert len(sent(stack, "sk-a")) == 1
        assert len(sent(stack, "sk-b")) == 1
        assert sent(stack, "sk-c") == []
    finally:
        await drain(stack, [client])


async def startStack3(mode, gatewayExtra="", **accounts):
    from tests.integration.harness import startStack

    return await startStack(
        threeAccounts(**accounts),
        gateway="{websocket: {mode_default: " + mode + "}" + gatewayExtra + "}",
    )


# -- R58 -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_switch_budget_resets_after_a_successful_turn(mode):
    """
    R58: with max_account_switches 1, turn 1 spends its switch (A is rate
    limited) and completes on B; turn 2, where B fails once, can still
    switch to C because the budget reset. A's own cooldown persists: turn 2
    never goes back to A.
    """
    stack = await startStack3(mode, gatewayExtra=", max_account_switches: 1")
    transport = transportFor(mode)
    stack.emulator.setFault(
        "sk-a", {"kind": "status", "preset": "rate_limit", "transport": transport}
    )
    client = await connect(stack)
    try:
        t1 = await client.turn(userTurn("turn-one"))
        assert t1[-1]["type"] == "response.completed", t1
        assert len(sent(stack, "sk-a")) == 1
        assert len(sent(stack, "sk-b")) == 1
        stack.emulator.setFault(
            "sk-b", {"kind": "status", "preset": "rate_limit", "times": 1, "transport": transport}
        )
        t2 = await client.turn(userTurn("turn-two"))
        assert t2[-1]["type"] == "response.completed", t2
        assert client.closeInfo is None
        assert len(sent(stack, "sk-a")) == 1
        assert len(sent(stack, "sk-b")) == 2
        onC = sent(stack, "sk-c")
        assert len(onC) == 1
        assert "turn-two" in texts(onC[0]) and "turn-one" not in texts(onC[0])
        states = await stack.app.store.getAccountStates(["a"])
        assert states["a"].unschedulable(stack.app.reactor.seconds()) is not None
    finally:
        await drain(stack, [client])


# -- R-B4 / R-B5 on http_bridge ---------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_bridge_same_account_retry():
    """
    R-B4, R14: on http_bridge a pool-mode account's 403 is retried on the
    same account, exactly as on HTTP, and the turn completes there.
    """
    stack = await startStack3("http_bridge", a={"pool_mode": True})
    stack.emulator.setFault(
        "sk-a",
        {
            "kind": "status",
            "code": 403,
            "body": {"error": {"type": "permission_error", "message": "forbidden for now"}},
            "times": 1,
        },
    )
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("retry-me"), timeout=4)
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        assert len(http(stack, "sk-a")) == 2
        assert http(stack, "sk-b") == []
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_bridge_later_turn_5xx_fails_over_with_the_current_turn():
    """
    R-B5, R61, R80: a 503 on the connection's account on turn 2 of an
    http_bridge connection fails over; the new account receives turn 2's
    input, never turn 1's.
    """
    stack = await startStack3("http_bridge")
    client = await connect(stack)
    try:
        t1 = await client.turn(userTurn("turn-one"))
        assert t1[-1]["type"] == "response.completed", t1
        stack.emulator.setFault("sk-a", {"kind": "status", "code": 503, "times": 1})
        t2 = await client.turn(userTurn("turn-two"))
        assert t2[-1]["type"] == "response.completed", t2
        assert client.closeInfo is None
        onB = http(stack, "sk-b")
        assert len(onB) == 1
        assert "turn-two" in texts(onB[0]) and "turn-one" not in texts(onB[0])
        assert "previous_response_id" not in onB[0]
    finally:
        await drain(stack, [client])


# -- protocol.md 4.5/4.6: websocket_connection_limit_reached -------------------


def setWebSocket(stack, **changes):
    current = stack.app.settings.current
    stack.app.settings.current = attrs.evolve(
        current, websocket=attrs.evolve(current.websocket, **changes)
    )


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_old_connection_gets_connection_limit_reached(mode):
    """
    protocol.md 4.5/4.6 (issue 6 item 8), R81, R70: once a client connection
    is older than client_max_age_seconds, its next response.create is
    answered with the status-400 websocket_connection_limit_reached error
    event and the socket closes 1001; nothing is sent upstream for it. A
    fresh connection then works.
    """
    stack = await startStack3(mode)
    setWebSocket(stack, client_max_age_seconds=0.5)
    client = await connect(stack)
    fresh = None
    try:
        t1 = await client.turn(userTurn("young"))
        assert t1[-1]["type"] == "response.completed", t1
        await sleep(0.6)
        events = await client.turn(userTurn("too-old"))
        assert events[0] == {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_connection_limit_reached",
                "message": "Responses websocket connection limit reached (60 minutes)."
                " Create a new websocket connection to continue.",
            },
        }
        code, reason = await client.closed.addTimeout(4, reactor)
        assert (code, reason) == (1001, "websocket connection limit reached; please reconnect")
        assert "too-old" not in json.dumps(sent(stack, "sk-a"))
        fresh = await connect(stack)
        t2 = await fresh.turn(userTurn("reconnected"))
        assert t2[-1]["type"] == "response.completed", t2
    finally:
        await drain(stack, [c for c in (client, fresh) if c is not None])


def test_client_max_age_config():
    """
    protocol.md 4.6: gateway.websocket.client_max_age_seconds defaults to
    3600 and must be at least 60 in the file.
    """
    from relay.configuration.parse import ConfigError, settingsFromString

    base = 'listen: "tcp:0"\nkeys: [{name: t, key: sk-t}]\naccounts: [{id: a, type: apikey, api_key: sk-a, base_url: "http://127.0.0.1:1/v1"}]\n'
    assert settingsFromString(base).gateway.websocket.client_max_age_seconds == 3600
    text = base + "gateway: {websocket: {client_max_age_seconds: 120}}\n"
    assert settingsFromString(text).gateway.websocket.client_max_age_seconds == 120
    with pytest.raises(ConfigError, match="client_max_age_seconds"):
        settingsFromString(base + "gateway: {websocket: {client_max_age_seconds: 30}}\n")


# -- R69 -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("passthrough", (1008, "client websocket idle timeout")),
        ("ctx_pool", (1000, "websocket idle timeout")),
        ("http_bridge", (1000, "websocket idle timeout")),
    ],
)
@pytest_twisted.ensureDeferred
async def test_idle_between_turns_close_per_mode(mode, expected):
    """
    R69, R70: a client idle after a turn is closed 1008 "client websocket
    idle timeout" in passthrough, 1000 "websocket idle timeout" otherwise.
    """
    stack = await startStack3(mode)
    setWebSocket(stack, inter_turn_idle_timeout_seconds=0.3)
    client = await connect(stack)
    try:
        t1 = await client.turn(userTurn("hi"))
        assert t1[-1]["type"] == "response.completed", t1
        assert await client.closed.addTimeout(4, reactor) == expected
    finally:
        await drain(stack, [client])


# -- R68 / R-B13 -----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_newer_connection_preempts_older_oauth_session():
    """
    R68, R-B13: a newer connection with the same (API key, session) on an
    OAuth account pre-empts the older one, which is closed 1001 "session
    preempted by a newer connection" even mid-turn and writes nothing to
    account state; a connection with another thread-id does not pre-empt;
    API-key accounts are never pre-empted.
    """
    from tests.integration.harness import startStack

    stack = await startStack(
        [{"id": "o1", "type": "oauth", "credential": "tok-o1"}],
        gateway="{websocket: {mode_default: ctx_pool}}",
    )
    session = {"session_id": "sess-r68"}
    old = await connect(stack, headers=session)
    new = other = None
    try:
        t1 = await old.turn(userTurn("old-one"))
        assert t1[-1]["type"] == "response.completed", t1
        stack.emulator.setFault(
            "tok-o1", {"kind": "delay_first_output", "seconds": 1.5, "times": 1, "transport": "ws"}
        )
        old.sendJSON(userTurn("old-two"))
        await sleep(0.2)
        new = await connect(stack, headers=session)
        t2 = await new.turn(userTurn("new-one"))
        assert t2[-1]["type"] == "response.completed", t2
        code, reason = await old.closed.addTimeout(4, reactor)
        assert (code, reason) == (1001, "session preempted by a newer connection")
        oldEvents = await old.collect()
        assert oldEvents[-1]["type"] == "__closed__"
        assert not any(e["type"] == "response.completed" for e in oldEvents), oldEvents
        states = await stack.app.store.getAccountStates(["o1"])
        assert states["o1"].unschedulable(stack.app.reactor.seconds()) is None
        other = await connect(stack, headers=dict(session, **{"thread-id": "thread-2"}))
        t3 = await other.turn(userTurn("other-thread"))
        assert t3[-1]["type"] == "response.completed", t3
        assert new.closeInfo is None and other.closeInfo is None
    finally:
        await drain(stack, [c for c in (old, new, other) if c is not None])


@pytest_twisted.ensureDeferred
async def test_apikey_sessions_are_not_preempted():
    """
    R68: pre-emption is for OAuth accounts only; two connections with the
    same session on an API-key account both keep working.
    """
    from tests.integration.harness import startStack

    stack = await startStack([{"id": "k1", "credential": "sk-k1"}])
    session = {"session_id": "sess-key"}
    first = await connect(stack, headers=session)
    second = None
    try:
        assert (await first.turn(userTurn("one")))[-1]["type"] == "response.completed"
        second = await connect(stack, headers=session)
        assert (await second.turn(userTurn("two")))[-1]["type"] == "response.completed"
        assert (await first.turn(userTurn("three")))[-1]["type"] == "response.completed"
        assert first.closeInfo is None and second.closeInfo is None
    finally:
        await drain(stack, [c for c in (first, second) if c is not None])


# -- R67 -------------------------------------------------------------------------


def breakerFailures(row) -> int:
    breaker = row.get("breaker")
    return int((breaker or {}).get("failures", 0)) if isinstance(breaker, dict) else 0


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough"])
@pytest_twisted.ensureDeferred
async def test_stale_connection_retried_once_on_a_new_one(mode):
    """
    R67: the upstream connection that served turn 1 breaks when turn 2 is
    sent (a read error before any output): the turn is retried once on a
    new connection of the same account and completes there; the broken
    connection is not the account's failure (no breaker count, no switch to
    C{b}). Only once: when the new connection breaks too, that failure
    counts (R-B1) and the turn fails over to C{b}.
    """
    from tests.integration.harness import startStack
    from tests.integration.parity import ADMIN, adminAccounts

    # One pooled connection for C{a}: ctx_pool lends turn 1's connection
    # (it holds a chain head, so only when no new one may be dialled, R-B11).
    accounts = threeAccounts(a={"concurrency": 1})
    stack = await startStack(
        accounts, extra=f"admin_key: {ADMIN}\n",
        gateway="{websocket: {mode_default: " + mode + ", pool_capacity_factor: 1}}")
    logged = []
    from twisted.logger import globalLogPublisher

    def observe(event):
        if event.get("event") in ("ingress_ws_turn_retry", "ingress_ws_turn_retry_skip"):
            logged.append(event)

    globalLogPublisher.addObserver(observe)
    client = await connect(stack)
    try:
        first = await client.turn(userTurn("one"))
        assert first[-1]["type"] == "response.completed", first
        stack.emulator.setFault("sk-a", {"kind": "reset_before_headers", "times": 1,
                                         "transport": "ws"})
        second = await client.turn(userTurn("two"))
        assert second[-1]["type"] == "response.completed", second
        assert len(stack.emulator.requestsFor("sk-a", "handshake")) == 2
        assert sent(stack, "sk-b") == []
        assert [(e["event"], e["stage"]) for e in logged] == [
            ("ingress_ws_turn_retry", "read_upstream")]
        row = (await adminAccounts(stack))["a"]
        assert row["schedulable"] is True and breakerFailures(row) == 0, row

        # Once only: when the new connection breaks too, that failure is the
        # account's (R-B1 counts it) and the turn fails over to b.
        stack.emulator.setFault("sk-a", {"kind": "reset_before_headers", "times": 2,
                                         "transport": "ws"})
        third = await client.turn(userTurn("three"))
        assert third[-1]["type"] == "response.completed", third
        assert len(sent(stack, "sk-b")) == 1
        assert [e["event"] for e in logged] == ["ingress_ws_turn_retry"] * 2
        assert breakerFailures((await adminAccounts(stack))["a"]) == 1
    finally:
        globalLogPublisher.removeObserver(observe)
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_strict_affinity_turn_not_retried_on_a_new_connection():
    """
    R67: a strict-affinity turn (C{store:false} with
    C{previous_response_id}: only its connection holds the chain) is not
    retried on a new connection when that connection breaks; relay logs
    C{ingress_ws_turn_retry_skip} (C{reason=strict_affinity}) and the
    engine's failover applies (the turn completes elsewhere from the
    connection's own history, R66/R76).
    """
    from twisted.logger import globalLogPublisher

    from tests.integration.harness import startStack

    stack = await startStack(
        threeAccounts(a={"concurrency": 1}),
        gateway="{websocket: {mode_default: ctx_pool, pool_capacity_factor: 1}}")
    logged = []

    def observe(event):
        if event.get("event") in ("ingress_ws_turn_retry", "ingress_ws_turn_retry_skip"):
            logged.append(event)

    globalLogPublisher.addObserver(observe)
    client = await connect(stack)
    try:
        first = await client.turn(userTurn("one"))
        rid = first[-1]["response"]["id"]
        stack.emulator.setFault("sk-a", {"kind": "reset_before_headers", "times": 1,
                                         "transport": "ws"})
        second = await client.turn(userTurn("two", previous=rid))
        assert second[-1]["type"] == "response.completed", second
        assert [(e["event"], e.get("reason")) for e in logged] == [
            ("ingress_ws_turn_retry_skip", "strict_affinity")]
        assert len(stack.emulator.requestsFor("sk-a", "handshake")) == 1
    finally:
        globalLogPublisher.removeObserver(observe)
        await drain(stack, [client])
