"""
L{relay.process.readiness}: C{GET /readyz} beside C{/healthz}, and the
Redis check a relay on the Redis backend registers (issue 23, behaviour.md
R101: "/readyz says not ready" while Redis does not answer).
"""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from relay.process.app import buildApplication
from relay.configuration.parse import settingsFromString
from relay.process.readiness import Readiness, ReadinessResource
from relay.wire.redisclient import RedisService


def _get(resource) -> tuple:
    request = DummyRequest([])
    body = resource.render_GET(request)
    return request.responseCode or 200, json.loads(body)


class ReadinessTests(SynchronousTestCase):
    """
    L{Readiness} and L{ReadinessResource}.
    """

    def test_readyWithoutChecks(self):
        self.assertEqual(Readiness().ready(), (True, []))
        self.assertEqual(_get(ReadinessResource(Readiness())), (200, {"status": "ready"}))

    def test_failingChecksListed(self):
        """
        The failing checks are named in the order they were added; a check
        that raises counts as failing (and is logged).
        """
        readiness = Readiness()
        state = {"redis": False}
        readiness.addCheck("stores", lambda: True)
        readiness.addCheck("redis", lambda: state["redis"])
        readiness.addCheck("broken", lambda: 1 / 0)
        self.assertEqual(readiness.ready(), (False, ["redis", "broken"]))
        self.assertEqual(
            _get(ReadinessResource(readiness)),
            (503, {"status": "not_ready", "waiting": ["redis", "broken"]}),
        )
        self.flushLoggedErrors(ZeroDivisionError)
        readiness.addCheck("broken", lambda: True)
        state["redis"] = True
        self.assertEqual(_get(ReadinessResource(readiness)), (200, {"status": "ready"}))


class AppReadinessTests(SynchronousTestCase):
    """
    The relay's C{/readyz}: mounted on every relay; with the Redis backend
    it waits for Redis (L{RedisService.reachable}).
    """

    def _app(self, state: str):
        config = settingsFromString(
            "database: \":memory:\"\n"
            "keys: [{name: k, key: sk-k}]\n"
            "accounts: [{id: a1, type: apikey, api_key: x, base_url: 'http://127.0.0.1:1/v1'}]\n"
            f"state: {state}\n"
        )
        return buildApplication(config, Clock())

    def test_memoryBackendReady(self):
        app = self._app("{backend: memory}")
        self.assertEqual(app.extras["readiness"].ready(), (True, []))

    def test_redisBackendWaitsForRedis(self):
        app = self._app("{backend: redis, redis_url: 'redis://127.0.0.1:1/0'}")
        redis = [s for s in app.services if isinstance(s, RedisService)][0]
        self.assertEqual(app.extras["readiness"].ready(), (False, ["redis"]))
        redis._replied()
        self.assertEqual(app.extras["readiness"].ready(), (True, []))
        redis._unreachable("test")
        self.assertEqual(app.extras["readiness"].ready(), (False, ["redis"]))

    def test_sentinelArguments(self):
        """
        C{state.redis_sentinels} / C{state.redis_master_name} reach the
        Redis client.
        """
        app = self._app(
            "{backend: redis, redis_url: 'redis://127.0.0.1/3',"
            " redis_sentinels: ['127.0.0.1:26379', 'h2:26380'], redis_master_name: mm}"
        )
        redis = [s for s in app.services if isinstance(s, RedisService)][0]
        self.assertEqual(redis.sentinels, (("127.0.0.1", 26379), ("h2", 26380)))
        self.assertEqual(redis.masterName, "mm")
        self.assertEqual(redis.durableReplicas, 1)


class StartupGateTests(SynchronousTestCase):
    """
    L{relay.process.readiness.StartupGate}: one gate, a flag per store
    (issue 19's settings and tokens, and those parts add: the control
    plane's first read, issue 21), waited on whole or by name.
    """

    def test_flagsAddedJoinTheGate(self):
        from relay.process.readiness import StartupGate

        gate = StartupGate()
        control = gate.add("control")
        self.assertIs(gate.add("control"), control)
        whole, keys = gate.wait(), gate.wait(["control"])
        gate.mark(gate.settings)()
        gate.mark(gate.tokens)()
        self.assertNoResult(whole)
        self.assertNoResult(keys)
        gate.mark(control)()
        self.successResultOf(whole)
        self.successResultOf(keys)
        self.assertTrue(gate.isOpen)
        self.assertIsNone(gate.wait())

    def test_waitByName(self):
        from relay.process.readiness import StartupGate

        gate = StartupGate()
        control = gate.add("control")
        keys = gate.wait(["control"])
        gate.mark(control)()
        self.successResultOf(keys)
        self.assertIsNone(gate.wait(["control"]))
        self.assertIsNone(gate.wait(["unknown"]))
        self.assertIsNotNone(gate.wait())  # settings and tokens still unread

    def test_cancelledWaitLeaves(self):
        from relay.process.readiness import StartupGate

        gate = StartupGate()
        d = gate.wait()
        d.cancel()
        self.failureResultOf(d)
        self.assertEqual(gate._waiters, [])
