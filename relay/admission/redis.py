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

Issue 24: acquire, leave and release calls go through a
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
    (C{leave.lua}) once Redis answers (L{RedisSlotAdmission.unreleased},
    issue 23): a command that timed out may still run later (a Redis that
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
import os
import random
from collections import deque
from typing import Optional

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relay.admission import admissionError
from relay.interfaces import ISlotAdmission, ISlotDrain, ISlotLease
from relay.base.records import AdmissionError, WaitPlan
from relay.wire.redisclient import RedisService, RedisUnavailable, describe
from relay.base.requestid import currentRequestId
from relay.state.redisbatch import SOLO, RedisBatch, batchScript


def _script(name: str) -> str:
    """
    @return: the text of C{relay/admission/<name>.lua}.
    """
    with open(os.path.join(os.path.dirname(__file__), name + ".lua"), encoding="utf-8") as f:
        return f.read()


ACQUIRE_LUA = _script("acquire")
LEAVE_LUA = _script("leave")
RENEW_LUA = _script("renew")
LOAD_LUA = _script("load")
BUSY_LUA = _script("busy")
HEARTBEAT_LUA = _script("heartbeat")

#: Issue 24: a slot try and the binding refresh as one operation: KEYS the
#: four of C{acquire.lua} and the binding key; ARGV those of C{acquire.lua}
#: (mode C{try}), then the account id and the binding's TTL ms. Returns
#: C{acquire.lua}'s reply with a fifth element, 1 when the binding was
#: refreshed.
ACQUIRE_BIND_LUA = (
    "local function acquire(KEYS, ARGV)\n" + ACQUIRE_LUA + "\nend\n" + """
local r = acquire({KEYS[1], KEYS[2], KEYS[3], KEYS[4]},
                  {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]})
local bound = 0
if tonumber(r[1]) == 1 and redis.call('GET', KEYS[5]) == ARGV[7] then
  redis.call('SET', KEYS[5], ARGV[7], 'PX', ARGV[8])
  bound = 1
end
r[5] = bound
return r
""")

#: The slot commands a turn sends (acquire, leave; release is a plain
#: C{ZREM}), as operations of one batch (issue 24): alone, each is the
#: script or command it always was.
ADMISSION_SOLO = {"ACQUIRE": ACQUIRE_LUA, "LEAVE": LEAVE_LUA, "ACQUIRE_BIND": ACQUIRE_BIND_LUA}
ADMISSION_BATCH_LUA = batchScript(ADMISSION_SOLO)

#: Issue 24: one batcher for the state store and the admission of a relay
#: process (L{sharedBatch}): a turn's state reads and its account slot acquire
#: travel in one round trip, and its end (slot releases, owner records, the
#: streak reset) in one more.
SHARED_SOLO = {**SOLO, **ADMISSION_SOLO}
SHARED_BATCH_LUA = batchScript(SHARED_SOLO)


def sharedBatch(redis: RedisService, clock: IReactorTime) -> RedisBatch:
    """
    The batcher a L{relay.state.redis.RedisStateStore} and a
    L{RedisSlotAdmission} share (issue 24): leading (a lone acquire leaves
    at once, as alone), the store's operations and the releases queued to
    the end of the reactor turn.
    """
    return RedisBatch(redis, clock, solo=SHARED_SOLO, script=SHARED_BATCH_LUA, leading=True)

#: The process registry ZSET (see the module docstring; R34 crash recovery).
PROCESSES_KEY = "relay:processes"

#: Seconds between passes over the slot members whose release is in doubt
#: (issue 23); each member is released on two passes that reached Redis.
RELEASE_RETRY_SECONDS = 1.0

#: With Sentinel: how far back releases are repeated on a new master.
RECENT_RELEASE_SECONDS = 60.0

#: R34: how long the load-balance layer's load read is reused in this
#: process (sub2api's C{load_batch_cache_ttl_ms}, 200 ms; issue 24). This
#: process's own slot takes and releases since the read are counted into
#: it at once; a pass whose tries all failed reads again uncached.
LOAD_CACHE_SECONDS = 0.2

#: R30 poll loop figures, seconds
BACKOFF_START = 0.1
BACKOFF_FACTOR = 1.5
BACKOFF_MAX = 2.0


def slotKey(kind: str, id: str) -> str:
    """
    @return: the slot ZSET key, C{concurrency:{kind}:{id}} (R34).
    """
    return f"concurrency:{kind}:{id}"


def queueKey(kind: str, id: str) -> str:
    """
    @return: the FIFO queue key: C{wait:account:{id}} or
        C{concurrency:wait:{id}} (R34 names).
    """
    return f"wait:account:{id}" if kind == "account" else f"concurrency:wait:{id}"


_KEYS: dict = {}
"""Issue 24: C{(kind, id)} -> its C{(slot, queue, alive)} keys, built once."""


def _keys(kind: str, id: str) -> tuple:
    """
    @return: C{(slot, queue, alive)} keys of one slot key (cached).
    """
    keys = _KEYS.get((kind, id))
    if keys is None:
        if len(_KEYS) > 4096:
            _KEYS.clear()
        q = queueKey(kind, id)
        keys = _KEYS[kind, id] = (slotKey(kind, id), q, q + ":alive")
    return keys


def keysFor(kind: str, id: str) -> list:
    """
    @return: C{[slot, queue, alive]} keys of one slot key.
    """
    return list(_keys(kind, id))


def nextBackoff(previous: float, rng: random.Random) -> float:
    """
    R30: the next poll delay.

    @param previous: the previous delay, seconds.
    @param rng: the jitter source.
    @return: C{min(previous * 1.5, 2) * U(0.8, 1.2)}, clamped to 0.1-2 s.
    """
    delay = min(previous * BACKOFF_FACTOR, BACKOFF_MAX) * rng.uniform(0.8, 1.2)
    return min(max(delay, BACKOFF_START), BACKOFF_MAX)


def _base36(n: int) -> str:
    """
    @return: C{n} in base 36, lower case.
    """
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


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
        log lines its renewals write outside the turn (issue 15).
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
        return self._admission._renew(self)

    def startRenewing(self, interval: Optional[float] = None) -> None:
        """
        Renew the lease every C{interval} seconds until L{release} (a helper
        for long turns). Errors are caught and logged (trap T26).

        @param interval: seconds; default a third of the slot TTL.
        """
        if self._renewEvery is not None or self.released or not self.counted:
            return
        self._renewEvery = interval or self._admission.slotTtl / 3
        self._admission._renewLater(self)

    def stopRenewing(self) -> None:
        """
        Stop L{startRenewing}'s loop, if running.
        """
        if self._renewEvery is not None:
            self._admission._renewStop(self)
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
    doubt, released again once Redis answers (issue 23)."""
    _releaser: Optional[LoopingCall] = field(default=None, init=False)
    _recent: Optional[deque] = field(default=None, init=False)
    """With Sentinel: C{(at, request id, kind, id)} of recent releases."""
    batch: Optional[RedisBatch] = None
    """A batcher shared with the state store (L{sharedBatch}), or L{None}
    for this admission's own (releases then leave at once when alone)."""
    _batch: Optional[RedisBatch] = field(default=None, init=False)
    _releaseLead: Optional[bool] = field(default=None, init=False)
    _busyIds: dict = field(factory=dict, init=False)
    """Issue 24: C{(kind, ids)} -> the ids as C{busy.lua}'s one argument."""
    _busyCache: dict = field(factory=dict, init=False)
    """Issue 24 (R34's load cache): C{(kind, ids)} -> C{[read at, loads or
    in-flight Deferred, {id: own slots taken (+) or released (-) since}]}."""
    _renewals: dict = field(factory=dict, init=False)
    """Issue 24: the leases being renewed (L{RedisSlotLease.startRenewing}):
    interval (seconds) -> {lease: when its next renewal is due}, in due
    order; one delayed call (L{_renewDue}) for all of them instead of a
    L{LoopingCall} per lease (one per relayed turn)."""
    _renewCall: Optional[object] = field(default=None, init=False)

    _log = Logger()

    def __attrs_post_init__(self) -> None:
        """
        Pick a process prefix when none was given.

        @raise ValueError: when C{heartbeatInterval} is not below
            C{liveTtl} (the entry would lapse between heartbeats).
        """
        if not self.prefix:
            self.prefix = "%08x" % self._random.getrandbits(32)
        listeners = getattr(self._redis, "switchListeners", None)
        if listeners is not None and getattr(self._redis, "sentinels", ()):
            self._recent = deque(maxlen=100_000)
            listeners.append(self.masterSwitched)
        if self.batch is not None:
            # Shared (issue 24): a release waits for the end of the reactor
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
        Issue 24: L{tryAcquire} with the session binding's refresh in the
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
        return Deferred.fromCoroutine(self._acquire(plan, cancel, deadline))

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
            # Issue 23: members left in doubt by earlier errors, once more.
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
        See L{ISlotAdmission.load}: one C{load.lua} call for all ids.
        """
        ids = list(ids)
        if not ids:
            return succeed({})
        keys = []
        for i in ids:
            keys.extend(keysFor(kind, i))
        keys.append(PROCESSES_KEY)
        d = self._redis.execute(self.timeout, "eval", LOAD_LUA, keys, [repr(self.slotTtl)])

        def _cb(flat):
            return {i: (int(flat[2 * n]), int(flat[2 * n + 1])) for n, i in enumerate(ids)}

        def _eb(f: Failure):
            f.trap(RedisUnavailable)
            self._logError("load", f)
            if self.onRedisError == "fail_closed":
                return f
            return {i: (0, 0) for i in ids}

        return d.addCallbacks(_cb, _eb)

    def busy(self, kind, ids=(), fresh=False) -> Deferred:
        """
        Issue 24: the loads of those of C{ids} that hold a slot or have a
        waiter (the scheduler's load-balance layer ranks only these one by
        one; every other id's load is C{(0, 0)}). One C{busy.lua} call for
        C{ids} (L{_busyRead}), reused for L{LOAD_CACHE_SECONDS} (R34's
        in-process load cache): Redis keeps no index of the busy slot keys,
        so the read's work in Redis grows with the ids, and a large pool
        reads it once per 200 ms, not once per turn. This process's own slot takes and releases since the read are
        counted in at once (its view of its own slots is exact; other
        processes' are at most 200 ms old, and an acquire checks the limit
        itself).

        @param ids: a collection the caller passes again unchanged (the
            scheduler's static candidate set) -- the cache is kept per
            C{(kind, ids)}.
        @param fresh: read uncached (R34: after a pass whose tries all
            failed).
        @return: a Deferred firing with id -> C{(inUse, waiting)}; failing
            as L{load} does.
        """
        cacheKey = (kind, ids)
        now = self._clock.seconds()
        entry = self._busyCache.get(cacheKey)
        if not fresh and entry is not None and now - entry[0] < LOAD_CACHE_SECONDS:
            loads = entry[1]
            if isinstance(loads, Deferred):
                waiter = Deferred()
                entry.append(waiter)
                return waiter
            return succeed(self._withOwn(loads, entry[2]))
        if len(self._busyCache) > 16:
            self._busyCache.clear()
        entry = [now, None, {}]
        d = self._busyRead(kind, ids)
        entry[1] = d
        self._busyCache[cacheKey] = entry

        def _read(busy):
            entry[1] = busy
            waiters = entry[3:]
            del entry[3:]
            out = self._withOwn(busy, entry[2])
            for w in waiters:
                w.callback(dict(out))
            return out

        def _failed(f):
            if self._busyCache.get(cacheKey) is entry:
                del self._busyCache[cacheKey]
            waiters = entry[3:]
            del entry[3:]
            for w in waiters:
                w.errback(f)
            return f

        return d.addCallbacks(_read, _failed)

    def _busyRead(self, kind, ids) -> Deferred:
        """
        One C{busy.lua} call: the ids with a load among C{ids}, sent as one
        argument (built once per C{ids}) and answered with the busy ones
        only, so neither side of the round trip grows with the pool (the
        script's work in Redis does: two C{ZCARD}s per idle id).

        @return: a Deferred firing with id -> C{(inUse, waiting)} of the
            busy ids; on a Redis error as L{load} (fail open: every id
            idle, logged).
        """
        blob = self._busyIds.get((kind, ids))
        if blob is None:
            if len(self._busyIds) > 16:
                self._busyIds.clear()
            blob = self._busyIds[(kind, ids)] = "\n".join(sorted(ids)).encode("utf-8")
        prefix = keysFor(kind, "")
        d = self._redis.execute(self.timeout, "eval", BUSY_LUA, [PROCESSES_KEY],
                                [repr(self.slotTtl), prefix[0], prefix[1], blob])

        def _cb(flat):
            out = {}
            for n in range(0, len(flat), 3):
                i = flat[n]
                out[i.decode("utf-8") if isinstance(i, bytes) else i] = (
                    int(flat[n + 1]), int(flat[n + 2]))
            return out

        def _eb(f: Failure):
            f.trap(RedisUnavailable)
            self._logError("load", f)
            if self.onRedisError == "fail_closed":
                return f
            return {}

        return d.addCallbacks(_cb, _eb)

    @staticmethod
    def _withOwn(busy: dict, own: dict) -> dict:
        """
        A cached busy read with this process's own changes since counted
        in (see L{busy}).
        """
        if not own:
            return dict(busy)
        out = dict(busy)
        for i, n in own.items():
            inUse, waiting = out.get(i, (0, 0))
            inUse = max(0, inUse + n)
            if inUse or waiting:
                out[i] = (inUse, waiting)
            else:
                out.pop(i, None)
        return out

    def _noteOwn(self, kind, id, n: int) -> None:
        """
        Count one of this process's slot takes (C{n} 1) or releases (-1)
        into every cached busy read of C{kind} that covers C{id}.
        """
        now = self._clock.seconds()
        stale = []
        for key, entry in self._busyCache.items():
            if now - entry[0] >= LOAD_CACHE_SECONDS and not isinstance(entry[1], Deferred):
                # Never used again (L{busy} reads anew): dropped, so the
                # turns that follow (a sticky session reads no loads) count
                # nothing into it (issue 24).
                stale.append(key)
            elif key[0] == kind and id in key[1]:
                own = entry[2]
                own[id] = own.get(id, 0) + n
        for key in stale:
            del self._busyCache[key]

    # -- the wait ------------------------------------------------------------

    async def _acquire(self, plan: WaitPlan, cancel, deadline):
        """
        Fast try, join the queue, poll until acquired or the wait ends
        (R27, R30, R33, R-B2). Every exit other than success sends
        C{leave.lua}, which drops the ticket and any slot member an
        abandoned (cancelled, timed-out) call may have added.
        """
        started = self._clock.seconds()
        if cancel.cancelled:
            raise admissionError("client_gone", plan)
        if deadline is not None and deadline <= started:
            raise admissionError("timeout", plan)
        rid = self._newRequestId()
        if plan.max_concurrency <= 0:
            return self._lease(plan.kind, plan.id, rid, counted=False)
        end = started + max(plan.timeout, 0)
        if deadline is not None:
            end = min(end, deadline)
        state = {"position": 0, "sent": False, "granted": False}

        def fail(reason: str, detail: str = "") -> AdmissionError:
            return admissionError(
                reason, plan, self._clock.seconds() - started, state["position"], detail
            )

        try:
            return await self._wait(plan, cancel, rid, started, end, state, fail)
        except _Cancelled:
            raise fail("client_gone")
        except CancelledError:
            # The caller cancelled the Deferred acquire() returned.
            raise fail("client_gone")
        finally:
            if state["sent"] and not state["granted"]:
                self._leave(plan, rid, True)

    async def _wait(self, plan, cancel, rid, started, end, state, fail):
        """
        The body of L{_acquire}.
        """
        state["sent"] = True
        try:
            reply = await self._raceCancel(
                self._acquireCall(plan.kind, plan.id, plan.max_concurrency, rid, "try", 0),
                cancel,
            )
        except RedisUnavailable as e:
            # R35: a slot acquire error is an admission error in both modes.
            self._logError("slot_acquire", e)
            raise fail("error", describe(e))
        if int(reply[0]) == 1:
            state["granted"] = True
            return self._lease(plan.kind, plan.id, rid)
        if plan.max_waiting < 1 or int(reply[3]) >= plan.max_waiting:
            raise fail("queue_full")
        mode = "enqueue"
        lastError = None
        delay = BACKOFF_START
        while True:
            if self._clock.seconds() >= end:
                raise fail("error" if lastError is not None else "timeout")
            try:
                reply = await self._raceCancel(
                    self._acquireCall(
                        plan.kind, plan.id, plan.max_concurrency, rid, mode, plan.max_waiting
                    ),
                    cancel,
                )
                lastError = None
            except RedisUnavailable as e:
                lastError = e
                self._logError("slot_enqueue" if mode == "enqueue" else "slot_poll", e)
                if self.onRedisError == "fail_closed":
                    raise fail("error", describe(e))
                reply = None
                if mode == "enqueue":
                    # R35 fail open: wait without counting; never jump a queue.
                    mode = "try"
            now = self._clock.seconds()
            if reply is not None:
                status = int(reply[0])
                if status == 1:
                    state["granted"] = True
                    lease = self._lease(plan.kind, plan.id, rid, now - started, state["position"])
                    if cancel.cancelled or now >= end:
                        # R33: a slot that arrives too late is released.
                        lease.release()
                        raise fail("client_gone" if cancel.cancelled else "timeout")
                    return lease
                if status == -1:
                    raise fail("queue_full")
                if mode == "enqueue":
                    state["position"] = int(reply[2])
                    mode = "poll"
                    self._log.debug(
                        "{kind} {id} queued at position {position}",
                        event="relay.admission_queued",
                        kind=plan.kind, id=plan.id, position=state["position"],
                    )
            if now >= end:
                raise fail("error" if lastError is not None else "timeout")
            await self._raceCancel(self._sleep((plan.kind, plan.id), min(delay, end - now)),
                                   cancel)
            delay = nextBackoff(delay, self._random)

    async def _raceCancel(self, d: Deferred, cancel):
        """
        Wait for C{d} unless the turn is cancelled first. A failure of C{d}
        is raised at once.

        @raise _Cancelled: when C{cancel} fires first (C{d} is cancelled).
        """
        if cancel.cancelled:
            d.cancel()
            d.addErrback(lambda f: None)
            raise _Cancelled()
        watch = cancel.whenCancelled()

        def _cancelBoth(_: Deferred) -> None:
            d.cancel()
            watch.cancel()

        first = Deferred(_cancelBoth)
        d.addBoth(lambda r: first.called or first.callback(("done", r)))
        watch.addBoth(lambda r: first.called or first.callback(("cancelled", r)))
        which, value = await first
        if which == "cancelled":
            d.cancel()
            raise _Cancelled()
        watch.cancel()
        if isinstance(value, Failure):
            value.raiseException()
        return value

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
        if self._busyCache:
            self._noteOwn(lease.kind, lease.id, -1)
        self._remember(lease.kind, lease.id, lease.requestId)
        d = self._track(self._batch.call(
            self.timeout, "ZREM", [_keys(lease.kind, lease.id)[0]], [lease.requestId],
            lead=self._releaseLead,
        ))

        def _eb(f: Failure) -> None:
            self._logError("slot_release", f)
            self._releaseLater(lease.kind, lease.id, lease.requestId)

        d.addCallbacks(lambda _: self._wake((lease.kind, lease.id)), _eb)

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
        have landed after its error (issue 23), and start the pass loop.

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
                self._wake(key)

            d.addCallbacks(_cb, lambda f: None)
            waits.append(d)
        return DeferredList(waits, consumeErrors=True).addCallback(lambda _: None)

    def _sleep(self, key: tuple, seconds: float) -> Deferred:
        """
        Sleep between polls; L{_wake} ends it early.

        @return: a cancellable L{Deferred} firing after C{seconds}.
        """
        sleepers = self._sleepers.setdefault(key, set())

        def _cancel(d: Deferred) -> None:
            if call.active():
                call.cancel()

        d = Deferred(_cancel)

        def _fire() -> None:
            if not d.called:
                d.callback(None)

        def _forget(result):
            sleepers.discard(d)
            if not sleepers and self._sleepers.get(key) is sleepers:
                del self._sleepers[key]
            return result

        call = self._clock.callLater(seconds, _fire)
        d.addBoth(_forget)
        d.wake = lambda: (call.cancel() if call.active() else None, _fire())
        sleepers.add(d)
        return d

    def _wake(self, key: tuple) -> None:
        """
        Wake every local waiter on C{key} so it polls now.
        """
        for d in list(self._sleepers.get(key, ())):
            d.wake()

    def _renew(self, lease: RedisSlotLease) -> Deferred:
        """
        One C{renew.lua} round trip.
        """
        d = self._redis.execute(
            self.timeout, "eval", RENEW_LUA, [slotKey(lease.kind, lease.id)],
            [lease.requestId, repr(self.slotTtl)],
        )

        def _cb(reply):
            if int(reply) != 1:
                self._log.warn(
                    "{kind} {id} slot lease {lease_id} was lost",
                    event="relay.slot_lease_lost",
                    kind=lease.kind, id=lease.id, lease_id=lease.requestId,
                    request_id=lease.turnRequestId,
                )
                return False
            return True

        def _eb(f: Failure):
            f.trap(RedisUnavailable)
            self._logError("slot_renew", f)
            return False

        return d.addCallbacks(_cb, _eb)

    # -- helpers ---------------------------------------------------------------

    def _renewLater(self, lease: RedisSlotLease) -> None:
        """
        Renew C{lease} every C{lease._renewEvery} seconds from now until
        L{_renewStop}.
        """
        interval = lease._renewEvery
        due = self._clock.seconds() + interval
        leases = self._renewals.get(interval)
        if leases is None:
            leases = self._renewals[interval] = {}
        leases[lease] = due
        call = self._renewCall
        if call is None or not call.active():
            self._renewCall = self._clock.callLater(interval, self._renewDue)
        elif due < call.getTime():
            call.reset(interval)

    def _renewStop(self, lease: RedisSlotLease) -> None:
        """
        Stop renewing C{lease} (its renewal's delayed call is left to
        fire, and finds nothing due, or is set again for another lease).
        """
        leases = self._renewals.get(lease._renewEvery)
        if leases is not None:
            leases.pop(lease, None)

    def _renewDue(self) -> None:
        """
        Renew the leases whose renewal is due (each is due again an
        interval later) and set the delayed call for the next one.
        """
        self._renewCall = None
        now = self._clock.seconds()
        due = []
        for interval, leases in list(self._renewals.items()):
            for lease, at in leases.items():
                if at > now:
                    break
                due.append((interval, lease))
        for interval, lease in due:
            leases = self._renewals[interval]
            del leases[lease]
            leases[lease] = now + interval
        for _, lease in due:
            lease._renewOnce()
        earliest = None
        for interval, leases in list(self._renewals.items()):
            if not leases:
                del self._renewals[interval]
                continue
            at = next(iter(leases.values()))
            if earliest is None or at < earliest:
                earliest = at
        if earliest is not None:
            call = self._renewCall
            if call is None or not call.active():
                self._renewCall = self._clock.callLater(max(earliest - now, 0), self._renewDue)
            elif earliest < call.getTime():
                call.reset(max(earliest - now, 0))

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
        if counted and self._busyCache:
            self._noteOwn(kind, id, 1)
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


class _Cancelled(Exception):
    """
    The turn's L{relay.base.records.CancelSignal} fired during a wait.
    """


__all__ = [
    "RedisSlotAdmission", "RedisSlotLease", "ProcessLivenessService", "AdmissionError",
    "nextBackoff", "PROCESSES_KEY",
]
