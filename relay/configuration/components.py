# -*- test-case-name: tests.test_components -*-
"""
Build the replaceable components named in the config's C{components:}
section (config.md).

A named class is imported with L{namedAny}, built with the same keyword
arguments as the built-in one and checked with C{verifyObject} at start-up.
Any failure is a L{ConfigError} with one line naming the key, e.g.::

    components.classifier: cannot import mypkg.Classifier: No module named 'mypkg'
    components.classifier: mypkg.Classifier does not provide IFailureClassifier: ...
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from twisted.python.reflect import namedAny
from zope.interface.exceptions import Invalid
from zope.interface.verify import verifyObject

from relay.base.records import ConfigError

__all__ = ["loadComponent"]

_MAX_REASON = 200


def _short(text: Any) -> str:
    """
    One line of at most 200 characters.

    @param text: an exception or any text.
    @rtype: L{str}
    """
    line = " ".join(str(text).split())
    if len(line) > _MAX_REASON:
        line = line[: _MAX_REASON - 3] + "..."
    return line


def _reason(e: Invalid) -> str:
    """
    The short reason of a C{verifyObject} failure, without zope's
    C{"The object <...> has failed to implement interface ...:"} preamble.

    @param e: the zope.interface exception.
    @rtype: L{str}
    """
    text = " ".join(str(e).split())
    text = re.sub(r"^The object .*? has failed to implement interface \S+?:\s*", "", text)
    return _short(text) or type(e).__name__


def _describeException(e: BaseException) -> str:
    """
    C{"TypeError: message"}, on one short line.
    """
    message = _short(e)
    name = type(e).__name__
    return f"{name}: {message}" if message else name


def loadComponent(
    dotted: Optional[str],
    interface: Any,
    default_factory: Callable[..., Any],
    key_path: str,
    **kwargs: Any,
) -> Any:
    """
    Build a component: the built-in one, or the class named in the config.

    @param dotted: the dotted name from C{components.<key>}, or L{None}
        for the built-in one.
    @param interface: the zope interface the component must provide, e.g.
        L{relay.interfaces.IFailureClassifier}.
    @param default_factory: builds the built-in component from C{kwargs}.
    @param key_path: the config key for messages, e.g.
        C{components.classifier} (a bare C{classifier} is prefixed with
        C{components.}).
    @param kwargs: the constructor arguments, the same for both.
    @return: the component.
    @raise ConfigError: the name cannot be imported, the object cannot be
        built with C{kwargs}, or it does not provide C{interface}. The
        message is one line naming C{key_path}.
    """
    if dotted is None:
        return default_factory(**kwargs)
    if not key_path.startswith("components."):
        key_path = "components." + key_path
    ifaceName = getattr(interface, "__name__", str(interface))

    try:
        factory = namedAny(dotted)
    except Exception as e:
        raise ConfigError(f"{key_path}: cannot import {dotted}: {_short(e) or type(e).__name__}")
    if not callable(factory):
        raise ConfigError(f"{key_path}: {dotted} is not callable (expected a class or factory)")

    try:
        component = factory(**kwargs)
    except Exception as e:
        raise ConfigError(
            f"{key_path}: cannot build {dotted} with the built-in arguments"
            f" ({', '.join(sorted(kwargs)) or 'none'}): {_describeException(e)}"
        )

    try:
        verifyObject(interface, component)
    except Invalid as e:
        raise ConfigError(f"{key_path}: {dotted} does not provide {ifaceName}: {_reason(e)}")
    return component
