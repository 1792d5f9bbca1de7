"""
Issue 12: two relay processes sharing one real Redis refresh an OAuth
account once between them (cross-process single flight: C{SET NX PX} lock,
the waiter re-reads the store), and both then use the new token.
"""

from __future__ import annotations

import os
import tempfile

import pytest_twisted
from twisted.internet import reactor

from relay.emulator import Emulator
from tests.integration.oauthstack import bearers, emulatorConfig, expOf, oauthStats, sleep
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import RelayProcess, writeConfig


@pytest_twisted.ensureDeferred
async def test_two_relays_refresh_once(redisServer):  # noqa: F811
    """
    Both relays plan the proactive refresh of the same account for the
    same moment; the emulator sees one token request and no reuse, and
    afterwards (past the old token's expiry) both relays' requests carry
    the one new token.
    """
    emulator = Emulator(reactor=reactor, config=emulatorConfig(("o1",), ttl=600))
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-oauth-redis-")
    accounts = [{
        "id": "o1", "type": "oauth", "base_url": emulator.baseURL("oauth"),
        "access_token": (first := emulator.mintAccessToken("o1", 8)),
        "refresh_token": "rt-o1-0", "auth_base_url": emulator.baseURL("root"),
    }]
    relays = []
    try:
        for i in range(2):
            path = os.path.join(tmp, f"relay{i}.yaml")
            relay = RelayProcess(config=path, log=os.path.join(tmp, f"relay{i}.log"))
            writeConfig(path, relay.port, accounts, gateway="{oauth: {refresh_margin_seconds: 4}}",
                        extra=f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n")
            relays.append(relay)
            relay.start()
        for relay in relays:
            await relay.waitHealthy()
        # Past the refresh (~4 s) and the old token's expiry (8 s after it was minted, not
        # 9 s after both relays were healthy).
        await sleep(max(0.0, expOf(first) + 0.5 - reactor.seconds()))
        for relay in relays:
            for i in range(2):
                code, body = await relay.post({"model": "gpt-5.5", "input": f"x{i}",
                                               "stream": True})
                assert code == 200 and b"response.completed" in body, (code, relay.tail())
        stats = oauthStats(emulator, "o1")
        assert stats["token_requests"] == 1, (stats, relays[0].tail(), relays[1].tail())
        assert stats["refreshes"] == 1 and stats["reuse_attempts"] == 0, stats
        used = bearers(emulator, "o1", "request")
        assert len(used) == 4 and len(set(used)) == 1, used
        versions = {(await relay.accounts())["o1"]["token_version"] for relay in relays}
        assert len(versions) == 1, versions
    finally:
        for relay in relays:
            relay.stop()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_redis_token_store_contract(redisServer):  # noqa: F811
    """
    L{RedisTokenStore} keeps the L{ITokenStore} contract on a real Redis:
    compare-and-set writes, and a lock with an owner (re-entrant for its
    owner, refused to others, freed by its owner or by its TTL).
    """
    from zope.interface.verify import verifyObject

    from relay.interfaces import ITokenStore
    from relay.oauth.store import RedisTokenStore
    from relay.wire.redisclient import RedisService

    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    try:
        store = RedisTokenStore(redis=service)
        assert verifyObject(ITokenStore, store)
        account = f"c{os.getpid()}"
        assert await store.load(account) is None
        assert await store.save(account, 1, "r1", None) is True
        assert await store.save(account, 1, "rX", None) is False
        assert await store.save(account, 2, "rX", 5) is False
        assert await store.save(account, 2, "r2", 1) is True
        assert await store.load(account) == "r2"
        assert await store.acquireLock(account, "a", 0.5) is True
        assert await store.acquireLock(account, "a", 0.5) is True  # the owner renews
        assert await store.acquireLock(account, "b", 0.5) is False
        await store.releaseLock(account, "b")
        assert await store.acquireLock(account, "b", 0.5) is False
        await store.releaseLock(account, "a")
        assert await store.acquireLock(account, "b", 0.3) is True
        await sleep(0.5)
        assert await store.acquireLock(account, "c", 0.3) is True
    finally:
        await service.stopService()


@pytest_twisted.ensureDeferred
async def test_durable_save_fails_on_a_demoted_master():
    """
    With Sentinel a token record's save waits for a replica (C{WAIT}, a
    pipeline; L{relay.wire.redisclient.RedisService.executeDurable}). On a
    Redis that is now a replica (a demoted master: every write answers
    C{READONLY}) the save fails with L{RedisUnavailable} -- it is not
    reported as a lost compare-and-set race (the old code read the
    pipeline's swallowed error as the value C{None}), so the rotated
    refresh token is not silently dropped. Back as a master, the same save
    is done (no replica acknowledged it: logged, not an error).
    """
    from relay.oauth.store import RedisTokenStore
    from relay.wire.redisclient import RedisService, RedisUnavailable
    from tests.integration.redis_server import RedisServer, freePort, requireRedis

    requireRedis()
    server = RedisServer()
    server.start()
    service = RedisService(url=server.url, clock=reactor)
    service.durableReplicas = 1
    service.durableTimeout = 0.1
    service.startService()
    try:
        store = RedisTokenStore(redis=service)
        assert await store.save("d1", 1, "r1", None) is True
        assert server.command("REPLICAOF", "127.0.0.1", str(freePort())).startswith(b"+OK")
        try:
            result = await store.save("d1", 2, "r2", 1)
        except RedisUnavailable as e:
            assert "READONLY" in str(e), e
        else:
            raise AssertionError(f"a refused durable write returned {result!r}")
        assert server.command("REPLICAOF", "NO", "ONE").startswith(b"+OK")
        deadline = reactor.seconds() + 5
        while True:
            try:
                assert await store.save("d1", 2, "r2", 1) is True
                break
            except RedisUnavailable:
                # The READONLY reply dropped the connections; they redial.
                assert reactor.seconds() < deadline
                await sleep(0.1)
        assert await store.load("d1") == "r2"
    finally:
        await service.stopService()
        server.cleanup()
