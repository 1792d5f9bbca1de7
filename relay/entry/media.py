# -*- test-case-name: tests.test_media -*-
"""
The embeddings and images entrypoints (behaviour.md R115):
C{POST /v1/embeddings}, C{POST /v1/images/generations} (JSON) and
C{POST /v1/images/edits} (C{multipart/form-data}).

Each is a turn like a chat completion: the resource reads the body (after
the key and its slot, R103: the intake holds it until then), checks it
(L{relay.translate.media}), builds a L{Turn} and a JSON sink and hands both
to the front door, which applies the key's policy, rate and budgets and
runs the engine (selection, admission, classification, failover, usage,
the request log). An edit's form is the one non-JSON body relay reads:
bounded like every body (413 over C{gateway.max_request_body_bytes}) and
parsed here once (L{relay.wire.multipart}); a malformed one is OpenAI's 400.
No policy here (architecture.md invariant 1).
"""

from __future__ import annotations

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.base.records import ClientError, Turn
from relay.base.requestid import clientRequestIdOf, requestIdOf
from relay.entry.body import DEFAULT_MAX_BODY_BYTES, tooLarge
from relay.entry.http import UNAUTHORIZED, _noteClient, clientHeaders, handOverKeyLease, requestJSON
from relay.entry.sinks import JSONSink, writeError
from relay.frontdoor.parse import RequestRefused, badRequest, turnFields
from relay.translate.media import (
    DEFAULT_IMAGE_MODEL,
    MediaRequestError,
    checkEmbeddings,
    checkImages,
)
from relay.wire.multipart import FormError, parseForm


class MediaResource(Resource):
    """
    C{POST} an embeddings or images turn (C{endpoint}: C{embeddings},
    C{images} or C{image_edits}); any other method gets a JSON 405.
    """

    isLeaf = True

    def __init__(self, door, keys, endpoint: str):
        """
        @param door: the L{relay.frontdoor.door.FrontDoor}.
        @param keys: the L{relay.frontdoor.keyring.KeyRing}.
        @param endpoint: C{embeddings}, C{images} or C{image_edits}.
        """
        super().__init__()
        self._door = door
        self._keys = keys
        self._endpoint = endpoint

    def render(self, request):
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            writeError(request, ClientError(
                405, "invalid_request_error",
                f"Method {request.method.decode('latin-1')} is not allowed on"
                f" {request.path.decode('latin-1')}", code="method_not_allowed"))
            return NOT_DONE_YET
        key = self._keys.authenticate(request)
        if key is None:
            writeError(request, UNAUTHORIZED)
            return NOT_DONE_YET
        try:
            body, upload, model = self._read(request)
        except RequestRefused as e:
            writeError(request, e.error)
            return NOT_DONE_YET
        except (FormError, MediaRequestError) as e:
            writeError(request, badRequest(str(e), param=e.param))
            return NOT_DONE_YET
        headers = clientHeaders(request)
        turn = Turn(
            entrypoint="http", endpoint=self._endpoint, client=key, model=model, body=body,
            stream=False, headers=headers, requestId=requestIdOf(request),
            clientRequestId=clientRequestIdOf(request), upload=upload,
        )
        _noteClient(turn, request)
        handOverKeyLease(request, turn)
        sink = JSONSink(request, self._endpoint, model)
        gone = getattr(request, "relayOnGone", None) or (
            lambda f: request.notifyFinish().addErrback(f))
        gone(lambda f: turn.cancel.cancel("client_gone"))
        self._door.enter(turn, sink)  # the key's checks, then the engine
        return NOT_DONE_YET

    def _read(self, request) -> tuple:
        """
        The checked body, an edit's files and the model.

        @return: C{(body dict, uploads or None, model)}.
        @raise RequestRefused: 400 (not JSON, a wrong-typed field), 413.
        @raise FormError: a malformed form.
        @raise MediaRequestError: a field the route refuses.
        """
        if self._endpoint == "image_edits":
            limit = getattr(request, "bodyLimit", DEFAULT_MAX_BODY_BYTES)
            raw = request.content.read(limit + 1) if request.content is not None else b""
            if len(raw) > limit:
                raise RequestRefused(tooLarge(limit))
            contentType = (request.getHeader(b"content-type") or b"").decode("latin-1")
            form = parseForm(raw, contentType)
            del raw
            body = dict(form.fields)
            model = body.get("model") or DEFAULT_IMAGE_MODEL
            checkImages(body, form.files)
            return body, form.files, model
        body = requestJSON(request)
        if self._endpoint == "embeddings":
            model = turnFields(body, "embeddings").model  # FieldRefused: a 400
            checkEmbeddings(body)
            return body, None, model
        if not isinstance(body, dict):
            raise RequestRefused(badRequest("The request body must be a JSON object."))
        checkImages(body)
        return body, None, body.get("model") or DEFAULT_IMAGE_MODEL


def mediaRoutes(door, keys) -> dict:
    """
    The resources of the media routes, by path under C{/v1}.

    @return: C{{b"embeddings": resource, b"images": node}} where the
        C{images} node has C{generations} and C{edits}.
    """
    from relay.entry.http import JSONRoot

    images = JSONRoot()
    images.putChild(b"generations", MediaResource(door, keys, "images"))
    images.putChild(b"edits", MediaResource(door, keys, "image_edits"))
    return {b"embeddings": MediaResource(door, keys, "embeddings"), b"images": images}
