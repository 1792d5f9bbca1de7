# -*- test-case-name: tests.test_session -*-
"""
The sticky session hash (behaviour.md R37).

The seed is the first non-empty signal among a fixed list of client
headers, the body's C{prompt_cache_key}, and a content seed built from
the parts of the request that stay constant across a conversation. The
hash is xxhash64 of the seed, scoped per client key, as 16 hex digits.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

import xxhash

#: Header names read for the seed, in order (R37 items 1-8). Lower-cased.
SESSION_HEADERS = (
    "session_id",
    "session-id",
    "conversation_id",
    "conversation-id",
    "x-session-affinity",
    "x-session-id",
    "x-opencode-session",
    "x-conversation-id",
)

#: Prefix of content-derived seeds, so they never collide with explicit ids.
CONTENT_SEED_PREFIX = "compat_cs_"


def _text(value: Any) -> str:
    """
    A header or body value as stripped text.

    @param value: a string, a list of strings (first one wins) or anything.
    @return: the stripped text, or C{""}.
    """
    if isinstance(value, (list, tuple)):
        value = value[0] if value else ""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return ""
    return value.strip()


def _canonical(value: Any) -> str:
    """
    Normalised JSON of a body fragment, so key order and spacing do not
    change the seed.

    @param value: any JSON value.
    @return: compact JSON text with sorted keys.
    """
    return _canonicalJSON(value)


_canonicalJSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode
"""C{json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)}:
the same encoder, built once instead of on every call."""


def _isMapping(value: Any) -> bool:
    """
    C{isinstance(value, Mapping)}, with a parsed body's C{dict} told without
    the ABC's C{__instancecheck__} (several per turn).
    """
    return value.__class__ is dict or isinstance(value, Mapping)


def _seedBody(body: Mapping) -> Mapping:
    """
    The object to read C{prompt_cache_key} and content from.

    For a WebSocket frame whose C{type} starts with C{response.}, a nested
    C{response} object wins when there is one (R37 item 9).

    @param body: the request body or WebSocket frame.
    @return: a mapping.
    """
    frameType = body.get("type")
    nested = body.get("response")
    if (
        isinstance(frameType, str)
        and frameType.startswith("response.")
        and _isMapping(nested)
    ):
        return nested
    return body


def contentSeed(body: Mapping, model: Optional[str] = None) -> Optional[str]:
    """
    The content seed (R37 item 10): C{"compat_cs_"} + model + tools +
    functions + instructions + the leading system/developer messages + the
    first user message, for chat C{messages} and Responses C{input}.

    @param body: the request body (already unwrapped by L{_seedBody}).
    @param model: the requested model; the body's C{model} when L{None}.
    @return: the seed, or L{None} when the body holds none of these parts.
    """
    parts = []
    name = model if model else _text(body.get("model"))
    if name:
        parts.append("model=" + name)
    for field in ("tools", "functions"):
        value = body.get(field)
        if isinstance(value, list) and value:
            parts.append(f"|{field}=" + _canonical(value))
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        parts.append("|instructions=" + instructions)

    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    if isinstance(items, str):
        if items:
            parts.append("|first_user=" + items)
    elif isinstance(items, list):
        for item in items:
            if not _isMapping(item):
                continue
            role = item.get("role")
            if role in ("system", "developer"):
                parts.append("|system=" + _canonical(item.get("content")))
                continue
            if role == "user":
                parts.append("|first_user=" + _canonical(item.get("content")))
                break
            if item.get("type") == "input_text":
                parts.append("|first_user=" + _text(item.get("text")))
                break
            # Anything else (assistant turns, tool items) ends the leading
            # system block without a user message yet; keep scanning for
            # the first user message only.
    if not parts:
        return None
    return CONTENT_SEED_PREFIX + "".join(parts)


def sessionSeed(
    headers: Mapping, body: Optional[Mapping], model: Optional[str] = None
) -> Optional[str]:
    """
    The session seed of a request (R37): the first non-empty of the session
    headers, the body's C{prompt_cache_key}, then the content seed.

    @param headers: lower-cased header name -> value (a string or a list of
        strings).
    @param body: the JSON request body or WebSocket frame, or L{None}.
    @param model: the requested model (before mapping), or L{None} to read
        the body's C{model}.
    @return: the seed string, or L{None} when there is no signal at all.
    """
    if headers:
        for name in SESSION_HEADERS:
            value = headers.get(name)
            if value is not None:
                value = _text(value)
                if value:
                    return value
    if not _isMapping(body):
        return None
    source = _seedBody(body)
    cacheKey = _text(source.get("prompt_cache_key"))
    if cacheKey:
        return cacheKey
    return contentSeed(source, model)


def sessionHash(seed: Optional[str], keyName: str) -> Optional[str]:
    """
    The sticky session hash (R37): xxhash64 of C{"{keyName}:{seed}"} as 16
    lower-case hex digits. Scoping by client key keeps two keys that send
    the same session id from sharing a binding.

    @param seed: the seed from L{sessionSeed}, or L{None}.
    @param keyName: the client key's name.
    @return: 16 hex digits, or L{None} when C{seed} is empty.
    """
    if not seed:
        return None
    # surrogatepass: any str hashes (entrypoints refuse unpaired surrogates;
    # this keeps the hash total anyway).
    return xxhash.xxh64_hexdigest(f"{keyName}:{seed}".encode("utf-8", "surrogatepass"))


def wsFallbackSeed(keyName: str, groupId: int = 0) -> str:
    """
    The WebSocket seed when a connection carries no signal at all (R37):
    C{openai_ws_ingress:{groupID}:{userID}:{apiKeyID}}. relay has no groups
    and one user per key, so both ids are the key name.

    @param keyName: the client key's name.
    @param groupId: the group id, 0 when there is none.
    @return: the seed.
    """
    return f"openai_ws_ingress:{groupId}:{keyName}:{keyName}"
