"""
Regression tests for what issue 14's fuzzing found below the routes
(L{relay.entry.site}), in JSON parsing (L{relay.entry.http.loadJSON}) and
in chat request checks (L{relay.translate.chatrequest.checkChatRequest}):
relay's answers stay in OpenAI's error format where twisted.web would
answer bare or in HTML, an unpaired surrogate never gets past the
entrypoints, and a chat request the translator cannot read is a 400, not
an internal error.
"""

from __future__ import annotations

import json
from typing import ClassVar

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from relay.entry.http import loadJSON
from relay.scheduling.session import sessionHash
from relay.translate.chatrequest import (
    ChatRequestError,
    chatToResponses,
    checkChatRequest,
)


class _GetOnly(Resource):
    """
    A leaf with only C{render_GET} (like C{/v1/models} and C{/healthz}).
    """

    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        return b'{"ok":true}'


def exchange(raw: bytes):
    """
    Feed C{raw} to a fresh connection of the relay's site classes.

    @return: C{(bytes written, transport)}.
    """
    from relay.process.app import _Request
    from relay.entry.site import RelaySite

    root = Resource()
    root.putChild(b"models", _GetOnly())
    site = RelaySite(root, requestFactory=_Request, reactor=Clock())
    protocol = site.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(raw)
    return transport.value(), transport


def appSite():
    """
    The site of a relay built from a minimal configuration (client key
    C{sk-team}, one API-key account) on a L{MemoryReactorClock}.
    """
    from twisted.internet.testing import MemoryReactorClock

    from relay.process.app import buildApplication
    from relay.configuration.parse import settingsFromString

    config = settingsFromString(
        'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        "keys: [{name: team, key: sk-team}]\n"
        "accounts: [{id: a1, type: apikey, api_key: sk-up, "
        'base_url: "http://127.0.0.1:1/v1"}]\n'
    )
    return buildApplication(config, MemoryReactorClock()).site


def split(data: bytes):
    """
    @return: C{(status line, lower-cased head, body)} of one response.
    """
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], head.lower(), body


class MalformedHTTPTests(SynchronousTestCase):
    """
    L{relay.entry.site.RelayHTTPChannel}.
    """

    def test_unknownVersionIsJSON400(self):
        """
        Issue 14 fuzz: C{HTTP/2.0} on the request line was a bare 400 with
        no body; now OpenAI's envelope, then the connection closes.
        """
        data, transport = exchange(b"POST /v1/responses HTTP/2.0\r\nHost: x\r\n\r\n")
        status, head, body = split(data)
        self.assertEqual(status, b"HTTP/1.1 400 Bad Request")
        self.assertIn(b"content-type: application/json", head)
        self.assertIn(b"connection: close", head)
        self.assertEqual(json.loads(body)["error"]["code"], "malformed_http_request")
        self.assertTrue(transport.disconnecting)

    def test_badContentLengthIsJSON400(self):
        """
        A non-numeric C{Content-Length} gets the same JSON 400.
        """
        data, _ = exchange(b"POST /models HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n")
        self.assertEqual(json.loads(split(data)[2])["error"]["type"], "invalid_request_error")


class TwistedHooksTests(SynchronousTestCase):
    """
    The private parts of twisted.web's L{HTTPChannel} that
    L{relay.entry.site.RelayHTTPChannel} reads to answer an over-long
    request line (414) or header (431): an upgrade that renames them fails
    here, not in production.
    """

    def test_pinned(self):
        from twisted.web.http import HTTPChannel

        channel = HTTPChannel()
        self.assertEqual(channel._HTTPChannel__first_line, 1)
        self.assertEqual(channel._HTTPChannel__header, b"")
        self.assertEqual((channel._receivedHeaderSize, channel.totalHeadersSize,
                          channel.MAX_LENGTH), (0, 16384, 16384))

    def test_overLongLineIsAnswered(self):
        """
        Through the site classes alone (no intake): 431, not an empty reply.
        """
        data, transport = exchange(b"GET /models HTTP/1.1\r\nX-Big: " + b"a" * 17000 + b"\r\n")
        status, _, body = split(data)
        self.assertTrue(status.startswith(b"HTTP/1.1 431 "), status)
        self.assertEqual(json.loads(body)["error"]["code"], "request_header_fields_too_large")
        self.assertTrue(transport.disconnecting)


class EarlyAnswerIdTests(SynchronousTestCase):
    """
    Issue 15: answers written below the resources -- the channel's 400 for
    unparseable HTTP and autobahn's refusal of a malformed upgrade -- carry
    the request id as C{X-Request-Id} (and the 400 as
    C{error.request_id}), chosen as for every other answer.
    """

    def test_malformedRequestCarriesTheId(self):
        """
        A bad C{Content-Length} after a well-formed C{X-Request-Id}: a new
        C{req_} id of relay's own (R111: never the client's); a request line
        that does not parse: a new C{req_} id.
        """
        data, _ = exchange(
            b"POST /models HTTP/1.1\r\nHost: x\r\nX-Request-Id: mine-1\r\n"
            b"Content-Length: 12abc\r\n\r\n"
        )
        _, head, body = split(data)
        self.assertNotIn(b"mine-1", head)
        requestId = json.loads(body)["error"]["request_id"]
        self.assertTrue(requestId.startswith("req_"), requestId)
        self.assertIn(b"x-request-id: " + requestId.encode() + b"\r\n", head)
        data, _ = exchange(b"POST /v1/responses HTTP/2.0\r\nHost: x\r\n\r\n")
        _, head, body = split(data)
        requestId = json.loads(body)["error"]["request_id"]
        self.assertTrue(requestId.startswith("req_"), requestId)
        self.assertIn(b"x-request-id: " + requestId.encode() + b"\r\n", head)

    def test_refusedUpgradeCarriesTheId(self):
        """
        An upgrade autobahn refuses (no C{Sec-WebSocket-Key}, an unknown
        version) answers with a new C{ws_} id of relay's own, whatever the
        client sent (R111).
        """
        from txaio.testutil import replace_loop

        site = appSite()

        class Transport(StringTransport):
            protocol = None

        def upgrade(headers: bytes) -> bytes:
            transport = Transport()
            with replace_loop(Clock()):
                protocol = site.buildProtocol(None)
                protocol.makeConnection(transport)
                protocol.dataReceived(
                    b"GET /v1/responses HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer sk-team\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\n" + headers + b"\r\n"
                )
            return transport.value()

        data = upgrade(b"Sec-WebSocket-Version: 13\r\nX-Request-Id: thread-7\r\n")
        status, head, _ = split(data)
        self.assertTrue(status.startswith(b"HTTP/1.1 400 "), status)
        self.assertNotIn(b"thread-7", head)
        self.assertRegex(head.decode(), r"\r\nx-request-id: ws_[0-9a-f]+(\r\n|$)")
        data = upgrade(
            b"Sec-WebSocket-Version: 99\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        )
        status, head, _ = split(data)
        self.assertTrue(status.startswith(b"HTTP/1.1 400 "), status)
        self.assertRegex(head.decode(), r"\r\nx-request-id: ws_[0-9a-f]+(\r\n|$)")


class _Refuses(Resource):
    """
    A leaf answering relay's 429 through L{relay.entry.sinks.writeError}.
    """

    isLeaf = True

    def render_GET(self, request):
        from twisted.web.server import NOT_DONE_YET

        from relay.entry.sinks import writeError
        from relay.base.records import ClientError

        writeError(request, ClientError(429, "rate_limit_error", "busy"))
        return NOT_DONE_YET


class StatusLineTests(SynchronousTestCase):
    """
    The reason phrase of statuses twisted.web has none for.
    """

    def test_upgradeRequired(self):
        """
        C{GET /v1/responses} (with the key: without it, 401 from the
        headers, R103) without an upgrade is C{426 Upgrade Required}, not
        twisted.web's C{426 Unknown Status}.
        """
        site = appSite()
        protocol = site.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(
            b"GET /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-team\r\n\r\n"
        )
        self.assertEqual(split(transport.value())[0], b"HTTP/1.1 426 Upgrade Required")

    def test_tooManyRequests(self):
        """
        relay's own 429 is C{429 Too Many Requests}.
        """
        from relay.process.app import _Request
        from relay.entry.site import RelaySite

        site = RelaySite(_Refuses(), requestFactory=_Request, reactor=Clock())
        protocol = site.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(split(transport.value())[0], b"HTTP/1.1 429 Too Many Requests")


class FieldTypeTests(SynchronousTestCase):
    """
    A turn's fields of the wrong JSON type are answered 400 in OpenAI's
    C{invalid_type} shape, naming the field; a missing model is still
    "you must provide a model parameter".
    """

    def post(self, body: dict) -> dict:
        """
        POST C{body} to C{/v1/responses} on an L{appSite}.

        @return: the answer's C{error} object.
        """
        raw = json.dumps(body).encode()
        protocol = appSite().buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-team\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(raw)).encode() + b"\r\n\r\n" + raw
        )
        status, _, data = split(transport.value())
        self.assertTrue(status.startswith(b"HTTP/1.1 400 "), status)
        return json.loads(data[data.index(b"{"): data.rindex(b"}") + 1])["error"]

    def test_wrongTypes(self):
        """
        C{{"model": 5}} says the model must be a string (not that it is
        missing); C{stream} and C{previous_response_id} the same way.
        """
        cases = [
            ({"model": 5}, "model", "expected a string, but got an integer"),
            ({"model": ["gpt-5.5"]}, "model", "expected a string, but got an array"),
            ({"model": "gpt-5.5", "stream": "yes"}, "stream",
             "expected a boolean, but got a string"),
            ({"model": "gpt-5.5", "previous_response_id": 7}, "previous_response_id",
             "expected a string, but got an integer"),
        ]
        for body, param, expected in cases:
            error = self.post(body)
            self.assertEqual(
                error["message"], f"Invalid type for '{param}': {expected} instead.", body
            )
            self.assertEqual(
                (error["type"], error["param"], error["code"]),
                ("invalid_request_error", param, "invalid_type"),
            )

    def test_missingModel(self):
        """
        No model (or an empty one) is OpenAI's "you must provide a model
        parameter".
        """
        for body in ({}, {"model": ""}, {"model": None}):
            error = self.post(body)
            self.assertEqual(error["message"], "you must provide a model parameter")
            self.assertEqual(error["param"], "model")


class MethodTests(SynchronousTestCase):
    """
    L{relay.entry.site.JSONMethodErrors} through relay's request class.
    """

    def test_unknownMethodIsJSON405(self):
        """
        Issue 14 fuzz: C{A /v1/models} was twisted.web's HTML C{501 Huh?};
        now a JSON 405 naming the allowed methods.
        """
        data, _ = exchange(b"A /models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status, head, body = split(data)
        self.assertTrue(status.startswith(b"HTTP/1.1 405"))
        self.assertIn(b"allow: head, get", head)
        error = json.loads(body[body.index(b"{"): body.rindex(b"}") + 1])["error"]
        self.assertEqual(error["code"], "method_not_allowed")

    def test_knownMethodIsJSON405(self):
        """
        A C{DELETE} on a GET-only resource was an HTML 405; now JSON.
        """
        data, _ = exchange(b"DELETE /models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status, head, _ = split(data)
        self.assertTrue(status.startswith(b"HTTP/1.1 405"))
        self.assertIn(b"application/json", head)

    def test_headStillServed(self):
        """
        C{HEAD} on a GET resource is still answered by twisted.web (no
        body, a length).
        """
        data, _ = exchange(b"HEAD /models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = split(data)
        self.assertTrue(status.startswith(b"HTTP/1.1 200"))
        self.assertEqual(body, b"")


class SurrogateTests(SynchronousTestCase):
    """
    Issue 14 fuzz: a JSON C{"\\ud800"} escape crashed the session hash
    (the WebSocket closed 1011) and could reach upstream.
    """

    def test_unpairedRefused(self):
        """
        An unpaired surrogate escape is invalid input.
        """
        for raw in (b'{"input": "\\ud800"}', b'{"a": ["x\\udfff"]}', b'"\\uDBFF"'):
            self.assertRaises(ValueError, loadJSON, raw)

    def test_pairedAccepted(self):
        """
        A surrogate pair (an emoji escaped by ensure_ascii clients) is fine.
        """
        self.assertEqual(loadJSON(b'{"t": "\\ud83d\\ude00"}'), {"t": "\U0001f600"})

    def test_nonFiniteRefused(self):
        """
        C{NaN}, C{Infinity} and C{-Infinity} are not JSON (RFC 8259), though
        C{json.loads} reads them: refused at any depth, in a short body
        (orjson's path) as in a long one; the words inside a string are
        fine.
        """
        for raw in (b'{"t": NaN}', b'{"a": [1, {"b": Infinity}]}', b"-Infinity",
                    b'{"x": "' + b"y" * 70_000 + b'", "t": NaN}'):
            self.assertRaises(ValueError, loadJSON, raw)
        self.assertEqual(loadJSON(b'{"t": "NaN, Infinity"}'), {"t": "NaN, Infinity"})

    def test_sessionHashTotal(self):
        """
        The session hash takes any string (defence in depth).
        """
        self.assertEqual(len(sessionHash("\ud800", "k")), 16)


class ChatShapeTests(SynchronousTestCase):
    """
    L{checkChatRequest}: every shape L{chatToResponses} reads is checked.
    """

    USER: ClassVar[dict] = {"role": "user", "content": "hi"}

    def test_unhashableRoleIs400(self):
        """
        Fuzz: a list C{role} raised TypeError in the check itself (an HTML
        500); now a L{ChatRequestError} naming the role.
        """
        e = self.assertRaises(
            ChatRequestError, checkChatRequest, {"messages": [{"role": ["user"]}]}
        )
        self.assertEqual(e.param, "messages[0].role")

    def test_wrongShapesAre400(self):
        """
        Fuzz: C{"tools": 1} crashed the OAuth translation (a 502 and a
        logged bug); it and its kin are refused up front, naming the
        parameter.
        """
        cases = [
            ({"tools": 1}, "tools"),
            ({"tools": [1]}, "tools[0]"),
            ({"functions": "f"}, "functions"),
            ({"messages": [dict(self.USER), {"role": "assistant", "tool_calls": 3}]},
             "messages[1].tool_calls"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
             "messages[0].tool_calls[0].function"),
            ({"messages": [{"role": "user", "content": [{"type": "file", "file": "x"}]}]},
             "messages[0].content[0].file"),
            ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"tools": 5}}},
             "tool_choice.allowed_tools.tools"),
        ]
        for extra, param in cases:
            body = {"messages": [dict(self.USER)], **extra}
            e = self.assertRaises(ChatRequestError, checkChatRequest, body)
            self.assertEqual(e.param, param)

    def test_checkedBodiesTranslate(self):
        """
        What the check lets through translates (odd but readable values
        included).
        """
        body = {
            "messages": [dict(self.USER), {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": 1}}]}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "functions": None,
            "tool_choice": "auto",
        }
        checkChatRequest(body)
        self.assertEqual(chatToResponses(body)["tools"][0]["name"], "f")


class _Held(Resource):
    """
    A leaf that keeps every request open until the test finishes it.
    """

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.held = []

    def render_GET(self, request):
        from twisted.web.server import NOT_DONE_YET

        self.held.append(request)
        return NOT_DONE_YET


class IdleTimeoutTests(SynchronousTestCase):
    """
    The connection's idle timeout (twisted.web's C{Site.timeout}) behaves
    as twisted.web's own while relay parks it during a request instead of
    cancelling and rescheduling it (L{relay.entry.site.RelayHTTPChannel.setTimeout}):
    the same closes at the same times, none while a request is handled,
    nothing left scheduled once the connection is gone.
    """

    TIMEOUT = 10

    def trace(self, relay: bool, upgrade: bool = False, lose: bool = False) -> list:
        """
        Run one connection through a held request and back to idle on
        relay's site (or twisted.web's) and record what a client sees.
        """
        from twisted.web.server import Site

        from relay.entry.site import RelaySite
        from relay.process.app import _Request

        clock = Clock()
        held = _Held()
        if relay:
            site = RelaySite(held, requestFactory=_Request, reactor=clock, timeout=self.TIMEOUT)
        else:
            site = Site(held, reactor=clock, timeout=self.TIMEOUT)
        protocol = site.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        seen = []

        def note(label):
            seen.append((label, transport.disconnecting, len(held.held)))

        clock.advance(self.TIMEOUT - 1)
        extra = b"Upgrade: websocket\r\nConnection: Upgrade\r\n" if upgrade else b""
        protocol.dataReceived(b"GET /a HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
        note("held")
        if upgrade:
            seen.append(("pending", len(clock.getDelayedCalls())))
        clock.advance(self.TIMEOUT * 3)
        note("held long")
        protocol.dataReceived(b"GET /b HTTP/1.1\r\n")  # pipelined, incomplete
        clock.advance(self.TIMEOUT - 1)
        note("more data")
        if lose:
            from twisted.internet.error import ConnectionDone
            from twisted.python.failure import Failure

            protocol.connectionLost(Failure(ConnectionDone()))
            seen.append(("lost", len(clock.getDelayedCalls())))
            return seen
        held.held[0].finish()
        note("finished")
        clock.advance(self.TIMEOUT - 0.5)
        note("idle almost")
        clock.advance(1)
        note("idle over")
        return seen

    def test_idle_timeout_as_twisted_web(self):
        expected = self.trace(relay=False)
        self.assertEqual(self.trace(relay=True), expected)
        self.assertEqual(expected[-2:], [("idle almost", False, 1), ("idle over", True, 1)])

    def test_upgrade_as_twisted_web(self):
        self.assertEqual(self.trace(relay=True, upgrade=True),
                         self.trace(relay=False, upgrade=True))

    def test_lost_during_a_request_leaves_nothing_scheduled(self):
        expected = self.trace(relay=False, lose=True)
        self.assertEqual(self.trace(relay=True, lose=True), expected)
        self.assertEqual(expected[-1], ("lost", 0))
