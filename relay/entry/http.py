# -*- test-case-name: tests.test_requests, tests.test_intake -*-
"""
The HTTP entrypoint: C{POST /v1/responses}, C{POST /v1/chat/completions},
C{GET /healthz}, and the dispatch of C{GET /v1/responses} upgrades to the
WebSocket resource (style.md 9(a), protocol.md 1). The routes under
C{/v1/responses/} are L{relay.entry.responsesapi}; C{GET /v1/models} is
L{relay.entry.models} (issue 20).

It authenticates, parses, builds a L{Turn} and a sink, and hands both to the
front door (L{relay.frontdoor.door.FrontDoor}), which checks the key and
runs the turn. It holds no failover, cooldown or admission policy
(architecture.md invariant 1).
"""

from __future__ import annotations

import hmac
from typing import Optional

from attrs import evolve
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.entry.annotate import annotateTurn
from relay.entry.body import DEFAULT_MAX_BODY_BYTES, tooLarge
from relay.entry.intake import UNAUTHORIZED, RequestRefused  # noqa: F401 - UNAUTHORIZED re-exported
from relay.frontdoor.jsonbody import NESTING_MESSAGE, loadJSON  # noqa: F401 - re-exported
from relay.frontdoor.parse import (  # noqa: F401 - badRequest, invalidType re-exported
    FieldRefused,
    badRequest,
    invalidType,
    readJSON,
    turnFields,
)
from relay.entry.sinks import JSONSink, SSESink, writeError
from relay.model import ClientError, ClientKey, Turn
from relay.requestid import (  # noqa: F401 - newRequestId re-exported
    clientRequestIdOf,
    newRequestId,
    requestIdOf,
)
from relay.scheduling.session import sessionHash, sessionSeed
from relay.tenants.keydigest import keyDigest
from relay.translate.chatrequest import ChatRequestError, checkChatRequest

MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES
"""The largest request body accepted when the request does not say
(C{gateway.max_request_body_bytes}, enforced while the body arrives by
L{relay.entry.body.LimitedBodyRequest})."""

NOT_FORWARDED = frozenset(
    {
        "authorization",
        "x-api-key",
        "cookie",
        "proxy-authorization",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "host",
        "content-length",
        "content-type",
        "accept",
        "accept-encoding",
        "content-encoding",
        "origin",
    }
)
"""Client headers that never go upstream: credentials, cookies, hop-by-hop
and framing headers (architecture.md invariant 7)."""


def filterClientHeaders(headers: dict) -> dict:
    """
    Drop L{NOT_FORWARDED} and WebSocket handshake headers from lower-cased
    client headers. The upstream dialers apply their own allow-list on top.

    @param headers: lower-cased name -> value.
    @return: a new dict.
    """
    return {
        k: v for k, v in headers.items() if k not in NOT_FORWARDED and not k.startswith("sec-websocket")
    }


def clientHeaders(request) -> dict:
    """
    The client's headers of a twisted.web request, lower-cased (first
    value), through L{filterClientHeaders}.

    @return: str -> str.
    """
    # Issue 24: one pass, each raw name's lower-cased text (or L{None}: not
    # forwarded) looked up once per process rather than decoded, lowered
    # and filtered on every turn; tests.test_requests compares it with
    # filterClientHeaders of the plain reading.
    headers = {}
    names = _CLIENT_NAMES
    for name, values in request.requestHeaders.getAllRawHeaders():
        value = values[0]
        key = names.get(name, _UNKNOWN)
        if key is _UNKNOWN:
            key = name.decode("latin-1").lower()
            if key in NOT_FORWARDED or key.startswith("sec-websocket"):
                key = None
            if len(names) >= _CLIENT_NAMES_MAX:
                names.clear()  # a client sending ever new names: start over
            names[name] = key
        if key is not None:
            headers[key] = value.decode("latin-1")
    return headers


_CLIENT_NAMES: dict = {}
"""Raw header name -> its lower-cased text, or L{None} when it is not
forwarded (L{clientHeaders})."""

_CLIENT_NAMES_MAX = 1024
"""The most names L{_CLIENT_NAMES} keeps (a client may send any names; it
is emptied when full)."""

_UNKNOWN = object()


class KeyRing:
    """
    Client API keys (config.md C{keys:}, and issue 22's keys issued through
    the admin API). One ring serves every entrypoint; a live reload swaps
    the file's keys (L{replace}, issue 14), the control plane the admin
    keys and the disables (L{replaceAdmin}).

    Keys are indexed by the SHA-256 digest of their secret
    (L{relay.tenants.keydigest}): authenticating hashes the presented
    secret once and looks it up (one lookup per request, whatever the
    number of keys), then confirms the match with
    L{hmac.compare_digest}. An admin key is known only by its digest.

    @ivar pending: L{True} while the control plane has not read its store
        yet (a Redis store at start): the admin keys and disables are not
        known, so the key policy refuses turns for that moment
        (L{relay.tenants.policy.KeyPolicy.keyRefusal}).
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
        Put the control plane's keys and disables in force at once (issue
        22): a deleted key's next request is a 401 and an open socket's
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
        WebSocket opened with it takes no new turn, issue 14 and 22).

        @param key: a L{ClientKey} authenticated earlier.
        """
        return self._index.get(key.digest if key.digest else keyDigest(key.key))

    def authenticate(self, request) -> Optional[ClientKey]:
        """
        Find the key in C{Authorization: Bearer} or C{x-api-key}
        (protocol.md 1; L{relay.entry.intake.bearerOrKey}): one digest, one
        lookup. A request the site's intake already authenticated
        (C{request.admission}) is answered from that, so a request is
        authenticated once, by one parser (issue 19).

        @return: the L{ClientKey}, or L{None}.
        """
        admission = getattr(request, "admission", None)
        if admission is not None:
            return self.current(admission.key)
        from relay.entry.intake import bearerOrKey

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



def requestJSON(request):
    """
    The request's JSON body: through the intake's
    C{request.relayJSON()} (parsed once, after the key's slot was
    admitted, R103), else read and parsed here (requests built without
    the intake, e.g. unit tests).

    @raise RequestRefused: 413 over the limit, 400 for a body that is not
        JSON or nests too deep.
    """
    parse = getattr(request, "relayJSON", None)
    if parse is not None:
        return parse()
    limit = getattr(request, "bodyLimit", MAX_BODY_BYTES)
    raw = request.content.read(limit + 1)
    if len(raw) > limit:
        raise RequestRefused(tooLarge(limit))
    return readJSON(raw)


def handOverKeyLease(request, turn: Turn) -> None:
    """
    Issue 19 (R103): when the intake admitted the key's slot before the
    body was decoded, the turn takes that lease (the engine does not admit
    the key again, and releases it when the turn ends). Every resource
    that starts a turn from a request with a body calls this.
    """
    admission = getattr(request, "admission", None)
    if admission is not None:
        admission.handOver(turn)


class TurnResource(Resource):
    """
    C{POST} a turn: C{/v1/responses} (C{endpoint="responses"}) or
    C{/v1/chat/completions} (C{endpoint="chat"}).

    For C{responses}, a C{GET} with C{Upgrade: websocket} goes to the
    WebSocket resource; a plain C{GET} gets 426 (protocol.md 1).
    """

    isLeaf = True
    _log = Logger()

    def __init__(self, door, keys: KeyRing, endpoint: str, websocket=None):
        """
        @param door: the L{relay.frontdoor.door.FrontDoor} a turn is
            handed to.
        @param keys: the L{KeyRing}.
        @param endpoint: C{responses} or C{chat}.
        @param websocket: the WebSocket resource for upgrades, or L{None}.
        """
        super().__init__()
        self._door = door
        self._keys = keys
        self._endpoint = endpoint
        self._ws = websocket

    def render(self, request):
        """
        Dispatch C{GET} (WebSocket upgrade) and C{POST}; any other method
        gets a JSON 405.
        """
        if request.method == b"POST":
            return self.render_POST(request)
        if request.method == b"GET" and self._endpoint == "responses":
            return self.render_GET(request)
        request.setHeader(b"allow", b"GET, POST" if self._endpoint == "responses" else b"POST")
        writeError(
            request,
            ClientError(
                405, "invalid_request_error",
                f"Method {request.method.decode('latin-1')} is not allowed on {request.path.decode('latin-1')}",
                code="method_not_allowed",
            ),
        )
        return NOT_DONE_YET

    def render_GET(self, request):
        upgrade = (request.getHeader(b"upgrade") or b"").lower()
        connection = (request.getHeader(b"connection") or b"").lower()
        if upgrade == b"websocket" and b"upgrade" in connection and self._ws is not None:
            return self._ws.render(request)
        writeError(
            request,
            ClientError(
                426, "invalid_request_error", "WebSocket upgrade required (Upgrade: websocket)"
            ),
        )
        return NOT_DONE_YET

    def render_POST(self, request):
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        try:
            body = requestJSON(request)
        except RequestRefused as e:
            writeError(request, e.error)
            return NOT_DONE_YET
        try:
            fields = turnFields(body, self._endpoint)  # the one check (relay.frontdoor.parse)
        except FieldRefused as e:
            writeError(request, e.error)
            return NOT_DONE_YET
        model, stream, previous = fields.model, fields.stream, fields.previous
        if not stream and getattr(request, "relaySSEStarted", False):
            # Issue 19: keepalives already went out (the raw body read as
            # streaming while the key's slot was awaited, R85) and committed
            # the SSE head; a body whose parse disagrees (a nested
            # "stream": true, L{relay.entry.intake.bodyStreams}) is streamed.
            body, stream = dict(body, stream=True), True
        if self._endpoint == "chat":
            try:
                checkChatRequest(body)
            except ChatRequestError as e:
                writeError(request, badRequest(str(e), param=e.param))
                return NOT_DONE_YET
        headers = clientHeaders(request)
        turn = Turn(
            entrypoint="http",
            endpoint=self._endpoint,
            client=key,
            model=model,
            body=body,
            stream=stream,
            headers=headers,
            sessionHash=sessionHash(sessionSeed(headers, body, model), key.ownerId),
            previousResponseId=previous,
            requestId=requestIdOf(request),
            clientRequestId=clientRequestIdOf(request),
        )
        _noteClient(turn, request)
        handOverKeyLease(request, turn)
        sinkType = SSESink if stream else JSONSink
        sink = sinkType(request, self._endpoint, model)
        if self._endpoint == "responses":
            annotateTurn(turn)  # R88-R90 (relay.entry.annotate)
        gone = getattr(request, "relayOnGone", None) or (
            lambda f: request.notifyFinish().addErrback(f))  # issue 24: no Deferred
        gone(lambda f: turn.cancel.cancel("client_gone"))
        self._door.enter(turn, sink)  # the key's checks, then the engine
        return NOT_DONE_YET


def _noteClient(turn: Turn, request) -> None:
    """
    Issue 22: the client's address and C{User-Agent} on the turn, for its
    request-log record.
    """
    address = request.getClientAddress()
    turn.clientAddress = getattr(address, "host", None)
    agent = request.getHeader(b"user-agent")
    if agent:
        turn.userAgent = agent.decode("latin-1")[:200]


class HealthResource(Resource):
    """
    C{GET /healthz}: 200 once the site is listening.
    """

    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'


class NotFoundResource(Resource):
    """
    A JSON 404 in OpenAI's format for any unknown path.
    """

    isLeaf = True

    def render(self, request):
        writeError(
            request,
            ClientError(
                404, "invalid_request_error",
                f"Invalid URL ({request.method.decode('latin-1')} {request.path.decode('latin-1')})",
                code="unknown_url",
            ),
        )
        return NOT_DONE_YET


class JSONRoot(Resource):
    """
    A resource tree node whose unknown children answer a JSON 404 instead of
    twisted.web's HTML page.
    """

    def getChild(self, path, request):
        return NotFoundResource()

    def render(self, request):
        return NotFoundResource().render(request)
