# -*- test-case-name: tests.test_tap -*-
"""
The checks and the error line that start-up and a live reload share:
the C{components:} check (L{checkComponents}) and the one-line
configuration error on standard error with exit status 2
(L{exitWithConfigError}).

They live beside L{relay.configuration.parse} rather than in L{relay.tap}, so that
L{relay.process.reload} (a reload validates with start-up's checks)
and L{relay.process.app} (a port that cannot be listened on is a configuration
error) need not import the twistd plugin's module, which imports
L{relay.process.app}: the house's import graph has no circle outside the emulator
(tests/test_invariants.py).
"""

from __future__ import annotations

import sys
from typing import NoReturn

from twisted.python.reflect import namedAny

from relay.base.records import ConfigError

__all__ = [
    "CONFIG_ERROR_EXIT", "CONFIG_ERROR_PREFIX", "checkComponents", "exitWithConfigError",
]

CONFIG_ERROR_PREFIX = "relay: config error: "
"""What every configuration error line on standard error starts with."""

CONFIG_ERROR_EXIT = 2
"""The exit status for a configuration error."""

_COMPONENT_INTERFACES = (
    ("classifier", "IFailureClassifier"),
    ("dialer", "IUpstreamDialer"),
    ("admission", "ISlotAdmission"),
)
"""The C{components:} keys and the interface (in L{relay.interfaces}) each must provide."""


def _stderr():
    """
    The process's own standard error. Once twistd has begun logging,
    C{sys.stderr} writes into the log (stdout under C{-n}), so prefer
    C{sys.__stderr__}. Tests patch this function.
    """
    return sys.__stderr__ or sys.stderr


def exitWithConfigError(message: str) -> NoReturn:
    """
    Write C{relay: config error: MESSAGE} as one line to standard error and
    exit with status L{CONFIG_ERROR_EXIT}.

    @param message: the problem, naming the key (whitespace is collapsed so
        it is always one line).
    @raise SystemExit: always.
    """
    stream = _stderr()
    stream.write(CONFIG_ERROR_PREFIX + " ".join(str(message).split()) + "\n")
    stream.flush()
    raise SystemExit(CONFIG_ERROR_EXIT)


def checkComponents(config) -> None:
    """
    Import every class named in C{components:} and check that it implements
    its interface, so that a bad dotted name is a one-line error at
    option-parsing time: twistd prints a traceback for anything
    L{makeService} raises.

    A factory that is not a class cannot be checked before it is called;
    L{relay.configuration.components.loadComponent} verifies what it builds.

    @param config: the parsed L{relay.base.records.RelayConfig}.
    @raise ConfigError: naming the key, e.g. C{components.classifier:
        cannot import mypkg.Classifier: No module named 'mypkg'}.
    """
    from relay import interfaces

    for key, ifaceName in _COMPONENT_INTERFACES:
        dotted = getattr(config.components, key)
        if dotted is None:
            continue
        path = f"components.{key}"
        try:
            factory = namedAny(dotted)
        except Exception as e:  # noqa: BLE001 - any import-time error is the config's
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            raise ConfigError(f"{path}: cannot import {dotted}: {reason}")
        if not callable(factory):
            raise ConfigError(f"{path}: {dotted} is not callable (expected a class or factory)")
        interface = getattr(interfaces, ifaceName)
        if isinstance(factory, type) and not interface.implementedBy(factory):
            raise ConfigError(f"{path}: {dotted} does not implement {ifaceName}")
