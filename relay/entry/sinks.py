# -*- test-case-name: tests.test_keepalive, tests.test_translate -*-
"""
The HTTP sinks the turn engine writes to: SSE (streaming) and JSON
(non-streaming). Transport adapters only; no policy (architecture.md
invariant 1).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import ITurnSink
from relay.base.records import PROMO_HEADER, ClientError, promoText
from relay.translate.anthropic.errors import (
    anthropicBody,
    anthropicStatus,
    anthropicStreamError,
)
from relay.translate.assemble import ResponseAssembler

_ITEM_DONE = b"response.output_item.done"
from relay.base.requestid import requestIdOf
from relay.base.requestnotes import notesOf

# protocol.md 2.6: error type -> in-stream code.
STREAM_ERROR_CODES = {
    "rate_limit_error": "rate_limit_exceeded",
    "invalid_request_error": "invalid_request",
    "permission_error": "permission_denied",
    "authentication_error": "authentication_failed",
    "upstream_error": "upstream_error",
    "api_error": "server_error",
    "server_error": "server_error",
    "": "server_error",
}


def errorBody(error: ClientError, requestId: Optional[str] = None) -> bytes:
    """
    @param requestId: the turn's id, added to the error object as
        C{request_id} (OpenAI's envelope tolerates extra fields).
    @return: the OpenAI error envelope as JSON bytes.
    """
    envelope = error.envelope()
    if requestId is not None:
        envelope["error"]["request_id"] = requestId
    return json.dumps(envelope).encode("utf-8")


def isMessagesRequest(request) -> bool:
    """
    Whether C{request} is on the Anthropic Messages surface
    (C{/v1/messages} and below, behaviour.md R115): its errors are written
    in Anthropic's shape and statuses.
    """
    return isMessagesPath(getattr(request, "path", None) or b"")


def isMessagesPath(path: bytes) -> bool:
    """
    Whether a request target is C{/v1/messages} or below (R115).
    """
    target = path.split(b"?", 1)[0].rstrip(b"/")
    return target == b"/v1/messages" or target.startswith(b"/v1/messages/")


def writeError(request, error: ClientError) -> None:
    """
    Answer C{request} with C{error} before anything was written: the status,
    C{Retry-After} when safe (R16), for a spent budget the usage-limit
    text Codex prints (L{PROMO_HEADER}, R113), and the JSON envelope carrying the
    request id (L{relay.base.requestid.requestIdOf}), or the upstream body
    unchanged for C{cyber_policy} (R9; the id is then in the
    C{X-Request-Id} header only).
    """
    requestId = requestIdOf(request)
    if notesOf(request).sseStarted:
        # R85: keepalives went out while the request waited for
        # its key's slot, so the 200 and the SSE headers are sent; the
        # error is written in-stream (R19.2).
        writeStreamError(request, error, requestId)
        return
    if isMessagesRequest(request):
        status, _, headers = anthropicStatus(error)  # R115
        request.setResponseCode(status)
        for name, value in headers:
            request.setHeader(name, value)
        request.setHeader(b"content-type", b"application/json")
        request.write(anthropicBody(error, requestId))
        request.finish()
        return
    request.setResponseCode(error.status)
    for name, value in error.headers:
        request.setHeader(name, value)
    if error.usageLimit:
        # R113: Codex prints a usage limit's text from this header
        request.setHeader(PROMO_HEADER, promoText(error.message))
    if error.rawBody is not None:
        request.setHeader(b"content-type", (error.contentType or "application/json").encode())
        request.write(error.rawBody)
    else:
        request.setHeader(b"content-type", b"application/json")
        request.write(errorBody(error, requestId))
    request.finish()


def writeStreamError(request, error: ClientError, requestId: str, model=None) -> None:
    """
    End a request whose SSE head is already sent with C{error} in-stream:
    a C{response.failed} event on the Responses routes, an C{error} event
    on Chat Completions (as L{SSESink.fail} does), then finish.
    """
    target = (getattr(request, "path", None) or b"").split(b"?", 1)[0].rstrip(b"/")
    if target.endswith(b"chat/completions"):
        request.write(b"event: error\ndata: " + errorBody(error, requestId) + b"\n\n")
    elif isMessagesRequest(request):
        request.write(anthropicStreamError(error, requestId))
    else:
        request.write(failedEvent(error, model, requestId))
    request.finish()


def failedEvent(error: ClientError, model, requestId: Optional[str] = None) -> bytes:
    """
    A terminal C{response.failed} SSE event for an error after the stream
    started (protocol.md 2.6, behaviour.md R17).

    @param requestId: the turn's id, added to C{response.error} as
        C{request_id}.
    """
    code = error.code if error.code and error.type != "rate_limit_error" else None
    code = code or STREAM_ERROR_CODES.get(error.type or "", "server_error")
    payload = {
        "type": "response.failed",
        "response": {
            "id": "resp_relay_" + os.urandom(8).hex(),
            "object": "response",
            "model": model,
            "status": "failed",
            "output": [],
            "error": {"code": code, "message": error.message},
        },
    }
    if requestId is not None:
        payload["response"]["error"]["request_id"] = requestId
    return b"event: response.failed\ndata: " + json.dumps(payload).encode() + b"\n\n"


class _RequestSink:
    """
    Common parts: the request, client-gone tracking, producer wiring.
    """

    _log = Logger()

    def __init__(self, request, endpoint: str, model=None):
        self._request = request
        self._endpoint = endpoint
        self._model = model
        self._gone = False
        self._finished = False
        self._producer = None
        self._onWrite = None
        self.committed = False
        self.status = None
        self.failed = None
        """The L{ClientError} the turn ended with, for its record."""
        onGone = getattr(request, "relayOnGone", None)
        if onGone is not None:
            onGone(self._clientGone)  # no Deferred
        else:
            request.notifyFinish().addErrback(self._clientGone)

    def watchWrites(self, callback) -> None:
        """
        Call C{callback()} after every event written to the client, so a
        L{relay.engine.keepalive.StreamKeepalive} writes only after real
        silence (behaviour.md R85).

        @param callback: a no-argument callable, or L{None} to stop.
        """
        self._onWrite = callback

    def _clientGone(self, reason) -> None:
        self._gone = True
        self._onWrite = None  # see L{_finish}

    def attachProducer(self, producer) -> None:
        """
        Let the client socket pause upstream reads (style.md 9(c)).
        """
        if not self._gone and self._producer is None:
            self._producer = producer
            self._request.registerProducer(producer, True)

    def detachProducer(self) -> None:
        if self._producer is not None:
            self._producer = None
            if not self._gone:
                self._request.unregisterProducer()

    def _finish(self) -> None:
        # The write watcher (a keepalive's C{touch}) refers back to this
        # sink through the keepalive: dropped at the end, the request, its
        # body and its parse are freed with the turn instead of at the next
        # full collection.
        self._onWrite = None
        self.detachProducer()
        if not self._gone and not self._finished:
            self._finished = True
            self._request.finish()


@implementer(ITurnSink)
class SSESink(_RequestSink):
    """
    Server-Sent Events to the client (protocol.md 2.2).

    C{headersSent} turns true at the first keepalive or commit; after it
    every error is written in-stream (R17). C{committed} turns true at the
    first output. Keepalive comments may come before and after the first
    output (R85): every write is a whole event, so a comment always falls
    between two events.
    """

    headersSent = False
    _noted = None
    quietSince = None
    """When the client was last written to before the turn began (clock
    seconds; keepalives during the key's slot wait), or L{None}."""

    def __init__(self, request, endpoint: str, model=None):
        super().__init__(request, endpoint, model)
        if notesOf(request).sseStarted:
            # R85: the intake sent the head with a keepalive
            # while the request waited for its key's slot.
            self.headersSent = True
            self.status = 200
            self.quietSince = notesOf(request).quietSince

    def noteHeaders(self, headers: dict) -> None:
        """
        R90: the upstream's response headers (its C{x-codex-turn-state})
        arrived before any output; a keepalive that commits the status line
        before the output now sends them too.

        @param headers: the headers L{relay.engine.pump.passHeaders} keeps.
        """
        self._noted = headers

    def _sendHeaders(self, headers=None) -> None:
        if self.headersSent:
            return
        if not headers:
            headers = self._noted
        self.headersSent = True
        self.status = 200
        r = self._request
        r.setResponseCode(200)
        r.setHeader(b"content-type", b"text/event-stream")
        r.setHeader(b"cache-control", b"no-cache")
        r.setHeader(b"x-accel-buffering", b"no")
        for name, value in (headers or {}).items():
            r.setHeader(name.encode("latin-1"), value.encode("latin-1"))

    def keepalive(self) -> None:
        """
        An SSE comment (protocol.md 2.2), before or after the first output
        (R31, R85); the first one commits 200 and the SSE headers.
        """
        if self._gone or self._finished:
            return
        self._sendHeaders()
        self._request.write(b":\n\n")

    def commit(self, headers) -> None:
        self._sendHeaders(headers)
        self.committed = True

    def writeEvent(self, event) -> None:
        if not self._gone and not self._finished:
            self._request.write(event.raw)
            if self._onWrite is not None:
                self._onWrite()

    def writeRaw(self, data: bytes) -> None:
        """
        Write complete upstream SSE events as they came (the pass-through
        hot path after first output).
        """
        if not self._gone and not self._finished:
            self._request.write(data)
            if self._onWrite is not None:
                self._onWrite()

    def writeBody(self, status, headers, body) -> None:
        # A streaming client got a JSON body from upstream: forward it as is.
        if self._gone or self._finished:
            return
        if not self.headersSent:
            self.status = status
            self._request.setResponseCode(status)
            self._request.setHeader(b"content-type", b"application/json")
        self._request.write(body)
        self._finish()

    def fail(self, error: ClientError) -> None:
        self.failed = error
        if self._gone or self._finished:
            return
        if not self.headersSent:
            self.status = error.status
            self._finished = True
            self._onWrite = None  # see L{_finish}
            writeError(self._request, error)
            return
        requestId = requestIdOf(self._request)
        if self._endpoint == "responses":
            self._request.write(failedEvent(error, self._model, requestId))
        elif self._endpoint == "messages":
            self._request.write(anthropicStreamError(error, requestId))  # R115
        else:
            self._request.write(b"event: error\ndata: " + errorBody(error, requestId) + b"\n\n")
        self._finish()

    def finish(self) -> None:
        self._finish()


@implementer(ITurnSink)
class JSONSink(_RequestSink):
    """
    One JSON answer for a non-streaming client. A streamed upstream (OAuth
    accounts) is collected: the terminal event's C{response} object is the
    body (protocol.md 2.7), its C{output} rebuilt from the
    C{response.output_item.done} events when the terminal event carries
    C{output: []}, as the ChatGPT backend's does.

    C{holdsOutput}: nothing reaches the client before the terminal event,
    so a failure before it may still fail over (behaviour.md R19 step 2).
    """

    holdsOutput = True

    def __init__(self, request, endpoint: str, model=None):
        super().__init__(request, endpoint, model)
        self._final = None
        self._headers = {}
        self._assembler = ResponseAssembler()

    def keepalive(self) -> None:
        """
        Non-streaming requests get no pings (R31).
        """

    def commit(self, headers) -> None:
        self.committed = True
        self._headers = dict(headers or {})

    def writeEvent(self, event) -> None:
        if event.type == _ITEM_DONE:
            self._assembler.add(event.json())
        elif event.terminal and event.type != b"[DONE]":
            final = event.json().get("response")
            self._final = self._assembler.complete(final) if isinstance(final, dict) else final
            self._reply()

    def _reply(self) -> None:
        if self._gone or self._finished:
            return
        self.status = 200
        r = self._request
        r.setResponseCode(200)
        r.setHeader(b"content-type", b"application/json")
        for name, value in self._headers.items():
            r.setHeader(name.encode("latin-1"), value.encode("latin-1"))
        data = json.dumps(self._final).encode("utf-8")
        r.setHeader(b"content-length", b"%d" % len(data))
        r.write(data)
        self._finish()

    def writeBody(self, status, headers, body) -> None:
        if self._gone or self._finished:
            return
        self.committed = True
        self.status = status
        r = self._request
        r.setResponseCode(status)
        r.setHeader(b"content-type", b"application/json")
        for name, value in (headers or {}).items():
            r.setHeader(name.encode("latin-1"), value.encode("latin-1"))
        # The whole body is here: a length instead of chunked encoding (one
        # write, no terminating chunk).
        r.setHeader(b"content-length", b"%d" % len(body))
        r.write(body)
        self._finish()

    def fail(self, error: ClientError) -> None:
        self.failed = error
        if self._gone or self._finished:
            return
        self.status = error.status
        self._finished = True
        self.detachProducer()
        writeError(self._request, error)

    def finish(self) -> None:
        if self._final is None:
            self._finish()
