"""
The L{IStateStore} contract of L{tests.test_state} run against
L{relay.state.redis.RedisStateStore} on a real redis-server, plus its
R35 failure modes with Redis killed and restarted.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from relay.state.runtime import AccountRuntime
from relay.wire.redisclient import RedisUnavailable
from relay.state.redis import RedisStateStore
from tests.integration.redis_server import redisServer, redisService  # noqa: F401 (fixtures)
from tests.test_state import StateStoreContractMixin, contractNames


class _RedisContract(StateStoreContractMixin):
    """
    The contract scenarios on Redis; time passes for real.
    """

    def __init__(self, service):
        self._service = service

    def makeStore(self):
        """
        @return: a L{RedisStateStore} that fails closed, so errors surface.
        """
        return RedisStateStore(redis=self._service, clock=reactor, onRedisError="fail_closed")

    async def advance(self, seconds):
        """
        Sleep on the real reactor.
        """
        await deferLater(reactor, seconds)

    def now(self):
        """
        @return: the reactor's time.
        """
        return reactor.seconds()


@pytest.mark.parametrize("name", contractNames())
@pytest_twisted.ensureDeferred
async def test_contract(name, redisService):
    """
    Every L{IStateStore} contract scenario holds on Redis.
    """
    await getattr(_RedisContract(redisService), name)()


@pytest_twisted.ensureDeferred
async def test_keyNames(redisService, redisServer):  # noqa: F811
    """
    Account state lives in the C{relay:account:{id}} hash; counters and
    values under the caller's names with a TTL.
    """
    store = RedisStateStore(redis=redisService, clock=reactor)
    await store.markAccount("a1", "rate_limited", 1e10, "429")
    await store.incrementCounter("openai_403_count:account:a1", 60)
    await store.setValue("sticky_session:0:openai:h", "a1", 60)
    assert b"rateLimitedUntil" in redisServer.command("HGETALL", "relay:account:a1")
    assert redisServer.command("PTTL", "openai_403_count:account:a1").startswith(b":")
    assert int(redisServer.command("PTTL", "sticky_session:0:openai:h")[1:].strip()) > 50000
    assert redisServer.command("GET", "sticky_session:0:openai:h") == b"$2\r\na1\r\n"


@pytest_twisted.ensureDeferred
async def test_numericValueStaysString(redisService):
    """
    T20: a value that looks like a number comes back as the same string.
    """
    store = RedisStateStore(redis=redisService, clock=reactor)
    await store.setValue("k", "00123", 60)
    assert await store.getValue("k") == "00123"


@pytest_twisted.ensureDeferred
async def test_redisDownFailOpenThenRecovers(redisService, redisServer):  # noqa: F811
    """
    R35: with Redis killed, each call ends within its own timeout; fail
    open reads give defaults / no binding and writes are dropped. After a
    restart on the same port the store works again.
    """
    store = RedisStateStore(redis=redisService, clock=reactor, timeout=0.3)
    closed = RedisStateStore(
        redis=redisService, clock=reactor, timeout=0.3, onRedisError="fail_closed"
    )
    await store.setValue("k", "v", 60)
    redisServer.stop()
    started = reactor.seconds()
    assert await store.getValue("k") is None
    assert await store.getAccountStates(["a"]) == {"a": AccountRuntime()}
    assert await store.incrementCounter("c", 60) == 0
    assert await store.markAccount("a", "overloaded", 1e10, "x") is None
    with pytest.raises(RedisUnavailable):
        await closed.getValue("k")
    assert reactor.seconds() - started < 2.5
    redisServer.start()
    await waitForRecovery(closed)
    await closed.setValue("k", "back", 60)
    assert await closed.getValue("k") == "back"


async def waitForRecovery(store, tries=60):
    """
    Poll until the pool has reconnected: ten calls in a row succeed.
    """
    ok = 0
    for _ in range(tries):
        try:
            await store.getValue("probe")
            ok += 1
            if ok >= 10:
                return
        except RedisUnavailable:
            ok = 0
            await deferLater(reactor, 0.1)
    raise AssertionError("redis did not come back")


@pytest_twisted.ensureDeferred
async def test_stateViewAcrossProcesses(redisService, redisServer):  # noqa: F811
    """
    Issue 24: a store's view follows the state writes of another store on
    the same Redis (another relay process) through the change log, reading
    again only the accounts written; a flushed Redis (a new epoch) is read
    again whole, so a block that is gone there is gone from the view.
    """
    ids = tuple(f"a{i}" for i in range(50))
    mine = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    other = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    await other.markAccount("a3", "rate_limited", reactor.seconds() + 60, "429")
    view = await mine.accountStateView(ids)
    assert set(view.flagged(reactor.seconds())) == {"a3"}
    await other.markAccount("a7", "disabled", 0, "401")
    await other.clearAccount("a3")
    reads = mine.batch.operations
    view = await mine.accountStateView(ids)
    assert set(view.flagged(reactor.seconds())) == {"a7"}
    assert view.get("a7").disabledReason == "401"
    # One sync and one read of the two changed accounts.
    assert mine.batch.operations - reads == 2
    reads = mine.batch.operations
    view = await mine.accountStateView(ids)
    assert mine.batch.operations - reads == 1
    redisServer.command("FLUSHALL")
    view = await mine.accountStateView(ids)
    assert set(view.flagged(reactor.seconds())) == set()
    assert view.get("a7") is None


@pytest_twisted.ensureDeferred
async def test_viewsOfOneTurnShareTheirSync(redisService):  # noqa: F811
    """
    Issue 24: views asked in one reactor turn (at load, every turn's
    selection) share one C{RELAY_SYNC} and see the same state; an account
    state write this store queued between two views gives the later view a
    sync of its own, after the write, so it sees it.
    """
    from twisted.internet.defer import gatherResults

    ids = ("s1", "s2")
    store = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    await store.accountStateView(ids)
    ops = store.batch.operations
    views = await gatherResults([store.accountStateView(ids) for _ in range(5)])
    assert store.batch.operations - ops == 1
    assert all(v is views[0] for v in views)
    ops = store.batch.operations
    before = store.accountStateView(ids)
    marked = store.markAccount("s2", "disabled", 0, "401")
    after = store.accountStateView(ids)
    _, _, second = await gatherResults([before, marked, after])
    # sync, mark, sync, and the read of the marked account
    assert store.batch.operations - ops == 4
    assert set(second.flagged(reactor.seconds())) == {"s2"}


@pytest_twisted.ensureDeferred
async def test_streakResetFollowsTheMirror(redisService, redisServer):  # noqa: F811
    """
    Issue 24: a success's streak reset sends nothing when the mirror holds
    no streak of that model; this process's own bump, and another's read
    by the next view, are reset in Redis.
    """
    ids = ("a1", "a2")
    mine = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    other = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    await mine.accountStateView(ids)
    sent = mine.batch.operations
    await mine.resetStreak("a1", "gpt-5")
    assert mine.batch.operations == sent
    assert await mine.bumpStreak("a1", "gpt-5", 60) == 1
    await mine.resetStreak("a1", "gpt-5")
    assert redisServer.command("HGETALL", "relay:account:a1") == b"*0\r\n"
    await other.bumpStreak("a2", "gpt-5", 60)
    await other.bumpStreak("a2", "gpt-5", 60)
    await mine.accountStateView(ids)
    await mine.resetStreak("a2", "gpt-5")
    assert (await other.getAccountStates(["a2"]))["a2"].streaks == {}
