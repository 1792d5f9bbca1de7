# -*- test-case-name: tests.test_frontdoor, tests.test_intake -*-
"""
L{Admission}: what the front door admitted for a request before its body
(or WebSocket frame) was parsed (behaviour.md R26, R103), travelling with
the request to the resource (or with the frame to its turn) that hands it
to the engine.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from relay.base.records import ClientKey


class Slot:
    """
    The key's admitted slot lease (R26): taken by one turn (L{take}) or
    released once (L{release}), whichever comes first.
    """

    __slots__ = ("_lease",)

    def __init__(self, lease):
        self._lease = lease

    def take(self) -> Optional["Slot"]:
        """
        Hand the lease over (to a turn, whose end releases it): a new
        L{Slot} holding it, or L{None} when it was taken or released.
        """
        lease, self._lease = self._lease, None
        return Slot(lease) if lease is not None else None

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def __getattr__(self, name):
        return getattr(self._lease, name)


class Admission(NamedTuple):
    """
    A request's admission: an immutable record (a named tuple: built
    in a fraction of a frozen attrs class's instructions, twice per
    request).

    @ivar key: the authenticated L{ClientKey} (R103: from the headers,
        before any of the body was read).
    @ivar admitted: the key's slot was admitted (R26) before the body was
        decoded; the engine does not admit it again.
    @ivar slot: that slot (L{Slot}), or L{None} for an unlimited key.
    @ivar hold: the bytes held for the body's parsed size (an object with
        C{release()}, released once), or L{None}.
    """

    key: ClientKey
    admitted: bool = False
    slot: Optional[Slot] = None
    hold: Optional[Any] = None

    def giveBack(self) -> None:
        """
        Release the slot and the bytes no turn took.
        """
        if self.slot is not None:
            self.slot.release()
        if self.hold is not None:
            self.hold.release()

    def handOver(self, turn) -> None:
        """
        Give the admitted slot to C{turn} (C{Turn.keyAdmitted},
        C{Turn.keyLease}); the engine releases it when the turn ends.
        """
        if self.admitted:
            turn.keyAdmitted = True
            turn.keyLease = self.slot.take() if self.slot is not None else None
