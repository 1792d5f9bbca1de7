# -*- test-case-name: tests.test_frontdoor -*-
"""
L{Admission}: what the front door admitted for a request before its body
(or WebSocket frame) was parsed (behaviour.md R26, R103).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import frozen

from relay.model import ClientKey


@frozen
class Admission:
    """
    A request's admission, handed with its turn to the engine.

    @ivar key: the authenticated L{ClientKey}.
    @ivar lease: the key's slot (R26), or L{None} for an unlimited key;
        the turn takes it (C{Turn.keyLease}) and the engine releases it.
    @ivar hold: the bytes held for the body's parsed size (an object with
        C{release()}, released once), or L{None}.
    """

    key: ClientKey
    lease: Any = None
    hold: Optional[Any] = None

    def giveBack(self) -> None:
        """
        Release the slot and the bytes no turn took.
        """
        if self.lease is not None:
            self.lease.release()
        if self.hold is not None:
            self.hold.release()
