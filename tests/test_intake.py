"""
Issue 19 items 1-4 (behaviour.md R103): nothing before the key, bounded
bodies, deep nesting, slow clients -- on the relay's real site
(L{relay.process.app.buildApplication}) over L{StringTransport}s.
"""

from __future__ import annotations

import gzip
import json
import zlib

import zstandard
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from relay.entry import body as B

KEY = "sk-team-intake"
ADMIN = "admin-intake-0123456789"
METRICS = "metrics-intake-0123456789"


class Probe(Resource):
    """
    Records what a resource sees of a request, answers 200.
    """

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.seen = []

    def render_POST(self, request):
        body = request.content.read()
        self.seen.append({"args": dict(request.args), "body": body,
                          "key": request.admission and request.admission.key,
                          "lease": request.admission and request.admission.slot})
        return b"{}"


def relaySite(limits="{}", concurrency=0, body_limit=None):
    """
    A relay's site and application with a probe at C{/v1/probe}.
    """
    from relay.process.app import buildApplication
    from relay.configuration.parse import settingsFromString

    extra = f", max_request_body_bytes: {body_limit}" if body_limit else ""
    config = settingsFromString(
        'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        f"admin_key: {ADMIN}\nmetrics_key: {METRICS}\n"
        f"keys: [{{name: team, key: {KEY}, concurrency: {concurrency}}}]\n"
        "accounts: [{id: a1, type: apikey, api_key: sk-up, "
        'base_url: "http://127.0.0.1:1/v1"}]\n'
        f"gateway: {{limits: {limits}{extra}}}\n"
    )
    app = buildApplication(config, MemoryReactorClock())
    probe = Probe()
    app.site.resource.root.children[b"v1"].putChild(b"probe", probe)
    return app, probe


class Conn:
    """
    One connection to a site, on a L{Clock}.
    """

    def __init__(self, site, clock=None, host="10.0.0.1"):
        self.clock = clock or Clock()
        self.protocol = site.buildProtocol(IPv4Address("TCP", host, 40000))
        self.inner = getattr(self.protocol, "wrappedProtocol", self.protocol)
        self.inner.callLater = self.clock.callLater
        self.transport = StringTransport()
        self.transport.loseWriteConnection = lambda: setattr(self, "halfClosed", True)
        self.transport.abortConnection = self.transport.loseConnection
        self.halfClosed = False
        self.protocol.makeConnection(self.transport)

    def send(self, data: bytes):
        self.protocol.dataReceived(data)
        return self

    @property
    def value(self) -> bytes:
        return self.transport.value()

    def status(self) -> int:
        return int(self.value.split(b" ", 2)[1]) if self.value else 0

    def error(self) -> dict:
        return json.loads(self.value.partition(b"\r\n\r\n")[2].split(b"\r\n0\r\n")[0]
                          .split(b"\r\n", 1)[-1] if b"chunked" in self.value.split(
                              b"\r\n\r\n")[0].lower() else self.value.partition(b"\r\n\r\n")[2]
                          )["error"]


def head(path=b"/v1/responses", method=b"POST", headers=b"", length=None):
    line = method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n" + headers
    if length is not None:
        line += b"Content-Length: %d\r\n" % length
    return line + b"\r\n"


AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"


class NothingBeforeTheKeyTests(SynchronousTestCase):
    """
    Item 1: a request without the credential its route needs is answered
    from its headers alone; its body is never read, decoded or stored.
    """

    def test_answeredBeforeTheBody(self):
        """
        Every route class: the answer is written before one body byte is
        sent (today it waits for, spools and decodes the whole body).
        """
        app, _ = relaySite()
        cases = [
            (b"/v1/responses", b"POST", b"", 401),
            (b"/v1/chat/completions", b"POST", b"", 401),
            (b"/backend-api/codex/responses", b"POST", b"", 401),
            (b"/responses", b"POST", b"x-api-key: wrong\r\n", 401),
            (b"/v1/responses", b"POST", b"Authorization: Basic " + KEY.encode() + b"\r\n", 401),
            (b"/admin/settings", b"PUT", AUTH, 401),
            (b"/admin/reload", b"POST", b"", 401),
            (b"/admin/settings", b"PUT", b"Authorization: Bearer " + METRICS.encode() + b"\r\n",
             401),
            (b"/metrics", b"GET", AUTH, 401),
            # Sorted by the resource twisted.web finds: segments percent-decoded.
            (b"/%61dmin/settings", b"PUT", AUTH, 401),
            (b"/%6detrics", b"GET", b"", 401),
            (b"/%761/responses", b"POST", b"", 401),
            (b"/v1/chat/%63ompletions", b"POST", b"", 401),
        ]
        for path, method, headers, expected in cases:
            conn = Conn(app.site).send(
                head(path, method, headers + b"Content-Encoding: zstd\r\n"
                     b"Content-Type: application/x-www-form-urlencoded\r\n", length=5000)
            )
            self.assertEqual(conn.status(), expected, (path, conn.value[:80]))
            self.assertIn(b"connection: close", conn.value.lower())
            request = conn.inner._channel.requests[-1]
            self.assertIsNone(request.content, path)
            conn.send(b"a" * 5000)  # the body: dropped, never stored
            self.assertIsNone(request.content, path)
            self.assertTrue(conn.halfClosed)

    def test_refusalsHaveAnAccessLine(self):
        """
        An answer written from the headers is in the access log like any
        other (issue 15's C{relay.http_access}), with its id (relay's own,
        R111), the client's id and status.
        """
        from twisted.logger import capturedLogs

        app, _ = relaySite()
        with capturedLogs() as events:
            Conn(app.site).send(head(b"/v1/responses?api_key=x", length=10,
                                     headers=b"X-Request-Id: intake-refused-1\r\n"))
        [line] = [e for e in events if e.get("event") == "relay.http_access"]
        self.assertEqual((line["status"], line["method"], line["client_request_id"],
                          line["path"]),
                         (401, "POST", "intake-refused-1", "/v1/responses?api_key=***"))
        self.assertTrue(line["request_id"].startswith("req_"), line["request_id"])

    def test_webSocketUpgradeWithoutKey(self):
        """
        The WebSocket upgrade needs the key like every client route.
        """
        app, _ = relaySite()
        conn = Conn(app.site).send(
            head(b"/v1/responses", b"GET", b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
        )
        self.assertEqual(conn.status(), 401)

    def test_chunkedBombWithoutKeyStoresNothing(self):
        """
        The issue's second attack: a chunked zstd chunk that decodes to
        60 MiB, the last chunk never sent: without a key nothing is
        decoded or spooled (today 60 MiB of temp file per connection).
        """
        app, _ = relaySite()
        zeros = zstandard.ZstdCompressor().compress(b"a=&" * (20 * 2**20))
        conn = Conn(app.site).send(head(headers=b"Transfer-Encoding: chunked\r\n"
                                        b"Content-Encoding: zstd\r\n"))
        conn.send(b"%x\r\n" % len(zeros) + zeros + b"\r\n")
        self.assertEqual(conn.status(), 401)
        self.assertIsNone(conn.inner._channel.requests[-1].content)

    def test_formsAreNeverParsed(self):
        """
        relay reads JSON only: a form body with the key reaches the
        resource as bytes, twisted.web parses no arguments from it.
        """
        app, probe = relaySite()
        body = b"a=&" * 1000
        Conn(app.site).send(head(b"/v1/probe", headers=AUTH + b"Content-Type: "
                                 b"application/x-www-form-urlencoded\r\n", length=len(body)) + body)
        [seen] = probe.seen
        self.assertEqual(seen["args"], {})
        self.assertEqual(seen["body"], body)
        self.assertEqual(seen["key"].name, "team")

    def test_statusShellAndHealthNeedNoKey(self):
        """
        R99: the status page shell (and its static files, issue 40),
        C{/healthz} and C{/readyz} need none; a body sent to them is
        discarded unread.
        """
        app, _ = relaySite()
        for path in (b"/healthz", b"/readyz", b"/admin/", b"/admin/static/js/app.js"):
            conn = Conn(app.site).send(head(path, b"GET"))
            self.assertEqual(conn.status(), 200, path)


class KeySlotBeforeDecodingTests(SynchronousTestCase):
    """
    Item 2 / R103: the key's slot is admitted before the body is decoded.
    """

    def test_decodedOnlyOnceAdmitted(self):
        app, probe = relaySite(concurrency=1)
        calls = []
        original = B.contentDecoder

        def spy(header, limit, out):
            if limit > 1:
                calls.append(limit)
            return original(header, limit, out)

        self.patch(B, "contentDecoder", spy)
        held = []
        app.admission.tryAcquire("user", "team", 1).addCallback(held.append)
        body = zstandard.ZstdCompressor().compress(b'{"model":"m"}')
        Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH + b"Content-Encoding: zstd\r\n", length=len(body))
            + body)
        self.assertEqual((calls, probe.seen), ([], []))
        held[0].release()
        app.reactor.advance(1)
        self.assertEqual(len(calls), 1)
        [seen] = probe.seen
        self.assertEqual(seen["body"], b'{"model":"m"}')
        self.assertIsNotNone(seen["lease"])

    def test_waitTimesOutWith429(self):
        """
        R26/R32: the wait for the key's slot times out as a 429 naming it.
        """
        app, probe = relaySite(concurrency=1)
        app.settings.update({"scheduling.user_wait_timeout": 1})
        held = []
        app.admission.tryAcquire("user", "team", 1).addCallback(held.append)
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        app.reactor.advance(3)
        self.assertEqual(conn.status(), 429)
        self.assertEqual(conn.error()["message"],
                         "Concurrency limit exceeded for user, please retry later")
        self.assertEqual(probe.seen, [])


class BoundedBodyTests(SynchronousTestCase):
    """
    Item 2: bytes held per key and in total, the decompression ratio, the
    parsed-size estimate.
    """

    def test_perKeyAndTotalBytesInFlight(self):
        app, _ = relaySite("{body_bytes_in_flight_per_key: 3000, body_bytes_in_flight: 5000}")
        first = Conn(app.site).send(head(headers=AUTH, length=2000))
        self.assertEqual(first.value, b"")
        second = Conn(app.site).send(head(headers=AUTH, length=2000))
        self.assertEqual(second.status(), 429)
        self.assertEqual(second.error()["code"], "body_bytes_in_flight_exceeded")
        self.assertIn("body_bytes_in_flight_per_key", second.error()["message"])
        first.protocol.connectionLost(None)
        third = Conn(app.site).send(head(headers=AUTH, length=2000))
        self.assertEqual(third.value, b"")

    def test_decompressionRatio(self):
        """
        Every encoding and chain, identity length and chunked: a body that
        decodes to more than 100x its size (and over 1 MiB) is a 413.
        """
        data = b'{"input":"' + b"a" * (8 * 2**20) + b'"}'
        z = zstandard.ZstdCompressor().compress
        deflate = zlib.compress
        encodings = {
            b"zstd": z(data), b"gzip": gzip.compress(data), b"deflate": deflate(data),
            b"gzip, zstd": z(gzip.compress(data)),
        }
        for encoding, payload in encodings.items():
            for chunked in (False, True):
                app, probe = relaySite()
                hdrs = AUTH + b"Content-Encoding: " + encoding + b"\r\n"
                if chunked:
                    raw = head(b"/v1/probe", headers=hdrs + b"Transfer-Encoding: chunked\r\n")
                    raw += b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n"
                else:
                    raw = head(b"/v1/probe", headers=hdrs, length=len(payload)) + payload
                conn = Conn(app.site).send(raw)
                self.assertEqual(conn.status(), 413, (encoding, chunked))
                self.assertEqual(conn.error()["code"], "decompression_ratio_exceeded")
                self.assertEqual(probe.seen, [])

    def test_parsedEstimateOverTheKeyBound(self):
        """
        C{[{},{},...]} parses to ~24x its size: a body whose estimate is
        over the per-key bound can never be held: 413 naming it.
        """
        self.assertGreater(B.parsedEstimate(b"{}," * 1000), 24 * 3000)
        app, probe = relaySite("{body_bytes_in_flight_per_key: 1048576}")
        body = b'{"input":[' + b"{}," * 100000 + b"{}]}"
        conn = Conn(app.site).send(head(b"/v1/probe", headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 413)
        self.assertIn("body_bytes_in_flight_per_key", conn.error()["message"])
        self.assertEqual(probe.seen, [])


class ParsedHoldTests(SynchronousTestCase):
    """
    R103: a large body (a Codex history) is held at the most its parse can
    take while it is parsed, then at the estimate of what it holds; no
    pass over its bytes first. When that bound does not fit, the pass's
    estimate decides, as for a small body.
    """

    def _site(self, limits="{}"):
        app, probe = relaySite(limits)
        seen = probe.seen

        def render(request):
            budget = request._intake.budget
            before = budget.total
            value = request.relayJSON()
            seen.append({"before": before, "after": budget.total, "items": len(value["input"]),
                         "budget": budget})
            return b"{}"

        probe.render_POST = render
        return app, seen

    def _body(self):
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "x" * 200}]}] * 300
        return json.dumps({"model": "m", "input": items}, separators=(",", ":")).encode()

    def test_boundThenShape(self):
        from relay.frontdoor import budgets
        from relay.wire.jsoncodec import loadsLarge

        body = self._body()
        calls = []
        real = budgets.parsedEstimate
        self.patch(B, "parsedEstimate", lambda data: calls.append(len(data)) or real(data))
        app, seen = self._site()
        conn = Conn(app.site).send(head(b"/v1/probe", headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 200)
        shape = []
        loadsLarge(body, shape)
        held = budgets.shapeEstimate(len(body), *shape[0])
        self.assertEqual([(s["before"], s["after"], s["items"]) for s in seen],
                         [(budgets.parsedBound(len(body)), held, 300)])
        self.assertEqual(calls, [])  # no pass over the bytes

    def test_boundDoesNotFit(self):
        from relay.frontdoor import budgets

        body = self._body()
        limit = budgets.parsedEstimate(body) + 1000
        self.assertLess(limit, budgets.parsedBound(len(body)))
        app, seen = self._site(f"{{body_bytes_in_flight_per_key: {limit}}}")
        conn = Conn(app.site).send(head(b"/v1/probe", headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 200)
        self.assertEqual(seen[0]["before"], budgets.parsedEstimate(body))
        self.assertLessEqual(seen[0]["after"], seen[0]["before"])  # never up
        self.assertEqual(seen[0]["budget"].total, 0)  # the request ended


    def test_wideStrings(self):
        """
        A string that is not ASCII holds 2 or 4 bytes a character: one
        emoji before 100 KiB of C{a} parses to 400 KiB. The hold counts
        what such strings take, never less than the parse holds.
        """
        import sys

        app, seen = self._site()
        text = "\U0001f600" + "a" * 100000
        body = json.dumps({"model": "m", "input": [{"type": "message", "content": text}]},
                          ensure_ascii=False, separators=(",", ":")).encode()
        conn = Conn(app.site).send(head(b"/v1/probe", headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 200)
        self.assertGreater(seen[0]["after"], len(body) + sys.getsizeof(text))
        # the bound does not fit: the pass's estimate is held while it is
        # parsed, then the shape's, up
        from relay.frontdoor import budgets

        app, seen = self._site(f"{{body_bytes_in_flight_per_key: {budgets.parsedBound(len(body)) - 1}}}")
        conn = Conn(app.site).send(head(b"/v1/probe", headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 200)
        self.assertEqual(seen[0]["before"], budgets.parsedEstimate(body))
        self.assertGreater(seen[0]["after"], len(body) + sys.getsizeof(text))
        # ... and when that does not fit, the client's 413
        app, _ = relaySite(f"{{body_bytes_in_flight_per_key: {len(body) * 2}}}")
        conn = Conn(app.site).send(head(headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 413)
        self.assertEqual(conn.error()["code"], "request_too_large")
        self.assertEqual(app.site.intake.budget.total, 0)

    def test_notReadAsJSON(self):
        """
        A large body the resource does not read as JSON (a multipart
        image edit) is not left held at the bound for its whole turn (113
        times its bytes: a 2 MiB image would hold most of a key's 256 MiB):
        once the resource has rendered, the pass's estimate is held.
        """
        from relay.frontdoor import budgets

        app, _ = relaySite()
        image = b"\x89PNG" + bytes(range(256)) * 400
        form = (b"--B\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n"
                b"--B\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
                b"Content-Type: image/png\r\n\r\n" + image + b"\r\n--B--\r\n")
        conn = Conn(app.site).send(head(
            b"/v1/images/edits", headers=AUTH + b"Content-Type: multipart/form-data; boundary=B\r\n",
            length=len(form)) + form)
        self.assertEqual(conn.status(), 0)  # the turn is in flight (its dial pending)
        self.assertEqual(app.site.intake.budget.total, budgets.parsedEstimate(form))

    def test_readByTheStandardLibrary(self):
        """
        A large body orjson's reading of is not certain (an integer beyond
        64 bits) is read by the standard library, which gives no shape:
        the pass's estimate is held for the turn, not the bound.
        """
        from relay.frontdoor import budgets

        app, _ = relaySite()
        body = self._body()[:-1] + b',"seed":123456789012345678901234567}'
        conn = Conn(app.site).send(head(headers=AUTH, length=len(body)) + body)
        self.assertEqual(conn.status(), 0)  # the turn is in flight
        self.assertEqual(app.site.intake.budget.total, budgets.parsedEstimate(body))


class HistoryReuseTests(SynchronousTestCase):
    """
    A Codex turn's body that extends the one its key sent before is read
    from that one and its new items (L{relay.frontdoor.reuse}), with the
    value and the hold a whole read gives.
    """

    def _send(self, app, body, key=AUTH):
        return Conn(app.site).send(head(b"/v1/probe", headers=key, length=len(body)) + body)

    def test_extended(self):
        from relay.frontdoor import budgets
        from relay.wire.jsoncodec import loadsLarge

        app, probe = relaySite()
        seen = []

        def render(request):
            value = request.relayJSON()
            seen.append((value, request._intake.budget.total, request._intake.histories.hits))
            return b"{}"

        probe.render_POST = render
        items = [{"type": "message", "role": "user", "content": "x" * 300}] * 100

        def body(n):
            return json.dumps({"model": "m", "input": items[:n], "prompt_cache_key": "c"},
                              separators=(",", ":")).encode()

        for n in (60, 61, 100, 100):
            self.assertEqual(self._send(app, body(n)).status(), 200)
            shape = []
            loadsLarge(body(n), shape)
            self.assertEqual(seen[-1][0], json.loads(body(n)))
            self.assertEqual(seen[-1][1], budgets.shapeEstimate(len(body(n)), *shape[0]))
        self.assertEqual([hits for _, _, hits in seen], [0, 1, 2, 3])
        self.assertEqual(app.site.intake.histories.size, len(body(100)))


    def test_reissuedKey(self):
        """
        R104: a key issued again under a name (another owner) never reads
        its bodies from those the name's former key sent: the kept bodies
        are the owner's (L{relay.base.records.ClientKey.ownerId}).
        """
        from attrs import evolve

        app, probe = relaySite()
        probe.render_POST = lambda request: request.relayJSON() and b"{}"
        items = [{"type": "message", "role": "user", "content": "x" * 300}] * 100

        def body(n):
            return json.dumps({"model": "m", "input": items[:n]}, separators=(",", ":")).encode()

        histories = app.site.intake.histories
        for n in (60, 61):
            self.assertEqual(self._send(app, body(n)).status(), 200)
        self.assertEqual(histories.hits, 1)
        keys = app.live.keys
        keys.replace([evolve(keys.byName("team"), issuance="again")])
        self.assertEqual(self._send(app, body(62)).status(), 200)
        self.assertEqual(histories.hits, 1)
        self.assertEqual(self._send(app, body(63)).status(), 200)
        self.assertEqual(histories.hits, 2)  # its own


class WideReadsTests(SynchronousTestCase):
    """
    While a body of a known length above 64 KiB arrives on a plain TCP
    connection, the connection is read up to 1 MiB at a time (a Codex
    history in a few reads); Twisted's read size comes back with its end.
    """

    def test_widenedWhileTheBodyArrives(self):
        import socket

        from twisted.internet import tcp

        from tests.test_sendnow import _Reactor

        app, probe = relaySite()
        listener = socket.create_server(("127.0.0.1", 0))
        theirs = socket.create_connection(listener.getsockname())
        mine, _ = listener.accept()
        listener.close()
        mine.setblocking(False)
        self.addCleanup(mine.close)
        self.addCleanup(theirs.close)
        protocol = app.site.buildProtocol(IPv4Address("TCP", "10.0.0.1", 40000))
        transport = tcp.Connection(mine, protocol, reactor=_Reactor())
        transport.connected = 1
        transport.getPeer = lambda: IPv4Address("TCP", "10.0.0.1", 40000)
        transport.getHost = lambda: IPv4Address("TCP", "127.0.0.1", 8080)
        protocol.makeConnection(transport)
        body = b'{"input":"' + b"x" * 300_000 + b'"}'
        protocol.dataReceived(head(b"/v1/probe", headers=AUTH, length=len(body)) + body[:1000])
        self.assertEqual(transport.bufferSize, len(body) + 65536)
        protocol.dataReceived(body[1000:])
        self.assertEqual(len(probe.seen), 1)
        self.assertNotIn("bufferSize", vars(transport))
        self.assertEqual(transport.bufferSize, tcp.Connection.bufferSize)
        big = b'{"input":"' + b"x" * 3_000_000 + b'"}'
        protocol.dataReceived(head(b"/v1/probe", headers=AUTH, length=len(big)) + big[:10])
        self.assertEqual(transport.bufferSize, B.READ_BYTES)
        protocol.connectionLost(None)
        self.assertNotIn("bufferSize", vars(transport))



class DeepNestingTests(SynchronousTestCase):
    """
    Item 3: deep nesting is a 400 in OpenAI's format on every JSON reader.
    """

    def test_http(self):
        app, _ = relaySite()
        body = b'{"model":"m","input":' + b"[" * 200000 + b"]" * 200000 + b"}"
        for path in (b"/v1/responses", b"/v1/chat/completions"):
            conn = Conn(app.site).send(head(path, headers=AUTH, length=len(body)) + body)
            self.assertEqual(conn.status(), 400, conn.value[:200])
            self.assertEqual(conn.error()["type"], "invalid_request_error")

    def test_admin(self):
        app, _ = relaySite()
        body = b"[" * 60000
        conn = Conn(app.site).send(head(b"/admin/settings", b"PUT", b"Authorization: Bearer "
                                        + ADMIN.encode() + b"\r\n", length=len(body)) + body)
        self.assertEqual(conn.status(), 400)

    def test_loadJSON(self):
        """
        The reader of WebSocket frames.
        """
        from relay.entry.http import NESTING_MESSAGE, loadJSON

        with self.assertRaises(ValueError) as e:
            loadJSON(b"[" * 200000)
        self.assertEqual(str(e.exception), NESTING_MESSAGE)


class SlowClientTests(SynchronousTestCase):
    """
    Item 4: header deadline, minimum body rate, connection caps.
    """

    def test_headerDrip(self):
        app, _ = relaySite("{header_timeout_seconds: 10}")
        conn = Conn(app.site).send(b"POST /v1/responses HTTP/1.1\r\n")
        for _ in range(3):
            conn.clock.advance(3)
            conn.send(b"X")
        self.assertEqual(conn.value, b"")
        conn.clock.advance(2)
        self.assertEqual(conn.status(), 408)
        self.assertTrue(conn.transport.disconnecting)

    def test_slowBody(self):
        app, _ = relaySite("{min_body_bytes_per_second: 100}")
        conn = Conn(app.site).send(head(headers=AUTH, length=100000))
        conn.send(b"a" * 999)
        conn.clock.advance(10)
        self.assertEqual(conn.status(), 408)

    def test_noCycleOnceIn(self):
        """
        A request whose body is in (the minimum rate configured, its timer
        stopped) is not left in a reference cycle with its rate: it, its
        body and its parse go with the request, not at the next full
        collection (1 MiB Codex bodies at c=32 kept dozens alive).
        """
        import gc
        import weakref

        app, probe = relaySite("{min_body_bytes_per_second: 100}")
        seen = []
        probe.render_POST = lambda request: seen.append(weakref.ref(request)) or b"{}"
        gc.disable()
        try:
            conn = Conn(app.site).send(head(path=b"/v1/probe", headers=AUTH, length=3) + b"{}\n")
            self.assertEqual(conn.status(), 200)
            conn.inner.connectionLost(None)
            del conn, app, probe
            self.assertIsNone(seen[0]())
        finally:
            gc.enable()

    def test_slowBodyWindow(self):
        """
        The window the rate is measured over is configurable.
        """
        app, _ = relaySite("{min_body_bytes_per_second: 100, body_rate_window_seconds: 2}")
        conn = Conn(app.site).send(head(headers=AUTH, length=100000))
        conn.send(b"a" * 150)
        conn.clock.advance(1.9)
        self.assertEqual(conn.value, b"")
        conn.clock.advance(0.1)
        self.assertEqual(conn.status(), 408)
        self.assertIn("min_body_bytes_per_second", conn.error()["message"])

    def test_connectionCaps(self):
        """
        A request on a connection over a cap (other than the health routes,
        L{OverCapHealthTests}) is a JSON 503 C{too_many_connections}.
        """
        models = head(b"/v1/models", b"GET", AUTH)
        app, _ = relaySite("{max_connections: 3, max_connections_per_address: 2}")
        a1, a2 = Conn(app.site), Conn(app.site)
        a3 = Conn(app.site).send(models)
        self.assertEqual(a3.status(), 503)
        self.assertEqual(a3.error()["code"], "too_many_connections")
        Conn(app.site, host="10.0.0.2")
        self.assertEqual(Conn(app.site, host="10.0.0.3").send(models).status(), 503)
        a1.protocol.connectionLost(None)
        self.assertEqual(Conn(app.site).value, b"")
        self.assertEqual(app.site.openByAddress, {"10.0.0.1": 2, "10.0.0.2": 1})

    def test_refusalsLoggedOncePerSecond(self):
        """
        A refused connection is logged (C{relay.intake_connection_refused},
        naming the cap), but a flood of them is one line per cap per second
        that counts the refusals it stands for.
        """
        app, _ = relaySite("{max_connections_per_address: 1}")
        Conn(app.site)
        with capturedLogs() as events:
            for _ in range(50):
                self.assertEqual(Conn(app.site).send(head()).status(), 503)
            app.reactor.advance(1)
            Conn(app.site)
        refused = [e for e in events if e.get("event") == "relay.intake_connection_refused"]
        self.assertEqual([(e["cap"], e["suppressed"]) for e in refused],
                         [("max_connections_per_address", 0), ("max_connections_per_address", 49)])
        self.assertIn("49 more refused", formatEvent(refused[1]))

    def test_capsThatBiteAreLogged(self):
        """
        The header deadline and the minimum body rate log when they close
        a connection (issue 19 item 4: "logged when it bites").
        """
        app, _ = relaySite("{header_timeout_seconds: 10, min_body_bytes_per_second: 100}")
        with capturedLogs() as events:
            late = Conn(app.site).send(b"POST /v1/responses HTTP/1.1\r\n")
            late.clock.advance(11)
            slow = Conn(app.site, host="10.0.0.9").send(head(headers=AUTH, length=100000))
            slow.send(b"a" * 999)
            slow.clock.advance(10)
        self.assertEqual((late.status(), slow.status()), (408, 408))
        kinds = [e.get("event") for e in events]
        self.assertIn("relay.intake_header_timeout", kinds)
        self.assertIn("relay.intake_slow_body", kinds)


class OverCapHealthTests(SynchronousTestCase):
    """
    A connection over C{max_connections} / C{max_connections_per_address}
    still answers C{/healthz} and C{/readyz} (a liveness probe sharing the
    flood's address must not fail), from a small allowance counted on its
    own; nothing else is answered on it.
    """

    def flooded(self, limits="{max_connections_per_address: 1}"):
        app, _ = relaySite(limits)
        Conn(app.site)  # the cap is reached
        return app

    def test_healthAnsweredOverTheCaps(self):
        """
        Over either cap, C{GET /healthz} and C{GET /readyz} are 200 (today
        503 C{too_many_connections} at connect), and the connection closes
        after the one answer.
        """
        for limits in ("{max_connections_per_address: 1}", "{max_connections: 1}"):
            app = self.flooded(limits)
            for path in (b"/healthz", b"/readyz", b"/healthz?probe=1"):
                conn = Conn(app.site).send(head(path, b"GET"))
                self.assertEqual(conn.status(), 200, (limits, path))
                self.assertIn(b"connection: close", conn.value.lower())
                self.assertTrue(conn.transport.disconnecting)
            self.assertEqual(app.site.openConnections, 1)
            self.assertEqual(app.site.openByAddress, {"10.0.0.1": 1})

    def test_otherRoutesRefused(self):
        """
        Any other request on an over-cap connection (with the key or not,
        the status page, a WebSocket upgrade) is the JSON 503 and close,
        logged as a refused connection; a request pipelined after a health
        probe is not answered.
        """
        app = self.flooded()
        upgrade = (b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13"
                   b"\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
        with capturedLogs() as events:
            for request in (head(b"/v1/models", b"GET", AUTH), head(headers=AUTH, length=2),
                            head(b"/admin/", b"GET"), head(b"/v1/responses", b"GET",
                                                           AUTH + upgrade),
                            head(b"/healthz/x", b"GET")):
                conn = Conn(app.site).send(request)
                self.assertEqual(conn.status(), 503, request)
                self.assertEqual(conn.error()["code"], "too_many_connections")
                self.assertIn(b"retry-after: 1", conn.value.lower())
                self.assertTrue(conn.halfClosed)
        refused = [e for e in events if e.get("event") == "relay.intake_connection_refused"]
        self.assertEqual([e["cap"] for e in refused], ["max_connections_per_address"])
        conn = Conn(app.site).send(head(b"/healthz", b"GET") + head(b"/v1/models", b"GET", AUTH))
        self.assertEqual(conn.value.count(b"HTTP/1.1 "), 1)

    def test_allowanceIsBounded(self):
        """
        At most L{OVER_CAP_ALLOWANCE} connections over the caps are open at
        once; when they are all past their headers, a new one is refused
        at connect.
        """
        from relay.entry.site import OVER_CAP_ALLOWANCE

        app = self.flooded()
        held = [Conn(app.site).send(head(b"/readyz", b"GET"))
                for _ in range(OVER_CAP_ALLOWANCE)]
        self.assertEqual({c.status() for c in held}, {200})
        self.assertEqual(len(app.site.overCap), OVER_CAP_ALLOWANCE)
        refused = Conn(app.site)
        self.assertEqual(refused.status(), 503)
        self.assertEqual(len(app.site.overCap), OVER_CAP_ALLOWANCE)
        app.site.unregisterProtocol(held[0].protocol)  # one closes
        self.assertEqual(Conn(app.site).send(head(b"/healthz", b"GET")).status(), 200)

    def test_idleConnectionsMakeRoom(self):
        """
        Connections held open without a request cannot keep the probe out:
        the oldest one whose headers are not in is closed (503) to make
        room, and every one of them is under the header deadline.
        """
        from relay.entry.site import OVER_CAP_ALLOWANCE

        app = self.flooded("{max_connections_per_address: 1, header_timeout_seconds: 5}")
        idle = [Conn(app.site) for _ in range(OVER_CAP_ALLOWANCE)]
        probe = Conn(app.site)
        self.assertEqual(idle[0].status(), 503)
        self.assertTrue(idle[0].transport.disconnecting)
        self.assertEqual([c.value for c in idle[1:]], [b""] * (OVER_CAP_ALLOWANCE - 1))
        self.assertEqual(len(app.site.overCap), OVER_CAP_ALLOWANCE)
        self.assertEqual(probe.send(head(b"/healthz", b"GET")).status(), 200)
        idle[1].clock.advance(5)
        self.assertEqual(idle[1].status(), 408)


class IntakeLogThrottleTests(SynchronousTestCase):
    """
    Every intake refusal an unauthenticated client can repeat at will is
    logged at most once per second per kind, counting the ones it stands
    for (one shared L{relay.entry.logthrottle.LogThrottle}).
    """

    def flood(self, app, event, one, times=20):
        with capturedLogs() as events:
            for i in range(times):
                one(i)
            app.reactor.advance(1)
            one(times)
        lines = [e for e in events if e.get("event") == event]
        self.assertEqual([e["suppressed"] for e in lines], [0, times - 1])
        self.assertIn(f"{times - 1} more", formatEvent(lines[1]))

    def test_headerTimeout(self):
        """
        C{relay.intake_header_timeout}: one line per second (today one per
        connection).
        """
        app, _ = relaySite("{header_timeout_seconds: 10}")

        def one(i):
            conn = Conn(app.site, host=f"10.0.1.{i}").send(b"POST /v1/responses HTTP/1.1\r\n")
            conn.clock.advance(11)
            self.assertEqual(conn.status(), 408)

        self.flood(app, "relay.intake_header_timeout", one)

    def test_slowBody(self):
        """
        C{relay.intake_slow_body}: the same.
        """
        app, _ = relaySite("{min_body_bytes_per_second: 100}")

        def one(i):
            conn = Conn(app.site, host=f"10.0.2.{i}").send(head(headers=AUTH, length=100000))
            conn.clock.advance(10)
            self.assertEqual(conn.status(), 408)

        self.flood(app, "relay.intake_slow_body", one)

    def test_headerTooLarge(self):
        """
        C{relay.intake_header_too_large}: the same.
        """
        app, _ = relaySite()

        def one(i):
            conn = Conn(app.site, host=f"10.0.3.{i}").send(
                head(headers=b"X-Big: " + b"a" * 17000 + b"\r\n"))
            self.assertEqual(conn.status(), 431)

        self.flood(app, "relay.intake_header_too_large", one)


class HeaderTooLargeTests(SynchronousTestCase):
    """
    A header line over twisted.web's 16 KiB line limit was dropped without
    a byte (curl: "Empty reply from server"); now 431 in OpenAI's format,
    with C{X-Request-Id}, then close.
    """

    def test_headerLine(self):
        app, _ = relaySite()
        with capturedLogs() as events:
            conn = Conn(app.site).send(head(headers=b"X-Request-Id: big-1\r\nX-Big: "
                                            + b"a" * 17000 + b"\r\n"))
        self.assertEqual(conn.status(), 431)
        self.assertEqual(conn.error()["code"], "request_header_fields_too_large")
        # R111: relay's own id, never the client's.
        requestId = conn.error()["request_id"]
        self.assertTrue(requestId.startswith("req_"), requestId)
        self.assertIn(b"x-request-id: " + requestId.encode() + b"\r\n", conn.value.lower())
        self.assertIn(b"connection: close", conn.value.lower())
        self.assertTrue(conn.transport.disconnecting)
        [line] = [e for e in events if e.get("event") == "relay.intake_header_too_large"]
        self.assertEqual((line["status"], line["client"]), (431, conn.transport.getPeer().host))
        conn.send(b"\r\nGET /healthz HTTP/1.1\r\n\r\n")  # nothing more is read
        self.assertEqual(conn.value.count(b"HTTP/1.1 "), 1)

    def test_tooManyHeaderLines(self):
        """
        More header lines than twisted.web's 500 (each small, the block
        under 16 KiB) was twisted.web's 400; now a 431 in OpenAI's format
        saying so, logged as C{relay.intake_header_too_large} in lines.
        """
        app, _ = relaySite()
        lines = b"".join(b"X-%d: 1\r\n" % i for i in range(501))
        with capturedLogs() as events:
            conn = Conn(app.site).send(head(headers=b"X-Request-Id: many-1\r\n" + lines))
        self.assertEqual(conn.status(), 431)
        self.assertEqual(conn.error()["code"], "request_header_fields_too_large")
        self.assertIn("too many header lines", conn.error()["message"])
        self.assertTrue(conn.transport.disconnecting)
        [line] = [e for e in events if e.get("event") == "relay.intake_header_too_large"]
        self.assertEqual((line["status"], line["limit"], line["unit"]), (431, 500, "lines"))
        ok = Conn(app.site).send(head(headers=b"".join(b"X-%d: 1\r\n" % i for i in range(499))))
        self.assertNotEqual(ok.status(), 431)

    def test_heldLineWithAnInvalidName(self):
        """
        The header line twisted.web held back before the long one is no
        valid header at all (the fuzz's C{;: ...}): still a 431 (the held
        line was added as a header and raised C{InvalidHeaderName}).
        """
        app, _ = relaySite()
        conn = Conn(app.site).send(head(headers=b";: " + b"x" * 100 + b"\r\nX-Big: "
                                        + b"a" * 17000 + b"\r\n"))
        self.assertEqual(conn.status(), 431)
        self.assertRegex(conn.value.decode(), r"X-Request-Id: req_[0-9a-f]+\r\n")

    def test_lineWithoutEnd(self):
        """
        17 KiB of one header line not yet ended is answered at once.
        """
        app, _ = relaySite()
        conn = Conn(app.site).send(b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 17000)
        self.assertEqual(conn.status(), 431)

    def test_headerBlock(self):
        """
        A header block over 16 KiB in short lines: 431 too (today JSON 400).
        """
        app, _ = relaySite()
        lines = b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 1000) for i in range(17))
        conn = Conn(app.site).send(head(headers=lines))
        self.assertEqual(conn.status(), 431)
        self.assertEqual(conn.error()["type"], "invalid_request_error")

    def test_requestLine(self):
        """
        A request line over the limit is a 414.
        """
        app, _ = relaySite()
        conn = Conn(app.site).send(b"GET /" + b"a" * 17000 + b" HTTP/1.1\r\n")
        self.assertEqual(conn.status(), 414)
        self.assertEqual(conn.error()["code"], "request_uri_too_long")
        self.assertRegex(conn.value.decode(), r"X-Request-Id: req_[0-9a-f]+\r\n")


class IntakeAccessLineTests(SynchronousTestCase):
    """
    The access line of an answer written by the intake has a duration
    (today C{in Nonems}).
    """

    def accessLine(self, app, send):
        with capturedLogs() as events:
            send()
        [line] = [e for e in events if e.get("event") == "relay.http_access"]
        return line

    def test_fromTheHeaders(self):
        app, _ = relaySite()
        line = self.accessLine(app, lambda: Conn(app.site).send(head(length=10)))
        self.assertEqual((line["status"], line["duration_ms"]), (401, 0.0))
        self.assertNotIn("None", formatEvent(line))
        self.assertTrue(formatEvent(line).endswith(" in 0.0ms"), formatEvent(line))

    def test_afterPartOfTheBody(self):
        """
        A 413 two seconds into the body: 2000 ms, counted from the headers.
        """
        app, _ = relaySite(body_limit=1024)

        def send():
            conn = Conn(app.site).send(head(headers=AUTH + b"Transfer-Encoding: chunked\r\n"))
            app.reactor.advance(2)
            conn.send(b"7d0\r\n" + b"a" * 2000 + b"\r\n")
            self.assertEqual(conn.status(), 413)

        line = self.accessLine(app, send)
        self.assertEqual(line["duration_ms"], 2000.0)


class OpenRouteBodyTests(SynchronousTestCase):
    """
    docs/security.md: a body sent to C{/healthz}, C{/readyz} or C{GET
    /admin/} is discarded unread -- whatever its size or encoding (today
    413 over 64 KiB, 415 for an unknown encoding).
    """

    def test_discardedUnread(self):
        app, _ = relaySite()
        big = b"a" * (200 * 1024)
        for path, method in ((b"/healthz", b"POST"), (b"/readyz", b"POST"),
                             (b"/admin/", b"GET"), (b"/healthz", b"GET")):
            conn = Conn(app.site).send(head(path, method, length=len(big)))
            request = conn.inner._channel.requests[-1]
            conn.send(big[:-1])
            self.assertEqual((conn.value, request.content.getvalue()), (b"", b""), path)
            conn.send(big[-1:])
            self.assertEqual(conn.status(), 200 if method == b"GET" else 405, (path, method))
            conn = Conn(app.site).send(
                head(path, method, b"Transfer-Encoding: chunked\r\nContent-Encoding: br\r\n")
                + b"%x\r\n" % len(big) + big + b"\r\n0\r\n\r\n")
            self.assertEqual(conn.status(), 200 if method == b"GET" else 405, (path, method))

    def test_stillUnderTheBodyRate(self):
        """
        A discarded body still has to arrive at the minimum rate.
        """
        app, _ = relaySite("{min_body_bytes_per_second: 100}")
        conn = Conn(app.site).send(head(b"/healthz", b"POST", length=100000))
        conn.send(b"a" * 999)
        conn.clock.advance(10)
        self.assertEqual(conn.status(), 408)


class DrainTests(SynchronousTestCase):
    """
    Issue 14 with issue 19's order: a request waiting for its key's slot
    before its body is decoded is a turn for the graceful stop.
    """

    def test_graceOverCancelsTheKeyWait(self):
        """
        The stop waits for a request queued for its key's slot and, when
        the grace runs out, answers it 503 C{server_restarting} with
        C{Retry-After}; it never gets the slot afterwards (today the drain
        does not see it: it takes the slot once the running turns are
        cancelled, after the drain gave every slot back).
        """
        app, probe = relaySite(concurrency=1)
        held = []
        app.admission.tryAcquire("user", "team", 1).addCallback(held.append)
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual(len(app.runner.inflight), 1)
        report = []
        app.drain.drain(grace=1).addCallback(report.append)
        app.reactor.advance(2)
        self.assertEqual(conn.status(), 503)
        self.assertEqual(conn.error()["code"], "server_restarting")
        self.assertIn(b"retry-after: 1", conn.value.lower())
        self.assertEqual(report[0].cancelled, 1)
        self.assertEqual(app.runner.inflight, {})
        held[0].release()
        app.reactor.advance(1)
        self.assertEqual(probe.seen, [])
        load = []
        app.admission.load("user", ["team"]).addCallback(load.append)
        self.assertEqual(load, [{"team": (0, 0)}])

    def test_noSlotTakenWhileDraining(self):
        """
        A request that arrives during the drain takes no slot and is
        answered 503 without its body being decoded.
        """
        app, probe = relaySite(concurrency=1)
        app.drain.start()
        calls = []
        self.patch(app.site.intake, "admitKey", lambda *a, **k: calls.append(a))
        body = zstandard.ZstdCompressor().compress(b'{"model":"m"}')
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH + b"Content-Encoding: zstd\r\n", length=len(body))
            + body)
        self.assertEqual(conn.status(), 503)
        self.assertEqual((calls, probe.seen), ([], []))


class KeepaliveWhileQueuedTests(SynchronousTestCase):
    """
    R85 with R103: a streaming turn that waits for its key's slot (before
    its body may be parsed) gets keepalives at the turn's pace; the body's
    C{stream} flag decides (protocol.md 2.1: the SDK sends C{Accept:
    application/json} when it streams), read from the raw bytes.
    """

    SDK_BODY = json.dumps({"input": [{"role": "user", "content": "hi"}], "model": "m",
                           "stream": True, "tools": [{"type": "function", "name": "f",
                                                      "parameters": {}}]}).encode()

    def queued(self, body, path=b"/v1/responses", headers=b"", wait=None):
        app, probe = relaySite(concurrency=1)
        app.settings.update({"stream_keepalive_interval": 10,
                             "scheduling.user_wait_timeout": wait or 30})
        held = []
        app.admission.tryAcquire("user", "team", 1).addCallback(held.append)
        conn = Conn(app.site, clock=app.reactor).send(
            head(path, headers=AUTH + b"Accept: application/json\r\n" + headers,
                 length=len(body)) + body)
        return app, conn, held

    def test_streamingBodyGetsKeepalives(self):
        """
        Nothing before C{stream_keepalive_interval}; then 200, the SSE
        headers and an SSE comment every interval while the wait lasts; a
        wait that times out ends in-stream (R19.2).
        """
        app, conn, _ = self.queued(self.SDK_BODY, wait=25)
        app.reactor.advance(9)
        self.assertEqual(conn.value, b"")
        app.reactor.advance(1)
        head_, _, rest = conn.value.partition(b"\r\n\r\n")
        self.assertTrue(head_.startswith(b"HTTP/1.1 200"), conn.value)
        self.assertIn(b"content-type: text/event-stream", head_.lower())
        self.assertIn(b"x-request-id: ", head_.lower())
        self.assertEqual(rest.count(b":\n\n"), 1)
        app.reactor.advance(10)
        self.assertEqual(conn.value.count(b":\n\n"), 2)
        app.reactor.advance(10)
        body = conn.value.partition(b"\r\n\r\n")[2]
        self.assertIn(b"event: response.failed", body)
        self.assertIn(b'"code": "rate_limit_exceeded"', body)
        self.assertTrue(body.endswith(b"0\r\n\r\n"), body[-40:])

    def test_chatStreamErrorIsAnErrorEvent(self):
        body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
        app, conn, _ = self.queued(body, path=b"/v1/chat/completions", wait=15)
        app.reactor.advance(20)
        rest = conn.value.partition(b"\r\n\r\n")[2]
        self.assertIn(b":\n\n", rest)
        self.assertIn(b"event: error\ndata: ", rest)
        self.assertNotIn(b"response.failed", rest)

    def test_nonStreamingBodyGetsNone(self):
        """
        R31: no keepalive for a request that does not stream, whatever its
        C{Accept}; its wait ends with a plain 429.
        """
        for body in (b'{"model":"m","input":"hi","stream":false}',
                     b'{"model":"m","input":"x, \\"stream\\": true"}'):
            app, conn, _ = self.queued(body, headers=b"Accept: text/event-stream\r\n", wait=25)
            app.reactor.advance(24)
            self.assertEqual(conn.value, b"", body)
            app.reactor.advance(2)
            self.assertEqual(conn.status(), 429)

    def test_admittedTurnIsStreamed(self):
        """
        Once admitted the turn's sink knows the head is sent (errors
        in-stream), and its silence counts from the last keepalive.
        """
        from relay.entry.sinks import SSESink

        app, conn, held = self.queued(self.SDK_BODY)
        app.reactor.advance(10)
        app.reactor.advance(5)
        seen = []

        def run(turn, sink):
            seen.append((turn.stream, type(sink), sink.headersSent, sink.quietSince))
            sink.fail(B.tooLarge(1))  # never runs upstream

        responses = app.site.resource.root.children[b"v1"].children[b"responses"]
        turns = getattr(responses, "_turns", responses)  # issue 20: the turn resource inside
        self.patch(turns, "_door", type("D", (), {"enter": staticmethod(run)})())
        held[0].release()
        app.reactor.advance(1)
        [(stream, sinkType, sent, quiet)] = seen
        self.assertEqual((stream, sinkType, sent, quiet), (True, SSESink, True, 10.0))
        self.assertIn(b"event: response.failed", conn.value)
        self.assertEqual(conn.value.count(b"HTTP/1.1"), 1)

    def test_compressedBodyIsNotDecodedForIt(self):
        """
        R103 first: a compressed body is not decoded before the slot to
        find its flag; it gets no keepalive while queued.
        """
        body = zstandard.ZstdCompressor().compress(self.SDK_BODY)
        app, conn, _ = self.queued(body, headers=b"Content-Encoding: zstd\r\n", wait=25)
        app.reactor.advance(24)
        self.assertEqual(conn.value, b"")


class BodyStreamsTests(SynchronousTestCase):
    """
    L{relay.entry.intake.bodyStreams}: the raw body's C{stream} flag.
    """

    def test_flag(self):
        from relay.entry.intake import bodyStreams

        cases = [
            ({"model": "m", "input": "x", "stream": True}, True),
            ({"model": "m", "input": "x", "stream": False}, False),
            ({"model": "m", "input": "x"}, False),
            ({"model": "m", "input": '"stream": true'}, False),
            ({"model": "m", "input": ["stream", ',"stream":true'], "stream": True}, True),
        ]
        for value, expected in cases:
            for separators in ((",", ":"), (", ", ": ")):
                raw = json.dumps(value, separators=separators).encode()
                self.assertIs(bodyStreams(raw), expected, raw)
            self.assertIs(bodyStreams(json.dumps(value, indent=2).encode()), expected)
        self.assertIs(bodyStreams(b'{"stream":true,"stream":false}'), False)
        self.assertIsNone(bodyStreams(b'{"input":[' + b'"stream",' * 100 + b'""]}'))


def policySite():
    """
    A relay's site with keys the policy refuses by themselves: C{offkey}
    (disabled in the file), C{old} (expired), and C{team}; the clock at a
    2026 instant.
    """
    from relay.process.app import buildApplication
    from relay.configuration.parse import settingsFromString

    config = settingsFromString(
        'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        f"admin_key: {ADMIN}\n"
        f"keys: [{{name: team, key: {KEY}}},"
        " {name: offkey, key: sk-off-intake, disabled: true},"
        " {name: old, key: sk-old-intake, expires_at: '2020-01-01T00:00:00Z'}]\n"
        "accounts: [{id: a1, type: apikey, api_key: sk-up, "
        'base_url: "http://127.0.0.1:1/v1"}]\n'
    )
    reactor = MemoryReactorClock()
    reactor.advance(1_780_000_000)
    app = buildApplication(config, reactor)
    probe = Probe()
    app.site.resource.root.children[b"v1"].putChild(b"probe", probe)
    return app, probe


UPGRADE = (b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")


def bearer(secret: str) -> bytes:
    return b"Authorization: Bearer " + secret.encode() + b"\r\n"


class KeyPolicyAtTheHeadersTests(SynchronousTestCase):
    """
    R102 with R103 (issues 19 and 22 merged): the key policy's refusals
    that need only the key -- disabled (in the file or through the admin
    API) and expired -- are answered from the headers like an unknown key,
    on every client route and the WebSocket upgrade; the body is never
    read. (Before the merge a disabled key's body was read, decoded and
    parsed, and its key slot taken, before the engine refused the turn.)
    """

    def test_refusedBeforeTheBody(self):
        app, probe = policySite()
        for secret, code in (("sk-off-intake", "api_key_disabled"),
                             ("sk-old-intake", "api_key_expired")):
            for path in (b"/v1/probe", b"/v1/responses", b"/v1/responses/compact"):
                conn = Conn(app.site, clock=app.reactor).send(
                    head(path, headers=bearer(secret), length=5000))
                self.assertEqual((conn.status(), conn.error()["code"]), (401, code), path)
                self.assertTrue(conn.halfClosed)
                request = conn.inner._channel.requests[-1] if conn.inner._channel.requests else None
                conn.send(b"a" * 5000)
                self.assertIsNone(getattr(request, "content", None))
        self.assertEqual(probe.seen, [])
        loads = self.successResultOf(app.admission.load("user", ["offkey", "old"]))
        self.assertEqual({k: tuple(v) for k, v in loads.items() if any(v)}, {})

    def test_webSocketUpgrade(self):
        app, _ = policySite()
        for secret, code in (("sk-off-intake", "api_key_disabled"),
                             ("sk-old-intake", "api_key_expired")):
            conn = Conn(app.site, clock=app.reactor).send(
                head(b"/v1/responses", b"GET", bearer(secret) + UPGRADE))
            self.assertEqual((conn.status(), conn.error()["code"]), (401, code))
            self.assertNotIn(b"101", conn.value.split(b"\r\n", 1)[0])

    def test_disabledThroughTheAdminAPI(self):
        """
        A disable kept in the control store (C{key_disabled}) is in the
        ring at once, so the next request is refused at its headers.
        """
        app, probe = policySite()
        app.keys.replaceAdmin([], {"team"})
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual((conn.status(), conn.error()["code"]), (401, "api_key_disabled"))
        app.keys.replaceAdmin([], set())
        Conn(app.site, clock=app.reactor).send(head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual(len(probe.seen), 1)


class KeysPendingAtStartTests(SynchronousTestCase):
    """
    R105 at the headers (issues 19, 21 and 22 merged): while the control
    store's first read is pending, the key ring cannot tell an admin key or
    a disable; a client request waits at its headers with the connection's
    reads paused (its body unread) until the read settles -- the start-up
    gate's C{control} flag -- instead of a 503 C{keys_loading} (before the
    merge) or a 401 for a key not read yet.
    """

    def pending(self):
        from relay.process.readiness import StartupGate

        app, probe = policySite()
        gate = StartupGate()
        gate.mark(gate.settings)()
        gate.mark(gate.tokens)()
        flag = gate.add("control")
        app.extras["startupGate"] = gate
        app.keys.pending = True
        return app, probe, gate, gate.mark(flag)

    def test_waitsThenGoesOn(self):
        app, probe, gate, settle = self.pending()
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual((conn.value, probe.seen), (b"", []))
        self.assertEqual(conn.transport.producerState, "paused")
        app.keys.pending = False
        settle()
        self.assertEqual(conn.transport.producerState, "producing")
        [seen] = probe.seen
        self.assertEqual((seen["body"], seen["key"].name), (b"{}", "team"))

    def test_bodyAfterTheWait(self):
        """
        A body that comes after the headers is read only once the key is
        known (and counted then); C{Expect: 100-continue} is answered then.
        """
        app, probe, gate, settle = self.pending()
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH + b"Expect: 100-continue\r\n", length=2))
        self.assertEqual(conn.value, b"")
        app.keys.pending = False
        settle()
        self.assertTrue(conn.value.startswith(b"HTTP/1.1 100 Continue"), conn.value)
        conn.send(b"{}")
        self.assertEqual(probe.seen[0]["body"], b"{}")

    def test_disableReadMeanwhileRefuses(self):
        """
        A disable the first read brings in refuses the waiting request
        from its headers; an admin key it brings in authenticates.
        """
        from relay.base.records import ClientKey
        from relay.tenants.keydigest import keyDigest

        app, probe, gate, settle = self.pending()
        refused = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        issued = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=bearer("sk-relay-issued-later"), length=2) + b"{}")
        app.keys.replaceAdmin(
            [ClientKey(name="later", key="", digest=keyDigest("sk-relay-issued-later"))], {"team"})
        app.keys.pending = False
        settle()
        self.assertEqual((refused.status(), refused.error()["code"]), (401, "api_key_disabled"))
        self.assertEqual([s["key"].name for s in probe.seen], ["later"])
        self.assertEqual(issued.status(), 200)

    def test_webSocketUpgradeWaits(self):
        app, _, gate, settle = self.pending()
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/responses", b"GET", bearer("sk-off-intake") + UPGRADE))
        self.assertEqual(conn.value, b"")
        app.keys.pending = False
        settle()
        self.assertEqual((conn.status(), conn.error()["code"]), (401, "api_key_disabled"))

    def test_boundedWait(self):
        """
        The wait lasts at most L{relay.entry.intake.KEYS_WAIT_SECONDS}; a
        ring still pending then is answered 503 C{keys_loading} (retry)
        from the headers, the body unread.
        """
        from relay.entry.intake import KEYS_WAIT_SECONDS

        app, probe, gate, _ = self.pending()
        conn = Conn(app.site, clock=app.reactor).send(head(b"/v1/probe", headers=AUTH, length=2))
        app.reactor.advance(KEYS_WAIT_SECONDS - 0.1)
        self.assertEqual(conn.value, b"")
        app.reactor.advance(0.2)
        self.assertEqual((conn.status(), conn.error()["code"]), (503, "keys_loading"))
        self.assertEqual((probe.seen, gate._waiters), ([], []))

    def test_clientGoneWhileWaiting(self):
        app, probe, gate, settle = self.pending()
        conn = Conn(app.site, clock=app.reactor).send(head(b"/v1/probe", headers=AUTH, length=2))
        conn.protocol.connectionLost(None)
        self.assertEqual(gate._waiters, [])
        app.keys.pending = False
        settle()
        self.assertEqual(probe.seen, [])

    def test_noWaitOnceKnown(self):
        app, probe = policySite()
        conn = Conn(app.site, clock=app.reactor).send(
            head(b"/v1/probe", headers=AUTH, length=2) + b"{}")
        self.assertEqual((conn.status(), len(probe.seen)), (200, 1))


class SubRoutesTakeTheLeaseTests(SynchronousTestCase):
    """
    Issue 20 behind the intake: C{POST /v1/responses/compact},
    C{/input_tokens} and C{/{id}/cancel} read their bodies through
    C{request.relayJSON()} and hand the key's slot the intake admitted to
    their turn (C{keyAdmitted}), so the engine does not admit the key a
    second time (with C{concurrency: 1} the turn waited for its own slot).
    """

    def test_compactAndInputTokens(self):
        app, _ = relaySite(concurrency=1)
        seen = []

        def run(turn, sink):
            seen.append((turn.keyAdmitted, turn.keyLease is not None, turn.body.get("model")))
            turn.keyLease.release()
            sink.fail(B.tooLarge(1))

        responses = app.site.resource.root.children[b"v1"].children[b"responses"]
        self.patch(responses, "_door", type("D", (), {"enter": staticmethod(run)})())
        body = b'{"model":"m","input":"hi"}'
        for path in (b"/v1/responses/compact", b"/v1/responses/input_tokens"):
            conn = Conn(app.site, clock=app.reactor).send(
                head(path, headers=AUTH, length=len(body)) + body)
            app.reactor.advance(0)
            self.assertEqual(conn.status(), 413, conn.value)
        self.assertEqual(seen, [(True, True, "m")] * 2)

    def test_badBodyIsA400(self):
        app, _ = relaySite()
        for raw in (b"[", b"{\"model\": " + b"[" * 100000 + b"]" * 100000 + b"}"):
            conn = Conn(app.site, clock=app.reactor).send(
                head(b"/v1/responses/compact", headers=AUTH, length=len(raw)) + raw)
            app.reactor.advance(0)
            self.assertEqual(conn.status(), 400, conn.value[:200])


class AdmittedAtOnceTests(SynchronousTestCase):
    """
    R26 with R103: a request whose key's slot is free (or whose key has
    none) goes on in the call that brought its body, as when the slot's
    Deferred fired and ran its callbacks.
    """

    def test_keyWithoutSlotNotAsked(self):
        """
        A key without a slot (C{concurrency: 0}) is admitted with no lease
        and the front door's C{admitSlot} is not asked (the door's
        C{takesSlot} says so).
        """
        app, probe = relaySite(concurrency=0)
        calls = []
        self.patch(app.site.intake, "admitKey", lambda *a, **k: calls.append(a))
        conn = Conn(app.site, clock=app.reactor).send(head(b"/v1/probe", headers=AUTH, length=2)
                                                      + b"{}")
        self.assertEqual(conn.status(), 200)
        self.assertEqual(calls, [])
        self.assertEqual([(s["body"], s["lease"]) for s in probe.seen], [(b"{}", None)])

    def test_freeSlotAdmittedInTheSameCall(self):
        """
        A free slot: the request is rendered before the read that brought
        it returns, with its lease; the lease is given back when it ends.
        """
        app, probe = relaySite(concurrency=1)
        conn = Conn(app.site, clock=app.reactor).send(head(b"/v1/probe", headers=AUTH, length=2)
                                                      + b"{}")
        self.assertEqual(conn.status(), 200)
        self.assertEqual(len(probe.seen), 1)
        self.assertIsNotNone(probe.seen[0]["lease"])
        load = []
        app.admission.load("user", ["team"]).addCallback(load.append)
        self.assertEqual(load, [{"team": (0, 0)}])

    def test_failureAtOnceAnswered(self):
        """
        A refusal that is there at once is answered as a waited one.
        """
        from twisted.internet.defer import fail

        from relay.base.records import ClientError

        app, probe = relaySite(concurrency=1)
        refusal = ValueError("full")
        refusal.error = ClientError(429, "rate_limit_error", "Too many", code="slots")
        self.patch(app.site.intake, "admitKey", lambda *a, **k: fail(refusal))
        conn = Conn(app.site, clock=app.reactor).send(head(b"/v1/probe", headers=AUTH, length=2)
                                                      + b"{}")
        self.assertEqual(conn.status(), 429)
        self.assertEqual(probe.seen, [])
