# -*- test-case-name: tests.test_operators -*-
"""
L{ConsoleGate}: what the request intake (L{relay.entry.intake}) asks of an
admin request that carries a console session cookie instead of the admin
key, at its headers, before its body is read (R103):

  1. the session (L{relay.operators.sessions}): unknown, expired or
     revoked is a 401 C{session_invalid};
  2. its operator, still in force (removed: 401), with the role it has
     now (a role lowered meanwhile counts at once);
  3. a state-changing request (not GET or HEAD) carries the session's
     CSRF token in C{X-CSRF-Token}, else 403 C{csrf_failed};
  4. the role allows the method (a viewer changes nothing: 403
     C{forbidden} with a message saying so, L{relay.operators.roles}).

The request then carries its L{relay.operators.roles.Principal} as
C{request.notes.operator}: the audit names it, the answers to a viewer are
masked (L{relay.console.masking}).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define

from relay.base.records import ClientError
from relay.base.requestnotes import notesOf
from relay.operators.roles import Principal, refusal
from relay.operators.sessions import COOKIE, CSRF_HEADER, csrfMatches

__all__ = ["ConsoleGate", "sessionCookie"]

SESSION_INVALID = ClientError(
    401, "authentication_error",
    "Your console session has expired or was ended; sign in again", code="session_invalid")

CSRF_FAILED = ClientError(
    403, "permission_error",
    "Missing or wrong X-CSRF-Token for this session (reload the page)", code="csrf_failed")


def sessionCookie(request) -> Optional[bytes]:
    """
    @return: the request's C{relay_session} cookie value, or L{None}.
    """
    value = request.getCookie(COOKIE) if hasattr(request, "getCookie") else None
    return value or None


def requestMethod(request) -> str:
    """
    @return: the request's method, upper-case, also at its headers (the
        intake asks before twisted.web sets C{request.method}: the
        channel's command then, as L{relay.entry.body} reads it).
    """
    raw = getattr(getattr(request, "channel", None), "_command", None) or request.method
    if isinstance(raw, str):
        return raw.upper()
    return raw.decode("ascii", "replace").upper()


def principalOf(request) -> Optional[Principal]:
    """
    @return: who made C{request} (set by the intake), or L{None}.
    """
    return notesOf(request).operator


@define(eq=False)
class ConsoleGate:
    """
    See the module docstring.

    @ivar sessions: the L{relay.interfaces.IOperatorSessions}.
    @ivar directory: the L{relay.interfaces.IOperatorDirectory}.
    """

    sessions: Any
    directory: Any

    def present(self, request) -> bool:
        """
        @return: whether C{request} carries a session cookie (and no
            C{Authorization}: the admin key wins when both are sent).
        """
        return sessionCookie(request) is not None

    def authenticate(self, request) -> Optional[ClientError]:
        """
        Check the request's session, CSRF token and role (see the module
        docstring); on success note its principal.

        @return: L{None} when allowed, else the error to answer.
        """
        session = self.sessions.lookup(sessionCookie(request))
        if session is None:
            return SESSION_INVALID
        operator = self.directory.find(session.operator)
        if operator is None:
            return SESSION_INVALID
        principal = Principal(name=operator["name"], role=operator["role"], via=session.via,
                              session=session.id)
        method = requestMethod(request)
        if method not in ("GET", "HEAD") and not csrfMatches(
                session, request.getHeader(CSRF_HEADER)):
            return CSRF_FAILED
        refused = refusal(principal, method)
        if refused:
            return ClientError(403, "permission_error", refused, code="forbidden")
        notesOf(request).operator = principal
        return None
