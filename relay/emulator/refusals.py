# -*- test-case-name: tests.test_clienttext -*-
"""
The upstream's refusals of a request, each quoting what the request carried, as OpenAI
words them: the emulator's C{refuse} fault kind (L{relay.emulator.state}) answers with
one, so a gateway can be tried against client text echoed in every error template
(behaviour.md R106).

Templates (the fault's C{template}):

  - C{unknown_parameter}: the API's refusal of a field it does not know, 400
    C{{"error": {"message": "Unknown parameter: '<name>'.", "type":
    "invalid_request_error", "param": "<name>", "code": "unknown_parameter"}}};
  - C{unsupported_parameter}: the ChatGPT backend's, 400
    C{{"detail": "Unsupported parameter: <name>"}};
  - C{invalid_value}: 400 C{{"error": {"message": "Invalid value: '<value>'. Supported values
    are: 'auto' and 'none'.", "param": "<name>", "code": "invalid_value", ...}}};
  - C{model_not_found}: the API's model refusal with the status of the fault's C{code}:
    404 "The model `<model>` does not exist or you do not have access to it.", 403
    "Project `proj_…` does not have access to model `<model>`" (a project's model
    restriction), 400 "The requested model '<model>' does not exist." (C{param: model});
    all with C{code: model_not_found};
  - C{model_not_supported}: the ChatGPT backend's, 400
    C{{"detail": "The '<model>' model is not supported when using Codex with a ChatGPT
    account."}}.

C{unknown_parameter} and C{unsupported_parameter} name the fault's C{param} when the
request carries it, else the first top-level field the endpoint does not know
(L{KNOWN_FIELDS}); a request without one is served normally, as upstream would.
C{invalid_value} quotes the string value of C{param}, else of the first top-level field
with a string value that is not the model, input, messages or instructions.

On the wire (the fault's C{wire}): C{error} (the default) is the HTTP status and body, or
on the WebSocket the status-bearing C{error} event (protocol.md 4.5; a C{detail} body
travels as the backend sends it, C{"error": {"detail": detail}}); C{response.failed} is,
on a Responses stream or WebSocket turn, C{response.created} then C{response.failed}
carrying the error object (a non-stream or chat request gets the HTTP form).
"""

from __future__ import annotations

import hashlib
from typing import Any

from attrs import frozen

TEMPLATES = (
    "unknown_parameter",
    "unsupported_parameter",
    "invalid_value",
    "model_not_found",
    "model_not_supported",
)
"""Every refusal template (see the module docstring)."""

WIRES = ("error", "response.failed")
"""How a refusal travels: as an error status/event, or as a C{response.failed}."""

MODEL_NOT_FOUND_STATUSES = (400, 403, 404)
"""The statuses a C{model_not_found} refusal may carry."""

KNOWN_FIELDS = {
    "responses": frozenset({
        "model", "input", "instructions", "stream", "store", "tools", "tool_choice",
        "parallel_tool_calls", "reasoning", "include", "text", "max_output_tokens",
        "temperature", "top_p", "previous_response_id", "prompt_cache_key",
        "prompt_cache_retention", "service_tier", "truncation", "metadata", "user",
        "safety_identifier", "background", "conversation", "max_tool_calls", "prompt",
        "stream_options", "top_logprobs", "client_metadata", "generate", "type",
        "context_management",
    }),
    "chat": frozenset({
        "model", "messages", "stream", "stream_options", "tools", "tool_choice",
        "parallel_tool_calls", "temperature", "top_p", "max_tokens", "max_completion_tokens",
        "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
        "top_logprobs", "user", "seed", "response_format", "reasoning_effort", "metadata",
        "store", "service_tier", "modalities", "audio", "prediction", "verbosity",
        "web_search_options", "prompt_cache_key", "safety_identifier",
    }),
}
"""The top-level request fields each endpoint knows."""

_NOT_ENUMS = ("model", "input", "messages", "instructions")
"""Fields whose value an C{invalid_value} refusal never quotes."""


@frozen
class Refusal:
    """
    One refusal.

    @ivar status: the HTTP status.
    @ivar body: the HTTP body (C{{"error": {...}}} or C{{"detail": "..."}}).
    """

    status: int
    body: dict

    def error(self) -> dict:
        """
        The error object an in-band event carries (a C{detail} body as an
        C{invalid_request_error} with that message).
        """
        inner = self.body.get("error")
        if isinstance(inner, dict):
            return dict(inner)
        return {"type": "invalid_request_error", "code": None,
                "message": str(self.body.get("detail", "")), "param": None}

    def wsError(self) -> dict:
        """
        The error object of the WebSocket C{error} event: the API's error
        object, or the ChatGPT backend's C{detail} body as it sends it there,
        C{{"detail": "..."}} with no C{message} (CLIProxyAPI#1901:
        C{{"type":"error","status":400,"error":{"detail":"Unsupported
        parameter: generate"}}}).
        """
        inner = self.body.get("error")
        if isinstance(inner, dict):
            return dict(inner)
        return {"detail": str(self.body.get("detail", ""))}


def checkSpec(params: dict) -> None:
    """
    Validate the fields of a C{refuse} fault.

    @raise ValueError: naming the bad field.
    """
    template = params.get("template")
    if template not in TEMPLATES:
        raise ValueError(f"refuse needs a template, one of {list(TEMPLATES)}")
    if params.get("wire", "error") not in WIRES:
        raise ValueError(f"refuse wire must be one of {list(WIRES)}")
    if template == "model_not_found" and params.get("code", 404) not in MODEL_NOT_FOUND_STATUSES:
        raise ValueError(f"model_not_found code must be one of {list(MODEL_NOT_FOUND_STATUSES)}")
    param = params.get("param")
    if param is not None and not isinstance(param, str):
        raise ValueError("refuse param must be a field name")


def _unknownField(body: dict, endpoint: str, param: str | None) -> str | None:
    if param is not None:
        return param if param in body else None
    known = KNOWN_FIELDS.get(endpoint, KNOWN_FIELDS["responses"])
    return next((name for name in body if name not in known), None)


def _project(credential: str) -> str:
    return "proj_" + hashlib.sha256(credential.encode("utf-8")).hexdigest()[:24]


def refusalFor(params: dict, body: dict, endpoint: str = "responses",
               credential: str = "") -> Refusal | None:
    """
    The refusal a C{refuse} fault gives C{body}, or L{None} when the body carries nothing
    the template refuses (the request is then served).

    @param params: the fault's fields (C{template}, C{code}, C{param}).
    @param body: the request body or C{response.create} frame.
    @param endpoint: C{responses} or C{chat} (which fields are known).
    @param credential: the account's credential (the project id is derived from it,
        never the secret itself).
    """
    template = params.get("template")
    param = params.get("param")
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    if template in ("unknown_parameter", "unsupported_parameter"):
        name = _unknownField(body, endpoint, param)
        if name is None:
            return None
        if template == "unsupported_parameter":
            return Refusal(400, {"detail": f"Unsupported parameter: {name}"})
        return Refusal(400, {"error": {
            "message": f"Unknown parameter: '{name}'.", "type": "invalid_request_error",
            "param": name, "code": "unknown_parameter"}})
    if template == "invalid_value":
        names = [param] if param is not None else [n for n in body if n not in _NOT_ENUMS]
        name = next((n for n in names if isinstance(body.get(n), str)), None)
        if name is None:
            return None
        return Refusal(400, {"error": {
            "message": f"Invalid value: '{body[name]}'. Supported values are: 'auto' and "
                       "'none'.", "type": "invalid_request_error", "param": name,
            "code": "invalid_value"}})
    if template == "model_not_supported":
        return Refusal(400, {"detail": f"The '{model}' model is not supported when using "
                                       "Codex with a ChatGPT account."})
    status = params.get("code", 404)
    if status == 403:
        message = f"Project `{_project(credential)}` does not have access to model `{model}`"
        param = None
    elif status == 400:
        message, param = f"The requested model '{model}' does not exist.", "model"
    else:
        message = f"The model `{model}` does not exist or you do not have access to it."
        param = None
    return Refusal(status, {"error": {
        "message": message, "type": "invalid_request_error", "param": param,
        "code": "model_not_found"}})


def refusalOf(fault: Any, body: Any, endpoint: str, credential: str) -> Refusal | None:
    """
    The refusal of a C{refuse} fault for a request, or L{None} (no such fault, or nothing
    to refuse).

    @param fault: a L{relay.emulator.state.Fault} or L{None}.
    """
    if fault is None or fault.kind != "refuse" or not isinstance(body, dict):
        return None
    return refusalFor(fault.params, body, endpoint, credential)
