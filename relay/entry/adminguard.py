# -*- test-case-name: tests.test_adminguard -*-
"""
Back-off for admin key guesses, per client address (behaviour.md R99; the
intake's admin check, L{relay.entry.intake.IntakePolicy.authenticate}).

An address that presented a wrong admin (or metrics) key L{THRESHOLD}
times within L{WINDOW} seconds is refused for a while: every admin or
C{/metrics} request from it is answered 429 C{admin_key_backoff} with
C{Retry-After}, its key not even compared (so the refusal tells a guesser
nothing, a right key included). The wait is L{BASE_SECONDS} and doubles
with every further wrong key after it, up to L{MAX_SECONDS}; a right key
(outside a wait) resets the address, and so does L{FORGET_SECONDS} without
a wrong key. Requests without a key guess nothing and are not counted.

An IPv6 address counts as its /64 (one host usually holds a whole /64).
Memory is bounded: at most L{MAX_ADDRESSES} addresses are tracked, the
least recently seen dropped first. The log gets one warning when an
address starts waiting, at most one per L{LOG_INTERVAL} seconds, counting
the ones not logged since (never one line per guess). Time is the
injected clock's.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any, Optional

from attrs import define, field
from twisted.logger import Logger

from relay.entry.logthrottle import LogThrottle, suppressedNote
from relay.base.records import ClientError

__all__ = ["AdminGuard", "BACKOFF_CODE"]

THRESHOLD = 5
"""Wrong keys within L{WINDOW} that start the first wait."""

WINDOW = 60.0
"""Seconds over which wrong keys are counted."""

BASE_SECONDS = 1.0
"""The first wait, seconds."""

MAX_SECONDS = 300.0
"""The longest wait, seconds."""

FORGET_SECONDS = 900.0
"""Seconds without a wrong key after which an address starts afresh."""

MAX_ADDRESSES = 10_000
"""Addresses tracked at once (least recently seen dropped first)."""

LOG_INTERVAL = 60.0
"""Seconds between two warnings."""

BACKOFF_CODE = "admin_key_backoff"
"""The error code of the 429."""


def _bucket(address: Optional[str]) -> Optional[str]:
    """
    @return: what C{address} is counted as: itself, or for IPv6 its /64.
    """
    if address and ":" in address:
        import ipaddress

        try:
            return str(ipaddress.ip_network(address + "/64", strict=False))
        except ValueError:
            return address
    return address


@define(eq=False)
class _Address:
    """
    What is known of one address.

    @ivar failures: times of its wrong keys within L{WINDOW}.
    @ivar level: waits started so far (the next lasts twice as long).
    @ivar until: when its current wait ends.
    @ivar last: its last wrong key.
    """

    failures: deque = field(factory=deque)
    level: int = 0
    until: float = 0.0
    last: float = 0.0


class _Throttle(LogThrottle):
    """
    One warning per L{LOG_INTERVAL}.
    """

    interval = LOG_INTERVAL


@define(eq=False)
class AdminGuard:
    """
    See the module docstring.

    @ivar clock: the injected L{twisted.internet.interfaces.IReactorTime}.
    @ivar maxAddresses: addresses tracked at most (L{MAX_ADDRESSES}).
    """

    clock: Any
    maxAddresses: int = MAX_ADDRESSES
    _addresses: OrderedDict = field(factory=OrderedDict)
    _throttle: Optional[_Throttle] = None
    _log = Logger()

    def refusal(self, address: Optional[str]) -> Optional[ClientError]:
        """
        The answer for an admin request from C{address} before its key is
        compared.

        @return: the 429 while the address waits, else L{None}.
        """
        entry = self._addresses.get(_bucket(address))
        if entry is None:
            return None
        now = self.clock.seconds()
        if now >= entry.until:
            return None
        wait = max(1, math.ceil(entry.until - now))
        return ClientError(
            429, "rate_limit_error",
            f"Too many wrong admin keys from this address; retry in {wait} s.",
            code=BACKOFF_CODE, headers=(("Retry-After", str(wait)),),
        )

    def succeeded(self, address: Optional[str]) -> None:
        """
        A right key from C{address}: it starts afresh.
        """
        self._addresses.pop(_bucket(address), None)

    def failed(self, address: Optional[str]) -> None:
        """
        A wrong key from C{address}: count it; at L{THRESHOLD} within
        L{WINDOW}, and for every wrong key after that, the address waits
        (twice as long each time, at most L{MAX_SECONDS}).
        """
        now = self.clock.seconds()
        bucket = _bucket(address)
        entry = self._addresses.pop(bucket, None)
        if entry is None or now - entry.last > FORGET_SECONDS:
            entry = _Address()
        self._addresses[bucket] = entry  # most recently seen last
        while len(self._addresses) > self.maxAddresses:
            self._addresses.popitem(last=False)
        entry.last = now
        while entry.failures and entry.failures[0] <= now - WINDOW:
            entry.failures.popleft()
        entry.failures.append(now)
        if len(entry.failures) < THRESHOLD and not entry.level:
            return
        entry.level += 1
        seconds = min(MAX_SECONDS, BASE_SECONDS * 2 ** (entry.level - 1))
        entry.until = now + seconds
        self._warn(address, seconds)

    def _warn(self, address, seconds: float) -> None:
        """
        Say that C{address} waits C{seconds}, unless a warning went out
        within L{LOG_INTERVAL}.
        """
        if self._throttle is None:
            self._throttle = _Throttle(self.clock)
        suppressed = self._throttle.admit("admin_key_backoff")
        if suppressed is None:
            return
        self._log.warn(
            "wrong admin keys from {client}: refusing its admin requests for {seconds:g} s"
            + suppressedNote(suppressed, "more waits started"),
            event="relay.admin_key_backoff", client=address or "-", seconds=seconds,
            suppressed=suppressed,
        )
