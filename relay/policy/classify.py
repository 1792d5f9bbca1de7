# -*- test-case-name: tests.test_classify -*-
"""
The default failure classifier: behaviour.md groups A-C (R1-R24) as data.

Every rule lives in a module-level table named after its requirement, so a
reader can hold this file next to behaviour.md and check it row by row:

    - L{R3_PERSISTENT_ERRNOS}, L{R3_PERSISTENT_TYPES}, L{R3_MARKERS}:
      transport failures, persistent or transient;
    - L{R8_TABLE}: whether an upstream status fails over (first match wins);
    - L{R9_STATUS_MAP}, L{R10_TYPE_BY_STATUS}: errors that do not fail over;
    - L{R11_STATUS_RULES}: account markings by status;
    - L{R15_STATUS_MAP}, L{R65_WS_CLOSE}: what the client sees when failover
      is exhausted;
    - L{R23_POLICY_MARKERS}, L{R23_ERROR_RETRY_WORDS}: stream failures;
    - L{R106_QUOTE_MARKERS}, L{scrubMessage}, L{rejectedField}: text the
      client supplied never decides (R106), and R7's rejected field.

The classifier is pure: no I/O and no clock. Times it needs (R12 resets,
R16 dates) come in as C{now}; the stateful part of marking (the 403 counter,
the transient streak, the R13 window, the R-B1 breaker) is
L{relay.policy.health.AccountHealth}.
"""

from __future__ import annotations

import errno
import functools
import json
import re
from email.utils import parsedate_to_datetime
from typing import Any, Iterator, Optional

from attrs import evolve, frozen
from twisted.internet import error as terror
from twisted.python.failure import Failure
from zope.interface import implementer

from relay.policy.failures import (
    FIRST_OUTPUT_TIMEOUT,
    MARK_COUNT_403,
    MARK_DISABLED,
    MARK_MODEL_BLOCK,
    MARK_RATE_LIMITED,
    MARK_TEMP_UNSCHEDULABLE,
    MARK_TRANSIENT_STREAK,
    STAGING_OVERFLOW,
    STATUS,
    STREAM,
    TRANSPORT,
    Marking,
    Verdict,
)
from relay.interfaces import IFailureClassifier
from relay.base.records import Account, ClientError

# ---------------------------------------------------------------------------
# Messages the client sees (R5, R8, R9, R15, R20, R65)
# ---------------------------------------------------------------------------

MSG_TEMPORARILY_UNAVAILABLE = "Upstream service temporarily unavailable"
MSG_REQUEST_FAILED = "Upstream request failed"
MSG_ACCESS_UNAVAILABLE = "Upstream access is temporarily unavailable, please retry later"
MSG_OVERLOADED_DEFAULT = "Upstream service is temporarily overloaded, please retry later"
MSG_PAYLOAD_TOO_LARGE = "Request payload is too large"
MSG_AUTH_FAILED = "Upstream authentication failed, please contact administrator"
MSG_FORBIDDEN = "Upstream access forbidden, please contact administrator"
MSG_RATE_LIMITED = "Upstream rate limit exceeded, please retry later"
MSG_SERVICE_OVERLOADED = "Upstream service overloaded, please retry later"
MSG_PAYMENT = "Upstream payment required: insufficient balance or billing issue"
MSG_REJECTED = "Upstream rejected the request"
MSG_NO_OUTPUT = "Upstream produced no output before the deadline"
MSG_STREAM_DISCONNECTED = "OpenAI stream disconnected before completion: "
MSG_STREAM_NO_TERMINAL = "OpenAI stream ended before a terminal event"
MSG_EMPTY_COMPLETED = "Upstream returned an empty response"

WS_PROXY_FAILED = (1011, "upstream websocket proxy failed")
WS_RATE_LIMITED = (1013, "upstream rate limit exceeded, please retry later")
WS_UNAVAILABLE = (1013, "upstream service temporarily unavailable")
WS_AUTH_FAILED = (1008, "upstream websocket authentication failed")
WS_CREDENTIAL_UNAVAILABLE = (1013, "upstream credential unavailable, please retry later")

# Short machine reasons (Verdict.reason), for logs and metrics.
REASON_TRANSPORT_PERSISTENT = "transport_persistent"
REASON_TRANSPORT_TRANSIENT = "transport_transient"
REASON_CYBER_POLICY = "cyber_policy"
REASON_CONTEXT_WINDOW = "context_window"
REASON_ACCESS_STATE = "access_state"
REASON_BODY_TOO_LARGE = "openai_request_body_too_large"
REASON_MODEL_NOT_FOUND = "model_not_found"
REASON_OVERLOAD = "overload"
REASON_TRANSIENT_PROCESSING = "transient_processing"
REASON_ACCOUNT_POLICY = "account_policy"
REASON_CLIENT_ERROR = "client_error"
REASON_REJECTED_FIELD = "rejected_field"
REASON_FIRST_OUTPUT_TIMEOUT = "first_output_timeout"
REASON_STAGING_OVERFLOW = "staging_overflow"
REASON_STREAM_READ_ERROR = "stream_read_error"
REASON_STREAM_NO_TERMINAL = "stream_no_terminal"
REASON_EMPTY_COMPLETED = "empty_completed"
REASON_STREAM_RATE_LIMIT = "stream_rate_limit"
REASON_STREAM_FAILED = "stream_failed"
REASON_STREAM_RETRYABLE_ERROR = "stream_retryable_error"
REASON_UPSTREAM_WS_BUSY = "upstream_ws_busy"

# ---------------------------------------------------------------------------
# Constants with units
# ---------------------------------------------------------------------------

#: R7: how much of an error body is read, bytes.
ERROR_BODY_LIMIT = 512 * 1024
#: Cap of a sanitised message, characters.
MESSAGE_CAP = 500
#: R11: OAuth 401 with a refresh token: temp-unschedulable, seconds.
OAUTH_401_COOLDOWN_SECONDS = 600
#: R11 check 4: model-level cooldown for "model not found", seconds. The
#: requirement gives no duration; relay uses 10 minutes.
MODEL_NOT_FOUND_COOLDOWN_SECONDS = 600
#: R12: fallback cooldown clamp, seconds.
RATE_LIMIT_FALLBACK_MIN_SECONDS = 1
RATE_LIMIT_FALLBACK_MAX_SECONDS = 7200
#: R13: same-account delay cap and default, seconds.
OAUTH_429_MAX_DELAY_SECONDS = 8.0
OAUTH_429_DEFAULT_DELAY_SECONDS = 0.5
#: R16: a copied Retry-After is at most this long, characters ...
RETRY_AFTER_MAX_CHARS = 128
#: ... and at most this far ahead, seconds (7 days).
RETRY_AFTER_MAX_SECONDS = 7 * 24 * 3600

# ---------------------------------------------------------------------------
# R3: transport failures
# ---------------------------------------------------------------------------

#: R3 typed check: an errno anywhere in the wrapped chain makes it persistent.
R3_PERSISTENT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})

#: R3 typed check: these exception types are persistent (refused, no route,
#: DNS "host not found").
R3_PERSISTENT_TYPES = (
    terror.ConnectionRefusedError,
    terror.NoRouteError,
    terror.DNSLookupError,
    ConnectionRefusedError,
)

#: R3 text markers, searched in the lower-cased text of every wrapped reason.
R3_MARKERS = (
    "authentication failed",
    "proxy authentication required",
    "connection refused",
    "no route to host",
    "network is unreachable",
    "no such host",
)

#: How deep the chain walk goes (wrapped Failures, causes, contexts).
_MAX_CHAIN = 32


def _children(exc: BaseException) -> list:
    """
    The exceptions C{exc} wraps: C{.reasons} (twisted.web's
    C{ResponseNeverReceived}, C{RequestTransmissionFailed},
    C{ResponseFailed}), C{.subFailure}, C{__cause__}, C{__context__}.

    @param exc: an exception.
    @return: a list of exceptions or L{Failure}s.
    """
    out = []
    reasons = getattr(exc, "reasons", None)
    if isinstance(reasons, (list, tuple)):
        out.extend(reasons)
    sub = getattr(exc, "subFailure", None)
    if sub is not None:
        out.append(sub)
    if exc.__cause__ is not None:
        out.append(exc.__cause__)
    if exc.__context__ is not None and not exc.__suppress_context__:
        out.append(exc.__context__)
    return out


def walkChain(reason: Any) -> Iterator[BaseException]:
    """
    Every exception in a failure chain, outermost first (R3 "found on the
    exception or any exception it wraps").

    @param reason: an exception or a L{Failure}.
    @return: an iterator of exceptions, each once.
    """
    seen: set = set()
    stack = [reason]
    count = 0
    while stack and count < _MAX_CHAIN:
        item = stack.pop(0)
        if isinstance(item, Failure):
            item = item.value
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        count += 1
        yield item
        stack.extend(_children(item))


def _errnoOf(exc: BaseException) -> Optional[int]:
    """
    The errno an exception carries: C{OSError.errno}, or the C{osError} of a
    Twisted C{ConnectError} (an int or an C{OSError}).

    @return: an int or L{None}.
    """
    if isinstance(exc, OSError) and isinstance(exc.errno, int):
        return exc.errno
    os_error = getattr(exc, "osError", None)
    if isinstance(os_error, int):
        return os_error
    if isinstance(os_error, OSError) and isinstance(os_error.errno, int):
        return os_error.errno
    return None


def isPersistentTransport(reason: Any) -> bool:
    """
    R3: typed checks first, then text markers; everything else is transient.

    @param reason: an exception or a L{Failure}.
    @return: L{True} for the persistent class.
    """
    chain = list(walkChain(reason))
    for exc in chain:
        if isinstance(exc, R3_PERSISTENT_TYPES) or _errnoOf(exc) in R3_PERSISTENT_ERRNOS:
            return True
    text = " ".join(str(exc) for exc in chain).lower()
    return any(marker in text for marker in R3_MARKERS)


def describeTransport(reason: Any) -> str:
    """
    A sanitised one-line description of a transport failure: the innermost
    reasons (those that wrap nothing), by type and text.

    @param reason: an exception or a L{Failure}.
    @return: text of at most L{MESSAGE_CAP} characters.
    """
    chain = list(walkChain(reason))
    leaves = [e for e in chain if not _children(e)] or chain
    parts = []
    for exc in leaves[:3]:
        text = str(exc).strip()
        parts.append(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    return sanitise("; ".join(parts) or "unknown transport error")


# ---------------------------------------------------------------------------
# Sanitising (architecture invariant 7: secrets never reach logs)
# ---------------------------------------------------------------------------

_SECRET_PATTERNS = (
    (re.compile(r"(?i)\bbearer\s+[^\s\"',;]+"), "Bearer [redacted]"),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{4,}"), "sk-[redacted]"),
    (re.compile(r"\b(eyJ[A-Za-z0-9_\-]{8,}\.)[A-Za-z0-9_\-.]+"), "[redacted-jwt]"),
    (re.compile(r"(?i)([a-z][a-z0-9+.\-]*://)[^/\s@:]+:[^/\s@]*@"), r"\1[redacted]@"),
    (
        re.compile(r"(?i)\b(api[_-]?key|access_token|refresh_token|password)=[^&\s]+"),
        r"\1=[redacted]",
    ),
)


def sanitise(text: Any, cap: int = MESSAGE_CAP) -> str:
    """
    Strip anything that looks like a secret (C{sk-...} keys, bearer tokens,
    JWTs, C{user:pass@} in URLs, C{api_key=} query values) and cap the length.

    @param text: any text (bytes are decoded leniently).
    @param cap: maximum characters kept.
    @return: single-line text.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = " ".join(str(text).split())
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    if len(text) > cap:
        text = text[: cap - 3] + "..."
    return text


# ---------------------------------------------------------------------------
# R106: text the client supplied never decides
# ---------------------------------------------------------------------------

#: R106: an upstream message quotes the request after these words ("Unknown
#: parameter: 'x'.", "Unsupported parameter: x", "Invalid value: 'x'."); the
#: text from the marker on is never matched against a phrase.
R106_QUOTE_MARKERS = (
    "unknown parameter",
    "unsupported parameter",
    "unrecognized request argument",
    "invalid value",
    "unsupported value",
    "invalid type",
    "invalid parameter",
    "missing required parameter",
)
#: R106: what an echoed client string is replaced with, so that taking it
#: out can never join the text around it into a phrase.
R106_SEPARATOR = "\x00"
#: R106: how many client strings one request contributes at most (bounded
#: work per failure; a body with more strings is still scrubbed by the
#: quote markers and the C{param} rule).
R106_MAX_STRINGS = 20_000


def _normalise(text: str) -> str:
    """
    Lower-case C{text} and collapse its whitespace runs to one space, as
    every phrase is written (R106: an upstream that re-spaces an echo must
    not turn it into a phrase).
    """
    return " ".join(text.lower().split())


def clientStrings(*values: Any) -> frozenset:
    """
    R106: every string a request carries that an upstream message may
    quote: the field names and string values of C{values} at any depth
    (dicts, lists), normalised like the messages they are matched in.

    @param values: request bodies, model names, header values (any JSON
        value; other types are ignored).
    @return: a frozenset of non-empty normalised strings, at most
        L{R106_MAX_STRINGS}.
    """
    out: set = set()
    stack = list(values)
    while stack and len(out) < R106_MAX_STRINGS:
        item = stack.pop()
        if isinstance(item, str):
            text = _normalise(item)
            if text:
                out.add(text)
        elif isinstance(item, dict):
            for key, value in item.items():
                stack.append(key)
                stack.append(value)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return frozenset(out)


@functools.cache
def _triggers() -> tuple:
    """
    R106: the phrase text the rules match in messages (R8 rows 2, 5, 7,
    R11's 400 row, R23's retry words, R49's limit signals). A client string
    that contains one of them is taken out of a message before any phrase
    is matched; a client string without any cannot put a phrase there.
    """
    first, second = R8_CONTEXT_PAIR
    return (
        R8_CONTEXT_SUBSTRINGS + first + second + R8_CONTEXT_ALL
        + R8_MODEL_NOT_FOUND_MESSAGES + R8_MODEL_REFUSAL_MESSAGES
        + R8_OVERLOAD_MESSAGES + R8_PROCESSING_MESSAGES + R8_PROCESSING_ALL
        + R11_400_DISABLE_MESSAGES + R23_ERROR_RETRY_WORDS
        + R106_LIMIT_WORDS + R106_QUOTE_MARKERS
    )


def scrubMessage(text: str, clientText: frozenset = frozenset()) -> str:
    """
    R106: the part of an upstream message that the client did not supply,
    for phrase matching only (what the client is shown is never scrubbed).

        1. lower-case, whitespace runs collapsed;
        2. every client string that carries phrase text (L{_triggers}),
           longest first, replaced by L{R106_SEPARATOR};
        3. everything from a quote marker (L{R106_QUOTE_MARKERS}) on cut.

    @param text: the message.
    @param clientText: L{clientStrings} of the request, or empty.
    @return: the scrubbed, normalised text.
    """
    text = _normalise(text)
    if not text:
        return text
    if clientText:
        triggers = _triggers()
        echoed = sorted(
            (s for s in clientText if len(s) <= len(text) and s in text
             and any(t in s for t in triggers)),
            key=len,
            reverse=True,
        )
        for s in echoed:
            text = text.replace(s, R106_SEPARATOR)
    for marker in R106_QUOTE_MARKERS:
        at = text.find(marker)
        if at >= 0:
            text = text[: at + len(marker)]
    return text


#: R106 / R7: an upstream 400 that names a request field it does not take:
#: the API's C{Unknown parameter: 'x'.} (code C{unknown_parameter}) and the
#: ChatGPT backend's C{{"detail":"Unsupported parameter: x"}}.
R106_REJECTED_FIELD_CODES = ("unknown_parameter", "unsupported_parameter")
_R106_REJECTED_PREFIX = (
    r"^\s*(?:unknown|unsupported|unrecognized) (?:parameter|request argument)"
    r"(?: supplied)?:\s*"
)
#: The API's quoted form, C{Unknown parameter: 'x'.} ...
R106_REJECTED_QUOTED = re.compile(
    _R106_REJECTED_PREFIX + r"(?P<q>['\"`])(?P<name>.*)(?P=q)\.?\s*$",
    re.IGNORECASE | re.DOTALL,
)
#: ... and the backend's bare one, C{Unsupported parameter: x}.
R106_REJECTED_BARE = re.compile(_R106_REJECTED_PREFIX + r"(?P<name>.*?)\s*$",
                                re.IGNORECASE | re.DOTALL)


def rejectedField(status: int, code: Optional[str], param: Optional[str],
                  message: Optional[str]) -> Optional[str]:
    """
    R106 / R112: the request field an upstream 400 refuses as unknown or
    unsupported, if it names one.

    @param status: the upstream status.
    @param code: C{error.code}, or L{None}.
    @param param: C{error.param}, or L{None}.
    @param message: the upstream message (C{error.message} or C{detail}),
        unscrubbed, or L{None}.
    @return: the field name or path, or L{None}.
    """
    if status != 400:
        return None
    if isinstance(code, str) and code.lower() in R106_REJECTED_FIELD_CODES and param:
        return param
    if isinstance(message, str):
        match = R106_REJECTED_QUOTED.match(message) or R106_REJECTED_BARE.match(message)
        if match and match.group("name").strip():
            return match.group("name")
    return None


# ---------------------------------------------------------------------------
# Reading an upstream error body (R7)
# ---------------------------------------------------------------------------


def _str(value: Any) -> str:
    """
    @return: C{value} as lower-cased text if it is a str, else C{""}.
    """
    return value.lower() if isinstance(value, str) else ""


def _dict(value: Any) -> dict:
    """
    @return: C{value} if it is a dict, else an empty dict.
    """
    return value if isinstance(value, dict) else {}


@frozen
class ErrorFacts:
    """
    The fields of an upstream error that the rules read.

    @ivar status: the upstream status (0 for stream events without one).
    @ivar isJson: whether the body parsed as a JSON object.
    @ivar raw: the lower-cased raw body text (non-JSON bodies only).
    @ivar error: the C{error} object (or the event's error object).
    @ivar codesCyber: C{error.code}, C{response.error.code} (R8 row 1).
    @ivar codesAccess: C{error.code}, C{response.error.code},
        C{detail.code}, C{code} (R8 row 3).
    @ivar contextTexts: the messages and codes R8 row 2 searches.
    @ivar codes: every code and type, lower-cased.
    @ivar messages: every message, lower-cased.
    @ivar message: the upstream message, sanitised, original case.
    @ivar type: C{error.type} as sent, or L{None}.
    @ivar code: C{error.code} as sent, or L{None}.
    @ivar param: C{error.param} as sent, or L{None}.
    @ivar detailUnauthorized: the body is C{{"detail":"Unauthorized"}}.
    @ivar html: the body is an HTML page.
    @ivar rejectedField: the field a 400 refuses as unknown or unsupported
        (L{rejectedField}), or L{None}.

    C{raw}, C{messages} and the messages in C{contextTexts} are scrubbed of
    client text (R106, L{scrubMessage}); C{message} is what upstream said.
    """

    status: int
    isJson: bool
    raw: str
    error: dict
    codesCyber: tuple
    codesAccess: tuple
    contextTexts: tuple
    codes: tuple
    messages: tuple
    message: str
    type: Optional[str]
    code: Optional[str]
    param: Optional[str]
    detailUnauthorized: bool
    html: bool
    rejectedField: Optional[str] = None


def looksHtml(text: str, contentType: str) -> bool:
    """
    R11 403 row: a CDN or proxy block page (an HTML content type, or a
    body that starts like an HTML document).
    """
    head = text.lstrip()[:200].lower()
    return "text/html" in contentType.lower() or head.startswith(("<!doctype html", "<html"))


def parseError(
    status: int, body: Any, contentType: str = "", clientText: frozenset = frozenset()
) -> ErrorFacts:
    """
    Read the fields R8-R12 look at from an error body (or a stream event).

    @param status: the upstream status.
    @param body: bytes, str, or an already-parsed dict.
    @param contentType: the upstream C{Content-Type}.
    @param clientText: L{clientStrings} of the request (R106), or empty.
    @return: an L{ErrorFacts}.
    """
    data: Any = None
    text = ""
    if isinstance(body, dict):
        data = body
    else:
        if isinstance(body, bytes):
            text = body[:ERROR_BODY_LIMIT].decode("utf-8", "replace")
        elif isinstance(body, str):
            text = body
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            data = None
    isJson = isinstance(data, dict)
    data = _dict(data)
    rawError = data.get("error")
    err = _dict(rawError)
    respErr = _dict(_dict(data.get("response")).get("error"))
    detail = data.get("detail")
    detailObj = _dict(detail)

    errMessage = err.get("message") if err else (rawError if isinstance(rawError, str) else None)
    if errMessage is None and isinstance(err.get("detail"), str):
        # The ChatGPT backend's WebSocket error event carries its 400 body
        # as C{"error": {"detail": "Unsupported parameter: x"}} (R7, R112).
        errMessage = err["detail"]
    codesCyber = (_str(err.get("code")), _str(respErr.get("code")))
    codesAccess = codesCyber + (_str(detailObj.get("code")), _str(data.get("code")))

    def scrubbed(value: Any) -> str:
        return scrubMessage(value, clientText) if isinstance(value, str) else ""

    messages = tuple(
        m
        for m in (
            scrubbed(errMessage),
            scrubbed(respErr.get("message")),
            scrubbed(data.get("message")),
            scrubbed(detail),
            scrubbed(detailObj.get("message")),
        )
        if m
    )
    contextTexts = (
        scrubbed(errMessage),
        scrubbed(respErr.get("message")),
        scrubbed(data.get("message")),
        codesCyber[0],
        codesCyber[1],
        _str(data.get("code")),
    )
    codes = tuple(c for c in codesAccess + (_str(err.get("type")), _str(data.get("type"))) if c)
    html = not isJson and looksHtml(text, contentType)

    original = next(
        (
            m
            for m in (
                errMessage,
                respErr.get("message"),
                data.get("message"),
                detail if isinstance(detail, str) else None,
                detailObj.get("message"),
            )
            if isinstance(m, str) and m.strip()
        ),
        None,
    )
    if original is None and not isJson and text.strip() and not html:
        original = text
    code = err.get("code") or respErr.get("code")
    param = (err or respErr).get("param")
    return ErrorFacts(
        status=status,
        isJson=isJson,
        raw="" if isJson else scrubMessage(text, clientText),
        error=err or respErr,
        codesCyber=codesCyber,
        codesAccess=codesAccess,
        contextTexts=contextTexts,
        codes=codes,
        messages=messages,
        message=sanitise(original) if original else "",
        type=err.get("type") if isinstance(err.get("type"), str) else None,
        code=(err.get("code") or respErr.get("code"))
        if isinstance(err.get("code") or respErr.get("code"), str)
        else None,
        param=err.get("param") if isinstance(err.get("param"), str) else None,
        detailUnauthorized=detail == "Unauthorized",
        html=html,
        rejectedField=rejectedField(
            status,
            code if isinstance(code, str) else None,
            param if isinstance(param, str) else None,
            original,
        ),
    )


# ---------------------------------------------------------------------------
# R8: the predicates of each row
# ---------------------------------------------------------------------------

#: R8 row 1.
CYBER_POLICY_CODE = "cyber_policy"

#: R8 row 2: any of these substrings ...
R8_CONTEXT_SUBSTRINGS = (
    "context_too_large",
    "context_length_exceeded",
    "maximum context length",
    "max context length",
)
#: ... or one of the first group together with one of the second ...
R8_CONTEXT_PAIR = (("context window", "context length"), ("exceed", "too large", "too long"))
#: ... or all of these.
R8_CONTEXT_ALL = ("token limit", "context", "exceed")

#: R8 row 3: access-state codes, in either word order.
R8_ACCESS_STATE = re.compile(
    r"deactivated_workspace"
    r"|(?:workspace|account|organization|org)_(?:deactivated|disabled|suspended)"
    r"|(?:deactivated|disabled|suspended)_(?:workspace|account|organization|org)"
)

#: R8 row 5: model-not-found code and messages.
R8_MODEL_NOT_FOUND_CODE = "model_not_found"
R8_MODEL_NOT_FOUND_MESSAGES = (
    "unknown provider for model",
    "model not found",
    "model is not supported",
)
#: R106: a project's model refusal ("Project `proj_…` does not have access
#: to model `o1-pro`") is R8 row 5 too, on 400, 403 and 404.
R8_MODEL_REFUSAL_MESSAGES = ("does not have access to model",)
#: R106: the statuses a model refusal arrives with, on either account type.
R8_MODEL_REFUSAL_STATUSES = frozenset({400, 403, 404})

#: R8 row 6: statuses that fail over (plus any >= 500).
R8_FAILOVER_STATUSES = frozenset({401, 402, 403, 405, 429, 529})

#: R8 row 7, any status >= 400: overload codes and messages (capacity shed).
R8_OVERLOAD_CODES = ("server_is_overloaded", "slow_down")
R8_OVERLOAD_MESSAGES = (
    "server is overloaded",
    "servers are overloaded",
    "servers are currently overloaded",
)
#: R8 row 7, status 400 only: processing messages ...
R8_PROCESSING_MESSAGES = (
    "an error occurred while processing your request",
    "selected model is at capacity",
)
#: ... or all of these words.
R8_PROCESSING_ALL = ("you can retry your request", "help.openai.com", "request id")


def isCyberPolicy(f: ErrorFacts) -> bool:
    """
    R8 row 1: C{error.code} or C{response.error.code} is C{cyber_policy}.
    """
    return CYBER_POLICY_CODE in f.codesCyber


def _contextText(t: str) -> bool:
    """
    R8 row 2 on one text.
    """
    if any(s in t for s in R8_CONTEXT_SUBSTRINGS):
        return True
    first, second = R8_CONTEXT_PAIR
    if any(a in t for a in first) and any(b in t for b in second):
        return True
    return all(w in t for w in R8_CONTEXT_ALL)


def isContextWindow(f: ErrorFacts) -> bool:
    """
    R8 row 2: the fields named there; the raw body only when not JSON.
    """
    texts = f.contextTexts if f.isJson else f.contextTexts + (f.raw,)
    return any(_contextText(t) for t in texts if t)


def isAccessState(f: ErrorFacts) -> bool:
    """
    R8 row 3: an access-state code in C{error.code}, C{response.error.code},
    C{detail.code} or C{code}.
    """
    return any(R8_ACCESS_STATE.search(c) for c in f.codesAccess if c)


def isModelNotFound(f: ErrorFacts, account: Account) -> bool:
    """
    R8 row 5 as R106 widens it: a model refusal -- status 400, 403 or 404
    with code C{model_not_found}, or one of the model messages (in text
    the client did not supply), on either account type. It blocks that
    model on that account and never marks the account.
    """
    if f.status not in R8_MODEL_REFUSAL_STATUSES:
        return False
    if R8_MODEL_NOT_FOUND_CODE in f.codes:
        return True
    return any(
        m in t
        for t in f.messages
        for m in R8_MODEL_NOT_FOUND_MESSAGES + R8_MODEL_REFUSAL_MESSAGES
    )


def isFailoverStatus(f: ErrorFacts) -> bool:
    """
    R8 row 6: 401, 402, 403, 405, 429, 529 or any >= 500.
    """
    return f.status in R8_FAILOVER_STATUSES or f.status >= 500


def isOverload(f: ErrorFacts) -> bool:
    """
    R8 row 7, first half (any status): an overload code or message. This is
    the capacity-shed case of R8's adjustments and R11 check 1.
    """
    if any(c in f.codes for c in R8_OVERLOAD_CODES):
        return True
    texts = f.messages + ((f.raw,) if f.raw else ())
    return any(m in t for t in texts for m in R8_OVERLOAD_MESSAGES)


def isProcessingMessage(f: ErrorFacts) -> bool:
    """
    R8 row 7, second half: the transient processing messages (the caller
    restricts this to status 400).
    """
    texts = f.messages + ((f.raw,) if f.raw else ())
    for t in texts:
        if any(m in t for m in R8_PROCESSING_MESSAGES):
            return True
        if all(w in t for w in R8_PROCESSING_ALL):
            return True
    return False


def isTransientProcessing(f: ErrorFacts) -> bool:
    """
    R8 row 7: any status >= 400 with an overload code or message; for 400
    also the processing messages.
    """
    if f.status >= 400 and isOverload(f):
        return True
    return f.status == 400 and isProcessingMessage(f)


#: R8: the ordered table; the first row whose predicate matches decides.
#: Columns: row number, Verdict.reason, predicate(facts, account), failover.
R8_TABLE: tuple = (
    (1, REASON_CYBER_POLICY, lambda f, a: isCyberPolicy(f), False),
    (2, REASON_CONTEXT_WINDOW, lambda f, a: isContextWindow(f), False),
    (3, REASON_ACCESS_STATE, lambda f, a: isAccessState(f), True),
    (4, REASON_BODY_TOO_LARGE, lambda f, a: f.status == 413, True),
    (5, REASON_MODEL_NOT_FOUND, isModelNotFound, True),
    (6, "status", lambda f, a: isFailoverStatus(f), True),
    (7, REASON_TRANSIENT_PROCESSING, lambda f, a: isTransientProcessing(f), True),
)


def r8Decide(f: ErrorFacts, account: Account) -> tuple:
    """
    Run L{R8_TABLE}.

    @return: C{(row, reason, failover)}; row 8 is "anything else".
    """
    for row, reason, predicate, failover in R8_TABLE:
        if predicate(f, account):
            return (row, reason, failover)
    return (8, REASON_CLIENT_ERROR, False)


# ---------------------------------------------------------------------------
# R9 / R10: errors that do not fail over
# ---------------------------------------------------------------------------

#: R9 step 7: upstream status -> (client status, type, message).
R9_STATUS_MAP = {
    401: (502, "upstream_error", MSG_AUTH_FAILED),
    402: (502, "upstream_error", MSG_PAYMENT),
    403: (502, "upstream_error", MSG_FORBIDDEN),
    429: (429, "rate_limit_error", MSG_RATE_LIMITED),
}
R9_DEFAULT = (502, "upstream_error", MSG_REQUEST_FAILED)

#: R10: chat completions keep the real status; the type follows it.
R10_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def r10Type(status: int) -> str:
    """
    R10: the error type for a real upstream status (5xx -> C{api_error},
    other 4xx -> C{invalid_request_error}).
    """
    if status >= 500:
        return "api_error"
    return R10_TYPE_BY_STATUS.get(status, "invalid_request_error")


# ---------------------------------------------------------------------------
# R11: markings
# ---------------------------------------------------------------------------

#: R11 401 row: codes that make a 401 permanent.
R11_401_PERMANENT_CODES = ("token_invalidated", "token_revoked")
#: R11 400 row: messages that disable the account.
R11_400_DISABLE_MESSAGES = ("organization has been disabled", "identity verification is required")
#: R11 "API-key transient streak": statuses that add to the streak.
R11_STREAK_STATUSES = frozenset({500, 502, 503, 504, 520, 521, 522, 523, 524})


def _mark401(f: ErrorFacts, a: Account, now: float, c: "DefaultClassifier") -> tuple:
    """
    R11 401 rows: revoked/invalidated or C{detail: Unauthorized}, an
    API-key account, or an OAuth account without a refresh token ->
    permanent; an OAuth account with a refresh token -> 10 min cooldown
    (the engine has already refreshed once and replayed, and
    invalidates the cached token). The account the engine dials carries
    its current refresh token (L{relay.interfaces.ICredentialSource}).
    """
    reason = "401: " + (f.message or "Unauthorized")
    if (
        any(code in f.codes for code in R11_401_PERMANENT_CODES)
        or f.detailUnauthorized
        or a.type != "oauth"
        or not a.refresh_token
    ):
        return (Marking(MARK_DISABLED, reason=reason),)
    return (Marking(MARK_TEMP_UNSCHEDULABLE, seconds=OAUTH_401_COOLDOWN_SECONDS, reason=reason),)


def _mark402(f: ErrorFacts, a: Account, now: float, c: "DefaultClassifier") -> tuple:
    """
    R11 402 row: permanent error.
    """
    return (Marking(MARK_DISABLED, reason="402: " + (f.message or "Payment required")),)


def _mark403(f: ErrorFacts, a: Account, now: float, c: "DefaultClassifier") -> tuple:
    """
    R11 403 rows: an HTML body marks nothing; other bodies go to the
    180-minute counter (L{relay.policy.health.AccountHealth}).
    """
    if f.html:
        return ()
    return (Marking(MARK_COUNT_403, reason=f.message or "Forbidden"),)


def _mark429(f: ErrorFacts, a: Account, now: float, c: "DefaultClassifier") -> tuple:
    """
    R11 429 row: rate-limited until the R12 reset (the OAuth window case is
    handled by the caller).
    """
    return ()  # filled in by classifyStatus, which has the headers


def _mark400(f: ErrorFacts, a: Account, now: float, c: "DefaultClassifier") -> tuple:
    """
    R11 400 rows: disabled-organization or identity-verification messages
    are permanent; other 400s mark nothing.
    """
    if any(m in t for t in f.messages for m in R11_400_DISABLE_MESSAGES):
        return (Marking(MARK_DISABLED, reason="400: " + f.message),)
    return ()


#: R11 status-specific rules: status -> marking builder. 5xx logs only
#: (plus the streak below); statuses not listed mark nothing. A 529 is a
#: capacity shed and marks nothing anywhere: behaviour.md R86.2 (section I)
#: wins over R11's "529: overloaded for 10 minutes" row.
R11_STATUS_RULES: dict = {
    400: _mark400,
    401: _mark401,
    402: _mark402,
    403: _mark403,
    429: _mark429,
}


# ---------------------------------------------------------------------------
# R12: the 429 reset time
# ---------------------------------------------------------------------------

_CODEX_WINDOWS = ("primary", "secondary")


def _float(value: Any) -> Optional[float]:
    """
    @return: C{value} as a float, or L{None}.
    """
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if result == result else None  # NaN


#: R82: an upstream Retry-After is capped at this for OAuth accounts (R13's
#: retry cap) and at L{R82_RETRY_AFTER_CAP_SECONDS} otherwise, seconds.
R82_RETRY_AFTER_CAP_SECONDS = 60.0
#: protocol.md 7.3: bodies that mean the plan window is spent.
USAGE_LIMIT_CODES = ("usage_limit_reached", "usage_not_included")


def retryAfterCap(account: Account) -> float:
    """
    R82: the cap on a 429's C{Retry-After} used as its reset: 8 s for OAuth
    accounts (R13), else 60 s.
    """
    return OAUTH_429_MAX_DELAY_SECONDS if account.type == "oauth" else R82_RETRY_AFTER_CAP_SECONDS


def r12Reset(
    headers: dict,
    error: dict,
    now: float,
    fallbackSeconds: float,
    retryAfterCapSeconds: float = R82_RETRY_AFTER_CAP_SECONDS,
) -> tuple:
    """
    R12 as revised by R82: choose the 429 reset.

        1. C{x-codex-*} headers: a window at C{used_percent >= 100} gives
           its own reset (the later one if both are spent). A window below
           100 % never gives a reset (R82: a burst is not a spent plan).
        2. Body C{usage_limit_reached} / C{usage_not_included}:
           C{resets_at}, or C{now + resets_in_seconds}.
        3. R82: the upstream C{Retry-After}, capped at
           C{retryAfterCapSeconds}.
        4. The fallback, clamped to 1-7200 s.

    @param headers: lower-cased headers.
    @param error: the body's C{error} object.
    @param now: Unix seconds.
    @param fallbackSeconds: the admin fallback cooldown, seconds.
    @param retryAfterCapSeconds: see L{retryAfterCap}.
    @return: C{(until, rule)} with rule C{headers}, C{body},
        C{retry_after} or C{fallback}.
    """
    spent = []
    for name in _CODEX_WINDOWS:
        used = _float(headers.get(f"x-codex-{name}-used-percent"))
        at = _float(headers.get(f"x-codex-{name}-reset-at"))
        after = _float(headers.get(f"x-codex-{name}-reset-after-seconds"))
        reset = at if at is not None else (now + after if after is not None else None)
        if reset is not None and reset > now and used is not None and used >= 100:
            spent.append(reset)
    if spent:
        return (max(spent), "headers")
    if (
        _str(error.get("type")) in USAGE_LIMIT_CODES
        or _str(error.get("code")) in USAGE_LIMIT_CODES
    ):
        at = _float(error.get("resets_at"))
        if at is not None and at > now:
            return (at, "body")
        after = _float(error.get("resets_in_seconds"))
        if after is not None and after > 0:
            return (now + after, "body")
    retry = retryAfterSeconds(headers.get("retry-after"), now)
    if retry is not None and retry > 0:
        return (now + min(retry, retryAfterCapSeconds), "retry_after")
    seconds = min(
        max(fallbackSeconds, RATE_LIMIT_FALLBACK_MIN_SECONDS), RATE_LIMIT_FALLBACK_MAX_SECONDS
    )
    return (now + seconds, "fallback")


# ---------------------------------------------------------------------------
# R16: Retry-After
# ---------------------------------------------------------------------------


def retryAfterSeconds(value: Any, now: float) -> Optional[float]:
    """
    R16: the seconds a C{Retry-After} value means, if it is safe to copy.

    Safe means at most 128 characters, no CR or LF, and either digits
    meaning at most 7 days or an HTTP date at most 7 days ahead.

    @param value: the header value (str or bytes) or L{None}.
    @param now: Unix seconds.
    @return: seconds from now (>= 0), or L{None} when unsafe or absent.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not isinstance(value, str) or len(value) > RETRY_AFTER_MAX_CHARS:
        return None
    if "\r" in value or "\n" in value:
        return None
    stripped = value.strip()
    if stripped.isdigit() and stripped.isascii():
        seconds = int(stripped)
        return float(seconds) if seconds <= RETRY_AFTER_MAX_SECONDS else None
    try:
        when = parsedate_to_datetime(stripped)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    delta = when.timestamp() - now
    if delta > RETRY_AFTER_MAX_SECONDS:
        return None
    return max(delta, 0.0)


def safeRetryAfter(value: Any, now: float) -> Optional[str]:
    """
    R16: the value to copy, or L{None}.
    """
    if retryAfterSeconds(value, now) is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value.strip()


# ---------------------------------------------------------------------------
# R15 / R65: failover exhausted
# ---------------------------------------------------------------------------

#: R15 step 8: last failover status -> (client status, type, message).
R15_STATUS_MAP = {
    401: (502, "upstream_error", MSG_AUTH_FAILED),
    403: (502, "upstream_error", MSG_FORBIDDEN),
    429: (429, "rate_limit_error", MSG_RATE_LIMITED),
    529: (503, "upstream_error", MSG_SERVICE_OVERLOADED),
    500: (502, "upstream_error", MSG_TEMPORARILY_UNAVAILABLE),
    502: (502, "upstream_error", MSG_TEMPORARILY_UNAVAILABLE),
    503: (502, "upstream_error", MSG_TEMPORARILY_UNAVAILABLE),
    504: (502, "upstream_error", MSG_TEMPORARILY_UNAVAILABLE),
}
R15_DEFAULT = (502, "upstream_error", MSG_REQUEST_FAILED)

#: R65: last failover status -> WebSocket close. The default is
#: L{WS_PROXY_FAILED}; access state is L{WS_CREDENTIAL_UNAVAILABLE}.
R65_WS_CLOSE = {
    429: WS_RATE_LIMITED,
    500: WS_UNAVAILABLE,
    502: WS_UNAVAILABLE,
    503: WS_UNAVAILABLE,
    504: WS_UNAVAILABLE,
    529: WS_UNAVAILABLE,
    401: WS_AUTH_FAILED,
    403: WS_AUTH_FAILED,
}


# ---------------------------------------------------------------------------
# R23: stream failures before output
# ---------------------------------------------------------------------------

#: R23: a C{response.failed} carrying none of these fails over.
R23_POLICY_MARKERS = (
    "invalid_request",
    "content_policy",
    "policy",
    "safety",
    "high-risk cyber",
    "not allowed",
    "violat",
)
#: R23: an C{error} event whose message has one of these fails over.
R23_ERROR_RETRY_WORDS = ("temporary", "try again", "please retry")
#: R23: semantic statuses that fail over.
R23_STATUSES = frozenset({401, 429, 529})
#: R106: the words of R49's limit messages, for L{_triggers}.
R106_LIMIT_WORDS = ("usage limit", "rate limit")
#: R49 step 5: rate-limit or usage-limit signals in a stream error.
R49_RATE_LIMIT_FRAGMENTS = ("rate_limit", "usage_limit")
R49_RATE_LIMIT_CODES = ("insufficient_quota",)
R49_RATE_LIMIT_MESSAGES = (
    re.compile(r"usage limit.*reached"),
    re.compile(r"rate limit.*(?:reached|exceeded)"),
)
#: Codes that are never failed over from a stream: the engine recovers
#: them (R66, R76) or the client must see them.
R23_NEVER_CODES = ("previous_response_not_found",)


def _eventError(event: dict) -> tuple:
    """
    The error object, semantic status and headers of a stream event.

    @param event: a C{response.failed} or C{error} event dict.
    @return: C{(error dict, status int or 0, headers dict)}.
    """
    etype = event.get("type")
    if etype == "response.failed":
        err = _dict(_dict(event.get("response")).get("error"))
    else:
        err = _dict(event.get("error")) or {
            k: event.get(k) for k in ("code", "message", "type", "param") if k in event
        }
    status = event.get("status", event.get("status_code"))
    status = (
        int(status)
        if isinstance(status, int) or (isinstance(status, str) and status.isdigit())
        else 0
    )
    headers = {str(k).lower(): v for k, v in _dict(event.get("headers")).items()}
    return (err, status, headers)


# ---------------------------------------------------------------------------
# The classifier
# ---------------------------------------------------------------------------


def _clientError(
    status: int,
    type: str,
    message: str,
    wsClose: Optional[tuple] = None,
    code: Optional[str] = None,
    param: Optional[str] = None,
    headers: tuple = (),
) -> ClientError:
    """
    Build a L{ClientError}.
    """
    return ClientError(
        status=status,
        type=type,
        message=message,
        code=code,
        param=param,
        headers=headers,
        wsClose=wsClose,
    )


@implementer(IFailureClassifier)
@frozen(kw_only=True)
class DefaultClassifier:
    """
    The built-in L{IFailureClassifier}: behaviour.md R1-R24.

    @ivar transport_cooldown_seconds: R4's cooldown for a persistent
        transport failure, seconds (C{gateway.transport_error_cooldown_seconds}).
    @ivar rate_limit_fallback_seconds: R12's fallback cooldown, seconds
        (clamped to 1-7200 when applied).
    """

    transport_cooldown_seconds: float = 600
    rate_limit_fallback_seconds: float = 5

    # -- R1, R3, R5 ---------------------------------------------------------

    def classifyTransport(self, account: Account, reason: Any, endpoint: str) -> Verdict:
        """
        R1, R3, R5: a failure without an HTTP status. Persistent failures
        carry a temp-unschedulable marking for L{transport_cooldown_seconds}
        (R4); transient ones carry none.
        """
        persistent = isPersistentTransport(reason)
        message = describeTransport(reason)
        markings: tuple = ()
        if persistent:
            markings = (
                Marking(
                    MARK_TEMP_UNSCHEDULABLE,
                    seconds=self.transport_cooldown_seconds,
                    reason="upstream transport error (proxy/network): " + message,
                ),
            )
        verdict = Verdict(
            kind=TRANSPORT,
            failover=True,
            status=502,
            persistent=persistent,
            reason=REASON_TRANSPORT_PERSISTENT if persistent else REASON_TRANSPORT_TRANSIENT,
            markings=markings,
            message=message,
        )
        return evolve(verdict, clientError=self.exhausted(verdict, endpoint))

    # -- R7-R16 -------------------------------------------------------------

    def classifyStatus(
        self,
        account: Account,
        endpoint: str,
        status: int,
        headers: dict,
        body: bytes,
        now: float,
        clientText: frozenset = frozenset(),
    ) -> Verdict:
        """
        R8 (decision), R9/R10 (pass-through), R11 (markings), R12 (reset),
        R13/R14 (same-account), R15 (exhaustion), R16 (Retry-After), with
        R106: phrases count only in text the client did not supply
        (C{clientText}, L{clientStrings}); a 400 naming an unknown or
        unsupported field passes with C{rejectedField} set (R7's rewrite)
        and marks nothing.
        """
        headers = {
            str(k).lower(): (v.decode("latin-1") if isinstance(v, bytes) else v)
            for k, v in (headers or {}).items()
        }
        contentType = headers.get("content-type") or ""
        f = parseError(status, body, contentType, clientText)
        row, reason, failover = r8Decide(f, account)
        retryAfter = safeRetryAfter(headers.get("retry-after"), now)

        if f.rejectedField is not None and row not in (1, 2, 3):
            # R106 / R7: the request's fault; the engine drops the field and
            # retries once on the same account.
            return Verdict(
                kind=STATUS,
                failover=False,
                status=status,
                reason=REASON_REJECTED_FIELD,
                clientError=self._passThrough(f, 8, endpoint, body, contentType),
                message=f.message,
                rejectedField=f.rejectedField,
            )
        if not failover:
            markings = self._markings(f, account, row, headers, now, oauthWindow=False)
            if any(m.kind == MARK_DISABLED for m in markings):
                # R9 step 5: marking says "stop scheduling it" -> switch anyway.
                verdict = Verdict(
                    kind=STATUS,
                    failover=True,
                    status=status,
                    reason=REASON_ACCOUNT_POLICY,
                    markings=markings,
                    retryAfter=retryAfter,
                    message=f.message,
                )
                return evolve(verdict, clientError=self.exhausted(verdict, endpoint))
            return Verdict(
                kind=STATUS,
                failover=False,
                status=status,
                reason=reason,
                markings=markings,
                clientError=self._passThrough(f, row, endpoint, body, contentType),
                message=f.message,
            )

        overload = isOverload(f)
        oauth429 = status == 429 and account.type == "oauth" and not overload
        if reason == "status":
            reason = f"status_{status}"
        if overload:
            reason = REASON_OVERLOAD
        poolRetry = (
            account.type != "oauth"
            and account.pool_mode
            and status in tuple(account.pool_mode_retry_status_codes)
        )

        sameAccount = False
        retryDelay = None
        backoff = False
        if overload:
            sameAccount, backoff = True, True  # R8 capacity shed, R14 backoff
        elif row in (3, 4, 5):
            sameAccount = False  # access state, 413, model not found: switch
        elif oauth429:
            sameAccount = True  # R13
            seconds = retryAfterSeconds(headers.get("retry-after"), now)
            retryDelay = (
                min(seconds, OAUTH_429_MAX_DELAY_SECONDS)
                if seconds is not None
                else OAUTH_429_DEFAULT_DELAY_SECONDS
            )
        elif poolRetry:
            sameAccount = True  # R14

        rateLimitUntil = None
        if status == 429 and not overload:
            rateLimitUntil, _ = r12Reset(
                headers, f.error, now, self.rate_limit_fallback_seconds, retryAfterCap(account)
            )
        markings = self._markings(f, account, row, headers, now, oauthWindow=oauth429)
        verdict = Verdict(
            kind=STATUS,
            failover=True,
            status=status,
            sameAccount=sameAccount,
            retryDelay=retryDelay,
            backoff=backoff,
            reason=reason,
            markings=markings,
            retryAfter=retryAfter,
            message=f.message,
            oauth429=oauth429,
            rateLimitUntil=rateLimitUntil,
        )
        return evolve(verdict, clientError=self.exhausted(verdict, endpoint))

    def _markings(
        self,
        f: ErrorFacts,
        account: Account,
        row: int,
        headers: dict,
        now: float,
        oauthWindow: bool,
    ) -> tuple:
        """
        R11: the checks before the status rules, then the status rules.

        @param row: the R8 row that matched.
        @param oauthWindow: an OAuth 429 (R13): no marking here.
        @return: a tuple of L{Marking}s.
        """
        if row in (1, 2):
            return ()  # cyber_policy, context window (R9 step 1, R11 check 3)
        if isOverload(f):
            return ()  # R11 check 1: capacity shed
        if row == 3:
            return (
                Marking(
                    MARK_DISABLED,
                    reason="access state: " + (f.message or next(c for c in f.codesAccess if c)),
                ),
            )
        if row == 5:
            return (
                Marking(
                    MARK_MODEL_BLOCK,
                    seconds=MODEL_NOT_FOUND_COOLDOWN_SECONDS,
                    reason="model not found: " + f.message,
                ),
            )
        if f.param is not None or f.rejectedField is not None:
            return ()  # R106: an error about a request field is never the account's
        if account.type != "oauth" and account.pool_mode:
            return ()  # R11 check 6: pool mode marks nothing beyond explicit rules
        status = f.status
        markings: tuple = ()
        if status == 429:
            if not oauthWindow:
                until, _ = r12Reset(
                    headers, f.error, now, self.rate_limit_fallback_seconds,
                    retryAfterCap(account),
                )
                markings = (
                    Marking(
                        MARK_RATE_LIMITED,
                        until=until,
                        reason="429: " + (f.message or "rate limited"),
                    ),
                )
        elif status in R11_STATUS_RULES:
            markings = R11_STATUS_RULES[status](f, account, now, self)
        if account.type != "oauth" and (
            status in R11_STREAK_STATUSES or (status == 400 and isProcessingMessage(f))
        ):
            markings += (
                Marking(MARK_TRANSIENT_STREAK, reason=f"{status}: " + (f.message or "transient")),
            )
        return markings

    def _passThrough(
        self, f: ErrorFacts, row: int, endpoint: str, body: Any, contentType: str
    ) -> ClientError:
        """
        R9 (responses) and R10 (chat, and the Messages API, R115: its
        surface writes the same decision in Anthropic's shape): the error
        for a status that does not fail over.
        """
        status = f.status
        if row == 1:
            if endpoint in ("chat", "messages"):
                return _clientError(
                    status,
                    "invalid_request_error",
                    f.message or "Request blocked by upstream policy",
                    code=CYBER_POLICY_CODE,
                )
            raw = body if isinstance(body, bytes) else str(body or "").encode("utf-8")
            return ClientError(
                status=status,
                type="invalid_request_error",
                message=f.message,
                code=CYBER_POLICY_CODE,
                rawBody=raw,
                contentType=contentType or "application/json",
            )
        if endpoint in ("chat", "messages"):
            return _clientError(
                status, r10Type(status), f.message or MSG_REQUEST_FAILED, code=f.code, param=f.param
            )
        if status == 400:
            return _clientError(
                400,
                f.type or "invalid_request_error",
                f.message or MSG_REJECTED,
                code=f.code,
                param=f.param,
            )
        mapped = R9_STATUS_MAP.get(status, R9_DEFAULT)
        if row == 2:
            return _clientError(mapped[0], mapped[1], f.message or mapped[2], code=f.code)
        return _clientError(*mapped)

    # -- R15, R65 -------------------------------------------------------------

    def exhausted(self, verdict: Optional[Verdict], endpoint: str) -> ClientError:
        """
        R15 (HTTP) and R65 (C{wsClose}): what the client sees when failover is
        exhausted. Steps 2 (continuations) and 7 (admin rules) belong to the
        engine.
        """
        if verdict is None:
            return _clientError(*R15_DEFAULT, wsClose=WS_PROXY_FAILED)
        headers: tuple = ()
        if verdict.retryAfter is not None:
            headers = (("Retry-After", verdict.retryAfter),)  # step 3
        status = verdict.status
        if verdict.kind == STATUS and verdict.reason == REASON_BODY_TOO_LARGE:
            return _clientError(
                413,
                "invalid_request_error",
                MSG_PAYLOAD_TOO_LARGE,
                wsClose=WS_PROXY_FAILED,
                headers=headers,
            )
        if verdict.reason == REASON_UPSTREAM_WS_BUSY and verdict.clientError is not None:
            # R-B3: a busy upstream pool keeps its own close, 1013 "upstream
            # websocket is busy, please retry later", not the 503 mapping.
            return verdict.clientError
        if verdict.reason == REASON_ACCESS_STATE:
            return _clientError(
                502,
                "upstream_error",
                MSG_ACCESS_UNAVAILABLE,
                wsClose=WS_CREDENTIAL_UNAVAILABLE,
                headers=headers,
            )
        if verdict.reason == REASON_OVERLOAD:
            return _clientError(
                503,
                "server_error",
                verdict.message or MSG_OVERLOADED_DEFAULT,
                wsClose=WS_UNAVAILABLE,
                headers=headers,
            )
        if verdict.reason == REASON_EMPTY_COMPLETED:
            return _clientError(
                502, "upstream_error", MSG_REQUEST_FAILED, wsClose=WS_PROXY_FAILED, headers=headers
            )
        if verdict.kind == FIRST_OUTPUT_TIMEOUT:
            return _clientError(
                502,
                "first_output_timeout",
                MSG_TEMPORARILY_UNAVAILABLE,
                wsClose=WS_UNAVAILABLE,
                headers=headers,
            )
        mapped = R15_STATUS_MAP.get(status, R15_DEFAULT)
        return _clientError(
            *mapped, wsClose=R65_WS_CLOSE.get(status, WS_PROXY_FAILED), headers=headers
        )

    # -- R20-R23 --------------------------------------------------------------

    def firstOutputTimeout(self, account: Account, seconds: float) -> Verdict:
        """
        R20: status 504, safe after write; exhausted as 502 "Upstream service
        temporarily unavailable" with type C{first_output_timeout}.
        """
        verdict = Verdict(
            kind=FIRST_OUTPUT_TIMEOUT,
            failover=True,
            status=504,
            safeAfterWrite=True,
            reason=REASON_FIRST_OUTPUT_TIMEOUT,
            message=f"{MSG_NO_OUTPUT} ({seconds:g} s)",
        )
        return evolve(verdict, clientError=self.exhausted(verdict, "responses"))

    def stagingOverflow(self, account: Account, size: int) -> Verdict:
        """
        R22: held-back events above the cap; a failover marked safe after
        write.
        """
        verdict = Verdict(
            kind=STAGING_OVERFLOW,
            failover=True,
            status=502,
            safeAfterWrite=True,
            reason=REASON_STAGING_OVERFLOW,
            message=f"staged events exceeded the cap ({size} bytes held)",
        )
        return evolve(verdict, clientError=self.exhausted(verdict, "responses"))

    def classifyStreamFailure(
        self,
        account: Account,
        endpoint: str,
        kind: str,
        event: Optional[dict],
        detail: str,
        clientText: frozenset = frozenset(),
    ) -> Optional[Verdict]:
        """
        R23: failures before the first semantic output. Returns L{None} for
        an event that must be forwarded unchanged (R23's non-qualifying
        events, C{cyber_policy}, context-window errors, and
        C{previous_response_not_found}, which R66/R76 handle). Phrases
        count only in text the client did not supply (R106, C{clientText}).
        """
        if kind == "read_error":
            return self._streamVerdict(
                endpoint,
                502,
                REASON_STREAM_READ_ERROR,
                MSG_STREAM_DISCONNECTED + sanitise(detail or "read error"),
            )
        if kind == "no_terminal":
            return self._streamVerdict(
                endpoint, 502, REASON_STREAM_NO_TERMINAL, MSG_STREAM_NO_TERMINAL
            )
        if kind == "empty_completed":
            return self._streamVerdict(endpoint, 502, REASON_EMPTY_COMPLETED, MSG_EMPTY_COMPLETED)
        if kind != "event" or not isinstance(event, dict):
            return None
        return self._classifyEvent(account, endpoint, event, clientText)

    def _streamVerdict(
        self, endpoint: str, status: int, reason: str, message: str, **kw: Any
    ) -> Verdict:
        """
        Build a stream failover verdict with its exhaustion mapping.
        """
        verdict = Verdict(
            kind=STREAM, failover=True, status=status, reason=reason, message=message, **kw
        )
        return evolve(verdict, clientError=self.exhausted(verdict, endpoint))

    def _classifyEvent(
        self, account: Account, endpoint: str, event: dict, clientText: frozenset = frozenset()
    ) -> Optional[Verdict]:
        """
        R23 (and R49 step 5) for a C{response.failed} or C{error} event.
        """
        err, status, headers = _eventError(event)
        f = parseError(status or 0, {"error": err, "detail": None}, "", clientText)
        if isCyberPolicy(f) or isContextWindow(f):
            return None
        if any(c in f.codes for c in R23_NEVER_CODES):
            return None
        text = " ".join(f.messages)
        message = f.message or sanitise(event.get("type", "stream error"))

        # R49 step 5: rate-limit / usage-limit -> 429 failover with marking.
        rateLimited = (
            status == 429
            or any(frag in c for c in f.codes for frag in R49_RATE_LIMIT_FRAGMENTS)
            or any(c in f.codes for c in R49_RATE_LIMIT_CODES)
            or any(p.search(text) for p in R49_RATE_LIMIT_MESSAGES)
        )
        if rateLimited and not isOverload(f):
            until, rule = r12Reset(
                headers, err, 0.0, self.rate_limit_fallback_seconds, retryAfterCap(account)
            )
            marking = self._relativeRateLimit(until, rule, headers, err, message)
            return self._streamVerdict(
                endpoint,
                429,
                REASON_STREAM_RATE_LIMIT,
                message,
                markings=(marking,),
            )
        if isAccessState(f):
            return self._streamVerdict(
                endpoint,
                status or 502,
                REASON_ACCESS_STATE,
                message,
                markings=(Marking(MARK_DISABLED, reason="access state: " + message),),
            )
        policy = any(m in t for t in f.codes + f.messages for m in R23_POLICY_MARKERS)
        if status in R23_STATUSES or (status == 403 and not policy):
            markings = (
                self._markings(f, account, 6, headers, 0.0, oauthWindow=False)
                if status != 429
                else ()
            )
            return self._streamVerdict(
                endpoint, status, f"status_{status}", message, markings=markings
            )
        if isOverload(f):
            return self._streamVerdict(
                endpoint, status or 503, REASON_OVERLOAD, message, sameAccount=True, backoff=True
            )
        if isProcessingMessage(f):
            return self._streamVerdict(
                endpoint, status or 502, REASON_TRANSIENT_PROCESSING, message
            )
        if event.get("type") == "response.failed":
            if not policy:
                return self._streamVerdict(endpoint, status or 502, REASON_STREAM_FAILED, message)
            return None
        if any(w in text for w in R23_ERROR_RETRY_WORDS):
            return self._streamVerdict(
                endpoint, status or 502, REASON_STREAM_RETRYABLE_ERROR, message
            )
        return None

    def _relativeRateLimit(
        self, until: float, rule: str, headers: dict, err: dict, message: str
    ) -> Marking:
        """
        The R12 marking for a stream event, which arrives without C{now}:
        absolute resets stay absolute (C{until}); relative ones become
        C{seconds} for the health object to add to its clock.

        @param until: L{r12Reset}'s answer computed with C{now=0}.
        """
        absolute = False
        if rule == "headers":
            absolute = any(headers.get(f"x-codex-{w}-reset-at") is not None for w in _CODEX_WINDOWS)
        elif rule == "body":
            absolute = _float(err.get("resets_at")) is not None
        reason = "429: " + message
        if absolute:
            return Marking(MARK_RATE_LIMITED, until=until, reason=reason)
        return Marking(MARK_RATE_LIMITED, seconds=until, reason=reason)
