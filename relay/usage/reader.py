# -*- test-case-name: tests.test_usage -*-
"""
Where the turn engine reads usage: one L{UsageTap} per upstream attempt.

The stream pump hands the tap the one event that ends the turn (the
terminal event, which it already singles out on its pass-through path) and,
on Chat Completions streams, the chunk that carries C{usage}; it never
parses other events for usage. A turn is counted once: only the attempt
that wrote the terminal event to the client reaches the tap's terminal
(attempts that failed over before output never do), and the tap ignores
anything after its first count.

Chat Completions streams carry usage only with
C{stream_options.include_usage} (protocol.md 3). relay therefore always asks
upstream for it (L{relay.engine.payload.upstreamBody}) and, when the client
did not ask, drops the usage chunk (C{choices: []}) after reading it; the
other chunks then carry C{"usage": null}, which the format allows.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from attrs import define
from twisted.logger import Logger

from relay.usage.tokens import USAGE_CHUNK, TokenCounts, fromEvent

__all__ = ["CHAT_MARK", "HostedCallWatch", "UsageTap", "clientAskedUsage"]

CHAT_MARK = re.compile(rb"\[DONE\]|" + USAGE_CHUNK.pattern)
"""What the pass-through of a chat stream must not write blindly: the end
marker, or a chunk that carries usage."""


def clientAskedUsage(body: dict) -> bool:
    """
    Whether a chat request asked for the usage chunk itself.

    @param body: the client's request body.
    """
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


@define(eq=False)
class UsageTap:
    """
    Reads the usage of one attempt, at most once.

    @ivar record: called with the L{TokenCounts} once found.
    @ivar chat: the attempt streams Chat Completions chunks.
    @ivar dropUsageChunk: drop the chat usage chunk (the client did not
        ask for it).
    @ivar requestId: the turn's request id, for logs.
    @ivar counted: the counts recorded, once recorded.
    """

    record: Callable[[TokenCounts], None]
    chat: bool = False
    dropUsageChunk: bool = False
    requestId: str = ""
    counted: TokenCounts | None = None
    _log = Logger()

    @property
    def mark(self) -> re.Pattern | None:
        """
        The pattern the pass-through must hand to the event path besides
        terminal events, or L{None} (Responses: the terminal mark is enough).
        """
        return CHAT_MARK if self.chat else None

    def terminal(self, event) -> None:
        """
        The turn's terminal event reached the client: count its usage.

        @param event: the L{relay.wire.sse.Event}.
        """
        self._count(event)

    def chunk(self, event) -> bool:
        """
        A chat chunk about to be written: count it if it carries usage.

        @param event: the L{relay.wire.sse.Event}.
        @return: L{True} when the chunk must not be written (a usage chunk
            the client did not ask for).
        """
        if USAGE_CHUNK.search(event.data) is None:
            return False
        self._count(event)
        parsed = event.json()
        return self.dropUsageChunk and parsed.get("choices") == []

    def _count(self, event) -> None:
        if self.counted is not None:
            return
        try:
            counts = fromEvent(event)
            if counts is None:
                return
            self.counted = counts
            self.record(counts)
        except Exception:  # noqa: BLE001 - accounting never breaks a stream
            self._log.failure(
                "reading usage failed", event="relay.usage_failed", request_id=self.requestId
            )


_ITEM_DONE = b"response.output_item.done"


class HostedCallWatch:
    """
    A sink in front of the turn's sink that counts the hosted-tool calls
    (R109) the answer reports in its C{response.output_item.done} events:
    the ChatGPT backend's terminal event carries C{output: []}, so the
    calls are only there. Put in front only for a key with a money budget
    whose request offers a hosted tool (the raw pass-through is off for
    it); the counts go to C{calls}, read when the usage is recorded
    (L{relay.engine.runner.TurnRunner.recordUsage}).

    @ivar calls: hosted tool -> calls seen.
    """

    def __init__(self, inner, calls: dict):
        self._inner = inner
        self.calls = calls

    def __getattr__(self, name):
        if name == "writeRaw":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def writeEvent(self, event) -> None:
        if event.type == _ITEM_DONE:
            from relay.usage.tokens import hostedTool

            try:
                item = event.json().get("item")
                kind = item.get("type") if isinstance(item, dict) else None
                tool = hostedTool(kind) if isinstance(kind, str) and kind.endswith("_call") \
                    else None
                if tool is not None:
                    self.calls[tool] = self.calls.get(tool, 0) + 1
            except Exception:  # noqa: BLE001 - accounting never breaks a stream
                Logger().failure("reading a hosted-tool call failed", event="relay.usage_failed")
        self._inner.writeEvent(event)
