"""
L{relay.wire.redisclient} on a L{Clock} with a pool stand-in (issue 23,
behaviour.md R101): what makes Redis reachable or unreachable, the
fail-fast while it is not, the probe that finds it again, a demoted master
(C{READONLY}, C{ROLE}), the Sentinels' C{+switch-master}, the durable write
(C{WAIT} on the same connection), and the one-line log of a background
job's Redis failure. The real-server side is in
L{tests.integration.test_redis_silent} and
L{tests.integration.test_redis_sentinel}.
"""

from __future__ import annotations

import txredisapi
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import Logger, capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from relay.wire.redisclient import RedisService, RedisUnavailable, logFailure, parseHostPort


class _Transport:
    def __init__(self):
        self.lost = 0

    def loseConnection(self):
        self.lost += 1


class _Conn:
    def __init__(self):
        self.transport = _Transport()


class _Factory:
    def __init__(self, n=2):
        self.pool = [_Conn() for _ in range(n)]


class _Pipe:
    """
    A pipelining connection: records the commands, answers on
    C{execute_pipeline} with C{replies}.
    """

    def __init__(self, replies):
        self.commands = []
        self.replies = replies
        self._waiting = []

    def execute_command(self, *args):
        d = Deferred()
        self.commands.append(args)
        self._waiting.append(d)
        return d

    def execute_pipeline(self):
        # As txredisapi: a DeferredList that consumes the replies' errors
        # waits on them (before anyone else can), then the replies come;
        # an exception is an error reply or the connection's loss.
        waited = defer.DeferredList(self._waiting, fireOnOneErrback=True, consumeErrors=True)
        for d, reply in zip(self._waiting, self.replies):
            if isinstance(reply, Exception):
                d.errback(reply)
            else:
                d.callback(reply)
        return waited


class _Pool:
    """
    A txredisapi connection handler stand-in: every method call is recorded
    as C{(name, args, Deferred)}; the test fires the Deferred.
    """

    def __init__(self):
        self.calls = []
        self._factory = _Factory()
        self.pipe = None

    def pipeline(self):
        return defer.succeed(self.pipe)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            d = Deferred()
            self.calls.append((name, args, d))
            return d

        return call

    def names(self):
        return [c[0] for c in self.calls]


def _service(**kw) -> tuple:
    clock = Clock()
    clock.advance(1000)
    service = RedisService(url="redis://127.0.0.1:6379/0", clock=clock, **kw)
    service.pool = _Pool()
    return service, clock


def _result(d: Deferred):
    out = []
    d.addBoth(out.append)
    return out[0] if out else None


class ParseHostPortTests(SynchronousTestCase):
    """
    L{parseHostPort}: the C{state.redis_sentinels} entries.
    """

    def test_forms(self):
        self.assertEqual(parseHostPort("10.0.0.5:26380"), ("10.0.0.5", 26380))
        self.assertEqual(parseHostPort("sentinel-1"), ("sentinel-1", 26379))
        self.assertEqual(parseHostPort("[::1]:26379"), ("::1", 26379))
        self.assertEqual(parseHostPort("[::1]"), ("::1", 26379))

    def test_bad(self):
        for bad in (":26379", "host:0", "host:99999", "host:abc", "[::1]x"):
            self.assertRaises(ValueError, parseHostPort, bad)


class ReachabilityTests(SynchronousTestCase):
    """
    L{RedisService.reachable} and the fail-fast of L{RedisService.execute}.
    """

    def test_unknownUntilFirstReply(self):
        """
        Before any reply Redis is not known to be reachable (C{/readyz}
        waits); commands go out; a reply makes it reachable.
        """
        service, clock = _service()
        self.assertFalse(service.reachable)
        d = service.execute(2, "get", "k")
        self.assertEqual(service.pool.names(), ["get"])
        service.pool.calls[0][2].callback("v")
        self.assertEqual(_result(d), "v")
        self.assertTrue(service.reachable)
        self.assertEqual(service.lastReplyAt, clock.seconds())

    def test_silenceMakesItUnreachableAndFailsFast(self):
        """
        A command that times out with no reply since it was sent marks
        Redis unreachable (logged once); every later command fails at once
        with L{RedisUnavailable} without reaching the pool.
        """
        service, clock = _service()
        first = service.execute(2, "get", "k")
        service.pool.calls[0][2].callback("v")
        _result(first)
        with capturedLogs() as logs:
            d = service.execute(2, "get", "k")
            clock.advance(2)
            failure = _result(d)
            self.assertIsInstance(failure.value, RedisUnavailable)
            self.assertFalse(service.reachable)
            again = _result(service.execute(2, "set", "k", "v"))
            self.assertIsInstance(again.value, RedisUnavailable)
            self.assertIn("unreachable", str(again.value))
        self.assertEqual(service.pool.names(), ["get", "get"])
        self.assertEqual(
            [e["event"] for e in logs if e.get("event", "").startswith("relay.redis_")],
            ["relay.redis_unreachable"],
        )

    def test_unreachableListenersHearIt(self):
        """
        Each time Redis is found unreachable the C{unreachableListeners}
        run (the control plane ends its start-up wait, R101); a listener
        that raises is logged and the others still run.
        """
        service, clock = _service()
        heard = []
        service.unreachableListeners.append(lambda: 1 / 0)
        service.unreachableListeners.append(lambda: heard.append(1))
        service.execute(2, "get", "k").addErrback(lambda f: None)
        clock.advance(2)
        self.assertEqual(heard, [1])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        service._unreachable("again")  # already unreachable: not again
        self.assertEqual(heard, [1])

    def test_slowCommandIsNotSilence(self):
        """
        A command that times out while another one sent after it got its
        reply is slow, not a silent Redis: still reachable.
        """
        service, clock = _service()
        slow = service.execute(2, "eval", "script")
        clock.advance(1)
        quick = service.execute(2, "get", "k")
        service.pool.calls[1][2].callback("v")
        _result(quick)
        clock.advance(1)
        self.assertIsInstance(_result(slow).value, RedisUnavailable)
        self.assertTrue(service.reachable)

    def test_lostConnectionIsSilence(self):
        """
        A lost connection with no reply since is unreachability too.
        """
        service, clock = _service()
        d = service.execute(2, "get", "k")
        service.pool.calls[0][2].errback(txredisapi.ConnectionError("Lost connection"))
        self.assertIsInstance(_result(d).value, RedisUnavailable)
        self.assertFalse(service.reachable)

    def test_cancelledIsNotSilence(self):
        """
        A command its caller cancelled (a client that left) says nothing
        about Redis.
        """
        service, clock = _service()
        d = service.execute(2, "get", "k")
        d.cancel()
        _result(d)
        self.assertIsNone(service._state)

    def test_errorReplyIsAnAnswer(self):
        """
        An error reply (a script error) is Redis answering: reachable.
        """
        service, clock = _service()
        d = service.execute(2, "eval", "bad")
        service.pool.calls[0][2].errback(txredisapi.ResponseError("ERR syntax"))
        self.assertIsInstance(_result(d).value, RedisUnavailable)
        self.assertTrue(service.reachable)

    def test_readonlyDropsTheConnections(self):
        """
        C{READONLY} (the master was demoted under relay) makes Redis
        unusable and drops every pooled connection, so the next one asks
        the Sentinels; C{LOADING} and C{NOREPLICAS} are unusable too.
        """
        service, clock = _service()
        d = service.execute(2, "eval", "write")
        service.pool.calls[0][2].errback(
            txredisapi.ResponseError("READONLY You can't write against a read only replica.")
        )
        _result(d)
        self.assertFalse(service.reachable)
        self.assertEqual([c.transport.lost for c in service.pool._factory.pool], [1, 1])
        for text in ("LOADING Redis is loading", "NOREPLICAS Not enough good replicas"):
            service, clock = _service()
            d = service.execute(2, "eval", "write")
            service.pool.calls[0][2].errback(txredisapi.ResponseError(text))
            _result(d)
            self.assertFalse(service.reachable, text)
            self.assertEqual([c.transport.lost for c in service.pool._factory.pool], [0, 0])


class ProbeTests(SynchronousTestCase):
    """
    The probe loop of L{RedisService} (C{_probeTick}).
    """

    def test_probesWhileUnreachableUntilItAnswers(self):
        """
        While unreachable each tick sends one C{PING} (never two at once);
        a C{PONG} makes Redis reachable again (logged with the outage).
        """
        service, clock = _service()
        service._unreachable("test")
        service._probeTick()
        service._probeTick()
        self.assertEqual(service.pool.names(), ["ping"])
        clock.advance(1)  # the probe's own timeout
        service._probeTick()
        self.assertEqual(service.pool.names(), ["ping", "ping"])
        self.assertFalse(service.reachable)
        with capturedLogs() as logs:
            service.pool.calls[1][2].callback("PONG")
        self.assertTrue(service.reachable)
        self.assertEqual([e["event"] for e in logs], ["relay.redis_reachable"])
        self.assertEqual(_result(service.execute(2, "get", "k")), None)
        self.assertEqual(service.pool.names()[-1], "get")

    def test_idleProbe(self):
        """
        A reachable Redis is probed only after L{idleProbeSeconds} without
        a reply; busy traffic needs no probe at all.
        """
        service, clock = _service(idleProbeSeconds=5)
        service._replied()
        clock.advance(4)
        service._probeTick()
        self.assertEqual(service.pool.names(), [])
        clock.advance(1)
        service._probeTick()
        self.assertEqual(service.pool.names(), ["ping"])

    def test_sentinelProbeChecksRole(self):
        """
        With Sentinel the probe is C{ROLE}: a replica (a demoted master)
        is not usable, its connections are dropped; the master is.
        """
        service, clock = _service(sentinels=(("127.0.0.1", 26379),), masterName="m")
        d = service.probe()
        self.assertEqual(service.pool.names(), ["role"])
        service.pool.calls[0][2].callback(["slave", "127.0.0.1", 6380, "connected", 10])
        self.assertFalse(_result(d))
        self.assertFalse(service.reachable)
        self.assertEqual([c.transport.lost for c in service.pool._factory.pool], [1, 1])
        d = service.probe()
        service.pool.calls[1][2].callback(["master", 100, []])
        self.assertTrue(_result(d))
        self.assertTrue(service.reachable)


class SentinelSwitchTests(SynchronousTestCase):
    """
    C{+switch-master} from the Sentinels (L{RedisService._masterSwitched}).
    """

    def test_switchDropsOnceAndTellsListeners(self):
        """
        The first message about a new master of ours drops the
        connections and runs the listeners; the other Sentinels' copies
        and other masters' switches do nothing.
        """
        service, clock = _service(sentinels=(("127.0.0.1", 26379),), masterName="m")
        heard = []
        service.switchListeners.append(lambda: heard.append(1))
        service._masterSwitched("other 127.0.0.1 1 127.0.0.1 2")
        self.assertEqual(heard, [])
        with capturedLogs() as logs:
            service._masterSwitched(b"m 127.0.0.1 6379 127.0.0.1 6380")
            service._masterSwitched("m 127.0.0.1 6379 127.0.0.1 6380")
        self.assertEqual(heard, [1])
        self.assertEqual([c.transport.lost for c in service.pool._factory.pool], [1, 1])
        self.assertEqual([e["event"] for e in logs], ["relay.redis_master_switched"])

    def test_durableReplicasDefault(self):
        """
        Durable writes wait for one replica with Sentinel, none without.
        """
        self.assertEqual(_service()[0].durableReplicas, 0)
        self.assertEqual(
            _service(sentinels=(("h", 1),), masterName="m")[0].durableReplicas, 1
        )


class DurableWriteTests(SynchronousTestCase):
    """
    L{RedisService.executeDurable}.
    """

    def test_waitOnTheSameConnection(self):
        """
        The write and C{WAIT 1 <ms>} go in one pipeline (one connection);
        the write's reply is returned.
        """
        service, clock = _service(sentinels=(("h", 1),), masterName="m", durableTimeout=0.5)
        service.pool.pipe = _Pipe([1, 1])
        with capturedLogs() as logs:
            d = service.executeDurable(5, ("EVAL", "script", 1, "k", "v"))
        self.assertEqual(_result(d), 1)
        self.assertEqual(service.pool.pipe.commands,
                         [("EVAL", "script", 1, "k", "v"), ("WAIT", 1, 500)])
        self.assertEqual(logs, [])
        self.assertTrue(service.reachable)

    def test_noReplicaIsLogged(self):
        """
        No replica acknowledged in time: the write stands (it is on the
        master) and a warning says so.
        """
        service, clock = _service(sentinels=(("h", 1),), masterName="m")
        service.pool.pipe = _Pipe(["OK", 0])
        with capturedLogs() as logs:
            d = service.executeDurable(5, ("SET", "k", "v"))
        self.assertEqual(_result(d), "OK")
        self.assertEqual([e["event"] for e in logs], ["relay.redis_write_not_replicated"])

    def test_errorReplyFails(self):
        """
        An error reply to the write (here a demoted master's C{READONLY})
        fails the durable write with L{RedisUnavailable} and drops the
        connections -- it is not a write reported done with the value
        C{None} (txredisapi's pipeline consumes its replies' errors).
        """
        service, clock = _service(sentinels=(("h", 1),), masterName="m")
        service.pool.pipe = _Pipe([
            txredisapi.ResponseError("READONLY You can't write against a read only replica."),
            0])
        d = service.executeDurable(5, ("SET", "k", "v"))
        failure = _result(d)
        self.assertIsInstance(failure, Failure)
        self.assertTrue(failure.check(RedisUnavailable), failure)
        self.assertIn("READONLY", str(failure.value))
        self.assertEqual([c.transport.lost for c in service.pool._factory.pool], [1, 1])

    def test_lostConnectionFails(self):
        """
        The connection lost before the replies: the durable write fails
        and Redis counts as unreachable (no reply since it was sent).
        """
        service, clock = _service(sentinels=(("h", 1),), masterName="m")
        service.pool.pipe = _Pipe([txredisapi.ConnectionError("Lost connection"),
                                   txredisapi.ConnectionError("Lost connection")])
        d = service.executeDurable(5, ("SET", "k", "v"))
        failure = _result(d)
        self.assertIsInstance(failure, Failure)
        self.assertTrue(failure.check(RedisUnavailable), failure)
        self.assertFalse(service.reachable)

    def test_withoutReplicasPlainExecute(self):
        """
        Without Sentinel a durable write is a plain command.
        """
        service, clock = _service()
        d = service.executeDurable(5, ("SET", "k", "v"))
        self.assertEqual(service.pool.calls[0][:2], ("execute_command", ("SET", "k", "v")))
        service.pool.calls[0][2].callback("OK")
        self.assertEqual(_result(d), "OK")


class LogFailureTests(SynchronousTestCase):
    """
    L{logFailure}: a Redis failure is one warning line, anything else a
    traceback.
    """

    def test_redisFailureOneLine(self):
        log = Logger()
        with capturedLogs() as logs:
            logFailure(log, Failure(RedisUnavailable("get", "redis unreachable")), "job failed",
                       event="x.job")
        self.assertEqual(len(logs), 1)
        self.assertEqual(logs[0]["log_level"].name, "warn")
        self.assertNotIn("log_failure", logs[0])
        self.assertEqual(logs[0]["event"], "x.job")

    def test_otherFailureTraceback(self):
        log = Logger()
        with capturedLogs() as logs:
            logFailure(log, Failure(KeyError("bug")), "job failed")
        self.assertEqual(logs[0]["log_level"].name, "critical")
        self.assertIn("log_failure", logs[0])
        self.flushLoggedErrors(KeyError)


class ParseRedisUrlTests(SynchronousTestCase):
    """
    L{parseRedisUrl}: the three forms of C{state.redis_url} (issue 23).
    """

    def test_tcp(self):
        from relay.wire.redisclient import parseRedisUrl

        target = parseRedisUrl("redis://user:p%40ss@cache.internal:6380/3")
        self.assertEqual((target.scheme, target.host, target.port, target.dbid),
                         ("redis", "cache.internal", 6380, 3))
        self.assertEqual((target.username, target.password), ("user", "p@ss"))
        self.assertFalse(target.tls)
        self.assertNotIn("p@ss", repr(target))
        target = parseRedisUrl("redis://h")
        self.assertEqual((target.port, target.dbid, target.password), (6379, None, None))

    def test_tls(self):
        from relay.wire.redisclient import parseRedisUrl

        target = parseRedisUrl("rediss://:pw@h/0?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem")
        self.assertTrue(target.tls)
        self.assertEqual((target.caCerts, target.certFile, target.keyFile),
                         ("/ca.pem", "/c.pem", None))

    def test_unix(self):
        from relay.wire.redisclient import parseRedisUrl

        target = parseRedisUrl("unix://:pw@/run/redis/redis.sock?db=5")
        self.assertEqual((target.path, target.dbid, target.password, target.host),
                         ("/run/redis/redis.sock", 5, "pw", None))


class FastCodecTests(SynchronousTestCase):
    """
    Issue 24: the pool's protocol builds commands and converts replies
    without txredisapi's per-argument Python (L{relay.wire.redisclient._fastProtocol})
    -- the same bytes and values as txredisapi's own.
    """

    def setUp(self):
        import txredisapi

        from relay.wire.redisclient import _fastProtocol

        self.fast = _fastProtocol(txredisapi.RedisProtocol)(convertNumbers=False)
        self.plain = txredisapi.RedisProtocol(convertNumbers=False)

    def test_commands(self):
        """
        Text, bytes, integers, floats and booleans encode as txredisapi
        encodes them; text that is not encodable fails as there.
        """
        import txredisapi

        for args in [("EVALSHA", "abc", 2, "k1", "k\u00e9", b"\xff", 1.5, True, -3), ("GET",),
                     ()]:
            self.assertEqual(self.fast._build_command(*args), self.plain._build_command(*args))
        self.assertRaises(txredisapi.InvalidData, self.fast._build_command, "\ud800")

    def test_replies(self):
        """
        Replies (nested lists, non-UTF-8 bytes, integers, nil, error
        elements) convert as txredisapi converts them.
        """
        import txredisapi

        error = txredisapi.ResponseError("ERR x")
        for reply in [b"x", [b"a", [b"\xff", None, 3], b"\xc3\xa9"], 5, None, [],
                      [b"\xff", b"a"], [1, 2, [b"x", [b"y"]]], [error]]:
            self.assertEqual(repr(self.fast.tryConvertData(reply)),
                             repr(self.plain.tryConvertData(reply)))


class _SentinelFactory:
    """
    What txredisapi's Sentinel protocol reads of its factory.
    """

    is_master = True
    isLazy = True

    def __init__(self):
        self.errors = []

    def connectionError(self, message):
        self.errors.append(message)

    def stopTrying(self):
        pass


class SentinelRoleCheckTests(SynchronousTestCase):
    """
    Every new pooled connection with Sentinel checks C{ROLE} before it
    serves (L{relay.wire.redisclient._sentinelConnectionMade}); a check that
    fails -- the connection lost before the reply (the master killed during
    a failover, the CI fault of 2026-12-02), an error reply -- drops the
    connection and leaves no unhandled failure behind.
    """

    def _connect(self):
        import gc

        from twisted.internet.testing import StringTransport

        from relay.wire.redisclient import _fastProtocol

        gc.collect()
        proto = _fastProtocol(txredisapi.SentinelRedisProtocol)(convertNumbers=False)
        proto.factory = _SentinelFactory()
        transport = StringTransport()
        proto.makeConnection(transport)
        self.assertEqual(transport.value(), b"*1\r\n$4\r\nROLE\r\n")
        return proto, transport

    def _unhandled(self) -> list:
        import gc

        gc.collect()
        return self.flushLoggedErrors(txredisapi.ConnectionError, txredisapi.ResponseError)

    def test_lostBeforeTheReply(self):
        """
        The connection lost while C{ROLE} is out: no "Unhandled error in
        Deferred"; the connection never became ready.
        """
        from twisted.internet.error import ConnectionLost

        proto, transport = self._connect()
        proto.connectionLost(Failure(ConnectionLost()))
        self.assertFalse(proto._ready)
        del proto
        self.assertEqual(self._unhandled(), [])

    def test_errorReply(self):
        """
        An error reply to C{ROLE} (a Redis that refuses it) drops the
        connection, which the factory redials.
        """
        proto, transport = self._connect()
        proto.dataReceived(b"-NOAUTH Authentication required.\r\n")
        self.assertTrue(transport.disconnecting)
        self.assertFalse(proto._ready)
        del proto
        self.assertEqual(self._unhandled(), [])

    def test_replicaIsDropped(self):
        """
        A connection that reached a replica (the Sentinels' answer was
        stale) is dropped and never serves.
        """
        proto, transport = self._connect()
        proto.dataReceived(b"*5\r\n$5\r\nslave\r\n$9\r\n127.0.0.1\r\n:6380\r\n"
                           b"$9\r\nconnected\r\n:100\r\n")
        self.assertTrue(transport.disconnecting)
        self.assertFalse(proto._ready)

    def test_masterServes(self):
        """
        C{master}: the connection becomes ready (C{SELECT} of the database
        is not asked for here: no C{dbid}).
        """
        proto, transport = self._connect()
        proto.dataReceived(b"*3\r\n$6\r\nmaster\r\n:100\r\n*0\r\n")
        self.assertFalse(transport.disconnecting)
        self.assertTrue(proto._ready)


class DirectCommandWriteTests(SynchronousTestCase):
    """
    A command on a ready pooled connection (L{RedisService._direct}) is
    written with L{relay.wire.sendnow.sendNow}: sent at once when nothing is
    queued, instead of waiting for the reactor's next poll (issue 24).
    """

    def test_sentWithSendNow(self) -> None:
        """
        The command's bytes go to C{sendNow} with the connection's
        transport; the reply fires the result.
        """
        import relay.wire.redisclient as redisclient

        class _Ready:
            connected = True
            replyTimeout = 0

            def __init__(self):
                self.transport = object()
                self.replyQueue = defer.DeferredQueue()

            def _build_command(self, *args):
                return b"|".join(a.encode() for a in args)

        conn = _Ready()
        service, clock = _service()
        service.pool._factory.connectionQueue = type("Q", (), {"pending": [conn]})()
        sent = []
        self.patch(redisclient, "sendNow", lambda transport, data: sent.append((transport, data)))
        d = service.execute(2, "execute_command", "GET", "k")
        self.assertEqual(sent, [(conn.transport, b"GET|k")])
        self.assertEqual(service.pool.calls, [])
        conn.replyQueue.put("v")
        self.assertEqual(_result(d), "v")
