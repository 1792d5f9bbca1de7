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

from relay.admission.redis import (
    ACQUIRE_LUA,
    PROCESSES_KEY,
    RedisSlotAdmission,
    keysFor,
    nextBackoff,
)
from relay.interfaces import ISlotAdmission, ISlotLease
from relay.base.records import AdmissionError, CancelSignal, WaitPlan
from relay.wire.redisclient import RedisUnavailable
from tests.integration.redis_server import redisServer, redisService  # noqa: F401 (fixtures)


def plan(id="a", limit=1, timeout=3.0, maxWaiting=10, kind="account"):
    """
    @return: a L{WaitPlan}.
    """
    return WaitPlan(kind=kind, id=id, max_concurrency=limit, timeout=timeout, max_waiting=maxWaiting)


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


# -- crash recovery: process liveness (R34) -----------------------------------

#: short liveness figures so the crash tests take seconds, not a minute;
#: margins of a second or more so a loaded CI box cannot turn them over
LIVE_TTL = 2.0
BEAT = 0.5


def process(service, prefix, **kw):
    """
    @return: a L{RedisSlotAdmission} standing for one relay process, its
        heartbeat running with the short test figures.
    """
    kw.setdefault("liveTtl", LIVE_TTL)
    kw.setdefault("heartbeatInterval", BEAT)
    adm = admission(service, prefix=prefix, **kw)
    adm.startHeartbeat()
    return adm


def kill(adm):
    """
    Simulate a SIGKILL of the process behind C{adm}: its heartbeat stops;
    nothing is released, no shutdown runs.
    """
    adm._heartbeat.stop()
    adm._heartbeat = None


async def registry(service):
    """
    @return: C{{prefix: expiry}} of the process registry.
    """
    flat = await service.execute(2, "execute_command", "ZRANGE", PROCESSES_KEY, 0, -1,
                                 "WITHSCORES")
    return {flat[i]: float(flat[i + 1]) for i in range(0, len(flat), 2)}


@pytest_twisted.ensureDeferred
async def test_killedProcessSlotFreedOnceLivenessLapses(redisService):
    """
    R34 crash recovery: process A holds the only slot of an account and is
    killed (heartbeat stopped, nothing released). Process B is refused
    while A's liveness entry is still valid, and acquires the slot once it
    has lapsed, long before the 30-minute slot TTL; A's lease is gone.
    """
    a = process(redisService, "procA")
    b = process(redisService, "procB")
    held = await a.tryAcquire("account", "k", 1)
    assert held is not None
    await sleep(BEAT * 2)
    assert await b.tryAcquire("account", "k", 1) is None
    kill(a)
    killed = reactor.seconds()
    await sleep(0.4)
    # The last beat was at most BEAT ago at the kill: valid until >= kill + 1.5 s.
    assert await b.tryAcquire("account", "k", 1) is None
    assert await b.load("account", ["k"]) == {"k": (1, 0)}
    lease = None
    while lease is None:
        assert reactor.seconds() - killed < LIVE_TTL + 1.0, "the slot was never freed"
        await sleep(0.05)
        lease = await b.tryAcquire("account", "k", 1)
    assert reactor.seconds() - killed >= LIVE_TTL - BEAT
    assert lease.requestId.startswith("procB-")
    assert await held.renew() is False
    lease.release()
    await b.stopHeartbeat()


@pytest_twisted.ensureDeferred
async def test_killedProcessWaiterServed(redisService):
    """
    R34 crash recovery on the wait path: B waits in the queue for the slot
    a killed A holds and is served once A's liveness lapses; C{load()}
    reports the freed slot too.
    """
    a = process(redisService, "procA")
    b = process(redisService, "procB")
    assert await a.tryAcquire("account", "w", 1) is not None
    kill(a)
    killed = reactor.seconds()
    lease = await b.acquire(plan("w", timeout=5), CancelSignal())
    assert LIVE_TTL - BEAT <= reactor.seconds() - killed < LIVE_TTL + 2.5
    assert lease.queuePosition == 1
    lease.release()
    await waitFor(lambda: _loadIs(b, "w", (0, 0)))
    await b.stopHeartbeat()


@pytest_twisted.ensureDeferred
async def test_loadPrunesKilledProcess(redisService):
    """
    R34: C{load()} stops counting a killed process's slots once its
    liveness lapses, so the scheduler and the metrics see the capacity.
    """
    a = process(redisService, "procA")
    b = admission(redisService, prefix="procB")
    assert await a.tryAcquire("user", "u", 2) is not None
    assert await a.tryAcquire("user", "u", 2) is not None
    assert await b.load("user", ["u"]) == {"u": (2, 0)}
    kill(a)
    await waitFor(lambda: _loadIs(b, "u", (0, 0), kind="user"), timeout=LIVE_TTL + 1.0)


@pytest_twisted.ensureDeferred
async def test_liveProcessKeepsSlot(redisService):
    """
    R34: a process whose heartbeat runs keeps its slot well past the
    liveness TTL; other processes are refused until it releases.
    """
    a = process(redisService, "procA")
    b = process(redisService, "procB")
    held = await a.tryAcquire("account", "l", 1)
    end = reactor.seconds() + 2 * LIVE_TTL
    while reactor.seconds() < end:
        assert await b.tryAcquire("account", "l", 1) is None
        assert await b.load("account", ["l"]) == {"l": (1, 0)}
        await sleep(0.2)
    assert await held.renew() is True
    held.release()
    await waitFor(lambda: _loadIs(b, "l", (0, 0)))
    lease = await b.tryAcquire("account", "l", 1)
    assert lease is not None
    lease.release()
    await a.stopHeartbeat()
    await b.stopHeartbeat()


class _Blip:
    """
    A L{RedisService} wrapper whose commands fail while C{down} is set: one
    process's Redis connection blipping while other processes still reach
    Redis.
    """

    def __init__(self, service):
        self.service = service
        self.down = False

    def execute(self, timeout, method, *args, **kwargs):
        if self.down:
            from twisted.internet.defer import fail

            return fail(RedisUnavailable(method, "connection lost (test)"))
        return self.service.execute(timeout, method, *args, **kwargs)


@pytest_twisted.ensureDeferred
async def test_connectionBlipKeepsSlots(redisService):
    """
    R34: a process whose Redis connection is down for less than the margin
    (C{liveTtl} - C{heartbeatInterval}) keeps its slots; its failed
    heartbeats are logged and the heartbeat resumes afterwards.
    """
    blip = _Blip(redisService)
    a = process(blip, "procA", liveTtl=3.0)
    b = process(redisService, "procB")
    held = await a.tryAcquire("account", "b", 1)
    await sleep(BEAT)
    blip.down = True
    # Down for 1.6 s, less than the margin (3.0 - 0.5 s): valid until >= 2.5 s.
    await sleep(1.6)
    assert await b.tryAcquire("account", "b", 1) is None
    blip.down = False
    await sleep(2 * BEAT)
    assert (await registry(redisService))["procA"] > reactor.seconds() + 1.5
    await sleep(1.0)
    assert await b.tryAcquire("account", "b", 1) is None
    assert await held.renew() is True
    held.release()
    await a.stopHeartbeat()
    await b.stopHeartbeat()


@pytest_twisted.ensureDeferred
async def test_cleanStopExpiresLivenessAtOnce(redisService):
    """
    R34: a clean stop (C{releaseAll}, then C{stopHeartbeat}) leaves no slot
    and expires the process's liveness entry at once, so even a member
    whose release was lost is free to others immediately.
    """
    a = process(redisService, "procA")
    b = process(redisService, "procB")
    lost = await a.tryAcquire("account", "c", 1)
    a.held.discard(lost)  # as if its ZREM had been lost: releaseAll skips it
    assert await a.releaseAll(2) == 0
    assert await b.tryAcquire("account", "c", 1) is None
    assert await a.stopHeartbeat() is True
    assert (await registry(redisService))["procA"] <= reactor.seconds()
    lease = await b.tryAcquire("account", "c", 1)
    assert lease is not None
    lease.release()
    assert await a.stopHeartbeat() is False
    await b.stopHeartbeat()


@pytest_twisted.ensureDeferred
async def test_unknownProcessKeepsSlotTtlOnly(redisService):
    """
    R34: only an expired liveness entry frees slots. A member whose process
    has no entry (a relay without heartbeats, or a registry lost with a
    Redis restart) keeps its slot until the slot TTL; deleting the
    registry does not free a live process's slots.
    """
    legacy = admission(redisService, prefix="legacy", slotTtl=LIVE_TTL + 1.5)
    b = process(redisService, "procB", slotTtl=LIVE_TTL + 1.5)
    assert await legacy.tryAcquire("account", "x", 1) is not None
    await sleep(LIVE_TTL + 0.1)
    assert await b.tryAcquire("account", "x", 1) is None
    await waitFor(lambda: _notNone(b.tryAcquire("account", "x", 1)), timeout=3.0)

    a = process(redisService, "procA")
    assert await a.tryAcquire("account", "y", 1) is not None
    await redisService.execute(2, "execute_command", "DEL", PROCESSES_KEY)
    assert await b.tryAcquire("account", "y", 1) is None
    await a.stopHeartbeat()
    await b.stopHeartbeat()


async def _notNone(d):
    return (await d) is not None


@pytest_twisted.ensureDeferred
async def test_registryEntriesDroppedAfterSlotTtl(redisService):
    """
    R34: the registry does not grow: an entry expired for longer than the
    slot TTL (no member of its process can remain) is dropped by the next
    heartbeat of any process, and the key carries an expiry.
    """
    old = process(redisService, "old", slotTtl=0.3)
    await old.stopHeartbeat()
    live = process(redisService, "live", slotTtl=0.3)
    await sleep(0.5)
    await live.beat()
    assert set(await registry(redisService)) == {"live"}
    pttl = await redisService.execute(2, "execute_command", "PTTL", PROCESSES_KEY)
    assert 0 < pttl <= (LIVE_TTL + 0.3) * 1000
    await live.stopHeartbeat()


@pytest_twisted.ensureDeferred
async def test_concurrentReleasesShareARoundTrip(redisService):
    """
    Issue 24: releases made while another slot command is in flight leave
    together at the end of the reactor turn: three releases in a row are
    two round trips (the first alone, at once; the other two batched), and
    every slot is free afterwards.
    """
    adm = admission(redisService, prefix="p9")
    leases = [await adm.acquire(plan(limit=5), CancelSignal()) for _ in range(3)]
    assert await adm.load("account", ["a"]) == {"a": (3, 0)}
    before = redisService.commandCount
    for lease in leases:
        lease.release()
    assert redisService.commandCount - before == 1
    await sleep(0.2)
    assert redisService.commandCount - before == 2
    assert await adm.load("account", ["a"]) == {"a": (0, 0)}


@pytest_twisted.ensureDeferred
async def test_busyReadNamesTheBusyOnly(redisService):
    """
    Issue 24: C{busy()} (the load-balance layer's load read, C{busy.lua})
    answers the loads of the ids that hold a slot or have a waiter, as
    C{load()} counts them -- slots of another process included -- and
    nothing for the idle ones; a fresh read sees a release of another
    process at once.
    """
    other, mine = admission(redisService), admission(redisService)
    ids = frozenset(f"a{i}" for i in range(1, 201))
    held = [await other.tryAcquire("account", "a7", 5), await other.tryAcquire("account", "a7", 5),
            await other.tryAcquire("account", "a150", 5)]
    waiting = other.acquire(plan("a150", limit=1, timeout=2.0), CancelSignal())
    await sleep(0.2)
    busy = await mine.busy("account", ids, fresh=True)
    loads = await mine.load("account", ["a7", "a150", "a3"])
    assert busy == {"a7": (2, 0), "a150": (1, 1)}
    assert loads == {"a7": (2, 0), "a150": (1, 1), "a3": (0, 0)}
    for lease in held:
        lease.release()
    (await waiting).release()
    await sleep(0.2)
    assert await mine.busy("account", ids, fresh=True) == {}
