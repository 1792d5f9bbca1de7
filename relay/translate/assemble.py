# -*- test-case-name: tests.test_translate -*-
"""
Assembling one answer from a stream (protocol.md 2.7, 3).

  - L{ResponseAssembler}: the ChatGPT backend's C{response.completed}
    carries C{output: []}; the items came earlier, one per
    C{response.output_item.done}. A non-streaming C{/v1/responses} client
    on an OAuth account gets C{output} rebuilt from those events, in
    C{output_index} order.
  - L{chatCompletion}: the C{chat.completion} object of a non-streaming
    chat client, folded from the chunks L{relay.translate.chatstream}
    produced, so streaming and non-streaming chat answers cannot drift.
"""

from __future__ import annotations

from typing import Optional


class ResponseAssembler:
    """
    Collects the items of C{response.output_item.done} events and completes
    a terminal response whose C{output} is empty.
    """

    def __init__(self):
        self._items: dict = {}

    def add(self, event: dict) -> None:
        """
        Note one event; only C{response.output_item.done} matters.

        @param event: the parsed event.
        """
        if event.get("type") != "response.output_item.done":
            return
        item = event.get("item")
        if not isinstance(item, dict):
            return
        index = event.get("output_index")
        if not isinstance(index, int):
            index = max(self._items) + 1 if self._items else 0
        self._items[index] = item

    def complete(self, response: dict) -> dict:
        """
        The terminal C{response} with C{output} filled from the collected
        items when it came empty; unchanged otherwise.

        @param response: the terminal event's C{response} object.
        @return: C{response} itself, or a copy with C{output} set.
        """
        if response.get("output") or not self._items:
            return response
        return {**response, "output": [self._items[i] for i in sorted(self._items)]}


def chatCompletion(chunks: list, usage: Optional[dict] = None) -> dict:
    """
    Fold chat chunks into the non-streaming C{chat.completion} object
    (protocol.md 3 "Non-stream response").

    @param chunks: the C{chat.completion.chunk} dicts of one turn, in order.
    @param usage: the chat usage, or L{None} (then the usage chunk's, if any).
    @return: C{{id, object, created, model, choices: [{index, message,
        logprobs, finish_reason}], usage}}.
    """
    text, refusal, calls = [], [], {}
    finish = None
    head = chunks[0] if chunks else {}
    for chunk in chunks:
        if chunk.get("usage") and usage is None:
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text.append(delta["content"])
            if delta.get("refusal"):
                refusal.append(delta["refusal"])
            for call in delta.get("tool_calls") or []:
                _foldCall(calls, call)
    message: dict = {
        "role": "assistant",
        "content": "".join(text) if text or not calls else None,
        "refusal": "".join(refusal) or None,
    }
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {
        "id": head.get("id"),
        "object": "chat.completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish or "stop"}
        ],
        "usage": usage,
    }


def _foldCall(calls: dict, delta: dict) -> None:
    """
    Add one C{tool_calls} delta to the call it belongs to (by C{index}).
    """
    index = delta.get("index", 0)
    kind = delta.get("type") or ("custom" if "custom" in delta else "function")
    call = calls.get(index)
    if call is None:
        field = "arguments" if kind == "function" else "input"
        call = calls[index] = {"id": None, "type": kind, kind: {"name": None, field: ""}}
    if delta.get("id"):
        call["id"] = delta["id"]
    body = delta.get(call["type"]) or {}
    target = call[call["type"]]
    if body.get("name"):
        target["name"] = body["name"]
    for field in ("arguments", "input"):
        if body.get(field):
            target[field] = target.get(field, "") + body[field]
