# -*- test-case-name: tests.test_operators -*-
"""
Operator roles and what each may do (docs/security.md "Operators"):

  - C{owner}: everything, managing owners included;
  - C{admin}: everything but managing owners (adding one, changing one,
    making someone one, removing one);
  - C{viewer}: reads only, and never a secret (answers are masked,
    L{relay.console.masking}); every change is refused 403.

The admin key (config.md C{admin_key}) stays for automation: it acts as
an owner, named C{admin-key} in the audit (L{ADMIN_KEY}).
"""

from __future__ import annotations

from typing import Optional

from attrs import frozen

__all__ = ["ADMIN_KEY", "OWNER", "ADMIN", "VIEWER", "ROLES", "Principal", "refusal",
           "mayManage"]

OWNER = "owner"
ADMIN = "admin"
VIEWER = "viewer"
ROLES = (OWNER, ADMIN, VIEWER)
"""Every role, most powerful first."""

READS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing."""


@frozen
class Principal:
    """
    Who made an admin request.

    @ivar name: the operator's name, or C{admin-key}.
    @ivar role: one of L{ROLES}.
    @ivar via: C{password}, C{oidc} or C{admin_key}.
    @ivar session: the session's id (a digest, never the cookie), or
        L{None} for the admin key.
    """

    name: str
    role: str
    via: str = "password"
    session: Optional[str] = None

    @property
    def seesSecrets(self) -> bool:
        """
        Whether answers to this principal may hold secrets (a viewer's never
        do, L{relay.console.masking}).
        """
        return self.role != VIEWER

    @property
    def actor(self) -> str:
        """
        The audit's name for this principal.
        """
        return self.name


ADMIN_KEY = Principal(name="admin-key", role=OWNER, via="admin_key")
"""The admin key: owner-equivalent, for automation."""


def refusal(principal: Principal, method: str) -> Optional[str]:
    """
    The route-level rule: a viewer changes nothing.

    @param method: the HTTP method.
    @return: L{None} when allowed, else the 403's message.
    """
    if principal.role == VIEWER and method.upper() not in READS:
        return (f"operator {principal.name!r} is a viewer: viewers read and change nothing;"
                " ask an owner or an admin")
    return None


def mayManage(principal: Principal, *roles: Optional[str]) -> Optional[str]:
    """
    The operator-management rule: an admin manages admins and viewers,
    only an owner manages owners.

    @param roles: the roles involved (the target's current role and the
        role it is given; L{None} entries are ignored).
    @return: L{None} when allowed, else the 403's message.
    """
    if principal.role == VIEWER:
        return refusal(principal, "POST")
    if OWNER in roles and principal.role != OWNER:
        return (f"operator {principal.name!r} is an admin: only an owner adds, changes or"
                " removes an owner")
    return None
