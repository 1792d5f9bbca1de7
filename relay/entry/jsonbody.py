# -*- test-case-name: tests.test_intake -*-
"""
The JSON reader of every client body and WebSocket frame (L{loadJSON}),
below the entry modules that use it (L{relay.entry.body},
L{relay.entry.http}, L{relay.entry.ws}), so none of them imports another
round (the import-circle invariant, tests.test_invariants).
"""

from __future__ import annotations

import json
import re

from relay.jsoncodec import loads

__all__ = ["NESTING_MESSAGE", "loadJSON"]

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON C{\\uD800}-C{\\uDFFF} escape: the only way a parsed body can
hold an unpaired surrogate (raw UTF-8 surrogates fail to decode)."""


NESTING_MESSAGE = "The JSON body of your request nests too deeply."


def loadJSON(raw: bytes):
    """
    Parse a client's JSON body or WebSocket frame, refusing an unpaired
    UTF-16 surrogate escape (e.g. C{"\\ud800"}): it is not text, it cannot
    be hashed or forwarded as UTF-8, and upstream must never see it
    (found by issue 14's fuzzing). Paired escapes (emoji written as
    C{"\\ud83d\\ude00"}) are fine. Only bodies that contain a surrogate
    escape pay for the second check.

    @param raw: the bytes.
    @return: the parsed value.
    @raise ValueError: for invalid JSON, bad UTF-8, an unpaired surrogate
        or nesting deeper than the parser's recursion limit
        (L{NESTING_MESSAGE}, issue 19 item 3).
    """
    try:
        value = loads(raw)  # json.loads, through orjson where it agrees (issue 24)
    except RecursionError:
        # Issue 19 item 3: deep nesting is the client's fault, a 400.
        raise ValueError(NESTING_MESSAGE) from None
    if _ESCAPED_SURROGATE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("unpaired Unicode surrogate") from None
    return value
