# -*- test-case-name: tests.test_anthropic -*-
"""
An Anthropic Messages request becomes a Responses request (protocol.md 10,
behaviour.md R115), on both account types.

The mapping:

  - C{system} (a string or text blocks) -> C{instructions};
  - C{messages} -> C{input} items, in order: C{text} -> C{input_text}
    (C{output_text} on an assistant message), C{image} (C{source} base64 or
    url) -> C{input_image}, a PDF C{document} -> C{input_file}, a text
    C{document} -> C{input_text}; C{tool_use} -> a C{function_call} whose
    C{call_id} is the C{tool_use} id unchanged (R115); C{tool_result} ->
    C{function_call_output} with the same C{call_id} (text, or text and
    images; C{is_error} prefixes the text with C{Error: });
    C{thinking} / C{redacted_thinking} relay itself produced (their
    signature / data carry L{SIGNATURE_PREFIX}) -> C{reasoning} items with
    their C{encrypted_content}; any other is left out (it is another
    provider's and the upstream cannot read it);
  - C{tools} (C{input_schema}) -> function tools (C{parameters}, not
    strict); C{web_search_*} server tools -> C{web_search};
  - C{tool_choice}: C{auto} -> C{auto}, C{any} -> C{required}, C{tool} ->
    the named function, C{none} -> C{none}; C{disable_parallel_tool_use}
    -> C{parallel_tool_calls: false};
  - C{max_tokens} -> C{max_output_tokens} (at least L{MIN_OUTPUT_TOKENS});
    C{temperature}, C{top_p} as is (both left out on OAuth accounts later,
    L{relay.engine.payload}); C{top_k} has no counterpart;
  - C{metadata.user_id} -> C{metadata.user_id}, and the seed of the
    C{prompt_cache_key} (with C{cache_control} anywhere, the system prompt
    and tools seed it otherwise); relay scopes the key per client key
    (R112);
  - C{thinking} (C{enabled} with C{budget_tokens}, or C{adaptive}) ->
    C{reasoning.effort} (L{effortOf}) with C{summary: auto}, and the encrypted reasoning asked
    for, so the answer's thinking blocks can be sent back;
  - C{stop_sequences} have no Responses field: they are applied to the
    answer (L{relay.translate.anthropic.stream}).

Pure data work.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from attrs import frozen

MIN_OUTPUT_TOKENS = 16
"""The least C{max_output_tokens} the Responses API accepts."""

SIGNATURE_PREFIX = "relay."
"""What starts the signature of a thinking block (and the data of a
redacted one) relay wrote: the upstream's C{encrypted_content} follows."""

ROLES = ("user", "assistant")

THINKING_ON = ("enabled", "adaptive")
"""The C{thinking.type}s that turn reasoning on (C{adaptive} without a budget:
C{output_config.effort} when it names one, else C{medium})."""

MAX_STOP_SEQUENCES = 64
"""The most C{stop_sequences} a request may give: each one is looked for in
every text delta of the answer (L{relay.translate.anthropic.stream}), on the
process's one thread, so an unbounded list would let one key stall every
other key's turns."""

MAX_STOP_SEQUENCE_CHARS = 256
"""The longest stop sequence, characters (the tail of the answer held back
while it may begin one is bounded by it)."""

EFFORT_BANDS = ((4096, "low"), (16384, "medium"))
"""C{thinking.budget_tokens} below the bound -> effort; at or above the last
bound: C{high}."""


class MessagesRequestError(ValueError):
    """
    A Messages request relay cannot read (bad client input, answered 400
    C{invalid_request_error}).

    @ivar param: the offending field path, e.g. C{messages.2.role}.
    """

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@frozen
class MessagesContext:
    """
    What the answer's translation needs of the client's request.

    @ivar model: the model name the client asked for (a C{claude-*} name:
        the answer carries it).
    @ivar stopSequences: the C{stop_sequences}, a tuple of strings.
    @ivar thinking: whether the client enabled thinking (the answer then
        carries thinking blocks).
    """

    model: str
    stopSequences: tuple = ()
    thinking: bool = False


def effortOf(budget: Any) -> str:
    """
    The reasoning effort band of a C{thinking.budget_tokens} (R115).

    @param budget: the budget, tokens.
    @return: C{low}, C{medium} or C{high}.
    """
    if not isinstance(budget, int) or isinstance(budget, bool):
        return "medium"
    for bound, effort in EFFORT_BANDS:
        if budget < bound:
            return effort
    return "high"


def checkMessagesRequest(body: Any, counting: bool = False) -> None:
    """
    The shape every Messages request must have (protocol.md 10), so bad
    input is a 400 at once whichever account would serve it.

    @param body: the parsed request.
    @param counting: a C{count_tokens} body (no C{max_tokens}).
    @raise MessagesRequestError: naming the field.
    """
    if not isinstance(body, dict):
        raise MessagesRequestError("The request body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise MessagesRequestError("model: Field required", "model")
    if not counting:
        limit = body.get("max_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise MessagesRequestError(
                "max_tokens: Field required (an integer of at least 1)", "max_tokens")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise MessagesRequestError("stream: Input should be a valid boolean", "stream")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise MessagesRequestError("messages: Field required (an array)", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise MessagesRequestError(
                f"messages.{i}.role: Input should be 'user' or 'assistant'", f"messages.{i}.role")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise MessagesRequestError(
                f"messages.{i}.content: Input should be a string or an array of blocks",
                f"messages.{i}.content")
        for j, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise MessagesRequestError(
                    f"messages.{i}.content.{j}: each block must be an object with a type",
                    f"messages.{i}.content.{j}")
            if block["type"] == "text" and not isinstance(block.get("text"), str):
                raise MessagesRequestError(
                    f"messages.{i}.content.{j}.text: Input should be a valid string",
                    f"messages.{i}.content.{j}.text")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise MessagesRequestError("system: Input should be a string or text blocks", "system")
    for i, block in enumerate(system if isinstance(system, list) else ()):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            raise MessagesRequestError(
                f"system.{i}: Input should be a text block with a string text",
                f"system.{i}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise MessagesRequestError("tools: Input should be an array", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise MessagesRequestError(f"tools.{i}.name: Field required", f"tools.{i}.name")
            kind = tool.get("type")
            if kind not in (None, "custom") and not str(kind).startswith("web_search"):
                raise MessagesRequestError(
                    f"tools.{i}.type: server tool {kind!r} is not served through this gateway",
                    f"tools.{i}.type")
    choice = body.get("tool_choice")
    if choice is not None and (
        not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none")
    ):
        raise MessagesRequestError(
            "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    if isinstance(choice, dict) and choice["type"] == "tool" and not isinstance(
            choice.get("name"), str):
        raise MessagesRequestError("tool_choice.name: Field required", "tool_choice.name")
    stops = body.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
    ):
        raise MessagesRequestError(
            "stop_sequences: Input should be an array of non-empty strings", "stop_sequences")
    if stops is not None and (
        len(stops) > MAX_STOP_SEQUENCES
        or any(len(s) > MAX_STOP_SEQUENCE_CHARS for s in stops)
    ):
        raise MessagesRequestError(
            f"stop_sequences: at most {MAX_STOP_SEQUENCES} sequences of at most"
            f" {MAX_STOP_SEQUENCE_CHARS} characters each", "stop_sequences")
    thinking = body.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict)
        or thinking.get("type") not in ("enabled", "disabled", "adaptive")
    ):
        raise MessagesRequestError(
            "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'", "thinking")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise MessagesRequestError("metadata: Input should be an object", "metadata")


def contextOf(body: dict) -> MessagesContext:
    """
    @param body: a checked Messages request.
    @return: its L{MessagesContext}.
    """
    thinking = body.get("thinking")
    return MessagesContext(
        model=body["model"],
        stopSequences=tuple(body.get("stop_sequences") or ()),
        thinking=isinstance(thinking, dict) and thinking.get("type") in THINKING_ON,
    )


def messagesToResponses(body: dict, model: str) -> dict:
    """
    Translate a checked Messages request into a Responses request (see the
    module docstring).

    @param body: the Messages request (L{checkMessagesRequest} passed).
    @param model: the OpenAI model it was mapped to (R115).
    @return: a new dict; C{stream} is the client's.
    """
    out: dict = {"model": model}
    system = _systemText(body.get("system"))
    if system:
        out["instructions"] = system
    out["input"] = messagesToInput(body.get("messages") or [])
    tools = [_tool(t) for t in body.get("tools") or []]
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        out["tool_choice"] = _toolChoice(choice)
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    if tools and "parallel_tool_calls" not in out:
        out["parallel_tool_calls"] = True
    limit = body.get("max_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool):
        out["max_output_tokens"] = max(MIN_OUTPUT_TOKENS, limit)
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            out[name] = body[name]
    metadata = body.get("metadata") or {}
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user:
        out["metadata"] = {"user_id": user[:512]}
    cacheKey = _cacheKey(body, user)
    if cacheKey is not None:
        out["prompt_cache_key"] = cacheKey
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in THINKING_ON:
        effort = effortOf(thinking.get("budget_tokens"))
        config = body.get("output_config")
        if "budget_tokens" not in thinking and isinstance(config, dict) and config.get(
                "effort") in ("low", "medium", "high"):
            effort = config["effort"]
        out["reasoning"] = {"effort": effort, "summary": "auto"}
        out["include"] = ["reasoning.encrypted_content"]
    out["stream"] = body.get("stream") is True
    return out


def messagesToInput(messages: list) -> list:
    """
    Messages -> Responses input items, in order (see the module docstring).

    @param messages: the checked C{messages}.
    @return: a list of item dicts.
    """
    items: list = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts: list = []
        partType = "output_text" if role == "assistant" else "input_text"

        def flush():
            if parts:
                items.append({"type": "message", "role": role, "content": list(parts)})
                parts.clear()

        for block in content:
            kind = block.get("type")
            if kind == "text":
                part = {"type": partType, "text": block.get("text") or ""}
                if role == "assistant":
                    part["annotations"] = []
                parts.append(part)
            elif kind in ("image", "document") and role == "user":
                parts.append(_source(block))
            elif kind == "tool_use":
                flush()
                items.append({
                    "type": "function_call", "call_id": block.get("id"),
                    "name": block.get("name"),
                    "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                })
            elif kind == "tool_result":
                flush()
                items.append({"type": "function_call_output", "call_id": block.get("tool_use_id"),
                              "output": _toolOutput(block)})
            elif kind in ("thinking", "redacted_thinking"):
                item = _reasoning(block)
                if item is not None:
                    flush()
                    items.append(item)
        flush()
    return items


def _source(block: dict) -> dict:
    """
    An C{image} or C{document} block -> an input content part.
    """
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    kind = source.get("type")
    if block.get("type") == "image":
        if kind == "url":
            url = source.get("url")
        else:
            url = f"data:{source.get('media_type') or 'image/png'};base64,{source.get('data') or ''}"
        return {"type": "input_image", "image_url": url, "detail": "auto"}
    if kind == "text":
        return {"type": "input_text", "text": source.get("data") or ""}
    if kind == "url":
        return {"type": "input_file", "file_url": source.get("url")}
    media = source.get("media_type") or "application/pdf"
    return {"type": "input_file", "filename": block.get("title") or "document.pdf",
            "file_data": f"data:{media};base64,{source.get('data') or ''}"}


def _toolOutput(block: dict) -> Any:
    """
    A C{tool_result}'s content: a string, or input parts when it holds
    images; C{is_error} prefixes the text with C{Error: }.
    """
    content = block.get("content")
    prefix = "Error: " if block.get("is_error") is True else ""
    if content is None or isinstance(content, str):
        return prefix + (content or "")
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and part.get("type") == "image":
            parts.append(_source(part))
        elif isinstance(part, dict):
            parts.append({"type": "input_text", "text": str(part.get("text", ""))})
    if all(p["type"] == "input_text" for p in parts):
        return prefix + "".join(p["text"] for p in parts)
    if prefix:
        parts.insert(0, {"type": "input_text", "text": prefix})
    return parts


def _reasoning(block: dict) -> Optional[dict]:
    """
    A thinking block relay wrote -> a C{reasoning} item; L{None} for
    another provider's.
    """
    secret = block.get("signature") if block["type"] == "thinking" else block.get("data")
    if not isinstance(secret, str) or not secret.startswith(SIGNATURE_PREFIX):
        return None
    summary = []
    if block["type"] == "thinking" and block.get("thinking"):
        summary.append({"type": "summary_text", "text": block["thinking"]})
    return {"type": "reasoning", "summary": summary,
            "encrypted_content": secret[len(SIGNATURE_PREFIX):]}


def _systemText(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n\n".join(
            b.get("text") or "" for b in system if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _tool(tool: dict) -> dict:
    kind = tool.get("type")
    if kind is not None and str(kind).startswith("web_search"):
        return {"type": "web_search"}
    out = {"type": "function", "name": tool.get("name")}
    if tool.get("description") is not None:
        out["description"] = tool["description"]
    out["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
    out["strict"] = False
    return out


def _toolChoice(choice: dict) -> Any:
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "name": choice.get("name")}
    return kind  # auto, none


def _hasCacheControl(value: Any) -> bool:
    """
    Whether a C{cache_control} key stands anywhere in C{value}. Walked
    with a stack, not by recursion: a client's body may nest as deep as
    the JSON reader allows, deeper than the interpreter's recursion limit
    leaves room for (a 500 before, never the client's 400).
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "cache_control" in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _cacheKey(body: dict, user: Optional[str]) -> Optional[str]:
    """
    The C{prompt_cache_key} of a request that asks for caching
    (C{cache_control} anywhere) or names its user: the user id (a Claude
    Code session), else the system prompt, tools and first message.
    """
    if not (isinstance(user, str) and user) and not _hasCacheControl(
            [body.get("system"), body.get("tools"), body.get("messages")]):
        return None
    if isinstance(user, str) and user:
        seed = user
    else:
        first = (body.get("messages") or [None])[0]
        seed = json.dumps([body.get("system"), body.get("tools"), first], sort_keys=True,
                          default=str)
    return "claude-" + hashlib.sha256(seed.encode("utf-8")).hexdigest()[:32]
