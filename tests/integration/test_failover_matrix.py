"""
The failover matrix through a real relay and the real emulator on loopback
(issue 3): every transport fault the emulator and the OS can produce, and
every status row of the classification table (behaviour.md groups A-C),
asserting what the client saw, which accounts upstream saw, and the
cooldown state afterwards.

Transport rows x columns (apikey / oauth x non-stream / stream) run with two
accounts: C{bad} (preferred, faulty) and C{good}. Status rows run once with
only the faulty account (what the client sees on exhaustion, R15) and once
with a healthy second account (the switch, or no switch for pass-through
rows).
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from attrs import evolve

from tests.integration.harness import closedPort, sseEvents, startStack

BAD = "cred-bad"
GOOD = "cred-good"

#: seconds; the small timeouts the hanging rows need
SHORT = 0.4

PERSISTENT = "persistent"
TRANSIENT = "transient"

COLUMNS = [
    ("apikey", False),
    ("apikey", True),
    ("oauth", False),
    ("oauth", True),
]


def _accounts(kind, badBase=None, second=True, **extra):
    bad = {"id": "bad", "type": kind, "credential": BAD, "priority": 1, **extra}
    if badBase is not None:
        bad["base_url"] = badBase
    accounts = [bad]
    if second:
        accounts.append({"id": "good", "type": kind, "credential": GOOD, "priority": 50})
    return accounts


def _shorten(stack) -> None:
    """
    Small header and idle timeouts straight on the runtime settings object
    (the config file's ranges are for production).
    """
    s = stack.app.settings.current
    stack.app.settings.current = evolve(
        s,
        upstream=evolve(
            s.upstream,
            connect_timeout_seconds=SHORT,
            header_timeout_seconds=SHORT,
            stream_idle_timeout_seconds=SHORT,
        ),
    )


async def _post(stack, stream: bool, endpoint: str = "responses"):
    if endpoint == "chat":
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        return await stack.postJSON("/v1/chat/completions", body)
    body = {"model": "gpt-5.5", "input": "hi", "stream": stream}
    return await stack.postJSON("/v1/responses", body)


async def _state(stack, accountId):
    return (await stack.app.store.getAccountStates([accountId]))[accountId]


# -- transport rows -----------------------------------------------------------

#: (row id, how to break the bad account, class, whether output had started)
#: The break is C{("base", url)} for an address-level fault or C{("fault", spec)}.
TRANSPORT_ROWS = [
    ("refused", ("base", lambda kind: f"http://127.0.0.1:{closedPort()}/x"), PERSISTENT, False),
    ("unresolvable", ("base", lambda kind: "http://relay-test.invalid:1/v1"), PERSISTENT, False),
    ("reset_before_headers", ("fault", {"kind": "reset_before_headers"}), TRANSIENT, False),
    ("hang_before_headers", ("fault", {"kind": "hang_before_headers"}), TRANSIENT, False),
    ("hang_after_headers", ("fault", {"kind": "hang_after_headers"}), TRANSIENT, False),
    ("cut_before_output", ("fault", {"kind": "cut_after_events", "events": 2}), TRANSIENT, False),
    ("cut_after_output", ("fault", {"kind": "cut_after_events", "events": 5}), TRANSIENT, True),
]


def _cells():
    for row in TRANSPORT_ROWS:
        for kind, stream in COLUMNS:
            yield pytest.param(row, kind, stream, id=f"{row[0]}-{kind}-{'stream' if stream else 'json'}")


@pytest.mark.parametrize("row,kind,stream", list(_cells()))
@pytest_twisted.ensureDeferred
async def test_transport_matrix(row, kind, stream):
    """
    R1-R5, R17, R19, R23, R24: a transport-class fault on the preferred
    account. Before output: the turn switches and completes on C{good};
    persistent faults (refused, DNS) cool C{bad} for 10 minutes (R4),
    transient ones write nothing. After output on a streaming client: an
    in-stream C{response.failed} and no second attempt.

    A non-streaming API-key upstream cannot be cut "after output" (the JSON
    body is one write), so that cell behaves like a cut before output; a
    non-streaming OAuth turn (upstream streams, the client gets one JSON
    body) has written nothing to the client either, so it fails over
    (R19 step 2 counts bytes written to the client).
    """
    _name, (how, what), cls, afterOutput = row
    badBase = what(kind) if how == "base" else None
    stack = await startStack(_accounts(kind, badBase=badBase))
    try:
        _shorten(stack)
        if how == "fault":
            stack.emulator.setFault(BAD, what)
        now = stack.app.reactor.seconds()
        response, data = await _post(stack, stream)
        clientSawOutput = afterOutput and stream
        badSeen = len(stack.emulator.requestsFor(BAD))
        goodSeen = len(stack.emulator.requestsFor(GOOD))
        assert badSeen == (0 if how == "base" else 1)
        if clientSawOutput:
            assert response.code == 200
            events = sseEvents(data)
            types = [e[0] for e in events]
            assert "response.output_text.delta" in types
            assert types[-1] == "response.failed", types
            assert types.count("response.failed") == 1
            assert "response.completed" not in types
            assert goodSeen == 0
        else:
            assert response.code == 200, data
            if stream:
                types = [e[0] for e in sseEvents(data)]
                assert types[0] == "response.created"
                assert types[-1] == "response.completed", types
                # Nothing of the failed attempt leaked (R22 staging).
                assert types.count("response.created") == 1
            else:
                body = json.loads(data)
                assert body["status"] == "completed"
            assert goodSeen == 1
        state = await _state(stack, "bad")
        if cls == PERSISTENT:
            assert now + 595 <= state.blockedUntil <= stack.app.reactor.seconds() + 601
            assert "transport" in state.blockReason
        else:
            assert state.blockedUntil == 0
            assert stack.app.health.localBlock("bad") is None
        assert (await _state(stack, "good")).blockedUntil == 0
        load = await stack.app.admission.load("account", ["bad", "good"])
        assert load == {"bad": (0, 0), "good": (0, 0)}
    finally:
        await stack.stop()


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest.mark.parametrize("stream", [False, True])
@pytest_twisted.ensureDeferred
async def test_transport_exhaustion_single_account(kind, stream):
    """
    R5/R15: when every account fails at the transport level the client sees
    502 "Upstream service temporarily unavailable".
    """
    stack = await startStack(_accounts(kind, second=False))
    try:
        stack.emulator.setFault(BAD, {"kind": "reset_before_headers"})
        response, data = await _post(stack, stream)
        assert response.code == 502
        error = json.loads(data)["error"]
        assert error["message"] == "Upstream service temporarily unavailable"
        assert len(stack.emulator.requestsFor(BAD)) == 1
    finally:
        await stack.stop()


# -- status rows --------------------------------------------------------------

JSON_ERR = lambda message, type_="invalid_request_error", code=None: {
    "error": {"message": message, "type": type_, "code": code, "param": None}
}

#: id, account type, fault, fails over?, exhaustion (status, message or
#: None to skip, type or None), marking check on the bad account.
STATUS_ROWS = [
    ("401-apikey", "apikey", {"kind": "status", "preset": "unauthorized"}, True,
     (502, "Upstream authentication failed, please contact administrator", None), "disabled"),
    # R11: an OAuth account without a refresh token -> permanent error (one
    # with a refresh token refreshes, replays, then cools 10 min: see
    # tests/integration/test_oauth_refresh.py).
    ("401-oauth", "oauth", {"kind": "status", "preset": "unauthorized"}, True,
     (502, "Upstream authentication failed, please contact administrator", None), "disabled"),
    ("402", "apikey", {"kind": "status", "code": 402, "body": JSON_ERR("pay up", "billing_error")},
     True, (502, "Upstream request failed", None), "disabled"),
    ("403-cloudflare", "oauth", {"kind": "status", "preset": "cloudflare"}, True,
     (502, "Upstream access forbidden, please contact administrator", None), "none"),
    ("403-json", "apikey", {"kind": "status", "code": 403,
                            "body": JSON_ERR("Country not supported", "invalid_request_error",
                                             "unsupported_country")},
     True, (502, "Upstream access forbidden, please contact administrator", None), "blocked600"),
    ("405", "apikey", {"kind": "status", "code": 405, "body": JSON_ERR("Method not allowed")},
     True, (502, "Upstream request failed", None), "none"),
    ("413", "apikey", {"kind": "status", "code": 413, "body": JSON_ERR("Request too large")},
     True, (413, "Request payload is too large", "invalid_request_error"), "none"),
    ("429-usage-limit-apikey", "apikey", {"kind": "status", "preset": "usage_limit"}, True,
     (429, "Upstream rate limit exceeded, please retry later", "rate_limit_error"), "ratelimited7200"),
    ("429-rate-limit-retry-after-apikey", "apikey", {"kind": "status", "preset": "rate_limit"}, True,
     (429, "Upstream rate limit exceeded, please retry later", "rate_limit_error"), "ratelimited"),
    ("500", "apikey", {"kind": "status", "preset": "server_error"}, True,
     (502, "Upstream service temporarily unavailable", None), "none"),
    ("502", "apikey", {"kind": "status", "code": 502, "body": "<html>bad gateway</html>"}, True,
     (502, "Upstream service temporarily unavailable", None), "none"),
    ("503", "oauth", {"kind": "status", "code": 503, "body": JSON_ERR("unavailable", "server_error")},
     True, (502, "Upstream service temporarily unavailable", None), "none"),
    ("504", "apikey", {"kind": "status", "code": 504, "body": "gateway timeout"}, True,
     (502, "Upstream service temporarily unavailable", None), "none"),
    ("520", "apikey", {"kind": "status", "code": 520, "body": "origin error"}, True,
     (502, "Upstream request failed", None), "none"),
    ("529", "apikey", {"kind": "status", "code": 529, "body": JSON_ERR("Site overloaded", "server_error")},
     True, (503, "Upstream service overloaded, please retry later", None), "none"),  # R86.2
    ("access-state", "apikey", {"kind": "status", "code": 403,
                                "body": {"detail": {"code": "deactivated_workspace"}}}, True,
     (502, "Upstream access is temporarily unavailable, please retry later", None), "disabled"),
    ("cyber-policy", "apikey", {"kind": "status", "code": 400,
                                "body": JSON_ERR("This request was flagged", "invalid_request_error",
                                                 "cyber_policy")}, False,
     (400, "This request was flagged", None), "none"),
    ("context-window", "apikey", {"kind": "status", "code": 400,
                                  "body": JSON_ERR("Your input exceeds the context window of this model",
                                                   "invalid_request_error", "context_length_exceeded")},
     False, (400, "Your input exceeds the context window of this model", "invalid_request_error"), "none"),
    ("400-client-error", "apikey", {"kind": "status", "code": 400,
                                    "body": JSON_ERR("Invalid value for 'temperature'", "invalid_request_error",
                                                     "invalid_value")},
     False, (400, "Invalid value for 'temperature'", "invalid_request_error"), "none"),
    ("404", "apikey", {"kind": "status", "code": 404, "body": JSON_ERR("Not found", "invalid_request_error")},
     False, (502, "Upstream request failed", "upstream_error"), "none"),
    ("409", "oauth", {"kind": "status", "code": 409, "body": JSON_ERR("Conflict")},
     False, (502, "Upstream request failed", "upstream_error"), "none"),
    ("422", "apikey", {"kind": "status", "code": 422, "body": JSON_ERR("Unprocessable")},
     False, (502, "Upstream request failed", "upstream_error"), "none"),
]


async def _checkMarking(stack, check, now):
    state = await _state(stack, "bad")
    later = stack.app.reactor.seconds()
    if check == "none":
        assert state.blockedUntil == 0 and not state.disabled, state
        assert state.rateLimitedUntil == 0 and state.overloadedUntil == 0, state
    elif check == "disabled":
        assert state.disabled, state
    elif check == "blocked600":
        assert now + 595 <= state.blockedUntil <= later + 601, state
    elif check == "overloaded600":
        assert now + 595 <= state.overloadedUntil <= later + 601, state
    elif check == "ratelimited7200":
        # R12 rule 1: the x-codex primary window is at 100 %: its reset.
        assert now + 7190 <= state.rateLimitedUntil <= later + 7201, state
    elif check == "ratelimited":
        assert state.rateLimitedUntil > now, state
    else:  # pragma: no cover
        raise AssertionError(check)


@pytest.mark.parametrize("row", STATUS_ROWS, ids=[r[0] for r in STATUS_ROWS])
@pytest_twisted.ensureDeferred
async def test_status_exhaustion(row):
    """
    R8, R9, R11, R12, R15: with only the failing account, the client sees
    the mapped status and message, the account is marked as R11 says, and a
    pass-through status is sent once, unchanged where R9 says so.
    """
    name, kind, fault, _failover, (status, message, etype), marking = row
    stack = await startStack(_accounts(kind, second=False))
    try:
        stack.emulator.setFault(BAD, fault)
        now = stack.app.reactor.seconds()
        response, data = await _post(stack, stream=True)
        assert response.code == status, data
        body = json.loads(data)
        assert body["error"]["message"] == message
        if etype is not None:
            assert body["error"]["type"] == etype
        if name == "cyber-policy":
            # R9 step 1: the upstream body unchanged.
            assert body == fault["body"]
        if name == "429-rate-limit-retry-after-apikey":
            # R16: a safe Retry-After is copied.
            assert response.headers.getRawHeaders(b"retry-after") == [b"2"]
        assert len(stack.emulator.requestsFor(BAD)) == 1
        await _checkMarking(stack, marking, now)
    finally:
        await stack.stop()


@pytest.mark.parametrize("row", STATUS_ROWS, ids=[r[0] for r in STATUS_ROWS])
@pytest_twisted.ensureDeferred
async def test_status_switch(row):
    """
    R8, R19 step 7: a failover status moves the turn to the healthy
    account; a pass-through status answers the client without touching the
    second account.
    """
    _name, kind, fault, failover, (status, _message, _etype), _marking = row
    stack = await startStack(_accounts(kind))
    try:
        stack.emulator.setFault(BAD, fault)
        response, data = await _post(stack, stream=True)
        assert len(stack.emulator.requestsFor(BAD)) == 1
        if failover:
            assert response.code == 200, data
            assert sseEvents(data)[-1][0] == "response.completed"
            assert len(stack.emulator.requestsFor(GOOD)) == 1
        else:
            assert response.code == status, data
            assert stack.emulator.requestsFor(GOOD) == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_status_403_counter_disables_on_third():
    """
    R11 403 row: JSON 403s count per account; the first two cool the
    account for 10 minutes, the third disables it.
    """
    stack = await startStack(_accounts("apikey", second=False))
    try:
        stack.emulator.setFault(BAD, {"kind": "status", "code": 403, "body": JSON_ERR("Forbidden")})
        for n in (1, 2, 3):
            # Lift the previous cooldown so the next request reaches the
            # account; the 180-minute counter survives (an operator's clear
            # would reset it too).
            await stack.app.store.markAccount("bad", "temp_unschedulable", 0, "")
            stack.app.health._blocks.clear()
            response, _data = await _post(stack, stream=False)
            assert response.code == 502
        state = await _state(stack, "bad")
        assert state.disabled
        assert len(stack.emulator.requestsFor(BAD)) == 3
    finally:
        await stack.stop()


# -- same-account retries through the real relay --------------------------------


@pytest_twisted.ensureDeferred
async def test_overload_retries_same_account_with_backoff():
    """
    R8 capacity shed, R14: an overload (server_is_overloaded) is retried on
    the same account after 0.5 s, never cools the account, and does not
    touch the second account.
    """
    stack = await startStack(_accounts("apikey"))
    try:
        stack.emulator.setFault(
            BAD,
            {"kind": "status", "code": 503, "times": 1,
             "body": JSON_ERR("Servers are overloaded", "server_error", "server_is_overloaded")},
        )
        start = stack.app.reactor.seconds()
        response, data = await _post(stack, stream=True)
        assert response.code == 200
        assert sseEvents(data)[-1][0] == "response.completed"
        seen = stack.emulator.requestsFor(BAD)
        assert len(seen) == 2
        assert stack.emulator.requestsFor(GOOD) == []
        assert stack.app.reactor.seconds() - start >= 0.45
        await _checkMarking(stack, "none", start)
    finally:
        await stack.stop()


@pytest.mark.parametrize("code", [400, 503])
@pytest_twisted.ensureDeferred
async def test_overload_exhaustion_is_503_with_upstream_text(code):
    """
    R8 capacity shed, R15 step 5: exhausted overloads answer 503
    C{server_error} with the upstream overload text; no cooldown.
    """
    stack = await startStack(_accounts("apikey", second=False, pool_mode_retry_count=1))
    try:
        stack.emulator.setFault(
            BAD,
            {"kind": "status", "code": code,
             "body": JSON_ERR("Our servers are currently overloaded", "server_error",
                              "server_is_overloaded")},
        )
        now = stack.app.reactor.seconds()
        response, data = await _post(stack, stream=False)
        assert response.code == 503, data
        error = json.loads(data)["error"]
        assert error["type"] == "server_error"
        assert error["message"] == "Our servers are currently overloaded"
        assert len(stack.emulator.requestsFor(BAD)) == 2  # 1 + one same-account retry
        await _checkMarking(stack, "none", now)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_oauth_429_retries_same_account_inside_window():
    """
    R13: an OAuth 429 inside its 2-minute window retries the same account
    (0.5 s without Retry-After) and marks nothing.
    """
    stack = await startStack(_accounts("oauth"))
    try:
        stack.emulator.setFault(BAD, {"kind": "status", "preset": "usage_limit", "times": 1})
        now = stack.app.reactor.seconds()
        response, data = await _post(stack, stream=True)
        assert response.code == 200, data
        assert len(stack.emulator.requestsFor(BAD)) == 2
        assert stack.emulator.requestsFor(GOOD) == []
        await _checkMarking(stack, "none", now)
    finally:
        await stack.stop()


@pytest.mark.parametrize("second", [False, True])
@pytest_twisted.ensureDeferred
async def test_oauth_429_after_window_marks_and_switches(second):
    """
    R12, R13: once the OAuth window has ended, the next 429 marks the
    account rate-limited until the x-codex reset and switches; it is not
    retried on the same account again. Alone, the client sees 429.
    """
    stack = await startStack(_accounts("oauth", second=second))
    try:
        stack.emulator.setFault(BAD, {"kind": "status", "preset": "usage_limit"})
        now = stack.app.reactor.seconds()
        stack.app.health._oauth429["bad"] = now - 121  # the window opened 2 min ago
        response, data = await _post(stack, stream=False)
        assert len(stack.emulator.requestsFor(BAD)) == 1
        if second:
            assert response.code == 200, data
            assert len(stack.emulator.requestsFor(GOOD)) == 1
        else:
            assert response.code == 429, data
            assert json.loads(data)["error"]["type"] == "rate_limit_error"
        await _checkMarking(stack, "ratelimited7200", now)
    finally:
        await stack.stop()


# -- chat completions: the real status (R10) -------------------------------------

CHAT_ROWS = [
    (400, JSON_ERR("bad temperature"), "invalid_request_error"),
    (404, JSON_ERR("no such model"), "not_found_error"),
    (422, JSON_ERR("unprocessable"), "invalid_request_error"),
]


@pytest.mark.parametrize("code,body,etype", CHAT_ROWS, ids=[str(r[0]) for r in CHAT_ROWS])
@pytest_twisted.ensureDeferred
async def test_chat_passes_real_status(code, body, etype):
    """
    R10: chat completions answer a non-failover error with the real
    upstream status, its R10 type and the upstream message.
    """
    stack = await startStack(_accounts("apikey"))
    try:
        stack.emulator.setFault(BAD, {"kind": "status", "code": code, "body": body})
        response, data = await _post(stack, stream=False, endpoint="chat")
        assert response.code == code, data
        error = json.loads(data)["error"]
        assert error["type"] == etype
        assert error["message"] == body["error"]["message"]
        assert stack.emulator.requestsFor(GOOD) == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_exhaustion_maps_like_responses():
    """
    R15 on chat completions: an exhausted 500 is 502 "Upstream service
    temporarily unavailable".
    """
    stack = await startStack(_accounts("apikey", second=False))
    try:
        stack.emulator.setFault(BAD, {"kind": "status", "preset": "server_error"})
        response, data = await _post(stack, stream=True, endpoint="chat")
        assert response.code == 502, data
        assert json.loads(data)["error"]["message"] == "Upstream service temporarily unavailable"
    finally:
        await stack.stop()
