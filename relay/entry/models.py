# -*- test-case-name: tests.test_responsesapi -*-
"""
C{GET /v1/models} in both shapes (behaviour.md R92; protocol.md 1):

  - with C{?client_version=...}: Codex's manifest C{{"models": [...]}}, an
    OAuth upstream's (cached, revalidated with its ETag), with relay's own
    C{ETag}; a matching C{If-None-Match} is answered 304;
  - without it: C{{"object": "list", "data": [...]}}, the accounts'
    declared models and mapping keys, or an account's upstream list where
    it declares none.

With an C{anthropic-version} header (the Messages surface, R115):
Anthropic's shape, C{{"data": [{"type": "model", "id", "display_name",
"created_at"}], "has_more", "first_id", "last_id"}}, one C{claude-<family>}
per family of C{anthropic_models}.

All need a client key. The lists come from L{relay.engine.catalog}; this is
the transport side only.
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.engine.catalog import etagOf
from relay.entry.http import UNAUTHORIZED
from relay.entry.sinks import writeError
from relay.base.records import ClientError
from relay.base.requestid import requestIdOf


class ModelsResource(Resource):
    """
    See the module docstring.
    """

    isLeaf = True
    _log = Logger()

    def __init__(self, keys, catalog, anthropic=None):
        """
        @param keys: the L{relay.entry.http.KeyRing}.
        @param catalog: the L{relay.engine.catalog.ModelCatalog}.
        @param anthropic: the live
            L{relay.translate.anthropic.models.AnthropicModels}, or L{None}.
        """
        super().__init__()
        self._keys = keys
        self._catalog = catalog
        self._anthropic = anthropic

    def render_GET(self, request):
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        if self._anthropic is not None and request.getHeader(b"anthropic-version"):
            self._answer(anthropicListing(self._anthropic.table), request)
            return NOT_DONE_YET
        requestId = requestIdOf(request)
        version = (request.args or {}).get(b"client_version")
        if version and version[0]:
            d = Deferred.fromCoroutine(
                self._catalog.manifest(key, version[0].decode("utf-8", "replace"), requestId))
        else:
            d = Deferred.fromCoroutine(self._catalog.listing(key, requestId))
        d.addCallback(self._answer, request)
        d.addErrback(self._failed, request)
        return NOT_DONE_YET

    def _answer(self, value, request) -> None:
        if request.finished or getattr(request, "_disconnected", False):
            return
        if isinstance(value, ClientError):
            writeError(request, value)
            return
        etag = etagOf(value)
        request.setHeader(b"etag", etag.encode("ascii"))
        if request.getHeader(b"if-none-match") == etag.encode("ascii"):
            request.setResponseCode(304)
            request.finish()
            return
        data = json.dumps(value).encode("utf-8")
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(data))
        request.write(data)
        request.finish()

    def _failed(self, failure, request) -> None:
        self._log.failure("answering /v1/models failed", failure)
        if not request.finished:
            writeError(request, ClientError(502, "upstream_error", "Upstream request failed"))


ANTHROPIC_CREATED_AT = "2025-01-01T00:00:00Z"
"""The C{created_at} of every listed family (relay has no date for them)."""


def anthropicListing(table: dict) -> dict:
    """
    The Messages surface's model list (R115).

    @param table: family -> OpenAI model (C{anthropic_models}).
    @return: Anthropic's list shape, one C{claude-<family>} per family.
    """
    data = [{"type": "model", "id": f"claude-{family}",
             "display_name": f"Claude {family.capitalize()} (relay: {model})",
             "created_at": ANTHROPIC_CREATED_AT} for family, model in sorted(table.items())]
    return {"data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


__all__ = ["ModelsResource", "anthropicListing"]
