# -*- test-case-name: tests.test_requests, tests.test_translate -*-
"""
Building the upstream request body for an account (protocol.md 2.7, 7.2),
and the semantic-output test of behaviour.md R22.
"""

from __future__ import annotations

import json
import re

import orjson

from relay.base.records import Account, Turn
from relay.wire.sse import Event
from relay.translate.chatrequest import chatToResponses
from relay.translate.media import MEDIA_ENDPOINTS, mediaPath
from relay.upstream.headers import SCOPED, routingHint
from relay.wire.jsoncodec import LARGE_BODY_BYTES

LARGE_INPUT_ITEMS = 64
"""An C{input} of more items than this is a large body (a history relay
expanded, R61, R77) even when the client's own frame was small."""

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

OAUTH_SAMPLING_DROPPED = ("max_output_tokens", "temperature", "top_p")
"""Sampling fields the ChatGPT backend answers 400 C{{"detail":"Unsupported
parameter: ..."}} to. Codex never sends them; SDK and chat clients do, so
relay leaves them out of every OAuth upstream request (HTTP and WebSocket,
Responses and translated chat turns alike): whether a turn succeeds must not
depend on which kind of account the scheduler picked (behaviour.md R86's
rule of one outcome for one request). They still apply on API-key accounts."""


def dropOAuthSampling(body: dict) -> None:
    """
    Remove L{OAUTH_SAMPLING_DROPPED} from C{body} (in place), for an OAuth
    upstream request.
    """
    for name in OAUTH_SAMPLING_DROPPED:
        body.pop(name, None)

OAUTH_CHAT_FIELDS = frozenset(
    {
        "model",
        "instructions",
        "input",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning",
        "store",
        "stream",
        "include",
        "prompt_cache_key",
        "text",
    }
)
"""The fields a translated chat turn keeps on an OAuth account: those Codex
itself sends (protocol.md 2.1). The ChatGPT backend answers 400
C{{"detail":"Unsupported parameter: ..."}} to others that chat clients
send by default, e.g. C{max_output_tokens} (from C{max_tokens}),
C{temperature} and C{top_p}."""


def translatesChat(turn: Turn, account: Account) -> bool:
    """
    Whether C{turn} is a chat turn that C{account} serves through its
    C{/responses} route (protocol.md 3 "Upstream": OAuth accounts have no
    C{/chat/completions}); the engine then puts a
    L{relay.translate.ChatCompletionsSink} in front of the client's sink.
    """
    return turn.endpoint == "chat" and account.type == "oauth"


def upstreamPath(turn: Turn, account: Account) -> str:
    """
    The upstream route under the account's base URL: C{/responses} (a
    Messages turn too, R115), or C{/chat/completions} for a chat turn on
    an account that has it, or a media turn's
    (L{relay.translate.media.mediaPath}).
    """
    if turn.endpoint in ("responses", "messages") or translatesChat(turn, account):
        return "/responses"
    if turn.endpoint in MEDIA_ENDPOINTS:
        return mediaPath(turn, account)  # R115: embeddings, images
    return "/chat/completions"


def upstreamStreams(turn: Turn, account: Account) -> bool:
    """
    Whether the upstream request streams.

    The ChatGPT (OAuth) backend accepts only streaming requests, so relay
    streams upstream and collects the terminal event for a non-streaming
    client (protocol.md 2.7); chat turns there too. A Messages turn always
    streams upstream: its answer is translated from the events (R115).
    """
    if account.type == "oauth" or turn.endpoint == "messages":
        return True
    return turn.stream and turn.endpoint not in MEDIA_ENDPOINTS


def upstreamBody(turn: Turn, account: Account, pieces: bool = False):
    """
    The JSON body to send to C{account} for C{turn}. A chat turn on an
    OAuth account is translated to a Responses request
    (L{relay.translate.chatrequest.chatToResponses}) keeping L{OAUTH_CHAT_FIELDS}.

    @param pieces: a body spliced from the client's bytes may be given as
        its pieces (L{relay.interfaces.IPiecesDialer}).
    @return: UTF-8 JSON bytes, or (with C{pieces}) a list of bytes-like
        pieces whose concatenation they are.
    """
    if translatesChat(turn, account):
        translated = chatToResponses(turn.body)
        body = {k: v for k, v in translated.items() if k in OAUTH_CHAT_FIELDS}
    elif turn.endpoint == "messages" and account.type == "oauth":
        # R115: the body is already the Responses translation
        # (relay.translate.anthropic); OAuth keeps what a chat turn keeps.
        body = {k: v for k, v in turn.body.items() if k in OAUTH_CHAT_FIELDS}
    else:
        body = dict(turn.body)
    for name in WS_ONLY_FIELDS:
        body.pop(name, None)
    if turn.model:
        body["model"] = account.upstreamModel(turn.model)
    scopeCacheKey(turn, body)  # R112, both account types
    if account.type == "oauth":
        body["stream"] = True
        body["store"] = False
        body.setdefault("instructions", "")
        for name in OAUTH_HTTP_DROPPED:
            body.pop(name, None)
        dropOAuthSampling(body)
    elif turn.stream or turn.endpoint == "messages":
        body["stream"] = True
        if turn.endpoint == "chat":
            # Always ask for the usage chunk, so every
            # chat stream is counted; relay drops it again when the client
            # did not ask (relay.usage.reader).
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            body["stream_options"] = options
    elif body.get("stream") is not False:
        # A client's own C{"stream": false} goes as it came (the spliced
        # body keeps the client's bytes); anything else is dropped.
        body.pop("stream", None)
    if translatesChat(turn, account):
        return encodeBody(body, turn.bodySize)
    return encodeBody(body, turn.bodySize, turn.rawBody, pieces)


def encodeBody(body: dict, size: int = 0, raw=None, pieces: bool = False):
    """
    The bytes of an upstream request body (HTTP, or a WebSocket frame).

    A small body is C{json.dumps(body, separators=(",", ":"))} (ASCII,
    the standard library's bytes). A large one -- the client's body was
    over L{LARGE_BODY_BYTES} (C{size}), or its C{input} holds more than
    L{LARGE_INPUT_ITEMS} items (a Codex history) -- is written by orjson:
    compact, non-ASCII text as UTF-8, which is byte for byte what Codex
    itself sends, so the upstream gets the client's own bytes with only
    the top-level fields relay changed, at a third of the standard
    library's cost and without its intermediate C{str}. A value orjson
    does not write (an integer beyond 64 bits, nesting past 255 levels)
    takes the standard library. With the client's own bytes (C{raw}) only
    the top-level members relay changed are written
    (L{relay.wire.rawjson.RawObject.splice}): the history is copied once,
    never read.

    @param body: the JSON-ready body; its values are never changed here.
    @param size: the client's body in bytes (L{Turn.bodySize}), 0 if not
        known.
    @param raw: the client's body as it came (L{Turn.rawBody}), or
        L{None}.
    @param pieces: a spliced body is given as its pieces (a list), not
        joined (L{relay.wire.rawjson.RawObject.splice}).
    @return: UTF-8 JSON bytes, or their pieces.
    """
    if raw is not None:
        spliced = raw.splice(body, pieces)
        if spliced is not None:
            return spliced
    if size > LARGE_BODY_BYTES or _manyItems(body):
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            pass
    return _compactJSON(body).encode("utf-8")


def _manyItems(body: dict) -> bool:
    items = body.get("input")
    return items.__class__ is list and len(items) > LARGE_INPUT_ITEMS


def _makeCompactJSON():
    """
    C{json.dumps(value, separators=(",", ":"))}, built once instead of on
    every turn (C{json.dumps} builds a new L{json.JSONEncoder}
    whenever an argument is not its default, and the encoder builds its C
    encoder on every call): the C encoder itself when there is one. It
    keeps no circular-reference markers (a body is parsed JSON or built
    from it, never circular); tests.test_frontpath compares the bytes.
    """
    from json.encoder import c_make_encoder, encode_basestring_ascii

    encoder = json.JSONEncoder(separators=(",", ":"))
    if c_make_encoder is None:
        return encoder.encode
    chunks = c_make_encoder(
        None, encoder.default, encode_basestring_ascii, None, ":", ",", False, False, True
    )
    join = "".join

    def compactJSON(value) -> str:
        return join(chunks(value, 0))

    return compactJSON


_compactJSON = _makeCompactJSON()


_NEVER_SEMANTIC = frozenset({b"response.created", b"response.in_progress", b"response.queued"})
_EMPTY_WHEN_BARE = frozenset(
    {
        b"response.output_item.added",
        b"response.content_part.added",
        b"response.reasoning_summary_part.added",
    }
)


def isSemanticOutput(event: Event, chat: bool = False) -> bool:
    """
    Whether C{event} is the first semantic output (behaviour.md R22, R84,
    R86.5).

    Not semantic: C{response.created}, C{response.in_progress}, upstream
    extras (C{codex.*}, C{responsesapi.*}), and C{output_item.added} /
    C{content_part.added} / C{reasoning_summary_part.added} that carry no
    content (a message with empty content, a reasoning item with neither
    C{encrypted_content} nor summary text). On a chat completions stream a
    role chunk without content and an empty delta are not semantic either
    (R84). Failure events are handled by the caller before this test.

    @param event: the upstream event.
    @param chat: the stream is a chat completions stream (data-only chunks).
    """
    if chat:
        return _chatSemantic(event)
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
    return True


_CHAT_OUTPUT_FIELDS = ("content", "tool_calls", "function_call", "refusal", "reasoning_content")


def _chatSemantic(event: Event) -> bool:
    """
    R84/R86.5: a chat chunk is output when a choice carries content, a tool
    call, a refusal or a finish reason, or when it is the final usage chunk
    (no choices).
    """
    if event.type == b"[DONE]":
        return True
    data = event.json()
    choices = data.get("choices")
    if not isinstance(choices, list):
        return bool(data.get("usage"))
    if not choices:
        return bool(data.get("usage"))
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            return True
        delta = choice.get("delta") or choice.get("message") or {}
        if isinstance(delta, dict) and any(delta.get(k) for k in _CHAT_OUTPUT_FIELDS):
            return True
    return False


def isEmptyCompleted(response: dict) -> bool:
    """
    A silent upstream refusal: a C{response.completed} with no output, no
    usage and no error (behaviour.md R23, sub2api #5009). A response that
    is still C{queued} or C{in_progress} (a background create, R88) is not
    one.

    @param response: the terminal event's C{response} object.
    """
    return (
        not response.get("output") and not response.get("usage") and not response.get("error")
        and response.get("status") in (None, "completed")
    )


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


_PATH_TOKEN = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


def withoutField(body: dict, path: str):
    """
    behaviour.md R7, R106, R112: after an upstream 400 naming an unknown or
    unsupported parameter, drop that field so the same account can be
    retried once. C{path} is a top-level name (matched exactly first), or a
    path as upstream writes it: C{text.verbosity}, C{input[0].foo}.

    @param body: the turn's request body.
    @param path: the field upstream named.
    @return: a new body without the field (containers on the path copied,
        the rest shared), or L{None} when the body has no such field.
    """
    if not isinstance(body, dict) or not isinstance(path, str):
        return None
    if path in body:
        return {k: v for k, v in body.items() if k != path}
    tokens = [(int(i) if i else n) for i, n in _PATH_TOKEN.findall(path)]
    if len(tokens) < 2:
        return None

    def drop(node, rest):
        head = rest[0]
        if isinstance(node, dict) and isinstance(head, str) and head in node:
            if len(rest) == 1:
                return {k: v for k, v in node.items() if k != head}
            child = drop(node[head], rest[1:])
            return None if child is None else {**node, head: child}
        if isinstance(node, list) and isinstance(head, int) and 0 <= head < len(node):
            if len(rest) == 1:
                return None  # an array element is not a parameter
            child = drop(node[head], rest[1:])
            return None if child is None else node[:head] + [child] + node[head + 1:]
        return None

    return drop(body, tokens)


SCOPED_HEADERS = tuple(h.spellings for h in SCOPED)
"""The identifiers of a conversation a client sends as headers, scoped per
key on OAuth accounts (behaviour.md R112, protocol.md 7.2): the rows of
L{relay.upstream.headers.UPSTREAM_HEADERS} marked C{scoped}; each entry's
names are spellings of one header, the first the one sent upstream."""

_CACHE_FALLBACK = frozenset(h.name for h in SCOPED if h.cacheFallback)
"""Scoped headers that fall back to the body's C{prompt_cache_key} when the
client sent none (protocol.md 7.2)."""


def scopedId(ownerId: str, raw: str) -> str:
    """
    One conversation identifier scoped to a key (behaviour.md R112, R104):
    C{xxhash64("k{key}:" + raw)} as 16 hex digits. Deterministic, so a
    key's own prompt caching and session stickiness still work, and two
    keys sending the same raw value never share it upstream.

    @param ownerId: the key's owner id (L{relay.base.records.ClientKey.ownerId}).
    @param raw: the client's value.
    @return: 16 lower-case hex digits.
    """
    import xxhash

    return xxhash.xxh64_hexdigest(("k" + ownerId + ":" + raw).encode("utf-8", "surrogatepass"))


def scopeCacheKey(turn: Turn, body: dict) -> None:
    """
    Replace the body's C{prompt_cache_key} by its key-scoped value
    (L{scopedId}) in place, on every account type (behaviour.md R112):
    two keys never share an upstream prompt cache. A missing, empty or
    non-string value is left as it is.

    @param turn: the turn (its client key scopes the value).
    @param body: a copy of the request body about to go upstream (HTTP
        body or WebSocket C{response.create}), changed in place.
    """
    raw = body.get("prompt_cache_key")
    if isinstance(raw, str) and raw:
        body["prompt_cache_key"] = scopedId(turn.client.ownerId, raw)


def upstreamClientHeaders(turn: Turn, account: Account) -> dict:
    """
    The client headers to hand the dialer for C{account} (it applies its
    own allow-list). For OAuth accounts every header of L{SCOPED_HEADERS}
    is replaced by its key-scoped value (L{scopedId}); the session and
    conversation ids fall back to C{prompt_cache_key}, so one tenant's ids
    never reach the backend next to another's (behaviour.md R112,
    protocol.md 7.2).

    The client's request id goes upstream as C{x-client-request-id}
    (R111: C{Turn.clientRequestId}, the well-formed C{X-Request-Id} or
    C{X-Client-Request-Id} it sent), relay's own id when it sent none.

    When relay maps the model (the account's C{model_mapping}), a client's
    C{x-codex-routing-hint} is rebuilt for the model and tier relay sends
    (R112), never copied stale.

    @return: a new dict (lower-cased names).
    """
    headers = dict(turn.headers)
    if turn.clientRequestId or turn.requestId:
        headers["x-client-request-id"] = turn.clientRequestId or turn.requestId
    if account.type != "oauth":
        return headers
    if headers.get("x-codex-routing-hint") and turn.model:
        sent = account.upstreamModel(turn.model)
        if sent != turn.body.get("model"):
            headers["x-codex-routing-hint"] = routingHint(sent, turn.body.get("service_tier"))
    owner = turn.client.ownerId  # R104
    cacheKey = turn.body.get("prompt_cache_key")
    cacheKey = cacheKey if isinstance(cacheKey, str) and cacheKey else None
    for names in SCOPED_HEADERS:
        raw = next((headers[n] for n in names if headers.get(n)), None)
        if raw is None and names[0] in _CACHE_FALLBACK:
            raw = cacheKey
        for n in names:
            headers.pop(n, None)
        if raw:
            headers[names[0]] = scopedId(owner, raw)
    return headers
