# -*- test-case-name: tests.test_intake, tests.test_control_keys, tests.test_frontdoor -*-
"""
Authenticate: the client keys in force (L{KeyRing}) and the one check of
a presented key (L{authenticateClient}) for every entrypoint (protocol.md
1; behaviour.md R102, R103: a request is authenticated from its headers,
before any of its body is read).
"""

from __future__ import annotations

import hmac
from typing import Callable, Optional

from attrs import evolve

from relay.base.records import ClientError, ClientKey
from relay.tenants.keydigest import keyDigest

UNAUTHORIZED = ClientError(
    401,
    "invalid_request_error",
    "Incorrect API key provided. Use Authorization: Bearer <relay key> or x-api-key.",
    code="invalid_api_key",
)
"""A client route without a valid key (protocol.md 1); re-exported by
L{relay.entry.intake} and L{relay.entry.http}."""


def authenticateClient(keys, secret: Optional[bytes],
                       refusal: Optional[Callable] = None) -> tuple:
    """
    The client key C{secret} presents, unless refused: an unknown key is
    L{UNAUTHORIZED}; a known one may be refused by C{refusal} (the key
    policy's key-only refusals, R102: disabled, expired).

    @param keys: the L{KeyRing}.
    @param secret: the presented secret (L{bearerOrKey}), or L{None}.
    @param refusal: C{(key) -> ClientError or None}, or L{None}.
    @return: C{(key, None)} or C{(None, ClientError)}.
    """
    key = keys.authenticateSecret(secret) if secret else None
    if key is None:
        return None, UNAUTHORIZED
    error = refusal(key) if refusal is not None else None
    if error is not None:
        return None, error
    return key, None


def bearerOrKey(request) -> Optional[bytes]:
    """
    The secret a request presents: C{Authorization: Bearer <secret>}, else
    C{x-api-key} (protocol.md 1). Another scheme (C{Basic ...}) is not a
    secret, and does not hide an C{x-api-key}.

    @return: the secret bytes, or L{None}.
    """
    headers = request.requestHeaders
    raw = getattr(headers, "_rawHeaders", None)  # twisted.web's Headers: canonical names
    if raw is None:
        auth = headers.getRawHeaders(b"authorization", [None])[0]
    else:
        values = raw.get(b"Authorization")
        auth = values[0] if values else None
    if auth and auth[:7].lower() == b"bearer ":
        secret = auth[7:].strip()
        if secret:
            return secret
    if raw is None:
        key = headers.getRawHeaders(b"x-api-key", [None])[0]
    else:
        values = raw.get(b"X-Api-Key")
        key = values[0] if values else None
    return key.strip() if key and key.strip() else None


class KeyRing:
    """
    Client API keys (config.md C{keys:}, and the keys issued through
    the admin API). One ring serves every entrypoint; a live reload swaps
    the file's keys (L{replace}), the control plane the admin
    keys and the disables (L{replaceAdmin}).

    Keys are indexed by the SHA-256 digest of their secret
    (L{relay.tenants.keydigest}): authenticating hashes the presented
    secret once and looks it up (one lookup per request, whatever the
    number of keys), then confirms the match with
    L{hmac.compare_digest}. An admin key is known only by its digest.

    @ivar pending: L{True} while the control plane has not read its store
        yet (a Redis store at start): the admin keys and disables are not
        known, so the key policy refuses turns for that moment
        (L{relay.tenants.keypolicy.KeyPolicy.keyRefusal}).
    """

    def __init__(self, keys):
        """
        @param keys: an iterable of L{ClientKey} (the file's).
        """
        self._file = _digested(keys)
        self._admin = ()
        self._disabled = frozenset()
        self._listeners = []
        self.pending = False
        self._rebuild()

    @property
    def keys(self) -> tuple:
        """
        @return: the keys in force: the file's in configuration order, then
            the admin keys; a key disabled through the admin API has
            C{disabled} set.
        @rtype: L{tuple} of L{ClientKey}
        """
        return self._keys

    @property
    def fileKeys(self) -> tuple:
        """
        @return: the file's keys as the file has them.
        """
        return self._file

    @property
    def adminNames(self) -> frozenset:
        """
        @return: the names of the keys issued through the admin API.
        """
        return frozenset(k.name for k in self._admin)

    def byName(self, name: str) -> Optional[ClientKey]:
        """
        @return: the key in force named C{name}, or L{None}.
        """
        return self._names.get(name)

    def replace(self, keys) -> None:
        """
        Put the file's C{keys} in force at once (a live reload): the next
        request or WebSocket turn authenticates against them; turns already
        running keep the key they started with.

        @param keys: an iterable of L{ClientKey}.
        """
        self._file = _digested(keys)
        self._rebuild()

    def replaceAdmin(self, keys, disabled) -> None:
        """
        Put the control plane's keys and disables in force at once:
        a deleted key's next request is a 401 and an open socket's
        next turn a close 1008 (L{current} no longer finds it).

        @param keys: the admin keys, L{ClientKey}s with a C{digest}.
        @param disabled: the names of the keys (file or admin) disabled
            through the admin API.
        """
        admin, disabled = tuple(k for k in keys if k.digest), frozenset(disabled)
        if admin == self._admin and disabled == self._disabled:
            return
        self._admin, self._disabled = admin, disabled
        self._rebuild()

    def subscribe(self, listener) -> None:
        """
        Be called (no arguments) after every change of the keys in force.
        """
        self._listeners.append(listener)

    def _rebuild(self) -> None:
        admin = {k.name for k in self._admin}
        keys = [k for k in self._file if k.name not in admin] + list(self._admin)
        keys = [evolve(k, disabled=True) if k.name in self._disabled and not k.disabled else k
                for k in keys]
        self._keys = tuple(keys)
        self._index = {k.digest: k for k in keys}
        self._names = {k.name: k for k in keys}
        for listener in list(self._listeners):
            listener()

    def _lookup(self, secret) -> Optional[ClientKey]:
        digest = keyDigest(secret)
        found = self._index.get(digest)
        if found is not None and hmac.compare_digest(found.digest, digest):
            return found
        return None

    def current(self, key: ClientKey) -> Optional[ClientKey]:
        """
        The key in force with C{key}'s secret: C{key} itself, its
        reloaded or edited version (e.g. a new C{concurrency}, disabled),
        or L{None} when the key was deleted, removed or rotated (a
        WebSocket opened with it takes no new turn).

        @param key: a L{ClientKey} authenticated earlier.
        """
        return self._index.get(key.digest if key.digest else keyDigest(key.key))

    def authenticate(self, request) -> Optional[ClientKey]:
        """
        Find the key in C{Authorization: Bearer} or C{x-api-key}
        (protocol.md 1; L{bearerOrKey}): one digest, one
        lookup. A request the site's intake already authenticated
        (C{request.admission}) is answered from that, so a request is
        authenticated once, by one parser.

        @return: the L{ClientKey}, or L{None}.
        """
        admission = getattr(request, "admission", None)
        if admission is not None:
            return self.current(admission.key)
        return self.authenticateSecret(bearerOrKey(request))

    def authenticateSecret(self, secret: Optional[bytes]) -> Optional[ClientKey]:
        """
        The key whose value is C{secret}, compared in constant time.

        @param secret: the presented secret, or L{None}.
        @return: the L{ClientKey}, or L{None}.
        """
        if not secret:
            return None
        return self._lookup(secret)

    def authenticateHeader(self, value: Optional[str]) -> Optional[ClientKey]:
        """
        Authenticate a raw bearer secret (WebSocket handshake headers).
        """
        if not value:
            return None
        secret = value[7:].strip() if value[:7].lower() == "bearer " else value.strip()
        if not secret:
            return None
        return self._lookup(secret)


def _digested(keys) -> tuple:
    """
    @return: C{keys} each with its C{digest} (a file key's is computed
        from its secret once, here).
    """
    return tuple(k if k.digest else evolve(k, digest=keyDigest(k.key)) for k in keys)
