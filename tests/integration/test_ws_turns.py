"""
The Responses WebSocket through a real relay to the real emulator on
loopback, with a real autobahn client (behaviour.md group F, R-B3, R-B7,
section I; protocol.md 4).
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater

from tests.integration.harness import RELAY_KEY, closedPort, startStack

TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}


class _Client(WebSocketClientProtocol):
    def __init__(self):
        super().__init__()
        self.events = DeferredQueue()
        self.opened = Deferred()
        self.closed = Deferred()
        self.closeInfo = None

    def onOpen(self):
        self.opened.callback(self)

    def onMessage(self, payload, isBinary):
        self.events.put(json.loads(payload))

    def onClose(self, wasClean, code, reason):
        self.closeInfo = (code, reason)
        if not self.opened.called:
            self.opened.errback(Exception(f"handshake failed {code} {reason}"))
        if not self.closed.called:
            self.closed.callback((code, reason))
        self.events.put({"type": "__closed__", "code": code, "reason": reason})

    def sendJSON(self, frame):
        self.sendMessage(json.dumps(frame).encode(), False)

    async def next(self, timeout=5.0):
        return await self.events.get().addTimeout(timeout, reactor)

    async def turn(self, frame, timeout=5.0):
        """
        Send C{frame} and collect events until a terminal event or a close.
        """
        self.sendJSON(frame)
        return await self.collect(timeout)

    async def collect(self, timeout=5.0):
        events = []
        while True:
            event = await self.next(timeout)
            events.append(event)
            if event["type"] in TERMINAL or event["type"] == "__closed__":
                return events

    def bye(self):
        if self.state == self.STATE_OPEN:
            self.sendClose(1000)


async def connect(stack, key=RELAY_KEY, path="/v1/responses", headers=None) -> _Client:
    port = stack.port.getHost().port
    hdrs = {"Authorization": f"Bearer {key}"}
    hdrs.update(headers or {})
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}{path}", headers=hdrs, reactor=reactor)
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await proto.opened.addTimeout(5, reactor)
    return proto


async def drain(stack, clients=()) -> None:
    """
    Close clients, wait for WebSocket connections to drain (trap T24), close
    the upstream pool, then stop the stack.
    """
    for c in clients:
        c.bye()
    factory = stack.app.site.wsFactory
    for _ in range(200):
        if factory.getConnectionCount() == 0:
            break
        await deferLater(reactor, 0.01, lambda: None)
    await stack.app.extras["wsPool"].close()
    await stack.stop()


def gateway(mode="ctx_pool", extra=""):
    return "{websocket: {mode_default: " + mode + "}" + extra + "}"


def frames(stack, credential):
    return [r.body for r in stack.emulator.requestsFor(credential, "frame")]


def http(stack, credential):
    return [r.body for r in stack.emulator.requestsFor(credential, "request")]


PREWARM = {
    "type": "response.create",
    "model": "gpt-5.5",
    "generate": False,
    "store": False,
    "stream": True,
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "base"}]}],
}


def userTurn(text, previous=None, model="gpt-5.5"):
    frame = {
        "type": "response.create",
        "model": model,
        "store": False,
        "stream": True,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}],
    }
    if previous:
        frame["previous_response_id"] = previous
    return frame


MODES = ["ctx_pool", "passthrough", "http_bridge"]


# -- basic turns -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_prewarm_and_chained_turn(mode):
    """
    R49, R51, R52, R53: a prewarm then a chained turn complete in every
    mode; ctx_pool and passthrough forward the prewarm unchanged, the
    bridge answers it locally and expands the chain into full input.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway(mode))
    client = await connect(stack)
    try:
        warm = await client.turn(PREWARM)
        assert warm[0]["type"] == "response.created"
        assert warm[-1]["type"] == "response.completed"
        assert warm[-1]["response"]["output"] == []
        rid = warm[-1]["response"]["id"]
        assert rid.startswith("resp_")
        t1 = await client.turn(userTurn("hello", previous=rid))
        assert t1[-1]["type"] == "response.completed", t1
        assert any(e["type"] == "response.output_text.delta" for e in t1)
        if mode == "http_bridge":
            bodies = http(stack, "sk-a1")
            assert len(bodies) == 1
            assert "previous_response_id" not in bodies[0]
            assert "generate" not in bodies[0] and "type" not in bodies[0]
            texts = json.dumps(bodies[0]["input"])
            assert "base" in texts and "hello" in texts
        else:
            sent = frames(stack, "sk-a1")
            assert sent[0].get("generate") is False
            assert sent[1]["previous_response_id"] == rid
            assert len(sent[1]["input"]) == 1
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_unauthenticated_upgrade_is_401():
    """
    R47 step 2: a bad key is answered 401 JSON before the upgrade.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}])
    try:
        response = await treq.get(
            stack.url + "/v1/responses",
            headers={
                "Authorization": ["Bearer nope"],
                "Upgrade": ["websocket"],
                "Connection": ["Upgrade"],
                "Sec-WebSocket-Version": ["13"],
                "Sec-WebSocket-Key": ["dGhlIHNhbXBsZSBub25jZQ=="],
            },
        )
        body = await response.content()
        assert response.code == 401
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_openai_sdk_connect_chains_two_turns():
    """
    protocol.md 6, R49, R58: the official SDK's C{responses.connect()} runs
    two chained turns through relay on one WebSocket.
    """
    import openai
    from twisted.internet.threads import deferToThread

    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway("ctx_pool"))

    def run():
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=RELAY_KEY, max_retries=0)
        out = []
        with client.responses.connect() as conn:
            for text, previous in (("first", None), ("second", "PREV")):
                kwargs = {"model": "gpt-5.5", "input": text}
                if previous:
                    kwargs["previous_response_id"] = out[-1]
                conn.response.create(**kwargs)
                for event in conn:
                    if event.type == "response.completed":
                        out.append(event.response.id)
                        break
        return out

    try:
        ids = await deferToThread(run)
        assert len(ids) == 2 and ids[0] != ids[1]
        sent = frames(stack, "sk-a1")
        assert sent[1]["previous_response_id"] == ids[0]
    finally:
        await drain(stack)


# -- failures on the first turn ----------------------------------------------


async def ownedByThisKey(stack, responseId: str, accountId: str = "a") -> None:
    """
    Record C{responseId} as a response of the test key on C{accountId}
    (R104: relay refuses a chain it holds no owner for), as another relay
    process sharing the store, or an earlier connection, would have; its
    chain is on no upstream connection this relay has.
    """
    from relay.base.records import Turn

    turn = Turn(entrypoint="ws", endpoint="responses", client=stack.app.keys.keys[0],
                model="gpt-5.5", body={}, stream=True)
    await stack.app.scheduler.recordResponse(
        turn, responseId, stack.app.live.accounts.byId(accountId)
    )


def twoAccounts(port=None, deadFirst=True, **extra):
    dead = {"id": "a", "credential": "sk-a", "priority": 1}
    if port is not None:
        dead["base_url"] = f"http://127.0.0.1:{port}/v1"
    dead.update(extra)
    return [dead, {"id": "b", "credential": "sk-b", "priority": 50}]


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_dial_failure_without_status_switches_and_cools(mode):
    """
    R55, R6, R78: a refused dial on the first turn switches accounts,
    records the persistent cooldown (R4), and the turn completes; the client
    never sees a 1013/1011 while a healthy account can serve.
    """
    stack = await startStack(twoAccounts(closedPort()), gateway=gateway(mode))
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        states = await stack.app.store.getAccountStates(["a"])
        assert states["a"].blockedUntil > stack.app.reactor.seconds() + 500
        assert (frames(stack, "sk-b") or http(stack, "sk-b"))
    finally:
        await drain(stack, [client])


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_handshake_rejected_503_switches(mode):
    """
    R56: a first-turn handshake rejected with 503 runs the HTTP status rules
    (failover); the turn completes on the other account. (For http_bridge
    the same 503 arrives on the bridged HTTP request, R52.)
    """
    stack = await startStack(twoAccounts(), gateway=gateway(mode))
    kind = "status" if mode == "http_bridge" else "ws_handshake_status"
    stack.emulator.setFault("sk-a", {"kind": kind, "code": 503, "times": 10})
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        assert (frames(stack, "sk-b") or http(stack, "sk-b"))
        assert not frames(stack, "sk-a")
    finally:
        await drain(stack, [client])


# -- slots ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_full_slot_waits_then_completes(mode):
    """
    R60: a busy account slot makes the turn wait (same wait plan as HTTP)
    and then complete, with no close.
    """
    from twisted.logger import globalLogPublisher

    stack = await startStack([{"id": "a1", "credential": "sk-a1", "concurrency": 1}], gateway=gateway(mode))
    seen = []
    observer = lambda e: seen.append(e) if str(e.get("event", "")).startswith("openai.websocket_account_wait") else None
    globalLogPublisher.addObserver(observer)
    lease = await stack.app.admission.tryAcquire("account", "a1", 1)
    client = await connect(stack)
    try:
        client.sendJSON(userTurn("hi"))
        await deferLater(reactor, 0.3, lambda: None)
        assert client.events.pending == []
        lease.release()
        events = await client.collect()
        assert events[-1]["type"] == "response.completed", events
        assert client.closeInfo is None
        finished = [e for e in seen if e["event"] == "openai.websocket_account_wait_finished"]
        assert finished and finished[0]["outcome"] == "acquired"
        assert finished[0]["mode"] == mode and finished[0]["phase"] == "first_turn"
    finally:
        globalLogPublisher.removeObserver(observer)
        await drain(stack, [client])


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_client_gone_mid_wait_releases_everything(mode):
    """
    R2, R60, R63 tests: the client closing while its turn waits leaves no
    waiter, no held slot and no cooldown.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1", "concurrency": 1}], gateway=gateway(mode))
    lease = await stack.app.admission.tryAcquire("account", "a1", 1)
    client = await connect(stack)
    try:
        client.sendJSON(userTurn("hi"))
        await deferLater(reactor, 0.2, lambda: None)
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (1, 1)
        client.dropConnection(abort=True)
        await deferLater(reactor, 0.2, lambda: None)
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (1, 0)
        lease.release()
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (0, 0)
        states = await stack.app.store.getAccountStates(["a1"])
        assert states["a1"].blockedUntil == 0
        assert frames(stack, "sk-a1") == [] and http(stack, "sk-a1") == []
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_second_early_frame_while_waiting_closes_1013():
    """
    R63: while a turn waits, one further frame is held; a second one closes
    1013 "too many requests while retrying, please retry later", and the
    waiting turn's slot wait is withdrawn.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1", "concurrency": 1}])
    lease = await stack.app.admission.tryAcquire("account", "a1", 1)
    client = await connect(stack)
    try:
        client.sendJSON(userTurn("one"))
        client.sendJSON(userTurn("two"))
        client.sendJSON(userTurn("three"))
        code, reason = await client.closed.addTimeout(5, reactor)
        assert (code, reason) == (1013, "too many requests while retrying, please retry later")
        await deferLater(reactor, 0.1, lambda: None)
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (1, 0)
    finally:
        lease.release()
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_early_frame_is_processed_after_the_turn():
    """
    R63: the one held frame is processed as the next turn.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1", "concurrency": 1}])
    lease = await stack.app.admission.tryAcquire("account", "a1", 1)
    client = await connect(stack)
    try:
        client.sendJSON(userTurn("one"))
        client.sendJSON(userTurn("two"))
        await deferLater(reactor, 0.2, lambda: None)
        lease.release()
        first = await client.collect()
        second = await client.collect()
        assert first[-1]["type"] == second[-1]["type"] == "response.completed"
        assert first[-1]["response"]["id"] != second[-1]["response"]["id"]
    finally:
        await drain(stack, [client])


# -- later turns ---------------------------------------------------------------


def failTurns(stack, credential, mode, times=10):
    transport = "http" if mode == "http_bridge" else "ws"
    # A 503 error event pre-output is forwarded on ctx_pool (R49 step 5);
    # a rate-limit one fails over on every mode (R49, R8).
    stack.emulator.setFault(
        credential,
        {"kind": "status", "preset": "rate_limit", "times": times, "transport": transport},
    )


def inputTexts(body):
    return json.dumps(body.get("input"))


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_later_turn_failover_carries_the_current_turn(mode):
    """
    R61, R80: a later complete turn (no previous_response_id) that fails on
    its account is resent to the other account exactly as sent: the second
    account sees the current turn's input, never turn 1's.
    """
    stack = await startStack(twoAccounts(), gateway=gateway(mode))
    client = await connect(stack)
    try:
        t1 = await client.turn(userTurn("turn-one"))
        assert t1[-1]["type"] == "response.completed"
        failTurns(stack, "sk-a", mode)
        t2 = await client.turn(userTurn("turn-two"))
        assert t2[-1]["type"] == "response.completed", t2
        onB = frames(stack, "sk-b") or http(stack, "sk-b")
        assert len(onB) == 1
        assert "turn-two" in inputTexts(onB[0]) and "turn-one" not in inputTexts(onB[0])
        assert "previous_response_id" not in onB[0]
    finally:
        await drain(stack, [client])


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_later_chained_turn_failover_expands_history(mode):
    """
    R61, R62, R76: a chained later turn whose history relay holds moves to
    another account as earlier inputs + outputs + current input, with the
    chain id removed (relay itself expanded it).
    """
    stack = await startStack(twoAccounts(), gateway=gateway(mode))
    client = await connect(stack)
    try:
        t1 = await client.turn(userTurn("turn-one"))
        rid = t1[-1]["response"]["id"]
        failTurns(stack, "sk-a", mode)
        t2 = await client.turn(userTurn("turn-two", previous=rid))
        assert t2[-1]["type"] == "response.completed", t2
        onB = frames(stack, "sk-b") or http(stack, "sk-b")
        assert len(onB) == 1
        text = inputTexts(onB[0])
        assert "turn-one" in text and "turn-two" in text
        assert "Hello from the relay emulator" in text  # turn 1's output item
        assert "previous_response_id" not in onB[0]
    finally:
        await drain(stack, [client])


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_incomplete_history_gets_previous_response_not_found(mode):
    """
    R62, R66, R76, R77, R-B7: a chain relay never saw is not sent as if
    complete; the client gets the status-400 previous_response_not_found
    error event and then the close, so it resends full input.
    """
    stack = await startStack(twoAccounts(), gateway=gateway(mode))
    await ownedByThisKey(stack, "resp_from_elsewhere")
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("more", previous="resp_from_elsewhere"))
        error = events[0]
        assert error["type"] == "error"
        assert error["status"] == 400
        assert error["error"]["code"] == "previous_response_not_found"
        code, _ = await client.closed.addTimeout(5, reactor)
        assert code == 1011
        assert http(stack, "sk-a") == [] and http(stack, "sk-b") == []
        if mode != "http_bridge":
            # R76: the id was kept, never stripped into a fragment.
            sent = frames(stack, "sk-a")
            assert all(f.get("previous_response_id") == "resp_from_elsewhere" for f in sent)
    finally:
        await drain(stack, [client])


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough"])
@pytest_twisted.ensureDeferred
async def test_incomplete_history_never_moves_accounts(mode):
    """
    R62, R-B7: a later turn chained to a response relay cannot rebuild is
    not moved when its account fails; previous_response_not_found, then
    close.
    """
    stack = await startStack(twoAccounts(), gateway=gateway(mode))
    await ownedByThisKey(stack, "resp_from_elsewhere")
    client = await connect(stack)
    failTurns(stack, "sk-a", mode)
    try:
        events = await client.turn(userTurn("one", previous="resp_from_elsewhere"))
        assert events[0]["type"] == "error" and events[0]["status"] == 400
        assert events[0]["error"]["code"] == "previous_response_not_found"
        assert (await client.closed.addTimeout(5, reactor))[0] == 1011
        assert len(frames(stack, "sk-a")) == 1
        assert frames(stack, "sk-b") == []
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_ctx_pool_chain_stays_on_its_upstream_connection():
    """
    R49 step 2, R-B11: a store=false chained turn goes to the same upstream
    connection that produced the previous response.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway("ctx_pool"))
    c1 = await connect(stack)
    c2 = await connect(stack)
    try:
        r1 = (await c1.turn(userTurn("c1-one")))[-1]["response"]["id"]
        r2 = (await c2.turn(userTurn("c2-one")))[-1]["response"]["id"]
        e1 = await c1.turn(userTurn("c1-two", previous=r1))
        e2 = await c2.turn(userTurn("c2-two", previous=r2))
        assert e1[-1]["type"] == e2[-1]["type"] == "response.completed"
        chained = [f for f in frames(stack, "sk-a1") if f.get("previous_response_id")]
        assert {f["previous_response_id"] for f in chained} == {r1, r2}
    finally:
        await drain(stack, [c1, c2])


@pytest_twisted.ensureDeferred
async def test_ctx_pool_lost_connection_expands_full_input():
    """
    R49, R66: when the upstream connection holding the chain is gone and
    relay holds the complete history, the turn is sent as full input on a
    new connection instead of failing upstream.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway("ctx_pool"))
    client = await connect(stack)
    try:
        rid = (await client.turn(userTurn("one")))[-1]["response"]["id"]
        stack.emulator.dropConnections()
        await deferLater(reactor, 0.1, lambda: None)
        events = await client.turn(userTurn("two", previous=rid))
        assert events[-1]["type"] == "response.completed", events
        last = frames(stack, "sk-a1")[-1]
        assert "previous_response_id" not in last
        assert "one" in inputTexts(last) and "two" in inputTexts(last)
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_pool_busy_fails_over_without_cooldown():
    """
    R-B3: a ctx_pool acquire that hits its deadline switches accounts (no
    cooldown) instead of closing 1013.
    """
    stack = await startStack(
        [
            {"id": "a", "credential": "sk-a", "priority": 1, "concurrency": 2},
            {"id": "b", "credential": "sk-b", "priority": 50},
        ],
        gateway="{websocket: {mode_default: ctx_pool, pool_capacity_factor: 0.5},"
        " upstream: {connect_timeout_seconds: 1.0}}",
    )
    pool = stack.app.extras["wsPool"]
    account = next(a for a in stack.app.config.accounts if a.id == "a")
    held = await pool.acquire(account, {})
    client = await connect(stack)
    try:
        events = await client.turn(userTurn("hi"))
        assert events[-1]["type"] == "response.completed", events
        assert len(frames(stack, "sk-b")) == 1
        states = await stack.app.store.getAccountStates(["a"])
        assert states["a"].blockedUntil == 0
    finally:
        pool.release(held)
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_model_change_reselects_and_unknown_model_is_an_error_event():
    """
    R59, R79: a later turn naming a model only another account serves is
    reselected (no cooldown, no close); an unknown model gets an error
    event (400 model_not_found) and the connection stays open.
    """
    stack = await startStack(
        [
            {"id": "a", "credential": "sk-a", "priority": 1, "models": ["gpt-5.5"]},
            {"id": "b", "credential": "sk-b", "priority": 50, "models": ["gpt-5.4"]},
        ]
    )
    client = await connect(stack)
    try:
        assert (await client.turn(userTurn("one")))[-1]["type"] == "response.completed"
        t2 = await client.turn(userTurn("two", model="gpt-5.4"))
        assert t2[-1]["type"] == "response.completed"
        assert len(frames(stack, "sk-b")) == 1
        t3 = await client.turn(userTurn("three", model="nope-1"))
        assert t3[-1]["type"] == "error"
        assert t3[-1]["status"] == 400 and t3[-1]["error"]["code"] == "model_not_found"
        t4 = await client.turn(userTurn("four"))
        assert t4[-1]["type"] == "response.completed"
        assert client.closeInfo is None
    finally:
        await drain(stack, [client])


# -- protocol errors ----------------------------------------------------------


PROTOCOL_CASES = [
    (b"{not json", 1008, "invalid JSON payload", "invalid_json", None),
    (b"[1, 2]", 1008, "invalid JSON payload", "invalid_json", None),
    # issue 19 item 3: deep nesting is the client's mistake, not a RecursionError
    (b'{"type": "response.create", "model": "gpt-5.5", "input": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}", 1008, "invalid JSON payload: nested too deeply", "invalid_json", None),
    (json.dumps({"type": "response.create", "input": "x"}).encode(), 1008,
     "model is required in first response.create payload", "missing_required_parameter", "model"),
    (json.dumps({"type": "response.create", "model": "gpt-5.5", "previous_response_id": "msg_1"}).encode(),
     1008, "previous_response_id must be a response.id (resp_*), not a message id",
     "invalid_value", "previous_response_id"),
    # A field of the wrong type: R47's close reason; the event words it as
    # HTTP's 400 does (the JSON itself is valid).
    (json.dumps({"type": "response.create", "model": "gpt-5.5", "previous_response_id": 7}).encode(),
     1008, "invalid JSON payload", "invalid_type", "previous_response_id",
     "Invalid type for 'previous_response_id': expected a string, but got an integer instead."),
    (json.dumps({"type": "response.create", "model": 5}).encode(),
     1008, "invalid JSON payload", "invalid_type", "model",
     "Invalid type for 'model': expected a string, but got an integer instead."),
    (json.dumps({"type": "response.create", "model": "gpt-5.5", "background": "yes"}).encode(),
     1008, "invalid JSON payload", "invalid_type", "background",
     "Invalid type for 'background': expected a boolean, but got a string instead."),
    # RFC 8259 has no NaN or infinities (json.loads reads them).
    (b'{"type": "response.create", "model": "gpt-5.5", "temperature": NaN}', 1008,
     "invalid JSON payload", "invalid_json", None),
    (b'{"type": "response.create", "model": "gpt-5.5", "temperature": -Infinity}', 1008,
     "invalid JSON payload", "invalid_json", None),
    (json.dumps({"type": "response.append", "model": "gpt-5.5"}).encode(), 1008,
     "response.append is not supported in ws v2; use response.create with previous_response_id",
     "unsupported_request_type", "type"),
    (json.dumps({"type": "session.update", "model": "gpt-5.5"}).encode(), 1008,
     "unsupported websocket request type: session.update", "unsupported_request_type", "type"),
]


async def untilClosed(client, timeout=5.0) -> list:
    """
    Every event up to and including the close.
    """
    events = []
    while not events or events[-1]["type"] != "__closed__":
        events.append(await client.next(timeout))
    return events


def assertClientMistake(events, code, reason, errorCode=None, param=None, message=None):
    """
    R81: a genuine client mistake is told with a status-bearing C{error}
    event (400, C{invalid_request_error}; its message is C{message}, else
    the close reason) that arrives before the R70 close.
    """
    assert [e["type"] for e in events] == ["error", "__closed__"], events
    error, closed = events
    assert error["status"] == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == (message or reason)
    assert error["error"]["code"] == errorCode
    assert error["error"]["param"] == param
    assert (closed["code"], closed["reason"]) == (code, reason)


@pytest.mark.parametrize("payload,code,reason,errorCode,param,message",
                         [case + (None,) * (6 - len(case)) for case in PROTOCOL_CASES])
@pytest_twisted.ensureDeferred
async def test_protocol_errors_close_with_r70_codes(payload, code, reason, errorCode, param,
                                                    message):
    """
    R47 step 5, R40, R70, R81: bad first frames get a status-bearing error
    event, then close with the exact code and reason.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}])
    client = await connect(stack)
    try:
        client.sendMessage(payload, False)
        assert await client.closed.addTimeout(5, reactor) == (code, reason)
        assertClientMistake(await untilClosed(client), code, reason, errorCode, param, message)
        assert frames(stack, "sk-a1") == []
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_protocol_error_after_a_turn_also_gets_an_error_event():
    """
    R81, R70: a bad frame on a connection that already ran a turn is the
    same client mistake: error event, then close 1008.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}])
    client = await connect(stack)
    try:
        assert (await client.turn(userTurn("hi")))[-1]["type"] == "response.completed"
        client.sendMessage(json.dumps({"type": "response.append", "input": "x"}).encode(), False)
        assertClientMistake(
            await untilClosed(client), 1008,
            "response.append is not supported in ws v2; use response.create with previous_response_id",
            "unsupported_request_type", "type",
        )
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_processed_dropped_and_binary_json_accepted():
    """
    protocol.md 4.2: C{response.processed} is dropped silently, and a binary
    frame holding JSON is a normal turn (protocol.md 4.6: 1003 not used).
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}])
    client = await connect(stack)
    try:
        client.sendJSON({"type": "response.processed", "response_id": "resp_x"})
        client.sendMessage(json.dumps(userTurn("bin")).encode(), True)
        events = await client.collect()
        assert events[-1]["type"] == "response.completed"
        assert client.closeInfo is None
    finally:
        await drain(stack, [client])


@pytest_twisted.ensureDeferred
async def test_oversized_frame_closes_1009():
    """
    R47 step 4, R70: a frame above the read limit closes 1009.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-a1"}], gateway="{websocket: {max_frame_bytes: 2048}}"
    )
    client = await connect(stack)
    try:
        client.sendJSON(userTurn("x" * 5000))
        code, reason = await client.closed.addTimeout(5, reactor)
        assert code == 1009
        # R81: an oversized frame is a client mistake; the event comes first.
        assertClientMistake(await untilClosed(client), 1009, reason, "frame_too_large")
        assert frames(stack, "sk-a1") == []
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_first_frame_timeout_and_idle_timeout():
    """
    R47 step 5, R69: no first frame in time closes 1008 "missing first
    response.create message"; idle between turns closes 1000 "websocket
    idle timeout".
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-a1"}],
        gateway="{websocket: {client_first_message_timeout_seconds: 0.2,"
        " inter_turn_idle_timeout_seconds: 0.3}}",
    )
    c1 = await connect(stack)
    c2 = await connect(stack)
    try:
        assert (await c2.turn(userTurn("hi")))[-1]["type"] == "response.completed"
        assert await c1.closed.addTimeout(5, reactor) == (1008, "missing first response.create message")
        assert await c2.closed.addTimeout(5, reactor) == (1000, "websocket idle timeout")
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_ws_closed_is_logged():
    """
    The report tool reads C{relay.ws_closed} with code, reason and turns.
    """
    from twisted.logger import globalLogPublisher

    seen = []
    observer = lambda e: seen.append(e) if e.get("event") == "relay.ws_closed" else None
    globalLogPublisher.addObserver(observer)
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}])
    client = await connect(stack)
    try:
        await client.turn(userTurn("hi"))
        client.bye()
        await client.closed.addTimeout(5, reactor)
        await deferLater(reactor, 0.05, lambda: None)
        assert seen and seen[0]["turns"] == 1 and seen[0]["code"] == 1000
    finally:
        globalLogPublisher.removeObserver(observer)
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_websocket_off_everywhere_refuses_the_upgrade():
    """
    R48: with every account's mode off the upgrade is refused (426) so the
    client uses HTTP.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway("off"))
    try:
        response = await treq.get(
            stack.url + "/v1/responses",
            headers={
                "Authorization": [f"Bearer {RELAY_KEY}"],
                "Upgrade": ["websocket"],
                "Connection": ["Upgrade"],
                "Sec-WebSocket-Version": ["13"],
                "Sec-WebSocket-Key": ["dGhlIHNhbXBsZSBub25jZQ=="],
            },
        )
        await response.content()
        assert response.code == 426
    finally:
        await drain(stack)


@pytest_twisted.ensureDeferred
async def test_account_mode_off_closes_1008():
    """
    R48, R70: a selected account whose mode is off closes 1008 "websocket
    mode is disabled for this account".
    """
    stack = await startStack(
        [
            {"id": "a", "credential": "sk-a", "priority": 1, "ws_mode": "off"},
            {"id": "b", "credential": "sk-b", "priority": 50, "models": ["gpt-5.4"]},
        ]
    )
    client = await connect(stack)
    try:
        client.sendJSON(userTurn("hi"))
        code, reason = await client.closed.addTimeout(5, reactor)
        assert (code, reason) == (1008, "websocket mode is disabled for this account")
        assert frames(stack, "sk-a") == []
    finally:
        await drain(stack)
