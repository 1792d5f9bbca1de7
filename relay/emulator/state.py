# -*- test-case-name: tests.test_emulator -*-
"""
The emulator's model: accounts, reply scripts, faults, request recordings, in-flight
accounting, and the builders for the Responses and Chat Completions wire objects.

Nothing here touches the network; everything takes the time from an injected clock, so the
whole module is exercised by unit tests with L{twisted.internet.task.Clock}.

Script format (a JSON object; every key optional)::

    {"text": "Tool said: {output}",          # reply text template
     "tool_call": {"name": "exec_command",    # answer a fresh turn with this call
                   "arguments": {"cmd": "echo hi"}},
     "tool_calls": [{"name": "a", "arguments": {}},   # or with these parallel calls
                    {"name": "b", "arguments": {}}],
     "argument_deltas": 2,                    # argument deltas per call; 0 = the arguments
                                              # only in function_call_arguments.done
     "completed_output": "empty",             # "full" or "empty": the terminal response's
                                              # output (default: "empty" on the OAuth
                                              # route, as the ChatGPT backend, else "full")
     "ending": "completed",                   # or "max_output_tokens" / "content_filter":
                                              # half the text, then response.incomplete
                                              # (chat: finish_reason length / content_filter)
     "delay": 0.0,                            # seconds between streamed events (a
                                              # non-stream answer takes as long as the
                                              # stream would have)
     "deltas": 3,                             # how many deltas the text is split into
     "usage": {"input_tokens": 120,           # pin the reported usage (each key optional;
               "cached_tokens": 100,          # default: estimated from the sizes, no cache,
               "output_tokens": 30,           # no reasoning); reasoning is part of output
               "reasoning_tokens": 12},
     "reasoning": false}                      # true: answers start with an encrypted
                                              # reasoning item (bound to the account) when
                                              # include asks for reasoning.encrypted_content

A Responses turn whose last input item is C{{"type": "compaction_trigger"}} is a compaction
turn (protocol.md 2.8): it answers with exactly one C{compaction} item whose
C{encrypted_content} is bound to the account (L{relay.emulator.sealing}); a trigger anywhere
else in the input is refused with 400, and so is an item another account sealed
(C{invalid_encrypted_content}).

A Responses request whose C{max_output_tokens} is below the reply's output tokens ends with
C{response.incomplete} (C{incomplete_details.reason: max_output_tokens}), as OpenAI does.

Template fields: C{{name}} / C{{credential_name}} (the account name, never the secret),
C{{output}} (the last C{function_call_output}), C{{result}} (that output after Codex's
C{Output:} line, i.e. just what the command printed), C{{model}} and C{{input}} (the last
user text).

Fault format (a JSON object, or a list of them; the first applicable one is used)::

    {"kind": "status", "code": 503, "body": {...} | "text", "headers": {...},
     "preset": "cloudflare" | "usage_limit" | "overloaded" | "server_error" | "unavailable"
               | "rate_limit" | "unauthorized",
     "times": 2,                 # apply to the next 2 matching requests, then heal
     "transport": "http" | "ws" | "any",
     "model": "o1-pro",          # only requests (and WebSocket turns) for this model
     "resets_in_seconds": 7200}  # usage_limit preset: when its window resets

A C{refuse} fault applies only to a request it refuses (one carrying what its template
quotes), so a list of them acts together as upstream's validations do: each request gets
the first refusal that fits it, and a request none fits is served (nor does it count down
their C{times}).

Seeded random faults (chaos mode) and the per-turn generation ledger are
L{relay.emulator.chaos}.

Kinds: C{reset_before_headers}, C{hang_before_headers}, C{hang_after_headers}, C{status},
C{delay_first_output} (C{seconds}), C{stall_after_events} (C{events}, C{seconds}: send that
many events, then nothing for that long, then the rest), C{cut_after_events} (C{events}),
C{end_after_events} (C{events}), C{stream_error} (C{code}, C{message}), C{empty_completed},
C{refuse} (C{template}, C{code}, C{param}, C{wire}: a refusal quoting the request, as
OpenAI words it; L{relay.emulator.refusals}),
C{ws_handshake_status} (C{code}, C{body}, C{headers}), C{ws_handshake_reset} and
C{ws_handshake_hang}.  The three C{ws_handshake_*} kinds apply to WebSocket upgrades only;
every other kind applies to HTTP requests and WebSocket turns (filtered by C{transport}).

What the stream-shaping kinds look like on each wire:

  - C{cut_after_events}: K events, then the connection is lost without a terminal event
    (HTTP: the TCP connection is closed mid-body, so the chunked body never ends; WebSocket:
    TCP closed without a close frame).  A non-stream request gets its status line, headers and
    the first half of the JSON body, then the same cut (a read error mid-body).
  - C{end_after_events}: K events, then a I{clean} end without a terminal event (HTTP: the
    chunked body ends normally; WebSocket: a close frame with code 1000 mid-turn).  A
    non-stream request gets 200 and the first half of the JSON body, ended cleanly.
  - C{stream_error}: on a Responses stream or WebSocket turn, C{response.created} then
    C{response.failed} with the code; on a Chat Completions stream, the role chunk, then an
    error chunk C{{"error": {"type": "server_error", "code": ...}}}, then the body ends
    (no C{[DONE]}); a non-stream request (either endpoint) gets HTTP 500 with the error
    envelope carrying the code, as the real API answers a failed non-stream request.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from typing import Any

from attrs import define, field, frozen
from twisted.internet.interfaces import IReactorTime

from relay.emulator.refusals import checkSpec, refusalFor
from relay.emulator.sealing import foreignItem, invalidContentError, seal

HTTP = "http"
WS = "ws"
ANY = "any"

HANDSHAKE_KINDS = frozenset({"ws_handshake_status", "ws_handshake_reset", "ws_handshake_hang"})
"""Fault kinds that apply to a WebSocket upgrade rather than to a request or turn."""

TURN_KINDS = frozenset(
    {
        "reset_before_headers",
        "hang_before_headers",
        "hang_after_headers",
        "status",
        "delay_first_output",
        "stall_after_events",
        "cut_after_events",
        "end_after_events",
        "stream_error",
        "empty_completed",
        "refuse",
    }
)
"""Fault kinds that apply to an HTTP request or a WebSocket turn."""

DEFAULT_TEXT = "Hello from the relay emulator (account {credential_name})"
"""The reply text when no script says otherwise."""

DEFAULT_MODELS = ("gpt-5.5", "gpt-5.4", "gpt-5.4-mini", "gpt-4.1")
"""Model ids listed by C{GET /v1/models}."""

_CLOUDFLARE_HTML = (
    "<!DOCTYPE html>\n<html><head><title>Attention Required! | Cloudflare</title></head>"
    "<body><h1>Sorry, you have been blocked</h1>"
    "<p>You are unable to access chatgpt.com</p>"
    "<p>Cloudflare Ray ID: 8f1e2d3c4b5a6978</p></body></html>\n"
)


def _preset(name: str, now: float, resetsIn: float = 7200) -> dict[str, Any]:
    """
    Build the status-fault fields of a named preset.

    @param name: the preset name.
    @type name: L{str}
    @param now: the current time in Unix seconds, for reset timestamps.
    @type now: L{float}
    @param resetsIn: seconds until the C{usage_limit} preset's primary window resets.
    @return: C{code}, C{body} and C{headers} for the preset.
    @rtype: L{dict}
    @raise ValueError: for an unknown preset.
    """
    if name == "cloudflare":
        return {
            "code": 403,
            "body": _CLOUDFLARE_HTML,
            "headers": {
                "content-type": "text/html; charset=UTF-8",
                "server": "cloudflare",
                "cf-ray": "8f1e2d3c4b5a6978-FRA",
            },
        }
    if name == "usage_limit":
        resetAt = int(now + resetsIn)
        return {
            "code": 429,
            "body": {
                "error": {
                    "type": "usage_limit_reached",
                    "message": "The usage limit has been reached",
                    "plan_type": "plus",
                    "resets_at": resetAt,
                    "resets_in_seconds": int(resetsIn),
                }
            },
            "headers": {
                "x-codex-primary-used-percent": "100",
                "x-codex-primary-window-minutes": "300",
                "x-codex-primary-reset-at": str(resetAt),
                "x-codex-secondary-used-percent": "42",
                "x-codex-secondary-window-minutes": "10080",
                "x-codex-secondary-reset-at": str(int(now) + 86400),
                "x-codex-plan-type": "plus",
            },
        }
    if name == "rate_limit":
        return {
            "code": 429,
            "body": _errorBody(
                "Rate limit reached for requests. Please try again in 2s.",
                "requests",
                "rate_limit_exceeded",
            ),
            "headers": {"retry-after": "2"},
        }
    if name == "overloaded":
        return {
            "code": 529,
            "body": _errorBody(
                "Our servers are currently overloaded. Please try again later.",
                "server_error",
                "server_is_overloaded",
            ),
            "headers": {},
        }
    if name == "server_error":
        return {
            "code": 500,
            "body": _errorBody(
                "The server had an error while processing your request. Sorry about that!",
                "server_error",
                None,
            ),
            "headers": {},
        }
    if name == "unavailable":
        return {
            "code": 503,
            "body": _errorBody(
                "The engine is currently overloaded, please try again later",
                "server_error",
                None,
            ),
            "headers": {},
        }
    if name == "unauthorized":
        return {"code": 401, "body": invalidKeyBody(), "headers": {}}
    raise ValueError(f"unknown fault preset {name!r}")


def _errorBody(message: str, kind: str, code: str | None, param: str | None = None) -> dict:
    """
    Build an OpenAI error envelope.

    @param message: the human-readable message.
    @type message: L{str}
    @param kind: the error C{type}.
    @type kind: L{str}
    @param code: the error C{code}, or L{None}.
    @type code: L{str} or L{None}
    @param param: the offending parameter, or L{None}.
    @type param: L{str} or L{None}
    @return: C{{"error": {...}}}.
    @rtype: L{dict}
    """
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def invalidKeyBody() -> dict:
    """
    The body OpenAI answers for an unknown API key.

    @return: the 401 error envelope.
    @rtype: L{dict}
    """
    return _errorBody("Incorrect API key provided", "invalid_request_error", "invalid_api_key")


def previousNotFoundError(previousId: str) -> dict:
    """
    The inner error object for an unknown C{previous_response_id}.

    @param previousId: the id the client asked for.
    @type previousId: L{str}
    @return: the C{error} object (without the envelope).
    @rtype: L{dict}
    """
    return {
        "type": "invalid_request_error",
        "code": "previous_response_not_found",
        "message": f"Previous response with id '{previousId}' not found.",
        "param": "previous_response_id",
    }


COMPACTION_TRIGGER = "compaction_trigger"
"""The input item type that asks for a compaction turn (protocol.md 2.8)."""


def misplacedTrigger(items: list) -> bool:
    """
    Whether a C{compaction_trigger} sits anywhere but last in C{items}, or appears twice:
    upstream refuses such a request (behaviour.md R89).

    @param items: the request's input items.
    """
    positions = [i for i, item in enumerate(items)
                 if isinstance(item, dict) and item.get("type") == COMPACTION_TRIGGER]
    return bool(positions) and positions != [len(items) - 1]


def misplacedTriggerError() -> dict:
    """
    The 400 error object for a misplaced or repeated C{compaction_trigger}.
    """
    return _errorBody("compaction_trigger must be the last input item, and appear once.",
                      "invalid_request_error", "invalid_compaction_trigger", "input")["error"]


def inputError(items: list, account: str) -> dict | None:
    """
    What upstream refuses in a request's input before generating: a misplaced
    C{compaction_trigger}, or an item another account sealed.

    @param items: the normalised input items.
    @param account: the serving account's name.
    @return: the error object (the caller answers 400), or L{None}.
    """
    if misplacedTrigger(items):
        return misplacedTriggerError()
    foreign = foreignItem(items, account)
    if foreign is not None:
        return invalidContentError(foreign)
    return None


@frozen
class Fault:
    """
    One injected fault.

    @ivar kind: one of L{TURN_KINDS} or L{HANDSHAKE_KINDS}.
    @ivar transport: C{"http"}, C{"ws"} or C{"any"}.
    @ivar times: how many matching requests it still applies to; L{None} means forever.
    @ivar params: the remaining kind-specific fields (C{code}, C{body}, C{headers},
        C{seconds}, C{events}, C{message}).
    """

    kind: str
    transport: str = ANY
    times: int | None = None
    params: dict = field(factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """
        Look up a kind-specific parameter.

        @param key: the parameter name.
        @type key: L{str}
        @param default: returned when absent.
        @return: the value.
        """
        return self.params.get(key, default)

    def appliesTo(self, transport: str, handshake: bool) -> bool:
        """
        Whether this fault applies to a request of the given transport and stage.

        @param transport: C{"http"} or C{"ws"}.
        @type transport: L{str}
        @param handshake: C{True} for a WebSocket upgrade, C{False} for an HTTP request or a
            WebSocket turn.
        @type handshake: L{bool}
        @rtype: L{bool}
        """
        if (self.kind in HANDSHAKE_KINDS) != handshake:
            return False
        return self.transport in (ANY, transport) or handshake

    def toJSON(self) -> dict:
        """
        The fault as the JSON object it was parsed from (normalised).

        @rtype: L{dict}
        """
        out = {"kind": self.kind, "transport": self.transport, "times": self.times}
        out.update(self.params)
        return out


def parseFault(spec: dict, now: float = 0.0) -> Fault:
    """
    Parse and validate one fault object (see the module docstring).

    @param spec: the JSON object.
    @type spec: L{dict}
    @param now: the current time in Unix seconds, used by presets.
    @type now: L{float}
    @return: the fault.
    @rtype: L{Fault}
    @raise ValueError: for a malformed fault.
    """
    if not isinstance(spec, dict):
        raise ValueError("a fault must be a JSON object")
    params = dict(spec)
    kind = params.pop("kind", None)
    preset = params.pop("preset", None)
    if kind is None and preset is not None:
        kind = "status"
    if kind not in TURN_KINDS and kind not in HANDSHAKE_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}")
    transport = params.pop("transport", ANY)
    if transport not in (HTTP, WS, ANY):
        raise ValueError(f"fault transport must be http, ws or any, not {transport!r}")
    if "model" in params and not isinstance(params["model"], str):
        raise ValueError("fault model must be a model name")
    times = params.pop("times", None)
    if times is not None and (not isinstance(times, int) or times < 1):
        raise ValueError("fault times must be a positive integer")
    if preset is not None:
        resetsIn = params.pop("resets_in_seconds", 7200)
        if isinstance(resetsIn, bool) or not isinstance(resetsIn, (int, float)) or resetsIn < 0:
            raise ValueError("resets_in_seconds must be a number of seconds")
        base = _preset(preset, now, resetsIn)
        base.update(params)
        params = base
    if kind in ("status", "ws_handshake_status"):
        code = params.get("code")
        if not isinstance(code, int) or not 100 <= code <= 599:
            raise ValueError(f"{kind} fault needs an integer code, not {code!r}")
    if kind == "delay_first_output" and not isinstance(params.get("seconds"), (int, float)):
        raise ValueError("delay_first_output needs seconds")
    if kind == "stall_after_events" and (
        not isinstance(params.get("events"), int)
        or not isinstance(params.get("seconds"), (int, float))
    ):
        raise ValueError("stall_after_events needs events (an integer) and seconds")
    if kind in ("cut_after_events", "end_after_events") and not isinstance(
            params.get("events"), int):
        raise ValueError(f"{kind} needs events (an integer)")
    if kind == "refuse":
        checkSpec(params)
    return Fault(kind=kind, transport=transport, times=times, params=params)


def _fitsBody(fault: Fault, body: Any, endpoint: str) -> bool:
    """
    Whether C{fault} applies to a request with C{body}: its C{model}, when it names one,
    is the body's; a C{refuse} fault refuses the body. Without a body (a WebSocket
    upgrade, an unparsed request) only the C{model} filter can exclude it.
    """
    model = fault.get("model")
    if not isinstance(body, dict):
        return model is None
    if model is not None and body.get("model") != model:
        return False
    if fault.kind == "refuse":
        return refusalFor(fault.params, body, endpoint) is not None
    return True


def parseFaults(spec: Any, now: float = 0.0) -> list[Fault]:
    """
    Parse a fault object, a list of them, or L{None} (no fault).

    @param spec: the JSON value.
    @param now: the current time in Unix seconds.
    @type now: L{float}
    @return: the faults, in order.
    @rtype: L{list} of L{Fault}
    @raise ValueError: for a malformed fault.
    """
    if spec is None:
        return []
    if isinstance(spec, list):
        return [parseFault(each, now) for each in spec]
    return [parseFault(spec, now)]


@frozen
class ToolCall:
    """
    The function call a script answers with.

    @ivar name: the tool name, e.g. C{exec_command}.
    @ivar arguments: the JSON argument string.
    """

    name: str
    arguments: str


@frozen
class ReplyScript:
    """
    How an account answers.

    @ivar text: the reply text template.
    @ivar toolCall: the call to answer a fresh turn with, or L{None}.
    @ivar toolCalls: parallel calls to answer a fresh turn with (wins over
        C{toolCall}).
    @ivar delay: seconds between streamed events.
    @ivar deltas: how many deltas the text is split into.
    @ivar argumentDeltas: how many deltas each call's arguments are split
        into; 0 sends them only in C{response.function_call_arguments.done}.
    @ivar completedOutput: C{full}, C{empty}, or L{None} for the route's
        default (C{empty} on the OAuth route).
    @ivar ending: C{completed}, C{max_output_tokens} or C{content_filter}.
    @ivar usage: pinned usage numbers (C{input_tokens}, C{cached_tokens},
        C{output_tokens}, C{reasoning_tokens}); absent keys are estimated.
    @ivar reasoning: answers start with an encrypted C{reasoning} item (bound to the
        account, L{relay.emulator.sealing}) when the request's C{include} asks for
        C{reasoning.encrypted_content}, as reasoning models do for Codex.
    """

    text: str = DEFAULT_TEXT
    toolCall: ToolCall | None = None
    delay: float = 0.0
    deltas: int = 3
    toolCalls: tuple = ()
    argumentDeltas: int = 2
    completedOutput: str | None = None
    ending: str = "completed"
    usage: dict = field(factory=dict, hash=False)
    reasoning: bool = False

    def calls(self) -> tuple:
        """
        The calls a fresh turn answers with, possibly none.

        @rtype: L{tuple} of L{ToolCall}
        """
        if self.toolCalls:
            return self.toolCalls
        return (self.toolCall,) if self.toolCall is not None else ()


ENDINGS = ("completed", "max_output_tokens", "content_filter")
"""Script C{ending} values: a normal end, or C{response.incomplete} with that reason."""


def _toolCall(tool: Any) -> ToolCall:
    """
    Parse one C{tool_call} object.

    @raise ValueError: without a name.
    """
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ValueError("tool_call needs a name")
    args = tool.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, separators=(",", ":"))
    return ToolCall(name=tool["name"], arguments=args)


def parseScript(spec: dict | None) -> ReplyScript:
    """
    Parse a script object (see the module docstring).

    @param spec: the JSON object, or L{None} for the default script.
    @type spec: L{dict} or L{None}
    @rtype: L{ReplyScript}
    @raise ValueError: for a malformed script.
    """
    if spec is None:
        return ReplyScript()
    if not isinstance(spec, dict):
        raise ValueError("a script must be a JSON object")
    unknown = set(spec) - {
        "text", "tool_call", "tool_calls", "delay", "deltas", "argument_deltas",
        "completed_output", "ending", "usage", "reasoning",
    }
    if unknown:
        raise ValueError(f"unknown script keys: {sorted(unknown)}")
    tool = spec.get("tool_call")
    toolCall = _toolCall(tool) if tool is not None else None
    tools = spec.get("tool_calls")
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise ValueError("tool_calls must be a list")
    delay = spec.get("delay", 0.0)
    deltas = spec.get("deltas", 3)
    argumentDeltas = spec.get("argument_deltas", 2)
    if not isinstance(delay, (int, float)) or delay < 0:
        raise ValueError("delay must be a non-negative number")
    if not isinstance(deltas, int) or deltas < 1:
        raise ValueError("deltas must be a positive integer")
    if not isinstance(argumentDeltas, int) or argumentDeltas < 0:
        raise ValueError("argument_deltas must be a non-negative integer")
    completedOutput = spec.get("completed_output")
    if completedOutput not in (None, "full", "empty"):
        raise ValueError('completed_output must be "full" or "empty"')
    ending = spec.get("ending", "completed")
    if ending not in ENDINGS:
        raise ValueError(f"ending must be one of {list(ENDINGS)}")
    usage = spec.get("usage") or {}
    if not isinstance(usage, dict) or set(usage) - set(USAGE_KEYS) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in usage.values()
    ):
        raise ValueError(f"usage must map some of {list(USAGE_KEYS)} to non-negative integers")
    return ReplyScript(
        text=str(spec.get("text", DEFAULT_TEXT)), toolCall=toolCall, delay=float(delay),
        deltas=deltas, toolCalls=tuple(_toolCall(t) for t in tools),
        argumentDeltas=argumentDeltas, completedOutput=completedOutput, ending=ending,
        usage=dict(usage), reasoning=bool(spec.get("reasoning", False)),
    )


USAGE_KEYS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")
"""The usage numbers a script may pin."""


class _Template(string.Formatter):
    """
    A formatter that leaves unknown fields as they are instead of raising.
    """

    def get_value(self, key, args, kwargs):  # noqa: N802 - Formatter API
        """
        Look up a field, keeping unknown ones literally.

        @param key: the field name or index.
        @param args: positional arguments.
        @param kwargs: keyword arguments.
        @return: the value, or the literal placeholder.
        """
        if isinstance(key, str):
            return kwargs.get(key, "{" + key + "}")
        return super().get_value(key, args, kwargs)


def renderText(template: str, **fields: str) -> str:
    """
    Fill a text template, leaving unknown placeholders as they are.

    @param template: the template.
    @type template: L{str}
    @param fields: the values.
    @return: the text.
    @rtype: L{str}
    """
    try:
        return _Template().format(template, **fields)
    except (ValueError, IndexError):
        return template


@frozen
class Reply:
    """
    What one turn answers.

    @ivar text: the text, when the answer is a message.
    @ivar toolCalls: the calls, when the answer is one or more function calls.
    @ivar ending: C{completed}, C{max_output_tokens} or C{content_filter}.
    @ivar compaction: for a compaction turn (input ending with C{compaction_trigger},
        protocol.md 2.8), the account-bound C{encrypted_content} of the one C{compaction}
        item the turn answers with (L{relay.emulator.sealing}); else L{None}.
    @ivar reasoning: the account-bound C{encrypted_content} of a C{reasoning} item the answer
        starts with (a script's C{reasoning: true} and C{include: ["reasoning.encrypted_content"]}),
        or L{None}.
    """

    text: str | None = None
    toolCalls: tuple = ()
    ending: str = "completed"
    compaction: str | None = None
    reasoning: str | None = None

    @property
    def toolCall(self) -> ToolCall | None:
        """
        The first call, or L{None}.
        """
        return self.toolCalls[0] if self.toolCalls else None


def _lastUserText(items: list) -> str:
    """
    Find the text of the last user message among Responses input items or chat messages.

    @param items: the items.
    @type items: L{list}
    @rtype: L{str}
    """
    for item in reversed(items):
        if not isinstance(item, dict) or item.get("role") != "user":
            continue
        content = item.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = [
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            ]
            return " ".join(texts)
    return ""


def normaliseInput(raw: Any) -> list:
    """
    Turn a Responses C{input} (a string or a list of items) into a list of items.

    @param raw: the C{input} value.
    @rtype: L{list}
    """
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if isinstance(raw, list):
        return raw
    return []


def chooseReply(script: ReplyScript, items: list, accountName: str, model: str,
                include: Any = None) -> Reply:
    """
    Pick the answer for a turn: one compaction item for a compaction turn (the last input item
    is C{compaction_trigger}); text after a tool output or a compaction item (the turn resumes
    from the compacted window); otherwise the scripted tool call, otherwise text.

    Works for Responses input items (C{function_call_output}) and chat messages
    (C{role: tool}).

    @param script: the account's script.
    @type script: L{ReplyScript}
    @param items: the request's input items or chat messages.
    @type items: L{list}
    @param accountName: the account name, for the template (never the credential).
    @type accountName: L{str}
    @param model: the requested model.
    @type model: L{str}
    @param include: the request's C{include} list (Responses), or L{None}.
    @rtype: L{Reply}
    """
    last = items[-1] if items and isinstance(items[-1], dict) else {}
    if last.get("type") == COMPACTION_TRIGGER:
        return Reply(compaction=seal(accountName, "compaction"))
    reasoning = None
    if script.reasoning and isinstance(include, list) and \
            "reasoning.encrypted_content" in include:
        reasoning = seal(accountName, "reasoning")
    toolOutput = None
    if last.get("type") == "function_call_output":
        toolOutput = last.get("output", "")
    elif last.get("role") == "tool":
        toolOutput = last.get("content", "")
    if not isinstance(toolOutput, (str, type(None))):
        toolOutput = json.dumps(toolOutput)
    if last.get("type") == "compaction":
        # The turn resumes after a compaction (Codex appends the compaction item to the
        # context it re-sends): the work it summarised is done, so the model answers.
        toolOutput = ""
    if toolOutput is None and script.calls():
        return Reply(toolCalls=script.calls(), ending=script.ending, reasoning=reasoning)
    output = (toolOutput or "").strip()
    marker = output.rfind("Output:\n")
    result = output[marker + len("Output:\n"):].strip() if marker >= 0 else output
    text = renderText(
        script.text, name=accountName, credential_name=accountName, output=output,
        result=result, model=model, input=_lastUserText(items),
    )
    return Reply(text=text, ending=script.ending, reasoning=reasoning)


def splitText(text: str, pieces: int) -> list[str]:
    """
    Split text into at most C{pieces} non-empty consecutive fragments.

    @param text: the text.
    @type text: L{str}
    @param pieces: the maximum number of fragments.
    @type pieces: L{int}
    @rtype: L{list} of L{str}
    """
    if not text:
        return [""]
    pieces = max(1, min(pieces, len(text)))
    size = -(-len(text) // pieces)
    return [text[i : i + size] for i in range(0, len(text), size)]


def estimateTokens(value: Any) -> int:
    """
    A rough token count: a quarter of the JSON size, at least one.

    @param value: any JSON value.
    @rtype: L{int}
    """
    if value is None:
        return 0
    raw = value if isinstance(value, str) else json.dumps(value)
    return max(1, len(raw) // 4)


def newId(prefix: str) -> str:
    """
    A fresh random id such as C{resp_0f3a…}.

    @param prefix: C{resp}, C{msg}, C{fc}, C{call} or C{chatcmpl}.
    @type prefix: L{str}
    @rtype: L{str}
    """
    sep = "-" if prefix == "chatcmpl" else "_"
    return prefix + sep + secrets.token_hex(12)


def usageFor(inputTokens: int, outputTokens: int, pinned: dict | None = None) -> dict:
    """
    A Responses C{usage} object (protocol.md §2.7).

    @param inputTokens: input tokens (estimated).
    @type inputTokens: L{int}
    @param outputTokens: output tokens (estimated).
    @type outputTokens: L{int}
    @param pinned: a script's C{usage} numbers, which win over the estimates.
    @type pinned: L{dict} or L{None}
    @rtype: L{dict}
    """
    pinned = pinned or {}
    inputTokens = pinned.get("input_tokens", inputTokens)
    outputTokens = pinned.get("output_tokens", outputTokens)
    return {
        "input_tokens": inputTokens,
        "input_tokens_details": {"cached_tokens": pinned.get("cached_tokens", 0)},
        "output_tokens": outputTokens,
        "output_tokens_details": {"reasoning_tokens": pinned.get("reasoning_tokens", 0)},
        "total_tokens": inputTokens + outputTokens,
    }


def chatUsageFor(promptTokens: int, completionTokens: int, pinned: dict | None = None) -> dict:
    """
    A Chat Completions C{usage} object (protocol.md §3).

    @param promptTokens: prompt tokens (estimated).
    @type promptTokens: L{int}
    @param completionTokens: completion tokens (estimated).
    @type completionTokens: L{int}
    @param pinned: a script's C{usage} numbers, which win over the estimates.
    @type pinned: L{dict} or L{None}
    @rtype: L{dict}
    """
    usage = usageFor(promptTokens, completionTokens, pinned)
    return {
        "prompt_tokens": usage["input_tokens"],
        "completion_tokens": usage["output_tokens"],
        "total_tokens": usage["total_tokens"],
        "prompt_tokens_details": dict(usage["input_tokens_details"]),
        "completion_tokens_details": dict(usage["output_tokens_details"]),
    }


HOSTED_CALLS = {
    "web_search": {"type": "web_search_call", "action": {"type": "search", "query": "emulated"}},
    "file_search": {"type": "file_search_call", "queries": ["emulated"], "results": None},
    "code_interpreter": {"type": "code_interpreter_call", "code": "print(1)", "outputs": None,
                         "container_id": "cntr_emulated"},
    "image_generation": {"type": "image_generation_call", "result": ""},
}
"""The output item of each hosted tool (its type minus C{_call}), as OpenAI reports it."""


def servedTier(body: dict) -> str:
    """
    The C{service_tier} a response reports: the request's C{priority},
    C{flex} or C{scale}, else C{default} (what C{auto} is served at).

    @param body: the request body.
    @rtype: L{str}
    """
    tier = body.get("service_tier")
    return tier if tier in ("priority", "flex", "scale") else "default"


def hostedCalls(body: dict) -> list:
    """
    The hosted-tool call items a turn reports: one per hosted tool
    (C{web_search}, C{file_search}, C{code_interpreter}, C{image_generation})
    in C{tools} when C{tool_choice} is C{required}, or one for the tool
    C{tool_choice} names (C{{"type": "web_search"}}); none otherwise (the
    model decides, and the emulator's never calls one by itself).

    @param body: the request body.
    @return: completed output items.
    """
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    choice = body.get("tool_choice")
    named = choice.get("type") if isinstance(choice, dict) else None
    items = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            continue
        base = "web_search" if kind.startswith("web_search") else kind
        if base not in HOSTED_CALLS:
            continue
        if choice == "required" or named == kind or named == base:
            item = dict(HOSTED_CALLS[base], id=newId("hc"), status="completed")
            if base == "image_generation":
                item.update(_imageCall(tool, body))
            items.append(item)
    return items


def _imageCall(tool: dict, body: dict) -> dict:
    """
    What an C{image_generation_call} item carries besides its type: the
    image (a PNG in base64, L{relay.emulator.pictures.pngImage}), the prompt
    as revised (the last user text) and the tool's settings as served.
    """
    from relay.emulator.pictures import pngImage

    def setting(name: str, default: str) -> str:
        value = tool.get(name)
        return value if isinstance(value, str) and value and value != "auto" else default

    return {"result": pngImage(), "revised_prompt": _lastUserText(normaliseInput(
        body.get("input"))), "background": setting("background", "opaque"),
        "output_format": setting("output_format", "png"),
        "quality": setting("quality", "medium"), "size": setting("size", "1024x1024")}


def responseObject(
    responseId: str, body: dict, createdAt: float, status: str, output: list,
    usage: dict | None,
) -> dict:
    """
    A Responses C{response} object (protocol.md §2.7), echoing request fields.

    @param responseId: the C{resp_…} id.
    @type responseId: L{str}
    @param body: the request body.
    @type body: L{dict}
    @param createdAt: Unix seconds.
    @type createdAt: L{float}
    @param status: C{in_progress}, C{completed}, C{failed}, …
    @type status: L{str}
    @param output: the output items.
    @type output: L{list}
    @param usage: the usage, or L{None}.
    @type usage: L{dict} or L{None}
    @rtype: L{dict}
    """
    return {
        "id": responseId,
        "object": "response",
        "created_at": int(createdAt),
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model") or "gpt-5.5",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "service_tier": servedTier(body),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.get("metadata") or {},
    }


@frozen
class Turn:
    """
    The planned events of one Responses turn.

    @ivar responseId: the C{resp_…} id.
    @ivar events: the events, with C{sequence_number}s, ending with the terminal event.
    @ivar final: the final C{response} object (what a non-stream request returns).
    @ivar firstOutput: the index of the first event after C{response.in_progress} (where
        C{delay_first_output} waits).
    """

    responseId: str
    events: list
    final: dict
    firstOutput: int


def buildTurn(
    body: dict, reply: Reply | None, now: float, fault: Fault | None = None, deltas: int = 3,
    argumentDeltas: int = 2, emptyOutput: bool = False, usage: dict | None = None,
) -> Turn:
    """
    Plan the events of one Responses turn (protocol.md §2.3, §2.4).

    @param body: the request body (or WebSocket frame).
    @type body: L{dict}
    @param reply: the answer, or L{None} for a prewarm (C{generate:false}), which produces
        C{response.created} and an empty C{response.completed}.
    @type reply: L{Reply} or L{None}
    @param now: Unix seconds.
    @type now: L{float}
    @param fault: a C{stream_error} or C{empty_completed} fault shaping the turn, or L{None}.
    @type fault: L{Fault} or L{None}
    @param deltas: how many C{response.output_text.delta} events the text is split into.
    @type deltas: L{int}
    @param argumentDeltas: how many C{response.function_call_arguments.delta} events each
        call's arguments are split into; 0 sends none (the arguments arrive only in
        C{response.function_call_arguments.done} and the finished item).
    @type argumentDeltas: L{int}
    @param emptyOutput: the terminal event carries C{output: []}, as the ChatGPT backend's
        does; the items are only in the C{response.output_item.done} events.
    @type emptyOutput: L{bool}
    @param usage: the script's pinned usage numbers, or L{None}.
    @type usage: L{dict} or L{None}
    @rtype: L{Turn}
    """
    rid = newId("resp")
    items = normaliseInput(body.get("input"))
    inputTokens = estimateTokens(items) + estimateTokens(body.get("instructions"))
    events: list[dict] = []

    def emit(kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": len(events)}
        event.update(fields)
        events.append(event)

    emit("response.created", response=responseObject(rid, body, now, "in_progress", [], None))
    kind = fault.kind if fault is not None else None
    if kind == "stream_error":
        failed = responseObject(rid, body, now, "failed", [], None)
        failed["error"] = dict(fault.get("error")) if isinstance(fault.get("error"), dict) else {
            "code": fault.get("code", "server_error"),
            "message": fault.get("message", "The emulator injected a stream error."),
        }
        emit("response.failed", response=failed)
        return Turn(rid, events, failed, 1)
    if kind == "empty_completed":
        final = responseObject(rid, body, now, "completed", [], None)
        emit("response.completed", response=final)
        return Turn(rid, events, final, 1)
    if reply is None:
        final = responseObject(rid, body, now, "completed", [], usageFor(inputTokens, 0))
        emit("response.completed", response=final)
        return Turn(rid, events, final, 1)
    emit("response.in_progress", response=responseObject(rid, body, now, "in_progress", [], None))
    firstOutput = len(events)
    ending = reply.ending
    output: list = []
    if reply.compaction is not None:
        # protocol.md 2.8: one compaction item, delivered in output_item.done (the
        # ChatGPT backend's response.completed then carries output: []).
        item = {"type": "compaction", "id": newId("cmp"), "encrypted_content": reply.compaction}
        emit("response.output_item.added", output_index=0, item=dict(item))
        emit("response.output_item.done", output_index=0, item=item)
        final = responseObject(rid, body, now, "completed", [item],
                               usageFor(inputTokens, max(1, inputTokens // 10), usage))
        emit("response.completed", response=dict(final, output=[]) if emptyOutput else final)
        return Turn(rid, events, final, firstOutput)
    if reply.reasoning is not None:
        item = {"type": "reasoning", "id": newId("rs"), "summary": [],
                "encrypted_content": reply.reasoning}
        emit("response.output_item.added", output_index=0, item=dict(item))
        emit("response.output_item.done", output_index=0, item=item)
        output.append(item)
    for item in hostedCalls(body):
        # Hosted tools the request made the model use (R109's per-call price).
        emit("response.output_item.added", output_index=len(output),
             item=dict(item, status="in_progress"))
        emit("response.output_item.done", output_index=len(output), item=item)
        output.append(item)
    base = len(output)
    if reply.toolCalls:
        outputTokens = 0
        for index, call in enumerate(reply.toolCalls):
            fid = newId("fc")
            item = {
                "type": "function_call", "id": fid, "call_id": newId("call"),
                "name": call.name, "arguments": "", "status": "in_progress",
            }
            at = base + index
            emit("response.output_item.added", output_index=at, item=dict(item))
            if argumentDeltas > 0:
                for piece in splitText(call.arguments, argumentDeltas):
                    emit("response.function_call_arguments.delta", item_id=fid,
                         output_index=at, delta=piece)
            emit("response.function_call_arguments.done", item_id=fid, output_index=at,
                 arguments=call.arguments)
            item.update(arguments=call.arguments, status="completed")
            emit("response.output_item.done", output_index=at, item=item)
            output.append(item)
            outputTokens += estimateTokens(call.arguments) + 5
    else:
        text = reply.text or ""
        limit = body.get("max_output_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < \
                estimateTokens(text):
            # OpenAI stops at the limit and ends with response.incomplete.
            text = text[: limit * 4]
            ending = "max_output_tokens"
        elif ending != "completed":
            text = text[: max(1, len(text) // 2)]
        mid = newId("msg")
        item = {"type": "message", "id": mid, "role": "assistant", "content": [],
                "status": "in_progress"}
        emit("response.output_item.added", output_index=base, item=dict(item))
        emit("response.content_part.added", item_id=mid, output_index=base, content_index=0,
             part={"type": "output_text", "text": "", "annotations": []})
        for piece in splitText(text, deltas):
            emit("response.output_text.delta", item_id=mid, output_index=base,
                 content_index=0, delta=piece, logprobs=[])
        emit("response.output_text.done", item_id=mid, output_index=base, content_index=0,
             text=text, logprobs=[])
        part = {"type": "output_text", "text": text, "annotations": []}
        emit("response.content_part.done", item_id=mid, output_index=base, content_index=0,
             part=part)
        item.update(content=[part],
                    status="incomplete" if ending != "completed" else "completed")
        emit("response.output_item.done", output_index=base, item=item)
        output.append(item)
        outputTokens = estimateTokens(text)
    status = "incomplete" if ending != "completed" else "completed"
    final = responseObject(rid, body, now, status, output,
                           usageFor(inputTokens, outputTokens, usage))
    if status == "incomplete":
        final["incomplete_details"] = {"reason": ending}
    terminal = dict(final, output=[]) if emptyOutput else final
    emit("response." + status, response=terminal)
    return Turn(rid, events, final, firstOutput)


def sseFrame(event: dict) -> bytes:
    """
    Encode one Responses event as an SSE C{event:}/C{data:} pair.

    @param event: the event.
    @type event: L{dict}
    @rtype: L{bytes}
    """
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def chatChunks(
    body: dict, reply: Reply, now: float, includeUsage: bool, argumentDeltas: int = 2,
    usage: dict | None = None,
) -> tuple[list[dict], dict]:
    """
    Plan a Chat Completions answer (protocol.md §3).

    @param body: the request body.
    @type body: L{dict}
    @param reply: the answer: text, or one or more (parallel) tool calls; its C{ending}
        gives C{finish_reason} C{length} or C{content_filter} (after half the text).
    @type reply: L{Reply}
    @param now: Unix seconds.
    @type now: L{float}
    @param includeUsage: C{stream_options.include_usage}.
    @type includeUsage: L{bool}
    @param argumentDeltas: how many chunks each call's arguments are split into (0 or 1:
        the whole arguments in the call's first chunk).
    @type argumentDeltas: L{int}
    @param usage: the script's pinned usage numbers, or L{None}.
    @type usage: L{dict} or L{None}
    @return: the stream chunks (without C{[DONE]}) and the non-stream completion object.
    @rtype: L{tuple}
    """
    cid = newId("chatcmpl")
    model = body.get("model") or "gpt-5.5"
    created = int(now)
    promptTokens = estimateTokens(body.get("messages"))
    extra = {"usage": None} if includeUsage else {}

    def chunk(delta: dict, finish: str | None) -> dict:
        out = {
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "service_tier": servedTier(body),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        out.update(extra)
        return out

    chunks = [chunk({"role": "assistant", "content": ""}, None)]
    if reply.toolCalls:
        calls = []
        completionTokens = 0
        for index, call in enumerate(reply.toolCalls):
            callId = newId("call")
            pieces = splitText(call.arguments, max(1, argumentDeltas))
            chunks.append(chunk({"tool_calls": [{
                "index": index, "id": callId, "type": "function",
                "function": {"name": call.name, "arguments": pieces[0]}}]}, None))
            for piece in pieces[1:]:
                chunks.append(chunk({"tool_calls": [{
                    "index": index, "function": {"arguments": piece}}]}, None))
            calls.append({"id": callId, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}})
            completionTokens += estimateTokens(call.arguments) + 5
        message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
        finish = "tool_calls"
    else:
        text = reply.text or ""
        if reply.ending != "completed":
            text = text[: max(1, len(text) // 2)]
        for piece in splitText(text, 3):
            chunks.append(chunk({"content": piece}, None))
        message = {"role": "assistant", "content": text, "refusal": None}
        finish = "stop"
        completionTokens = estimateTokens(text)
    finish = {"max_output_tokens": "length", "content_filter": "content_filter"}.get(
        reply.ending, finish
    )
    chunks.append(chunk({}, finish))
    usage = chatUsageFor(promptTokens, completionTokens, usage)
    if includeUsage:
        last = chunk({}, None)
        last["choices"] = []
        last["usage"] = usage
        chunks.append(last)
    completion = {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "service_tier": servedTier(body),
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }
    return chunks, completion


def anonymousName(credential: str) -> str:
    """
    A stable, non-secret name for a credential that has no configured account.

    @param credential: the bearer token.
    @type credential: L{str}
    @rtype: L{str}
    """
    return "key-" + hashlib.sha256(credential.encode()).hexdigest()[:8]


@frozen
class RecordedRequest:
    """
    One request the emulator received.

    @ivar credential: the bearer token (L{None} when absent).
    @ivar name: the account name (never secret).
    @ivar transport: C{"http"} or C{"ws"}.
    @ivar kind: C{"request"} (an HTTP request), C{"handshake"} (a WebSocket upgrade) or
        C{"frame"} (one WebSocket C{response.create}).
    @ivar path: the request path.
    @ivar method: the HTTP method (C{GET} for handshakes and frames).
    @ivar headers: lower-cased header names to values (the upgrade headers for frames).
    @ivar body: the parsed JSON body or frame, or L{None}.
    @ivar peer: the peer's host.
    @ivar time: when it arrived, in the clock's seconds.
    """

    credential: str | None
    name: str
    transport: str
    kind: str
    path: str
    method: str
    headers: dict
    body: Any
    peer: str | None
    time: float

    def __getitem__(self, key: str) -> Any:
        """
        Dict-style access to a field, e.g. C{record["credential"]}.

        @param key: the field name.
        @type key: L{str}
        @return: the value.
        @raise KeyError: for an unknown field.
        """
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def toJSON(self) -> dict:
        """
        The record with secrets redacted, for the control API.

        @rtype: L{dict}
        """
        headers = {
            k: ("Bearer ***" if k == "authorization" else v) for k, v in self.headers.items()
        }
        return {
            "name": self.name, "transport": self.transport, "kind": self.kind,
            "path": self.path, "method": self.method, "headers": headers, "body": self.body,
            "peer": self.peer, "time": self.time,
        }


@frozen
class AccountSpec:
    """
    A configured account.

    @ivar name: its public name.
    @ivar credential: its bearer token.
    """

    name: str
    credential: str


@define(eq=False)
class EmulatorState:
    """
    Everything the emulator remembers: accounts, scripts, faults, recordings and in-flight
    turns (stored responses are L{relay.emulator.stored}).

    @ivar clock: the time source.
    @ivar acceptAny: whether unknown credentials are served (as anonymous accounts).
    @ivar requests: the recorded requests, oldest first.
    """

    clock: IReactorTime
    acceptAny: bool = True
    requests: list = field(factory=list)
    _accounts: dict = field(factory=dict)
    _byName: dict = field(factory=dict)
    _scripts: dict = field(factory=dict)
    _faults: dict = field(factory=dict)
    _inflight: dict = field(factory=dict)
    _peak: dict = field(factory=dict)

    def addAccount(self, name: str, credential: str) -> None:
        """
        Configure an account.

        @param name: its public name.
        @type name: L{str}
        @param credential: its bearer token.
        @type credential: L{str}
        """
        self._accounts[credential] = AccountSpec(name, credential)
        self._byName[name] = credential

    def resolve(self, credentialOrName: str) -> str:
        """
        Map an account name (or C{"*"}, or a credential) to the key faults and scripts use.

        @param credentialOrName: a credential, an account name, or C{"*"} for every account.
        @type credentialOrName: L{str}
        @rtype: L{str}
        """
        return self._byName.get(credentialOrName, credentialOrName)

    def known(self, credential: str | None) -> bool:
        """
        Whether a credential may be served.

        @param credential: the bearer token, or L{None}.
        @rtype: L{bool}
        """
        if not credential:
            return False
        return self.acceptAny or credential in self._accounts

    def nameOf(self, credential: str | None) -> str:
        """
        The public name of a credential.

        @param credential: the bearer token, or L{None}.
        @rtype: L{str}
        """
        if not credential:
            return "anonymous"
        spec = self._accounts.get(credential)
        return spec.name if spec is not None else anonymousName(credential)

    def names(self) -> dict:
        """
        Every credential seen or configured, mapped to its name.

        @rtype: L{dict}
        """
        out = {c: s.name for c, s in self._accounts.items()}
        for cred in list(self._inflight) + list(self._peak):
            out.setdefault(cred, self.nameOf(cred))
        return out

    def setScript(self, credentialOrName: str, spec: dict | None) -> None:
        """
        Set (or with L{None} reset) an account's script; C{"*"} sets the default.

        @param credentialOrName: a credential, an account name, or C{"*"}.
        @type credentialOrName: L{str}
        @param spec: the script object.
        @raise ValueError: for a malformed script.
        """
        key = self.resolve(credentialOrName)
        if spec is None:
            self._scripts.pop(key, None)
        else:
            self._scripts[key] = parseScript(spec)

    def scriptFor(self, credential: str | None) -> ReplyScript:
        """
        The script that applies to a credential.

        @param credential: the bearer token.
        @rtype: L{ReplyScript}
        """
        if credential in self._scripts:
            return self._scripts[credential]
        return self._scripts.get("*", ReplyScript())

    def setFault(self, credentialOrName: str, spec: Any) -> None:
        """
        Replace an account's faults; L{None} clears them and C{"*"} addresses every account
        without faults of its own.

        @param credentialOrName: a credential, an account name, or C{"*"}.
        @type credentialOrName: L{str}
        @param spec: a fault object, a list of them, or L{None}.
        @raise ValueError: for a malformed fault.
        """
        key = self.resolve(credentialOrName)
        faults = parseFaults(spec, self.clock.seconds())
        if faults:
            self._faults[key] = faults
        else:
            self._faults.pop(key, None)

    def clearFaults(self) -> None:
        """
        Remove every fault.
        """
        self._faults.clear()

    def faults(self) -> dict:
        """
        The current faults per account name, as JSON.

        @rtype: L{dict}
        """
        return {
            ("*" if key == "*" else self.nameOf(key)): [f.toJSON() for f in faults]
            for key, faults in self._faults.items()
        }

    def takeFault(self, credential: str | None, transport: str,
                  handshake: bool = False, body: Any = None,
                  endpoint: str = "responses") -> Fault | None:
        """
        Consume the fault that applies to the next request, counting down C{times}.

        @param credential: the bearer token.
        @param transport: C{"http"} or C{"ws"}.
        @type transport: L{str}
        @param handshake: whether this is a WebSocket upgrade.
        @type handshake: L{bool}
        @param body: the request body or C{response.create} frame, when known: a fault
            naming a C{model} applies only to a body for that model, and a C{refuse} fault
            only to a body it refuses (see the module docstring).
        @param endpoint: C{responses} or C{chat} (the fields a C{refuse} fault knows).
        @return: the fault, or L{None}.
        @rtype: L{Fault} or L{None}
        """
        key = credential if credential in self._faults else "*"
        faults = self._faults.get(key, [])
        for index, fault in enumerate(faults):
            if not fault.appliesTo(transport, handshake):
                continue
            if not _fitsBody(fault, body, endpoint):
                continue
            if fault.times is not None:
                if fault.times <= 1:
                    del faults[index]
                    if not faults:
                        del self._faults[key]
                else:
                    faults[index] = Fault(fault.kind, fault.transport, fault.times - 1,
                                          fault.params)
            return fault
        return None

    def record(self, credential: str | None, transport: str, kind: str, path: str,
               method: str, headers: dict, body: Any, peer: str | None) -> RecordedRequest:
        """
        Record a request.

        @param credential: the bearer token.
        @param transport: C{"http"} or C{"ws"}.
        @param kind: C{"request"}, C{"handshake"} or C{"frame"}.
        @param path: the path.
        @param method: the method.
        @param headers: lower-cased headers.
        @param body: the parsed body.
        @param peer: the peer host.
        @rtype: L{RecordedRequest}
        """
        rec = RecordedRequest(credential, self.nameOf(credential), transport, kind, path,
                              method, headers, body, peer, self.clock.seconds())
        self.requests.append(rec)
        return rec

    def turnStarted(self, credential: str | None) -> None:
        """
        Count a turn as in flight for a credential and update its peak.

        @param credential: the bearer token.
        """
        now = self._inflight.get(credential, 0) + 1
        self._inflight[credential] = now
        self._peak[credential] = max(self._peak.get(credential, 0), now)

    def turnEnded(self, credential: str | None) -> None:
        """
        Count a turn as finished.

        @param credential: the bearer token.
        """
        self._inflight[credential] = max(0, self._inflight.get(credential, 0) - 1)

    def inflight(self, credentialOrName: str) -> int:
        """
        Turns in flight now.

        @param credentialOrName: a credential or account name.
        @type credentialOrName: L{str}
        @rtype: L{int}
        """
        return self._inflight.get(self.resolve(credentialOrName), 0)

    def peak(self, credentialOrName: str) -> int:
        """
        The highest number of turns in flight at once since the last reset.

        @param credentialOrName: a credential or account name.
        @type credentialOrName: L{str}
        @rtype: L{int}
        """
        return self._peak.get(self.resolve(credentialOrName), 0)

    def resetPeaks(self) -> None:
        """
        Reset every peak to the current in-flight count.
        """
        self._peak = dict(self._inflight)

    def stats(self) -> dict:
        """
        In-flight and peak counts per account name.

        @rtype: L{dict}
        """
        return {
            name: {"inflight": self._inflight.get(cred, 0), "peak": self._peak.get(cred, 0)}
            for cred, name in self.names().items()
        }
