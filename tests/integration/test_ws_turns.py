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
    return "{websocket: {mode_default: %s}%s}" % (mode, extra)


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
