# -*- test-case-name: tests.test_usage_drain -*-
"""
relay's own estimate of a turn's tokens, for a turn whose upstream usage
could not be read (behaviour.md R107: the client left after output and the
upstream's terminal event was cut off or beyond the drain's bounds).

Input comes from the request: a quarter of the JSON size of what the model
reads (C{instructions} and C{input} of a Responses body, C{messages} of a
chat body), the rule of thumb of about four bytes per token. Output comes
from what was relayed: one token per delta event (upstream streams one
token per C{*.delta} event), or a quarter of the relayed bytes when no
delta was seen; at least one token. A turn counted so carries
C{estimated=1} (L{relay.usage.tokens.TokenCounts.estimated}).
"""

from __future__ import annotations

import json
from typing import Any

from relay.usage.tokens import TokenCounts

__all__ = ["BYTES_PER_TOKEN", "DELTA_MARK", "estimateInput", "estimatedCounts"]

BYTES_PER_TOKEN = 4
"""About four bytes of English text or JSON per token."""

DELTA_MARK = b'"delta":'
"""What every output delta carries (C{response.*.delta} events, chat
chunks); inside a JSON string the quotes are escaped, so text never
matches."""


def _size(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    try:
        return len(json.dumps(value, separators=(",", ":")))
    except (TypeError, ValueError):
        return len(repr(value))


def estimateInput(body: Any) -> int:
    """
    The input tokens a request's body is estimated to cost.

    @param body: the client's request body (a Responses or chat body).
    @return: tokens, at least 1 for a body with anything to read.
    """
    if not isinstance(body, dict):
        return 0
    size = sum(_size(body.get(name)) for name in ("instructions", "input", "messages", "tools"))
    return max(1, size // BYTES_PER_TOKEN) if size else 0


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
    return TokenCounts(requests=1, input=estimateInput(body), output=output, estimated=1)
