# -*- test-case-name: tests.test_control -*-
"""
The HTTP side the control plane's resources share: the admin
key check (relay's existing one, L{relay.console.admin}, behaviour.md
R99), the one place admin JSON bodies are read (L{readJSONBody}), the
error type the services raise (L{ControlError}) and how an answer is
written (L{deliver}).

Every admin route goes through the request intake (R103,
L{relay.entry.intake}): the admin key is checked at the headers (a request
without it is answered 401, or 404 with no admin key configured, and its
body is never read), the body is held bounded by
L{relay.entry.intake.ADMIN_BODY_LIMIT} (413 at once over it) and decoded at
the request level; L{readJSONBody} parses it through the intake's
C{request.relayJSON()} (deep nesting a 400). The admin check of
L{AdminLeaf} stays as a second line for resources mounted without the
intake (unit tests).
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Optional

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET

from relay.control.store import ControlStoreUnavailable, VersionConflict
from relay.entry.intake import ADMIN_BODY_LIMIT, RequestRefused
from relay.console.admin import errorBody, Guarded, respond
from relay.console.fields import FieldTypeError, checkTypes
from relay.base.requestnotes import notesOf

__all__ = [
    "AdminLeaf", "ControlError", "MAX_BODY_BYTES", "ServiceLeaf", "checkedTypes", "clientAddress",
    "deliver", "notFound", "pathId", "readJSONBody",
]

MAX_BODY_BYTES = ADMIN_BODY_LIMIT
"""The largest admin JSON body accepted, bytes (the intake's bound)."""

MAX_DEPTH = 16
"""The deepest nesting of arrays and objects accepted in an admin body."""

_log = Logger()


class ControlError(Exception):
    """
    A request the control plane refuses, in OpenAI's error envelope
    (protocol.md 2.6): nothing was changed.

    @ivar status: the HTTP status (400, 404, 409, 413, 503, ...).
    @ivar code: the machine code, e.g. C{invalid_account}.
    @ivar message: one line for a person, naming the field; never a
        secret.
    @ivar param: the offending field, or L{None}.
    @ivar extra: more top-level fields of the answer (never a secret).
    """

    def __init__(self, status: int, code: str, message: str, param: Optional[str] = None,
                 extra: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.extra = extra or {}

    def envelope(self) -> dict:
        """
        @return: the error body (with C{extra}'s fields beside C{error},
            e.g. the C{login} a refused paste leaves pending).
        """
        kind = "invalid_request_error" if self.status < 500 else "api_error"
        return dict(errorBody(self.message, kind, self.code, self.param), **self.extra)


class AdminLeaf(Guarded):
    """
    A control plane resource behind the admin key: 404 when no admin key
    is configured, 401 without it, a JSON 405 for other methods (the
    operator surface's own guard, R99).
    """


class ServiceLeaf(AdminLeaf):
    """
    An L{AdminLeaf} that answers with a control plane service's rules
    (accounts, logins, keys, groups, prices).

    @ivar service: the service (e.g.
        L{relay.control.keys.service.KeyService}).
    """

    def __init__(self, adminKey, service):
        super().__init__(adminKey)
        self.service = service

    def _note(self, request) -> dict:
        """
        @return: a new dict, left on the request as C{request.notes.audit}:
            the service writes the change's audit details into it for
            L{relay.control.audit} (never a secret).
        """
        note = {}
        notesOf(request).audit = note
        return note


def notFound() -> tuple:
    """
    @return: the C{(404, not_found envelope)} answer for L{deliver}.
    """
    return 404, ControlError(404, "not_found", "Not found").envelope()


def _depth(value, limit: int) -> bool:
    """
    @return: whether C{value} nests arrays and objects deeper than C{limit}.
    """
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return False


def readJSONBody(request, allowEmpty: bool = False, fields=None,
                 code: str = "invalid_type") -> dict:
    """
    Read an admin request's JSON object body: the one place the control
    plane reads bodies.

    @param request: the twisted.web request (its C{content}).
    @param allowEmpty: an empty body reads as C{{}} (actions whose options
        are optional).
    @param fields: the route's body table (field -> L{relay.console.fields.FieldType}),
        checked before the body is handed on (L{checkedTypes}); L{None}
        checks nothing.
    @param code: the error code of a field of the wrong type (the route's
        own code for a bad field, e.g. C{invalid_account}).
    @return: the parsed JSON object.
    @raise ControlError: 413 above L{MAX_BODY_BYTES}; 400 for a body that
        is not UTF-8 JSON, not an object, or nested deeper than
        L{MAX_DEPTH}; 400 C{code} naming a field of the wrong type.
    """
    return checkedTypes(_readJSONBody(request, allowEmpty), fields, code)


def checkedTypes(body: dict, fields, code: str = "invalid_type") -> dict:
    """
    @param body: a parsed admin body.
    @param fields: its table (field -> L{relay.console.fields.FieldType}),
        or L{None}.
    @param code: the error code of a field of the wrong type.
    @return: C{body}, when every field it names has its JSON type.
    @raise ControlError: 400 C{code} naming the first field of the wrong
        type (L{relay.console.fields.checkTypes}).
    """
    if fields is not None:
        try:
            checkTypes(body, fields)
        except FieldTypeError as e:
            raise ControlError(400, code, e.message, e.param) from None
    return body


def _readJSONBody(request, allowEmpty: bool) -> dict:
    """
    See L{readJSONBody}, without the type check.
    """
    parse = getattr(request, "relayJSON", None)
    if parse is not None:
        # R103: the intake's bounded, decoded body, parsed once.
        try:
            body = parse(allowEmpty=True)
        except RequestRefused as e:
            nested = "nest" in e.error.message
            raise ControlError(400, "invalid_json", "Request body is nested too deeply"
                               if nested else "Request body is not valid JSON") from None
        if not allowEmpty and notesOf(request).bodyBlank:
            raise ControlError(400, "invalid_json", "Request body must be a JSON object")
        return _checked(body)
    content = getattr(request, "content", None)
    raw = content.read(MAX_BODY_BYTES + 1) if content is not None else b""
    if len(raw) > MAX_BODY_BYTES:
        raise ControlError(413, "body_too_large",
                           f"Request body larger than {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        if allowEmpty:
            return {}
        raise ControlError(400, "invalid_json", "Request body must be a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ControlError(400, "invalid_json", "Request body is nested too deeply")
    except (ValueError, UnicodeDecodeError):
        raise ControlError(400, "invalid_json", "Request body is not valid JSON")
    return _checked(body)


def _checked(body) -> dict:
    """
    @return: C{body} when it is a JSON object nested at most L{MAX_DEPTH}.
    @raise ControlError: 400 otherwise.
    """
    if not isinstance(body, dict):
        raise ControlError(400, "invalid_json", "Request body must be a JSON object")
    if _depth(body, MAX_DEPTH):
        raise ControlError(400, "invalid_json", "Request body is nested too deeply")
    return body


def clientAddress(request) -> Optional[str]:
    """
    @return: the address of the peer that sent C{request} (the audit's
        "from which address"), or L{None}.
    """
    address = request.getClientAddress()
    return getattr(address, "host", None)


def pathId(segment: bytes) -> str:
    """
    An id from a path segment.

    @raise ControlError: 404 for a segment that is not UTF-8 or is empty.
    """
    try:
        value = segment.decode("utf-8")
    except UnicodeDecodeError:
        value = ""
    if not value:
        raise ControlError(404, "not_found", "Not found")
    return value


def deliver(request, work, what: str):
    """
    Run C{work} and answer C{request} with its C{(status, object)}, unless
    the client has gone. A L{ControlError} is its own answer; a
    L{VersionConflict} is 409 (someone changed the record meanwhile); an
    unreachable store is 503; anything else is a logged 500.

    @param work: a coroutine, a L{Deferred}, a C{(status, object)} answer,
        or a no-argument callable returning one of them (its synchronous
        L{ControlError} is answered too).
    @param what: what the work is, for the log (no secrets).
    @return: L{NOT_DONE_YET}.
    """
    try:
        if callable(work):
            work = work()
        if isinstance(work, Deferred):
            d = work
        elif inspect.iscoroutine(work):
            d = Deferred.fromCoroutine(work)
        else:
            d = succeed(work)
    except ControlError as e:
        request.write(respond(request, e.status, e.envelope()))
        request.finish()
        return NOT_DONE_YET
    gone = []
    request.notifyFinish().addErrback(lambda _: gone.append(True))

    def _ebAnswer(f: Failure):
        if f.check(ControlError):
            return f.value.status, f.value.envelope()
        if f.check(VersionConflict):
            return 409, errorBody(
                "The record changed meanwhile (another admin or process wrote it); read it"
                " again and retry", "invalid_request_error", "conflict")
        if f.check(ControlStoreUnavailable):
            _log.error("control store unavailable while {what}: {error}", what=what,
                       error=str(f.value), event="relay.control_store_unavailable")
            return 503, errorBody("The control store is unavailable; nothing was changed",
                                   "api_error", "control_store_unavailable")
        _log.failure("admin request failed while {what}", f, what=what,
                     event="relay.admin_failed")
        return 500, errorBody("Internal error while " + what, "api_error", "internal_error")

    def _write(answer: Any):
        if gone or request.finished:
            return
        status, obj = answer
        request.write(respond(request, status, obj))
        request.finish()

    d.addErrback(_ebAnswer)
    d.addCallback(_write)
    d.addErrback(lambda f: _log.failure("writing admin answer", f, event="relay.admin_failed"))
    return NOT_DONE_YET
