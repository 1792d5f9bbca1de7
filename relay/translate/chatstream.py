# -*- test-case-name: tests.test_translate -*-
"""
Responses stream events become Chat Completions chunks (protocol.md 3
"Stream").

The chunks, in order:

  1. a role chunk, C{delta: {"role": "assistant", "content": ""}}, just
     before the first content or tool call (or before the finish chunk of
     an empty answer);
  2. content deltas (C{delta.content}, C{delta.refusal}) and tool-call
     deltas C{delta.tool_calls[{index, id, type, function: {name,
     arguments}}]}: the first delta of a call carries its C{index}, C{id},
     C{type} and C{name}; later ones only C{index} and an C{arguments}
     fragment. A call's C{index} counts the calls of the turn from 0 and
     never changes. The arguments reach the client exactly once: as the
     upstream's deltas, or, when the upstream sent none (some models send
     them only in C{response.function_call_arguments.done} or the finished
     item), as one fragment from there; text the same way;
  3. a finish chunk with an empty delta and C{finish_reason}: C{stop},
     C{tool_calls} (the turn called a tool), C{length}
     (C{response.incomplete} for C{max_output_tokens}) or
     C{content_filter} (C{response.incomplete} for C{content_filter});
  4. with C{stream_options.include_usage}: a chunk with C{choices: []} and
     the usage (C{input_tokens} -> C{prompt_tokens}, C{output_tokens} ->
     C{completion_tokens}); every earlier chunk then has C{"usage": null}.

The C{data: [DONE]} line and errors are the sink's business
(L{relay.translate.sink}). A failed turn (C{response.failed}, an C{error}
event) produces no chunk; L{ChatChunkTranslator.error} holds the error.
"""

from __future__ import annotations

import os
from typing import Optional

TERMINAL = frozenset(
    {
        "response.completed",
        "response.incomplete",
        "response.failed",
        "response.done",
        "response.cancelled",
        "response.canceled",
    }
)
"""Responses events that end a turn (protocol.md 2.5)."""

_INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}


def chatUsage(usage: Optional[dict]) -> Optional[dict]:
    """
    A Responses C{usage} object in Chat Completions form (protocol.md 3).

    @param usage: C{input_tokens}, C{output_tokens}, C{total_tokens} and
        their details, or L{None}.
    @return: C{prompt_tokens}, C{completion_tokens}, C{total_tokens},
        C{prompt_tokens_details.cached_tokens} and
        C{completion_tokens_details.reasoning_tokens}; L{None} for L{None}.
    """
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("input_tokens") or 0
    completion = usage.get("output_tokens") or 0
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": usage.get("total_tokens") or prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


class _Call:
    """
    One tool call of the turn: its chat index and what was sent of it.
    """

    __slots__ = ("index", "kind", "callId", "name", "sent", "announced")

    def __init__(self, index: int, kind: str):
        self.index = index
        self.kind = kind
        self.callId = None
        self.name = None
        self.sent = ""
        self.announced = False


class ChatChunkTranslator:
    """
    Turns the Responses events of one turn into chat chunks, one event at a
    time (see the module docstring).

    @ivar finished: a terminal event was fed.
    @ivar finishReason: the finish chunk's reason, once finished.
    @ivar error: the C{{code, message, ...}} of a failed turn, or L{None}.
    @ivar usage: the chat usage of the terminal event, or L{None}.
    """

    def __init__(self, model: Optional[str], includeUsage: bool, created: int):
        """
        @param model: the model name the client asked for (chunks carry it).
        @param includeUsage: C{stream_options.include_usage}.
        @param created: Unix seconds for C{created} when the upstream's
            C{response.created} has no C{created_at}.
        """
        self._model = model
        self._includeUsage = includeUsage
        self._created = created
        self._id: Optional[str] = None
        self._roleSent = False
        self._calls: dict = {}  # item key -> _Call
        self._text: dict = {}  # (item key, "text" | "refusal") -> text sent
        self._keys: dict = {}  # item id -> item key
        self.finished = False
        self.finishReason: Optional[str] = None
        self.error: Optional[dict] = None
        self.usage: Optional[dict] = None

    # -- chunk building ------------------------------------------------------

    @property
    def chunkId(self) -> str:
        """
        The C{chatcmpl-…} id of every chunk, derived from the upstream
        response id when there is one.
        """
        if self._id is None:
            self._id = "chatcmpl-" + os.urandom(12).hex()
        return self._id

    def _chunk(self, delta: dict, finish: Optional[str] = None) -> dict:
        chunk = {
            "id": self.chunkId,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self._includeUsage:
            chunk["usage"] = None
        return chunk

    def _role(self, out: list) -> None:
        """
        The role chunk, once, before anything else.
        """
        if not self._roleSent:
            self._roleSent = True
            out.append(self._chunk({"role": "assistant", "content": ""}))

    def _out(self, out: list, delta: dict) -> None:
        self._role(out)
        out.append(self._chunk(delta))

    # -- item bookkeeping ----------------------------------------------------

    def _key(self, event: dict, item: Optional[dict] = None):
        itemId = (item or {}).get("id") or event.get("item_id")
        index = event.get("output_index")
        if index is None:
            return self._keys.get(itemId, itemId)
        if itemId is not None:
            self._keys[itemId] = index
        return index

    def _call(self, key, kind: str) -> _Call:
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call(len(self._calls), kind)
        return call

    def _announce(self, out: list, call: _Call, item: dict) -> None:
        """
        The first delta of a call: index, id, type and name.
        """
        call.callId = call.callId or item.get("call_id") or item.get("id")
        call.name = call.name or item.get("name")
        if call.announced:
            return
        call.announced = True
        body = {"name": call.name}
        if call.kind == "function":
            body["arguments"] = ""
        else:
            body["input"] = ""
        self._out(
            out,
            {"tool_calls": [{"index": call.index, "id": call.callId, "type": call.kind,
                             call.kind: body}]},
        )

    def _args(self, out: list, call: _Call, fragment: str) -> None:
        if not fragment:
            return
        call.sent += fragment
        field = "arguments" if call.kind == "function" else "input"
        self._out(out, {"tool_calls": [{"index": call.index, call.kind: {field: fragment}}]})

    def _argsRemainder(self, out: list, call: _Call, full: Optional[str]) -> None:
        """
        Send what C{full} has beyond what was sent, so the arguments reach
        the client exactly once.
        """
        if not isinstance(full, str) or not full or call.sent == full:
            return
        if full.startswith(call.sent):
            self._args(out, call, full[len(call.sent):])

    def _textRemainder(self, out: list, key, field: str, full: Optional[str]) -> None:
        if not isinstance(full, str) or not full:
            return
        sent = self._text.get((key, field), "")
        if full.startswith(sent) and len(full) > len(sent):
            self._text[(key, field)] = full
            self._out(out, {field: full[len(sent):]})

    def _item(self, out: list, key, item: dict, done: bool) -> None:
        """
        An C{output_item.added} (C{done} false) or C{.done} event, or an item
        of the terminal response that no event announced.
        """
        kind = item.get("type")
        if kind in ("function_call", "custom_tool_call"):
            call = self._call(key, "function" if kind == "function_call" else "custom")
            self._announce(out, call, item)
            if done:
                self._argsRemainder(
                    out, call, item.get("arguments" if kind == "function_call" else "input")
                )
        elif kind == "message" and done:
            text = "".join(
                p.get("text", "") for p in item.get("content") or []
                if isinstance(p, dict) and p.get("type") == "output_text"
            )
            refusal = "".join(
                p.get("refusal", "") for p in item.get("content") or []
                if isinstance(p, dict) and p.get("type") == "refusal"
            )
            self._textRemainder(out, key, "content", text)
            self._textRemainder(out, key, "refusal", refusal)

    # -- events --------------------------------------------------------------

    def feed(self, event: dict) -> list:
        """
        Translate one upstream event.

        @param event: the parsed event (its C{type} key says which).
        @return: the chunks to send, possibly none.
        """
        if self.finished:
            return []
        kind = event.get("type")
        out: list = []
        if kind in ("response.created", "response.in_progress", "response.queued"):
            response = event.get("response") or {}
            rid = response.get("id")
            if self._id is None and isinstance(rid, str) and rid:
                self._id = "chatcmpl-" + rid.split("_", 1)[-1]
            if isinstance(response.get("created_at"), (int, float)):
                self._created = int(response["created_at"])
        elif kind == "response.output_text.delta":
            key = self._key(event)
            delta = event.get("delta") or ""
            if delta:
                self._text[(key, "content")] = self._text.get((key, "content"), "") + delta
                self._out(out, {"content": delta})
        elif kind == "response.output_text.done":
            self._textRemainder(out, self._key(event), "content", event.get("text"))
        elif kind == "response.refusal.delta":
            key = self._key(event)
            delta = event.get("delta") or ""
            if delta:
                self._text[(key, "refusal")] = self._text.get((key, "refusal"), "") + delta
                self._out(out, {"refusal": delta})
        elif kind == "response.refusal.done":
            self._textRemainder(out, self._key(event), "refusal", event.get("refusal"))
        elif kind in ("response.output_item.added", "response.output_item.done"):
            item = event.get("item") or {}
            self._item(out, self._key(event, item), item, kind.endswith(".done"))
        elif kind in ("response.function_call_arguments.delta",
                      "response.custom_tool_call_input.delta"):
            custom = kind.startswith("response.custom")
            call = self._call(self._key(event), "custom" if custom else "function")
            self._announce(out, call, {"id": event.get("item_id")})
            self._args(out, call, event.get("delta") or "")
        elif kind == "response.function_call_arguments.done":
            call = self._call(self._key(event), "function")
            self._announce(out, call, {"id": event.get("item_id"), "name": event.get("name")})
            self._argsRemainder(out, call, event.get("arguments"))
        elif kind == "response.custom_tool_call_input.done":
            call = self._call(self._key(event), "custom")
            self._announce(out, call, {"id": event.get("item_id")})
            self._argsRemainder(out, call, event.get("input"))
        elif kind == "error":
            self.finished = True
            self.error = _errorOf(event)
        elif kind in TERMINAL:
            self._terminal(out, kind, event.get("response") or {})
        return out

    def _terminal(self, out: list, kind: str, response: dict) -> None:
        self.finished = True
        if kind == "response.failed":
            self.error = _errorOf(response)
            return
        for index, item in enumerate(response.get("output") or []):
            if isinstance(item, dict):
                self._item(out, self._key({"output_index": index}, item), item, True)
        if kind == "response.incomplete":
            reason = (response.get("incomplete_details") or {}).get("reason")
            self.finishReason = _INCOMPLETE_REASONS.get(reason, "length")
        elif self._calls:
            self.finishReason = "tool_calls"
        else:
            self.finishReason = "stop"
        self._role(out)
        out.append(self._chunk({}, self.finishReason))
        self.usage = chatUsage(response.get("usage"))
        if self._includeUsage and self.usage is not None:
            last = self._chunk({})
            last["choices"] = []
            last["usage"] = self.usage
            out.append(last)


def _errorOf(obj: dict) -> dict:
    """
    The error of a C{response.failed} response or of an C{error} event,
    as C{{code, message, type, param}} (missing keys absent).
    """
    error = obj.get("error")
    if not isinstance(error, dict):
        # A bare C{error} event: its C{type} is the event's own.
        error = {k: obj[k] for k in ("code", "message", "param") if obj.get(k) is not None}
    return error or {"code": None, "message": "The upstream response failed."}
