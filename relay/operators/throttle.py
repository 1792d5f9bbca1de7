# -*- test-case-name: tests.test_operators -*-
"""
L{SignInThrottle}: console sign-in attempts per client address.

An address may fail L{FREE_FAILURES} sign-ins (wrong name or password, a
refused OIDC answer) within L{WINDOW} seconds; after that it must wait
before its next attempt: L{BASE_SECONDS}, doubling with every further
failure, up to L{MAX_SECONDS}. A refused attempt is answered 429
C{sign_in_throttled} with C{Retry-After}, its password not even checked
(so a guesser learns nothing, a right password included). A success
clears the address. IPv6 addresses count as their /64. At most
L{MAX_ADDRESSES} addresses are remembered (the least recently seen go
first). Time is the injected clock's.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict, deque
from typing import Any, Optional

from attrs import define, field

__all__ = ["SignInThrottle"]

FREE_FAILURES = 5
WINDOW = 300.0
BASE_SECONDS = 2.0
MAX_SECONDS = 600.0
MAX_ADDRESSES = 10_000


def _bucket(address: Optional[str]) -> str:
    if address and ":" in address:
        try:
            return str(ipaddress.ip_network(address + "/64", strict=False))
        except ValueError:
            return address
    return address or "-"


@define(eq=False)
class SignInThrottle:
    """
    See the module docstring.

    @ivar clock: the injected clock.
    """

    clock: Any
    free: int = FREE_FAILURES
    window: float = WINDOW
    _addresses: OrderedDict = field(factory=OrderedDict)

    def _entry(self, address):
        key = _bucket(address)
        entry = self._addresses.get(key)
        if entry is None:
            entry = self._addresses[key] = {"failures": deque(), "until": 0.0}
            while len(self._addresses) > MAX_ADDRESSES:
                self._addresses.popitem(last=False)
        self._addresses.move_to_end(key)
        return entry

    def retryAfter(self, address: Optional[str]) -> Optional[int]:
        """
        @return: the whole seconds C{address} must still wait before its
            next attempt, or L{None} when it may try now.
        """
        entry = self._addresses.get(_bucket(address))
        if entry is None:
            return None
        left = entry["until"] - self.clock.seconds()
        return max(1, math.ceil(left)) if left > 0 else None

    def failed(self, address: Optional[str]) -> None:
        """
        Count a failed attempt; past the free ones, start (or lengthen) the
        wait.
        """
        now = self.clock.seconds()
        entry = self._entry(address)
        failures = entry["failures"]
        failures.append(now)
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        over = len(failures) - self.free
        if over >= 0:
            entry["until"] = now + min(MAX_SECONDS, BASE_SECONDS * 2 ** min(over, 20))

    def succeeded(self, address: Optional[str]) -> None:
        """
        Forget the address.
        """
        self._addresses.pop(_bucket(address), None)
