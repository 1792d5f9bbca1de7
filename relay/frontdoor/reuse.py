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
as one array, and the body is read whole). That holds when the known
body's C{]} closes the array of its only C{input} member: a duplicated
top-level key (C{json.loads} keeps its last occurrence) could put another
member between C{input} and that C{]} (C{"input":[...],"tools":[...]},
C{tools} repeated after), whose array the new items would then extend
while the value read extends C{input}. So a known body is extended only
once its C{input}'s bytes have been read alone as one array (orjson, at
its first extension: once a conversation), and a body that extended one
inherits that. A known body's top-level
members and items are shared with the new value: relay copies what it
changes and never changes a parsed container in place (as the splice,
L{relay.wire.rawjson}, relies on too).

Only bodies laid out as Codex writes them are kept (compact, their
C{input} located by L{relay.wire.rawjson.RawObject.layout}), and only the
last of each conversation. A body that extends none (a conversation's
first turn, or a one-off request) is kept on probation, at most
L{PROBATION_BYTES} of them, so one-off requests never push out the
conversations that go on; a body that extended one is kept in its place,
at most L{MAX_BYTES} of them; in each, the least recently kept is dropped
first. A key keeps at most L{PER_KEY} bodies. Nothing is shared between
keys (nor with a key issued again under a revoked key's name: the caller
names a key by its owner, L{relay.base.records.ClientKey.ownerId}, R104). Kept bodies cost memory between a conversation's turns: about
twice their bytes (the text and its parsed value). A body whose parsed
value is estimated at more than L{PARSED_RATIO} times its bytes (many
tiny containers: C{[{},{},...]} parses to 24 times its bytes) counts as
that estimate divided by L{PARSED_RATIO}, so whatever a client sends, the
parsed values kept never take more than L{PARSED_RATIO} times the bounds
(one key's one-off bodies could otherwise hold about 1 GiB).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import orjson

from relay.frontdoor.budgets import shapeEstimate
from relay.wire.jsoncodec import NOT_FAST, loadsLarge
from relay.wire.rawjson import RawObject

__all__ = ["HistoryReuse", "MAX_BYTES", "PARSED_RATIO", "PER_KEY", "PROBATION_BYTES"]

PER_KEY = 64
"""The most bodies one client key keeps: its recent conversations (a
team's key carries many at once)."""

MAX_BYTES = 32 * 2**20
"""The most bytes of kept bodies of conversations that went on (their
parsed values take about as much again)."""

PROBATION_BYTES = 4 * 2**20
"""The most bytes of kept bodies that extended none yet (a Codex
conversation's first body is 20-50 KiB: its instructions, tools and first
message)."""

PARSED_RATIO = 4
"""A kept body counts at least its parsed value's estimate
(L{relay.frontdoor.budgets.shapeEstimate}) divided by this, in bytes: a
Codex history is estimated at about 1.5 times its bytes (it parses to
1.2) and counts its bytes."""


class _Known:
    __slots__ = ("raw", "value", "big", "start", "close", "shape", "kept", "single", "weight",
                 "layout")

    def __init__(self, raw: bytes, value: dict, layout: tuple, close: int, shape: tuple):
        self.raw = raw
        self.value = value
        self.layout = layout
        self.big = big = layout[0]
        self.start = layout[1][big][0] + len(big) + 3
        """Where the history's value starts in C{raw} (after C{"input":})."""
        self.close = close
        """Where the C{]} closing the history's array is in C{raw}."""
        self.shape = shape
        self.single = False
        """C{raw[start:close + 1]} is known to be one JSON value: the
        C{input} member is the only one before that C{]} (see the module)."""

    def isSingle(self) -> bool:
        """
        Whether the history's bytes, read alone, are one array (checked
        once: one orjson read of them).
        """
        if not self.single:
            try:
                self.single = orjson.loads(
                    memoryview(self.raw)[self.start:self.close + 1]).__class__ is list
            except (orjson.JSONDecodeError, RecursionError):
                return False
        return self.single


class HistoryReuse:
    """
    The last large bodies each client key sent, parsed (see the module).
    """

    def __init__(self, perKey: int = PER_KEY, maxBytes: int = MAX_BYTES,
                 probationBytes: int = PROBATION_BYTES):
        self.perKey = perKey
        self._byKey: dict = {}
        # (key name, id of its bytes) -> _Known, least recently kept first;
        # [kept bodies, their bytes, the bound]
        self._segments = {True: [OrderedDict(), 0, maxBytes],
                          False: [OrderedDict(), 0, probationBytes]}
        self.hits = 0

    def read(self, keyName: str, raw: bytes) -> Optional[tuple]:
        """
        The value of C{raw} when it extends a body C{keyName} sent before.

        @return: C{(value, (containers, pairs, elements), known, layout)}:
            the value and its shape as L{relay.wire.jsoncodec.loadsLarge}
            gives them for the whole text, the body it extends (for
            L{remember}'s C{replaces}), and the new body's layout
            (L{relay.wire.rawjson.RawObject.layout}: the known one's, the
            members after the history moved by the bytes added); or
            L{None}: read the body whole.
        """
        known = self._byKey.get(keyName)
        if not known:
            return None
        size = len(raw)
        for entry in reversed(list(known.values())):
            old = entry.raw
            close = entry.close
            after = len(old) - close - 1
            end = size - after - 1  # where the new body's closing ] must be
            if end < close or not raw.startswith(memoryview(old)[:close]):
                continue
            if not raw.endswith(memoryview(old)[close:]):
                continue
            if end > close and not entry.isSingle():
                # (a member after input's array: never extended, see the module)
                self._drop(keyName, id(old), entry)
                continue
            found = self._extend(entry, raw, end)
            if found is not None:
                self.hits += 1
                return found + (entry, _moved(entry.layout, size - len(old)))
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
        old, new = entry.shape, shape[0]
        # the array parsed alone is one container more, its elements are the history's
        counts = (old[0] + new[0] - 1, old[1] + new[1], old[2] + new[2])
        wide = old[3:] + new[3:]  # (the bytes of strings not ASCII, when some)
        return value, counts + (sum(wide),) if wide else counts

    def remember(self, keyName: str, body: RawObject, shape: tuple, replaces=None) -> None:
        """
        Keep C{body} (a large body just read, its parse's C{shape}) for
        C{keyName}'s next turns, when its history can be found in it, in
        place of the body it extends (C{replaces}, from L{read}): one body
        per conversation.
        """
        raw = body.raw
        if replaces is not None and len(raw) == len(replaces.raw):
            # the same bytes again (L{read} matched all of them): a resend
            # keeps the body it repeats, however many are in flight
            if self._segments[replaces.kept][0].get((keyName, id(replaces.raw))) is replaces:
                return
        layout = body.layout()
        if layout is None:
            return
        big, spans, _ = layout
        if body.values[big].__class__ is not list:
            return
        went = replaces is not None
        segment = self._segments[went]
        weight = max(len(raw), shapeEstimate(len(raw), *shape) // PARSED_RATIO)
        if weight > segment[2]:
            return
        close = spans[big][1] - 1
        if raw[close:close + 1] != b"]":
            return
        if replaces is not None:
            self._drop(keyName, id(replaces.raw), replaces)
        known = self._byKey.setdefault(keyName, OrderedDict())
        ident = id(raw)
        entry = _Known(raw, body.values, layout, close, shape)
        entry.kept = went
        entry.weight = weight
        # the history it extended was one array, and its new items parsed as one
        entry.single = went and replaces.single
        known[ident] = entry
        segment[0][keyName, ident] = entry
        segment[1] += weight
        while len(known) > self.perKey:
            oldIdent, oldEntry = next(iter(known.items()))
            self._drop(keyName, oldIdent, oldEntry)
        while segment[1] > segment[2] and segment[0]:
            (oldKey, oldIdent), oldEntry = next(iter(segment[0].items()))
            self._drop(oldKey, oldIdent, oldEntry)

    def _drop(self, keyName: str, ident: int, entry: _Known) -> None:
        segment = self._segments[entry.kept]
        if segment[0].get((keyName, ident)) is not entry:
            return  # dropped already
        del segment[0][keyName, ident]
        segment[1] -= entry.weight
        known = self._byKey[keyName]
        del known[ident]
        if not known:
            del self._byKey[keyName]

    @property
    def size(self) -> int:
        """
        Bytes of bodies kept (a body of many tiny containers counts
        more, L{PARSED_RATIO}).
        """
        return self._segments[True][1] + self._segments[False][1]


def _moved(layout: tuple, added: int) -> tuple:
    big, spans, before = layout
    moved = {}
    for key, (start, end) in spans.items():
        if key in before:
            moved[key] = (start, end)
        elif key == big:
            moved[key] = (start, end + added)
        else:
            moved[key] = (start + added, end + added)
    return big, moved, before
