# -*- test-case-name: tests.test_control_store -*-
"""
L{MemoryControlStore}: the control store in one process's memory
(L{relay.interfaces.IControlStore}); nothing survives a restart. For tests
and for a relay built without a C{database}.
"""

from __future__ import annotations

from attrs import define, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.control.store import (
    ANY,
    ControlChange,
    ControlRecord,
    ControlStoreUnavailable,
    Listeners,
    VersionConflict,
    checkKey,
    decodeData,
    encodeData,
    sequenceId,
)
from relay.interfaces import IControlStore

__all__ = ["MemoryControlStore"]


@implementer(IControlStore)
@define(eq=False)
class MemoryControlStore:
    """
    See the module docstring. Data is kept as JSON text, so a caller can
    never change a stored record through a dict it holds.

    @ivar _clock: the time records are stamped with.
    @ivar failing: when true every call fails with
        L{ControlStoreUnavailable} (tests of store outages).
    """

    _clock: IReactorTime
    failing: bool = False
    _records: dict = field(factory=dict, init=False, repr=False)
    _revision: int = field(default=0, init=False)
    _sequences: dict = field(factory=dict, init=False)
    _listeners: Listeners = field(factory=Listeners, init=False)

    def _record(self, kind: str, id: str):
        entry = self._records.get((kind, id))
        if entry is None:
            return None
        version, raw, at = entry
        return ControlRecord(kind=kind, id=id, version=version, data=decodeData(raw),
                             updated_at=at)

    def _down(self) -> Deferred:
        return fail(ControlStoreUnavailable("memory control store is failing (test)"))

    def get(self, kind: str, id: str) -> Deferred:
        """
        See L{IControlStore.get}.
        """
        checkKey(kind, id)
        if self.failing:
            return self._down()
        return succeed(self._record(kind, id))

    def list(self, kind: str) -> Deferred:
        """
        See L{IControlStore.list}.
        """
        checkKey(kind, "-")
        if self.failing:
            return self._down()
        ids = sorted(i for (k, i) in self._records if k == kind)
        return succeed([self._record(kind, i) for i in ids])

    def put(self, kind: str, id: str, data: dict, expected) -> Deferred:
        """
        See L{IControlStore.put}.
        """
        checkKey(kind, id)
        raw = encodeData(data)
        if self.failing:
            return self._down()
        current = self._records.get((kind, id))
        currentVersion = current[0] if current else None
        if expected is not ANY and expected != currentVersion:
            return fail(VersionConflict(kind, id, currentVersion))
        self._revision += 1
        self._records[(kind, id)] = (self._revision, raw, self._clock.seconds())
        record = self._record(kind, id)
        self._listeners.notify(ControlChange(kind, id, record.version))
        return succeed(record)

    def delete(self, kind: str, id: str, expected=ANY) -> Deferred:
        """
        See L{IControlStore.delete}.
        """
        checkKey(kind, id)
        if self.failing:
            return self._down()
        current = self._records.get((kind, id))
        currentVersion = current[0] if current else None
        if expected is not ANY and expected != currentVersion:
            return fail(VersionConflict(kind, id, currentVersion))
        if current is None:
            return succeed(False)
        del self._records[(kind, id)]
        self._revision += 1
        self._listeners.notify(ControlChange(kind, id, None))
        return succeed(True)

    def append(self, kind: str, data: dict, keep: int) -> Deferred:
        """
        See L{IControlStore.append}.
        """
        checkKey(kind, "-")
        raw = encodeData(data)
        if self.failing:
            return self._down()
        number = self._sequences.get(kind, 0) + 1
        self._sequences[kind] = number
        id = sequenceId(number)
        self._revision += 1
        self._records[(kind, id)] = (self._revision, raw, self._clock.seconds())
        ids = sorted(i for (k, i) in self._records if k == kind)
        for old in ids[: max(0, len(ids) - max(1, keep))]:
            del self._records[(kind, old)]
        record = self._record(kind, id)
        self._listeners.notify(ControlChange(kind, id, record.version))
        return succeed(record)

    def subscribe(self, listener):
        """
        See L{IControlStore.subscribe}.
        """
        return self._listeners.subscribe(listener)

    def start(self) -> Deferred:
        """
        See L{IControlStore.start}: nothing to open.
        """
        return succeed(None)

    def stop(self) -> Deferred:
        """
        See L{IControlStore.stop}.
        """
        return succeed(None)
