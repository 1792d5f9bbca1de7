# -*- test-case-name: tests.test_readiness -*-
"""
Readiness (C{GET /readyz}) beside liveness (C{GET /healthz}), and the one
start-up gate turns wait on (behaviour.md R101, R105).

C{/healthz} says the process is alive and listening (200 once the port
answers); C{/readyz} says it will serve a turn now. A load balancer or
orchestrator sends traffic only to a relay whose C{/readyz} answers 200,
and restarts one whose C{/healthz} stops answering.

L{Readiness} is a set of named checks, each a cheap synchronous callable
(no I/O: it reads state the relay keeps anyway); the relay is ready when
every check passes. relay registers its own (L{relay.process.app}): C{settings}
(the persisted runtime settings were read), C{tokens} (the OAuth token
store was read), C{draining} (a graceful stop began), C{control} (the
control store was read, L{relay.control.assemble}) and, on the Redis
backend, C{redis} (the shared store answers). Other parts add theirs:
C{app.extras["readiness"].addCheck("redis", lambda: service.reachable)}.
A check that raises counts as failing (and is logged).

Answers: 200 C{{"status":"ready"}}, or 503
C{{"status":"not_ready","waiting":[names of the failing checks]}}.

L{StartupGate} is what a turn (and, for the key ring, a client request at
its headers) waits on in the first moments after start: one L{Flag} per
store a turn depends on -- C{settings}, C{tokens}, and C{control} (the
control plane's first read: admin accounts, pauses, admin keys and
disables) when there is a control plane. Each flag is set when its store's
first read is done B{or has failed} (fail open, R35, logged by the reader),
so a silent store ends the wait instead of holding every turn (R101).
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from attrs import define, field
from twisted.logger import Logger
from twisted.web.resource import Resource
from zope.interface import implementer

from relay.interfaces import IStartupGate

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

    def clear(self) -> None:
        """
        Unset the flag (a gate closed again until its store is read).
        """
        self.value = False

    def __call__(self) -> bool:
        return self.value


@implementer(IStartupGate)
@define(eq=False)
class StartupGate:
    """
    Open once the stores a turn depends on are loaded (R105): the
    persisted runtime settings, the OAuth token records, and whatever
    other parts add (L{add}: the control plane's first read). Turns that
    arrive before wait for it (briefly; L{relay.engine.runner}); a client
    request whose key cannot be told yet waits at its headers
    (L{relay.entry.body}).

    @ivar settings: the settings were read.
    @ivar tokens: the token records were read.
    """

    settings: Flag = field(factory=Flag)
    tokens: Flag = field(factory=Flag)
    _extra: dict = field(factory=dict)
    _waiters: list = field(factory=list)

    def add(self, name: str) -> Flag:
        """
        Add (or return) the flag of another store the gate waits for.

        @param name: e.g. C{control}.
        @return: the L{Flag}; set it with L{mark}.
        """
        flag = self._extra.get(name)
        if flag is None:
            flag = self._extra[name] = Flag()
        return flag

    def flag(self, name: str) -> Optional[Flag]:
        """
        @return: the flag called C{name} (C{settings}, C{tokens} or one
            L{add}ed), or L{None}.
        """
        if name in ("settings", "tokens"):
            return getattr(self, name)
        return self._extra.get(name)

    @property
    def isOpen(self) -> bool:
        """
        Whether every flag is set.
        """
        if not (self.settings.value and self.tokens.value):
            return False
        for f in self._extra.values():
            if not f.value:
                return False
        return True

    def isSet(self, names) -> bool:
        """
        Whether the flags called C{names} are set (an unknown name counts
        as set).
        """
        extra = self._extra
        for name in names:
            if name == "settings":
                flag = self.settings
            elif name == "tokens":
                flag = self.tokens
            else:
                flag = extra.get(name)
                if flag is None:
                    continue
            if not flag.value:
                return False
        return True

    def mark(self, flag: Flag):
        """
        Return a callback that sets C{flag} (passing its argument through)
        and releases the waiters whose flags are all set now.
        """

        def callback(result=None):
            flag.set()
            waiters, self._waiters = self._waiters, []
            for names, d in waiters:
                if d.called:
                    continue
                if self.isSet(names) if names is not None else self.isOpen:
                    d.callback(None)
                else:
                    self._waiters.append((names, d))
            return result

        return callback

    def wait(self, names=None):
        """
        Wait for every flag, or only for those called C{names}.

        @return: L{None} when they are set, else a Deferred firing when
            they are (cancellable).
        """
        if names is None:
            # isOpen inlined: a turn asks this (R105)
            if self.settings.value and self.tokens.value:
                for f in self._extra.values():
                    if not f.value:
                        break
                else:
                    return None
        elif self.isSet(names):
            return None
        from twisted.internet.defer import Deferred

        entry = [names, None]

        def cancel(d):
            try:
                self._waiters.remove(tuple(entry))
            except ValueError:
                pass

        d = Deferred(cancel)
        entry[1] = d
        self._waiters.append(tuple(entry))
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
        Add (or replace) a check.

        @param name: what C{/readyz} lists while the check fails, e.g.
            C{redis}.
        @param check: returns whether that part is ready; it must be
            synchronous and cheap (it runs on every C{/readyz}). An
            exception counts as not ready (and is logged).
        """
        self._checks[name] = check

    def ready(self) -> tuple:
        """
        Run every check.

        @return: C{(ready, [names of the failing checks in the order
            added])}.
        """
        waiting = []
        for name, check in list(self._checks.items()):
            try:
                ok = bool(check())
            except Exception:  # noqa: BLE001 - logged; a broken check is not ready
                self._log.failure("readiness check {name} failed", name=name)
                ok = False
            if not ok:
                waiting.append(name)
        return (not waiting, waiting)


class ReadinessResource(Resource):
    """
    C{GET /readyz}: 200 C{{"status":"ready"}} when every check of the
    L{Readiness} passes, else 503 C{{"status":"not_ready","waiting":[...]}}.
    No credentials needed (like C{/healthz}); it tells nothing but the
    failing check names.
    """

    isLeaf = True

    def __init__(self, readiness: Readiness) -> None:
        super().__init__()
        self.readiness = readiness

    def render_GET(self, request) -> bytes:
        ok, waiting = self.readiness.ready()
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"cache-control", b"no-store")
        if ok:
            return b'{"status":"ready"}'
        request.setResponseCode(503)
        return json.dumps({"status": "not_ready", "waiting": waiting}).encode()

    render_HEAD = render_GET
