# -*- test-case-name: tests.test_anthropic -*-
"""
Responses stream events become Anthropic Messages stream events
(protocol.md 10 "Stream", behaviour.md R115).

The events, in order: C{message_start} (the message with empty content and
zero usage) and one C{ping}, then per content block C{content_block_start},
C{content_block_delta}s and C{content_block_stop}: a C{text} block per
output message (C{text_delta}; refusals are text too), a C{tool_use} block
per C{function_call} (its C{id} is the upstream C{call_id} unchanged,
C{input_json_delta} fragments), and, when the client enabled thinking, a
C{thinking} block per reasoning item with summary text (C{thinking_delta},
then one C{signature_delta}: L{SIGNATURE_PREFIX} and the encrypted
reasoning) or a C{redacted_thinking} block for one with only encrypted
content; then C{message_delta} (C{stop_reason}, C{stop_sequence}, the
usage) and C{message_stop}.

C{stop_sequences} are applied here: text that could begin a stop sequence
is held back until it cannot; a sequence found ends the text there, and the
rest of the upstream answer is not shown (C{stop_reason:
stop_sequence}). C{stop_reason} is otherwise C{tool_use} (a tool was
called), C{max_tokens} (C{response.incomplete} for C{max_output_tokens}),
C{refusal} (for C{content_filter}) or C{end_turn}.

Usage: C{input_tokens} is the upstream's less its cached tokens, which are
C{cache_read_input_tokens}; C{cache_creation_input_tokens} is 0.

A failed turn (C{response.failed}, an C{error} event) produces no event;
L{MessagesTranslator.error} holds the error (the sink writes it).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from relay.translate.anthropic.request import SIGNATURE_PREFIX, MessagesContext
from relay.translate.chatstream import TERMINAL, _errorOf


def anthropicUsage(usage: Optional[dict]) -> dict:
    """
    A Responses C{usage} in the Messages form.

    @return: C{input_tokens}, C{output_tokens}, C{cache_creation_input_tokens},
        C{cache_read_input_tokens}.
    """
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("input_tokens_details")
    total = _count(usage.get("input_tokens"))
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return {
        "input_tokens": max(0, total - cached),
        "output_tokens": _count(usage.get("output_tokens")),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _str(value) -> str:
    return value if isinstance(value, str) else ""


class _Block:
    __slots__ = ("index", "kind", "sent", "pending", "open")

    def __init__(self, index: int, kind: str):
        self.index = index
        self.kind = kind
        self.sent = ""
        self.pending = ""
        self.open = True


class MessagesTranslator:
    """
    Turns the Responses events of one turn into Messages events, one event
    at a time (see the module docstring).

    @ivar finished: a terminal event was fed.
    @ivar error: the C{{code, message, ...}} of a failed turn, or L{None}.
    @ivar stopReason: the C{stop_reason}, once finished.
    """

    def __init__(self, context: MessagesContext):
        self._context = context
        self._id: Optional[str] = None
        self._started = False
        self._blocks: dict = {}  # item key -> _Block
        self._keys: dict = {}  # item id -> item key
        self._count = 0
        self._tools = False
        self._stopped: Optional[str] = None  # the stop sequence met
        self._refused = False
        self.finished = False
        self.error: Optional[dict] = None
        self.stopReason: Optional[str] = None

    @property
    def messageId(self) -> str:
        if self._id is None:
            self._id = "msg_" + os.urandom(12).hex()
        return self._id

    # -- blocks ---------------------------------------------------------------

    def _start(self, out: list) -> None:
        if self._started:
            return
        self._started = True
        out.append(("message_start", {"type": "message_start", "message": {
            "id": self.messageId, "type": "message", "role": "assistant",
            "model": self._context.model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": anthropicUsage(None)}}))
        out.append(("ping", {"type": "ping"}))

    def _key(self, event: dict, item: Optional[dict] = None):
        itemId = (item or {}).get("id") or event.get("item_id")
        itemId = itemId if isinstance(itemId, str) else None
        index = event.get("output_index")
        index = index if isinstance(index, int) else None
        if index is None:
            return self._keys.get(itemId, itemId)
        if itemId is not None:
            self._keys[itemId] = index
        return index

    def _open(self, out: list, key, kind: str, head: dict) -> Optional[_Block]:
        block = self._blocks.get(key)
        if block is not None:
            return block if block.open else None
        if self._stopped is not None:
            return None
        block = self._blocks[key] = _Block(self._count, kind)
        self._count += 1
        self._start(out)
        out.append(("content_block_start", {"type": "content_block_start",
                                            "index": block.index, "content_block": head}))
        return block

    def _delta(self, out: list, block: _Block, delta: dict) -> None:
        out.append(("content_block_delta", {"type": "content_block_delta",
                                            "index": block.index, "delta": delta}))

    def _close(self, out: list, block: Optional[_Block]) -> None:
        if block is None or not block.open:
            return
        if block.kind == "text" and block.pending:
            self._delta(out, block, {"type": "text_delta", "text": block.pending})
            block.sent += block.pending
            block.pending = ""
        block.open = False
        out.append(("content_block_stop", {"type": "content_block_stop", "index": block.index}))

    # -- text and stop sequences -----------------------------------------------

    def _text(self, out: list, key, delta: str) -> None:
        if not delta or self._stopped is not None:
            return
        block = self._open(out, key, "text", {"type": "text", "text": ""})
        if block is None:
            return
        text = block.pending + delta
        found = None
        for stop in self._context.stopSequences:
            at = text.find(stop)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            before = text[:found[0]]
            if before:
                self._delta(out, block, {"type": "text_delta", "text": before})
                block.sent += before
            block.pending = ""
            self._stopped = found[1]
            for other in self._blocks.values():
                self._close(out, other)
            return
        hold = _heldBack(text, self._context.stopSequences)
        send = text[:len(text) - hold]
        block.pending = text[len(text) - hold:]
        if send:
            self._delta(out, block, {"type": "text_delta", "text": send})
            block.sent += send

    def _textRemainder(self, out: list, key, full: Optional[str]) -> None:
        block = self._blocks.get(key)
        seen = (block.sent + block.pending) if block is not None else ""
        if isinstance(full, str) and full.startswith(seen) and len(full) > len(seen):
            self._text(out, key, full[len(seen):])

    # -- tools and thinking -------------------------------------------------------

    def _toolBlock(self, out: list, key, item: dict) -> Optional[_Block]:
        self._tools = True
        return self._open(out, key, "tool_use", {
            "type": "tool_use", "id": item.get("call_id") or item.get("id"),
            "name": item.get("name"), "input": {}})

    def _args(self, out: list, block: Optional[_Block], fragment: str) -> None:
        if block is None or not block.open or not fragment:
            return
        block.sent += fragment
        self._delta(out, block, {"type": "input_json_delta", "partial_json": fragment})

    def _argsRemainder(self, out: list, block: Optional[_Block], full) -> None:
        if block is None or not isinstance(full, str) or not full.startswith(block.sent):
            return
        self._args(out, block, full[len(block.sent):])

    def _thinking(self, out: list, key, delta: str) -> None:
        if not self._context.thinking or not delta:
            return
        block = self._open(out, key, "thinking",
                           {"type": "thinking", "thinking": "", "signature": ""})
        if block is not None and block.open:
            block.sent += delta
            self._delta(out, block, {"type": "thinking_delta", "thinking": delta})

    def _reasoningDone(self, out: list, key, item: dict) -> None:
        if not self._context.thinking:
            return
        secret = item.get("encrypted_content")
        block = self._blocks.get(key)
        if block is None:
            summary = item.get("summary")
            text = "".join(_str(p.get("text")) for p in (
                summary if isinstance(summary, list) else []) if isinstance(p, dict))
            if text:
                self._thinking(out, key, text)
                block = self._blocks.get(key)
            elif isinstance(secret, str) and secret:
                block = self._open(out, key, "redacted_thinking", {
                    "type": "redacted_thinking", "data": SIGNATURE_PREFIX + secret})
                self._close(out, block)
                return
        if block is not None and block.open and block.kind == "thinking":
            if isinstance(secret, str) and secret:
                self._delta(out, block, {"type": "signature_delta",
                                         "signature": SIGNATURE_PREFIX + secret})
            self._close(out, block)

    def _item(self, out: list, key, item: dict, done: bool) -> None:
        kind = item.get("type")
        if kind == "function_call":
            block = self._toolBlock(out, key, item)
            if done:
                self._argsRemainder(out, block, item.get("arguments"))
                self._close(out, block)
        elif kind == "message" and done:
            content = item.get("content")
            text = "".join(
                _str(p.get("text")) if p.get("type") == "output_text" else _str(p.get("refusal"))
                for p in (content if isinstance(content, list) else [])
                if isinstance(p, dict) and p.get("type") in ("output_text", "refusal"))
            self._textRemainder(out, key, text)
            self._close(out, self._blocks.get(key))
        elif kind == "reasoning" and done:
            self._reasoningDone(out, key, item)

    # -- events ------------------------------------------------------------------

    def feed(self, event: dict) -> list:
        """
        Translate one upstream event.

        @param event: the parsed Responses event.
        @return: C{(event name, data dict)} pairs to send, possibly none.
        """
        if self.finished:
            return []
        kind = event.get("type")
        out: list = []
        if kind in ("response.created", "response.in_progress", "response.queued"):
            response = event.get("response")
            rid = response.get("id") if isinstance(response, dict) else None
            if self._id is None and isinstance(rid, str) and rid:
                self._id = "msg_" + rid.split("_", 1)[-1]
            self._start(out)
        elif kind in ("response.output_text.delta", "response.refusal.delta"):
            self._refused = self._refused or kind == "response.refusal.delta"
            self._text(out, self._key(event), _str(event.get("delta")))
        elif kind == "response.output_text.done":
            self._textRemainder(out, self._key(event), event.get("text"))
        elif kind in ("response.output_item.added", "response.output_item.done"):
            item = event.get("item")
            item = item if isinstance(item, dict) else {}
            self._item(out, self._key(event, item), item, kind.endswith(".done"))
        elif kind == "response.function_call_arguments.delta":
            key = self._key(event)
            block = self._blocks.get(key) or self._toolBlock(out, key, {"id": event.get("item_id")})
            self._args(out, block, _str(event.get("delta")))
        elif kind == "response.function_call_arguments.done":
            self._argsRemainder(out, self._blocks.get(self._key(event)), event.get("arguments"))
        elif kind == "response.reasoning_summary_text.delta":
            self._thinking(out, self._key(event), _str(event.get("delta")))
        elif kind == "error":
            self.finished = True
            self.error = _errorOf(event)
        elif kind in TERMINAL:
            response = event.get("response")
            self._terminal(out, kind, response if isinstance(response, dict) else {})
        return out

    def _terminal(self, out: list, kind: str, response: dict) -> None:
        self.finished = True
        if kind == "response.failed":
            self.error = _errorOf(response)
            return
        self._start(out)
        output = response.get("output")
        for index, item in enumerate(output if isinstance(output, list) else []):
            if isinstance(item, dict):
                self._item(out, self._key({"output_index": index}, item), item, True)
        for block in list(self._blocks.values()):
            self._close(out, block)
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        if self._stopped is not None:
            self.stopReason = "stop_sequence"
        elif kind == "response.incomplete":
            self.stopReason = "refusal" if reason == "content_filter" else "max_tokens"
        elif self._tools:
            self.stopReason = "tool_use"
        elif self._refused:
            self.stopReason = "refusal"
        else:
            self.stopReason = "end_turn"
        out.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stopReason, "stop_sequence": self._stopped},
            "usage": anthropicUsage(response.get("usage"))}))
        out.append(("message_stop", {"type": "message_stop"}))


def _heldBack(text: str, stops: tuple) -> int:
    """
    How many characters at the end of C{text} could begin a stop sequence.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


def foldMessage(events: list) -> dict:
    """
    Fold the Messages events of one turn into the non-streaming message
    object (protocol.md 10 "Answer"), so streaming and non-streaming
    answers cannot drift.

    @param events: C{(name, data)} pairs from L{MessagesTranslator.feed}.
    @return: C{{id, type, role, model, content, stop_reason,
        stop_sequence, usage}}.
    """
    message: dict = {}
    blocks: dict = {}
    partial: dict = {}
    for name, data in events:
        if name == "message_start":
            message = dict(data["message"])
        elif name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            kind = delta.get("type")
            if kind == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif kind == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            elif kind == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"] = data["usage"]
    for index, text in partial.items():
        try:
            blocks[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            blocks[index]["input"] = {}
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message
