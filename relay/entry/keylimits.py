# -*- test-case-name: tests.integration.test_key_limits -*-
"""
Where Codex reads an account's usage, a client key's own (behaviour.md
R114; protocol.md 7.3, 7.3a), transport side only; the windows are
L{relay.tenants.keyusage}'s:

  - C{GET /backend-api/wham/usage} and C{GET /api/codex/usage} (Codex
    0.154+, by how its ChatGPT base URL is configured): the key's
    C{wham/usage} answer; a key is needed like on every route (R103);
  - C{GET /v1/user-auth-credential/whoami} and C{GET
    /backend-api/wham/accounts/check} (L{KeyIdentityResource}): who the key
    is, for Codex signed in with a personal access token (a relay key
    starting C{at-} as its C{CODEX_ACCESS_TOKEN}), the sign-in under which
    Codex reads the usage route for C{/status};
  - the WebSocket handshake's C{x-codex-*} rate-limit headers
    (L{handshakeHeaders}).
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.base.records import ClientError
from relay.entry.http import UNAUTHORIZED
from relay.entry.sinks import writeError
from relay.tenants.keyusage import limitHeaders, usageBody

__all__ = ["KeyUsageResource", "KeyIdentityResource", "handshakeHeaders"]


class KeyUsageResource(Resource):
    """
    C{GET} the key's usage windows in the shape of C{wham/usage} (R114).
    """

    isLeaf = True
    _log = Logger()

    def __init__(self, keys, usage):
        """
        @param keys: the L{relay.entry.http.KeyRing}.
        @param usage: the L{relay.interfaces.IKeyUsage}.
        """
        super().__init__()
        self._keys = keys
        self._usage = usage

    def render_GET(self, request):
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        d = Deferred.fromCoroutine(self._usage.limits(key))
        d.addCallback(self._answer, request)
        d.addErrback(self._failed, request)
        return NOT_DONE_YET

    def _answer(self, limits, request) -> None:
        if request.finished or getattr(request, "_disconnected", False):
            return
        data = json.dumps(usageBody(limits)).encode("utf-8")
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(data))
        request.write(data)
        request.finish()

    def _failed(self, failure, request) -> None:
        self._log.failure("answering a key's usage failed", failure)
        if not request.finished and not getattr(request, "_disconnected", False):
            writeError(request, ClientError(503, "server_error", "Usage is unavailable"))


class KeyIdentityResource(Resource):
    """
    C{GET} who the key is, for Codex signed in with it as a personal access
    token (R114): C{whoami} (L{relay.tenants.keyusage.whoamiBody}) or
    C{accounts/check} (L{relay.tenants.keyusage.accountsCheckBody}).
    """

    isLeaf = True

    def __init__(self, keys, body):
        """
        @param keys: the L{relay.entry.http.KeyRing}.
        @param body: a callable from the key to the JSON-ready answer.
        """
        super().__init__()
        self._keys = keys
        self._body = body

    def render_GET(self, request):
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(self._body(key)).encode("utf-8")


def handshakeHeaders(runner, key, answer):
    """
    R114: add the key's C{x-codex-*} rate-limit headers to a WebSocket
    handshake's answer.

    @param answer: autobahn's C{(protocol, headers)}, or a Deferred firing
        with it.
    @return: a Deferred firing with the answer, the headers added (as it
        was when the windows cannot be read).
    """
    usage = getattr(runner, "keyUsage", None)
    answered = answer if isinstance(answer, Deferred) else succeed(answer)
    if usage is None or key is None:
        return answered
    limits = Deferred.fromCoroutine(usage.limits(key))

    def add(found, value):
        protocol, headers = value
        return (protocol, {**headers, **limitHeaders(found)})

    def unread(failure, value):
        Logger().failure("reading key {key_name}'s windows failed", failure, key_name=key.name)
        return value

    return answered.addCallback(lambda value: limits.addCallbacks(add, unread, (value,), None,
                                                                  (value,), None))
