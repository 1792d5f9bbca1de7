"""
Named regression tests for what issue 14's fuzzing found in the
entrypoints, on real sockets against the real emulator: malformed fields
never reach upstream, and every answer is OpenAI's error format or an R70
close with R81's status event.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol

from relay.entry.site import RelaySite
from tests.integration.harness import RELAY_KEY, startStack
from tests.integration.test_reload import waitFor
from tests.integration.test_ws_turns import connect, drain, frames

CRED = "sk-emu-regress-a1"


async def stack():
    return await startStack(
        [{"id": "a1", "credential": CRED}], gateway="{websocket: {mode_default: ctx_pool}}"
    )


async def rejected(client, frame):
    """
    Send C{frame}; return the error event and the close.
    """
    client.sendJSON(frame)
    events = await client.collect()
    closing = await client.collect()
    return events[-1], closing[-1]


@pytest_twisted.ensureDeferred
async def test_ws_non_boolean_stream_is_refused():
    """
    Fuzz: a frame with C{"stream": {}} was forwarded upstream as is; now a
    status-bearing error event (param stream) and close 1008, like HTTP's
    400.
    """
    s = await stack()
    client = await connect(s)
    try:
        event, closed = await rejected(
            client, {"type": "response.create", "model": "gpt-5.5", "stream": {}}
        )
        assert event["status"] == 400 and event["error"]["param"] == "stream"
        assert closed == {"type": "__closed__", "code": 1008, "reason": "invalid JSON payload"}
        assert frames(s, CRED) == []
    finally:
        await drain(s, [client])


@pytest_twisted.ensureDeferred
async def test_ws_empty_previous_response_id_is_refused():
    """
    Fuzz: C{"previous_response_id": ""} was forwarded upstream; now 1008
    after a status event naming the parameter.
    """
    s = await stack()
    client = await connect(s)
    try:
        event, closed = await rejected(client, {
            "type": "response.create", "model": "gpt-5.5", "previous_response_id": "",
        })
        assert event["status"] == 400
        assert event["error"]["param"] == "previous_response_id"
        assert closed["code"] == 1008
        assert frames(s, CRED) == []
    finally:
        await drain(s, [client])


@pytest_twisted.ensureDeferred
async def test_ws_null_fields_not_forwarded():
    """
    Fuzz: C{"stream": null} reached upstream; null C{stream} and
    C{previous_response_id} now count as absent and are not forwarded.
    """
    s = await stack()
    client = await connect(s)
    try:
        events = await client.turn({
            "type": "response.create", "model": "gpt-5.5", "input": "hi",
            "stream": None, "previous_response_id": None,
        })
        assert events[-1]["type"] == "response.completed"
        [frame] = frames(s, CRED)
        assert "stream" not in frame and "previous_response_id" not in frame
    finally:
        await drain(s, [client])


@pytest_twisted.ensureDeferred
async def test_ws_unpaired_surrogate_is_invalid_json():
    """
    Fuzz: C{"input": "\\ud800"} crashed the session hash (close 1011,
    a logged bug); now it is invalid JSON: status event, close 1008.
    """
    s = await stack()
    client = await connect(s)
    try:
        client.sendMessage(
            b'{"type": "response.create", "model": "gpt-5.5", "input": "\\ud800"}', False
        )
        event = (await client.collect())[-1]
        closed = (await client.collect())[-1]
        assert event["status"] == 400 and event["error"]["code"] == "invalid_json"
        assert closed == {"type": "__closed__", "code": 1008, "reason": "invalid JSON payload"}
        assert frames(s, CRED) == []
    finally:
        await drain(s, [client])


@pytest_twisted.ensureDeferred
async def test_http_empty_previous_and_surrogate_are_400():
    """
    Fuzz, HTTP side: an empty C{previous_response_id} and an unpaired
    surrogate are 400s in OpenAI's format and never reach upstream; a
    surrogate pair (an escaped emoji) is served.
    """
    s = await stack()
    try:
        response, data = await s.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "x", "previous_response_id": ""}
        )
        assert response.code == 400
        assert json.loads(data)["error"]["param"] == "previous_response_id"
        response = await treq.post(
            s.url + "/v1/responses", b'{"model": "gpt-5.5", "input": "\\ud800"}',
            headers={"Authorization": [f"Bearer {RELAY_KEY}"]},
        )
        assert response.code == 400
        assert "error" in json.loads(await response.content())
        assert s.emulator.requestsFor(CRED, "request") == []
        response = await treq.post(
            s.url + "/v1/responses", b'{"model": "gpt-5.5", "input": "\\ud83d\\ude00"}',
            headers={"Authorization": [f"Bearer {RELAY_KEY}"]},
        )
        assert response.code == 200
        await response.content()
    finally:
        await s.stop()


@pytest_twisted.ensureDeferred
async def test_http_nan_infinity_and_non_boolean_background_are_400():
    """
    Bad values that C{json.loads} reads were forwarded after an account
    was chosen and a slot taken: C{NaN}, C{Infinity} and C{-Infinity}
    (RFC 8259 has none; upstream could not parse the forwarded body) on
    every JSON reader -- responses (JSON and stream), chat, compact, input
    tokens -- and a non-boolean C{background} on responses. Each is a 400
    in OpenAI's format; upstream sees nothing. The words inside a string
    are served.
    """
    s = await stack()
    try:
        auth = {"Authorization": [f"Bearer {RELAY_KEY}"], "Content-Type": ["application/json"]}
        bodies = [
            ("/v1/responses", b'{"model": "gpt-5.5", "input": "x", "temperature": NaN}'),
            ("/v1/responses", b'{"model": "gpt-5.5", "input": "x", "stream": true,'
                              b' "top_p": Infinity}'),
            ("/v1/chat/completions", b'{"model": "gpt-5.5", "temperature": -Infinity,'
                                     b' "messages": [{"role": "user", "content": "x"}]}'),
            ("/v1/responses/compact", b'{"model": "gpt-5.5", "input": [NaN]}'),
            ("/v1/responses/input_tokens", b'{"model": "gpt-5.5", "input": "x", "n": NaN}'),
        ]
        for path, raw in bodies:
            response = await treq.post(s.url + path, raw, headers=auth)
            error = json.loads(await response.content())["error"]
            assert (response.code, error["type"]) == (400, "invalid_request_error"), (path, error)
            assert "could not parse the JSON body" in error["message"], (path, error)
        response, data = await s.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "x", "background": "yes"})
        error = json.loads(data)["error"]
        assert (response.code, error["param"], error["code"]) == (400, "background",
                                                                   "invalid_type"), error
        assert error["message"] == ("Invalid type for 'background': expected a boolean, but got"
                                    " a string instead.")
        assert s.emulator.requestsFor(CRED) == []
        response, data = await s.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "NaN and Infinity, in words"})
        assert response.code == 200, data
    finally:
        await s.stop()


class _Raw(Protocol):
    def __init__(self):
        self.data = b""

    def dataReceived(self, data):
        self.data += data


@pytest_twisted.ensureDeferred
async def test_site_answers_unparseable_http_and_odd_methods_in_json():
    """
    Fuzz: the relay's listening site answers unparseable HTTP with a JSON
    400 and an unknown method with a JSON 405 (not twisted.web's bare 400
    or HTML 501).
    """
    s = await stack()
    try:
        assert isinstance(s.app.site, RelaySite)
        port = s.port.getHost().port
        answers = []
        for raw in (b"POST /v1/responses HTTP/2.0\r\nHost: x\r\n\r\n",
                    b"BREW /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
            proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(
                Factory.forProtocol(_Raw)
            )
            proto.transport.write(raw)
            await waitFor(lambda proto=proto: b"}" in proto.data)
            proto.transport.loseConnection()
            answers.append(proto.data)
        assert answers[0].startswith(b"HTTP/1.1 400")
        assert b'"malformed_http_request"' in answers[0]
        assert answers[1].startswith(b"HTTP/1.1 405")
        assert b'"method_not_allowed"' in answers[1]
    finally:
        await s.stop()


@pytest_twisted.ensureDeferred
async def test_chat_shapes_on_oauth_are_400():
    """
    Fuzz: on an OAuth account C{"tools": 1} failed inside the engine's
    translation (502, a logged bug) and a list C{role} failed the entry's
    check (an HTML 500); both are 400s in OpenAI's format now, and nothing
    reaches upstream.
    """
    s = await startStack([{"id": "o1", "type": "oauth", "credential": "sk-emu-regress-o1"}])
    try:
        for body, param in (
            ({"model": "gpt-5.5", "tools": 1, "messages": [{"role": "user", "content": "x"}]},
             "tools"),
            ({"model": "gpt-5.5", "messages": [{"role": ["user"], "content": "x"}]},
             "messages[0].role"),
        ):
            response, data = await s.postJSON("/v1/chat/completions", body)
            assert response.code == 400, data
            assert json.loads(data)["error"]["param"] == param
        assert s.emulator.requestsFor("sk-emu-regress-o1", "request") == []
    finally:
        await s.stop()


@pytest_twisted.ensureDeferred
async def test_refused_websocket_handshake_is_json():
    """
    Fuzz: an upgrade autobahn refuses (no C{Sec-WebSocket-Key}, an unknown
    C{Sec-WebSocket-Version}) was answered with a bare status line and no
    body; now OpenAI's error format with its length, the request id and
    C{Connection: close}.
    """
    s = await stack()
    try:
        port = s.port.getHost().port
        head = (b"GET /v1/responses HTTP/1.1\r\nHost: relay.test\r\nAuthorization: Bearer "
                + RELAY_KEY.encode() + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n")
        for extra in (b"Content-Length: 0\r\n",
                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 99\r\n"):
            proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(
                Factory.forProtocol(_Raw)
            )
            proto.transport.write(head + extra + b"\r\n")
            await waitFor(lambda proto=proto: b"}}" in proto.data)
            proto.transport.loseConnection()
            status, _, rest = proto.data.partition(b"\r\n")
            headers, _, body = rest.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 4"), proto.data
            assert b"Content-Length: %d" % len(body) in headers, proto.data
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error", error
            assert error["code"] == "websocket_handshake_failed", error
            assert error["request_id"].encode() in headers, proto.data
        assert frames(s, CRED) == []
    finally:
        await s.stop()
