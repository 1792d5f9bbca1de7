# -*- test-case-name: tests.test_control_store -*-
"""
The control plane's store (L{relay.interfaces.IControlStore}):
the values its providers share (the choice of provider is
L{relay.control.assemble.controlStoreFor}).

Providers, one contract (tests/test_control_store.py, architecture
invariant 8):

  - L{relay.control.store.memory.MemoryControlStore}: one process, nothing
    survives a restart (tests; a relay built without a C{database});
  - L{relay.control.store.sqlite.SQLiteControlStore}: the embedded default,
    tables in the SQLite C{database} beside the settings and tokens, on
    the settings store's one connection;
  - L{relay.control.store.redis.RedisControlStore}: C{state.backend:
    redis}; every write publishes on the channel
    C{relay:control:changes}, so every relay process on that Redis hears
    of it within a second (import it only where txredisapi may be
    imported, style.md trap T5).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Optional

from attrs import define, field, frozen
from twisted.logger import Logger

__all__ = [
    "ANY",
    "ControlChange",
    "ControlRecord",
    "ControlStoreError",
    "ControlStoreUnavailable",
    "Listeners",
    "STORE_TIMEOUT_SECONDS",
    "VersionConflict",
    "checkKey",
    "decodeData",
    "encodeData",
    "sequenceId",
]

STORE_TIMEOUT_SECONDS = 5.0
"""Every store call has this long, seconds (style.md trap T16)."""

SEQUENCE_DIGITS = 12
"""The width of the ids L{relay.interfaces.IControlStore.append} gives."""


class _Any:
    """
    The type of L{ANY}.
    """

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()
"""C{expected} for a write that does not care which version is stored."""


class ControlStoreError(Exception):
    """
    Base of the control store's errors.
    """


class VersionConflict(ControlStoreError):
    """
    A compare-and-set write found another version than the one expected:
    someone else wrote first, nothing was written.

    @ivar kind: the record's kind.
    @ivar id: the record's id.
    @ivar current: the version stored now, or L{None} when there is none.
    """

    def __init__(self, kind: str, id: str, current: Optional[int]):
        super().__init__(f"{kind} {id!r} changed meanwhile (now version {current})")
        self.kind = kind
        self.id = id
        self.current = current


class ControlStoreUnavailable(ControlStoreError):
    """
    The backend could not be reached or did not answer in time; nothing
    may be assumed written.
    """


@frozen
class ControlRecord:
    """
    One stored record (see L{relay.interfaces.IControlStore}).

    @ivar kind: e.g. C{account}, C{pause}, C{login}, C{audit}, C{key}.
    @ivar id: its id within the kind.
    @ivar version: the store revision of its last write (grows with every
        write to the store).
    @ivar data: the JSON object stored (secrets included for some kinds:
        never logged or shown, see L{relay.control}).
    @ivar updated_at: when it was written, Unix seconds.
    """

    kind: str
    id: str
    version: int
    data: dict = field(repr=False)
    updated_at: float = 0.0


@frozen
class ControlChange:
    """
    One change notification.

    @ivar kind: the kind written, or L{None} for "anything may have
        changed, re-read everything" (a feed that reconnected).
    @ivar id: the record's id (L{None} with C{kind} L{None}).
    @ivar version: the new version, or L{None} when the record was deleted.
    """

    kind: Optional[str] = None
    id: Optional[str] = None
    version: Optional[int] = None

    @property
    def deleted(self) -> bool:
        """
        Whether the record is gone.
        """
        return self.kind is not None and self.version is None

    def toJSON(self) -> str:
        """
        @return: the message published on Redis.
        """
        return json.dumps({"kind": self.kind, "id": self.id, "version": self.version})

    @classmethod
    def fromJSON(cls, raw) -> "ControlChange":
        """
        Read a published message; anything unreadable is a resync change
        (L{kind} L{None}), never an error.
        """
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        try:
            value = json.loads(raw)
        except (TypeError, ValueError):
            return cls()
        if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
            return cls()
        version = value.get("version")
        return cls(
            kind=value["kind"], id=str(value.get("id")),
            version=version if isinstance(version, int) and not isinstance(version, bool)
            else None,
        )


_KIND = re.compile(r"[a-z][a-z_]{0,31}")


def checkKey(kind: str, id: str) -> None:
    """
    Refuse a malformed kind or id before it reaches a backend.

    @raise ValueError: a kind that is not a short C{[a-z_]} name, or an
        empty or non-string id.
    """
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ValueError(f"bad control record kind {kind!r}")
    if not isinstance(id, str) or not id:
        raise ValueError("a control record id must be a non-empty string")


def sequenceId(number: int) -> str:
    """
    @return: the id of the C{number}th appended record, zero-padded.
    """
    return str(number).zfill(SEQUENCE_DIGITS)


def encodeData(data: dict) -> str:
    """
    @param data: a JSON-able C{dict}.
    @return: its compact JSON (sorted keys).
    @raise ValueError: when C{data} is not a dict or not JSON-able.
    """
    if not isinstance(data, dict):
        raise ValueError("control record data must be a JSON object")
    try:
        return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"control record data is not JSON-able: {e}") from None


def decodeData(raw) -> dict:
    """
    @return: the stored JSON object, or C{{}} when unreadable.
    """
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


@define(eq=False)
class Listeners:
    """
    The subscribers of one store (L{relay.interfaces.IControlStore.subscribe}).
    """

    _listeners: list = field(factory=list)
    _log = Logger()

    def subscribe(self, listener: Callable[[ControlChange], Any]) -> Callable[[], None]:
        """
        Add a listener.

        @return: a no-argument callable that removes it.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def notify(self, change: ControlChange) -> None:
        """
        Call every listener with C{change}; one that raises is logged.
        """
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:  # noqa: BLE001 - logged; one bad part must not stop the rest
                self._log.failure(
                    "a control store listener failed", event="relay.control_listener_failed"
                )
