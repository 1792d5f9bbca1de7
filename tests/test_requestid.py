"""
Tests for L{relay.base.requestid} (issue 15): which client ids are adopted, the
id of a twisted.web request, and the turn's id as context for log lines.
"""

from __future__ import annotations

import io
import json

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from relay.base.logs import observerFor
from relay.base.requestid import (
    MAX_LENGTH,
    adoptClientId,
    bindRequestId,
    clientRequestIdOf,
    currentRequestId,
    newRequestId,
    requestIdOf,
    wellFormed,
    withRequestId,
)


class WellFormedTests(SynchronousTestCase):
    """
    L{wellFormed} and L{adoptClientId}.
    """

    def test_accepted(self):
        """
        1 to 128 characters of C{[A-Za-z0-9._:-]} are adopted as they are
        (surrounding blanks stripped; bytes decoded).
        """
        for value in ("a", "req-1", "5f0e3c1a-0000-4000-8000-000000000001", "a.b:c_d-E",
                      "x" * MAX_LENGTH):
            self.assertEqual(wellFormed(value), value)
        self.assertEqual(wellFormed(b" thread-1 "), "thread-1")

    def test_refused(self):
        """
        Empty, too long, or any other character (space, slash, quote,
        newline, non-ASCII) is refused.
        """
        for value in (None, "", " ", "x" * (MAX_LENGTH + 1), "a b", "a/b", 'a"b', "a\nb",
                      "caf\u00e9", b"\xff", "{req}"):
            self.assertIsNone(wellFormed(value), value)

    def test_headerOrder(self):
        """
        C{X-Request-Id} wins; a malformed one falls back to
        C{X-Client-Request-Id}; neither usable gives L{None}.
        """
        def headers(**values):
            return lambda name: values.get(name.replace("-", "_"))

        self.assertEqual(adoptClientId(headers(x_request_id="a", x_client_request_id="b")), "a")
        self.assertEqual(adoptClientId(headers(x_request_id="a b", x_client_request_id="b")), "b")
        self.assertIsNone(adoptClientId(headers(x_request_id="a b")))
        self.assertIsNone(adoptClientId(headers()))

    def test_newIds(self):
        """
        relay's own ids are unique, well-formed, and take a prefix.
        """
        ids = {newRequestId() for _ in range(100)}
        self.assertEqual(len(ids), 100)
        self.assertTrue(all(i.startswith("req_") and wellFormed(i) == i for i in ids))
        self.assertTrue(newRequestId("ws_").startswith("ws_"))


class RequestIdOfTests(SynchronousTestCase):
    """
    L{requestIdOf} on a twisted.web request.
    """

    def test_clientIdKeptBesideRelays(self):
        """
        R111: the client's id (even one in relay's own C{req_} format) is
        never the request's: relay's id is new and answered; the client's
        is kept as L{clientRequestIdOf}. Two requests with one client id
        get two ids.
        """
        ids = set()
        for value in (b"thread-9", b"thread-9", b"req_" + newRequestId()[4:].encode()):
            request = DummyRequest([b""])
            request.requestHeaders.setRawHeaders(b"x-client-request-id", [value])
            requestId = requestIdOf(request)
            self.assertNotEqual(requestId, value.decode())
            self.assertTrue(requestId.startswith("req_"))
            self.assertEqual(request.responseHeaders.getRawHeaders(b"x-request-id"),
                             [requestId.encode()])
            self.assertEqual(clientRequestIdOf(request), value.decode())
            ids.add(requestId)
        self.assertEqual(len(ids), 3)
        request = DummyRequest([b""])
        request.requestHeaders.setRawHeaders(b"x-request-id", [b"not ok"])
        self.assertIsNone(clientRequestIdOf(request))

    def test_chosenOnce(self):
        """
        Without a client id one is made, once: later calls return it.
        """
        request = DummyRequest([b""])
        first = requestIdOf(request)
        self.assertTrue(first.startswith("req_"))
        self.assertEqual(requestIdOf(request), first)
        self.assertEqual(
            request.responseHeaders.getRawHeaders(b"x-request-id"), [first.encode()]
        )


class ContextTests(SynchronousTestCase):
    """
    The turn's id as context: L{bindRequestId} in a coroutine started with
    C{Deferred.fromCoroutine}, and L{withRequestId}.
    """

    def setUp(self):
        self.text = io.StringIO()
        self.json = io.StringIO()
        textObserver = observerFor("text", self.text, ())
        jsonObserver = observerFor("json", self.json, ())

        def both(event):
            textObserver(event)
            jsonObserver(event)

        self.log = Logger(namespace="relay.test", observer=both)

    def records(self):
        return [json.loads(line) for line in self.json.getvalue().splitlines()]

    def test_coroutineLinesCarryTheId(self):
        """
        Lines logged inside the turn's coroutine without C{request_id} --
        before and after it waited on the clock -- carry the bound id in
        both formats; a line logged outside, meanwhile and afterwards, does
        not; an explicit C{request_id} wins.
        """
        clock = Clock()

        async def turn():
            bindRequestId("turn-7")
            self.log.info("before the wait", event="relay.test_before")
            waited = Deferred()
            clock.callLater(1, waited.callback, None)
            await waited
            self.log.info("after the wait", event="relay.test_after")
            self.log.info("explicit", event="relay.test_explicit", request_id="other")

        d = Deferred.fromCoroutine(turn())
        self.log.info("outside, meanwhile", event="relay.test_meanwhile")
        clock.advance(1)
        self.successResultOf(d)
        self.log.info("outside, afterwards", event="relay.test_afterwards")
        self.assertIsNone(currentRequestId.get())
        ids = {r["event"]: r["request_id"] for r in self.records()}
        self.assertEqual(ids, {
            "relay.test_before": "turn-7",
            "relay.test_meanwhile": None,
            "relay.test_after": "turn-7",
            "relay.test_explicit": "other",
            "relay.test_afterwards": None,
        })
        lines = self.text.getvalue().splitlines()
        self.assertIn("[relay.test_before#info req=turn-7] before the wait", lines[0])
        self.assertIn("[relay.test_meanwhile#info] outside, meanwhile", lines[1])
        self.assertIn("[relay.test_after#info req=turn-7] after the wait", lines[2])

    def test_nestedCoroutineInherits(self):
        """
        A coroutine the turn starts (e.g. health's) sees the turn's id.
        """
        async def health():
            self.log.info("marked", event="relay.test_marked")

        async def turn():
            bindRequestId("turn-8")
            await Deferred.fromCoroutine(health())

        self.successResultOf(Deferred.fromCoroutine(turn()))
        self.assertEqual(self.records()[0]["request_id"], "turn-8")

    def test_withRequestId(self):
        """
        L{withRequestId} runs a callback (e.g. a stream's end, called from
        the reactor) as part of the turn, and leaves the caller's context
        alone.
        """
        result = withRequestId(
            "turn-9", lambda x: self.log.info("cut", event="relay.test_cut") or x * 2, 21
        )
        self.assertEqual(result, 42)
        self.assertEqual(self.records()[0]["request_id"], "turn-9")
        self.assertIsNone(currentRequestId.get())


class ForwardedIdTests(SynchronousTestCase):
    """
    R111: what goes upstream as C{x-client-request-id}.
    """

    def test_clientsIdElseRelays(self):
        """
        The client's (well-formed) id when it sent one, relay's own
        otherwise; a raw header the client sent is never passed as is.
        """
        from relay.engine.payload import upstreamClientHeaders
        from relay.base.records import Account, ClientKey, Turn

        account = Account(id="a", type="apikey", base_url="http://u/v1", credential="c")
        client = ClientKey(name="k", key="sk")

        def sent(clientId, headers=()):
            turn = Turn(entrypoint="http", endpoint="responses", client=client, model="m",
                        body={}, stream=False, headers=dict(headers), requestId="req_own1",
                        clientRequestId=clientId)
            return upstreamClientHeaders(turn, account)["x-client-request-id"]

        self.assertEqual(sent("thread-9", {"x-client-request-id": "thread-9"}), "thread-9")
        self.assertEqual(sent(None), "req_own1")
        self.assertEqual(sent(None, {"x-client-request-id": "not ok"}), "req_own1")
