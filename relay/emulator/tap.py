# -*- test-case-name: tests.test_emulator -*-
"""
The C{relay-emulator} twistd plugin: C{twistd -n relay-emulator --config etc/emulator.yaml}.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import yaml
from twisted.application.service import MultiService
from twisted.internet.endpoints import serverFromString
from twisted.python import usage

from relay.emulator.core import Emulator, EmulatorConfigError, validateConfig
from relay.process.listener import Listener

DEFAULT_LISTEN = "tcp:9090:interface=127.0.0.1"
"""Where the emulator listens when neither the file nor the options say."""


def configFromString(text: str) -> dict:
    """
    Parse and validate an emulator configuration from YAML text.

    @param text: the YAML document.
    @type text: L{str}
    @rtype: L{dict}
    @raise EmulatorConfigError: for invalid YAML or configuration.
    """
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EmulatorConfigError(f"invalid YAML: {e}") from e
    return validateConfig(config if config is not None else {})


def portNumber(value: str) -> int:
    """
    The C{--port} option's value as a TCP port number (the help text is the
    C{optParameters} entry's, so a C{--help} shows one plain line).

    @param value: the option as typed.
    @type value: L{str}
    @return: the port, 0 to 65535.
    @rtype: L{int}
    @raise ValueError: if it is not such a number (L{usage.Options} turns it
        into a L{usage.UsageError}).
    """
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"--port must be a number, not {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--port out of range: {port}")
    return port


portNumber.coerceDoc = ""  # the entry's own text says it all


class Options(usage.Options):
    """
    Command-line options of the C{relay-emulator} plugin.

    @ivar config: the parsed configuration, set by L{postOptions}.
    """

    optParameters = [
        ["config", "c", None, "YAML configuration file (see etc/emulator.yaml)."],
        ["listen", "l", None, "Endpoint string to listen on (overrides the file)."],
        ["port", "p", None, "TCP port on 127.0.0.1 (shortcut for --listen).", portNumber],
    ]

    def postOptions(self) -> None:
        """
        Read the configuration file once and work out the listen endpoint.

        @raise usage.UsageError: for an unreadable or invalid file.
        """
        from relay.tap import ownPidfile

        ownPidfile(self, "relay-emulator")
        config: dict = {}
        if self["config"]:
            try:
                with open(self["config"], encoding="utf-8") as f:
                    config = configFromString(f.read())
            except OSError as e:
                raise usage.UsageError(f"cannot read {self['config']}: {e.strerror}") from e
            except EmulatorConfigError as e:
                raise usage.UsageError(f"{self['config']}: {e}") from e
        self.config = config
        if self["listen"]:
            self.listen = self["listen"]
        elif self["port"] is not None:
            self.listen = f"tcp:{self['port']}:interface=127.0.0.1"
        else:
            self.listen = config.get("listen") or DEFAULT_LISTEN


LISTEN_ERROR_EXIT = 2
"""The exit status of an emulator whose port cannot be listened on (the
relay's own for the same problem, L{relay.configuration.check})."""


class _Listener(Listener):
    """
    The emulator's listening endpoint: relay's own (L{Listener}: one line
    and exit status L{LISTEN_ERROR_EXIT} for a port that cannot be listened
    on, in use by another demo or emulator or not permitted; the
    C{CannotListenError} itself under a daemonising twistd), its line
    naming the emulator.

    @ivar stderr: where the line goes: the process's own standard error
        (C{sys.__stderr__}: once twistd logs, C{sys.stderr} writes into the
        log, stdout under C{-n}).
    """

    def __init__(self, endpoint, factory, listen: str):
        super().__init__(endpoint, factory, listen)
        self.stderr = sys.__stderr__ or sys.stderr

    def exitListenFailed(self, message: str, reason: str) -> NoReturn:
        """
        Write C{relay-emulator: cannot listen on ENDPOINT: REASON} and exit.

        @raise SystemExit: with L{LISTEN_ERROR_EXIT}.
        """
        self.stderr.write(f"relay-emulator: cannot listen on {self.listen}: {reason}\n")
        self.stderr.flush()
        raise SystemExit(LISTEN_ERROR_EXIT)


def makeService(options: Options, reactor: Any = None) -> MultiService:
    """
    Build the emulator service.

    @param options: parsed L{Options}.
    @type options: L{Options}
    @param reactor: the reactor; the global one when L{None}.
    @return: a L{MultiService} whose child listens with the emulator's site
        (a port in use ends the process with one line, L{_Listener}); the
        L{Emulator} is available as its C{emulator} attribute.
    @rtype: L{MultiService}
    """
    if reactor is None:
        from relay.tap import globalReactor

        reactor = globalReactor()
    emulator = Emulator(reactor=reactor, config=options.config)
    service = MultiService()
    service.emulator = emulator
    endpoint = serverFromString(reactor, options.listen)
    listener = _Listener(endpoint, emulator.site, options.listen)
    parent = getattr(options, "parent", None)
    if parent is not None and "nodaemon" in parent and not parent["nodaemon"]:
        listener.exitOnError = False
    elif parent is not None:
        from relay.tap import removeOwnPidfile

        pidfile = parent.get("pidfile")
        listener.beforeExit = lambda: removeOwnPidfile(pidfile)
    listener.setServiceParent(service)
    return service
