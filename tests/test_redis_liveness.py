"""
Process liveness of L{relay.admission.redis.RedisSlotAdmission} (R34 crash
recovery) on a L{Clock} with a Redis stand-in: the heartbeat's schedule and
arguments, its error handling, the clean-stop retirement, the registry key
on the slot scripts, and the service that runs it in the relay. The Lua side
runs against a real redis-server in
L{tests.integration.test_redis_admission}.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.admission.redis import (
    ACQUIRE_LUA,
    HEARTBEAT_LUA,
    LOAD_LUA,
    PROCESSES_KEY,
    ProcessLivenessService,
    RedisSlotAdmission,
)
from relay.interfaces import ISlotAdmission, ISlotDrain
from relay.wire.redisclient import RedisUnavailable


class _Redis:
    """
    A L{relay.wire.redisclient.RedisService} stand-in: records every command and
    answers it with the next of C{replies} (a value, or an exception to fail
    with), or leaves it pending when C{replies} is empty.

    @ivar calls: C{(method, args)} of every command, in order.
    """

    def __init__(self):
        self.calls = []
        self.replies = []

    def execute(self, timeout, method, *args, **kwargs):
        self.calls.append((method, args))
        if not self.replies:
            return Deferred()
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            return fail(reply)
        return succeed(reply)

    def heartbeats(self):
        """
        @return: the C{heartbeat.lua} calls' C{(keys, args)}.
        """
        return [(a[1], a[2]) for m, a in self.calls if m == "eval" and a[0] == HEARTBEAT_LUA]


def events(logs, name):
    """
    @return: the captured events whose C{event} is C{name}.
    """
    return [e for e in logs if e.get("event") == name]


class HeartbeatTests(SynchronousTestCase):
    """
    L{RedisSlotAdmission.startHeartbeat}, L{RedisSlotAdmission.beat} and
    L{RedisSlotAdmission.stopHeartbeat}.
    """

    def setUp(self):
        self.clock = Clock()
        self.redis = _Redis()
        self.admission = RedisSlotAdmission(redis=self.redis, clock=self.clock, prefix="p")

    def test_interfaces(self):
        """
        The provider still provides its interfaces.
        """
        self.assertTrue(verifyObject(ISlotAdmission, self.admission))
        self.assertTrue(verifyObject(ISlotDrain, self.admission))

    def test_defaults(self):
        """
        R34: the liveness entry lives 60 s and is refreshed every 20 s, a
        40 s margin for a Redis blip.
        """
        self.assertEqual((self.admission.liveTtl, self.admission.heartbeatInterval), (60.0, 20.0))

    def test_beatsNowThenEveryInterval(self):
        """
        R34: the first heartbeat is sent at once, then every 20 s on the
        injected clock; each sets the process's entry in
        C{relay:processes} to expire C{liveTtl} (60 s) from now, and
        passes the slot TTL (1800 s) for pruning old entries.
        """
        self.redis.replies = ["1", "2", "3"]
        self.admission.startHeartbeat()
        expected = ([PROCESSES_KEY], ["p", "60.0", "1800.0"])
        self.assertEqual(self.redis.heartbeats(), [expected])
        self.clock.advance(19.9)
        self.assertEqual(len(self.redis.heartbeats()), 1)
        self.clock.advance(0.1)
        self.clock.advance(20)
        self.assertEqual(self.redis.heartbeats(), [expected] * 3)
        self.admission.startHeartbeat()
        self.assertEqual(len(self.redis.heartbeats()), 3)

    def test_failedBeatLoggedAndLoopGoesOn(self):
        """
        R35, trap T26: a heartbeat that fails is logged as
        C{relay.redis_admission_error} (operation C{heartbeat}) and the next
        one is still sent 20 s later.
        """
        self.redis.replies = [RedisUnavailable("eval", "down"), "1"]
        with capturedLogs() as logs:
            self.admission.startHeartbeat()
            self.clock.advance(20)
        self.assertEqual(len(self.redis.heartbeats()), 2)
        self.assertEqual(
            [e["operation"] for e in events(logs, "relay.redis_admission_error")], ["heartbeat"]
        )

    def test_beatResult(self):
        """
        L{RedisSlotAdmission.beat} fires with L{True} when the entry was
        refreshed and L{False} on a Redis error; it never fails.
        """
        self.redis.replies = ["1", RedisUnavailable("eval", "down")]
        self.assertIs(self.successResultOf(self.admission.beat()), True)
        with capturedLogs():
            self.assertIs(self.successResultOf(self.admission.beat()), False)

    def test_stopRetires(self):
        """
        R34: a clean stop ends the heartbeat and expires the entry at once
        (a liveness TTL of 0); no heartbeat follows. A second stop, or a
        stop without a start, sends nothing.
        """
        self.redis.replies = ["1", "1"]
        self.admission.startHeartbeat()
        self.assertIs(self.successResultOf(self.admission.stopHeartbeat()), True)
        self.assertEqual(
            self.redis.heartbeats()[-1], ([PROCESSES_KEY], ["p", "0.0", "1800.0"])
        )
        self.clock.advance(60)
        self.assertEqual(len(self.redis.heartbeats()), 2)
        self.assertIs(self.successResultOf(self.admission.stopHeartbeat()), False)
        self.assertEqual(len(self.redis.heartbeats()), 2)

    def test_stopWhileBeatPending(self):
        """
        A stop while a heartbeat is still in flight (Redis slow) still
        retires the entry, and no later heartbeat is scheduled.
        """
        self.admission.startHeartbeat()
        d = self.admission.stopHeartbeat()
        self.assertEqual([a[1][1] for a in self.redis.heartbeats()], ["60.0", "0.0"])
        self.assertNoResult(d)
        self.clock.advance(60)
        self.assertEqual(len(self.redis.heartbeats()), 2)

    def test_failedRetireLogged(self):
        """
        A retirement that fails is logged (operation C{retire}) and gives
        L{False}; the entry then lapses after C{liveTtl}.
        """
        self.redis.replies = ["1", RedisUnavailable("eval", "down")]
        self.admission.startHeartbeat()
        with capturedLogs() as logs:
            self.assertIs(self.successResultOf(self.admission.stopHeartbeat()), False)
        self.assertEqual(
            [e["operation"] for e in events(logs, "relay.redis_admission_error")], ["retire"]
        )

    def test_intervalBelowTtl(self):
        """
        A heartbeat interval that is not below the liveness TTL (the entry
        would lapse between heartbeats of a live process) is refused.
        """
        for interval in (60.0, 90.0, 0):
            self.assertRaises(
                ValueError, RedisSlotAdmission, redis=self.redis, clock=self.clock,
                liveTtl=60.0, heartbeatInterval=interval,
            )

    def test_scriptsCarryTheRegistry(self):
        """
        R34: C{acquire.lua} and C{load.lua} receive the process registry as
        their last key, so they can free the slots of dead processes.
        """
        self.admission.tryAcquire("account", "a1", 1)
        self.admission.load("account", ["a1", "a2"])
        [(_, acquire), (_, load)] = self.redis.calls
        self.assertEqual(acquire[0], ACQUIRE_LUA)
        self.assertEqual(acquire[1][-1], PROCESSES_KEY)
        self.assertEqual(len(acquire[1]), 4)
        self.assertEqual(load[0], LOAD_LUA)
        self.assertEqual(load[1][-1], PROCESSES_KEY)
        self.assertEqual(len(load[1]), 7)


class ProcessLivenessServiceTests(SynchronousTestCase):
    """
    L{ProcessLivenessService} and its place in the relay.
    """

    def test_startAndStop(self):
        """
        Starting the service starts the heartbeat; stopping it retires the
        entry and returns the retirement's Deferred.
        """
        clock, redis = Clock(), _Redis()
        redis.replies = ["1", "1"]
        admission = RedisSlotAdmission(redis=redis, clock=clock, prefix="p")
        service = ProcessLivenessService(admission)
        service.startService()
        self.assertTrue(service.running)
        self.assertEqual(len(redis.heartbeats()), 1)
        self.assertIs(self.successResultOf(service.stopService()), True)
        self.assertFalse(service.running)
        self.assertEqual(redis.heartbeats()[-1][1][1], "0.0")

    def test_redisRelayRunsHeartbeat(self):
        """
        R34: a relay on the Redis backend runs its admission's heartbeat as
        a child after the Redis client (started after it, stopped before it
        and after the drain); one on memory has none.
        """
        from twisted.internet.testing import MemoryReactorClock

        from relay.process.app import buildApplication
        from relay.configuration.parse import settingsFromString
        from relay.wire.redisclient import RedisService

        base = 'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
        app = buildApplication(
            settingsFromString(
                base + "state: {backend: redis, redis_url: 'redis://127.0.0.1:1/0'}\n"
            ),
            MemoryReactorClock(),
        )
        kinds = [type(s) for s in app.services]
        self.assertEqual(kinds[:2], [RedisService, ProcessLivenessService])
        self.assertIs(app.services[1].admission, app.admission)
        self.assertEqual(kinds.count(ProcessLivenessService), 1)
        memory = buildApplication(settingsFromString(base), MemoryReactorClock())
        self.assertNotIn(ProcessLivenessService, [type(s) for s in memory.services])
