# -*- test-case-name: tests.test_admission -*-
"""
The in-memory L{ISlotAdmission} provider for a single relay process.

Each slot key C{(kind, id)} has a set of held leases and a FIFO queue of
tickets (R-B2). A release hands the slot to the queue's head at once
(no polling); a ticket leaves the queue on grant, timeout, deadline or
cancellation, so the wait counter (the queue length, R29) goes back down
on every exit path (R33).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from attrs import define, field
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.admission import admissionError
from relay.interfaces import ISlotAdmission, ISlotDrain, ISlotLease, ISynchronousAdmission
from relay.base.records import WaitPlan
from relay.base.requestid import currentRequestId


@implementer(ISlotLease)
@define(eq=False)
class MemorySlotLease:
    """
    One held slot of L{MemorySlotAdmission}.

    @ivar kind: C{account} or C{user}.
    @ivar id: the account id or client key name.
    @ivar waitedSeconds: seconds waited before acquisition.
    @ivar queuePosition: 1-based queue position when the wait began, or 0.
    @ivar released: whether L{release} was called.
    """

    _admission: "MemorySlotAdmission"
    kind: str
    id: str
    waitedSeconds: float = 0.0
    queuePosition: int = 0
    released: bool = False

    def release(self) -> None:
        """
        See L{ISlotLease.release}. Idempotent; wakes the next waiter.
        """
        if self.released:
            return
        self.released = True
        self._admission._release(self)

    def renew(self) -> Deferred:
        """
        See L{ISlotLease.renew}. Memory leases never expire.
        """
        return succeed(None)


@define(eq=False)
class _Ticket:
    """
    A waiter's place in a FIFO queue.

    @ivar plan: the L{WaitPlan}.
    @ivar end: Unix seconds when the wait ends (plan timeout or deadline).
    @ivar started: Unix seconds when the wait began.
    @ivar position: the 1-based position on joining.
    @ivar result: the L{Deferred} given to the caller.
    @ivar timer: the timeout L{IDelayedCall}.
    @ivar cancelWait: the L{relay.base.records.CancelSignal.whenCancelled} Deferred.
    @ivar done: whether the ticket left the queue (granted or failed).
    @ivar requestId: the waiting turn's id (L{currentRequestId} when it
        joined), for the lines written when it leaves from a timer or a
        cancellation, outside the turn.
    """

    plan: WaitPlan
    end: float
    started: float
    position: int
    result: Optional[Deferred] = None
    timer: object = None
    cancelWait: Optional[Deferred] = None
    done: bool = False
    requestId: Optional[str] = field(factory=currentRequestId.get)


@implementer(ISlotAdmission, ISlotDrain, ISynchronousAdmission)
@define(eq=False)
class MemorySlotAdmission:
    """
    Slots and FIFO wait queues in dicts.

    @ivar _clock: the time source (Unix seconds) for waits and timeouts.
    @ivar _held: C{(kind, id)} -> set of held L{MemorySlotLease}s.
    @ivar _queues: C{(kind, id)} -> C{deque} of L{_Ticket}s.
    """

    _clock: IReactorTime
    _held: dict = field(factory=dict, init=False)
    _queues: dict = field(factory=dict, init=False)

    _log = Logger()

    # -- ISlotAdmission ------------------------------------------------------

    def tryAcquire(self, kind, id, limit) -> Deferred:
        """
        See L{ISlotAdmission.tryAcquire}. Fails (fires L{None}) while others
        wait in the FIFO queue of that slot (R-B2).
        """
        return succeed(self._tryNow(kind, id, limit))

    def tryAcquireNow(self, kind, id, limit) -> Optional[MemorySlotLease]:
        """
        L{tryAcquire} without its Deferred (the scheduler's sticky
        fast path).

        @return: a lease or L{None}.
        """
        return self._tryNow(kind, id, limit)

    def acquire(self, plan, cancel, deadline=None) -> Deferred:
        """
        See L{ISlotAdmission.acquire}.

        Cancelling the returned L{Deferred} leaves the queue like a client
        cancellation does.
        """
        now = self._clock.seconds()
        if cancel.cancelled:
            return self._failed("client_gone", plan)
        if deadline is not None and deadline <= now:
            return self._failed("timeout", plan)
        lease = self._tryNow(plan.kind, plan.id, plan.max_concurrency)
        if lease is not None:
            return succeed(lease)
        key = (plan.kind, plan.id)
        queue = self._queues.get(key)
        waiting = len(queue) if queue else 0
        if waiting >= plan.max_waiting:
            self._log.debug(
                "{kind} {id} wait queue full ({waiting}/{max_waiting})",
                event="relay.admission_queue_full",
                kind=plan.kind,
                id=plan.id,
                waiting=waiting,
                max_waiting=plan.max_waiting,
            )
            return self._failed("queue_full", plan)
        end = now + max(plan.timeout, 0)
        if deadline is not None:
            end = min(end, deadline)
        if end <= now:
            return self._failed("timeout", plan)
        if queue is None:
            queue = self._queues[key] = deque()
        ticket = _Ticket(plan=plan, end=end, started=now, position=waiting + 1)
        ticket.result = Deferred(lambda d: self._leave(ticket, "client_gone"))
        queue.append(ticket)
        ticket.timer = self._clock.callLater(end - now, self._leave, ticket, "timeout")
        ticket.cancelWait = cancel.whenCancelled()
        ticket.cancelWait.addCallback(lambda _: self._leave(ticket, "client_gone"))
        ticket.cancelWait.addErrback(lambda f: f.trap(CancelledError))
        self._log.debug(
            "{kind} {id} queued at position {position}",
            event="relay.admission_queued",
            kind=plan.kind,
            id=plan.id,
            position=ticket.position,
        )
        return ticket.result

    def load(self, kind, ids) -> Deferred:
        """
        See L{ISlotAdmission.load}.
        """
        out = {}
        for i in ids:
            key = (kind, i)
            out[i] = (len(self._held.get(key, ())), len(self._queues.get(key, ())))
        return succeed(out)

    def busy(self, kind, ids=(), fresh=False) -> dict:
        """
        The loads of the slot keys of C{kind} that hold a slot or
        have a waiter -- every other key's load is C{(0, 0)} -- at the cost
        of those keys, not of every account (the scheduler's load-balance
        layer reads this instead of every candidate's load). Always fresh
        (C{fresh} is accepted for the Redis admission's signature).

        @return: id -> C{(inUse, waiting)}.
        """
        out = {}
        for key, held in self._held.items():
            if key[0] == kind:
                out[key[1]] = (len(held), 0)
        for key, queue in self._queues.items():
            if key[0] == kind:
                out[key[1]] = (out.get(key[1], (0, 0))[0], len(queue))
        return out

    # -- ISlotDrain -----------------------------------------------------------

    def releaseAll(self, timeout: float) -> Deferred:
        """
        See L{ISlotDrain.releaseAll}: release every lease still held (the
        store is this process's memory, so nothing is in flight).
        """
        leftover = [lease for held in list(self._held.values()) for lease in list(held)]
        for lease in leftover:
            lease.release()
        return succeed(len(leftover))

    # -- internals -----------------------------------------------------------

    def _tryNow(self, kind: str, id: str, limit: int) -> Optional[MemorySlotLease]:
        """
        One immediate attempt; only when nobody waits (FIFO).

        @return: a lease or L{None}.
        """
        key = (kind, id)
        if self._queues.get(key):
            return None
        held = self._held.get(key)
        if limit > 0 and held is not None and len(held) >= limit:
            return None
        return self._grant(key, 0.0, 0)

    def _grant(self, key: tuple, waited: float, position: int) -> MemorySlotLease:
        """
        Record and return a new lease for C{key}.
        """
        lease = MemorySlotLease(self, key[0], key[1], waited, position)
        self._held.setdefault(key, set()).add(lease)
        return lease

    def _release(self, lease: MemorySlotLease) -> None:
        """
        Forget C{lease} and wake the queue's head(s).
        """
        key = (lease.kind, lease.id)
        held = self._held.get(key)
        if held is not None:
            held.discard(lease)
            if not held:
                del self._held[key]
        self._pump(key)

    def _pump(self, key: tuple) -> None:
        """
        Grant free slots to the heads of C{key}'s queue, in order. Heads
        whose time is up leave with C{timeout} (R33: no slot for an expired
        wait). Deferreds fire only after the bookkeeping is done, so a
        callback that releases or acquires re-enters a consistent state.
        """
        queue = self._queues.get(key)
        fired = []
        now = self._clock.seconds()
        while queue:
            head = queue[0]
            if head.end <= now:
                queue.popleft()
                self._finish(head)
                fired.append((head, self._error(head, "timeout", now)))
                continue
            limit = head.plan.max_concurrency
            if limit > 0 and len(self._held.get(key, ())) >= limit:
                break
            queue.popleft()
            self._finish(head)
            fired.append((head, self._grant(key, now - head.started, head.position)))
        if queue is not None and not queue:
            self._queues.pop(key, None)
        for ticket, outcome in fired:
            self._fire(ticket, outcome)

    def _fire(self, ticket: _Ticket, outcome) -> None:
        """
        Deliver a lease or an L{AdmissionError} to a ticket's caller.
        """
        if ticket.result.called:
            # Defensive: the caller's Deferred already has a result.
            if not isinstance(outcome, Exception):
                outcome.release()
            return
        if isinstance(outcome, Exception):
            ticket.result.errback(outcome)
        else:
            ticket.result.callback(outcome)

    def _error(self, ticket: _Ticket, reason: str, now: float):
        """
        @return: the L{AdmissionError} for a ticket leaving with C{reason}.
        """
        return admissionError(reason, ticket.plan, now - ticket.started, ticket.position)

    def _finish(self, ticket: _Ticket) -> None:
        """
        Mark a ticket done; stop its timer and cancellation watch.
        """
        ticket.done = True
        if ticket.timer is not None and ticket.timer.active():
            ticket.timer.cancel()
        if ticket.cancelWait is not None and not ticket.cancelWait.called:
            ticket.cancelWait.cancel()

    def _leave(self, ticket: _Ticket, reason: str) -> None:
        """
        Remove a waiting ticket (timeout, cancellation) and fail its
        Deferred with C{reason}. Does nothing once the ticket was granted or
        has left.
        """
        if ticket.done:
            return
        key = (ticket.plan.kind, ticket.plan.id)
        queue = self._queues.get(key)
        if queue is not None:
            try:
                queue.remove(ticket)
            except ValueError:
                pass
            if not queue:
                del self._queues[key]
        self._finish(ticket)
        error = self._error(ticket, reason, self._clock.seconds())
        self._log.debug(
            "{kind} {id} left the queue: {reason}",
            event="relay.admission_left_queue",
            kind=ticket.plan.kind,
            id=ticket.plan.id,
            reason=reason,
            request_id=ticket.requestId,
        )
        # The next waiter may now be the head of a queue with a free slot.
        self._pump(key)
        self._fire(ticket, error)

    def _failed(self, reason: str, plan: WaitPlan) -> Deferred:
        """
        @return: a failed L{Deferred} with an L{AdmissionError}.
        """
        d = Deferred()
        d.errback(admissionError(reason, plan))
        return d


__all__ = ["MemorySlotAdmission", "MemorySlotLease"]
