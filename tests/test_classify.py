"""
Tests for L{relay.policy.classify}: behaviour.md R1-R24, table by table.
"""

from __future__ import annotations

import errno
import json
from email.utils import formatdate

from OpenSSL import SSL
from twisted.internet import defer
from twisted.internet import error as terror
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseNeverReceived
from zope.interface.verify import verifyObject

from relay.policy import failures as F
from relay.policy.classify import (
    MSG_ACCESS_UNAVAILABLE,
    MSG_AUTH_FAILED,
    MSG_FORBIDDEN,
    MSG_OVERLOADED_DEFAULT,
    MSG_PAYLOAD_TOO_LARGE,
    MSG_RATE_LIMITED,
    MSG_REQUEST_FAILED,
    MSG_SERVICE_OVERLOADED,
    MSG_TEMPORARILY_UNAVAILABLE,
    WS_AUTH_FAILED,
    WS_CREDENTIAL_UNAVAILABLE,
    WS_PROXY_FAILED,
    WS_RATE_LIMITED,
    WS_UNAVAILABLE,
    DefaultClassifier,
    retryAfterSeconds,
    safeRetryAfter,
    sanitise,
)
from relay.interfaces import IFailureClassifier
from relay.base.records import Account

#: a fixed "now", Unix seconds
NOW = 1_700_000_000.0

APIKEY = Account(
    id="k1", type="apikey", base_url="https://api.openai.com/v1", credential="sk-secret"
)
OAUTH = Account(
    id="o1", type="oauth", base_url="https://chatgpt.com/backend-api/codex", credential="tok",
    refresh_token="rt-secret",
)
#: An OAuth account with a static access token and no refresh token.
OAUTH_STATIC = Account(
    id="o2", type="oauth", base_url="https://chatgpt.com/backend-api/codex", credential="tok2"
)
POOL = Account(
    id="p1", type="apikey", base_url="https://api.openai.com/v1", credential="sk-x", pool_mode=True
)


def err(code=None, message=None, type=None, **extra):
    """
    @return: an OpenAI error body as bytes.
    """
    e = {}
    if code is not None:
        e["code"] = code
    if message is not None:
        e["message"] = message
    if type is not None:
        e["type"] = type
    e.update(extra)
    return json.dumps({"error": e}).encode()


def classify(account, status, body=b"", headers=None, endpoint="responses", classifier=None):
    """
    Run L{DefaultClassifier.classifyStatus} at L{NOW}.
    """
    return (classifier or DefaultClassifier()).classifyStatus(
        account, endpoint, status, headers or {}, body, NOW
    )


def kinds(verdict):
    """
    @return: the marking kinds of a verdict.
    """
    return [m.kind for m in verdict.markings]


class InterfaceTests(SynchronousTestCase):
    """
    The classifier provides its interface.
    """

    def test_verifyObject(self):
        """
        L{DefaultClassifier} provides L{IFailureClassifier}; the constructor
        is keyword-only.
        """
        self.assertTrue(verifyObject(IFailureClassifier, DefaultClassifier()))
        self.assertRaises(TypeError, DefaultClassifier, 30)
        self.assertEqual(
            DefaultClassifier(transport_cooldown_seconds=30).transport_cooldown_seconds, 30
        )


class TransportTests(SynchronousTestCase):
    """
    R1, R3, R4, R5: transport failures.
    """

    PERSISTENT = [
        ("twisted ConnectionRefusedError", terror.ConnectionRefusedError()),
        ("NoRouteError", terror.NoRouteError()),
        ("DNSLookupError", terror.DNSLookupError("api.example")),
        ("builtin ConnectionRefusedError", ConnectionRefusedError(errno.ECONNREFUSED, "x")),
        ("OSError EHOSTUNREACH", OSError(errno.EHOSTUNREACH, "x")),
        ("OSError ENETUNREACH", OSError(errno.ENETUNREACH, "x")),
        ("ConnectError osError errno", terror.ConnectError(osError=errno.ECONNREFUSED)),
        ("Failure of refused", Failure(terror.ConnectionRefusedError())),
        (
            "ResponseNeverReceived wrapping refused",
            ResponseNeverReceived([Failure(terror.ConnectionRefusedError())]),
        ),
        (
            "ResponseNeverReceived wrapping EHOSTUNREACH",
            ResponseNeverReceived(
                [Failure(terror.ConnectionLost()), Failure(OSError(errno.EHOSTUNREACH, "x"))]
            ),
        ),
        ("marker: SOCKS5 authentication failed", Exception("SOCKS5 Authentication failed")),
        ("marker: proxy 407", Exception("Proxy Authentication Required")),
        ("marker: connection refused", Exception("dial tcp: connection refused")),
        ("marker: no route to host", Exception("no route to host")),
        ("marker: network is unreachable", Exception("Network is unreachable")),
        ("marker: no such host", Exception("lookup x: no such host")),
    ]

    TRANSIENT = [
        ("TCPTimedOutError", terror.TCPTimedOutError()),
        ("TimeoutError", terror.TimeoutError()),
        ("defer.TimeoutError", defer.TimeoutError()),
        ("ConnectionLost", terror.ConnectionLost()),
        ("ConnectionDone (EOF)", terror.ConnectionDone()),
        ("reset", OSError(errno.ECONNRESET, "Connection reset by peer")),
        ("TLS error", SSL.Error([("SSL routines", "", "certificate verify failed")])),
        (
            "ResponseNeverReceived wrapping lost",
            ResponseNeverReceived([Failure(terror.ConnectionLost())]),
        ),
        ("proxy CONNECT timeout", Exception("proxyconnect tcp: i/o timeout")),
        ("HeaderTimeout", type("HeaderTimeout", (Exception,), {})("no headers in 120 s")),
    ]

    def test_persistent(self):
        """
        R3: typed checks (anywhere in the chain) and text markers make a
        failure persistent; R4: it carries a temp-unschedulable marking for
        the cooldown; R5: synthetic 502, failover.
        """
        c = DefaultClassifier()
        for name, reason in self.PERSISTENT:
            v = c.classifyTransport(APIKEY, reason, "responses")
            self.assertTrue(v.persistent, name)
            self.assertEqual(
                (v.kind, v.failover, v.status, v.reason),
                (F.TRANSPORT, True, 502, "transport_persistent"),
                name,
            )
            self.assertEqual(len(v.markings), 1, name)
            m = v.markings[0]
            self.assertEqual((m.kind, m.seconds), (F.MARK_TEMP_UNSCHEDULABLE, 600), name)
            self.assertTrue(m.reason.startswith("upstream transport error (proxy/network): "), name)

    def test_transient(self):
        """
        R3: timeouts, resets, EOF, TLS and proxy timeouts are transient; R4:
        a transient failure carries no marking.
        """
        c = DefaultClassifier()
        for name, reason in self.TRANSIENT:
            v = c.classifyTransport(APIKEY, reason, "responses")
            self.assertFalse(v.persistent, name)
            self.assertEqual(
                (v.failover, v.status, v.reason, v.markings),
                (True, 502, "transport_transient", ()),
                name,
            )

    def test_chainedCause(self):
        """
        R3: an errno on C{__cause__} or C{__context__} counts.
        """
        try:
            try:
                raise OSError(errno.ECONNREFUSED, "refused")
            except OSError as inner:
                raise RuntimeError("wrapper") from inner
        except RuntimeError as e:
            caused = e
        try:
            try:
                raise terror.DNSLookupError("x")
            except Exception:
                raise ValueError("during handling")
        except ValueError as e:
            context = e
        c = DefaultClassifier()
        self.assertTrue(c.classifyTransport(APIKEY, caused, "chat").persistent)
        self.assertTrue(c.classifyTransport(APIKEY, context, "chat").persistent)

    def test_cooldownConfigurable(self):
        """
        R4: the cooldown is C{transport_cooldown_seconds}.
        """
        v = DefaultClassifier(transport_cooldown_seconds=42).classifyTransport(
            APIKEY, terror.ConnectionRefusedError(), "responses"
        )
        self.assertEqual(v.markings[0].seconds, 42)

    def test_exhaustion(self):
        """
        R5, R15, R65: exhausted transport failures give 502 "Upstream service
        temporarily unavailable" and close 1013.
        """
        v = DefaultClassifier().classifyTransport(APIKEY, terror.ConnectionLost(), "responses")
        self.assertEqual(
            (
                v.clientError.status,
                v.clientError.type,
                v.clientError.message,
                v.clientError.wsClose,
            ),
            (502, "upstream_error", MSG_TEMPORARILY_UNAVAILABLE, WS_UNAVAILABLE),
        )

    def test_sanitised(self):
        """
        R4: the reason text carries no secrets and is capped.
        """
        reason = Exception(
            "connection refused via socks5://alice:hunter2@proxy:1080"
            " with Bearer abc.def sk-proj-ABCDEF123456 " + "x" * 2000
        )
        v = DefaultClassifier().classifyTransport(APIKEY, reason, "responses")
        for text in (v.message, v.markings[0].reason):
            self.assertNotIn("hunter2", text)
            self.assertNotIn("abc.def", text)
            self.assertNotIn("ABCDEF123456", text)
            self.assertLessEqual(len(text), 600)
        self.assertIn("connection refused", v.message)

    def test_sanitise(self):
        """
        The sanitiser removes keys, bearer tokens and URL credentials.
        """
        self.assertEqual(sanitise("key sk-abcdef12345 here"), "key sk-[redacted] here")
        self.assertEqual(
            sanitise("Authorization: Bearer tok123"), "Authorization: Bearer [redacted]"
        )
        self.assertEqual(sanitise("http://u:p@h:1/x"), "http://[redacted]@h:1/x")
        self.assertEqual(len(sanitise("y" * 5000)), 500)


#: R8: every row of the ordered table.
#: (name, account, status, body, failover, reason)
R8_ROWS = [
    # row 1
    (
        "1 cyber_policy error.code",
        APIKEY,
        400,
        err("cyber_policy", "blocked"),
        False,
        "cyber_policy",
    ),
    (
        "1 cyber_policy response.error.code",
        APIKEY,
        403,
        b'{"response":{"error":{"code":"cyber_policy"}}}',
        False,
        "cyber_policy",
    ),
    (
        "1 cyber_policy beats context",
        APIKEY,
        400,
        err("cyber_policy", "context length exceeded"),
        False,
        "cyber_policy",
    ),
    # row 2
    (
        "2 context_length_exceeded code",
        APIKEY,
        400,
        err("context_length_exceeded", "x"),
        False,
        "context_window",
    ),
    ("2 context_too_large", APIKEY, 400, err(None, "context_too_large"), False, "context_window"),
    (
        "2 maximum context length",
        APIKEY,
        400,
        err(None, "This model's maximum context length is 8192"),
        False,
        "context_window",
    ),
    (
        "2 max context length",
        APIKEY,
        400,
        err(None, "max context length hit"),
        False,
        "context_window",
    ),
    (
        "2 context window + exceed",
        APIKEY,
        400,
        err(None, "Your input exceeds the context window"),
        False,
        "context_window",
    ),
    (
        "2 context length + too long",
        APIKEY,
        400,
        err(None, "context length too long"),
        False,
        "context_window",
    ),
    (
        "2 context window + too large",
        APIKEY,
        400,
        err(None, "context window too large"),
        False,
        "context_window",
    ),
    (
        "2 token limit context exceed",
        APIKEY,
        400,
        err(None, "token limit of the context was exceeded"),
        False,
        "context_window",
    ),
    (
        "2 top-level message",
        APIKEY,
        400,
        b'{"message":"maximum context length"}',
        False,
        "context_window",
    ),
    (
        "2 top-level code",
        APIKEY,
        400,
        b'{"code":"context_length_exceeded"}',
        False,
        "context_window",
    ),
    ("2 raw non-JSON body", APIKEY, 400, b"context_length_exceeded!", False, "context_window"),
    (
        "2 on 429 still no failover",
        APIKEY,
        429,
        err("context_length_exceeded"),
        False,
        "context_window",
    ),
    (
        "2 on 413 still no failover",
        APIKEY,
        413,
        err(None, "maximum context length"),
        False,
        "context_window",
    ),
    # row 3
    (
        "3 deactivated_workspace detail.code",
        APIKEY,
        402,
        b'{"detail":{"code":"deactivated_workspace"}}',
        True,
        "access_state",
    ),
    ("3 account_deactivated", OAUTH, 403, err("account_deactivated"), True, "access_state"),
    (
        "3 disabled_organization reversed",
        APIKEY,
        400,
        b'{"code":"disabled_organization"}',
        True,
        "access_state",
    ),
    (
        "3 org_suspended response.error",
        APIKEY,
        400,
        b'{"response":{"error":{"code":"org_suspended"}}}',
        True,
        "access_state",
    ),
    ("3 workspace_disabled", APIKEY, 404, err("workspace_disabled"), True, "access_state"),
    # row 4
    ("4 413", APIKEY, 413, err(None, "too big"), True, "openai_request_body_too_large"),
    # row 5
    (
        "5 model_not_found apikey",
        APIKEY,
        400,
        err("model_not_found", "no"),
        True,
        "model_not_found",
    ),
    (
        "5 unknown provider",
        APIKEY,
        400,
        err(None, "Unknown provider for model x"),
        True,
        "model_not_found",
    ),
    (
        "5 model is not supported",
        APIKEY,
        400,
        err(None, "The model is not supported"),
        True,
        "model_not_found",
    ),
    ("5 model not found", APIKEY, 400, err(None, "model not found"), True, "model_not_found"),
    # R106 widens row 5 to either account type (was: OAuth passes through).
    ("5 oauth model_not_found", OAUTH, 400, err("model_not_found", "no"), True, "model_not_found"),
    # R106: a project's model refusal, 403 or 404, either account type.
    (
        "5 403 project refusal",
        OAUTH,
        403,
        err("model_not_found", "Project `proj_x` does not have access to model `o1-pro`"),
        True,
        "model_not_found",
    ),
    ("5 404 model_not_found", APIKEY, 404, err("model_not_found", "no"), True, "model_not_found"),
    ("5 403 no access message", APIKEY, 403, err(None, "does not have access to model `m`"),
     True, "model_not_found"),
    # row 6
    ("6 401", APIKEY, 401, err(None, "bad key"), True, "status_401"),
    ("6 402", APIKEY, 402, err(None, "pay"), True, "status_402"),
    ("6 403", APIKEY, 403, err(None, "forbidden"), True, "status_403"),
    ("6 405", APIKEY, 405, b"", True, "status_405"),
    ("6 429", APIKEY, 429, err("rate_limit_exceeded"), True, "status_429"),
    ("6 529", APIKEY, 529, b"", True, "status_529"),
    ("6 500", APIKEY, 500, b"", True, "status_500"),
    ("6 503", APIKEY, 503, b"", True, "status_503"),
    ("6 599", APIKEY, 599, b"", True, "status_599"),
    # row 7
    ("7 server_is_overloaded on 400", APIKEY, 400, err("server_is_overloaded"), True, "overload"),
    ("7 slow_down on 404", APIKEY, 404, err("slow_down"), True, "overload"),
    (
        "7 servers are currently overloaded on 409",
        APIKEY,
        409,
        err(None, "Our servers are currently overloaded"),
        True,
        "overload",
    ),
    ("7 overload on 503", APIKEY, 503, err(None, "The server is overloaded"), True, "overload"),
    (
        "7 processing message 400",
        APIKEY,
        400,
        err(None, "An error occurred while processing your request."),
        True,
        "transient_processing",
    ),
    (
        "7 model at capacity 400",
        APIKEY,
        400,
        err(None, "Selected model is at capacity"),
        True,
        "transient_processing",
    ),
    (
        "7 retry/help/request id 400",
        APIKEY,
        400,
        err(
            None,
            "You can retry your request, or contact us through help.openai.com"
            " if the error persists. (Request ID abc)",
        ),
        True,
        "transient_processing",
    ),
    (
        "7 processing message only for 400",
        APIKEY,
        404,
        err(None, "An error occurred while processing your request."),
        False,
        "client_error",
    ),
    # row 8
    ("8 404", APIKEY, 404, err(None, "not found"), False, "client_error"),
    ("8 409", APIKEY, 409, b"", False, "client_error"),
    ("8 422", APIKEY, 422, err(None, "bad"), False, "client_error"),
    (
        "8 plain 400",
        APIKEY,
        400,
        err("invalid_value", "bad param", "invalid_request_error"),
        False,
        "client_error",
    ),
]


class R8Tests(SynchronousTestCase):
    """
    R8: the ordered failover table.
    """

    def test_rows(self):
        """
        R8: every row decides failover and the machine reason as the table
        says, first match winning.
        """
        for name, account, status, body, failover, reason in R8_ROWS:
            v = classify(account, status, body)
            self.assertEqual((v.failover, v.reason), (failover, reason), name)
            self.assertEqual(v.kind, F.STATUS, name)
            self.assertIsNotNone(v.clientError, name)


#: R8 summary table: (name, account, status, body, headers, sameAccount,
#: exhausted status, exhausted type, exhausted message, wsClose)
SUMMARY_ROWS = [
    (
        "access state",
        APIKEY,
        403,
        err("account_suspended"),
        {},
        False,
        502,
        "upstream_error",
        MSG_ACCESS_UNAVAILABLE,
        WS_CREDENTIAL_UNAVAILABLE,
    ),
    (
        "400 processing, not pool",
        APIKEY,
        400,
        err(None, "An error occurred while processing your request"),
        {},
        False,
        502,
        "upstream_error",
        MSG_REQUEST_FAILED,
        WS_PROXY_FAILED,
    ),
    (
        "400 model not found",
        APIKEY,
        400,
        err("model_not_found"),
        {},
        False,
        502,
        "upstream_error",
        MSG_REQUEST_FAILED,
        WS_PROXY_FAILED,
    ),
    (
        "401 apikey",
        APIKEY,
        401,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_AUTH_FAILED,
        WS_AUTH_FAILED,
    ),
    ("401 pool", POOL, 401, b"", {}, True, 502, "upstream_error", MSG_AUTH_FAILED, WS_AUTH_FAILED),
    (
        "402 pool not listed",
        POOL,
        402,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_REQUEST_FAILED,
        WS_PROXY_FAILED,
    ),
    ("403 pool", POOL, 403, b"", {}, True, 502, "upstream_error", MSG_FORBIDDEN, WS_AUTH_FAILED),
    (
        "405",
        APIKEY,
        405,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_REQUEST_FAILED,
        WS_PROXY_FAILED,
    ),
    (
        "413",
        POOL,
        413,
        b"",
        {},
        False,
        413,
        "invalid_request_error",
        MSG_PAYLOAD_TOO_LARGE,
        WS_PROXY_FAILED,
    ),
    (
        "429 apikey",
        APIKEY,
        429,
        b"",
        {},
        False,
        429,
        "rate_limit_error",
        MSG_RATE_LIMITED,
        WS_RATE_LIMITED,
    ),
    (
        "429 pool",
        POOL,
        429,
        b"",
        {},
        True,
        429,
        "rate_limit_error",
        MSG_RATE_LIMITED,
        WS_RATE_LIMITED,
    ),
    (
        "429 oauth",
        OAUTH,
        429,
        b"",
        {},
        True,
        429,
        "rate_limit_error",
        MSG_RATE_LIMITED,
        WS_RATE_LIMITED,
    ),
    (
        "529",
        POOL,
        529,
        b"",
        {},
        False,
        503,
        "upstream_error",
        MSG_SERVICE_OVERLOADED,
        WS_UNAVAILABLE,
    ),
    (
        "500",
        APIKEY,
        500,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_TEMPORARILY_UNAVAILABLE,
        WS_UNAVAILABLE,
    ),
    (
        "502",
        APIKEY,
        502,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_TEMPORARILY_UNAVAILABLE,
        WS_UNAVAILABLE,
    ),
    (
        "503",
        APIKEY,
        503,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_TEMPORARILY_UNAVAILABLE,
        WS_UNAVAILABLE,
    ),
    (
        "504",
        APIKEY,
        504,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_TEMPORARILY_UNAVAILABLE,
        WS_UNAVAILABLE,
    ),
    (
        "other >= 500",
        APIKEY,
        507,
        b"",
        {},
        False,
        502,
        "upstream_error",
        MSG_REQUEST_FAILED,
        WS_PROXY_FAILED,
    ),
    (
        "overload with text",
        APIKEY,
        503,
        err("server_is_overloaded", "Servers are overloaded now"),
        {},
        True,
        503,
        "server_error",
        "Servers are overloaded now",
        WS_UNAVAILABLE,
    ),
    (
        "overload default text",
        OAUTH,
        400,
        err("slow_down"),
        {},
        True,
        503,
        "server_error",
        MSG_OVERLOADED_DEFAULT,
        WS_UNAVAILABLE,
    ),
]


class SummaryTests(SynchronousTestCase):
    """
    R8 summary table (with R13, R14, R15, R65).
    """

    def test_rows(self):
        """
        R8 summary: same-account retry and the exhaustion mapping per row.
        """
        for name, account, status, body, headers, same, st, typ, msg, ws in SUMMARY_ROWS:
            v = classify(account, status, body, headers)
            self.assertTrue(v.failover, name)
            self.assertEqual(v.sameAccount, same, name)
            e = v.clientError
            self.assertEqual((e.status, e.type, e.message, e.wsClose), (st, typ, msg, ws), name)

    def test_overloadBackoffNoCooldown(self):
        """
        R8 capacity shed / R14: overload retries with backoff and never
        cools the account (R11 check 1).
        """
        v = classify(APIKEY, 529, err("server_is_overloaded"))
        self.assertEqual((v.sameAccount, v.backoff, v.markings), (True, True, ()))

    def test_poolEmptyList(self):
        """
        R14: an explicitly empty retry list turns off retry by status.
        """
        pool = Account(
            id="p2",
            type="apikey",
            base_url="u",
            credential="c",
            pool_mode=True,
            pool_mode_retry_status_codes=(),
        )
        self.assertFalse(classify(pool, 401).sameAccount)

    def test_oauth429Delay(self):
        """
        R13: an OAuth 429 retries the same account after Retry-After capped
        at 8 s, else 0.5 s; it carries no marking but the R12 reset.
        """
        for headers, delay, reset in (
            ({}, 0.5, 5),
            ({"retry-after": "3"}, 3.0, 3),
            ({"retry-after": "30"}, 8.0, 8),
            ({"retry-after": "junk"}, 0.5, 5),
        ):
            v = classify(OAUTH, 429, b"", headers)
            self.assertEqual(
                (v.oauth429, v.sameAccount, v.retryDelay, v.markings),
                (True, True, delay, ()),
                headers,
            )
            # R82: the reset is Retry-After capped at 8 s, else the fallback.
            self.assertEqual(v.rateLimitUntil, NOW + reset, headers)
        self.assertFalse(classify(APIKEY, 429).oauth429)


class PassThroughTests(SynchronousTestCase):
    """
    R9 (responses) and R10 (chat): errors that do not fail over.
    """

    def test_cyberPolicyRaw(self):
        """
        R9 step 1: cyber_policy passes the upstream body unchanged with the
        upstream status and content type, and marks nothing.
        """
        body = err("cyber_policy", "This request was blocked")
        v = classify(APIKEY, 403, body, {"content-type": "application/json; charset=utf-8"})
        e = v.clientError
        self.assertEqual((v.failover, v.markings), (False, ()))
        self.assertEqual(
            (e.status, e.rawBody, e.contentType), (403, body, "application/json; charset=utf-8")
        )

    def test_cyberPolicyChat(self):
        """
        R10: on chat, cyber_policy is written in the endpoint's format as
        invalid_request_error.
        """
        e = classify(APIKEY, 400, err("cyber_policy", "blocked"), endpoint="chat").clientError
        self.assertEqual(
            (e.status, e.type, e.code, e.rawBody),
            (400, "invalid_request_error", "cyber_policy", None),
        )

    def test_responsesMapping(self):
        """
        R9 steps 6 and 7: 400 passes through with its fields; other statuses
        are mapped; context-window errors keep the upstream message.
        """
        rows = [
            (
                "400 passthrough",
                400,
                err(
                    "invalid_value", "bad temperature", "invalid_request_error", param="temperature"
                ),
                (400, "invalid_request_error", "bad temperature", "invalid_value", "temperature"),
            ),
            (
                "400 upstream type kept",
                400,
                err("x", "m", "weird_error"),
                (400, "weird_error", "m", "x", None),
            ),
            (
                "400 no message",
                400,
                b"{}",
                (400, "invalid_request_error", "Upstream rejected the request", None, None),
            ),
            (
                "404",
                404,
                err(None, "nope"),
                (502, "upstream_error", MSG_REQUEST_FAILED, None, None),
            ),
            ("422", 422, b"", (502, "upstream_error", MSG_REQUEST_FAILED, None, None)),
            (
                "context 400",
                400,
                err("context_length_exceeded", "too many tokens"),
                (400, "invalid_request_error", "too many tokens", "context_length_exceeded", None),
            ),
            (
                "context 429",
                429,
                err(None, "maximum context length is 10"),
                (429, "rate_limit_error", "maximum context length is 10", None, None),
            ),
            (
                "context 403",
                403,
                err(None, "maximum context length is 10"),
                (502, "upstream_error", "maximum context length is 10", None, None),
            ),
            (
                "context 401",
                401,
                err(None, "maximum context length"),
                (502, "upstream_error", "maximum context length", None, None),
            ),
            (
                "context 402",
                402,
                err(None, "maximum context length"),
                (502, "upstream_error", "maximum context length", None, None),
            ),
            (
                "context 413",
                413,
                err(None, "maximum context length"),
                (502, "upstream_error", "maximum context length", None, None),
            ),
        ]
        for name, status, body, expected in rows:
            e = classify(APIKEY, status, body).clientError
            self.assertEqual((e.status, e.type, e.message, e.code, e.param), expected, name)

    def test_contextMessageSanitised(self):
        """
        R9: the context-window message shown to the client is sanitised.
        """
        e = classify(
            APIKEY, 400, err(None, "maximum context length for key sk-abcdef123456")
        ).clientError
        self.assertNotIn("abcdef123456", e.message)

    def test_chatMapping(self):
        """
        R10: chat writes the real upstream status with a type by status and
        the upstream message.
        """
        rows = [
            (400, err(None, "bad"), (400, "invalid_request_error", "bad")),
            (404, err(None, "no such thing"), (404, "not_found_error", "no such thing")),
            (422, err(None, "odd"), (422, "invalid_request_error", "odd")),
            (409, b"", (409, "invalid_request_error", MSG_REQUEST_FAILED)),
            (429, err("context_length_exceeded", "ctx"), (429, "rate_limit_error", "ctx")),
            (500, err("context_length_exceeded", "ctx"), (500, "api_error", "ctx")),
        ]
        for status, body, expected in rows:
            e = classify(APIKEY, status, body, endpoint="chat").clientError
            self.assertEqual((e.status, e.type, e.message), expected, status)

    def test_accountPolicySwitch(self):
        """
        R9 step 5 with R11's 400 rows: a disabling 400 switches anyway,
        without same-account retry.
        """
        for account in (APIKEY, OAUTH):
            for message in (
                "Your organization has been disabled.",
                "Identity verification is required",
            ):
                v = classify(account, 400, err(None, message))
                self.assertEqual(
                    (v.failover, v.sameAccount, v.reason, kinds(v)),
                    (True, False, "account_policy", [F.MARK_DISABLED]),
                )
        # R11 check 6: a pool-mode account marks nothing, so the 400 passes.
        v = classify(POOL, 400, err(None, "Your organization has been disabled."))
        self.assertEqual((v.failover, v.reason, v.clientError.status), (False, "client_error", 400))


#: R11: (name, account, status, body, headers, [(kind, seconds, until)])
R11_ROWS = [
    (
        "401 apikey permanent",
        APIKEY,
        401,
        err(None, "bad key"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    (
        "401 oauth token_revoked",
        OAUTH,
        401,
        err("token_revoked"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    (
        "401 oauth token_invalidated",
        OAUTH,
        401,
        err("token_invalidated"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    (
        "401 oauth detail Unauthorized",
        OAUTH,
        401,
        b'{"detail":"Unauthorized"}',
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    (
        "401 oauth without a refresh token -> permanent",
        OAUTH_STATIC,
        401,
        err(None, "expired"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    (
        "401 oauth other -> 10 min",
        OAUTH,
        401,
        err(None, "expired"),
        {},
        [(F.MARK_TEMP_UNSCHEDULABLE, 600, None)],
    ),
    ("402 permanent", OAUTH, 402, err(None, "billing"), {}, [(F.MARK_DISABLED, None, None)]),
    (
        "403 HTML none",
        APIKEY,
        403,
        b"<!DOCTYPE html><html>blocked</html>",
        {"content-type": "text/html"},
        [],
    ),
    (
        "403 HTML by content type",
        APIKEY,
        403,
        b"blocked",
        {"content-type": "text/html; charset=utf-8"},
        [],
    ),
    (
        "403 other -> counter",
        APIKEY,
        403,
        err(None, "forbidden"),
        {},
        [(F.MARK_COUNT_403, None, None)],
    ),
    ("429 apikey rate limited", APIKEY, 429, b"", {}, [(F.MARK_RATE_LIMITED, None, NOW + 5)]),
    ("429 oauth none (R13)", OAUTH, 429, b"", {}, []),
    # R86.2 (section I) wins over R11's 529 row: a capacity shed marks nothing.
    ("529 marks nothing (R86.2)", APIKEY, 529, b"", {}, []),
    ("500 apikey streak", APIKEY, 500, b"", {}, [(F.MARK_TRANSIENT_STREAK, None, None)]),
    ("522 apikey streak", APIKEY, 522, b"", {}, [(F.MARK_TRANSIENT_STREAK, None, None)]),
    ("507 apikey logs only", APIKEY, 507, b"", {}, []),
    ("500 oauth logs only", OAUTH, 500, b"", {}, []),
    ("500 pool nothing (check 6)", POOL, 500, b"", {}, []),
    ("401 pool nothing (check 6)", POOL, 401, b"", {}, []),
    (
        "400 processing apikey streak",
        APIKEY,
        400,
        err(None, "An error occurred while processing your request"),
        {},
        [(F.MARK_TRANSIENT_STREAK, None, None)],
    ),
    (
        "400 org disabled",
        APIKEY,
        400,
        err(None, "Your organization has been disabled"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    (
        "400 identity verification",
        OAUTH,
        400,
        err(None, "Identity verification is required"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    ("400 other none", APIKEY, 400, err(None, "bad"), {}, []),
    ("check 1 capacity shed none", APIKEY, 529, err("server_is_overloaded"), {}, []),
    (
        "check 2 access state",
        POOL,
        403,
        err("organization_deactivated"),
        {},
        [(F.MARK_DISABLED, None, None)],
    ),
    ("check 3 context none", APIKEY, 500, err("context_length_exceeded"), {}, []),
    (
        "check 4 model not found",
        APIKEY,
        400,
        err("model_not_found"),
        {},
        [(F.MARK_MODEL_BLOCK, 600, None)],
    ),
    ("cyber none", APIKEY, 403, err("cyber_policy"), {}, []),
    # R106: a model refusal is a model block, never the 403 counter; an error
    # naming a param is never the account's.
    (
        "403 model refusal",
        APIKEY,
        403,
        err("model_not_found", "Project `proj_x` does not have access to model `o1-pro`"),
        {},
        [(F.MARK_MODEL_BLOCK, 600, None)],
    ),
    ("403 with param none", APIKEY, 403, err(None, "no", param="input"), {}, []),
    ("400 with param none", APIKEY, 400, err(None, "Your organization has been disabled",
                                             param="input"), {}, []),
]


class R11Tests(SynchronousTestCase):
    """
    R11: account markings.
    """

    def test_rows(self):
        """
        R11: every row of the status table and the checks before it.
        """
        for name, account, status, body, headers, expected in R11_ROWS:
            v = classify(account, status, body, headers)
            got = [(m.kind, m.seconds, m.until) for m in v.markings]
            self.assertEqual(got, expected, name)
            for m in v.markings:
                self.assertNotIn("sk-secret", m.reason, name)

    def test_403Reason(self):
        """
        R11: the 403 counter marking carries the sanitised upstream message.
        """
        v = classify(APIKEY, 403, err(None, "nope Bearer abcdef"))
        self.assertEqual(v.markings[0].reason, "nope Bearer [redacted]")


class R12Tests(SynchronousTestCase):
    """
    R12: choosing the 429 reset.
    """

    def until(self, headers=None, body=b"", classifier=None):
        """
        @return: the rate-limited marking's until for an API-key 429.
        """
        v = classify(APIKEY, 429, body, headers, classifier=classifier)
        self.assertEqual(v.markings[0].kind, F.MARK_RATE_LIMITED)
        self.assertEqual(v.rateLimitUntil, v.markings[0].until)
        return v.markings[0].until

    def test_headerSpentWindow(self):
        """
        R12 rule 1: a window at used_percent >= 100 gives its own reset,
        even when the other resets later.
        """
        h = {
            "x-codex-primary-used-percent": "100",
            "x-codex-primary-reset-at": str(int(NOW + 600)),
            "x-codex-secondary-used-percent": "40",
            "x-codex-secondary-reset-at": str(int(NOW + 86400)),
        }
        self.assertEqual(self.until(h), NOW + 600)
        h2 = dict(
            h, **{"x-codex-primary-used-percent": "20", "x-codex-secondary-used-percent": "100.0"}
        )
        self.assertEqual(self.until(h2), NOW + 86400)

    def test_headerSpentRelative(self):
        """
        R12 rule 1: a spent window's relative C{reset-after-seconds} form is
        converted from now; with both spent, the later reset.
        """
        h = {
            "x-codex-primary-used-percent": "100",
            "x-codex-primary-reset-after-seconds": "300",
            "x-codex-secondary-used-percent": "90",
            "x-codex-secondary-reset-after-seconds": "7200",
        }
        self.assertEqual(self.until(h), NOW + 300)
        h["x-codex-secondary-used-percent"] = "100"
        self.assertEqual(self.until(h), NOW + 7200)

    def test_burstNotSpentPlan(self):
        """
        R82: a 429 whose windows are all below 100 % (and whose body is not a
        usage limit) is a burst: never a window reset, but Retry-After
        capped at 60 s (8 s on OAuth accounts), else the fallback. Before
        R82 this parked the account until the later window reset (R12.1).
        """
        h = {
            "x-codex-primary-used-percent": "80",
            "x-codex-primary-reset-after-seconds": "18000",
            "x-codex-secondary-used-percent": "90",
            "x-codex-secondary-reset-after-seconds": "600000",
        }
        self.assertEqual(self.until(h), NOW + 5)
        self.assertEqual(self.until(dict(h, **{"retry-after": "20"})), NOW + 20)
        self.assertEqual(self.until(dict(h, **{"retry-after": "600"})), NOW + 60)
        self.assertEqual(self.until({"x-codex-primary-reset-after-seconds": "90"}), NOW + 5)
        oauth = classify(OAUTH, 429, b"", dict(h, **{"retry-after": "20"}))
        self.assertEqual(oauth.rateLimitUntil, NOW + 8)
        spent = classify(OAUTH, 429, b"", dict(h, **{"x-codex-primary-used-percent": "100"}))
        self.assertEqual(spent.rateLimitUntil, NOW + 18000)

    def test_body(self):
        """
        R12 rule 2: usage_limit_reached (and usage_not_included) use
        resets_at, else now + resets_in_seconds; a spent window's header
        reset wins over the body.
        """
        self.assertEqual(
            self.until(body=err(None, "x", "usage_limit_reached", resets_at=NOW + 1234)), NOW + 1234
        )
        self.assertEqual(
            self.until(body=err(None, "x", "usage_limit_reached", resets_in_seconds=77)), NOW + 77
        )
        self.assertEqual(
            self.until(
                {"x-codex-primary-used-percent": "100",
                 "x-codex-primary-reset-at": str(NOW + 50)},
                err(None, "x", "usage_limit_reached", resets_in_seconds=77),
            ),
            NOW + 50,
        )
        # R82: a window below 100 % gives no reset; the body's does.
        self.assertEqual(
            self.until(
                {"x-codex-primary-used-percent": "60",
                 "x-codex-primary-reset-at": str(NOW + 50)},
                err(None, "x", "usage_not_included", resets_in_seconds=77),
            ),
            NOW + 77,
        )

    def test_fallback(self):
        """
        R12 rule 3: the fallback, default 5 s, clamped to 1-7200 s.
        """
        self.assertEqual(self.until(), NOW + 5)
        self.assertEqual(
            self.until(classifier=DefaultClassifier(rate_limit_fallback_seconds=0)), NOW + 1
        )
        self.assertEqual(
            self.until(classifier=DefaultClassifier(rate_limit_fallback_seconds=10**6)), NOW + 7200
        )
        # a reset in the past is ignored
        self.assertEqual(self.until({"x-codex-primary-reset-at": str(NOW - 10)}), NOW + 5)


class R15Tests(SynchronousTestCase):
    """
    R15 / R65: exhaustion mapping.
    """

    def test_statusMap(self):
        """
        R15 step 8 and R65: the last status maps to the client status,
        message and WebSocket close.
        """
        c = DefaultClassifier()
        rows = [
            (401, 502, MSG_AUTH_FAILED, WS_AUTH_FAILED),
            (403, 502, MSG_FORBIDDEN, WS_AUTH_FAILED),
            (429, 429, MSG_RATE_LIMITED, WS_RATE_LIMITED),
            (529, 503, MSG_SERVICE_OVERLOADED, WS_UNAVAILABLE),
            (500, 502, MSG_TEMPORARILY_UNAVAILABLE, WS_UNAVAILABLE),
            (502, 502, MSG_TEMPORARILY_UNAVAILABLE, WS_UNAVAILABLE),
            (503, 502, MSG_TEMPORARILY_UNAVAILABLE, WS_UNAVAILABLE),
            (504, 502, MSG_TEMPORARILY_UNAVAILABLE, WS_UNAVAILABLE),
            (402, 502, MSG_REQUEST_FAILED, WS_PROXY_FAILED),
            (405, 502, MSG_REQUEST_FAILED, WS_PROXY_FAILED),
            (599, 502, MSG_REQUEST_FAILED, WS_PROXY_FAILED),
        ]
        for last, status, message, ws in rows:
            e = c.exhausted(
                F.Verdict(kind=F.STATUS, failover=True, status=last, reason=f"status_{last}"),
                "responses",
            )
            self.assertEqual((e.status, e.message, e.wsClose), (status, message, ws), last)
        self.assertEqual(
            c.exhausted(F.Verdict(kind=F.STATUS, failover=True, status=429), "chat").type,
            "rate_limit_error",
        )

    def test_orderedSteps(self):
        """
        R15 steps 1, 4, 5, 6 and the no-verdict case.
        """
        c = DefaultClassifier()
        e = c.exhausted(None, "responses")
        self.assertEqual(
            (e.status, e.message, e.wsClose), (502, MSG_REQUEST_FAILED, WS_PROXY_FAILED)
        )
        e = c.exhausted(
            F.Verdict(
                kind=F.STATUS, failover=True, status=413, reason="openai_request_body_too_large"
            ),
            "responses",
        )
        self.assertEqual(
            (e.status, e.type, e.message), (413, "invalid_request_error", MSG_PAYLOAD_TOO_LARGE)
        )
        e = c.exhausted(
            F.Verdict(kind=F.STATUS, failover=True, status=403, reason="access_state"), "responses"
        )
        self.assertEqual(
            (e.status, e.message, e.wsClose),
            (502, MSG_ACCESS_UNAVAILABLE, WS_CREDENTIAL_UNAVAILABLE),
        )
        self.assertEqual(e.wsClose[0], 1013)
        self.assertIn("credential unavailable", e.wsClose[1])
        e = c.exhausted(
            F.Verdict(kind=F.STATUS, failover=True, status=500, reason="overload", message="busy!"),
            "responses",
        )
        self.assertEqual((e.status, e.type, e.message), (503, "server_error", "busy!"))
        v = c.classifyStreamFailure(APIKEY, "responses", "empty_completed", None, "")
        self.assertEqual((v.clientError.status, v.failover), (502, True))

    def test_wsReasonsFitLimit(self):
        """
        R65: every close reason fits 120 bytes and uses a code from R70.
        """
        for code, reason in (
            WS_PROXY_FAILED,
            WS_RATE_LIMITED,
            WS_UNAVAILABLE,
            WS_AUTH_FAILED,
            WS_CREDENTIAL_UNAVAILABLE,
        ):
            self.assertLessEqual(len(reason.encode()), 120)
            self.assertIn(code, (1008, 1011, 1013))


class R16Tests(SynchronousTestCase):
    """
    R16: copying Retry-After.
    """

    def test_rules(self):
        """
        R16: at most 128 characters, no CR/LF, digits at most 7 days or an
        HTTP date at most 7 days ahead.
        """
        day = 86400
        self.assertEqual(retryAfterSeconds("30", NOW), 30)
        self.assertEqual(retryAfterSeconds(b"604800", NOW), 604800)
        self.assertIsNone(retryAfterSeconds("604801", NOW))
        self.assertIsNone(retryAfterSeconds("30\r\nX-Evil: 1", NOW))
        self.assertIsNone(retryAfterSeconds("1\n", NOW))
        self.assertIsNone(retryAfterSeconds(" " * 127 + "12", NOW))
        self.assertIsNone(retryAfterSeconds("soon", NOW))
        self.assertIsNone(retryAfterSeconds("-5", NOW))
        self.assertIsNone(retryAfterSeconds(None, NOW))
        self.assertEqual(retryAfterSeconds(formatdate(NOW + day, usegmt=True), NOW), day)
        self.assertIsNone(retryAfterSeconds(formatdate(NOW + 8 * day, usegmt=True), NOW))
        self.assertEqual(safeRetryAfter(" 12 ", NOW), "12")

    def test_copied(self):
        """
        R16 / R15 step 3: a safe value lands in the verdict and in the 429
        exhaustion headers; an unsafe one does not.
        """
        v = classify(APIKEY, 429, b"", {"retry-after": "12"})
        self.assertEqual(v.retryAfter, "12")
        self.assertEqual(v.clientError.headers, (("Retry-After", "12"),))
        v = classify(APIKEY, 429, b"", {"Retry-After": "99999999"})
        self.assertIsNone(v.retryAfter)
        self.assertEqual(v.clientError.headers, ())


def failed(code=None, message=None, **kw):
    """
    @return: a C{response.failed} event.
    """
    return {
        "type": "response.failed",
        "response": {"status": "failed", "error": {"code": code, "message": message}},
        **kw,
    }


def errorEvent(code=None, message=None, **kw):
    """
    @return: an C{error} event (WebSocket wrapper form when C{status} is given).
    """
    return {"type": "error", "error": {"code": code, "message": message}, **kw}


class R23Tests(SynchronousTestCase):
    """
    R23: stream failures before output.
    """

    def stream(self, event, account=APIKEY):
        """
        Classify a stream event.
        """
        return DefaultClassifier().classifyStreamFailure(account, "responses", "event", event, "")

    def test_readErrorNoTerminal(self):
        """
        R23: read errors and missing terminals fail over with their fixed
        messages; exhausted as 502 "Upstream service temporarily unavailable".
        """
        c = DefaultClassifier()
        v = c.classifyStreamFailure(
            APIKEY, "responses", "read_error", None, "INTERNAL_ERROR sk-abcdef123456"
        )
        self.assertEqual((v.kind, v.failover, v.status), (F.STREAM, True, 502))
        self.assertTrue(
            v.message.startswith("OpenAI stream disconnected before completion: INTERNAL_ERROR")
        )
        self.assertNotIn("abcdef123456", v.message)
        self.assertEqual(v.clientError.message, MSG_TEMPORARILY_UNAVAILABLE)
        v = c.classifyStreamFailure(APIKEY, "responses", "no_terminal", None, "")
        self.assertEqual(
            (v.failover, v.message), (True, "OpenAI stream ended before a terminal event")
        )

    def test_emptyCompleted(self):
        """
        R23 / R15 step 6: an empty response.completed fails over; exhausted
        as 502.
        """
        v = DefaultClassifier().classifyStreamFailure(
            OAUTH, "responses", "empty_completed", None, ""
        )
        self.assertEqual(
            (v.failover, v.reason, v.clientError.status), (True, "empty_completed", 502)
        )

    def test_forwarded(self):
        """
        R23: cyber_policy, context-window, policy-marked failures, plain
        error events and previous_response_not_found are forwarded (None).
        """
        for event in (
            failed("cyber_policy", "blocked"),
            failed("context_length_exceeded", "too long"),
            errorEvent("context_length_exceeded", "too long", status=400),
            failed("invalid_request", "bad"),
            failed(None, "This content violates our usage policy"),
            failed(None, "safety system"),
            failed(None, "high-risk cyber activity"),
            failed(None, "that is not allowed"),
            failed("content_policy_violation", "x"),
            errorEvent("bad_thing", "something broke"),
            errorEvent(
                "previous_response_not_found",
                "Previous response with id 'resp_B' not found.",
                status=400,
            ),
            failed("previous_response_not_found", "gone"),
            {"type": "error", "code": "x", "message": "plain"},
        ):
            self.assertIsNone(self.stream(event), event)

    def test_failover(self):
        """
        R23: qualifying events fail over with the expected reason and status.
        """
        rows = [
            (failed("server_error", "An error occurred"), "stream_failed", 502),
            (failed(None, None), "stream_failed", 502),
            (errorEvent(None, "temporary failure"), "stream_retryable_error", 502),
            (errorEvent(None, "please try again later"), "stream_retryable_error", 502),
            ({"type": "error", "message": "Please retry"}, "stream_retryable_error", 502),
            (errorEvent("account_deactivated", "gone"), "access_state", 502),
            (failed("workspace_suspended", "gone"), "access_state", 502),
            (errorEvent("x", "unauthorized", status=401), "status_401", 401),
            (errorEvent("x", "overloaded", status=529), "status_529", 529),
            (errorEvent("x", "forbidden account", status=403), "status_403", 403),
            (errorEvent("server_is_overloaded", "busy"), "overload", 503),
            (
                errorEvent(None, "An error occurred while processing your request"),
                "transient_processing",
                502,
            ),
        ]
        for event, reason, status in rows:
            v = self.stream(event)
            self.assertIsNotNone(v, event)
            self.assertEqual(
                (v.failover, v.reason, v.status, v.kind), (True, reason, status, F.STREAM), event
            )

    def test_policy403NotAccountLike(self):
        """
        R23: a 403 carrying a policy marker is not an account failure.
        """
        self.assertIsNone(self.stream(errorEvent("x", "policy says no", status=403)))

    def test_markings(self):
        """
        R23 with R11: access state disables, a semantic 401 on OAuth cools
        for 10 min, overload retries the same account with backoff.
        """
        self.assertEqual(
            kinds(self.stream(errorEvent("account_deactivated", "x"))), [F.MARK_DISABLED]
        )
        v = self.stream(errorEvent("x", "expired", status=401), account=OAUTH)
        self.assertEqual(
            [(m.kind, m.seconds) for m in v.markings], [(F.MARK_TEMP_UNSCHEDULABLE, 600)]
        )
        v = self.stream(errorEvent("server_is_overloaded", "busy"))
        self.assertEqual((v.sameAccount, v.backoff, v.markings), (True, True, ()))

    def test_rateLimit(self):
        """
        R23 / R49 step 5: rate-limit and usage-limit errors are 429 failovers
        with a rate-limited marking: relative resets as C{seconds}, absolute
        ones as C{until}, else the 5 s fallback.
        """
        rows = [
            (errorEvent("rate_limit_exceeded", "slow down"), 5.0, None),
            (errorEvent("insufficient_quota", "no money"), 5.0, None),
            (errorEvent(None, "Rate limit reached for requests"), 5.0, None),
            (errorEvent(None, "The usage limit has been reached"), 5.0, None),
            (
                {
                    "type": "error",
                    "status": 429,
                    "error": {
                        "type": "usage_limit_reached",
                        "message": "x",
                        "resets_in_seconds": 7200,
                    },
                },
                7200.0,
                None,
            ),
            (
                {
                    "type": "error",
                    "status": 429,
                    "error": {
                        "type": "usage_limit_reached",
                        "message": "x",
                        "resets_at": 1790300000,
                    },
                },
                None,
                1790300000.0,
            ),
            (
                {
                    "type": "error",
                    "status": 429,
                    "error": {"type": "usage_limit_reached"},
                    "headers": {
                        "x-codex-primary-used-percent": "100",
                        "x-codex-primary-reset-after-seconds": "60",
                    },
                },
                60.0,
                None,
            ),
            (failed("rate_limit_exceeded", "Rate limit reached"), 5.0, None),
        ]
        for event, seconds, until in rows:
            v = self.stream(event, account=OAUTH)
            self.assertEqual(
                (v.failover, v.status, v.reason, v.oauth429),
                (True, 429, "stream_rate_limit", False),
                event,
            )
            self.assertEqual(
                [(m.kind, m.seconds, m.until) for m in v.markings],
                [(F.MARK_RATE_LIMITED, seconds, until)],
                event,
            )
            self.assertEqual(v.clientError.status, 429)


class FirstOutputTests(SynchronousTestCase):
    """
    R20, R21, R22.
    """

    def test_firstOutputTimeout(self):
        """
        R20: status 504, safe after write; exhausted as 502 "Upstream
        service temporarily unavailable" with type first_output_timeout.
        """
        v = DefaultClassifier().firstOutputTimeout(APIKEY, 30)
        self.assertEqual(
            (v.kind, v.failover, v.status, v.safeAfterWrite, v.reason),
            (F.FIRST_OUTPUT_TIMEOUT, True, 504, True, "first_output_timeout"),
        )
        e = v.clientError
        self.assertEqual(
            (e.status, e.type, e.message, e.wsClose),
            (502, "first_output_timeout", MSG_TEMPORARILY_UNAVAILABLE, WS_UNAVAILABLE),
        )

    def test_stagingOverflow(self):
        """
        R22: a staging overflow is a failover marked safe after write.
        """
        v = DefaultClassifier().stagingOverflow(APIKEY, 8 * 2**20)
        self.assertEqual(
            (v.kind, v.failover, v.safeAfterWrite, v.reason),
            (F.STAGING_OVERFLOW, True, True, "staging_overflow"),
        )
        self.assertEqual(v.clientError.status, 502)
