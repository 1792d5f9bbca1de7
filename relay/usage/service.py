# -*- test-case-name: tests.test_usage -*-
"""
The service that flushes the usage ledger periodically, and once more on
shutdown.
"""

from __future__ import annotations

from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from relay.wire.redisclient import logFailure

__all__ = ["UsageFlushService"]


class UsageFlushService(TimerService):
    """
    Calls L{relay.usage.ledger.UsageLedger.flush} every C{interval} seconds
    on the injected clock; never stops on an error (style.md trap T26); the
    last flush runs in C{stopService}.
    """

    _log = Logger()

    def __init__(self, ledger, interval: float, clock):
        """
        @param ledger: the L{relay.usage.ledger.UsageLedger}.
        @param interval: seconds between flushes.
        @param clock: the L{IReactorTime} to run on.
        """
        super().__init__(interval, self._flush)
        self.ledger = ledger
        self.clock = clock

    def _flush(self) -> Deferred:
        try:
            d = self.ledger.flush()
        except Exception:  # noqa: BLE001 - a periodic job never stops (T26)
            self._log.failure("flushing usage failed", event="relay.usage_flush_failed")
            return None
        return d.addErrback(
            lambda f: logFailure(
                self._log, f, "flushing usage failed", event="relay.usage_flush_failed"
            )
        )

    def stopService(self) -> Deferred:
        """
        Stop the timer, then flush what is left.

        @return: a L{Deferred} firing once the last flush ended.
        """
        d = super().stopService()
        return d.addCallback(lambda _: self._flush())
