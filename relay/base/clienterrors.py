# -*- test-case-name: tests.test_runner -*-
"""
The client-facing errors the turn engine itself originates: admission
failures (behaviour.md R32) and internal errors (R19). Upstream-derived
errors come from the classifier (R9, R10, R15).
"""

from __future__ import annotations

from typing import Optional

from relay.base.records import AdmissionError, ClientError

QUEUE_FULL_MESSAGE = "Too many pending requests, please retry later"
ACCOUNT_TIMEOUT_MESSAGE = "Concurrency limit exceeded for account, please retry later"
USER_TIMEOUT_MESSAGE = "Concurrency limit exceeded for user, please retry later"
UNAVAILABLE_MESSAGE = "Service temporarily unavailable, please retry later"


def admissionError(error: AdmissionError, kind: str) -> ClientError:
    """
    Map an admission failure to what the client sees (behaviour.md R32).

    relay's own 429s carry a distinct C{code} (C{relay_queue_full},
    C{relay_wait_timeout}) so they cannot be confused with an upstream 429.

    @param error: the L{AdmissionError} (C{queue_full}, C{timeout}, C{error}).
    @param kind: C{account} or C{user}.
    @return: a L{ClientError} with the HTTP status and the WebSocket close.
    """
    if error.reason == "queue_full":
        close = (
            (1013, "account is busy, please retry later")
            if kind == "account"
            else (1013, "too many concurrent requests, please retry later")
        )
        return ClientError(
            429, "rate_limit_error", QUEUE_FULL_MESSAGE, code="relay_queue_full", wsClose=close
        )
    if error.reason == "timeout":
        if kind == "account":
            return ClientError(
                429,
                "rate_limit_error",
                ACCOUNT_TIMEOUT_MESSAGE,
                code="relay_wait_timeout",
                wsClose=(1013, "account is busy, please retry later"),
            )
        return ClientError(
            429,
            "rate_limit_error",
            USER_TIMEOUT_MESSAGE,
            code="relay_wait_timeout",
            wsClose=(1013, "too many concurrent requests, please retry later"),
        )
    return ClientError(
        503,
        "api_error",
        UNAVAILABLE_MESSAGE,
        code="relay_admission_error",
        wsClose=(1011, f"failed to acquire {kind} concurrency slot"),
    )


def internalError() -> ClientError:
    """
    A relay bug surfaced to the client (R19: "writes the fallback error").
    """
    return ClientError(
        502,
        "upstream_error",
        "Upstream request failed",
        wsClose=(1011, "upstream websocket proxy failed"),
    )


def streamBrokenError(message: str) -> ClientError:
    """
    An upstream stream that failed after output began (R17, R23): written
    in-stream as C{response.failed}.
    """
    return ClientError(
        502, "upstream_error", message, wsClose=(1011, "upstream websocket proxy failed")
    )


def streamTimeoutError() -> ClientError:
    """
    The upstream stream went idle after output began (R24).
    """
    return ClientError(
        504,
        "upstream_error",
        "Upstream stream idle timeout",
        code="stream_timeout",
        wsClose=(1001, "upstream websocket read timeout; please reconnect"),
    )


def previousResponseNotFound(responseId: Optional[str]) -> ClientError:
    """
    The error that makes a client resend its full input (protocol.md 4.5,
    behaviour.md R66, R-B7): status 400 C{previous_response_not_found}, then
    the WebSocket closes so Codex reconnects.
    """
    return ClientError(
        400,
        "invalid_request_error",
        f"Previous response with id '{responseId}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
        wsClose=(1011, "upstream websocket proxy failed"),
    )


RESTART_CLOSE = (1001, "server restarting")
"""The WebSocket close a draining relay sends: C{(code, reason)}."""
