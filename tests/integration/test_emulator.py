"""
Real-socket tests of L{relay.emulator.Emulator} on 127.0.0.1: SSE, JSON, Chat Completions,
faults, the Responses WebSocket and the official C{openai} SDK.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.web.client import Agent, HTTPConnectionPool

from relay.emulator import Emulator

TOOL_SCRIPT = {"tool_call": {"name": "exec_command", "arguments": {"cmd": "echo hi"}},
               "text": "Tool said: {output}"}

CONFIG = {
    "accept_any": False,
    "accounts": [
        {"name": "a1", "credential": "sk-emu-a1"},
        {"name": "a2", "credential": "sk-emu-a2", "script": TOOL_SCRIPT},
        {"name": "a3", "credential": "oauth-emu-a3"},
    ],
}


@pytest_twisted.async_yield_fixture
async def emulator():
    """
    An emulator listening on an ephemeral loopback port; stopped (connections drained)
    afterwards.
    """
    emu = Emulator(reactor=reactor, config=CONFIG)
    await emu.listen(reactor)
    yield emu
    await emu.stop()


@pytest_twisted.async_yield_fixture
async def http():
    """
    A treq client without persistent connections.
    """
    pool = HTTPConnectionPool(reactor, persistent=False)
    yield treq.client.HTTPClient(Agent(reactor, pool=pool))
    await pool.closeCachedConnections()


def _auth(credential: str) -> dict:
    """
    Authorization headers.

    @param credential: the bearer token.
    @rtype: L{dict}
    """
    return {"Authorization": "Bearer " + credential, "Content-Type": "application/json"}


def _sse(text: str) -> list[tuple[str, dict]]:
    """
    Parse an SSE body into C{(event, data)} pairs.

    @param text: the body.
    @rtype: L{list}
    """
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


class _WSClient(WebSocketClientProtocol):
    """
    A test WebSocket client that queues decoded events and records the close.
    """

    def __init__(self) -> None:
        """
        Set up the queue.
        """
        super().__init__()
        self.events: DeferredQueue = DeferredQueue()
        self.closeCode = None

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        """
        Queue one event.

        @param payload: the JSON frame.
        @param isBinary: ignored.
        """
        self.events.put(json.loads(payload))

    def onClose(self, wasClean: bool, code: int, reason: str) -> None:
        """
        Record the close and wake up readers.

        @param wasClean: whether the close was clean.
        @param code: the close code.
        @param reason: the reason.
        """
        self.closeCode = code
        self.events.put(None)

    async def send(self, frame: dict) -> None:
        """
        Send one frame.

        @param frame: the JSON object.
        """
        self.sendMessage(json.dumps(frame).encode())

    async def turn(self) -> list[dict]:
        """
        Read events up to a terminal event, an error event or the close.

        @return: the events (with L{None} last if the connection closed).
        """
        out = []
        while True:
            event = await self.events.get().addTimeout(2, reactor)
            out.append(event)
            if event is None or event["type"] in (
                    "response.completed", "response.failed", "error"):
                return out

    async def close(self) -> None:
        """
        Close cleanly and wait for the close to finish.
        """
        if self.state == self.STATE_OPEN:
            self.sendClose()
        await self.is_closed


async def _connect(emu: Emulator, credential: str, path: str = "/v1/responses") -> _WSClient:
    """
    Open a WebSocket to the emulator.

    @param emu: the emulator.
    @param credential: the bearer token.
    @param path: the upgrade path.
    @rtype: L{_WSClient}
    """
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{emu.port}{path}", reactor=reactor,
                                     headers={"Authorization": "Bearer " + credential})
    factory.protocol = _WSClient
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", emu.port).connect(factory)
    await proto.is_open.addTimeout(2, reactor)
    return proto


class _RawHTTP(Protocol):
    """
    Sends raw request bytes and collects the answer until the peer closes.
    """

    def __init__(self, request: bytes) -> None:
        """
        @param request: the bytes to send.
        """
        self.request = request
        self.data = b""
        self.done: Deferred = Deferred()

    def connectionMade(self) -> None:
        """
        Send the request.
        """
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        """
        Collect the answer; stop at the end of the headers of a non-101 answer.

        @param data: bytes.
        """
        self.data += data
        if b"\r\n\r\n" in self.data and not self.done.called:
            self.transport.loseConnection()

    def connectionLost(self, reason) -> None:
        """
        Report what was received.

        @param reason: why.
        """
        if not self.done.called:
            self.done.callback(self.data)


@pytest_twisted.ensureDeferred
async def test_sseTextTurn(emulator, http):
    """
    A streaming Responses request gets §2.3 SSE events with matching C{event:} and C{type},
    numbered in order, ending with C{response.completed} and no C{[DONE]}.
    """
    response = await http.post(emulator.baseURL() + "/responses", json.dumps(
        {"model": "gpt-5.5", "input": "hi", "stream": True}).encode(),
        headers=_auth("sk-emu-a1"))
    assert response.code == 200
    assert response.headers.getRawHeaders("content-type") == ["text/event-stream"]
    text = await response.text()
    assert "[DONE]" not in text
    events = _sse(text)
    assert all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    assert "a1" in deltas and "sk-emu-a1" not in text
    assert final["usage"]["input_tokens"] > 0
    [record] = emulator.requestsFor("a1")
    assert record.peer == "127.0.0.1" and record.body["stream"] is True
    assert emulator.peak("a1") == 1 and emulator.inflight("a1") == 0


@pytest_twisted.ensureDeferred
async def test_functionCallTurn(emulator, http):
    """
    With a tool script, a fresh turn streams a C{function_call}; the follow-up carrying the
    C{function_call_output} gets text with the tool output.
    """
    response = await http.post(emulator.baseURL() + "/responses", json.dumps(
        {"model": "gpt-5.5", "input": "run it", "stream": True}).encode(),
        headers=_auth("sk-emu-a2"))
    events = _sse(await response.text())
    item = events[-1][1]["response"]["output"][0]
    assert item["type"] == "function_call" and item["name"] == "exec_command"
    assert json.loads(item["arguments"]) == {"cmd": "echo hi"}
    follow = await http.post(emulator.baseURL() + "/responses", json.dumps({
        "model": "gpt-5.5", "stream": True, "input": [
            {"type": "message", "role": "user", "content": "run it"}, item,
            {"type": "function_call_output", "call_id": item["call_id"], "output": "hi\n"}]
    }).encode(), headers=_auth("sk-emu-a2"))
    events = _sse(await follow.text())
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "Tool said: hi"


@pytest_twisted.ensureDeferred
async def test_nonStreamJSON(emulator, http):
    """
    A non-stream request gets one JSON response object with usage.
    """
    response = await http.post(emulator.baseURL() + "/responses", json.dumps(
        {"model": "gpt-5.5", "input": "hi"}).encode(), headers=_auth("sk-emu-a1"))
    body = json.loads(await response.text())
    assert response.code == 200
    assert body["id"].startswith("resp_") and body["status"] == "completed"
    assert set(body["usage"]) >= {"input_tokens", "output_tokens", "total_tokens"}


@pytest_twisted.ensureDeferred
async def test_chatStream(emulator, http):
    """
    A streaming chat request gets data-only chunks, a usage chunk with empty choices when
    C{include_usage} is set, and C{data: [DONE]}.
    """
    response = await http.post(emulator.baseURL() + "/chat/completions", json.dumps({
        "model": "gpt-5.5", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers=_auth("sk-emu-a1"))
    text = await response.text()
    assert "event:" not in text
    lines = [line[len("data: "):] for line in text.strip().split("\n\n")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


@pytest_twisted.ensureDeferred
async def test_oauthNonStream(emulator, http):
    """
    The OAuth route answers a non-stream request with 400 C{Stream must be set to true}.
    """
    response = await http.post(emulator.baseURL("oauth") + "/responses", json.dumps(
        {"model": "gpt-5.5", "input": "hi"}).encode(), headers=_auth("oauth-emu-a3"))
    assert response.code == 400
    assert json.loads(await response.text()) == {"detail": "Stream must be set to true"}


@pytest_twisted.ensureDeferred
async def test_statusFault(emulator, http):
    """
    A 529 overloaded fault answers once with its body, then the account heals.
    """
    emulator.setFault("a1", {"kind": "status", "preset": "overloaded", "times": 1})
    body = json.dumps({"model": "gpt-5.5", "input": "hi"}).encode()
    response = await http.post(emulator.baseURL() + "/responses", body,
                               headers=_auth("sk-emu-a1"))
    assert response.code == 529
    assert json.loads(await response.text())["error"]["code"] == "server_is_overloaded"
    again = await http.post(emulator.baseURL() + "/responses", body, headers=_auth("sk-emu-a1"))
    assert again.code == 200
    await again.text()


@pytest_twisted.ensureDeferred
async def test_resetBeforeHeaders(emulator, http):
    """
    C{reset_before_headers} aborts the connection: the client gets a connection error.
    """
    emulator.setFault("sk-emu-a1", {"kind": "reset_before_headers"})
    with pytest.raises(Exception):
        await http.post(emulator.baseURL() + "/responses", b'{"input":"hi"}',
                        headers=_auth("sk-emu-a1"))


@pytest_twisted.ensureDeferred
async def test_cutAfterEvents(emulator, http):
    """
    C{cut_after_events} sends K events and drops the connection without a terminal event.
    """
    emulator.setFault("a1", {"kind": "cut_after_events", "events": 3})
    response = await http.post(emulator.baseURL() + "/responses", json.dumps(
        {"input": "hi", "stream": True}).encode(), headers=_auth("sk-emu-a1"))
    assert response.code == 200
    with pytest.raises(Exception):
        await response.text()
    assert emulator.inflight("a1") == 0


@pytest_twisted.ensureDeferred
async def test_endAfterEvents(emulator, http):
    """
    C{end_after_events} sends K events and then ends the body I{cleanly} (the chunked body
    is complete) without a terminal event, on Responses and Chat Completions streams.
    """
    emulator.setFault("a1", {"kind": "end_after_events", "events": 2})
    response = await http.post(emulator.baseURL() + "/responses", json.dumps(
        {"input": "hi", "stream": True}).encode(), headers=_auth("sk-emu-a1"))
    assert response.code == 200
    events = _sse(await response.text())
    assert [e for e, _ in events] == ["response.created", "response.in_progress"]
    response = await http.post(emulator.baseURL() + "/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode(),
        headers=_auth("sk-emu-a1"))
    body = await response.text()
    chunks = [line for line in body.split("\n") if line.startswith("data: ")]
    assert len(chunks) == 2 and "[DONE]" not in body
    assert emulator.inflight("a1") == 0


@pytest.mark.parametrize("path", ["/responses", "/chat/completions"])
@pytest_twisted.ensureDeferred
async def test_nonStreamBreaks(emulator, http, path):
    """
    On a non-stream request C{cut_after_events} sends 200, the headers and half the JSON
    body, then drops the connection (a read error mid-body); C{end_after_events} ends the
    same half body cleanly; C{stream_error} is an HTTP 500 with the code in the envelope.
    """
    body = {"input": "hi", "messages": [{"role": "user", "content": "hi"}]}
    emulator.setFault("a1", [
        {"kind": "cut_after_events", "events": 3, "times": 1},
        {"kind": "end_after_events", "events": 3, "times": 1},
        {"kind": "stream_error", "code": "server_is_overloaded", "times": 1}])
    response = await http.post(emulator.baseURL() + path, json.dumps(body).encode(),
                               headers=_auth("sk-emu-a1"))
    assert response.code == 200
    with pytest.raises(Exception):
        await response.content()
    response = await http.post(emulator.baseURL() + path, json.dumps(body).encode(),
                               headers=_auth("sk-emu-a1"))
    assert response.code == 200
    text = await response.text()
    assert text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)
    response = await http.post(emulator.baseURL() + path, json.dumps(body).encode(),
                               headers=_auth("sk-emu-a1"))
    assert response.code == 500
    error = json.loads(await response.text())["error"]
    assert (error["type"], error["code"]) == ("server_error", "server_is_overloaded")
    assert emulator.inflight("a1") == 0


@pytest_twisted.ensureDeferred
async def test_webSocketChain(emulator):
    """
    Over the WebSocket: a prewarm gets an empty completed response; a turn chained to it gets
    the scripted call; the tool output chained to that gets text; an id from elsewhere gets
    the C{previous_response_not_found} error event.
    """
    client = await _connect(emulator, "sk-emu-a2")
    try:
        await client.send({"type": "response.create", "model": "gpt-5.5", "generate": False,
                           "stream": True, "input": []})
        prewarm = await client.turn()
        assert [e["type"] for e in prewarm] == ["response.created", "response.completed"]
        assert prewarm[-1]["response"]["output"] == []
        await client.send({"type": "response.create", "stream": True, "input": [
            {"type": "message", "role": "user", "content": "go"}],
            "previous_response_id": prewarm[0]["response"]["id"]})
        first = await client.turn()
        call = first[-1]["response"]["output"][0]
        assert call["type"] == "function_call"
        assert first[-1]["response"]["model"] == "gpt-5.5"
        await client.send({"input": [{"type": "function_call_output",
                                      "call_id": call["call_id"], "output": "hi\n"}],
                           "previous_response_id": first[-1]["response"]["id"]})
        second = await client.turn()
        assert second[-1]["response"]["output"][0]["content"][0]["text"] == "Tool said: hi"
        await client.send({"type": "response.create", "input": [],
                           "previous_response_id": "resp_elsewhere"})
        [error] = await client.turn()
        assert error["type"] == "error" and error["status"] == 400
        assert error["error"]["code"] == "previous_response_not_found"
        assert error["error"]["message"] == "Previous response with id 'resp_elsewhere' not found."
        frames = emulator.requestsFor("a2", kind="frame")
        assert len(frames) == 4 and frames[0].transport == "ws"
        assert emulator.peak("a2") == 1 and emulator.inflight("a2") == 0
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_webSocketFaults(emulator):
    """
    A status fault on a WebSocket turn becomes an C{error} event with that status; a cut
    closes the connection abnormally after K events.
    """
    emulator.setFault("a1", [
        {"kind": "status", "preset": "usage_limit", "times": 1, "transport": "ws"},
        {"kind": "cut_after_events", "events": 2, "times": 1}])
    client = await _connect(emulator, "sk-emu-a1")
    try:
        await client.send({"type": "response.create", "model": "gpt-5.5", "input": "hi"})
        [error] = await client.turn()
        assert error["status"] == 429
        assert error["error"]["type"] == "usage_limit_reached"
        assert error["headers"]["x-codex-primary-used-percent"] == "100"
        await client.send({"type": "response.create", "model": "gpt-5.5", "input": "hi"})
        events = await client.turn()
        assert events[-1] is None and len(events) == 3
        assert client.closeCode == 1006
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_webSocketCleanCloseMidTurn(emulator):
    """
    C{end_after_events} on a WebSocket turn sends K events and then closes the connection
    cleanly with code 1000, in the middle of the turn.
    """
    emulator.setFault("a1", {"kind": "end_after_events", "events": 2, "times": 1})
    client = await _connect(emulator, "sk-emu-a1")
    try:
        await client.send({"type": "response.create", "model": "gpt-5.5", "input": "hi"})
        events = await client.turn()
        assert [e["type"] for e in events[:-1]] == ["response.created", "response.in_progress"]
        assert events[-1] is None
        assert client.closeCode == 1000
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_webSocketAgeLimit():
    """
    A connection older than C{ws_max_age} answers C{response.create} with
    C{websocket_connection_limit_reached}.
    """
    emu = Emulator(reactor=reactor, config={"ws_max_age": 0.01})
    await emu.listen(reactor)
    try:
        client = await _connect(emu, "sk-any")
        await deferLater(reactor, 0.05, lambda: None)
        await client.send({"type": "response.create", "model": "gpt-5.5", "input": "hi"})
        [error] = await client.turn()
        assert error["error"]["code"] == "websocket_connection_limit_reached"
        await client.close()
    finally:
        await emu.stop()


@pytest_twisted.ensureDeferred
async def test_wsHandshakeStatus(emulator):
    """
    C{ws_handshake_status} rejects the upgrade with that HTTP status and body, then (with
    C{times: 1}) the next upgrade succeeds.
    """
    emulator.setFault("a1", {"kind": "ws_handshake_status", "code": 500, "times": 1})
    raw = (b"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
           b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Authorization: Bearer sk-emu-a1\r\n\r\n")
    proto = _RawHTTP(raw)
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", emulator.port), proto)
    answer = await proto.done.addTimeout(2, reactor)
    assert answer.startswith(b"HTTP/1.1 500 ")
    client = await _connect(emulator, "sk-emu-a1")
    await client.close()
    assert [r.kind for r in emulator.requestsFor("a1")] == ["handshake", "handshake"]


@pytest_twisted.ensureDeferred
async def test_wsUnknownCredential(emulator):
    """
    With C{accept_any: false}, an upgrade with an unknown credential gets 401 before the
    upgrade.
    """
    raw = (b"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
           b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Authorization: Bearer sk-unknown\r\n\r\n")
    proto = _RawHTTP(raw)
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", emulator.port), proto)
    answer = await proto.done.addTimeout(2, reactor)
    assert answer.startswith(b"HTTP/1.1 401 ")


def _sdkCalls(baseURL: str) -> tuple:
    """
    Run the blocking SDK calls (in a thread).

    @param baseURL: the emulator's C{/v1} base URL.
    @return: the non-stream text and the streamed event types and text.
    """
    import openai

    client = openai.OpenAI(base_url=baseURL, api_key="sk-emu-a1", max_retries=0, timeout=5)
    try:
        response = client.responses.create(model="gpt-5.5", input="hi")
        types = []
        final = None
        for event in client.responses.create(model="gpt-5.5", input="hi", stream=True):
            types.append(event.type)
            if event.type == "response.completed":
                final = event.response.output_text
        return response.output_text, types, final
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_openaiSDK(emulator):
    """
    The official C{openai} SDK can use C{responses.create}, non-stream and stream, directly
    against the emulator.
    """
    text, types, final = await deferToThread(_sdkCalls, emulator.baseURL())
    assert "relay emulator" in text
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final == text
