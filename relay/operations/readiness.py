# -*- test-case-name: tests.test_readiness -*-
"""
Readiness (C{GET /readyz}) beside liveness (C{GET /healthz}).

C{/healthz} says the process is alive and listening; C{/readyz} says it
will serve a turn now. A load balancer or orchestrator sends traffic only to
a relay whose C{/readyz} answers 200, and restarts one whose C{/healthz}
stops answering (behaviour.md R101, R105).

L{Readiness} is a set of named checks, each a cheap synchronous callable
(no I/O: it reads state the relay keeps anyway); the relay is ready when
every check passes. Parts of the relay register their own check, e.g. the
Redis client's reachability (issue 23):
C{app.extras["readiness"].addCheck("redis", lambda: service.reachable)}.

Answers: 200 C{{"status":"ready"}}, or 503
C{{"status":"not_ready","waiting":[names of the failing checks]}}.
"""

from __future__ import annotations

import json
from typing import Callable

from twisted.logger import Logger
from twisted.web.resource import Resource


class Readiness:
    """
    Named readiness checks.
    """

    _log = Logger()

    def __init__(self) -> None:
        self._checks: dict[str, Callable[[], bool]] = {}

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

    def ready(self) -> tuple[bool, list[str]]:
        """
        Run every check.

        @return: C{(ready, failing check names in the order added)}.
        """
        failing = []
        for name, check in self._checks.items():
            try:
                ok = bool(check())
            except Exception:  # noqa: BLE001 - logged; a broken check is not ready
                self._log.failure("readiness check {name} failed", name=name)
                ok = False
            if not ok:
                failing.append(name)
        return not failing, failing


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
