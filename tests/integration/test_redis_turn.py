"""
Issue 24 item 3: what a selection sends to a real redis-server when the
state store and the slot admission share one batcher
(L{relay.admission.redis.sharedBatch}): a sticky selection's binding read,
state sync, slot try and binding refresh travel in one round trip, and a
guess that turns out wrong gives its slot back.
"""

from __future__ import annotations

import random

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from relay.admission.redis import RedisSlotAdmission, sharedBatch
from relay.base.records import Account, ClientKey, GatewaySettings, SchedulingSettings, Turn
from relay.process.live import AccountRegistry
from relay.scheduling.scheduler import AccountScheduler, sessionKey
from relay.state.settings import RuntimeSettings
from relay.state.redis import RedisStateStore
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_redis_state import redisService  # noqa: F401 (fixture)

HASH = "0123456789abcdef"


def _account(id):
    return Account(id=id, type="apikey", base_url="https://api.example/v1", credential="c",
                   concurrency=4)


def _turn():
    return Turn(entrypoint="http", endpoint="responses", client=ClientKey(name="k", key="sk-k"),
                model="gpt-5", body={}, stream=True, requestId="req-1", sessionHash=HASH)


def _rig(service):
    batch = sharedBatch(service, reactor)
    store = RedisStateStore(redis=service, clock=reactor, batch=batch)
    admission = RedisSlotAdmission(redis=service, clock=reactor, batch=batch, prefix="t1",
                                   random=random.Random(1))
    scheduler = AccountScheduler(
        accounts=AccountRegistry([_account("a"), _account("b")]), admission=admission,
        store=store, clock=reactor,
        settings=RuntimeSettings(GatewaySettings(scheduling=SchedulingSettings())),
        random=random.Random(1),
    )
    return store, admission, scheduler


async def _settle():
    await deferLater(reactor, 0.05)


@pytest_twisted.ensureDeferred
async def test_stickySelectionIsOneRoundTrip(redisService):  # noqa: F811
    """
    Once this process has bound a session, its next sticky selection
    (binding read, state sync, the slot of the bound account, the
    binding's refresh) is one command, and the record says what happened
    (R45: a session-hash hit).
    """
    store, admission, scheduler = _rig(redisService)
    await store.setValue(sessionKey(HASH), "a", 3600)
    first = await scheduler.select(_turn())
    assert (first.account.id, first.record.layer) == ("a", "session_hash")
    first.lease.release()
    await _settle()
    before = redisService.commandCount
    second = await scheduler.select(_turn())
    assert redisService.commandCount - before == 1
    assert (second.account.id, second.record.layer, second.record.sticky_session_hit) == (
        "a", "session_hash", True)
    assert second.lease is not None
    assert await admission.load("account", ["a"]) == {"a": (1, 0)}
    second.lease.release()
    await _settle()
    assert await admission.load("account", ["a"]) == {"a": (0, 0)}


@pytest_twisted.ensureDeferred
async def test_wrongGuessGivesTheSlotBack(redisService):  # noqa: F811
    """
    Another process rebinds the session, or blocks the guessed account: the
    selection follows the store (the new binding; R38's delete and load
    balance), and the guessed account's slot is released.
    """
    store, admission, scheduler = _rig(redisService)
    other = RedisStateStore(redis=redisService, clock=reactor)
    await store.setValue(sessionKey(HASH), "a", 3600)
    (await scheduler.select(_turn())).lease.release()
    await other.setValue(sessionKey(HASH), "b", 3600)
    moved = await scheduler.select(_turn())
    assert (moved.account.id, moved.record.layer) == ("b", "session_hash")
    await _settle()
    assert await admission.load("account", ["a", "b"]) == {"a": (0, 0), "b": (1, 0)}
    moved.lease.release()
    await other.markAccount("b", "disabled", 0, "401")
    away = await scheduler.select(_turn())
    assert (away.account.id, away.record.layer) == ("a", "load_balance")
    await _settle()
    assert await admission.load("account", ["a", "b"]) == {"a": (1, 0), "b": (0, 0)}
    assert await store.getValue(sessionKey(HASH)) == "a"
    away.lease.release()


@pytest_twisted.ensureDeferred
async def test_newSessionRanksBusyAccountsFromRedis(redisService):  # noqa: F811
    """
    The load-balance layer on Redis ranks the accounts another process
    keeps busy by their load (R43): a new session goes to an idle one, and
    the record counts every candidate and the load's spread (R45).
    """
    store, admission, scheduler = _rig(redisService)
    other = RedisSlotAdmission(redis=redisService, clock=reactor, prefix="t2")
    held = [await other.tryAcquire("account", "a", 4) for _ in range(3)]
    turn = Turn(entrypoint="http", endpoint="responses", client=ClientKey(name="k", key="sk-k"),
                model="gpt-5", body={}, stream=True, requestId="req-2", sessionHash="f" * 16)
    picked = await scheduler.select(turn)
    assert (picked.account.id, picked.record.layer) == ("b", "load_balance")
    assert picked.record.candidate_count == 2
    assert picked.record.load_skew > 0
    picked.lease.release()
    for lease in held:
        lease.release()
