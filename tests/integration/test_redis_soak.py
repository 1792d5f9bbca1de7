"""
A seeded random no-leak soak of L{RedisSlotAdmission} against a real
C{redis-server} (issue 4, behaviour.md R27-R35, R-B2), with process
crashes.

Three "processes" (each its own L{RedisService} and admission, as in
separate relay processes) run a few hundred random steps on shared slots:
waiting acquires with short timeouts, queue bounds and deadlines,
C{tryAcquire}s, releases, turn cancellations, abandoned waits (the
L{Deferred} cancelled), short sleeps, and crashes. A crash stops a
process's Redis client without releasing anything: its held leases stay in
Redis unreleased and unrenewed, and its queued tickets stop polling; a new
process takes its place. The slot TTL and ticket TTL are short, so what a
crash left behind expires.

At every step no slot holds more than its limit; at the end, after every
live lease was released and the TTLs passed, every slot set and wait queue
is empty and Redis holds no key at all.
"""

from __future__ import annotations

import random

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.task import deferLater

from relay.admission.redis import RedisSlotAdmission
from relay.base.records import AdmissionError, CancelSignal, WaitPlan
from relay.wire.redisclient import RedisService
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)

SLOT_TTL = 1.0
TICKET_TTL = 0.5
STEPS = 300
#: slot key -> limit
LIMITS = {("account", "x"): 1, ("account", "y"): 2, ("user", "u"): 1}
KEYS = sorted(LIMITS)


async def sleep(seconds: float) -> None:
    """
    Wait on the real reactor.
    """
    await deferLater(reactor, seconds, lambda: None)


async def waitFor(predicate, timeout: float) -> None:
    """
    Poll an async predicate until it is true.
    """
    end = reactor.seconds() + timeout
    while not await predicate():
        assert reactor.seconds() < end, "condition not reached"
        await sleep(0.05)


class Process:
    """
    One simulated relay process: a Redis client, an admission on it, and
    the leases it holds.
    """

    def __init__(self, url: str, n: int, rng: random.Random):
        self.service = RedisService(url=url, clock=reactor)
        self.service.startService()
        self.admission = RedisSlotAdmission(
            redis=self.service, clock=reactor, random=random.Random(rng.random()),
            slotTtl=SLOT_TTL, ticketTtl=TICKET_TTL, timeout=0.5, prefix=f"p{n}",
        )
        self.held = []
        self.waits = []
        self.crashed = False

    def crash(self) -> None:
        """
        Die without releasing: stop renewals (a dead process renews
        nothing) and drop the Redis client; leases and tickets stay in Redis.
        """
        self.crashed = True
        for lease in self.held:
            lease.stopRenewing()
        self.held = []
        return self.service.stopService()


@pytest_twisted.ensureDeferred
async def test_random_acquire_cancel_timeout_crash_leaves_nothing(redisServer):  # noqa: F811
    """
    A seeded mix of acquire / try / release / cancel / abandon / timeout /
    crash steps from three processes on one Redis respects every limit and,
    once live leases are released and the TTLs pass, leaves every slot set
    and wait queue empty (R33, R34: a crashed process leaks nothing).
    """
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    rng = random.Random(4242)
    serial = iter(range(1000))
    procs = [Process(redisServer.url, next(serial), rng) for _ in range(3)]
    everyone = list(procs)
    pending = []
    crashes = 0

    def track(proc, d):
        def _ok(lease):
            if lease is None:  # a tryAcquire that found the slot full
                return
            if proc.crashed:
                # Granted after the crash (a reply in flight): the dead
                # process never uses or releases it; the TTL reclaims it.
                lease.stopRenewing()
                return
            lease.startRenewing(SLOT_TTL / 3)
            proc.held.append(lease)

        def _err(f):
            f.trap(AdmissionError)
            assert f.value.reason in {"timeout", "queue_full", "client_gone", "error"}

        d.addCallbacks(_ok, _err)
        pending.append(d)

    try:
        for _ in range(STEPS):
            proc = rng.choice(procs)
            kind, id = rng.choice(KEYS)
            op = rng.random()
            if op < 0.40:
                cancel = CancelSignal()
                plan = WaitPlan(kind=kind, id=id, max_concurrency=LIMITS[(kind, id)],
                                timeout=rng.uniform(0, 0.6), max_waiting=rng.randint(0, 3))
                deadline = reactor.seconds() + rng.uniform(0, 0.6) if rng.random() < 0.2 else None
                d = proc.admission.acquire(plan, cancel, deadline=deadline)
                proc.waits.append((d, cancel))
                track(proc, d)
            elif op < 0.50:
                track(proc, proc.admission.tryAcquire(kind, id, LIMITS[(kind, id)]))
            elif op < 0.70 and proc.held:
                proc.held.pop(rng.randrange(len(proc.held))).release()
            elif op < 0.77 and proc.waits:
                proc.waits[rng.randrange(len(proc.waits))][1].cancel()
            elif op < 0.83 and proc.waits:
                proc.waits[rng.randrange(len(proc.waits))][0].cancel()
            elif op < 0.86:
                # Crash (preferably one holding slots): nothing released; a
                # new process replaces it.
                holding = [p for p in procs if p.held]
                proc = rng.choice(holding) if holding else proc
                crashes += 1
                await proc.crash()
                fresh = Process(redisServer.url, next(serial), rng)
                procs[procs.index(proc)] = fresh
                everyone.append(fresh)
            else:
                await sleep(rng.uniform(0, 0.05))
            live = procs[0].admission
            for kind, id in KEYS:
                inUse, _ = (await live.load(kind, [id]))[id]
                assert inUse <= LIMITS[(kind, id)], (kind, id, inUse)
        assert crashes >= 3, crashes

        await gatherResults(pending)
        for proc in procs:
            for lease in proc.held:
                lease.release()
            proc.held = []
        live = procs[0].admission

        async def drained():
            for kind, id in KEYS:
                if (await live.load(kind, [id]))[id] != (0, 0):
                    return False
            return True

        await waitFor(drained, SLOT_TTL + 1.0)
        # A last, deterministic crash holding every slot: only the TTL can
        # give them back.
        victim = procs[-1]
        for kind, id in KEYS:
            lease = await victim.admission.tryAcquire(kind, id, LIMITS[(kind, id)])
            assert lease is not None, (kind, id)
            victim.held.append(lease)
        await victim.crash()
        left = sum(int(redisServer.command("ZCARD", f"concurrency:{kind}:{id}")[1:].split()[0])
                   for kind, id in KEYS)
        assert left == len(KEYS)
        # Crashed leases and tickets expire after their TTLs.
        await sleep(SLOT_TTL + 0.3)
        for kind, id in KEYS:
            assert (await live.load(kind, [id]))[id] == (0, 0), (kind, id)
        assert redisServer.command("KEYS", "*") == b"*0\r\n"
        for proc in procs[:-1]:
            assert proc.admission.held == set()
            assert proc.admission._sleepers == {}
    finally:
        for proc in everyone:
            for lease in proc.held:
                lease.stopRenewing()
            if proc.service.running:
                await proc.service.stopService()
