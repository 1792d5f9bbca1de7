# -*- test-case-name: tests.test_responsesapi -*-
"""
The Responses API routes under C{/v1/responses/} that are not turns
(behaviour.md R87, R88; protocol.md 1), on every alias of C{/v1/responses}:

  - C{POST …/compact}: remote compaction (API-key accounts: their
    C{/responses/compact}; OAuth accounts: the equivalent compaction turn);
  - C{POST …/input_tokens}: an input token count (API-key accounts);
  - C{GET …/{id}} (a poll; with C{?stream=true&starting_after=N} a
    background stream resume), C{DELETE …/{id}}, C{GET …/{id}/input_items},
    C{POST …/{id}/cancel}: to the account that owns the id, for the key that
    owns it (R39, R104); an id with no owner record, or another key's, is a
    404 (which of the two is not said);
  - anything else: a JSON 404 (405 for a known path with another method),
    never a generation.

A transport adapter like L{relay.entry.http.TurnResource}: it
authenticates, reads the body (L{readBody}, the one place that reads
one), builds a L{Turn} carrying a L{relay.engine.requests.RequestKind} and a
sink, and hands both to the front door (L{relay.frontdoor.door.FrontDoor}). C{POST}/C{GET} on C{…/responses}
itself go to the turn resource unchanged.
"""

from __future__ import annotations

from typing import Optional
from urllib.parse import quote

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.engine import requests as R
from relay.entry.annotate import annotateTurn
from relay.entry.body import DEFAULT_MAX_BODY_BYTES, tooLarge
from relay.entry.http import (
    UNAUTHORIZED,
    badRequest,
    clientHeaders,
    handOverKeyLease,
    invalidType,
)
from relay.entry.sinks import JSONSink, SSESink, writeError
from relay.frontdoor.door import FrontDoor
from relay.frontdoor.parse import RequestRefused, readJSON
from relay.base.records import ClientError, Turn
from relay.base.requestid import clientRequestIdOf, requestIdOf
from relay.scheduling.session import sessionHash, sessionSeed

COMPACT = b"compact"
INPUT_TOKENS = b"input_tokens"

def notFound(responseId: str) -> ClientError:
    """
    R87, R104: the 404 for a response id relay holds no owner record for,
    or that another key created (never said which), in OpenAI's words.
    """
    return ClientError(404, "invalid_request_error",
                       f"Response with id '{responseId}' not found.", param="response_id")


def unknownPath(request) -> ClientError:
    """
    The JSON 404 for an unknown sub-path (never a generation, R87).
    """
    return ClientError(
        404, "invalid_request_error",
        f"Invalid URL ({request.method.decode('latin-1')} {request.path.decode('latin-1')})",
        code="unknown_url",
    )


def methodNotAllowed(request, allowed: bytes) -> ClientError:
    request.setHeader(b"allow", allowed)
    return ClientError(
        405, "invalid_request_error",
        f"Method {request.method.decode('latin-1')} is not allowed on"
        f" {request.path.decode('latin-1')}",
        code="method_not_allowed",
    )


def readBody(request) -> tuple:
    """
    The one place this module reads a request body: through the intake's
    C{request.relayJSON()} (R103: the key was checked at the headers, the
    body bounded by C{gateway.max_request_body_bytes} and the bytes in
    flight, decoded after the key's slot; deep nesting a 400), a JSON
    object; an empty body is C{{}}. A request built without the intake
    (unit tests) is read and parsed here with the same rules.

    @return: C{(body dict, None, None)} or C{(None, None, ClientError)}
        (the middle element is kept for callers of the former shape).
    """
    parse = getattr(request, "relayJSON", None)
    if parse is not None:
        try:
            body = parse(allowEmpty=True)
        except RequestRefused as e:
            return None, None, e.error
    else:
        limit = getattr(request, "bodyLimit", DEFAULT_MAX_BODY_BYTES)
        raw = request.content.read(limit + 1) if request.content is not None else b""
        if len(raw) > limit:
            return None, None, tooLarge(limit)
        if not raw.strip():
            return {}, None, None
        try:
            body = readJSON(raw)
        except RequestRefused as e:
            return None, None, e.error
    if not isinstance(body, dict):
        return None, None, badRequest("The request body must be a JSON object.")
    return body, None, None


class ResponsesResource(Resource):
    """
    C{/v1/responses} and everything under it (protocol.md 1). The path
    itself goes to the turn resource; sub-paths are the requests of
    L{relay.engine.requests}.
    """

    isLeaf = True
    _log = Logger()

    def __init__(self, turns, runner, keys, door=None):
        """
        @param turns: the L{relay.entry.http.TurnResource} of C{responses}.
        @param runner: the L{relay.engine.runner.TurnRunner} (its scheduler).
        @param keys: the L{relay.entry.http.KeyRing}.
        @param door: the L{relay.frontdoor.door.FrontDoor} a request's turn
            is handed to (one around C{runner} when not given).
        """
        super().__init__()
        self._turns = turns
        self._runner = runner
        self._keys = keys
        self._door = door if door is not None else FrontDoor(runner)

    def render(self, request):
        rest = list(request.postpath or [])
        while rest and rest[-1] == b"":
            rest.pop()
        if not rest:
            return self._turns.render(request)
        try:
            return self._route(request, rest)
        except Exception:  # noqa: BLE001 - a bug answers 500 JSON, the process stays up
            self._log.failure("serving {path} failed", path=request.path)
            writeError(request, ClientError(500, "api_error", "Internal error"))
            return NOT_DONE_YET

    def _route(self, request, rest: list):
        method = request.method
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        if rest in ([COMPACT], [INPUT_TOKENS]):
            if method != b"POST":
                writeError(request, methodNotAllowed(request, b"POST"))
                return NOT_DONE_YET
            return self._modelRun(request, key, rest[0])
        if len(rest) == 1 and method != b"POST":
            # (A POST to one segment is no route at all: a 404 below.)
            if method not in (b"GET", b"DELETE"):
                writeError(request, methodNotAllowed(request, b"GET, DELETE"))
                return NOT_DONE_YET
            return self._owned(request, key, rest[0], b"" if method == b"GET" else b"DELETE")
        if len(rest) == 2 and rest[1] == b"input_items":
            if method != b"GET":
                writeError(request, methodNotAllowed(request, b"GET"))
                return NOT_DONE_YET
            return self._owned(request, key, rest[0], b"input_items")
        if len(rest) == 2 and rest[1] == b"cancel":
            if method != b"POST":
                writeError(request, methodNotAllowed(request, b"POST"))
                return NOT_DONE_YET
            return self._owned(request, key, rest[0], b"cancel")
        writeError(request, unknownPath(request))
        return NOT_DONE_YET

    # -- compact, input_tokens ------------------------------------------------------

    def _modelRun(self, request, key, which: bytes):
        """
        C{compact} or C{input_tokens}: selected like a turn (the model,
        the session, R89's compaction owner), admitted, classified.
        """
        body, _, error = readBody(request)
        if error is not None:
            writeError(request, error)
            return NOT_DONE_YET
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            writeError(request, invalidType("model", "a string", model))
            return NOT_DONE_YET
        if which == COMPACT and not model:
            writeError(request, badRequest("you must provide a model parameter", param="model"))
            return NOT_DONE_YET
        body.pop("stream", None)  # unary routes: a stream flag means nothing here
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            writeError(request, invalidType("previous_response_id", "a string", previous)
                       if not isinstance(previous, str) else badRequest(
                           "previous_response_id must not be empty",
                           param="previous_response_id", code="invalid_value"))
            return NOT_DONE_YET
        headers = clientHeaders(request)
        kind = R.compactRequest() if which == COMPACT else R.inputTokensRequest()
        turn = Turn(
            entrypoint="http", endpoint="responses", client=key, model=model or None,
            body=body, stream=False, headers=headers,
            sessionHash=sessionHash(sessionSeed(headers, body, model), key.ownerId),
            # A compaction or a token count of a chain goes where the chain
            # lives (R40-R42), for the key that owns it (R104).
            previousResponseId=previous,
            requestId=requestIdOf(request), clientRequestId=clientRequestIdOf(request),
            request=kind,
        )
        annotateTurn(turn)
        turn.background = False
        if which == COMPACT:
            turn.compactionItems = []
        self._start(request, turn, JSONSink(request, "responses", model))
        return NOT_DONE_YET

    # -- requests about one response -------------------------------------------------

    def _owned(self, request, key, rawId: bytes, action: bytes):
        """
        Retrieve (a poll or a stream resume), delete, list the input items
        of, or cancel one response: looked up first (R39), for the key that
        owns it (R104).
        """
        if action == b"cancel":
            _, _, error = readBody(request)  # a JSON body is allowed, and means nothing
            if error is not None:
                writeError(request, error)
                return NOT_DONE_YET
        try:
            responseId = rawId.decode("utf-8")
        except UnicodeDecodeError:
            responseId = ""
        if not responseId or "/" in responseId:
            writeError(request, notFound(responseId or "?"))
            return NOT_DONE_YET
        requestIdOf(request)
        d = self._runner.scheduler.lookupResponse(responseId)
        d.addCallback(self._ownerFound, request, key, responseId, action)
        d.addErrback(self._lookupFailed, request, responseId)
        return NOT_DONE_YET

    def _lookupFailed(self, failure, request, responseId):
        self._log.failure("looking up the owner of {response_id} failed", failure,
                          response_id=responseId)
        if not request.finished:
            writeError(request, ClientError(503, "api_error",
                                            "Service temporarily unavailable, please retry later"))

    def _ownerFound(self, owner: Optional[tuple], request, key, responseId: str, action: bytes):
        if getattr(request, "_disconnected", False) or request.finished:
            return
        if owner is None or owner[1] != key.ownerId:  # R104
            writeError(request, notFound(responseId))
            return
        accountId = owner[0]
        account = self._runner.scheduler.accountById(accountId)
        if account is None or account.type == "oauth":
            # The ChatGPT backend keeps no responses (relay sends store:
            # false there), so nothing on an OAuth account can be
            # retrieved, listed, cancelled or deleted; an account no longer
            # configured cannot answer either.
            writeError(request, notFound(responseId))
            return
        query = request.uri.partition(b"?")[2]
        stream = action == b"" and request.method == b"GET" and (
            (request.args or {}).get(b"stream") == [b"true"])
        name = {b"": "stream" if stream else "retrieve", b"DELETE": "delete",
                b"input_items": "input_items", b"cancel": "cancel"}[action]
        suffix = {b"input_items": "/input_items", b"cancel": "/cancel"}.get(action, "")
        method = {b"DELETE": b"DELETE", b"cancel": b"POST"}.get(action, b"GET")
        kind = R.ownedRequest(name, method, quote(responseId, safe=""), accountId, suffix,
                              query if action in (b"", b"input_items") else b"")
        turn = Turn(
            entrypoint="http", endpoint="responses", client=key, model=None,
            body={}, stream=stream, headers=clientHeaders(request),
            requestId=requestIdOf(request), clientRequestId=clientRequestIdOf(request),
            request=kind,
        )
        sink = SSESink(request, "responses", None) if stream else JSONSink(request, "responses")
        self._start(request, turn, sink)

    def _start(self, request, turn: Turn, sink) -> Deferred:
        handOverKeyLease(request, turn)  # R103: a slot the intake admitted
        request.notifyFinish().addErrback(lambda f: turn.cancel.cancel("client_gone"))
        return self._door.enter(turn, sink)


__all__ = ["ResponsesResource", "notFound", "readBody"]
