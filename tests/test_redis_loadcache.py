"""
R34's in-process load cache on the Redis admission (issue 24): the
load-balance layer's busy read is one C{busy.lua} call per 200 ms, with
this process's own slot takes and releases counted in at once; a fresh
read bypasses it.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.redis import BUSY_LUA, LOAD_CACHE_SECONDS, RedisSlotAdmission
from tests.test_redis_liveness import _Redis

IDS = frozenset({"a1", "a2", "a3"})


class LoadCacheTests(SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.redis = _Redis()
        self.admission = RedisSlotAdmission(redis=self.redis, clock=self.clock, prefix="p")

    def loadCalls(self):
        return [a for m, a in self.redis.calls if m == "eval" and a[0] == BUSY_LUA]

    def busy(self, **kw):
        return self.successResultOf(self.admission.busy("account", IDS, **kw))

    def test_oneReadPer200ms(self):
        """
        Busy reads within L{LOAD_CACHE_SECONDS} share one C{busy.lua}
        call (the ids go as one argument, one per line); the next one after it reads again. On the old code every
        call read every id.
        """
        self.assertEqual(LOAD_CACHE_SECONDS, 0.2)
        self.redis.replies = [["a2", 2, 1]]
        self.assertEqual(self.busy(), {"a2": (2, 1)})
        self.assertEqual(self.loadCalls()[0][2][3], b"a1\na2\na3")
        self.clock.advance(0.1)
        self.assertEqual(self.busy(), {"a2": (2, 1)})
        self.assertEqual(len(self.loadCalls()), 1)
        self.clock.advance(0.15)
        self.redis.replies = [[]]
        self.assertEqual(self.busy(), {})
        self.assertEqual(len(self.loadCalls()), 2)

    def test_freshReadsAgain(self):
        """
        R34: a fresh read (after a failed pass) bypasses the cache.
        """
        self.redis.replies = [[], ["a1", 1, 0]]
        self.assertEqual(self.busy(), {})
        self.assertEqual(self.busy(fresh=True), {"a1": (1, 0)})
        self.assertEqual(len(self.loadCalls()), 2)

    def test_ownTakesAndReleasesCountAtOnce(self):
        """
        A slot this process takes after the read counts in the cached
        answer at once, and its release takes it out again.
        """
        self.redis.replies = [[]]
        self.assertEqual(self.busy(), {})
        self.redis.replies = [[1, "1000", 0, 0]]
        lease = self.successResultOf(self.admission.tryAcquire("account", "a3", 4))
        self.assertEqual(self.busy(), {"a3": (1, 0)})
        lease.release()
        self.assertEqual(self.busy(), {})
        self.assertEqual(len(self.loadCalls()), 1)

    def test_concurrentCallersShareTheRead(self):
        """
        A second caller while the read is in flight waits for it instead
        of reading again.
        """
        pending = []
        execute = self.redis.execute

        def held(timeout, method, *args, **kwargs):
            d = execute(timeout, method, *args, **kwargs)
            pending.append(d)
            return d

        self.redis.execute = held
        first = self.admission.busy("account", IDS)
        second = self.admission.busy("account", IDS)
        self.assertEqual(len(self.loadCalls()), 1)
        self.assertNoResult(first)
        self.assertNoResult(second)
        pending[0].callback([b"a2", 3, 0])
        self.assertEqual(self.successResultOf(first), {"a2": (3, 0)})
        self.assertEqual(self.successResultOf(second), {"a2": (3, 0)})
