"""
Tests for L{relay.wire.sendnow} and the one-send answer of
L{relay.entry.site.RelayHTTPChannel} (issue 24 item 2).
"""

from __future__ import annotations

import socket

from twisted.internet import tcp
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.wire.sendnow import sendNow, socketOf


class _Reactor:
    """
    The reactor methods a L{tcp.Connection} calls to queue its writes.
    """

    def __init__(self):
        self.writers = set()

    def addWriter(self, writer):
        self.writers.add(writer)

    def removeWriter(self, writer):
        self.writers.discard(writer)

    def addReader(self, reader):
        pass

    def removeReader(self, reader):
        pass


class SendNowTCPTests(SynchronousTestCase):
    """
    On a plain TCP connection (a L{tcp.Connection} on one end of a real
    socket pair).
    """

    def setUp(self):
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        theirs.settimeout(5)
        self.addCleanup(mine.close)
        self.addCleanup(theirs.close)
        self.reactor = _Reactor()
        self.transport = tcp.Connection(mine, Protocol(), reactor=self.reactor)
        self.transport.connected = 1
        self.peer = theirs

    def test_sentAtOnce(self):
        """
        With nothing queued the bytes leave in the call: nothing is
        buffered and the socket is not registered for writing.
        """
        t = self.transport
        self.assertIs(socketOf(t), t)
        sendNow(t, b"hello!")
        self.assertEqual((t._tempDataBuffer, t.dataBuffer), ([], b""))
        self.assertEqual(self.reactor.writers, set())
        self.assertEqual(self.peer.recv(100), b"hello!")

    def test_queuedKeepsOrder(self):
        """
        Bytes queued by C{write} go first: L{sendNow} queues behind them.
        """
        t = self.transport
        t.write(b"first ")
        sendNow(t, b"second!")
        self.assertEqual(t._tempDataBuffer, [b"first ", b"second!"])
        self.assertEqual(self.reactor.writers, {t})
        t.doWrite()
        self.assertEqual(self.peer.recv(100), b"first second!")


class SendNowPiecesTests(SendNowTCPTests):
    """
    A request's pieces (head, body) leave in one C{sendmsg}; what the
    kernel does not take is queued as it is, never copied or joined.
    """

    def _drain(self, t, expected: bytes) -> bytes:
        got = b""
        self.peer.setblocking(False)
        while len(got) < len(expected):
            try:
                got += self.peer.recv(1 << 20)
            except BlockingIOError:
                pass
            if t.dataBuffer or t._tempDataBuffer:
                t.doWrite()
        return got

    def test_piecesAtOnce(self):
        t = self.transport
        sendNow(t, [b"head\r\n\r\n", b"{}"])
        self.assertEqual((t._tempDataBuffer, t.dataBuffer), ([], b""))
        self.assertEqual(self.reactor.writers, set())
        self.assertEqual(self.peer.recv(100), b"head\r\n\r\n{}")

    def test_restQueuedUncopied(self):
        """
        A body larger than the socket's buffers: the kernel takes part of
        it; the body itself (not a copy of its rest) is queued with the
        offset reached, and the bytes arrive whole and in order.
        """
        t = self.transport
        head, body, tail = b"H" * 100, bytes(range(256)) * 32768, b"T" * 10  # 8 MiB body
        sendNow(t, [head, body, tail])
        self.assertIs(t.dataBuffer, body)
        self.assertGreater(t.offset, 0)
        self.assertEqual(t._tempDataBuffer, [tail])
        self.assertEqual(self.reactor.writers, {t})
        self.assertEqual(self._drain(t, head + body + tail), head + body + tail)

    def test_bytesRestUncopied(self):
        t = self.transport
        body = b"x" * (8 << 20)
        sendNow(t, body)
        self.assertIs(t.dataBuffer, body)
        self.assertEqual(self._drain(t, body), body)

    def test_viewQueuedUncopied(self):
        """
        A piece that is a view of a client's body (a spliced history) is
        queued as that view.
        """
        t = self.transport
        body = bytes(range(256)) * 32768
        view = memoryview(body)[10:]
        sendNow(t, [b"H" * 10, view])
        self.assertIs(t.dataBuffer, view)
        self.assertEqual(self._drain(t, b"H" * 10 + body[10:]), b"H" * 10 + body[10:])

    def test_queuedBehind(self):
        t = self.transport
        t.write(b"first ")
        sendNow(t, [b"second ", b"third"])
        self.assertEqual(t._tempDataBuffer, [b"first ", b"second ", b"third"])
        t.doWrite()
        self.assertEqual(self.peer.recv(100), b"first second third")


class SendNowFallbackTests(SynchronousTestCase):
    """
    Anything but a plain TCP connection gets C{write}.
    """

    def test_stringTransport(self):
        t = StringTransport()
        self.assertIsNone(socketOf(t))
        sendNow(t, b"abc")
        sendNow(t, [b"d", memoryview(b"xef")[1:]])  # views are copied only here
        self.assertEqual(t.value(), b"abcdef")


class _Counting(StringTransport):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def write(self, data):
        self.calls += 1
        super().write(data)

    def writeSequence(self, seq):
        self.calls += 1
        super().writeSequence(seq)


class _Leaf(Resource):
    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"11")
        request.write(b'{"ok":true}')
        request.finish()
        return NOT_DONE_YET

    def render_HEAD(self, request):
        return self.render_GET(request)


def _exchange(raw: bytes) -> _Counting:
    from twisted.internet.task import Clock

    from relay.process.app import _Request
    from relay.entry.site import RelaySite

    root = Resource()
    root.putChild(b"x", _Leaf())
    site = RelaySite(root, requestFactory=_Request, reactor=Clock())
    protocol = site.buildProtocol(None)
    transport = _Counting()
    protocol.makeConnection(transport)
    protocol.dataReceived(raw)
    return transport


class OneSendAnswerTests(SynchronousTestCase):
    """
    An answer written in one C{Request.write} leaves as one write: head
    and body together (twisted.web wrote the head and the body apart).
    """

    def test_headAndBodyTogether(self):
        t = _exchange(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        value = t.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertTrue(value.endswith(b'\r\n\r\n{"ok":true}'), value)
        self.assertEqual(t.calls, 1)

    def test_headWithoutBody(self):
        """
        A HEAD answer (no body is written) still sends its head.
        """
        t = _exchange(b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n")
        value = t.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertTrue(value.endswith(b"\r\n\r\n"), value)
        self.assertNotIn(b"ok", value)


class _Stream(Resource):
    """
    A streamed answer (chunked): two events written one after the other.
    """

    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(b"data: 1\n\n")
        request.write(b"data: 2\n\n")
        return NOT_DONE_YET


class _Connection(tcp.Connection):
    """
    A L{tcp.Connection} with the addresses a L{Request} asks for.
    """

    def getPeer(self):
        from twisted.internet.address import IPv4Address

        return IPv4Address("TCP", "127.0.0.1", 40000)

    getHost = getPeer


class _TCPExchange:
    """
    A L{RelaySite} connection on one end of a real socket pair (a
    L{tcp.Connection}), its reactor recording the writers it registers.
    """

    def __init__(self, testCase, answerAtOnce: bool):
        from twisted.internet.task import Clock

        from relay.process.app import _Request
        from relay.entry.site import RelaySite

        listener = socket.create_server(("127.0.0.1", 0))
        theirs = socket.create_connection(listener.getsockname())
        mine, _ = listener.accept()
        listener.close()
        mine.setblocking(False)
        theirs.settimeout(0.5)
        testCase.addCleanup(mine.close)
        testCase.addCleanup(theirs.close)
        root = Resource()
        root.putChild(b"x", _Leaf())
        root.putChild(b"stream", _Stream())
        site = RelaySite(root, requestFactory=_Request, reactor=Clock())
        site.answerAtOnce = answerAtOnce
        self.reactor = _Reactor()
        protocol = site.buildProtocol(None)
        self.transport = _Connection(mine, protocol, reactor=self.reactor)
        self.transport.connected = 1
        protocol.makeConnection(self.transport)
        self.protocol = protocol
        self.peer = theirs

    def received(self) -> bytes:
        try:
            return self.peer.recv(65536)
        except TimeoutError:
            return b""


class AnswerAtOnceTests(SynchronousTestCase):
    """
    L{relay.entry.site.RelaySite.answerAtOnce} (issue 24): with every store
    in the process the answer leaves in the call that writes it; otherwise
    it is queued for the next poll, behind the store writes of the same
    reactor iteration (R39/R40/R104).
    """

    def test_atOnce(self):
        x = _TCPExchange(self, answerAtOnce=True)
        x.protocol.dataReceived(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        self.assertEqual(x.reactor.writers, set())
        value = x.received()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertTrue(value.endswith(b'\r\n\r\n{"ok":true}'), value)

    def test_queuedWithARemoteStore(self):
        """
        Without C{answerAtOnce} nothing reaches the client before the
        reactor's next poll finds the socket writable.
        """
        x = _TCPExchange(self, answerAtOnce=False)
        x.protocol.dataReceived(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        self.assertEqual(x.received(), b"")
        self.assertEqual(x.reactor.writers, {x.transport})
        x.transport.doWrite()
        self.assertTrue(x.received().endswith(b'\r\n\r\n{"ok":true}'))

    def test_streamFirstWriteAtOnceLaterQueued(self):
        """
        A stream's first write (head and first event) leaves at once; the
        events after it are queued, so those of one reactor iteration share
        one send (not one system call per event).
        """
        x = _TCPExchange(self, answerAtOnce=True)
        x.protocol.dataReceived(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
        first = x.received()
        self.assertTrue(first.startswith(b"HTTP/1.1 200 OK\r\n"), first)
        self.assertIn(b"data: 1", first)
        self.assertNotIn(b"data: 2", first)
        self.assertEqual(x.reactor.writers, {x.transport})
        x.transport.doWrite()
        self.assertIn(b"data: 2", x.received())

    def test_headWithoutBodyAtOnce(self):
        """
        A head no body took (HEAD) is sent at once too.
        """
        x = _TCPExchange(self, answerAtOnce=True)
        x.protocol.dataReceived(b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n")
        self.assertEqual(x.reactor.writers, set())
        value = x.received()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertNotIn(b"ok", value)


class AnswersAtOnceTests(SynchronousTestCase):
    """
    L{relay.process.app.answersAtOnce}: answers go at once only with the memory
    backend's built-in state store and admission.
    """

    CONFIG = (
        'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        "keys: [{name: team, key: sk-team}]\n"
        "accounts: [{id: a1, type: apikey, api_key: sk-up, "
        'base_url: "http://127.0.0.1:1/v1"}]\n'
    )

    def site(self, extra: str = ""):
        from twisted.internet.testing import MemoryReactorClock

        from relay.process.app import buildApplication
        from relay.configuration.parse import settingsFromString

        return buildApplication(settingsFromString(self.CONFIG + extra),
                                MemoryReactorClock()).site

    def test_memory(self):
        self.assertTrue(self.site().answerAtOnce)

    def test_redis(self):
        """
        Redis state: the owner records are batched to Redis at the end of
        the reactor iteration, so the answer waits.
        """
        site = self.site("state: {backend: redis, redis_url: 'redis://127.0.0.1:1/0'}\n")
        self.assertFalse(site.answerAtOnce)

    def test_component(self):
        """
        An operator's admission (which may be remote) makes answers wait.
        """
        site = self.site(f"components: {{admission: {__name__}.RemoteAdmission}}\n")
        self.assertFalse(site.answerAtOnce)

    def test_declaredComponent(self):
        """
        An operator's admission that declares
        L{relay.interfaces.ISynchronousAdmission} (it lives in this
        process) lets answers go at once: the capability is read from the
        interface, not from the provider's type.
        """
        site = self.site(f"components: {{admission: {__name__}.LocalAdmission}}\n")
        self.assertTrue(site.answerAtOnce)


def _remoteAdmission():
    from zope.interface import implementer_only

    from relay.admission.memory import MemorySlotAdmission
    from relay.interfaces import ISlotAdmission, ISlotDrain

    @implementer_only(ISlotAdmission, ISlotDrain)
    class RemoteAdmission(MemorySlotAdmission):
        """
        Stands for an operator's admission component (which may be remote:
        it does not declare L{relay.interfaces.ISynchronousAdmission}).
        """

    return RemoteAdmission


RemoteAdmission = _remoteAdmission()


def _localAdmission():
    from relay.admission.memory import MemorySlotAdmission

    class LocalAdmission(MemorySlotAdmission):
        """
        Stands for an operator's in-process admission component: it keeps
        the memory admission's declared capabilities.
        """

    return LocalAdmission


LocalAdmission = _localAdmission()
