# -*- test-case-name: tests.test_jsoncodec -*-
"""
JSON on the turn path, through orjson where it gives what the standard
library gives (a turn reads the client's body, the upstream's
answer or its first events, and writes one request-log record).

L{loads} is C{json.loads} for every input: the same values, the same
errors. orjson reads a text first when it can only agree with the
standard library:

  - orjson reads an integer beyond 64 bits as a float; the standard
    library keeps it exact. A text with a run of 19 or more digits (the
    shortest integer orjson could change) is read by the standard library
    (a digit run inside a string sends it there too: slower, never
    wrong);
  - orjson reads nesting up to 1,024 levels whatever the caller's stack;
    the standard library stops where the interpreter's recursion limit
    does (about 1,000 frames, the caller's included), and relay answers
    that with a 400 (L{relay.frontdoor.jsonbody}). A text with more than
    L{MAX_FAST_BRACKETS} opening brackets is read by the standard
    library;
  - everything orjson refuses (C{NaN}, C{Infinity}, a number out of a
    double's range, a lone surrogate escape, UTF-8 that is not valid, a
    byte-order mark, UTF-16, nesting past its limit) goes to the standard
    library, which accepts it or raises its own error, as before;
  - only C{bytes} of at most L{MAX_FAST_BYTES} take the fast path (the
    checks copy the text once); a C{str} or a longer text goes to the
    standard library.

tests.test_jsoncodec checks the agreement on generated documents and on
mutated texts (hypothesis). L{dumpsRecord} is compact JSON for relay's own
records (read back with L{loads}); it is not used for what goes upstream,
whose bytes stay the standard library's (C{relay.engine.payload}).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

import orjson

__all__ = ["LARGE_BODY_BYTES", "NOT_FAST", "dumpsRecord", "loads", "loadsLarge"]

MAX_FAST_BYTES = 64 * 1024
"""The longest text L{loads} gives orjson (the upstream's answers and
events, small client bodies): the checks below copy it once, which a
client body of up to 64 MiB should not cost; a longer text nearly always
holds more than L{MAX_FAST_BRACKETS} brackets anyway."""

MAX_FAST_BRACKETS = 128
"""Opening brackets (C{[} and C{{}) a text may hold and still be read by
orjson: it then nests at most this deep, which the standard library reads
too unless the caller is more than ~870 frames deep."""

_FOLD = bytes.maketrans(b"123456789{", b"000000000[")
_LONG_DIGIT_RUN = b"0" * 19
"""After C{_FOLD} every digit is a C{0} and no other byte is, and every
opening bracket a C{[}: a run of 19 digits is a run of 19 zeros. Integers
of up to 18 digits are below 2**63, exact in orjson."""

_orjsonLoads = orjson.loads
_orjsonRefusals = (orjson.JSONDecodeError, RecursionError)
_stdlibLoads = json.loads


def loads(data: Any) -> Any:
    """
    Parse JSON exactly as C{json.loads(data)}.

    @param data: C{bytes} (the fast path) or anything C{json.loads}
        takes.
    @return: the parsed value.
    @raise ValueError: C{json.JSONDecodeError} or C{UnicodeDecodeError}
        for what the standard library refuses, with its message.
    @raise RecursionError: for nesting the standard library cannot read.
    """
    if data.__class__ is bytes and len(data) <= MAX_FAST_BYTES:
        folded = data.translate(_FOLD)
        if folded.find(_LONG_DIGIT_RUN) < 0 and folded.count(91) <= MAX_FAST_BRACKETS:
            try:
                return _orjsonLoads(data)
            except _orjsonRefusals:
                pass
    return _stdlibLoads(data)


LARGE_BODY_BYTES = 16 * 1024
"""A client body longer than this (a Codex history: 20 KiB a turn) is read
by L{loadsLarge} (L{relay.frontdoor.jsonbody.loadJSON}), kept as its bytes
and spliced upstream (L{relay.wire.rawjson}), its tokens estimated from its
length (L{relay.usage.estimate.inputTokens})."""

MAX_FAST_DEPTH = 256
"""The deepest nesting L{loadsLarge} keeps orjson's reading of: far below
where the standard library (about 1,000 frames, the caller's included) or
orjson (1,024 levels, its own limit since 3.9) stops, so both read it
alike."""

LARGE_FLOAT = 1e18
"""A float at least this large (either sign) may be an integer of 19 or
more digits that orjson read as a float (the standard library keeps such an
integer exact); a text whose value holds one is looked at again."""

NOT_FAST = object()
"""What L{loadsLarge} returns for a text it leaves to L{loads}."""


def _shape(value: Any, depth: int = 1) -> Optional[tuple]:
    """
    One pass over C{value}'s containers (strings and numbers are looked at,
    never read): how deep it nests, what it holds.

    @return: L{None} when it nests deeper than L{MAX_FAST_DEPTH}, else
        C{(containers, pairs, elements, large float, wide)}: the dicts and
        lists, the dicts' pairs and the lists' elements in all, whether a
        float of at least L{LARGE_FLOAT} is among them, and the bytes
        the strings (keys and values) that are not ASCII take (such a
        string holds 2 or 4 bytes a character: C{"\U0001f600"} and a
        megabyte of C{a} take 4 MiB, its text 1 MiB; R103).
    """
    dictType, listType, floatType, strType = dict, list, float, str
    large = LARGE_FLOAT
    sizeof = sys.getsizeof
    if value.__class__ is not dictType and value.__class__ is not listType:
        return (0, 0, 0, value.__class__ is floatType and not -large < value < large,
                sizeof(value) if value.__class__ is strType and not value.isascii() else 0)
    stack = [(value, depth)]
    pop, push = stack.pop, stack.append
    containers = pairs = elements = wide = 0
    floats = False
    while stack:
        node, depth = pop()
        if depth > MAX_FAST_DEPTH:
            return None
        containers += 1
        if node.__class__ is dictType:
            pairs += len(node)
            for key in node:
                if not key.isascii():
                    wide += sizeof(key)
            children = node.values()
        else:
            elements += len(node)
            children = node
        for child in children:
            kind = child.__class__
            if kind is dictType or kind is listType:
                push((child, depth + 1))
            elif kind is floatType and not -large < child < large:
                floats = True
            elif kind is strType and not child.isascii():
                wide += sizeof(child)
    return containers, pairs, elements, floats, wide


def loadsLarge(data: bytes, shape: Optional[list] = None, depth: int = 1) -> Any:
    """
    Parse a large client body (more than L{LARGE_BODY_BYTES}) through orjson
    when orjson's reading is certainly C{json.loads}' (a Codex history of
    1 MiB: one orjson pass and one pass over its containers, instead of
    the standard library's three times slower parse):

      - orjson refuses the text (C{NaN}, an infinity, a lone surrogate
        escape, nesting past its own limit of 1,024 levels, anything else
        it does not read): L{NOT_FAST};
      - the value nests deeper than L{MAX_FAST_DEPTH}: L{NOT_FAST} (the
        standard library decides, with its own recursion limit);
      - it holds a float of at least L{LARGE_FLOAT} and the text a run of
        19 or more digits (an integer beyond 64 bits orjson would read as
        a float): L{NOT_FAST}.

    Since orjson refuses C{NaN}, infinities and lone surrogate escapes, a
    value returned here needs none of the checks of
    L{relay.frontdoor.jsonbody.loadJSON} that look for them.

    @param data: C{bytes}.
    @param shape: a list that gets C{(containers, pairs, elements)} of the
        value appended, and the bytes of its strings that are not ASCII as a
        fourth when there are some (L{_shape}; for
        L{relay.frontdoor.budgets.shapeEstimate}), or L{None}.
    @param depth: the nesting level of the text's value (1: a whole body;
        2: the elements of a body's member, L{relay.frontdoor.reuse}).
    @return: the value C{json.loads(data)} gives, or L{NOT_FAST} when the
        caller must use L{loads}.
    """
    if data.__class__ is not bytes:
        return NOT_FAST
    try:
        value = _orjsonLoads(data)
    except _orjsonRefusals:
        return NOT_FAST
    found = _shape(value, depth)
    if found is None:
        return NOT_FAST
    if found[3] and data.translate(_FOLD).find(_LONG_DIGIT_RUN) >= 0:
        return NOT_FAST
    if shape is not None:
        shape.append(found[:3] + found[4:] if found[4] else found[:3])
    return value



def _asText(value: Any) -> str:
    return str(value)


def dumpsRecord(value: Any, default: Callable[[Any], Any] = _asText) -> str:
    """
    Compact JSON text for one of relay's stored records (a request-log
    row): keys in insertion order, non-ASCII text as UTF-8 rather than
    C{\\u} escapes, a non-finite float as C{null} (a record holds
    none). Values orjson cannot write (an integer beyond 64 bits, a
    non-string key) take the standard library's
    C{json.dumps(value, separators=(",", ":"), default=default)}.

    @param value: JSON-ready values; others go through C{default}.
    @param default: turns any other value into one (C{str} by default).
    @return: the text.
    """
    try:
        return orjson.dumps(value, default=default).decode("utf-8")
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=default)
