# -*- test-case-name: tests.test_redis_releases -*-
"""
L{LeaseRenewals}: the renewal of the slot leases of
L{relay.admission.redis.RedisSlotAdmission} (R34: a long turn keeps its
slot past the slot TTL): C{renew.lua}, and one delayed call for every
lease renewed periodically (L{relay.admission.redis.RedisSlotLease.startRenewing}).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from relay.admission.rediskeys import RENEW_LUA, slotKey
from relay.wire.redisclient import RedisUnavailable


@define(eq=False, repr=False)
class LeaseRenewals:
    """
    The lease renewals of one L{relay.admission.redis.RedisSlotAdmission};
    every method takes a L{relay.admission.redis.RedisSlotLease}.

    @ivar _admission: the admission: its C{timeout}, C{slotTtl} and logs.
    @ivar _redis: the running L{relay.wire.redisclient.RedisService}.
    @ivar _clock: the injected clock (seconds).
    @ivar _due: the leases being renewed: interval (seconds) -> {lease:
        when its next renewal is due}, in due order; one delayed call
        (L{_renewDue}) for all of them instead of a
        L{twisted.internet.task.LoopingCall} per
        lease (one per relayed turn).
    @ivar _call: that delayed call, or L{None}.
    """

    _admission: Any
    _redis: Any
    _clock: Any
    _due: dict = field(factory=dict, init=False)
    _call: Optional[object] = field(default=None, init=False)

    @property
    def _log(self):
        return self._admission._log

    def renew(self, lease) -> Deferred:
        """
        One C{renew.lua} round trip.
        """
        d = self._redis.execute(
            self._admission.timeout, "eval", RENEW_LUA, [slotKey(lease.kind, lease.id)],
            [lease.requestId, repr(self._admission.slotTtl)],
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
            self._admission._logError("slot_renew", f)
            return False

        return d.addCallbacks(_cb, _eb)

    def start(self, lease) -> None:
        """
        Renew C{lease} every C{lease._renewEvery} seconds from now until
        L{stop}.
        """
        interval = lease._renewEvery
        due = self._clock.seconds() + interval
        leases = self._due.get(interval)
        if leases is None:
            leases = self._due[interval] = {}
        leases[lease] = due
        call = self._call
        if call is None or not call.active():
            self._call = self._clock.callLater(interval, self._renewDue)
        elif due < call.getTime():
            call.reset(interval)

    def stop(self, lease) -> None:
        """
        Stop renewing C{lease} (its renewal's delayed call is left to
        fire, and finds nothing due, or is set again for another lease).
        """
        leases = self._due.get(lease._renewEvery)
        if leases is not None:
            leases.pop(lease, None)

    def _renewDue(self) -> None:
        """
        Renew the leases whose renewal is due (each is due again an
        interval later) and set the delayed call for the next one.
        """
        self._call = None
        now = self._clock.seconds()
        due = []
        for interval, leases in list(self._due.items()):
            for lease, at in leases.items():
                if at > now:
                    break
                due.append((interval, lease))
        for interval, lease in due:
            leases = self._due[interval]
            del leases[lease]
            leases[lease] = now + interval
        for _, lease in due:
            lease._renewOnce()
        earliest = None
        for interval, leases in list(self._due.items()):
            if not leases:
                del self._due[interval]
                continue
            at = next(iter(leases.values()))
            if earliest is None or at < earliest:
                earliest = at
        if earliest is not None:
            call = self._call
            if call is None or not call.active():
                self._call = self._clock.callLater(max(earliest - now, 0), self._renewDue)
            elif earliest < call.getTime():
                call.reset(max(earliest - now, 0))
