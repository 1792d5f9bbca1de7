# -*- test-case-name: tests.test_usage_holds -*-
"""
A turn's tokens before it runs (behaviour.md R108): what a budget
reservation assumes.

Input is a quarter of the JSON size of what the body gives the model
(C{input}, a bare string counted as the user message it stands for,
C{instructions}, C{messages}, C{tools}): the estimate the bundled emulator
bills by too, a little above OpenAI's count (JSON punctuation stands in for
the per-message framing tokens); output is what the request allows
(C{max_output_tokens}; chat C{max_completion_tokens} or C{max_tokens}),
else the key's C{max_turn_output_tokens}.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_TURN_OUTPUT_TOKENS", "inputTokens", "outputTokens"]

MAX_TURN_OUTPUT_TOKENS = 32000
"""The default of C{keys[].max_turn_output_tokens} (behaviour.md R108)."""

_INPUT_FIELDS = ("input", "instructions", "messages", "tools")

_OUTPUT_FIELDS = ("max_output_tokens", "max_completion_tokens", "max_tokens")


def inputTokens(body: Any) -> int:
    """
    @param body: the request body (a dict).
    @return: estimated input tokens, at least 1.
    """
    if not isinstance(body, dict):
        return 1
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
    return max(1, size // 4)


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
