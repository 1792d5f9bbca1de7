# -*- test-case-name: tests.test_anthropic -*-
"""
relay's errors in Anthropic's shape (protocol.md 10 "Errors", behaviour.md
R115): C{{"type": "error", "error": {"type", "message"}}}.

The engine decides every error as on any route (its classification, R8-R16);
only the shape and the status are the surface's:

  - 400 C{invalid_request_error}, 401 C{authentication_error}, 403
    C{permission_error}, 404 C{not_found_error}, 413 C{request_too_large},
    429 C{rate_limit_error} (C{retry-after} kept, and given when the
    engine gave none);
  - relay's own "no capacity" and every retryable capacity answer (a 503,
    R15) -> 529 C{overloaded_error} with C{retry-after};
  - any other 5xx -> C{api_error} with its status.
"""

from __future__ import annotations

import json
from typing import Optional

from relay.base.records import ClientError

DEFAULT_RETRY_AFTER = "5"
"""Seconds a 529 or 429 without the engine's own C{Retry-After} asks for."""

_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropicStatus(error: ClientError) -> tuple:
    """
    @param error: relay's decided error.
    @return: C{(status, Anthropic error type, headers)}; headers as
        C{(name bytes, value bytes)} pairs, C{retry-after} added for 429
        and 529 when missing.
    """
    status = error.status
    if status == 503 or status == 529:
        status, kind = 529, "overloaded_error"
    elif status >= 500:
        kind = "api_error"
    else:
        kind = _BY_STATUS.get(status, "invalid_request_error")
    headers = [(n, v) for n, v in error.headers]
    if status in (429, 529) and not any(
            (n.lower() if isinstance(n, bytes) else n.lower().encode()) == b"retry-after"
            for n, _ in headers):
        headers.append((b"retry-after", DEFAULT_RETRY_AFTER.encode()))
    return status, kind, headers


def anthropicBody(error: ClientError, requestId: Optional[str] = None) -> bytes:
    """
    @return: C{{"type": "error", "error": {"type", "message"}}} as JSON
        bytes (with C{request_id} at the top when given).
    """
    _, kind, _ = anthropicStatus(error)
    message = error.message or "The request failed."
    if error.rawBody is not None and not error.message:
        message = error.rawBody.decode("utf-8", "replace")[:2000]
    envelope: dict = {"type": "error", "error": {"type": kind, "message": message}}
    if requestId is not None:
        envelope["request_id"] = requestId
    return json.dumps(envelope).encode("utf-8")


def anthropicStreamError(error: ClientError, requestId: Optional[str] = None) -> bytes:
    """
    @return: an C{event: error} SSE event for an error after the stream
        started.
    """
    return b"event: error\ndata: " + anthropicBody(error, requestId) + b"\n\n"
