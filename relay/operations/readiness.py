# -*- test-case-name: tests.test_readiness -*-
"""
Readiness (behaviour.md R101, R105; issue 19 item 6).

C{/healthz} stays liveness: 200 once the port answers. C{/readyz} says
whether this process should get traffic: 200 C{{"status":"ready"}} when
every registered check passes, else 503
C{{"status":"not_ready","waiting":[names]}}.

relay registers its own checks (L{relay.app}): C{settings} (the persisted
runtime settings were read), C{tokens} (the OAuth token store was read) and
C{draining} (a graceful stop began). Other parts add theirs with
L{Readiness.addCheck} (e.g. C{redis}: the shared store answers); a check
that raises counts as failing.
"""

from __future__ import annotations

import json
from typing import Callable

from attrs import define, field
from twisted.logger import Logger
from twisted.web.resource import Resource

__all__ = ["Readiness", "ReadinessResource", "Flag", "StartupGate"]


@define(eq=False)
class Flag:
    """
    A boolean a check reads (C{flag.set()} once something happened).
    """

    value: bool = False

    def set(self, *ignored):
        """
        Set the flag; returns its first argument so it can sit in a
        callback chain.
        """
        self.value = True
        return ignored[0] if ignored else None

    def __call__(self) -> bool:
        return self.value


@define(eq=False)
class StartupGate:
    """
    Open once the stores a turn depends on are loaded (R105): the
    persisted runtime settings and the OAuth token records. Turns that
    arrive before wait for it (briefly; L{relay.engine.runner}).

    @ivar settings: the settings were read.
    @ivar tokens: the token records were read.
    """

    settings: Flag = field(factory=Flag)
    tokens: Flag = field(factory=Flag)
    _waiters: list = field(factory=list)

    @property
    def isOpen(self) -> bool:
        return self.settings.value and self.tokens.value

    def mark(self, flag: Flag):
        """
        Return a callback that sets C{flag} (passing its argument through)
        and releases the waiters once every flag is set.
        """

        def callback(result=None):
            flag.set()
            if self.isOpen:
                waiters, self._waiters = self._waiters, []
                for d in waiters:
                    if not d.called:
                        d.callback(None)
            return result

        return callback

    def wait(self):
        """
        @return: L{None} when open, else a Deferred firing when it opens.
        """
        if self.isOpen:
            return None
        from twisted.internet.defer import Deferred

        d = Deferred(lambda d: self._waiters.remove(d) if d in self._waiters else None)
        self._waiters.append(d)
        return d


@define(eq=False)
class Readiness:
    """
    Named readiness checks.

    @ivar _checks: name -> C{() -> bool}, in registration order.
    """

    _checks: dict = field(factory=dict)
    _log = Logger()

    def addCheck(self, name: str, check: Callable[[], bool]) -> None:
        """
        Register (or replace) a check.

        @param name: the name C{/readyz} lists while it fails.
        @param check: called on every C{/readyz} request; true when ready.
        """
        self._checks[name] = check

    def ready(self) -> tuple:
        """
        @return: C{(ready, [names of failing checks])}.
        """
        waiting = []
        for name, check in list(self._checks.items()):
            try:
                ok = bool(check())
            except Exception:  # noqa: BLE001 - a broken check is not ready
                self._log.failure("readiness check {name} failed", name=name)
                ok = False
            if not ok:
                waiting.append(name)
        return (not waiting, waiting)


class ReadinessResource(Resource):
    """
    C{GET /readyz} (no credentials, like C{/healthz}).
    """

    isLeaf = True

    def __init__(self, readiness: Readiness):
        super().__init__()
        self._readiness = readiness

    def render_GET(self, request):
        ready, waiting = self._readiness.ready()
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"cache-control", b"no-store")
        if ready:
            return b'{"status":"ready"}'
        request.setResponseCode(503)
        return json.dumps({"status": "not_ready", "waiting": waiting}).encode()

    render_HEAD = render_GET
