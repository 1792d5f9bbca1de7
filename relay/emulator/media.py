# -*- test-case-name: tests.test_emulator_media -*-
"""
The emulator's embeddings and images endpoints (C{POST /v1/embeddings},
C{/v1/images/generations}, C{/v1/images/edits}) in OpenAI's shapes, with the
HTTP faults of L{relay.emulator.http.EmulatorResource} (statuses, resets,
hangs, a delayed or cut body, C{stream_error} as a 500, C{refuse}'s request
refusals), and the image the
ChatGPT backend's C{image_generation} tool returns (L{pngImage}).

Embeddings: C{{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}}, each
vector float32 numbers or, with C{encoding_format: base64}, their
little-endian bytes in base64; deterministic per input text.
Images: C{{"created", "data": [{"b64_json"} or {"url"}], ...}} with
C{usage} (and C{background}, C{output_format}, C{quality}, C{size}) for
C{gpt-image-*} models and C{revised_prompt} for C{dall-e-3}. The image is
L{relay.emulator.pictures.PNG}.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

from relay.emulator.httpwire import Route, breakAfter, lowerHeaders, streamErrorBody
from relay.emulator.pictures import PNG, pngImage  # noqa: F401 - PNG re-exported
from relay.emulator.refusals import refusalOf
from relay.emulator.state import HTTP, estimateTokens, newId
from relay.emulator.stream import TurnTracker
from relay.wire.multipart import FormError, parseForm

EMBEDDINGS = ("/v1/embeddings", "/embeddings")
IMAGES = ("/v1/images/generations", "/images/generations")
IMAGE_EDITS = ("/v1/images/edits", "/images/edits")

_DIMENSIONS = {"text-embedding-3-large": 3072}
"""Vector sizes by model (1536 for the others)."""


def _vector(text: str, size: int) -> list:
    """
    A deterministic unit-ish vector for C{text}.
    """
    seed = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    out = []
    while len(out) < size:
        seed = hashlib.sha256(seed).digest()
        out.extend((b - 128) / 1024.0 for b in seed)
    return [round(v, 6) for v in out[:size]]


def embeddingsAnswer(body: dict) -> tuple:
    """
    The answer to an embeddings body.

    @return: C{(status, JSON value)}: 200 and the list, or 400 and OpenAI's
        error for a missing or malformed C{input}.
    """
    value = body.get("input")
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, (str, int, list)) for v in value):
        texts = [v if isinstance(v, str) else str(v) for v in value] if not all(
            isinstance(v, int) for v in value) else [str(value)]
    else:
        return 400, {"error": {"message": "'input' is a required property", "type":
                               "invalid_request_error", "param": "input", "code": None}}
    model = body.get("model") or "text-embedding-3-small"
    size = body.get("dimensions")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        size = _DIMENSIONS.get(model, 1536)
    data = []
    for index, text in enumerate(texts):
        vector = _vector(text, size)
        if body.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(max(1, estimateTokens(t)) for t in texts)
    return 200, {"object": "list", "data": data, "model": model,
                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def imagesAnswer(body: dict, now: float, edit: bool = False) -> dict:
    """
    The answer to an images generation or edit (body: the JSON or the form
    fields).
    """
    model = body.get("model") or "dall-e-2"
    n = body.get("n") or 1
    n = int(n) if str(n).isdigit() else 1
    gptImage = str(model).startswith("gpt-image")
    data = []
    for _ in range(max(1, min(n, 10))):
        if body.get("response_format") == "url" and not gptImage:
            entry = {"url": f"https://images.emulator.invalid/{newId('img')}.png"}
        else:
            entry = {"b64_json": pngImage()}
        if model == "dall-e-3":
            entry["revised_prompt"] = str(body.get("prompt") or "")
        data.append(entry)
    answer: dict[str, Any] = {"created": int(now), "data": data}
    if gptImage:
        prompt = estimateTokens(body.get("prompt") or "")
        image = 194 if edit else 0
        answer.update(
            background=body.get("background") or "opaque",
            output_format=body.get("output_format") or "png",
            quality=body.get("quality") if body.get("quality") not in (None, "auto") else "medium",
            size=body.get("size") if body.get("size") not in (None, "auto") else "1024x1024",
            usage={"input_tokens": prompt + image, "output_tokens": 1056 * len(data),
                   "total_tokens": prompt + image + 1056 * len(data),
                   "input_tokens_details": {"text_tokens": prompt, "image_tokens": image}},
        )
    return answer


class MediaRoutes(Route):
    """
    C{POST /v1/embeddings}, C{/v1/images/generations} and
    C{/v1/images/edits} of L{relay.emulator.http.EmulatorResource}.
    """

    def post(self, request: Any, path: str) -> Any:
        """
        Answer one of the routes (see the module docstring).

        @param path: the request path (one of L{EMBEDDINGS}, L{IMAGES},
            L{IMAGE_EDITS}).
        @return: the body or C{NOT_DONE_YET}.
        """
        r = self._resource
        edit = path in IMAGE_EDITS
        if edit:
            raw = request.content.read() if request.content is not None else b""
            try:
                form = parseForm(raw, (request.getHeader(b"content-type") or b"").decode(
                    "latin-1"))
                ok, body = True, dict(form.fields, image=[u.describe() for u in form.files
                                                          if u.field.startswith("image")])
            except FormError:
                ok, body, form = False, None, None
        else:
            ok, body = r._parseBody(request)
        credential, denied = r._credential(request)
        r._record(request, HTTP, "request", credential, body)
        if denied is not None:
            return r._json(request, 401, denied)
        if not ok or not isinstance(body, dict):
            return r._json(request, 400, {"error": {
                "message": "We could not parse the body of your request.",
                "type": "invalid_request_error", "code": None, "param": None}})
        kind = "embeddings" if path in EMBEDDINGS else "images"
        draw = self.emulator.arrive(credential, HTTP, body, lowerHeaders(request))
        answer, fault = r._admit(request, credential, draw, body, kind)
        if answer is not None:
            return answer
        if fault is not None and fault.kind == "refuse":
            # a request fault (model refusal, unknown parameter): the status, as chat
            refusal = refusalOf(fault, body, kind, credential)
            if refusal is not None:
                return r._json(request, refusal.status, refusal.body)
            fault = None
        if fault is not None and fault.kind == "hang_after_headers":
            return r._hangAfterHeaders(request, credential, False)
        if kind == "embeddings":
            status, final = embeddingsAnswer(body)
        elif not isinstance(body.get("prompt"), str) or not body["prompt"]:
            status, final = 400, {"error": {
                "message": "Missing required parameter: 'prompt'.",
                "type": "invalid_request_error", "param": "prompt",
                "code": "missing_required_parameter"}}
        elif edit and not body.get("image"):
            status, final = 400, {"error": {
                "message": "Missing required parameter: 'image'.",
                "type": "invalid_request_error", "param": "image",
                "code": "missing_required_parameter"}}
        else:
            status, final = 200, imagesAnswer(body, self.emulator.clock.seconds(), edit)
        if status != 200:
            return r._json(request, status, final)
        tracker = TurnTracker(self._state, credential)
        if fault is not None and fault.kind == "stream_error":
            tracker.end()
            return r._json(request, 500, streamErrorBody(fault))
        firstDelay = float(fault.get("seconds", 0)) if fault is not None and \
            fault.kind == "delay_first_output" else 0.0
        cutAfter, cleanEnd = breakAfter(fault)
        script = self._state.scriptFor(credential)

        def complete() -> None:
            self.emulator.generated(draw, credential, final)

        return r._nonStream(request, tracker, final, firstDelay + script.delay, cutAfter,
                            cleanEnd, complete)
