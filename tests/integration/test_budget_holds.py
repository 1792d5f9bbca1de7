"""
L{relay.usage.holds.RedisBudgetHolds} on a real Redis (behaviour.md R108):
the reservation contract every provider passes
(L{tests.test_usage_holds.holdsContract}), and atomicity: parallel
reservations from two clients of one server never both take the last room.
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.task import deferLater

from relay.redisclient import RedisService
from relay.usage.holds import RedisBudgetHolds
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.test_usage_holds import holdsContract, usd


@pytest_twisted.ensureDeferred
async def test_redis_holds_contract(redisServer):  # noqa: F811
    """
    The contract, on the Redis server's clock (holds expire by C{TIME}).
    """
    redisServer.command("FLUSHALL")
    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    try:

        async def advance(seconds):
            await deferLater(reactor, seconds, lambda: None)

        await holdsContract(RedisBudgetHolds(redis=service), advance)
    finally:
        await service.stopService()


@pytest_twisted.ensureDeferred
async def test_redis_holds_are_atomic_across_processes(redisServer):  # noqa: F811
    """
    Two connections (two relay processes) reserve 40 turns at once against
    one budget: exactly as many are held as the budget has room for.
    """
    redisServer.command("FLUSHALL")
    services = [RedisService(url=redisServer.url, clock=reactor) for _ in range(2)]
    for service in services:
        service.startService()
    try:
        holds = [RedisBudgetHolds(redis=service) for service in services]
        replies = await gatherResults([
            holds[n % 2].reserve("k", f"h{n}", 10, 100, [usd(1000)], 60) for n in range(40)
        ])
        assert sum(1 for r in replies if r is None) == 10, replies
        assert await holds[0].outstanding("k") == (100, 1000)
    finally:
        for service in services:
            await service.stopService()
