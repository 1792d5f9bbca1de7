# -*- test-case-name: tests.test_reuse -*-
"""
A Codex conversation over HTTP resends its whole history every turn: the
body of turn N+1 is the body of turn N with more items at the end of
C{input} (the model's output, the tools' results, the next message),
byte for byte the same before them and after them (C{tools},
C{prompt_cache_key}, ...). L{HistoryReuse} keeps the last large bodies a
client key sent, parsed, and reads a new body that extends one of them
by parsing only the items it adds: the cost of a turn stops growing with
its conversation.

How a body is recognised, without reading it: it starts with the known
body's bytes up to (not including) the C{]} that closes its C{input}
(one C{memcmp}), and ends with the known body's bytes after that C{]}
(another). What lies between is the new items: C{,} followed by
elements and the closing C{]}. They are parsed as the array C{[...]}
alone, by the body's own reader: a text that parses so can only be
elements of that array, so the value is the known body's with those
elements appended, exactly what C{json.loads} gives for the whole text
(a text that closes the array and opens another member does not parse
as one array, and the body is read whole). A known body's top-level
members and items are shared with the new value: relay copies what it
changes and never changes a parsed container in place (as the splice,
L{relay.wire.rawjson}, relies on too).

Only bodies laid out as Codex writes them are kept (compact, their
C{input} located by L{relay.wire.rawjson.RawObject.layout}); a key keeps
at most L{PER_KEY} bodies, the process at most L{MAX_BYTES} of them, the
least recently used dropped first. Nothing is shared between keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from relay.wire.jsoncodec import NOT_FAST, loadsLarge
from relay.wire.rawjson import RawObject

__all__ = ["HistoryReuse", "MAX_BYTES", "PER_KEY"]

PER_KEY = 64
"""The most bodies one client key keeps: its recent conversations (a
team's key carries many at once)."""

MAX_BYTES = 64 * 2**20
"""The most bytes of kept bodies in the process (their parsed values take
about as much again)."""


class _Known:
    __slots__ = ("raw", "value", "big", "close", "shape")

    def __init__(self, raw: bytes, value: dict, big: str, close: int, shape: tuple):
        self.raw = raw
        self.value = value
        self.big = big
        self.close = close
        """Where the C{]} closing the history's array is in C{raw}."""
        self.shape = shape


class HistoryReuse:
    """
    The last large bodies each client key sent, parsed (see the module).
    """

    def __init__(self, perKey: int = PER_KEY, maxBytes: int = MAX_BYTES):
        self.perKey = perKey
        self.maxBytes = maxBytes
        self._byKey: dict = {}
        self._all: OrderedDict = OrderedDict()
        self._bytes = 0
        self.hits = 0

    def read(self, keyName: str, raw: bytes) -> Optional[tuple]:
        """
        The value of C{raw} when it extends a body C{keyName} sent before.

        @return: C{(value, (containers, pairs, elements), known)}: the
            value and its shape as L{relay.wire.jsoncodec.loadsLarge} gives
            them for the whole text, and the body it extends (for
            L{remember}'s C{replaces}); or L{None}: read the body whole.
        """
        known = self._byKey.get(keyName)
        if not known:
            return None
        size = len(raw)
        for entry in reversed(known.values()):
            old = entry.raw
            close = entry.close
            after = len(old) - close - 1
            end = size - after - 1  # where the new body's closing ] must be
            if end < close or not raw.startswith(memoryview(old)[:close]):
                continue
            if not raw.endswith(memoryview(old)[close:]):
                continue
            found = self._extend(entry, raw, end)
            if found is not None:
                self.hits += 1
                return found + (entry,)
        return None

    def _extend(self, entry: _Known, raw: bytes, end: int) -> Optional[tuple]:
        items = entry.value[entry.big]
        if end == entry.close:
            return dict(entry.value), entry.shape
        added = raw[entry.close:end + 1]  # the new elements and the closing ]
        if items:
            if added[:1] != b",":
                return None
            added = b"[" + added[1:]
        else:
            added = b"[" + added
        shape = []
        more = loadsLarge(added, shape, depth=2)
        if more is NOT_FAST or more.__class__ is not list or (items and not more):
            return None  # (a comma and no element after it: not JSON)
        value = dict(entry.value)
        value[entry.big] = items + more
        containers, pairs, elements = entry.shape
        c, p, e = shape[0]
        # the array parsed alone is one container more, its elements are the history's
        return value, (containers + c - 1, pairs + p, elements + e)

    def remember(self, keyName: str, body: RawObject, shape: tuple, replaces=None) -> None:
        """
        Keep C{body} (a large body just read, its parse's C{shape}) for
        C{keyName}'s next turns, when its history can be found in it, in
        place of the body it extends (C{replaces}, from L{read}): one body
        per conversation.
        """
        layout = body.layout()
        if layout is None:
            return
        big, spans, _ = layout
        if body.values[big].__class__ is not list:
            return
        raw = body.raw
        if len(raw) > self.maxBytes:
            return
        close = spans[big][1] - 1
        if raw[close:close + 1] != b"]":
            return
        if replaces is not None:
            self._drop(keyName, id(replaces.raw), replaces)
        known = self._byKey.setdefault(keyName, OrderedDict())
        ident = id(raw)
        entry = _Known(raw, body.values, big, close, shape)
        known[ident] = entry
        self._all[keyName, ident] = entry
        self._bytes += len(raw)
        while len(known) > self.perKey:
            oldIdent, oldEntry = next(iter(known.items()))
            self._drop(keyName, oldIdent, oldEntry)
        while self._bytes > self.maxBytes and self._all:
            (oldKey, oldIdent), oldEntry = next(iter(self._all.items()))
            self._drop(oldKey, oldIdent, oldEntry)

    def _drop(self, keyName: str, ident: int, entry: _Known) -> None:
        if self._all.get((keyName, ident)) is not entry:
            return  # dropped already
        del self._all[keyName, ident]
        self._bytes -= len(entry.raw)
        known = self._byKey[keyName]
        del known[ident]
        if not known:
            del self._byKey[keyName]

    @property
    def size(self) -> int:
        """
        Bytes of bodies kept.
        """
        return self._bytes
