# -*- test-case-name: tests.integration.test_operators_console -*-
"""
Wires the console's operators into a relay: the directory and the
sessions over the control store (every backend), the intake's gate, the
sign-in throttle, the optional OIDC sign-in, C{/auth} and
C{/admin/operators}.
"""

from __future__ import annotations

from typing import Any

from attrs import define
from twisted.internet.defer import DeferredList

from relay.operators.directory import OperatorDirectory
from relay.operators.gate import ConsoleGate
from relay.operators.resource import OperatorsResource
from relay.operators.sessions import OperatorSessions
from relay.operators.signin import SignInResource, deferToThreads
from relay.operators.throttle import SignInThrottle

__all__ = ["OperatorParts", "assembleOperators"]

RESYNC_SECONDS = 30.0
"""How often the operators and sessions are re-read anyway (a missed change
cannot outlive it)."""


@define(eq=False)
class OperatorParts:
    """
    The console operators' parts, for the app and tests.
    """

    directory: Any
    sessions: Any
    gate: Any
    throttle: Any
    signin: Any
    oidc: Any
    service: Any


def assembleOperators(app, root, control) -> OperatorParts:
    """
    Build the operators of C{app}: mount C{/auth} on C{root} and
    C{/admin/operators} among the control plane's routes.

    @param app: the L{relay.process.app.RelayApplication}.
    @param root: the site's root resource.
    @param control: the L{relay.control.assemble.ControlParts}.
    @rtype: L{OperatorParts}
    """
    from relay.console.view import periodic

    reactor, store = app.reactor, control.store
    directory = OperatorDirectory(store=store, clock=reactor,
                                  fileOperators=lambda: app.live.config.operators,
                                  fileName=getattr(control.plane, "fileName", "the file"))
    sessions = OperatorSessions(store=store, clock=reactor)
    oidc = None
    if app.config.oidc is not None:
        from twisted.web.client import BrowserLikePolicyForHTTPS

        from relay.oauth.egress import EgressClient
        from relay.operators.oidc import OIDCSignIn

        trustRoot = app.extras.get("trustRoot")
        policy = BrowserLikePolicyForHTTPS(trustRoot) if trustRoot is not None else None
        egress = EgressClient(reactor=reactor, settings=app.settings, tlsPolicy=policy)
        oidc = OIDCSignIn(settings=app.config.oidc, egress=egress, store=store,
                          directory=directory, clock=reactor)
    throttle = SignInThrottle(clock=reactor)
    hashing = deferToThreads(reactor) if hasattr(reactor, "getThreadPool") else None
    signin = SignInResource(sessions, directory, throttle, audit=control.audit, oidc=oidc,
                            hashing=hashing)
    root.putChild(b"auth", signin)
    control.resource.routes[b"operators"] = OperatorsResource(app.live.adminKey, directory,
                                                              sessions)
    subscribed = []

    def resync():
        if not subscribed:
            subscribed.append(True)
            return DeferredList([directory.start(), sessions.start()])
        return DeferredList([directory._reload(), sessions._reload()])

    service = periodic(RESYNC_SECONDS, resync, reactor)
    return OperatorParts(directory=directory, sessions=sessions,
                         gate=ConsoleGate(sessions=sessions, directory=directory),
                         throttle=throttle, signin=signin, oidc=oidc, service=service)
