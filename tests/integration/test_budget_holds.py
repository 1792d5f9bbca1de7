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

from relay.wire.redisclient import RedisService
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


@pytest_twisted.ensureDeferred
async def test_two_processes_hold_one_money_budget(redisServer):  # noqa: F811
    """
    R108 across processes: 40 turns at once spread over two relay
    processes on one Redis, a key with C{daily_usd: 0.0005}: the spend
    settled in Redis ends within the budget plus one turn's cost, and no
    reservation is left behind.
    """
    import json
    import os
    import tempfile

    import treq
    from twisted.internet.defer import Deferred

    from relay.emulator import Emulator
    from relay.tenants.prices import PriceTable
    from relay.usage.store import dayStart
    from relay.usage.tokens import fromUsage
    from tests.integration.harness import sseEvents
    from tests.integration.relayproc import RelayProcess

    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor, config={"default_script": {"text": "word " * 40,
                                                                    "delay": 0.02}})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-budget-redis-")
    relays = []
    secret = "sk-relay-budget"
    accounts = [{"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                 "api_key": "sk-budget-a1", "concurrency": 0}]
    keys = [{"name": "shared", "key": secret, "concurrency": 0, "daily_usd": 0.0005}]

    async def post(relay):
        body = {"model": "gpt-5.5", "input": "hi", "max_output_tokens": 4, "stream": True}
        response = await treq.post(
            relay.url + "/v1/responses", json.dumps(body).encode(), persistent=False,
            headers={"Authorization": [f"Bearer {secret}"],
                     "Content-Type": ["application/json"]})
        data = await response.content()
        if response.code != 200:
            return response.code, None
        return 200, sseEvents(data)[-1][1]["response"]

    try:
        for i in range(2):
            path = os.path.join(tmp, f"relay{i}.yaml")
            relay = RelayProcess(config=path, log=os.path.join(tmp, f"relay{i}.log"))
            with open(path, "w") as f:
                f.write(f'listen: "tcp:{relay.port}:interface=127.0.0.1"\n'
                        f"keys: {json.dumps(keys)}\n"
                        f"accounts: {json.dumps(accounts)}\n"
                        f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n")
            relay.start()
            relays.append(relay)
        for relay in relays:
            await relay.waitHealthy()
        results = await gatherResults(
            [Deferred.fromCoroutine(post(relays[i % 2])) for i in range(40)])
        served = [r for code, r in results if code == 200]
        assert served and len(served) < 40, [c for c, _ in results]
        assert {c for c, _ in results if c != 200} == {429}
        costs = [PriceTable().cost("gpt-5.5", fromUsage(r["usage"])) for r in served]
        await deferLater(reactor, 0.3, lambda: None)  # the settles are not awaited
        day = dayStart(reactor.seconds())
        raw = redisServer.command("HGET", f"relay:budget:s:shared:d:{day}", "n")
        settled = int(raw.split(b"\r\n")[1])
        assert settled == sum(costs), (settled, costs)
        assert settled <= 500_000 + max(costs), (settled, costs)
        assert redisServer.command("HLEN", "relay:budget:h:shared") == b":0\r\n"
        assert len(emulator.requestsFor("sk-budget-a1")) == len(served)
    finally:
        for relay in relays:
            relay.stop()
        await emulator.stop()
