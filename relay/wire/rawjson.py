# -*- test-case-name: tests.test_rawjson -*-
"""
A client's JSON object body kept as the bytes it came in, so a large one
(a Codex history) goes upstream as those bytes with only the top-level
members relay changed written anew, instead of re-encoded whole.

L{RawObject.splice} finds the members' byte spans without reading the big
one: the members before it and after it are matched byte for byte
against their compact encoding (orjson's: compact, non-ASCII as UTF-8,
which is what Codex sends), from the start and from the end of the text;
the big member (C{input}, or C{messages} of a chat body) is what lies
between. A text that is not written so (spaces, C{\\u} escapes, keys that
are not plain names) has no spans: the caller encodes the body whole.

Why the spliced text means what the body means, although the big member's
bytes are never read: a duplicated top-level key (C{json.loads} keeps the
last occurrence, and so does upstream) may hide an earlier occurrence
inside those bytes. A member after the big one that relay changed is
written after that occurrence, so it wins; a member before the big one
that relay changed, and any member relay removed, is spliced only when
the big member's bytes hold no C{"name":} at all (one C{bytes.find});
else the caller encodes the body whole.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import orjson

__all__ = ["BIG_MEMBERS", "RawObject"]

BIG_MEMBERS = ("input", "messages")
"""The member that holds a body's history (Responses, chat)."""

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SCALARS = (str, int, float, bool, type(None))
_MISSING = object()


class RawObject:
    """
    One client body: its bytes and its top-level values as parsed.

    The values of a body relay builds from the parsed one are compared to
    these by identity (scalars by value): relay copies what it changes
    and never changes a parsed container in place.

    @ivar raw: the body's bytes.
    @ivar values: a shallow copy of the parsed top-level object.
    """

    __slots__ = ("raw", "values", "_layout")

    def __init__(self, raw: bytes, parsed: dict, layout=_MISSING):
        """
        @param layout: the members' spans when already known (L{layout}'s
            value for these bytes and values), else found when first asked.
        """
        self.raw = raw
        self.values = dict(parsed)
        self._layout = layout

    def layout(self) -> Optional[tuple]:
        """
        The members' spans, found once.

        @return: C{(big key, spans, before)}: C{spans} maps each key to
            the C{(start, end)} of its C{"key":value} bytes, C{before} is
            the set of keys before the big one; or L{None} when the text
            is not laid out so (see the module).
        """
        if self._layout is _MISSING:
            self._layout = _find(self.raw, self.values)
        return self._layout

    def splice(self, body: dict, pieces: bool = False):
        """
        C{body} (this one's values, some top-level members changed, added
        or removed) as the client's bytes with those members written anew
        (orjson, compact).

        @param pieces: give the text as a list of its pieces in order
            (C{bytes}, and C{memoryview}s of the client's bytes), never
            joined, instead of one C{bytes}.
        @return: the bytes (or pieces), or L{None} when the caller must
            encode C{body} whole: no layout, the big member itself
            changed, or a changed member that the big one's bytes could
            override.
        """
        layout = self.layout()
        if layout is None:
            return None
        big, spans, before = layout
        raw, values = self.raw, self.values
        view = memoryview(raw)
        parts = [b"{"]
        check = [k for k in spans if k not in body]
        # Unchanged members that follow each other in the client's bytes
        # go as one piece: the one comma between two of them is the
        # client's (the layout checked it). A member written anew carries
        # its comma; the last one's is cut.
        runStart = runEnd = -1
        try:
            for key, value in body.items():
                span = spans.get(key)
                if span is not None and _same(values[key], value):
                    if runEnd < 0 or span[0] != runEnd + 1:
                        if runEnd >= 0:
                            parts.append(view[runStart:runEnd])
                            parts.append(b",")
                        runStart = span[0]
                    runEnd = span[1]
                    continue
                if key == big:
                    return None
                if span is not None and key in before:
                    check.append(key)
                if runEnd >= 0:
                    parts.append(view[runStart:runEnd])
                    parts.append(b",")
                    runEnd = -1
                parts.append(orjson.dumps(key) + b":" + orjson.dumps(value) + b",")
        except orjson.JSONEncodeError:
            return None
        if big in check:
            return None
        start, end = spans[big]
        for key in check:
            if raw.find(b'"' + key.encode() + b'":', start, end) >= 0:
                return None
        if runEnd >= 0:
            parts.append(view[runStart:runEnd])
        elif len(parts) > 1:
            parts[-1] = parts[-1][:-1]
        parts.append(b"}")
        return parts if pieces else b"".join(parts)


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    return old.__class__ is new.__class__ and old.__class__ in _SCALARS and old == new


def _piece(key: str, value: Any) -> bytes:
    return b'"' + key.encode() + b'":' + orjson.dumps(value)


def _find(raw: bytes, values: dict) -> Optional[tuple]:
    """
    See L{RawObject.layout}.
    """
    keys = list(values)
    big = next((k for k in BIG_MEMBERS if k in values), None)
    if big is None or raw[:1] != b"{" or raw[-1:] != b"}":
        return None
    if not all(_PLAIN_KEY.match(k) for k in keys):
        return None
    at = keys.index(big)
    spans = {}
    try:
        pos = 1
        for key in keys[:at]:
            piece = _piece(key, values[key])
            if not raw.startswith(piece, pos) or raw[pos + len(piece):pos + len(piece) + 1] != b",":
                return None
            spans[key] = (pos, pos + len(piece))
            pos += len(piece) + 1
        end = len(raw) - 1
        for key in reversed(keys[at + 1:]):
            piece = _piece(key, values[key])
            start = end - len(piece)
            if start <= pos or not raw.startswith(piece, start) or raw[start - 1:start] != b",":
                return None
            spans[key] = (start, end)
            end = start - 1
    except orjson.JSONEncodeError:
        return None
    if not raw.startswith(b'"' + big.encode() + b'":', pos, end):
        return None
    spans[big] = (pos, end)
    return big, spans, frozenset(keys[:at])
