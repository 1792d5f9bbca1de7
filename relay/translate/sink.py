# -*- test-case-name: tests.test_translate -*-
"""
L{ChatCompletionsSink}: the turn sink of a chat turn on an OAuth account.

The engine runs every turn the same way: its stream pump stages, classifies
and fails over on upstream Responses events (behaviour.md R22, R23, R84,
R86.5). For a chat turn on an account that only has C{/responses}, the
engine puts this adapter in front of the client's own sink for that one
attempt (L{relay.engine.payload.translatesChat}); what the pump writes is
translated here, on write, into Chat Completions: chunks and C{data:
[DONE]} for a streaming client (protocol.md 3 "Stream"), one
C{chat.completion} object for a non-streaming one. Nothing reaches the
client before the pump commits, so a failed attempt leaves no trace and
the next account's answer is the only stream the client sees (R84).

Errors: a failed upstream turn (C{response.failed}, an C{error} event)
becomes the chat error envelope: an HTTP status when nothing was written
yet (R10: C{invalid_request_error} 400, C{rate_limit_error} 429,
C{api_error} 5xx), else an in-stream C{event: error} (protocol.md 3
"Errors"). Transport adapter only; no policy (architecture.md invariant 1).
"""

from __future__ import annotations

import json

from zope.interface import implementer

from relay.interfaces import ITurnSink
from relay.base.records import ClientError, Turn
from relay.wire.sse import DONE, Event
from relay.translate.adapter import TranslatingSink
from relay.translate.assemble import chatCompletion
from relay.translate.chatstream import ChatChunkTranslator

_CHUNK = b"chat.completion.chunk"
_DONE_EVENT = Event(DONE, DONE, b"data: [DONE]\n\n")

RATE_LIMIT_CODES = frozenset(
    {"rate_limit_exceeded", "insufficient_quota", "usage_limit_reached", "usage_not_included"}
)
"""In-band error codes a chat client gets as 429 C{rate_limit_error} (R10)."""

SERVER_CODES = frozenset(
    {"server_error", "server_is_overloaded", "upstream_error", "stream_timeout"}
)
"""In-band error codes a chat client gets as 500 C{api_error} (R10)."""


def chatError(error: dict) -> ClientError:
    """
    The chat error envelope for an upstream in-band failure (behaviour.md
    R10; protocol.md 3 "Errors").

    @param error: C{{code, message, type?, param?}} of a C{response.failed}
        or an C{error} event.
    @return: a L{ClientError}: 429 C{rate_limit_error} for rate and quota
        codes, 500 C{api_error} for server-side codes or none, otherwise
        400 C{invalid_request_error} (context window, policy, invalid
        request: the failures that are the request's own).
    """
    code = error.get("code")
    code = code if isinstance(code, str) and code else None
    message = error.get("message") or "The upstream response failed."
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if code in RATE_LIMIT_CODES or error.get("type") == "rate_limit_error":
        return ClientError(429, "rate_limit_error", message, code=code, param=param)
    if code is None or code in SERVER_CODES:
        return ClientError(500, "api_error", message, code=code, param=param)
    return ClientError(400, "invalid_request_error", message, code=code, param=param)


@implementer(ITurnSink)
class ChatCompletionsSink(TranslatingSink):
    """
    Writes Responses events to a chat client (see the module docstring).

    @ivar committed: the engine committed this attempt's output.
    """

    def __init__(self, inner, turn: Turn, now: float):
        """
        @param inner: the client's L{ITurnSink} (an SSE sink for a streaming
            client, a JSON sink otherwise), built for C{endpoint="chat"}.
        @param turn: the chat turn (its C{stream}, C{model} and
            C{stream_options.include_usage}).
        @param now: clock seconds, for C{created} when upstream gives none.
        """
        self._inner = inner
        self._stream = turn.stream
        options = turn.body.get("stream_options")
        includeUsage = isinstance(options, dict) and options.get("include_usage") is True
        self._translator = ChatChunkTranslator(
            turn.model, includeUsage or not turn.stream, int(now)
        )
        self._chunks: list = []
        self._headers: dict = {}
        self._started = False
        self._done = False
        self.committed = False

    def writeEvent(self, event) -> None:
        if self._done or event.type == DONE:
            return
        parsed = event.json()
        chunks = self._translator.feed(parsed if isinstance(parsed, dict) else {})
        if self._translator.error is not None:
            self._fail(chatError(self._translator.error))
            return
        if self._stream:
            for chunk in chunks:
                self._send(chunk)
            if self._translator.finished:
                self._inner.writeEvent(_DONE_EVENT)
                self._done = True
            return
        self._chunks.extend(chunks)
        if self._translator.finished:
            self._done = True
            body = chatCompletion(self._chunks, self._translator.usage)
            self._inner.writeBody(200, self._headers, json.dumps(body).encode("utf-8"))

    def _send(self, chunk: dict) -> None:
        if not self._started:
            self._started = True
            self._inner.commit(self._headers)
        data = json.dumps(chunk, separators=(",", ":")).encode("utf-8")
        self._inner.writeEvent(Event(_CHUNK, data, b"data: " + data + b"\n\n"))

    def writeBody(self, status, headers, body) -> None:
        """
        A non-streaming upstream answer: a Responses object is translated
        like a terminal event; anything else goes to the client unchanged.
        """
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if status == 200 and isinstance(parsed, dict) and parsed.get("object") == "response":
            self._headers = dict(headers or {})
            kind = "response." + {"failed": "failed", "incomplete": "incomplete"}.get(
                parsed.get("status"), "completed"
            )
            data = json.dumps({"type": kind, "response": parsed}).encode()
            self.writeEvent(Event(kind.encode(), data))
            return
        self._done = True
        self._inner.writeBody(status, headers, body)
