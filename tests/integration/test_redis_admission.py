"""
L{relay.admission.redis.RedisSlotAdmission} against a real redis-server:
the Lua scripts under concurrent callers, FIFO order, lease expiry and
renewal, crashed waiters, Redis killed and restarted (R35), and a short
randomized no-leak soak.
"""

from __future__ import annotations

import random

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.task import deferLater
from zope.interface.verify import verifyObject

from relay.admission.redis import ACQUIRE_LUA, RedisSlotAdmission, keysFor, nextBackoff
from relay.interfaces import ISlotAdmission, ISlotLease
from relay.model import AdmissionError, CancelSignal, WaitPlan
from relay.redisclient import RedisService, RedisUnavailable
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)


def plan(id="a", limit=1, timeout=3.0, maxWaiting=10, kind="account"):
    """
    @return: a L{WaitPlan}.
    """
    return WaitPlan(kind=kind, id=id, max_concurrency=limit, timeout=timeout, max_waiting=maxWaiting)


@pytest_twisted.async_yield_fixture
async def redisService(redisServer):  # noqa: F811
    """
    A started L{RedisService} on a flushed server; stopped afterwards.
    """
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    yield service
    await service.stopService()


def admission(service, **kw):
    """
    @return: a L{RedisSlotAdmission} on the real reactor, seeded jitter.
    """
    kw.setdefault("random", random.Random(7))
    return RedisSlotAdmission(redis=service, clock=reactor, **kw)


async def sleep(seconds):
    """
    Wait on the real reactor.
    """
    await deferLater(reactor, seconds)


async def waitFor(predicate, timeout=3.0):
    """
    Poll an async predicate until it is true.
    """
    end = reactor.seconds() + timeout
    while not await predicate():
        assert reactor.seconds() < end, "condition not reached"
        await sleep(0.02)


@pytest_twisted.ensureDeferred
async def test_interfacesAndFastPath(redisService):
    """
    The provider and its lease implement their interfaces; the fast path is
    one acquire and one release round trip; request ids are
    C{<prefix>-<seq base36>}.
    """
    adm = admission(redisService, prefix="p1")
    assert verifyObject(ISlotAdmission, adm)
    before = redisService.commandCount
    lease = await adm.acquire(plan(), CancelSignal())
    assert verifyObject(ISlotLease, lease)
    assert lease.requestId == "p1-1"
    assert (lease.waitedSeconds, lease.queuePosition) == (0.0, 0)
    assert await adm.load("account", ["a"]) == {"a": (1, 0)}
    before2 = redisService.commandCount
    lease.release()
    lease.release()
    assert redisService.commandCount - before2 == 1
    assert before2 - before == 2  # acquire + load
    await waitFor(lambda: _loadIs(adm, "a", (0, 0)))


async def _loadIs(adm, id, expected, kind="account"):
    return (await adm.load(kind, [id]))[id] == expected


@pytest_twisted.ensureDeferred
async def test_tryAcquireLimitAndUnlimited(redisService):
    """
    C{tryAcquire} respects the limit per kind and id; a limit <= 0 is
    unlimited and touches no key.
    """
    adm = admission(redisService)
    a = await adm.tryAcquire("account", "a", 2)
    b = await adm.tryAcquire("account", "a", 2)
    assert await adm.tryAcquire("account", "a", 2) is None
    assert await adm.tryAcquire("user", "a", 1) is not None
    free = [await adm.tryAcquire("account", "u", 0) for _ in range(5)]
    assert None not in free
    assert await adm.load("account", ["a", "u"]) == {"a": (2, 0), "u": (0, 0)}
    a.release()
    b.release()


@pytest_twisted.ensureDeferred
async def test_concurrentNeverExceedsLimit(redisService):
    """
    R34: many callers in three "processes" acquire in parallel; the number
    of holders never exceeds the limit and everyone is served.
    """
    adms = [admission(redisService, prefix=f"proc{i}", random=random.Random(i)) for i in range(3)]
    limit = 3
    holding = [0]
    peak = [0]

    async def turn(n):
        lease = await adms[n % 3].acquire(plan("c", limit=limit, timeout=10, maxWaiting=50),
                                         CancelSignal())
        holding[0] += 1
        peak[0] = max(peak[0], holding[0])
        await sleep(0.02)
        holding[0] -= 1
        lease.release()

    from twisted.internet.defer import Deferred

    await gatherResults([Deferred.fromCoroutine(turn(n)) for n in range(15)])
    assert peak[0] <= limit
    assert peak[0] >= 2
    await waitFor(lambda: _loadIs(adms[0], "c", (0, 0)))


@pytest_twisted.ensureDeferred
async def test_luaAcquireRaceDirect(redisService):
    """
    200 concurrent C{acquire.lua} calls with limit 5 grant exactly 5.
    """
    calls = [
        redisService.execute(2, "eval", ACQUIRE_LUA, keysFor("account", "r"),
                             [5, "60", f"x-{i}", "try", 0, "6"])
        for i in range(200)
    ]
    replies = await gatherResults(calls)
    assert sum(1 for r in replies if int(r[0]) == 1) == 5


@pytest_twisted.ensureDeferred
async def test_fifoOrder(redisService):
    """
    R-B2: three waiters are served in arrival order with their positions.
    """
    adm = admission(redisService)
    holder = await adm.tryAcquire("account", "f", 1)
    order = []
    waits = []
    for i in range(3):
        d = adm.acquire(plan("f"), CancelSignal())

        def _cb(lease, i=i):
            order.append((i, lease.queuePosition))
            lease.release()

        waits.append(d.addCallback(_cb))
        await waitFor(lambda n=i + 1: _loadIs(adm, "f", (1, n)))
    holder.release()
    await gatherResults(waits)
    assert order == [(0, 1), (1, 2), (2, 3)]
    await waitFor(lambda: _loadIs(adm, "f", (0, 0)))


@pytest_twisted.ensureDeferred
async def test_queueFullTimeoutCancel(redisService):
    """
    R27/R33: queue full is refused at once; timeout and cancellation end
    the wait; the wait count is back to 0 and the holder is untouched.
    """
    adm = admission(redisService)
    holder = await adm.tryAcquire("account", "q", 1)
    cancel = CancelSignal()
    waiting = adm.acquire(plan("q", timeout=0.4, maxWaiting=1), cancel)
    await waitFor(lambda: _loadIs(adm, "q", (1, 1)))
    with pytest.raises(AdmissionError) as e:
        await adm.acquire(plan("q", maxWaiting=1), CancelSignal())
    assert e.value.reason == "queue_full"
    cancel.cancel()
    with pytest.raises(AdmissionError) as e:
        await waiting
    assert e.value.reason == "client_gone"
    assert e.value.queuePosition == 1
    await waitFor(lambda: _loadIs(adm, "q", (1, 0)))
    started = reactor.seconds()
    with pytest.raises(AdmissionError) as e:
        await adm.acquire(plan("q", timeout=0.4), CancelSignal())
    assert e.value.reason == "timeout"
    assert 0.35 < reactor.seconds() - started < 1.0
    assert e.value.waitedSeconds >= 0.35
    await waitFor(lambda: _loadIs(adm, "q", (1, 0)))
    d = adm.acquire(plan("q"), CancelSignal())
    await waitFor(lambda: _loadIs(adm, "q", (1, 1)))
    d.cancel()
    with pytest.raises(AdmissionError) as e:
        await d
    assert e.value.reason == "client_gone"
    await waitFor(lambda: _loadIs(adm, "q", (1, 0)))
    holder.release()


@pytest_twisted.ensureDeferred
async def test_deadline(redisService):
    """
    R33: a deadline bounds only this wait; a passed deadline takes no slot.
    """
    adm = admission(redisService)
    with pytest.raises(AdmissionError) as e:
        await adm.acquire(plan("d"), CancelSignal(), deadline=reactor.seconds() - 1)
    assert e.value.reason == "timeout"
    holder = await adm.tryAcquire("account", "d", 1)
    started = reactor.seconds()
    with pytest.raises(AdmissionError) as e:
        await adm.acquire(plan("d", timeout=30), CancelSignal(), deadline=started + 0.3)
    assert e.value.reason == "timeout"
    assert reactor.seconds() - started < 0.9
    holder.release()
    await waitFor(lambda: _loadIs(adm, "d", (0, 0)))


@pytest_twisted.ensureDeferred
async def test_leaseExpiryAndRenew(redisService):
    """
    R34: an unrenewed lease expires after the slot TTL, so a crashed
    process leaks nothing; a renewed one stays.
    """
    adm = admission(redisService, slotTtl=0.4)
    crashed = await adm.tryAcquire("account", "e", 1)
    assert await adm.tryAcquire("account", "e", 1) is None
    await sleep(0.5)
    alive = await adm.tryAcquire("account", "e", 1)
    assert alive is not None
    assert await crashed.renew() is False
    alive.startRenewing(0.1)
    await sleep(0.6)
    assert await adm.tryAcquire("account", "e", 1) is None
    assert await alive.renew() is True
    alive.release()
    await waitFor(lambda: _loadIs(adm, "e", (0, 0)))


@pytest_twisted.ensureDeferred
async def test_crashedWaiterDropped(redisService):
    """
    R-B2: a ticket whose waiter stopped polling (a crash) is dropped after
    the ticket TTL, and the next waiter is served.
    """
    adm = admission(redisService, ticketTtl=0.4)
    holder = await adm.tryAcquire("account", "w", 1)
    await redisService.execute(2, "eval", ACQUIRE_LUA, keysFor("account", "w"),
                               [1, "60", "dead-1", "enqueue", 10, "0.4"])
    d = adm.acquire(plan("w", timeout=3), CancelSignal())
    await waitFor(lambda: _loadIs(adm, "w", (1, 2)))
    holder.release()
    lease = await d
    assert lease.queuePosition == 2
    lease.release()
    await waitFor(lambda: _loadIs(adm, "w", (0, 0)))


@pytest_twisted.ensureDeferred
async def test_redisDownAndBack(redisService, redisServer):  # noqa: F811
    """
    R35: with Redis killed, each call ends within its own timeout; a slot
    acquire error is C{error} (both modes); fail-open C{load} reports
    (0, 0) while fail-closed fails; release never raises. After a restart
    on the same port admission works again.
    """
    adm = admission(redisService, timeout=0.3)
    closed = admission(redisService, timeout=0.3, onRedisError="fail_closed")
    lease = await adm.tryAcquire("account", "k", 1)
    redisServer.stop()
    started = reactor.seconds()
    lease.release()
    with pytest.raises(AdmissionError) as e:
        await adm.tryAcquire("account", "k", 1)
    assert e.value.reason == "error"
    with pytest.raises(AdmissionError) as e:
        await adm.acquire(plan("k"), CancelSignal())
    assert e.value.reason == "error"
    assert await adm.load("account", ["k"]) == {"k": (0, 0)}
    with pytest.raises(RedisUnavailable):
        await closed.load("account", ["k"])
    assert reactor.seconds() - started < 2.5
    redisServer.start()
    end = reactor.seconds() + 5
    ok = 0
    while ok < 10:
        assert reactor.seconds() < end, "redis did not come back"
        try:
            await closed.load("account", ["k"])
            ok += 1
        except RedisUnavailable:
            ok = 0
            await sleep(0.1)
    lease = await closed.acquire(plan("k"), CancelSignal())
    assert await closed.load("account", ["k"]) == {"k": (1, 0)}
    lease.release()


def test_backoff():
    """
    R30: the poll delay grows x1.5 from 100 ms with 0.8-1.2 jitter,
    clamped to 0.1-2 s.
    """
    rng = random.Random(3)
    delay, seen = 0.1, []
    for _ in range(20):
        delay = nextBackoff(delay, rng)
        seen.append(delay)
    assert all(0.1 <= d <= 2.0 for d in seen)
    assert seen[-1] >= 1.6
    assert 0.12 <= nextBackoff(0.1, random.Random(1)) <= 0.18


@pytest_twisted.ensureDeferred
async def test_soak(redisService, redisServer):  # noqa: F811
    """
    A seeded random mix of acquires, releases, cancellations and timeouts
    from two "processes" never exceeds the limits and leaves no slot or
    queue entry behind.
    """
    rng = random.Random(99)
    adms = [admission(redisService, prefix=f"s{i}", random=random.Random(i)) for i in range(2)]
    limits = {"x": 1, "y": 2}
    held, cancels, pending = [], [], []
    for _ in range(80):
        op = rng.random()
        aid = rng.choice(list(limits))
        if op < 0.5:
            cancel = CancelSignal()
            d = rng.choice(adms).acquire(
                plan(aid, limit=limits[aid], timeout=rng.uniform(0, 0.5),
                     maxWaiting=rng.randint(0, 3)), cancel)
            d.addCallbacks(held.append, lambda f: f.trap(AdmissionError))
            pending.append(d)
            cancels.append(cancel)
        elif op < 0.75 and held:
            held.pop(rng.randrange(len(held))).release()
        elif op < 0.85 and cancels:
            cancels.pop(rng.randrange(len(cancels))).cancel()
        else:
            await sleep(rng.uniform(0, 0.05))
        for i in limits:
            assert (await adms[0].load("account", [i]))[i][0] <= limits[i]
    await gatherResults(pending)
    for lease in held:
        lease.release()
    for i in limits:
        await waitFor(lambda i=i: _loadIs(adms[0], i, (0, 0)))
    assert redisServer.command("KEYS", "*") == b"*0\r\n"
