"""
The listening endpoint of a relay process (and of the emulator,
L{relay.emulator.tap}): a port that cannot be listened on is one line and
a non-zero exit, not twistd's traceback.
"""

from __future__ import annotations

from typing import NoReturn

from twisted.application.internet import StreamServerEndpointService
from twisted.internet.error import CannotListenError
from twisted.logger import Logger

_log = Logger(namespace="relay.process.app._Listener")
"""The namespace relay's logs have always given this line."""


class Listener(StreamServerEndpointService):
    """
    The listening endpoint service. A port that cannot be listened on (in
    use, no permission) is one line naming C{listen} on standard error and
    exit status 2 (L{relay.configuration.check.exitWithConfigError}), not twistd's
    CannotListenError traceback. twistd calls C{privilegedStartService}
    before dropping privileges; twist and tests reach it through
    C{startService}.

    @ivar listen: the endpoint string, for the message.
    @ivar exitOnError: when false (a daemonising twistd, see
        L{relay.tap.makeService}) the L{CannotListenError} propagates: the
        daemon's parent waits on a status pipe that only an exception
        writes, and the daemon has no stderr.
    @ivar beforeExit: L{None}, or a no-argument callable run just before
        the exit (L{relay.tap.makeService} removes twistd's pid file there:
        twistd removes it only for an L{Exception}).
    """

    def __init__(self, endpoint, factory, listen: str):
        super().__init__(endpoint, factory)
        self._raiseSynchronously = True
        self.listen = listen
        self.exitOnError = True
        self.beforeExit = None

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except CannotListenError as e:
            reason = getattr(e.socketError, "strerror", None) or str(e.socketError)
            message = f"listen: cannot listen on {self.listen}: {reason}"
            if not self.exitOnError:
                # The daemon's log is the only place the line can go (error,
                # not critical: critical is echoed to stderr as well).
                _log.error("listen: cannot listen on {listen}: {reason}",
                                event="relay.listen_failed", listen=self.listen, reason=reason)
                raise
            # The stderr line is the message: the log (stdout, under twistd
            # -n and twist) would show it a second time.
            if self.beforeExit is not None:
                self.beforeExit()
            self.exitListenFailed(message, reason)

    def exitListenFailed(self, message: str, reason: str) -> NoReturn:
        """
        End the process for a port that cannot be listened on: relay's
        one config-error line (L{relay.configuration.check.exitWithConfigError}).

        @param message: C{listen: cannot listen on ENDPOINT: REASON}.
        @param reason: the socket error's text alone.
        @raise SystemExit: always.
        """
        from relay.configuration.check import exitWithConfigError

        exitWithConfigError(message)
