# -*- test-case-name: tests.test_alerts -*-
"""
The alert book: which conditions are in force, which were told, and when
(docs/operating.md "Alerts").

A condition is an event and a subject (C{login_needed} of account C{o1},
C{pool_exhausted} of model C{gpt-5.5}, ...). L{AlertBook.update} takes
every condition in force now for the events that were evaluated and
answers the notices to send:

  - a condition that starts is told once (C{firing}), unless the same
    condition fired less than C{cooloff} seconds ago: then it is told when
    the cool-off ends, if it is still in force;
  - a told condition that ends is told once more (C{resolved});
  - a condition that ends before it was told is never told.
"""

from __future__ import annotations

from typing import Iterable, Optional

from attrs import define, field, frozen
from twisted.internet.interfaces import IReactorTime

FIRING = "firing"
RESOLVED = "resolved"


@frozen
class Condition:
    """
    Something in force now.

    @ivar event: one of L{relay.base.alertsettings.EVENTS}.
    @ivar subject: what it is about (an account id, a model, a key's
        budget); with C{event}, the condition's identity.
    @ivar summary: one line for people.
    @ivar details: JSON-ready facts (no secrets).
    """

    event: str
    subject: str
    summary: str
    details: dict = field(factory=dict, eq=False, hash=False)

    @property
    def ident(self) -> tuple:
        """
        @return: C{(event, subject)}, the condition's identity.
        """
        return (self.event, self.subject)


@frozen
class Notice:
    """
    One message to send.

    @ivar state: L{FIRING} or L{RESOLVED}.
    @ivar condition: the L{Condition} (for a resolved one, as it was last
        seen in force).
    @ivar at: Unix seconds.
    @ivar since: when the condition was first seen in force, Unix seconds.
    """

    state: str
    condition: Condition
    at: float
    since: float


@define
class _Entry:
    """
    A condition the book holds: when it was first seen, whether it was told.
    """

    condition: Condition
    since: float
    told: bool = False


@define(eq=False)
class AlertBook:
    """
    See the module docstring.

    @ivar clock: the injected L{IReactorTime}.
    @ivar cooloff: seconds between two firings of one condition.
    """

    clock: IReactorTime
    cooloff: float = 600.0
    _entries: dict = field(factory=dict)
    _lastFired: dict = field(factory=dict)

    def update(self, events: Iterable[str], active: Iterable[Condition]) -> list:
        """
        Take what is in force now and answer what to send.

        @param events: the events that were evaluated: a condition of
            another event is left as it was (its reading failed or was not
            due).
        @param active: every L{Condition} of those events in force now.
        @return: L{Notice}s, in a stable order.
        """
        now = self.clock.seconds()
        events = set(events)
        current = {c.ident: c for c in active if c.event in events}
        out = []
        for ident in sorted(set(self._entries) | set(current)):
            entry: Optional[_Entry] = self._entries.get(ident)
            condition = current.get(ident)
            if condition is None:
                if entry is None or ident[0] not in events:
                    continue
                del self._entries[ident]
                if entry.told:
                    out.append(Notice(RESOLVED, entry.condition, now, entry.since))
                continue
            if entry is None:
                entry = self._entries[ident] = _Entry(condition, now)
            else:
                entry.condition = condition
            if not entry.told and now - self._lastFired.get(ident, -float("inf")) >= self.cooloff:
                entry.told = True
                self._lastFired[ident] = now
                out.append(Notice(FIRING, condition, now, entry.since))
        for ident in [i for i, t in self._lastFired.items()
                      if i not in self._entries and now - t >= self.cooloff]:
            del self._lastFired[ident]
        return out

    def active(self) -> list:
        """
        @return: the L{Condition}s in force, told or waiting out a cool-off.
        """
        return [e.condition for _, e in sorted(self._entries.items())]

    def nextDue(self) -> Optional[float]:
        """
        @return: the earliest time a condition waiting out its cool-off may
            be told, Unix seconds, or L{None}.
        """
        due = [self._lastFired[i] + self.cooloff for i, e in self._entries.items() if not e.told]
        return min(due) if due else None
