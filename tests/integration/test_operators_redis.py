"""
The console's operators and sessions on the Redis control store (a real
redis-server; the memory and SQLite providers: L{tests.test_operators}):
the same directory and session rules, and what only Redis does: an
operator added and a session revoked by one relay process are seen by
another within a second (pub/sub), so a signed-out cookie is refused
everywhere.
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import reactor
from zope.interface.verify import verifyObject

from relay.control.store.redis import RedisControlStore
from relay.control.web import ControlError
from relay.interfaces import IOperatorDirectory, IOperatorSessions
from relay.operators.directory import OperatorDirectory
from relay.operators.passwords import verifyPassword
from relay.operators.roles import ADMIN_KEY, Principal
from relay.operators.sessions import OperatorSessions
from relay.wire.redisclient import RedisService
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_control_store_redis import _until

ADMIN = Principal("adam", "admin")


async def _process(redisServer):  # noqa: F811
    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    store = RedisControlStore(redis=service, clock=reactor)
    await store.start()
    directory = OperatorDirectory(store=store, clock=reactor)
    sessions = OperatorSessions(store=store, clock=reactor)
    await directory.start()
    await sessions.start()
    return service, store, directory, sessions


@pytest_twisted.ensureDeferred
async def test_operatorsAndSessionsAcrossProcesses(redisServer):  # noqa: F811
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    one = await _process(redisServer)
    two = await _process(redisServer)
    try:
        _, _, directory, sessions = one
        _, _, otherDirectory, otherSessions = two
        assert verifyObject(IOperatorDirectory, directory)
        assert verifyObject(IOperatorSessions, sessions)
        await directory.add("olga", "owner", "olga-password-1", None, ADMIN_KEY)
        await directory.add("vic", "viewer", "vic-password-123", None, ADMIN_KEY)
        assert await _until(lambda: otherDirectory.find("vic") is not None)
        assert verifyPassword(otherDirectory.passwordHash("vic"), "vic-password-123")
        try:
            await otherDirectory.change("olga", {"role": "viewer"}, ADMIN)
        except ControlError as e:
            assert e.status == 403
        else:
            raise AssertionError("an admin demoted an owner")
        view, revoke = await otherDirectory.change("vic", {"role": "admin"}, ADMIN_KEY)
        assert (view["role"], revoke) == ("admin", False)
        assert await _until(lambda: directory.find("vic")["role"] == "admin")

        cookie, session = await sessions.open("vic", "admin", "password")
        assert await _until(lambda: otherSessions.lookup(cookie) == session)
        assert await otherSessions.revokeOperator("vic") == 1
        assert await _until(lambda: sessions.lookup(cookie) is None)
        await otherDirectory.remove("vic", ADMIN_KEY)
        assert await _until(lambda: directory.find("vic") is None)
    finally:
        for service, store, directory, sessions in (one, two):
            directory.stop()
            sessions.stop()
            await store.stop()
            await service.stopService()
