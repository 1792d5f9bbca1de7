# -*- test-case-name: tests.test_requests, tests.test_intake -*-
"""
The HTTP entrypoint: C{POST /v1/responses}, C{POST /v1/chat/completions},
C{GET /healthz}, and the dispatch of C{GET /v1/responses} upgrades to the
WebSocket resource (style.md 9(a), protocol.md 1). The routes under
C{/v1/responses/} are L{relay.entry.responsesapi}; C{GET /v1/models} is
L{relay.entry.models}.

It authenticates, parses, builds a L{Turn} and a sink, and hands both to the
front door (L{relay.frontdoor.door.FrontDoor}), which checks the key and
runs the turn. It holds no failover, cooldown or admission policy
(architecture.md invariant 1).
"""

from __future__ import annotations


from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.entry.annotate import annotateTurn
from relay.entry.body import DEFAULT_MAX_BODY_BYTES, tooLarge
from relay.entry.intake import UNAUTHORIZED, RequestRefused  # noqa: F401 - UNAUTHORIZED re-exported
from relay.frontdoor.keyring import KeyRing  # noqa: F401 - re-exported
from relay.frontdoor.jsonbody import NESTING_MESSAGE, loadJSON  # noqa: F401 - re-exported
from relay.frontdoor.parse import (  # noqa: F401 - badRequest, invalidType re-exported
    FieldRefused,
    badRequest,
    invalidType,
    readJSON,
    turnFields,
)
from relay.entry.sinks import JSONSink, SSESink, writeError
from relay.base.records import ClientError, Turn
from relay.base.logs import cutRedacted
from relay.base.requestid import (  # noqa: F401 - newRequestId re-exported
    clientRequestIdOf,
    newRequestId,
    requestIdOf,
)
from relay.scheduling.session import sessionHash, sessionSeed
from relay.translate.chatrequest import ChatRequestError, checkChatRequest
from relay.base.requestnotes import notesOf

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
    # One pass, each raw name's lower-cased text (or L{None}: not
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
    R103: when the intake admitted the key's slot before the
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
        parse = getattr(request, "relayJSON", None)  # requestJSON's, without its call
        try:
            body = parse() if parse is not None else requestJSON(request)
        except RequestRefused as e:
            writeError(request, e.error)
            return NOT_DONE_YET
        try:
            fields = turnFields(body, self._endpoint)  # the one check (relay.frontdoor.parse)
        except FieldRefused as e:
            writeError(request, e.error)
            return NOT_DONE_YET
        model, stream, previous = fields.model, fields.stream, fields.previous
        if not stream and (getattr(request, "notes", None) or notesOf(request)).sseStarted:
            # Keepalives already went out (the raw body read as
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
            bodySize=getattr(request, "relayBodySize", 0),
            rawBody=getattr(request, "relayRawBody", None),
        )
        _noteClient(turn, request)
        admission = getattr(request, "admission", None)  # handOverKeyLease's
        if admission is not None:
            admission.handOver(turn)
        sinkType = SSESink if stream else JSONSink
        sink = sinkType(request, self._endpoint, model)
        if self._endpoint == "responses":
            annotateTurn(turn)  # R88-R90 (relay.entry.annotate)
        gone = getattr(request, "relayOnGone", None) or (
            lambda f: request.notifyFinish().addErrback(f))  # no Deferred
        gone(lambda f: turn.cancel.cancel("client_gone"))
        self._door.enter(turn, sink)  # the key's checks, then the engine
        return NOT_DONE_YET


def _noteClient(turn: Turn, request) -> None:
    """
    The client's address and C{User-Agent} on the turn, for its
    request-log record.
    """
    address = request.getClientAddress()
    turn.clientAddress = getattr(address, "host", None)
    raw = getattr(request.requestHeaders, "_rawHeaders", None)  # twisted.web's Headers
    if raw is None:
        agent = request.getHeader(b"user-agent")
    else:
        values = raw.get(b"User-Agent")  # getHeader's: the last value
        agent = values[-1] if values else None
    if agent:
        # for the request log, which no log observer redacts
        turn.userAgent = cutRedacted(agent.decode("latin-1"), 200, always=True)


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
