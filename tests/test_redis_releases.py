"""
Slot members left in doubt by a Redis error are released again (issue 23,
behaviour.md R34: no slot leaked): a failed release, or an acquire that
timed out (it may still run later on a paused Redis), is repeated with
C{leave.lua} on two passes that reach Redis; with Sentinel, the releases of
the last minute are repeated on a new master. L{RedisSlotAdmission} on a
L{Clock} with the Redis stand-in of L{tests.test_redis_liveness}.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.redis import (
    LEAVE_LUA,
    RELEASE_RETRY_SECONDS,
    RedisSlotAdmission,
)
from relay.base.records import AdmissionError
from relay.wire.redisclient import RedisUnavailable
from tests.test_redis_liveness import _Redis


def _leaves(redis):
    return [a[2][0] for m, a in redis.calls if m == "eval" and a[0] == LEAVE_LUA]


class _SentinelRedis(_Redis):
    sentinels = (("127.0.0.1", 26379),)

    def __init__(self):
        super().__init__()
        self.switchListeners = []


class ReleaseRetryTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.redis = _Redis()
        self.admission = RedisSlotAdmission(redis=self.redis, clock=self.clock, prefix="p")

    def _lease(self):
        self.redis.replies = [[1, 0, 0, 0]]
        out = []
        self.admission.tryAcquire("account", "a", 1).addCallback(out.append)
        return out[0]

    def test_failedReleaseRepeatedTwice(self):
        """
        A C{ZREM} that failed: the member is released with C{leave.lua}
        on the next passes until two reached Redis, then forgotten and the
        loop stops.
        """
        lease = self._lease()
        self.redis.replies = [RedisUnavailable("execute_command", "down")]
        with capturedLogs():
            lease.release()
        self.assertEqual(list(self.admission.unreleased), [lease.requestId])
        self.redis.replies = [RedisUnavailable("eval", "redis unreachable")]
        self.clock.advance(RELEASE_RETRY_SECONDS)
        self.assertEqual(self.admission.unreleased[lease.requestId][2], 0)
        self.redis.replies = [1]
        self.clock.advance(RELEASE_RETRY_SECONDS)
        self.redis.replies = [1]
        self.clock.advance(RELEASE_RETRY_SECONDS)
        self.assertEqual(self.admission.unreleased, {})
        self.assertEqual(_leaves(self.redis), [lease.requestId] * 3)
        self.clock.advance(RELEASE_RETRY_SECONDS)
        self.assertIsNone(self.admission._releaser)
        self.assertEqual(len(_leaves(self.redis)), 3)

    def test_timedOutAcquireReleasedLater(self):
        """
        A fast try that failed (it may have landed after its timeout) and
        whose immediate C{leave.lua} failed too is released again later.
        """
        self.redis.replies = [RedisUnavailable("eval", "timeout"),
                              RedisUnavailable("eval", "redis unreachable")]
        out = []
        with capturedLogs():
            self.admission.tryAcquire("account", "a", 1).addErrback(out.append)
        self.assertIsInstance(out[0].value, AdmissionError)
        self.assertEqual(len(self.admission.unreleased), 1)
        self.redis.replies = [1, 1]
        self.clock.advance(RELEASE_RETRY_SECONDS)
        self.clock.advance(RELEASE_RETRY_SECONDS)
        self.assertEqual(self.admission.unreleased, {})

    def test_noSentinelNoHistory(self):
        """
        Without Sentinel no release history is kept (nothing on the hot path).
        """
        self.assertIsNone(self.admission._recent)


class MasterSwitchTests(SynchronousTestCase):
    def test_recentReleasesRepeatedOnNewMaster(self):
        """
        With Sentinel, a master switch repeats every release of the last
        minute (the old master may have acknowledged one it never passed on).
        """
        clock = Clock()
        redis = _SentinelRedis()
        admission = RedisSlotAdmission(redis=redis, clock=clock, prefix="p")
        self.assertEqual(redis.switchListeners, [admission.masterSwitched])
        leases = []
        for _ in range(2):
            redis.replies = [[1, 0, 0, 0]]
            admission.tryAcquire("account", "a", 5).addCallback(leases.append)
        redis.replies = [1]
        leases[0].release()
        clock.advance(120)
        redis.replies = [1]
        leases[1].release()
        with capturedLogs() as logs:
            admission.masterSwitched()
        self.assertEqual(list(admission.unreleased), [leases[1].requestId])
        self.assertEqual(logs[0]["count"], 1)
        redis.replies = [1, 1]
        clock.advance(RELEASE_RETRY_SECONDS)
        clock.advance(RELEASE_RETRY_SECONDS)
        self.assertEqual(admission.unreleased, {})
        admission.stopHeartbeat()

    def test_abandonedAcquireRepeatedOnLaterMasters(self):
        """
        R34 across two failovers (the Sentinel test's leak): an acquire in
        flight when relay left the old master failed here, and its leave
        reached the new master; the old master had run the acquire after
        the promotion and, made master again by the next failover, still
        held the member. Every switch within the window now repeats the
        leave of such a member, not only releases.
        """
        clock = Clock()
        redis = _SentinelRedis()
        admission = RedisSlotAdmission(redis=redis, clock=clock, prefix="p")
        failed = []
        redis.replies = [RedisUnavailable("eval", "ConnectionError: Lost connection"), 1]
        with capturedLogs():
            admission.tryAcquire("account", "a", 5).addErrback(failed.append)
        [rid] = _leaves(redis)
        self.assertEqual(admission.unreleased, {})  # the leave itself landed
        for _ in range(2):  # the next failover, and the one after it
            clock.advance(10)
            with capturedLogs():
                admission.masterSwitched()
            self.assertEqual(list(admission.unreleased), [rid])
            redis.replies = [1, 1]
            clock.advance(RELEASE_RETRY_SECONDS)
            clock.advance(RELEASE_RETRY_SECONDS)
            self.assertEqual(admission.unreleased, {})
        self.assertEqual(_leaves(redis), [rid] * 5)
        self.assertEqual(len(admission._recent), 1)
        admission.stopHeartbeat()


class SharedRenewalTests(SynchronousTestCase):
    """
    Issue 24: leases renewing (L{RedisSlotLease.startRenewing}) share one
    delayed call; each is still renewed every interval from its start until
    released.
    """

    def setUp(self):
        self.clock = Clock()
        self.redis = _Redis()
        self.admission = RedisSlotAdmission(redis=self.redis, clock=self.clock, prefix="p")

    def _lease(self):
        self.redis.replies = [[1, 0, 0, 0]]
        out = []
        self.admission.tryAcquire("account", "a", 2).addCallback(out.append)
        return out[0]

    def _renewed(self):
        from relay.admission.redis import RENEW_LUA

        return [a[2][0] for m, a in self.redis.calls if m == "eval" and a[0] == RENEW_LUA]

    def test_everyIntervalUntilReleased(self):
        """
        Two leases started 4 s apart with a 10 s interval: one delayed call;
        each renewed 10 s after its start and every 10 s after, none once
        released, and no delayed call is left when none is renewing.
        """
        first = self._lease()
        first.startRenewing(10)
        self.clock.advance(4)
        second = self._lease()
        second.startRenewing(10)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.redis.replies = [1, 1, 1, 1]
        self.clock.advance(5.9)
        self.assertEqual(self._renewed(), [])
        self.clock.advance(0.1)
        self.assertEqual(self._renewed(), [first.requestId])
        self.clock.advance(4)
        self.assertEqual(self._renewed(), [first.requestId, second.requestId])
        first.release()
        self.clock.advance(10)
        self.assertEqual(self._renewed(), [first.requestId, second.requestId,
                                           second.requestId])
        second.release()
        self.clock.advance(30)
        self.assertEqual(len(self._renewed()), 3)
        self.assertEqual(self.clock.getDelayedCalls(), [])
