# -*- test-case-name: tests.test_tap -*-
"""
The twistd plugin's C{Options} and C{makeService}: C{twistd -n relay
--config FILE}. The only module in relay that imports the global reactor
(lazily, in L{makeService}).
"""

from __future__ import annotations

from twisted.python import usage
from twisted.python.reflect import namedAny

from relay.model import ConfigError

_COMPONENT_INTERFACES = (
    ("classifier", "IFailureClassifier"),
    ("dialer", "IUpstreamDialer"),
    ("admission", "ISlotAdmission"),
)
"""The C{components:} keys and the interface (in L{relay.interfaces}) each must provide."""


def checkComponents(config) -> None:
    """
    Import every class named in C{components:} and check that it implements
    its interface, so that a bad dotted name is a one-line L{usage.UsageError}
    at option-parsing time: twistd prints a traceback for anything
    L{makeService} raises.

    A factory that is not a class cannot be checked before it is called;
    L{relay.components.loadComponent} verifies what it builds.

    @param config: the parsed L{relay.model.RelayConfig}.
    @raise usage.UsageError: naming the key, e.g. C{components.classifier:
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
            raise usage.UsageError(f"{path}: cannot import {dotted}: {reason}")
        if not callable(factory):
            raise usage.UsageError(
                f"{path}: {dotted} is not callable (expected a class or factory)"
            )
        interface = getattr(interfaces, ifaceName)
        if isinstance(factory, type) and not interface.implementedBy(factory):
            raise usage.UsageError(f"{path}: {dotted} does not implement {ifaceName}")


class Options(usage.Options):
    """
    C{twistd relay} options.
    """

    optParameters = [
        ["config", "c", "/etc/relay/relay.yaml", "The relay configuration file (YAML)."],
        ["listen", "l", None, "A Twisted endpoint string overriding the config's listen."],
        ["log-format", None, None, "text or json (one JSON object per line); overrides log.format."],
    ]

    def postOptions(self) -> None:
        """
        Parse the configuration once, into C{self.config}. Any problem
        becomes a one-line L{usage.UsageError} naming the key.
        """
        from attrs import evolve

        from relay.config import loadConfig, secretsOf
        from relay.logs import observerFor, registerSecrets

        try:
            config = loadConfig(self["config"])
        except ConfigError as e:
            raise usage.UsageError(str(e))
        except OSError as e:
            raise usage.UsageError(f"cannot read config {self['config']}: {e.strerror or e}")
        if self["listen"]:
            config = evolve(config, listen=self["listen"])
        fmt = self["log-format"] or config.log_format
        if fmt not in ("text", "json"):
            raise usage.UsageError(f"--log-format: expected text or json, got {fmt!r}")
        checkComponents(config)
        self.config = config
        registerSecrets(secretsOf(config))
        parent = getattr(self, "parent", None)
        if parent is not None and "fileLogObserverFactory" in parent:
            # twist (python -m twisted relay ...) builds its observer with
            # this factory on its --log-file (stdout by default).
            parent["fileLogObserverFactory"] = lambda stream: observerFor(fmt, stream)
        elif parent is not None and not parent.get("logger"):
            # twistd builds its logger after parsing options; hand it ours so
            # every line is redacted, and JSON when asked. twistd's own
            # postOptions runs after ours and resolves --logger with namedAny,
            # so this must be a dotted name, not a callable.
            parent["logger"] = f"relay.logs.{fmt}Stdout"


def makeService(options: Options, reactor=None):
    """
    Build the relay service.

    @param options: parsed L{Options}.
    @param reactor: the reactor; the global one when L{None}
        (coding-standard idiom).
    @return: a L{twisted.application.service.MultiService}.
    """
    if reactor is None:
        from twisted.internet import reactor
    from relay.app import buildService

    try:
        return buildService(options.config, reactor)
    except ConfigError as e:
        raise usage.UsageError(str(e))
