# -*- test-case-name: tests.test_control_logins -*-
"""
L{EgressClient}: the L{relay.interfaces.IEgressClient} for requests that
are not turns -- ChatGPT login code exchanges and device-code polls
(L{relay.control.logins}), usage probes (L{relay.oauth.usageprobe}) --
through the account's egress proxy (behaviour.md R97), with the same
proxy endpoints and TLS verification as the token refresh
(L{relay.oauth.endpoint.TokenEndpoint}).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.web.client import Agent
from twisted.web.http_headers import Headers
from zope.interface import implementer

from relay.interfaces import IEgressClient
from relay.upstream.headers import CODEX_USER_AGENT
from relay.upstream.http import QuietConnectionPool

__all__ = ["EgressClient", "EgressReply", "REPLY_LIMIT", "USER_AGENT"]

REPLY_LIMIT = 256 * 1024
"""The most of an answer's body read, bytes."""

USER_AGENT = CODEX_USER_AGENT
"""A Codex-shaped C{User-Agent} (protocol.md 7.2), unless the caller gives one."""


@frozen
class EgressReply:
    """
    What an endpoint answered.

    @ivar status: the HTTP status.
    @ivar headers: lower-cased name -> first value.
    @ivar body: at most L{REPLY_LIMIT} bytes of the body.
    """

    status: int
    headers: dict = field(factory=dict)
    body: bytes = field(default=b"", repr=False)

    def json(self) -> dict:
        """
        @return: the body as a JSON object, or C{{}}.
        """
        import json

        try:
            value = json.loads(self.body)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@implementer(IEgressClient)
@define(eq=False)
class EgressClient:
    """
    See the module docstring.

    @ivar _reactor: the reactor.
    @ivar _settings: the L{relay.state.settings.RuntimeSettings} (the upstream
        connect timeout).
    @ivar _tlsPolicy: an C{IPolicyForHTTPS}, or L{None} for the platform
        trust store.
    """

    _reactor: Any
    _settings: Any
    _tlsPolicy: Any = None

    def request(self, proxy, method: str, url: str, headers: dict, body: Optional[bytes],
                timeout: float) -> Deferred:
        """
        See L{IEgressClient.request}.
        """
        return Deferred.fromCoroutine(self._request(proxy, method, url, headers, body, timeout))

    async def _request(self, proxy, method, url, headers, body, timeout) -> EgressReply:
        from treq.client import HTTPClient  # late, for RSS: only when used

        from relay.upstream.proxy import ProxyAgentEndpointFactory

        connect = self._settings.current.upstream.connect_timeout_seconds
        factory = ProxyAgentEndpointFactory(self._reactor, proxy, connect, self._tlsPolicy)
        pool = QuietConnectionPool(self._reactor, persistent=False)
        pool.retryAutomatically = False
        client = HTTPClient(Agent.usingEndpointFactory(self._reactor, factory, pool=pool))
        sent = {k.lower(): v for k, v in headers.items()}
        sent.setdefault("user-agent", USER_AGENT)
        sent.setdefault("accept", "application/json")
        raw = Headers({k.encode("latin-1"): [v.encode("latin-1")] for k, v in sent.items()})
        d = client.request(method, url, data=body, headers=raw, unbuffered=True)
        d.addTimeout(timeout, self._reactor)
        response = await d
        reader = response.content()
        reader.addTimeout(timeout, self._reactor)
        data = await reader
        replyHeaders = {
            k.decode("latin-1").lower(): v[0].decode("latin-1", "replace")
            for k, v in response.headers.getAllRawHeaders()
        }
        return EgressReply(status=response.code, headers=replyHeaders, body=data[:REPLY_LIMIT])
