# -*- test-case-name: tests.test_oauth -*-
"""
The OAuth token endpoint client (L{relay.interfaces.ITokenEndpoint},
protocol.md 7.4): C{POST {auth_base_url}/oauth/token} with Codex's JSON
body, through the account's egress proxy, verifying TLS like every other
upstream call.

Each exchange gets its own non-persistent connection, so relay knows
whether the request can have reached the server: a failure before the
connection (or the proxy tunnel) was up, or while the request was still
being written, is L{NotSent} and safe to retry; anything later leaves the
refresh token in doubt (the server may have rotated it).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from attrs import define, field, frozen
from OpenSSL import SSL
from twisted.internet.defer import Deferred
from twisted.web.client import (
    Agent,
    RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from relay.interfaces import ITokenEndpoint
from relay.oauth.tokens import PERMANENT_CODES
from relay.upstream.headers import CODEX_USER_AGENT
from relay.upstream.http import QuietConnectionPool

USER_AGENT = CODEX_USER_AGENT.encode("ascii")
"""The C{User-Agent} of token requests (a Codex-shaped one, protocol.md 7.2)."""

REPLY_LIMIT = 64 * 1024
"""The largest token endpoint body read, bytes."""


class NotSent(Exception):
    """
    The token request certainly never reached the server (connect,
    proxy or TLS failure, or a request not fully written): the refresh
    token is unused.
    """


@frozen
class TokenReply:
    """
    What the token endpoint answered.

    @ivar status: the HTTP status.
    @ivar body: the parsed JSON body, or C{{}}.
    """

    status: int
    body: dict = field(factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """
        A 2xx with an C{access_token}.
        """
        return 200 <= self.status < 300 and isinstance(self.body.get("access_token"), str)

    @property
    def errorCode(self) -> Optional[str]:
        """
        The error code: C{error} when it is a string (OAuth's
        C{invalid_grant}), else C{error.code} or C{error.type}, else
        C{code}.
        """
        error = self.body.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict):
            for key in ("code", "type"):
                if isinstance(error.get(key), str) and error[key]:
                    return error[key]
        code = self.body.get("code")
        return code if isinstance(code, str) else None

    @property
    def permanent(self) -> bool:
        """
        protocol.md 7.4: C{refresh_token_expired}, C{refresh_token_reused},
        C{refresh_token_invalidated} and C{invalid_grant} (any 4xx carrying
        one), and any 401, need a new login. 5xx, 429 and other answers
        are transient.
        """
        if self.ok or self.status >= 500 or self.status == 429:
            return False
        code = self.errorCode or ""
        return code in PERMANENT_CODES or self.status == 401

    def describe(self) -> str:
        """
        @return: short text for logs and the admin view (no secrets).
        """
        return f"{self.status} {self.errorCode or 'error'}"


@implementer(IAgentEndpointFactory)
class _Watched:
    """
    Wraps an endpoint factory and records whether a connection came up.
    """

    def __init__(self, factory, connected: list):
        self._factory = factory
        self._connected = connected

    def endpointForURI(self, uri):
        return _WatchedEndpoint(self._factory.endpointForURI(uri), self._connected)


class _WatchedEndpoint:
    def __init__(self, endpoint, connected: list):
        self._endpoint = endpoint
        self._connected = connected

    def connect(self, factory):
        d = self._endpoint.connect(factory)

        def _cbConnected(proto):
            self._connected.append(True)
            return proto

        return d.addCallback(_cbConnected)


def _tlsFailure(failure) -> bool:
    reasons = getattr(failure.value, "reasons", None) or []
    return any(r.check(SSL.Error) is not None for r in reasons)


@implementer(ITokenEndpoint)
@define(eq=False)
class TokenEndpoint:
    """
    The built-in L{ITokenEndpoint}.

    @ivar _reactor: the reactor.
    @ivar _settings: the L{relay.state.settings.RuntimeSettings} (for
        C{gateway.oauth.auth_base_url}, C{client_id}, and the upstream
        connect timeout).
    @ivar _tlsPolicy: an C{IPolicyForHTTPS}, or L{None} for the platform
        trust store.
    """

    _reactor: Any
    _settings: Any
    _tlsPolicy: Any = None

    def url(self, account) -> str:
        """
        @return: C{{auth_base_url}/oauth/token} for C{account}.
        """
        base = account.auth_base_url or self._settings.current.oauth.auth_base_url
        return base.rstrip("/") + "/oauth/token"

    def refresh(self, account, refreshToken: str, timeout: float) -> Deferred:
        """
        See L{ITokenEndpoint.refresh}.
        """
        return Deferred.fromCoroutine(self._refresh(account, refreshToken, timeout))

    async def _refresh(self, account, refreshToken: str, timeout: float) -> TokenReply:
        from relay.upstream.proxy import ProxyAgentEndpointFactory

        current = self._settings.current
        connected: list = []
        factory = ProxyAgentEndpointFactory(
            self._reactor, account.proxy, current.upstream.connect_timeout_seconds,
            self._tlsPolicy,
        )
        pool = QuietConnectionPool(self._reactor, persistent=False)
        pool.retryAutomatically = False
        agent = Agent.usingEndpointFactory(self._reactor, _Watched(factory, connected), pool=pool)
        from treq.client import HTTPClient  # late, for RSS: only for a refresh

        client = HTTPClient(agent)
        body = json.dumps({
            "client_id": current.oauth.client_id,
            "grant_type": "refresh_token",
            "refresh_token": refreshToken,
            "scope": "openid profile email",
        }).encode("utf-8")
        headers = Headers({
            b"content-type": [b"application/json"],
            b"accept": [b"application/json"],
            # Codex-shaped, like every other upstream call (protocol.md 7.2).
            b"user-agent": [USER_AGENT],
            b"originator": [b"codex_cli_rs"],
        })
        d = client.post(self.url(account), data=body, headers=headers, unbuffered=True)
        d.addTimeout(timeout, self._reactor)
        try:
            response = await d
        except Exception as e:
            failure = _asFailure(e)
            if not connected or failure.check(RequestTransmissionFailed) is not None or (
                failure.check(ResponseNeverReceived) is not None and _tlsFailure(failure)
            ):
                raise NotSent(describeError(e)) from e
            raise
        reader = response.content()
        reader.addTimeout(timeout, self._reactor)
        raw = await reader
        try:
            parsed = json.loads(raw[:REPLY_LIMIT])
        except ValueError:
            parsed = {}
        return TokenReply(status=response.code, body=parsed if isinstance(parsed, dict) else {})


_FAILURE_REPR = re.compile(r"<twisted\.python\.failure\.Failure (?:[\w.]+\.)?(\w+): ?(.*?)>")


def describeError(e: BaseException, limit: int = 160) -> str:
    """
    A short, readable description of an exception for logs and the admin
    view: its class name and message, with the Failures that Twisted's
    wrapper exceptions (C{ResponseNeverReceived}, C{RequestTransmissionFailed},
    ...) hold described the same way instead of their C{repr}.

    @param e: the exception.
    @param limit: at most this many characters of message.
    @return: e.g. C{ResponseNeverReceived: ConnectionLost: Connection to
        the other side was lost in a non-clean fashion.}
    """
    reasons = getattr(e, "reasons", None)
    if isinstance(reasons, (list, tuple)) and reasons:
        inner = [
            describeError(r.value, limit) if isinstance(getattr(r, "value", None), BaseException)
            else str(r)
            for r in reasons
        ]
        text = "; ".join(inner)
    else:
        text = _FAILURE_REPR.sub(lambda m: m.group(1) + (": " + m.group(2) if m.group(2) else ""),
                                 str(e))
    text = " ".join(text.split())[:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _asFailure(e: Exception):
    from twisted.python.failure import Failure

    return Failure(e)
