# -*- test-case-name: tests.test_media -*-
"""
Embeddings and images, the surface's half (behaviour.md R115): the check of
a request, what goes upstream for each account type, and the answer's shape.
Everything else (selection, admission, classification, failover, budgets,
usage, the request log) is the engine's.

  - C{POST /v1/embeddings}: API-key accounts only (the scheduler's
    capability filter, L{relay.base.records.Account.servesEndpoint}); the
    JSON body goes to the account's C{/embeddings} with the model mapped.
  - C{POST /v1/images/generations} (JSON) and C{POST /v1/images/edits}
    (C{multipart/form-data}, L{relay.wire.multipart}): on an API-key
    account the request goes to C{/images/generations} or C{/images/edits}
    (an edit's form encoded anew); on an OAuth account it becomes a
    streamed Responses turn that must call the C{image_generation} tool
    (L{imagesToResponses}), and the tool's C{image_generation_call} result
    comes back in the images API's shape (L{imagesAnswer},
    L{relay.translate.imagesink.ImagesSink}).

Pure data work: nothing here touches the network or the clock.
"""

from __future__ import annotations

import base64
from typing import Any, Optional

from relay.wire.multipart import encodeForm

MEDIA_ENDPOINTS = frozenset({"embeddings", "images", "image_edits"})
"""The endpoints of this module (L{relay.base.records.ENDPOINTS})."""

IMAGE_ENDPOINTS = frozenset({"images", "image_edits"})

DEFAULT_IMAGE_MODEL = "dall-e-2"
"""The model of an images request that names none (OpenAI's default)."""

OAUTH_IMAGE_MODEL = "gpt-5.4-mini"
"""The model an images request runs on as a Responses turn on an OAuth
account when the account's C{model_mapping} maps the image model to no
other (e.g. C{gpt-image-1: gpt-5.5}); the image itself is the hosted
C{image_generation} tool's."""

IMAGE_INSTRUCTIONS = (
    "Make the image the user describes by calling the image_generation tool exactly once."
    " Do not answer in text."
)

_TOOL_OPTIONS = ("quality", "background", "output_format", "output_compression",
                 "moderation", "input_fidelity")
"""Images API fields the C{image_generation} tool takes as they are."""

_SIZES = frozenset({"1024x1024", "1024x1536", "1536x1024", "auto"})
"""The sizes the C{image_generation} tool knows."""


class MediaRequestError(ValueError):
    """
    An embeddings or images request relay cannot take (answered 400 in
    OpenAI's shape).

    @ivar param: the offending parameter, or L{None}.
    """

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _isTokens(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def checkEmbeddings(body: dict) -> None:
    """
    An embeddings body: C{input} a non-empty string, array of strings,
    array of token ids or array of arrays of token ids;
    C{encoding_format} C{float} or C{base64}.

    @raise MediaRequestError: for the first field that fails.
    """
    value = body.get("input")
    if value is None:
        raise MediaRequestError("you must provide an input parameter", "input")
    ok = (isinstance(value, str) and value != "") or (
        isinstance(value, list) and value and (
            all(isinstance(v, str) and v for v in value) or _isTokens(value)
            or all(_isTokens(v) and v for v in value)))
    if not ok:
        raise MediaRequestError(
            "'input' must be a non-empty string, an array of strings, an array of token ids"
            " or an array of arrays of token ids.", "input")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise MediaRequestError(
            f"Invalid value for 'encoding_format': {encoding!r}; expected 'float' or 'base64'.",
            "encoding_format")


MAX_FORM_DIGITS = 9
"""The most digits a form field read as an integer may have (Python's
C{int()} refuses a text of more than 4,300 digits with a C{ValueError},
and non-ASCII digits such as C{"\u00b2"} pass C{str.isdigit} but not
C{int()}: both were a 500)."""


def formInteger(value: Any) -> Any:
    """
    A form field's digits as an integer, any other value as it is.

    @param value: a JSON value or a form field's text.
    @return: the integer of a text of 1 to L{MAX_FORM_DIGITS} ASCII digits
        (surrounding blanks allowed), else C{value} unchanged.
    """
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and text.isdigit() and len(text) <= MAX_FORM_DIGITS:
            return int(text)
    return value


def imageCount(body: dict) -> int:
    """
    The C{n} of an images request (1 when absent), a JSON integer or a
    form field's text.

    @raise MediaRequestError: C{n} is not an integer from 1 to 10.
    """
    value = body.get("n")
    if value is None:
        return 1
    value = formInteger(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10:
        raise MediaRequestError("'n' must be an integer from 1 to 10.", "n")
    return value


def checkImages(body: dict, uploads=None) -> None:
    """
    An images body (generations: JSON; edits: form fields with C{uploads}):
    C{prompt} a non-empty string, C{n} from 1 to 10, C{output_compression}
    from 0 to 100 (a JSON integer or a form field's digits), no C{stream} (relay
    answers images as one JSON body), and for an edit at least one C{image}
    file.

    @param uploads: an edit's L{relay.wire.multipart.Upload}s, or
        L{None} for a generation.
    @raise MediaRequestError: for the first field that fails.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise MediaRequestError("you must provide a prompt parameter", "prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise MediaRequestError("'model' must be a string.", "model")
    imageCount(body)
    compression = body.get("output_compression")
    if compression is not None and compression != "":
        compression = formInteger(compression)
        if not isinstance(compression, int) or isinstance(compression, bool) or not (
                0 <= compression <= 100):
            raise MediaRequestError("'output_compression' must be an integer from 0 to 100.",
                                    "output_compression")
    if body.get("stream") in (True, "true"):
        raise MediaRequestError(
            "Streaming image generation is not supported by this gateway; leave out 'stream'.",
            "stream")
    if uploads is not None and not any(u.field in ("image", "image[]") for u in uploads):
        raise MediaRequestError("you must provide an image file (the 'image' field)", "image")


# -- what goes upstream -------------------------------------------------------------


def translatesImages(turn, account) -> bool:
    """
    Whether C{turn} is an images turn that C{account} serves through its
    C{/responses} route with the C{image_generation} tool (an OAuth
    account).
    """
    return turn.endpoint in IMAGE_ENDPOINTS and account.type == "oauth"


def mediaPath(turn, account) -> str:
    """
    The upstream route of a media turn under the account's base URL.
    """
    if translatesImages(turn, account):
        return "/responses"
    return {"embeddings": "/embeddings", "images": "/images/generations",
            "image_edits": "/images/edits"}[turn.endpoint]


def mediaBody(turn, account) -> tuple:
    """
    The upstream body of a media turn for C{account}.

    @return: C{(body bytes, content type)}; the body's C{model} is the
        account's name for the client's model (C{model_mapping}).
    """
    import json

    model = account.upstreamModel(turn.model) if turn.model else None
    if translatesImages(turn, account):
        body = imagesToResponses(turn.body, turn.upload or (), model)
        return json.dumps(body, separators=(",", ":")).encode("utf-8"), "application/json"
    body = dict(turn.body)
    if model:
        body["model"] = model
    body.pop("stream", None)
    if turn.endpoint == "image_edits":
        return encodeForm({k: v for k, v in body.items() if isinstance(v, (str, int, float))},
                          turn.upload or ())
    return json.dumps(body, separators=(",", ":")).encode("utf-8"), "application/json"


def _dataURL(upload) -> str:
    kind = upload.contentType if upload.contentType.startswith("image/") else "image/png"
    return f"data:{kind};base64," + base64.b64encode(upload.data).decode("ascii")


def imagesToResponses(body: dict, uploads, model: Optional[str]) -> dict:
    """
    An images request as a Responses request for an OAuth account: the
    prompt (and an edit's images, as C{input_image} data URLs) in one user
    message, the C{image_generation} tool (C{size}, C{quality},
    C{background}, C{output_format}, ... as the request gives them; an
    edit's C{mask} as C{input_image_mask}) and a C{tool_choice} that makes
    the model call it.

    @param body: the images request (a generation's JSON or an edit's
        form fields).
    @param uploads: an edit's files (C{image}/C{image[]}, C{mask}), or
        C{()}.
    @param model: the account's name for the request's model; an image
        model's name (C{gpt-image-*}, C{dall-e-*}) runs on
        L{OAUTH_IMAGE_MODEL}.
    @return: the Responses body (C{stream: true}, C{store: false}).
    """
    host = model or OAUTH_IMAGE_MODEL
    if host.startswith(("gpt-image", "dall-e", "chatgpt-image")):
        host = OAUTH_IMAGE_MODEL
    content: list[dict] = [{"type": "input_text", "text": body.get("prompt") or ""}]
    tool: dict[str, Any] = {"type": "image_generation"}
    for upload in uploads:
        if upload.field in ("image", "image[]"):
            content.append({"type": "input_image", "image_url": _dataURL(upload)})
        elif upload.field == "mask":
            tool["input_image_mask"] = {"image_url": _dataURL(upload)}
    size = body.get("size")
    if isinstance(size, str) and size in _SIZES:
        tool["size"] = size
    for name in _TOOL_OPTIONS:
        value = body.get(name)
        if value is None or value == "":
            continue
        if name == "output_compression":
            value = formInteger(value)
        tool[name] = value
    return {
        "model": host,
        "instructions": IMAGE_INSTRUCTIONS,
        "input": [{"type": "message", "role": "user", "content": content}],
        "tools": [tool],
        "tool_choice": {"type": "image_generation"},
        "stream": True,
        "store": False,
    }


# -- the answer ---------------------------------------------------------------------


def imagesAnswer(items: list, response: dict, created: int) -> Optional[dict]:
    """
    The images API's answer from a finished Responses turn.

    @param items: the turn's output items (from C{response.output_item.done}
        events, or the terminal event's C{output}).
    @param response: the terminal event's C{response} (its C{usage}).
    @param created: Unix seconds.
    @return: C{{"created", "data": [{"b64_json", "revised_prompt"}],
        "background", "output_format", "quality", "size", "usage"}}, or
        L{None} when the turn made no image.
    """
    calls = [i for i in items if isinstance(i, dict) and i.get("type") == "image_generation_call"
             and isinstance(i.get("result"), str) and i.get("result")]
    if not calls:
        return None
    data = []
    for call in calls:
        entry = {"b64_json": call["result"]}
        if isinstance(call.get("revised_prompt"), str):
            entry["revised_prompt"] = call["revised_prompt"]
        data.append(entry)
    answer: dict[str, Any] = {"created": created, "data": data}
    for name in ("background", "output_format", "quality", "size"):
        if isinstance(calls[0].get(name), str):
            answer[name] = calls[0][name]
    usage = response.get("usage") if isinstance(response, dict) else None
    if isinstance(usage, dict):
        inputTokens = int(usage.get("input_tokens") or 0)
        outputTokens = int(usage.get("output_tokens") or 0)
        answer["usage"] = {
            "input_tokens": inputTokens, "output_tokens": outputTokens,
            "total_tokens": int(usage.get("total_tokens") or inputTokens + outputTokens),
            "input_tokens_details": {"text_tokens": inputTokens, "image_tokens": 0},
        }
    return answer
