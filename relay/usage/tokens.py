# -*- test-case-name: tests.test_usage -*-
"""
Token counts, and reading them from what upstream sent.

Responses (protocol.md 2.5, 2.7) report C{usage} on the terminal event's
C{response} (C{response.completed}, C{response.incomplete},
C{response.failed}) and in a non-stream JSON body::

    {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 100},
     "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 12},
     "total_tokens": 150}

Chat Completions (protocol.md 3) report C{usage} in a non-stream body and,
with C{stream_options.include_usage}, in one last chunk with C{choices: []}::

    {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 100},
     "completion_tokens": 30, "completion_tokens_details": {"reasoning_tokens": 12},
     "total_tokens": 150}

Cached tokens are part of the input, reasoning tokens part of the output,
as upstream counts them; L{TokenCounts.total} is input + output.
"""

from __future__ import annotations

import re
from typing import Any

from attrs import evolve, field, frozen

__all__ = [
    "USAGE_CHUNK",
    "TokenCounts",
    "fromBody",
    "fromEvent",
    "fromUsage",
    "served",
    "HOSTED_TOOLS",
    "hostedTool",
]


def _count(value: Any) -> int:
    """
    A token count from JSON: a non-negative integer, else 0.
    """
    if value.__class__ is int:
        # What JSON gives (the general path below agrees).
        return value if value > 0 else 0  # noqa: FURB136 - max() is a call more
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return max(0, int(value))


@frozen
class TokenCounts:
    """
    Tokens of one or more turns.

    @ivar requests: how many turns reported usage.
    @ivar input: input (prompt) tokens, cached ones included.
    @ivar cached: cached input tokens.
    @ivar output: output (completion) tokens, reasoning ones included.
    @ivar reasoning: reasoning tokens.
    """

    requests: int = 0
    input: int = 0
    cached: int = 0
    output: int = 0
    reasoning: int = 0
    cost: int = 0
    """The cost of the priced turns among these, nano-dollars
    (L{relay.tenants.prices}); 0 until priced."""
    unpriced: int = 0
    """How many of these turns ran on a model without a price
    (their cost is unknown, never zero)."""
    estimated: int = 0
    """How many of these turns were counted from relay's estimate, not the
    upstream's usage (behaviour.md R107: the client left and the upstream's
    terminal event could not be read)."""
    tier: str | None = field(default=None, eq=False)
    """R109: the C{service_tier} the response reports (one turn's; not
    summed), or L{None}."""
    tools: tuple = field(default=(), eq=False)
    """R109: C{(hosted tool, calls)} pairs the response reports (one
    turn's; not summed), e.g. C{(("web_search", 2),)}."""

    @property
    def total(self) -> int:
        """
        Input plus output tokens (what a token budget counts).
        """
        return self.input + self.output

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(
            self.requests + other.requests,
            self.input + other.input,
            self.cached + other.cached,
            self.output + other.output,
            self.reasoning + other.reasoning,
            self.cost + other.cost,
            self.unpriced + other.unpriced,
            self.estimated + other.estimated,
        )

    def asDict(self) -> dict:
        """
        @return: the counts under the names C{/admin/usage} serves:
            C{requests}, C{input_tokens}, C{cached_input_tokens},
            C{output_tokens}, C{reasoning_tokens}, C{total_tokens},
            C{cost_usd} (the priced turns' cost in dollars) and
            C{unpriced_requests} (turns on a model without a price, whose
            cost C{cost_usd} does not include), and C{estimated_requests}
            (R107: turns counted from relay's estimate).
        """
        return {
            "requests": self.requests,
            "input_tokens": self.input,
            "cached_input_tokens": self.cached,
            "output_tokens": self.output,
            "reasoning_tokens": self.reasoning,
            "total_tokens": self.total,
            "cost_usd": round(self.cost / 1e9, 9),
            "unpriced_requests": self.unpriced,
            "estimated_requests": self.estimated,
        }


def fromUsage(usage: Any) -> TokenCounts | None:
    """
    Read a Responses or Chat Completions C{usage} object.

    @param usage: the parsed C{usage} value.
    @return: the counts of one turn, or L{None} when C{usage} is not a
        usage object (absent, C{null}, or neither shape).
    """
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "output_tokens" in usage:
        inputDetails = usage.get("input_tokens_details")
        outputDetails = usage.get("output_tokens_details")
        inputKey, outputKey = "input_tokens", "output_tokens"
    elif "prompt_tokens" in usage or "completion_tokens" in usage:
        inputDetails = usage.get("prompt_tokens_details")
        outputDetails = usage.get("completion_tokens_details")
        inputKey, outputKey = "prompt_tokens", "completion_tokens"
    else:
        return None
    inputDetails = inputDetails if isinstance(inputDetails, dict) else {}
    outputDetails = outputDetails if isinstance(outputDetails, dict) else {}
    return TokenCounts(
        requests=1,
        input=_count(usage.get(inputKey)),
        cached=_count(inputDetails.get("cached_tokens")),
        output=_count(usage.get(outputKey)),
        reasoning=_count(outputDetails.get("reasoning_tokens")),
    )


HOSTED_TOOLS = ("web_search", "file_search", "code_interpreter", "image_generation")
"""The hosted tools priced per call (R109): a request's C{tools[].type}
(C{web_search_preview...} counts as C{web_search}) and a response's
C{<tool>_call} output items."""


def hostedTool(kind) -> str | None:
    """
    The hosted tool a request's tool type or a response's output item type
    names (R109).

    @param kind: a C{tools[].type} (C{web_search}, C{web_search_preview},
        C{image_generation}, ...) or an output item C{type}
        (C{web_search_call}, ...).
    @return: one of L{HOSTED_TOOLS}, or L{None} (a function or custom tool,
        not billed by the call).
    """
    if not isinstance(kind, str):
        return None
    if kind.endswith("_call"):
        kind = kind[: -len("_call")]
    if kind.startswith("web_search"):
        return "web_search"
    return kind if kind in HOSTED_TOOLS else None


IMAGES = "images"
"""The head of the name an image turn's images are counted under in
L{TokenCounts.tools} (R109, R115): C{images}, C{images:<quality>},
C{images:<quality>:<size>} or C{images::<size>}; priced per image
(L{relay.tenants.prices.PriceTable})."""


def imagesTool(body: Any) -> str:
    """
    The L{TokenCounts.tools} name of an images request's images: L{IMAGES}
    with its C{quality} and C{size} when given (C{auto} is no value).

    @param body: the images request (JSON or form fields).
    """
    parts = [IMAGES]
    for name in ("quality", "size"):
        value = body.get(name) if isinstance(body, dict) else None
        parts.append(value if isinstance(value, str) and value and value != "auto" else "")
    return ":".join(parts).rstrip(":")


def requestedImages(body: Any) -> int:
    """
    The images an images request asks for: its C{n} (a JSON integer or a
    form field's digits) from 1 to 10, else 1.
    """
    value = body.get("n") if isinstance(body, dict) else None
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 10:
        return value
    return 1


def mediaCounts(turn: Any, parsed: Any, counts: TokenCounts | None) -> TokenCounts | None:
    """
    The usage of an embeddings or images answer (R115). Embeddings: its
    C{usage} (C{prompt_tokens}: input). Images: its C{usage} when it has
    one (C{gpt-image-*}), else one request of no tokens, with the images
    of C{data} under L{imagesTool} of the quality and size the answer
    reports (else the request's; priced per image as served, R109).

    @param turn: the turn (C{endpoint}, C{body}).
    @param parsed: the answer's parsed body.
    @param counts: what L{fromBody} read of it, or L{None}.
    """
    if turn.endpoint == "embeddings" or not isinstance(parsed, dict):
        return counts
    data = parsed.get("data")
    images = len(data) if isinstance(data, list) else 0
    base = counts if counts is not None else TokenCounts(requests=1)
    # R109: priced as served: the answer's quality and size (an "auto" or
    # absent request is served at the quality the upstream chose) win
    # over the request's
    asked = turn.body if isinstance(turn.body, dict) else {}
    servedAs = {name: parsed[name] for name in ("quality", "size")
                if isinstance(parsed.get(name), str) and parsed[name]}
    return evolve(base, tools=((imagesTool(dict(asked, **servedAs)), images),) if images else ())


def imageCalls(counts: TokenCounts, body: Any) -> TokenCounts:
    """
    R109, R115: an images turn served through the Responses
    C{image_generation} tool (an OAuth account) counts its tool calls as
    images (L{imagesTool}), priced per image rather than per tool call.
    """
    calls = sum(n for tool, n in counts.tools if tool == "image_generation")
    if not calls:
        return counts
    rest = tuple(t for t in counts.tools if t[0] != "image_generation")
    return evolve(counts, tools=rest + ((imagesTool(body), calls),))


def served(counts: TokenCounts | None, response: Any) -> TokenCounts | None:
    """
    R109: C{counts} with what the response reports about how it was
    served: its C{service_tier} and its hosted-tool calls (output items of
    type C{web_search_call}, C{file_search_call}, C{code_interpreter_call},
    C{image_generation_call}).

    @param counts: the turn's counts, or L{None}.
    @param response: a Responses C{response} object or a chat completion
        (chunk), parsed.
    """
    if counts is None or not isinstance(response, dict):
        return counts
    tier = response.get("service_tier")
    tier = tier if isinstance(tier, str) and tier not in ("default", "auto") else None
    calls: dict = {}
    output = response.get("output")
    if isinstance(output, list):
        for item in output:
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind.endswith("_call"):
                tool = hostedTool(kind)
                if tool is not None:
                    calls[tool] = calls.get(tool, 0) + 1
    if tier is None and not calls:
        return counts
    return evolve(counts, tier=tier, tools=tuple(sorted(calls.items())))


def fromEvent(event) -> TokenCounts | None:
    """
    The usage a stream event carries: a Responses terminal event's
    C{response.usage}, or a chat chunk's top-level C{usage}.

    @param event: a L{relay.wire.sse.Event}.
    @return: the counts, or L{None} (C{[DONE]}, no usage, not JSON).
    """
    if event.type == b"[DONE]":
        return None
    parsed = event.json()
    if not isinstance(parsed, dict):
        return None
    response = parsed.get("response")
    if isinstance(response, dict) and "usage" in response:
        return served(fromUsage(response.get("usage")), response)
    return served(fromUsage(parsed.get("usage")), parsed)


def fromBody(parsed: Any) -> TokenCounts | None:
    """
    The usage of a non-stream JSON answer (a Responses C{response} object
    or a C{chat.completion}).

    @param parsed: the parsed body.
    @return: the counts, or L{None}.
    """
    if not isinstance(parsed, dict):
        return None
    return served(fromUsage(parsed.get("usage")), parsed)


USAGE_CHUNK = re.compile(rb'"usage":\s*\{')
"""A chat chunk that carries a usage object (not C{"usage":null}); scanned
on the pass-through path instead of parsing every chunk. Inside a JSON
string the quotes are escaped, so text never matches."""
