"""
Unit tests of the WebSocket pieces that need no network: the connection's
history rules (R61, R62, R76, R80), the sink's error rule (R81), upstream
URLs and headers (protocol.md 7), pool capacity (R50) and the pool's lending
order (R-B11, R-B3), driven by a L{Clock}.
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import ISSLTransport, ITransport
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.trial.unittest import SynchronousTestCase

from relay.base.clienterrors import previousResponseNotFound
from relay.engine.wsattempt import errorFromEvent, isPreviousNotFound
from relay.policy.judgement import busyVerdict
from relay.entry.conversation import ConnectionState, normaliseInput
from relay.entry.ws import _plainForAutobahn
from relay.entry.wssink import WebSocketSink, isStatusEvent
from relay.base.records import (
    Account,
    ClientError,
    ClientKey,
    GatewaySettings,
    Turn,
    WebSocketSettings,
)
from relay.wire.sse import eventFromJSON
from relay.upstream.ws import (
    BETA_HEADER,
    PoolBusy,
    UpstreamPool,
    handshakeHeaders,
    upstreamWebSocketURL,
)


def turn(body, previous=None):
    return Turn(
        entrypoint="ws", endpoint="responses", client=ClientKey("k", "s"), model="gpt-5.5",
        body=body, stream=True, previousResponseId=previous,
    )


class HistoryTests(SynchronousTestCase):
    """
    R61, R62, R76, R80: what the connection may expand.
    """

    def test_complete_turn_needs_no_expansion(self):
        """
        R80: a turn without previous_response_id is complete.
        """
        state = ConnectionState()
        self.assertTrue(state.historyComplete(None))
        self.assertIsNone(state.expandedBody(turn({"input": "x"})))

    def test_chain_to_own_last_response_expands(self):
        """
        R61: earlier inputs + earlier outputs + current input, id removed.
        """
        state = ConnectionState()
        state.record(None, normaliseInput("one"), {"id": "resp_1", "output": [{"type": "message", "id": "m1"}]})
        t = turn({"input": "two", "previous_response_id": "resp_1"}, "resp_1")
        self.assertTrue(state.historyComplete("resp_1"))
        body = state.expandedBody(t)
        self.assertNotIn("previous_response_id", body)
        self.assertEqual(len(body["input"]), 3)
        self.assertEqual(body["input"][1]["id"], "m1")
        self.assertIn("two", json.dumps(body["input"][2]))

    def test_foreign_chain_is_incomplete(self):
        """
        R62: a chain begun before this connection is not complete, and
        turns that follow it stay incomplete.
        """
        state = ConnectionState()
        self.assertFalse(state.historyComplete("resp_old"))
        state.record("resp_old", normaliseInput("x"), {"id": "resp_2", "output": []})
        self.assertIsNone(state.items)
        self.assertFalse(state.historyComplete("resp_2"))
        self.assertIsNone(state.expandedBody(turn({"input": "y"}, "resp_2")))

    def test_chain_to_older_response_is_incomplete(self):
        """
        R62: only this connection's previous turn's response expands.
        """
        state = ConnectionState()
        state.record(None, [], {"id": "resp_1", "output": []})
        state.record("resp_1", [], {"id": "resp_2", "output": []})
        self.assertFalse(state.historyComplete("resp_1"))


class _Conn:
    def __init__(self):
        self.sent, self.closes = [], []

    def isOpen(self):
        return not self.closes

    def sendText(self, data):
        self.sent.append(json.loads(data))

    def closeWith(self, code, reason):
        self.closes.append((code, reason))


class SinkTests(SynchronousTestCase):
    """
    R81 and protocol.md 4.5: status events only where the client must act.
    """

    def test_previous_not_found_is_event_then_close(self):
        conn = _Conn()
        WebSocketSink(conn).fail(previousResponseNotFound("resp_x"))
        self.assertEqual(conn.sent[0]["status"], 400)
        self.assertEqual(conn.sent[0]["error"]["code"], "previous_response_not_found")
        self.assertEqual(conn.closes, [(1011, "upstream websocket proxy failed")])

    def test_busy_is_only_a_close(self):
        conn = _Conn()
        WebSocketSink(conn).fail(busyVerdict("acquire_timeout").clientError)
        self.assertEqual(conn.sent, [])
        self.assertEqual(conn.closes, [(1013, "upstream websocket is busy, please retry later")])

    def test_model_not_found_keeps_the_connection(self):
        conn = _Conn()
        WebSocketSink(conn).fail(
            ClientError(400, "invalid_request_error", "no", code="model_not_found")
        )
        self.assertEqual(conn.sent[0]["status"], 400)
        self.assertEqual(conn.closes, [])

    def test_rate_limit_is_never_a_status_event(self):
        self.assertFalse(
            isStatusEvent(ClientError(429, "rate_limit_error", "x", wsClose=(1013, "y")))
        )

    def test_terminal_event_recorded(self):
        conn = _Conn()
        sink = WebSocketSink(conn)
        sink.writeEvent(eventFromJSON(b'{"type":"response.completed","response":{"id":"resp_1","output":[]}}'))
        self.assertEqual(sink.terminal["id"], "resp_1")
        self.assertEqual(conn.sent[0]["type"], "response.completed")


class UpstreamTests(SynchronousTestCase):
    """
    protocol.md 7: URLs and handshake headers.
    """

    def test_urls(self):
        self.assertEqual(upstreamWebSocketURL("https://api.openai.com/v1"), "wss://api.openai.com/v1/responses")
        self.assertEqual(upstreamWebSocketURL("http://127.0.0.1:9/v1/"), "ws://127.0.0.1:9/v1/responses")

    def test_headers_oauth(self):
        account = Account(id="o", type="oauth", base_url="https://x", credential="tok",
                          chatgpt_account_id="acct")
        headers = handshakeHeaders(account, {"session-id": "s", "cookie": "no"})
        self.assertEqual(headers["authorization"], "Bearer tok")
        self.assertEqual(headers["chatgpt-account-id"], "acct")
        self.assertEqual(headers["openai-beta"], BETA_HEADER)
        self.assertEqual(headers["session-id"], "s")
        self.assertNotIn("cookie", headers)
        self.assertNotIn("content-type", headers)

    def test_error_event_helpers(self):
        event = {"type": "error", "status": 400, "error": {"code": "previous_response_not_found",
                                                          "message": "Previous response with id 'r' not found."}}
        self.assertTrue(isPreviousNotFound(event))
        self.assertEqual(errorFromEvent(event).status, 400)


class _Settings:
    def __init__(self, factor=5.0):
        self.current = GatewaySettings(websocket=WebSocketSettings(pool_capacity_factor=factor))


class _Proto:
    closed = False

    def __init__(self):
        self.listener = None

    def close(self):
        self.closed = True


class PoolTests(SynchronousTestCase):
    """
    R50 capacity, R-B11 lending order, R-B3 acquire deadline.
    """

    def setUp(self):
        self.clock = Clock()
        self.dialled = []

        async def dial(account, headers):
            proto = _Proto()
            self.dialled.append(proto)
            return proto

        self.pool = UpstreamPool(reactor=self.clock, settings=_Settings(1.0), dial=dial)
        self.account = Account(id="a", type="apikey", base_url="http://x", credential="k", concurrency=2)

    def acquire(self, preferred=None):
        return self.successResultOf(
            Deferred.fromCoroutine(self.pool.acquire(self.account, {}, preferred))
        )

    def test_capacity(self):
        pool = UpstreamPool(reactor=self.clock, settings=_Settings(5.0))
        self.assertEqual(pool.capacity(self.account), 10)
        self.assertEqual(pool.capacity(Account(id="u", type="apikey", base_url="", credential="", concurrency=0)), 128)
        self.assertEqual(pool.capacity(Account(id="u", type="apikey", base_url="", credential="", concurrency=100)), 128)

    def test_chain_head_lent_last_and_preferred_first(self):
        """
        R-B11: a connection holding a chain head goes back to its chain; a
        new turn gets a new connection while capacity allows.
        """
        c1 = self.acquire()
        c1.lastResponseId = "resp_1"
        self.pool.release(c1)
        c2 = self.acquire()
        self.assertIsNot(c1, c2)
        self.pool.release(c2)
        self.assertIs(self.pool.findByResponse("a", "resp_1"), c1)
        self.assertIs(self.acquire(preferred=c1), c1)

    def test_acquire_deadline_is_pool_busy(self):
        """
        R-B3, R69: at capacity the acquire waits dial + 2 s, then PoolBusy.
        """
        self.acquire()
        self.acquire()
        d = Deferred.fromCoroutine(self.pool.acquire(self.account, {}))
        self.assertNoResult(d)
        self.clock.advance(12.1)
        self.assertEqual(self.failureResultOf(d, PoolBusy).value.reason, "acquire_timeout")

    def test_release_hands_to_waiter_and_retires_broken(self):
        c1 = self.acquire()
        self.acquire()
        d = Deferred.fromCoroutine(self.pool.acquire(self.account, {}))
        self.pool.release(c1)
        self.assertIs(self.successResultOf(d), c1)
        self.pool.release(c1, broken=True)
        self.assertTrue(c1.proto.closed)
        self.assertEqual(self.pool.counts("a")[0], 1)

    def test_retire_after_50_minutes(self):
        c1 = self.acquire()
        self.clock.advance(50 * 60)
        self.pool.release(c1)
        self.assertTrue(c1.proto.closed)


class TLSUpgradeTests(SynchronousTestCase):
    """
    An upgrade on a TLS listener (C{listen: "ssl:..."}): autobahn reads TLS
    details only from the TLS protocol itself, so the connection's
    counting wrapper stops declaring TLS before autobahn takes it.
    """

    def wrapperOverTLS(self):
        """
        @return: a connection's protocol wrapper whose transport is TLS.
        """
        tls = TLSMemoryBIOProtocol(TLSMemoryBIOFactory(CertificateOptions(), False, Factory()),
                                   Protocol())
        tls.transport = StringTransport()
        wrapper = ProtocolWrapper(WrappingFactory(Factory()), Protocol())
        wrapper.makeConnection(tls)
        return wrapper

    def test_wrapperStopsDeclaringTLS(self):
        """
        The wrapper no longer provides C{ISSLTransport} (it did, through
        C{INegotiated}), and keeps the other interfaces of its transport.
        """
        wrapper = self.wrapperOverTLS()
        self.assertTrue(ISSLTransport.providedBy(wrapper))
        _plainForAutobahn(wrapper)
        self.assertFalse(ISSLTransport.providedBy(wrapper))
        self.assertTrue(ITransport.providedBy(wrapper))

    def test_plainConnectionUntouched(self):
        """
        A plain TCP connection's wrapper, and no transport at all, are left
        as they are.
        """
        wrapper = ProtocolWrapper(WrappingFactory(Factory()), Protocol())
        wrapper.makeConnection(StringTransport())
        before = list(wrapper.__provides__)
        _plainForAutobahn(wrapper)
        _plainForAutobahn(None)
        self.assertEqual(list(wrapper.__provides__), before)
        self.assertTrue(ITransport.providedBy(wrapper))
