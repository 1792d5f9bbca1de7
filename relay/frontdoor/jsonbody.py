# -*- test-case-name: tests.test_intake, tests.test_frontdoor -*-
"""
The JSON reader of every client body and WebSocket frame (L{loadJSON};
the front door's L{relay.frontdoor.parse.readJSON} words its refusal),
below the entry modules that use it (L{relay.entry.body},
L{relay.entry.http}, L{relay.entry.ws}), so none of them imports another
round (the import-circle invariant, tests.test_invariants).
"""

from __future__ import annotations

import json
import re

from relay.wire.jsoncodec import LARGE_BODY_BYTES, NOT_FAST, loads, loadsLarge

__all__ = ["NESTING_MESSAGE", "loadJSON"]

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON C{\\uD800}-C{\\uDFFF} escape: the only way a parsed body can
hold an unpaired surrogate (raw UTF-8 surrogates fail to decode)."""


NESTING_MESSAGE = "The JSON body of your request nests too deeply."

_CONSTANT_WORDS = (b"NaN", b"Infinity")
"""What a text holds when it may hold C{NaN}, C{Infinity} or C{-Infinity}
as a bare value (or only inside a string)."""

_BARE_CONSTANT = re.compile(rb"[\[:,]\s*-?(?:NaN|Infinity)|^\s*-?(?:NaN|Infinity)")
"""Where a bare constant can stand: after C{[}, C{:} or C{,} (or alone).
Text inside a string can match too (C{"x: NaN"}); the second read tells."""


def _refuseConstant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def loadJSON(raw: bytes, shape=None):
    """
    Parse a client's JSON body or WebSocket frame, refusing an unpaired
    UTF-16 surrogate escape (e.g. C{"\\ud800"}): it is not text, it cannot
    be hashed or forwarded as UTF-8, and upstream must never see it
    (found by fuzzing). Paired escapes (emoji written as
    C{"\\ud83d\\ude00"}) are fine. Only bodies that contain a surrogate
    escape pay for the second check.

    C{NaN}, C{Infinity} and C{-Infinity} are refused too (RFC 8259 has no
    such values; C{json.loads} reads them, OpenAI answers them with a
    400): forwarded, they would reach upstream as text it cannot parse,
    after relay had chosen an account and taken a slot. Only a text
    holding one of those words where a value can stand pays for the
    second read.

    @param raw: the bytes.
    @return: the parsed value.
    A body longer than L{LARGE_BODY_BYTES} (a Codex history) is read by
    orjson when that certainly gives C{json.loads}' value
    (L{relay.wire.jsoncodec.loadsLarge}); orjson refuses C{NaN},
    infinities and lone surrogates itself, so such a body skips both
    second checks.

    @param shape: a list that gets C{(containers, pairs, elements)} of a
        large body's value appended when orjson read it
        (L{relay.wire.jsoncodec.loadsLarge}), or L{None}.
    @raise ValueError: for invalid JSON, bad UTF-8, an unpaired surrogate,
        C{NaN} or an infinity, or nesting deeper than the parser's
        recursion limit (L{NESTING_MESSAGE}).
    """
    if len(raw) > LARGE_BODY_BYTES:
        value = loadsLarge(raw, shape)
        if value is not NOT_FAST:
            return value
    try:
        value = loads(raw)  # json.loads, through orjson where it agrees
    except RecursionError:
        # Deep nesting is the client's fault, a 400.
        raise ValueError(NESTING_MESSAGE) from None
    if (_CONSTANT_WORDS[0] in raw or _CONSTANT_WORDS[1] in raw) and _BARE_CONSTANT.search(raw):
        try:
            json.loads(raw, parse_constant=_refuseConstant)
        except RecursionError:
            raise ValueError(NESTING_MESSAGE) from None
    if _ESCAPED_SURROGATE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("unpaired Unicode surrogate") from None
    return value
