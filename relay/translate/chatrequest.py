# -*- test-case-name: tests.test_translate -*-
"""
A Chat Completions request becomes a Responses request (protocol.md 3
"Upstream": OAuth accounts have only C{/responses}).

The mapping:

  - C{messages} -> C{input} items: C{system} and C{developer} messages
    become C{developer} messages (Codex sends its own system prompt that
    way, protocol.md 2.1), C{user} messages keep their text and images
    (C{input_text}, C{input_image}, C{input_file}), C{assistant} messages
    become C{output_text} messages followed by one C{function_call} (or
    C{custom_tool_call}) item per entry of C{tool_calls}, and C{tool}
    messages become C{function_call_output} (or C{custom_tool_call_output})
    items with the same C{call_id};
  - C{tools} (and the legacy C{functions}) -> flat Responses tools;
    C{strict} is written out as C{false} when the chat tool left it out,
    because Responses functions are strict by default and chat ones are not;
  - C{tool_choice} (and the legacy C{function_call}) -> the flat Responses
    form; C{parallel_tool_calls} as is;
  - C{max_completion_tokens} or C{max_tokens} -> C{max_output_tokens};
  - C{response_format} -> C{text.format}, C{verbosity} -> C{text.verbosity};
  - C{reasoning_effort} -> C{reasoning.effort};
  - C{temperature}, C{top_p}, C{store}, C{metadata}, C{prompt_cache_key},
    C{safety_identifier}, C{service_tier}, C{user} as is.

Fields with no Responses counterpart (C{n}, C{stop}, C{seed},
C{logit_bias}, C{logprobs}, C{frequency_penalty}, C{presence_penalty},
C{stream_options}, C{audio}, C{modalities}, ...) are left out;
C{stream_options.include_usage} is honoured by relay itself
(L{relay.translate.sink}). What the ChatGPT backend additionally refuses is
removed later, by L{relay.engine.payload.upstreamBody}.

Content parts relay does not know are passed on unchanged, so that the
upstream (not relay) judges them.
"""

from __future__ import annotations

from typing import Any, Optional

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The message roles a chat request may use (protocol.md 3)."""

_PASSED = (
    "model",
    "temperature",
    "top_p",
    "store",
    "metadata",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
    "user",
    "parallel_tool_calls",
)


class ChatRequestError(ValueError):
    """
    A chat request relay cannot read (bad client input, answered 400).

    @ivar param: the offending parameter path, e.g. C{messages[2].role}.
    """

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def checkMessages(messages: Any) -> None:
    """
    The shape every chat request must have, whichever account serves it:
    a non-empty array of objects, each with a known C{role}.

    @param messages: the request's C{messages} value.
    @raise ChatRequestError: when it is not so.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatRequestError("each message must be an object", f"messages[{i}]")
        role = message.get("role")
        # A list or object role is unhashable: test the type first
        # (fuzzing found the 500).
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ChatRequestError(
                f"Invalid value for 'role': {role!r}. Supported values are: "
                "'system', 'developer', 'user', 'assistant', 'tool' and 'function'.",
                f"messages[{i}].role",
            )


def checkChatRequest(body: dict) -> None:
    """
    Everything L{chatToResponses} reads has a shape it can read, so a chat
    request is answered 400 at once whichever account serves it, never
    translated into an internal error (fuzzing found C{"tools":
    1} failing inside the engine on an OAuth account): L{checkMessages},
    then C{tools} and C{functions} arrays of objects, each message's
    C{tool_calls} an array of objects whose C{function} / C{custom} are
    objects, a C{file} content part's C{file} an object, and an
    C{allowed_tools} choice's C{tools} an array.

    @param body: the parsed chat request.
    @raise ChatRequestError: naming the parameter.
    """
    messages = body.get("messages")
    checkMessages(messages)
    for name in ("tools", "functions"):
        _objects(body.get(name), name)
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        _objects(calls, f"messages[{i}].tool_calls")
        callId = message.get("tool_call_id")
        if callId is not None and not isinstance(callId, str):
            # An unhashable id crashed the translation.
            raise ChatRequestError(
                "tool_call_id must be a string", f"messages[{i}].tool_call_id"
            )
        for j, call in enumerate(calls or []):
            if call.get("id") is not None and not isinstance(call["id"], str):
                raise ChatRequestError("id must be a string", f"messages[{i}].tool_calls[{j}].id")
            for key in ("function", "custom"):
                if call.get(key) is not None and not isinstance(call[key], dict):
                    raise ChatRequestError(
                        f"{key} must be an object", f"messages[{i}].tool_calls[{j}].{key}"
                    )
        content = message.get("content")
        for k, part in enumerate(content if isinstance(content, list) else [content]):
            if (
                isinstance(part, dict) and part.get("type") == "file"
                and part.get("file") is not None and not isinstance(part["file"], dict)
            ):
                raise ChatRequestError("file must be an object", f"messages[{i}].content[{k}].file")
    choice = body.get("tool_choice", body.get("function_call"))
    if isinstance(choice, dict) and isinstance(choice.get("allowed_tools"), dict):
        allowed = choice["allowed_tools"].get("tools")
        if allowed is not None and not isinstance(allowed, list):
            raise ChatRequestError("tools must be an array", "tool_choice.allowed_tools.tools")


def _objects(value: Any, param: str) -> None:
    """
    C{value} is absent, or an array of objects.

    @raise ChatRequestError: otherwise, naming C{param}.
    """
    if value is None:
        return
    if not isinstance(value, list):
        raise ChatRequestError(f"{param.rsplit('.', 1)[-1]} must be an array", param)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ChatRequestError("each entry must be an object", f"{param}[{i}]")


def chatToResponses(body: dict) -> dict:
    """
    Translate a chat request body into a Responses request body.

    @param body: the chat request, already checked by L{checkChatRequest}.
    @return: a new dict; C{stream} is left for the caller to set.
    """
    out: dict = {}
    for name in _PASSED:
        if name in body:
            out[name] = body[name]
    out["input"] = messagesToInput(body.get("messages") or [])
    tools = list(body.get("tools") or [])
    tools += [{"type": "function", "function": f} for f in body.get("functions") or []]
    if tools:
        out["tools"] = [_tool(t) for t in tools if isinstance(t, dict)]
    choice = body.get("tool_choice", body.get("function_call"))
    if choice is not None:
        out["tool_choice"] = _toolChoice(choice)
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is not None:
        out["max_output_tokens"] = limit
    text = {}
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        text["format"] = _textFormat(fmt)
    if body.get("verbosity") is not None:
        text["verbosity"] = body["verbosity"]
    if text:
        out["text"] = text
    if body.get("reasoning_effort") is not None:
        out["reasoning"] = {"effort": body["reasoning_effort"]}
    return out


def messagesToInput(messages: list) -> list:
    """
    Chat messages -> Responses input items, in order.

    @param messages: the chat messages.
    @return: a list of item dicts.
    """
    items: list = []
    customCalls: set = set()
    legacyCalls: dict = {}  # function name -> call ids not yet answered
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = message.get("content")
        if role in ("system", "developer", "user"):
            parts = _inputParts(content)
            items.append(
                {"type": "message", "role": "user" if role == "user" else "developer",
                 "content": parts}
            )
        elif role == "assistant":
            parts = _outputParts(content)
            if message.get("refusal"):
                parts.append({"type": "refusal", "refusal": message["refusal"]})
            if parts:
                items.append({"type": "message", "role": "assistant", "content": parts})
            for call in message.get("tool_calls") or []:
                items.append(_callItem(call, customCalls))
            legacy = message.get("function_call")
            if isinstance(legacy, dict):
                callId = f"call_legacy_{len(items)}"
                legacyCalls.setdefault(legacy.get("name"), []).append(callId)
                items.append(
                    {"type": "function_call", "call_id": callId, "name": legacy.get("name"),
                     "arguments": legacy.get("arguments") or ""}
                )
        elif role == "tool":
            callId = message.get("tool_call_id")
            kind = "custom_tool_call_output" if callId in customCalls else "function_call_output"
            items.append({"type": kind, "call_id": callId, "output": _plainText(content)})
        elif role == "function":
            pending = legacyCalls.get(message.get("name")) or [None]
            items.append(
                {"type": "function_call_output", "call_id": pending.pop(0),
                 "output": _plainText(content)}
            )
    return items


def _inputParts(content: Any) -> list:
    """
    User/system content -> Responses input content parts.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if not isinstance(part, dict):
            parts.append({"type": "input_text", "text": str(part)})
            continue
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "input_text", "text": part.get("text", "")})
        elif kind == "image_url":
            image = part.get("image_url")
            if isinstance(image, dict):
                url, detail = image.get("url"), image.get("detail") or "auto"
            else:
                url, detail = image, "auto"
            parts.append({"type": "input_image", "image_url": url, "detail": detail})
        elif kind == "file":
            file = dict(part.get("file") or {})
            parts.append({"type": "input_file", **file})
        else:
            parts.append(part)
    return parts


def _outputParts(content: Any) -> list:
    """
    Assistant content -> Responses output content parts.
    """
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "output_text", "text": content, "annotations": []}]
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and part.get("type") == "refusal":
            parts.append({"type": "refusal", "refusal": part.get("refusal", "")})
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append({"type": "output_text", "text": part.get("text", ""), "annotations": []})
        elif isinstance(part, str):
            parts.append({"type": "output_text", "text": part, "annotations": []})
    return parts


def _callItem(call: Any, customCalls: set) -> dict:
    """
    One assistant C{tool_calls} entry -> a C{function_call} or
    C{custom_tool_call} item.
    """
    call = call if isinstance(call, dict) else {}
    callId = call.get("id")
    if call.get("type") == "custom":
        custom = call.get("custom") or {}
        customCalls.add(callId)
        return {"type": "custom_tool_call", "call_id": callId, "name": custom.get("name"),
                "input": custom.get("input", "")}
    function = call.get("function") or {}
    arguments = function.get("arguments")
    return {"type": "function_call", "call_id": callId, "name": function.get("name"),
            "arguments": arguments if isinstance(arguments, str) else ""}


def _plainText(content: Any) -> str:
    """
    A tool result: text as is, text parts joined.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") if isinstance(p, dict) else str(p) for p in content
        )
    return str(content)


def _tool(tool: dict) -> dict:
    """
    A chat tool -> a Responses tool (unknown kinds unchanged).
    """
    kind = tool.get("type")
    if kind == "function" and isinstance(tool.get("function"), dict):
        function = tool["function"]
        out = {"type": "function", "name": function.get("name")}
        if function.get("description") is not None:
            out["description"] = function["description"]
        out["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        out["strict"] = bool(function.get("strict", False))
        return out
    if kind == "custom" and isinstance(tool.get("custom"), dict):
        return {"type": "custom", **tool["custom"]}
    return tool


def _toolChoice(choice: Any) -> Any:
    """
    A chat C{tool_choice} (or legacy C{function_call}) -> the Responses form.
    """
    if isinstance(choice, str):
        return choice
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind is None and "name" in choice:  # legacy function_call: {"name": ...}
        return {"type": "function", "name": choice["name"]}
    if kind == "function" and isinstance(choice.get("function"), dict):
        return {"type": "function", "name": choice["function"].get("name")}
    if kind == "custom" and isinstance(choice.get("custom"), dict):
        return {"type": "custom", "name": choice["custom"].get("name")}
    if kind == "allowed_tools" and isinstance(choice.get("allowed_tools"), dict):
        allowed = choice["allowed_tools"]
        return {
            "type": "allowed_tools",
            "mode": allowed.get("mode", "auto"),
            "tools": [_toolChoice(t) for t in allowed.get("tools") or []],
        }
    return choice


def _textFormat(fmt: dict) -> dict:
    """
    A chat C{response_format} -> a Responses C{text.format}.
    """
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"]
        out = {"type": "json_schema"}
        for key in ("name", "description", "schema", "strict"):
            if key in schema:
                out[key] = schema[key]
        return out
    return {"type": fmt.get("type", "text")}
