"""
Issue 24 (third round): the fast paths of a turn's way in give the answers
of the general paths they stand in for, on the same inputs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import _parseRequestLine
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel

from relay.engine import payload
from relay.entry import headblock
from relay.entry.body import LimitedBodyRequest, _Headers
from relay.entry.http import clientHeaders, filterClientHeaders
from relay.entry.site import RelayHTTPChannel
from relay.model import Account, ClientKey, Turn
from relay.requestid import _ATTRIBUTE, _textHeader, adoptClientId, requestIdOf
from relay.scheduling import session

HEADERS = [
    (b"Host", b"relay.test"),
    (b"User-Agent", b"codex_cli_rs/0.171.0"),
    (b"Authorization", b"Bearer sk-secret"),
    (b"X-Api-Key", b"sk-other"),
    (b"Cookie", b"a=b"),
    (b"Content-Type", b"application/json"),
    (b"Content-Length", b"12"),
    (b"Sec-WebSocket-Key", b"abc"),
    (b"session_id", b"s-1"),
    (b"X-Codex-Turn-State", b"tok"),
    (b"x-odd-NAME", b"\xe9t\xe9"),
    (b"Accept", b"text/event-stream"),
    (b"Originator", b"codex_cli_rs"),
]


def _plainClientHeaders(request) -> dict:
    """
    The reading L{clientHeaders} did before issue 24's third round.
    """
    return filterClientHeaders({
        name.decode("latin-1").lower(): values[0].decode("latin-1")
        for name, values in request.requestHeaders.getAllRawHeaders()
    })


def _request(headers, cls=LimitedBodyRequest) -> Request:
    request = cls(DummyChannel())
    for name, value in headers:
        request.requestHeaders.addRawHeader(name, value)
    return request


class ClientHeadersTests(SynchronousTestCase):
    """
    L{clientHeaders}' one pass with its name cache gives what the plain
    reading gives.
    """

    def test_same(self):
        for headers in (HEADERS, HEADERS[::-1], HEADERS[2:5], [], [(b"X-A", b"1"), (b"x-a", b"2")]):
            for _ in range(2):  # the second time from the name cache
                request = _request(headers)
                request.requestHeaders.addRawHeader(b"user-agent", b"second")
                self.assertEqual(clientHeaders(request), _plainClientHeaders(request))
                self.assertEqual(list(clientHeaders(request)), list(_plainClientHeaders(request)))

    def test_credentialsNeverForwarded(self):
        forwarded = clientHeaders(_request(HEADERS))
        for name in ("authorization", "x-api-key", "cookie", "sec-websocket-key", "host"):
            self.assertNotIn(name, forwarded)


class RequestIdTests(SynchronousTestCase):
    """
    L{requestIdOf}'s look at the raw headers adopts what L{adoptClientId}
    adopts.
    """

    def _both(self, headers):
        request = _request(headers)
        general = adoptClientId(_textHeader(request))
        chosen = requestIdOf(request)
        self.assertEqual(getattr(request, _ATTRIBUTE), chosen)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"x-request-id"), [chosen.encode()])
        return general, chosen

    def test_adopted(self):
        for headers in (
            [(b"X-Request-Id", b"abc-1")],
            [(b"x-client-request-id", b"thread.7")],
            [(b"x-request-id", b"bad id"), (b"X-Client-Request-Id", b"ok:2")],
            [(b"x-request-id", b"one"), (b"x-request-id", b"two")],
        ):
            general, chosen = self._both(headers)
            self.assertEqual(chosen, general)

    def test_none(self):
        for headers in ([], HEADERS, [(b"x-request-id", b"\xff\xfe")], [(b"x-request-id", b"")]):
            general, chosen = self._both(headers)
            self.assertIsNone(general)
            self.assertTrue(chosen.startswith("req_"))

    def test_otherRequests(self):
        """
        A request class that does not say its C{getHeader} reads the raw
        headers is read through C{getHeader}.
        """

        class Own(Request):
            def getHeader(self, key):
                return b"from-getheader" if key == b"x-request-id" else None

        request = _request([], Own)
        self.assertEqual(requestIdOf(request), "from-getheader")


class RequestInitTests(SynchronousTestCase):
    """
    A request of a relay channel sets what twisted.web's constructors set.
    """

    def test_same(self):
        channel = RelayHTTPChannel()
        channel.site = DummyChannel().site
        channel.makeConnection(DummyChannel.TCP())
        for args in ((), (0,), (3,)):
            fast = LimitedBodyRequest(channel, *args)
            channel.relayPlainRequests = False
            try:
                general = LimitedBodyRequest(channel, *args)
            finally:
                del channel.relayPlainRequests
            self.assertEqual(sorted(vars(fast)), sorted(vars(general)))
            for name, value in vars(general).items():
                mine = getattr(fast, name)
                self.assertIs(type(mine), type(value), name)
                if name not in ("requestHeaders", "responseHeaders"):
                    self.assertEqual(mine, value, name)
            self.assertIs(type(fast.requestHeaders), _Headers)
            self.assertEqual(fast.requestHeaders._rawHeaders, {})
        channel.connectionLost(None)


class RequestLineTests(SynchronousTestCase):
    """
    L{headblock.readHead}'s request lines checked once give what
    C{_parseRequestLine} gives.
    """

    def test_same(self):
        for line in (b"POST /v1/responses HTTP/1.1", b"GET /healthz?x=1 HTTP/1.0"):
            data = line + b"\r\nHost: a\r\n\r\n"
            first = headblock.readHead(data)
            self.assertIn(line, headblock._LINES)
            self.assertEqual(headblock.readHead(data), first)
            self.assertEqual(first[:3], _parseRequestLine(line))

    def test_refusedNotKept(self):
        for line in (b"POST /a\x7f\xffb HTTP/1.1", b"P(ST / HTTP/1.1", b"POST / HTTP/2.0"):
            self.assertIsNone(headblock.readHead(line + b"\r\nHost: a\r\n\r\n"))
            self.assertNotIn(line, headblock._LINES)


class SeedTests(SynchronousTestCase):
    """
    The session seed's encoder built once and its C{dict} test answer as
    C{json.dumps} and C{isinstance(Mapping)} do.
    """

    def test_canonical(self):
        for value in ("hi", [{"b": 1, "a": "\u00e9"}], {"z": [1.5, None, True]}, 7):
            self.assertEqual(
                session._canonical(value),
                json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False),
            )

    def test_mappings(self):
        class Frozen(Mapping):
            def __init__(self, d):
                self._d = d

            def __getitem__(self, k):
                return self._d[k]

            def __iter__(self):
                return iter(self._d)

            def __len__(self):
                return len(self._d)

        body = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                            {"role": "user", "content": [{"t": 1}]}]}
        frozen = Frozen({"model": "m", "messages": [Frozen(m) for m in body["messages"]]})
        self.assertEqual(session.sessionSeed({}, body), session.sessionSeed({}, frozen))
        self.assertEqual(session.sessionSeed({"session_id": None, "session-id": " x "}, body), "x")
        self.assertIsNone(session.sessionSeed({}, ["not", "a", "mapping"]))


class UpstreamBodyTests(SynchronousTestCase):
    """
    L{payload.upstreamBody}'s encoder built once gives C{json.dumps}' bytes.
    """

    def test_same(self):
        account = Account(id="a", type="apikey", base_url="http://u", credential="sk")
        body = {"model": "gpt", "input": [{"role": "user", "content": "h\u00e9\U0001f600"}],
                "n": 1.0, "stream": False}
        turn = Turn(entrypoint="http", endpoint="responses", client=ClientKey(name="k", key="s"),
                    model="gpt", body=body, stream=False)
        expected = dict(body)
        expected.pop("stream")
        self.assertEqual(payload.upstreamBody(turn, account),
                         json.dumps(expected, separators=(",", ":")).encode("utf-8"))
