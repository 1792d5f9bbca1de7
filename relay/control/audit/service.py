# -*- test-case-name: tests.test_control -*-
"""
L{AuditTrail}: every admin change, kept in the control store.

One record (kind C{audit}, appended, the newest L{AUDIT_KEEP} kept) per
change: when (C{at}, Unix seconds), who (C{actor}: the operator's name,
or C{admin-key}), what (C{action}, e.g.
C{account.create}, C{account.disable}, C{login.complete},
C{settings.update}, C{config.reload}), which account (C{account}), from
which address (C{address}), the answer's C{status}, the C{request_id},
and C{detail} (field names and ids only). Never a secret: details are
built from names, and any value under a secret-looking name is dropped
before writing (L{scrub}).

Changes made through the admin API are recorded by
L{relay.control.audit.resource.AuditedAdmin} once their answer is sent
(2xx only: a refused request changed nothing); what happens later in the
background (a device-code login approved or refused) is recorded by the
part that saw it, with the address of the admin who started it.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from attrs import define
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

__all__ = ["AUDIT", "AUDIT_KEEP", "AuditTrail", "actionOf", "scrub"]

AUDIT = "audit"
"""The store kind of audit records."""

AUDIT_KEEP = 1000
"""How many audit records the store keeps (the newest)."""

_SECRET_NAME = re.compile(r"key|token|secret|password|verifier|code|auth_json|proxy|state",
                          re.IGNORECASE)

_ACTIONS = {
    ("POST", "accounts", 1): "account.create",
    ("PATCH", "accounts", 2): "account.update",
    ("DELETE", "accounts", 2): "account.delete",
    ("PUT", "accounts", 3): "account.tokens",
    ("POST", "logins", 1): "login.start",
    ("DELETE", "logins", 2): "login.cancel",
    ("PUT", "settings", 1): "settings.update",
    ("POST", "reload", 1): "config.reload",
}


def actionOf(method: str, segments: list) -> tuple:
    """
    Name an admin change from its method and path below C{/admin}.

    @param method: C{POST}, C{PUT}, C{PATCH} or C{DELETE}.
    @param segments: the path segments after C{/admin} (str), e.g.
        C{["accounts", "a1", "disable"]}.
    @return: C{(action, target)}: e.g. C{("account.disable", "a1")};
        a route this table does not know is named after its first
        segment, singular, and the verb (C{key.create}, C{key.update},
        C{key.delete}, C{key.<action>}).
    """
    segments = [s for s in segments if s != ""] or [""]
    head, count = segments[0], len(segments)
    target = segments[1] if count > 1 else None
    known = _ACTIONS.get((method, head, count))
    if known is not None:
        return known, target
    noun = head[:-1] if head.endswith("s") else head
    if count >= 3:
        return f"{noun}.{segments[-1]}", target
    verb = {"POST": "create", "PUT": "update", "PATCH": "update", "DELETE": "delete"}.get(
        method, method.lower())
    return f"{noun}.{verb}", target


def scrub(value: Any, depth: int = 0) -> Any:
    """
    A detail object without any value under a secret-looking name
    (C{*key*}, C{*token*}, C{*secret*}, C{*password*}, C{*code*},
    C{proxy}, C{state}, ...): such values become C{"***"}; lists of names
    stay (they hold names, not values).
    """
    if depth > 6:
        return None
    if isinstance(value, dict):
        return {str(k): ("***" if _SECRET_NAME.search(str(k)) and not isinstance(v, (list, bool))
                         and v is not None else scrub(v, depth + 1))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, depth + 1) for v in value][:50]
    if isinstance(value, str):
        return value[:200]
    return value


@define(eq=False)
class AuditTrail:
    """
    See the module docstring.

    @ivar store: the L{relay.interfaces.IControlStore} (set at wiring).
    @ivar _clock: stamps records.
    @ivar keep: how many records are kept.
    """

    store: Any
    _clock: IReactorTime
    keep: int = AUDIT_KEEP
    _log = Logger()

    def record(self, action: str, account: Optional[str] = None,
               address: Optional[str] = None, status: Optional[int] = None,
               requestId: Optional[str] = None, detail: Optional[dict] = None,
               target: Optional[str] = None, actor: Optional[str] = None) -> Deferred:
        """
        Append one audit record (and log it as C{relay.admin_audit}).

        @param actor: who did it: the operator's name, or C{admin-key}
            (L{relay.operators.roles}); L{None} for relay itself.

        @return: a Deferred firing once written; it never fails (a store
            failure is logged).
        """
        entry = {
            "at": self._clock.seconds(), "action": action, "account": account,
            "target": target if target != account else None, "address": address,
            "status": status, "request_id": requestId, "detail": scrub(detail or {}),
            "actor": actor,
        }
        self._log.info(
            "admin {action} {account} by {actor} from {address} ({status})",
            event="relay.admin_audit", actor=actor or "-",
            action=action, account=account or target or "-", address=address or "-",
            status=status if status is not None else "-", request_id=requestId,
        )
        d = self.store.append(AUDIT, entry, self.keep)
        d.addErrback(lambda f: self._log.error(
            "writing the audit record of {action} failed: {error}", action=action,
            error=str(f.value), event="relay.admin_audit_failed"))
        return d

    async def recent(self, limit: int = 100, account: Optional[str] = None) -> list:
        """
        The newest audit records first.

        @param limit: at most this many.
        @param account: only this account's, when given.
        @return: a list of dicts (the stored entries with their C{id}).
        """
        records = await self.store.list(AUDIT)
        out = []
        for record in reversed(records):
            entry = dict(record.data, id=record.id)
            if account is not None and entry.get("account") != account:
                continue
            out.append(entry)
            if len(out) >= limit:
                break
        return out
