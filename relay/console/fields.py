# -*- test-case-name: tests.test_admin_fields -*-
"""
The JSON types of admin request bodies, checked in one place before any
rule reads a field (behaviour.md R99's admin surface; the 400 of
protocol.md 2.6).

Every admin write route declares its body as a table, field name ->
L{FieldType} (e.g. L{relay.control.accounts.records.ACCOUNT_BODY}), and
hands it to L{checkTypes} (through L{relay.control.web.readJSONBody} for
the control plane's routes): a value of the wrong JSON type -- a list
where a token belongs, an object for a name, a number for a string -- is
a L{FieldTypeError} naming the field's path (C{account.concurrency},
C{prices.gpt-5.5.input}, C{models[2]}), answered 400 with the route's own
code for a bad field (C{invalid_account}, C{invalid_key}, ...); nothing was
read or changed. C{null} passes (each route says what an
absent or null field means), and so do names outside the table (the
route answers an unknown field itself, naming it). Values are never
echoed: a secret in the wrong place stays out of the answer and the log.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from attrs import frozen

__all__ = [
    "ANY_OBJECT", "BOOLEAN", "FieldType", "FieldTypeError", "INTEGER", "NUMBER", "REASON_BODY",
    "STRING",
    "checkTypes", "describe", "listOf", "mapOf", "objectOf", "oneOf",
]


@frozen
class FieldType:
    """
    The JSON type a field's value must have.

    @ivar what: what it is, for the message (C{"a string"}).
    @ivar accepts: C{value -> bool} for the value itself (not its parts).
    @ivar items: for a list, the type of its items, or L{None}.
    @ivar values: for an object used as a map, the type of its values, or
        L{None}.
    @ivar fields: for an object with named fields, their table, or
        L{None}.
    """

    what: str
    accepts: Callable[[Any], bool]
    items: Optional["FieldType"] = None
    values: Optional["FieldType"] = None
    fields: Optional[Mapping[str, "FieldType"]] = None


class FieldTypeError(ValueError):
    """
    A field of an admin body has the wrong JSON type.

    @ivar param: the field's path (C{account.api_key}, C{models[0]}).
    @ivar message: one line naming it and the type expected, never the
        value.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def _isInteger(value) -> bool:
    """
    @return: whether C{value} is a JSON integer (not a boolean).
    """
    return isinstance(value, int) and not isinstance(value, bool)


def _isNumber(value) -> bool:
    """
    @return: whether C{value} is a JSON number (not a boolean).
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


STRING = FieldType("a string", lambda v: isinstance(v, str))
INTEGER = FieldType("an integer", _isInteger)
NUMBER = FieldType("a number", _isNumber)
BOOLEAN = FieldType("true or false", lambda v: isinstance(v, bool))
ANY_OBJECT = FieldType("an object", lambda v: isinstance(v, dict))


REASON_BODY = {"reason": STRING}
"""The optional body of a C{disable} action (accounts, keys)."""


def listOf(item: FieldType) -> FieldType:
    """
    @return: a list whose every item is an C{item}.
    """
    return FieldType(f"a list of {_plural(item.what)}", lambda v: isinstance(v, list), items=item)


def mapOf(value: FieldType) -> FieldType:
    """
    @return: an object of any names whose every value is a C{value}.
    """
    return FieldType(f"an object of {_plural(value.what)}", lambda v: isinstance(v, dict),
                     values=value)


def objectOf(fields: Mapping[str, FieldType]) -> FieldType:
    """
    @return: an object whose named fields are checked with C{fields}.
    """
    return FieldType("an object", lambda v: isinstance(v, dict), fields=fields)


def oneOf(*types: FieldType) -> FieldType:
    """
    @return: a value of any of C{types} (scalars only).
    """
    return FieldType(" or ".join(t.what for t in types),
                     lambda v: any(t.accepts(v) for t in types))


def _plural(what: str) -> str:
    """
    @return: C{"a string"} as C{"strings"}, for a list's description.
    """
    for article in ("an ", "a "):
        if what.startswith(article):
            what = what[len(article):]
            break
    return {"true or false": "booleans"}.get(what, what + "s")


def describe(value: Any) -> str:
    """
    The JSON type of C{value}, for a message (never the value: it may be a
    secret).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a " + type(value).__name__


def _join(path: str, name: str) -> str:
    """
    @return: the path of field C{name} inside C{path}.
    """
    return f"{path}.{name}" if path else str(name)


def _check(value, kind: FieldType, path: str) -> None:
    """
    Check one value (and its parts) against C{kind}.

    @raise FieldTypeError: naming C{path} or a path inside it.
    """
    if value is None:
        return
    if not kind.accepts(value):
        raise FieldTypeError(path, f"{path}: expected {kind.what}, got {describe(value)}")
    if kind.items is not None:
        for i, item in enumerate(value):
            if item is None:
                raise FieldTypeError(f"{path}[{i}]",
                                     f"{path}[{i}]: expected {kind.items.what}, got null")
            _check(item, kind.items, f"{path}[{i}]")
    if kind.values is not None:
        for name, item in value.items():
            _check(item, kind.values, _join(path, name))
    if kind.fields is not None:
        checkTypes(value, kind.fields, path)


def checkTypes(body: Mapping, table: Mapping[str, FieldType], path: str = "") -> None:
    """
    Check the JSON type of every field of C{body} that C{table} names
    (recursively for lists and objects).

    @param body: a parsed JSON object.
    @param table: field name -> L{FieldType}.
    @param path: the path of C{body} itself, for messages (C{""} at the
        top).
    @raise FieldTypeError: for the first field of the wrong type.
    """
    for name, value in body.items():
        kind = table.get(name) if isinstance(name, str) else None
        if kind is not None:
            _check(value, kind, _join(path, name))
