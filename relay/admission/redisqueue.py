# -*- test-case-name: tests.integration.test_redis_admission,tests.test_redis_releases -*-
"""
L{RedisWait}: the wait for a slot of
L{relay.admission.redis.RedisSlotAdmission} (R27, R30, R33, R35, R-B2):
a fast try, then a ticket in the slot key's FIFO queue polled with R30's
backoff until the queue's head gets the slot, the wait ends or the turn
is cancelled; a local release wakes this process's waiters at once.
"""

from __future__ import annotations

from typing import Any

from attrs import define
from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from relay.admission import admissionError
from relay.admission.rediskeys import BACKOFF_START, nextBackoff
from relay.base.records import AdmissionError, WaitPlan
from relay.wire.redisclient import RedisUnavailable, describe


class _Cancelled(Exception):
    """
    The turn's L{relay.base.records.CancelSignal} fired during a wait.
    """


@define(eq=False, repr=False)
class RedisWait:
    """
    The waits of one L{relay.admission.redis.RedisSlotAdmission}.

    @ivar _admission: the admission: its Redis calls (C{acquire.lua},
        C{leave.lua}), leases, request ids, C{onRedisError} and error log.
    @ivar _clock: the injected clock (seconds).
    @ivar _random: the jitter source for the poll backoff (R30).
    @ivar _sleepers: C{(kind, id)} -> this process's waiters between polls
        (the admission's C{_sleepers}).
    """

    _admission: Any
    _clock: Any
    _random: Any
    _sleepers: dict

    @property
    def _log(self):
        return self._admission._log

    async def acquire(self, plan: WaitPlan, cancel, deadline):
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
        rid = self._admission._newRequestId()
        if plan.max_concurrency <= 0:
            return self._admission._lease(plan.kind, plan.id, rid, counted=False)
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
                self._admission._leave(plan, rid, True)

    async def _wait(self, plan, cancel, rid, started, end, state, fail):
        """
        The body of L{acquire}.
        """
        state["sent"] = True
        try:
            reply = await self._raceCancel(
                self._admission._acquireCall(
                    plan.kind, plan.id, plan.max_concurrency, rid, "try", 0
                ),
                cancel,
            )
        except RedisUnavailable as e:
            # R35: a slot acquire error is an admission error in both modes.
            self._admission._logError("slot_acquire", e)
            raise fail("error", describe(e))
        if int(reply[0]) == 1:
            state["granted"] = True
            return self._admission._lease(plan.kind, plan.id, rid)
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
                    self._admission._acquireCall(
                        plan.kind, plan.id, plan.max_concurrency, rid, mode, plan.max_waiting
                    ),
                    cancel,
                )
                lastError = None
            except RedisUnavailable as e:
                lastError = e
                self._admission._logError("slot_enqueue" if mode == "enqueue" else "slot_poll", e)
                if self._admission.onRedisError == "fail_closed":
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
                    lease = self._admission._lease(
                        plan.kind, plan.id, rid, now - started, state["position"]
                    )
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

    def _sleep(self, key: tuple, seconds: float) -> Deferred:
        """
        Sleep between polls; L{wake} ends it early.

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

    def wake(self, key: tuple) -> None:
        """
        Wake every local waiter on C{key} so it polls now.
        """
        for d in list(self._sleepers.get(key, ())):
            d.wake()
