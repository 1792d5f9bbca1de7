# -*- test-case-name: tests.test_anthropic -*-
"""
The Anthropic Messages surface (protocol.md 10, behaviour.md R115):

  - C{POST /v1/messages}: a turn. The body is checked and translated
    (L{relay.translate.anthropic}): the C{claude-*} name is mapped first
    (C{anthropic_models}), and the turn carries the Responses translation
    and the mapped model, so key policy, budgets, rates, groups, prices,
    the request log and account C{models} see the OpenAI model (R110)
    and the engine runs it as every turn (the front door, then
    L{relay.engine.runner.TurnRunner}); a L{MessagesSink} translates each
    attempt's answer back;
  - C{POST /v1/messages/count_tokens}: C{{"input_tokens": N}} from relay's
    own estimate of the translated request (L{relay.usage.estimate}),
    after the key's checks; never a generation.

Auth is the client key in C{x-api-key} or C{Authorization: Bearer} (the
key ring, L{relay.frontdoor.keyring.bearerOrKey}); C{anthropic-version}
and C{anthropic-beta} are accepted. Every error is written in Anthropic's
shape (L{relay.entry.sinks.writeError} on this path). Transport only.
"""

from __future__ import annotations

import json

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.base.records import ClientError, Turn
from relay.base.requestid import clientRequestIdOf, requestIdOf
from relay.entry.http import (
    NESTING_MESSAGE,
    UNAUTHORIZED,
    RequestRefused,
    _noteClient,
    clientHeaders,
    handOverKeyLease,
    requestJSON,
)
from relay.entry.sinks import JSONSink, SSESink, writeError
from relay.frontdoor.parse import badRequest
from relay.base.requestnotes import notesOf
from relay.scheduling.session import sessionHash, sessionSeed
from relay.translate.anthropic import (
    AnthropicModels,
    MessagesRequestError,
    checkMessagesRequest,
    contextOf,
    messagesToResponses,
)
from relay.usage.estimate import inputTokens

COUNT_TOKENS = b"count_tokens"


class MessagesResource(Resource):
    """
    C{POST /v1/messages} and C{POST /v1/messages/count_tokens} (see the
    module docstring).
    """

    isLeaf = True

    def __init__(self, door, keys, models: AnthropicModels):
        """
        @param door: the L{relay.frontdoor.door.FrontDoor}.
        @param keys: the L{relay.frontdoor.keyring.KeyRing}.
        @param models: the live L{AnthropicModels} table.
        """
        super().__init__()
        self._door = door
        self._keys = keys
        self._models = models

    def render(self, request):
        path = [p for p in request.postpath if p]
        if path not in ([], [COUNT_TOKENS]):
            writeError(request, ClientError(
                404, "not_found_error",
                f"Not found: {request.path.decode('latin-1')}"))
            return NOT_DONE_YET
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            writeError(request, ClientError(
                405, "invalid_request_error",
                f"Method {request.method.decode('latin-1')} is not allowed here"))
            return NOT_DONE_YET
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        try:
            body = requestJSON(request)
        except RequestRefused as e:
            writeError(request, e.error)
            return NOT_DONE_YET
        counting = path == [COUNT_TOKENS]
        try:
            checkMessagesRequest(body, counting)
            model = self._models.resolve(body["model"])  # R115: mapped first
            translated = messagesToResponses(body, model)
        except MessagesRequestError as e:
            writeError(request, badRequest(str(e), param=e.param))
            return NOT_DONE_YET
        except RecursionError:
            # a body nested as deep as the reader allows: the client's 400
            writeError(request, badRequest(NESTING_MESSAGE))
            return NOT_DONE_YET
        stream = translated.get("stream") is True
        if not counting and not stream and notesOf(request).sseStarted:
            stream = translated["stream"] = True  # R85: the SSE head went out
        headers = clientHeaders(request)
        turn = Turn(
            entrypoint="http",
            endpoint="messages",
            client=key,
            model=model,
            body=translated,
            stream=stream and not counting,
            headers=headers,
            sessionHash=sessionHash(sessionSeed(headers, translated, model), key.ownerId),
            requestId=requestIdOf(request),
            clientRequestId=clientRequestIdOf(request),
            messages=contextOf(body),
        )
        if counting:
            return self._count(request, turn)
        _noteClient(turn, request)
        handOverKeyLease(request, turn)
        sink = (SSESink if stream else JSONSink)(request, "messages", model)
        gone = getattr(request, "relayOnGone", None) or (
            lambda f: request.notifyFinish().addErrback(f))
        gone(lambda f: turn.cancel.cancel("client_gone"))
        self._door.enter(turn, sink)
        return NOT_DONE_YET

    def _count(self, request, turn: Turn):
        """
        C{count_tokens}: the key's checks as for a turn (its models, its
        budgets, R102), then relay's estimate; never a generation (R115).
        """
        refusal = self._door.checks.refusal(turn)  # the intake frees an untaken slot
        if refusal is not None:
            writeError(request, refusal)
            return NOT_DONE_YET
        data = json.dumps({"input_tokens": inputTokens(turn.body)}).encode("utf-8")
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(data))
        request.write(data)
        request.finish()
        return NOT_DONE_YET


__all__ = ["MessagesResource"]
