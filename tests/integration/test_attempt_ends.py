"""
The five reproductions of issue 11 ("one bookkeeping for every attempt's
end"), each through a real relay and the emulator on loopback:

  1. clients that leave mid-turn write no account state (R2, R-B1), over
     HTTP and over the WebSocket in every mode, whichever way they leave;
  2. the demo's shape (preferred C{a2} answers 503): HTTP and every
     WebSocket mode mark C{a2} the same way (R11 streak, R86.1, R86.2), and
     the siblings (R86.2 C{response.failed}, R86.3 cuts for JSON clients,
     R86.4 clean WebSocket closes);
  3. the operator view shows every block the scheduler honours, and
     C{clear} resets the streak too;
  4. a chat stream holds back and fails over like a Responses stream (R84);
  5. "no account" answers carry a retry hint and name the reason (R83).
"""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.logger import globalLogPublisher

from tests.integration import parity as P
from tests.integration.harness import sseEvents
from tests.integration.test_ws_turns import userTurn

MODES = ["ctx_pool", "passthrough", "http_bridge"]
HOWS = ["rst", "fin", "close"]

SLOW = 0.05
"""Seconds between the slow upstream's events (issue 11 item 1). A client leaves
after the first text delta; about six events (0.3 s) are still to come, and
the relay, the emulator and the client share one reactor, so the departure is
seen long before the turn could end. Each turn, drained to its end (R107),
costs about ten events: the wait per turn is 10 x SLOW."""

A1, A2 = "sk-emu-a1", "sk-emu-a2"
DEMO_503 = {"kind": "status", "preset": "unavailable"}
"""etc/emulator.yaml: C{a2} answers 503 to every request, forever."""


def demoAccounts(**a2Extra):
    """
    The demo's accounts (etc/demo.yaml): C{a2} preferred, C{a1} behind it.
    """
    return [{"id": "a2", "credential": A2, "priority": 10, **a2Extra},
            {"id": "a1", "credential": A1, "priority": 20}]


def show(row) -> str:
    """
    An admin row in full, for assertion messages.
    """
    return json.dumps(row, sort_keys=True, default=str)


async def admin(stack, method, path):
    response = await treq.request(method, stack.url + path,
                                  headers={"Authorization": [f"Bearer {P.ADMIN}"]})
    body = await response.content()
    assert response.code == 200, body
    return json.loads(body)


async def storeModelBlock(stack, accountId, model=P.MODEL) -> float:
    """
    Seconds left on the stored model block of an account (0 when none).
    """
    runtime = (await stack.app.store.getAccountStates([accountId]))[accountId]
    return max(0.0, runtime.modelBlocks.get(model, 0) - stack.app.reactor.seconds())


def modelBlocks(row, model=P.MODEL) -> list:
    """
    The view's model-scoped blocks for C{model} (issue 11 item 3 field names).
    """
    return [b for b in row.get("blocks") or []
            if b.get("scope") == "model" and b.get("model") == model]


def assertModelBlocked(row, seconds, streak, model=P.MODEL):
    """
    The operator view reports the account unschedulable for the model with
    the block's model, reason, until (Unix and ISO-8601 UTC) and seconds
    left, and the R11 streak.
    """
    assert row["schedulable"] is False, show(row)
    assert row.get("reason"), show(row)
    blocks = modelBlocks(row, model)
    assert len(blocks) == 1, show(row)
    block = blocks[0]
    assert block.get("reason"), block
    left = block["until"] - reactor.seconds()
    assert seconds - 2 <= left <= seconds + 0.5, block
    assert seconds - 2 <= block["seconds_left"] <= seconds + 0.5, block
    iso = datetime.fromisoformat(block["until_iso"])
    assert iso.utcoffset() is not None and iso.utcoffset().total_seconds() == 0, block
    assert abs(iso.timestamp() - block["until"]) < 1, block
    assert (row.get("streaks") or {}).get(model) == streak, show(row)


# -- 1. departed clients ------------------------------------------------------------


async def _assertUntouched(stack, accountId="a"):
    """
    The account shows no trace of departed clients: schedulable, no reason,
    no breaker failures, nothing in the store.
    """
    view = await P.adminAccounts(stack)
    row = view[accountId]
    assert row["schedulable"] is True, show(row)
    assert row["reason"] is None, show(row)
    breaker = row.get("breaker") or {}
    assert not breaker.get("failures") and not breaker.get("opens"), show(row)
    runtime = (await stack.app.store.getAccountStates([accountId]))[accountId]
    assert runtime.blockedUntil == 0 and not runtime.disabled, runtime


@pytest_twisted.ensureDeferred
async def test_departed_http_clients_write_nothing():
    """
    R2, R-B1: one API-key account, concurrency 2, a slow upstream; three
    streaming clients in a row close their connection after the first text
    delta. The fourth, ordinary request is served (200, completed), and
    C{/admin/accounts} shows the account schedulable with no breaker
    failures: a departure is not an upstream transport failure.
    """
    accounts = [{"id": "a", "credential": "cred-a", "concurrency": 2}]
    stack = await P.startParityStack("http_sse", accounts)
    try:
        stack.emulator.setScript("cred-a", {"delay": SLOW})
        for n in range(3):
            await P.leaveMidTurn(stack, "http_sse", "fin", credential="cred-a")
            await P.settle(stack, n + 1)
        assert P.departures(stack) == 3
        await _assertUntouched(stack)
        stack.emulator.setScript("cred-a", None)
        response, data = await stack.postJSON(
            "/v1/responses", {"model": P.MODEL, "input": "hi", "stream": True})
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        await P.settle(stack, 4)
        await _assertUntouched(stack)
    finally:
        await P.drain(stack)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_departed_websocket_clients_write_nothing(mode, how):
    """
    R2, R-B1: 20 WebSocket clients (four at a time on an account with four
    slots) leave mid-turn after the first text delta: with an RST
    (C{abortConnection}), a FIN without a close frame (C{loseConnection}),
    or a close frame 1000. The account stays schedulable with no breaker
    failures, and the next turn is served by it.
    """
    accounts = [{"id": "a", "credential": "cred-a", "concurrency": 4}]
    ep = "ws_" + mode
    stack = await P.startParityStack(ep, accounts)
    clients = []
    try:
        stack.emulator.setScript("cred-a", {"delay": SLOW})
        for wave in range(5):
            leavers = [await P.startLeaver(stack, ep) for _ in range(4)]
            for leaver in leavers:
                await P.waitForOutput(stack, ep, leaver, "cred-a")
            for leaver in leavers:
                P.leaveNow(ep, leaver, how)
            await P.settle(stack, 4 * (wave + 1))
            await _assertUntouched(stack)
        assert P.departures(stack) == 20
        await _assertUntouched(stack)
        stack.emulator.setScript("cred-a", None)
        outcome, client = await P.oneTurn(stack, ep, faulty="a")
        clients.append(client)
        assert (outcome.kind, outcome.servedBy) == ("served_same", "a"), outcome
        await P.settle(stack, 21)
        await _assertUntouched(stack)
    finally:
        await P.drain(stack, clients)


# -- 2. the demo's shape: the same 503, the same marking ---------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest_twisted.ensureDeferred
async def test_demo_http_503_streak_view_and_clear(stream):
    """
    R11 streak, issue 11 items 2 and 3, over HTTP: C{a2} (preferred)
    answers 503, every request is served by C{a1}. The first 503 blocks
    nothing (streak 1); the second blocks C{a2} for gpt-5.5 for 10 s, the
    third (after that block ran out) for 45 s; each time the store holds
    the model block and C{/admin/accounts} shows C{a2} unschedulable for
    the model with model, reason, until (Unix and ISO-8601 UTC), seconds
    left and the streak. C{POST /admin/accounts/a2/clear} resets the
    streak too: the next single 503 blocks nothing.
    """
    stack = await P.startParityStack("http_sse" if stream else "http_json", demoAccounts())
    try:
        stack.emulator.setFault(A2, DEMO_503)

        async def request(n):
            outcome, _ = await P.oneTurn(stack, "http_sse" if stream else "http_json",
                                         faulty="a2")
            assert (outcome.kind, outcome.servedBy) == ("served_by_other", "a1"), outcome
            await P.settle(stack, n)
            return (await P.adminAccounts(stack))["a2"]

        row = await request(1)
        assert await storeModelBlock(stack, "a2") == 0
        assert row["schedulable"] is True and modelBlocks(row) == [], show(row)
        assert (row.get("streaks") or {}).get(P.MODEL) == 1, show(row)

        row = await request(2)
        assert 8 <= await storeModelBlock(stack, "a2") <= 10
        assertModelBlocked(row, 10, 2)

        # The 10 s pass: expire the stored block (the streak counter stays).
        now = stack.app.reactor.seconds()
        await stack.app.store.markAccount("a2", "model_block", now - 1, "expired by the test",
                                          P.MODEL)
        row = await request(3)
        assert 43 <= await storeModelBlock(stack, "a2") <= 45
        assertModelBlocked(row, 45, 3)

        await admin(stack, "POST", "/admin/accounts/a2/clear")
        row = (await P.adminAccounts(stack))["a2"]
        assert row["schedulable"] is True and not row.get("blocks"), show(row)
        assert not (row.get("streaks") or {}).get(P.MODEL), show(row)
        row = await request(4)
        assert await storeModelBlock(stack, "a2") == 0
        assert row["schedulable"] is True, show(row)
        assert (row.get("streaks") or {}).get(P.MODEL) == 1, show(row)
    finally:
        await P.drain(stack)


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_demo_websocket_503_marks_like_http(mode):
    """
    R86.1, R86.2 (issue 11 item 2): the demo's 503 over the WebSocket. In
    ctx_pool and passthrough it arrives as an in-band C{error} event with
    C{status: 503}; in http_bridge as an HTTP 503. Every turn (one per
    connection, like Codex's) is served by C{a1}, never closed 1011, and
    after two turns C{a2} is blocked for gpt-5.5 for 10 s with streak 2,
    exactly as after two HTTP requests.
    """
    ep = "ws_" + mode
    stack = await P.startParityStack(ep, demoAccounts())
    clients = []
    try:
        stack.emulator.setFault(A2, DEMO_503)
        rows, blocks = [], []
        for n in (1, 2):
            outcome, client = await P.oneTurn(stack, ep, faulty="a2")
            clients.append(client)
            assert (outcome.kind, outcome.servedBy) == ("served_by_other", "a1"), outcome
            await P.settle(stack, n)
            rows.append((await P.adminAccounts(stack))["a2"])
            blocks.append(await storeModelBlock(stack, "a2"))
        if mode != "http_bridge":
            frames = stack.emulator.requestsFor(A2, "frame")
            assert len(frames) == 2, frames  # the 503s really were in-band events
        # The engine first (the store), then what the operator sees.
        assert blocks[0] == 0 and 8 <= blocks[1] <= 10, blocks
        assert rows[0]["schedulable"] is True, show(rows[0])
        assert (rows[0].get("streaks") or {}).get(P.MODEL) == 1, show(rows[0])
        assertModelBlocked(rows[1], 10, 2)
    finally:
        await P.drain(stack, clients)


@pytest.mark.parametrize("ep", P.ENTRYPOINTS)
@pytest_twisted.ensureDeferred
async def test_failed_server_error_adds_to_streak(ep):
    """
    R86.2: a pre-output C{response.failed} with C{server_error} (a chat
    error chunk with C{server_error}; a 500 for a non-stream request) fails
    over and adds to the R11 streak on every entrypoint: after two turns the
    account is blocked for the model for 10 s.
    """
    stack = await P.startParityStack(ep, demoAccounts())
    clients = []
    try:
        stack.emulator.setFault(A2, {"kind": "stream_error", "code": "server_error",
                                     "transport": P.upstreamTransport(ep)})
        for n in (1, 2):
            outcome, client = await P.oneTurn(stack, ep, faulty="a2")
            if client is not None:
                clients.append(client)
            assert (outcome.kind, outcome.servedBy) == ("served_by_other", "a1"), outcome
            await P.settle(stack, n)
        assert 8 <= await storeModelBlock(stack, "a2") <= 10
        assertModelBlocked((await P.adminAccounts(stack))["a2"], 10, 2)
    finally:
        await P.drain(stack, clients)


@pytest.mark.parametrize("kind,ep", [("apikey", "http_sse"), ("apikey", "http_json"),
                                     ("oauth", "http_sse"), ("oauth", "http_json")])
@pytest_twisted.ensureDeferred
async def test_cut_after_output_counts_for_breaker(kind, ep):
    """
    R86.3: an upstream cut after the upstream began its answer is an
    upstream transport failure for the R-B1 breaker whether the client
    streams (it gets an in-stream failure) or waits for JSON (it never saw
    output, so it fails over, R19 step 2). The breaker of C{a2} shows one
    failure either way.
    """
    accounts = [dict(a, type=kind) for a in demoAccounts()]
    stack = await P.startParityStack(ep, accounts)
    try:
        stack.emulator.setFault(A2, {"kind": "cut_after_events", "events": 5})
        outcome, _ = await P.oneTurn(stack, ep, faulty="a2")
        expected = ("served_by_other", None)
        if ep == "http_sse":
            expected = ("terminal_error", "in-stream")
        assert outcome.key() == expected, outcome
        await P.settle(stack, 1)
        row = (await P.adminAccounts(stack))["a2"]
        assert (row.get("breaker") or {}).get("failures") == 1, show(row)
    finally:
        await P.drain(stack)


@pytest.mark.parametrize("ep", ["http_sse", "ws_ctx_pool", "ws_passthrough", "ws_http_bridge"])
@pytest.mark.parametrize("events", [2, 5], ids=["before-output", "after-output"])
@pytest_twisted.ensureDeferred
async def test_clean_end_is_not_a_breaker_failure(ep, events):
    """
    R86.3, R86.4: an upstream that ends cleanly without a terminal event (an
    HTTP body that ends; a WebSocket closed with 1000 mid-turn) is a stream
    failure, never a breaker failure: before output the turn fails over,
    after it the client gets the failure, and C{a2}'s breaker stays at 0
    on every entrypoint.
    """
    stack = await P.startParityStack(ep, demoAccounts())
    clients = []
    try:
        stack.emulator.setFault(A2, {"kind": "end_after_events", "events": events,
                                     "transport": P.upstreamTransport(ep)})
        outcome, client = await P.oneTurn(stack, ep, faulty="a2")
        if client is not None:
            clients.append(client)
        if events == 2:
            assert (outcome.kind, outcome.servedBy) == ("served_by_other", "a1"), outcome
        else:
            assert outcome.kind in ("terminal_error", "retryable_close"), outcome
        await P.settle(stack, 1)
        row = (await P.adminAccounts(stack))["a2"]
        assert not (row.get("breaker") or {}).get("failures"), show(row)
        assert row["schedulable"] is True, show(row)
    finally:
        await P.drain(stack, clients)


# -- 3. the operator view tells the truth ---------------------------------------------

#: marking -> (fault on C{bad}, how many requests, reason class in the view)
MARKINGS = {
    "streak_model_block": ({"kind": "status", "code": 503,
                            "body": {"error": {"message": "unavailable", "type": "server_error"}}},
                           2, "streak"),
    "rate_limited": ({"kind": "status", "preset": "usage_limit"}, 1, "rate_limited"),
    "disabled_401": ({"kind": "status", "preset": "unauthorized"}, 1, "disabled"),
    "cooldown_403": ({"kind": "status", "code": 403,
                      "body": {"error": {"message": "Forbidden", "type": "request_forbidden"}}},
                     1, "403_cooldown"),
    "transport_refused": (None, 1, "transport"),
    "breaker_open": ({"kind": "reset_before_headers"}, 3, "breaker"),
}


@pytest.mark.parametrize("marking", sorted(MARKINGS))
@pytest_twisted.ensureDeferred
async def test_operator_view_agrees_with_scheduler(marking):
    """
    Issue 11 "operator truth": for every marking the engine writes, the
    operator view reports the account unschedulable (with the reason class)
    while the scheduler skips it: the next request never reaches it. Then
    C{clear} makes it schedulable, and the scheduler uses it again.
    """
    fault, count, reason = MARKINGS[marking]
    accounts = [{"id": "bad", "credential": P.BAD, "priority": 1},
                {"id": "good", "credential": P.GOOD, "priority": 50}]
    if fault is None:
        accounts[0]["base_url"] = f"http://127.0.0.1:{P.closedPort()}/v1"
    stack = await P.startParityStack("http_sse", accounts)
    try:
        if fault is not None:
            stack.emulator.setFault(P.BAD, fault)
        for n in range(count):
            outcome, _ = await P.oneTurn(stack, "http_sse")
            assert outcome.servedBy == "good", outcome
        await P.settle(stack, count)
        row = (await P.adminAccounts(stack))["bad"]
        assert row["schedulable"] is False, show(row)
        assert P.reasonClass(row) == reason, show(row)
        seen = len(stack.emulator.requestsFor(P.BAD))
        outcome, _ = await P.oneTurn(stack, "http_sse")
        assert outcome.servedBy == "good", outcome
        assert len(stack.emulator.requestsFor(P.BAD)) == seen  # the scheduler skipped it
        await admin(stack, "POST", "/admin/accounts/bad/clear")
        stack.emulator.setFault(P.BAD, None)
        row = (await P.adminAccounts(stack))["bad"]
        assert row["schedulable"] is True and P.reasonClass(row) == "ok", show(row)
        if fault is not None:
            outcome, _ = await P.oneTurn(stack, "http_sse")
            assert outcome.servedBy == "bad", outcome
    finally:
        await P.drain(stack)


# -- 4. chat streams hold back ------------------------------------------------------------


@pytest.mark.parametrize("ep", ["chat_stream", "http_sse"])
@pytest_twisted.ensureDeferred
async def test_stream_holds_back_and_fails_over(ep):
    """
    R84, R22, R23, R8 (issue 11 item 4): C{a}'s stream sends its role chunk
    (Responses: C{response.created}), then an error with
    C{server_is_overloaded}, then ends. The client gets 200 and one stream
    from C{b}: one role chunk, no error chunk, no relay error, C{[DONE]} (a
    Responses stream: one C{response.created}, C{response.completed} by
    C{b}).
    """
    accounts = [{"id": "a", "credential": "cred-a", "priority": 1,
                 "pool_mode_retry_count": 0},  # switch at once (R14), no backoff
                {"id": "b", "credential": "cred-b", "priority": 50}]
    stack = await P.startParityStack(ep, accounts)
    try:
        stack.emulator.setFault("cred-a", {"kind": "stream_error", "code": "server_is_overloaded",
                                           "message": "Our servers are currently overloaded."})
        if ep == "chat_stream":
            body = {"model": P.MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}
            response, data = await stack.postJSON("/v1/chat/completions", body)
            assert response.code == 200, data
            outcome = P.chatOutcome(data, "a")
            assert outcome.detail == "roles=1 errors=0 done=True", data
            assert data.rstrip().endswith(b"data: [DONE]"), data
        else:
            outcome, _ = await P.oneTurn(stack, ep, faulty="a")
        assert (outcome.kind, outcome.servedBy) == ("served_by_other", "b"), outcome
        assert len(stack.emulator.requestsFor("cred-a")) == 1
        assert len(stack.emulator.requestsFor("cred-b")) == 1
    finally:
        await P.drain(stack)


# -- 5. "no account" answers --------------------------------------------------------------

#: case -> (a1's marking, a2's marking, HTTP status); a1 ends 42 s from now,
#: a2 100 s from now, so the earliest is 42 s away.
COOLING = {
    "model_blocked": ("model_block", "model_block", 503),
    "temp_blocked": ("temp_unschedulable", "temp_unschedulable", 503),
    "rate_limited": ("rate_limited", "rate_limited", 429),
    "mixed": ("rate_limited", "temp_unschedulable", 503),
}


async def _cool(stack, case):
    first, second, _status = COOLING[case]
    now = stack.app.reactor.seconds()
    for accountId, kind, until in (("a1", first, now + 42), ("a2", second, now + 100)):
        model = P.MODEL if kind == "model_block" else None
        await stack.app.store.markAccount(accountId, kind, until, f"test {kind}", model)


def _assertHint(message, seconds):
    """
    The R83 message: the count, the model and "available in N s".
    """
    assert re.search(r"\b2\b", message), message
    assert P.MODEL in message, message
    match = re.search(r"available in (\d+) s", message)
    assert match, message
    assert int(match.group(1)) == seconds, message


@pytest.mark.parametrize("case", sorted(COOLING))
@pytest_twisted.ensureDeferred
async def test_no_account_answer_has_retry_hint(case):
    """
    R44, R83 (issue 11 item 5): every account for the model is cooling. The
    client gets 503 (429 when every one is rate-limited) with
    C{Retry-After} = whole seconds until the earliest is schedulable, and a
    message naming the count, the model and that time; the
    C{openai.account_select_no_available} log line names every account.
    """
    events = []
    globalLogPublisher.addObserver(events.append)
    stack = await P.startParityStack("http_json", demoAccounts())
    try:
        await _cool(stack, case)
        response, data = await stack.postJSON("/v1/responses", {"model": P.MODEL, "input": "hi"})
        assert response.code == COOLING[case][2], data
        header = response.headers.getRawHeaders(b"retry-after")
        assert header is not None, data
        seconds = int(header[0])
        assert seconds in (41, 42), header
        _assertHint(json.loads(data)["error"]["message"], seconds)
        assert stack.emulator.requests == []
        lines = [e for e in events if e.get("event") == "openai.account_select_no_available"]
        assert lines, "no openai.account_select_no_available line"
        text = repr({k: v for k, v in lines[-1].items() if not k.startswith("log_")})
        assert "a1" in text and "a2" in text, text
    finally:
        globalLogPublisher.removeObserver(events.append)
        await P.drain(stack)


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_no_account_websocket_close_has_retry_hint(mode):
    """
    R83, R44: on the WebSocket the same condition closes 1013 with the same
    text (count, model, "available in N s").
    """
    stack = await P.startParityStack("ws_" + mode, demoAccounts())
    client = None
    try:
        await _cool(stack, "model_blocked")
        client = await P.connectNew(stack)
        client.sendJSON(userTurn("hi"))
        events = await P.collectTurn(client)
        kind, data = events[-1]
        assert kind == "__closed__", events
        assert data["code"] == 1013, data
        match = re.search(r"available in (\d+) s", data["reason"])
        assert match and int(match.group(1)) in (41, 42), data
        _assertHint(data["reason"], int(match.group(1)))
    finally:
        await P.drain(stack, [client] if client is not None else [])
