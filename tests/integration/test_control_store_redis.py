"""
The L{IControlStore} contract of L{tests.test_control_store} on
L{relay.control.store.redis.RedisControlStore} against a real
redis-server (issue 21, architecture invariant 8), plus what only Redis
does: two stores (two relay processes) on one Redis hear each other's
changes through pub/sub within a second, and a feed that lost its
connection asks for a resync once it is back.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from relay.control.store import ANY, ControlChange, ControlStoreUnavailable
from relay.control.store.redis import RedisControlStore
from relay.wire.redisclient import RedisService
from tests.integration.redis_server import redisServer, redisService  # noqa: F401 (fixtures)
from tests.test_control_store import ControlStoreContractMixin, contractNames


class _RedisContract(ControlStoreContractMixin):
    """
    The contract scenarios on Redis.
    """

    def __init__(self, service):
        self._service = service

    def makeStore(self):
        return RedisControlStore(redis=self._service, clock=reactor)

    def now(self):
        return reactor.seconds()


@pytest.mark.parametrize("name", contractNames())
@pytest_twisted.ensureDeferred
async def test_contract(name, redisService):
    """
    Every L{IControlStore} contract scenario holds on Redis.
    """
    await getattr(_RedisContract(redisService), name)()


async def _until(predicate, timeout=2.0):
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            return False
        await deferLater(reactor, 0.01, lambda: None)
    return True


@pytest_twisted.ensureDeferred
async def test_twoProcessesHearEachOtherWithinASecond(redisServer):  # noqa: F811
    """
    Issue 21: a change written through one store (one relay process) is
    heard by another store on the same Redis (another process, its own
    connections) within a second, once, with its version; the writer hears
    its own change once (not again through the feed).
    """
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    services = [RedisService(url=redisServer.url, clock=reactor) for _ in range(2)]
    for s in services:
        s.startService()
    writer, reader = (RedisControlStore(redis=s, clock=reactor) for s in services)
    heardByReader, heardByWriter = [], []
    reader.subscribe(heardByReader.append)
    writer.subscribe(heardByWriter.append)
    try:
        await writer.start()
        await reader.start()
        assert await _until(lambda: ControlChange() in heardByReader)  # the first resync
        heardByReader.clear()
        heardByWriter.clear()
        started = reactor.seconds()
        record = await writer.put("pause", "a1", {"paused": True}, None)
        assert await _until(lambda: heardByReader, 1.0), "not heard within 1 s"
        assert reactor.seconds() - started < 1.0
        assert heardByReader == [ControlChange("pause", "a1", record.version)]
        assert (await reader.get("pause", "a1")).data == {"paused": True}
        await writer.delete("pause", "a1", ANY)
        assert await _until(lambda: len(heardByReader) == 2, 1.0)
        assert heardByReader[1] == ControlChange("pause", "a1", None)
        await deferLater(reactor, 0.2, lambda: None)
        assert heardByWriter == [ControlChange("pause", "a1", record.version),
                                 ControlChange("pause", "a1", None)]
    finally:
        await writer.stop()
        await reader.stop()
        for s in services:
            await s.stopService()


@pytest_twisted.ensureDeferred
async def test_feedReconnectsAndAsksForAResync(redisServer):  # noqa: F811
    """
    With Redis restarted the feed reconnects by itself and its listeners
    are told to re-read everything (messages sent while it was away are
    lost); store calls meanwhile fail with L{ControlStoreUnavailable}
    within their timeout.
    """
    if redisServer.process is None:
        redisServer.start()
    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    store = RedisControlStore(redis=service, clock=reactor, timeout=0.5)
    heard = []
    store.subscribe(heard.append)
    try:
        await store.start()
        assert await _until(lambda: ControlChange() in heard)
        heard.clear()
        redisServer.stop()
        with pytest.raises(ControlStoreUnavailable):
            await store.get("account", "a")
        redisServer.start()
        assert await _until(lambda: ControlChange() in heard, 10.0), "no resync after restart"
    finally:
        await store.stop()
        await service.stopService()
