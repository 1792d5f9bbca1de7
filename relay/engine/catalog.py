# -*- test-case-name: tests.test_requests -*-
"""
The model catalog behind C{GET /v1/models} (behaviour.md R92): the Codex
models manifest of an OAuth upstream, cached with its ETag and
revalidated, and the plain model list, built from the accounts' declared
models and mapping keys or, for an account that declares none, from its
upstream model list (cached).

Upstream lists are fetched through the one engine as requests of their own
kind (L{relay.engine.requests.manifestRequest},
L{relay.engine.requests.modelsRequest}): the same selection, classification,
logs and metrics as everything else, never a generation.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

from attrs import define, field
from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import Logger
from zope.interface import implementer

from relay.engine import requests as R
from relay.interfaces import ITurnSink
from relay.base.records import ClientError, ClientKey, Turn
from relay.upstream.headers import CODEX_VERSION

DEFAULT_TTL = 300.0
"""Seconds a fetched manifest or list is served before it is revalidated."""

CLIENT_VERSION = CODEX_VERSION
"""The C{client_version} relay asks an OAuth account's manifest with when it
needs only the names (the plain list, R92)."""


@implementer(ITurnSink)
class CaptureSink:
    """
    The sink of a request relay makes for itself: it keeps the answer (or
    the error) instead of writing to a client.

    @ivar status: the answer's status, once written.
    @ivar headers: the answer's headers (lower-case names).
    @ivar body: the answer's bytes.
    @ivar error: the L{ClientError}, when the request failed.
    """

    holdsOutput = True

    def __init__(self):
        self.committed = False
        self.status: Optional[int] = None
        self.headers: dict = {}
        self.body: bytes = b""
        self.error: Optional[ClientError] = None

    def keepalive(self) -> None:
        """
        Nobody to keep alive.
        """

    def commit(self, headers) -> None:
        self.committed = True

    def writeEvent(self, event) -> None:
        """
        Unary requests write no events.
        """

    def writeBody(self, status, headers, body) -> None:
        self.committed = True
        self.status, self.headers, self.body = status, dict(headers or {}), body

    def fail(self, error: ClientError) -> None:
        self.error = error

    def finish(self) -> None:
        """
        Nothing to close.
        """


@define(eq=False)
class _Cached:
    value: object
    etag: Optional[str]
    fetchedAt: float


def etagOf(value) -> str:
    """
    relay's own strong ETag of what it answers (a digest of its JSON), so a
    client's C{If-None-Match} is checked against exactly what it would get.
    """
    raw = json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return '"' + hashlib.sha256(raw).hexdigest()[:32] + '"'


@define(eq=False)
class ModelCatalog:
    """
    See the module docstring.

    @ivar runner: the L{relay.engine.runner.TurnRunner}.
    @ivar accounts: the live accounts registry (read on every call).
    @ivar ttl: seconds a fetched answer is fresh.
    """

    runner: object
    accounts: object
    ttl: float = DEFAULT_TTL
    _manifests: dict = field(factory=dict)
    _lists: dict = field(factory=dict)
    _pending: dict = field(factory=dict)
    _log = Logger()

    # -- fetching through the engine ---------------------------------------------

    async def _fetch(self, key: ClientKey, kind, requestId: str) -> CaptureSink:
        turn = Turn(entrypoint="http", endpoint="responses", client=key, model=None, body={},
                    stream=False, requestId=requestId, request=kind)
        sink = CaptureSink()
        await self.runner.run(turn, sink)
        return sink

    def _once(self, cacheKey, make) -> Deferred:
        """
        One fetch per cache key at a time; callers arriving meanwhile share it.
        """
        pending = self._pending.get(cacheKey)
        if pending is None:
            pending = Deferred.fromCoroutine(make())
            self._pending[cacheKey] = pending
            pending.addBoth(self._done, cacheKey)
        out = Deferred()
        pending.addBoth(lambda r: (out.callback(r), r)[1])
        return out

    def _done(self, result, cacheKey):
        self._pending.pop(cacheKey, None)
        return result

    def _now(self) -> float:
        return self.runner.clock.seconds()

    # -- the manifest -------------------------------------------------------------

    async def manifest(self, key: ClientKey, clientVersion: str, requestId: str):
        """
        The Codex models manifest (R92): an OAuth account's (cached; a stale
        copy is revalidated with its ETag, and served as it is when the
        revalidation fails), filtered to the models the accounts serve; with
        no OAuth account, one built from the plain list.

        @return: the manifest dict, or a L{ClientError}.
        """
        cached = self._manifests.get(clientVersion)
        if cached is not None and self._now() - cached.fetchedAt < self.ttl:
            return self._servable(cached.value, key)
        fetched = await self._once(("manifest", clientVersion),
                                   lambda: self._fetchManifest(key, clientVersion, requestId))
        if isinstance(fetched, ClientError):
            cached = self._manifests.get(clientVersion)
            if cached is not None:
                return self._servable(cached.value, key)
            if not any(a.type == "oauth" for a in self.accounts):
                listing = await self.listing(key, requestId)
                return {"models": [{"slug": m["id"], "display_name": m["id"]}
                                   for m in listing["data"]]}
            return fetched
        return self._servable(fetched, key)

    async def _fetchManifest(self, key, clientVersion, requestId):
        cached = self._manifests.get(clientVersion)
        kind = R.manifestRequest(clientVersion, cached.etag if cached is not None else None)
        sink = await self._fetch(key, kind, requestId)
        if sink.error is not None:
            self._log.warn(
                "fetching the models manifest failed: {message}",
                event="relay.models_manifest_failed", message=sink.error.message,
                request_id=requestId,
            )
            return sink.error
        if sink.status == 304 and cached is not None:
            cached.fetchedAt = self._now()
            return cached.value
        try:
            value = json.loads(sink.body)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("models"), list):
            return ClientError(502, "upstream_error", "The upstream models manifest is malformed")
        self._manifests[clientVersion] = _Cached(value, sink.headers.get("etag"), self._now())
        return value

    def _reachable(self, key: ClientKey) -> list:
        """
        The accounts C{key} may reach: all of them, or with a key policy
        (behaviour.md R102) only its group's.
        """
        policy = getattr(self.runner, "keyPolicy", None)
        if policy is None:
            return list(self.accounts)
        return policy.reachable(key, self.accounts)

    def _allowed(self, key: ClientKey, model) -> bool:
        """
        Whether C{key}'s model allow/deny lists let it use C{model} (R92:
        filtered to what the key may use; R110: as the turn would be,
        mapped names included).
        """
        policy = getattr(self.runner, "keyPolicy", None)
        return policy is None or policy.modelAllowed(key, model, self._reachable(key))

    def _servable(self, manifest: dict, key: ClientKey) -> dict:
        """
        The manifest's models that some account C{key} may reach serves
        (after mapping) and that C{key} may use.
        """
        accounts = self._reachable(key)
        models = [m for m in manifest.get("models") or []
                  if isinstance(m, dict) and self._allowed(key, m.get("slug"))
                  and any(a.servesModel(m.get("slug")) for a in accounts)]
        return {**manifest, "models": models}

    # -- the plain list -----------------------------------------------------------

    async def listing(self, key: ClientKey, requestId: str) -> dict:
        """
        C{{"object": "list", "data": [...]}} (R92): every account's declared
        models and mapping keys; an account that declares none adds what its
        upstream lists (cached; an upstream that cannot be asked adds
        nothing).
        """
        names = set()
        fetches = []
        accounts = self._reachable(key)
        for account in accounts:
            names.update(account.model_mapping)
            if account.models:
                names.update(account.models)
            else:
                fetches.append(self._accountModels(key, account, requestId))
        if fetches:
            for found in await gatherResults(fetches, consumeErrors=True):
                names.update(found)
        # A key's own allow-list names the models it uses even where the
        # accounts declare none (they then serve any model; R102).
        names.update(m for m in key.models or () if any(a.servesModel(m) for a in accounts))
        names = {name for name in names if self._allowed(key, name)}
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "relay"}
            for name in sorted(names)
        ]}

    def _accountModels(self, key, account, requestId) -> Deferred:
        cached = self._lists.get(account.id)
        if cached is not None and self._now() - cached.fetchedAt < self.ttl:
            d = Deferred()
            d.callback(cached.value)
            return d
        return self._once(("list", account.id),
                          lambda: self._fetchModels(key, account, requestId))

    async def _fetchModels(self, key, account, requestId) -> tuple:
        path = "/models" if account.type != "oauth" else f"/models?client_version={CLIENT_VERSION}"
        sink = await self._fetch(key, R.modelsRequest(account.id, path), requestId)
        value = None
        if sink.error is None:
            try:
                value = json.loads(sink.body)
            except ValueError:
                value = None
        if isinstance(value, dict) and isinstance(value.get("data"), list):
            found = tuple(m.get("id") for m in value["data"]
                          if isinstance(m, dict) and isinstance(m.get("id"), str))
        elif isinstance(value, dict) and isinstance(value.get("models"), list):
            found = tuple(m.get("slug") for m in value["models"]
                          if isinstance(m, dict) and isinstance(m.get("slug"), str))
        else:
            cached = self._lists.get(account.id)
            self._log.warn(
                "listing the models of {account_id} failed", event="relay.models_list_failed",
                account_id=account.id, request_id=requestId,
            )
            return cached.value if cached is not None else ()
        self._lists[account.id] = _Cached(found, None, self._now())
        return found


__all__ = ["CaptureSink", "ModelCatalog", "etagOf"]
