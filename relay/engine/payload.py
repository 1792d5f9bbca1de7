# -*- test-case-name: tests.test_payload -*-
"""
Building the upstream request body for an account (protocol.md 2.7, 7.2),
and the semantic-output test of behaviour.md R22.
"""

from __future__ import annotations

import json

from relay.model import Account, Turn
from relay.sse import Event

WS_ONLY_FIELDS = ("type", "generate", "stream_id")
"""Fields that exist only on WebSocket frames; an HTTP upstream rejects them
(protocol.md 8, "Timing rules")."""

OAUTH_HTTP_DROPPED = (
    "previous_response_id",
    "prompt_cache_retention",
    "safety_identifier",
    "disable_response_storage",
)
"""Fields the ChatGPT backend's HTTP path rejects (protocol.md 7.2)."""


def upstreamStreams(turn: Turn, account: Account) -> bool:
    """
    Whether the upstream request streams.

    The ChatGPT (OAuth) backend accepts only streaming requests, so relay
    streams upstream and collects the terminal event for a non-streaming
    client (protocol.md 2.7).
    """
    if turn.endpoint == "responses" and account.type == "oauth":
        return True
    return turn.stream


def upstreamBody(turn: Turn, account: Account) -> bytes:
    """
    The JSON body to send to C{account} for C{turn}.

    @return: UTF-8 JSON bytes.
    """
    body = dict(turn.body)
    for name in WS_ONLY_FIELDS:
        body.pop(name, None)
    if turn.model:
        body["model"] = account.upstreamModel(turn.model)
    if turn.endpoint == "responses" and account.type == "oauth":
        body["stream"] = True
        body["store"] = False
        body.setdefault("instructions", "")
        for name in OAUTH_HTTP_DROPPED:
            body.pop(name, None)
    elif turn.stream:
        body["stream"] = True
    else:
        body.pop("stream", None)
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


_NEVER_SEMANTIC = frozenset({b"response.created", b"response.in_progress", b"response.queued"})
_EMPTY_WHEN_BARE = frozenset(
    {
        b"response.output_item.added",
        b"response.content_part.added",
        b"response.reasoning_summary_part.added",
    }
)


def isSemanticOutput(event: Event) -> bool:
    """
    Whether C{event} is the first semantic output (behaviour.md R22).

    Not semantic: C{response.created}, C{response.in_progress}, upstream
    extras (C{codex.*}, C{responsesapi.*}), and C{output_item.added} /
    C{content_part.added} / C{reasoning_summary_part.added} that carry no
    content (a message with empty content, a reasoning item with neither
    C{encrypted_content} nor summary text). Failure events are handled by
    the caller before this test.
    """
    t = event.type
    if t in _NEVER_SEMANTIC or t.startswith(b"codex.") or t.startswith(b"responsesapi."):
        return False
    if t in _EMPTY_WHEN_BARE:
        ev = event.json()
        part = ev.get("part")
        if part is not None:
            return bool(part.get("text"))
        item = ev.get("item") or {}
        itype = item.get("type")
        if itype == "message":
            return bool(item.get("content"))
        if itype == "reasoning":
            summary = item.get("summary") or []
            return bool(item.get("encrypted_content")) or any(s.get("text") for s in summary)
        return True
    if t == b"chat.completion.chunk":
        choices = event.json().get("choices") or []
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason"):
                return True
        return bool(event.json().get("usage")) and not choices
    return True


def isEmptyCompleted(response: dict) -> bool:
    """
    A silent upstream refusal: a C{response.completed} with no output, no
    usage and no error (behaviour.md R23, sub2api #5009).

    @param response: the terminal event's C{response} object.
    """
    return not response.get("output") and not response.get("usage") and not response.get("error")


def withoutEncryptedReasoning(body: dict):
    """
    behaviour.md R7: after a 400 C{invalid_encrypted_content}, drop the
    encrypted reasoning items from C{input} so the same account can be
    retried once. Reasoning encrypted by one account is rejected by
    another, so this is what a failover of a Codex conversation needs.

    @param body: the turn's request body.
    @return: a new body without those items, or L{None} when there were
        none to drop.
    """
    items = body.get("input")
    if not isinstance(items, list):
        return None
    kept = [
        item for item in items
        if not (isinstance(item, dict) and item.get("type") == "reasoning"
                and item.get("encrypted_content"))
    ]
    if len(kept) == len(items):
        return None
    return {**body, "input": kept}


_SESSION_NAMES = ("session_id", "session-id")
_CONVERSATION_NAMES = ("conversation_id", "conversation-id")


def upstreamClientHeaders(turn: Turn, account: Account) -> dict:
    """
    The client headers to hand the dialer for C{account} (it applies its
    own allow-list). For OAuth accounts the session and conversation ids
    are replaced by C{xxhash64("k{key}:" + raw)} as 16 hex digits, falling
    back to C{prompt_cache_key}, so one tenant's ids never reach the
    backend next to another's (protocol.md 7.2).

    The turn's request id goes upstream as C{x-client-request-id} (issue
    15), replacing the client's value (which relay adopted as the id when
    it was well-formed).

    @return: a new dict (lower-cased names).
    """
    headers = dict(turn.headers)
    if turn.requestId:
        headers["x-client-request-id"] = turn.requestId
    if account.type != "oauth":
        return headers
    import xxhash

    scope = "k" + turn.client.name + ":"
    cacheKey = turn.body.get("prompt_cache_key")
    cacheKey = cacheKey if isinstance(cacheKey, str) and cacheKey else None
    for names in (_SESSION_NAMES, _CONVERSATION_NAMES):
        raw = next((headers[n] for n in names if headers.get(n)), None) or cacheKey
        for n in names:
            headers.pop(n, None)
        if raw:
            headers[names[0]] = xxhash.xxh64_hexdigest((scope + raw).encode("utf-8"))
    return headers
