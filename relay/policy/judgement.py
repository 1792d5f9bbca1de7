# -*- test-case-name: tests.test_policy -*-
"""
From an attempt's end to a verdict (behaviour.md R86).

L{judge} is the one function the engine asks "what does this end mean":
fail over, retry the same account, or pass the error to the client. It
reads the fact (L{relay.policy.ends}), never how it travelled, and asks the
failure classifier (L{relay.interfaces.IFailureClassifier}, the R1-R24
tables) about the status the fact stands for:

  - an in-band C{error} event that carries a status is judged exactly like
    that HTTP status (R86.1), so a WebSocket 503 event fails over and adds
    to the R11 streak like an HTTP 503;
  - an in-band failure without a status stands for the status its code
    names: C{server_error} for a 500 (R86.2), the R49 rate-limit and
    usage-limit signals for a 429; anything else is R23's stream rule;
  - a WebSocket handshake status is an HTTP status under R56's guard
    (first turn, no C{previous_response_id}); outside it R56's older
    mapping applies (1008 for 401, 403 and other 4xx; 429 and 5xx still
    fail over).

Upstream may quote the request in its messages (R106), so every rule that
matches a phrase sees the message without the request's own strings
(L{requestText}); a status or a code is never the client's to choose.

L{relay.policy.bookkeeping} then turns the same fact and verdict into
account state.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from relay.policy import failures as F
from relay.policy.classify import (
    R49_RATE_LIMIT_CODES,
    R49_RATE_LIMIT_FRAGMENTS,
    REASON_UPSTREAM_WS_BUSY,
    clientStrings,
    isOverload,
    looksHtml,
    parseError,
)
from relay.base.records import ClientError
from relay.policy import ends as E

WS_BUSY_CLOSE = (1013, "upstream websocket is busy, please retry later")
WS_AUTH_FAILED = (1008, "upstream websocket authentication failed")
WS_HANDSHAKE_REJECTED = (1008, "upstream websocket handshake rejected")

#: R86.2: in-band codes (or types) that stand for an HTTP 500.
SERVER_ERROR_CODES = frozenset({"server_error", "internal_error", "internal_server_error"})

#: R106: in-band codes that name a request fault, and the HTTP status each
#: stands for when the event carries none (a bare C{error} event or a
#: C{response.failed}): judged like that status, so a model refusal is R8
#: row 5's model block and an unknown field is R7's rejected field.
REQUEST_FAULT_STATUS = {
    "unknown_parameter": 400,
    "unsupported_parameter": 400,
    "invalid_value": 400,
    "model_not_found": 404,
}

_RATE_LIMIT_MESSAGES = (
    re.compile(r"usage limit.*reached"),
    re.compile(r"rate limit.*(?:reached|exceeded)"),
)


def passVerdict(error: ClientError, reason: str) -> F.Verdict:
    """
    A verdict that gives C{error} to the client without failover and
    without any account marking.

    @param error: what the client sees.
    @param reason: a short machine reason for logs and metrics.
    """
    return F.Verdict(
        kind=F.STATUS,
        failover=False,
        status=error.status,
        reason=reason,
        clientError=error,
        message=error.message,
    )


def busyVerdict(reason: str) -> F.Verdict:
    """
    R-B3: a pool acquire timeout or a full connection queue switches
    accounts, uses the switch budget and writes no cooldown; when the
    budget is spent the client gets close 1013 "upstream websocket is
    busy, please retry later".

    @param reason: the pool's reason (C{timeout}, C{conn_queue_full}).
    """
    return F.Verdict(
        kind=F.STATUS,
        failover=True,
        status=503,
        reason=REASON_UPSTREAM_WS_BUSY,
        message=f"upstream websocket pool busy ({reason})",
        clientError=ClientError(
            503,
            "server_error",
            "Upstream websocket is busy, please retry later",
            wsClose=WS_BUSY_CLOSE,
        ),
    )


def eventError(event: dict) -> tuple:
    """
    The error object, status and headers of an in-band failure event.

    @param event: a C{response.failed}, C{error} or chat error chunk.
    @return: C{(error dict, status int or 0, headers dict lower-cased)}.
    """
    if event.get("type") == "response.failed":
        response = event.get("response")
        err = response.get("error") if isinstance(response, dict) else None
        err = err if isinstance(err, dict) else {}
    else:
        err = event.get("error")
        if not isinstance(err, dict):
            err = {k: event.get(k) for k in ("code", "message", "type", "param") if k in event}
    raw = event.get("status", event.get("status_code"))
    if isinstance(raw, int) and not isinstance(raw, bool):
        status = raw
    elif isinstance(raw, str) and raw.isdigit():
        status = int(raw)
    else:
        status = 0
    headers = event.get("headers")
    headers = {str(k).lower(): v for k, v in headers.items()} if isinstance(headers, dict) else {}
    return err, status, headers


def requestText(turn, account=None) -> frozenset:
    """
    R106: the strings of C{turn} an upstream message may quote: its body's
    field names and string values at any depth, its model name (and the
    account's mapped name for it), its forwarded header values, and an
    image edit's file names and content types (C{turn.upload}, R115).

    @param turn: the L{relay.base.records.Turn}.
    @param account: the L{relay.base.records.Account} attempted, or L{None}.
    @return: L{relay.policy.classify.clientStrings} of them.
    """
    model = getattr(turn, "model", None)
    mapped = account.upstreamModel(model) if account is not None and model else None
    headers = getattr(turn, "headers", None)
    uploads = getattr(turn, "upload", None) or ()
    return clientStrings(
        getattr(turn, "body", None),
        model,
        mapped,
        list(headers.values()) if isinstance(headers, dict) else None,
        [[u.filename, u.contentType, u.field] for u in uploads],
    )


def impliedStatus(err: dict, clientText: frozenset = frozenset()) -> int:
    """
    The HTTP status an in-band failure without one stands for (R86.1,
    R86.2, R49 step 5, R106): 429 for rate-limit and usage-limit signals,
    500 for C{server_error}, the status of a request-fault code
    (L{REQUEST_FAULT_STATUS}), else 0 (R23's stream rule decides).

    @param err: the event's error object.
    @param clientText: the request's strings (L{requestText}).
    """
    f = parseError(0, {"error": err}, "", clientText)
    code = err.get("code")
    if isinstance(code, str) and code.lower() in REQUEST_FAULT_STATUS:
        return REQUEST_FAULT_STATUS[code.lower()]
    if parseError(400, {"error": err}).rejectedField is not None:
        return 400  # the backend's "Unsupported parameter: x" carried in-band
    if isOverload(f):
        return 500 if any(c in SERVER_ERROR_CODES for c in f.codes) else 0
    if any(frag in c for c in f.codes for frag in R49_RATE_LIMIT_FRAGMENTS):
        return 429
    if any(c in f.codes for c in R49_RATE_LIMIT_CODES):
        return 429
    text = " ".join(f.messages)
    if any(p.search(text) for p in _RATE_LIMIT_MESSAGES):
        return 429
    if any(c in SERVER_ERROR_CODES for c in f.codes):
        return 500
    return 0


def _handshakeGuard(turn) -> bool:
    """
    R56's guard: the HTTP status policy applies to a rejected WebSocket
    upgrade on a first turn without C{previous_response_id}.
    """
    return turn.phase == "first_turn" and not turn.previousResponseId


def judge(classifier, end, account, turn, now: float) -> Optional[F.Verdict]:
    """
    Judge one attempt end (behaviour.md R86; see the module docstring).

    @param classifier: the L{relay.interfaces.IFailureClassifier}.
    @param end: an attempt end from L{relay.policy.ends}.
    @param account: the L{relay.base.records.Account} attempted.
    @param turn: the L{relay.base.records.Turn} (endpoint, phase, chain id).
    @param now: Unix seconds, for R12 reset times.
    @return: a L{relay.policy.failures.Verdict}; L{None} for the ends that are not
        failures (L{ends.Completed}, L{ends.Forwarded}, L{ends.Departed},
        L{ends.Refused}) and for an in-band failure R23 forwards unchanged.
    """
    endpoint = turn.endpoint
    if isinstance(end, (E.Completed, E.Forwarded, E.Departed, E.Refused)):
        return None
    if isinstance(end, E.TransportFailure):
        return classifier.classifyTransport(account, end.reason, endpoint)
    if isinstance(end, E.StatusRefused):
        if end.wire == E.WIRE_WS_HANDSHAKE and not _handshakeGuard(turn):
            if end.status in (401, 403):
                return passVerdict(
                    ClientError(
                        end.status, "upstream_error", WS_AUTH_FAILED[1], wsClose=WS_AUTH_FAILED
                    ),
                    "ws_handshake_auth",
                )
            if end.status != 429 and end.status < 500:
                return passVerdict(
                    ClientError(
                        end.status,
                        "upstream_error",
                        WS_HANDSHAKE_REJECTED[1],
                        wsClose=WS_HANDSHAKE_REJECTED,
                    ),
                    "ws_handshake_rejected",
                )
        return classifier.classifyStatus(
            account, endpoint, end.status, end.headers, end.body, now,
            clientText=requestText(turn, account),
        )
    if isinstance(end, E.InBandFailure):
        return _inBand(classifier, end, account, endpoint, now, requestText(turn, account))
    if isinstance(end, E.StreamCut):
        return classifier.classifyStreamFailure(account, endpoint, "read_error", None, end.detail)
    if isinstance(end, E.StreamEnded):
        return classifier.classifyStreamFailure(account, endpoint, "no_terminal", None, "")
    if isinstance(end, E.EmptyCompletion):
        return classifier.classifyStreamFailure(
            account, endpoint, "empty_completed", end.event, ""
        )
    if isinstance(end, E.RelayTimeout):
        if end.which == E.FIRST_OUTPUT:
            return classifier.firstOutputTimeout(account, end.seconds)
        return classifier.classifyStreamFailure(
            account, endpoint, "read_error", None, "stream idle timeout"
        )
    if isinstance(end, E.StagingOverflow):
        return classifier.stagingOverflow(account, end.size)
    if isinstance(end, E.PoolBusy):
        return busyVerdict(end.reason)
    raise TypeError(f"not an attempt end: {end!r}")


def _inBand(
    classifier, end: E.InBandFailure, account, endpoint: str, now: float, clientText: frozenset
):
    """
    R86.1/R86.2: an in-band failure with a status, or one whose code names
    a status, is that HTTP status; anything else is R23's stream rule.
    Either way phrases count only outside C{clientText} (R106).
    """
    err, status, headers = eventError(end.event)
    if not status:
        status = impliedStatus(err, clientText)
    if status >= 400:
        message = err.get("message")
        contentType = str(headers.get("content-type") or "")
        if isinstance(message, str) and looksHtml(message, contentType):
            # The wrapped answer was a page (a CDN block, protocol.md 7.2):
            # judged like that HTTP body, so R11's HTML 403 row applies.
            body = message.encode("utf-8", "replace")
            headers = {**headers, "content-type": contentType or "text/html"}
        else:
            body = json.dumps({"error": err}).encode("utf-8")
            headers = {**headers, "content-type": "application/json"}
        return classifier.classifyStatus(
            account, endpoint, status, headers, body, now, clientText=clientText
        )
    return classifier.classifyStreamFailure(
        account, endpoint, "event", end.event, "", clientText=clientText
    )
