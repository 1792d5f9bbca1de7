"""
Issue 15: one request id, end to end, through a real relay and the real
emulator on loopback.

relay's id is its own and unique for every request and WebSocket turn
(R111): it comes back as C{X-Request-Id} and is on every relay log line of
the turn in both log formats -- including the lines written by code that
does not know the turn (health's cooldown, the scheduler), which get it
from the turn's context (L{relay.base.requestid.currentRequestId}). A client's
C{X-Request-Id} (or C{X-Client-Request-Id}) is kept as
C{client_request_id}: on the turn's end and access lines, in the request
log (C{/admin/requests?client_request_id=}, with each turn's own key), and
upstream as C{X-Client-Request-Id} on every attempt. The upstream's own id
comes back as C{X-Upstream-Request-Id}. WebSocket connections answer the
101 with the connection's id (relay's, new on every connection) and number
their turns C{<id>:<n>}.

The logs are captured with the real observers (L{relay.base.logs.observerFor})
on the global log publisher, limited to relay's own namespaces (the
in-process emulator's lines and Twisted's are not the relay's).
"""

from __future__ import annotations

import io
import json
import re

import attrs
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.logger import globalLogPublisher

from relay.base.logs import JSON_FIXED_KEYS, observerFor
from tests.integration.harness import RELAY_KEY, sseEvents, startStack

GOOD, BAD = "sk-good", "sk-bad"
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class RelayLogs:
    """
    The relay's log lines (text and JSON, through the real observers)
    while it is installed on the global publisher; C{seen(name)} fires
    when an event of that name has been logged.
    """

    def __init__(self):
        self.text = io.StringIO()
        self.json = io.StringIO()
        self._text = observerFor("text", self.text, ())
        self._json = observerFor("json", self.json, ())
        self._waiting = {}
        self.names = []

    def __call__(self, event):
        """
        Write a relay event through both observers (other namespaces are
        not the relay's lines).
        """
        namespace = event.get("log_namespace") or ""
        if not namespace.startswith("relay.") or namespace.startswith("relay.emulator"):
            return
        self._text(event)
        self._json(event)
        name = event.get("event")
        self.names.append(name)
        for d in self._waiting.pop(name, []):
            d.callback(None)

    def seen(self, name) -> Deferred:
        """
        @return: a Deferred firing once an event called C{name} was logged
            (at most 5 s).
        """
        if name in self.names:
            return Deferred.fromCoroutine(_done())
        d = Deferred()
        self._waiting.setdefault(name, []).append(d)
        return d.addTimeout(5, reactor)

    def __enter__(self):
        """
        Start capturing.
        """
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc):
        """
        Stop capturing.
        """
        globalLogPublisher.removeObserver(self)

    def textLines(self):
        """
        @return: the text lines written.
        """
        return self.text.getvalue().splitlines()

    def jsonRecords(self):
        """
        @return: the JSON lines written, parsed.
        """
        return [json.loads(line) for line in self.json.getvalue().splitlines()]


async def _done():
    """
    Nothing to wait for.
    """
    return None


async def _failoverStack():
    """
    BAD (preferred) answers 503, GOOD serves: one failover per turn.
    """
    stack = await startStack(
        [
            {"id": "bad", "credential": BAD, "priority": 1},
            {"id": "good", "credential": GOOD, "priority": 50},
        ]
    )
    stack.emulator.setFault(BAD, {"kind": "status", "code": 503})
    return stack


def _checkTurnLines(logs: RelayLogs, requestId: str) -> list:
    """
    Every relay text line carries C{req=<id>} and its event name; every
    JSON record carries C{request_id} and the fixed keys first.

    @return: the JSON records.
    """
    lines = [line for line in logs.textLines() if not line.startswith("\t")]
    assert lines
    for line in lines:
        assert f" req={requestId}] " in line, line
    records = logs.jsonRecords()
    assert len(records) == len(lines)
    for record in records:
        assert list(record)[: len(JSON_FIXED_KEYS)] == list(JSON_FIXED_KEYS), record
        assert record["request_id"] == requestId, record
        assert ISO_UTC.match(record["time"]), record
    return records


@pytest_twisted.ensureDeferred
async def test_client_id_end_to_end_with_a_failover():
    """
    Issue 15 "done when", with R111: a request with a client
    C{X-Request-Id} that fails over once gets relay's own id on the
    response and on every relay log line of the turn (text and JSON: the
    attempt's failure, the failover, the R11 streak line health writes
    without knowing the turn, the decisions, the turn's end, the access
    line); the client's id is the end and access lines'
    C{client_request_id} and reaches both upstream attempts as
    C{X-Client-Request-Id}.
    """
    stack = await _failoverStack()
    requestId = "client-abc.123:try-1"
    try:
        with RelayLogs() as logs:
            response, data = await stack.postJSON(
                "/v1/responses",
                {"model": "gpt-5.5", "input": "hi", "stream": True},
                headers={"X-Request-Id": [requestId]},
            )
            assert response.code == 200, data
            assert sseEvents(data)[-1][0] == "response.completed"
            await logs.seen("relay.turn_finished")
            await logs.seen("relay.http_access")
        (own,) = response.headers.getRawHeaders(b"x-request-id")
        assert re.match(rb"^req_[0-9a-f]+$", own), own
        upstreamId = response.headers.getRawHeaders(b"x-upstream-request-id")
        assert upstreamId and upstreamId[0].startswith(b"req_") and upstreamId[0] != requestId
        seen = [r.headers.get("x-client-request-id") for r in stack.emulator.requestsFor(BAD)]
        seen += [r.headers.get("x-client-request-id") for r in stack.emulator.requestsFor(GOOD)]
        assert seen == [requestId, requestId]
        records = _checkTurnLines(logs, own.decode())
        for record in records:
            if record["event"] in ("relay.turn_finished", "relay.http_access"):
                assert record["client_request_id"] == requestId, record
        names = {r["event"] for r in records}
        for name in (
            "openai.ops_event",
            "openai.upstream_failover_switching",
            "openai_model_transient_state",  # health.py: no request_id passed
            "openai.account_schedule_decision",
            "relay.turn_finished",
            "relay.http_access",
        ):
            assert name in names, (name, names)
        finished = next(r for r in records if r["event"] == "relay.turn_finished")
        assert finished["upstream_request_id"] == upstreamId[0].decode()
        failed = next(r for r in records if r["event"] == "openai.ops_event")
        assert failed["upstream_request_id"].startswith("req_")
        assert failed["upstream_request_id"] != finished["upstream_request_id"]
        text = "\n".join(logs.textLines())
        assert "[openai.upstream_failover_switching#warn req=" in text
        assert "[relay.turn_finished#info req=" in text
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_own_id_when_the_client_sends_none_or_a_bad_one():
    """
    Without a usable client id (none, or one with characters outside
    C{[A-Za-z0-9._:-]}, or longer than 128) relay assigns its own and keeps
    no client id; with X-Client-Request-Id the id is relay's too (R111).
    """
    stack = await _failoverStack()
    try:
        for headers in ({}, {"X-Request-Id": ["has space"]}, {"X-Request-Id": ["x" * 129]}):
            with RelayLogs() as logs:
                response, data = await stack.postJSON(
                    "/v1/responses", {"model": "gpt-5.5", "input": "hi"}, headers=headers
                )
                await logs.seen("relay.turn_finished")
            assert response.code == 200, data
            (own,) = response.headers.getRawHeaders(b"x-request-id")
            assert re.match(rb"^req_[0-9a-f]+$", own), own
            _checkTurnLines(logs, own.decode())
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi"},
            headers={"X-Client-Request-Id": ["thread-5f0e"]},
        )
        (own,) = response.headers.getRawHeaders(b"x-request-id")
        assert re.match(rb"^req_[0-9a-f]+$", own), own
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_relay_errors_carry_the_id():
    """
    relay's own answers carry the id too: 401, 404, 405, 426, a bad body
    (400), and relay's 429s when the one slot is busy (queue full, wait
    timeout), each in C{X-Request-Id} and as C{error.request_id} in the
    body; relay's own id, never the client's (R111).
    """
    stack = await startStack(
        [{"id": "good", "credential": GOOD, "concurrency": 1}],
        emulatorConfig={"default_script": {"text": "slow", "delay": 0.3, "deltas": 4}},
    )
    current = stack.app.settings.current
    stack.app.settings.current = attrs.evolve(
        current,
        scheduling=attrs.evolve(
            current.scheduling, fallback_max_waiting=1, fallback_wait_timeout=0.3
        ),
    )
    try:
        url = stack.url
        auth = {"Authorization": [f"Bearer {RELAY_KEY}"]}
        cases = [
            (401, treq.post(url + "/v1/responses", b"{}", headers={"X-Request-Id": ["e401"]})),
            (404, treq.get(url + "/nowhere", headers={"X-Request-Id": ["e404"]})),
            # With the key: without it a client route is a 401 first (R103).
            (405, treq.put(url + "/v1/responses", b"",
                           headers={**auth, "X-Request-Id": ["e405"]})),
            (426, treq.get(url + "/v1/responses", headers={**auth, "X-Request-Id": ["e426"]})),
            (400, treq.post(url + "/v1/responses", b"nope",
                            headers={**auth, "X-Request-Id": ["e400"]})),
        ]
        for status, d in cases:
            response = await d
            body = json.loads(await response.content())
            assert response.code == status
            (own,) = response.headers.getRawHeaders(b"x-request-id")
            assert re.match(rb"^req_[0-9a-f]+$", own), own
            assert body["error"]["request_id"] == own.decode()
        # One slot, one waiter: of three turns one is served, one finds the
        # queue full and one times out waiting (relay's own 429s, R32).
        results = await gatherResults([
            Deferred.fromCoroutine(stack.postJSON(
                "/v1/responses", {"model": "gpt-5.5", "input": f"q{i}", "stream": True},
                headers={"X-Request-Id": [f"turn-{i}"]},
            ))
            for i in range(3)
        ])
        refused = [(r, d) for r, d in results if r.code == 429]
        assert len(refused) == 2, [r.code for r, _ in results]
        for response, data in refused:
            (requestId,) = response.headers.getRawHeaders(b"x-request-id")
            assert requestId.startswith(b"req_")
            assert json.loads(data)["error"]["request_id"] == requestId.decode()
    finally:
        await stack.stop()


class _Client(WebSocketClientProtocol):
    """
    A WebSocket client that keeps the 101's headers.
    """

    def __init__(self):
        super().__init__()
        self.events = DeferredQueue()
        self.opened = Deferred()
        self.upgradeHeaders = {}

    def onConnect(self, response):
        """
        Keep the 101's headers.
        """
        self.upgradeHeaders = {k.lower(): v for k, v in response.headers.items()}

    def onOpen(self):
        """
        The handshake completed.
        """
        self.opened.callback(self)

    def onMessage(self, payload, isBinary):
        """
        Queue each event.
        """
        self.events.put(json.loads(payload))

    def onClose(self, wasClean, code, reason):
        """
        Fail a pending handshake; queue a close marker.
        """
        if not self.opened.called:
            self.opened.errback(Exception(f"handshake failed {code} {reason}"))
        self.events.put({"type": "__closed__", "code": code})

    async def turn(self, frame):
        """
        Send C{frame}; return the turn's terminal event (or the close).
        """
        self.sendMessage(json.dumps(frame).encode(), False)
        while True:
            event = await self.events.get().addTimeout(5, reactor)
            if event["type"] in ("response.completed", "response.failed", "error", "__closed__"):
                return event


async def _connect(stack, headers) -> _Client:
    """
    Open a client WebSocket to the relay with C{headers}.
    """
    port = stack.port.getHost().port
    factory = WebSocketClientFactory(
        f"ws://127.0.0.1:{port}/v1/responses",
        headers={"Authorization": f"Bearer {RELAY_KEY}", **headers},
        reactor=reactor,
    )
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(5, reactor)
    return proto


@pytest_twisted.ensureDeferred
async def test_websocket_connection_and_turn_ids():
    """
    The 101 carries the connection's id (relay's own, R111, whatever the
    client's C{x-client-request-id} -- Codex sends its thread id); turn n
    is C{<id>:<n>} on every relay line of that turn; the client's id
    reaches the upstream handshake as C{x-client-request-id}; the upstream
    handshake's statuses are counted like HTTP statuses (a refused 503,
    then a 101).
    """
    stack = await _failoverStack()
    stack.emulator.clearFaults()
    stack.emulator.setFault(BAD, {"kind": "ws_handshake_status", "code": 503})
    thread = "5f0e3c1a-0000-4000-8000-000000000001"
    try:
        client = await _connect(stack, {"x-client-request-id": thread, "session-id": thread})
        connId = client.upgradeHeaders.get("x-request-id")
        assert re.match(r"^ws_[0-9a-f]+$", connId), connId
        for n in (1, 2):
            with RelayLogs() as logs:
                event = await client.turn(
                    {"type": "response.create", "model": "gpt-5.5", "input": f"turn {n}"}
                )
                assert event["type"] == "response.completed", event
                await logs.seen("relay.turn_finished")
            records = _checkTurnLines(logs, f"{connId}:{n}")
            finished = next(r for r in records if r["event"] == "relay.turn_finished")
            assert finished["client_request_id"] == thread
        client.sendClose(1000)
        handshakes = stack.emulator.requestsFor(GOOD, "handshake")
        assert handshakes and handshakes[0].headers.get("x-client-request-id") == thread
        metrics = stack.app.extras["metrics"]
        text = metrics.registry.get_sample_value
        assert text("relay_upstream_status_total", {"status": "503"}) == 1
        assert text("relay_upstream_status_total", {"status": "101"}) >= 1
        assert text(
            "relay_failovers_total",
            {"from_account": "bad", "to_account": "good", "reason": "status_503"},
        ) >= 1
    finally:
        await stack.stop()


ADMIN = "request-id-admin-key-0123"


async def _tenantsStack():
    """
    Two client keys and the admin API on one account.
    """
    keys = [{"name": name, "key": "sk-" + name, "concurrency": 0} for name in ("alice", "bob")]
    return await startStack([{"id": "good", "credential": GOOD}], keys=json.dumps(keys),
                            extra=f"admin_key: {ADMIN}\n")


async def _requests(stack, query: str) -> list:
    response = await treq.get(stack.url + "/admin/requests?" + query,
                              headers={"Authorization": [f"Bearer {ADMIN}"]})
    body = await response.json()
    assert response.code == 200, body
    return body["requests"]


@pytest_twisted.ensureDeferred
async def test_two_keys_one_client_id_two_requests():
    """
    R111: two keys sending the same C{X-Request-Id} (even one in relay's
    own C{req_} format) get two distinct relay ids; each relay id finds
    exactly its own key's record; C{client_request_id=} finds both, each
    with its own key; the client's id is no relay id; both upstream
    requests carry the client's id as C{X-Client-Request-Id}.
    """
    stack = await _tenantsStack()
    try:
        for shared in ("shared-7", "req_0123abcd"):
            ids = {}
            for name in ("alice", "bob"):
                response, data = await stack.postJSON(
                    "/v1/responses", {"model": "gpt-5.5", "input": "hi"}, key="sk-" + name,
                    headers={"X-Request-Id": [shared]})
                assert response.code == 200, data
                ids[name] = response.headers.getRawHeaders("x-request-id")[0]
            assert ids["alice"] != ids["bob"] and shared not in ids.values()
            for name, rid in ids.items():
                [record] = await _requests(stack, f"request_id={rid}")
                assert (record["key"], record["client_request_id"]) == (name, shared)
            found = await _requests(stack, f"client_request_id={shared}")
            assert sorted((r["key"], r["request_id"]) for r in found) == sorted(
                (name, rid) for name, rid in ids.items())
            assert await _requests(stack, f"request_id={shared}") == []
        sent = [r.headers.get("x-client-request-id") for r in stack.emulator.requestsFor(GOOD)]
        assert sent == ["shared-7"] * 2 + ["req_0123abcd"] * 2
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_reconnect_with_a_reused_id_gets_fresh_ids():
    """
    R111: Codex reconnects with the same C{x-client-request-id}; each
    connection gets a new id, so turn 1 of the second connection is not
    turn 1 of the first; both are found by the client's id, each by its
    own relay id.
    """
    stack = await _tenantsStack()
    thread = "5f0e3c1a-0000-4000-8000-000000000002"
    try:
        turns = []
        for _ in range(2):
            port = stack.port.getHost().port
            factory = WebSocketClientFactory(
                f"ws://127.0.0.1:{port}/v1/responses", reactor=reactor,
                headers={"Authorization": "Bearer sk-alice", "x-client-request-id": thread})
            factory.protocol = _Client
            client = await TCP4ClientEndpoint(reactor, "127.0.0.1", port,
                                              timeout=5).connect(factory)
            await client.opened.addTimeout(5, reactor)
            event = await client.turn({"type": "response.create", "model": "gpt-5.5",
                                       "input": "hi"})
            assert event["type"] == "response.completed", event
            turns.append(client.upgradeHeaders["x-request-id"] + ":1")
            client.sendClose(1000)
        assert turns[0] != turns[1]
        found = await _requests(stack, f"client_request_id={thread}")
        assert sorted(r["request_id"] for r in found) == sorted(turns)
        for rid in turns:
            [record] = await _requests(stack, f"request_id={rid}")
            assert (record["key"], record["client_request_id"]) == ("alice", thread)
    finally:
        await stack.stop()
