"""
L{relay.state.redisbatch}'s script on a real redis-server: the state
store's calls of one reactor turn in one round trip, with the replies and
errors each call gets alone (issue 24).
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import gatherResults

from relay.state.runtime import AccountRuntime
from relay.wire.redisclient import RedisUnavailable
from relay.state.redis import RedisStateStore
from tests.integration.redis_server import redisServer, redisService  # noqa: F401 (fixtures)


@pytest_twisted.ensureDeferred
async def test_oneTurnOneRoundTrip(redisService, redisServer):  # noqa: F811
    """
    Every kind of state call issued in one reactor turn leaves as one
    command, runs in issue order (the read after a write sees it) and
    answers each call as the plain command would.
    """
    store = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    await store.setValue("warm", "1", 60)
    before = redisService.commandCount
    calls = [
        store.setValue("sticky_session:0:openai:h", "a1", 60),
        store.getValue("sticky_session:0:openai:h"),
        store.markAccount("a1", "rate_limited", 1e10, "429"),
        store.bumpStreak("a2", "gpt-5.5", 30),
        store.bumpStreak("a2", "gpt-5.5", 30),
        store.incrementCounter("openai_403_count:account:a1", 60),
        store.getAccountStates(["a1", "a2", "a3"]),
        store.touchValue("sticky_session:0:openai:h", 120),
        store.getValue("missing"),
        store.resetStreak("a2", "other"),
    ]
    results = await gatherResults(calls)
    assert redisService.commandCount - before == 1
    assert results[:6] == [None, "a1", None, 1, 2, 1]
    states = results[6]
    assert states["a1"].rateLimitedUntil == 1e10
    assert states["a2"].streaks["gpt-5.5"][0] == 2
    assert states["a3"] == AccountRuntime()
    assert results[7:] == [None, None, None]
    assert int(redisServer.command("PTTL", "sticky_session:0:openai:h")[1:].strip()) > 60000


@pytest_twisted.ensureDeferred
async def test_oneCallFailsAlone(redisService):
    """
    A call Redis refuses (a counter on a hash key: WRONGTYPE) fails alone
    (fail_closed: L{RedisUnavailable}; fail_open: its fallback) while the
    others of the same round trip succeed.
    """
    closed = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    opened = RedisStateStore(redis=redisService, clock=reactor, batch=closed.batch)
    await closed.markAccount("a1", "overloaded", 1e10, "x")
    first = closed.setValue("k", "v", 60)
    bad = closed.incrementCounter("relay:account:a1", 60)
    lenient = opened.incrementCounter("relay:account:a1", 60)
    after = closed.getValue("k")
    await first
    with pytest.raises(RedisUnavailable):
        await bad
    assert await lenient == 0
    assert await after == "v"


@pytest_twisted.ensureDeferred
async def test_valuesRoundTrip(redisService):
    """
    Values with quotes, backslashes, non-ASCII text and digits with
    leading zeros come back as they went in through a batch (T20).
    """
    store = RedisStateStore(redis=redisService, clock=reactor, onRedisError="fail_closed")
    odd = ['a"b\\c', "zürich ✓", "00123", ""]
    writes = [store.setValue(f"k{i}", v, 60) for i, v in enumerate(odd)]
    reads = [store.getValue(f"k{i}") for i in range(len(odd))]
    await gatherResults(writes)
    assert await gatherResults(reads) == odd


@pytest_twisted.ensureDeferred
async def test_scriptCacheFlushedUnderRelay(redisService, redisServer):  # noqa: F811
    """
    Issue 24: scripts go as C{EVALSHA} of a SHA1 computed once; after
    C{SCRIPT FLUSH} (a restarted or failed-over Redis) the next call sends
    the script whole and every call still gets its answer.
    """
    script = "return redis.call('INCR', KEYS[1])"
    assert await redisService.execute(2, "eval", script, ["flushed"], []) == 1
    assert await redisService.execute(2, "eval", script, ["flushed"], []) == 2
    redisServer.command("SCRIPT", "FLUSH")
    assert await redisService.execute(2, "eval", script, ["flushed"], []) == 3
    assert await redisService.execute(2, "eval", script, ["flushed"], []) == 4
