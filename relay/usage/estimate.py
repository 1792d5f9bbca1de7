# -*- test-case-name: tests.test_usage_holds,tests.test_usage_drain -*-
"""
relay's own estimate of a turn's tokens, where the upstream's count is not
known: before the turn runs, what a budget reservation assumes
(behaviour.md R108); after it, for a turn whose upstream usage could not be
read (R107: the client left after output and the upstream's terminal event
was cut off or beyond the drain's bounds).

Input is a quarter of the JSON size of what the body gives the model
(C{input}, a bare string counted as the user message it stands for,
C{instructions}, C{messages}, C{tools}): the estimate the bundled emulator
bills by too, a little above OpenAI's count (JSON punctuation stands in for
the per-message framing tokens). Output before the turn is what the request
allows (C{max_output_tokens}; chat C{max_completion_tokens} or
C{max_tokens}), else (or where an account the turn may reach drops that
limit, as OAuth accounts do) the key's C{max_turn_output_tokens}; after it, one
token per delta event relayed (upstream streams one token per C{*.delta}
event), or a quarter of the relayed bytes when no delta was seen, at least
one. A turn counted so carries C{estimated=1}
(L{relay.usage.tokens.TokenCounts.estimated}).
"""


from __future__ import annotations

import json
from typing import Any

from relay.usage.tokens import TokenCounts
from relay.wire.jsoncodec import LARGE_BODY_BYTES

__all__ = [
    "BYTES_PER_TOKEN", "DELTA_MARK", "MAX_TURN_OUTPUT_TOKENS", "estimatedCounts", "inputTokens",
    "outputTokens",
]

BYTES_PER_TOKEN = 4
"""About four bytes of English text or JSON per token."""

DELTA_MARK = b'"delta":'
"""What every output delta carries (C{response.*.delta} events, chat
chunks); inside a JSON string the quotes are escaped, so text never
matches."""

MAX_TURN_OUTPUT_TOKENS = 32000
"""The default of C{keys[].max_turn_output_tokens} (behaviour.md R108)."""

_INPUT_FIELDS = ("input", "instructions", "messages", "tools")

_OUTPUT_FIELDS = ("max_output_tokens", "max_completion_tokens", "max_tokens")




def inputTokens(body: Any, size: int = 0) -> int:
    """
    @param body: the request body (a dict).
    @param size: the client's body in bytes, 0 if not known. Over
        L{LARGE_BODY_BYTES} the estimate is a quarter of it (everything
        but C{input}, C{instructions} and C{tools} is a few hundred bytes
        of such a body), instead of a quarter of the fields re-encoded.
    @return: estimated input tokens, at least 1.
    """
    if not isinstance(body, dict):
        return 1
    if size > LARGE_BODY_BYTES:
        return max(1, size // BYTES_PER_TOKEN)
    size = 0
    for name in _INPUT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "input" and isinstance(value, str):
            value = [{"type": "message", "role": "user", "content": value}]
        if isinstance(value, str):
            size += len(value)
            continue
        try:
            size += len(json.dumps(value, ensure_ascii=False))
        except (TypeError, ValueError):
            continue
    return max(1, size // BYTES_PER_TOKEN)


def outputTokens(body: Any, cap: int | None) -> int:
    """
    @param body: the request body.
    @param cap: the key's C{max_turn_output_tokens}, or L{None} for
        L{MAX_TURN_OUTPUT_TOKENS}.
    @return: the output the turn may produce: the body's limit when it
        gives a positive integer, else C{cap}.
    """
    if isinstance(body, dict):
        for name in _OUTPUT_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return int(cap or MAX_TURN_OUTPUT_TOKENS)


def estimatedCounts(body: Any, deltas: int, relayedBytes: int) -> TokenCounts:
    """
    The estimated counts of one turn (R107).

    @param body: the client's request body.
    @param deltas: output delta events relayed (L{DELTA_MARK} seen).
    @param relayedBytes: bytes of upstream events relayed after the first
        output.
    @return: L{TokenCounts} of one turn with C{estimated=1}.
    """
    output = max(1, deltas or relayedBytes // BYTES_PER_TOKEN)
    return TokenCounts(requests=1, input=inputTokens(body), output=output, estimated=1)
