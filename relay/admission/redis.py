# -*- test-case-name: tests.integration.test_redis_admission,tests.test_redis_liveness -*-
"""
The Redis L{ISlotAdmission} provider: slots shared by several relay
processes, with a FIFO ticket queue per slot key (behaviour.md R27-R35,
R-B2).

Keys (R34 names; C{kind} is C{account} or C{user}):

  - C{concurrency:{kind}:{id}}: ZSET of held slots; member = request id
    (C{<process prefix>-<seq base36>}), score = Redis C{TIME} seconds.
    Released with C{ZREM}. Two ways a member that no one will release
    (its process was killed: SIGKILL, OOM) is removed:
      - crash recovery (R34 "purge slots that belong to dead process
        prefixes"): once its process's liveness entry in
        C{relay:processes} has expired (60 s after the last
        heartbeat), by the next C{acquire.lua} call that finds the key full
        for its caller, and by every C{load.lua} call;
      - the slot TTL, C{concurrency_slot_ttl_minutes} (30): members older
        than it are pruned by every script. This remains the fallback for a
        prefix with no liveness entry (a relay without heartbeats, or a
        registry lost with a Redis restart); a long turn renews its lease
        (L{RedisSlotLease.renew} or L{RedisSlotLease.startRenewing}).
  - C{relay:processes} (relay's own key, outside R34's C{concurrency:*}
    slot names): ZSET process registry; member = process prefix, score =
    liveness expiry in Redis C{TIME} seconds (no clock skew between
    hosts). Each process refreshes its entry every C{heartbeatInterval}
    (20 s) to now + C{liveTtl} (60 s), the figures of R34's live leases,
    with C{heartbeat.lua} (L{RedisSlotAdmission.startHeartbeat}, run by
    L{ProcessLivenessService}), so a process whose Redis connection blips
    keeps its slots through up to 40 s without a heartbeat. A clean stop
    expires its entry at once (L{RedisSlotAdmission.stopHeartbeat}). An
    entry is dropped (by any heartbeat) once it has been expired for a
    slot TTL, when no member of its process can be left; the key expires
    after C{liveTtl} + the slot TTL without any heartbeat. Only an
    I{expired} entry marks a process dead: a missing one is unknown, so a
    lost or flushed registry, or a relay that predates heartbeats, never
    frees a live process's slots early.
  - C{wait:account:{id}} (accounts) and C{concurrency:wait:{id}} (users):
    the FIFO ticket queue, a ZSET (member = request id, score = arrival
    order). Its size is the one wait counter per account of R29 that
    C{load()} reports and C{max_waiting} bounds. (R34 keeps these as string
    counters; here the queue is the counter, R-B2.)
  - C{<queue key>:alive}: ZSET ticket -> heartbeat expiry. Each poll
    refreshes its ticket; a ticket not refreshed for C{ticketTtl} seconds
    (a crashed waiter) is dropped by the next script run.

Scripts (C{relay/admission/*.lua}, one round trip each, sent with
C{eval}, which falls back from C{EVALSHA} on C{NOSCRIPT} by itself, T17):
C{acquire.lua} (modes C{try}, C{enqueue}, C{poll}), C{leave.lua},
C{renew.lua}, C{load.lua}, C{heartbeat.lua}. Release is a plain C{ZREM}.
Every key a script touches is one of its C{KEYS}.

Fast path: one C{acquire.lua} call and one C{ZREM}.

Acquire, leave and release calls go through a
L{relay.state.redisbatch.RedisBatch} in leading mode: a call made while
none of them is queued or in flight leaves at once as the plain script or
command above; calls made while one is in flight (concurrent turns) wait for
the end of the reactor turn and leave together as one script call, in issue
order, each with its own reply.

Waiting polls with R30's backoff (100 ms x1.5 up to 2 s, jitter 0.8-1.2
from the injected random); only the queue's head may take a slot.

C{on_redis_error} (R35), as implemented:

  - a slot acquire error (C{tryAcquire}, the fast try of C{acquire}) fails
    with C{AdmissionError("error")} in both modes (R35: 503 / 1011);
  - a queue join error (the wait-count increment): C{fail_open} waits
    without a ticket (uncounted; it still never jumps a live queue),
    logging C{relay.redis_admission_error}; C{fail_closed} fails with
    C{AdmissionError("error")};
  - a poll error while waiting: C{fail_open} keeps polling until the wait
    ends, then fails with C{error} when the last poll failed, else
    C{timeout}; C{fail_closed} fails with C{error} at once;
  - release and leave errors are logged, and the member is released again
    (C{leave.lua}) once Redis answers (L{RedisSlotAdmission.unreleased}):
    a command that timed out may still run later (a Redis that
    was paused, or a reply lost in a failover), so every slot member an
    error left in doubt is removed twice, L{RELEASE_RETRY_SECONDS} apart,
    and the slot TTL is only the last resort. With Sentinel, the members
    released in the last L{RECENT_RELEASE_SECONDS} are released again on
    the new master when the Sentinels switch (a release the old master
    acknowledged may never have reached the replica that took over);
  - heartbeat errors are logged and the heartbeat goes on;
  - C{load()} errors: C{fail_open} reports C{(0, 0)} for every id,
    C{fail_closed} fails with L{relay.wire.redisclient.RedisUnavailable}.

After Redis comes back, the pool reconnects by itself and the next call
works; tickets lost in a restart are re-added at the tail by the next
poll.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from typing import Optional

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relay.admission import admissionError
from relay.admission.rediskeys import (
    ACQUIRE_LUA,
    ADMISSION_BATCH_LUA,
    ADMISSION_SOLO,
    BUSY_LUA,
    HEARTBEAT_LUA,
    LEAVE_LUA,
    LOAD_CACHE_SECONDS,
    LOAD_LUA,
    PROCESSES_KEY,
    RECENT_RELEASE_SECONDS,
    RELEASE_RETRY_SECONDS,
    RENEW_LUA,
    _base36,
    _keys,
    keysFor,
    nextBackoff,
    sharedBatch,
)
from relay.admission.redisload import RedisLoads
from relay.admission.redisqueue import RedisWait
from relay.admission.redisrenew import LeaseRenewals
from relay.base.records import AdmissionError, WaitPlan
from relay.base.requestid import currentRequestId
from relay.interfaces import ISlotAdmission, ISlotDrain, ISlotLease
from relay.state.redisbatch import RedisBatch
from relay.wire.redisclient import RedisService, RedisUnavailable, describe


@implementer(ISlotLease)
@define(eq=False)
class RedisSlotLease:
    """
    A slot held in Redis.

    @ivar kind: C{account} or C{user}.
    @ivar id: the account id or client key name.
    @ivar requestId: the ZSET member, C{<prefix>-<seq base36>}.
    @ivar waitedSeconds: seconds waited before acquisition.
    @ivar queuePosition: 1-based queue position when the wait began, or 0.
    @ivar counted: L{False} for an unlimited slot, which holds nothing in
        Redis.
    @ivar released: whether L{release} was called.
    @ivar turnRequestId: the id of the turn that acquired it
        (L{relay.base.requestid.currentRequestId} when it was made), for the
        log lines its renewals write outside the turn.
    """

    _admission: "RedisSlotAdmission"
    kind: str
    id: str
    requestId: str
    waitedSeconds: float = 0.0
    queuePosition: int = 0
    counted: bool = True
    released: bool = False
    _renewEvery: Optional[float] = None
    turnRequestId: Optional[str] = field(factory=currentRequestId.get)

    def release(self) -> None:
        """
        See L{ISlotLease.release}. Local accounting first, then a
        fire-and-forget C{ZREM} with a timeout; an error is logged.
        """
        if self.released:
            return
        self.released = True
        self.stopRenewing()
        self._admission._release(self)

    def renew(self) -> Deferred:
        """
        See L{ISlotLease.renew}.

        @return: a Deferred firing with L{True} when renewed, L{False} when
            the lease is gone (released, or pruned after its TTL); Redis
            errors are logged and give L{False}.
        """
        if self.released or not self.counted:
            return succeed(not self.released)
        return self._admission._renewer.renew(self)

    def startRenewing(self, interval: Optional[float] = None) -> None:
        """
        Renew the lease every C{interval} seconds until L{release} (a helper
        for long turns). Errors are caught and logged (trap T26).

        @param interval: seconds; default a third of the slot TTL.
        """
        if self._renewEvery is not None or self.released or not self.counted:
            return
        self._renewEvery = interval or self._admission.slotTtl / 3
        self._admission._renewer.start(self)

    def stopRenewing(self) -> None:
        """
        Stop L{startRenewing}'s loop, if running.
        """
        if self._renewEvery is not None:
            self._admission._renewer.stop(self)
        self._renewEvery = None

    def _renewOnce(self) -> Deferred:
        """
        One periodic renewal that never fails.
        """

        def _eb(f: Failure) -> None:
            self._admission._log.failure("while renewing a slot lease", f)

        return self.renew().addErrback(_eb)


@implementer(ISlotAdmission, ISlotDrain)
@define(eq=False)
class RedisSlotAdmission:
    """
    L{ISlotAdmission} on Redis.

    @ivar _redis: the running L{RedisService}.
    @ivar _clock: the clock for timeouts, waits and renewals.
    @ivar _random: the jitter source for the poll backoff (R30).
    @ivar slotTtl: slot lease TTL, seconds (C{concurrency_slot_ttl_minutes}
        x 60; R34: 30 min).
    @ivar timeout: per-command timeout, seconds.
    @ivar onRedisError: C{fail_open} or C{fail_closed} (R35).
    @ivar ticketTtl: seconds a waiter's ticket lives without a poll.
    @ivar prefix: this process's request id prefix, also its member of the
        process registry C{relay:processes}.
    @ivar liveTtl: seconds this process's liveness entry lives after a
        heartbeat (R34 live leases: 60 s). Once it has lapsed, other
        processes free this process's slots.
    @ivar heartbeatInterval: seconds between heartbeats (R34: 20 s); less
        than C{liveTtl}, whose excess over it is the Redis outage a live
        process survives without losing its slots (40 s by default).
    @ivar held: leases held by this process (local accounting).
    @ivar _sleepers: C{(kind, id)} -> this process's waiters between polls;
        a local release wakes them at once (after its C{ZREM} lands), so
        in-process hand-over does not wait for the backoff.
    @ivar _writes: the slot and queue commands in flight (acquire, leave,
        release), so L{releaseAll} can wait until they have landed.
    """

    _redis: RedisService
    _clock: IReactorTime
    _random: random.Random = field(factory=random.Random)
    slotTtl: float = 30 * 60.0
    timeout: float = 2.0
    onRedisError: str = "fail_open"
    ticketTtl: float = 6.0
    prefix: str = ""
    liveTtl: float = 60.0
    heartbeatInterval: float = 20.0
    held: set = field(factory=set, init=False)
    _seq: object = field(factory=lambda: itertools.count(1), init=False)
    _sleepers: dict = field(factory=dict, init=False)
    _writes: set = field(factory=set, init=False)
    _heartbeat: Optional[LoopingCall] = field(default=None, init=False)
    unreleased: dict = field(factory=dict, init=False)
    """Request id -> C{[kind, id, passes]}: slot members an error left in
    doubt, released again once Redis answers."""
    _releaser: Optional[LoopingCall] = field(default=None, init=False)
    _recent: Optional[deque] = field(default=None, init=False)
    """With Sentinel: C{(at, request id, kind, id)} of recent releases."""
    batch: Optional[RedisBatch] = None
    """A batcher shared with the state store (L{sharedBatch}), or L{None}
    for this admission's own (releases then leave at once when alone)."""
    _batch: Optional[RedisBatch] = field(default=None, init=False)
    _releaseLead: Optional[bool] = field(default=None, init=False)
    _loads: RedisLoads = field(default=None, init=False)
    _waits: RedisWait = field(default=None, init=False)
    _renewer: LeaseRenewals = field(default=None, init=False)

    _log = Logger()

    def __attrs_post_init__(self) -> None:
        """
        Pick a process prefix when none was given.

        @raise ValueError: when C{heartbeatInterval} is not below
            C{liveTtl} (the entry would lapse between heartbeats).
        """
        if not self.prefix:
            self.prefix = "%08x" % self._random.getrandbits(32)
        self._loads = RedisLoads(self, self._redis, self._clock)
        self._waits = RedisWait(self, self._clock, self._random, self._sleepers)
        self._renewer = LeaseRenewals(self, self._redis, self._clock)
        listeners = getattr(self._redis, "switchListeners", None)
        if listeners is not None and getattr(self._redis, "sentinels", ()):
            self._recent = deque(maxlen=100_000)
            listeners.append(self.masterSwitched)
        if self.batch is not None:
            # A shared batch: a release waits for the end of the reactor
            # turn, with the turn's other end-of-turn writes.
            self._batch, self._releaseLead = self.batch, False
        else:
            self._batch = RedisBatch(self._redis, self._clock, solo=ADMISSION_SOLO,
                                     script=ADMISSION_BATCH_LUA, leading=True)
        if not 0 < self.heartbeatInterval < self.liveTtl:
            raise ValueError(
                f"heartbeatInterval ({self.heartbeatInterval}s) must be positive and"
                f" below liveTtl ({self.liveTtl}s)"
            )

    # -- process liveness (R34 crash recovery) --------------------------------

    def startHeartbeat(self) -> None:
        """
        Register this process in C{relay:processes} now and refresh
        its entry every C{heartbeatInterval} seconds on the injected clock,
        until L{stopHeartbeat}. Errors are logged and the loop goes on
        (trap T26). Idempotent.
        """
        if self._heartbeat is not None:
            return
        self._heartbeat = LoopingCall(self.beat)
        self._heartbeat.clock = self._clock
        self._heartbeat.start(self.heartbeatInterval, now=True)

    def beat(self) -> Deferred:
        """
        One C{heartbeat.lua} round trip: this process's liveness entry
        expires C{liveTtl} seconds from now (Redis C{TIME}).

        @return: a Deferred firing with L{True} once the entry is refreshed,
            L{False} on a Redis error (logged); it never fails.
        """
        return self._heartbeatCall(self.liveTtl, "heartbeat")

    def stopHeartbeat(self) -> Deferred:
        """
        Stop the heartbeat and expire this process's liveness entry at once
        (a clean stop), so any slot member it left behind is freed by the
        next full acquire instead of after C{liveTtl}. Call it after
        L{releaseAll}.

        @return: a Deferred firing with L{True} once the entry is expired,
            L{False} when the heartbeat was not running or on a Redis error
            (logged; the entry then lapses after C{liveTtl}); it never
            fails.
        """
        releaser, self._releaser = self._releaser, None
        if releaser is not None and releaser.running:
            releaser.stop()
        loop, self._heartbeat = self._heartbeat, None
        if loop is None:
            return succeed(False)
        if loop.running:
            loop.stop()
        return self._heartbeatCall(0, "retire")

    def _heartbeatCall(self, liveTtl: float, operation: str) -> Deferred:
        """
        Set this process's liveness entry to expire C{liveTtl} seconds from
        now.

        @param liveTtl: seconds; 0 expires it at once.
        @param operation: C{heartbeat} or C{retire}, for the error log.
        @return: a Deferred firing with L{True}, or L{False} on a Redis
            error (logged).
        """
        d = self._redis.execute(
            self.timeout, "eval", HEARTBEAT_LUA, [PROCESSES_KEY],
            [self.prefix, repr(float(liveTtl)), repr(self.slotTtl)],
        )

        def _eb(f: Failure) -> bool:
            if f.check(RedisUnavailable):
                self._logError(operation, f)
            else:
                self._log.failure("process {operation} failed", f, operation=operation)
            return False

        return d.addCallbacks(lambda _: True, _eb)

    # -- ISlotAdmission ------------------------------------------------------

    def tryAcquire(self, kind, id, limit) -> Deferred:
        """
        See L{ISlotAdmission.tryAcquire}: one C{acquire.lua} call. Fails with
        C{AdmissionError("error")} on a Redis error (R35).
        """
        rid = self._newRequestId()
        if limit <= 0:
            return succeed(self._lease(kind, id, rid, counted=False))
        d = self._acquireCall(kind, id, limit, rid, "try", 0)

        def _cb(reply):
            if int(reply[0]) == 1:
                return self._lease(kind, id, rid)
            return None

        return d.addCallbacks(_cb, self._tryFailed, errbackArgs=(kind, id, limit, rid))

    def _tryFailed(self, f: Failure, kind, id, limit, rid):
        """
        A try's round trip failed (L{tryAcquire}, L{tryAcquireBinding}):
        logged, and its member dropped, since the try may have landed after
        our timeout.

        @raise AdmissionError: C{error}, naming the Redis failure.
        """
        f.trap(RedisUnavailable)
        self._logError("slot_acquire", f)
        self._leave(WaitPlan(kind, id, limit, 0, 0), rid, True)
        raise admissionError("error", None, detail=describe(f))

    def tryAcquireBinding(self, kind, id, limit, bindingKey: str, ttl: float) -> Deferred:
        """
        L{tryAcquire} with the session binding's refresh in the
        same round trip: when the slot is taken and C{bindingKey} still
        names C{id}, its TTL is set to C{ttl} (R38's hit). With a shared
        batcher the acquire waits for the reactor turn's other commands
        (the scheduler's binding and state reads) and leaves with them.

        @param ttl: seconds.
        @return: a Deferred firing with C{(lease or None, refreshed)}, or
            failing as L{tryAcquire} does.
        """
        rid = self._newRequestId()
        if limit <= 0:
            return succeed((self._lease(kind, id, rid, counted=False), False))
        d = self._track(self._batch.call(
            self.timeout, "ACQUIRE_BIND", keysFor(kind, id) + [PROCESSES_KEY, bindingKey],
            [int(limit), repr(self.slotTtl), rid, "try", 0, repr(self.ticketTtl), id,
             max(1, int(round(ttl * 1000)))], lead=False,
        ))

        def _cb(reply):
            if int(reply[0]) == 1:
                return (self._lease(kind, id, rid), int(reply[4]) == 1)
            return (None, False)

        return d.addCallbacks(_cb, self._tryFailed, errbackArgs=(kind, id, limit, rid))

    def acquire(self, plan, cancel, deadline=None) -> Deferred:
        """
        See L{ISlotAdmission.acquire}.
        """
        return Deferred.fromCoroutine(self._waits.acquire(plan, cancel, deadline))

    # -- ISlotDrain -----------------------------------------------------------

    def releaseAll(self, timeout: float) -> Deferred:
        """
        See L{ISlotDrain.releaseAll}: release every lease still in L{held}
        (a C{ZREM} each), then wait up to C{timeout} seconds for every slot
        and queue command in flight to land.
        """
        return Deferred.fromCoroutine(self._releaseAll(timeout))

    async def _releaseAll(self, timeout: float) -> int:
        leftover = [lease for lease in list(self.held) if not lease.released]
        for lease in leftover:
            lease.release()
        if self.unreleased:
            # Members left in doubt by earlier errors, once more.
            self.retryReleases()
        self._batch.flush()
        if self._writes:
            waits = []
            for d in list(self._writes):
                w = Deferred()
                d.addBoth(_fire, w)
                waits.append(w)
            # A timeout cancels the waits; the list then fires normally.
            await DeferredList(waits, consumeErrors=True).addTimeout(timeout, self._clock)
            if self._writes:
                self._log.warn(
                    "{count} redis slot command(s) still in flight after {timeout}s",
                    event="relay.redis_admission_error",
                    operation="release_all",
                    count=len(self._writes),
                    timeout=timeout,
                )
        return len([lease for lease in leftover if lease.counted])

    def _track(self, d: Deferred) -> Deferred:
        """
        Remember a slot or queue command until it completes (L{releaseAll}).

        @return: C{d}.
        """
        self._writes.add(d)

        def _done(result):
            self._writes.discard(d)
            return result

        return d.addBoth(_done)

    def load(self, kind, ids) -> Deferred:
        """
        See L{ISlotAdmission.load}: one C{load.lua} call for all ids
        (L{RedisLoads.load}).
        """
        return self._loads.load(kind, ids)

    def busy(self, kind, ids=(), fresh=False) -> Deferred:
        """
        The loads of those of C{ids} that hold a slot or have a waiter, read
        through R34's load cache (L{RedisLoads.busy}).
        """
        return self._loads.busy(kind, ids, fresh)

    # -- Redis calls -----------------------------------------------------------

    def _acquireCall(self, kind, id, limit, rid, mode, maxWaiting, lead=None) -> Deferred:
        """
        One C{acquire.lua} round trip.

        @param lead: the batcher's C{lead} for this call (L{False}: wait for
            the end of the reactor turn, with what follows).
        @return: Deferred firing with C{[status, now, position, waiting]}.
        """
        return self._track(self._batch.call(
            self.timeout, "ACQUIRE", keysFor(kind, id) + [PROCESSES_KEY],
            [int(limit), repr(self.slotTtl), rid, mode, int(maxWaiting), repr(self.ticketTtl)],
            lead=lead,
        ))

    def _leave(self, plan: WaitPlan, rid: str, dropSlot: bool) -> None:
        """
        Fire-and-forget C{leave.lua}: drop the ticket (and a slot member an
        abandoned attempt may have added).
        """
        if dropSlot:
            # The abandoned acquire's member may exist on a master relay
            # is about to leave (it ran there after the switch): repeated on
            # the next masters too (L{masterSwitched}).
            self._remember(plan.kind, plan.id, rid)
        d = self._track(self._batch.call(
            self.timeout, "LEAVE", keysFor(plan.kind, plan.id), [rid, "1" if dropSlot else "0"],
        ))

        def _eb(f: Failure) -> None:
            self._logError("slot_leave", f)
            if dropSlot:
                self._releaseLater(plan.kind, plan.id, rid)

        d.addErrback(_eb)

    def _release(self, lease: RedisSlotLease) -> None:
        """
        Forget C{lease} locally, then C{ZREM} it (fire and forget) and wake
        this process's waiters on that slot.
        """
        self.held.discard(lease)
        if not lease.counted:
            return
        self._loads.noteOwn(lease.kind, lease.id, -1)
        self._remember(lease.kind, lease.id, lease.requestId)
        d = self._track(self._batch.call(
            self.timeout, "ZREM", [_keys(lease.kind, lease.id)[0]], [lease.requestId],
            lead=self._releaseLead,
        ))

        def _eb(f: Failure) -> None:
            self._logError("slot_release", f)
            self._releaseLater(lease.kind, lease.id, lease.requestId)

        d.addCallbacks(lambda _: self._waits.wake((lease.kind, lease.id)), _eb)

    def _remember(self, kind: str, id: str, rid: str) -> None:
        """
        With Sentinel: note a slot member relay removed (a release, or the
        leave of an acquire that failed or was abandoned), for
        L{masterSwitched}.
        """
        if self._recent is not None:
            self._recent.append((self._clock.seconds(), rid, kind, id))

    def _releaseLater(self, kind: str, id: str, rid: str, remember: bool = True) -> None:
        """
        Remember a slot member whose release failed or whose acquire may
        have landed after its error, and start the pass loop.

        @param remember: also note it for the next master switches
            (L{_remember}); L{masterSwitched} itself does not note again.
        """
        if remember:
            self._remember(kind, id, rid)
        self.unreleased[rid] = [kind, id, 0]
        if self._releaser is None:
            self._releaser = LoopingCall(self.retryReleases)
            self._releaser.clock = self._clock
            self._releaser.start(RELEASE_RETRY_SECONDS, now=False)

    def masterSwitched(self) -> None:
        """
        The Sentinels promoted a new master (a
        L{relay.wire.redisclient.RedisService.switchListeners} hook): every
        removal of a slot member of the last L{RECENT_RELEASE_SECONDS} -- a
        release, and the leave of an acquire that failed or was abandoned
        -- is repeated there (R34: no slot leaked across a failover). The
        old master may have acknowledged a release without passing it on;
        and an acquire in flight when relay left it may still have run
        there after the replica was promoted, so the member exists only on
        the old master, which a later failover can make master again (it
        came back that way in the Sentinel test: the leave had reached the
        new master only). Every switch within the window repeats them.
        """
        if self._recent is None:
            return
        horizon = self._clock.seconds() - RECENT_RELEASE_SECONDS
        count = 0
        for at, rid, kind, id in list(self._recent):
            if at >= horizon:
                self._releaseLater(kind, id, rid, remember=False)
                count += 1
        self._log.info(
            "new redis master: repeating {count} recent slot release(s)",
            event="relay.redis_admission_rereleased", count=count,
        )

    def retryReleases(self) -> Deferred:
        """
        One pass over L{unreleased}: C{leave.lua} (slot member, ticket and
        its heartbeat) for each; a member is forgotten after its second
        pass that reached Redis. The loop stops when none is left. Never
        fails.

        @return: a Deferred firing when the pass's commands have ended.
        """
        if not self.unreleased:
            if self._releaser is not None and self._releaser.running:
                self._releaser.stop()
            self._releaser = None
            return succeed(None)
        waits = []
        for rid, entry in list(self.unreleased.items()):
            kind, id, passes = entry
            d = self._track(self._redis.execute(
                self.timeout, "eval", LEAVE_LUA, keysFor(kind, id), [rid, "1"],
            ))

            def _cb(_, rid=rid, entry=entry, key=(kind, id)):
                entry[2] += 1
                if entry[2] >= 2 and self.unreleased.get(rid) is entry:
                    del self.unreleased[rid]
                self._waits.wake(key)

            d.addCallbacks(_cb, lambda f: None)
            waits.append(d)
        return DeferredList(waits, consumeErrors=True).addCallback(lambda _: None)

    # -- helpers ---------------------------------------------------------------

    def _newRequestId(self) -> str:
        """
        @return: C{<prefix>-<seq base36>}.
        """
        return f"{self.prefix}-{_base36(next(self._seq))}"

    def _lease(self, kind, id, rid, waited=0.0, position=0, counted=True) -> RedisSlotLease:
        """
        Record and return a lease.
        """
        lease = RedisSlotLease(self, kind, id, rid, waited, position, counted)
        self.held.add(lease)
        if counted:
            self._loads.noteOwn(kind, id, 1)
        return lease

    def _logError(self, operation: str, reason) -> None:
        """
        Log a Redis error under C{relay.redis_admission_error}.
        """
        self._log.warn(
            "redis admission {operation} failed ({error}); {mode}",
            event="relay.redis_admission_error",
            operation=operation,
            error=describe(reason),
            mode=self.onRedisError,
        )


class ProcessLivenessService(Service):
    """
    Runs a L{RedisSlotAdmission}'s liveness heartbeat while the relay runs
    (R34 crash recovery): started after the Redis client, stopped after the
    drain has released this process's slots (L{relay.process.app._Startup} stops
    children in reverse order), which expires its liveness entry.

    @ivar admission: the L{RedisSlotAdmission}.
    """

    def __init__(self, admission: RedisSlotAdmission):
        """
        @param admission: the L{RedisSlotAdmission} whose heartbeat to run.
        """
        self.admission = admission

    def startService(self) -> None:
        """
        Start the heartbeat (first beat now).
        """
        super().startService()
        self.admission.startHeartbeat()

    def stopService(self) -> Deferred:
        """
        Stop the heartbeat and expire this process's liveness entry.

        @return: a Deferred that fires (never fails) once the entry is
            expired or the attempt has failed or timed out.
        """
        super().stopService()
        return self.admission.stopHeartbeat()


def _fire(result, waiter: Deferred):
    """
    Fire C{waiter} (once) when a tracked command completes; pass C{result}
    through unchanged.
    """
    if not waiter.called:
        waiter.callback(None)
    return result


__all__ = [
    "RedisSlotAdmission", "RedisSlotLease", "ProcessLivenessService", "AdmissionError",
    "nextBackoff", "PROCESSES_KEY", "sharedBatch", "ACQUIRE_LUA", "BUSY_LUA", "HEARTBEAT_LUA",
    "LEAVE_LUA", "LOAD_CACHE_SECONDS", "LOAD_LUA", "RELEASE_RETRY_SECONDS", "RENEW_LUA",
]
