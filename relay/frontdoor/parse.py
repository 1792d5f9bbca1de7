# -*- test-case-name: tests.test_frontdoor, tests.test_requests -*-
"""
Parse once, check once: the one reader of a client's JSON (an HTTP body,
a WebSocket frame; L{readJSON}) and the one check of a turn's fields
(L{turnFields}) for both entrypoints, so a WebSocket C{response.create}
is held to what an HTTP C{POST /v1/responses} is (protocol.md 2.1, 4;
behaviour.md R103). The refusals are L{relay.base.records.ClientError}s in
OpenAI's 400 form; the WebSocket protocol words its C{error} event and
close from them (R47, R81).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from relay.frontdoor.jsonbody import NESTING_MESSAGE, loadJSON
from relay.base.records import ClientError

NOT_JSON_MESSAGE = "We could not parse the JSON body of your request."


class RequestRefused(Exception):
    """
    A request answered with an error before a turn began (its body is not
    JSON, nests too deep, ...).

    @ivar error: the L{ClientError} to write.
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error


class FieldRefused(RequestRefused):
    """
    A turn's field that is missing, of the wrong type or empty
    (L{turnFields}).

    @ivar kind: C{type}, C{missing}, C{empty} or C{shape} (not an object).
    @ivar param: the field's name, or L{None} for C{shape}.
    """

    def __init__(self, error: ClientError, kind: str, param: Optional[str]):
        super().__init__(error)
        self.kind, self.param = kind, param


def readJSON(raw: bytes, shape: Optional[list] = None):
    """
    Parse a client's body or frame (L{loadJSON}).

    @param shape: a list that gets what a large body's value holds
        (L{loadJSON}), or L{None}.

    @return: the value.
    @raise RequestRefused: a 400 whose message is L{NESTING_MESSAGE} for
        deep nesting, else L{NOT_JSON_MESSAGE}; C{.nested} tells which.
    """
    try:
        return loadJSON(raw, shape)
    except ValueError as e:
        nested = str(e) == NESTING_MESSAGE
        refused = RequestRefused(
            badRequest(NESTING_MESSAGE if nested else NOT_JSON_MESSAGE))
        refused.nested = nested
        raise refused from None


class TurnFields(NamedTuple):
    """
    What L{turnFields} read from a turn's body (a named tuple: immutable,
    built in a fraction of a frozen attrs class's instructions).

    @ivar model: the model (the body's, else the default given).
    @ivar stream: the body's C{stream} is C{true}.
    @ivar previous: C{previous_response_id}, or L{None}.
    """

    model: str
    stream: bool
    previous: Optional[str]


def turnFields(body, endpoint: str = "responses", defaultModel: Optional[str] = None) -> TurnFields:
    """
    Check a turn's body, an HTTP body or a WebSocket C{response.create}
    alike: an object; C{model} a non-empty string (or absent when
    C{defaultModel} stands in: a WebSocket's earlier turn); C{stream} a
    boolean; on C{responses}, C{background} a boolean (relay reads it,
    R88) and C{previous_response_id} a non-empty string (never forwarded
    as an empty chain id). A wrong-typed field is never forwarded
    upstream, where it would be refused only after an account was chosen
    and a slot taken.

    @param body: the parsed JSON.
    @param endpoint: C{responses} or C{chat}.
    @param defaultModel: the model of a body without one, or L{None}.
    @raise FieldRefused: OpenAI's 400 for the first field that fails.
    """
    if not isinstance(body, dict):
        raise FieldRefused(badRequest("The request body must be a JSON object."), "shape", None)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldRefused(invalidType("model", "a string", model), "type", "model")
    if not model:
        if not defaultModel:
            raise FieldRefused(
                badRequest("you must provide a model parameter", param="model"), "missing",
                "model")
        model = defaultModel
    streamFlag = body.get("stream", False)
    if streamFlag is not None and not isinstance(streamFlag, bool):
        raise FieldRefused(invalidType("stream", "a boolean", streamFlag), "type", "stream")
    if endpoint != "responses":
        return TurnFields(model, streamFlag is True, None)
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise FieldRefused(invalidType("background", "a boolean", background), "type",
                           "background")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise FieldRefused(invalidType("previous_response_id", "a string", previous), "type",
                           "previous_response_id")
    if previous == "":
        raise FieldRefused(badRequest(
            "previous_response_id must not be empty", param="previous_response_id",
            code="invalid_value",
        ), "empty", "previous_response_id")
    return TurnFields(model, streamFlag is True, previous)


def badRequest(message: str, param=None, code=None) -> ClientError:
    """
    A 400 in OpenAI's format.
    """
    return ClientError(400, "invalid_request_error", message, param=param, code=code)


_JSON_TYPES = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)
"""How OpenAI names a JSON value's type in its messages (C{bool} before
C{int}: a boolean is an C{int} in Python)."""


def invalidType(param: str, expected: str, value) -> ClientError:
    """
    OpenAI's 400 for a field of the wrong JSON type, e.g. C{Invalid type
    for 'model': expected a string, but got an integer instead.}

    @param param: the field's name (also the error's C{param}).
    @param expected: the type it must have, as OpenAI words it (C{a string}).
    @param value: the value the client sent.
    @return: the L{ClientError}, code C{invalid_type}.
    """
    got = next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), "null")
    return badRequest(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param, code="invalid_type",
    )


