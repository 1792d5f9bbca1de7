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
from relay.base.records import Account, ClientKey, Turn
from relay.base.requestid import (
    _textHeader,
    adoptClientId,
    clientRequestIdOf,
    requestIdOf,
)
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
    L{clientRequestIdOf}'s look at the raw headers reads what
    L{adoptClientId} reads; L{requestIdOf} is relay's own whatever the
    client sent (R111).
    """

    def _both(self, headers):
        request = _request(headers)
        general = adoptClientId(_textHeader(request))
        chosen = requestIdOf(request)
        self.assertTrue(chosen.startswith("req_"), chosen)
        self.assertEqual(request.notes.requestId, chosen)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"x-request-id"), [chosen.encode()])
        return general, clientRequestIdOf(request)

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
            self.assertIsNone(chosen)

    def test_otherRequests(self):
        """
        A request class that does not say its C{getHeader} reads the raw
        headers is read through C{getHeader}.
        """

        class Own(Request):
            def getHeader(self, key):
                return b"from-getheader" if key == b"x-request-id" else None

        request = _request([], Own)
        self.assertEqual(clientRequestIdOf(request), "from-getheader")
        self.assertTrue(requestIdOf(request).startswith("req_"))


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

    def setUp(self):
        # The cache is the process's: other tests' request lines fill it.
        self.patch(headblock, "_LINES", {})

    def test_same(self):
        for line in (b"POST /v1/responses HTTP/1.1", b"GET /healthz?x=1 HTTP/1.0"):
            data = line + b"\r\nHost: a\r\n\r\n"
            first = headblock.readHead(data)
            self.assertIn(line, headblock._LINES)
            self.assertEqual(headblock.readHead(data), first)
            self.assertEqual(first[:3], _parseRequestLine(line))

    def test_bounded(self):
        """
        At most C{_LINES_MAX} lines are kept: when full the cache starts
        over, so the line read last is kept; every line is read alike.
        """
        for i in range(headblock._LINES_MAX + 10):
            line = b"POST /v1/responses/resp_%d HTTP/1.1" % i
            head = headblock.readHead(line + b"\r\nHost: a\r\n\r\n")
            self.assertEqual(head[:3], _parseRequestLine(line))
            self.assertLessEqual(len(headblock._LINES), headblock._LINES_MAX)
            self.assertIn(line, headblock._LINES)
        self.assertEqual(len(headblock._LINES), 10)

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
        expected = dict(body)  # the client's own "stream": false goes as it came
        self.assertEqual(payload.upstreamBody(turn, account),
                         json.dumps(expected, separators=(",", ":")).encode("utf-8"))


class LargeBodyTests(SynchronousTestCase):
    """
    A large client body (a Codex history) goes upstream as the client's
    bytes with the members relay changed spliced in; its token estimate
    is read from its length.
    """

    def _turn(self, **fields):
        from relay.wire.rawjson import RawObject

        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "caf\u00e9 " * 20000}]}]
        body = {"model": "gpt", "input": items, "stream": True, "prompt_cache_key": "c"}
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        parsed = json.loads(raw)
        turn = Turn(entrypoint="http", endpoint="responses", client=ClientKey(name="k", key="s"),
                    model="gpt", body=parsed, stream=True, bodySize=len(raw),
                    rawBody=RawObject(raw, parsed), **fields)
        return turn, raw

    def test_pieces(self):
        """
        For a dialer that takes pieces the spliced body is not joined: its
        history is a view of the client's bytes.
        """
        account = Account(id="a", type="apikey", base_url="http://u", credential="sk")
        turn, raw = self._turn()
        pieces = payload.upstreamBody(turn, account, pieces=True)
        self.assertIsInstance(pieces, list)
        self.assertEqual(b"".join(pieces), payload.upstreamBody(turn, account))
        self.assertTrue(any(isinstance(p, memoryview) and p.obj is raw for p in pieces))

    def test_spliced(self):
        account = Account(id="a", type="apikey", base_url="http://u", credential="sk")
        turn, raw = self._turn()
        sent = payload.upstreamBody(turn, account)
        history = raw[raw.index(b'"input":'):raw.index(b',"stream"')]
        self.assertIn(history, sent)
        expected = dict(turn.body, prompt_cache_key=json.loads(sent)["prompt_cache_key"])
        self.assertNotEqual(expected["prompt_cache_key"], "c")  # R112
        self.assertEqual(json.loads(sent), expected)

    def test_oauthSpliced(self):
        """
        On an OAuth account (store forced false, instructions added) too.
        """
        account = Account(id="o", type="oauth", base_url="http://u", credential="t")
        turn, raw = self._turn()
        sent = json.loads(payload.upstreamBody(turn, account))
        self.assertEqual((sent["store"], sent["instructions"], sent["input"]),
                         (False, "", turn.body["input"]))

    def test_changedHistoryEncodedWhole(self):
        """
        A history relay changed (R7: encrypted reasoning dropped) is
        encoded whole, by orjson for a large body: the new value goes.
        """
        account = Account(id="a", type="apikey", base_url="http://u", credential="sk")
        turn, raw = self._turn()
        turn.body = dict(turn.body, input=turn.body["input"][:0])
        self.assertEqual(json.loads(payload.upstreamBody(turn, account))["input"], [])

    def test_largeEncodedByOrjson(self):
        """
        Without the client's bytes (a history relay expanded) a large body
        is orjson's compact UTF-8; a small one the standard library's.
        """
        big = {"input": [{"text": "\u00e9"}] * (payload.LARGE_INPUT_ITEMS + 1)}
        self.assertEqual(payload.encodeBody(big), json.dumps(
            big, ensure_ascii=False, separators=(",", ":")).encode())
        self.assertEqual(payload.encodeBody({"a": "\u00e9"}), b'{"a":"\\u00e9"}')
        self.assertEqual(payload.encodeBody({"a": 2**70}, 10**6), b'{"a":1180591620717411303424}')

    def test_tokensFromLength(self):
        from relay.usage.estimate import inputTokens

        turn, raw = self._turn()
        self.assertEqual(inputTokens(turn.body, turn.bodySize), len(raw) // 4)
        small = {"input": "abcd" * 10}
        self.assertEqual(inputTokens(small, 100), inputTokens(small))


class UpstreamHeadersTests(SynchronousTestCase):
    """
    L{relay.upstream.http.upstreamHeaders} copies the forwarded names in
    C{FORWARDED_HEADERS}' order, as a look-up of each name in turn does.
    """

    def _plain(self, account, client):
        from relay.upstream.http import FORWARDED_HEADERS

        headers = {}
        for name in FORWARDED_HEADERS:
            value = client.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def test_same(self):
        from relay.upstream.http import upstreamHeaders

        account = Account(id="a", type="apikey", base_url="http://u", credential="sk")
        oauth = Account(id="o", type="oauth", base_url="http://u", credential="t",
                        chatgpt_account_id="acc")
        client = {"x-codex-turn-state": "t", "user-agent": "ua", "authorization": "Bearer no",
                  "traceparent": "00-1", "originator": "codex_x", "session_id": "s",
                  "accept": "application/json", "x-client-request-id": "r", "other": "o",
                  "accept-language": None}
        for headers in (client, dict(reversed(list(client.items()))), {}, {"other": "x"},
                        {"user-agent": "ua"}):
            for acct in (account, oauth):
                got = upstreamHeaders(acct, headers)
                plain = self._plain(acct, headers)
                self.assertEqual(list(got)[:len(plain)], list(plain))
                self.assertEqual({k: got[k] for k in plain}, plain)
                self.assertNotIn("Bearer no", got.values())


def _plainReadHead(data: bytes):
    """
    L{headblock.readHead} as it read header lines before issue 24's third
    round (one C{partition} and C{strip} per line).
    """
    from twisted.web.http_headers import InvalidHeaderName, _nameEncoder

    end = data.find(b"\r\n\r\n", 0, headblock.PLAIN_BLOCK_BYTES + 4)
    if end <= 0:
        return None
    block = data[:end]
    crlf = block.count(b"\r\n")
    if (
        block.count(b"\n") != crlf or block.count(b"\r") != crlf or b"\0" in block
        or b"\r\n " in block or b"\r\n\t" in block or crlf > headblock.MAX_FIELDS
    ):
        return None
    lines = block.split(b"\r\n")
    try:
        command, path, version = _parseRequestLine(lines[0])
    except ValueError:
        return None
    fields = []
    length = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            return None
        try:
            canonical = _nameEncoder.encode(name)
        except InvalidHeaderName:
            return None
        value = value.strip(b" \t")
        if canonical == b"Content-Length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif canonical == b"Transfer-Encoding":
            return None
        fields.append((canonical, value))
    return command, path, version, fields, length, end - 2 * crlf, end + 2


class HeaderLineTests(SynchronousTestCase):
    """
    L{headblock.readHead}'s one-call split of the header lines reads what
    one C{partition} per line read.
    """

    LINES = [
        b"Host: a", b"host:a", b"X-A:  spaced \t ", b"X-B:", b"X-C: \t", b"X-D: a:b: c",
        b"Content-Length: 12", b"content-length: 1x", b"Content-Length:  7 ", b"NoColon",
        b": empty name", b"Bad Name: v", b"X-E:\tv\t", b"Transfer-Encoding: chunked",
        b"X-F: \xe9\xff", b"X-G:v ", b" X-H: lead", b"X-I:::", b"Content-Length: 3",
    ]

    def test_same(self):
        import random

        rng = random.Random(24)
        cases = [[], [b"Host: a"], [b"Host: a", b"Content-Length: 2"]]
        for _ in range(3000):
            cases.append(rng.sample(self.LINES, rng.randint(1, 5)))
        for lines in cases:
            data = b"\r\n".join([b"POST /v1/responses HTTP/1.1", *lines]) + b"\r\n\r\nbody"
            self.assertEqual(headblock.readHead(data), _plainReadHead(data), lines)


class CompactJSONTests(SynchronousTestCase):
    """
    The upstream body's encoder gives C{json.dumps(value, separators=(",",
    ":"))}' text, and its errors.
    """

    def test_same(self):
        values = [
            {"a": [1, 2.5, 1e100, -0.0, float("nan"), float("inf"), True, None]},
            {"t": "h\u00e9\U0001f600\n\"\\", "n": {"x": {"y": []}}, 3: "int key"},
            ["top", "list"], "text", 7, {},
        ]
        for value in values:
            self.assertEqual(payload._compactJSON(value), json.dumps(value, separators=(",", ":")))

    def test_errors(self):
        for value in ({"a": object()}, {(1, 2): "tuple key"}):
            self.assertRaises(TypeError, json.dumps, value, separators=(",", ":"))
            self.assertRaises(TypeError, payload._compactJSON, value)
